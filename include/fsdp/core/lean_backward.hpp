// Units whose backward needs less than their forward (core layer: std only): when a unit's gathered
// weight may be freed before its gradient exists (fsdp::linear_releasing_weight), and when backward
// need not gather a unit at all (fsdp::backward_reads_no_parameter). The engine and fsdp-plan's
// simulator both decide through these, so the plan predicts what the engine does.
#pragma once

namespace fsdp {

/// A unit at the point where a linear_releasing_weight backward has computed its input's gradient.
struct UnitAtWeightRelease {
  bool sole_parameter = false;          ///< the released weight is the unit's only parameter
  bool called_through_forward = false;  ///< the unit runs through fsdp::forward (not gathered with the root)
  bool recomputing = false;             ///< inside an activation-checkpointing recomputation, which reads it again
  bool frozen_companion = false;        ///< the unit has a frozen companion gathered and freed with it
  int pending_backwards = 0;            ///< gathers for backward still to be consumed (forwards not yet undone)
  int releasing_reads_left = 0;         ///< other linear_releasing_weight reads of the weight still to come
};

/// Whether no backward node left reads the unit's gathered buffer: only then may it be freed early.
constexpr bool may_release_before_gradient(const UnitAtWeightRelease& u) noexcept {
  return u.sole_parameter && u.called_through_forward && !u.recomputing && !u.frozen_companion && u.pending_backwards == 1 &&
         u.releasing_reads_left == 0;
}

/// Whether backward all-gathers a unit whose forward declared (or not) that its backward reads no
/// parameter. A checkpointed unit runs its forward again in backward, which reads them.
constexpr bool backward_gathers(bool declared_reads_no_parameter, bool checkpointed) noexcept { return !declared_reads_no_parameter || checkpointed; }

}  // namespace fsdp
