// Sharding strategies and the decisions that follow from one (core layer: std only, no MPI, no
// LibTorch): the strategy and prefetch enums with their names, the shard group size with its errors,
// and whether a strategy frees parameters after forward. The engine, fsdp-plan and fsdp-train all call
// these functions, so each decision is written once.
//
// Enum naming: enums whose values are names users type (in decks and after PyTorch/Accelerate) keep
// those names (FULL_SHARD, BACKWARD_PRE); every other enum uses kPascalCase values (DType::kFloat32).
#pragma once

#include <algorithm>
#include <array>
#include <cctype>
#include <ostream>
#include <string>
#include <string_view>

#include "fsdp/errors.hpp"

namespace fsdp {

/// How parameters, gradients and optimizer state are split (names as in PyTorch / Accelerate).
enum class ShardingStrategy {
  FULL_SHARD,          ///< ZeRO-3: shard everything; free parameters after forward, re-gather for backward
  SHARD_GRAD_OP,       ///< ZeRO-2: shard gradients and optimizer state; keep parameters from forward to backward
  NO_SHARD,            ///< DDP: replicate everything; all-reduce gradients
  HYBRID_SHARD,        ///< FULL_SHARD inside a shard group, replicate across groups
  HYBRID_SHARD_ZERO2,  ///< SHARD_GRAD_OP inside a shard group, replicate across groups
};

inline constexpr std::array<ShardingStrategy, 5> kShardingStrategies = {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP,
                                                                        ShardingStrategy::NO_SHARD, ShardingStrategy::HYBRID_SHARD,
                                                                        ShardingStrategy::HYBRID_SHARD_ZERO2};

constexpr const char* to_string(ShardingStrategy s) noexcept {
  switch (s) {
    case ShardingStrategy::FULL_SHARD: return "FULL_SHARD";
    case ShardingStrategy::SHARD_GRAD_OP: return "SHARD_GRAD_OP";
    case ShardingStrategy::NO_SHARD: return "NO_SHARD";
    case ShardingStrategy::HYBRID_SHARD: return "HYBRID_SHARD";
    case ShardingStrategy::HYBRID_SHARD_ZERO2: return "HYBRID_SHARD_ZERO2";
  }
  return "?";
}

inline std::ostream& operator<<(std::ostream& os, ShardingStrategy s) { return os << to_string(s); }

/// When backward gathers the next unit's parameters (PyTorch's BackwardPrefetch). The next unit is the
/// one that ran before the current one in this step's forward.
enum class BackwardPrefetch {
  NO_PREFETCH,    ///< gather each unit when its backward needs it
  BACKWARD_PRE,   ///< issue the next unit's all-gather when the current unit's backward begins
  BACKWARD_POST,  ///< issue it when the current unit's gradients are computed, before its reduce-scatter
};

inline constexpr std::array<BackwardPrefetch, 3> kBackwardPrefetches = {BackwardPrefetch::NO_PREFETCH, BackwardPrefetch::BACKWARD_PRE,
                                                                        BackwardPrefetch::BACKWARD_POST};

constexpr const char* to_string(BackwardPrefetch p) noexcept {
  switch (p) {
    case BackwardPrefetch::NO_PREFETCH: return "NO_PREFETCH";
    case BackwardPrefetch::BACKWARD_PRE: return "BACKWARD_PRE";
    case BackwardPrefetch::BACKWARD_POST: return "BACKWARD_POST";
  }
  return "?";
}

inline std::ostream& operator<<(std::ostream& os, BackwardPrefetch p) { return os << to_string(p); }

namespace detail {
/// The value of `all` whose name equals `text` in any case; ConfigError naming `what` and every valid name.
template <class Enum, std::size_t N>
Enum parse_enum_name(std::string_view text, const std::array<Enum, N>& all, const char* what) {
  std::string up(text);
  std::transform(up.begin(), up.end(), up.begin(), [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  std::string valid;
  for (auto value : all) {
    if (up == to_string(value)) return value;
    valid += (valid.empty() ? "" : ", ") + std::string(to_string(value));
  }
  throw ConfigError("unknown " + std::string(what) + " '" + std::string(text) + "' (valid: " + valid + ")");
}
}  // namespace detail

/// Parses "FULL_SHARD", "full_shard", ...; throws ConfigError naming the valid values.
inline ShardingStrategy parse_sharding_strategy(std::string_view text) {
  return detail::parse_enum_name(text, kShardingStrategies, "sharding strategy");
}

/// Parses "BACKWARD_PRE", "backward_pre", ...; throws ConfigError naming the valid values.
inline BackwardPrefetch parse_backward_prefetch(std::string_view text) {
  return detail::parse_enum_name(text, kBackwardPrefetches, "backward prefetch");
}

/// The strategies that shard inside a group of chosen size and replicate across groups.
constexpr bool is_hybrid(ShardingStrategy s) noexcept { return s == ShardingStrategy::HYBRID_SHARD || s == ShardingStrategy::HYBRID_SHARD_ZERO2; }

/// Which ranks split the optimizer state and fp32 master weights (the hybrid strategies' choice;
/// Megatron-FSDP's HFSDP): GROUP, the shard group, as the parameters; WORLD, every rank: gradients are
/// reduce-scattered across the replicas too, and the parameters all-gathered back into the group shards.
enum class OptimizerSharding { GROUP, WORLD };

inline constexpr std::array<OptimizerSharding, 2> kOptimizerShardings = {OptimizerSharding::GROUP, OptimizerSharding::WORLD};

constexpr const char* to_string(OptimizerSharding s) noexcept { return s == OptimizerSharding::WORLD ? "WORLD" : "GROUP"; }

/// Parses "group", "WORLD", ...; throws ConfigError naming the valid values.
inline OptimizerSharding parse_optimizer_sharding(std::string_view text) {
  return detail::parse_enum_name(text, kOptimizerShardings, "optimizer sharding");
}

/// What happens to buffers (BatchNorm running statistics) during training. NONE, PyTorch FSDP's
/// behaviour: each rank keeps its own (sync_module_states makes them equal at the start), and
/// checkpoints store every rank's copy of a buffer that differs between ranks. AVERAGE: after every
/// training forward floating-point buffers are averaged over the world and integer ones broadcast
/// from rank 0, so every rank holds the same (one collective per buffer per forward).
enum class BufferSync { NONE, AVERAGE };

inline constexpr std::array<BufferSync, 2> kBufferSyncs = {BufferSync::NONE, BufferSync::AVERAGE};

constexpr const char* to_string(BufferSync s) noexcept { return s == BufferSync::AVERAGE ? "AVERAGE" : "NONE"; }

/// Parses "none", "AVERAGE", ...; throws ConfigError naming the valid values.
inline BufferSync parse_buffer_sync(std::string_view text) { return detail::parse_enum_name(text, kBufferSyncs, "buffer sync"); }

/// Why optimizer state cannot be sharded as `sharding` under `strategy`; empty when it can. WORLD
/// differs from GROUP only where a strategy replicates across groups: the hybrid strategies.
inline std::string optimizer_sharding_problem(ShardingStrategy strategy, OptimizerSharding sharding) {
  if (sharding == OptimizerSharding::GROUP || is_hybrid(strategy)) return {};
  return std::string("optimizer state sharded over the world applies to the hybrid strategies (HYBRID_SHARD, HYBRID_SHARD_ZERO2); ") +
         to_string(strategy) + (strategy == ShardingStrategy::NO_SHARD ? " replicates it by definition" : " shards it over the world already");
}

/// Whether a unit frees its gathered parameters after forward when the user does not say
/// (FsdpOptions::reshard_after_forward unset, deck fsdp.reshard_after_forward = "auto").
constexpr bool reshard_after_forward_default(ShardingStrategy s) noexcept {
  return s == ShardingStrategy::FULL_SHARD || s == ShardingStrategy::HYBRID_SHARD;
}

/// Why `kept` cannot be the group a unit stays sharded over after forward (reshard_after_forward_group)
/// in a shard group of `shard_group` ranks; empty when it can: it divides the shard group and lies
/// between 2 and half of it (a group of all of them is plain resharding, of one is not resharding).
inline std::string reshard_group_problem(int shard_group, int kept) {
  if (kept >= 2 && kept < shard_group && shard_group % kept == 0) return {};
  std::string why = std::to_string(kept) + " does not divide the shard group of " + std::to_string(shard_group) + " rank(s) into smaller groups";
  if (shard_group < 4 || shard_group % 2 != 0) {
    bool any = false;
    for (int g = 2; g < shard_group; ++g) any = any || shard_group % g == 0;
    if (!any) why += " (it has none: use a world size with a divisor, or true)";
  }
  return why;
}

/// The number of ranks that share one copy of the parameters (the shard group):
/// FULL_SHARD and SHARD_GRAD_OP the world, NO_SHARD one rank, the hybrid strategies `requested`
/// (0 = `node_size`, the ranks of one node). Throws ConfigError when `requested` is negative, does
/// not divide the world, or is given for a non-hybrid strategy (other than the world size itself).
inline int shard_group_size(ShardingStrategy strategy, int world_size, int requested, int node_size) {
  if (world_size <= 0) throw ConfigError("world size must be positive, got " + std::to_string(world_size));
  if (strategy == ShardingStrategy::NO_SHARD) {
    if (requested != 0 && requested != 1)
      throw ConfigError("shard_group_size applies to the hybrid strategies only (strategy is NO_SHARD, whose shard group is one rank)");
    return 1;
  }
  if (!is_hybrid(strategy)) {
    if (requested != 0 && requested != world_size)
      throw ConfigError(std::string("shard_group_size applies to the hybrid strategies only (strategy is ") + to_string(strategy) + ")");
    return world_size;
  }
  if (requested < 0) throw ConfigError("shard_group_size must be >= 0, got " + std::to_string(requested));
  const int group = requested == 0 ? node_size : requested;
  if (group <= 0) throw ConfigError("the node size must be positive, got " + std::to_string(group));
  if (world_size % group != 0)
    throw ConfigError("world size " + std::to_string(world_size) + " is not divisible by shard_group_size " + std::to_string(group) +
                      (requested == 0 ? " (the ranks of one node)" : ""));
  return group;
}

}  // namespace fsdp
