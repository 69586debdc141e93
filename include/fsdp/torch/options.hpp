// What users configure and read back from FullyShardedDataParallel (torch layer, the public face of
// the engine's options): FsdpOptions with mixed precision, the statistics structs, the unit
// descriptions and the per-unit view checkpoints use.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/core/layout.hpp"
#include "fsdp/core/strategy.hpp"
#include "fsdp/torch/wrap_policy.hpp"

namespace fsdp {

/// Communication that overlapped computation, and what did not (see FullyShardedDataParallel::overlap_stats()).
struct OverlapStats {
  std::int64_t prefetched = 0;              ///< unit all-gathers issued ahead on the collective worker
  std::int64_t gathered_on_demand = 0;      ///< unit all-gathers run when the unit was needed
  double exposed_all_gather_seconds = 0;    ///< time the computing thread waited for unit all-gathers
  std::int64_t reductions_overlapped = 0;   ///< gradient reductions run on the collective worker during backward
  std::int64_t reductions_synchronous = 0;  ///< gradient reductions run by the computing thread
  double exposed_reduce_seconds = 0;        ///< time the computing thread waited for gradient reductions
  std::int64_t reduced_in_place = 0;        ///< one-parameter units whose gradient was reduced without a packed copy
  double waited_for_worker_seconds = 0;     ///< of the two exposed times, the waits for the collective worker's (or a stream's) results
  /// Gathered units freed in backward before their weight's gradient was computed (fsdp::linear_releasing_weight).
  std::int64_t released_before_gradient = 0;
};

/// Mixed precision (PyTorch's MixedPrecision). The optimizer keeps full-precision master shards; an
/// unset dtype keeps full precision for that part.
struct MixedPrecision {
  /// Parameters are all-gathered and used in forward and backward in this dtype (bf16/fp16 halve the
  /// all-gather bytes and the gathered memory).
  std::optional<c10::ScalarType> param_dtype;
  /// Gradients are reduce-scattered (and all-reduced across replicas) in this dtype; unset: param_dtype.
  std::optional<c10::ScalarType> reduce_dtype;
  /// Floating-point buffers (e.g. BatchNorm statistics) are kept in this dtype.
  std::optional<c10::ScalarType> buffer_dtype;
  /// Cast floating-point tensor arguments of the root forward to param_dtype.
  bool cast_forward_inputs = true;
  bool enabled() const noexcept { return param_dtype || reduce_dtype || buffer_dtype; }
  /// bf16 everywhere: the common choice on hardware with bf16 arithmetic.
  static MixedPrecision bf16() { return {c10::ScalarType::BFloat16, c10::ScalarType::BFloat16, c10::ScalarType::BFloat16, true}; }
  /// fp16 everywhere; scale the loss (fsdp::DynamicLossScale with unscale_grads()) to keep small
  /// gradients from underflowing. LibTorch's CPU kernels have no fp16 matmul or LayerNorm: GPU only.
  static MixedPrecision fp16() { return {c10::ScalarType::Half, c10::ScalarType::Half, c10::ScalarType::Half, true}; }
  /// fp32 compute, gradients reduced in fp16 (half the reduce-scatter bytes; runs on CPU too). The
  /// reduction's fp16 range applies: scale the loss as for fp16().
  static MixedPrecision fp16_reduce() { return {std::nullopt, c10::ScalarType::Half, std::nullopt, true}; }
  /// Whether gradients pass through fp16 somewhere (then loss scaling is due).
  bool fp16_gradients() const noexcept { return param_dtype == c10::ScalarType::Half || reduce_dtype == c10::ScalarType::Half; }
};

struct FsdpOptions {
  ShardingStrategy sharding_strategy = ShardingStrategy::FULL_SHARD;
  AutoWrapPolicy auto_wrap_policy = AutoWrapPolicy::none();
  /// Free a nested unit's parameters after its forward. Unset: the strategy decides
  /// (true for FULL_SHARD and HYBRID_SHARD, false otherwise).
  std::optional<bool> reshard_after_forward;
  /// > 1 (FSDP2's integer reshard_after_forward, DeepSpeed's hpZ): after a training forward a unit keeps
  /// its parameters sharded over groups of this many consecutive ranks of the shard group (a node),
  /// so that backward's all-gather stays inside the group. Must divide the shard group size and be
  /// smaller; reshard_after_forward must not be false. 0: off.
  int reshard_after_forward_group = 0;
  /// Ranks per shard group for the hybrid strategies (hfai's fsdp_group_size); 0 = the ranks of a node.
  int shard_group_size = 0;
  /// The hybrid strategies' optimizer state and fp32 master shards: split over the shard group like the
  /// parameters (GROUP), or over every rank (WORLD, Megatron-FSDP's HFSDP): each replica updates
  /// 1/replicas of its group shard, gradients are reduce-scattered across the replicas instead of
  /// all-reduced, and the updated parts are all-gathered back into the group shards at the next forward
  /// (or checkpoint). The optimizer's parameters are then those parts (parameters()).
  OptimizerSharding optimizer_sharding = OptimizerSharding::GROUP;
  /// Buffers (BatchNorm running statistics) during training: each rank's own (NONE, PyTorch FSDP's
  /// behaviour; checkpoints keep every rank's copy of a buffer that differs) or averaged over the
  /// world after every training forward (AVERAGE). See BufferSync.
  BufferSync buffer_sync = BufferSync::NONE;
  /// Promise that every wrapped submodule is called through fsdp::forward. Without it the first
  /// forward gathers every nested unit up front (a one-time whole-model peak) because it cannot know
  /// which units are called directly; with it even the first forward gathers a unit only as it runs.
  /// A unit called directly despite the promise reads freed memory: keep the promise.
  bool all_units_called_through_forward = false;
  /// Broadcast world rank 0's parameters and buffers at construction, so ranks that initialized
  /// differently start identical (across shard and replica groups alike).
  bool sync_module_states = false;
  MixedPrecision mixed_precision;
  /// Activation checkpointing of every nested unit: its forward (called through fsdp::forward with
  /// tensor arguments and a tensor result) keeps no activations and runs again during backward, with
  /// the CPU RNG state of the first run, so dropout masks and results equal the run without it.
  bool activation_checkpointing = false;
  /// The device the units compute on (PyTorch's device_id). Unset: where the module's parameters are.
  /// The module is moved there at construction. MpiComm moves host memory: CPU only; a communicator
  /// that moves device memory (NcclComm) takes CUDA devices.
  std::optional<torch::Device> device;
  /// PyTorch's CPUOffload(offload_params=True): parameter shards, their gradients and so the optimizer
  /// state live in host memory (pinned when the compute device is a GPU) and the optimizer steps
  /// there; a unit's shard is copied to the compute device for its all-gather, its reduced gradient
  /// back. On a CPU compute device the copies are no-ops and results are identical to no offload.
  bool offload_params = false;
  /// Overlap of all-gathers with computation (PyTorch's backward_prefetch / forward_prefetch /
  /// limit_all_gathers). With MpiComm, prefetched all-gathers run on a collective worker thread over a
  /// duplicate of the shard group; MPI must be initialized with MPI_THREAD_MULTIPLE.
  BackwardPrefetch backward_prefetch = BackwardPrefetch::NO_PREFETCH;
  /// Issue the next unit's all-gather (in the previous step's forward order) when a unit's forward begins.
  bool forward_prefetch = false;
  /// At most this many prefetched units in flight or gathered ahead of use (memory bound); 0: no limit.
  int limit_all_gathers = 1;
  /// Overlap of gradient reductions with the rest of backward (what PyTorch does on its reduction
  /// stream and DDP with its buckets): a unit's reduce-scatter / all-reduce runs on the collective
  /// worker thread while backward goes on to earlier units; backward waits for all of them at its end
  /// and then adds each reduced gradient to its shard's grad, in the order the units finished, so the
  /// result is bit-identical to reducing synchronously. Sharded units keep at most
  /// kMaxReductionsInFlight unreduced gradients alive (memory bound); NO_SHARD holds its full gradients
  /// anyway. It pays where the worker has a core to itself: on a node whose cores are all busy
  /// computing, the worker's copies and reductions slow the computation by about what they hide
  /// (docs/performance.md). With MpiComm, MPI must be initialized with MPI_THREAD_MULTIPLE; NcclComm
  /// reduces on its own stream and ignores it.
  bool overlap_grad_reduce = false;
  /// PyTorch's param_init_fn, for memory-bounded construction: (re)initializes the parameters and
  /// buffers `module` holds itself (not its children's). When set, the engine calls it for every
  /// module, unit by unit, right before flattening that unit, with the CPU RNG seeded from init_seed
  /// and the module's path, so the values depend on neither the world size nor the build order.
  /// Tensors released by fsdp::defer_init() get their storage back first: release each layer right
  /// after building it and no rank ever holds more than about one unsharded unit plus its shards.
  /// Every rank computes the same values, so nothing is broadcast. The same function on a module
  /// built normally gives the same parameters, bit for bit.
  std::function<void(torch::nn::Module& module, const std::string& path)> param_init_fn;
  std::uint64_t init_seed = 0;
};

/// True when `Comm` moves device (GPU) memory; such communicators declare
/// `static constexpr bool kMovesDeviceMemory = true`. MpiComm and the test communicator move host memory.
template <class Comm>
constexpr bool comm_moves_device_memory() {
  if constexpr (requires { Comm::kMovesDeviceMemory; })
    return Comm::kMovesDeviceMemory;
  else
    return false;
}

/// True when `Comm`'s non-blocking collectives progress on their own once issued (a GPU stream), so
/// the engine overlaps by issuing them from the computing thread and ordering their results later,
/// without a collective worker thread. Such communicators declare `kProgressesOnItsOwn`; absent, the
/// device-memory communicators do and the others (MPI: progress needs a thread in a call) do not.
template <class Comm>
constexpr bool comm_progresses_on_its_own() {
  if constexpr (requires { Comm::kProgressesOnItsOwn; })
    return Comm::kProgressesOnItsOwn;
  else
    return comm_moves_device_memory<Comm>();
}

/// True unless `Comm` says that two threads may not call its collectives at the same time (MPI
/// initialized without MPI_THREAD_MULTIPLE): the collective worker needs them to.
template <class Comm>
bool comm_threads_may_call_concurrently() {
  if constexpr (requires { Comm::threads_may_call_concurrently(); })
    return Comm::threads_may_call_concurrently();
  else
    return true;
}

/// Bytes this rank holds for the model's training state (see memory_stats()).
struct MemoryStats {
  std::int64_t shard_param_bytes = 0;      ///< local shards of the flat parameters
  std::int64_t gathered_param_bytes = 0;   ///< unsharded unit buffers currently allocated
  std::int64_t grad_bytes = 0;             ///< gradients of the shards
  std::int64_t optimizer_state_bytes = 0;  ///< optimizer state (if an optimizer was given)
  std::int64_t unsharded_param_bytes = 0;  ///< all units' padded flat parameters (what one replica would hold)
  std::int64_t largest_unit_bytes = 0;     ///< the largest unit's padded flat parameter
  std::int64_t total() const noexcept { return shard_param_bytes + gathered_param_bytes + grad_bytes + optimizer_state_bytes; }
};

/// Description of one FSDP unit.
struct UnitInfo {
  int index = 0;
  int parent = -1;
  std::string module_path;  ///< "" for the root
  std::string type_name;
  std::vector<std::string> param_names;  ///< fully qualified, in flat order
  std::int64_t numel = 0;
  std::int64_t padded_numel = 0;
  std::int64_t shard_numel = 0;
  bool called_through_hook = false;  ///< forward seen through fsdp::forward (frees between forward and backward)
  /// Holds the frozen (requires_grad = false) parameters of unit `parent`: sharded and gathered with
  /// it, but no gradient, no optimizer state, not in parameters().
  bool frozen = false;
};

/// One unit as checkpoints and exports see it: its parameters' names and shapes, its flat layout over
/// the shard group and this rank's shard (the tensor the optimizer updates). The shard shares storage
/// with the engine's: writing into it (under NoGradGuard) changes the model.
struct ShardedUnit {
  int index = 0;
  std::string module_path;
  bool frozen = false;
  std::vector<std::string> param_names;  ///< fully qualified, in flat order
  std::vector<std::vector<std::int64_t>> shapes;
  c10::ScalarType dtype = c10::ScalarType::Float;  ///< of the parameters and the (master) shard
  FlatLayout layout;
  int shard_rank = 0;  ///< this rank's place in the shard group
  torch::Tensor shard;
  /// The tensor the optimizer updates (the engine's parameter): `shard` itself, or with the optimizer
  /// sharded over the world this replica's part of it (replica_part_range), a view into the shard's
  /// storage. Optimizer state is keyed by and shaped like this tensor.
  torch::Tensor optimized;
  int replicas = 1;  ///< parts the shard is split into for the optimizer (1: optimizer state sharded like the shard)
  int replica_rank = 0;
  bool optimizer_sharded_over_replicas() const noexcept { return replicas > 1; }
  /// Where `optimized` lies in `shard` (it may run past its end into padding).
  FlatRange optimized_range() const {
    return optimizer_sharded_over_replicas() ? replica_part_range(layout.shard_numel(), replicas, replica_rank) : FlatRange{0, layout.shard_numel()};
  }
  /// This rank's part of `shard_like` (a tensor shaped like the shard: a loaded optimizer state, a
  /// mask), zero where the part runs past the shard; `shard_like` itself when the optimizer is not
  /// sharded over the replicas.
  torch::Tensor optimized_part_of(const torch::Tensor& shard_like) const {
    if (!optimizer_sharded_over_replicas()) return shard_like;
    const FlatRange part = optimized_range();
    auto out = torch::zeros({part.numel()}, shard_like.options());
    const FlatRange inside = intersect(part, {0, shard_like.numel()});
    if (!inside.empty()) out.narrow(0, 0, inside.numel()).copy_(shard_like.narrow(0, inside.begin, inside.numel()));
    return out;
  }
  bool empty() const noexcept { return param_names.empty(); }
  /// The flat elements this rank holds.
  FlatRange own_range() const { return layout.rank_range(shard_rank); }
};

}  // namespace fsdp
