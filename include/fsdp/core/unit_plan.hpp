// Unit planning (core layer: std only): which modules of a model become FSDP units, which unit owns
// each parameter (a tied one goes to the lowest common ancestor unit of its users), the frozen
// companions, each unit's flat layout and so every rank's shard ranges. The model is described as a
// plain tree, so the engine (which describes its torch module this way and then only moves storage),
// fsdp-plan (which describes a model in closed form) and the tests all call the same plan_units().
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/layout.hpp"
#include "fsdp/errors.hpp"

namespace fsdp {

/// Elements of a tensor of `shape` (1 for a 0-d tensor).
inline std::int64_t shape_numel(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

/// One parameter as a module registers it (PyTorch's named_parameters(recurse = false)).
struct TreeParam {
  std::string name;  ///< fully qualified: "block0.attn.qkv.weight"
  std::vector<std::int64_t> shape;
  /// Equal for names of one tensor (tied weights); any value that identifies the tensor.
  std::int64_t tensor_id = 0;
  bool frozen = false;  ///< requires_grad = false
  std::int64_t numel() const { return shape_numel(shape); }
};

/// One module of the tree.
struct TreeModule {
  std::string path;            ///< "" for the root, "block0.attn" ...
  std::string type_name;       ///< short: "Linear" (torch::nn::LinearImpl), "TransformerBlock"
  std::string full_type_name;  ///< qualified, without "Impl": "torch::nn::Linear"
  int parent = -1;
  std::vector<int> children;
  std::vector<TreeParam> params;  ///< registered on this module itself
};

/// A model's module tree in pre-order (parents before children, children in registration order).
struct ModuleTree {
  std::vector<TreeModule> modules;

  /// Appends a module under `parent` (-1: the root) and returns its index.
  int add_module(int parent, const std::string& key, std::string type_name, std::string full_type_name) {
    TreeModule m;
    if (parent >= 0) {
      const std::string& base = modules.at(static_cast<std::size_t>(parent)).path;
      m.path = base.empty() ? key : base + "." + key;
    }
    m.type_name = std::move(type_name);
    m.full_type_name = std::move(full_type_name);
    m.parent = parent;
    modules.push_back(std::move(m));
    const int id = static_cast<int>(modules.size()) - 1;
    if (parent >= 0) modules[static_cast<std::size_t>(parent)].children.push_back(id);
    return id;
  }
  /// Registers parameter `key` on module `module`.
  void add_param(int module, const std::string& key, std::vector<std::int64_t> shape, std::int64_t tensor_id, bool frozen = false) {
    auto& m = modules.at(static_cast<std::size_t>(module));
    m.params.push_back({m.path.empty() ? key : m.path + "." + key, std::move(shape), tensor_id, frozen});
  }
};

/// Which modules become units (PyTorch's auto-wrap policies). The root is always a unit.
class WrapRule {
 public:
  /// (module, its index in the tree, parameters in its subtree not already inside a wrapped descendant)
  using Predicate = std::function<bool(const TreeModule& module, int index, std::int64_t nonwrapped_numel)>;

  /// No nested units (NO_WRAP).
  static WrapRule none() { return WrapRule("NO_WRAP", nullptr); }
  /// A module whose not-yet-wrapped parameters number at least `min_num_params` (SIZE_BASED_WRAP,
  /// bottom-up); containers (ModuleList, ModuleDict) have no forward of their own and are never wrapped.
  static WrapRule size_based(std::int64_t min_num_params) {
    if (min_num_params < 1) throw ConfigError("min_num_params must be >= 1, got " + std::to_string(min_num_params));
    return WrapRule("SIZE_BASED_WRAP(min_num_params=" + std::to_string(min_num_params) + ")",
                    [min_num_params](const TreeModule& m, int, std::int64_t numel) {
                      return numel >= min_num_params && m.type_name != "ModuleList" && m.type_name != "ModuleDict";
                    });
  }
  /// Every module whose short or full type name is listed (TRANSFORMER_BASED_WRAP); a trailing "Impl"
  /// of a listed name is ignored.
  static WrapRule module_types(std::vector<std::string> type_names) {
    if (type_names.empty()) throw ConfigError("module_types policy needs at least one type name");
    std::string text;
    for (auto& n : type_names) {
      n = without_impl(n);
      text += (text.empty() ? "" : ",") + n;
    }
    return WrapRule("TRANSFORMER_BASED_WRAP(" + text + ")", [names = std::move(type_names)](const TreeModule& m, int, std::int64_t) {
      for (const auto& n : names)
        if (n == m.type_name || n == m.full_type_name) return true;
      return false;
    });
  }
  /// Wrap where `predicate` says so.
  static WrapRule custom(Predicate predicate, std::string description = "CUSTOM") {
    if (!predicate) throw ConfigError("custom wrap policy needs a predicate");
    return WrapRule(std::move(description), std::move(predicate));
  }

  bool should_wrap(const TreeModule& module, int index, std::int64_t nonwrapped_numel) const {
    return predicate_ && predicate_(module, index, nonwrapped_numel);
  }
  const std::string& description() const noexcept { return description_; }

  /// "my::BlockImpl" -> "my::Block": LibTorch's module holders name their Impl classes.
  static std::string without_impl(std::string name) {
    if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
    return name;
  }

 private:
  WrapRule(std::string description, Predicate predicate) : description_(std::move(description)), predicate_(std::move(predicate)) {}
  std::string description_;
  Predicate predicate_;
};

/// One parameter of a unit, in flat order.
struct PlannedParam {
  std::string name;  ///< the first name the tree gives the tensor (its checkpoint name)
  std::vector<std::int64_t> shape;
  std::int64_t tensor_id = 0;
  std::vector<std::string> aliases;  ///< the tensor's other names (tied weights)
  std::int64_t numel() const { return shape_numel(shape); }
};

/// One unit: the module it wraps and its flat layout over the shard group.
struct PlannedUnit {
  int index = 0;
  int parent = -1;   ///< the enclosing unit; for a frozen companion, the unit whose frozen parameters it holds
  int module = 0;    ///< index into ModuleTree::modules
  std::string path;  ///< the module's path, "" for the root
  std::string type_name;
  bool frozen = false;  ///< a companion holding unit `parent`'s frozen parameters: gathered with it, no gradient
  int companion = -1;   ///< this unit's frozen companion, if it has frozen parameters
  std::vector<PlannedParam> params;
  FlatLayout layout;
  std::vector<std::int64_t> numels() const {
    std::vector<std::int64_t> n;
    n.reserve(params.size());
    for (const auto& p : params) n.push_back(p.numel());
    return n;
  }
};
/// The units of a tree: regular units in pre-order of their modules, then the frozen companions.
struct UnitPlan {
  std::vector<PlannedUnit> units;
  std::vector<int> owner;  ///< per module of the tree: the unit it belongs to (its nearest wrapped ancestor)
  std::int64_t group_size = 1;

  /// Distinct parameter elements (a tied tensor counted once).
  std::int64_t num_params() const {
    std::int64_t n = 0;
    for (const auto& u : units) n += u.layout.numel();
    return n;
  }
};

namespace detail {
inline int common_ancestor_unit(const std::vector<PlannedUnit>& units, int a, int b) {
  auto depth = [&](int u) {
    int d = 0;
    for (; units[static_cast<std::size_t>(u)].parent >= 0; u = units[static_cast<std::size_t>(u)].parent) ++d;
    return d;
  };
  int da = depth(a), db = depth(b);
  for (; da > db; --da) a = units[static_cast<std::size_t>(a)].parent;
  for (; db > da; --db) b = units[static_cast<std::size_t>(b)].parent;
  while (a != b) {
    a = units[static_cast<std::size_t>(a)].parent;
    b = units[static_cast<std::size_t>(b)].parent;
  }
  return a;
}
}  // namespace detail

/// Plans the units of `tree` under `rule` for shard groups of `group_size` ranks:
/// 1. wrap decisions bottom-up: a module's non-wrapped numel excludes wrapped descendants (PyTorch's
///    size-based policy), the root is always a unit;
/// 2. each module belongs to its nearest wrapped ancestor;
/// 3. each distinct tensor (by tensor_id, first name wins) goes to the lowest common ancestor unit of
///    every unit that uses it, so it is gathered whenever any user runs;
/// 4. a unit's frozen parameters go to a companion unit appended after the regular units, in the
///    order of their first frozen parameter;
/// 5. each unit's parameters are laid out flat in that order over `group_size` ranks.
inline UnitPlan plan_units(const ModuleTree& tree, const WrapRule& rule, std::int64_t group_size) {
  const std::size_t n = tree.modules.size();
  if (n == 0) throw ConfigError("plan_units: the module tree is empty");
  UnitPlan plan;
  plan.group_size = group_size;
  std::vector<std::int64_t> nonwrapped(n, 0);
  std::vector<bool> wrapped(n, false);
  for (int id = static_cast<int>(n) - 1; id >= 0; --id) {
    const auto& m = tree.modules[static_cast<std::size_t>(id)];
    std::int64_t numel = 0;
    for (const auto& p : m.params) numel += p.numel();
    for (int c : m.children)
      if (!wrapped[static_cast<std::size_t>(c)]) numel += nonwrapped[static_cast<std::size_t>(c)];
    nonwrapped[static_cast<std::size_t>(id)] = numel;
    if (id != 0 && rule.should_wrap(m, id, numel)) wrapped[static_cast<std::size_t>(id)] = true;
  }
  wrapped[0] = true;

  plan.owner.assign(n, -1);
  for (std::size_t id = 0; id < n; ++id) {
    const auto& m = tree.modules[id];
    if (id > 0 && (m.parent < 0 || static_cast<std::size_t>(m.parent) >= id))
      throw ConfigError("plan_units: module '" + m.path + "' is not in pre-order after its parent");
    if (!wrapped[id]) {
      plan.owner[id] = plan.owner[static_cast<std::size_t>(m.parent)];
      continue;
    }
    PlannedUnit u;
    u.index = static_cast<int>(plan.units.size());
    u.parent = m.parent >= 0 ? plan.owner[static_cast<std::size_t>(m.parent)] : -1;
    u.module = static_cast<int>(id);
    u.path = m.path;
    u.type_name = m.type_name;
    plan.owner[id] = u.index;
    plan.units.push_back(std::move(u));
  }

  struct Use {
    const TreeParam* param;
    int unit;
    std::vector<std::string> aliases;
  };
  std::vector<Use> uses;
  std::map<std::int64_t, std::size_t> first_use;
  for (std::size_t id = 0; id < n; ++id) {
    for (const auto& p : tree.modules[id].params) {
      const auto it = first_use.find(p.tensor_id);
      if (it == first_use.end()) {
        first_use.emplace(p.tensor_id, uses.size());
        uses.push_back({&p, plan.owner[id], {}});
      } else {
        auto& use = uses[it->second];
        use.unit = detail::common_ancestor_unit(plan.units, use.unit, plan.owner[id]);
        use.aliases.push_back(p.name);
      }
    }
  }
  for (auto& use : uses) {
    int target = use.unit;
    if (use.param->frozen) {
      auto& regular = plan.units[static_cast<std::size_t>(target)];
      if (regular.companion < 0) {
        PlannedUnit c;
        c.index = static_cast<int>(plan.units.size());
        c.parent = regular.index;
        c.module = regular.module;
        c.path = regular.path;
        c.type_name = regular.type_name;
        c.frozen = true;
        regular.companion = c.index;
        plan.units.push_back(std::move(c));
      }
      target = plan.units[static_cast<std::size_t>(target)].companion;
    }
    plan.units[static_cast<std::size_t>(target)].params.push_back({use.param->name, use.param->shape, use.param->tensor_id, std::move(use.aliases)});
  }
  for (auto& u : plan.units) u.layout = FlatLayout(u.numels(), group_size);
  return plan;
}

}  // namespace fsdp
