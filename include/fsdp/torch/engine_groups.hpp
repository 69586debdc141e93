// The communicators of one engine (torch layer): the world, the shard and replica groups the core's
// rule decides, the group kept after forward (reshard_after_forward_group), and the collective
// worker's duplicates of them. ShardedRuntime owns one; the groups are split once, at construction,
// in the same order on every rank.
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "fsdp/comm/communicator.hpp"
#include "fsdp/core/strategy.hpp"
#include "fsdp/errors.hpp"
#include "fsdp/torch/options.hpp"

namespace fsdp::detail {

template <Communicator Comm>
struct EngineGroups {
  Comm world;
  Comm shard = world;
  Comm replica = world;
  std::optional<Comm> forward_group;         // reshard_after_forward_group: this rank's group inside the shard group
  std::optional<Comm> worker_shard;          // the collective worker's duplicate of the shard group
  std::optional<Comm> worker_replica;        // ... of the replica group
  std::optional<Comm> worker_forward_group;  // ... of the forward group

  /// Splits the shard and replica groups (and the forward group) as `options` ask. Collective.
  EngineGroups(Comm world_comm, const FsdpOptions& options) : world(std::move(world_comm)) {
    const int requested = options.shard_group_size;
    const bool needs_node = is_hybrid(options.sharding_strategy) && requested == 0;
    const int group = fsdp::shard_group_size(options.sharding_strategy, world.size(), requested, needs_node ? node_size() : 1);
    const int r = world.rank();
    shard = world.split(r / group, r);
    replica = world.split(r % group, r);
    if (const auto why = optimizer_sharding_problem(options.sharding_strategy, options.optimizer_sharding); !why.empty())
      throw ConfigError("optimizer_sharding = WORLD: " + why);
    if (optimizer_sharded_over_replicas(options) && options.offload_params && comm_moves_device_memory<Comm>())
      throw ConfigError(
          "optimizer_sharding = WORLD with offload_params: the replicas' parts would be all-gathered in host memory, which this communicator cannot "
          "move");
    const int kept = options.reshard_after_forward_group;
    if (kept != 0) {
      if (!reshard_after_forward(options))
        throw ConfigError("reshard_after_forward_group = " + std::to_string(kept) + " with reshard_after_forward = false (set, or " +
                          to_string(options.sharding_strategy) + "'s default): keeping a group shard after forward is a way of resharding");
      if (const auto why = reshard_group_problem(group, kept); !why.empty()) throw ConfigError("reshard_after_forward_group: " + why);
      const int s = shard.rank();
      forward_group.emplace(shard.split(s / kept, s));
    }
  }

  EngineGroups(const EngineGroups&) = delete;
  EngineGroups& operator=(const EngineGroups&) = delete;

  /// Duplicates of the groups for the collective worker: its collectives form their own sequence on
  /// every rank. Every collective is issued in the same order everywhere, so each duplicate is split
  /// on all ranks. Collective.
  void add_worker_duplicates(bool prefetch, bool overlap_reduce) {
    if (prefetch || (overlap_reduce && shard.size() > 1)) worker_shard.emplace(shard.split(0, shard.rank()));
    if (overlap_reduce && replica.size() > 1) worker_replica.emplace(replica.split(0, replica.rank()));
    if (prefetch && forward_group) worker_forward_group.emplace(forward_group->split(0, forward_group->rank()));
    // An MPI worker runs beside the computing threads: waiting for a late peer must not take their core.
    if constexpr (!comm_progresses_on_its_own<Comm>() && requires(Comm & c) { c.set_waiting_yields_cpu(true); }) {
      if (worker_shard) worker_shard->set_waiting_yields_cpu(true);
      if (worker_forward_group) worker_forward_group->set_waiting_yields_cpu(true);
      if (worker_replica) worker_replica->set_waiting_yields_cpu(true);
    }
  }

  /// With FsdpOptions::optimizer_sharding = WORLD, each replica's optimizer updates its part of the
  /// group shard (with a single replica there is nothing to split).
  bool optimizer_sharded_over_replicas(const FsdpOptions& options) const {
    return options.optimizer_sharding == OptimizerSharding::WORLD && replica.size() > 1;
  }

  static bool reshard_after_forward(const FsdpOptions& options) {
    return options.reshard_after_forward.value_or(reshard_after_forward_default(options.sharding_strategy));
  }

  /// Bytes moved and time spent by every group together. Local.
  CommCounters counters() const {
    CommCounters total = world.counters();
    total += shard.counters();
    total += replica.counters();
    if (worker_shard) total += worker_shard->counters();      // the worker's all-gathers and reduce-scatters
    if (worker_replica) total += worker_replica->counters();  // ... and all-reduces
    total += forward_group_counters();
    return total;
  }

  /// Time spent inside blocking collectives on the world, shard, replica and forward groups (not the
  /// worker's duplicates), waiting for peers included: with MPI, what the computing thread spends in
  /// them. Copies of a communicator share its counters, so the world's include the caller's own
  /// collectives on it. Host time.
  double computing_thread_seconds() const {
    CommCounters total = world.counters();
    total += shard.counters();
    total += replica.counters();
    if (forward_group) total += forward_group->counters();
    return total.all_gather_seconds + total.reduce_scatter_seconds + total.all_reduce_seconds + total.broadcast_seconds + total.skew_seconds;
  }

  /// Bytes and time of the all-gathers inside the forward groups; zero without them. Local.
  CommCounters forward_group_counters() const {
    CommCounters total{};
    if (forward_group) total += forward_group->counters();
    if (worker_forward_group) total += worker_forward_group->counters();
    return total;
  }

 private:
  int node_size() {
    if constexpr (requires(Comm c) { c.split_node(); })
      return world.split_node().size();
    else
      return world.size();
  }
};

}  // namespace fsdp::detail
