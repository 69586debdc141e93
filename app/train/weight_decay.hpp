// fsdp-train (app layer): optim.no_decay. The engine's parameters are flat shards that mix many of the
// model's tensors, so torch's parameter groups cannot exempt biases or LayerNorm weights from AdamW's
// decay. Instead the optimizer runs without decay and this mask applies the decoupled decay itself,
// element by element: p *= (1 - lr * wd) where the element's tensor decays, p *= 1 elsewhere. That is
// exactly what PyTorch's AdamW does to a group with and a group without weight_decay.
#pragma once

#include <fsdp/fsdp.hpp>
#include <torch/torch.h>

#include <map>
#include <set>
#include <string>
#include <vector>

namespace fsdp::app {

/// The kinds of optim.no_decay a tensor belongs to: "bias" (a parameter named bias), "norm" (a weight
/// of a LayerNorm, RMSNorm, BatchNorm or GroupNorm), "embedding" (an Embedding's table, or a tensor tied to
/// one, like a tied LM head).
inline std::set<std::string> decay_kinds(const std::string& name, const std::map<std::string, std::string>& module_types,
                                         const std::vector<std::string>& aliases) {
  std::set<std::string> kinds;
  auto of_name = [&](const std::string& n) {
    const auto dot = n.rfind('.');
    const std::string module = dot == std::string::npos ? "" : n.substr(0, dot), key = dot == std::string::npos ? n : n.substr(dot + 1);
    const auto it = module_types.find(module);
    const std::string type = it == module_types.end() ? "" : it->second;
    if (key == "bias") kinds.insert("bias");
    if (type == "LayerNorm" || type == "RMSNorm" || type == "GroupNorm" || type.rfind("BatchNorm", 0) == 0) kinds.insert("norm");
    if (type == "Embedding") kinds.insert("embedding");
  };
  of_name(name);
  for (const auto& a : aliases) of_name(a);
  return kinds;
}

/// Per-element decay factors of what this rank's optimizer updates, for optim.no_decay.
class WeightDecayMask {
 public:
  template <class Engine>
  WeightDecayMask(Engine& model, const std::vector<std::string>& no_decay) {
    std::map<std::string, std::string> module_types;
    for (const auto& m : model.module()->named_modules("", /*include_self=*/true)) module_types[m.key()] = fsdp::module_type_name(*m.value());
    const std::set<std::string> exempt(no_decay.begin(), no_decay.end());
    for (const auto& u : model.sharded_units()) {
      Unit unit;
      unit.optimized = u.optimized;  // what the optimizer updates: the shard or its replica part
      if (!u.empty() && !u.frozen) {
        auto decays = torch::zeros({u.shard.numel()}, torch::kBool);  // padding: no decay (it is zero)
        for (const auto& slice : u.layout.slices(u.shard_rank)) {
          const auto& name = u.param_names[static_cast<std::size_t>(slice.param_index)];
          const auto aliases = model.tied_parameter_aliases().find(name);
          const auto kinds =
              decay_kinds(name, module_types, aliases == model.tied_parameter_aliases().end() ? std::vector<std::string>{} : aliases->second);
          bool decay = true;
          for (const auto& k : kinds) decay = decay && !exempt.count(k);
          if (decay) decays.narrow(0, slice.shard_offset, slice.numel).fill_(true);
        }
        unit.decays = u.optimized_part_of(decays).to(u.optimized.device());
      }
      units_.push_back(std::move(unit));
    }
  }

  /// AdamW's decoupled decay at learning rate `lr`, before the optimizer's step (which runs with no
  /// decay of its own). Local.
  void apply(double lr, double weight_decay) {
    if (weight_decay == 0) return;
    torch::NoGradGuard no_grad;
    // The factor rounded to float once, as PyTorch's p.mul_(1 - lr * wd) rounds its scalar.
    const float factor = static_cast<float>(1.0 - lr * weight_decay);
    for (auto& u : units_) {
      if (!u.decays.defined()) continue;
      auto values = u.optimized.detach();
      values.mul_(torch::where(u.decays, torch::full({}, factor, values.options()), torch::ones({}, values.options())));
    }
  }

  /// Elements this rank's optimizer updates that decay (for tests and the echo).
  std::int64_t decaying_elements() const {
    std::int64_t n = 0;
    for (const auto& u : units_)
      if (u.decays.defined()) n += u.decays.sum().item<std::int64_t>();
    return n;
  }

 private:
  struct Unit {
    torch::Tensor optimized, decays;
  };
  std::vector<Unit> units_;
};

}  // namespace fsdp::app
