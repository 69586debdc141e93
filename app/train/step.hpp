// fsdp-train (app layer): one optimizer step of the loop: the micro-batches' forward and backward
// (gradients reduced on the last one only), clipping, and the step, skipped when any rank saw a
// non-finite loss or gradient norm. One small all-reduce decides that, and carries a stop request and
// whether the step's collectives failed on some rank.
#pragma once

#include <fsdp/fsdp.hpp>
#include <torch/torch.h>

#include <cmath>
#include <csignal>
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>

#include "data.hpp"
#include "train/dataset.hpp"
#include "train/ranks.hpp"
#include "train/timing.hpp"

namespace fsdp::app {

/// What one step did, agreed by every rank where it decides a branch.
struct StepOutcome {
  double loss = 0;               ///< this rank's loss summed over the micro-batches (each divided by their count)
  std::int64_t samples = 0;      ///< this rank's samples
  bool nonfinite = false;        ///< some rank saw a non-finite loss or gradient norm: the step was not taken
  bool overflowed = false;       ///< fp16 loss scaling: some rank's gradients overflowed; the step was skipped, the scale backed off
  std::int64_t stop_signal = 0;  ///< the largest stop signal any rank received (0: none)
};

/// Runs `accum` micro-batches from `loader` and the optimizer step (the learning rate is set by the
/// caller), reducing gradients after the last micro-batch or, with `reduce_every`, after each; with a
/// `scaler` (fp16) the loss is scaled before backward and the gradients unscaled before clipping;
/// `before_update`, if set, runs right before the optimizer's step (optim.no_decay's decay).
/// `stop_signal` is this rank's pending signal (set by a handler), read after the micro-batches and
/// shared with the others. `fail_collectives` (test hook FSDP_TEST_FAIL_COLLECTIVES) makes this rank's
/// collectives of the step fail as an aborted GPU communicator's do. Collective.
template <class Engine, class Loader>
StepOutcome train_step(Engine& model, torch::optim::Optimizer& optimizer, const Dataset& data, Loader& loader, std::int64_t accum, bool reduce_every, double clip,
                       fsdp::DynamicLossScale* scaler, const volatile std::sig_atomic_t& stop_signal, MpiComm& world, Phases& phases,
                       const std::function<void()>& before_update = {}, bool fail_collectives = false) {
  StepOutcome out;
  std::optional<Timed> optimizer_time;
  bool overflowed = false;
  double norm = 0.0;
  const auto compute = [&] {
    optimizer.zero_grad();
    for (std::int64_t a = 0; a < accum; ++a) {
      std::optional<Batch> b;
      {
        Timed t(phases.data, "data");
        b = loader.next();
      }
      if (!b) throw std::runtime_error("data loader ended early");
      std::optional<typename Engine::NoSyncScope> no_sync;
      if (a + 1 < accum && !reduce_every) no_sync.emplace(model.no_sync());  // reduce the gradients once, on the last micro-batch
      torch::Tensor loss;
      {
        Timed t(phases.forward, "forward + loss");
        loss = loss_of(data, model.forward(b->x.to(model.compute_device())), b->y.to(model.compute_device())) / static_cast<double>(accum);
      }
      {
        Timed t(phases.backward, "backward");
        (scaler ? loss * scaler->scale() : loss).backward();
      }
      out.loss += loss.template item<double>();
      out.samples += b->samples;
    }
    optimizer_time.emplace(phases.optimizer, "optimizer");
    overflowed = scaler && model.unscale_grads(scaler->scale());  // agreed by every rank
    norm = clip > 0 && !overflowed ? model.clip_grad_norm(clip) : 0.0;
    // The step's collectives settled before the optimizer uses their results.
    model.synchronize_collectives();
  };
  const std::string test_failure = "rank " + std::to_string(world.rank()) +
                                   ": all_reduce did not complete within its deadline; the NCCL communicator was aborted (test hook FSDP_TEST_FAIL_COLLECTIVES)";
  std::optional<std::string> comm_failure;
  if constexpr (Engine::kCollectivesMayBePending) {
    // A GPU communicator's collectives are stream-ordered: one its watcher aborted (deadline, NCCL
    // error) surfaces at a later call of the step. Caught and agreed below, so every rank stops before
    // the update; the peers' own collectives end at their deadline, so they reach the agreement too.
    try {
      compute();
      if (fail_collectives) throw fsdp::CommError(test_failure, "fsdp.comm.deadline");
    } catch (const fsdp::CommError& e) {
      comm_failure = e.what();
    }
  } else {
    compute();  // an MPI collective has no deadline of its own to let the peers out: a failure ends the job
    if (fail_collectives) comm_failure = "[fsdp.comm.deadline] " + test_failure;
  }
  std::int64_t flags[3] = {stop_signal, std::isfinite(out.loss) && std::isfinite(norm) ? 0 : 1, comm_failure ? 1 : 0};
  world.all_reduce(flags, flags, 3, fsdp::DType::kInt64, fsdp::ReduceOp::kMax);
  if (flags[2] != 0) agree(world, comm_failure, /*bad_input=*/false);  // every rank throws the failing rank's message
  out.stop_signal = flags[0];
  out.nonfinite = flags[1] != 0;
  // An overflow is what loss scaling expects now and then: skip and back off. A non-finite loss is not,
  // nor an overflow at the floor of the scale (gradients that are inf or NaN at any scale): both go to
  // run.on_nonfinite.
  if (overflowed && scaler->at_floor()) out.nonfinite = true;
  out.overflowed = overflowed && !out.nonfinite;
  if (scaler && !out.nonfinite) scaler->update(overflowed);
  if (!out.nonfinite && !out.overflowed) {
    if (before_update) before_update();
    optimizer.step();
  }
  return out;
}

}  // namespace fsdp::app
