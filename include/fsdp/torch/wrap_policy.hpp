// Auto-wrap policies: which submodules become their own FSDP unit (torch layer).
// Mirrors PyTorch's policies: none (one unit), size-based (min_num_params), module-type based
// (TRANSFORMER_BASED_WRAP) and a user predicate. The root module is always a unit.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "fsdp/errors.hpp"

namespace fsdp {

/// Short type name of a module: "torch::nn::LinearImpl" -> "Linear", "my::BlockImpl" -> "Block".
inline std::string module_type_name(const torch::nn::Module& module) {
  std::string name = module.name();
  if (const auto pos = name.rfind("::"); pos != std::string::npos) name = name.substr(pos + 2);
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
  return name;
}

class AutoWrapPolicy {
 public:
  /// (qualified name, module, parameters in its subtree not already inside a wrapped descendant)
  using Predicate = std::function<bool(const std::string& fqn, const torch::nn::Module& module, std::int64_t nonwrapped_numel)>;

  /// No nested units: the whole model is one unit (NO_WRAP).
  static AutoWrapPolicy none() { return AutoWrapPolicy("NO_WRAP", nullptr); }

  /// Wrap a submodule when its not-yet-wrapped parameters number at least `min_num_params`
  /// (SIZE_BASED_WRAP; decided bottom-up like PyTorch's size_based_auto_wrap_policy).
  static AutoWrapPolicy size_based(std::int64_t min_num_params) {
    if (min_num_params < 1) throw ConfigError("min_num_params must be >= 1, got " + std::to_string(min_num_params));
    return AutoWrapPolicy(
        "SIZE_BASED_WRAP(min_num_params=" + std::to_string(min_num_params) + ")",
        [min_num_params](const std::string&, const torch::nn::Module& m, std::int64_t numel) { return numel >= min_num_params && !is_container(m); });
  }

  /// Wrap every submodule whose type name is listed (TRANSFORMER_BASED_WRAP). Names match the short
  /// type name ("TransformerBlock" matches "my::TransformerBlockImpl") or the full one.
  static AutoWrapPolicy module_types(std::vector<std::string> type_names) {
    if (type_names.empty()) throw ConfigError("module_types policy needs at least one type name");
    std::string text;
    for (auto& n : type_names) {
      if (n.size() > 4 && n.compare(n.size() - 4, 4, "Impl") == 0) n.resize(n.size() - 4);
      text += (text.empty() ? "" : ",") + n;
    }
    return AutoWrapPolicy("TRANSFORMER_BASED_WRAP(" + text + ")",
                          [names = std::move(type_names)](const std::string&, const torch::nn::Module& m, std::int64_t) {
                            const std::string short_name = module_type_name(m);
                            std::string full = m.name();
                            if (full.size() > 4 && full.compare(full.size() - 4, 4, "Impl") == 0) full.resize(full.size() - 4);
                            for (const auto& n : names)
                              if (n == short_name || n == full) return true;
                            return false;
                          });
  }

  /// Wrap where `predicate` says so.
  static AutoWrapPolicy custom(Predicate predicate, std::string description = "CUSTOM") {
    if (!predicate) throw ConfigError("custom wrap policy needs a predicate");
    return AutoWrapPolicy(std::move(description), std::move(predicate));
  }

  bool should_wrap(const std::string& fqn, const torch::nn::Module& module, std::int64_t nonwrapped_numel) const {
    return predicate_ && predicate_(fqn, module, nonwrapped_numel);
  }
  const std::string& description() const noexcept { return description_; }

 private:
  AutoWrapPolicy(std::string description, Predicate predicate) : description_(std::move(description)), predicate_(std::move(predicate)) {}
  // Containers have no forward of their own to hook (PyTorch excludes ModuleList/ModuleDict too).
  static bool is_container(const torch::nn::Module& m) {
    const std::string t = module_type_name(m);
    return t == "ModuleList" || t == "ModuleDict";
  }
  std::string description_;
  Predicate predicate_;
};

}  // namespace fsdp
