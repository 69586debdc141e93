// fsdp-train (app layer): the parts of the training loop that do not need the Trainer's state: what a
// step did, where a GPU communicator's failure is caught so that every rank can agree on it, the test
// hooks that name a rank and step, and the progress line's style and window.
#pragma once

#include <fsdp/fsdp.hpp>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "choices.hpp"
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

/// A test hook "RANK:STEP" in environment variable `name` that names this rank and step.
inline bool test_hook_at(const char* name, int rank, std::int64_t step) {
  const char* v = std::getenv(name);
  if (!v || !*v) return false;
  int r = -1;
  long long s = -1;
  return std::sscanf(v, "%d:%lld", &r, &s) == 2 && r == rank && s == step;
}

/// Test hooks (docs/reliability.md, "Long runs"): FSDP_TEST_SLOW_RANK=R:MS makes rank R work MS
/// milliseconds longer in every step; FSDP_TEST_LEAK_MIB=R:MIB makes it keep MIB MiB more resident
/// memory after every step.
inline void run_slow_rank_and_leak_test_hooks(int this_rank) {
  static std::vector<std::vector<char>> leaked;
  int rank = -1;
  long long amount = 0;
  if (const char* v = std::getenv("FSDP_TEST_SLOW_RANK"); v && std::sscanf(v, "%d:%lld", &rank, &amount) == 2 && rank == this_rank)
    std::this_thread::sleep_for(std::chrono::milliseconds(amount));
  if (const char* v = std::getenv("FSDP_TEST_LEAK_MIB"); v && std::sscanf(v, "%d:%lld", &rank, &amount) == 2 && rank == this_rank)
    leaked.emplace_back(static_cast<std::size_t>(amount) << 20, '\1');  // written: resident
}

/// Test hook FSDP_TEST_SAMPLE_LOG=DIR: every rank appends to DIR/samples.<rank> one line per training
/// sample it reads, "epoch position sample" (position in the epoch's global order, sample as the data
/// numbers it), so a test can compare what runs at different world sizes read. Off when unset.
class SampleLog {
 public:
  explicit SampleLog(int rank) : rank_(rank) {
    if (const char* dir = std::getenv("FSDP_TEST_SAMPLE_LOG"); dir && *dir) path_ = std::string(dir) + "/samples." + std::to_string(rank);
  }
  bool on() const { return !path_.empty(); }
  /// The lines of samples `idx[begin, end)` of this rank's epoch order (its positions rank, rank +
  /// world, ...): made with the batch (on a loader thread, maybe), ...
  std::string lines(std::int64_t epoch, const std::vector<std::int64_t>& idx, std::size_t begin, std::size_t end, int world) const {
    std::string out;
    if (!on()) return out;
    char line[80];
    for (std::size_t j = begin; j < end; ++j) {
      std::snprintf(line, sizeof line, "%lld %lld %lld\n", static_cast<long long>(epoch), static_cast<long long>(j) * world + rank_,
                    static_cast<long long>(idx[j]));
      out += line;
    }
    return out;
  }
  /// ... and written when the step takes the batch (a loader makes batches ahead of the last step).
  void append(const std::string& lines) const {
    if (!on() || lines.empty()) return;
    if (std::FILE* f = std::fopen(path_.c_str(), "a")) {
      std::fputs(lines.c_str(), f);
      std::fclose(f);
    }
  }

 private:
  int rank_;
  std::string path_;
};

/// Runs the step's computation `compute` and returns the communicator failure it met, for the step's
/// agreement. With `fail_collectives` (test hook FSDP_TEST_FAIL_COLLECTIVES) this rank's collectives
/// fail as an aborted GPU communicator's do.
template <class Engine, class Compute>
std::optional<std::string> comm_failure_of(Compute&& compute, bool fail_collectives, int rank) {
  const std::string test_failure =
      "rank " + std::to_string(rank) +
      ": all_reduce did not complete within its deadline; the NCCL communicator was aborted (test hook FSDP_TEST_FAIL_COLLECTIVES)";
  std::optional<std::string> comm_failure;
  if constexpr (Engine::kCollectivesMayBePending) {
    // A GPU communicator's collectives are stream-ordered: one its watcher aborted (deadline, NCCL
    // error) surfaces at a later call of the step. Caught and agreed by the caller, so every rank stops
    // before the update; the peers' own collectives end at their deadline, so they reach the agreement too.
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
  return comm_failure;
}

/// Gradients live from a step's backward to its update only. LibTorch 1.13's Optimizer::zero_grad()
/// zeroes them in place and keeps them, so every rank carried a shard-sized gradient through the next
/// forward and backward, where activations peak (PyTorch 2 frees them by default: set_to_none).
inline void release_gradients(torch::optim::Optimizer& optimizer) {
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params()) p.mutable_grad().reset();
}

/// With release_gradients, the updates zero_grad() gave: a parameter that had a gradient in an earlier
/// step of this process and none in this one gets zeros (zero_grad() kept its gradient, zeroed, so the
/// update moved it: Adam's moments, the decay); one that never had a gradient stays skipped.
class ZeroedGradients {
 public:
  /// After the step's backward, before clipping and the update (zeros change neither). Local.
  void fill_missing(torch::optim::Optimizer& optimizer) {
    torch::NoGradGuard no_grad;
    std::size_t i = 0;
    for (auto& group : optimizer.param_groups())
      for (auto& p : group.params()) {
        if (had_.size() <= i) had_.push_back(false);
        if (p.grad().defined())
          had_[i] = true;
        else if (had_[i])
          p.mutable_grad() = torch::zeros_like(p);
        ++i;
      }
  }

 private:
  std::vector<bool> had_;  ///< per parameter, in the optimizer's order
};

/// How the run's progress is shown: a live line only for a process started directly on a terminal
/// (log.progress = auto). Under mpirun or srun the ranks' stdout is a pseudo-terminal even when the
/// job's output goes to a file.
struct ProgressStyle {
  bool live = false, quiet = false;
  static ProgressStyle of(ProgressMode mode) {
    const bool launched = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK") || std::getenv("SLURM_PROCID");
    return {mode == ProgressMode::kLive || (mode == ProgressMode::kAuto && isatty(STDOUT_FILENO) && !launched), mode == ProgressMode::kNone};
  }
};

/// The steps between two progress lines: their mean loss and throughput.
struct LogWindow {
  double loss = 0;
  std::int64_t steps = 0, samples = 0, skipped = 0;
  Clock::time_point start = Clock::now();
  double pause = 0;  ///< checkpoint and evaluation time inside the window: throughput counts training only
  double busy = 0;   ///< this rank's own work in the window's steps: their time minus communication waits
  void reset() { *this = LogWindow{}; }
};

}  // namespace fsdp::app
