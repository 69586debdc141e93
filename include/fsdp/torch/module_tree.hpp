// A torch module as the engine first sees it (torch layer, FSDP2's init): described as the core's
// ModuleTree for unit planning, and the device its units compute on.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "fsdp/core/unit_plan.hpp"
#include "fsdp/errors.hpp"
#include "fsdp/torch/deferred_init.hpp"
#include "fsdp/torch/options.hpp"
#include "fsdp/torch/wrap_policy.hpp"

namespace fsdp {

/// A torch module described for plan_units(): the tree (pre-order, as named_children() lists it), the
/// module of each tree index, and each distinct parameter tensor at its TreeParam::tensor_id (tied
/// names share one id).
struct TorchModuleTree {
  ModuleTree tree;
  std::vector<torch::nn::Module*> modules;
  std::vector<torch::Tensor> tensors;
};

inline TorchModuleTree describe_module_tree(torch::nn::Module& root) {
  TorchModuleTree out;
  std::unordered_map<c10::TensorImpl*, std::int64_t> tensor_ids;
  std::function<void(torch::nn::Module&, const std::string&, int)> visit = [&](torch::nn::Module& m, const std::string& key, int parent) {
    const int id = out.tree.add_module(parent, key, module_type_name(m), module_full_type_name(m));
    out.modules.push_back(&m);
    for (const auto& p : m.named_parameters(/*recurse=*/false)) {
      const auto [it, fresh] = tensor_ids.emplace(p.value().unsafeGetTensorImpl(), static_cast<std::int64_t>(out.tensors.size()));
      if (fresh) out.tensors.push_back(p.value());
      out.tree.add_param(id, p.key(), p.value().sizes().vec(), it->second, !p.value().requires_grad());
    }
    for (const auto& child : m.named_children()) visit(*child.value(), child.key(), id);
  };
  visit(root, "", -1);
  return out;
}

/// Where the units compute: FsdpOptions::device, or where the module's parameters are. Checked against
/// what `Comm` moves (host or device memory); the module moves there unless it was released by
/// fsdp::defer_init() (then it is moved unit by unit as it is initialized).
template <class Comm>
torch::Device resolve_compute_device(torch::nn::Module& module, const FsdpOptions& options) {
  std::optional<torch::Device> found;
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    found = p.device();
    break;
  }
  const torch::Device device = options.device ? *options.device : found.value_or(torch::Device(torch::kCPU));
  if constexpr (comm_moves_device_memory<Comm>()) {
    if (!device.is_cuda())
      throw ConfigError("this communicator moves GPU memory, but the compute device is " + device.str() +
                        ": set FsdpOptions::device to a CUDA device (or use MpiComm for CPU training)");
  } else if (!device.is_cpu()) {
    throw ConfigError("the compute device is " + device.str() +
                      ", but this communicator moves host memory only (MpiComm): use NcclComm for GPUs (fsdp.backend = \"nccl\")");
  }
  bool deferred = false;
  for (const auto& p : module.parameters(/*recurse=*/true)) deferred = deferred || detail::is_deferred(p);
  for (const auto& b : module.buffers(/*recurse=*/true)) deferred = deferred || detail::is_deferred(b);
  if (deferred && !options.param_init_fn)
    throw ConfigError(
        "the module has parameters or buffers released by fsdp::defer_init(): set FsdpOptions::param_init_fn to "
        "initialize them unit by unit");
  if (found && *found != device) {
    if (!deferred)
      module.to(device);
    else if (!found->is_cpu())
      throw ConfigError("a module released by fsdp::defer_init() must be built on the CPU; it is moved unit by unit");
  }
  return device;
}

}  // namespace fsdp
