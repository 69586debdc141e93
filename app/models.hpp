// The models fsdp-train builds from a deck: the FSDP tutorial's CNN, a configurable MLP and a
// GPT-style decoder. Every child module is called through fsdp::forward, at every depth, so that any
// wrapping frees its units after use (fsdp-train promises this: all_units_called_through_forward).
#pragma once

#include <fsdp/fsdp.hpp>
#include <torch/torch.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "gpt_config.hpp"

namespace fsdp::app {

namespace F = torch::nn::functional;

/// fsdp.deferred_init: releases a freshly built layer's storage (fsdp::defer_init), so that the model
/// never exists whole; the engine initializes it unit by unit with init_module().
template <class Holder>
Holder deferred_if(bool deferred, Holder module) {
  if (deferred) fsdp::defer_init(*module);
  return module;
}

/// What the training loop needs from any model: one tensor in, one tensor out.
struct AppModel : torch::nn::Module {
  using torch::nn::Module::Module;
  virtual torch::Tensor forward(torch::Tensor x) = 0;
};

/// The CNN of the PyTorch FSDP tutorial (and PyTorch's MNIST example), exactly: conv1 1->32 3x3,
/// conv2 32->64 3x3, max-pool 2, dropout 0.25, fc1 9216->128, dropout 0.5, fc2 128->10, log-softmax.
struct TutorialCnnImpl : AppModel {
  explicit TutorialCnnImpl(std::optional<double> dropout, bool deferred = false) : AppModel("TutorialCnn") {
    conv1 = register_module("conv1", deferred_if(deferred, torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).stride(1))));
    conv2 = register_module("conv2", deferred_if(deferred, torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).stride(1))));
    dropout1 = register_module("dropout1", torch::nn::Dropout(dropout.value_or(0.25)));
    dropout2 = register_module("dropout2", torch::nn::Dropout(dropout.value_or(0.5)));
    fc1 = register_module("fc1", deferred_if(deferred, torch::nn::Linear(9216, 128)));
    fc2 = register_module("fc2", deferred_if(deferred, torch::nn::Linear(128, 10)));
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = torch::relu(fsdp::forward(conv1, x));
    x = torch::relu(fsdp::forward(conv2, x));
    x = fsdp::forward(dropout1, F::max_pool2d(x, F::MaxPool2dFuncOptions(2)));
    x = torch::relu(fsdp::forward(fc1, x.flatten(1)));
    x = fsdp::forward(fc2, fsdp::forward(dropout2, x));
    return F::log_softmax(x, F::LogSoftmaxFuncOptions(1));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Dropout dropout1{nullptr}, dropout2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

/// 784 -> hidden_sizes... -> 10 with ReLU (and dropout, default none), log-softmax.
struct MlpImpl : AppModel {
  MlpImpl(const std::vector<std::int64_t>& hidden_sizes, std::optional<double> dropout, bool deferred = false)
      : AppModel("Mlp"), p_(dropout.value_or(0.0)) {
    std::int64_t in = 784;
    for (std::size_t i = 0; i < hidden_sizes.size(); ++i) {
      layers.push_back(register_module("fc" + std::to_string(i + 1), deferred_if(deferred, torch::nn::Linear(in, hidden_sizes[i]))));
      in = hidden_sizes[i];
    }
    layers.push_back(register_module("out", deferred_if(deferred, torch::nn::Linear(in, 10))));
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = x.flatten(1);
    for (std::size_t i = 0; i + 1 < layers.size(); ++i) {
      x = torch::relu(fsdp::forward(layers[i], x));
      if (p_ > 0) x = F::dropout(x, F::DropoutFuncOptions().p(p_).training(is_training()));
    }
    return F::log_softmax(fsdp::forward(layers.back(), x), F::LogSoftmaxFuncOptions(1));
  }
  std::vector<torch::nn::Linear> layers;
  double p_;
};

/// Causal multi-head self-attention.
struct CausalSelfAttentionImpl : torch::nn::Module {
  explicit CausalSelfAttentionImpl(const GptConfig& c) : torch::nn::Module("CausalSelfAttention"), heads_(c.n_heads), p_(c.dropout) {
    qkv = register_module("qkv", torch::nn::Linear(c.d_model, 3 * c.d_model));
    proj = register_module("proj", torch::nn::Linear(c.d_model, c.d_model));
    register_buffer("mask", torch::ones({c.context, c.context}).tril().view({1, 1, c.context, c.context}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto b = x.size(0), t = x.size(1), d = x.size(2), hd = d / heads_;
    auto parts = fsdp::forward(qkv, x).split(d, 2);
    auto shape = [&](const torch::Tensor& y) { return y.view({b, t, heads_, hd}).transpose(1, 2); };
    auto q = shape(parts[0]), k = shape(parts[1]), v = shape(parts[2]);
    auto att = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    att = att.masked_fill(blocked(t), -std::numeric_limits<float>::infinity());
    att = F::dropout(torch::softmax(att, -1), F::DropoutFuncOptions().p(p_).training(is_training()));
    auto y = torch::matmul(att, v).transpose(1, 2).contiguous().view({b, t, d});
    return F::dropout(fsdp::forward(proj, y), F::DropoutFuncOptions().p(p_).training(is_training()));
  }
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
  std::int64_t heads_;
  double p_;

 private:
  /// Where attention is blocked for a sequence of t tokens, built once rather than every forward. Rebuilt
  /// if the mask buffer moved or its version changed (deferred init, a dtype or device change); writes
  /// that bypass the version counter (collectives into its memory) rewrite the same constant mask.
  const torch::Tensor& blocked(std::int64_t t) {
    const torch::Tensor mask = named_buffers(/*recurse=*/false)["mask"];
    if (!blocked_.defined() || blocked_.size(-1) != t || blocked_.device() != mask.device() || blocked_source_ != mask.data_ptr() ||
        blocked_version_ != mask._version()) {
      blocked_ = mask.slice(2, 0, t).slice(3, 0, t) == 0;
      blocked_source_ = mask.data_ptr();
      blocked_version_ = mask._version();
    }
    return blocked_;
  }
  torch::Tensor blocked_;
  const void* blocked_source_ = nullptr;
  std::int64_t blocked_version_ = 0;
};
TORCH_MODULE(CausalSelfAttention);

/// Pre-norm transformer block; the unit TRANSFORMER_BASED_WRAP wraps ("TransformerBlock").
struct TransformerBlockImpl : torch::nn::Module {
  explicit TransformerBlockImpl(const GptConfig& c)
      : torch::nn::Module("TransformerBlock"), p_(c.dropout), gelu_(F::GELUFuncOptions().approximate(c.gelu_tanh ? "tanh" : "none")) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    attn = register_module("attn", CausalSelfAttention(c));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    fc = register_module("fc", torch::nn::Linear(c.d_model, c.mlp_ratio * c.d_model));
    out = register_module("out", torch::nn::Linear(c.mlp_ratio * c.d_model, c.d_model));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + fsdp::forward(attn, fsdp::forward(ln1, x));
    auto h = fsdp::forward(out, F::gelu(fsdp::forward(fc, fsdp::forward(ln2, x)), gelu_));
    return x + F::dropout(h, F::DropoutFuncOptions().p(p_).training(is_training()));
  }
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::Linear fc{nullptr}, out{nullptr};
  double p_;
  F::GELUFuncOptions gelu_;
};
TORCH_MODULE(TransformerBlock);

/// Output projection to the vocabulary, optionally sharing the token embedding's weight.
struct LmHeadImpl : torch::nn::Module {
  LmHeadImpl(std::int64_t d_model, std::int64_t vocab, torch::Tensor tied) : torch::nn::Module("LmHead") {
    weight = register_parameter("weight", tied.defined() ? tied : torch::empty({vocab, d_model}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return F::linear(x, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(LmHead);

/// GPT-style decoder: token + position embeddings, n_layers blocks, final LayerNorm, LM head (tied to
/// the token embedding by default). Input: (batch, t) token ids; output: (batch, t, vocab) logits (the
/// padded vocabulary's extra rows are cut off, so no loss, evaluation or argmax ever sees them).
struct GptImpl : AppModel {
  explicit GptImpl(const GptConfig& c) : AppModel("Gpt"), config(c) {
    if (c.d_model % c.n_heads != 0)
      throw ConfigError("model.d_model (" + std::to_string(c.d_model) + ") must be divisible by model.n_heads (" + std::to_string(c.n_heads) + ")");
    const bool d = c.deferred;
    tok = register_module("tok", deferred_if(d, torch::nn::Embedding(c.padded_vocab(), c.d_model)));
    pos = register_module("pos", deferred_if(d, torch::nn::Embedding(c.context, c.d_model)));
    for (std::int64_t i = 0; i < c.n_layers; ++i) blocks.push_back(register_module("block" + std::to_string(i), deferred_if(d, TransformerBlock(c))));
    ln_f = register_module("ln_f", deferred_if(d, torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model}))));
    head = register_module("head", deferred_if(d, LmHead(c.d_model, c.padded_vocab(), c.tie_embeddings ? tok->weight : torch::Tensor())));
    if (d) return;  // init_module() initializes it, unit by unit, inside the engine
    // GPT-2 initialization: N(0, 0.02) for weights and embeddings, zero biases.
    torch::NoGradGuard no_grad;
    for (auto& p : named_parameters()) {
      if (p.key().find("ln") != std::string::npos) continue;
      if (p.key().size() >= 4 && p.key().compare(p.key().size() - 4, 4, "bias") == 0)
        p.value().zero_();
      else
        p.value().normal_(0, 0.02);
    }
  }
  torch::Tensor forward(torch::Tensor idx) override {
    const auto t = idx.size(1);
    if (t > config.context) throw ConfigError("sequence of " + std::to_string(t) + " tokens exceeds model.context " + std::to_string(config.context));
    auto positions = torch::arange(t, idx.options().dtype(torch::kLong));  // on the input's device
    auto x = fsdp::forward(tok, idx) + fsdp::forward(pos, positions).unsqueeze(0);
    x = F::dropout(x, F::DropoutFuncOptions().p(config.dropout).training(is_training()));
    for (auto& b : blocks) x = fsdp::forward(b, x);
    auto logits = fsdp::forward(head, fsdp::forward(ln_f, x));
    return config.padded_vocab() == config.vocab_size ? logits : logits.narrow(-1, 0, config.vocab_size);
  }
  GptConfig config;
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  std::vector<TransformerBlock> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  LmHead head{nullptr};
};

/// fsdp.deferred_init's FsdpOptions::param_init_fn: initializes the parameters and buffers `m` holds
/// itself. The GPT family (`gpt`) gets GPT-2's N(0, 0.02) weights and embeddings, zero biases, unit
/// LayerNorms and its causal mask; the CNN and MLP their layers' default (PyTorch) initialization.
inline void init_module(torch::nn::Module& m, bool gpt) {
  torch::NoGradGuard no_grad;
  if (auto* ln = m.as<torch::nn::LayerNorm>()) return ln->reset_parameters();
  if (auto* attn = m.as<CausalSelfAttention>()) {
    for (auto& b : attn->named_buffers(/*recurse=*/false))
      if (b.key() == "mask") b.value().copy_(torch::ones({b.value().size(2), b.value().size(3)}).tril().view_as(b.value()));
    return;
  }
  if (gpt) {
    for (auto& p : m.named_parameters(/*recurse=*/false)) {
      if (p.key() == "bias")
        p.value().zero_();
      else
        p.value().normal_(0, 0.02);
    }
    return;
  }
  if (auto* linear = m.as<torch::nn::Linear>()) return linear->reset_parameters();
  if (auto* conv = m.as<torch::nn::Conv2d>()) return conv->reset_parameters();
  if (!m.named_parameters(/*recurse=*/false).is_empty()) throw ConfigError("fsdp.deferred_init: no initialization for module " + m.name());
}

}  // namespace fsdp::app
