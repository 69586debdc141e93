// Building an engine's units (torch layer): the compute device, mixed precision's buffer casts, the
// core's plan of units over the module tree, then per unit (one at a time, so that memory-bounded
// construction holds one unit's full parameters at most) initialization, flattening, sharding and
// the parameters' views of the flat buffer. FullyShardedDataParallel runs it once, at construction.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "fsdp/comm/communicator.hpp"
#include "fsdp/core/layout.hpp"
#include "fsdp/core/text.hpp"
#include "fsdp/errors.hpp"
#include "fsdp/torch/deferred_init.hpp"
#include "fsdp/torch/flat_unit.hpp"
#include "fsdp/torch/gradient_collectives.hpp"
#include "fsdp/torch/module_tree.hpp"
#include "fsdp/torch/sharded_runtime.hpp"

namespace fsdp::detail {

/// What the engine keeps from building its units, besides the units the runtime holds.
struct BuiltUnits {
  UnitPlan plan;                                            // the core's decisions the units were built from
  std::map<std::string, std::vector<std::string>> aliases;  // canonical name -> other names of tied parameters
  std::map<std::string, c10::ScalarType> buffer_dtypes;     // buffers cast by MixedPrecision::buffer_dtype: their own dtype
};

template <Communicator Comm>
class UnitBuilder {
 public:
  UnitBuilder(ShardedRuntime<Comm>& runtime, torch::nn::Module& root) : runtime_(runtime), root_(root), options_(runtime.options()) {}

  /// Builds the units into the runtime. Collective (with sync_module_states).
  BuiltUnits build() {
    // The compute device: asked for, or where the parameters are; the module moves there. Set before
    // the first collective (sync_module_states).
    runtime_.use_compute_device(resolve_compute_device<Comm>(root_, options_));
    cast_buffers();
    auto [tree, modules, tensors] = describe_module_tree(root_);
    const std::vector<const torch::nn::Module*> const_modules(modules.begin(), modules.end());
    built_.plan = plan_units(tree, options_.auto_wrap_policy.rule(const_modules), runtime_.groups().shard.size());
    for (const auto& planned : built_.plan.units) runtime_.units().push_back(unit_from_plan(planned, modules, tensors));

    // param_init_fn: the RNG of the caller is left as it was.
    std::optional<torch::Tensor> caller_rng;
    if (options_.param_init_fn) caller_rng = at::detail::getDefaultCPUGenerator().get_state();
    for (auto& u : runtime_.units()) {
      // Memory-bounded construction: this unit's modules (not nested units') get their values now.
      if (options_.param_init_fn && !u->frozen)
        for (std::size_t id = 0; id < modules.size(); ++id)
          if (built_.plan.owner[id] == u->info.index) initialize_module(*modules[id], tree.modules[id].path);
      if (syncs_module_states())
        for (auto& p : u->params) broadcast_from_rank0(p);
      flatten(*u);
    }
    if (caller_rng) {
      at::Generator generator = at::detail::getDefaultCPUGenerator();  // shares the default generator
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(*caller_rng);
    }
    if (syncs_module_states())
      for (auto& b : root_.buffers(/*recurse=*/true))
        if (b.defined() && b.numel() > 0) broadcast_from_rank0(b);
    return std::move(built_);
  }

 private:
  torch::Device device() const { return runtime_.compute_device(); }
  bool syncs_module_states() const { return options_.sync_module_states && runtime_.groups().world.size() > 1; }

  void broadcast_from_rank0(const torch::Tensor& t) {
    auto& world = runtime_.groups().world;
    on_contiguous(t, [&world](const torch::Tensor& c) { world.broadcast(c.data_ptr(), c.numel(), to_comm_dtype(c.scalar_type()), 0); });
  }

  // Mixed precision: checks the dtypes; buffers move to buffer_dtype (their own dtype is kept for
  // checkpoints; released ones are cast once initialized).
  void cast_buffers() {
    const auto& mp = options_.mixed_precision;
    for (const auto& dt : {mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype})
      if (dt && !c10::isFloatingType(*dt)) throw ConfigError(std::string("mixed precision dtypes must be floating point, got ") + c10::toString(*dt));
    if (!mp.buffer_dtype) return;
    torch::NoGradGuard no_grad;
    for (const auto& b : root_.named_buffers(/*recurse=*/true)) {
      if (!b.value().defined() || !b.value().is_floating_point() || b.value().scalar_type() == *mp.buffer_dtype) continue;
      built_.buffer_dtypes[b.key()] = b.value().scalar_type();
      if (is_deferred(b.value()))
        deferred_buffer_casts_.insert(b.key());
      else
        b.value().set_data(b.value().to(*mp.buffer_dtype));
    }
  }

  std::unique_ptr<FlatUnit> unit_from_plan(const PlannedUnit& planned, const std::vector<torch::nn::Module*>& modules,
                                           const std::vector<torch::Tensor>& tensors) {
    auto u = std::make_unique<FlatUnit>();
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
      if (tensor.device() != device() && !(options_.param_init_fn && tensor.is_cpu()))
        throw ConfigError("parameter '" + p.name + "' is on " + tensor.device().str() + ", the module's other parameters on " + device().str() +
                          ": move the whole module to one device (or set FsdpOptions::device)");
      u->params.push_back(tensor);
      u->info.param_names.push_back(p.name);
      u->shapes.push_back(p.shape);
      if (!p.aliases.empty()) built_.aliases[p.name] = p.aliases;
    }
    u->layout = planned.layout;
    return u;
  }

  // Memory-bounded construction: materializes meta tensors that `module` holds itself on the compute
  // device and runs param_init_fn on it with a seed of its own.
  void initialize_module(torch::nn::Module& module, const std::string& path) {
    torch::NoGradGuard no_grad;
    for (auto& p : module.named_parameters(/*recurse=*/false)) restore_storage(p.value());
    for (auto& b : module.named_buffers(/*recurse=*/false)) restore_storage(b.value());
    torch::manual_seed(fnv1a64(path, 14695981039346656037ull ^ options_.init_seed));
    options_.param_init_fn(module, path);
    for (auto& b : module.named_buffers(/*recurse=*/false))
      if (deferred_buffer_casts_.erase(join_path(path, b.key())) > 0) b.value().set_data(b.value().to(*options_.mixed_precision.buffer_dtype));
    if (!device().is_cpu()) {  // built and initialized on the CPU, one module at a time
      for (auto& p : module.named_parameters(/*recurse=*/false)) p.value().set_data(p.value().to(device()));
      for (auto& b : module.named_buffers(/*recurse=*/false)) b.value().set_data(b.value().to(device()));
    }
  }

  // Flattens unit `u`'s parameters into `full`, keeps this rank's shard, points the parameters at
  // `full` and frees it (resharded until the first forward).
  void flatten(FlatUnit& u) {
    for (std::size_t i = 0; i < u.params.size(); ++i)
      if (is_deferred(u.params[i]))
        throw ConfigError("parameter '" + u.info.param_names[i] + "' is still released (fsdp::defer_init) when unit '" + u.info.module_path +
                          "' is flattened: it is tied to a module of another unit, which deferred initialization does not support; "
                          "wrap the tied modules into one unit or build them normally");
    u.info.numel = u.layout.numel();
    u.info.padded_numel = u.layout.padded_numel();
    u.info.shard_numel = u.layout.shard_numel();
    if (u.params.empty()) return;
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
    const auto& shard_comm = runtime_.groups().shard;
    u.offloaded = options_.offload_params && !device().is_cpu();
    if (u.offloaded) {  // the master shard in (pinned) host memory; `full` stays on the device
      u.shard = narrow_flat(full, u.layout.rank_range(shard_comm.rank())).to(torch::kCPU).pin_memory();
      u.full = full;
    } else if (shard_comm.size() == 1) {
      u.shard = full.detach();
      u.full = u.shard.detach();  // same storage: nothing to gather (and no gradient edge when the shard is the optimizer's)
    } else {
      u.shard = narrow_flat(full, u.layout.rank_range(shard_comm.rank())).clone();
      u.full = full;
    }
    u.optimized = u.shard;
    if (runtime_.optimizer_sharded_over_replicas() && !u.frozen) split_shard_over_replicas(u);
    u.optimized.requires_grad_(!u.frozen);
    if (u.low_precision) u.full = full.to(*mp.param_dtype);  // its own storage, refilled by gather()
    u.gathered = true;
    u.point_params_at(u.full);
    for (const auto& p : u.params) u.param_views.push_back(p.data());  // shares `full`'s storage, also once freed
    // Never refilled: the parameters are the shard's values, and an optimizer's in-place update of
    // the shard must move their version as it would move a plain parameter's.
    if (!u.needs_gather())
      for (auto& p : u.params) torch::autograd::impl::set_version_counter(p, torch::autograd::impl::version_counter(u.shard));
    runtime_.reshard(u);
  }

  // Optimizer sharded over the world: the shard moves into storage with room for every replica's part
  // (zero past the shard), and the optimizer gets this replica's part, a view of it, so that its
  // updates land in the shard directly; synchronize_shards() brings in the others'.
  void split_shard_over_replicas(FlatUnit& u) {
    torch::NoGradGuard no_grad;
    const auto& replica_comm = runtime_.groups().replica;
    const std::int64_t replicas = replica_comm.size();
    const FlatRange part = replica_part_range(u.layout.shard_numel(), replicas, replica_comm.rank());
    auto room = torch::zeros({part.numel() * replicas}, u.shard.options().pinned_memory(u.offloaded));
    room.narrow(0, 0, u.shard.numel()).copy_(u.shard);
    const bool shares_full = u.full.storage().is_alias_of(u.shard.storage());
    u.shard = room.narrow(0, 0, u.shard.numel());
    if (shares_full) u.full = u.shard.detach();
    u.optimized = room.narrow(0, part.begin, part.numel());
    u.replicas_synced_version = u.shard._version();
  }

  ShardedRuntime<Comm>& runtime_;
  torch::nn::Module& root_;
  const FsdpOptions& options_;
  BuiltUnits built_;
  std::set<std::string> deferred_buffer_casts_;  // buffers cast by buffer_dtype still released: cast after param_init_fn
};

}  // namespace fsdp::detail
