// fsdp-train (app layer, std only): the learning-rate schedule of the deck, one formula for the loop,
// the checkpoints' scheduler state and the tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "run_config.hpp"

namespace fsdp::app {

/// The learning rate at optimizer step `step` (0-based) in `epoch`: a linear warmup from 0 to
/// optim.lr over optim.warmup_steps, then the schedule: constant; step (optim.lr x gamma^epoch, not
/// below optim.lr_min); cosine (from optim.lr down to optim.lr_min at the last step); wsd (optim.lr,
/// then over the last optim.decay_fraction of the steps linearly down to optim.lr_min at the last).
inline double lr_at(const RunConfig& cfg, std::int64_t step, std::int64_t epoch, std::int64_t total_steps) {
  const double base = cfg.optim.lr, floor = cfg.optim.lr_min;
  const auto warmup = cfg.optim.warmup_steps;
  if (step < warmup) return base * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const LrSchedule schedule = cfg.optim.schedule;
  if (schedule == LrSchedule::kStep)
    return std::max(floor, base * std::pow(cfg.optim.gamma, static_cast<double>(epoch)));  // StepLR(step_size=1) per epoch
  if (schedule == LrSchedule::kCosine) {
    const double span = static_cast<double>(std::max<std::int64_t>(1, total_steps - warmup - 1));
    const double progress = std::min(1.0, static_cast<double>(step - warmup) / span);
    return floor + (base - floor) * 0.5 * (1 + std::cos(M_PI * progress));
  }
  if (schedule == LrSchedule::kWsd) {
    const auto decay_steps = std::max<std::int64_t>(1, std::llround(cfg.optim.decay_fraction * static_cast<double>(total_steps)));
    const auto decay_start = std::max(warmup, total_steps - decay_steps);
    if (step < decay_start) return base;
    const double progress = std::min(1.0, static_cast<double>(step - decay_start + 1) / static_cast<double>(total_steps - decay_start));
    return base + (floor - base) * progress;
  }
  return base;
}

}  // namespace fsdp::app

namespace fsdp::app {

/// What a deck's schedule will not do that its keys say, one warning each (fsdp-train prints them at
/// the start): a run.max_steps the data cannot reach, evaluation asked for without validation data or
/// less often than the run is long, a warmup as long as the run, checkpoints less often than the run
/// is long. `steps_per_epoch` and `total_steps` as the loop plans them; `train_samples` the training
/// set's size.
inline std::vector<std::string> schedule_warnings(const RunConfig& cfg, std::int64_t steps_per_epoch, std::int64_t total_steps,
                                                  std::int64_t train_samples, std::int64_t global_batch, bool has_validation) {
  std::vector<std::string> out;
  const auto n = [](std::int64_t v) { return std::to_string(v); };
  const std::string run_steps = "the run's " + n(total_steps) + " step" + (total_steps == 1 ? "" : "s");
  if (cfg.run.max_steps > 0 && cfg.run.max_steps > steps_per_epoch * cfg.run.epochs) {
    const std::int64_t epochs_needed = (cfg.run.max_steps + steps_per_epoch - 1) / steps_per_epoch;
    out.push_back("run.max_steps = " + n(cfg.run.max_steps) + " cannot be reached: the data gives " + n(steps_per_epoch) +
                  " optimizer steps per epoch (" + n(train_samples) + " training samples, global batch " + n(global_batch) + ") x run.epochs " +
                  n(cfg.run.epochs) + " = " + n(total_steps) + "; the run ends at step " + n(total_steps) + " (run.epochs = " + n(epochs_needed) +
                  " would reach it)");
  }
  if (cfg.eval.every_steps > 0 && !has_validation)
    out.push_back("eval.every_steps = " + n(cfg.eval.every_steps) + " asks for evaluation, but there is no validation data (data.val_path " +
                  "is empty): none will run");
  else if (cfg.eval.every_steps > total_steps)
    out.push_back("eval.every_steps = " + n(cfg.eval.every_steps) + " is beyond " + run_steps + ": one evaluation, after the last step");
  if (cfg.optim.warmup_steps > 0 && cfg.optim.warmup_steps >= total_steps)
    out.push_back("optim.warmup_steps = " + n(cfg.optim.warmup_steps) + " is not shorter than " + run_steps +
                  ": the learning rate never reaches optim.lr");
  if (cfg.checkpoint.every_steps > total_steps)
    out.push_back(
        "checkpoint.every_steps = " + n(cfg.checkpoint.every_steps) + " is beyond " + run_steps +
        (cfg.checkpoint.save_final ? ": the only checkpoint is the final one" : ": no checkpoint will be written (checkpoint.save_final is false)"));
  return out;
}

}  // namespace fsdp::app
