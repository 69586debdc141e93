// The one place where fsdp's torch layer meets LibTorch API differences between the versions it builds
// against: Debian's LibTorch 1.13 (the CPU machines) and PyTorch 2.x's LibTorch (GPU nodes, 2.11). The
// engine calls the functions here instead of the differing API, so no version test appears elsewhere.
// Only differences confirmed in PyTorch's sources are here (docs/gpu.md, "The GPU kit").
#pragma once

#include <torch/torch.h>
#include <torch/version.h>

#include <string>
#include <type_traits>
#include <utility>

/// True when the LibTorch being compiled against is at least MAJOR.MINOR.
#define FSDP_TORCH_AT_LEAST(major, minor) (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace fsdp::torch_compat {

// ---- optimizer state keys ----------------------------------------------------------------------
// torch::optim::Optimizer keeps each parameter's state in a map keyed by the parameter's TensorImpl:
// up to 2.1 by its address printed as a string (c10::guts::to_string(p.unsafeGetTensorImpl())), from
// 2.2 on by the address itself (void*; pytorch/pytorch#108480, which also removed c10::guts::to_string).
#if FSDP_TORCH_AT_LEAST(2, 2)
using OptimizerStateKey = void*;
inline OptimizerStateKey optimizer_state_key(const at::Tensor& p) { return p.unsafeGetTensorImpl(); }
#else
using OptimizerStateKey = std::string;
inline OptimizerStateKey optimizer_state_key(const at::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }
#endif
// A LibTorch whose map disagrees with the version test stops the build here, not at run time.
static_assert(
    std::is_same_v<OptimizerStateKey, typename std::remove_reference_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type>,
    "fsdp/torch/torch_compat.hpp: torch::optim::Optimizer::state()'s key type is not the one expected for this LibTorch version");

}  // namespace fsdp::torch_compat
