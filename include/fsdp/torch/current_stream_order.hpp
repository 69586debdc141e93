// Orders a GPU communicator's collectives against LibTorch's current CUDA stream (torch layer). The
// stream is reached through c10's device-generic interface (DeviceGuardImplInterface: record an event
// on a stream, make a stream wait for one), which every LibTorch build has, so this compiles with
// Debian's CPU LibTorch and needs no c10/cuda headers. The events are the communicator's own
// cudaEvent_t handles: CUDA's implementation records an event it is given instead of creating one.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <functional>
#include <utility>

namespace fsdp::detail {

/// The hooks NcclComm::set_compute_stream_order takes: record `event` on, and make wait for `event`,
/// the stream that is current for `device` at the moment of the call (as PyTorch's collectives use
/// the caller's current stream).
struct CurrentStreamOrder {
  std::function<void(void*)> record;
  std::function<void(void*)> wait;
};

inline CurrentStreamOrder current_stream_order(c10::Device device) {
  const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
  CurrentStreamOrder order;
  order.record = [impl, device](void* event) {
    void* handle = event;  // given, so not created; CUDA's record writes the same handle back
    impl->record(&handle, impl->getStream(device), device.index(), c10::EventFlag::PYTORCH_DEFAULT);
  };
  order.wait = [impl, device](void* event) { impl->block(event, impl->getStream(device)); };
  return order;
}

/// Orders a GPU communicator's collectives against LibTorch's current stream of `device` (as
/// PyTorch's collectives use the caller's current stream), not the legacy default stream. Every group
/// split from `world` shares its stream, so setting it there sets it for all. Other communicators, and
/// a CPU device, need nothing.
template <class Comm>
void order_collectives_with_current_stream(Comm& world, c10::Device device) {
  if constexpr (requires(Comm & c, std::function<void(void*)> f) { c.set_compute_stream_order(f, f); }) {
    if (!device.is_cuda()) return;
    auto order = current_stream_order(device);
    world.set_compute_stream_order(std::move(order.record), std::move(order.wait));
  }
}

}  // namespace fsdp::detail
