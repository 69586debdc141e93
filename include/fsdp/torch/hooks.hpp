// fsdp::forward: the call site through which FSDP sees a nested unit's forward (torch layer).
//
// C++ modules have no forward hooks and a parent calls its children's forward directly, so a wrapped
// submodule can only free its parameters between its own forward and backward if the parent calls it
// through fsdp::forward(child, args...). A child called directly still trains correctly: FSDP then
// gathers it together with the root unit (see docs/design.md, "Nested units").
#pragma once

#include <torch/torch.h>

#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fsdp {
namespace detail {

/// What an engine does around a nested unit's forward.
class ForwardHooks {
 public:
  virtual ~ForwardHooks() = default;
  virtual void pre_forward(int unit) = 0;
  /// `outputs` are the tensors found in the result; `complete` is false if the result type was not
  /// understood (then the unit cannot be re-gathered from its outputs and stays gathered).
  virtual void post_forward(int unit, const std::vector<at::Tensor>& outputs, bool complete) = 0;
};

struct HookEntry {
  ForwardHooks* engine = nullptr;
  int unit = -1;
};

/// Module -> unit hooks. Only touched on the thread that runs forward.
inline std::unordered_map<const torch::nn::Module*, HookEntry>& hook_registry() {
  static std::unordered_map<const torch::nn::Module*, HookEntry> registry;
  return registry;
}

inline bool collect_tensors(const at::Tensor& t, std::vector<at::Tensor>& out) {
  if (t.defined()) out.push_back(t);
  return true;
}
template <class T>
bool collect_tensors(const std::vector<T>& values, std::vector<at::Tensor>& out);
template <class A, class B>
bool collect_tensors(const std::pair<A, B>& value, std::vector<at::Tensor>& out);
template <class... T>
bool collect_tensors(const std::tuple<T...>& value, std::vector<at::Tensor>& out);
/// Unknown result types carry no tensors we can see.
template <class T>
bool collect_tensors(const T&, std::vector<at::Tensor>&) {
  return false;
}
template <class T>
bool collect_tensors(const std::vector<T>& values, std::vector<at::Tensor>& out) {
  bool complete = true;
  for (const auto& v : values) complete = collect_tensors(v, out) && complete;
  return complete;
}
template <class A, class B>
bool collect_tensors(const std::pair<A, B>& value, std::vector<at::Tensor>& out) {
  const bool a = collect_tensors(value.first, out);
  const bool b = collect_tensors(value.second, out);
  return a && b;
}
template <class... T>
bool collect_tensors(const std::tuple<T...>& value, std::vector<at::Tensor>& out) {
  return std::apply([&](const auto&... v) { return (collect_tensors(v, out) && ... && true); }, value);
}

}  // namespace detail

/// Calls `module->forward(args...)`; if `module` is a nested FSDP unit, gathers its parameters before
/// and (FULL_SHARD) frees them after, arranging the re-gather for backward. Works on a ModuleHolder
/// (`torch::nn::Linear`) or a `std::shared_ptr<Impl>`. Outside FSDP it is a plain call.
template <class ModulePtr, class... Args>
auto forward(ModulePtr& module, Args&&... args) {
  const torch::nn::Module* key = &*module;
  auto& registry = detail::hook_registry();
  const auto it = registry.find(key);
  if (it == registry.end()) return module->forward(std::forward<Args>(args)...);
  const detail::HookEntry entry = it->second;
  entry.engine->pre_forward(entry.unit);
  auto result = module->forward(std::forward<Args>(args)...);
  std::vector<at::Tensor> outputs;
  const bool complete = detail::collect_tensors(result, outputs);
  entry.engine->post_forward(entry.unit, outputs, complete);
  return result;
}

}  // namespace fsdp
