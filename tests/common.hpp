// What the test programs that run under mpirun share (no LibTorch): MPI for a Boost.Test module and a
// short collective deadline, so a check that fails on one rank while the others wait in a collective
// ends the run in seconds instead of at CTest's timeout.
#pragma once

#include <boost/test/unit_test.hpp>

#include <cstdlib>
#include <string>

#include "fsdp/comm/mpi_comm.hpp"
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

/// MPI for a whole test module (BOOST_TEST_GLOBAL_FIXTURE) with the collective deadline armed.
template <int kThreadLevel = MPI_THREAD_FUNNELED>
struct MpiFixture {
  MpiFixture() : env(&boost::unit_test::framework::master_test_suite().argc, &boost::unit_test::framework::master_test_suite().argv, kThreadLevel) {
    arm_collective_deadline(fsdp::MpiComm::world().rank());
  }
  fsdp::MpiEnvironment env;
};
