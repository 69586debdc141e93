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
  NcclRequest(std::shared_ptr<detail::NcclState> state, std::shared_ptr<detail::CompletionEvent> done, const char* op)
      : state_(std::move(state)), done_(std::move(done)), op_(op) {}
  NcclRequest(NcclRequest&& other) noexcept = default;
  /// Completes the request this one held before taking `other`'s.
  NcclRequest& operator=(NcclRequest&& other) noexcept {
    if (this != &other) {
      complete_quietly();
      state_ = std::move(other.state_);
      done_ = std::move(other.done_);
      op_ = other.op_;
    }
    return *this;
  }
  NcclRequest(const NcclRequest&) = delete;
  NcclRequest& operator=(const NcclRequest&) = delete;
  ~NcclRequest() { complete_quietly(); }

  /// The compute stream waits for the collective; the host does not. Throws CommError on an NCCL
  /// error or past the deadline (counted from issue) of this or an earlier collective of the lane.
  void wait() {
    if (!done_) return;
    const detail::CudaDeviceGuard on(state_->device);
    state_->check_usable(op_);
    finish();
  }

  /// True when the collective has completed (then as after wait()). Never blocks; throws like wait().
  bool test() {
    if (!done_) return true;
    const detail::CudaDeviceGuard on(state_->device);
    state_->check_usable(op_);
    const cudaError_t q = cudaEventQuery(done_->event);
    if (q == cudaSuccess) {
      finish();
      return true;
    }
    if (q != cudaErrorNotReady) detail::throw_cuda_error("cudaEventQuery(completion event)", q, __FILE__, __LINE__);
    state_->poll_lane();  // the lane watches it (and every earlier one) from issue: deadline, NCCL's errors
    return false;
  }

  /// The completion event (recorded on the lane), e.g. for another stream to wait on; null once waited for.
  cudaEvent_t event() const noexcept { return done_ ? done_->event : nullptr; }

 private:
  void finish() {
    const auto done = std::exchange(done_, nullptr);
    state_->lane->order_compute_after(done->event);
    state_->poll_lane();
  }
  void complete_quietly() noexcept {
    try {
      wait();
    } catch (...) {   // a destructor must not throw; the communicator is aborted and the next call reports it
      done_.reset();  // no host wait here: the event may sit behind another communicator's hung collective
    }
  }

  std::shared_ptr<detail::NcclState> state_;
  std::shared_ptr<detail::CompletionEvent> done_;
  const char* op_ = "";
};

static_assert(CommRequest<NcclRequest>);

}  // namespace fsdp
