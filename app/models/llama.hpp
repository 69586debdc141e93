// The Llama-family decoder, model.kind = "llama" (app layer, LibTorch); its family is
// app/models/llama_family.hpp. Its modules carry Hugging Face's LlamaForCausalLM names
// (model.embed_tokens, model.layers.{i}.self_attn.{q,k,v,o}_proj, model.layers.{i}.mlp.{gate,up,down}_proj,
// model.layers.{i}.{input,post_attention}_layernorm, model.norm, lm_head), so its safetensors are a
// Hugging Face model's. Per layer: RMSNorm, attention with rotary positions (Hugging Face's
// rotate_half layout) and grouped-query heads (q/k/v biases optional, as Qwen2 has), residual,
// RMSNorm, SwiGLU MLP, residual; a final RMSNorm; a head tied to the embedding or not.
#pragma once

#include <fsdp/fsdp.hpp>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "models/app_model.hpp"
#include "models/attention.hpp"
#include "models/documents.hpp"
#include "models/recomputed.hpp"
#include "models/llama_config.hpp"
#include "run_config.hpp"

namespace fsdp::app {

/// Root-mean-square normalization, in fp32 whatever the input's dtype (as Hugging Face's LlamaRMSNorm).
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(std::int64_t width, double eps) : torch::nn::Module("RMSNorm"), eps_(eps) {
    weight = register_parameter("weight", torch::ones({width}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto xf = x.to(torch::kFloat);
    const auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps_);
    return weight * normed.to(x.scalar_type());
  }
  torch::Tensor weight;
  double eps_;
};
TORCH_MODULE(RMSNorm);

/// Causal self-attention with rotary positions and grouped-query heads; inside each document, with
/// positions that restart in each, when `documents` is given.
struct LlamaAttentionImpl : torch::nn::Module {
  explicit LlamaAttentionImpl(const LlamaConfig& c, SharedDocumentLayout documents = nullptr, SharedKvCache cache = nullptr, std::size_t layer = 0)
      : torch::nn::Module("LlamaAttention"), c_(c), documents_(std::move(documents)), cache_(std::move(cache)), layer_(layer) {
    const bool bias = c.attention_bias;
    q_proj = register_module("q_proj", torch::nn::Linear(torch::nn::LinearOptions(c.d_model, c.q_width()).bias(bias)));
    k_proj = register_module("k_proj", torch::nn::Linear(torch::nn::LinearOptions(c.d_model, c.kv_width()).bias(bias)));
    v_proj = register_module("v_proj", torch::nn::Linear(torch::nn::LinearOptions(c.d_model, c.kv_width()).bias(bias)));
    o_proj = register_module("o_proj", torch::nn::Linear(torch::nn::LinearOptions(c.q_width(), c.d_model).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto b = x.size(0), t = x.size(1), hd = c_.head_dim;
    auto heads = [&](const torch::Tensor& y, std::int64_t n) { return y.view({b, t, n, hd}).transpose(1, 2); };
    auto q = heads(fsdp::forward(q_proj, x), c_.n_heads);
    auto k = heads(fsdp::forward(k_proj, x), c_.n_kv_heads);
    auto v = heads(fsdp::forward(v_proj, x), c_.n_kv_heads);
    const bool cached = cache_ && cache_->on;
    const auto& [cos, sin] = cached ? cached_rotary(t, x) : documents_ ? document_rotary(x) : rotary(t, x);
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    if (cached) std::tie(k, v) = cache_->append(layer_, k, v);  // generation: the earlier tokens' keys too
    if (c_.n_kv_heads != c_.n_heads) {                          // each key/value head serves n_heads / n_kv_heads query heads
      k = k.repeat_interleave(c_.n_heads / c_.n_kv_heads, 1);
      v = v.repeat_interleave(c_.n_heads / c_.n_kv_heads, 1);
    }
    const auto& mask = cached ? KvCache::blocked(t, k.size(2) - t, x.device()) : documents_ ? documents_->blocked : blocked(t, x.device());
    // The softmax in fp32, as Hugging Face's; recomputed in backward with model.recompute_attention.
    auto y = attend(q, k, v, mask, 1.0 / std::sqrt(static_cast<double>(hd)), /*p=*/0.0, c_.recompute_attention, /*softmax_in_fp32=*/true)
                 .transpose(1, 2)
                 .reshape({b, t, c_.q_width()});
    return fsdp::forward(o_proj, y);
  }
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};

 private:
  static torch::Tensor rotate_half(const torch::Tensor& x) {
    const auto half = x.size(-1) / 2;
    return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  }
  /// cos and sin of every position's angles, [t, head_dim] in the input's dtype: frequencies
  /// theta^(-2i/head_dim) for the first half, repeated for the second (Hugging Face's layout). Not
  /// buffers (nothing to store): computed once per length, device and dtype.
  const std::pair<torch::Tensor, torch::Tensor>& rotary(std::int64_t t, const torch::Tensor& like) {
    if (!rotary_.first.defined() || rotary_.first.size(0) != t || rotary_.first.device() != like.device() ||
        rotary_.first.scalar_type() != like.scalar_type()) {
      const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(like.device());
      const auto angles = angles_of(torch::arange(t, opts));
      rotary_ = {angles.cos().to(like.scalar_type()), angles.sin().to(like.scalar_type())};
    }
    return rotary_;
  }
  /// The same for t tokens after the cache's (generation), every forward.
  const std::pair<torch::Tensor, torch::Tensor>& cached_rotary(std::int64_t t, const torch::Tensor& like) {
    const std::int64_t past = cache_->length - t;  // the model counted these t tokens in before its layers ran
    const auto angles = angles_of(torch::arange(past, past + t, torch::TensorOptions().dtype(torch::kFloat).device(like.device())));
    per_forward_rotary_ = {angles.cos().to(like.scalar_type()), angles.sin().to(like.scalar_type())};
    return per_forward_rotary_;
  }
  /// The same for the document layout's positions: [batch, 1, t, head_dim], every forward.
  const std::pair<torch::Tensor, torch::Tensor>& document_rotary(const torch::Tensor& like) {
    const auto angles = angles_of(documents_->positions.to(torch::kFloat)).unsqueeze(1);
    per_forward_rotary_ = {angles.cos().to(like.scalar_type()), angles.sin().to(like.scalar_type())};
    return per_forward_rotary_;
  }
  /// Each position's angles (fp32): the position times theta^(-2i/head_dim), first half repeated.
  torch::Tensor angles_of(const torch::Tensor& positions) const {
    const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(positions.device());
    const auto exponents = torch::arange(0, c_.head_dim, 2, opts.dtype(torch::kLong)).to(torch::kFloat) / static_cast<double>(c_.head_dim);
    auto inv_freq = 1.0 / torch::pow(torch::full({}, c_.rope_theta, opts), exponents);
    if (c_.rope_scaling == RopeScaling::kLlama3) inv_freq = llama3_scaled(inv_freq);
    const auto freqs = positions.unsqueeze(-1) * inv_freq;
    return torch::cat({freqs, freqs}, -1);
  }
  /// rope_scaling llama3 (Llama 3.1/3.2), in fp32 as Hugging Face computes it: frequencies whose
  /// wavelength is below original_context / high_freq_factor stay, those above original_context /
  /// low_freq_factor are divided by the factor, and between the two a blend of both, weighted by
  /// where original_context / wavelength lies between the two factors.
  torch::Tensor llama3_scaled(const torch::Tensor& inv_freq) const {
    const double original = static_cast<double>(c_.rope_original_context), low = c_.rope_low_freq_factor, high = c_.rope_high_freq_factor;
    const auto wavelength = 2 * M_PI / inv_freq;
    const auto divided = inv_freq / c_.rope_scaling_factor;
    const auto smooth = (original / wavelength - low) / (high - low);
    const auto blended = (1 - smooth) * inv_freq / c_.rope_scaling_factor + smooth * inv_freq;
    auto scaled = torch::where(wavelength > original / low, divided, inv_freq);
    const auto medium = wavelength.ge(original / high).logical_and(wavelength.le(original / low));
    return torch::where(medium, blended, scaled);
  }
  const torch::Tensor& blocked(std::int64_t t, const torch::Device& device) {
    if (!blocked_.defined() || blocked_.size(-1) != t || blocked_.device() != device)
      blocked_ = torch::ones({t, t}, torch::TensorOptions().dtype(torch::kBool).device(device)).triu(1);
    return blocked_;
  }
  LlamaConfig c_;
  SharedDocumentLayout documents_;
  SharedKvCache cache_;
  std::size_t layer_;
  std::pair<torch::Tensor, torch::Tensor> rotary_, per_forward_rotary_;  // per_forward_: document positions or a generation's
  torch::Tensor blocked_;
};
TORCH_MODULE(LlamaAttention);

/// SwiGLU: down(silu(gate(x)) * up(x)); down_proj (SwiGluLinear) applies silu(gate) * up itself and
/// recomputes it in backward.
struct LlamaMlpImpl : torch::nn::Module {
  explicit LlamaMlpImpl(const LlamaConfig& c) : torch::nn::Module("LlamaMlp") {
    gate_proj = register_module("gate_proj", torch::nn::Linear(torch::nn::LinearOptions(c.d_model, c.intermediate_size).bias(false)));
    up_proj = register_module("up_proj", torch::nn::Linear(torch::nn::LinearOptions(c.d_model, c.intermediate_size).bias(false)));
    down_proj = register_module("down_proj", SwiGluLinear(c.intermediate_size, c.d_model));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto gate = fsdp::forward(gate_proj, x);
    const auto up = fsdp::forward(up_proj, x);
    return fsdp::forward(down_proj, gate, up);
  }
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr};
  SwiGluLinear down_proj{nullptr};
};
TORCH_MODULE(LlamaMlp);

/// One decoder layer; the unit TRANSFORMER_BASED_WRAP wraps ("LlamaDecoderLayer").
struct LlamaDecoderLayerImpl : torch::nn::Module {
  explicit LlamaDecoderLayerImpl(const LlamaConfig& c, SharedDocumentLayout documents = nullptr, SharedKvCache cache = nullptr, std::size_t layer = 0)
      : torch::nn::Module("LlamaDecoderLayer") {
    input_layernorm = register_module("input_layernorm", RMSNorm(c.d_model, c.norm_eps));
    self_attn = register_module("self_attn", LlamaAttention(c, std::move(documents), std::move(cache), layer));
    post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(c.d_model, c.norm_eps));
    mlp = register_module("mlp", LlamaMlp(c));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + fsdp::forward(self_attn, fsdp::forward(input_layernorm, x));
    return x + fsdp::forward(mlp, fsdp::forward(post_attention_layernorm, x));
  }
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  LlamaAttention self_attn{nullptr};
  LlamaMlp mlp{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

/// The layers, named 0, 1, ... as Hugging Face's ModuleList names them, and called in order (through
/// fsdp::forward: a wrapping that makes the whole stack a unit frees it after use).
struct LlamaLayersImpl : torch::nn::Module {
  LlamaLayersImpl(const LlamaConfig& c, bool deferred, const SharedDocumentLayout& documents, const SharedKvCache& cache)
      : torch::nn::Module("LlamaLayers") {
    for (std::int64_t i = 0; i < c.n_layers; ++i)
      layers.push_back(
          register_module(std::to_string(i), deferred_if(deferred, LlamaDecoderLayer(c, documents, cache, static_cast<std::size_t>(i)))));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : layers) x = fsdp::forward(layer, x);
    return x;
  }
  std::vector<LlamaDecoderLayer> layers;
};
TORCH_MODULE(LlamaLayers);

/// Hugging Face's LlamaModel: the embedding, the layers and the final norm.
struct LlamaModelImpl : torch::nn::Module {
  LlamaModelImpl(const LlamaConfig& c, bool deferred, const SharedDocumentLayout& documents, const SharedKvCache& cache)
      : torch::nn::Module("LlamaModel"), tied_(c.tie_embeddings) {
    embed_tokens = register_module("embed_tokens", deferred_if(deferred, torch::nn::Embedding(c.vocab_size, c.d_model)));
    layers = register_module("layers", LlamaLayers(c, deferred, documents, cache));
    norm = register_module("norm", deferred_if(deferred, RMSNorm(c.d_model, c.norm_eps)));
  }
  torch::Tensor forward(const torch::Tensor& idx) { return fsdp::forward(norm, fsdp::forward(layers, lookup_tokens(embed_tokens, idx, tied_))); }
  torch::nn::Embedding embed_tokens{nullptr};
  LlamaLayers layers{nullptr};
  RMSNorm norm{nullptr};

 private:
  bool tied_;  // the embedding's weight is the head's too, read in its backward
};
TORCH_MODULE(LlamaModel);

/// LlamaForCausalLM. Input: (batch, t) token ids; output: (batch, t, vocab) logits.
struct LlamaImpl : AppModel {
  explicit LlamaImpl(const LlamaConfig& c) : AppModel("Llama"), config(c) {
    if (c.document_mask) documents_ = std::make_shared<DocumentLayout>();
    model = register_module("model", LlamaModel(c, c.deferred, documents_, cache_));
    lm_head = register_module(
        "lm_head", deferred_if(c.deferred, LmHead(c.d_model, c.vocab_size, c.tie_embeddings ? model->embed_tokens->weight : torch::Tensor())));
    if (c.deferred) return;  // init_llama_module() initializes it, unit by unit, inside the engine
    for (const auto& m : modules(/*include_self=*/false)) init_llama_module(*m);
  }
  torch::Tensor forward(torch::Tensor idx) override {
    const std::int64_t past = cache_->on ? cache_->length : 0;  // generation: positions after the cached tokens
    if (past + idx.size(1) > config.context)
      throw ConfigError("sequence of " + std::to_string(past + idx.size(1)) + " tokens exceeds model.context " + std::to_string(config.context));
    if (cache_->on)
      cache_->length += idx.size(1);
    else if (documents_)
      *documents_ = document_layout(idx, config.document_token, *documents_);  // the attention modules read it
    return fsdp::forward(lm_head, fsdp::forward(model, idx));
  }

  /// Hugging Face's initialization (initializer_range 0.02): N(0, 0.02) weights and embeddings, zero
  /// biases, unit RMSNorms; of the parameters `m` holds itself (fsdp.deferred_init's param_init_fn).
  static void init_llama_module(torch::nn::Module& m) {
    torch::NoGradGuard no_grad;
    if (auto* norm = m.as<RMSNorm>()) {
      norm->weight.fill_(1.0);
      return;
    }
    init_normal_weights_zero_biases(m);
  }
  static std::shared_ptr<AppModel> build(const ModelSection& m, bool deferred) {
    LlamaConfig c = LlamaConfig::of(m);
    c.deferred = deferred;
    return std::make_shared<LlamaImpl>(c);
  }

  KvCache* kv_cache() override { return cache_.get(); }
  DocumentLayout* documents() override { return documents_.get(); }
  LlamaConfig config;
  SharedDocumentLayout documents_;                     // data.document_mask
  SharedKvCache cache_ = std::make_shared<KvCache>();  // generation
  LlamaModel model{nullptr};
  LmHead lm_head{nullptr};
};

}  // namespace fsdp::app
