// fsdp-plan: predicts the memory of an fsdp-train run per rank from its deck, without MPI and without
// allocating the model, and finds the largest model of the deck's family that fits a budget.
//   fsdp-plan DECK --np N [--set section.key=value ...] [--memory GIB] [--ranks-per-node R]
//                  [--baseline-mib MIB] [--units]
// The deck is read, validated and resolved exactly as fsdp-train does (Deck::parse, resolve_run_config),
// so a bad deck gives the same message and exit code 2. No LibTorch: `fsdp-train DECK --check-plan`
// checks the closed-form model against the built one. docs/planning.md explains the model.
// Exit status: 0 done, 1 failure, 2 bad input.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "unused_keys.hpp"
#include "deck.hpp"
#include "fsdp/version.hpp"
#include "plan.hpp"
#include "run_config.hpp"

using namespace fsdp::app;
using fsdp::ShardingStrategy;

namespace {

constexpr int kExitFailure = 1;
constexpr int kExitBadInput = 2;

double mib(std::int64_t bytes) { return static_cast<double>(bytes) / 1048576.0; }

/// 1234567 -> "1,234,567"
std::string grouped(std::int64_t v) {
  std::string s = std::to_string(v < 0 ? -v : v), out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return (v < 0 ? "-" : "") + out;
}

void print_prediction(const RunConfig& cfg, const ModelSection& shape, const RunShape& run, const Prediction& p, bool list_units) {
  std::printf("  model %s: %s parameters (closed form), %zu unit(s) under %s, largest unit %s (%s padded elements)\n", to_string(shape.kind).c_str(),
              grouped(p.num_params).c_str(), p.units, to_string(run.wrap.policy).c_str(), p.largest_unit_path.c_str(),
              grouped(p.largest_unit).c_str());
  const std::string updated =
      run.optimizer_over_world ? "1/" + std::to_string(run.replicas) + " of a shard, optimizer state over the world" : "shard";
  std::printf("  strategy %s, shard group %lld, %lld replica group(s), %s, optimizer %s (%d %s state tensor(s) per %s), batch %lld per rank%s\n",
              to_string(run.strategy), static_cast<long long>(run.group), static_cast<long long>(run.replicas),
              run.param_bytes == 4 ? "fp32" : ("mixed precision " + to_string(cfg.fsdp.mixed_precision)).c_str(), to_string(run.optimizer).c_str(),
              run.optimizer_copies, run.state_element_bytes == 2 ? "bf16" : "fp32", updated.c_str(), static_cast<long long>(run.batch),
              run.activation_checkpointing ? ", activation checkpointing" : "");
  std::printf("  parameters %lld\n", static_cast<long long>(p.num_params));
  std::printf("  per rank: %lld shard elements (%lld padding in all units), expected %.2f MiB of params + grads + optimizer state\n",
              static_cast<long long>(p.shard_elements), static_cast<long long>(p.padding), mib(p.state_bytes));
  std::printf("  data %s: %s (%.1f MiB)\n", to_string(cfg.data.kind).c_str(), run.data.note.c_str(), mib(run.data.resident_bytes));
  const ModelFamily& family = model_family(shape.kind);
  const ModelDesc desc = family.describe(shape);
  const auto fields = [](const PlanUnit& u) { return UnitFields{u.params, u.numel, u.padded}; };
  const auto facts = root_unit_facts(p.unit_list, fields, desc, units_freed_between_uses(run.reshard_after_forward, run.group), run.param_bytes,
                                     run.wrap.policy, run.wrap.types, family.layer_classes(shape));
  if (const auto note = root_unit_note(facts, desc)) std::printf("  note: %s\n", note->c_str());
  if (list_units) {
    std::printf("\n  unit  parent  module                         params        numel       padded        shard\n");
    for (const auto& u : p.unit_list)
      std::printf("  %4d  %6d  %-28s %7zu %12lld %12lld %12lld\n", u.index, u.parent, u.path.empty() ? "(root)" : u.path.c_str(), u.params.size(),
                  static_cast<long long>(u.numel), static_cast<long long>(u.padded), static_cast<long long>(u.shard));
  }

  std::printf("\nPredicted memory per rank (every rank alike: shards are padded to equal size)\n");
  std::printf("  %-40s %12s %12s\n", "component", "at peak MiB", "own max MiB");
  const char* notes[kMemKinds] = {
      "fp32 master shards",
      "shard-sized, from backward to the update",
      "",
      "unsharded units allocated (all-gathered)",
      "autograd's per-parameter grads, flat buffer, reduced shard",
      "saved for backward, and activation gradients",
      "",
      "ring reduce-scatter scratch, MPI buffers",
      "original parameters, flat copies",
      "replicated on every rank",
      "",
      "host copy of shards and optimizer state, from the first save",
  };
  for (int k = 0; k < kMemKinds; ++k) {
    const auto kind = static_cast<Mem>(k);
    if (p.max_by_kind[static_cast<std::size_t>(k)] == 0) continue;
    std::string label = mem_label(kind);
    if (kind == Mem::kOptimizer) label += " (" + to_string(run.optimizer) + ")";
    std::printf("  %-40s %12.2f %12.2f   %s\n", label.c_str(), mib(p.at_peak[static_cast<std::size_t>(k)]),
                mib(p.max_by_kind[static_cast<std::size_t>(k)]), notes[k]);
  }
  std::printf("  %-40s %12.2f %12s   %s\n", "allocator retention", mib(p.retained_at_peak), "", "freed and fragmented memory the allocator keeps");
  std::printf("  %-40s %12.2f %12s   %s\n", "process baseline", mib(p.baseline_bytes), "", "LibTorch + MPI before the model (--baseline-mib)");
  std::printf("  %-40s %12.2f\n", "total", mib(p.total_bytes));
  std::printf(
      "  allocator model (%s, run.malloc = %s) at the peak: %.1f MiB in blocks given back when freed, kept high-water %.1f MiB x %.2f "
      "(--heap-factor)",
      kTrainAllocatorName, std::string(to_string(cfg.run.malloc)).c_str(), mib(p.mapped_at_peak), mib(p.heap_at_peak), run.heap_factor);
  if (run.activation_heap_factor > 0) std::printf(", its activations x %.2f (recomputed by activation checkpointing)", run.activation_heap_factor);
  std::printf("; most bytes live at once %.1f MiB\n", mib(p.live_peak));
  std::printf("  phases without the baseline: construction %.1f MiB, training step %.1f MiB, evaluation %.1f MiB\n", mib(p.construction_peak),
              mib(p.step_peak), run.evaluate ? mib(p.eval_peak) : 0.0);
  std::printf("predicted peak RSS per rank: %.1f MiB (during the %s)\n", mib(p.total_bytes), p.peak_phase.c_str());
  // The allocator's retention is the one cost a deck key removes: say what it would give.
  const std::int64_t returning = mmap_threshold_of(MallocPolicy::kReturn);
  if (run.mmap_threshold_bytes != returning && p.retained_at_peak > p.total_bytes / 10) {
    RunShape fixed = run;
    fixed.mmap_threshold_bytes = returning;
    if (run.heap_factor == default_heap_factor(run.mmap_threshold_bytes, shape.kind)) {  // not --heap-factor
      fixed.heap_factor = default_heap_factor(returning, shape.kind);
      fixed.activation_heap_factor = default_activation_heap_factor(returning, run.activation_checkpointing);
    }
    const Prediction q = predict(shape, fixed);
    std::printf(
        "  with --set run.malloc=return (freed memory goes back to the system at once; page faults on every "
        "large allocation, slower): %.1f MiB\n",
        mib(q.total_bytes));
  }
}

/// Where fsdp-train would be placed at `np` ranks on this machine's cores, ranks not bound to CPUs.
Placement plan_placement(int np, int ranks_per_node) {
  Placement placement;
  placement.world_size = np;
  placement.ranks_per_node = ranks_per_node > 0 ? ranks_per_node : np;
  placement.nodes = (np + placement.ranks_per_node - 1) / placement.ranks_per_node;
  placement.node_cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  placement.rank_cpus = placement.node_cores;
  return placement;
}

/// One strategy at this world size: its run, or why the deck cannot run it.
struct StrategyRow {
  ShardingStrategy strategy;
  std::optional<RunShape> run;
  std::string why;
};

std::vector<StrategyRow> strategy_rows(const RunConfig& cfg, const DataFootprint& data, double baseline_mib, double heap_factor) {
  std::vector<StrategyRow> rows;
  for (auto s : fsdp::kShardingStrategies) {
    StrategyRow r{s, std::nullopt, ""};
    try {
      r.run = run_shape(cfg, s, data);
      r.run->baseline_mib = baseline_mib;
      if (heap_factor > 0) {
        r.run->heap_factor = heap_factor;
        r.run->activation_heap_factor = 0;
      }
    } catch (const std::exception& e) {
      r.why = e.what();
    }
    rows.push_back(std::move(r));
  }
  return rows;
}

void print_strategy_table(const ModelSection& shape, const std::vector<StrategyRow>& rows, ShardingStrategy deck_strategy, int np) {
  std::printf("\nEvery strategy at %d rank(s), same deck otherwise\n", np);
  std::printf("  %-20s %6s %16s %14s %14s %14s\n", "strategy", "group", "state MiB", "gathered MiB", "activ. MiB", "peak MiB");
  for (const auto& r : rows) {
    if (!r.run) {
      std::printf("  %-20s n/a: %s\n", to_string(r.strategy), r.why.c_str());
      continue;
    }
    const Prediction q = predict(shape, *r.run);
    std::printf("  %-20s %6lld %16.2f %14.2f %14.2f %14.1f%s\n", to_string(r.strategy), static_cast<long long>(r.run->group), mib(q.state_bytes),
                mib(q.max_by_kind[static_cast<std::size_t>(Mem::kGathered)]), mib(q.max_by_kind[static_cast<std::size_t>(Mem::kActivations)]),
                mib(q.total_bytes), r.strategy == deck_strategy ? "   <- the deck's" : "");
  }
}

/// How far a --memory search goes for `key`: the deck's maximum of it, at most 2^20 (the search's
/// own bound, where a key has none or it is larger).
std::int64_t search_limit(const std::string& key) {
  constexpr std::int64_t kCap = std::int64_t{1} << 20;
  const KeySpec* spec = find_key(key);
  if (!spec || !spec->max || *spec->max >= static_cast<double>(kCap)) return kCap;
  return static_cast<std::int64_t>(*spec->max);
}

/// The largest value of `knob` under one strategy whose model fits `budget` ("none" when even the
/// smallest does not), and that model's parameters. Each search doubles until the prediction exceeds
/// the budget, then bisects. A knob whose every step adds the same tensors (layers) is searched
/// exactly up to 256; beyond, the peak is extrapolated from 128 and 256 and checked exactly up to
/// 4,096, a deeper answer printed with "~". No answer passes the deck's own maximum of the key (or
/// 2^20): one there is printed ">=".
std::pair<std::string, std::string> largest_by_knob(const ModelSection& model, const SizeKnob& knob, const StrategyRow& r, std::int64_t budget) {
  constexpr std::int64_t kExact = 256, kVerify = 4096;
  const std::int64_t limit = search_limit("model." + knob.name);
  auto fits = [&](std::int64_t value) { return predict(knob.with(model, value), *r.run).total_bytes <= budget; };
  std::int64_t steps = 0;
  bool extrapolated = false;
  if (knob.same_per_step) {
    steps = largest_fitting(1, std::min(kExact, limit), fits);
    if (steps == kExact) {
      const auto m1 = predict(knob.with(model, kExact / 2), *r.run).total_bytes, m2 = predict(knob.with(model, kExact), *r.run).total_bytes;
      const std::int64_t per_step = std::max<std::int64_t>(1, (m2 - m1) / (kExact / 2));
      steps = std::min(limit, kExact + (budget - m2) / per_step);
      if (steps <= kVerify) {
        while (steps > kExact && !fits(steps)) --steps;
        while (steps < kVerify && fits(steps + 1)) ++steps;
      } else {
        extrapolated = true;
      }
    }
  } else {
    steps = knob.multiple * largest_fitting(1, limit / knob.multiple, [&](std::int64_t k) { return fits(k * knob.multiple); });
  }
  if (steps == 0) return {"none", "-"};
  const ModelSection largest = knob.with(model, steps);
  const std::string prefix = steps + knob.multiple > limit ? ">=" : extrapolated ? "~" : "";
  return {prefix + knob.shown(largest), grouped(closed_form_num_params(largest))};
}

/// --memory: the largest model of the deck's family (each of its size knobs moved alone) and the
/// largest batch per strategy that fit.
void print_largest_fitting(const ModelSection& model, const std::vector<StrategyRow>& rows, const Prediction& p, double memory_gib) {
  const auto budget = static_cast<std::int64_t>(memory_gib * 1073741824.0);
  const auto knobs = model_family(model.kind).size_knobs(model);
  std::printf("\nLargest model of the %s family that fits %.2f GiB per rank (predicted peak RSS, baseline included)\n", to_string(model.kind).c_str(),
              memory_gib);
  if (p.total_bytes <= budget)
    std::printf("  the deck's model fits with the deck's strategy (%.1f of %.1f MiB)\n", mib(p.total_bytes), mib(budget));
  else
    std::printf("  the deck's model does NOT fit with the deck's strategy (%.1f of %.1f MiB)\n", mib(p.total_bytes), mib(budget));
  const std::int64_t batch_limit = search_limit("data.batch_size");
  std::printf("  %-20s", "strategy");
  for (const auto& k : knobs) std::printf(" %*s %16s ", k.column, k.name.c_str(), "parameters");
  std::printf(" %10s%s\n", "batch_size", knobs.empty() ? ("   (model.kind = \"" + to_string(model.kind) + "\" has no size keys)").c_str() : "");
  for (const auto& r : rows) {
    if (!r.run) {
      std::printf("  %-20s n/a\n", to_string(r.strategy));
      continue;
    }
    const std::int64_t batch = largest_fitting(1, batch_limit, [&](std::int64_t b) {
      RunShape x = *r.run;
      x.batch = b;
      return predict(model, x).total_bytes <= budget;
    });
    std::printf("  %-20s", to_string(r.strategy));
    for (const auto& k : knobs) {
      const auto [value, params] = largest_by_knob(model, k, r, budget);
      std::printf(" %*s %16s ", k.column, value.c_str(), params.c_str());
    }
    std::printf(" %10s\n", batch ? ((batch == batch_limit ? ">=" : "") + std::to_string(batch)).c_str() : "none");
  }
  if (knobs.empty()) return;
  std::string notes;
  for (const auto& k : knobs) notes += (notes.empty() ? "" : "; ") + k.note;
  std::printf("  (%s;%sbatch_size for the deck's model)\n", notes.c_str(), knobs.size() > 1 ? "\n   " : " ");
}

/// --memory's largest budget: a PiB per rank (beyond, the byte counts would overflow).
constexpr double kMostMemoryGib = 1024.0 * 1024.0;

int plan(const std::string& deck_path, const std::vector<std::string>& overrides, int np, int ranks_per_node, double memory_gib, double baseline_mib,
         double heap_factor, bool list_units) {
  const std::string text = Deck::read_text(deck_path);
  const Deck deck = Deck::parse(text, deck_path, overrides);
  const RunConfig cfg = resolve_run_config(deck, plan_placement(np, ranks_per_node));
  const ModelSection& shape = cfg.model;
  const ModelDesc desc = describe_model(shape);
  std::set<std::string> full_types;  // a full name ("torch::nn::Linear") selects a module too
  for (const auto& m : desc.modules) full_types.insert(m.full_type);
  check_wrap_classes(cfg.fsdp, desc.types(), full_types);
  const auto strategy = cfg.fsdp.sharding_strategy;
  const DataFootprint data = data_footprint(cfg);

  std::printf("fsdp-plan %s: deck %s, %d rank(s)%s\n", fsdp::kVersion, deck_path.c_str(), np,
              ranks_per_node > 0 ? (", " + std::to_string(ranks_per_node) + " per node").c_str() : " on one node");
  for (const auto& o : deck.overrides()) std::printf("  %s\n", o.c_str());
  for (const auto& w : data.warnings) std::printf("warning: %s\n", w.c_str());
  for (const auto& w : unused_key_warnings(deck)) std::printf("warning: %s\n", w.c_str());
  if (cfg.fsdp.backend == Backend::kNccl)
    std::printf("note: fsdp.backend = \"nccl\": this plan is of host memory with MPI (the GPU path is not modelled)\n");

  RunShape run = run_shape(cfg, strategy, data);
  run.baseline_mib = baseline_mib;
  if (heap_factor > 0) {
    run.heap_factor = heap_factor;
    run.activation_heap_factor = 0;
  }
  const Prediction p = predict(shape, run);
  print_prediction(cfg, shape, run, p, list_units);
  const auto rows = strategy_rows(cfg, data, baseline_mib, heap_factor);
  print_strategy_table(shape, rows, strategy, np);
  if (memory_gib > 0) print_largest_fitting(shape, rows, p, memory_gib);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App cli{"fsdp-plan: predict per-rank memory of an fsdp-train deck, and the largest model that fits", "fsdp-plan"};
  std::string deck_path;
  std::vector<std::string> overrides;
  int np = 1, ranks_per_node = 0;
  double memory_gib = 0, baseline_mib = kDefaultBaselineMib, heap_factor = 0;
  bool list_units = false;
  cli.add_option("DECK", deck_path, "the input deck (TOML)")->required();
  cli.add_option("--np", np, "number of ranks (mpirun -np)")->required()->check(CLI::Range(1, 1 << 24));
  cli.add_option("--set", overrides, "override a deck value: section.key=value (repeatable)");
  cli.add_option("--memory", memory_gib, "GiB per rank: also find the largest model of the deck's family that fits")->check(CLI::PositiveNumber);
  cli.add_option("--ranks-per-node", ranks_per_node, "ranks per node (the hybrid strategies' default shard group); 0: all on one node")
      ->check(CLI::Range(0, 1 << 24));
  cli.add_option("--baseline-mib", baseline_mib, "resident MiB of a rank before data and model (LibTorch + MPI); default measured here")
      ->check(CLI::Range(0.0, 1e9));
  cli.add_option("--heap-factor", heap_factor,
                 "resident heap per byte of its live high-water mark (the allocator's fragmentation), one factor for the whole heap; default "
                 "measured here for "
                 "run.malloc's policy")
      ->check(CLI::Range(1.0, 100.0));
  cli.add_flag("--units", list_units, "list the FSDP units");
  try {
    cli.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return cli.exit(e) == 0 ? 0 : kExitBadInput;
  }
  // CLI11's ranges let NaN through (every comparison with it is false); a budget past a PiB per rank
  // would overflow the byte counts.
  for (const auto& [flag, value] : {std::pair{"--memory", memory_gib}, {"--baseline-mib", baseline_mib}, {"--heap-factor", heap_factor}})
    if (std::isnan(value)) {
      std::fprintf(stderr, "fsdp-plan: error: %s: 'nan' is not a number\n", flag);
      return kExitBadInput;
    }
  if (memory_gib > kMostMemoryGib) {
    std::fprintf(stderr, "fsdp-plan: error: --memory: %g GiB per rank is more than the %g GiB this plan counts\n", memory_gib, kMostMemoryGib);
    return kExitBadInput;
  }
  if (ranks_per_node > np) {
    std::fprintf(stderr, "fsdp-plan: error: --ranks-per-node %d is more than the %d rank(s) of --np\n", ranks_per_node, np);
    return kExitBadInput;
  }
  try {
    return plan(deck_path, overrides, np, ranks_per_node, memory_gib, baseline_mib, heap_factor, list_units);
  } catch (const fsdp::ConfigError& e) {  // DeckError, DataError and the engine's configuration errors
    std::fflush(stdout);
    std::fprintf(stderr, "fsdp-plan: error: %s\n", e.what());
    return kExitBadInput;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "fsdp-plan: error: %s\n", e.what());
    return kExitFailure;
  }
}
