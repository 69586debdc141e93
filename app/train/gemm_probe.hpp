// fsdp-train (app layer): the machine's fp32 matrix-multiply rate at the model's shapes, one thread,
// measured once per host and kept in the run directory: the denominator of the model FLOP utilization
// (MFU) the progress line, metrics.csv and summary.json report.
#pragma once

#include <fsdp/fsdp.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "models/families.hpp"
#include "plan/model_desc.hpp"
#include "run_config.hpp"
#include "train/compute_threads.hpp"
#include "train/ranks.hpp"

namespace fsdp::app {

/// One product as a linear layer runs it: y[rows x cols] = x[rows x inner] w[cols x inner]^T.
struct GemmShape {
  std::string name;  ///< the first module with this weight shape ("blocks.0.mlp.fc"), or "fixed"
  std::int64_t rows = 0, inner = 0, cols = 0;
  double flops() const { return 2.0 * static_cast<double>(rows) * static_cast<double>(inner) * static_cast<double>(cols); }
  bool same_size(const GemmShape& o) const { return rows == o.rows && inner == o.inner && cols == o.cols; }
};

struct GemmRate {
  GemmShape shape;
  double gflops = 0;  ///< on one thread, the best repetition
};

/// Products larger than this in any dimension are probed at this size: they run at the same rate and
/// the probe stays short (a few tenths of a second) and small (12 MiB) however large the model.
inline constexpr std::int64_t kProbeMaxDim = 1024;
/// The same product in every run, whatever the model: how fast the machine was when the run started.
inline const GemmShape kFixedProbeShape{"fixed", 512, 512, 512};
/// Distinct products probed: the model's largest by FLOPs per step.
inline constexpr std::size_t kProbeShapes = 4;

/// The forward products of the model's linear layers and LM head for a micro-batch of `rows` rows
/// (samples x tokens per sample), distinct shapes, those doing the most FLOPs per step first.
inline std::vector<GemmShape> model_gemm_shapes(const ModelDesc& desc, std::int64_t rows) {
  struct Use {
    GemmShape shape;
    double total = 0;
  };
  std::vector<Use> uses;
  for (const auto& m : desc.modules) {
    if (m.type != "Linear" && m.type != "GeluLinear" && m.type != "SwiGluLinear" && m.type != "LmHead") continue;
    for (const auto& p : m.params) {
      if (p.shape.size() != 2 || !p.name.ends_with("weight")) continue;
      GemmShape s{m.path, std::min(rows, kProbeMaxDim), std::min(p.shape[1], kProbeMaxDim), std::min(p.shape[0], kProbeMaxDim)};
      const double full = 2.0 * static_cast<double>(rows) * static_cast<double>(p.shape[1]) * static_cast<double>(p.shape[0]);
      auto it = std::find_if(uses.begin(), uses.end(), [&](const Use& u) { return u.shape.same_size(s); });
      if (it == uses.end())
        uses.push_back({s, full});
      else
        it->total += full;
    }
  }
  std::stable_sort(uses.begin(), uses.end(), [](const Use& a, const Use& b) { return a.total > b.total; });
  std::vector<GemmShape> shapes;
  for (std::size_t i = 0; i < uses.size() && i < kProbeShapes; ++i) shapes.push_back(uses[i].shape);
  return shapes;
}

/// Times `shape` as torch::nn::functional::linear runs it on the calling thread's settings: one
/// warm-up, then repetitions until `min_seconds` and 3 of them have passed; the best one counts.
/// Constant inputs: the rate does not depend on the values, and the run's random generator is left alone.
inline GemmRate time_linear(const GemmShape& shape, double min_seconds = 0.03) {
  using Clock = std::chrono::steady_clock;
  torch::NoGradGuard no_grad;
  const auto x = torch::full({shape.rows, shape.inner}, 0.5f);
  const auto w = torch::full({shape.cols, shape.inner}, 0.25f);
  auto y = torch::nn::functional::linear(x, w);
  double best = 1e300, spent = 0;
  for (int reps = 0; reps < 3 || spent < min_seconds; ++reps) {
    const auto start = Clock::now();
    y = torch::nn::functional::linear(x, w);
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    best = std::min(best, s);
    spent += s;
  }
  return {shape, shape.flops() / std::max(best, 1e-12) / 1e9};
}

/// One host's probe: the fixed product and the model's, each on one thread.
struct GemmProbe {
  std::string host;
  GemmRate fixed;
  std::vector<GemmRate> shapes;
  bool cached = false;  ///< read from the run directory (an earlier start on this host)
  /// The rate a thread reaches at the model's products: the best of them (the fixed one without any).
  double peak_gflops_per_thread() const {
    double peak = shapes.empty() ? fixed.gflops : 0;
    for (const auto& r : shapes) peak = std::max(peak, r.gflops);
    return peak;
  }
};

inline nlohmann::ordered_json gemm_rate_json(const GemmRate& r) {
  return {{"name", r.shape.name}, {"rows", r.shape.rows}, {"inner", r.shape.inner}, {"cols", r.shape.cols}, {"gflops_per_thread", r.gflops}};
}
inline nlohmann::ordered_json gemm_probe_json(const GemmProbe& p) {
  nlohmann::ordered_json js;
  js["host"] = p.host;
  js["threads"] = 1;
  js["peak_gflops_per_thread"] = p.peak_gflops_per_thread();
  js["fixed"] = gemm_rate_json(p.fixed);
  js["shapes"] = nlohmann::ordered_json::array();
  for (const auto& r : p.shapes) js["shapes"].push_back(gemm_rate_json(r));
  return js;
}

/// This host's cached probe if it measured the same products; nullopt otherwise (absent, unreadable,
/// another model or batch).
inline std::optional<GemmProbe> read_gemm_probe(const std::filesystem::path& path, const std::vector<GemmShape>& shapes) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  try {
    const auto js = nlohmann::json::parse(in);
    auto rate = [](const nlohmann::json& j) {
      return GemmRate{
          {j.at("name").get<std::string>(), j.at("rows").get<std::int64_t>(), j.at("inner").get<std::int64_t>(), j.at("cols").get<std::int64_t>()},
          j.at("gflops_per_thread").get<double>()};
    };
    GemmProbe p{js.at("host").get<std::string>(), rate(js.at("fixed")), {}, true};
    for (const auto& j : js.at("shapes")) p.shapes.push_back(rate(j));
    if (p.shapes.size() != shapes.size()) return std::nullopt;
    for (std::size_t i = 0; i < shapes.size(); ++i)
      if (!p.shapes[i].shape.same_size(shapes[i]) || !(p.shapes[i].gflops > 0)) return std::nullopt;
    return p;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

inline std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

/// The cache of `host`'s probe in the run directory.
inline std::filesystem::path gemm_probe_path(const std::filesystem::path& out_dir, const std::string& host) {
  return out_dir / ("gemm_probe_" + host + ".json");
}

/// This host's probe: read from the run directory, or measured on one thread and written there
/// (atomically; a failed write only warns: the next start measures again).
inline GemmProbe probe_this_host(const std::filesystem::path& out_dir, const std::vector<GemmShape>& shapes) {
  const std::string host = host_name();
  const auto path = gemm_probe_path(out_dir, host);
  if (auto cached = read_gemm_probe(path, shapes)) return *cached;
  GemmProbe p{host, {}, {}, false};
  {
    const OneComputeThread one;
    p.fixed = time_linear(kFixedProbeShape);
    for (const auto& s : shapes) p.shapes.push_back(time_linear(s));
  }
  try {
    fsdp::write_file_atomically(path, gemm_probe_json(p).dump(2) + "\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-train: warning: cannot keep the GEMM probe: %s\n", e.what());
  }
  return p;
}

/// The run's peak: every host's probe (its first rank measures while the others on the node wait
/// without spinning, so that no rank takes a core from it) and the model FLOP/s all ranks could reach
/// together (per-thread peak x threads, summed over ranks). Collective.
struct RunPeak {
  GemmProbe probe;  ///< this host's, on the node's first rank (world rank 0 among them); empty on the others
  double flops_per_s = 0;
};

inline RunPeak probe_run_peak(MpiComm& world, const std::filesystem::path& out_dir, const std::vector<GemmShape>& shapes, int threads) {
  RunPeak peak;
  MpiComm node = world.split_node();
  node.set_waiting_yields_cpu(true);
  std::optional<std::string> failed;
  if (node.rank() == 0) {
    try {
      peak.probe = probe_this_host(out_dir, shapes);
    } catch (const std::exception& e) {
      failed = e.what();
    }
  }
  std::int32_t done = 1;  // the node's other ranks wait here, yielding their cores
  node.all_reduce(&done, &done, 1, fsdp::DType::kInt32, fsdp::ReduceOp::kMax);
  on_all_ranks(world, [&] {
    if (failed) throw std::runtime_error("the GEMM probe failed: " + *failed);
  });
  double gflops = peak.probe.peak_gflops_per_thread();
  node.broadcast(&gflops, 1, fsdp::DType::kFloat64, 0);
  double total = gflops * 1e9 * threads;
  world.all_reduce(&total, &total, 1, fsdp::DType::kFloat64, fsdp::ReduceOp::kSum);
  peak.flops_per_s = total;
  return peak;
}

/// The model FLOP utilization's two terms for a run: training FLOPs per sample and the peak FLOP/s of
/// all ranks together.
struct Utilization {
  double flops_per_sample = 0;
  RunPeak peak;
  /// Achieved model FLOP/s at `samples_per_s` (all ranks) over the peak; nullopt without either.
  std::optional<double> at(double samples_per_s) const {
    if (!(flops_per_sample > 0) || !(peak.flops_per_s > 0)) return std::nullopt;
    return flops_per_sample * samples_per_s / peak.flops_per_s;
  }
};

/// The probe at the products of the run's micro-batch (model.context tokens per sample for a language
/// model) and the model's FLOPs per sample; on a GPU (`on_cpu` false) none: the CPU's rate is not its
/// peak. Collective.
inline Utilization measure_utilization(MpiComm& world, const RunConfig& cfg, std::int64_t num_params, bool on_cpu) {
  Utilization u;
  const auto& family = model_family(cfg.model.kind);
  u.flops_per_sample = family.flops_per_sample(cfg.model, num_params);
  if (!on_cpu) return u;
  const std::int64_t rows = cfg.data.batch_size * (family.language_model() ? cfg.model.context : 1);
  u.peak = probe_run_peak(world, cfg.run.out_dir, model_gemm_shapes(family.describe(cfg.model), rows), cfg.run.threads);
  if (world.rank() == 0 && cfg.log.progress != ProgressMode::kNone) {
    const auto& p = u.peak.probe;
    std::printf(
        "GEMM probe (%s %s): %.1f GFLOP/s per thread at the model's products, %.1f at 512x512x512; the run's peak %.1f GFLOP/s "
        "(%d rank(s) x %d thread(s))\n",
        p.cached ? "kept in" : "measured, kept in", gemm_probe_path(cfg.run.out_dir, p.host).filename().c_str(), p.peak_gflops_per_thread(),
        p.fixed.gflops, u.peak.flops_per_s / 1e9, world.size(), cfg.run.threads);
  }
  return u;
}

}  // namespace fsdp::app
