// fsdp-train (app layer): what the ranks agree on: the exit codes, a failure on any rank (so that every
// rank stops the same way and none waits in a collective a failed rank never reaches), running the
// same job, and where this rank runs.
#pragma once

#include <fsdp/fsdp.hpp>
#include <sched.h>

#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "deck.hpp"
#include "run_config.hpp"

namespace fsdp::app {

// Exit codes (docs/reliability.md): 0 done, 1 failure, 2 bad input, 3 stopped by a signal after saving
// a checkpoint (rerun to continue), 4 non-finite loss or gradient norm.
inline constexpr int kExitFailure = 1;
inline constexpr int kExitBadInput = 2;
inline constexpr int kExitStopped = 3;
inline constexpr int kExitNonFinite = 4;

/// Every rank learns whether any rank failed; all throw the lowest failing rank's message.
void agree(MpiComm& world, const std::optional<std::string>& error, bool bad_input);

struct RankError : std::runtime_error {
  RankError(const std::string& what, bool bad_input) : std::runtime_error(what), bad_input(bad_input) {}
  RankError(const std::string& what, int exit_code) : std::runtime_error(what), bad_input(false), code(exit_code) {}
  bool bad_input;
  int code = 0;  ///< overrides the exit code when set
};

inline void agree(MpiComm& world, const std::optional<std::string>& error, bool bad_input) {
  const auto failure = fsdp::agree_on_failure(world, error, bad_input);
  if (!failure) return;
  std::string text = failure->message;
  if (world.size() > 1 && text.find("(reported by rank") == std::string::npos) text += " (rank " + std::to_string(failure->rank) + ")";
  throw RankError(text, failure->flagged);
}

/// A collective that some rank never entered: the ranks cannot agree on it, so it ends the job (MPI_Abort).
struct DeadlineMissed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Runs `f` on every rank; a failure on any rank becomes a RankError on all of them.
template <class F>
inline void on_all_ranks(MpiComm& world, F&& f) {
  std::optional<std::string> error;
  bool bad_input = true;
  try {
    f();
  } catch (const fsdp::ConfigError& e) {
    error = e.what();
  } catch (const fsdp::CheckpointError& e) {
    error = e.what();
  } catch (const DeadlineMissed&) {
    throw;
  } catch (const std::exception& e) {
    error = e.what();
    bad_input = false;
  }
  agree(world, error, bad_input);
}

struct Stats {
  double min = 0, avg = 0, max = 0;
};

inline Stats across_ranks(MpiComm& world, double v) {
  double mx = v, mn = -v, sum = v;
  world.all_reduce(&mx, &mx, 1, fsdp::DType::kFloat64, fsdp::ReduceOp::kMax);
  world.all_reduce(&mn, &mn, 1, fsdp::DType::kFloat64, fsdp::ReduceOp::kMax);
  world.all_reduce(&sum, &sum, 1, fsdp::DType::kFloat64, fsdp::ReduceOp::kSum);
  return {-mn, sum / world.size(), mx};
}

/// Every rank must run the same job: compares the resolved deck (its values) and the sharding plan's
/// hash with rank 0's before the first training collective; a RankError (bad input) names the first
/// rank that differs. Collective.
inline void check_same_job(MpiComm& world, const Deck& deck, std::uint64_t plan_hash) {
  std::string values;
  std::istringstream lines(deck.to_toml());
  for (std::string line; std::getline(lines, line);)
    if (!line.empty() && line[0] != '#') values += line + "\n";
  std::int64_t mine[2] = {static_cast<std::int64_t>(fsdp::fnv1a64(values) >> 1), static_cast<std::int64_t>(plan_hash >> 1)};
  std::vector<std::int64_t> all(static_cast<std::size_t>(2 * world.size()));
  world.all_gather(mine, all.data(), 2, fsdp::DType::kInt64);
  for (int r = 1; r < world.size(); ++r) {
    const bool deck_differs = all[2 * r] != all[0], plan_differs = all[2 * r + 1] != all[1];
    if (!deck_differs && !plan_differs) continue;
    throw RankError(std::string("rank ") + std::to_string(r) + " runs a different job than rank 0: " +
                        (deck_differs ? "its resolved deck differs (other --set options or deck file?)" : "its model or wrapping plan differs") +
                        "; every rank must get the same deck and options",
                    true);
  }
}

/// Where this rank runs, as resolve_run_config takes it: the world and node layout, the node's cores
/// and the CPUs this rank may run on (its affinity mask).
inline Placement placement_of_this_rank(const MpiComm::Placement& p) {
  cpu_set_t affinity;
  CPU_ZERO(&affinity);
  Placement out;
  out.world_size = p.size;
  out.nodes = p.nodes;
  out.ranks_per_node = p.local_size;
  out.node_cores = static_cast<int>(std::thread::hardware_concurrency());
  out.rank_cpus = sched_getaffinity(0, sizeof(affinity), &affinity) == 0 ? CPU_COUNT(&affinity) : 1;
  return out;
}

}  // namespace fsdp::app
