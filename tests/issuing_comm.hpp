// MpiComm declared to progress on its own, as NcclComm does (test header for the engine and checkpoint
// suites): the engine then overlaps as on a GPU, issuing non-blocking collectives from the computing
// thread, and its host waits for the communicator's stream (synchronize()) are counted.
#pragma once

#include <fsdp/comm/mpi_comm.hpp>
#include <fsdp/torch/options.hpp>

class IssuingComm : public fsdp::MpiComm {
 public:
  static constexpr bool kProgressesOnItsOwn = true;
  explicit IssuingComm(fsdp::MpiComm comm) : fsdp::MpiComm(std::move(comm)) {}
  IssuingComm split(int color, int key) const { return IssuingComm(fsdp::MpiComm::split(color, key)); }
  IssuingComm split_node() const { return IssuingComm(fsdp::MpiComm::split_node()); }
  /// The MPI communicator over the same ranks (as NcclComm::mpi()): checkpoints write through it.
  const fsdp::MpiComm& mpi() const { return *this; }
  /// NcclComm's host wait for everything queued on its stream: counted; on rank `fail_on_rank` it
  /// throws what an NCCL communicator aborted by its watcher throws.
  void synchronize() {
    ++host_waits;
    if (rank() == fail_on_rank)
      throw fsdp::CommError("rank " + std::to_string(rank()) + ": all_reduce did not complete within 2 s; the NCCL communicator was aborted",
                            "fsdp.comm.deadline");
  }
  static inline int host_waits = 0;
  static inline int fail_on_rank = -1;
};
static_assert(fsdp::comm_progresses_on_its_own<IssuingComm>());
static_assert(!fsdp::comm_progresses_on_its_own<fsdp::MpiComm>());
