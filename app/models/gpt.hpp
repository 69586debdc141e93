// The GPT-style decoder, model.kind = "transformer" (app layer, LibTorch); its family is
// app/models/gpt_family.hpp.
#pragma once

#include <fsdp/fsdp.hpp>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gpt_config.hpp"
#include "models/app_model.hpp"
#include "models/attention.hpp"
#include "models/documents.hpp"
#include "models/recomputed.hpp"
#include "run_config.hpp"

namespace fsdp::app {

/// Causal multi-head self-attention; inside each document only when `documents` is given.
struct CausalSelfAttentionImpl : torch::nn::Module {
  explicit CausalSelfAttentionImpl(const GptConfig& c, SharedDocumentLayout documents = nullptr, SharedKvCache cache = nullptr, std::size_t layer = 0)
      : torch::nn::Module("CausalSelfAttention"),
        heads_(c.n_heads),
        p_(c.dropout),
        recompute_(c.recompute_attention),
        documents_(std::move(documents)),
        cache_(std::move(cache)),
        layer_(layer) {
    qkv = register_module("qkv", torch::nn::Linear(c.d_model, 3 * c.d_model));
    proj = register_module("proj", torch::nn::Linear(c.d_model, c.d_model));
    register_buffer("mask", torch::ones({c.context, c.context}).tril().view({1, 1, c.context, c.context}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto b = x.size(0), t = x.size(1), d = x.size(2), hd = d / heads_;
    auto parts = fsdp::forward(qkv, x).split(d, 2);
    auto shape = [&](const torch::Tensor& y) { return y.view({b, t, heads_, hd}).transpose(1, 2); };
    auto q = shape(parts[0]), k = shape(parts[1]), v = shape(parts[2]);
    const bool cached = cache_ && cache_->on;
    if (cached) std::tie(k, v) = cache_->append(layer_, k, v);  // generation: the earlier tokens' keys too
    const auto& mask = cached ? KvCache::blocked(t, k.size(2) - t, x.device()) : documents_ ? documents_->blocked : blocked(t);
    auto y = attend(q, k, v, mask, 1.0 / std::sqrt(static_cast<double>(hd)), is_training() ? p_ : 0.0, recompute_)
                 .transpose(1, 2)
                 .contiguous()
                 .view({b, t, d});
    return F::dropout(fsdp::forward(proj, y), F::DropoutFuncOptions().p(p_).training(is_training()));
  }
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
  std::int64_t heads_;
  double p_;
  bool recompute_;  // model.recompute_attention
  SharedDocumentLayout documents_;
  SharedKvCache cache_;
  std::size_t layer_;

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
  explicit TransformerBlockImpl(const GptConfig& c, SharedDocumentLayout documents = nullptr, SharedKvCache cache = nullptr, std::size_t layer = 0)
      : torch::nn::Module("TransformerBlock"), p_(c.dropout) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    attn = register_module("attn", CausalSelfAttention(c, std::move(documents), std::move(cache), layer));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    fc = register_module("fc", torch::nn::Linear(c.d_model, c.mlp_ratio * c.d_model));
    out = register_module("out", GeluLinear(c.mlp_ratio * c.d_model, c.d_model, c.gelu_tanh ? "tanh" : "none"));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + fsdp::forward(attn, fsdp::forward(ln1, x));
    auto h = fsdp::forward(out, fsdp::forward(fc, fsdp::forward(ln2, x)));  // out applies the GELU
    return x + F::dropout(h, F::DropoutFuncOptions().p(p_).training(is_training()));
  }
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::Linear fc{nullptr};
  GeluLinear out{nullptr};
  double p_;
};
TORCH_MODULE(TransformerBlock);

/// GPT-style decoder: token + position embeddings, n_layers blocks, final LayerNorm, LM head (tied to
/// the token embedding by default). Input: (batch, t) token ids; output: (batch, t, vocab) logits (the
/// padded vocabulary's extra rows are cut off, so no loss, evaluation or argmax ever sees them).
struct GptImpl : AppModel {
  explicit GptImpl(const GptConfig& c) : AppModel("Gpt"), config(c) {
    if (c.d_model % c.n_heads != 0)
      throw ConfigError("model.d_model (" + std::to_string(c.d_model) + ") must be divisible by model.n_heads (" + std::to_string(c.n_heads) + ")");
    const bool d = c.deferred;
    if (c.document_mask) documents_ = std::make_shared<DocumentLayout>();
    tok = register_module("tok", deferred_if(d, torch::nn::Embedding(c.padded_vocab(), c.d_model)));
    pos = register_module("pos", deferred_if(d, torch::nn::Embedding(c.context, c.d_model)));
    for (std::int64_t i = 0; i < c.n_layers; ++i)
      blocks.push_back(
          register_module("block" + std::to_string(i), deferred_if(d, TransformerBlock(c, documents_, cache_, static_cast<std::size_t>(i)))));
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
    const std::int64_t past = cache_->on ? cache_->length : 0;  // generation: positions after the cached tokens
    if (past + t > config.context)
      throw ConfigError("sequence of " + std::to_string(past + t) + " tokens exceeds model.context " + std::to_string(config.context));
    torch::Tensor x;
    if (documents_ && !cache_->on) {  // positions restart in every document; the blocks read the mask
      *documents_ = document_layout(idx, config.document_token, *documents_);
      x = lookup_tokens(tok, idx, config.tie_embeddings) + fsdp::forward(pos, documents_->positions);
    } else {
      auto positions = torch::arange(past, past + t, idx.options().dtype(torch::kLong));  // on the input's device
      x = lookup_tokens(tok, idx, config.tie_embeddings) + fsdp::forward(pos, positions).unsqueeze(0);
      if (cache_->on) cache_->length += t;
    }
    x = F::dropout(x, F::DropoutFuncOptions().p(config.dropout).training(is_training()));
    for (auto& b : blocks) x = fsdp::forward(b, x);
    auto logits = fsdp::forward(head, fsdp::forward(ln_f, x));
    return config.padded_vocab() == config.vocab_size ? logits : logits.narrow(-1, 0, config.vocab_size);
  }
  KvCache* kv_cache() override { return cache_.get(); }
  DocumentLayout* documents() override { return documents_.get(); }
  GptConfig config;
  SharedDocumentLayout documents_;                     // data.document_mask
  SharedKvCache cache_ = std::make_shared<KvCache>();  // generation
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  std::vector<TransformerBlock> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  LmHead head{nullptr};

  static std::shared_ptr<AppModel> build(const ModelSection& m, bool deferred) {
    GptConfig c = gpt_config(m);
    c.deferred = deferred;
    return std::make_shared<GptImpl>(c);
  }
};

/// fsdp.deferred_init's initialization of a module `m` of the GPT holds itself: GPT-2's N(0, 0.02)
/// weights and embeddings, zero biases, unit LayerNorms and the causal mask.
inline void init_gpt_module(torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  if (auto* ln = m.as<torch::nn::LayerNorm>()) return ln->reset_parameters();
  if (auto* attn = m.as<CausalSelfAttention>()) {
    for (auto& b : attn->named_buffers(/*recurse=*/false))
      if (b.key() == "mask") b.value().copy_(torch::ones({b.value().size(2), b.value().size(3)}).tril().view_as(b.value()));
    return;
  }
  init_normal_weights_zero_biases(m);
}

}  // namespace fsdp::app
