// Auto-wrap policies: which submodules become their own FSDP unit (torch layer).
// Mirrors PyTorch's policies: none (one unit), size-based (min_num_params), module-type based
// (TRANSFORMER_BASED_WRAP) and a user predicate. The root module is always a unit. The decisions
// themselves are the core's (fsdp/core/unit_plan.hpp); this adds predicates on torch modules.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "fsdp/core/unit_plan.hpp"
#include "fsdp/errors.hpp"

namespace fsdp {

/// Short type name of a module: "torch::nn::LinearImpl" -> "Linear", "my::BlockImpl" -> "Block".
inline std::string module_type_name(const torch::nn::Module& module) {
  std::string name = module.name();
  if (const auto pos = name.rfind("::"); pos != std::string::npos) name = name.substr(pos + 2);
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
  return name;
}

/// Qualified type name of a module without LibTorch's "Impl": "torch::nn::LinearImpl" -> "torch::nn::Linear".
inline std::string module_full_type_name(const torch::nn::Module& module) { return WrapRule::without_impl(module.name()); }

/// Which submodules become units: the core's WrapRule, plus predicates that look at the torch module.
class AutoWrapPolicy {
 public:
  /// (qualified name, module, parameters in its subtree not already inside a wrapped descendant)
  using Predicate = std::function<bool(const std::string& fqn, const torch::nn::Module& module, std::int64_t nonwrapped_numel)>;

  /// No nested units: the whole model is one unit (NO_WRAP).
  static AutoWrapPolicy none() { return AutoWrapPolicy(WrapRule::none(), nullptr); }

  /// Wrap a submodule when its not-yet-wrapped parameters number at least `min_num_params`
  /// (SIZE_BASED_WRAP; decided bottom-up like PyTorch's size_based_auto_wrap_policy).
  static AutoWrapPolicy size_based(std::int64_t min_num_params) { return AutoWrapPolicy(WrapRule::size_based(min_num_params), nullptr); }

  /// Wrap every submodule whose type name is listed (TRANSFORMER_BASED_WRAP). Names match the short
  /// type name ("TransformerBlock" matches "my::TransformerBlockImpl") or the full one.
  static AutoWrapPolicy module_types(std::vector<std::string> type_names) {
    return AutoWrapPolicy(WrapRule::module_types(std::move(type_names)), nullptr);
  }

  /// Wrap where `predicate` says so.
  static AutoWrapPolicy custom(Predicate predicate, std::string description = "CUSTOM") {
    if (!predicate) throw ConfigError("custom wrap policy needs a predicate");
    return AutoWrapPolicy(WrapRule::custom([](const TreeModule&, int, std::int64_t) { return false; }, std::move(description)), std::move(predicate));
  }

  /// The rule for a tree whose module i is `modules[i]` (a custom predicate sees the torch module).
  WrapRule rule(const std::vector<const torch::nn::Module*>& modules) const {
    if (!predicate_) return rule_;
    return WrapRule::custom(
        [predicate = predicate_, &modules](const TreeModule& m, int index, std::int64_t numel) {
          return predicate(m.path, *modules.at(static_cast<std::size_t>(index)), numel);
        },
        rule_.description());
  }

  bool should_wrap(const std::string& fqn, const torch::nn::Module& module, std::int64_t nonwrapped_numel) const {
    if (predicate_) return predicate_(fqn, module, nonwrapped_numel);
    TreeModule m;
    m.path = fqn;
    m.type_name = module_type_name(module);
    m.full_type_name = module_full_type_name(module);
    return rule_.should_wrap(m, 0, nonwrapped_numel);
  }
  const std::string& description() const noexcept { return rule_.description(); }

 private:
  AutoWrapPolicy(WrapRule rule, Predicate predicate) : rule_(std::move(rule)), predicate_(std::move(predicate)) {}
  WrapRule rule_;
  Predicate predicate_;
};

}  // namespace fsdp
