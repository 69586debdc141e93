// What fsdp-train needs from every model it builds (app layer, LibTorch): one tensor in, one tensor
// out, every child module called through fsdp::forward, at every depth, so that any wrapping frees its
// units after use (fsdp-train promises this: all_units_called_through_forward).
#pragma once

#include <fsdp/fsdp.hpp>
#include <torch/torch.h>

#include <string>

#include "fsdp/errors.hpp"
#include "models/documents.hpp"
#include "models/kv_cache.hpp"

namespace fsdp::app {

namespace F = torch::nn::functional;

/// fsdp.deferred_init: releases a freshly built layer's storage (fsdp::defer_init), so that the model
/// never exists whole; the engine initializes it unit by unit with its kind's init_module.
template <class Holder>
Holder deferred_if(bool deferred, Holder module) {
  if (deferred) fsdp::defer_init(*module);
  return module;
}

/// What the training loop needs from any model: one tensor in, one tensor out.
struct AppModel : torch::nn::Module {
  using torch::nn::Module::Module;
  virtual torch::Tensor forward(torch::Tensor x) = 0;
  /// A language model's key/value cache for generation (off unless turned on); null for the others.
  virtual KvCache* kv_cache() { return nullptr; }
  /// data.document_mask: the layout its forward computes and its attention reads (where the data's
  /// document starts go before a forward); null without the mask.
  virtual DocumentLayout* documents() { return nullptr; }
};

/// A language model's output projection to the vocabulary, optionally sharing the token embedding's
/// weight (then it is the same tensor, stored once).
struct LmHeadImpl : torch::nn::Module {
  LmHeadImpl(std::int64_t d_model, std::int64_t vocab, torch::Tensor tied) : torch::nn::Module("LmHead") {
    weight = register_parameter("weight", tied.defined() ? tied : torch::empty({vocab, d_model}));
  }
  /// Under FSDP, a head that is a unit of its own frees its gathered weight before computing its gradient.
  torch::Tensor forward(const torch::Tensor& x) { return fsdp::linear_releasing_weight(*this, x, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(LmHead);

/// A token embedding's lookup through fsdp::forward. Its backward reads only the indices: unless the
/// weight is tied to the output projection (which reads it in backward), FSDP does not gather the
/// embedding again for backward.
inline torch::Tensor lookup_tokens(torch::nn::Embedding& embedding, const torch::Tensor& idx, bool tied) {
  auto out = fsdp::forward(embedding, idx);
  if (!tied) fsdp::backward_reads_no_parameter(*embedding);
  return out;
}

/// GPT-2's and Hugging Face's initialization (initializer_range 0.02) of the parameters `m` holds
/// itself: N(0, 0.02) weights and embeddings, zero biases.
inline void init_normal_weights_zero_biases(torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.named_parameters(/*recurse=*/false)) {
    if (p.key() == "bias")
      p.value().zero_();
    else
      p.value().normal_(0, 0.02);
  }
}

/// fsdp.deferred_init's initialization of a module `m` holds itself, by its layers' own default
/// (PyTorch's): the image classifiers'.
inline void init_default_module(torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  if (auto* ln = m.as<torch::nn::LayerNorm>()) return ln->reset_parameters();
  if (auto* linear = m.as<torch::nn::Linear>()) return linear->reset_parameters();
  if (auto* conv = m.as<torch::nn::Conv2d>()) return conv->reset_parameters();
  if (!m.named_parameters(/*recurse=*/false).is_empty()) throw ConfigError("fsdp.deferred_init: no initialization for module " + m.name());
}

}  // namespace fsdp::app
