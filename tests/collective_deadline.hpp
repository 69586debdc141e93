// The collective deadline of the test programs under mpirun (std and the watchdog only, no Boost: the
// programs with a main of their own use it too).
#pragma once

#include <cstdlib>
#include <string>

#include "fsdp/comm/watchdog.hpp"

/// Seconds a rank may wait in one collective before it ends the run: FSDP_TEST_COLLECTIVE_TIMEOUT_S,
/// default 60 (far longer than any collective of these tests waits; 0 turns the deadline off, e.g. in a
/// debugger).
inline double test_collective_timeout_s() {
  const char* text = std::getenv("FSDP_TEST_COLLECTIVE_TIMEOUT_S");
  return text != nullptr && *text != '\0' ? std::stod(text) : 60.0;
}

/// Arms the collective deadline (fsdp::CollectiveWatchdog): a rank left alone in a collective prints
/// which one and exits with fsdp::kWatchdogExitCode; mpirun then ends the other ranks.
inline void arm_collective_deadline(int rank) { fsdp::CollectiveWatchdog::instance().configure(test_collective_timeout_s(), rank); }
