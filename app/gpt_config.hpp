// The GPT model's size and options (app layer, std only): models.hpp builds it with LibTorch, the memory
// planner (app/plan/) describes it in closed form, the Hugging Face GPT-2 names (gpt2_names.hpp) map it.
#pragma once

#include <algorithm>
#include <cstdint>

namespace fsdp::app {

/// A decoder's training FLOPs per token, nanoGPT's and llm.c's estimate: 6 per parameter (forward and
/// backward; `num_params` counts every parameter once) plus attention's 12 n_layers width context,
/// `attention_width` the query heads' total width.
inline double decoder_flops_per_token(std::int64_t num_params, std::int64_t n_layers, std::int64_t attention_width, std::int64_t context) {
  return 6.0 * static_cast<double>(num_params) + 12.0 * static_cast<double>(n_layers * attention_width * context);
}

/// Sequences per forward when a language model evaluates a batch of `batch`: a chunk's logits (context
/// x vocabulary rows floats) and their log-softmax together stay within kEvalLogitsBytes, so the
/// evaluation batch never sets the run's peak memory; the loss is the same sum.
inline constexpr std::int64_t kEvalLogitsBytes = std::int64_t{32} << 20;
inline std::int64_t language_model_eval_chunk(std::int64_t context, std::int64_t vocab_rows, std::int64_t batch) {
  const std::int64_t per_sequence = 2 * context * vocab_rows * 4;
  return std::clamp<std::int64_t>(kEvalLogitsBytes / std::max<std::int64_t>(1, per_sequence), 1, std::max<std::int64_t>(1, batch));
}

struct GptConfig {
  std::int64_t vocab_size = 256, context = 64, d_model = 128, n_heads = 4, n_layers = 4, mlp_ratio = 4;
  /// The embedding and LM head have vocab_size rounded up to this multiple rows (llm.c pads GPT-2's
  /// 50257 to 50304 for faster matrix shapes); the logits are cut back to vocab_size.
  std::int64_t vocab_pad_multiple = 1;
  double dropout = 0.1;
  bool gelu_tanh = false;           ///< GPT-2's tanh approximation of GELU instead of the exact one
  bool recompute_attention = true;  ///< attention's backward recomputes the probabilities (models/recomputed.hpp)
  bool tie_embeddings = true;
  bool deferred = false;             ///< fsdp.deferred_init: layers released as built, initialized by init_module()
  bool document_mask = false;        ///< data.document_mask (models/documents.hpp)
  std::int64_t document_token = -1;  ///< its separator; -1: the data's document starts (an indexed dataset's)

  /// Rows of the token embedding and the LM head.
  std::int64_t padded_vocab() const { return (vocab_size + vocab_pad_multiple - 1) / vocab_pad_multiple * vocab_pad_multiple; }

  double flops_per_token(std::int64_t num_params) const { return decoder_flops_per_token(num_params, n_layers, d_model, context); }
  std::int64_t eval_chunk(std::int64_t batch) const { return language_model_eval_chunk(context, padded_vocab(), batch); }
};

}  // namespace fsdp::app
