// Memory planning (app layer, std only): one forward pass as tensors created, saved for backward and
// released (Trace), and the builder each model family's trace uses.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fsdp/errors.hpp"
#include "plan/model_desc.hpp"

namespace fsdp::app {

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
  int releases_weight_of = -1;      ///< fsdp::linear_releasing_weight: this module's unit frees its gathered weight before the op's weight gradient
  bool no_backward_gather = false;  ///< kExit: fsdp::backward_reads_no_parameter, the unit is not gathered for backward
};

struct Trace {
  std::vector<std::int64_t> tensor_bytes;
  std::vector<TraceOp> ops;
  std::vector<std::string> param_names;  ///< canonical parameter names used by ops
};

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
  void enter(const std::string& path, int input) { enter(path, std::vector<int>{input}); }
  /// A module called with several tensors (activation checkpointing keeps them all).
  void enter(const std::string& path, const std::vector<int>& inputs) {
    TraceOp op;
    op.kind = TraceOp::Kind::kEnter;
    op.module = module(path);
    for (int input : inputs)
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
  /// fsdp::backward_reads_no_parameter after the module just exited (the last operation is its exit).
  void backward_reads_no_parameter() { t_.ops.back().no_backward_gather = true; }
  /// The last operation is fsdp::linear_releasing_weight in module `path`'s forward.
  void releases_weight(const std::string& path) { t_.ops.back().releases_weight_of = module(path); }
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

}  // namespace fsdp::app
