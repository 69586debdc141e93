// Memory planning (app layer): a model's module tree without tensors (ModelDesc) and the FSDP units
// derived from it as FullyShardedDataParallel::build_units makes them (plan_units). No LibTorch.
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

#include "fsdp/core/layout.hpp"
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
  std::string kind;  ///< cnn, mlp, transformer
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
  std::string policy = "NO_WRAP";  ///< NO_WRAP, SIZE_BASED_WRAP, TRANSFORMER_BASED_WRAP
  std::int64_t min_num_params = 100000;
  std::vector<std::string> types;
  bool should_wrap(const ModuleDesc& m, std::int64_t nonwrapped_numel) const {
    if (policy == "SIZE_BASED_WRAP") return nonwrapped_numel >= min_num_params && m.type != "ModuleList" && m.type != "ModuleDict";
    if (policy == "TRANSFORMER_BASED_WRAP") {
      for (std::string n : types) {
        if (n.size() > 4 && n.compare(n.size() - 4, 4, "Impl") == 0) n.resize(n.size() - 4);
        if (n == m.type || n == m.full_type) return true;
      }
    }
    return false;
  }
};

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

/// The units of `d` under `wrap` with shard groups of `group` ranks: the same decisions, order and
/// parameter assignment as FullyShardedDataParallel::build_units (bottom-up wrap decisions on the
/// parameters not already in a wrapped descendant; a tied tensor goes to the lowest common ancestor
/// unit of its users).
inline std::vector<PlanUnit> plan_units(const ModelDesc& d, const WrapDesc& wrap, std::int64_t group) {
  const std::size_t n = d.modules.size();
  std::vector<std::int64_t> nonwrapped(n, 0);
  std::vector<bool> wrapped(n, false);
  for (int id = static_cast<int>(n) - 1; id >= 0; --id) {
    const auto& m = d.modules[static_cast<std::size_t>(id)];
    std::int64_t numel = 0;
    for (const auto& p : m.params) numel += p.numel();
    for (int c : m.children)
      if (!wrapped[static_cast<std::size_t>(c)]) numel += nonwrapped[static_cast<std::size_t>(c)];
    nonwrapped[static_cast<std::size_t>(id)] = numel;
    if (id != 0 && wrap.should_wrap(m, numel)) wrapped[static_cast<std::size_t>(id)] = true;
  }
  wrapped[0] = true;
  std::vector<PlanUnit> units;
  std::vector<int> owner(n, -1);
  for (std::size_t id = 0; id < n; ++id) {
    const auto& m = d.modules[id];
    if (wrapped[id]) {
      PlanUnit u;
      u.index = static_cast<int>(units.size());
      u.parent = m.parent >= 0 ? owner[static_cast<std::size_t>(m.parent)] : -1;
      u.module = static_cast<int>(id);
      u.path = m.path;
      units.push_back(u);
      owner[id] = u.index;
    } else {
      owner[id] = owner[static_cast<std::size_t>(m.parent)];
    }
  }
  auto common_ancestor = [&](int a, int b) {
    auto depth = [&](int u) {
      int k = 0;
      while (units[static_cast<std::size_t>(u)].parent >= 0) {
        u = units[static_cast<std::size_t>(u)].parent;
        ++k;
      }
      return k;
    };
    int da = depth(a), db = depth(b);
    while (da > db) {
      a = units[static_cast<std::size_t>(a)].parent;
      --da;
    }
    while (db > da) {
      b = units[static_cast<std::size_t>(b)].parent;
      --db;
    }
    while (a != b) {
      a = units[static_cast<std::size_t>(a)].parent;
      b = units[static_cast<std::size_t>(b)].parent;
    }
    return a;
  };
  struct Use {
    std::string name;
    std::int64_t numel;
    int unit;
  };
  std::vector<Use> uses;
  std::map<std::string, std::size_t> first;
  for (std::size_t id = 0; id < n; ++id) {
    for (const auto& p : d.modules[id].params) {
      const std::string canonical = p.tied_to.empty() ? p.name : p.tied_to;
      const auto it = first.find(canonical);
      if (it == first.end()) {
        first.emplace(canonical, uses.size());
        uses.push_back({canonical, p.numel(), owner[id]});
      } else {
        uses[it->second].unit = common_ancestor(uses[it->second].unit, owner[id]);
      }
    }
  }
  for (const auto& use : uses) {
    auto& u = units[static_cast<std::size_t>(use.unit)];
    u.params.push_back(use.name);
    u.numels.push_back(use.numel);
  }
  for (auto& u : units) {
    const FlatLayout layout(u.numels, group);
    u.numel = layout.numel();
    u.padded = layout.padded_numel();
    u.shard = layout.shard_numel();
  }
  return units;
}

}  // namespace fsdp::app
