// The Llama-family decoder's sizes (app layer, std only): the deck's [model] with every derived size
// resolved. models/llama.hpp builds it, models/llama_family.hpp describes it for the planner.
#pragma once

#include <algorithm>
#include <cstdint>

#include "run_config.hpp"

namespace fsdp::app {

struct LlamaConfig {
  std::int64_t vocab_size = 256, context = 64, d_model = 128, n_layers = 4;
  std::int64_t n_heads = 4, n_kv_heads = 4, head_dim = 32, intermediate_size = 512;
  double norm_eps = 1e-5, rope_theta = 10000;
  bool attention_bias = false, tie_embeddings = true;
  bool recompute_attention = true;  ///< attention's backward recomputes the probabilities (models/recomputed.hpp)
  RopeScaling rope_scaling = RopeScaling::kNone;
  double rope_scaling_factor = 8, rope_low_freq_factor = 1, rope_high_freq_factor = 4;
  std::int64_t rope_original_context = 8192;
  std::int64_t max_positions = 64, bos_token_id = -1;  ///< max_positions: model.max_positions or the context
  std::vector<std::int64_t> eos_token_ids;             ///< Hugging Face's eos_token_id: one id or a list
  std::int64_t sliding_window = 0;                     ///< Mistral's or Qwen2's window, kept for the export (within it, attention is full attention)
  bool deferred = false;                               ///< fsdp.deferred_init: layers released as built
  bool document_mask = false;                          ///< data.document_mask (models/documents.hpp)
  std::int64_t document_token = -1;                    ///< its separator; -1: the data's document starts

  /// model.n_kv_heads, model.head_dim and model.intermediate_size of 0 take their defaults here.
  static LlamaConfig of(const ModelSection& m) {
    LlamaConfig c;
    c.vocab_size = m.vocab_size;
    c.context = m.context;
    c.d_model = m.d_model;
    c.n_layers = m.n_layers;
    c.n_heads = m.n_heads;
    c.n_kv_heads = m.n_kv_heads > 0 ? m.n_kv_heads : m.n_heads;
    c.head_dim = m.head_dim > 0 ? m.head_dim : m.d_model / std::max<std::int64_t>(1, m.n_heads);
    c.intermediate_size = m.intermediate_size > 0 ? m.intermediate_size : m.mlp_ratio * m.d_model;
    c.norm_eps = m.norm_eps;
    c.rope_theta = m.rope_theta;
    c.attention_bias = m.attention_bias;
    c.recompute_attention = m.recompute_attention;
    c.tie_embeddings = m.tie_embeddings;
    c.rope_scaling = m.rope_scaling;
    c.rope_scaling_factor = m.rope_scaling_factor;
    c.rope_low_freq_factor = m.rope_low_freq_factor;
    c.rope_high_freq_factor = m.rope_high_freq_factor;
    c.rope_original_context = m.rope_original_context;
    c.document_mask = m.document_mask;
    c.document_token = m.document_token;
    c.max_positions = m.max_positions > 0 ? m.max_positions : m.context;
    c.bos_token_id = m.bos_token_id;
    c.eos_token_ids = m.eos_token_ids;
    c.sliding_window = m.sliding_window;
    return c;
  }
  std::int64_t q_width() const { return n_heads * head_dim; }
  std::int64_t kv_width() const { return n_kv_heads * head_dim; }

  /// Distinct parameter elements.
  std::int64_t num_params() const {
    const std::int64_t D = d_model, I = intermediate_size;
    const std::int64_t attention = D * q_width() + 2 * D * kv_width() + q_width() * D + (attention_bias ? q_width() + 2 * kv_width() : 0);
    const std::int64_t layer = attention + 3 * D * I + 2 * D;
    return vocab_size * D * (tie_embeddings ? 1 : 2) + n_layers * layer + D;
  }
  double flops_per_token(std::int64_t params) const { return decoder_flops_per_token(params, n_layers, q_width(), context); }
  std::int64_t eval_chunk(std::int64_t batch) const { return language_model_eval_chunk(context, vocab_size, batch); }
};

}  // namespace fsdp::app
