// Memory planning (app layer): everything besides the model that decides memory (RunShape): strategy,
// shard group, precision, optimizer, batch and the data's footprint, from the resolved deck.
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

#include <zlib.h>

#include "app_build.hpp"
#include "fsdp/core/strategy.hpp"
#include "plan/measured.hpp"
#include "models/families.hpp"
#include "run_config.hpp"

namespace fsdp::app {

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
inline DataFootprint data_footprint(const RunConfig& cfg) {
  DataFootprint f;
  const DataKind kind = cfg.data.kind;
  const auto context = cfg.model.context;
  if (kind == DataKind::kFashionMnist || kind == DataKind::kMnist) {
    const std::string& dir = cfg.data.path;
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
  } else if (kind == DataKind::kTokens) {
    const auto n = cfg.data.num_samples;
    const auto test = std::max<std::int64_t>(n / 10, 1);
    f.resident_bytes = (n + test) * (context + 1) * 4;  // int32 tokens
    f.train_samples = n;
    f.test_samples = test;
    f.note = "synthetic int32 token sequences";
  } else if (is_token_file_data(kind)) {
    // Memory-mapped: the pages read are the kernel's file cache (reclaimable), not the process's heap.
    f.note = "token files memory-mapped (read pages are file cache); samples not counted without opening the files";
  } else {  // text
    const std::string& path = cfg.data.path;
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
  const auto limit_train = cfg.data.train_samples, limit_test = cfg.data.test_samples;
  if (limit_train > 0) f.train_samples = std::min(f.train_samples, limit_train);
  if (limit_test > 0) f.test_samples = std::min(f.test_samples, limit_test);
  return f;
}

/// Everything besides the model that decides memory, from the deck and the command line.
struct RunShape {
  int world = 1;
  int ranks_per_node = 0;  ///< 0: all ranks on one node
  ShardingStrategy strategy = ShardingStrategy::FULL_SHARD;
  std::int64_t group = 1;             ///< shard group size G
  std::int64_t replicas = 1;          ///< R = world / G
  bool optimizer_over_world = false;  ///< fsdp.optimizer_sharding = world (hybrid, R > 1): optimizer state, master gradients over all ranks
  bool reshard_after_forward = true;
  int reshard_after_forward_group = 0;  ///< fsdp.reshard_after_forward = N: kept sharded over N ranks between forward and backward
  int param_bytes = 4;                  ///< bytes per element of gathered parameters, activations and their gradients
  int reduce_bytes = 4;                 ///< bytes per element of reduced gradients
  OptimizerKind optimizer = OptimizerKind::kAdam;
  int optimizer_copies = 2;     ///< shard-sized state tensors per parameter shard
  int state_element_bytes = 4;  ///< bytes per element of each state tensor (optim.state_dtype)
  bool weight_decay = false;
  bool momentum = false;
  bool clip = false;
  std::int64_t grad_accum = 1;
  bool reduce_every_micro_batch = false;  ///< optim.accum_reduce = every: no unsharded gradient kept between micro-batches
  bool async_checkpoint = false;          ///< checkpoint.async with any save: host copies of the training state from the first step on
  int async_copies = 1;                   ///< how many (checkpoint.async_when_writing = "queue": 2)
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
  double activation_heap_factor = 0;                 ///< the activations' own factor; 0: heap_factor (fsdp-plan --heap-factor sets both)
  std::int64_t mmap_threshold_bytes = kNeverMapped;  ///< run.malloc through mmap_threshold_of: from what size freed blocks go back
};

/// Bytes per element of gathered parameters and activations under fsdp.mixed_precision.
inline int gathered_param_bytes(Precision p) { return p == Precision::kNo || p == Precision::kFp16Reduce ? 4 : 2; }

/// The size from which freed blocks go back to the system under run.malloc, for the allocator
/// fsdp-train links (app_build.hpp). glibc: the mmap threshold (0: its dynamic one, "untouched").
/// jemalloc: its large size classes under "return"; nothing under "reuse" and "untouched" (its
/// built-in settings keep freed pages).
inline std::int64_t mmap_threshold_of(MallocPolicy malloc_policy) {
  if constexpr (kTrainLinksJemalloc) return malloc_policy == MallocPolicy::kReturn ? kJemallocLargeBytes : kNeverMapped;
  switch (malloc_policy) {
    case MallocPolicy::kReturn: return kReturnThresholdBytes;
    case MallocPolicy::kUntouched: return 0;
    case MallocPolicy::kReuse: break;
  }
  return kNeverMapped;
}

/// The measured heap factor for an allocator policy (mmap_threshold_of) and model.kind: when freed
/// memory is kept, jemalloc's one factor, or under glibc each family's own (plan/measured.hpp).
inline double default_heap_factor(std::int64_t mmap_threshold_bytes, ModelKind model_kind) {
  if (mmap_threshold_bytes != kNeverMapped) return kDefaultHeapFactor;
  if constexpr (kTrainLinksJemalloc) return kJemallocReuseHeapFactor;
  return model_family(model_kind).reuse_heap_factor();
}

/// The activations' own heap factor: under glibc's "reuse" with activation checkpointing, whose
/// recomputed forwards fragment the heap more than the state; otherwise 0 (the heap's factor).
inline double default_activation_heap_factor(std::int64_t mmap_threshold_bytes, bool activation_checkpointing) {
  return !kTrainLinksJemalloc && mmap_threshold_bytes == kNeverMapped && activation_checkpointing ? kReuseHeapFactorCheckpointedActivations : 0;
}

/// The shape of the deck's run (`cfg`, resolved for the planned placement) under `strategy`: the deck's
/// strategy or another one for the side-by-side table (the shard group and resharding then follow it).
inline RunShape run_shape(const RunConfig& cfg, ShardingStrategy strategy, const DataFootprint& data) {
  RunShape r;
  const int world = cfg.placement.world_size;
  r.world = world;
  r.ranks_per_node = cfg.placement.ranks_per_node;
  r.strategy = strategy;
  r.group = strategy == cfg.fsdp.sharding_strategy
                ? cfg.fsdp.shard_group_size
                : shard_group_size(strategy, world, is_hybrid(strategy) ? cfg.fsdp.shard_group_size_requested : 0, cfg.placement.ranks_per_node);
  r.replicas = world / r.group;
  r.optimizer_over_world = cfg.fsdp.optimizer_sharding == OptimizerSharding::WORLD && is_hybrid(strategy) && r.replicas > 1;
  r.reshard_after_forward = cfg.fsdp.reshard_after_forward_asked.value_or(reshard_after_forward_default(strategy));
  r.reshard_after_forward_group = strategy == cfg.fsdp.sharding_strategy ? cfg.fsdp.reshard_after_forward_group : 0;
  r.param_bytes = gathered_param_bytes(cfg.fsdp.mixed_precision);
  r.reduce_bytes = cfg.fsdp.mixed_precision == Precision::kNo ? 4 : 2;
  r.optimizer = cfg.optim.kind;
  r.optimizer_copies = cfg.optim.state_copies();
  r.state_element_bytes = cfg.optim.state_dtype == StateDtype::kBf16 ? 2 : 4;
  r.weight_decay = cfg.optim.weight_decay > 0;
  r.momentum = cfg.optim.momentum > 0;
  r.clip = cfg.optim.clip_grad_norm > 0;
  r.grad_accum = cfg.optim.grad_accum_steps;
  r.reduce_every_micro_batch = cfg.optim.reduce_every_micro_batch;
  r.async_checkpoint = cfg.checkpoint.asynchronous && (cfg.checkpoint.every_steps > 0 || cfg.checkpoint.save_final);
  r.async_copies = cfg.checkpoint.async_copies();
  r.activation_checkpointing = cfg.fsdp.activation_checkpointing;
  r.deferred_init = cfg.fsdp.deferred_init;
  r.backward_prefetch = cfg.fsdp.backward_prefetch_name;
  r.forward_prefetch = cfg.fsdp.forward_prefetch;
  r.overlap_grad_reduce = world > 1 && cfg.fsdp.overlap_grad_reduce;  // one rank has no reductions to overlap
  r.mmap_threshold_bytes = mmap_threshold_of(cfg.run.malloc);
  r.heap_factor = default_heap_factor(r.mmap_threshold_bytes, cfg.model.kind);
  r.activation_heap_factor = default_activation_heap_factor(r.mmap_threshold_bytes, r.activation_checkpointing);
  r.batch = cfg.data.batch_size;
  r.data = data;
  const std::int64_t test_per_rank = (data.test_samples + world - 1) / world;
  r.test_batch = std::min(cfg.data.test_batch_size, test_per_rank);
  r.evaluate = r.test_batch > 0;
  r.wrap.policy = cfg.fsdp.auto_wrap_policy;
  r.wrap.min_num_params = cfg.fsdp.min_num_params;
  r.wrap.types = cfg.fsdp.transformer_layer_cls_to_wrap;
  return r;
}

}  // namespace fsdp::app
