// Memory planning (app layer, LibTorch): the model fsdp-train builds, described like the closed form,
// and the differences between the two; fsdp-train --check-plan uses it.
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

#include "models.hpp"
#include "models/families.hpp"

namespace fsdp::app {

/// Describes a built LibTorch module the way describe_model() does (tied tensors by identity).
inline ModelDesc describe_module(torch::nn::Module& root, ModelKind kind) {
  ModelDesc d;
  d.kind = kind;
  std::unordered_map<const void*, std::string> seen;
  std::function<void(torch::nn::Module&, int, const std::string&)> visit = [&](torch::nn::Module& m, int parent, const std::string& key) {
    std::string full = m.name();
    if (full.size() > 4 && full.compare(full.size() - 4, 4, "Impl") == 0) full.resize(full.size() - 4);
    const int id = d.add(parent, key, module_type_name(m), full);
    for (const auto& p : m.named_parameters(/*recurse=*/false)) {
      const void* impl = p.value().unsafeGetTensorImpl();
      const auto it = seen.find(impl);
      const std::string name =
          d.modules[static_cast<std::size_t>(id)].path.empty() ? p.key() : d.modules[static_cast<std::size_t>(id)].path + "." + p.key();
      d.param(id, p.key(), p.value().sizes().vec(), it == seen.end() ? "" : it->second);
      if (it == seen.end()) seen.emplace(impl, name);
    }
    for (const auto& b : m.named_buffers(/*recurse=*/false))
      if (b.value().is_floating_point()) d.modules[static_cast<std::size_t>(id)].buffer_numel += b.value().numel();
    for (const auto& c : m.named_children()) visit(*c.value(), id, c.key());
  };
  visit(root, -1, "");
  return d;
}

/// Differences between two descriptions ("" when equal): paths, types, parameter names, shapes, ties, buffers.
inline std::string compare_descriptions(const ModelDesc& expected, const ModelDesc& built) {
  std::ostringstream os;
  if (expected.modules.size() != built.modules.size())
    os << "module count: closed form " << expected.modules.size() << ", built " << built.modules.size() << "\n";
  const std::size_t n = std::min(expected.modules.size(), built.modules.size());
  auto shape = [](const std::vector<std::int64_t>& s) {
    std::string t = "[";
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (i) t += ',';
      t += std::to_string(s[i]);
    }
    return t + "]";
  };
  for (std::size_t i = 0; i < n; ++i) {
    const auto& a = expected.modules[i];
    const auto& b = built.modules[i];
    const std::string where = "module '" + b.path + "'";
    if (a.path != b.path) os << "module " << i << ": closed form '" << a.path << "', built '" << b.path << "'\n";
    if (a.type != b.type || a.full_type != b.full_type)
      os << where << ": type closed form " << a.type << " (" << a.full_type << "), built " << b.type << " (" << b.full_type << ")\n";
    if (a.parent != b.parent) os << where << ": parent differs\n";
    if (a.buffer_numel != b.buffer_numel) os << where << ": buffers closed form " << a.buffer_numel << ", built " << b.buffer_numel << "\n";
    if (a.params.size() != b.params.size()) {
      os << where << ": " << a.params.size() << " parameters in closed form, " << b.params.size() << " built\n";
      continue;
    }
    for (std::size_t k = 0; k < a.params.size(); ++k) {
      const auto& p = a.params[k];
      const auto& q = b.params[k];
      if (p.name != q.name || p.shape != q.shape || p.tied_to != q.tied_to)
        os << "parameter " << q.name << shape(q.shape) << (q.tied_to.empty() ? "" : " tied to " + q.tied_to) << ": closed form " << p.name
           << shape(p.shape) << (p.tied_to.empty() ? "" : " tied to " + p.tied_to) << "\n";
    }
  }
  return os.str();
}

}  // namespace fsdp::app
