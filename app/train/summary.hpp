// fsdp-train (app layer): the end of a run: times per phase across ranks, collectives, overlap, peak
// memory, written to summary.json and printed as a table.
#pragma once

#include <fsdp/fsdp.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "app_build.hpp"
#include "train/allocator.hpp"
#include "run_config.hpp"
#include "train/dataset.hpp"
#include "train/gemm_probe.hpp"
#include "train/metrics_log.hpp"
#include "train/ranks.hpp"
#include "train/timing.hpp"

namespace fsdp::app {

/// The run's checkpoint saves (this rank's view): what each held training up and how long each write took.
struct CheckpointTotals {
  bool asynchronous = false;
  double reserve_s = 0;  ///< allocating the host copy after the first step (asynchronous only)
  std::vector<double> held_s, write_s;
  std::vector<double> step_ms_while_writing;  ///< steps begun while a background write was in flight
  std::vector<std::int64_t> skipped;          ///< checkpoint.async_when_writing = "skip": steps whose save was skipped
};

/// Bytes the training steps all-gathered (this rank's count), and of them those inside the groups of
/// fsdp.reshard_after_forward = N.
struct StepAllGather {
  std::uint64_t total = 0, inside_reshard_group = 0;
};

/// What a run did: the numbers its summary is made of (this rank's).
struct RunTotals {
  std::string backend;
  std::filesystem::path out_dir;
  std::filesystem::path metrics_path;  ///< "" when metrics.csv was not written
  std::int64_t steps = 0, resumed_from_step = 0, skipped_steps = 0, samples_trained = 0;
  std::vector<std::string> resume_changed;  ///< keys deciding the training changed at the resume ("key: before -> now")
  std::vector<SourceShare> sources;         ///< data.sources: each source's draws at the end
  std::int64_t overflow_steps = 0;          ///< of skipped_steps: fp16 gradients overflowed (the loss scale backed off)
  std::optional<double> loss_scale;         ///< fp16's loss scale at the end; unset without loss scaling
  std::int64_t tokens_per_sample = 0;       ///< language models: tokens predicted per sequence; 0 otherwise
  double flops_per_token = 0;               ///< language models: training FLOPs per token (6 N + 12 L d T); 0 otherwise
  Utilization utilization;                  ///< the model's FLOPs per sample and the run's peak (GEMM probe); no peak on a GPU
  std::int64_t samples_per_step = 0;        ///< the global batch
  std::int64_t timing_warmup_steps = 0;     ///< log.timing_warmup_steps: first steps kept out of the median step time
  double last_loss = std::nan("");
  std::optional<EvalResult> eval;  ///< the last evaluation, if any ran
  std::int64_t eval_step = 0;      ///< the step it followed
  double wall_s = 0;               ///< since the program started
  double train_elapsed_s = 0;      ///< since training started (checkpoints and evaluation included)
  Phases phases;
  std::vector<double> step_ms;
  fsdp::CommCounters comm_start;  ///< the engine's counters when training started
  StepAllGather step_all_gather;
  bool overlap_grad_reduce = false;
  CheckpointTotals checkpoints;
  std::vector<double> rss_growth_mib;         ///< per rank: resident memory at the last log minus at warm-up; empty before warm-up
  std::optional<std::int64_t> rss_warm_step;  ///< the step warm-up ended (RankWatch)
  bool rewritten = false;                     ///< written by a rerun of the finished run: losses from metrics.csv, no timings of the training
};

inline double median_of(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0 : values[values.size() / 2];
}

/// A run's step times split into the warm-up (its first `warmup` steps: the heap, caches and page
/// tables fill) and the steps after it, whose median is the run's step time. A run of no more steps
/// than `warmup` has no warm-up apart: all its steps are measured (the benchmark peer does the same).
struct StepTimes {
  std::vector<double> warmup, measured;
  double median() const { return median_of(measured); }
};
inline StepTimes split_warmup(const std::vector<double>& step_ms, std::int64_t warmup) {
  const auto n = static_cast<std::int64_t>(step_ms.size()) > warmup ? static_cast<std::ptrdiff_t>(warmup) : 0;
  return {{step_ms.begin(), step_ms.begin() + n}, {step_ms.begin() + n, step_ms.end()}};
}

/// What summary.json reports across ranks, gathered by every rank (collective) before rank 0 writes.
struct RunStatsAcrossRanks {
  fsdp::CommCounters comm;  ///< rank 0's counters at the end
  double all_gather_s = 0, reduce_scatter_s = 0, all_reduce_s = 0;
  std::vector<std::pair<std::string, Stats>> phases;
  fsdp::OverlapStats overlap;  ///< this rank's
  Stats exposed_all_gather, exposed_reduce;
  std::vector<double> peak_rss_mb;  ///< per rank
  double total_samples = 0;
  double train_s = 0;  ///< training only: without checkpoints and evaluation
  double rate = 0;     ///< samples per second over all ranks
};

template <class Engine>
RunStatsAcrossRanks gather_run_stats(MpiComm& world, Engine& model, const RunTotals& t) {
  RunStatsAcrossRanks r;
  r.comm = model.comm_counters();
  r.all_gather_s = r.comm.all_gather_seconds - t.comm_start.all_gather_seconds;
  r.reduce_scatter_s = r.comm.reduce_scatter_seconds - t.comm_start.reduce_scatter_seconds;
  r.all_reduce_s = r.comm.all_reduce_seconds - t.comm_start.all_reduce_seconds;
  const std::vector<std::pair<std::string, double>> phase_list = {
      {"data", t.phases.data},           {"forward", t.phases.forward},          {"backward", t.phases.backward},
      {"all_gather", r.all_gather_s},    {"reduce_scatter", r.reduce_scatter_s}, {"all_reduce", r.all_reduce_s},
      {"optimizer", t.phases.optimizer}, {"checkpoint", t.phases.checkpoint},    {"eval", t.phases.eval}};
  for (const auto& [n, v] : phase_list) r.phases.emplace_back(n, across_ranks(world, v));
  r.overlap = model.overlap_stats();
  r.exposed_all_gather = across_ranks(world, r.overlap.exposed_all_gather_seconds);
  r.exposed_reduce = across_ranks(world, r.overlap.exposed_reduce_seconds);
  r.peak_rss_mb.resize(static_cast<std::size_t>(world.size()));
  const double my_rss = peak_rss_mb();
  world.all_gather(&my_rss, r.peak_rss_mb.data(), 1, fsdp::DType::kFloat64);
  r.total_samples = static_cast<double>(t.samples_trained);
  world.all_reduce(&r.total_samples, &r.total_samples, 1, fsdp::DType::kFloat64, fsdp::ReduceOp::kSum);
  r.train_s = t.train_elapsed_s - t.phases.checkpoint - t.phases.eval;
  r.rate = r.total_samples / std::max(r.train_s, 1e-9);
  return r;
}

inline nlohmann::ordered_json min_avg_max(const Stats& st) { return nlohmann::ordered_json{{"min", st.min}, {"avg", st.avg}, {"max", st.max}}; }

/// Rank 0's saves: training held per save (copy to the host and waiting for the previous write when
/// asynchronous; the whole save otherwise) and each write's duration.
inline nlohmann::ordered_json checkpoints_json(const CheckpointTotals& c) {
  nlohmann::ordered_json js;
  js["async"] = c.asynchronous;
  js["saves"] = c.held_s.size();
  js["held_s"] = c.held_s;
  js["write_s"] = c.write_s;
  if (c.asynchronous) {
    js["reserve_s"] = c.reserve_s;
    js["steps_while_writing"] = c.step_ms_while_writing.size();
    js["step_ms_median_while_writing"] = median_of(c.step_ms_while_writing);
    js["skipped_saves"] = c.skipped;
  }
  return js;
}

/// Rank 0's collectives over the same span as the phases (training, evaluation, checkpoints): bytes as
/// the engine counts them (all_gather: this rank's shard; reduce_scatter: the full input buffer;
/// all_reduce, broadcast: the buffer) and wall seconds inside the blocking calls.
inline nlohmann::ordered_json comm_json(const RunConfig& cfg, const RunTotals& t, const RunStatsAcrossRanks& r) {
  nlohmann::ordered_json js;
  const auto& comm = r.comm;
  js["rank"] = 0;
  js["calls"] = comm.calls - t.comm_start.calls;
  auto comm_kind = [&](const char* n, std::uint64_t bytes, double seconds) { js[n] = {{"bytes", bytes}, {"seconds", seconds}}; };
  comm_kind("all_gather", comm.all_gather_bytes - t.comm_start.all_gather_bytes, r.all_gather_s);
  comm_kind("reduce_scatter", comm.reduce_scatter_bytes - t.comm_start.reduce_scatter_bytes, r.reduce_scatter_s);
  comm_kind("all_reduce", comm.all_reduce_bytes - t.comm_start.all_reduce_bytes, r.all_reduce_s);
  if (cfg.fsdp.reshard_after_forward_group > 0) {
    // fsdp.reshard_after_forward = N: backward's all-gathers inside the groups of N ranks (a node:
    // they never leave it), part of all_gather above; the rest of all_gather crosses the shard group.
    const auto steps = static_cast<std::uint64_t>(std::max<std::int64_t>(1, t.steps - t.resumed_from_step));
    const auto& g = t.step_all_gather;
    js["reshard_group"] = {{"size", cfg.fsdp.reshard_after_forward_group},
                           {"all_gather_bytes_per_step_inside_group", g.inside_reshard_group / steps},
                           {"all_gather_bytes_per_step_across_shard_group", (g.total - g.inside_reshard_group) / steps}};
  }
  comm_kind("broadcast", comm.broadcast_bytes - t.comm_start.broadcast_bytes, comm.broadcast_seconds - t.comm_start.broadcast_seconds);
  js["skew_s"] = comm.skew_seconds - t.comm_start.skew_seconds;  // FSDP_COMM_SKEW_PROBE=1 only
  return js;
}

/// Overlap: unit all-gathers issued ahead on the worker vs run on demand (rank 0), and the time the
/// computing thread waited for unit all-gathers (across ranks): the exposed communication. Gradient
/// reductions run on the worker while backward went on, and the time the computing thread then waited
/// for them (end of backward, or the in-flight bound). NCCL reduces on its own stream: the setting is
/// not used there.
inline nlohmann::ordered_json overlap_json(const RunConfig& cfg, const RunTotals& t, const RunStatsAcrossRanks& r) {
  nlohmann::ordered_json js;
  js["backward_prefetch"] = cfg.fsdp.backward_prefetch_name;
  js["forward_prefetch"] = cfg.fsdp.forward_prefetch;
  js["prefetched"] = r.overlap.prefetched;
  js["gathered_on_demand"] = r.overlap.gathered_on_demand;
  js["exposed_all_gather_s"] = min_avg_max(r.exposed_all_gather);
  js["overlap_grad_reduce"] = t.overlap_grad_reduce;
  js["reductions_overlapped"] = r.overlap.reductions_overlapped;
  js["reductions_synchronous"] = r.overlap.reductions_synchronous;
  js["exposed_reduce_s"] = min_avg_max(r.exposed_reduce);
  return js;
}

/// The model FLOP utilization of the median step after the warm-up (a global batch per step).
inline std::optional<double> steady_mfu(const RunTotals& t, const StepTimes& steps) {
  const double step_s = steps.median() / 1000;
  return step_s > 0 ? t.utilization.at(static_cast<double>(t.samples_per_step) / step_s) : std::nullopt;
}

/// Model FLOPs and utilization: model_flops_per_s from the throughput (all steps over train_s); mfu
/// from the median step after the warm-up against the GEMM probe's peak (null without one: a GPU).
inline void utilization_json(nlohmann::ordered_json& js, const RunTotals& t, const RunStatsAcrossRanks& r, const StepTimes& steps) {
  const auto& u = t.utilization;
  if (!(u.flops_per_sample > 0)) return;
  js["model_flops_per_sample"] = u.flops_per_sample;
  js["model_flops_per_s"] = u.flops_per_sample * r.rate;
  const auto mfu = steady_mfu(t, steps);
  js["mfu"] = mfu ? nlohmann::ordered_json(*mfu) : nlohmann::ordered_json(nullptr);
  if (u.peak.flops_per_s > 0) {
    js["peak_flops_per_s"] = u.peak.flops_per_s;
    auto probe = gemm_probe_json(u.peak.probe);
    probe["cached"] = u.peak.probe.cached;
    js["gemm_probe"] = probe;
  }
}

/// summary.json's document (rank 0's view).
template <class Engine>
nlohmann::ordered_json summary_json(MpiComm& world, const MpiComm::Placement& placement, const RunConfig& cfg, Engine& model, const RunTotals& t,
                                    const RunStatsAcrossRanks& r) {
  nlohmann::ordered_json js;
  js["name"] = cfg.run.name;
  js["world_size"] = world.size();
  js["nodes"] = placement.nodes;
  js["ranks_per_node"] = placement.local_size;
  js["threads_per_rank"] = cfg.run.threads;
  js["backend"] = t.backend;
  js["strategy"] = to_string(model.sharding_strategy());
  js["shard_group_size"] = model.shard_group_size();
  js["replica_groups"] = world.size() / model.shard_group_size();
  js["optimizer_sharding"] = cfg.fsdp.optimizer_sharding == OptimizerSharding::WORLD ? "world" : "group";
  js["optimizer_state_dtype"] = to_string(cfg.optim.state_dtype);
  js["params"] = model.num_params();
  js["steps"] = t.steps;
  js["resumed_from_step"] = t.resumed_from_step;
  if (t.rewritten) js["rewritten_by_rerun"] = true;
  if (!t.resume_changed.empty()) js["resume_changed"] = t.resume_changed;
  for (const auto& source : t.sources)
    js["data_sources"].push_back({{"path", source.path},
                                  {"weight", source.weight},
                                  {"share", source.share},
                                  {"drawn", source.drawn},
                                  {"drawn_share", source.drawn_share},
                                  {"epoch", source.epoch},
                                  {"position", source.position}});
  js["skipped_steps"] = t.skipped_steps;
  if (t.loss_scale) {
    js["overflow_steps"] = t.overflow_steps;
    js["loss_scale"] = *t.loss_scale;
  }
  js["final_train_loss"] = std::isnan(t.last_loss) ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(t.last_loss);
  if (t.eval) {
    js["test_loss"] = t.eval->loss;
    js["test_accuracy"] = t.eval->accuracy;
    js["eval_step"] = t.eval_step;
    if (t.tokens_per_sample > 0) js["eval_perplexity"] = std::exp(t.eval->loss);
  }
  js["wall_s"] = t.wall_s;
  js["train_s"] = r.train_s;
  const StepTimes steps = split_warmup(t.step_ms, t.timing_warmup_steps);
  js["step_ms_median"] = steps.median();
  js["timing_warmup_steps"] = steps.warmup.size();
  js["step_ms_warmup"] = steps.warmup;
  js[t.tokens_per_sample > 0 ? "tokens_per_s" : "samples_per_s"] =
      t.tokens_per_sample > 0 ? r.rate * static_cast<double>(t.tokens_per_sample) : r.rate;
  if (t.flops_per_token > 0) {
    // Achieved model FLOP/s: nanoGPT's and llm.c's estimate (forward and backward of every parameter,
    // plus attention), from the training throughput; hardware-independent, no recomputation counted.
    js["model_flops_per_token"] = t.flops_per_token;
  }
  utilization_json(js, t, r, steps);
  js["peak_rss_mb"] = r.peak_rss_mb;
  js["allocator"] = kTrainAllocatorName;  // what run.malloc set (fsdp-plan models the same one)
  js["malloc"] = std::string(to_string(cfg.run.malloc));
  auto& settings_js = js["allocator_settings"] = nlohmann::ordered_json::object();
  for (const auto& [name, value] : allocator_settings()) settings_js[name] = value;
  if (t.rss_warm_step) {
    js["rss_growth_mib"] = t.rss_growth_mib;
    js["rss_growth_since_step"] = *t.rss_warm_step;
  }
  js["checkpoints"] = checkpoints_json(t.checkpoints);
  auto& phases_js = js["phases"] = nlohmann::ordered_json::object();
  for (const auto& [n, st] : r.phases) phases_js[n] = min_avg_max(st);
  js["comm"] = comm_json(cfg, t, r);
  js["overlap"] = overlap_json(cfg, t, r);
  return js;
}

/// The end-of-run table: phases across ranks, peak memory, steps and throughput.
inline void print_summary(int world_size, const RunTotals& t, const RunStatsAcrossRanks& r) {
  std::printf("\nphase            min s     avg s     max s   (across %d ranks; the collectives run inside the other phases)\n", world_size);
  for (const auto& [n, s] : r.phases) std::printf("%-14s %8.3f  %8.3f  %8.3f\n", n.c_str(), s.min, s.avg, s.max);
  std::printf("peak RSS per rank (MiB):");
  for (double rss : r.peak_rss_mb) std::printf(" %.0f", rss);
  const bool tokens = t.tokens_per_sample > 0;
  const StepTimes steps = split_warmup(t.step_ms, t.timing_warmup_steps);
  char warmup[48] = "";
  if (!steps.warmup.empty()) std::snprintf(warmup, sizeof warmup, " (after %zu warm-up)", steps.warmup.size());
  const auto mfu = steady_mfu(t, steps);
  char utilization[32] = "";
  if (mfu) std::snprintf(utilization, sizeof utilization, ", MFU %.1f%%", 100 * *mfu);
  std::printf("\n%lld steps, median step %.1f ms%s%s, %.0f %s, wall %.1f s\n", static_cast<long long>(t.steps), steps.median(), warmup, utilization,
              tokens ? r.rate * static_cast<double>(t.tokens_per_sample) : r.rate, tokens ? "tokens/s" : "samples/s", t.wall_s);
  // A language model's loss per token is read as perplexity; an image classifier's as accuracy.
  if (t.eval && tokens)
    std::printf("eval loss %.4f, perplexity %.2f (per token)\n", t.eval->loss, std::exp(t.eval->loss));
  else if (t.eval)
    std::printf("test accuracy %.2f%%, test loss %.4f\n", 100 * t.eval->accuracy, t.eval->loss);
  std::printf("wrote %s%s%s\n", (t.out_dir / "summary.json").c_str(), t.metrics_path.empty() ? "" : " and ", t.metrics_path.c_str());
}

/// Whether `path` (a summary.json) holds a training's figures, not only --eval-only's.
inline bool summary_has_training(const std::filesystem::path& path) {
  std::ifstream in(path);
  const auto js = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  return js.is_object() && js.contains("steps");
}

/// `eval_only` as summary.json's "eval_only": added to the run's summary.json when there is one (its
/// training figures stay as they are), else a new summary.json; written atomically. A summary.json
/// that is not a JSON object is left alone: OutputError naming it.
inline void write_eval_only_summary(const std::filesystem::path& out_dir, const nlohmann::ordered_json& eval_only) {
  namespace fs = std::filesystem;
  const fs::path path = out_dir / "summary.json";
  auto summary = nlohmann::ordered_json::object();
  if (fs::exists(path)) {
    std::ifstream in(path);
    summary = nlohmann::ordered_json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (summary.is_discarded() || !summary.is_object())
      throw fsdp::OutputError(path.string() + " is not a JSON object: left as it is (the evaluation is in the output above)");
  }
  fs::create_directories(out_dir);
  summary["eval_only"] = eval_only;
  fsdp::write_file_atomically(path, summary.dump(2) + "\n");
}

/// Writes <out_dir>/summary.json (atomically; a failed write stops every rank, exit 1) and, with
/// `print_table`, prints the phase table (rank 0). Collective: every rank calls it.
template <class Engine>
void write_summary(MpiComm& world, const MpiComm::Placement& placement, const RunConfig& cfg, Engine& model, const RunTotals& t,
                   bool print_table = true) {
  const RunStatsAcrossRanks r = gather_run_stats(world, model, t);
  on_all_ranks(world, [&] {
    if (world.rank() == 0) fsdp::write_file_atomically(t.out_dir / "summary.json", summary_json(world, placement, cfg, model, t, r).dump(2) + "\n");
  });
  if (world.rank() == 0 && print_table) print_summary(world.size(), t, r);
}

/// summary.json written again by a rerun of the finished run (it was lost, or --eval-only's is all
/// there is): marked "rewritten_by_rerun", the last step's losses as metrics.csv logged them (the
/// checkpoint holds neither; no accuracy), no timings of the training, --eval-only's figures kept.
/// Collective.
template <class Engine>
void write_summary_again(MpiComm& world, const MpiComm::Placement& placement, const RunConfig& cfg, Engine& model, RunTotals t) {
  const auto out_dir = std::filesystem::path(cfg.run.out_dir);
  nlohmann::ordered_json eval_only;
  on_all_ranks(world, [&] {  // a damaged metrics.csv or summary.json stops every rank alike
    if (world.rank() != 0) return;
    if (!cfg.log.metrics_file.empty()) {
      const auto logged = logged_losses_at(out_dir / cfg.log.metrics_file, t.steps);
      if (logged.train) t.last_loss = *logged.train;
      if (logged.eval) {
        t.eval = EvalResult{*logged.eval, std::nan(""), 0};
        t.eval_step = t.steps;
      }
    }
    std::ifstream in(out_dir / "summary.json");
    const auto old = nlohmann::ordered_json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (old.is_object() && old.contains("eval_only")) eval_only = old["eval_only"];
  });
  t.rewritten = true;
  write_summary(world, placement, cfg, model, t, /*print_table=*/false);
  on_all_ranks(world, [&] {
    if (world.rank() == 0 && !eval_only.is_null()) write_eval_only_summary(out_dir, eval_only);
  });
}

}  // namespace fsdp::app
