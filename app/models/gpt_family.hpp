// The GPT family, model.kind = "transformer" (app layer, std only): token and position embeddings,
// model.n_layers pre-norm blocks (LayerNorm, causal self-attention, LayerNorm, MLP), a final LayerNorm
// and an LM head tied to the token embedding or not. Its LibTorch model is app/models/gpt.hpp.
#pragma once

#include <string>
#include <vector>

#include "gpt2_names.hpp"
#include "gpt_config.hpp"
#include "models/family.hpp"

namespace fsdp::app {

class GptFamily final : public ModelFamily {
 public:
  ModelKind kind() const override { return ModelKind::kTransformer; }
  bool language_model() const override { return true; }

  /// An untied vocabulary-sized matrix in the root unit would stay gathered, with its gradient, from
  /// the first forward to the end of backward; as its own unit it is gathered only while it is used.
  std::vector<std::string> layer_classes(const ModelSection& m) const override {
    if (!m.tie_embeddings) return {"TransformerBlock", "Embedding", "LmHead"};
    return {"TransformerBlock"};
  }

  ModelDesc describe(const ModelSection& m) const override {
    const GptConfig c = gpt_config(m);
    ModelDesc d;
    d.kind = kind();
    const int root = d.add(-1, "", "Gpt", "Gpt");
    const int tok = d.add(root, "tok", "Embedding", "torch::nn::Embedding");
    d.param(tok, "weight", {c.padded_vocab(), c.d_model});
    const int pos = d.add(root, "pos", "Embedding", "torch::nn::Embedding");
    d.param(pos, "weight", {c.context, c.d_model});
    for (std::int64_t i = 0; i < c.n_layers; ++i) {
      const int b = d.add(root, "block" + std::to_string(i), "TransformerBlock", "TransformerBlock");
      detail::describe_layer_norm(d, b, "ln1", c.d_model);
      const int attn = d.add(b, "attn", "CausalSelfAttention", "CausalSelfAttention");
      detail::describe_linear(d, attn, "qkv", c.d_model, 3 * c.d_model);
      detail::describe_linear(d, attn, "proj", c.d_model, c.d_model);
      d.modules[static_cast<std::size_t>(attn)].buffer_numel = c.context * c.context;  // the causal mask
      detail::describe_layer_norm(d, b, "ln2", c.d_model);
      detail::describe_linear(d, b, "fc", c.d_model, c.mlp_ratio * c.d_model);
      const int out = d.add(b, "out", "GeluLinear", "fsdp::app::GeluLinear");  // a Linear that applies the GELU first
      d.param(out, "weight", {c.d_model, c.mlp_ratio * c.d_model});
      d.param(out, "bias", {c.d_model});
    }
    detail::describe_layer_norm(d, root, "ln_f", c.d_model);
    const int head = d.add(root, "head", "LmHead", "LmHead");
    d.param(head, "weight", {c.padded_vocab(), c.d_model}, c.tie_embeddings ? "tok.weight" : "");
    return d;
  }

  static std::int64_t num_params(const GptConfig& c) {
    const std::int64_t d = c.d_model, r = c.mlp_ratio;
    const std::int64_t block = (4 + 2 * r) * d * d + (9 + r) * d;
    const std::int64_t v = c.padded_vocab();
    return v * d + c.context * d + c.n_layers * block + 2 * d + (c.tie_embeddings ? 0 : v * d);
  }
  std::int64_t num_params(const ModelSection& m) const override { return num_params(gpt_config(m)); }

  /// Saved per transformer block (B batch, T context, d d_model, r mlp_ratio, h heads, dropout p > 0):
  /// (10 + r)·B·T·d elements, B·h·T² bytes (attention's kept positions) and LayerNorm statistics; with
  /// p = 0: (8 + r)·B·T·d. The GELU's output and attention's probabilities are recomputed in backward;
  /// with model.recompute_attention = false, attention keeps its probabilities (and matmul's copies of q,
  /// k and v instead of the qkv output): (10 + r)·B·T·d + 3·B·h·T² elements with dropout,
  /// (8 + r)·B·T·d + B·h·T² without.
  void trace(TraceBuilder& b, const ModelSection& m, std::int64_t batch, int eb, bool training, bool /*cast_input: token ids*/) const override {
    constexpr int input = 0;
    const GptConfig c = gpt_config(m);
    const std::int64_t B = batch;
    const double p = training ? c.dropout : 0.0;
    const std::int64_t T = c.context, D = c.d_model, H = c.n_heads, V = c.padded_vocab();
    const std::int64_t btd = B * T * D * eb, scores = B * H * T * T * eb, stats = 2 * B * T * 4, logits = B * T * V * eb;
    b.enter("tok", input);
    const int e = b.op(btd, {}, {}, {"tok.weight"}, btd);
    b.exit("tok");
    if (!c.tie_embeddings) b.backward_reads_no_parameter();  // lookup_tokens
    const int positions = b.op(T * 8, {}, {}, {}, 0);
    b.enter("pos", positions);
    const int pe = b.op(T * D * eb, {positions}, {}, {"pos.weight"}, T * D * eb);
    b.exit("pos");
    int x = b.op(btd, {}, {e, pe, positions}, {}, btd);
    if (p > 0) {
      const int dd = b.op(btd, {}, {x}, {}, 2 * btd);
      b.aux(btd);
      x = dd;
    }
    for (std::int64_t i = 0; i < c.n_layers; ++i) x = trace_block(b, c, i, x, p, btd, scores, stats, eb);
    b.enter("ln_f", x);
    const int lf = b.op(btd, {x}, {x}, {"ln_f.weight", "ln_f.bias"}, 2 * btd);
    b.aux(stats);
    b.exit("ln_f");
    b.enter("head", lf);
    const int lg = b.op(logits, {lf}, {lf}, {"head.weight"}, logits + btd);
    b.releases_weight("head");  // LmHead
    b.exit("head");
    // loss_of: fp32 logits, log_softmax (saves its result), nll_loss (train/cross_entropy.hpp).
    int l32 = lg;
    if (eb != 4) l32 = b.op(B * T * V * 4, {}, {}, {}, logits + B * T * V * 4);  // backward: the fp32 gradient and its cast
    const int ls = b.op(B * T * V * 4, {}, {}, {}, 0, true);                     // token_cross_entropy: the logits' gradient takes this buffer
    b.op(8, {ls}, {ls, lg, l32 == lg ? -1 : l32}, {}, 0);
  }

  std::int64_t input_bytes(const ModelSection& m, std::int64_t batch) const override { return batch * m.context * 8; }  // token ids (int64)
  std::int64_t target_bytes(const ModelSection& m, std::int64_t batch) const override { return batch * m.context * 8; }
  std::int64_t predictions_per_sample(const ModelSection& m) const override { return m.context; }
  std::int64_t eval_chunk(const ModelSection& m, std::int64_t batch) const override { return gpt_config(m).eval_chunk(batch); }
  double flops_per_token(const ModelSection& m, std::int64_t num_params) const override { return gpt_config(m).flops_per_token(num_params); }

  SizeEstimate size_estimate(const ModelSection& m, long double batch) const override {
    const GptConfig c = gpt_config(m);
    const long double V = static_cast<long double>(c.padded_vocab()), T = static_cast<long double>(c.context),
                      D = static_cast<long double>(c.d_model), L = static_cast<long double>(c.n_layers), R = static_cast<long double>(c.mlp_ratio),
                      H = static_cast<long double>(c.n_heads);
    return {.params = V * D * (c.tie_embeddings ? 1 : 2) + T * D + L * ((4 + 2 * R) * D * D + (9 + R) * D) + 2 * D,
            // The scores of one block exist in forward whether or not backward keeps them.
            .activations = batch * T * (L * (12 + R) * D + kept_scores(c) * L * H * T + 3 * H * T + 2 * V),
            .keys = "model.vocab_size, model.context, model.d_model, model.n_layers, model.mlp_ratio"};
  }

  /// Attention scores' elements kept per score for backward (a bool mask is a quarter of a float).
  static long double kept_scores(const GptConfig& c) {
    if (c.recompute_attention) return c.dropout > 0 ? 0.25L : 0.0L;
    return c.dropout > 0 ? 3.0L : 1.0L;
  }

  /// n_layers at the deck's d_model (every block adds the same tensors), and d_model, a multiple of
  /// n_heads, at the deck's n_layers.
  std::vector<SizeKnob> size_knobs(const ModelSection& m) const override { return {layers_knob(m), width_knob(m, m.n_heads, "n_heads")}; }

  double reuse_heap_factor() const override { return kReuseHeapFactorGpt; }

  /// GPT2LMHeadModel: GPT-2's names and Conv1D layouts (gpt2_names.hpp).
  std::optional<HfForm> hf_form(const ModelSection& m) const override {
    const GptConfig c = gpt_config(m);
    return HfForm{hf_gpt2_config(c), hf_gpt2_naming(c)};
  }

  void cross_check(const Deck& deck, std::vector<std::string>& problems) const override {
    const std::int64_t d = deck.get_int("model.d_model"), h = deck.get_int("model.n_heads");
    if (d % h == 0) return;
    const Entry& heads = deck.entry("model.n_heads");
    const Entry& blamed = detail::set_explicitly(heads)                         ? heads
                          : detail::set_explicitly(deck.entry("model.d_model")) ? deck.entry("model.d_model")
                                                                                : deck.entry("model.kind");
    problems.push_back(detail::where(deck, blamed) + ": " + blamed.spec->key + ": model.n_heads = " + std::to_string(h) +
                       " does not divide model.d_model = " + std::to_string(d));
  }

 private:
  /// Transformer block `i` on the residual stream `x`; returns the stream after the block.
  static int trace_block(TraceBuilder& b, const GptConfig& c, std::int64_t i, int x, double p, std::int64_t btd, std::int64_t scores,
                         std::int64_t stats, int eb) {
    const std::int64_t R = c.mlp_ratio;
    const std::string blk = "block" + std::to_string(i);
    b.enter(blk, x);
    // Every activation gradient inside a block coexists with the residual stream's gradient.
    b.enter(blk + ".ln1", x);
    const int a1 = b.op(btd, {x}, {}, {blk + ".ln1.weight", blk + ".ln1.bias"}, 3 * btd);
    b.aux(stats);
    b.exit(blk + ".ln1");
    b.enter(blk + ".attn", a1);
    const int q3 = b.linear(blk + ".attn.qkv", a1, btd, 3 * btd, btd);
    int o = -1, y = -1;
    if (c.recompute_attention) {
      // attend (models/recomputed.hpp): the scores and probabilities live in forward only; it keeps q,
      // k and v (views of the qkv output) and, under dropout, one byte per score. Its backward computes
      // them again (with matmul's copies of q, k and v) beside their gradients.
      const int pr = b.op(scores, {}, {}, {}, 0);
      int noise = -1, dropped = -1;
      if (p > 0) {  // the noise, then the product, beside the probabilities
        noise = b.op(scores, {}, {}, {}, 0);
        dropped = b.op(scores, {}, {}, {}, 0);
      }
      o = b.op(btd, {q3}, {pr, noise, dropped}, {}, (p > 0 ? 6 : 4) * scores + 5 * btd);
      if (p > 0) b.aux(scores / eb);        // the kept positions, a bool each
      y = b.op(btd, {}, {o}, {}, 3 * btd);  // transpose(1, 2).contiguous()
    } else {
      // q @ k^T: matmul copies the transposed head views into contiguous [B*h, T, hd] operands it saves.
      const int s0 = b.op(scores, {}, {}, {}, scores + 3 * btd);
      b.aux(btd);
      b.aux(btd);
      const int s1 = b.op(scores, {}, {s0}, {}, 2 * scores + btd);        // / sqrt(hd)
      const int s2 = b.op(scores, {}, {s1}, {}, 2 * scores + btd);        // the mask added
      const int pr = b.op(scores, {}, {s2}, {}, 2 * scores + btd, true);  // softmax saves its result
      int pd = pr;
      if (p > 0) {
        pd = b.op(scores, {}, {}, {}, 2 * scores + btd);
        b.aux(scores);
      }
      o = b.op(btd, {pd}, {}, {}, scores + 3 * btd);  // att @ v (v copied and saved)
      b.aux(btd);
      y = b.op(btd, {}, {o, pd, pd == pr ? -1 : pr}, {}, 3 * btd);  // transpose(1, 2).contiguous()
    }
    int ao = b.linear(blk + ".attn.proj", y, btd, btd, btd);
    b.drop({y, q3});
    if (p > 0) {
      const int dd = b.op(btd, {}, {ao}, {}, 3 * btd);
      b.aux(btd);
      ao = dd;
    }
    b.exit(blk + ".attn");
    const int x2 = b.op(btd, {}, {ao, a1}, {}, btd);
    b.enter(blk + ".ln2", x2);
    const int a2 = b.op(btd, {x2}, {}, {blk + ".ln2.weight", blk + ".ln2.bias"}, 3 * btd);
    b.aux(stats);
    b.exit(blk + ".ln2");
    const int f = b.linear(blk + ".fc", a2, btd, R * btd, btd);
    // out = linear(gelu(f)) (GeluLinear) keeps f, not the GELU's output, and recomputes it in backward.
    b.enter(blk + ".out", f);
    const int g = b.op(R * btd, {}, {}, {}, 0);
    int h = b.op(btd, {f}, {g, f, a2}, {blk + ".out.weight", blk + ".out.bias"}, 2 * R * btd + btd);
    b.exit(blk + ".out");
    if (p > 0) {
      const int dd = b.op(btd, {}, {h}, {}, 3 * btd);
      b.aux(btd);
      h = dd;
    }
    const int x3 = b.op(btd, {}, {h, x2, x}, {}, btd);
    b.exit(blk);
    return x3;
  }
};

}  // namespace fsdp::app
