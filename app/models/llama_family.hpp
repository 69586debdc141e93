// The Llama family, model.kind = "llama" (app layer, std only): what the planner and the app know of
// app/models/llama.hpp's decoder (Llama 2/3, Qwen2 with model.attention_bias, Mistral without a
// sliding window, SmolLM2, TinyLlama).
#pragma once

#include <string>
#include <vector>

#include "models/family.hpp"
#include "models/llama_config.hpp"
#include "models/llama_hf.hpp"

namespace fsdp::app {

class LlamaFamily final : public ModelFamily {
 public:
  ModelKind kind() const override { return ModelKind::kLlama; }
  bool language_model() const override { return true; }

  /// Each decoder layer is a unit; an untied embedding and head are units of their own (tied, they
  /// share one tensor and stay in the root unit).
  std::vector<std::string> layer_classes(const ModelSection& m) const override {
    if (!m.tie_embeddings) return {"LlamaDecoderLayer", "Embedding", "LmHead"};
    return {"LlamaDecoderLayer"};
  }

  ModelDesc describe(const ModelSection& m) const override {
    const LlamaConfig c = LlamaConfig::of(m);
    ModelDesc d;
    d.kind = kind();
    const int root = d.add(-1, "", "Llama", "Llama");
    const int model = d.add(root, "model", "LlamaModel", "LlamaModel");
    const int embed = d.add(model, "embed_tokens", "Embedding", "torch::nn::Embedding");
    d.param(embed, "weight", {c.vocab_size, c.d_model});
    const int layers = d.add(model, "layers", "LlamaLayers", "LlamaLayers");
    for (std::int64_t i = 0; i < c.n_layers; ++i) {
      const int layer = d.add(layers, std::to_string(i), "LlamaDecoderLayer", "LlamaDecoderLayer");
      rms_norm(d, layer, "input_layernorm", c.d_model);
      const int attn = d.add(layer, "self_attn", "LlamaAttention", "LlamaAttention");
      detail::describe_linear(d, attn, "q_proj", c.d_model, c.q_width(), c.attention_bias);
      detail::describe_linear(d, attn, "k_proj", c.d_model, c.kv_width(), c.attention_bias);
      detail::describe_linear(d, attn, "v_proj", c.d_model, c.kv_width(), c.attention_bias);
      detail::describe_linear(d, attn, "o_proj", c.q_width(), c.d_model, false);
      rms_norm(d, layer, "post_attention_layernorm", c.d_model);
      const int mlp = d.add(layer, "mlp", "LlamaMlp", "LlamaMlp");
      detail::describe_linear(d, mlp, "gate_proj", c.d_model, c.intermediate_size, false);
      detail::describe_linear(d, mlp, "up_proj", c.d_model, c.intermediate_size, false);
      const int down = d.add(mlp, "down_proj", "SwiGluLinear", "fsdp::app::SwiGluLinear");  // a Linear of silu(gate) * up
      d.param(down, "weight", {c.d_model, c.intermediate_size});
    }
    rms_norm(d, model, "norm", c.d_model);
    const int head = d.add(root, "lm_head", "LmHead", "LmHead");
    d.param(head, "weight", {c.vocab_size, c.d_model}, c.tie_embeddings ? "model.embed_tokens.weight" : "");
    return d;
  }

  std::int64_t num_params(const ModelSection& m) const override { return LlamaConfig::of(m).num_params(); }

  /// One layer saves (B batch, T context, D d_model, q = heads x head_dim, kv = kv heads x head_dim,
  /// I intermediate, h heads): its input, both norms' fp32 statistics and outputs, q, k and v before
  /// and after the rotation, the repeated k and v, the attention output (with
  /// model.recompute_attention = false also the scores and their fp32 softmax), and the MLP's gate
  /// and up (models/recomputed.hpp: the silu and the product are recomputed in backward).
  void trace(TraceBuilder& b, const ModelSection& m, std::int64_t batch, int eb, bool /*training: no dropout*/,
             bool /*cast_input: token ids*/) const override {
    constexpr int input = 0;
    const LlamaConfig c = LlamaConfig::of(m);
    const std::int64_t B = batch, T = c.context, D = c.d_model, V = c.vocab_size, bt = B * T;
    const Sizes s{.btd = bt * D * eb,
                  .q = bt * c.q_width() * eb,
                  .kv = bt * c.kv_width() * eb,
                  .scores = B * c.n_heads * T * T * eb,
                  .scores32 = B * c.n_heads * T * T * 4,
                  .mlp = bt * c.intermediate_size * eb,
                  .stats = bt * 4,
                  .cast = eb == 4 ? 0 : bt * D * 4};
    b.enter("model", input);
    b.enter("model.embed_tokens", input);
    int x = b.op(s.btd, {}, {}, {"model.embed_tokens.weight"}, s.btd);
    b.exit("model.embed_tokens");
    if (!c.tie_embeddings) b.backward_reads_no_parameter();  // lookup_tokens
    b.enter("model.layers", x);
    for (std::int64_t i = 0; i < c.n_layers; ++i) x = trace_layer(b, c, "model.layers." + std::to_string(i), x, s);
    b.exit("model.layers");
    x = trace_norm(b, "model.norm", x, s, /*drop_input=*/true);
    b.exit("model");
    const std::int64_t logits = bt * V * eb;
    b.enter("lm_head", x);
    const int lg = b.op(logits, {x}, {x}, {"lm_head.weight"}, logits + s.btd);
    b.releases_weight("lm_head");  // LmHead
    b.exit("lm_head");
    int l32 = lg;  // loss_of: fp32 logits, log_softmax (saves its result), nll_loss (train/cross_entropy.hpp)
    if (eb != 4) l32 = b.op(bt * V * 4, {}, {}, {}, logits + bt * V * 4);  // backward: the fp32 gradient and its cast
    const int ls = b.op(bt * V * 4, {}, {}, {}, 0, true);                  // token_cross_entropy: the logits' gradient takes this buffer
    b.op(8, {ls}, {ls, lg, l32 == lg ? -1 : l32}, {}, 0);
  }

  std::int64_t input_bytes(const ModelSection& m, std::int64_t batch) const override { return batch * m.context * 8; }  // token ids (int64)
  std::int64_t target_bytes(const ModelSection& m, std::int64_t batch) const override { return batch * m.context * 8; }
  std::int64_t predictions_per_sample(const ModelSection& m) const override { return m.context; }
  std::int64_t eval_chunk(const ModelSection& m, std::int64_t batch) const override { return LlamaConfig::of(m).eval_chunk(batch); }
  double flops_per_token(const ModelSection& m, std::int64_t num_params) const override { return LlamaConfig::of(m).flops_per_token(num_params); }

  SizeEstimate size_estimate(const ModelSection& m, long double batch) const override {
    const LlamaConfig c = LlamaConfig::of(m);
    const auto ld = [](std::int64_t v) { return static_cast<long double>(v); };
    const long double V = ld(c.vocab_size), T = ld(c.context), D = ld(c.d_model), L = ld(c.n_layers), Q = ld(c.q_width()), KV = ld(c.kv_width()),
                      I = ld(c.intermediate_size), H = ld(c.n_heads);
    return {.params = V * D * (c.tie_embeddings ? 1 : 2) + L * (2 * D * Q + 2 * D * KV + 3 * D * I + 2 * D) + D,
            // The scores of one layer exist in forward whether or not backward keeps them.
            .activations = batch * T * (L * (6 * D + 6 * Q + 2 * KV + 2 * I + (c.recompute_attention ? 0 : 3) * H * T) + 3 * H * T + 2 * V),
            .keys = "model.vocab_size, model.context, model.d_model, model.n_layers, model.n_heads, model.head_dim, model.intermediate_size"};
  }

  /// n_layers at the deck's widths, and d_model (where head_dim follows it, a multiple of 2 n_heads:
  /// rotary positions rotate pairs) at the deck's depth, the MLP following it where
  /// model.intermediate_size is not set.
  std::vector<SizeKnob> size_knobs(const ModelSection& m) const override {
    return {layers_knob(m), width_knob(m, m.head_dim > 0 ? 1 : 2 * m.n_heads, "2 n_heads")};
  }

  double reuse_heap_factor() const override { return kReuseHeapFactorLlama; }

  /// LlamaForCausalLM, or Qwen2ForCausalLM with q/k/v biases; the modules carry their names.
  std::optional<HfForm> hf_form(const ModelSection& m) const override { return HfForm{hf_llama_config(LlamaConfig::of(m)), std::nullopt}; }

  void cross_check(const Deck& deck, std::vector<std::string>& problems) const override {
    const std::int64_t d = deck.get_int("model.d_model"), h = deck.get_int("model.n_heads"), kv = deck.get_int("model.n_kv_heads");
    const std::int64_t hd = deck.get_int("model.head_dim");
    auto blame = [&](const char* key, const std::string& what) {
      const Entry& e = detail::set_explicitly(deck.entry(key)) ? deck.entry(key) : deck.entry("model.kind");
      problems.push_back(detail::where(deck, e) + ": " + key + ": " + what);
    };
    if (hd == 0 && d % h != 0)
      blame("model.n_heads",
            "model.n_heads = " + std::to_string(h) + " does not divide model.d_model = " + std::to_string(d) + " (or set model.head_dim)");
    if (hd == 0 && d % h == 0 && (d / h) % 2 != 0)
      blame("model.n_heads", "the head width model.d_model / model.n_heads = " + std::to_string(d / h) + " is odd: rotary positions rotate pairs");
    if (hd % 2 != 0) blame("model.head_dim", std::to_string(hd) + " is odd: rotary positions rotate pairs");
    if (kv > 0 && h % kv != 0)
      blame("model.n_kv_heads", "model.n_kv_heads = " + std::to_string(kv) + " does not divide model.n_heads = " + std::to_string(h));
    if (deck.is_set("model.dropout") && deck.get_float("model.dropout") > 0)
      blame("model.dropout", "a llama has no dropout (Hugging Face's attention_dropout 0): leave model.dropout unset or 0");
    if (const auto positions = deck.get_int("model.max_positions"); positions > 0 && deck.get_int("model.context") > positions) {
      const Entry& c = deck.entry("model.context");
      problems.push_back(detail::where(deck, c) + ": model.context: " + std::to_string(deck.get_int("model.context")) +
                         " is beyond model.max_positions = " + std::to_string(positions) + " (" +
                         detail::where(deck, deck.entry("model.max_positions")) + "): the model was not made for sequences this long");
    }
    if (const auto window = deck.get_int("model.sliding_window"); window > 0 && deck.get_int("model.context") > window)
      problems.push_back(detail::where(deck, deck.entry("model.context")) + ": model.context: " + std::to_string(deck.get_int("model.context")) +
                         " is beyond model.sliding_window = " + std::to_string(window) + " (" +
                         detail::where(deck, deck.entry("model.sliding_window")) +
                         "), which is not supported (up to it, windowed attention is exactly full attention)");
    if (deck.get_string("model.rope_scaling") == "llama3" &&
        deck.get_float("model.rope_high_freq_factor") <= deck.get_float("model.rope_low_freq_factor"))
      blame("model.rope_high_freq_factor",
            "must be above model.rope_low_freq_factor (" + format_value(deck.entry("model.rope_low_freq_factor").value) + ")");
    if (deck.get_int("model.vocab_pad_multiple") != 1)
      blame("model.vocab_pad_multiple", "a llama's embedding has exactly model.vocab_size rows, as Hugging Face's: leave it at 1");
  }

 private:
  struct Sizes {
    std::int64_t btd, q, kv, scores, scores32, mlp, stats, cast;
  };
  static void rms_norm(ModelDesc& d, int parent, const std::string& key, std::int64_t width) {
    const int m = d.add(parent, key, "RMSNorm", "RMSNorm");
    d.param(m, "weight", {width});
  }
  /// An RMSNorm on `x` (saved): its fp32 copy (mixed precision), the statistics and the normalized
  /// values are saved; returns its output.
  static int trace_norm(TraceBuilder& b, const std::string& path, int x, const Sizes& s, bool drop_input = false) {
    b.enter(path, x);
    const int y = b.op(s.btd, {x}, {drop_input ? x : -1}, {path + ".weight"}, 3 * s.btd + s.cast);
    b.aux(s.stats);
    b.aux(s.btd);
    if (s.cast > 0) b.aux(s.cast);
    b.exit(path);
    return y;
  }
  static int trace_layer(TraceBuilder& b, const LlamaConfig& c, const std::string& p, int x, const Sizes& s) {
    b.enter(p, x);
    const int a = trace_norm(b, p + ".input_layernorm", x, s);
    const std::string at = p + ".self_attn";
    b.enter(at, a);
    const int q = b.linear(at + ".q_proj", a, s.btd, s.q);
    const int k = b.linear(at + ".k_proj", a, s.btd, s.kv);
    const int v = b.linear(at + ".v_proj", a, s.btd, s.kv);
    const int qr = b.op(s.q, {}, {q}, {}, 3 * s.q);  // q cos + rotate_half(q) sin
    const int kr = b.op(s.kv, {}, {k}, {}, 3 * s.kv);
    const bool grouped = c.n_kv_heads != c.n_heads;
    const int kx = grouped ? b.op(s.q, {}, {kr}, {}, s.q + s.kv) : kr;  // repeat_interleave
    const int vx = grouped ? b.op(s.q, {}, {v}, {}, s.q + s.kv) : v;
    int o = -1;
    if (c.recompute_attention) {
      // attend (models/recomputed.hpp): the scores, their fp32 softmax and its cast live in forward
      // only; it keeps q, k and v, and its backward computes them again (with matmul's copies of q and
      // k) beside their gradients.
      const int sc = b.op(s.scores, {}, {}, {}, 0);
      const int sm = b.op(s.scores32, {}, {sc}, {}, 0);
      const int pr = s.scores32 == s.scores ? sm : b.op(s.scores, {}, {sm}, {}, 0);
      o = b.op(s.q, {qr, kx, vx}, {pr, qr, kx, vx}, {}, 2 * s.scores + 2 * s.scores32 + 5 * s.q);
    } else {
      const int sc = b.op(s.scores, {qr, kx}, {qr, kx}, {}, s.scores + 2 * s.q);         // q k^T, scaled, masked
      const int sm = b.op(s.scores32, {}, {sc}, {}, 2 * s.scores32, /*save_out=*/true);  // fp32 softmax saves its result
      const int pr = s.scores32 == s.scores ? sm : b.op(s.scores, {}, {}, {}, s.scores + s.scores32);
      o = b.op(s.q, {pr, vx}, {pr, sm == pr ? -1 : sm, vx}, {}, s.scores + 2 * s.q);  // att v
    }
    const int y = b.op(s.q, {}, {o}, {}, 2 * s.q);  // transpose(1, 2).reshape
    const int ao = b.linear(at + ".o_proj", y, s.q, s.btd);
    b.drop({y, a});
    b.exit(at);
    const int h = b.op(s.btd, {}, {ao}, {}, s.btd);  // residual
    const int n = trace_norm(b, p + ".post_attention_layernorm", h, s);
    const std::string mp = p + ".mlp";
    b.enter(mp, n);
    const int g = b.linear(mp + ".gate_proj", n, s.btd, s.mlp);
    const int u = b.linear(mp + ".up_proj", n, s.btd, s.mlp);
    // down = linear(silu(g) * u) (SwiGluLinear) keeps g and u; in backward it computes silu(g) and the
    // product again, beside the product's gradient and the gate's and up's.
    b.enter(mp + ".down_proj", {g, u});
    const int pu = b.op(s.mlp, {}, {}, {}, 0);  // silu(g), multiplied by u in place
    const int dn = b.op(s.btd, {g, u}, {pu, g, u}, {mp + ".down_proj.weight"}, 4 * s.mlp + s.btd);
    b.exit(mp + ".down_proj");
    b.drop({n});
    b.exit(mp);
    const int out = b.op(s.btd, {}, {dn, h, x}, {}, s.btd);  // residual
    b.exit(p);
    return out;
  }
};

}  // namespace fsdp::app
