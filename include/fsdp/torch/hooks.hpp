// fsdp::forward: the call site through which FSDP sees a nested unit's forward (torch layer).
//
// C++ modules have no forward hooks and a parent calls its children's forward directly, so a wrapped
// submodule can only free its parameters between its own forward and backward if the parent calls it
// through fsdp::forward(child, args...). A child called directly still trains correctly: FSDP then
// gathers it together with the root unit (see docs/design.md, "Nested units").
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fsdp/torch/registry.hpp"
#include "fsdp/torch/rng_state.hpp"

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
  /// For a unit whose forward is to be recomputed in backward (activation checkpointing) while grad
  /// mode is on: a tensor that requires grad and ties the recomputation into the graph (the unit's
  /// flat shard). Undefined otherwise.
  virtual at::Tensor checkpoint_anchor(int unit) = 0;
  /// Where the units compute: the generators a recomputation must replay are that device's and the CPU's.
  virtual c10::Device recompute_device() const = 0;
  /// Around the backward a recomputed unit runs inside the outer one: a gradient reaching another
  /// unit there (an ancestor's weight the unit uses) must wait for that unit's own backward.
  virtual void recomputed_backward(int unit, bool begins) = 0;
  /// A fsdp::linear_releasing_weight of `unit` ran forward: its backward will call
  /// release_before_gradient once (the engine frees nothing while another such call is still to come).
  virtual void will_release_before_gradient(int unit) = 0;
  /// In backward, this node no longer reads `weight` (a parameter of `unit`): its gradient alone
  /// remains to be computed. The engine frees the unit's gathered buffer now if no other node can read
  /// it (fsdp::linear_releasing_weight).
  virtual void release_before_gradient(int unit, const at::Tensor& weight) = 0;
  /// The unit's forward just run is undone in backward without its parameters (an embedding lookup):
  /// its backward needs no gather (fsdp::backward_reads_no_parameter).
  virtual void backward_reads_no_parameter(int unit) = 0;
};

struct HookEntry {
  ForwardHooks* engine = nullptr;
  int unit = -1;
};

/// Module -> unit hooks of every live engine.
inline LockedMap<const torch::nn::Module*, HookEntry>& hook_registry() {
  static LockedMap<const torch::nn::Module*, HookEntry> registry;
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

/// The recomputation of a checkpointed unit's forward, kept in the autograd context.
struct Recompute : torch::CustomClassHolder {
  std::function<at::Tensor(const std::vector<at::Tensor>&)> run;
  ForwardHooks* engine = nullptr;
  int unit = -1;
};

/// Activation checkpointing: forward runs the unit without recording a graph; backward restores the
/// RNG state of the forward (CPU and compute device: dropout draws the same masks), runs it again with grad, and
/// back-propagates through it. The unit's parameters reach their UnitGather node from there, which
/// reduces their gradients as usual; `anchor` (the unit's shard) only makes the output require grad.
struct CheckpointedForward : public torch::autograd::Function<CheckpointedForward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, c10::intrusive_ptr<Recompute> recompute, at::Tensor anchor,
                            c10::Device compute_device, at::TensorList inputs) {
    (void)anchor;
    const RngState rng = capture_rng_state(compute_device);
    ctx->saved_data["rng_cpu"] = rng.cpu;
    if (rng.device.defined()) {
      ctx->saved_data["rng_device"] = rng.device;
      ctx->saved_data["rng_device_of"] = rng.device_of;
    }
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(c10::static_intrusive_pointer_cast<torch::CustomClassHolder>(recompute));
    ctx->save_for_backward(inputs.vec());
    torch::NoGradGuard no_grad;
    return recompute->run(inputs.vec());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto recompute = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    std::vector<at::Tensor> inputs;
    for (const auto& t : ctx->get_saved_variables()) inputs.push_back(t.detach().requires_grad_(t.requires_grad()));
    RngState first_run;
    first_run.cpu = ctx->saved_data["rng_cpu"].toTensor();
    if (ctx->saved_data.count("rng_device")) {
      first_run.device = ctx->saved_data["rng_device"].toTensor();
      first_run.device_of = ctx->saved_data["rng_device_of"].toDevice();
    }
    const RngState now = capture_rng_state(first_run.device_of);
    restore_rng_state(first_run);
    at::Tensor out;
    {
      torch::AutoGradMode enable(true);
      out = recompute->run(inputs);
    }
    restore_rng_state(now);
    if (out.requires_grad()) {
      struct InRecomputedBackward {
        Recompute& r;
        explicit InRecomputedBackward(Recompute& recompute) : r(recompute) { r.engine->recomputed_backward(r.unit, true); }
        ~InRecomputedBackward() { r.engine->recomputed_backward(r.unit, false); }
      } scope(*recompute);
      torch::autograd::backward({out}, {grads[0]});
    }
    torch::autograd::variable_list result = {at::Tensor(), at::Tensor(), at::Tensor()};  // recompute, anchor, compute_device
    for (const auto& t : inputs) result.push_back(t.requires_grad() ? t.grad() : at::Tensor());
    return result;
  }
};

template <class T>
inline constexpr bool is_tensor_v = std::is_same_v<std::decay_t<T>, at::Tensor>;

/// y = x W^T whose backward computes x's gradient first (the one product that reads W), then tells
/// the engine that holds `owner` as a unit, then computes W's gradient (from x and y's gradient).
/// The products are LibTorch's own for F::linear's backward, in the same form: the same bits.
struct LinearReleasingWeight : public torch::autograd::Function<LinearReleasingWeight> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                                                const torch::nn::Module* owner) {
    ctx->save_for_backward({input, weight});
    ctx->saved_data["owner"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(owner));
    return {torch::nn::functional::linear(input, weight)};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor input = saved[0];
    at::Tensor weight = saved[1];
    saved.clear();
    const at::Tensor& grad = grads[0];
    const at::Tensor grad_2d = grad.reshape({-1, grad.size(-1)});
    at::Tensor grad_input, grad_weight;
    if (ctx->needs_input_grad(0)) grad_input = grad_2d.mm(weight).reshape(input.sizes());
    const auto* owner = reinterpret_cast<const torch::nn::Module*>(static_cast<std::intptr_t>(ctx->saved_data["owner"].toInt()));
    if (const auto found = hook_registry().find(owner)) found->engine->release_before_gradient(found->unit, weight);
    weight = at::Tensor();
    if (ctx->needs_input_grad(1)) grad_weight = grad_2d.t().mm(input.reshape({-1, input.size(-1)}));
    return {grad_input, grad_weight, at::Tensor()};
  }
};

}  // namespace detail

/// Declares, after `fsdp::forward(owner, ...)`, that no backward node reads the parameters of
/// `owner`: its forward's gradient comes from its inputs alone (an embedding lookup: its weight's
/// gradient is a scatter of the output's gradient by the indices), and no other module uses them
/// (not for a weight tied to an output projection). When `owner` is an FSDP unit, backward then does
/// not all-gather it again: under FULL_SHARD a vocabulary-sized embedding is gathered once per step,
/// for forward, and is not held beside its gradient at the end of backward. Until the next root forward.
inline void backward_reads_no_parameter(const torch::nn::Module& owner) {
  if (!torch::GradMode::is_enabled()) return;
  if (const auto found = detail::hook_registry().find(&owner)) found->engine->backward_reads_no_parameter(found->unit);
}

/// `torch::nn::functional::linear(input, weight)` (no bias) for the forward of a module `owner` whose
/// only parameter is `weight`, such as a language model's output projection to the vocabulary, called
/// through `fsdp::forward(owner, ...)`. When `owner` is an FSDP unit of its own whose gathered buffer
/// backward would otherwise hold (FULL_SHARD, SHARD_GRAD_OP, or a low-precision or offloaded copy),
/// its backward frees the gathered weight as soon as the input's gradient is computed, before the
/// weight's gradient exists: the two vocabulary-sized matrices are never held at once (a 32000 x 768
/// head: 94 MiB less at the step's peak). The weight may be read by several such calls, and by no
/// other operation of the step. The results are F::linear's, bit for bit, wherever it is used.
inline at::Tensor linear_releasing_weight(const torch::nn::Module& owner, const at::Tensor& input, const at::Tensor& weight) {
  if (!torch::GradMode::is_enabled() || !weight.requires_grad()) return torch::nn::functional::linear(input, weight);
  const auto found = detail::hook_registry().find(&owner);
  if (!found) return torch::nn::functional::linear(input, weight);
  found->engine->will_release_before_gradient(found->unit);
  return detail::LinearReleasingWeight::apply(input, weight, &owner)[0];
}

/// Calls `module->forward(args...)`; if `module` is a nested FSDP unit, gathers its parameters before
/// and (FULL_SHARD) frees them after, arranging the re-gather for backward. Works on a ModuleHolder
/// (`torch::nn::Linear`) or a `std::shared_ptr<Impl>`. Outside FSDP it is a plain call.
template <class ModulePtr, class... Args>
auto forward(ModulePtr& module, Args&&... args) {
  const torch::nn::Module* key = &*module;
  const auto found = detail::hook_registry().find(key);
  if (!found) return module->forward(std::forward<Args>(args)...);
  const detail::HookEntry entry = *found;
  entry.engine->pre_forward(entry.unit);
  using Result = decltype(module->forward(std::forward<Args>(args)...));
  if constexpr ((detail::is_tensor_v<Args> && ...) && std::is_same_v<std::decay_t<Result>, at::Tensor> && sizeof...(Args) > 0) {
    const at::Tensor anchor = entry.engine->checkpoint_anchor(entry.unit);
    if (anchor.defined()) {
      auto recompute = c10::make_intrusive<detail::Recompute>();
      recompute->engine = entry.engine;
      recompute->unit = entry.unit;
      auto raw = &*module;
      recompute->run = [raw](const std::vector<at::Tensor>& in) {
        return [&]<std::size_t... I>(std::index_sequence<I...>) { return raw->forward(in[I]...); }
        (std::index_sequence_for<Args...>{});
      };
      std::vector<at::Tensor> inputs = {at::Tensor(args)...};
      at::Tensor result = detail::CheckpointedForward::apply(recompute, anchor, entry.engine->recompute_device(), at::TensorList(inputs));
      entry.engine->post_forward(entry.unit, {result}, true);
      return Result(result);
    }
  }
  auto result = module->forward(std::forward<Args>(args)...);
  std::vector<at::Tensor> outputs;
  const bool complete = detail::collect_tensors(result, outputs);
  entry.engine->post_forward(entry.unit, outputs, complete);
  return result;
}

}  // namespace fsdp
