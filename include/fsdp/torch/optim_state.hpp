// Generic access to the tensors inside a LibTorch optimizer's per-parameter state (torch layer).
// LibTorch's state types have no common accessor, so each known type is listed here.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/errors.hpp"
#include "fsdp/torch/optim/adadelta.hpp"
#include "fsdp/torch/optim/bf16_moments_adam.hpp"
#include "fsdp/torch/torch_compat.hpp"

namespace fsdp {

/// Named tensors and integer step of one parameter's optimizer state.
struct OptimizerStateView {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  std::int64_t step = 0;
};

/// The tensors of `state`, named as in torch.optim state dicts. Throws for unknown state types.
inline OptimizerStateView optimizer_state_view(const torch::optim::OptimizerParamState& state) {
  OptimizerStateView v;
  auto add = [&v](const char* name, const torch::Tensor& t) {
    if (t.defined()) v.tensors.emplace_back(name, t);
  };
  auto add_adam_like = [&](const auto* s) {  // Adam and AdamW keep the same state under different types
    add("exp_avg", s->exp_avg());
    add("exp_avg_sq", s->exp_avg_sq());
    add("max_exp_avg_sq", s->max_exp_avg_sq());
    v.step = s->step();
  };
  if (const auto* s = dynamic_cast<const torch::optim::SGDParamState*>(&state)) {
    add("momentum_buffer", s->momentum_buffer());
  } else if (const auto* s = dynamic_cast<const torch::optim::AdamParamState*>(&state)) {
    add_adam_like(s);
  } else if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(&state)) {
    add_adam_like(s);
  } else if (const auto* s = dynamic_cast<const torch::optim::AdagradParamState*>(&state)) {
    add("sum", s->sum());
    v.step = s->step();
  } else if (const auto* s = dynamic_cast<const torch::optim::RMSpropParamState*>(&state)) {
    add("square_avg", s->square_avg());
    add("momentum_buffer", s->momentum_buffer());
    add("grad_avg", s->grad_avg());
    v.step = s->step();
  } else if (const auto* s = dynamic_cast<const optim::AdadeltaParamState*>(&state)) {
    add("square_avg", s->square_avg());
    add("acc_delta", s->acc_delta());
    v.step = s->step();
  } else {
    throw ConfigError("unknown optimizer state type " + std::string(typeid(state).name()));
  }
  return v;
}

/// The key under which LibTorch optimizers keep the state of parameter `p` (its type depends on the
/// LibTorch version: torch_compat.hpp).
inline torch_compat::OptimizerStateKey optimizer_state_key(const torch::Tensor& p) { return torch_compat::optimizer_state_key(p); }

/// The optimizer's kind as written to checkpoints ("SGD", "Adam", ...). Throws for unknown types.
inline std::string optimizer_kind(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return "SGD";
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return "AdamW";
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return "Adam";
  if (dynamic_cast<const torch::optim::Adagrad*>(&optimizer)) return "Adagrad";
  if (dynamic_cast<const torch::optim::RMSprop*>(&optimizer)) return "RMSprop";
  if (dynamic_cast<const optim::Adadelta*>(&optimizer)) return "Adadelta";
  throw ConfigError(std::string("unsupported optimizer type ") + typeid(optimizer).name() +
                    " (supported: SGD, Adam, AdamW, Adagrad, RMSprop, Adadelta)");
}

/// The dtype `optimizer` keeps the state of parameter `p` in: bf16 for the bf16-moment Adams, the
/// parameter's own otherwise. A checkpoint's state is converted to it on load, so a checkpoint written
/// with either setting loads into the other.
inline c10::ScalarType optimizer_state_dtype(const torch::optim::Optimizer& optimizer, const torch::Tensor& p) {
  if (dynamic_cast<const optim::AdamBf16Moments*>(&optimizer) || dynamic_cast<const optim::AdamWBf16Moments*>(&optimizer))
    return optim::AdamBf16Moments::kStateDtype;
  return p.scalar_type();
}

/// A fresh per-parameter state for `optimizer` holding `view` (the inverse of optimizer_state_view).
/// Names not used by the optimizer's state are an error.
inline std::unique_ptr<torch::optim::OptimizerParamState> make_optimizer_state(const torch::optim::Optimizer& optimizer,
                                                                               const OptimizerStateView& view) {
  const std::string kind = optimizer_kind(optimizer);
  auto tensor = [&](const char* name) {
    for (const auto& [n, t] : view.tensors)
      if (n == name) return t;
    return torch::Tensor();
  };
  std::vector<std::string> known;
  std::unique_ptr<torch::optim::OptimizerParamState> out;
  if (kind == "SGD") {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(tensor("momentum_buffer"));
    known = {"momentum_buffer"};
    out = std::move(s);
  } else if (kind == "Adam" || kind == "AdamW") {
    auto fill = [&](auto s) {
      s->exp_avg(tensor("exp_avg"));
      s->exp_avg_sq(tensor("exp_avg_sq"));
      s->max_exp_avg_sq(tensor("max_exp_avg_sq"));
      s->step(view.step);
      return s;
    };
    if (kind == "Adam")
      out = fill(std::make_unique<torch::optim::AdamParamState>());
    else
      out = fill(std::make_unique<torch::optim::AdamWParamState>());
    known = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  } else if (kind == "Adagrad") {
    auto s = std::make_unique<torch::optim::AdagradParamState>();
    s->sum(tensor("sum"));
    s->step(view.step);
    known = {"sum"};
    out = std::move(s);
  } else if (kind == "RMSprop") {
    auto s = std::make_unique<torch::optim::RMSpropParamState>();
    s->square_avg(tensor("square_avg"));
    s->momentum_buffer(tensor("momentum_buffer"));
    s->grad_avg(tensor("grad_avg"));
    s->step(view.step);
    known = {"square_avg", "momentum_buffer", "grad_avg"};
    out = std::move(s);
  } else {
    auto s = std::make_unique<optim::AdadeltaParamState>();
    s->square_avg(tensor("square_avg"));
    s->acc_delta(tensor("acc_delta"));
    s->step(view.step);
    known = {"square_avg", "acc_delta"};
    out = std::move(s);
  }
  for (const auto& [name, t] : view.tensors)
    if (std::find(known.begin(), known.end(), name) == known.end())
      throw ConfigError("optimizer state '" + name + "' does not belong to a " + kind + " optimizer");
  // The tensors a step of each kind reads whenever it has state (the others depend on its options):
  // without one, the step would meet an undefined tensor.
  std::vector<std::string> required = {known.front()};
  if (kind == "Adam" || kind == "AdamW" || kind == "Adadelta") required = {known[0], known[1]};
  // ... and those its options make it read (the optimizer's defaults; fsdp's groups share them).
  const auto& d = optimizer.defaults();
  if ((kind == "Adam" && static_cast<const torch::optim::AdamOptions&>(d).amsgrad()) ||
      (kind == "AdamW" && static_cast<const torch::optim::AdamWOptions&>(d).amsgrad()))
    required.emplace_back("max_exp_avg_sq");
  if (kind == "RMSprop") {
    const auto& o = static_cast<const torch::optim::RMSpropOptions&>(d);
    if (o.momentum() > 0) required.emplace_back("momentum_buffer");
    if (o.centered()) required.emplace_back("grad_avg");
  }
  for (const auto& name : required)
    if (!tensor(name.c_str()).defined()) throw ConfigError("optimizer state '" + name + "' of a " + kind + " optimizer is missing");
  return out;
}

/// An optimizer of the same type and default options as `like`, over `groups` (a checkpoint snapshot's
/// stand-in, whose parameters and state are host copies of the live ones).
inline std::unique_ptr<torch::optim::Optimizer> make_optimizer_like(const torch::optim::Optimizer& like,
                                                                    std::vector<torch::optim::OptimizerParamGroup> groups) {
  const std::string kind = optimizer_kind(like);
  auto make = [&](auto* type, const auto& defaults) -> std::unique_ptr<torch::optim::Optimizer> {
    using Type = std::remove_pointer_t<decltype(type)>;
    return std::make_unique<Type>(std::move(groups), defaults);
  };
  const auto& d = like.defaults();
  if (kind == "SGD") return make(static_cast<torch::optim::SGD*>(nullptr), static_cast<const torch::optim::SGDOptions&>(d));
  if (kind == "Adam") return make(static_cast<torch::optim::Adam*>(nullptr), static_cast<const torch::optim::AdamOptions&>(d));
  if (kind == "AdamW") return make(static_cast<torch::optim::AdamW*>(nullptr), static_cast<const torch::optim::AdamWOptions&>(d));
  if (kind == "Adagrad") return make(static_cast<torch::optim::Adagrad*>(nullptr), static_cast<const torch::optim::AdagradOptions&>(d));
  if (kind == "RMSprop") return make(static_cast<torch::optim::RMSprop*>(nullptr), static_cast<const torch::optim::RMSpropOptions&>(d));
  return make(static_cast<optim::Adadelta*>(nullptr), static_cast<const optim::AdadeltaOptions&>(d));
}

/// Creates now, for every parameter of a LibTorch Adam or AdamW without state, what its first step
/// would create (step 0, zero moments, and max_exp_avg_sq under amsgrad): the updates stay the same
/// bits. Created lazily, the state takes its memory in the holes the first backward leaves, and glibc's
/// heap grows by them in the next steps (docs/performance.md: 134M GPT at 4 ranks); created before
/// training, it sits beside the shards. Other optimizers (and the bf16-moment Adams) keep their own
/// first-step creation. Returns the number of states created. Local.
inline std::int64_t create_adam_state_ahead(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const optim::AdamBf16Moments*>(&optimizer) || dynamic_cast<const optim::AdamWBf16Moments*>(&optimizer)) return 0;
  const bool adam = dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr;
  if (!adam && !dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return 0;
  std::int64_t created = 0;
  torch::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    const bool amsgrad = adam ? static_cast<const torch::optim::AdamOptions&>(group.options()).amsgrad()
                              : static_cast<const torch::optim::AdamWOptions&>(group.options()).amsgrad();
    for (auto& p : group.params()) {
      const auto key = optimizer_state_key(p);
      if (optimizer.state().count(key)) continue;
      OptimizerStateView fresh{.tensors = {{"exp_avg", torch::zeros_like(p, at::MemoryFormat::Preserve)},
                                           {"exp_avg_sq", torch::zeros_like(p, at::MemoryFormat::Preserve)}},
                               .step = 0};
      if (amsgrad) fresh.tensors.emplace_back("max_exp_avg_sq", torch::zeros_like(p, at::MemoryFormat::Preserve));
      optimizer.state()[key] = make_optimizer_state(optimizer, fresh);
      ++created;
    }
  }
  return created;
}

/// Bytes held in all of an optimizer's state tensors.
inline std::int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  std::int64_t bytes = 0;
  for (const auto& [key, state] : optimizer.state())
    for (const auto& [name, t] : optimizer_state_view(*state).tensors) bytes += t.numel() * static_cast<std::int64_t>(t.element_size());
  return bytes;
}

}  // namespace fsdp
