// fsdp-train (app layer, std only): the learning-rate schedule of the deck, one formula for the loop,
// the checkpoints' scheduler state and the tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

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
