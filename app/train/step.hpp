// fsdp-train (app layer): one optimizer step of the loop: the micro-batches' forward and backward
// (gradients reduced on the last one only), clipping, and the step, skipped when any rank saw a
// non-finite loss or gradient norm. One small all-reduce decides that, and carries a stop request.
#pragma once

#include <fsdp/fsdp.hpp>
#include <torch/torch.h>

#include <cmath>
#include <csignal>
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>

#include "data.hpp"
#include "train/dataset.hpp"
#include "train/timing.hpp"

namespace fsdp::app {

/// What one step did, agreed by every rank where it decides a branch.
struct StepOutcome {
  double loss = 0;               ///< this rank's loss summed over the micro-batches (each divided by their count)
  std::int64_t samples = 0;      ///< this rank's samples
  bool nonfinite = false;        ///< some rank saw a non-finite loss or gradient norm: the step was not taken
  std::int64_t stop_signal = 0;  ///< the largest stop signal any rank received (0: none)
};

/// Runs `accum` micro-batches from `loader` and the optimizer step (the learning rate is set by the
/// caller); `before_update`, if set, runs right before the optimizer's step (optim.no_decay's decay).
/// `stop_signal` is this rank's pending signal (set by a handler), read after the micro-batches and
/// shared with the others. Collective.
template <class Engine, class Loader>
StepOutcome train_step(Engine& model, torch::optim::Optimizer& optimizer, const Dataset& data, Loader& loader, std::int64_t accum, double clip,
                       const volatile std::sig_atomic_t& stop_signal, MpiComm& world, Phases& phases,
                       const std::function<void()>& before_update = {}) {
  StepOutcome out;
  optimizer.zero_grad();
  for (std::int64_t a = 0; a < accum; ++a) {
    std::optional<Batch> b;
    {
      Timed t(phases.data, "data");
      b = loader.next();
    }
    if (!b) throw std::runtime_error("data loader ended early");
    std::optional<typename Engine::NoSyncScope> no_sync;
    if (a + 1 < accum) no_sync.emplace(model.no_sync());  // reduce the gradients once, on the last micro-batch
    torch::Tensor loss;
    {
      Timed t(phases.forward, "forward + loss");
      loss = loss_of(data, model.forward(b->x.to(model.compute_device())), b->y.to(model.compute_device())) / static_cast<double>(accum);
    }
    {
      Timed t(phases.backward, "backward");
      loss.backward();
    }
    out.loss += loss.template item<double>();
    out.samples += b->samples;
  }
  Timed t(phases.optimizer, "optimizer");
  const double norm = clip > 0 ? model.clip_grad_norm(clip) : 0.0;
  std::int64_t flags[2] = {stop_signal, std::isfinite(out.loss) && std::isfinite(norm) ? 0 : 1};
  world.all_reduce(flags, flags, 2, fsdp::DType::kInt64, fsdp::ReduceOp::kMax);
  out.stop_signal = flags[0];
  out.nonfinite = flags[1] != 0;
  if (!out.nonfinite) {
    if (before_update) before_update();
    optimizer.step();
  }
  return out;
}

}  // namespace fsdp::app
