// The GPT's tensors under Hugging Face GPT-2's names and layouts (app layer, std + nlohmann-json):
// fsdp-train's pretrained starts and exports and fsdp-ckpt export --names hf (hf-gpt2) map through it,
// and config.json makes an export folder a model that transformers' GPT2LMHeadModel.from_pretrained
// reads (hf_export.hpp writes it).
#pragma once

#include <nlohmann/json.hpp>

#include <map>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "fsdp/errors.hpp"
#include "fsdp/io/tensor_naming.hpp"
#include "choices.hpp"
#include "gpt_config.hpp"

namespace fsdp::app {

inline constexpr const char* kHfGpt2Scheme = "hf-gpt2";

/// GPT-2's names for the GPT of `c`. Conv1D weights (attention and MLP) are stored transposed; the
/// token embedding (and an untied LM head) without the vocabulary padding; a tied LM head is the
/// token embedding (GPT-2 files do not store lm_head.weight). Files saved from GPT2Model, without the
/// "transformer." prefix, are read too; their attention-mask buffers are ignored.
inline TensorNaming hf_gpt2_naming(const GptConfig& c) {
  TensorNaming naming;
  naming.scheme = kHfGpt2Scheme;
  const bool padded = c.padded_vocab() != c.vocab_size;
  naming.external = [c, padded](const std::string& name, const std::vector<std::int64_t>&) -> std::optional<ExternalTensor> {
    static const std::regex block(R"(block(\d+)\.(ln1|ln2|attn\.qkv|attn\.proj|fc|out)\.(weight|bias))");
    static const std::regex mask(R"(block\d+\.attn\.mask)");
    auto hf = [](const std::string& tail, std::int64_t rows = -1, bool transposed = false) {
      return ExternalTensor{"transformer." + tail, rows, transposed, {tail}};
    };
    const std::int64_t vocab_rows = padded ? c.vocab_size : -1;
    if (name == "tok.weight" || (name == "head.weight" && c.tie_embeddings)) return hf("wte.weight", vocab_rows);
    if (name == "head.weight") return ExternalTensor{"lm_head.weight", vocab_rows, false, {}};
    if (name == "pos.weight") return hf("wpe.weight");
    if (name == "ln_f.weight" || name == "ln_f.bias") return hf(name);
    if (std::regex_match(name, mask)) return std::nullopt;  // transformers rebuilds the causal mask
    std::smatch m;
    if (!std::regex_match(name, m, block)) throw ConfigError("hf-gpt2 names: the GPT has no tensor '" + name + "' in GPT-2's layout", "fsdp.names");
    static const std::map<std::string, std::string> module = {
        {"ln1", "ln_1"}, {"ln2", "ln_2"}, {"attn.qkv", "attn.c_attn"}, {"attn.proj", "attn.c_proj"}, {"fc", "mlp.c_fc"}, {"out", "mlp.c_proj"}};
    const std::string& part = m[2].str();
    const bool conv1d = part != "ln1" && part != "ln2";
    return hf("h." + m[1].str() + "." + module.at(part) + "." + m[3].str(), -1, conv1d && m[3].str() == "weight");
  };
  naming.ignorable = [tied = c.tie_embeddings](const std::string& name) {
    static const std::regex masks(R"((transformer\.)?h\.\d+\.attn\.(bias|masked_bias))");
    return std::regex_match(name, masks) || (tied && name == "lm_head.weight");
  };
  return naming;
}

/// Whether tensor names are GPT-2's (with or without the "transformer." prefix) rather than fsdp's.
inline bool has_hf_gpt2_names(const std::vector<std::string>& names) {
  for (const auto& n : names)
    if (n.rfind("transformer.", 0) == 0 || n == "wte.weight" || n.rfind("h.0.", 0) == 0) return true;
  return false;
}

/// Hugging Face's GPT2Config of the GPT of `c` (config.json); `torch_dtype` as exported.
inline nlohmann::ordered_json hf_gpt2_config(const GptConfig& c, const std::string& torch_dtype = "float32") {
  nlohmann::ordered_json j;
  j["architectures"] = {"GPT2LMHeadModel"};
  j["model_type"] = "gpt2";
  j["vocab_size"] = c.vocab_size;
  j["n_positions"] = c.context;
  j["n_ctx"] = c.context;
  j["n_embd"] = c.d_model;
  j["n_layer"] = c.n_layers;
  j["n_head"] = c.n_heads;
  j["n_inner"] = c.mlp_ratio * c.d_model;
  // transformers' "gelu_new" is GPT-2's tanh approximation; "gelu" the exact one.
  j["activation_function"] = c.gelu_tanh ? "gelu_new" : "gelu";
  j["resid_pdrop"] = c.dropout;
  j["embd_pdrop"] = c.dropout;
  j["attn_pdrop"] = c.dropout;
  j["layer_norm_epsilon"] = 1e-5;
  j["initializer_range"] = 0.02;
  j["scale_attn_weights"] = true;
  j["tie_word_embeddings"] = c.tie_embeddings;
  if (c.vocab_size == 50257) j["bos_token_id"] = j["eos_token_id"] = 50256;  // GPT-2's <|endoftext|>
  j["torch_dtype"] = torch_dtype;
  return j;
}

}  // namespace fsdp::app
