// Generic access to the tensors inside a LibTorch optimizer's per-parameter state (torch layer).
// LibTorch's state types have no common accessor, so each known type is listed here.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/errors.hpp"
#include "fsdp/torch/optim/adadelta.hpp"

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

/// Bytes held in all of an optimizer's state tensors.
inline std::int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  std::int64_t bytes = 0;
  for (const auto& [key, state] : optimizer.state())
    for (const auto& [name, t] : optimizer_state_view(*state).tensors) bytes += t.numel() * static_cast<std::int64_t>(t.element_size());
  return bytes;
}

}  // namespace fsdp
