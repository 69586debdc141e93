// The Llama family as Hugging Face's transformers builds it (app layer, std + nlohmann-json): the
// config.json from which LlamaForCausalLM (Qwen2ForCausalLM with q/k/v biases) builds the model that
// app/models/llama.hpp trains. Its tensors need no renaming: the modules carry transformers' names.
#pragma once

#include <nlohmann/json.hpp>

#include <regex>
#include <string>

#include "fsdp/io/tensor_naming.hpp"

#include "models/llama_config.hpp"

namespace fsdp::app {

/// Hugging Face's names are the Llama's own; what transformers passes over in a file is passed over
/// too: the rotary inverse frequencies older conversions stored per layer (rebuilt from rope_theta),
/// and, for a tied model, an lm_head.weight (transformers ties it to the token embedding).
inline TensorNaming llama_hf_naming(bool tied) {
  TensorNaming naming;
  naming.scheme = "hf";
  naming.ignorable = [tied](const std::string& name) {
    static const std::regex inv_freq(R"((model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq|(model\.)?rotary_emb\.inv_freq)");
    return std::regex_match(name, inv_freq) || (tied && name == "lm_head.weight");
  };
  return naming;
}

/// config.json of the Llama of `c`; `torch_dtype` as exported.
inline nlohmann::ordered_json hf_llama_config(const LlamaConfig& c, const std::string& torch_dtype = "float32") {
  nlohmann::ordered_json j;
  // transformers' Llama biases o_proj too when attention_bias is set; Qwen2 biases exactly q, k, v.
  // A window without the biases is Mistral's (LlamaForCausalLM has none).
  const bool qwen2 = c.attention_bias, mistral = !qwen2 && c.sliding_window > 0;
  j["architectures"] = {qwen2 ? "Qwen2ForCausalLM" : mistral ? "MistralForCausalLM" : "LlamaForCausalLM"};
  j["model_type"] = qwen2 ? "qwen2" : mistral ? "mistral" : "llama";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.d_model;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.n_layers;
  j["num_attention_heads"] = c.n_heads;
  j["num_key_value_heads"] = c.n_kv_heads;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = c.max_positions;
  j["rms_norm_eps"] = c.norm_eps;
  j["rope_theta"] = c.rope_theta;
  if (c.rope_scaling == RopeScaling::kLlama3)
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", c.rope_scaling_factor},
                         {"low_freq_factor", c.rope_low_freq_factor},
                         {"high_freq_factor", c.rope_high_freq_factor},
                         {"original_max_position_embeddings", c.rope_original_context}};
  else
    j["rope_scaling"] = nullptr;
  if (mistral) {
    j["sliding_window"] = c.sliding_window;
  } else if (!qwen2) {
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
  } else if (c.sliding_window > 0) {
    // transformers' Qwen2 windows the layers from max_window_layers on: every one here.
    j["use_sliding_window"] = true;
    j["sliding_window"] = c.sliding_window;
    j["max_window_layers"] = 0;
  } else {
    j["use_sliding_window"] = false;
    j["max_window_layers"] = c.n_layers;
  }
  j["attention_dropout"] = 0.0;
  j["initializer_range"] = 0.02;
  j["tie_word_embeddings"] = c.tie_embeddings;
  j["use_cache"] = true;
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  // One id stays a number, as the files Hugging Face writes; several are a list (Llama 3.1's).
  if (c.eos_token_ids.size() == 1)
    j["eos_token_id"] = c.eos_token_ids.front();
  else if (!c.eos_token_ids.empty())
    j["eos_token_id"] = c.eos_token_ids;
  j["torch_dtype"] = torch_dtype;
  return j;
}

}  // namespace fsdp::app
