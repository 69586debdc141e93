// Memory planning (app layer): the deck's model family and size (ModelShape), its closed-form
// description (describe_model) and parameter counts. No LibTorch.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "gpt_config.hpp"
#include "plan/model_desc.hpp"
#include "run_config.hpp"

namespace fsdp::app {

/// The family and size of the deck's model (the keys of [model] that matter for memory).
struct ModelShape {
  ModelKind kind = ModelKind::kCnn;
  std::vector<std::int64_t> hidden_sizes;  ///< mlp
  GptConfig gpt;                           ///< transformer
  std::optional<double> dropout;           ///< model.dropout; unset: each model's own
};

inline ModelShape model_shape(const ModelSection& m) {
  ModelShape s;
  s.kind = m.kind;
  s.dropout = m.dropout;
  s.hidden_sizes = m.hidden_sizes;
  s.gpt = gpt_config(m);
  return s;
}

namespace detail {
inline void linear(ModelDesc& d, int parent, const std::string& key, std::int64_t in, std::int64_t out, bool bias = true) {
  const int m = d.add(parent, key, "Linear", "torch::nn::Linear");
  d.param(m, "weight", {out, in});
  if (bias) d.param(m, "bias", {out});
}
inline void layer_norm(ModelDesc& d, int parent, const std::string& key, std::int64_t n) {
  const int m = d.add(parent, key, "LayerNorm", "torch::nn::LayerNorm");
  d.param(m, "weight", {n});
  d.param(m, "bias", {n});
}
}  // namespace detail

/// The module tree of models.hpp's model for `s`, built in closed form (no tensors). `fsdp-train
/// --check-plan` and tests/plan_e2e.cmake compare it with the model LibTorch builds.
inline ModelDesc describe_model(const ModelShape& s) {
  ModelDesc d;
  d.kind = s.kind;
  if (s.kind == ModelKind::kCnn) {
    const int root = d.add(-1, "", "TutorialCnn", "TutorialCnn");
    const int c1 = d.add(root, "conv1", "Conv2d", "torch::nn::Conv2d");
    d.param(c1, "weight", {32, 1, 3, 3});
    d.param(c1, "bias", {32});
    const int c2 = d.add(root, "conv2", "Conv2d", "torch::nn::Conv2d");
    d.param(c2, "weight", {64, 32, 3, 3});
    d.param(c2, "bias", {64});
    d.add(root, "dropout1", "Dropout", "torch::nn::Dropout");
    d.add(root, "dropout2", "Dropout", "torch::nn::Dropout");
    detail::linear(d, root, "fc1", 9216, 128);
    detail::linear(d, root, "fc2", 128, 10);
  } else if (s.kind == ModelKind::kMlp) {
    const int root = d.add(-1, "", "Mlp", "Mlp");
    std::int64_t in = 784;
    for (std::size_t i = 0; i < s.hidden_sizes.size(); ++i) {
      detail::linear(d, root, "fc" + std::to_string(i + 1), in, s.hidden_sizes[i]);
      in = s.hidden_sizes[i];
    }
    detail::linear(d, root, "out", in, 10);
  } else if (s.kind == ModelKind::kTransformer) {
    const auto& c = s.gpt;
    const int root = d.add(-1, "", "Gpt", "Gpt");
    const int tok = d.add(root, "tok", "Embedding", "torch::nn::Embedding");
    d.param(tok, "weight", {c.padded_vocab(), c.d_model});
    const int pos = d.add(root, "pos", "Embedding", "torch::nn::Embedding");
    d.param(pos, "weight", {c.context, c.d_model});
    for (std::int64_t i = 0; i < c.n_layers; ++i) {
      const int b = d.add(root, "block" + std::to_string(i), "TransformerBlock", "TransformerBlock");
      detail::layer_norm(d, b, "ln1", c.d_model);
      const int attn = d.add(b, "attn", "CausalSelfAttention", "CausalSelfAttention");
      detail::linear(d, attn, "qkv", c.d_model, 3 * c.d_model);
      detail::linear(d, attn, "proj", c.d_model, c.d_model);
      d.modules[static_cast<std::size_t>(attn)].buffer_numel = c.context * c.context;  // the causal mask
      detail::layer_norm(d, b, "ln2", c.d_model);
      detail::linear(d, b, "fc", c.d_model, c.mlp_ratio * c.d_model);
      detail::linear(d, b, "out", c.mlp_ratio * c.d_model, c.d_model);
    }
    detail::layer_norm(d, root, "ln_f", c.d_model);
    const int head = d.add(root, "head", "LmHead", "LmHead");
    d.param(head, "weight", {c.padded_vocab(), c.d_model}, c.tie_embeddings ? "tok.weight" : "");
  } else {
    throw ConfigError("plan: unknown model.kind '" + to_string(s.kind) + "'", "fsdp.plan");
  }
  return d;
}

/// Closed-form parameter counts (distinct elements), the formulas docs/planning.md gives.
inline std::int64_t mlp_num_params(const std::vector<std::int64_t>& hidden) {
  std::int64_t n = 0, in = 784;
  for (auto h : hidden) {
    n += in * h + h;
    in = h;
  }
  return n + in * 10 + 10;
}
inline constexpr std::int64_t kCnnNumParams = (32 * 9 + 32) + (64 * 32 * 9 + 64) + (9216 * 128 + 128) + (128 * 10 + 10);
inline std::int64_t gpt_num_params(const GptConfig& c) {
  const std::int64_t d = c.d_model, r = c.mlp_ratio;
  const std::int64_t block = (4 + 2 * r) * d * d + (9 + r) * d;
  const std::int64_t v = c.padded_vocab();
  return v * d + c.context * d + c.n_layers * block + 2 * d + (c.tie_embeddings ? 0 : v * d);
}
inline std::int64_t closed_form_num_params(const ModelShape& s) {
  if (s.kind == ModelKind::kCnn) return kCnnNumParams;
  if (s.kind == ModelKind::kMlp) return mlp_num_params(s.hidden_sizes);
  return gpt_num_params(s.gpt);
}

}  // namespace fsdp::app
