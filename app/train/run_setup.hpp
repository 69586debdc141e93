// fsdp-train (app layer): what a run starts from, shared by the trainer and its echo, and the choice
// of the engine's communicator type.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>

#include "deck.hpp"
#include "plan/fit_check.hpp"
#include "run_config.hpp"
#include "train/ranks.hpp"
#include "train/timing.hpp"

namespace fsdp::app {

/// What a run starts from before the engine's type is known: the rank's world, the deck as parsed
/// and as resolved for this placement, and the memory verdict (unset with run.memory_check = off).
struct RunSetup {
  MpiComm& world;
  MpiComm::Placement placement;  ///< the world and node layout (asked once: placement() is collective)
  const Deck& deck;
  const RunConfig& cfg;
  std::string deck_path;
  std::optional<FitVerdict> fit;
  Clock::time_point wall_start;
};

/// The one place that picks the engine's communicator type from fsdp.backend: runs
/// `f.template operator()<Comm>()` with MpiComm (CPU tensors) or, built with NCCL, NcclComm (GPUs).
template <class F>
int with_communicator(const RunConfig& cfg, F&& f) {
  if (cfg.fsdp.backend_resolved == Backend::kNccl) {
#ifdef FSDP_WITH_NCCL
    return f.template operator()<fsdp::NcclComm>();
#else
    throw std::logic_error("fsdp.backend resolved to nccl in a build without NCCL");  // resolve_run_config refuses it
#endif
  }
  return f.template operator()<MpiComm>();
}

}  // namespace fsdp::app
