// Memory-bounded construction (torch layer): releasing a freshly built layer's storage while keeping
// its tensors' shapes and identities, and giving it back before the engine initializes the layer.
#pragma once

#include <torch/torch.h>

#include <cstddef>

#include "fsdp/errors.hpp"

namespace fsdp {

namespace detail {
/// A tensor whose storage fsdp::defer_init() released: it has elements but no bytes.
inline bool is_deferred(const torch::Tensor& t) { return t.defined() && t.numel() > 0 && t.has_storage() && t.storage().nbytes() == 0; }

/// Gives a released tensor fresh (uninitialized) storage of its size.
inline void restore_storage(const torch::Tensor& t) {
  if (!is_deferred(t)) return;
  if (t.storage_offset() != 0 || !t.is_contiguous()) throw ConfigError("fsdp::defer_init: a released tensor is a strided view; cannot restore it");
  auto* storage = t.storage().unsafeGetStorageImpl();
  const std::size_t nbytes = static_cast<std::size_t>(t.numel()) * t.element_size();
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}
}  // namespace detail

/// Memory-bounded construction (the C++ counterpart of building on the meta device, which LibTorch
/// 1.13 cannot turn back into CPU tensors in place): releases the storage of every parameter and
/// buffer of `module` and its children, keeping their shapes, dtypes and identities. Call it on each
/// layer right after building it; FsdpOptions::param_init_fn then initializes the layers unit by unit.
inline void defer_init(torch::nn::Module& module) {
  auto release = [](const torch::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return;
    auto* storage = t.storage().unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
    storage->set_nbytes(0);
  };
  for (const auto& p : module.parameters(/*recurse=*/true)) release(p);
  for (const auto& b : module.buffers(/*recurse=*/true)) release(b);
}

}  // namespace fsdp
