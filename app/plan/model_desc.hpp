// Memory planning (app layer): a model's module tree without tensors (ModelDesc) and its FSDP units,
// planned by the core's plan_units() as the engine plans them. No LibTorch.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "choices.hpp"
#include "fsdp/core/layout.hpp"
#include "fsdp/core/unit_plan.hpp"
#include "fsdp/errors.hpp"

namespace fsdp::app {

// ==== 1. The model, described without tensors ========================================================

struct ParamDesc {
  std::string name;  ///< fully qualified, as named_parameters() names it
  std::vector<std::int64_t> shape;
  std::string tied_to;  ///< "" or the name of the parameter whose tensor this one is
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

struct ModuleDesc {
  std::string path;       ///< "" for the root, "block0.attn" ...
  std::string type;       ///< short type name (fsdp::module_type_name): "Linear"
  std::string full_type;  ///< Module::name() without "Impl": "torch::nn::Linear"
  int parent = -1;
  std::vector<int> children;
  std::vector<ParamDesc> params;  ///< registered on this module (recurse = false)
  std::int64_t buffer_numel = 0;  ///< floating-point buffers registered on this module
};

/// A model's module tree in pre-order (what build_units visits), with every parameter's shape.
struct ModelDesc {
  ModelKind kind = ModelKind::kCnn;
  std::vector<ModuleDesc> modules;

  int add(int parent, const std::string& key, const std::string& type, const std::string& full_type) {
    ModuleDesc m;
    m.path = parent < 0                                               ? ""
             : modules[static_cast<std::size_t>(parent)].path.empty() ? key
                                                                      : modules[static_cast<std::size_t>(parent)].path + "." + key;
    m.type = type;
    m.full_type = full_type;
    m.parent = parent;
    modules.push_back(std::move(m));
    const int id = static_cast<int>(modules.size()) - 1;
    if (parent >= 0) modules[static_cast<std::size_t>(parent)].children.push_back(id);
    return id;
  }
  void param(int module, const std::string& key, std::vector<std::int64_t> shape, const std::string& tied_to = "") {
    auto& m = modules[static_cast<std::size_t>(module)];
    m.params.push_back({m.path.empty() ? key : m.path + "." + key, std::move(shape), tied_to});
  }
  int find(const std::string& path) const {
    for (std::size_t i = 0; i < modules.size(); ++i)
      if (modules[i].path == path) return static_cast<int>(i);
    throw ConfigError("plan: no module '" + path + "' in the model description", "fsdp.plan");
  }
  /// Distinct parameter elements (a tied tensor counted once): what summary.json calls "params".
  std::int64_t num_params() const {
    std::int64_t n = 0;
    for (const auto& m : modules)
      for (const auto& p : m.params)
        if (p.tied_to.empty()) n += p.numel();
    return n;
  }
  std::int64_t buffer_numel() const {
    std::int64_t n = 0;
    for (const auto& m : modules) n += m.buffer_numel;
    return n;
  }
  /// Every module type, short names (for fsdp.transformer_layer_cls_to_wrap messages).
  std::set<std::string> types() const {
    std::set<std::string> t;
    for (const auto& m : modules) t.insert(m.type);
    return t;
  }
};

// ==== 2. FSDP units, as build_units makes them ======================================================

/// fsdp.auto_wrap_policy and its parameters.
struct WrapDesc {
  WrapPolicy policy = WrapPolicy::NO_WRAP;
  std::int64_t min_num_params = 100000;
  std::vector<std::string> types;
  /// The core's rule for this policy: the one the engine applies.
  WrapRule rule() const {
    switch (policy) {
      case WrapPolicy::SIZE_BASED_WRAP: return WrapRule::size_based(min_num_params);
      case WrapPolicy::TRANSFORMER_BASED_WRAP: return WrapRule::module_types(types);
      case WrapPolicy::NO_WRAP: break;
    }
    return WrapRule::none();
  }
};

/// The description as the core's module tree (a tied parameter shares its tensor's id).
inline ModuleTree module_tree(const ModelDesc& d) {
  ModuleTree tree;
  std::map<std::string, std::int64_t> tensor_ids;
  for (const auto& m : d.modules) {
    const std::string key = m.parent < 0 ? "" : m.path.substr(m.path.rfind('.') == std::string::npos ? 0 : m.path.rfind('.') + 1);
    const int id = tree.add_module(m.parent, key, m.type, m.full_type);
    for (const auto& p : m.params) {
      const std::string& tensor = p.tied_to.empty() ? p.name : p.tied_to;
      const auto [it, fresh] = tensor_ids.emplace(tensor, static_cast<std::int64_t>(tensor_ids.size()));
      tree.add_param(id, p.name.substr(p.name.rfind('.') == std::string::npos ? 0 : p.name.rfind('.') + 1), p.shape, it->second);
    }
  }
  return tree;
}

/// One unit: its parameters (distinct tensors, canonical names) and flat layout over the shard group.
struct PlanUnit {
  int index = 0;
  int parent = -1;
  int module = 0;  ///< index into ModelDesc::modules of the module it wraps
  std::string path;
  std::vector<std::string> params;
  std::vector<std::int64_t> numels;
  std::int64_t numel = 0, padded = 0, shard = 0;
};

/// The units of `d` under `wrap` with shard groups of `group` ranks: the core's plan_units, the
/// function the engine builds its units from.
inline std::vector<PlanUnit> plan_units(const ModelDesc& d, const WrapDesc& wrap, std::int64_t group) {
  std::vector<PlanUnit> units;
  for (const auto& planned : fsdp::plan_units(module_tree(d), wrap.rule(), group).units) {
    PlanUnit u;
    u.index = planned.index;
    u.parent = planned.parent;
    u.module = planned.module;
    u.path = planned.path;
    for (const auto& p : planned.params) u.params.push_back(p.name);
    u.numels = planned.numels();
    u.numel = planned.layout.numel();
    u.padded = planned.layout.padded_numel();
    u.shard = planned.layout.shard_numel();
    units.push_back(std::move(u));
  }
  return units;
}

}  // namespace fsdp::app
