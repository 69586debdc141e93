// Memory planning (app layer): one training step replayed as allocations and frees (RunSimulator);
// its high-water mark is the prediction (predict).
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

#include "fsdp/comm/detail/reduce.hpp"
#include "plan/lean_backward_units.hpp"
#include "plan/memory_model.hpp"

namespace fsdp::app {

namespace detail {

/// Elements of unit `u` that one rank's optimizer updates: its shard, or with the optimizer sharded over
/// the world its replica part (the engine's split, core/layout.hpp).
inline std::int64_t optimized_elements(const RunShape& run, const PlanUnit& u) {
  return run.optimizer_over_world ? replica_part_range(u.shard, run.replicas, 0).numel() : u.shard;
}

/// Replays data loading, model construction, two training steps and one evaluation batch.
class RunSimulator {
 public:
  RunSimulator(const ModelSection& model, const ModelDesc& desc, const std::vector<PlanUnit>& units, const RunShape& run)
      : model_(model),
        family_(model_family(model.kind)),
        desc_(desc),
        units_(units),
        run_(run),
        mem_(run.heap_factor, run.mmap_threshold_bytes, run.activation_heap_factor) {
    module_unit_.assign(desc.modules.size(), -1);
    for (const auto& u : units) module_unit_[static_cast<std::size_t>(u.module)] = u.index;
    for (const auto& u : units)
      for (std::size_t i = 0; i < u.params.size(); ++i) {
        param_unit_[u.params[i]] = u.index;
        param_numel_[u.params[i]] = u.numels[i];
      }
    const std::size_t n = units.size();
    full_.assign(n, -1);
    kept_.assign(n, -1);
    shard_.assign(n, -1);
    grad_.assign(n, -1);
    state_.assign(n, {});
    unsynced_.assign(n, -1);
    pending_.assign(n, {});
  }

  std::int64_t optimized_elements(const PlanUnit& u) const { return detail::optimized_elements(run_, u); }

  Prediction run() {
    load_data();
    construct();
    mem_.phase("training step");
    if (state_created_ahead()) create_optimizer_state();
    const std::int64_t micro = std::min<std::int64_t>(run_.grad_accum, 2);
    for (int step = 0; step < 2; ++step) {
      for (std::int64_t a = 0; a < micro; ++a) micro_batch(a + 1 < micro && !run_.reduce_every_micro_batch);
      optimizer_step(step == 0);
      if (step == 0 && run_.async_checkpoint) stage_checkpoint();
    }
    if (run_.evaluate) {
      mem_.phase("evaluation");
      evaluate();
    }
    Prediction p;
    p.model_bytes = mem_.peak();
    p.at_peak = mem_.at_peak();
    p.retained_at_peak = mem_.retained_at_peak();
    p.mapped_at_peak = mem_.mapped_at_peak();
    p.heap_at_peak = mem_.heap_at_peak();
    p.live_peak = mem_.live_peak();
    p.max_by_kind = mem_.max_by_kind();
    p.peak_phase = mem_.peak_phase();
    p.construction_peak = mem_.phase_peak("construction");
    p.step_peak = mem_.phase_peak("training step");
    p.eval_peak = mem_.phase_peak("evaluation");
    return p;
  }

 private:
  bool needs_gather(const PlanUnit& u) const { return u.numel > 0 && (run_.group > 1 || run_.param_bytes != 4); }

  /// After the first step the asynchronous checkpointer allocates its host copies of the shards, the
  /// optimizer state and the buffers (CheckpointSnapshot), and keeps them for every save.
  void stage_checkpoint() {
    std::int64_t elements = 0;
    for (const auto& u : units_) elements += u.shard;
    std::int64_t bytes = elements * (4 + run_.state_element_bytes * run_.optimizer_copies);
    for (const auto& m : desc_.modules) bytes += m.buffer_numel * 4;
    mem_.alloc(Mem::kStaging, bytes * run_.async_copies);
  }

  void load_data() {
    mem_.phase("data");
    int peak = mem_.alloc(Mem::kData, run_.data.load_peak_bytes);
    data_ = mem_.alloc(Mem::kData, run_.data.resident_bytes);
    mem_.free(peak);
    // The sampler's per-epoch permutation of the whole train split, then this rank's indices.
    int perm = mem_.alloc(Mem::kData, run_.data.train_samples * 8);
    indices_ = mem_.alloc(Mem::kData, (run_.data.train_samples + run_.world - 1) / run_.world * 8);
    mem_.free(perm);
  }

  void construct() {
    mem_.phase("construction");
    // build_model: every distinct parameter tensor and the buffers (with fsdp.deferred_init the layers
    // release their storage as they are built, and each unit's parameters exist only while it is flattened).
    std::map<std::string, int> original;
    std::map<std::string, std::int64_t> numel;
    for (const auto& m : desc_.modules) {
      for (const auto& p : m.params)
        if (p.tied_to.empty()) {
          numel[p.name] = p.numel();
          if (!run_.deferred_init) original[p.name] = mem_.alloc(Mem::kBuild, p.numel() * 4);
        }
      if (m.buffer_numel > 0) buffers_.push_back(mem_.alloc(Mem::kBuffers, m.buffer_numel * (run_.param_bytes == 4 ? 4 : 2)));
    }
    // build_units, unit by unit: the padded flat copy, the shard, views of it, the originals freed.
    for (const auto& u : units_) {
      if (u.numel == 0) continue;
      if (run_.deferred_init)
        for (const auto& name : u.params) original[name] = mem_.alloc(Mem::kBuild, numel[name] * 4);
      int full = mem_.alloc(Mem::kBuild, u.padded * 4);
      if (run_.group == 1) {
        mem_.relabel(full, Mem::kShards);
        shard_[static_cast<std::size_t>(u.index)] = full;
        full = -1;
      } else {
        shard_[static_cast<std::size_t>(u.index)] = mem_.alloc(Mem::kShards, u.shard * 4);
      }
      int low = run_.param_bytes != 4 ? mem_.alloc(Mem::kGathered, u.padded * run_.param_bytes) : -1;
      for (const auto& name : u.params) mem_.free(original[name]);
      mem_.free(low);   // reshard
      mem_.free(full);  // reshard (G > 1) or the end of the iteration (the fp32 copy under mixed precision)
    }
  }

  int unit_of_module(int module) const { return module_unit_[static_cast<std::size_t>(module)]; }

  void gather(int ui) {
    if (ui < 0) return;
    const auto& u = units_[static_cast<std::size_t>(ui)];
    if (!needs_gather(u) || full_[static_cast<std::size_t>(ui)] >= 0) return;
    full_[static_cast<std::size_t>(ui)] = mem_.alloc(Mem::kGathered, u.padded * run_.param_bytes);
    mem_.free(kept_[static_cast<std::size_t>(ui)]);  // gathered from the slice kept after forward, which goes
  }
  // Prefetching (fsdp.forward_prefetch, fsdp.backward_prefetch): the all-gather of the unit that runs
  // next is issued early, so it is gathered alongside the running one (one unit ahead: the engine
  // prefetches a single neighbour per unit, and fsdp.limit_all_gathers >= 1 bounds what is in flight).
  void prefetch_after(int ui, int direction) {
    if (run_.group == 1) return;  // nothing is all-gathered: the engine does not prefetch
    const int at = order_pos_[static_cast<std::size_t>(ui)];
    if (at < 0) {
      if (ui == 0 && direction < 0 && !order_.empty() && lean_.gathers_for_backward(order_.back())) gather(order_.back());
      return;
    }
    const int pos = at + direction;
    if (pos < 0 || pos >= static_cast<int>(order_.size())) return;
    const int next = order_[static_cast<std::size_t>(pos)];
    if (direction < 0 && !lean_.gathers_for_backward(next)) return;  // the engine does not prefetch it for backward
    gather(next);
  }
  void reshard(int ui) { mem_.free(full_[static_cast<std::size_t>(ui)]); }
  // A training forward's end with fsdp.reshard_after_forward = N: the rank keeps 1/N of the unit.
  void reshard_after_forward(int ui) {
    const auto& u = units_[static_cast<std::size_t>(ui)];
    if (run_.reshard_after_forward_group > 1 && run_.group > 1 && full_[static_cast<std::size_t>(ui)] >= 0 &&
        lean_.gathers_for_backward(ui))  // no gather for backward: nothing kept for one
      kept_[static_cast<std::size_t>(ui)] = mem_.alloc(Mem::kGathered, u.padded / run_.reshard_after_forward_group * run_.param_bytes);
    reshard(ui);
  }

  // ---- tensors of the trace ----
  void make(const Trace& t, int id) {
    if (handle_[static_cast<std::size_t>(id)] >= 0 || t.tensor_bytes[static_cast<std::size_t>(id)] <= 0) return;
    handle_[static_cast<std::size_t>(id)] = mem_.alloc(Mem::kActivations, t.tensor_bytes[static_cast<std::size_t>(id)]);
    refs_[static_cast<std::size_t>(id)] = 1;
  }
  void unref(int id) {
    auto& r = refs_[static_cast<std::size_t>(id)];
    if (r <= 0) return;
    if (--r == 0) mem_.free(handle_[static_cast<std::size_t>(id)]);
  }
  void ref(int id) {
    if (handle_[static_cast<std::size_t>(id)] >= 0) ++refs_[static_cast<std::size_t>(id)];
  }

  // Forward of ops [begin, end), saving for backward when `grad`. `recompute`: the forward of a
  // checkpointed unit run again in backward; only tensors it creates (listed in `created`) take part.
  void forward_ops(const Trace& t, std::size_t begin, std::size_t end, bool grad, bool recompute, std::vector<int>* created) {
    for (std::size_t i = begin; i < end; ++i) {
      const auto& op = t.ops[i];
      if (op.kind == TraceOp::Kind::kEnter || op.kind == TraceOp::Kind::kExit) {
        const int ui = unit_of_module(op.module);
        if (ui <= 0 || recompute) continue;
        if (op.kind == TraceOp::Kind::kEnter) {
          gather(ui);
          if (grad && run_.forward_prefetch) prefetch_after(ui, +1);
          if (grad && run_.activation_checkpointing && ckpt_unit_ < 0) {
            ckpt_unit_ = ui;  // a checkpointed unit: its forward keeps only its input
            ckpt_begin_ = i;
            for (int s : op.saves) ref(s);
            ckpt_input_ = op.saves;
          }
        } else {
          if (ckpt_unit_ == ui) {
            ckpt_regions_.push_back({ckpt_begin_, i, ckpt_input_});
            ckpt_unit_ = -1;
          }
          if (!grad)
            reshard(ui);
          else if (run_.reshard_after_forward)
            reshard_after_forward(ui);
        }
        continue;
      }
      const bool saving = grad && ckpt_unit_ < 0;
      for (int o : op.outs) {
        const bool was_live = handle_[static_cast<std::size_t>(o)] >= 0;
        make(t, o);
        if (created && !was_live) created->push_back(o);
      }
      if (saving || recompute)
        for (int s : op.saves)
          if (!recompute || std::find(created->begin(), created->end(), s) != created->end()) ref(s);
      for (int d : op.drops)
        if (!recompute || std::find(created->begin(), created->end(), d) != created->end()) unref(d);
    }
  }

  // The trace's parameters by index: their unit and size, and the gradient autograd holds for them.
  void index_params(const Trace& t) {
    const std::size_t n = t.param_names.size();
    tparam_unit_.resize(n);
    tparam_numel_.resize(n);
    pending_handle_.assign(n, -1);
    for (std::size_t i = 0; i < n; ++i) {
      tparam_unit_[i] = param_unit_.at(t.param_names[i]);
      tparam_numel_[i] = param_numel_.at(t.param_names[i]);
    }
    for (auto& l : pending_) l.clear();
  }

  // An op's backward: its parameters' gradients join their unit's pending ones (a tied weight's second
  // gradient is added into the first), its activation gradients come and go, its saved tensors go.
  void backward_op(const TraceOp& op) {
    int temp = -1;
    if (op.releases_weight_of >= 0) {  // the input's gradient first, then the gathered weight goes, then its gradient comes
      temp = mem_.alloc(Mem::kActivations, op.bwd_temp);
      release_before_gradient(op);
    }
    for (int pi : op.params) {
      auto& h = pending_handle_[static_cast<std::size_t>(pi)];
      if (h >= 0) continue;
      h = mem_.alloc(Mem::kGradFlight, tparam_numel_[static_cast<std::size_t>(pi)] * run_.param_bytes);
      pending_[static_cast<std::size_t>(tparam_unit_[static_cast<std::size_t>(pi)])].push_back(pi);
    }
    if (temp < 0) temp = mem_.alloc(Mem::kActivations, op.bwd_temp);
    mem_.free(temp);
    for (int s : op.saves) unref(s);
  }

  // ShardedRuntime::release_before_gradient, by the same rule (LeanBackwardUnits::may_release).
  void release_before_gradient(const TraceOp& op) {
    const int ui = unit_of_module(op.releases_weight_of);
    if (ui <= 0) return;
    const bool sole_parameter = op.params.size() == 1 && units_[static_cast<std::size_t>(ui)].params.size() == 1 &&
                                tparam_unit_[static_cast<std::size_t>(op.params.front())] == ui;
    if (lean_.may_release(ui, sole_parameter, run_.activation_checkpointing)) reshard(ui);
  }

  void free_pending(int ui) {
    auto& list = pending_[static_cast<std::size_t>(ui)];
    for (int pi : list) mem_.free(pending_handle_[static_cast<std::size_t>(pi)]);
    list.clear();
  }

  // FlatUnit::grad_as_flat: a sharded unit of one unpadded fp32 parameter reduce-scatters autograd's
  // gradient itself (no packed copy); that gradient then lives as long as the flat buffer would.
  int take_gradient_as_flat(int ui, bool no_sync) {
    const auto& u = units_[static_cast<std::size_t>(ui)];
    auto& list = pending_[static_cast<std::size_t>(ui)];
    if (u.params.size() != 1 || u.padded != u.numel || run_.group <= 1 || no_sync || run_.param_bytes != 4 || list.size() != 1 ||
        unsynced_[static_cast<std::size_t>(ui)] >= 0)
      return -1;
    auto& handle = pending_handle_[static_cast<std::size_t>(list.front())];
    const int flat = handle;
    handle = -1;
    list.clear();
    return flat;
  }

  // UnitGather::backward: pack, (reduce-scatter, all-reduce), hand the shard gradient to autograd.
  void reduce(int ui, bool no_sync) {
    const auto& u = units_[static_cast<std::size_t>(ui)];
    if (u.numel == 0) return;
    int flat = take_gradient_as_flat(ui, no_sync);
    if (flat < 0) flat = mem_.alloc(Mem::kGradFlight, u.padded * 4);
    auto& unsynced = unsynced_[static_cast<std::size_t>(ui)];
    if (no_sync) {
      free_pending(ui);
      if (unsynced >= 0)
        mem_.free(flat);  // added into the accumulator
      else {
        mem_.relabel(flat, Mem::kGrads);  // kept as the accumulator (no_sync costs one unsharded gradient per unit)
        unsynced = flat;
      }
      reshard(ui);
      return;
    }
    mem_.free(unsynced);           // added into flat
    if (run_.reduce_bytes != 4) {  // cast to reduce_dtype: the collectives move these bytes
      int low = mem_.alloc(Mem::kGradFlight, u.padded * run_.reduce_bytes);
      mem_.free(flat);
      flat = low;
    }
    int shard_grad = flat;
    const bool overlapped = run_.overlap_grad_reduce && run_.group * run_.replicas > 1;
    const std::int64_t part = optimized_elements(u);
    if (run_.group > 1) {  // room for every replica's part when the optimizer is sharded over the world
      shard_grad = mem_.alloc(Mem::kGradFlight, (run_.optimizer_over_world ? part * run_.replicas : u.shard) * run_.reduce_bytes);
      grow_scratch(overlapped ? worker_shard_scratch_ : shard_scratch_, overlapped ? worker_shard_scratch_bytes_ : shard_scratch_bytes_,
                   2 * u.shard * run_.reduce_bytes);
    }
    int reduced = shard_grad;         // the gradient handed back: the shard's, or its replica part's
    if (run_.optimizer_over_world) {  // reduce-scatter across the replicas into this rank's part
      reduced = mem_.alloc(Mem::kGradFlight, part * run_.reduce_bytes);
      grow_scratch(overlapped ? worker_replica_scratch_ : replica_scratch_, overlapped ? worker_replica_scratch_bytes_ : replica_scratch_bytes_,
                   2 * part * run_.reduce_bytes);
    } else if (run_.replicas > 1) {
      all_reduce(u.shard * run_.reduce_bytes, run_.reduce_bytes, overlapped);
    }
    if (overlapped && flat != shard_grad) {
      // The engine keeps at most two unreduced unit gradients waiting for the worker; this one waits
      // until two more are issued or backward ends (worst case: the worker is behind).
      while (waiting_flats_.size() >= 2) {
        mem_.free(waiting_flats_.front());
        waiting_flats_.erase(waiting_flats_.begin());
      }
      waiting_flats_.push_back(flat);
      flat = shard_grad;  // not freed below
    }
    int returned = reduced;
    if (run_.reduce_bytes != 4) returned = mem_.alloc(Mem::kGradFlight, part * 4);  // back to the master's dtype
    free_pending(ui);
    if (flat != shard_grad) mem_.free(flat);
    if (reduced != shard_grad) mem_.free(shard_grad);
    if (returned != reduced) mem_.free(reduced);
    auto& grad = grad_[static_cast<std::size_t>(ui)];
    if (grad < 0) {  // AccumulateGrad adopts the first gradient as .grad
      mem_.relabel(returned, Mem::kGrads);
      grad = returned;
    } else {
      mem_.free(returned);  // added in place
    }
    reshard(ui);
  }

  void grow_scratch(int& handle, std::int64_t& bytes, std::int64_t want) {
    want = std::min(want, 2 * fsdp::detail::kRingSegmentBytes);  // the ring goes round in segments
    if (want <= bytes) return;
    const int old = handle;
    handle = mem_.alloc(Mem::kComm, want);  // std::vector::resize: new block, copy, free the old one
    int o = old;
    mem_.free(o);
    bytes = want;
  }

  // fsdp::MpiComm's floating-point all-reduce: the ring reduce-scatter (two segments of scratch, kept by
  // the communicator: the worker's own when overlapped) into a chunk, then MPI_Allgather; a padded
  // copy only when the elements are not a multiple of the ranks. (At most 8 KiB gathered it gathers the
  // whole buffers instead: a few KiB, not modelled.)
  void all_reduce(std::int64_t bytes, int element_bytes, bool overlapped) {
    const std::int64_t n = bytes / element_bytes, chunk = (n + run_.replicas - 1) / run_.replicas;
    int padded = chunk * run_.replicas == n ? -1 : mem_.alloc(Mem::kComm, chunk * run_.replicas * element_bytes);
    int mine = mem_.alloc(Mem::kComm, chunk * element_bytes);
    grow_scratch(overlapped ? worker_replica_scratch_ : replica_scratch_, overlapped ? worker_replica_scratch_bytes_ : replica_scratch_bytes_,
                 2 * chunk * element_bytes);
    mem_.free(mine);
    mem_.free(padded);
  }

  std::int64_t input_bytes(std::int64_t batch) const { return family_.input_bytes(model_, batch); }
  std::int64_t target_bytes(std::int64_t batch) const { return family_.target_bytes(model_, batch); }

  void micro_batch(bool no_sync) {
    const std::int64_t B = run_.batch;
    int x = mem_.alloc(Mem::kData, input_bytes(B));
    int y = mem_.alloc(Mem::kData, target_bytes(B));
    const bool cast = run_.param_bytes != 4 && !family_.language_model();  // token ids are not cast
    if (train_trace_.ops.empty()) train_trace_ = trace_forward(model_, desc_, B, run_.param_bytes, true, cast);
    const Trace& t = train_trace_;
    handle_.assign(t.tensor_bytes.size(), -1);
    refs_.assign(t.tensor_bytes.size(), 0);
    index_params(t);
    ckpt_regions_.clear();
    order_.clear();  // nested units in the order their forwards begin
    order_pos_.assign(units_.size(), -1);
    lean_.count(t, module_unit_, units_.size(), run_.activation_checkpointing);
    for (const auto& op : t.ops) {
      const int ui = op.kind == TraceOp::Kind::kEnter ? unit_of_module(op.module) : -1;
      if (ui <= 0 || order_pos_[static_cast<std::size_t>(ui)] >= 0) continue;
      order_pos_[static_cast<std::size_t>(ui)] = static_cast<int>(order_.size());
      order_.push_back(ui);
    }
    // forward
    gather(0);
    forward_ops(t, 0, t.ops.size(), true, false, nullptr);
    // backward, in reverse order
    std::size_t region = ckpt_regions_.size();
    std::vector<int> recomputed;
    if (run_.backward_prefetch != "NO_PREFETCH") prefetch_after(0, -1);  // the root's backward begins first
    for (std::size_t i = t.ops.size(); i-- > 0;) {
      const auto& op = t.ops[i];
      if (op.kind == TraceOp::Kind::kExit) {
        const int ui = unit_of_module(op.module);
        if (ui > 0 && lean_.gathers_for_backward(ui)) gather(ui);  // the output hook re-gathers a freed unit
        if (ui > 0 && run_.backward_prefetch == "BACKWARD_PRE") prefetch_after(ui, -1);
        if (region > 0 && ckpt_regions_[region - 1].end == i) {
          recomputed.clear();
          forward_ops(t, ckpt_regions_[region - 1].begin + 1, i, true, true, &recomputed);
        }
      } else if (op.kind == TraceOp::Kind::kEnter) {
        const int ui = unit_of_module(op.module);
        if (ui > 0 && run_.backward_prefetch == "BACKWARD_POST") prefetch_after(ui, -1);
        if (ui > 0) reduce(ui, no_sync);
        if (region > 0 && ckpt_regions_[region - 1].begin == i) {
          for (int id : recomputed) {
            refs_[static_cast<std::size_t>(id)] = std::min(refs_[static_cast<std::size_t>(id)], 1);
            unref(id);
          }
          for (int s : ckpt_regions_[region - 1].inputs) unref(s);
          --region;
        }
      } else {
        backward_op(op);
      }
    }
    reduce(0, no_sync);
    // end of backward: everything still gathered is freed; the step's tensors die; the overlapped
    // reductions are waited for.
    for (std::size_t ui = 0; ui < units_.size(); ++ui) reshard(static_cast<int>(ui));
    for (int& h : waiting_flats_) mem_.free(h);
    waiting_flats_.clear();
    for (auto& h : handle_) mem_.free(h);
    mem_.free(x);
    mem_.free(y);
  }

  /// fsdp::create_adam_state_ahead: fp32 Adam and AdamW states exist before the first forward; the
  /// others' come with their first step.
  bool state_created_ahead() const {
    return (run_.optimizer == OptimizerKind::kAdam || run_.optimizer == OptimizerKind::kAdamW) && run_.state_element_bytes == 4;
  }

  void create_optimizer_state() {
    for (const auto& u : units_)
      if (u.numel > 0) create_optimizer_state(u);
  }
  void create_optimizer_state(const PlanUnit& u) {
    auto& st = state_[static_cast<std::size_t>(u.index)];
    for (int c = 0; c < run_.optimizer_copies; ++c) st.push_back(mem_.alloc(Mem::kOptimizer, optimized_elements(u) * run_.state_element_bytes));
  }

  void optimizer_step(bool first) {
    for (const auto& u : units_) {
      if (u.numel == 0) continue;
      const std::int64_t bytes = optimized_elements(u) * 4;
      if (run_.clip) {  // clip_grad_norm: |g|^2 in double
        int d = mem_.alloc(Mem::kStepTemps, 2 * bytes);
        int a = mem_.alloc(Mem::kStepTemps, 2 * bytes);
        mem_.free(d);
        int pw = mem_.alloc(Mem::kStepTemps, 2 * bytes);
        mem_.free(pw);
        mem_.free(a);
      }
    }
    for (const auto& u : units_) {
      if (u.numel == 0) continue;
      const std::int64_t bytes = optimized_elements(u) * 4;
      if (first && !state_created_ahead()) create_optimizer_state(u);  // LibTorch's first step, parameter by parameter
      // Adam and AdamW update in one pass per element (fsdp::optim::OnePassAdam, and the bf16-moment
      // Adams): no temporaries. SGD's and Adadelta's L2 decay makes grad + wd p.
      if (run_.optimizer == OptimizerKind::kAdam || run_.optimizer == OptimizerKind::kAdamW) continue;
      int wd = run_.weight_decay ? mem_.alloc(Mem::kStepTemps, bytes) : -1;
      if (run_.optimizer == OptimizerKind::kAdadelta) {
        int t1 = mem_.alloc(Mem::kStepTemps, bytes);  // sqrt()
        int t2 = mem_.alloc(Mem::kStepTemps, bytes);  // the delta
        mem_.free(t2);
        mem_.free(t1);
      }
      mem_.free(wd);
    }
    for (int& g : grad_) mem_.free(g);  // fsdp-train releases the gradients after the update (release_gradients)
  }

  void evaluate() {
    // fsdp-train evaluates a language model's batch in chunks (GptConfig::eval_chunk): one chunk's forward.
    const std::int64_t B = family_.eval_chunk(model_, run_.test_batch);
    int idx = mem_.alloc(Mem::kData, (run_.data.test_samples + run_.world - 1) / run_.world * 8);
    int x = mem_.alloc(Mem::kData, input_bytes(B));
    int y = mem_.alloc(Mem::kData, target_bytes(B));
    const bool cast = run_.param_bytes != 4 && !family_.language_model();
    const Trace t = trace_forward(model_, desc_, B, run_.param_bytes, false, cast);
    handle_.assign(t.tensor_bytes.size(), -1);
    refs_.assign(t.tensor_bytes.size(), 0);
    gather(0);
    forward_ops(t, 0, t.ops.size(), false, false, nullptr);
    int argmax = mem_.alloc(Mem::kActivations, B * family_.predictions_per_sample(model_) * 8);
    for (std::size_t ui = 0; ui < units_.size(); ++ui) reshard(static_cast<int>(ui));
    for (auto& h : handle_) mem_.free(h);
    mem_.free(argmax);
    mem_.free(x);
    mem_.free(y);
    mem_.free(idx);
  }

  struct Region {
    std::size_t begin, end;
    std::vector<int> inputs;
  };

  const ModelSection& model_;
  const ModelFamily& family_;
  const ModelDesc& desc_;
  const std::vector<PlanUnit>& units_;
  const RunShape& run_;
  MemorySim mem_;
  std::vector<int> module_unit_;
  std::unordered_map<std::string, int> param_unit_;
  std::unordered_map<std::string, std::int64_t> param_numel_;
  std::vector<int> full_, shard_, grad_, unsynced_;
  std::vector<int> kept_;  // fsdp.reshard_after_forward = N: the slice kept between forward and backward
  LeanBackwardUnits lean_;
  std::vector<std::vector<int>> state_;
  std::vector<std::vector<int>> pending_;  ///< per unit: trace parameters whose gradient autograd holds
  std::vector<int> tparam_unit_, pending_handle_;
  std::vector<std::int64_t> tparam_numel_;
  std::vector<int> buffers_;
  int data_ = -1, indices_ = -1;
  int shard_scratch_ = -1, replica_scratch_ = -1;
  std::int64_t shard_scratch_bytes_ = 0, replica_scratch_bytes_ = 0;
  int worker_shard_scratch_ = -1, worker_replica_scratch_ = -1;  // the collective worker's communicators
  std::int64_t worker_shard_scratch_bytes_ = 0, worker_replica_scratch_bytes_ = 0;
  std::vector<int> waiting_flats_;  // overlapped reductions' unit gradients not yet reduced
  std::vector<int> handle_, refs_;
  std::vector<int> order_, order_pos_;
  Trace train_trace_;
  int ckpt_unit_ = -1;
  std::size_t ckpt_begin_ = 0;
  std::vector<int> ckpt_input_;
  std::vector<Region> ckpt_regions_;
};

}  // namespace detail

/// Predicts one rank's memory for the deck's `model` under `run`.
inline Prediction predict(const ModelSection& model, const RunShape& run) {
  const ModelDesc desc = describe_model(model);
  const auto units = plan_units(desc, run.wrap, run.group);
  detail::RunSimulator sim(model, desc, units, run);
  Prediction p = sim.run();
  p.num_params = desc.num_params();
  p.units = units.size();
  for (const auto& u : units) {
    p.shard_elements += u.shard;
    p.optimized_elements += detail::optimized_elements(run, u);
    p.padding += u.padded - u.numel;
    if (u.padded > p.largest_unit) {
      p.largest_unit = u.padded;
      p.largest_unit_path = u.path.empty() ? "(root)" : u.path;
    }
  }
  p.state_bytes = training_state_bytes(p.shard_elements, p.optimized_elements, run.state_element_bytes * run.optimizer_copies);
  p.baseline_bytes = static_cast<std::int64_t>(run.baseline_mib * 1048576.0);
  p.total_bytes = p.model_bytes + p.baseline_bytes;
  p.unit_list = units;
  return p;
}

}  // namespace fsdp::app
