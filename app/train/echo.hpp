// fsdp-train (app layer): the echo at the start of a run: the deck, the placement, the engine's
// units and state, the data (and a mixture's sources).
#pragma once

#include <cstdint>
#include <cstdio>

#include "unused_keys.hpp"
#include "models/families.hpp"
#include "plan/memory_model.hpp"
#include "plan/root_unit.hpp"
#include "train/dataset.hpp"
#include "train/run_setup.hpp"

namespace fsdp::app {

/// Rank 0 prints it; every rank takes part (the engine's units are the same on every rank). `data`:
/// nullptr when the run reads none (generation).
template <class Engine>
void print_echo(const Engine& model, const RunSetup& s, const Dataset* data) {
  const RunConfig& cfg = s.cfg;
  const bool root = s.world.rank() == 0;
  const auto units = model.units();
  std::int64_t shard_numel = 0, padding = 0;
  for (const auto& u : units) {
    shard_numel += u.shard_numel;
    padding += u.padded_numel - u.numel;
  }
  std::int64_t optimized_numel = 0;  // what this rank's optimizer updates: the shards, or their replica parts
  for (const auto& p : model.parameters()) optimized_numel += p.numel();
  const std::int64_t state_bytes = training_state_bytes(shard_numel, optimized_numel, cfg.optim.state_bytes_per_element());
  if (!root) return;
  const ModelFamily& family = model_family(cfg.model.kind);
  const ModelDesc desc = family.describe(cfg.model);
  const auto fields = [](const UnitInfo& u) { return UnitFields{u.param_names, u.numel, u.padded_numel}; };
  const auto facts = root_unit_facts(units, fields, desc, units_freed_between_uses(cfg.fsdp.reshard_after_forward, model.shard_group_size()),
                                     gathered_param_bytes(cfg.fsdp.mixed_precision), cfg.fsdp.auto_wrap_policy,
                                     cfg.fsdp.transformer_layer_cls_to_wrap, family.layer_classes(cfg.model));
  const auto root_note = root_unit_note(facts, desc);
  const auto& placement = s.placement;
  std::printf("fsdp-train %s: deck %s\n\n%s\n", fsdp::kVersion, s.deck_path.c_str(), s.deck.echo_table().c_str());
  std::printf("  world size %d on %d node(s), %d rank(s) per node, %d thread(s) per rank\n", s.world.size(), placement.nodes, placement.local_size,
              cfg.run.threads);
  if (cfg.run.threads > cfg.placement.rank_cpus)
    std::printf(
        "warning: run.threads = %d but rank 0 may run on %d CPU(s) (its affinity mask; Open MPI's mpirun binds each rank to one core when it starts "
        "2 or fewer): "
        "the threads take turns on them. Give each rank its cores: mpirun --map-by slot:PE=%d (or --bind-to none), "
        "srun --cpus-per-task=%d\n",
        cfg.run.threads, cfg.placement.rank_cpus, cfg.run.threads, cfg.run.threads);
  std::printf("  backend %s (fsdp.backend = %s), compute on %s%s\n", to_string(cfg.fsdp.backend_resolved).c_str(),
              to_string(cfg.fsdp.backend).c_str(), model.compute_device().str().c_str(),
              cfg.fsdp.offload_params ? ", parameter shards offloaded to host memory" : "");
  if (s.fit) std::printf("  memory: %s\n", fit_summary(*s.fit, cfg.placement.ranks_per_node).c_str());
  std::printf("  strategy %s, shard group %d, %zu unit(s), %lld parameters\n", to_string(model.sharding_strategy()), model.shard_group_size(),
              units.size(), static_cast<long long>(model.num_params()));
  std::printf("  per rank: %lld shard elements (%lld padding in all units), expected %.2f MiB of params + grads + optimizer state%s\n",
              static_cast<long long>(shard_numel), static_cast<long long>(padding), state_bytes / 1048576.0,
              cfg.optim.state_dtype == StateDtype::kBf16 ? " (moments in bf16)" : "");
  if (root_note) std::printf("  note: %s\n", root_note->c_str());
  for (const auto& w : unused_key_warnings(s.deck)) std::printf("warning: %s\n", w.c_str());
  if (!data)
    std::printf("  data not read (generation); out_dir %s\n", cfg.run.out_dir.c_str());
  else
    std::printf("  data %s: %lld train, %lld test samples; global batch %lld = %lld per rank x %d ranks x %lld micro-batches; out_dir %s\n",
                to_string(cfg.data.kind).c_str(), static_cast<long long>(data->train_size()), static_cast<long long>(data->test_size()),
                static_cast<long long>(cfg.data.batch_size * s.world.size() * cfg.optim.grad_accum_steps),
                static_cast<long long>(cfg.data.batch_size), s.world.size(), static_cast<long long>(cfg.optim.grad_accum_steps),
                cfg.run.out_dir.c_str());
  if (data && data->blend)
    for (std::size_t i = 0; i < cfg.data.sources.size(); ++i)
      std::printf("  source %zu: %s (%s), %lld samples, weight %g: share %.4f\n", i, cfg.data.sources[i].path.c_str(),
                  to_string(cfg.data.sources[i].kind).c_str(), static_cast<long long>(data->train_sources[i].n), cfg.data.sources[i].weight,
                  data->blend->share(i));
  std::printf("\n");
  std::fflush(stdout);
}

}  // namespace fsdp::app
