// A wrapping that leaves much of the model in the root unit (app layer, std only). FSDP gathers the
// root unit at the first forward and keeps it, and its gradient, until the end of backward: what the
// root holds costs its full size on every rank for the whole step. The classic case is a deck that
// names only the block class (transformer_layer_cls_to_wrap = "TransformerBlock", as the PyTorch and
// Accelerate guides teach) on a model with untied embedding and head. fsdp-plan and fsdp-train's echo
// say so, with the bytes and the setting that avoids it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "choices.hpp"
#include "plan/model_desc.hpp"

namespace fsdp::app {

/// What the note is computed from: the root unit's parameters (fully qualified names and sizes), its
/// padded size and this rank's shard of it, every unit's elements, and the run.
struct RootUnitFacts {
  std::vector<std::string> root_params;
  std::vector<std::int64_t> root_numels;
  std::int64_t root_numel = 0, root_padded = 0;
  std::int64_t total_numel = 0;  ///< over every unit
  std::size_t units = 0;
  bool gathered_then_freed = true;  ///< the strategy shards parameters and frees them after use (FULL_SHARD, HYBRID_SHARD)
  int param_bytes = 4;              ///< gathered parameters' element size
  WrapPolicy policy = WrapPolicy::NO_WRAP;
  std::vector<std::string> wrap_types;  ///< fsdp.transformer_layer_cls_to_wrap, resolved
  std::vector<std::string> auto_types;  ///< the family's "auto" classes
};

/// The root holds at least this share of the model before the note is worth a line.
inline constexpr double kRootShareWorthSaying = 0.2;

/// The module that registers parameter `name` ("lm_head.weight" -> "lm_head"; "" for the root's own).
inline std::string module_of_param(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? "" : name.substr(0, dot);
}

/// The facts of a run whose units are `units` (the root first): the engine's (fsdp-train) or the
/// plan's (fsdp-plan), each giving a unit's parameter names, elements and padded elements. The
/// sizes of the root's parameters (to name its largest modules) come from the model's description.
template <class Unit, class Fields>
RootUnitFacts root_unit_facts(const std::vector<Unit>& units, Fields fields, const ModelDesc& desc, bool gathered_then_freed, int param_bytes,
                              WrapPolicy policy, std::vector<std::string> wrap_types, std::vector<std::string> auto_types) {
  RootUnitFacts f;
  std::map<std::string, std::int64_t> numel_of;
  for (const auto& m : desc.modules)
    for (const auto& p : m.params) numel_of[p.name] = p.numel();
  for (const auto& u : units) f.total_numel += fields(u).numel;
  if (!units.empty()) {
    const auto root = fields(units.front());
    for (const auto& name : root.params) {
      f.root_params.push_back(name);
      f.root_numels.push_back(numel_of.count(name) ? numel_of[name] : 0);
    }
    f.root_numel = root.numel;
    f.root_padded = root.padded;
  }
  f.units = units.size();
  f.gathered_then_freed = gathered_then_freed;
  f.param_bytes = param_bytes;
  f.policy = policy;
  f.wrap_types = std::move(wrap_types);
  f.auto_types = std::move(auto_types);
  return f;
}

/// What root_unit_facts reads of a unit.
struct UnitFields {
  const std::vector<std::string>& params;
  std::int64_t numel, padded;
};

/// Whether the strategy frees the other units between uses, so that the root's staying gathered
/// stands out: parameters sharded over more than one rank and resharded after forward.
inline bool units_freed_between_uses(bool reshard_after_forward, std::int64_t shard_group) { return reshard_after_forward && shard_group > 1; }

/// One line (without a trailing newline), or nothing when the root holds little, the model is one
/// unit anyway (NO_WRAP: the deck asks for it), or the strategy keeps parameters whole.
inline std::optional<std::string> root_unit_note(const RootUnitFacts& f, const ModelDesc& desc) {
  if (f.units < 2 || !f.gathered_then_freed || f.total_numel <= 0) return std::nullopt;
  const std::int64_t root_numel = f.root_numel;
  const double share = static_cast<double>(root_numel) / static_cast<double>(f.total_numel);
  if (share < kRootShareWorthSaying) return std::nullopt;
  // The largest modules the root holds, with their classes.
  std::map<std::string, std::string> type_of;
  for (const auto& m : desc.modules) type_of[m.path] = m.type;
  std::map<std::string, std::int64_t> by_module;
  for (std::size_t i = 0; i < f.root_params.size(); ++i) by_module[module_of_param(f.root_params[i])] += f.root_numels[i];
  std::vector<std::pair<std::int64_t, std::string>> largest;
  for (const auto& [module, numel] : by_module) largest.emplace_back(numel, module);
  std::sort(largest.begin(), largest.end(),
            [](const auto& a, const auto& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
  std::vector<std::string> named;
  std::set<std::string> root_types;
  for (const auto& [numel, module] : largest) {
    const std::string type = type_of.count(module) ? type_of[module] : "?";
    root_types.insert(type);
    if (named.size() < 3 && static_cast<double>(numel) >= 0.05 * static_cast<double>(root_numel))
      named.push_back((module.empty() ? "(root)" : module) + " (" + type + ")");
  }
  std::string list;
  for (std::size_t i = 0; i < named.size(); ++i) list += (i ? ", " : "") + named[i];
  const double mib = 1024.0 * 1024.0;
  // The gathered flat buffer is allocated beside the shard; autograd's gradient is as large.
  const double gathered = static_cast<double>(f.root_padded) * f.param_bytes / mib;
  char head[256];
  std::snprintf(head, sizeof head,
                "the root unit holds %.0f%% of the parameters (%s), gathered from the first forward to the end of backward: ", 100 * share,
                list.c_str());
  char cost[160];
  std::snprintf(cost, sizeof cost, "%.1f MiB per rank besides its shard, and as much again for its gradient in backward", gathered);
  // What avoids it: classes "auto" makes units of their own that the deck's list leaves in the root.
  std::vector<std::string> missing;
  if (f.policy == WrapPolicy::TRANSFORMER_BASED_WRAP)
    for (const auto& t : f.auto_types)
      if (root_types.count(t) && std::find(f.wrap_types.begin(), f.wrap_types.end(), t) == f.wrap_types.end()) missing.push_back(t);
  std::string advice;
  if (!missing.empty()) {
    std::string classes;
    for (std::size_t i = 0; i < missing.size(); ++i) classes += (i ? ", " : "") + missing[i];
    advice = "; fsdp.transformer_layer_cls_to_wrap = \"auto\" (or adding " + classes + ") makes them units of their own";
  } else if (f.policy == WrapPolicy::TRANSFORMER_BASED_WRAP && root_types.count("Embedding") && root_types.count("LmHead") == 0) {
    advice =
        "; a tied embedding is used by the first and the last layer and stays in the root (model.tie_embeddings = false lets "
        "it and the head be units of their own)";
  }
  return std::string(head) + cost + advice;
}

}  // namespace fsdp::app
