// The GPT model's size and options (app layer, std only): models.hpp builds it with LibTorch, the memory
// planner (app/plan/) describes it in closed form, the Hugging Face GPT-2 names (gpt2_names.hpp) map it.
#pragma once

#include <algorithm>
#include <cstdint>

namespace fsdp::app {

struct GptConfig {
  std::int64_t vocab_size = 256, context = 64, d_model = 128, n_heads = 4, n_layers = 4, mlp_ratio = 4;
  /// The embedding and LM head have vocab_size rounded up to this multiple rows (llm.c pads GPT-2's
  /// 50257 to 50304 for faster matrix shapes); the logits are cut back to vocab_size.
  std::int64_t vocab_pad_multiple = 1;
  double dropout = 0.1;
  bool gelu_tanh = false;  ///< GPT-2's tanh approximation of GELU instead of the exact one
  bool tie_embeddings = true;
  bool deferred = false;  ///< fsdp.deferred_init: layers released as built, initialized by init_module()

  /// Rows of the token embedding and the LM head.
  std::int64_t padded_vocab() const { return (vocab_size + vocab_pad_multiple - 1) / vocab_pad_multiple * vocab_pad_multiple; }

  /// Training FLOPs per token, nanoGPT's and llm.c's estimate: 6 per parameter (forward and backward)
  /// plus attention's 12 n_layers d_model context; `num_params` counts every parameter once.
  double flops_per_token(std::int64_t num_params) const {
    return 6.0 * static_cast<double>(num_params) + 12.0 * static_cast<double>(n_layers * d_model * context);
  }

  /// Sequences per forward when evaluating a batch of `batch`: a chunk's logits (context x padded
  /// vocabulary floats) and their log-softmax together stay within kEvalLogitsBytes, so the evaluation
  /// batch never sets the run's peak memory; the loss is the same sum.
  static constexpr std::int64_t kEvalLogitsBytes = std::int64_t{32} << 20;
  std::int64_t eval_chunk(std::int64_t batch) const {
    const std::int64_t per_sequence = 2 * context * padded_vocab() * 4;
    return std::clamp<std::int64_t>(kEvalLogitsBytes / std::max<std::int64_t>(1, per_sequence), 1, std::max<std::int64_t>(1, batch));
  }
};

}  // namespace fsdp::app
