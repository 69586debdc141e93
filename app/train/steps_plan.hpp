// fsdp-train (app layer): the run's step counts, from the samples per rank, the batch and the deck, and
// what a resume's checkpoint must agree with: its global batch and a position on a step boundary.
#pragma once

#include <fsdp/fsdp.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
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
/// how to keep it, unless checkpoint.resume_changed = "allow": then, when the checkpoint stopped on a
/// step boundary of the new batch, a warning (rank 0) and the change is kept for summary.json. A
/// checkpoint off this run's step boundary is refused either way. Every rank decides alike.
inline void check_global_batch(const RunConfig& cfg, int world_size, bool root, const fsdp::TrainState& start, TrainingSchedule& p) {
  const auto stored = start.scheduler.find("global_batch");  // checkpoints of earlier versions have none
  const std::int64_t trained_with = stored == start.scheduler.end() ? 0 : static_cast<std::int64_t>(stored->second);
  const auto was = std::to_string(trained_with), now = std::to_string(p.global_batch), ranks = std::to_string(world_size);
  const std::string how = cfg.data.global_batch_size > 0 ? "data.global_batch_size"
                                                         : "data.batch_size " + std::to_string(p.batch) + " x " + ranks +
                                                               " ranks x optim.grad_accum_steps " + std::to_string(p.accum);
  const std::string keep = trained_with % world_size == 0
                               ? "set data.global_batch_size = " + was + " to continue the same training on " + ranks + " ranks"
                               : "its " + was + " samples do not divide over " + ranks + " ranks: run on a world size that divides " + was +
                                     " with data.global_batch_size = " + was;
  const bool changed = trained_with > 0 && trained_with != p.global_batch;
  if (changed && cfg.checkpoint.resume_changed == ResumeChanged::kRefuse)
    throw RankError("the checkpoint resumed from was trained with global batches of " + was + " samples, this run's are " + now + " (" + how +
                        "): " + keep + ", or checkpoint.resume_changed = \"allow\" to go on with " + now,
                    true);
  if (start.sample_index % p.global_batch != 0)
    throw RankError("the checkpoint resumed from stopped " + std::to_string(start.sample_index) + " samples into epoch " +
                        std::to_string(start.epoch + 1) + ", not a whole number of this run's global batches of " + now + " (" + how +
                        "): " + (trained_with > 0 ? keep : "set data.global_batch_size to the global batch it was trained with"),
                    true);
  if (!changed) return;
  if (root)
    std::printf(
        "warning: the checkpoint resumed from was trained with global batches of %s samples, this run's are %s (%s) "
        "(checkpoint.resume_changed = \"allow\")\n",
        was.c_str(), now.c_str(), how.c_str());
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
  const std::int64_t rank_steps = (samples_per_rank + p.batch - 1) / p.batch / p.accum;  // a rank's micro-batches, the last partial
  p.steps_per_epoch = whole_global_batches ? train_samples / p.global_batch : rank_steps;
  if (p.steps_per_epoch == 0)
    throw RankError(whole_global_batches
                        ? "data.global_batch_size " + std::to_string(p.global_batch) + " exceeds the training samples of an epoch (" +
                              std::to_string(train_samples) + ")"
                        : "data.batch_size x optim.grad_accum_steps exceeds the samples per rank (" + std::to_string(samples_per_rank) + ")",
                    true);
  check_global_batch(cfg, world_size, root, start, p);
  const std::int64_t epochs_left = std::max<std::int64_t>(0, cfg.run.epochs - start.epoch);
  const std::int64_t steps_left = epochs_left > 0 ? epochs_left * p.steps_per_epoch - start.sample_index / p.global_batch : 0;
  const std::int64_t all_steps = start.step + std::max<std::int64_t>(0, steps_left);
  p.total_steps = cfg.run.max_steps > 0 ? std::min(cfg.run.max_steps, all_steps) : all_steps;
  // A checkpoint of an earlier version (no global batch stored) planned partial last steps under
  // data.global_batch_size: when that rule, under this deck, gives the checkpoint's planned last step
  // and this one another, the run now ends elsewhere (and a schedule over its steps moves with it).
  const auto planned = start.scheduler.find("total_steps");
  if (root && whole_global_batches && !start.scheduler.count("global_batch") && planned != start.scheduler.end()) {
    const std::int64_t earlier_all = rank_steps * cfg.run.epochs;
    const std::int64_t earlier = cfg.run.max_steps > 0 ? std::min(cfg.run.max_steps, earlier_all) : earlier_all;
    if (earlier == static_cast<std::int64_t>(planned->second) && earlier != p.total_steps)
      std::printf(
          "warning: the run now ends at step %lld, not at the checkpoint's planned %lld: with data.global_batch_size an epoch is its "
          "whole global batches (docs/data.md)\n",
          static_cast<long long>(p.total_steps), static_cast<long long>(earlier));
  }
  return p;
}

}  // namespace fsdp::app
