// A host copy of everything a checkpoint holds (io layer), taken from a live engine between two steps:
// this rank's shards, the optimizer's state for them, the buffers and the RNG state, with the engine's
// layout and its own duplicates of the engine's communicators (as MPI communicators: HDF5 and the
// gathers of a FULL save run on the host). The save functions take a snapshot in place of the
// engine, so a save from a snapshot on another thread writes the same file a save from the engine
// would have written at the moment of the capture.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/comm/mpi_comm.hpp"
#include "fsdp/errors.hpp"
#include "fsdp/io/checkpoint_state.hpp"
#include "fsdp/io/host_copy.hpp"
#include "fsdp/torch/optim_state.hpp"
#include "fsdp/torch/options.hpp"

namespace fsdp {

namespace detail {
/// An MPI communicator of its own over the ranks of `comm` (a duplicate, for another thread). Collective.
template <class Comm>
MpiComm duplicate_as_mpi(Comm& comm) {
  MpiComm mpi = mpi_of(comm);
  return mpi.split(0, mpi.rank());
}

/// A host tensor of `sizes` to stage `like`'s kind of data in: page-locked when `like` is on a GPU, so
/// the copy is a plain DMA; zero-filled, so that its pages are mapped now rather than during a save's copy.
inline torch::Tensor staging_like(const torch::Tensor& like, c10::IntArrayRef sizes) {
  return torch::zeros(sizes, torch::TensorOptions().dtype(like.scalar_type()).device(torch::kCPU).pinned_memory(like.is_cuda()));
}
inline torch::Tensor staging_like(const torch::Tensor& like) { return staging_like(like, like.sizes()); }

}  // namespace detail

template <class Engine>
class CheckpointSnapshot {
 public:
  /// Duplicates the engine's world, shard-group and replica-group communicators. Collective over the world.
  explicit CheckpointSnapshot(Engine& engine)
      : world_(detail::duplicate_as_mpi(engine.comm())),
        shard_(detail::duplicate_as_mpi(engine.shard_comm())),
        replica_(detail::duplicate_as_mpi(engine.replica_comm())) {}

  CheckpointSnapshot(const CheckpointSnapshot&) = delete;
  CheckpointSnapshot& operator=(const CheckpointSnapshot&) = delete;

  /// Copies the engine's shards, `optimizer`'s state for them (null: none), the buffers and the CPU RNG
  /// state into host buffers, allocated at the first capture and reused by the next ones: the only part
  /// of an asynchronous save that holds up training, so it copies on copy_threads() threads. Local.
  /// With `in_background`, the host shards and optimizer state are only listed here and copied later by
  /// copy_rest() and finish_copy() (any thread): the caller must call finish_copy() before
  /// anything changes them (an optimizer step, a load). Pairs that are not plain host memory (a GPU's)
  /// and the buffers (a forward may update them) are copied now; so is everything when the optimizer
  /// is sharded over the replicas (the next forward rewrites the shards from its parts).
  /// With the optimizer sharded over the replicas its state is staged as the optimizer holds it (this
  /// rank's parts), and the write gathers it over the snapshot's replica communicator; the shards must
  /// be current (FullyShardedDataParallel::synchronize_shards(), which AsyncCheckpointer::save calls).
  void capture(Engine& engine, const torch::optim::Optimizer* optimizer, bool in_background = false) {
    torch::NoGradGuard no_grad;
    const auto live = engine.sharded_units();
    reserve_units(live);
    std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;  // (staged, live), copied together below
    bool parts_over_replicas = false;
    for (std::size_t k = 0; k < live.size(); ++k) {
      if (live[k].shard.defined()) copies.emplace_back(units_[k].shard, live[k].shard);
      if (live[k].optimizer_sharded_over_replicas()) {
        copies.emplace_back(units_[k].optimized, live[k].optimized);
        parts_over_replicas = true;
      }
    }
    capture_optimizer(optimizer, live, copies);
    pending_.reset();
    if (in_background && !parts_over_replicas) {
      detail::HostCopyPlan later;
      std::vector<torch::Tensor> sources;
      std::vector<std::pair<torch::Tensor, torch::Tensor>> now;
      for (auto& pair : copies) {
        if (!pair.second.defined() || pair.second.numel() == 0) continue;
        if (later.add(pair.first, pair.second))
          sources.push_back(pair.second);
        else
          now.push_back(std::move(pair));
      }
      copies = std::move(now);
      pending_ = std::make_shared<detail::BackgroundCopy>(std::move(later), std::move(sources));
    }
    const auto buffers = detail::named_buffers_of(engine);
    reserve_buffers(buffers);
    for (std::size_t b = 0; b < buffers.size(); ++b) copies.emplace_back(buffers_[b].second, buffers[b].second);
    detail::copy_all(copies, copy_threads_);
    rng_ = detail::capture_rng_state(engine.compute_device());
    world_size_ = engine.world_size();
    shard_group_size_ = engine.shard_group_size();
    strategy_ = engine.sharding_strategy();
    plan_hash_ = engine.plan_hash();
    aliases_ = engine.tied_parameter_aliases();
  }

  /// Bytes the last capture left to copy in the background (0: it copied everything).
  std::size_t background_bytes() const noexcept { return pending_ ? pending_->bytes() : 0; }
  /// Copies what the last capture left for the background until nothing is left to take. Any thread.
  void copy_rest() noexcept {
    if (pending_) pending_->help();
  }
  /// Copies what is left of it on this thread and `threads` - 1 helpers, and waits for the parts other
  /// threads took: the sources may change once this returns. Any thread.
  void finish_copy(int threads = 1) {
    if (pending_) pending_->finish(threads);
  }
  /// Whether the background copy is done (true when there was none).
  bool copy_finished() const { return !pending_ || pending_->finished(); }
  /// After finish_copy(): whether a source was written in place before its copy ended, so that the
  /// copy may mix two steps (the caller changed the state without calling finish_copy() first).
  bool copy_torn() const noexcept { return pending_ && pending_->sources_changed(); }

  /// The threads a capture copies with (default: detail::default_copy_threads()).
  void set_copy_threads(int threads) noexcept { copy_threads_ = std::max(1, threads); }
  int copy_threads() const noexcept { return copy_threads_; }

  /// Allocates (and touches) the staging buffers for the engine's state and `optimizer`'s as they are
  /// now, without copying: the first capture then costs no more than the next ones. Local.
  void reserve(Engine& engine, const torch::optim::Optimizer* optimizer) {
    const auto live = engine.sharded_units();
    reserve_units(live);
    reserve_buffers(detail::named_buffers_of(engine));
    if (!optimizer) return;
    for (std::size_t k = 0; k < live.size(); ++k) {
      const auto view = detail::unit_optimizer_state(optimizer, live[k]);
      if (!view) continue;
      for (const auto& [name, t] : view->tensors) staging_for(optim_staging_[k][name], t);
    }
  }

  /// The stand-in optimizer holding the captured state (null when captured without one).
  const torch::optim::Optimizer* optimizer() const noexcept { return has_optimizer_ ? optimizer_.get() : nullptr; }

  /// Bytes of host memory the staging buffers hold. Local.
  std::int64_t staging_bytes() const {
    std::int64_t bytes = 0;
    auto add = [&](const torch::Tensor& t) {
      if (t.defined()) bytes += t.numel() * static_cast<std::int64_t>(t.element_size());
    };
    for (const auto& u : units_) {
      add(u.shard);
      if (u.optimizer_sharded_over_replicas()) add(u.optimized);
    }
    for (const auto& unit : optim_staging_)
      for (const auto& [name, t] : unit) add(t);
    for (const auto& [name, t] : buffers_) add(t);
    return bytes;
  }

  // ---- the engine's checkpoint interface (fsdp/io/checkpoint_save.hpp), on the copies ---------------
  MpiComm& comm() noexcept { return world_; }
  MpiComm& shard_comm() noexcept { return shard_; }
  MpiComm& replica_comm() noexcept { return replica_; }
  int rank() const { return world_.rank(); }
  int world_size() const noexcept { return world_size_; }
  int shard_group_size() const noexcept { return shard_group_size_; }
  ShardingStrategy sharding_strategy() const noexcept { return strategy_; }
  std::uint64_t plan_hash() const noexcept { return plan_hash_; }
  const std::map<std::string, std::vector<std::string>>& tied_parameter_aliases() const noexcept { return aliases_; }
  std::vector<ShardedUnit> sharded_units() const { return units_; }
  const std::vector<std::pair<std::string, torch::Tensor>>& checkpoint_buffers() const noexcept { return buffers_; }
  const detail::RngState& checkpoint_rng_state() const noexcept { return rng_; }
  /// The copies are current and complete once captured: nothing to bring in or to settle.
  static constexpr bool kCollectivesMayBePending = false;
  void synchronize_shards() noexcept {}
  void synchronize_collectives() noexcept {}

  /// The padded flat tensor of unit `unit` from every shard rank's `shard_like`. Collective over the shard group.
  torch::Tensor gather_flat(int unit, const torch::Tensor& shard_like) {
    const auto& u = units_.at(static_cast<std::size_t>(unit));
    const auto src = shard_like.contiguous();
    if (src.numel() != u.layout.shard_numel())
      throw CheckpointError("checkpoint snapshot: unit " + std::to_string(unit) + " expects " + std::to_string(u.layout.shard_numel()) +
                            " elements, got " + std::to_string(src.numel()));
    if (u.layout.group_size() == 1) return src.clone();
    auto out = torch::empty({u.layout.padded_numel()}, torch::TensorOptions().dtype(src.scalar_type()));
    shard_.all_gather(src.data_ptr(), out.data_ptr(), u.layout.shard_numel(), detail::to_comm_dtype(src.scalar_type()));
    return out;
  }

 private:
  /// The stand-in optimizer has the live one's type, groups and options, with the staged shards as its
  /// parameters; its per-parameter state points at staging copies of the live state.
  void capture_optimizer(const torch::optim::Optimizer* live, const std::vector<ShardedUnit>& live_units,
                         std::vector<std::pair<torch::Tensor, torch::Tensor>>& copies) {
    has_optimizer_ = live != nullptr;
    if (!live) return;
    if (!optimizer_) {
      std::map<const c10::TensorImpl*, torch::Tensor> staged_of;
      for (std::size_t k = 0; k < live_units.size(); ++k)
        if (live_units[k].optimized.defined()) staged_of[live_units[k].optimized.unsafeGetTensorImpl()] = units_[k].optimized;
      std::vector<torch::optim::OptimizerParamGroup> groups;
      for (const auto& g : live->param_groups()) {
        std::vector<torch::Tensor> params;
        for (const auto& p : g.params()) {
          const auto it = staged_of.find(p.unsafeGetTensorImpl());
          params.push_back(it != staged_of.end() ? it->second : torch::empty({0}));  // not a unit's shard: never saved
        }
        groups.emplace_back(std::move(params), g.options().clone());
      }
      optimizer_ = make_optimizer_like(*live, std::move(groups));
    }
    if (optimizer_->param_groups().size() != live->param_groups().size())
      throw CheckpointError("checkpoint snapshot: the optimizer's parameter groups changed since the first capture");
    for (std::size_t g = 0; g < live->param_groups().size(); ++g)
      optimizer_->param_groups()[g].set_options(live->param_groups()[g].options().clone());
    optimizer_->state().clear();
    for (std::size_t k = 0; k < live_units.size(); ++k) {
      auto view = detail::unit_optimizer_state(live, live_units[k]);
      if (!view) continue;
      for (auto& [name, t] : view->tensors) {
        auto& staged = staging_for(optim_staging_[k][name], t);
        copies.emplace_back(staged, t);
        t = staged;
      }
      optimizer_->state()[optimizer_state_key(units_[k].optimized)] = make_optimizer_state(*live, *view);
    }
  }

  /// `staged`, (re)allocated when it does not have `sizes` and `like`'s dtype.
  static torch::Tensor& staging_for(torch::Tensor& staged, const torch::Tensor& like, c10::IntArrayRef sizes) {
    if (!staged.defined() || staged.sizes() != sizes || staged.scalar_type() != like.scalar_type()) staged = detail::staging_like(like, sizes);
    return staged;
  }
  static torch::Tensor& staging_for(torch::Tensor& staged, const torch::Tensor& like) { return staging_for(staged, like, like.sizes()); }
  void reserve_units(const std::vector<ShardedUnit>& live) {
    if (units_.empty()) {
      units_ = live;
      for (auto& u : units_) {
        if (u.shard.defined()) u.shard = detail::staging_like(u.shard);
        // The stand-in optimizer's parameters: the staged shard, or a staged copy of the replica part.
        u.optimized = u.optimizer_sharded_over_replicas() ? detail::staging_like(u.optimized) : u.shard;
      }
      optim_staging_.resize(units_.size());
    }
    if (live.size() != units_.size()) throw CheckpointError("checkpoint snapshot: the engine's units changed since the first capture");
  }
  void reserve_buffers(const std::vector<std::pair<std::string, torch::Tensor>>& buffers) {
    if (buffers.size() != buffers_.size()) buffers_.assign(buffers.size(), {});
    for (std::size_t b = 0; b < buffers.size(); ++b) {
      buffers_[b].first = buffers[b].first;
      staging_for(buffers_[b].second, buffers[b].second);
    }
  }

  MpiComm world_, shard_, replica_;
  std::vector<ShardedUnit> units_;                                   // the engine's, with staged shards
  std::vector<std::map<std::string, torch::Tensor>> optim_staging_;  // per unit: state name -> staged tensor
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  bool has_optimizer_ = false;
  std::vector<std::pair<std::string, torch::Tensor>> buffers_;
  detail::RngState rng_;
  int world_size_ = 0, shard_group_size_ = 0;
  ShardingStrategy strategy_ = ShardingStrategy::FULL_SHARD;
  std::uint64_t plan_hash_ = 0;
  std::map<std::string, std::vector<std::string>> aliases_;
  int copy_threads_ = detail::default_copy_threads();
  std::shared_ptr<detail::BackgroundCopy> pending_;  // the last capture's copy left for the background
};

}  // namespace fsdp
