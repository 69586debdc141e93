// The random state a computation draws from (torch layer): the CPU generator's and, for a computation
// on a GPU, that device's default generator's, which dropout on CUDA tensors uses. Activation
// checkpointing captures it before a unit's forward and replays it for the recomputation, so the
// recomputed dropout masks are the ones of the first run on either kind of device.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <torch/torch.h>

#include <mutex>

namespace fsdp::detail {

struct RngState {
  torch::Tensor cpu;
  torch::Tensor device;  ///< the compute device's generator state; undefined for a CPU computation
  c10::Device device_of{torch::kCPU};
};

/// The default generator of `device` (the CPU's, or the GPU's with that index).
inline at::Generator default_generator(const c10::Device& device) {
  if (device.is_cpu()) return at::detail::getDefaultCPUGenerator();
  return at::globalContext().defaultGenerator(device);
}

inline torch::Tensor generator_state(at::Generator generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

inline void set_generator_state(at::Generator generator, const torch::Tensor& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

/// The state of the CPU generator and, when `compute` is not the CPU, of `compute`'s generator.
inline RngState capture_rng_state(const c10::Device& compute) {
  RngState s;
  s.cpu = generator_state(at::detail::getDefaultCPUGenerator());
  if (!compute.is_cpu()) {
    s.device_of = compute;
    s.device = generator_state(default_generator(compute));
  }
  return s;
}

/// Puts every generator `state` holds back as captured.
inline void restore_rng_state(const RngState& state) {
  set_generator_state(at::detail::getDefaultCPUGenerator(), state.cpu);
  if (state.device.defined()) set_generator_state(default_generator(state.device_of), state.device);
}

}  // namespace fsdp::detail
