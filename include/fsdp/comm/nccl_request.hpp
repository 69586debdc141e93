// NcclRequest: a pending non-blocking NCCL collective (comm layer; CUDA runtime + NCCL, no LibTorch).
// Include fsdp/comm/nccl_comm.hpp, not this file.
#pragma once

#include <memory>
#include <optional>
#include <utility>

#include "fsdp/comm/communicator.hpp"
#include "fsdp/comm/nccl_utils.hpp"

namespace fsdp {

/// A pending NCCL collective. wait() orders the compute stream after it (the host goes on; the lane
/// watches its deadline and errors until the host sees it complete). The GPU overlaps the collective
/// with whatever was queued on the compute stream after it was issued and before wait(). Keep its
/// buffers alive until wait(); a request never waited for is waited for by its destructor, so memory
/// freed afterwards on the compute stream is reused only after the collective.
class NcclRequest {
 public:
  NcclRequest() = default;
  NcclRequest(std::shared_ptr<detail::NcclState> state, cudaEvent_t done, const char* op, const detail::Deadline& deadline)
      : state_(std::move(state)), done_(done), op_(op), deadline_(deadline) {}
  NcclRequest(NcclRequest&& other) noexcept
      : state_(std::move(other.state_)), done_(std::exchange(other.done_, nullptr)), op_(other.op_), deadline_(other.deadline_) {}
  /// Completes the request this one held before taking `other`'s.
  NcclRequest& operator=(NcclRequest&& other) noexcept {
    if (this != &other) {
      complete_quietly();
      state_ = std::move(other.state_);
      done_ = std::exchange(other.done_, nullptr);
      op_ = other.op_;
      deadline_ = other.deadline_;
    }
    return *this;
  }
  NcclRequest(const NcclRequest&) = delete;
  NcclRequest& operator=(const NcclRequest&) = delete;
  ~NcclRequest() { complete_quietly(); }

  /// The compute stream waits for the collective; the host does not. Throws CommError on an NCCL
  /// error or past the deadline (counted from issue) of this or an earlier collective of the lane.
  void wait() {
    if (done_ == nullptr) return;
    const detail::CudaDeviceGuard on(state_->device);
    state_->check_usable(op_);
    finish();
  }

  /// True when the collective has completed (then as after wait()). Never blocks; throws like wait().
  bool test() {
    if (done_ == nullptr) return true;
    const detail::CudaDeviceGuard on(state_->device);
    state_->check_usable(op_);
    const cudaError_t q = cudaEventQuery(done_);
    if (q == cudaSuccess) {
      finish();
      return true;
    }
    if (q != cudaErrorNotReady) detail::throw_cuda_error("cudaEventQuery(completion event)", q, __FILE__, __LINE__);
    state_->poll_async(state_->comm, op_, __FILE__, __LINE__);
    if (deadline_->passed()) state_->deadline_passed(op_, *deadline_);
    return false;
  }

  /// The completion event (recorded on the communicator's stream), e.g. for another stream to wait on.
  cudaEvent_t event() const noexcept { return done_; }

 private:
  void finish() { state_->order_compute_after(std::exchange(done_, nullptr), op_, *deadline_); }  // the lane owns the event now
  void complete_quietly() noexcept {
    if (done_ == nullptr) return;
    try {
      wait();
    } catch (...) {  // a destructor must not throw; the communicator is aborted and the next call reports it
      if (done_ != nullptr) {
        const cudaEvent_t e = std::exchange(done_, nullptr);
        cudaEventSynchronize(e);  // aborted: its kernels end, and the event is not reused before
        cudaEventDestroy(e);
      }
    }
  }

  std::shared_ptr<detail::NcclState> state_;
  cudaEvent_t done_ = nullptr;
  const char* op_ = "";
  std::optional<detail::Deadline> deadline_;  // the collective's, set when it was issued
};

static_assert(CommRequest<NcclRequest>);

}  // namespace fsdp
