// Memory planning (app layer): one forward pass as tensors created, saved for backward and released.
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

#include "plan/run_shape.hpp"

namespace fsdp::app {

// ==== 4. One forward pass as tensors created, saved for backward and released =======================

/// One step of a forward pass. kEnter/kExit: a module called through fsdp::forward begins/ends
/// (`saves` of kEnter holds its input, what activation checkpointing keeps). kCompute: an operation creates `outs`, saves `saves` for its
/// backward, drops the forward's references in `drops`, and produces gradients of `params` in backward,
/// needing `bwd_temp` bytes of activation gradients meanwhile.
struct TraceOp {
  enum class Kind : std::uint8_t { kEnter, kExit, kCompute };
  Kind kind = Kind::kCompute;
  int module = -1;
  std::vector<int> outs, saves, drops;
  std::vector<int> params;  ///< indices into Trace::param_names
  std::int64_t bwd_temp = 0;
};

struct Trace {
  std::vector<std::int64_t> tensor_bytes;
  std::vector<TraceOp> ops;
  std::vector<std::string> param_names;  ///< canonical parameter names used by ops
};

namespace detail {
class TraceBuilder {
 public:
  TraceBuilder(const ModelDesc& d, Trace& t) : desc_(d), t_(t) {
    for (std::size_t i = 0; i < d.modules.size(); ++i) {
      module_index_[d.modules[i].path] = static_cast<int>(i);
      for (const auto& p : d.modules[i].params) canonical_[p.name] = p.tied_to.empty() ? p.name : p.tied_to;
    }
  }
  int tensor(std::int64_t bytes) {
    t_.tensor_bytes.push_back(bytes);
    return static_cast<int>(t_.tensor_bytes.size()) - 1;
  }
  void enter(const std::string& path, int input) {
    TraceOp op;
    op.kind = TraceOp::Kind::kEnter;
    op.module = module(path);
    if (input >= 0) op.saves.push_back(input);
    t_.ops.push_back(std::move(op));
  }
  void exit(const std::string& path) {
    TraceOp op;
    op.kind = TraceOp::Kind::kExit;
    op.module = module(path);
    t_.ops.push_back(std::move(op));
  }
  /// An operation with one output of `out_bytes` (none if 0): returns the output's id (or -1).
  int op(std::int64_t out_bytes, std::vector<int> saves, std::vector<int> drops, std::vector<std::string> params, std::int64_t bwd_temp,
         bool save_out = false) {
    TraceOp op;
    int out = -1;
    if (out_bytes > 0) {
      out = tensor(out_bytes);
      op.outs.push_back(out);
      if (save_out) saves.push_back(out);
    }
    op.saves = std::move(saves);
    for (int d : drops)
      if (d >= 0) op.drops.push_back(d);
    for (const auto& p : params) op.params.push_back(param_index(p));
    op.bwd_temp = bwd_temp;
    t_.ops.push_back(std::move(op));
    return out;
  }
  /// A tensor the last operation creates and saves, referenced by nothing else (a dropout mask, the
  /// copies matmul makes of non-contiguous inputs, LayerNorm's statistics).
  int aux(std::int64_t bytes) {
    const int id = tensor(bytes);
    auto& op = t_.ops.back();
    op.outs.push_back(id);
    op.saves.push_back(id);
    op.drops.push_back(id);
    return id;
  }
  /// Ends the forward's reference to `ids` (an operation with no output).
  void drop(std::vector<int> ids) { op(0, {}, std::move(ids), {}, 0); }
  /// A Linear called through fsdp::forward on `in` (saved): out_bytes of output.
  int linear(const std::string& path, int in, std::int64_t in_bytes, std::int64_t out_bytes, std::int64_t extra_bwd = 0) {
    enter(path, in);
    std::vector<std::string> ps;
    for (const auto& p : desc_.modules[static_cast<std::size_t>(module(path))].params) ps.push_back(p.name);
    const int y = op(out_bytes, {in}, {}, ps, out_bytes + in_bytes + extra_bwd);
    exit(path);
    return y;
  }

 private:
  int module(const std::string& path) const {
    const auto it = module_index_.find(path);
    if (it == module_index_.end()) throw ConfigError("plan: no module '" + path + "' in the model description", "fsdp.plan");
    return it->second;
  }
  int param_index(const std::string& name) {
    const auto it = canonical_.find(name);
    const std::string c = it == canonical_.end() ? name : it->second;
    const auto [pos, added] = param_ids_.emplace(c, static_cast<int>(t_.param_names.size()));
    if (added) t_.param_names.push_back(c);
    return pos->second;
  }
  const ModelDesc& desc_;
  Trace& t_;
  std::unordered_map<std::string, int> module_index_, param_ids_;
  std::unordered_map<std::string, std::string> canonical_;
};
}  // namespace detail

/// The MLP's layers on the (possibly cast) input `x` of `x_bytes`.
inline void trace_mlp(detail::TraceBuilder& b, const ModelShape& s, std::int64_t B, int eb, bool training, int x, std::int64_t x_bytes) {
  constexpr int input = 0;
  auto keep = [](int v, int input_id) { return v == input_id ? -1 : v; };  // the batch is the loop's, never dropped here
  const double p = training ? s.dropout.value_or(0.0) : 0.0;
  for (std::size_t i = 0; i < s.hidden_sizes.size(); ++i) {
    const std::int64_t h = s.hidden_sizes[i], hb = B * h * eb;
    const int y = b.linear("fc" + std::to_string(i + 1), x, x_bytes, hb);
    int r = b.op(hb, {}, {y, keep(x, input)}, {}, 2 * hb, /*save_out=*/true);  // relu saves its result
    if (p > 0) {
      const int dd = b.op(hb, {}, {r}, {}, 2 * hb);
      b.aux(hb);  // the dropout mask (a float tensor) saved by the multiplication
      r = dd;
    }
    x = r;
    x_bytes = hb;
  }
  const int y = b.linear("out", x, x_bytes, B * 10 * eb);
  const int ls = b.op(B * 10 * eb, {}, {y, keep(x, input)}, {}, 2 * B * 10 * eb, true);  // log_softmax
  int lo = ls;
  if (eb != 4) lo = b.op(B * 10 * 4, {}, {}, {}, B * 10 * 4);   // loss_of casts the output to fp32
  b.op(8, {lo}, {ls, lo == ls ? -1 : lo}, {}, 2 * B * 10 * 4);  // nll_loss
}

/// The tutorial CNN on the (possibly cast) input `x` of `x_bytes`.
inline void trace_cnn(detail::TraceBuilder& b, const ModelShape& s, std::int64_t B, int eb, bool training, int x, std::int64_t x_bytes) {
  constexpr int input = 0;
  auto keep = [](int v, int input_id) { return v == input_id ? -1 : v; };  // the batch is the loop's, never dropped here
  // The tutorial CNN: conv 1->32 3x3, relu, conv 32->64 3x3, relu, max-pool 2, dropout, fc 9216->128,
  // relu, dropout, fc 128->10, log-softmax.
  const double p1 = training ? s.dropout.value_or(0.25) : 0.0, p2 = training ? s.dropout.value_or(0.5) : 0.0;
  const std::int64_t c1 = B * 32 * 26 * 26 * eb, c2 = B * 64 * 24 * 24 * eb, pool = B * 9216 * eb;
  int y = b.linear("conv1", x, x_bytes, c1);
  int r = b.op(c1, {}, {y, keep(x, input)}, {}, 2 * c1, true);
  y = b.linear("conv2", r, c1, c2);
  int r2 = b.op(c2, {}, {y}, {}, 2 * c2, true);
  b.drop({r});
  int mp = b.op(pool, {r2}, {r2}, {}, pool + c2);  // max_pool2d saves its input and the indices
  b.aux(B * 9216 * 8);
  b.enter("dropout1", mp);
  if (p1 > 0) {
    const int dd = b.op(pool, {}, {mp}, {}, 2 * pool);
    b.aux(pool);
    mp = dd;
  }
  b.exit("dropout1");
  y = b.linear("fc1", mp, pool, B * 128 * eb);
  r = b.op(B * 128 * eb, {}, {y, mp}, {}, 2 * B * 128 * eb, true);
  b.enter("dropout2", r);
  if (p2 > 0) {
    const int dd = b.op(B * 128 * eb, {}, {r}, {}, 2 * B * 128 * eb);
    b.aux(B * 128 * eb);
    r = dd;
  }
  b.exit("dropout2");
  y = b.linear("fc2", r, B * 128 * eb, B * 10 * eb);
  const int ls = b.op(B * 10 * eb, {}, {y, r}, {}, 2 * B * 10 * eb, true);
  int lo = ls;
  if (eb != 4) lo = b.op(B * 10 * 4, {}, {}, {}, B * 10 * 4);
  b.op(8, {lo}, {ls, lo == ls ? -1 : lo}, {}, 2 * B * 10 * 4);
}

/// Transformer block `i` on the residual stream `x`; returns the stream after the block.
inline int trace_gpt_block(detail::TraceBuilder& b, const GptConfig& c, std::int64_t i, int x, double p, std::int64_t btd, std::int64_t scores,
                           std::int64_t stats) {
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
  // q @ k^T: matmul copies the transposed head views into contiguous [B*h, T, hd] operands it saves.
  const int s0 = b.op(scores, {}, {}, {}, scores + 3 * btd);
  b.aux(btd);
  b.aux(btd);
  const int s1 = b.op(scores, {}, {s0}, {}, 2 * scores + btd);  // / sqrt(hd)
  const int s2 = b.op(scores, {}, {s1}, {}, 2 * scores + btd);  // masked_fill
  int pr = b.op(scores, {}, {s2}, {}, 2 * scores + btd, true);  // softmax saves its result
  int pd = pr;
  if (p > 0) {
    pd = b.op(scores, {}, {}, {}, 2 * scores + btd);
    b.aux(scores);
  }
  const int o = b.op(btd, {pd}, {}, {}, scores + 3 * btd);  // att @ v (v copied and saved)
  b.aux(btd);
  const int y = b.op(btd, {}, {o, pd, pd == pr ? -1 : pr}, {}, 3 * btd);  // transpose(1, 2).contiguous()
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
  const int g = b.op(R * btd, {f}, {f, a2}, {}, 2 * R * btd + btd);  // gelu saves its input
  int h = b.linear(blk + ".out", g, R * btd, btd, btd);
  b.drop({g});
  if (p > 0) {
    const int dd = b.op(btd, {}, {h}, {}, 3 * btd);
    b.aux(btd);
    h = dd;
  }
  const int x3 = b.op(btd, {}, {h, x2, x}, {}, btd);
  b.exit(blk);
  return x3;
}

/// The GPT: token + position embeddings, n_layers pre-norm blocks, final LayerNorm, LM head, loss.
inline void trace_gpt(detail::TraceBuilder& b, const ModelShape& s, std::int64_t B, int eb, bool training) {
  constexpr int input = 0;
  const auto& c = s.gpt;
  const double p = training ? c.dropout : 0.0;
  const std::int64_t T = c.context, D = c.d_model, H = c.n_heads, V = c.padded_vocab();
  const std::int64_t btd = B * T * D * eb, scores = B * H * T * T * eb, stats = 2 * B * T * 4, logits = B * T * V * eb;
  b.enter("tok", input);
  const int e = b.op(btd, {}, {}, {"tok.weight"}, btd);
  b.exit("tok");
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
  for (std::int64_t i = 0; i < c.n_layers; ++i) x = trace_gpt_block(b, c, i, x, p, btd, scores, stats);
  b.enter("ln_f", x);
  const int lf = b.op(btd, {x}, {x}, {"ln_f.weight", "ln_f.bias"}, 2 * btd);
  b.aux(stats);
  b.exit("ln_f");
  b.enter("head", lf);
  const int lg = b.op(logits, {lf}, {lf}, {"head.weight"}, logits + btd);
  b.exit("head");
  // loss_of: fp32 logits, log_softmax (saves its result), nll_loss.
  int l32 = lg;
  if (eb != 4) l32 = b.op(B * T * V * 4, {}, {}, {}, logits);
  const int ls = b.op(B * T * V * 4, {}, {}, {}, 2 * B * T * V * 4, true);
  b.op(8, {ls}, {ls, lg, l32 == lg ? -1 : l32}, {}, B * T * V * 4);
}

/// The forward pass of the deck's model on a batch of `batch` samples whose activations take `eb` bytes
/// per element, in training mode (dropout on) or evaluation (dropout off). Tensor 0 stands for the
/// batch, which the training loop holds (and the simulator counts as data); the model's output is
/// dropped by the loss, whose saved tensors close the trace.
/// Saved per transformer block (B batch, T context, d d_model, r mlp_ratio, h heads, dropout p > 0):
/// (10 + 2r)·B·T·d + 3·B·h·T² elements plus LayerNorm statistics; with p = 0: (8 + 2r)·B·T·d + B·h·T².
inline Trace trace_forward(const ModelShape& s, const ModelDesc& d, std::int64_t batch, int eb, bool training, bool cast_input) {
  Trace t;
  detail::TraceBuilder b(d, t);
  constexpr int input = 0;
  t.tensor_bytes.push_back(0);
  const std::int64_t B = batch;
  if (s.kind == ModelKind::kMlp || s.kind == ModelKind::kCnn) {
    int x = input;
    std::int64_t x_bytes = B * 784 * 4;
    if (cast_input) {  // root forward: floating-point arguments cast to param_dtype
      x = b.op(B * 784 * eb, {}, {}, {}, 0);
      x_bytes = B * 784 * eb;
    }
    if (s.kind == ModelKind::kMlp)
      trace_mlp(b, s, B, eb, training, x, x_bytes);
    else
      trace_cnn(b, s, B, eb, training, x, x_bytes);
    return t;
  }
  trace_gpt(b, s, B, eb, training);
  return t;
}

}  // namespace fsdp::app
