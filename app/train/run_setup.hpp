// fsdp-train (app layer): what a run starts from, shared by the trainer and its echo.
#pragma once

#include <optional>
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

}  // namespace fsdp::app
