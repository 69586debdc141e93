// fsdp-train (app layer): the run's step counts, from the samples per rank, the batch and the deck, and
// what a resume's checkpoint must agree with: its global batch and a position on a step boundary.
#pragma once

#include <fsdp/fsdp.hpp>

#include <algorithm>
#include <cstdint>
#include <string>

#include "choices.hpp"
#include "run_config.hpp"
#include "train/ranks.hpp"

namespace fsdp::app {

/// The step counts of the run, from the data, batch and deck.
struct TrainingSchedule {
  std::int64_t batch = 0, accum = 1, steps_per_epoch = 0, total_steps = 0, global_batch = 0;
  /// A resume that goes on with another global batch (checkpoint.resume_changed = "allow"):
  /// "global batch: before -> now"; empty otherwise.
  std::string global_batch_change;
};

/// A resume whose global batch (samples per optimizer step) differs from the checkpoint's: another
/// world size without data.global_batch_size changes the training. A RankError (exit 2) naming both and
/// the key that keeps it, unless checkpoint.resume_changed = "allow": then a warning (rank 0), and the
/// change is kept for summary.json. Every rank decides alike.
inline void check_global_batch(const RunConfig& cfg, int world_size, bool root, const fsdp::TrainState& start, TrainingSchedule& p) {
  const auto stored = start.scheduler.find("global_batch");  // checkpoints of earlier versions have none
  if (stored == start.scheduler.end() || static_cast<std::int64_t>(stored->second) == p.global_batch) return;
  const auto was = std::to_string(static_cast<std::int64_t>(stored->second)), now = std::to_string(p.global_batch);
  const std::string how = cfg.data.global_batch_size > 0 ? "data.global_batch_size"
                                                         : "data.batch_size " + std::to_string(p.batch) + " x " + std::to_string(world_size) +
                                                               " ranks x optim.grad_accum_steps " + std::to_string(p.accum);
  const std::string what =
      "the checkpoint resumed from was trained with global batches of " + was + " samples, this run's are " + now + " (" + how + ")";
  if (cfg.checkpoint.resume_changed == ResumeChanged::kRefuse)
    throw RankError(what + ": set data.global_batch_size = " + was + " to continue the same training on " + std::to_string(world_size) +
                        " ranks, or checkpoint.resume_changed = \"allow\" to go on with " + now,
                    true);
  if (root) std::printf("warning: %s (checkpoint.resume_changed = \"allow\")\n", what.c_str());
  p.global_batch_change = "global batch: " + was + " -> " + now;
}

/// The steps of a run whose epoch has `train_samples` samples, `samples_per_rank` a rank (the sampler's,
/// padded), resumed at `start` (step 0 for a fresh run). With data.global_batch_size an epoch is its
/// whole global batches (as Megatron-LM and torchtitan count): every world size takes the same steps
/// of the same samples, and the epoch's last partial global batch is not trained; without it, the
/// micro-batches of a rank, the last one partial. The steps left are counted from where the checkpoint
/// stopped in the data: the same as steps_per_epoch x run.epochs unless the global batch changed at
/// the resume. Every rank computes the same and throws the same RankError.
inline TrainingSchedule plan_training_schedule(const RunConfig& cfg, std::int64_t train_samples, std::int64_t samples_per_rank, int world_size,
                                               bool root, const fsdp::TrainState& start) {
  TrainingSchedule p;
  p.batch = cfg.data.batch_size;
  p.accum = cfg.optim.grad_accum_steps;
  p.global_batch = p.batch * p.accum * world_size;
  const bool whole_global_batches = cfg.data.global_batch_size > 0;
  p.steps_per_epoch = whole_global_batches ? train_samples / p.global_batch : (samples_per_rank + p.batch - 1) / p.batch / p.accum;
  if (p.steps_per_epoch == 0)
    throw RankError(whole_global_batches
                        ? "data.global_batch_size " + std::to_string(p.global_batch) + " exceeds the training samples of an epoch (" +
                              std::to_string(train_samples) + ")"
                        : "data.batch_size x optim.grad_accum_steps exceeds the samples per rank (" + std::to_string(samples_per_rank) + ")",
                    true);
  check_global_batch(cfg, world_size, root, start, p);
  if (start.sample_index % p.global_batch != 0)
    throw RankError("the checkpoint resumed from stopped " + std::to_string(start.sample_index) + " samples into epoch " +
                        std::to_string(start.epoch + 1) + ", not a whole number of this run's global batches of " + std::to_string(p.global_batch) +
                        " (data.batch_size " + std::to_string(p.batch) + " x " + std::to_string(world_size) + " ranks x optim.grad_accum_steps " +
                        std::to_string(p.accum) + "): set data.global_batch_size to the global batch it was trained with",
                    true);
  const std::int64_t epochs_left = std::max<std::int64_t>(0, cfg.run.epochs - start.epoch);
  const std::int64_t steps_left = epochs_left > 0 ? epochs_left * p.steps_per_epoch - start.sample_index / p.global_batch : 0;
  const std::int64_t all_steps = start.step + std::max<std::int64_t>(0, steps_left);
  p.total_steps = cfg.run.max_steps > 0 ? std::min(cfg.run.max_steps, all_steps) : all_steps;
  return p;
}

}  // namespace fsdp::app
