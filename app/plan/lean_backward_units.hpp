// Memory planning (app layer): the engine's lean-backward decisions (fsdp/core/lean_backward.hpp)
// for the units of one step's trace: which units backward does not gather again, and when a unit's
// gathered weight may be freed before its gradient exists.
#pragma once

#include <cstddef>
#include <vector>

#include "fsdp/core/lean_backward.hpp"
#include "plan/trace.hpp"

namespace fsdp::app::detail {

class LeanBackwardUnits {
 public:
  /// Counts over `trace` (whose module m belongs to unit `module_unit[m]`, 0 being the root) each nested
  /// unit's forwards (the engine's pending gathers for backward) and releasing reads, and marks the
  /// units whose forward declared that backward reads no parameter.
  void count(const Trace& trace, const std::vector<int>& module_unit, std::size_t units, bool checkpointing) {
    no_backward_gather_.assign(units, false);
    releasing_reads_.assign(units, 0);
    forwards_.assign(units, 0);
    auto unit_of = [&](int module) { return module_unit[static_cast<std::size_t>(module)]; };
    for (const auto& op : trace.ops) {
      if (op.kind == TraceOp::Kind::kEnter && unit_of(op.module) > 0) ++forwards_[static_cast<std::size_t>(unit_of(op.module))];
      if (op.kind == TraceOp::Kind::kExit && unit_of(op.module) > 0 && !backward_gathers(op.no_backward_gather, checkpointing))
        no_backward_gather_[static_cast<std::size_t>(unit_of(op.module))] = true;
      if (op.releases_weight_of >= 0 && unit_of(op.releases_weight_of) > 0)
        ++releasing_reads_[static_cast<std::size_t>(unit_of(op.releases_weight_of))];
    }
  }

  /// fsdp::backward_reads_no_parameter: backward neither gathers unit `ui` nor prefetches it.
  bool gathers_for_backward(int ui) const { return !no_backward_gather_[static_cast<std::size_t>(ui)]; }

  /// ShardedRuntime::release_before_gradient at one releasing read's backward of unit `ui` (a unit of
  /// the trace runs through fsdp::forward; under activation checkpointing every nested unit's backward
  /// runs inside its recomputation): whether its gathered weight may be freed now.
  bool may_release(int ui, bool sole_parameter, bool checkpointing) {
    auto& reads_left = releasing_reads_[static_cast<std::size_t>(ui)];
    if (reads_left > 0) --reads_left;
    UnitAtWeightRelease state;
    state.sole_parameter = sole_parameter;
    state.called_through_forward = true;
    state.recomputing = checkpointing;
    state.pending_backwards = forwards_[static_cast<std::size_t>(ui)];
    state.releasing_reads_left = reads_left;
    return may_release_before_gradient(state);
  }

 private:
  std::vector<bool> no_backward_gather_;  // per unit: fsdp::backward_reads_no_parameter
  std::vector<int> releasing_reads_;      // per unit: fsdp::linear_releasing_weight backwards still to run
  std::vector<int> forwards_;             // per unit: its forwards in the step
};

}  // namespace fsdp::app::detail
