// What the test programs that run under mpirun share (no LibTorch): MPI for a Boost.Test module and a
// short collective deadline, so a check that fails on one rank while the others wait in a collective
// ends the run in seconds instead of at CTest's timeout.
#pragma once

#include <boost/test/unit_test.hpp>

#include "collective_deadline.hpp"
#include "fsdp/comm/mpi_comm.hpp"

/// MPI for a whole test module (BOOST_TEST_GLOBAL_FIXTURE) with the collective deadline armed.
template <int kThreadLevel = MPI_THREAD_FUNNELED>
struct MpiFixture {
  MpiFixture() : env(&boost::unit_test::framework::master_test_suite().argc, &boost::unit_test::framework::master_test_suite().argv, kThreadLevel) {
    arm_collective_deadline(fsdp::MpiComm::world().rank());
  }
  fsdp::MpiEnvironment env;
};
