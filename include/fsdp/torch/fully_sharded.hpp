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
#include "fsdp/torch/optim_state.hpp"
#include "fsdp/torch/wrap_policy.hpp"
#include "fsdp/trace.hpp"

namespace fsdp {

/// Wraps `module` (a std::shared_ptr to a torch::nn::Module subclass) for fully sharded data parallel
/// training over communicator `Comm`. Construction, forward, backward, summon_full_params() and
/// memory_stats() with an optimizer are collective: every rank calls them in the same order.
template <class ModuleImpl, Communicator Comm>
class FullyShardedDataParallel : public torch::nn::Module, private detail::ShardedRuntime<Comm> {
  using Runtime = detail::ShardedRuntime<Comm>;
  using Runtime::compute_device_;
  using Runtime::finish_prefetch;
  using Runtime::forward_group_comm_;
  using Runtime::gather;
  using Runtime::no_sync_;
  using Runtime::options_;
  using Runtime::overlap_;
  using Runtime::replica_comm_;
  using Runtime::reshard;
  using Runtime::shard_comm_;
  using Runtime::units_;
  using Runtime::worker_forward_group_comm_;
  using Runtime::worker_replica_comm_;
  using Runtime::worker_shard_comm_;
  using Runtime::world_;

 public:
  using communicator_type = Comm;
  FullyShardedDataParallel(std::shared_ptr<ModuleImpl> module, Comm comm, FsdpOptions options = {})
      : torch::nn::Module("FullyShardedDataParallel"), Runtime(std::move(comm), std::move(options)), module_(std::move(module)) {
    if (!module_) throw ConfigError("FullyShardedDataParallel: module is null");
    this->root_module_ = module_.get();
    this->wrapper_ = this;
    this->setup_groups();
    build_units();
    this->setup_overlap();
    this->register_units();
  }

  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  /// Runs the wrapped module's forward on this rank's local batch. Collective.
  template <class... Args>
  auto forward(Args&&... args) {
    const TraceScope traced("forward (root)", "forward");
    this->root_pre_forward();
    auto result = module_->forward(cast_input(std::forward<Args>(args))...);
    std::vector<at::Tensor> outputs;
    const bool complete = detail::collect_tensors(result, outputs);
    this->root_post_forward(outputs, complete);
    return result;
  }

  /// A floating-point tensor argument of the root forward in MixedPrecision::param_dtype.
  torch::Tensor cast_input(const torch::Tensor& t) const {
    const auto& mp = options_.mixed_precision;
    if (mp.param_dtype && mp.cast_forward_inputs && t.defined() && t.is_floating_point()) return t.to(*mp.param_dtype);
    return t;
  }
  template <class T>
  requires(!std::is_same_v<std::decay_t<T>, torch::Tensor>) T && cast_input(T&& arg)
  const { return std::forward<T>(arg); }

  /// The wrapped module. Its parameters are views of the gathered buffers: read them only inside
  /// summon_full_params().
  std::shared_ptr<ModuleImpl> module() const { return module_; }

  const FsdpOptions& options() const noexcept { return options_; }
  /// All-gathers that overlapped computation and the time the computing thread still waited. Local.
  const OverlapStats& overlap_stats() const noexcept { return overlap_; }

  /// Where the units compute (FsdpOptions::device, or where the module's parameters were).
  torch::Device compute_device() const noexcept { return compute_device_; }
  ShardingStrategy sharding_strategy() const noexcept { return options_.sharding_strategy; }
  Comm& comm() noexcept { return world_; }
  Comm& shard_comm() noexcept { return shard_comm_; }
  Comm& replica_comm() noexcept { return replica_comm_; }
  int rank() const { return world_.rank(); }
  int world_size() const { return world_.size(); }
  int shard_group_size() const { return shard_comm_.size(); }

  /// The units in creation order (index 0 is the root).
  std::vector<UnitInfo> units() const {
    std::vector<UnitInfo> out;
    for (const auto& u : units_) {
      UnitInfo i = u->info;
      const auto& owner = u->frozen ? *units_[static_cast<std::size_t>(u->info.parent)] : *u;
      i.called_through_hook = owner.hooked == detail::FlatUnit::Hooked::kYes;
      out.push_back(std::move(i));
    }
    return out;
  }

  /// Total number of (unpadded) model parameters.
  std::int64_t num_params() const {
    std::int64_t n = 0;
    for (const auto& u : units_) n += u->layout.numel();
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
    for (auto& u : units_) finish_prefetch(*u);  // a prefetch left by a forward that did not use it
    synchronize_shards();
    std::vector<int> gathered_here;
    std::vector<torch::Tensor> saved(units_.size());
    for (auto& u : units_) {
      if (u->low_precision && !u->params.empty()) {
        // Full precision inside the scope: gather the master shards and point the parameters there.
        u->summoned = gather_flat(u->info.index, u->shard);
        u->point_params_at(u->summoned);
        continue;
      }
      if (!u->gathered) {
        gather(*u);
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
    for (const auto& u : units_) {
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
    Comm& holders = this->optimizer_sharded_over_replicas() ? world_ : shard_comm_;
    holders.all_reduce(&local, &local, 1, DType::kFloat64, is_inf ? ReduceOp::kMax : ReduceOp::kSum);
    const double total = is_inf ? local : std::pow(local, 1.0 / norm_type);
    const double coef = max_norm / (total + 1e-6);
    if (coef < 1) {
      for (auto& u : units_)
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
    for (auto& u : units_) {
      if (!u->optimized.defined() || !u->optimized.grad().defined()) continue;
      auto& g = u->optimized.mutable_grad();
      finite.push_back(torch::isfinite(g).all());
      g.mul_(1.0 / scale);
    }
    std::int32_t found = finite.empty() || torch::stack(finite).all().template item<bool>() ? 0 : 1;
    world_.all_reduce(&found, &found, 1, DType::kInt32, ReduceOp::kMax);
    return found != 0;
  }

  /// RAII scope for gradient accumulation without communication: backward passes inside it keep the
  /// unit gradients locally (unsharded, like PyTorch's no_sync); the first backward after it reduces
  /// them together with its own. Local.
  class NoSyncScope {
   public:
    explicit NoSyncScope(FullyShardedDataParallel* owner) : owner_(owner), previous_(std::exchange(owner->no_sync_, true)) {}
    NoSyncScope(NoSyncScope&& other) noexcept : owner_(std::exchange(other.owner_, nullptr)), previous_(other.previous_) {}
    NoSyncScope(const NoSyncScope&) = delete;
    NoSyncScope& operator=(const NoSyncScope&) = delete;
    NoSyncScope& operator=(NoSyncScope&&) = delete;
    ~NoSyncScope() {
      if (owner_) owner_->no_sync_ = previous_;
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
    for (auto& u : units_) {
      if (u->params.empty()) continue;
      const auto flat = gather_flat(u->info.index, u->shard);  // master precision, one unit at a time
      for (std::size_t i = 0; i < u->params.size(); ++i) out.emplace_back(u->info.param_names[i], u->param_view(flat, i).clone());
    }
    return out;
  }

  /// Bytes held for training state on this rank. Local.
  MemoryStats memory_stats(const torch::optim::Optimizer* optimizer = nullptr) const {
    MemoryStats m;
    for (const auto& u : units_) {
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
    os << "FullyShardedDataParallel(strategy=" << to_string(options_.sharding_strategy) << ", world_size=" << world_.size()
       << ", shard_group_size=" << shard_comm_.size() << ", policy=" << options_.auto_wrap_policy.description() << ", units=" << units_.size()
       << ", params=" << num_params() << ")\n";
    print_module(os, *module_, "", "", 1);
    return os.str();
  }

  /// Bytes moved and time spent in collectives by this engine's world, shard and replica
  /// communicators together (see CommCounters). Local.
  CommCounters comm_counters() const {
    CommCounters total = world_.counters();
    total += shard_comm_.counters();
    total += replica_comm_.counters();
    if (worker_shard_comm_) total += worker_shard_comm_->counters();      // the collective worker's all-gathers and reduce-scatters
    if (worker_replica_comm_) total += worker_replica_comm_->counters();  // ... and all-reduces
    total += forward_group_counters();
    return total;
  }

  /// Bytes and time of the all-gathers inside the groups of reshard_after_forward_group (backward's
  /// gathers from the slices kept after forward); zero without it. Local.
  CommCounters forward_group_counters() const {
    CommCounters total{};
    if (forward_group_comm_) total += forward_group_comm_->counters();
    if (worker_forward_group_comm_) total += worker_forward_group_comm_->counters();
    return total;
  }

  // ---- access for checkpointing (fsdp/io/checkpoint.hpp) ---------------------------------------

  /// The units with their flat layouts and this rank's shards. Local.
  std::vector<ShardedUnit> sharded_units() const {
    std::vector<ShardedUnit> out;
    out.reserve(units_.size());
    const bool parts = this->optimizer_sharded_over_replicas();
    for (const auto& u : units_) {
      ShardedUnit s{u->info.index, u->info.module_path, u->frozen, u->info.param_names, u->shapes, u->dtype, u->layout, shard_comm_.rank(), u->shard};
      s.optimized = u->optimized;
      if (parts && !u->frozen && !u->params.empty()) {
        s.replicas = replica_comm_.size();
        s.replica_rank = replica_comm_.rank();
      }
      out.push_back(std::move(s));
    }
    return out;
  }

  /// With FsdpOptions::optimizer_sharding = WORLD: all-gathers across the replicas the parts of the
  /// group shards that the optimizer updated, so that every shard (sharded_units(), checkpoints,
  /// exports) is current; forward, the gathering functions and the checkpoint functions call it.
  /// Collective; a no-op otherwise.
  void synchronize_shards() { Runtime::synchronize_shards(); }

  /// Waits on the host until every collective queued by the engine has completed, and throws the
  /// CommError of one that failed (a GPU communicator's collectives are stream-ordered: the engine
  /// never waits for them itself). The checkpoint and export functions call it before they read the
  /// state. Local; a no-op on communicators whose collectives return complete (MPI).
  void synchronize_collectives() {
    if constexpr (kCollectivesMayBePending) world_.synchronize();  // every group shares the world's stream
  }
  /// Whether collectives can still run when a call returns (a GPU communicator's are stream-ordered),
  /// so that synchronize_collectives() must settle them before their results are read on the host.
  static constexpr bool kCollectivesMayBePending = requires(Comm & c) { c.synchronize(); };

  /// The dtype buffer `name` is checkpointed in: its own, from before MixedPrecision::buffer_dtype.
  c10::ScalarType checkpoint_buffer_dtype(const std::string& name, const torch::Tensor& buffer) const {
    const auto it = buffer_dtypes_.find(name);
    return it == buffer_dtypes_.end() ? buffer.scalar_type() : it->second;
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
  detail::RngState checkpoint_rng_state() const { return detail::capture_rng_state(compute_device_); }

  /// The core's plan the units were built from (units, ownership, layouts over the shard group). Local.
  const UnitPlan& unit_plan() const noexcept { return plan_; }

  /// Tied parameters: the name a parameter is stored under -> its other names.
  const std::map<std::string, std::vector<std::string>>& tied_parameter_aliases() const noexcept { return aliases_; }

  /// The padded flat tensor of unit `unit` assembled from each shard rank's `shard_like` (the shard
  /// itself, or an optimizer state of the same shape). Collective over the shard group. With the
  /// optimizer sharded over the world, call synchronize_shards() first for a current shard (the
  /// library's gathering and checkpoint functions do).
  torch::Tensor gather_flat(int unit, const torch::Tensor& shard_like) {
    const auto& u = *units_.at(static_cast<std::size_t>(unit));
    auto src = shard_like.detach().to(compute_device_).contiguous();
    if (src.numel() != u.layout.shard_numel())
      throw ConfigError("gather_flat: unit " + std::to_string(unit) + " expects " + std::to_string(u.layout.shard_numel()) + " elements, got " +
                        std::to_string(src.numel()));
    if (u.layout.group_size() == 1) return src.clone();
    auto out = torch::empty({u.layout.padded_numel()}, src.options());
    shard_comm_.all_gather(src.data_ptr(), out.data_ptr(), u.layout.shard_numel(), detail::to_comm_dtype(src.scalar_type()));
    return out;
  }

  /// Hash of everything that decides which elements each rank holds: world size, shard group size,
  /// and every unit's parameters (names, shapes, dtypes). FULL_SHARD and SHARD_GRAD_OP at the same
  /// world size shard identically and share a plan hash. Local.
  std::uint64_t plan_hash() const {
    std::ostringstream os;
    os << "world=" << world_.size() << ";group=" << shard_comm_.size() << ";";
    for (const auto& u : units_) {
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
  // ---- construction -------------------------------------------------------------------------

  // Memory-bounded construction: materializes meta tensors that `module` holds itself on the compute
  // device and runs param_init_fn on it with a seed of its own.
  void initialize_module(torch::nn::Module& module, const std::string& path) {
    torch::NoGradGuard no_grad;
    for (auto& p : module.named_parameters(/*recurse=*/false)) detail::restore_storage(p.value());
    for (auto& b : module.named_buffers(/*recurse=*/false)) detail::restore_storage(b.value());
    torch::manual_seed(fnv1a64(path, 14695981039346656037ull ^ options_.init_seed));
    options_.param_init_fn(module, path);
    for (auto& b : module.named_buffers(/*recurse=*/false))
      if (deferred_buffer_casts_.erase(detail::join_path(path, b.key())) > 0)
        b.value().set_data(b.value().to(*options_.mixed_precision.buffer_dtype));
    if (!compute_device_.is_cpu()) {  // built and initialized on the CPU, one module at a time
      for (auto& p : module.named_parameters(/*recurse=*/false)) p.value().set_data(p.value().to(compute_device_));
      for (auto& b : module.named_buffers(/*recurse=*/false)) b.value().set_data(b.value().to(compute_device_));
    }
  }

  void build_units() {
    // 0. The compute device: asked for, or where the parameters are; the module moves there.
    compute_device_ = resolve_compute_device<Comm>(*module_, options_);
    this->order_collectives_with_current_stream();  // before the first collective (sync_module_states)
    // Mixed precision: check the dtypes; buffers move to buffer_dtype (their own dtype is kept for checkpoints).
    const auto& mp = options_.mixed_precision;
    for (const auto& dt : {mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype})
      if (dt && !c10::isFloatingType(*dt)) throw ConfigError(std::string("mixed precision dtypes must be floating point, got ") + c10::toString(*dt));
    if (mp.buffer_dtype) {
      torch::NoGradGuard no_grad;
      for (const auto& b : module_->named_buffers(/*recurse=*/true)) {
        if (!b.value().defined() || !b.value().is_floating_point() || b.value().scalar_type() == *mp.buffer_dtype) continue;
        buffer_dtypes_[b.key()] = b.value().scalar_type();
        if (detail::is_deferred(b.value()))
          deferred_buffer_casts_.insert(b.key());  // cast once initialized
        else
          b.value().set_data(b.value().to(*mp.buffer_dtype));
      }
    }

    // 1. The module tree in pre-order, described for the core's planner.
    auto [tree, modules, tensors] = describe_module_tree(*module_);

    // 2. Units, parameter ownership, frozen companions and layouts: decided by the core.
    const std::vector<const torch::nn::Module*> const_modules(modules.begin(), modules.end());
    plan_ = plan_units(tree, options_.auto_wrap_policy.rule(const_modules), shard_comm_.size());
    for (const auto& planned : plan_.units) {
      auto u = std::make_unique<detail::FlatUnit>();
      u->info.index = planned.index;
      u->info.parent = planned.parent;
      u->info.module_path = planned.path;
      u->info.type_name = planned.type_name;
      u->info.frozen = planned.frozen;
      u->frozen = planned.frozen;
      u->companion = planned.companion;
      u->module = modules[static_cast<std::size_t>(planned.module)];
      for (const auto& p : planned.params) {
        const auto& tensor = tensors[static_cast<std::size_t>(p.tensor_id)];
        if (tensor.device() != compute_device_ && !(options_.param_init_fn && tensor.is_cpu()))
          throw ConfigError("parameter '" + p.name + "' is on " + tensor.device().str() + ", the module's other parameters on " +
                            compute_device_.str() + ": move the whole module to one device (or set FsdpOptions::device)");
        u->params.push_back(tensor);
        u->info.param_names.push_back(p.name);
        u->shapes.push_back(p.shape);
        if (!p.aliases.empty()) aliases_[p.name] = p.aliases;
      }
      u->layout = planned.layout;
      units_.push_back(std::move(u));
    }

    const bool sync = options_.sync_module_states && world_.size() > 1;
    auto broadcast = [this](const torch::Tensor& t) {
      Runtime::on_contiguous(
          t, [this](const torch::Tensor& c) { world_.broadcast(c.data_ptr(), c.numel(), detail::to_comm_dtype(c.scalar_type()), 0); });
    };
    // param_init_fn: the RNG of the caller is left as it was.
    std::optional<torch::Tensor> caller_rng;
    if (options_.param_init_fn) caller_rng = at::detail::getDefaultCPUGenerator().get_state();

    // 5. Flatten, shard, alias.
    const int group = shard_comm_.size();
    const int shard_rank = shard_comm_.rank();
    for (auto& up : units_) {
      auto& u = *up;
      // Memory-bounded construction: this unit's modules (not nested units') get their values now.
      if (options_.param_init_fn && !u.frozen)
        for (std::size_t id = 0; id < modules.size(); ++id)
          if (plan_.owner[id] == u.info.index) initialize_module(*modules[id], tree.modules[id].path);
      if (sync)
        for (auto& p : u.params) broadcast(p);
      for (std::size_t i = 0; i < u.params.size(); ++i)
        if (detail::is_deferred(u.params[i]))
          throw ConfigError("parameter '" + u.info.param_names[i] + "' is still released (fsdp::defer_init) when unit '" + u.info.module_path +
                            "' is flattened: it is tied to a module of another unit, which deferred initialization does not support; "
                            "wrap the tied modules into one unit or build them normally");
      u.info.numel = u.layout.numel();
      u.info.padded_numel = u.layout.padded_numel();
      u.info.shard_numel = u.layout.shard_numel();
      if (u.params.empty()) continue;
      const auto dtype = u.params.front().scalar_type();
      for (std::size_t i = 0; i < u.params.size(); ++i)
        if (u.params[i].scalar_type() != dtype)
          throw ConfigError("unit '" + u.info.module_path + "' mixes dtypes (" + u.info.param_names[i] + " is " +
                            c10::toString(u.params[i].scalar_type()) + ", expected " + c10::toString(dtype) + ")");
      u.dtype = dtype;
      const auto& mp = options_.mixed_precision;
      u.low_precision = mp.param_dtype && *mp.param_dtype != dtype;
      torch::NoGradGuard no_grad;
      auto full = torch::empty({u.layout.padded_numel()}, u.params.front().options().requires_grad(false));
      full.narrow(0, u.layout.numel(), u.layout.padding()).zero_();
      for (std::size_t i = 0; i < u.params.size(); ++i) {
        const auto i64 = static_cast<std::int64_t>(i);
        full.narrow(0, u.layout.param_offset(i64), u.layout.param_numel(i64)).copy_(u.params[i].detach().reshape({-1}));
      }
      u.offloaded = options_.offload_params && !compute_device_.is_cpu();
      if (u.offloaded) {  // the master shard in (pinned) host memory; `full` stays on the device
        u.shard = detail::narrow_flat(full, u.layout.rank_range(shard_rank)).to(torch::kCPU).pin_memory();
        u.full = full;
      } else if (group == 1) {
        u.shard = full.detach();
        u.full = u.shard.detach();  // same storage: nothing to gather (and no gradient edge when the shard is the optimizer's)
      } else {
        u.shard = detail::narrow_flat(full, u.layout.rank_range(shard_rank)).clone();
        u.full = full;
      }
      u.optimized = u.shard;
      if (this->optimizer_sharded_over_replicas() && !u.frozen) split_shard_over_replicas(u);
      u.optimized.requires_grad_(!u.frozen);
      if (u.low_precision) u.full = full.to(*mp.param_dtype);  // its own storage, refilled by gather()
      u.gathered = true;
      u.point_params_at(u.full);
      for (const auto& p : u.params) u.param_views.push_back(p.data());  // shares `full`'s storage, also once freed
      // Never refilled: the parameters are the shard's values, and an optimizer's in-place update of
      // the shard must move their version as it would move a plain parameter's.
      if (!u.needs_gather())
        for (auto& p : u.params) torch::autograd::impl::set_version_counter(p, torch::autograd::impl::version_counter(u.shard));
      reshard(u);
      if (!u.frozen) register_parameter("flat_shard_" + std::to_string(u.info.index), u.optimized, /*requires_grad=*/true);
    }
    if (caller_rng) {
      at::Generator generator = at::detail::getDefaultCPUGenerator();  // shares the default generator
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(*caller_rng);
    }
    if (sync)
      for (auto& b : module_->buffers(/*recurse=*/true))
        if (b.defined() && b.numel() > 0) broadcast(b);
  }

  // Optimizer sharded over the world: the shard moves into storage with room for every replica's part
  // (zero past the shard), and the optimizer gets this replica's part, a view of it, so that its
  // updates land in the shard directly; synchronize_shards() brings in the others'.
  void split_shard_over_replicas(detail::FlatUnit& u) {
    torch::NoGradGuard no_grad;
    const std::int64_t replicas = replica_comm_.size();
    const FlatRange part = replica_part_range(u.layout.shard_numel(), replicas, replica_comm_.rank());
    auto room = torch::zeros({part.numel() * replicas}, u.shard.options().pinned_memory(u.offloaded));
    room.narrow(0, 0, u.shard.numel()).copy_(u.shard);
    const bool shares_full = u.full.storage().is_alias_of(u.shard.storage());
    u.shard = room.narrow(0, 0, u.shard.numel());
    if (shares_full) u.full = u.shard.detach();
    u.optimized = room.narrow(0, part.begin, part.numel());
    u.replicas_synced_version = u.shard._version();
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
    for (auto& u : units_) {
      if (u->params.empty()) continue;
      if (u->summoned.defined()) {
        const auto s = u->layout.shard_numel();
        if (writeback) u->shard.detach().copy_(u->summoned.narrow(0, shard_comm_.rank() * s, s));
        // Back to the low-precision views (no view can be cut from `full` while its storage is freed).
        u->show_params_as_full_is();
        u->summoned = torch::Tensor();
      } else if (full_is_shard(*u)) {
        const auto& copy = saved[static_cast<std::size_t>(u->info.index)];
        // Through .data(): the values come back unchanged, and the parameters share the shard's
        // version, which must not move under a graph whose backward is still to come.
        if (!writeback && copy.defined()) u->shard.data().copy_(copy);
      } else if (writeback && u->gathered) {  // also a group of one with offload: `full` is on the device, the shard in host memory
        u->shard.copy_(detail::narrow_flat(u->full, u->layout.rank_range(shard_comm_.rank())));
      }
    }
    for (int i : gathered_here) reshard(*units_[static_cast<std::size_t>(i)]);
  }

  // ---- printing -------------------------------------------------------------------------------

  void print_module(std::ostream& os, const torch::nn::Module& m, const std::string& key, const std::string& path, int depth) const {
    const std::string indent(static_cast<std::size_t>(depth) * 2, ' ');
    os << indent;
    if (!key.empty()) os << "(" << key << "): ";
    m.pretty_print(os);
    for (const auto& u : units_) {
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
  std::map<std::string, std::vector<std::string>> aliases_;  // canonical name -> other names of tied parameters
  UnitPlan plan_;                                            // the core's decisions this engine's units were built from
  std::map<std::string, c10::ScalarType> buffer_dtypes_;     // buffers cast by MixedPrecision::buffer_dtype: their own dtype
  std::set<std::string> deferred_buffer_casts_;              // ... of those, released ones, cast after param_init_fn
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
