// Input decks (app layer): the schema's keys of the [model] section, every model kind's sizes;
// deck_schema.cpp holds the others and the lookups.
#include "choices.hpp"
#include "deck.hpp"
#include "deck_detail.hpp"

namespace fsdp::app::detail {

void add_model_keys(std::vector<KeySpec>& s) {
  using T = KeyType;
  s.push_back({.key = "model.kind",
               .type = T::kString,
               .default_value = "cnn",
               .choices = choice_names<ModelKind>(),
               .description = "cnn (the PyTorch FSDP tutorial's MNIST net), mlp, transformer (a GPT-2 style decoder) or llama (a "
                              "Llama-family decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU; Hugging Face's "
                              "names); the decoders are for data.kind tokens, text, token-shards or indexed"});
  s.push_back({.key = "model.hf_config",
               .type = T::kString,
               .default_value = "",
               .description = "a Hugging Face config.json, or the folder holding it (LlamaForCausalLM, Qwen2ForCausalLM, "
                              "MistralForCausalLM, GPT2LMHeadModel): sets model.kind and every size from it (source hf_config); a "
                              "model key of the deck that contradicts it is an error; an option that cannot be built exactly (a sliding "
                              "window shorter than model.context, another rope_scaling, biases beyond q/k/v, experts) is refused"});
  s.push_back(
      {.key = "model.dropout",
       .type = T::kFloat,
       .default_value = std::monostate{},
       .min = 0,
       .max = 1,
       .description =
           "every dropout probability of the model; unset: each model's own (cnn 0.25 and 0.5, mlp none, transformer 0.1; llama has none); 0: none",
       .max_exclusive = true});
  s.push_back({.key = "model.hidden_sizes",
               .type = T::kIntArray,
               .default_value = Ints{512, 256},
               .min = 1,
               .max = 1e8,
               .description = "mlp: widths of the hidden layers"});
  s.push_back({.key = "model.vocab_size",
               .type = T::kInt,
               .default_value = I{256},
               .min = 1,
               .max = 1e9,
               .description = "transformer, llama: vocabulary size (256: bytes)"});
  s.push_back({.key = "model.context",
               .type = T::kInt,
               .default_value = I{64},
               .min = 1,
               .max = 1e7,
               .description = "transformer, llama: tokens per sequence"});
  s.push_back({.key = "model.d_model",
               .type = T::kInt,
               .default_value = I{128},
               .min = 1,
               .max = 1e6,
               .description = "transformer, llama: width of the residual stream, a multiple of model.n_heads (llama: unless model.head_dim is set)"});
  s.push_back({.key = "model.n_heads",
               .type = T::kInt,
               .default_value = I{4},
               .min = 1,
               .max = 1e5,
               .description = "transformer, llama: attention (query) heads per block"});
  s.push_back({.key = "model.n_layers",
               .type = T::kInt,
               .default_value = I{4},
               .min = 1,
               .max = 1e5,
               .description = "transformer, llama: number of blocks (decoder layers)"});
  s.push_back(
      {.key = "model.mlp_ratio",
       .type = T::kInt,
       .default_value = I{4},
       .min = 1,
       .max = 1000,
       .description = "transformer: width of each block's MLP as a multiple of model.d_model (llama: the default of model.intermediate_size)"});
  s.push_back({.key = "model.tie_embeddings",
               .type = T::kBool,
               .default_value = true,
               .description = "transformer, llama: the output projection shares the token embedding's weights"});
  s.push_back({.key = "model.vocab_pad_multiple",
               .type = T::kInt,
               .default_value = I{1},
               .min = 1,
               .max = 1e6,
               .description = "transformer: the embedding and output rows are model.vocab_size rounded up to this multiple (llm.c: 50257 "
                              "-> 50304 with 64); the padding is cut from the logits, so it never enters the loss, and from exports"});
  s.push_back({.key = "model.activation",
               .type = T::kString,
               .default_value = "gelu",
               .choices = choice_names<Activation>(),
               .description = "transformer: the MLP's GELU, exact (gelu) or GPT-2's tanh approximation (gelu_tanh)"});
  s.push_back({.key = "model.recompute_attention",
               .type = T::kBool,
               .default_value = true,
               .description = "transformer, llama: attention's backward computes the probabilities again from q, k and v instead of "
                              "keeping them from forward (heads x context scores per token and block less memory: 4 bytes each in fp32, "
                              "a llama's 6 in bf16 (its fp32 softmax); the same bits; measured 1-8% more step time, the more the larger "
                              "context / d_model)"});
  s.push_back({.key = "model.n_kv_heads",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = 1e5,
               .description = "llama: key/value heads (grouped-query attention), dividing model.n_heads; 0: model.n_heads"});
  s.push_back({.key = "model.head_dim",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = 1e5,
               .description = "llama: width of each attention head; 0: model.d_model / model.n_heads"});
  s.push_back({.key = "model.intermediate_size",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = 1e8,
               .description = "llama: width of each layer's SwiGLU MLP, down(silu(gate(x)) * up(x)); 0: model.mlp_ratio x model.d_model"});
  s.push_back({.key = "model.norm_eps",
               .type = T::kFloat,
               .default_value = 1e-5,
               .min = 0,
               .max = 1,
               .description = "llama: the RMSNorms' epsilon (Hugging Face's rms_norm_eps)"});
  s.push_back({.key = "model.rope_theta",
               .type = T::kFloat,
               .default_value = 10000.0,
               .min = 1,
               .max = 1e12,
               .description = "llama: the rotary embedding's base (Hugging Face's rope_theta; Llama 3 500000, SmolLM2 100000)"});
  s.push_back({.key = "model.attention_bias",
               .type = T::kBool,
               .default_value = false,
               .description = "llama: biases on the q, k and v projections (Qwen2's layout); no other layer has one (Hugging Face "
                              "Llama's attention_bias, which also biases o_proj, is not supported)"});
  s.push_back({.key = "model.max_positions",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = 1e9,
               .description = "llama: the longest sequence the model is made for (Hugging Face's max_position_embeddings, kept in "
                              "an exported config.json); model.context may not exceed it; 0: model.context"});
  s.push_back({.key = "model.sliding_window",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = 1e9,
               .description = "llama: the attention window of Mistral and of Qwen2 with use_sliding_window (Hugging Face's "
                              "sliding_window, kept in an exported config.json); model.context may not exceed it: within it windowed "
                              "attention is exactly full attention; 0: none"});
  s.push_back({.key = "model.bos_token_id",
               .type = T::kInt,
               .default_value = I{-1},
               .min = -1,
               .max = 1e9,
               .description = "llama: the tokenizer's first token (Hugging Face's bos_token_id, kept in an exported config.json); -1: none"});
  s.push_back({.key = "model.eos_token_id",
               .type = T::kIntArray,
               .default_value = Ints{},
               .min = -1,
               .max = 1e9,
               .description = "llama: the tokenizer's end of text (Hugging Face's eos_token_id, where generation stops; kept in an "
                              "exported config.json): one id, or a list (Llama 3.1's instruct models end a turn at any of three); "
                              "[] or -1: none",
               .scalar_as_array = true});
  s.push_back({.key = "model.rope_scaling",
               .type = T::kString,
               .default_value = "none",
               .choices = choice_names<RopeScaling>(),
               .description = "llama: none, or llama3 (Llama 3.1/3.2's rotary frequencies: below the model.rope_original_context / "
                              "model.rope_high_freq_factor wavelength unchanged, above the model.rope_low_freq_factor one divided by "
                              "model.rope_scaling_factor, smoothly between)"});
  s.push_back({.key = "model.rope_scaling_factor",
               .type = T::kFloat,
               .default_value = 8.0,
               .min = 1,
               .max = 1e6,
               .description = "llama, rope_scaling llama3: the long wavelengths' divisor (Hugging Face's rope_scaling.factor; Llama 3.2 32)"});
  s.push_back({.key = "model.rope_low_freq_factor",
               .type = T::kFloat,
               .default_value = 1.0,
               .min = 0,
               .max = 1e6,
               .description = "llama, rope_scaling llama3: rope_scaling.low_freq_factor",
               .min_exclusive = true});
  s.push_back({.key = "model.rope_high_freq_factor",
               .type = T::kFloat,
               .default_value = 4.0,
               .min = 0,
               .max = 1e6,
               .description = "llama, rope_scaling llama3: rope_scaling.high_freq_factor, above model.rope_low_freq_factor",
               .min_exclusive = true});
  s.push_back({.key = "model.rope_original_context",
               .type = T::kInt,
               .default_value = I{8192},
               .min = 1,
               .max = 1e9,
               .description = "llama, rope_scaling llama3: the context the model was first trained at "
                              "(rope_scaling.original_max_position_embeddings)"});
}

}  // namespace fsdp::app::detail
