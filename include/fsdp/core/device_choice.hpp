// Which GPU a rank computes on (core layer: std only, no CUDA): a pure function of what the launcher
// gives the process, so that every launcher layout is tested without a device. Launchers differ:
// mpirun and plain srun show every GPU of the node to every task (the node-local rank picks one),
// srun --gpus-per-task=1 or --gpu-bind=single:1 show each task only its own (device 0 is the task's).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/errors.hpp"

namespace fsdp {

/// The CUDA device index for a rank that sees `visible_count` devices: `requested` when >= 0 (an
/// explicit choice, which must be visible); else the only visible device; else the node-local rank
/// modulo the visible count (ranks of a node on distinct devices while there are enough). Throws
/// ConfigError naming what is missing.
inline int choose_device(int requested, int local_rank, int visible_count) {
  if (visible_count <= 0) throw ConfigError("no CUDA device is visible to this rank");
  if (requested >= 0) {
    if (requested >= visible_count)
      throw ConfigError("device " + std::to_string(requested) + " was asked for but this rank sees " + std::to_string(visible_count) +
                        " device(s) (indices 0-" + std::to_string(visible_count - 1) + ", after CUDA_VISIBLE_DEVICES)");
    return requested;
  }
  if (visible_count == 1) return 0;
  if (local_rank < 0)
    throw ConfigError("this rank sees " + std::to_string(visible_count) + " devices and has no node-local rank to choose one (set the device)");
  return local_rank % visible_count;
}

/// The first two node-local ranks whose device identities (e.g. PCI bus ids; empty: no device) are
/// equal, or nullopt: NCCL cannot put two ranks of a communicator on one GPU.
inline std::optional<std::pair<int, int>> first_shared_device(const std::vector<std::string>& identities) {
  for (std::size_t a = 0; a < identities.size(); ++a)
    for (std::size_t b = a + 1; b < identities.size(); ++b)
      if (!identities[a].empty() && identities[a] == identities[b]) return std::pair{static_cast<int>(a), static_cast<int>(b)};
  return std::nullopt;
}

}  // namespace fsdp
