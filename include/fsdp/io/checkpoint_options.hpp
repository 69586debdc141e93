// What a checkpoint call is asked to do and what it reports (io layer, the public types of
// fsdp/io/checkpoint.hpp): the state dict types, the training position stored beside the model,
// the options of saves and loads, and their results.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/core/strategy.hpp"
#include "fsdp/errors.hpp"

namespace fsdp {

/// What a checkpoint holds and who writes it (names as in PyTorch's StateDictType).
enum class StateDictType {
  FULL_STATE_DICT,     ///< rank 0 gathers one unit at a time and writes one file
  SHARDED_STATE_DICT,  ///< every rank writes its part of one file in parallel (MPI-IO)
  LOCAL_STATE_DICT,    ///< every rank writes its raw flat shard to its own file; same world size and plan only
};

inline const char* to_string(StateDictType t) noexcept {
  switch (t) {
    case StateDictType::FULL_STATE_DICT: return "FULL_STATE_DICT";
    case StateDictType::SHARDED_STATE_DICT: return "SHARDED_STATE_DICT";
    case StateDictType::LOCAL_STATE_DICT: return "LOCAL_STATE_DICT";
  }
  return "?";
}

inline constexpr std::array<StateDictType, 3> kStateDictTypes = {StateDictType::FULL_STATE_DICT, StateDictType::SHARDED_STATE_DICT,
                                                                 StateDictType::LOCAL_STATE_DICT};

/// Parses "SHARDED_STATE_DICT", "full_state_dict", ...; throws ConfigError naming the valid values.
inline StateDictType parse_state_dict_type(std::string_view text) { return detail::parse_enum_name(text, kStateDictTypes, "state dict type"); }

/// Training progress stored next to the model: what resuming needs besides parameters and
/// optimizer state.
struct TrainState {
  std::int64_t step = 0;                    ///< optimizer steps taken
  std::int64_t epoch = 0;                   ///< data position: epoch ...
  std::int64_t sample_index = 0;            ///< ... and the next sample within it
  std::map<std::string, double> scheduler;  ///< LR scheduler state (e.g. {"last_epoch": 12, "base_lr": 3e-4})
  /// The application's data position beyond epoch and sample_index (e.g. a mixture's per-source
  /// positions), as named counters in /train/data; empty in checkpoints that have none.
  std::map<std::string, std::int64_t> data;
  std::string deck;  ///< the input deck text (rank 0's is written)
  /// Set by loading: whether this rank's CPU RNG state was restored (only at the saving world size) ...
  bool rng_restored = false;
  /// ... and, on a GPU, its device generator's (/rng/cuda; not in a checkpoint saved by a CPU run).
  bool device_rng_restored = false;
};

struct CheckpointOptions {
  StateDictType state_dict_type = StateDictType::SHARDED_STATE_DICT;
  /// Keep the newest `keep_last` checkpoints in the folder, delete older ones after a commit; 0 keeps all.
  int keep_last = 0;
  /// FULL_STATE_DICT loading: only rank 0 reads the file and broadcasts one unit at a time (the file
  /// may sit on rank 0's disk only). Saving FULL always writes from rank 0 only.
  bool rank0_only = true;
  /// Store and restore each rank's CPU RNG state.
  bool save_rng_state = true;
  /// Loading restores the stored RNG state (off for a start from another run's weights only).
  bool load_rng_state = true;
  /// Save and load first wait at most this long for every rank to arrive; a call made on some ranks
  /// only then fails with CommError (fsdp.comm.deadline) instead of hanging. <= 0 waits forever.
  double collective_timeout_s = 600;
  /// Called on every rank with the step being saved at "writing" (parameters written, files still
  /// open), "written" (files closed, not yet committed) and "committed"; an asynchronous save's I/O
  /// thread also calls it at "copying", before it copies what a background copy left. For tests that
  /// crash or hold a save half way; leave empty otherwise.
  std::function<void(const std::string& stage, std::int64_t step)> on_stage;
};

struct SaveResult {
  std::string path;                   ///< the committed checkpoint (file or LOCAL folder)
  std::int64_t bytes = 0;             ///< its size on disk
  double seconds = 0;                 ///< wall time of the save on this rank
  std::vector<std::string> pruned;    ///< older checkpoints removed by keep_last
  std::vector<std::string> warnings;  ///< e.g. an old checkpoint that could not be deleted (rank 0)
};

struct ResumeResult {
  std::string path;                    ///< the checkpoint loaded; empty if none was usable
  std::vector<std::string> skipped;    ///< "<name>: <why>" for each checkpoint not loaded, and what was wrong with `latest`
  std::vector<std::string> set_aside;  ///< checkpoints past the one loaded, moved to abandoned/ (another trajectory)
};

}  // namespace fsdp
