// Memory planning for fsdp-train decks (app layer): predicts, per rank, the bytes of every part of a
// run (parameter shards, gradients, optimizer state, gathered unit buffers, activations, data, the
// process baseline) from the deck alone, and finds the largest model of the deck's family that fits a
// memory budget. No MPI and no model tensors: the model is described in closed form (module tree,
// parameter shapes), the FSDP units are derived from it exactly as FullyShardedDataParallel's
// build_units does, and one training step is replayed as a sequence of allocations and frees whose
// high-water mark is the prediction. Used by fsdp-plan (app/fsdp_plan.cpp); docs/planning.md explains
// the model and its limits, tests/plan_e2e.cmake checks it against fsdp-train's measured peak RSS.
#pragma once

#include <zlib.h>

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
#include <thread>
#include <vector>

#include "deck.hpp"
#include "fsdp/core/layout.hpp"
#include "models.hpp"

namespace fsdp::app {

/// The resident memory of an fsdp-train rank before any data or model exists (LibTorch, Open MPI,
/// the C++ runtime), in MiB. Measured on the development machine (Debian 12, LibTorch 1.13 CPU, Open
/// MPI 4.1, 2 ranks on one node) as the peak RSS of a run whose data and model are negligible, minus
/// what the plan predicts for them (178.5 MiB peak RSS, 0.0 MiB predicted); tests/plan_e2e.cmake
/// measures it again on every run. fsdp-plan --baseline-mib overrides it.
inline constexpr double kDefaultBaselineMib = 178.0;

/// glibc's largest dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit): larger blocks are
/// always mapped and unmapped; smaller ones may come from the heap, which keeps freed memory.
inline constexpr std::int64_t kMmapThresholdMaxBytes = std::int64_t{32} << 20;
inline constexpr std::int64_t kMmapThresholdStartBytes = std::int64_t{128} << 10;

/// Resident heap per byte of the heap's live high-water mark. glibc places 64-byte-aligned tensor
/// blocks (posix_memalign) so that a freed block rarely takes the next request of the same size, and
/// small objects settle in the holes: the heap grows past its live bytes. Measured by tracing every
/// malloc/free of fsdp-train (docs/planning.md): 1.47 for a GPT whose blocks all live on the heap, 1.75
/// for an MLP with 12-16 MiB units. fsdp-plan --heap-factor overrides it.
inline constexpr double kDefaultHeapFactor = 1.5;

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

/// The family and size of the deck's model (the keys of [model] that matter for memory).
struct ModelShape {
  std::string kind;                        ///< cnn, mlp, transformer
  std::vector<std::int64_t> hidden_sizes;  ///< mlp
  GptConfig gpt;                           ///< transformer
  std::optional<double> dropout;           ///< model.dropout; unset: each model's own
};

inline ModelShape model_shape(const Deck& deck) {
  ModelShape s;
  s.kind = deck.get_string("model.kind");
  if (deck.is_set("model.dropout")) s.dropout = deck.get_float("model.dropout");
  s.hidden_sizes = deck.get_int_array("model.hidden_sizes");
  s.gpt.vocab_size = deck.get_int("model.vocab_size");
  s.gpt.context = deck.get_int("model.context");
  s.gpt.d_model = deck.get_int("model.d_model");
  s.gpt.n_heads = deck.get_int("model.n_heads");
  s.gpt.n_layers = deck.get_int("model.n_layers");
  s.gpt.mlp_ratio = deck.get_int("model.mlp_ratio");
  s.gpt.dropout = s.dropout.value_or(0.1);
  s.gpt.tie_embeddings = deck.get_bool("model.tie_embeddings");
  return s;
}

namespace detail {
inline void linear(ModelDesc& d, int parent, const std::string& key, std::int64_t in, std::int64_t out, bool bias = true) {
  const int m = d.add(parent, key, "Linear", "torch::nn::Linear");
  d.param(m, "weight", {out, in});
  if (bias) d.param(m, "bias", {out});
}
inline void layer_norm(ModelDesc& d, int parent, const std::string& key, std::int64_t n) {
  const int m = d.add(parent, key, "LayerNorm", "torch::nn::LayerNorm");
  d.param(m, "weight", {n});
  d.param(m, "bias", {n});
}
}  // namespace detail

/// The module tree of models.hpp's model for `s`, built in closed form (no tensors). `fsdp-plan
/// --check-model` and tests/plan_e2e.cmake compare it with the model LibTorch builds.
inline ModelDesc describe_model(const ModelShape& s) {
  ModelDesc d;
  d.kind = s.kind;
  if (s.kind == "cnn") {
    const int root = d.add(-1, "", "TutorialCnn", "TutorialCnn");
    const int c1 = d.add(root, "conv1", "Conv2d", "torch::nn::Conv2d");
    d.param(c1, "weight", {32, 1, 3, 3});
    d.param(c1, "bias", {32});
    const int c2 = d.add(root, "conv2", "Conv2d", "torch::nn::Conv2d");
    d.param(c2, "weight", {64, 32, 3, 3});
    d.param(c2, "bias", {64});
    d.add(root, "dropout1", "Dropout", "torch::nn::Dropout");
    d.add(root, "dropout2", "Dropout", "torch::nn::Dropout");
    detail::linear(d, root, "fc1", 9216, 128);
    detail::linear(d, root, "fc2", 128, 10);
  } else if (s.kind == "mlp") {
    const int root = d.add(-1, "", "Mlp", "Mlp");
    std::int64_t in = 784;
    for (std::size_t i = 0; i < s.hidden_sizes.size(); ++i) {
      detail::linear(d, root, "fc" + std::to_string(i + 1), in, s.hidden_sizes[i]);
      in = s.hidden_sizes[i];
    }
    detail::linear(d, root, "out", in, 10);
  } else if (s.kind == "transformer") {
    const auto& c = s.gpt;
    const int root = d.add(-1, "", "Gpt", "Gpt");
    const int tok = d.add(root, "tok", "Embedding", "torch::nn::Embedding");
    d.param(tok, "weight", {c.vocab_size, c.d_model});
    const int pos = d.add(root, "pos", "Embedding", "torch::nn::Embedding");
    d.param(pos, "weight", {c.context, c.d_model});
    for (std::int64_t i = 0; i < c.n_layers; ++i) {
      const int b = d.add(root, "block" + std::to_string(i), "TransformerBlock", "TransformerBlock");
      detail::layer_norm(d, b, "ln1", c.d_model);
      const int attn = d.add(b, "attn", "CausalSelfAttention", "CausalSelfAttention");
      detail::linear(d, attn, "qkv", c.d_model, 3 * c.d_model);
      detail::linear(d, attn, "proj", c.d_model, c.d_model);
      d.modules[static_cast<std::size_t>(attn)].buffer_numel = c.context * c.context;  // the causal mask
      detail::layer_norm(d, b, "ln2", c.d_model);
      detail::linear(d, b, "fc", c.d_model, c.mlp_ratio * c.d_model);
      detail::linear(d, b, "out", c.mlp_ratio * c.d_model, c.d_model);
    }
    detail::layer_norm(d, root, "ln_f", c.d_model);
    const int head = d.add(root, "head", "LmHead", "LmHead");
    d.param(head, "weight", {c.vocab_size, c.d_model}, c.tie_embeddings ? "tok.weight" : "");
  } else {
    throw ConfigError("plan: unknown model.kind '" + s.kind + "'", "fsdp.plan");
  }
  return d;
}

/// Closed-form parameter counts (distinct elements), the formulas docs/planning.md gives.
inline std::int64_t mlp_num_params(const std::vector<std::int64_t>& hidden) {
  std::int64_t n = 0, in = 784;
  for (auto h : hidden) {
    n += in * h + h;
    in = h;
  }
  return n + in * 10 + 10;
}
inline constexpr std::int64_t kCnnNumParams = (32 * 9 + 32) + (64 * 32 * 9 + 64) + (9216 * 128 + 128) + (128 * 10 + 10);
inline std::int64_t gpt_num_params(const GptConfig& c) {
  const std::int64_t d = c.d_model, r = c.mlp_ratio;
  const std::int64_t block = (4 + 2 * r) * d * d + (9 + r) * d;
  return c.vocab_size * d + c.context * d + c.n_layers * block + 2 * d + (c.tie_embeddings ? 0 : c.vocab_size * d);
}
inline std::int64_t closed_form_num_params(const ModelShape& s) {
  if (s.kind == "cnn") return kCnnNumParams;
  if (s.kind == "mlp") return mlp_num_params(s.hidden_sizes);
  return gpt_num_params(s.gpt);
}

/// The model fsdp-train builds for the deck (models.hpp), for --check-model.
inline std::shared_ptr<AppModel> build_app_model(const ModelShape& s) {
  if (s.kind == "cnn") return std::make_shared<TutorialCnnImpl>(s.dropout);
  if (s.kind == "mlp") return std::make_shared<MlpImpl>(s.hidden_sizes, s.dropout);
  return std::make_shared<GptImpl>(s.gpt);
}

/// Describes a built LibTorch module the way describe_model() does (tied tensors by identity).
inline ModelDesc describe_module(torch::nn::Module& root, const std::string& kind) {
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

// ==== 3. The run: strategy, precision, optimizer, batch, data ========================================

/// Bytes of the data set a rank keeps in memory and of one batch (fsdp-train's load_dataset and make_batch).
struct DataFootprint {
  std::int64_t resident_bytes = 0;   ///< train + test splits, kept for the whole run
  std::int64_t load_peak_bytes = 0;  ///< extra while loading (text: the file and its ids)
  std::int64_t train_samples = 0;    ///< samples (sequences) in the train split
  std::int64_t test_samples = 0;
  std::string note;  ///< where the sizes came from
  std::vector<std::string> warnings;
};

namespace detail {
/// The dimensions in an IDX file's header (gzip or not), or nullopt if it cannot be read.
inline std::optional<std::vector<std::int64_t>> idx_dims(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) return std::nullopt;
  unsigned char magic[4];
  std::optional<std::vector<std::int64_t>> out;
  if (gzread(f, magic, 4) == 4 && magic[0] == 0 && magic[1] == 0 && magic[3] > 0) {
    std::vector<std::int64_t> dims;
    for (int i = 0; i < magic[3]; ++i) {
      unsigned char b[4];
      if (gzread(f, b, 4) != 4) break;
      dims.push_back((std::int64_t{b[0]} << 24) | (std::int64_t{b[1]} << 16) | (std::int64_t{b[2]} << 8) | b[3]);
    }
    if (static_cast<int>(dims.size()) == magic[3]) out = dims;
  }
  gzclose(f);
  return out;
}
inline std::optional<std::vector<std::int64_t>> find_idx(const std::string& dir, const std::string& stem) {
  for (const auto& name : {stem, stem + ".gz"}) {
    const auto p = (std::filesystem::path(dir) / name).string();
    std::error_code ec;
    if (std::filesystem::exists(p, ec)) return idx_dims(p);
  }
  return std::nullopt;
}
}  // namespace detail

/// What the deck's data costs per rank. Image files are read only for their headers; missing files are
/// a warning (planning on a machine without the data) with the standard MNIST sizes assumed.
inline DataFootprint data_footprint(const Deck& deck) {
  DataFootprint f;
  const std::string kind = deck.get_string("data.kind");
  const auto context = deck.get_int("model.context");
  if (kind == "fashion-mnist" || kind == "mnist") {
    const std::string dir = deck.get_string("data.path");
    std::int64_t split_bytes[2] = {0, 0}, samples[2] = {60000, 10000};
    for (int train = 1; train >= 0; --train) {
      const std::string prefix = train ? "train" : "t10k";
      auto images = detail::find_idx(dir, prefix + "-images-idx3-ubyte");
      if (images && images->size() == 3) {
        samples[1 - train] = (*images)[0];
        split_bytes[1 - train] = (*images)[0] * (*images)[1] * (*images)[2] + (*images)[0];  // images + labels
      } else {
        split_bytes[1 - train] = samples[1 - train] * (28 * 28 + 1);
        f.warnings.push_back("cannot read the " + prefix + " images in " + dir + ": assuming " + std::to_string(samples[1 - train]) +
                             " images of 28x28 (fsdp-train itself needs the files)");
      }
    }
    // fsdp-train loads both splits whole (data.train_samples and data.test_samples cut the vectors
    // without giving their memory back).
    f.resident_bytes = split_bytes[0] + split_bytes[1];
    f.train_samples = samples[0];
    f.test_samples = samples[1];
    f.note = "IDX images and labels, both splits";
  } else if (kind == "tokens") {
    const auto n = deck.get_int("data.num_samples");
    const auto test = std::max<std::int64_t>(n / 10, 1);
    f.resident_bytes = (n + test) * (context + 1) * 4;  // int32 tokens
    f.train_samples = n;
    f.test_samples = test;
    f.note = "synthetic int32 token sequences";
  } else {  // text
    const std::string path = deck.get_string("data.path");
    std::error_code ec;
    const auto size = static_cast<std::int64_t>(std::filesystem::file_size(path, ec));
    if (ec) {
      f.warnings.push_back("cannot read the size of " + path + ": the text data is left out of the plan");
    } else {
      const std::int64_t windows = std::max<std::int64_t>(1, (size - 1) / context);
      f.resident_bytes = windows * (context + 1) * 4;
      f.load_peak_bytes = size + 4 * size;  // the file's bytes and their ids while the windows are cut
      f.train_samples = windows * 9 / 10;
      f.test_samples = windows - f.train_samples;
    }
    f.note = "text windows of context + 1 int32 tokens";
  }
  const auto limit_train = deck.get_int("data.train_samples"), limit_test = deck.get_int("data.test_samples");
  if (limit_train > 0) f.train_samples = std::min(f.train_samples, limit_train);
  if (limit_test > 0) f.test_samples = std::min(f.test_samples, limit_test);
  return f;
}

/// Everything besides the model that decides memory, from the deck and the command line.
struct RunShape {
  int world = 1;
  int ranks_per_node = 0;  ///< 0: all ranks on one node
  ShardingStrategy strategy = ShardingStrategy::FULL_SHARD;
  std::int64_t group = 1;     ///< shard group size G
  std::int64_t replicas = 1;  ///< R = world / G
  bool reshard_after_forward = true;
  int param_bytes = 4;   ///< bytes per element of gathered parameters, activations and their gradients
  int reduce_bytes = 4;  ///< bytes per element of reduced gradients
  std::string optimizer = "adam";
  int optimizer_copies = 2;  ///< shard-sized state tensors per parameter shard
  bool weight_decay = false;
  bool momentum = false;
  bool clip = false;
  std::int64_t grad_accum = 1;
  bool activation_checkpointing = false;
  bool deferred_init = false;                     ///< fsdp.deferred_init: the model is built and initialized unit by unit
  std::string backward_prefetch = "NO_PREFETCH";  ///< fsdp.backward_prefetch
  bool forward_prefetch = false;                  ///< fsdp.forward_prefetch
  bool overlap_grad_reduce = false;               ///< fsdp.overlap_grad_reduce, resolved (auto: see run_shape)
  std::int64_t batch = 64;                        ///< per rank
  std::int64_t test_batch = 0;                    ///< first evaluation batch per rank; 0: no evaluation
  bool evaluate = true;
  DataFootprint data;
  WrapDesc wrap;
  double baseline_mib = kDefaultBaselineMib;
  double heap_factor = kDefaultHeapFactor;
  std::int64_t mmap_threshold_bytes = 0;  ///< run.malloc_mmap_threshold_mib; 0: glibc's dynamic threshold
};

/// Optimizer state tensors per parameter element: fsdp-train's optimizer_state_copies().
inline int optimizer_state_copies(const std::string& kind, double momentum) {
  if (kind == "sgd") return momentum > 0 ? 1 : 0;
  return 2;  // adam, adamw: exp_avg, exp_avg_sq; adadelta: square_avg, acc_delta
}

/// fsdp.transformer_layer_cls_to_wrap as a list (fsdp-train's layer_classes()).
inline std::vector<std::string> layer_classes(const Deck& deck) {
  std::vector<std::string> names;
  std::stringstream ss(deck.get_string("fsdp.transformer_layer_cls_to_wrap"));
  for (std::string n; std::getline(ss, n, ',');) {
    n.erase(0, n.find_first_not_of(" \t"));
    n.erase(n.find_last_not_of(" \t") + 1);
    if (!n.empty()) names.push_back(n);
  }
  return names;
}

/// The shard group size `strategy` uses at `world` ranks (FullyShardedDataParallel::setup_groups);
/// throws fsdp-train's errors for group sizes that do not divide the world size.
inline std::int64_t shard_group_size(const Deck& deck, ShardingStrategy strategy, int world, int ranks_per_node) {
  if (strategy == ShardingStrategy::NO_SHARD) return 1;
  if (strategy != ShardingStrategy::HYBRID_SHARD && strategy != ShardingStrategy::HYBRID_SHARD_ZERO2) return world;
  std::int64_t g = deck.get_int("fsdp.shard_group_size");
  if (g > 0 && world % g != 0)
    throw DeckError(deck.entry("fsdp.shard_group_size").where + ": fsdp.shard_group_size: " + std::to_string(g) + " does not divide the world size " +
                    std::to_string(world));
  if (g == 0) g = ranks_per_node > 0 ? ranks_per_node : world;
  if (world % g != 0) throw ConfigError("world size " + std::to_string(world) + " is not divisible by shard_group_size " + std::to_string(g));
  return g;
}

inline RunShape run_shape(const Deck& deck, int world, int ranks_per_node, ShardingStrategy strategy, const DataFootprint& data) {
  RunShape r;
  r.world = world;
  r.ranks_per_node = ranks_per_node;
  r.strategy = strategy;
  r.group = shard_group_size(deck, strategy, world, ranks_per_node);
  r.replicas = world / r.group;
  const std::string reshard = deck.get_string("fsdp.reshard_after_forward");
  r.reshard_after_forward = reshard == "true"    ? true
                            : reshard == "false" ? false
                                                 : strategy == ShardingStrategy::FULL_SHARD || strategy == ShardingStrategy::HYBRID_SHARD;
  const std::string mp = deck.get_string("fsdp.mixed_precision");
  r.param_bytes = r.reduce_bytes = mp == "no" ? 4 : 2;
  r.optimizer = deck.get_string("optim.kind");
  r.optimizer_copies = optimizer_state_copies(r.optimizer, deck.get_float("optim.momentum"));
  r.weight_decay = deck.get_float("optim.weight_decay") > 0;
  r.momentum = deck.get_float("optim.momentum") > 0;
  r.clip = deck.get_float("optim.clip_grad_norm") > 0;
  r.grad_accum = deck.get_int("optim.grad_accum_steps");
  r.activation_checkpointing = deck.get_bool("fsdp.activation_checkpointing");
  // Keys of features that may not be in every schema version: read only where the schema has them.
  if (find_key("fsdp.deferred_init")) r.deferred_init = deck.get_bool("fsdp.deferred_init");
  if (find_key("fsdp.backward_prefetch")) r.backward_prefetch = deck.get_string("fsdp.backward_prefetch");
  if (find_key("fsdp.forward_prefetch")) r.forward_prefetch = deck.get_bool("fsdp.forward_prefetch");
  if (find_key("fsdp.overlap_grad_reduce")) {
    // auto as fsdp-train decides it, for this machine's cores, ranks not bound to CPUs.
    const int local = ranks_per_node > 0 ? ranks_per_node : world;
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    const auto threads = deck.get_int("run.threads");
    const int per_rank = threads > 0 ? static_cast<int>(threads) : std::max(1, cores / local);
    r.overlap_grad_reduce = world > 1 && overlap_grad_reduce_resolved(deck.get_string("fsdp.overlap_grad_reduce"), cores, per_rank, local, cores);
  }
  if (find_key("run.malloc_mmap_threshold_mib")) r.mmap_threshold_bytes = deck.get_int("run.malloc_mmap_threshold_mib") << 20;
  r.batch = deck.get_int("data.batch_size");
  r.data = data;
  const std::int64_t test_per_rank = (data.test_samples + world - 1) / world;
  r.test_batch = std::min(deck.get_int("data.test_batch_size"), test_per_rank);
  r.evaluate = r.test_batch > 0;
  r.wrap.policy = deck.get_string("fsdp.auto_wrap_policy");
  r.wrap.min_num_params = deck.get_int("fsdp.min_num_params");
  r.wrap.types = layer_classes(deck);
  return r;
}

// ==== 4. One forward pass as tensors created, saved for backward and released =======================

/// One step of a forward pass. kEnter/kExit: a module called through fsdp::forward begins/ends
/// (`saves` of kEnter holds its input, what activation checkpointing keeps). kCompute: an operation creates `outs`, saves `saves` for its
/// backward, drops the forward's references in `drops`, and produces gradients of `params` in backward,
/// needing `bwd_temp` bytes of activation gradients meanwhile.
struct TraceOp {
  enum class Kind : std::uint8_t { kEnter, kExit, kCompute };
  Kind kind = Kind::kCompute;
  int module = -1;
  std::vector<int> outs, saves, drops;
  std::vector<int> params;  ///< indices into Trace::param_names
  std::int64_t bwd_temp = 0;
};

struct Trace {
  std::vector<std::int64_t> tensor_bytes;
  std::vector<TraceOp> ops;
  std::vector<std::string> param_names;  ///< canonical parameter names used by ops
};

namespace detail {
class TraceBuilder {
 public:
  TraceBuilder(const ModelDesc& d, Trace& t) : desc_(d), t_(t) {
    for (std::size_t i = 0; i < d.modules.size(); ++i) {
      module_index_[d.modules[i].path] = static_cast<int>(i);
      for (const auto& p : d.modules[i].params) canonical_[p.name] = p.tied_to.empty() ? p.name : p.tied_to;
    }
  }
  int tensor(std::int64_t bytes) {
    t_.tensor_bytes.push_back(bytes);
    return static_cast<int>(t_.tensor_bytes.size()) - 1;
  }
  void enter(const std::string& path, int input) {
    TraceOp op;
    op.kind = TraceOp::Kind::kEnter;
    op.module = module(path);
    if (input >= 0) op.saves.push_back(input);
    t_.ops.push_back(std::move(op));
  }
  void exit(const std::string& path) {
    TraceOp op;
    op.kind = TraceOp::Kind::kExit;
    op.module = module(path);
    t_.ops.push_back(std::move(op));
  }
  /// An operation with one output of `out_bytes` (none if 0): returns the output's id (or -1).
  int op(std::int64_t out_bytes, std::vector<int> saves, std::vector<int> drops, std::vector<std::string> params, std::int64_t bwd_temp,
         bool save_out = false) {
    TraceOp op;
    int out = -1;
    if (out_bytes > 0) {
      out = tensor(out_bytes);
      op.outs.push_back(out);
      if (save_out) saves.push_back(out);
    }
    op.saves = std::move(saves);
    for (int d : drops)
      if (d >= 0) op.drops.push_back(d);
    for (const auto& p : params) op.params.push_back(param_index(p));
    op.bwd_temp = bwd_temp;
    t_.ops.push_back(std::move(op));
    return out;
  }
  /// A tensor the last operation creates and saves, referenced by nothing else (a dropout mask, the
  /// copies matmul makes of non-contiguous inputs, LayerNorm's statistics).
  int aux(std::int64_t bytes) {
    const int id = tensor(bytes);
    auto& op = t_.ops.back();
    op.outs.push_back(id);
    op.saves.push_back(id);
    op.drops.push_back(id);
    return id;
  }
  /// Ends the forward's reference to `ids` (an operation with no output).
  void drop(std::vector<int> ids) { op(0, {}, std::move(ids), {}, 0); }
  /// A Linear called through fsdp::forward on `in` (saved): out_bytes of output.
  int linear(const std::string& path, int in, std::int64_t in_bytes, std::int64_t out_bytes, std::int64_t extra_bwd = 0) {
    enter(path, in);
    std::vector<std::string> ps;
    for (const auto& p : desc_.modules[static_cast<std::size_t>(module(path))].params) ps.push_back(p.name);
    const int y = op(out_bytes, {in}, {}, ps, out_bytes + in_bytes + extra_bwd);
    exit(path);
    return y;
  }

 private:
  int module(const std::string& path) const {
    const auto it = module_index_.find(path);
    if (it == module_index_.end()) throw ConfigError("plan: no module '" + path + "' in the model description", "fsdp.plan");
    return it->second;
  }
  int param_index(const std::string& name) {
    const auto it = canonical_.find(name);
    const std::string c = it == canonical_.end() ? name : it->second;
    const auto [pos, added] = param_ids_.emplace(c, static_cast<int>(t_.param_names.size()));
    if (added) t_.param_names.push_back(c);
    return pos->second;
  }
  const ModelDesc& desc_;
  Trace& t_;
  std::unordered_map<std::string, int> module_index_, param_ids_;
  std::unordered_map<std::string, std::string> canonical_;
};
}  // namespace detail

/// The forward pass of the deck's model on a batch of `batch` samples whose activations take `eb` bytes
/// per element, in training mode (dropout on) or evaluation (dropout off). Tensor 0 stands for the
/// batch, which the training loop holds (and the simulator counts as data); the model's output is
/// dropped by the loss, whose saved tensors close the trace.
/// Saved per transformer block (B batch, T context, d d_model, r mlp_ratio, h heads, dropout p > 0):
/// (10 + 2r)·B·T·d + 3·B·h·T² elements plus LayerNorm statistics; with p = 0: (8 + 2r)·B·T·d + B·h·T².
inline Trace trace_forward(const ModelShape& s, const ModelDesc& d, std::int64_t batch, int eb, bool training, bool cast_input) {
  Trace t;
  detail::TraceBuilder b(d, t);
  constexpr int input = 0;
  t.tensor_bytes.push_back(0);
  const std::int64_t B = batch;
  auto keep = [](int x, int input_id) { return x == input_id ? -1 : x; };  // the batch is the loop's, never dropped here
  if (s.kind == "mlp" || s.kind == "cnn") {
    int x = input;
    std::int64_t x_bytes = B * 784 * 4;
    if (cast_input) {  // root forward: floating-point arguments cast to param_dtype
      x = b.op(B * 784 * eb, {}, {}, {}, 0);
      x_bytes = B * 784 * eb;
    }
    if (s.kind == "mlp") {
      const double p = training ? s.dropout.value_or(0.0) : 0.0;
      for (std::size_t i = 0; i < s.hidden_sizes.size(); ++i) {
        const std::int64_t h = s.hidden_sizes[i], hb = B * h * eb;
        const int y = b.linear("fc" + std::to_string(i + 1), x, x_bytes, hb);
        int r = b.op(hb, {}, {y, keep(x, input)}, {}, 2 * hb, /*save_out=*/true);  // relu saves its result
        if (p > 0) {
          const int dd = b.op(hb, {}, {r}, {}, 2 * hb);
          b.aux(hb);  // the dropout mask (a float tensor) saved by the multiplication
          r = dd;
        }
        x = r;
        x_bytes = hb;
      }
      const int y = b.linear("out", x, x_bytes, B * 10 * eb);
      const int ls = b.op(B * 10 * eb, {}, {y, keep(x, input)}, {}, 2 * B * 10 * eb, true);  // log_softmax
      int lo = ls;
      if (eb != 4) lo = b.op(B * 10 * 4, {}, {}, {}, B * 10 * 4);   // loss_of casts the output to fp32
      b.op(8, {lo}, {ls, lo == ls ? -1 : lo}, {}, 2 * B * 10 * 4);  // nll_loss
      return t;
    }
    // The tutorial CNN: conv 1->32 3x3, relu, conv 32->64 3x3, relu, max-pool 2, dropout, fc 9216->128,
    // relu, dropout, fc 128->10, log-softmax.
    const double p1 = training ? s.dropout.value_or(0.25) : 0.0, p2 = training ? s.dropout.value_or(0.5) : 0.0;
    const std::int64_t c1 = B * 32 * 26 * 26 * eb, c2 = B * 64 * 24 * 24 * eb, pool = B * 9216 * eb;
    int y = b.linear("conv1", x, x_bytes, c1);
    int r = b.op(c1, {}, {y, keep(x, input)}, {}, 2 * c1, true);
    y = b.linear("conv2", r, c1, c2);
    int r2 = b.op(c2, {}, {y}, {}, 2 * c2, true);
    b.drop({r});
    int mp = b.op(pool, {r2}, {r2}, {}, pool + c2);  // max_pool2d saves its input and the indices
    b.aux(B * 9216 * 8);
    b.enter("dropout1", mp);
    if (p1 > 0) {
      const int dd = b.op(pool, {}, {mp}, {}, 2 * pool);
      b.aux(pool);
      mp = dd;
    }
    b.exit("dropout1");
    y = b.linear("fc1", mp, pool, B * 128 * eb);
    r = b.op(B * 128 * eb, {}, {y, mp}, {}, 2 * B * 128 * eb, true);
    b.enter("dropout2", r);
    if (p2 > 0) {
      const int dd = b.op(B * 128 * eb, {}, {r}, {}, 2 * B * 128 * eb);
      b.aux(B * 128 * eb);
      r = dd;
    }
    b.exit("dropout2");
    y = b.linear("fc2", r, B * 128 * eb, B * 10 * eb);
    const int ls = b.op(B * 10 * eb, {}, {y, r}, {}, 2 * B * 10 * eb, true);
    int lo = ls;
    if (eb != 4) lo = b.op(B * 10 * 4, {}, {}, {}, B * 10 * 4);
    b.op(8, {lo}, {ls, lo == ls ? -1 : lo}, {}, 2 * B * 10 * 4);
    return t;
  }
  // GPT: token + position embeddings, n_layers pre-norm blocks, final LayerNorm, LM head.
  const auto& c = s.gpt;
  const double p = training ? c.dropout : 0.0;
  const std::int64_t T = c.context, D = c.d_model, H = c.n_heads, R = c.mlp_ratio, V = c.vocab_size;
  const std::int64_t btd = B * T * D * eb, scores = B * H * T * T * eb, stats = 2 * B * T * 4, logits = B * T * V * eb;
  b.enter("tok", input);
  const int e = b.op(btd, {}, {}, {"tok.weight"}, btd);
  b.exit("tok");
  const int positions = b.op(T * 8, {}, {}, {}, 0);
  b.enter("pos", positions);
  const int pe = b.op(T * D * eb, {positions}, {}, {"pos.weight"}, T * D * eb);
  b.exit("pos");
  int x = b.op(btd, {}, {e, pe, positions}, {}, btd);
  if (p > 0) {
    const int dd = b.op(btd, {}, {x}, {}, 2 * btd);
    b.aux(btd);
    x = dd;
  }
  for (std::int64_t i = 0; i < c.n_layers; ++i) {
    const std::string blk = "block" + std::to_string(i);
    b.enter(blk, x);
    // Every activation gradient inside a block coexists with the residual stream's gradient.
    b.enter(blk + ".ln1", x);
    const int a1 = b.op(btd, {x}, {}, {blk + ".ln1.weight", blk + ".ln1.bias"}, 3 * btd);
    b.aux(stats);
    b.exit(blk + ".ln1");
    b.enter(blk + ".attn", a1);
    const int q3 = b.linear(blk + ".attn.qkv", a1, btd, 3 * btd, btd);
    // q @ k^T: matmul copies the transposed head views into contiguous [B*h, T, hd] operands it saves.
    const int s0 = b.op(scores, {}, {}, {}, scores + 3 * btd);
    b.aux(btd);
    b.aux(btd);
    const int s1 = b.op(scores, {}, {s0}, {}, 2 * scores + btd);  // / sqrt(hd)
    const int s2 = b.op(scores, {}, {s1}, {}, 2 * scores + btd);  // masked_fill
    int pr = b.op(scores, {}, {s2}, {}, 2 * scores + btd, true);  // softmax saves its result
    int pd = pr;
    if (p > 0) {
      pd = b.op(scores, {}, {}, {}, 2 * scores + btd);
      b.aux(scores);
    }
    const int o = b.op(btd, {pd}, {}, {}, scores + 3 * btd);  // att @ v (v copied and saved)
    b.aux(btd);
    const int y = b.op(btd, {}, {o, pd, pd == pr ? -1 : pr}, {}, 3 * btd);  // transpose(1, 2).contiguous()
    int ao = b.linear(blk + ".attn.proj", y, btd, btd, btd);
    b.drop({y, q3});
    if (p > 0) {
      const int dd = b.op(btd, {}, {ao}, {}, 3 * btd);
      b.aux(btd);
      ao = dd;
    }
    b.exit(blk + ".attn");
    const int x2 = b.op(btd, {}, {ao, a1}, {}, btd);
    b.enter(blk + ".ln2", x2);
    const int a2 = b.op(btd, {x2}, {}, {blk + ".ln2.weight", blk + ".ln2.bias"}, 3 * btd);
    b.aux(stats);
    b.exit(blk + ".ln2");
    const int f = b.linear(blk + ".fc", a2, btd, R * btd, btd);
    const int g = b.op(R * btd, {f}, {f, a2}, {}, 2 * R * btd + btd);  // gelu saves its input
    int h = b.linear(blk + ".out", g, R * btd, btd, btd);
    b.drop({g});
    if (p > 0) {
      const int dd = b.op(btd, {}, {h}, {}, 3 * btd);
      b.aux(btd);
      h = dd;
    }
    const int x3 = b.op(btd, {}, {h, x2, x}, {}, btd);
    b.exit(blk);
    x = x3;
  }
  b.enter("ln_f", x);
  const int lf = b.op(btd, {x}, {x}, {"ln_f.weight", "ln_f.bias"}, 2 * btd);
  b.aux(stats);
  b.exit("ln_f");
  b.enter("head", lf);
  const int lg = b.op(logits, {lf}, {lf}, {"head.weight"}, logits + btd);
  b.exit("head");
  // loss_of: fp32 logits, log_softmax (saves its result), nll_loss.
  int l32 = lg;
  if (eb != 4) l32 = b.op(B * T * V * 4, {}, {}, {}, logits);
  const int ls = b.op(B * T * V * 4, {}, {}, {}, 2 * B * T * V * 4, true);
  b.op(8, {ls}, {ls, lg, l32 == lg ? -1 : l32}, {}, B * T * V * 4);
  return t;
}

// ==== 5. Replaying a run as allocations ==============================================================

/// What a byte of the plan is for (the rows of fsdp-plan's table).
enum class Mem : int {
  kShards,       ///< parameter shards (fp32 masters)
  kGrads,        ///< gradient shards
  kOptimizer,    ///< optimizer state
  kGathered,     ///< unsharded unit buffers
  kGradFlight,   ///< a unit's gradients between autograd and the optimizer: per-parameter grads, flat buffer, reduced shard
  kActivations,  ///< saved activations and activation gradients
  kStepTemps,    ///< optimizer step and gradient clipping temporaries
  kComm,         ///< ring reduce-scatter scratch and MPI's temporary buffers
  kBuild,        ///< model construction: the original parameters and flat copies
  kBuffers,      ///< module buffers (replicated on every rank)
  kData,         ///< the data set and the current batch
  kCount
};

inline const char* mem_label(Mem m) {
  switch (m) {
    case Mem::kShards: return "parameter shards";
    case Mem::kGrads: return "gradient shards";
    case Mem::kOptimizer: return "optimizer state";
    case Mem::kGathered: return "gathered unit buffers";
    case Mem::kGradFlight: return "unit gradients in flight";
    case Mem::kActivations: return "activations";
    case Mem::kStepTemps: return "optimizer/clip temporaries";
    case Mem::kComm: return "communication buffers";
    case Mem::kBuild: return "model construction";
    case Mem::kBuffers: return "module buffers";
    case Mem::kData: return "data set and batch";
    case Mem::kCount: break;
  }
  return "?";
}

inline constexpr int kMemKinds = static_cast<int>(Mem::kCount);
using MemArray = std::array<std::int64_t, kMemKinds>;

/// Live bytes per kind plus a model of glibc malloc: blocks at or above the (dynamic) mmap threshold
/// are mapped and return to the system when freed; smaller ones come from the heap, whose resident
/// size is its high-water mark of live bytes (freed heap memory is kept for reuse) times `heap_factor`
/// (fragmentation).
class MemorySim {
 public:
  /// `fixed_threshold` > 0: mallopt(M_MMAP_THRESHOLD) was called, the threshold no longer moves.
  explicit MemorySim(double heap_factor = kDefaultHeapFactor, std::int64_t fixed_threshold = 0)
      : heap_factor_(heap_factor),
        threshold_(fixed_threshold > 0 ? fixed_threshold : kMmapThresholdStartBytes),
        threshold_fixed_(fixed_threshold > 0) {}
  int alloc(Mem kind, std::int64_t bytes) {
    if (bytes <= 0) return -1;
    const bool mapped = bytes >= threshold_;
    int h;
    if (!free_slots_.empty()) {
      h = free_slots_.back();
      free_slots_.pop_back();
      blocks_[static_cast<std::size_t>(h)] = {bytes, kind, mapped, true};
    } else {
      blocks_.push_back({bytes, kind, mapped, true});
      h = static_cast<int>(blocks_.size()) - 1;
    }
    live_[static_cast<std::size_t>(kind)] += bytes;
    if (mapped)
      mapped_ += bytes;
    else
      heap_hw_ = std::max(heap_hw_, heap_ += bytes);
    max_[static_cast<std::size_t>(kind)] = std::max(max_[static_cast<std::size_t>(kind)], live_[static_cast<std::size_t>(kind)]);
    const std::int64_t heap_resident = static_cast<std::int64_t>(static_cast<double>(heap_hw_) * heap_factor_);
    const std::int64_t rss = mapped_ + heap_resident;
    if (rss > peak_) {
      peak_ = rss;
      at_peak_ = live_;
      retained_at_peak_ = heap_resident - heap_;
      mapped_at_peak_ = mapped_;
      heap_at_peak_ = heap_hw_;
      peak_phase_ = phase_;
    }
    phase_peak_[phase_] = std::max(phase_peak_[phase_], rss);
    live_peak_ = std::max(live_peak_, mapped_ + heap_);
    return h;
  }
  void free(int& h) {
    if (h < 0) return;
    auto& b = blocks_[static_cast<std::size_t>(h)];
    if (b.live) {
      b.live = false;
      live_[static_cast<std::size_t>(b.kind)] -= b.bytes;
      if (b.mapped) {
        mapped_ -= b.bytes;
        if (!threshold_fixed_ && b.bytes > threshold_ && b.bytes <= kMmapThresholdMaxBytes) threshold_ = b.bytes;  // glibc's dynamic threshold
      } else {
        heap_ -= b.bytes;
      }
      free_slots_.push_back(h);
    }
    h = -1;
  }
  /// Counts a live block as another kind from now on (a gradient that autograd adopts as .grad).
  void relabel(int h, Mem kind) {
    if (h < 0) return;
    auto& b = blocks_[static_cast<std::size_t>(h)];
    live_[static_cast<std::size_t>(b.kind)] -= b.bytes;
    b.kind = kind;
    live_[static_cast<std::size_t>(kind)] += b.bytes;
    max_[static_cast<std::size_t>(kind)] = std::max(max_[static_cast<std::size_t>(kind)], live_[static_cast<std::size_t>(kind)]);
  }
  void phase(const std::string& name) { phase_ = name; }

  std::int64_t peak() const { return peak_; }
  const MemArray& at_peak() const { return at_peak_; }
  std::int64_t retained_at_peak() const { return retained_at_peak_; }
  std::int64_t mapped_at_peak() const { return mapped_at_peak_; }
  std::int64_t heap_at_peak() const { return heap_at_peak_; }
  const std::string& peak_phase() const { return peak_phase_; }
  const MemArray& max_by_kind() const { return max_; }
  std::int64_t live_peak() const { return live_peak_; }
  std::int64_t phase_peak(const std::string& p) const {
    const auto it = phase_peak_.find(p);
    return it == phase_peak_.end() ? 0 : it->second;
  }
  std::int64_t live(Mem kind) const { return live_[static_cast<std::size_t>(kind)]; }

 private:
  struct Block {
    std::int64_t bytes;
    Mem kind;
    bool mapped;
    bool live;
  };
  std::vector<Block> blocks_;
  std::vector<int> free_slots_;
  MemArray live_{}, max_{}, at_peak_{};
  double heap_factor_;
  std::int64_t heap_ = 0, heap_hw_ = 0, mapped_ = 0, threshold_ = kMmapThresholdStartBytes;
  bool threshold_fixed_ = false;
  std::int64_t peak_ = 0, retained_at_peak_ = 0, live_peak_ = 0, mapped_at_peak_ = 0, heap_at_peak_ = 0;
  std::string phase_ = "start", peak_phase_;
  std::map<std::string, std::int64_t> phase_peak_;
};

/// The prediction for one rank (all ranks hold the same: shards are padded to equal size).
struct Prediction {
  std::int64_t num_params = 0;
  std::int64_t shard_elements = 0;  ///< sum of the units' shard_numel (fsdp-train's "shard elements")
  std::int64_t padding = 0;         ///< padding in all units
  std::int64_t state_bytes = 0;     ///< params + grads + optimizer state: fsdp-train's "expected ... MiB"
  std::size_t units = 0;
  std::int64_t largest_unit = 0;  ///< padded elements
  std::string largest_unit_path;
  std::int64_t model_bytes = 0;  ///< peak of the modelled allocations (without the baseline)
  std::int64_t total_bytes = 0;  ///< model_bytes + baseline: the predicted peak RSS
  std::int64_t baseline_bytes = 0;
  MemArray at_peak{};                 ///< live bytes per kind at the peak
  std::int64_t retained_at_peak = 0;  ///< freed heap memory glibc holds at the peak
  std::int64_t mapped_at_peak = 0;    ///< bytes in mmap()ed blocks at the peak
  std::int64_t heap_at_peak = 0;      ///< the heap's high-water of live bytes at the peak (times heap_factor: resident)
  std::int64_t live_peak = 0;         ///< the most bytes live at once (no allocator model)
  MemArray max_by_kind{};             ///< each kind's own maximum
  std::string peak_phase;             ///< "construction", "training step", "evaluation"
  std::int64_t construction_peak = 0, step_peak = 0, eval_peak = 0;  ///< without the baseline
  std::vector<PlanUnit> unit_list;
};

namespace detail {

/// Replays data loading, model construction, two training steps and one evaluation batch.
class RunSimulator {
 public:
  RunSimulator(const ModelShape& shape, const ModelDesc& desc, const std::vector<PlanUnit>& units, const RunShape& run)
      : shape_(shape), desc_(desc), units_(units), run_(run), mem_(run.heap_factor, run.mmap_threshold_bytes) {
    module_unit_.assign(desc.modules.size(), -1);
    for (const auto& u : units) module_unit_[static_cast<std::size_t>(u.module)] = u.index;
    for (const auto& u : units)
      for (std::size_t i = 0; i < u.params.size(); ++i) {
        param_unit_[u.params[i]] = u.index;
        param_numel_[u.params[i]] = u.numels[i];
      }
    const std::size_t n = units.size();
    full_.assign(n, -1);
    shard_.assign(n, -1);
    grad_.assign(n, -1);
    state_.assign(n, {});
    unsynced_.assign(n, -1);
    pending_.assign(n, {});
  }

  Prediction run() {
    load_data();
    construct();
    mem_.phase("training step");
    const std::int64_t micro = std::min<std::int64_t>(run_.grad_accum, 2);
    for (int step = 0; step < 2; ++step) {
      for (std::int64_t a = 0; a < micro; ++a) micro_batch(a + 1 < micro);
      optimizer_step(step == 0);
    }
    if (run_.evaluate) {
      mem_.phase("evaluation");
      evaluate();
    }
    Prediction p;
    p.model_bytes = mem_.peak();
    p.at_peak = mem_.at_peak();
    p.retained_at_peak = mem_.retained_at_peak();
    p.mapped_at_peak = mem_.mapped_at_peak();
    p.heap_at_peak = mem_.heap_at_peak();
    p.live_peak = mem_.live_peak();
    p.max_by_kind = mem_.max_by_kind();
    p.peak_phase = mem_.peak_phase();
    p.construction_peak = mem_.phase_peak("construction");
    p.step_peak = mem_.phase_peak("training step");
    p.eval_peak = mem_.phase_peak("evaluation");
    return p;
  }

 private:
  bool needs_gather(const PlanUnit& u) const { return u.numel > 0 && (run_.group > 1 || run_.param_bytes != 4); }

  void load_data() {
    mem_.phase("data");
    int peak = mem_.alloc(Mem::kData, run_.data.load_peak_bytes);
    data_ = mem_.alloc(Mem::kData, run_.data.resident_bytes);
    mem_.free(peak);
    // The sampler's per-epoch permutation of the whole train split, then this rank's indices.
    int perm = mem_.alloc(Mem::kData, run_.data.train_samples * 8);
    indices_ = mem_.alloc(Mem::kData, (run_.data.train_samples + run_.world - 1) / run_.world * 8);
    mem_.free(perm);
  }

  void construct() {
    mem_.phase("construction");
    // build_model: every distinct parameter tensor and the buffers (with fsdp.deferred_init the layers
    // release their storage as they are built, and each unit's parameters exist only while it is flattened).
    std::map<std::string, int> original;
    std::map<std::string, std::int64_t> numel;
    for (const auto& m : desc_.modules) {
      for (const auto& p : m.params)
        if (p.tied_to.empty()) {
          numel[p.name] = p.numel();
          if (!run_.deferred_init) original[p.name] = mem_.alloc(Mem::kBuild, p.numel() * 4);
        }
      if (m.buffer_numel > 0) buffers_.push_back(mem_.alloc(Mem::kBuffers, m.buffer_numel * (run_.param_bytes == 4 ? 4 : 2)));
    }
    // build_units, unit by unit: the padded flat copy, the shard, views of it, the originals freed.
    for (const auto& u : units_) {
      if (u.numel == 0) continue;
      if (run_.deferred_init)
        for (const auto& name : u.params) original[name] = mem_.alloc(Mem::kBuild, numel[name] * 4);
      int full = mem_.alloc(Mem::kBuild, u.padded * 4);
      if (run_.group == 1) {
        mem_.relabel(full, Mem::kShards);
        shard_[static_cast<std::size_t>(u.index)] = full;
        full = -1;
      } else {
        shard_[static_cast<std::size_t>(u.index)] = mem_.alloc(Mem::kShards, u.shard * 4);
      }
      int low = run_.param_bytes != 4 ? mem_.alloc(Mem::kGathered, u.padded * run_.param_bytes) : -1;
      for (const auto& name : u.params) mem_.free(original[name]);
      mem_.free(low);   // reshard
      mem_.free(full);  // reshard (G > 1) or the end of the iteration (the fp32 copy under mixed precision)
    }
  }

  int unit_of_module(int module) const { return module_unit_[static_cast<std::size_t>(module)]; }

  void gather(int ui) {
    if (ui < 0) return;
    const auto& u = units_[static_cast<std::size_t>(ui)];
    if (!needs_gather(u) || full_[static_cast<std::size_t>(ui)] >= 0) return;
    full_[static_cast<std::size_t>(ui)] = mem_.alloc(Mem::kGathered, u.padded * run_.param_bytes);
  }
  // Prefetching (fsdp.forward_prefetch, fsdp.backward_prefetch): the all-gather of the unit that runs
  // next is issued early, so it is gathered alongside the running one (one unit ahead: the engine
  // prefetches a single neighbour per unit, and fsdp.limit_all_gathers >= 1 bounds what is in flight).
  void prefetch_after(int ui, int direction) {
    if (run_.group == 1) return;  // nothing is all-gathered: the engine does not prefetch
    const int at = order_pos_[static_cast<std::size_t>(ui)];
    if (at < 0) {
      if (ui == 0 && direction < 0 && !order_.empty()) gather(order_.back());
      return;
    }
    const int pos = at + direction;
    if (pos >= 0 && pos < static_cast<int>(order_.size())) gather(order_[static_cast<std::size_t>(pos)]);
  }
  void reshard(int ui) { mem_.free(full_[static_cast<std::size_t>(ui)]); }

  // ---- tensors of the trace ----
  void make(const Trace& t, int id) {
    if (handle_[static_cast<std::size_t>(id)] >= 0 || t.tensor_bytes[static_cast<std::size_t>(id)] <= 0) return;
    handle_[static_cast<std::size_t>(id)] = mem_.alloc(Mem::kActivations, t.tensor_bytes[static_cast<std::size_t>(id)]);
    refs_[static_cast<std::size_t>(id)] = 1;
  }
  void unref(int id) {
    auto& r = refs_[static_cast<std::size_t>(id)];
    if (r <= 0) return;
    if (--r == 0) mem_.free(handle_[static_cast<std::size_t>(id)]);
  }
  void ref(int id) {
    if (handle_[static_cast<std::size_t>(id)] >= 0) ++refs_[static_cast<std::size_t>(id)];
  }

  // Forward of ops [begin, end), saving for backward when `grad`. `recompute`: the forward of a
  // checkpointed unit run again in backward; only tensors it creates (listed in `created`) take part.
  void forward_ops(const Trace& t, std::size_t begin, std::size_t end, bool grad, bool recompute, std::vector<int>* created) {
    for (std::size_t i = begin; i < end; ++i) {
      const auto& op = t.ops[i];
      if (op.kind == TraceOp::Kind::kEnter || op.kind == TraceOp::Kind::kExit) {
        const int ui = unit_of_module(op.module);
        if (ui <= 0 || recompute) continue;
        if (op.kind == TraceOp::Kind::kEnter) {
          gather(ui);
          if (grad && run_.forward_prefetch) prefetch_after(ui, +1);
          if (grad && run_.activation_checkpointing && ckpt_unit_ < 0) {
            ckpt_unit_ = ui;  // a checkpointed unit: its forward keeps only its input
            ckpt_begin_ = i;
            for (int s : op.saves) ref(s);
            ckpt_input_ = op.saves;
          }
        } else {
          if (ckpt_unit_ == ui) {
            ckpt_regions_.push_back({ckpt_begin_, i, ckpt_input_});
            ckpt_unit_ = -1;
          }
          if (!grad || run_.reshard_after_forward) reshard(ui);
        }
        continue;
      }
      const bool saving = grad && ckpt_unit_ < 0;
      for (int o : op.outs) {
        const bool was_live = handle_[static_cast<std::size_t>(o)] >= 0;
        make(t, o);
        if (created && !was_live) created->push_back(o);
      }
      if (saving || recompute)
        for (int s : op.saves)
          if (!recompute || std::find(created->begin(), created->end(), s) != created->end()) ref(s);
      for (int d : op.drops)
        if (!recompute || std::find(created->begin(), created->end(), d) != created->end()) unref(d);
    }
  }

  // The trace's parameters by index: their unit and size, and the gradient autograd holds for them.
  void index_params(const Trace& t) {
    const std::size_t n = t.param_names.size();
    tparam_unit_.resize(n);
    tparam_numel_.resize(n);
    pending_handle_.assign(n, -1);
    for (std::size_t i = 0; i < n; ++i) {
      tparam_unit_[i] = param_unit_.at(t.param_names[i]);
      tparam_numel_[i] = param_numel_.at(t.param_names[i]);
    }
    for (auto& l : pending_) l.clear();
  }

  // An op's backward: its parameters' gradients join their unit's pending ones (a tied weight's second
  // gradient is added into the first), its activation gradients come and go, its saved tensors go.
  void backward_op(const TraceOp& op) {
    for (int pi : op.params) {
      auto& h = pending_handle_[static_cast<std::size_t>(pi)];
      if (h >= 0) continue;
      h = mem_.alloc(Mem::kGradFlight, tparam_numel_[static_cast<std::size_t>(pi)] * run_.param_bytes);
      pending_[static_cast<std::size_t>(tparam_unit_[static_cast<std::size_t>(pi)])].push_back(pi);
    }
    int temp = mem_.alloc(Mem::kActivations, op.bwd_temp);
    mem_.free(temp);
    for (int s : op.saves) unref(s);
  }

  void free_pending(int ui) {
    auto& list = pending_[static_cast<std::size_t>(ui)];
    for (int pi : list) mem_.free(pending_handle_[static_cast<std::size_t>(pi)]);
    list.clear();
  }

  // UnitGather::backward: pack, (reduce-scatter, all-reduce), hand the shard gradient to autograd.
  void reduce(int ui, bool no_sync) {
    const auto& u = units_[static_cast<std::size_t>(ui)];
    if (u.numel == 0) return;
    int flat = mem_.alloc(Mem::kGradFlight, u.padded * 4);
    auto& unsynced = unsynced_[static_cast<std::size_t>(ui)];
    if (no_sync) {
      free_pending(ui);
      if (unsynced >= 0)
        mem_.free(flat);  // added into the accumulator
      else {
        mem_.relabel(flat, Mem::kGrads);  // kept as the accumulator (no_sync costs one unsharded gradient per unit)
        unsynced = flat;
      }
      reshard(ui);
      return;
    }
    mem_.free(unsynced);           // added into flat
    if (run_.reduce_bytes != 4) {  // cast to reduce_dtype: the collectives move these bytes
      int low = mem_.alloc(Mem::kGradFlight, u.padded * run_.reduce_bytes);
      mem_.free(flat);
      flat = low;
    }
    int shard_grad = flat;
    const bool overlapped = run_.overlap_grad_reduce && run_.group * run_.replicas > 1;
    if (run_.group > 1) {
      shard_grad = mem_.alloc(Mem::kGradFlight, u.shard * run_.reduce_bytes);
      grow_scratch(overlapped ? worker_shard_scratch_ : shard_scratch_, overlapped ? worker_shard_scratch_bytes_ : shard_scratch_bytes_,
                   2 * u.shard * run_.reduce_bytes);
    }
    if (run_.replicas > 1) all_reduce(u.shard * run_.reduce_bytes, run_.reduce_bytes, overlapped);
    if (overlapped && flat != shard_grad) {
      // The engine keeps at most two unreduced unit gradients waiting for the worker; this one waits
      // until two more are issued or backward ends (worst case: the worker is behind).
      while (waiting_flats_.size() >= 2) {
        mem_.free(waiting_flats_.front());
        waiting_flats_.erase(waiting_flats_.begin());
      }
      waiting_flats_.push_back(flat);
      flat = shard_grad;  // not freed below
    }
    int returned = shard_grad;
    if (run_.reduce_bytes != 4) returned = mem_.alloc(Mem::kGradFlight, u.shard * 4);  // back to the master's dtype
    free_pending(ui);
    if (flat != shard_grad) mem_.free(flat);
    if (returned != shard_grad) mem_.free(shard_grad);
    auto& grad = grad_[static_cast<std::size_t>(ui)];
    if (grad < 0) {  // AccumulateGrad adopts the first gradient as .grad
      mem_.relabel(returned, Mem::kGrads);
      grad = returned;
    } else {
      mem_.free(returned);  // added in place
    }
    reshard(ui);
  }

  void grow_scratch(int& handle, std::int64_t& bytes, std::int64_t want) {
    if (want <= bytes) return;
    const int old = handle;
    handle = mem_.alloc(Mem::kComm, want);  // std::vector::resize: new block, copy, free the old one
    int o = old;
    mem_.free(o);
    bytes = want;
  }

  // fsdp::MpiComm's floating-point all-reduce: the ring reduce-scatter (two chunks of scratch, kept by
  // the communicator: the worker's own when overlapped) into a chunk, then MPI_Allgather; a padded
  // copy only when the elements are not a multiple of the ranks. (At most 8 KiB gathered it gathers the
  // whole buffers instead: a few KiB, not modelled.)
  void all_reduce(std::int64_t bytes, int element_bytes, bool overlapped) {
    const std::int64_t n = bytes / element_bytes, chunk = (n + run_.replicas - 1) / run_.replicas;
    int padded = chunk * run_.replicas == n ? -1 : mem_.alloc(Mem::kComm, chunk * run_.replicas * element_bytes);
    int mine = mem_.alloc(Mem::kComm, chunk * element_bytes);
    grow_scratch(overlapped ? worker_replica_scratch_ : replica_scratch_, overlapped ? worker_replica_scratch_bytes_ : replica_scratch_bytes_,
                 2 * chunk * element_bytes);
    mem_.free(mine);
    mem_.free(padded);
  }

  std::int64_t input_bytes(std::int64_t batch) const {
    if (shape_.kind == "transformer") return batch * shape_.gpt.context * 8;  // token ids (int64)
    return batch * 784 * 4;
  }
  std::int64_t target_bytes(std::int64_t batch) const {
    if (shape_.kind == "transformer") return batch * shape_.gpt.context * 8;
    return batch * 8;
  }

  void micro_batch(bool no_sync) {
    const std::int64_t B = run_.batch;
    int x = mem_.alloc(Mem::kData, input_bytes(B));
    int y = mem_.alloc(Mem::kData, target_bytes(B));
    const bool cast = run_.param_bytes != 4 && shape_.kind != "transformer";
    if (train_trace_.ops.empty()) train_trace_ = trace_forward(shape_, desc_, B, run_.param_bytes, true, cast);
    const Trace& t = train_trace_;
    handle_.assign(t.tensor_bytes.size(), -1);
    refs_.assign(t.tensor_bytes.size(), 0);
    index_params(t);
    ckpt_regions_.clear();
    order_.clear();  // nested units in the order their forwards begin
    order_pos_.assign(units_.size(), -1);
    for (const auto& op : t.ops) {
      const int ui = op.kind == TraceOp::Kind::kEnter ? unit_of_module(op.module) : -1;
      if (ui <= 0 || order_pos_[static_cast<std::size_t>(ui)] >= 0) continue;
      order_pos_[static_cast<std::size_t>(ui)] = static_cast<int>(order_.size());
      order_.push_back(ui);
    }
    // forward
    gather(0);
    forward_ops(t, 0, t.ops.size(), true, false, nullptr);
    // backward, in reverse order
    std::size_t region = ckpt_regions_.size();
    std::vector<int> recomputed;
    if (run_.backward_prefetch != "NO_PREFETCH") prefetch_after(0, -1);  // the root's backward begins first
    for (std::size_t i = t.ops.size(); i-- > 0;) {
      const auto& op = t.ops[i];
      if (op.kind == TraceOp::Kind::kExit) {
        const int ui = unit_of_module(op.module);
        if (ui > 0) gather(ui);  // the output hook re-gathers a freed unit
        if (ui > 0 && run_.backward_prefetch == "BACKWARD_PRE") prefetch_after(ui, -1);
        if (region > 0 && ckpt_regions_[region - 1].end == i) {
          recomputed.clear();
          forward_ops(t, ckpt_regions_[region - 1].begin + 1, i, true, true, &recomputed);
        }
      } else if (op.kind == TraceOp::Kind::kEnter) {
        const int ui = unit_of_module(op.module);
        if (ui > 0 && run_.backward_prefetch == "BACKWARD_POST") prefetch_after(ui, -1);
        if (ui > 0) reduce(ui, no_sync);
        if (region > 0 && ckpt_regions_[region - 1].begin == i) {
          for (int id : recomputed) {
            refs_[static_cast<std::size_t>(id)] = std::min(refs_[static_cast<std::size_t>(id)], 1);
            unref(id);
          }
          for (int s : ckpt_regions_[region - 1].inputs) unref(s);
          --region;
        }
      } else {
        backward_op(op);
      }
    }
    reduce(0, no_sync);
    // end of backward: everything still gathered is freed; the step's tensors die; the overlapped
    // reductions are waited for.
    for (std::size_t ui = 0; ui < units_.size(); ++ui) reshard(static_cast<int>(ui));
    for (int& h : waiting_flats_) mem_.free(h);
    waiting_flats_.clear();
    for (auto& h : handle_) mem_.free(h);
    mem_.free(x);
    mem_.free(y);
  }

  void optimizer_step(bool first) {
    for (const auto& u : units_) {
      if (u.numel == 0) continue;
      const std::int64_t bytes = u.shard * 4;
      if (run_.clip) {  // clip_grad_norm: |g|^2 in double
        int d = mem_.alloc(Mem::kStepTemps, 2 * bytes);
        int a = mem_.alloc(Mem::kStepTemps, 2 * bytes);
        mem_.free(d);
        int pw = mem_.alloc(Mem::kStepTemps, 2 * bytes);
        mem_.free(pw);
        mem_.free(a);
      }
    }
    for (const auto& u : units_) {
      if (u.numel == 0) continue;
      const std::int64_t bytes = u.shard * 4;
      auto& st = state_[static_cast<std::size_t>(u.index)];
      if (first)
        for (int c = 0; c < run_.optimizer_copies; ++c) st.push_back(mem_.alloc(Mem::kOptimizer, bytes));
      const bool l2 = run_.weight_decay && run_.optimizer != "adamw";
      int wd = l2 ? mem_.alloc(Mem::kStepTemps, bytes) : -1;
      if (run_.optimizer == "adam" || run_.optimizer == "adamw" || run_.optimizer == "adadelta") {
        int t1 = mem_.alloc(Mem::kStepTemps, bytes);  // sqrt()
        int t2 = mem_.alloc(Mem::kStepTemps, bytes);  // / sqrt(bias_correction2)  (adadelta: the delta)
        if (run_.optimizer != "adadelta") mem_.free(t1);
        mem_.free(t2);
        mem_.free(t1);
      }
      mem_.free(wd);
    }
  }

  void evaluate() {
    const std::int64_t B = run_.test_batch;
    int idx = mem_.alloc(Mem::kData, (run_.data.test_samples + run_.world - 1) / run_.world * 8);
    int x = mem_.alloc(Mem::kData, input_bytes(B));
    int y = mem_.alloc(Mem::kData, target_bytes(B));
    const bool cast = run_.param_bytes != 4 && shape_.kind != "transformer";
    const Trace t = trace_forward(shape_, desc_, B, run_.param_bytes, false, cast);
    handle_.assign(t.tensor_bytes.size(), -1);
    refs_.assign(t.tensor_bytes.size(), 0);
    gather(0);
    forward_ops(t, 0, t.ops.size(), false, false, nullptr);
    int argmax = mem_.alloc(Mem::kActivations, B * (shape_.kind == "transformer" ? shape_.gpt.context : 1) * 8);
    for (std::size_t ui = 0; ui < units_.size(); ++ui) reshard(static_cast<int>(ui));
    for (auto& h : handle_) mem_.free(h);
    mem_.free(argmax);
    mem_.free(x);
    mem_.free(y);
    mem_.free(idx);
  }

  struct Region {
    std::size_t begin, end;
    std::vector<int> inputs;
  };

  const ModelShape& shape_;
  const ModelDesc& desc_;
  const std::vector<PlanUnit>& units_;
  const RunShape& run_;
  MemorySim mem_;
  std::vector<int> module_unit_;
  std::unordered_map<std::string, int> param_unit_;
  std::unordered_map<std::string, std::int64_t> param_numel_;
  std::vector<int> full_, shard_, grad_, unsynced_;
  std::vector<std::vector<int>> state_;
  std::vector<std::vector<int>> pending_;  ///< per unit: trace parameters whose gradient autograd holds
  std::vector<int> tparam_unit_, pending_handle_;
  std::vector<std::int64_t> tparam_numel_;
  std::vector<int> buffers_;
  int data_ = -1, indices_ = -1;
  int shard_scratch_ = -1, replica_scratch_ = -1;
  std::int64_t shard_scratch_bytes_ = 0, replica_scratch_bytes_ = 0;
  int worker_shard_scratch_ = -1, worker_replica_scratch_ = -1;  // the collective worker's communicators
  std::int64_t worker_shard_scratch_bytes_ = 0, worker_replica_scratch_bytes_ = 0;
  std::vector<int> waiting_flats_;  // overlapped reductions' unit gradients not yet reduced
  std::vector<int> handle_, refs_;
  std::vector<int> order_, order_pos_;
  Trace train_trace_;
  int ckpt_unit_ = -1;
  std::size_t ckpt_begin_ = 0;
  std::vector<int> ckpt_input_;
  std::vector<Region> ckpt_regions_;
};

}  // namespace detail

/// Predicts one rank's memory for `shape` under `run`.
inline Prediction predict(const ModelShape& shape, const RunShape& run) {
  const ModelDesc desc = describe_model(shape);
  const auto units = plan_units(desc, run.wrap, run.group);
  detail::RunSimulator sim(shape, desc, units, run);
  Prediction p = sim.run();
  p.num_params = desc.num_params();
  p.units = units.size();
  for (const auto& u : units) {
    p.shard_elements += u.shard;
    p.padding += u.padded - u.numel;
    if (u.padded > p.largest_unit) {
      p.largest_unit = u.padded;
      p.largest_unit_path = u.path.empty() ? "(root)" : u.path;
    }
  }
  p.state_bytes = p.shard_elements * 4 * (2 + run.optimizer_copies);
  p.baseline_bytes = static_cast<std::int64_t>(run.baseline_mib * 1048576.0);
  p.total_bytes = p.model_bytes + p.baseline_bytes;
  p.unit_list = units;
  return p;
}

// ==== 6. The largest model that fits ==================================================================

/// The largest value in [lo, ...) for which fits(v) holds, assuming fits is monotone (true then false);
/// 0 if not even `lo` fits. Stops at `cap` (returned if it still fits).
inline std::int64_t largest_fitting(std::int64_t lo, std::int64_t cap, const std::function<bool(std::int64_t)>& fits) {
  if (!fits(lo)) return 0;
  std::int64_t good = lo, bad = -1, probe = lo;
  while (bad < 0) {
    probe = std::min(cap, probe * 2);
    if (fits(probe)) {
      good = probe;
      if (probe == cap) return cap;
    } else {
      bad = probe;
    }
  }
  while (bad - good > 1) {
    const std::int64_t mid = good + (bad - good) / 2;
    (fits(mid) ? good : bad) = mid;
  }
  return good;
}

}  // namespace fsdp::app
