// FullyShardedDataParallel: wraps a torch::nn::Module so that each rank keeps 1/N of every unit's
// flat parameter (torch layer). See docs/design.md for the flow of one step.
//
// Per unit: the parameters are flattened into one padded buffer `full`; each rank keeps `shard`, its
// part over the shard group, and the leaf tensor `optimized` the optimizer updates (the shard itself,
// or with the optimizer sharded over the world this replica's part of it); every module parameter is a
// view of `full`, whose storage is freed while resharded and refilled by an all-gather. A custom
// autograd Function (UnitGather) sits between `optimized` and the parameter views: its backward packs
// the unit's gradients into a flat buffer and reduce-scatters them, so autograd accumulates the
// averaged gradient into `optimized.grad()`.
#pragma once

#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <set>
#include <future>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "fsdp/comm/collective_worker.hpp"
#include "fsdp/comm/communicator.hpp"
#include "fsdp/core/layout.hpp"
#include "fsdp/core/strategy.hpp"
#include "fsdp/core/text.hpp"
#include "fsdp/errors.hpp"
#include "fsdp/torch/deferred_init.hpp"
#include "fsdp/torch/flat_unit.hpp"
#include "fsdp/torch/hooks.hpp"
#include "fsdp/torch/module_tree.hpp"
#include "fsdp/torch/options.hpp"
#include "fsdp/torch/sharded_runtime.hpp"
#include "fsdp/torch/unit_builder.hpp"
#include "fsdp/torch/optim_state.hpp"
#include "fsdp/torch/wrap_policy.hpp"
#include "fsdp/trace.hpp"

namespace fsdp {

/// Wraps `module` (a std::shared_ptr to a torch::nn::Module subclass) for fully sharded data parallel
/// training over communicator `Comm`. Construction, forward, backward, summon_full_params() and
/// memory_stats() with an optimizer are collective: every rank calls them in the same order.
template <class ModuleImpl, Communicator Comm>
class FullyShardedDataParallel : public torch::nn::Module {
 public:
  using communicator_type = Comm;
  FullyShardedDataParallel(std::shared_ptr<ModuleImpl> module, Comm comm, FsdpOptions options = {})
      : torch::nn::Module("FullyShardedDataParallel"),
        module_(checked_module(std::move(module))),
        runtime_(std::move(comm), std::move(options), *this, *module_),
        built_(detail::UnitBuilder<Comm>(runtime_, *module_).build()) {
    for (const auto& u : runtime_.units())
      if (!u->frozen && !u->params.empty()) register_parameter("flat_shard_" + std::to_string(u->info.index), u->optimized, /*requires_grad=*/true);
    runtime_.setup_overlap();
    runtime_.register_units();
  }

  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  /// Runs the wrapped module's forward on this rank's local batch. Collective.
  template <class... Args>
  auto forward(Args&&... args) {
    const TraceScope traced("forward (root)", "forward");
    runtime_.root_pre_forward();
    auto result = module_->forward(cast_input(std::forward<Args>(args))...);
    std::vector<at::Tensor> outputs;
    const bool complete = detail::collect_tensors(result, outputs);
    runtime_.root_post_forward(outputs, complete);
    return result;
  }

  /// A floating-point tensor argument of the root forward in MixedPrecision::param_dtype.
  torch::Tensor cast_input(const torch::Tensor& t) const {
    const auto& mp = runtime_.options().mixed_precision;
    if (mp.param_dtype && mp.cast_forward_inputs && t.defined() && t.is_floating_point()) return t.to(*mp.param_dtype);
    return t;
  }
  template <class T>
  requires(!std::is_same_v<std::decay_t<T>, torch::Tensor>) T && cast_input(T&& arg)
  const { return std::forward<T>(arg); }

  /// The wrapped module. Its parameters are views of the gathered buffers: read them only inside
  /// summon_full_params().
  std::shared_ptr<ModuleImpl> module() const { return module_; }

  const FsdpOptions& options() const noexcept { return runtime_.options(); }
  /// All-gathers that overlapped computation and the time the computing thread still waited. Local.
  const OverlapStats& overlap_stats() const noexcept { return runtime_.overlap_stats(); }

  /// Where the units compute (FsdpOptions::device, or where the module's parameters were).
  torch::Device compute_device() const noexcept { return runtime_.compute_device(); }
  ShardingStrategy sharding_strategy() const noexcept { return runtime_.options().sharding_strategy; }
  Comm& comm() noexcept { return runtime_.groups().world; }
  Comm& shard_comm() noexcept { return runtime_.groups().shard; }
  Comm& replica_comm() noexcept { return runtime_.groups().replica; }
  int rank() const { return runtime_.groups().world.rank(); }
  int world_size() const { return runtime_.groups().world.size(); }
  int shard_group_size() const { return runtime_.groups().shard.size(); }

  /// The units in creation order (index 0 is the root).
  std::vector<UnitInfo> units() const {
    std::vector<UnitInfo> out;
    for (const auto& u : runtime_.units()) {
      UnitInfo i = u->info;
      const auto& owner = u->frozen ? *runtime_.units()[static_cast<std::size_t>(u->info.parent)] : *u;
      i.called_through_hook = owner.hooked == detail::FlatUnit::Hooked::kYes;
      out.push_back(std::move(i));
    }
    return out;
  }

  /// Total number of (unpadded) model parameters.
  std::int64_t num_params() const {
    std::int64_t n = 0;
    for (const auto& u : runtime_.units()) n += u->layout.numel();
    return n;
  }

  void train(bool on = true) override {
    torch::nn::Module::train(on);
    module_->train(on);
  }

  /// Refused: the flat shards, the gathered buffers and the parameters' views of them would part (a
  /// moved shard no longer backs the module's parameters). Choose the device and dtype before wrapping
  /// (FsdpOptions::device, MixedPrecision).
  void to(torch::Device device, torch::Dtype dtype, bool /*non_blocking*/ = false) override { refuse_to(device.str() + ", " + c10::toString(dtype)); }
  void to(torch::Dtype dtype, bool /*non_blocking*/ = false) override { refuse_to(c10::toString(dtype)); }
  void to(torch::Device device, bool /*non_blocking*/ = false) override { refuse_to(device.str()); }

  /// RAII scope in which every module parameter holds its full value on every rank.
  class FullParamsScope {
   public:
    FullParamsScope(FullyShardedDataParallel* owner, bool writeback, std::vector<int> gathered_here, std::vector<torch::Tensor> saved)
        : owner_(owner), writeback_(writeback), gathered_here_(std::move(gathered_here)), saved_(std::move(saved)) {}
    FullParamsScope(FullParamsScope&& other) noexcept
        : owner_(std::exchange(other.owner_, nullptr)),
          writeback_(other.writeback_),
          gathered_here_(std::move(other.gathered_here_)),
          saved_(std::move(other.saved_)) {}
    FullParamsScope(const FullParamsScope&) = delete;
    FullParamsScope& operator=(const FullParamsScope&) = delete;
    FullParamsScope& operator=(FullParamsScope&&) = delete;
    /// Local (no communication): keeps or discards changes, then frees what the scope gathered.
    ~FullParamsScope() {
      if (!owner_) return;
      try {
        owner_->end_summon(writeback_, gathered_here_, saved_);
      } catch (const std::exception& e) {  // a destructor must not throw; this is a bug if it happens
        std::fprintf(stderr, "fsdp: summon_full_params scope end failed: %s\n", e.what());
      }
    }

   private:
    FullyShardedDataParallel* owner_;
    bool writeback_;
    std::vector<int> gathered_here_;
    std::vector<torch::Tensor> saved_;  // per unit: the shard at entry where shard and full share storage
  };

  /// Gathers every unit so module()->parameters() hold full values (hfai's summon_full_params).
  /// With `writeback`, changes made to the parameters inside the scope (under torch::NoGradGuard, the
  /// same on every rank) are kept; without it they are discarded. Collective on entry; the end is local.
  [[nodiscard]] FullParamsScope summon_full_params(bool writeback = false) {
    for (auto& u : runtime_.units()) runtime_.finish_prefetch(*u);  // a prefetch left by a forward that did not use it
    synchronize_shards();
    std::vector<int> gathered_here;
    std::vector<torch::Tensor> saved(runtime_.units().size());
    for (auto& u : runtime_.units()) {
      if (u->low_precision && !u->params.empty()) {
        // Full precision inside the scope: gather the master shards and point the parameters there.
        u->summoned = gather_flat(u->info.index, u->shard);
        u->point_params_at(u->summoned);
        continue;
      }
      if (!u->gathered) {
        runtime_.gather(*u);
        gathered_here.push_back(u->info.index);
      }
      // Units whose `full` is the shard's own storage expose the shard itself; keep a copy to restore
      // if changes are discarded.
      if (!writeback && full_is_shard(*u)) saved[static_cast<std::size_t>(u->info.index)] = u->shard.detach().clone();
    }
    return FullParamsScope(this, writeback, std::move(gathered_here), std::move(saved));
  }

  /// Scales the shards' gradients so that their global `norm_type`-norm is at most `max_norm` and
  /// returns the norm before clipping (PyTorch's clip_grad_norm_). Every element is counted once:
  /// the shards of a group are disjoint, replica groups hold copies, padding is zero. Collective.
  double clip_grad_norm(double max_norm, double norm_type = 2.0) {
    if (!(max_norm > 0)) throw ConfigError("clip_grad_norm: max_norm must be positive, got " + std::to_string(max_norm));
    if (!(norm_type > 0)) throw ConfigError("clip_grad_norm: norm_type must be positive, got " + std::to_string(norm_type));
    torch::NoGradGuard no_grad;
    const bool is_inf = std::isinf(norm_type);
    std::vector<torch::Tensor> per_unit;  // stays where the gradients are until one copy to the host: one sync, not one per unit
    for (const auto& u : runtime_.units()) {
      if (!u->optimized.defined() || !u->optimized.grad().defined()) continue;
      const auto g = u->optimized.grad().to(torch::kDouble).abs();
      per_unit.push_back(!is_inf ? g.pow(norm_type).sum() : g.numel() ? g.max() : torch::zeros({}, g.options()));
    }
    double local = 0;
    if (!per_unit.empty()) {
      const auto host = torch::stack(per_unit).to(torch::kCPU);
      const double* value = host.data_ptr<double>();
      for (std::int64_t i = 0; i < host.numel(); ++i) local = is_inf ? std::max(local, value[i]) : local + value[i];  // in unit order, as before
    }
    // The parts are disjoint over the shard group, or over the world when the optimizer is sharded there.
    Comm& holders = runtime_.optimizer_sharded_over_replicas() ? runtime_.groups().world : runtime_.groups().shard;
    holders.all_reduce(&local, &local, 1, DType::kFloat64, is_inf ? ReduceOp::kMax : ReduceOp::kSum);
    const double total = is_inf ? local : std::pow(local, 1.0 / norm_type);
    const double coef = max_norm / (total + 1e-6);
    if (coef < 1) {
      for (auto& u : runtime_.units())
        if (u->optimized.defined() && u->optimized.grad().defined()) u->optimized.mutable_grad().mul_(coef);
    }
    return total;
  }

  /// fp16 loss scaling (fsdp::DynamicLossScale, PyTorch's ShardedGradScaler.unscale_): divides every
  /// shard gradient by `scale` and returns whether any rank's gradients hold an inf or NaN, in which
  /// case the caller skips the optimizer step. Call after backward, before clip_grad_norm. Collective
  /// over all ranks, which all get the same answer.
  bool unscale_grads(double scale) {
    if (!(scale > 0) || !std::isfinite(scale))
      throw ConfigError("unscale_grads: the loss scale must be positive and finite, got " + std::to_string(scale));
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> finite;  // per unit, read once at the end: one host sync, not one per unit
    for (auto& u : runtime_.units()) {
      if (!u->optimized.defined() || !u->optimized.grad().defined()) continue;
      auto& g = u->optimized.mutable_grad();
      finite.push_back(torch::isfinite(g).all());
      g.mul_(1.0 / scale);
    }
    std::int32_t found = finite.empty() || torch::stack(finite).all().template item<bool>() ? 0 : 1;
    runtime_.groups().world.all_reduce(&found, &found, 1, DType::kInt32, ReduceOp::kMax);
    return found != 0;
  }

  /// RAII scope for gradient accumulation without communication: backward passes inside it keep the
  /// unit gradients locally (unsharded, like PyTorch's no_sync); the first backward after it reduces
  /// them together with its own. Local.
  class NoSyncScope {
   public:
    explicit NoSyncScope(FullyShardedDataParallel* owner) : owner_(owner), previous_(owner->runtime_.exchange_no_sync(true)) {}
    NoSyncScope(NoSyncScope&& other) noexcept : owner_(std::exchange(other.owner_, nullptr)), previous_(other.previous_) {}
    NoSyncScope(const NoSyncScope&) = delete;
    NoSyncScope& operator=(const NoSyncScope&) = delete;
    NoSyncScope& operator=(NoSyncScope&&) = delete;
    ~NoSyncScope() {
      if (owner_) owner_->runtime_.exchange_no_sync(previous_);
    }

   private:
    FullyShardedDataParallel* owner_;
    bool previous_;
  };
  [[nodiscard]] NoSyncScope no_sync() { return NoSyncScope(this); }

  /// Full parameters by fully qualified name, gathered one unit at a time (each rank gets all).
  /// Collective.
  std::vector<std::pair<std::string, torch::Tensor>> full_parameters() {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    torch::NoGradGuard no_grad;
    synchronize_shards();  // once: gather_flat below does not
    for (auto& u : runtime_.units()) {
      if (u->params.empty()) continue;
      const auto flat = gather_flat(u->info.index, u->shard);  // master precision, one unit at a time
      for (std::size_t i = 0; i < u->params.size(); ++i) out.emplace_back(u->info.param_names[i], u->param_view(flat, i).clone());
    }
    return out;
  }

  /// Bytes held for training state on this rank. Local.
  MemoryStats memory_stats(const torch::optim::Optimizer* optimizer = nullptr) const {
    MemoryStats m;
    for (const auto& u : runtime_.units()) {
      const std::int64_t elem = u->shard.defined() ? static_cast<std::int64_t>(u->shard.element_size()) : 4;
      const std::int64_t padded_bytes = u->layout.padded_numel() * elem;
      m.unsharded_param_bytes += padded_bytes;
      m.largest_unit_bytes = std::max(m.largest_unit_bytes, padded_bytes);
      if (!u->shard.defined()) continue;
      m.shard_param_bytes += u->shard.numel() * elem;
      if (u->optimized.grad().defined()) m.grad_bytes += u->optimized.grad().numel() * elem;
      if (u->unsynced_grad.defined()) m.grad_bytes += u->unsynced_grad.numel() * elem;
      if (u->gathered && u->needs_gather()) m.gathered_param_bytes += u->layout.padded_numel() * static_cast<std::int64_t>(u->full.element_size());
    }
    if (optimizer) m.optimizer_state_bytes = optimizer_state_bytes(*optimizer);
    return m;
  }

  void pretty_print(std::ostream& stream) const override { stream << describe(); }

  /// A printable tree of the wrapped model with its units.
  std::string describe() const {
    std::ostringstream os;
    os << "FullyShardedDataParallel(strategy=" << to_string(runtime_.options().sharding_strategy) << ", world_size=" << runtime_.groups().world.size()
       << ", shard_group_size=" << runtime_.groups().shard.size() << ", policy=" << runtime_.options().auto_wrap_policy.description()
       << ", units=" << runtime_.units().size() << ", params=" << num_params() << ")\n";
    print_module(os, *module_, "", "", 1);
    return os.str();
  }

  /// Bytes moved and time spent in collectives by this engine's world, shard and replica
  /// communicators together (see CommCounters). Local.
  CommCounters comm_counters() const { return runtime_.groups().counters(); }

  /// Bytes and time of the all-gathers inside the groups of reshard_after_forward_group (backward's
  /// gathers from the slices kept after forward); zero without it. Local.
  CommCounters forward_group_counters() const { return runtime_.groups().forward_group_counters(); }

  /// Seconds the computing thread spent in blocking collectives or waiting for the collective worker's
  /// results, waiting for slower ranks included: with MPI a step's time minus this is this rank's own
  /// work. The world's count includes the caller's collectives on copies of the same communicator.
  /// Host time: a GPU communicator's stream-ordered collectives cost the host their launch only, and
  /// a wait for a slower GPU shows up in the host's device syncs instead, not here.
  double communication_wait_seconds() const {
    return runtime_.groups().computing_thread_seconds() + runtime_.overlap_stats().waited_for_worker_seconds;
  }

  // ---- access for checkpointing (fsdp/io/checkpoint.hpp) ---------------------------------------

  /// The units with their flat layouts and this rank's shards. Local.
  std::vector<ShardedUnit> sharded_units() const {
    std::vector<ShardedUnit> out;
    out.reserve(runtime_.units().size());
    const bool parts = runtime_.optimizer_sharded_over_replicas();
    for (const auto& u : runtime_.units()) {
      ShardedUnit s{
          u->info.index, u->info.module_path, u->frozen, u->info.param_names, u->shapes, u->dtype, u->layout, runtime_.groups().shard.rank(),
          u->shard};
      s.optimized = u->optimized;
      if (parts && !u->frozen && !u->params.empty()) {
        s.replicas = runtime_.groups().replica.size();
        s.replica_rank = runtime_.groups().replica.rank();
      }
      out.push_back(std::move(s));
    }
    return out;
  }

  /// With FsdpOptions::optimizer_sharding = WORLD: all-gathers across the replicas the parts of the
  /// group shards that the optimizer updated, so that every shard (sharded_units(), checkpoints,
  /// exports) is current; forward, the gathering functions and the checkpoint functions call it.
  /// Collective; a no-op otherwise.
  void synchronize_shards() { runtime_.synchronize_shards(); }

  /// Waits on the host until every collective queued by the engine has completed, and throws the
  /// CommError of one that failed (a GPU communicator's collectives are stream-ordered: the engine
  /// never waits for them itself). The checkpoint and export functions call it before they read the
  /// state. Local; a no-op on communicators whose collectives return complete (MPI).
  void synchronize_collectives() {
    if constexpr (kCollectivesMayBePending) runtime_.groups().world.synchronize();  // every group shares the world's stream
  }
  /// Whether collectives can still run when a call returns (a GPU communicator's are stream-ordered),
  /// so that synchronize_collectives() must settle them before their results are read on the host.
  static constexpr bool kCollectivesMayBePending = requires(Comm & c) { c.synchronize(); };

  /// The dtype buffer `name` is checkpointed in: its own, from before MixedPrecision::buffer_dtype.
  c10::ScalarType checkpoint_buffer_dtype(const std::string& name, const torch::Tensor& buffer) const {
    const auto it = built_.buffer_dtypes.find(name);
    return it == built_.buffer_dtypes.end() ? buffer.scalar_type() : it->second;
  }
  /// The module's buffers by name as checkpoints hold them: in their own dtype (a cast copy under
  /// MixedPrecision::buffer_dtype, else the live buffer). Local.
  std::vector<std::pair<std::string, torch::Tensor>> checkpoint_buffers() const {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    for (const auto& b : module_->named_buffers(/*recurse=*/true)) {
      if (!b.value().defined()) continue;
      const auto dtype = checkpoint_buffer_dtype(b.key(), b.value());
      out.emplace_back(b.key(), dtype == b.value().scalar_type() ? b.value() : b.value().detach().to(dtype));
    }
    return out;
  }
  /// The generators a checkpoint stores: the CPU's and the compute device's, as they are now. Local.
  detail::RngState checkpoint_rng_state() const { return detail::capture_rng_state(runtime_.compute_device()); }

  /// The core's plan the units were built from (units, ownership, layouts over the shard group). Local.
  const UnitPlan& unit_plan() const noexcept { return built_.plan; }

  /// Tied parameters: the name a parameter is stored under -> its other names.
  const std::map<std::string, std::vector<std::string>>& tied_parameter_aliases() const noexcept { return built_.aliases; }

  /// The padded flat tensor of unit `unit` assembled from each shard rank's `shard_like` (the shard
  /// itself, or an optimizer state of the same shape). Collective over the shard group. With the
  /// optimizer sharded over the world, call synchronize_shards() first for a current shard (the
  /// library's gathering and checkpoint functions do).
  torch::Tensor gather_flat(int unit, const torch::Tensor& shard_like) {
    const auto& u = *runtime_.units().at(static_cast<std::size_t>(unit));
    auto src = shard_like.detach().to(runtime_.compute_device()).contiguous();
    if (src.numel() != u.layout.shard_numel())
      throw ConfigError("gather_flat: unit " + std::to_string(unit) + " expects " + std::to_string(u.layout.shard_numel()) + " elements, got " +
                        std::to_string(src.numel()));
    if (u.layout.group_size() == 1) return src.clone();
    auto out = torch::empty({u.layout.padded_numel()}, src.options());
    runtime_.groups().shard.all_gather(src.data_ptr(), out.data_ptr(), u.layout.shard_numel(), detail::to_comm_dtype(src.scalar_type()));
    return out;
  }

  /// Hash of everything that decides which elements each rank holds: world size, shard group size,
  /// and every unit's parameters (names, shapes, dtypes). FULL_SHARD and SHARD_GRAD_OP at the same
  /// world size shard identically and share a plan hash. Local.
  std::uint64_t plan_hash() const {
    std::ostringstream os;
    os << "world=" << runtime_.groups().world.size() << ";group=" << runtime_.groups().shard.size() << ";";
    for (const auto& u : runtime_.units()) {
      os << "unit" << u->info.index << "@" << u->info.module_path << ":";
      for (std::size_t i = 0; i < u->params.size(); ++i) {
        os << u->info.param_names[i] << "[";
        for (auto d : u->shapes[i]) os << d << ",";
        os << "]" << c10::toString(u->dtype) << ";";
      }
    }
    return fnv1a64(os.str());
  }

 private:
  static std::shared_ptr<ModuleImpl> checked_module(std::shared_ptr<ModuleImpl> module) {
    if (!module) throw ConfigError("FullyShardedDataParallel: module is null");
    return module;
  }

  // The module's parameters are views of the shard itself (a group of one, not offloaded, full precision).
  static bool full_is_shard(const detail::FlatUnit& u) {
    return u.shard.defined() && u.full.defined() && u.full.storage().is_alias_of(u.shard.storage());
  }

  [[noreturn]] static void refuse_to(const std::string& target) {
    throw ConfigError("FullyShardedDataParallel::to(" + target +
                      "): a wrapped model cannot move or change dtype; set FsdpOptions::device (or MixedPrecision) when wrapping");
  }

  void end_summon(bool writeback, const std::vector<int>& gathered_here, const std::vector<torch::Tensor>& saved) {
    torch::NoGradGuard no_grad;
    for (auto& u : runtime_.units()) {
      if (u->params.empty()) continue;
      if (u->summoned.defined()) {
        const auto s = u->layout.shard_numel();
        if (writeback) u->shard.detach().copy_(u->summoned.narrow(0, runtime_.groups().shard.rank() * s, s));
        // Back to the low-precision views (no view can be cut from `full` while its storage is freed).
        u->show_params_as_full_is();
        u->summoned = torch::Tensor();
      } else if (full_is_shard(*u)) {
        const auto& copy = saved[static_cast<std::size_t>(u->info.index)];
        // Through .data(): the values come back unchanged, and the parameters share the shard's
        // version, which must not move under a graph whose backward is still to come.
        if (!writeback && copy.defined()) u->shard.data().copy_(copy);
      } else if (writeback && u->gathered) {  // also a group of one with offload: `full` is on the device, the shard in host memory
        u->shard.copy_(detail::narrow_flat(u->full, u->layout.rank_range(runtime_.groups().shard.rank())));
      }
    }
    for (int i : gathered_here) runtime_.reshard(*runtime_.units()[static_cast<std::size_t>(i)]);
  }

  // ---- printing -------------------------------------------------------------------------------

  void print_module(std::ostream& os, const torch::nn::Module& m, const std::string& key, const std::string& path, int depth) const {
    const std::string indent(static_cast<std::size_t>(depth) * 2, ' ');
    os << indent;
    if (!key.empty()) os << "(" << key << "): ";
    m.pretty_print(os);
    for (const auto& u : runtime_.units()) {
      if (u->module != &m) continue;
      os << "  [unit " << u->info.index << (u->info.index == 0 ? ", root" : "") << (u->frozen ? ", frozen" : "") << ": " << u->params.size()
         << " params, numel " << u->layout.numel() << ", padded " << u->layout.padded_numel() << ", shard " << u->layout.shard_numel();
      if (u->info.index != 0 && !u->frozen && u->hooked == detail::FlatUnit::Hooked::kNo)
        os << ", gathered with root (not called through fsdp::forward)";
      os << "]";
    }
    os << "\n";
    for (const auto& child : m.named_children()) print_module(os, *child.value(), child.key(), detail::join_path(path, child.key()), depth + 1);
  }

  std::shared_ptr<ModuleImpl> module_;
  detail::ShardedRuntime<Comm> runtime_;  // after module_: it runs on the wrapped model's units
  detail::BuiltUnits built_;              // the plan, tied names and buffer dtypes the units were built from
};

/// Wraps a module given as a ModuleHolder (torch::nn::Linear) or a std::shared_ptr<Impl>.
template <Communicator Comm, class ModulePtr>
auto make_fsdp(ModulePtr module, Comm comm, FsdpOptions options = {}) {
  using Impl = std::remove_reference_t<decltype(*module)>;
  std::shared_ptr<Impl> ptr;
  if constexpr (requires { module.ptr(); })
    ptr = module.ptr();
  else
    ptr = std::move(module);
  return std::make_shared<FullyShardedDataParallel<Impl, Comm>>(std::move(ptr), std::move(comm), std::move(options));
}

}  // namespace fsdp
