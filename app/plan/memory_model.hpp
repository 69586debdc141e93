// Memory planning (app layer): what each byte is for (Mem), live bytes with a model of glibc malloc
// (MemorySim), and the prediction it yields.
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

#include "plan/forward_trace.hpp"

namespace fsdp::app {

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
  kStaging,      ///< checkpoint.async: the host copy of the shards and optimizer state a background write reads
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
    case Mem::kStaging: return "checkpoint staging (async)";
    case Mem::kCount: break;
  }
  return "?";
}

inline constexpr int kMemKinds = static_cast<int>(Mem::kCount);
using MemArray = std::array<std::int64_t, kMemKinds>;

/// Live bytes per kind plus a model of glibc malloc: blocks at or above the (dynamic) mmap threshold
/// are mapped and return to the system when freed; smaller ones come from the heap, whose resident
/// size is its high-water mark of live bytes (freed heap memory is kept for reuse), each byte weighted
/// by its fragmentation factor: `heap_factor`, or `activation_heap_factor` (when > 0) for activations.
class MemorySim {
 public:
  /// `fixed_threshold` > 0: mallopt(M_MMAP_THRESHOLD) was called, the threshold no longer moves.
  explicit MemorySim(double heap_factor = kDefaultHeapFactor, std::int64_t fixed_threshold = 0, double activation_heap_factor = 0)
      : heap_factor_(heap_factor),
        activation_heap_factor_(activation_heap_factor > 0 ? activation_heap_factor : heap_factor),
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
    if (mapped) {
      mapped_ += bytes;
    } else {
      heap_hw_ = std::max(heap_hw_, heap_ += bytes);
      if (kind == Mem::kActivations) heap_activations_ += bytes;
      resident_hw_ = std::max(resident_hw_, resident_heap());
    }
    max_[static_cast<std::size_t>(kind)] = std::max(max_[static_cast<std::size_t>(kind)], live_[static_cast<std::size_t>(kind)]);
    const std::int64_t heap_resident = resident_hw_;
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
        if (b.kind == Mem::kActivations) heap_activations_ -= b.bytes;
      }
      free_slots_.push_back(h);
    }
    h = -1;
  }
  /// Counts a live block as another kind from now on (a gradient that autograd adopts as .grad).
  void relabel(int h, Mem kind) {
    if (h < 0) return;
    auto& b = blocks_[static_cast<std::size_t>(h)];
    if (!b.mapped) {
      heap_activations_ += (kind == Mem::kActivations ? b.bytes : 0) - (b.kind == Mem::kActivations ? b.bytes : 0);
      resident_hw_ = std::max(resident_hw_, resident_heap());
    }
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
  /// The live heap bytes times their factors; with one factor exactly the former hw x factor's rounding.
  std::int64_t resident_heap() const {
    if (activation_heap_factor_ == heap_factor_) return static_cast<std::int64_t>(static_cast<double>(heap_) * heap_factor_);
    return static_cast<std::int64_t>(static_cast<double>(heap_ - heap_activations_) * heap_factor_ +
                                     static_cast<double>(heap_activations_) * activation_heap_factor_);
  }

  std::vector<Block> blocks_;
  std::vector<int> free_slots_;
  MemArray live_{}, max_{}, at_peak_{};
  double heap_factor_, activation_heap_factor_;
  std::int64_t heap_activations_ = 0, resident_hw_ = 0;  // live heap bytes of activations; the high-water of resident_heap()
  std::int64_t heap_ = 0, heap_hw_ = 0, mapped_ = 0, threshold_ = kMmapThresholdStartBytes;
  bool threshold_fixed_ = false;
  std::int64_t peak_ = 0, retained_at_peak_ = 0, live_peak_ = 0, mapped_at_peak_ = 0, heap_at_peak_ = 0;
  std::string phase_ = "start", peak_phase_;
  std::map<std::string, std::int64_t> phase_peak_;
};

/// Bytes of one rank's training state: its fp32 parameter shards, and for what its optimizer updates
/// (the shards, or their replica parts with fsdp.optimizer_sharding = world) the fp32 gradients and
/// `state_bytes_per_element` bytes of optimizer state (OptimSection::state_bytes_per_element).
/// fsdp-train's "expected ... MiB" and fsdp-plan's state row.
inline std::int64_t training_state_bytes(std::int64_t shard_elements, std::int64_t optimized_elements, int state_bytes_per_element) {
  return 4 * shard_elements + optimized_elements * (4 + state_bytes_per_element);
}

/// The prediction for one rank (all ranks hold the same: shards are padded to equal size).
struct Prediction {
  std::int64_t num_params = 0;
  std::int64_t shard_elements = 0;      ///< sum of the units' shard_numel (fsdp-train's "shard elements")
  std::int64_t optimized_elements = 0;  ///< of those, what the optimizer updates (replica parts with optimizer_sharding = world)
  std::int64_t padding = 0;             ///< padding in all units
  std::int64_t state_bytes = 0;         ///< params + grads + optimizer state: fsdp-train's "expected ... MiB"
  std::size_t units = 0;
  std::int64_t largest_unit = 0;  ///< padded elements
  std::string largest_unit_path;
  std::int64_t model_bytes = 0;  ///< peak of the modelled allocations (without the baseline)
  std::int64_t total_bytes = 0;  ///< model_bytes + baseline: the predicted peak RSS
  std::int64_t baseline_bytes = 0;
  MemArray at_peak{};                 ///< live bytes per kind at the peak
  std::int64_t retained_at_peak = 0;  ///< freed heap memory glibc holds at the peak
  std::int64_t mapped_at_peak = 0;    ///< bytes in mmap()ed blocks at the peak
  std::int64_t heap_at_peak = 0;      ///< the heap's high-water of live bytes at the peak (times the factors: resident)
  std::int64_t live_peak = 0;         ///< the most bytes live at once (no allocator model)
  MemArray max_by_kind{};             ///< each kind's own maximum
  std::string peak_phase;             ///< "construction", "training step", "evaluation"
  std::int64_t construction_peak = 0, step_peak = 0, eval_peak = 0;  ///< without the baseline
  std::vector<PlanUnit> unit_list;
};

}  // namespace fsdp::app
