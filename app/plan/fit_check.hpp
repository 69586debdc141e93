// Will a run fit? (app layer, std only): fsdp-train asks fsdp-plan's model of the deck for the peak
// memory per rank before it builds anything, multiplies by the ranks on the node and compares with
// the node's tightest limit (memory_limit.hpp). A run that does not fit is told what would: another
// strategy, a smaller batch, more nodes or fewer ranks per node, each checked with the same model.
#pragma once

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "deck.hpp"
#include "plan/largest_fitting.hpp"
#include "plan/memory_limit.hpp"
#include "plan/run_shape.hpp"
#include "plan/simulate.hpp"
#include "run_config.hpp"

namespace fsdp::app {

struct FitVerdict {
  std::int64_t per_rank = 0;  ///< predicted peak RSS of one rank (bytes)
  std::int64_t per_node = 0;  ///< times the ranks on this node
  std::string phase;          ///< where the peak is: construction, training step, evaluation
  std::optional<MemoryLimit> limit;
  bool fits = true;                      ///< unknown limits fit
  std::vector<std::string> suggestions;  ///< what would fit, when it does not
};

namespace detail {
inline std::string mib_text(std::int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0f MiB", static_cast<double>(bytes) / 1048576.0);
  return buf;
}
}  // namespace detail

/// The predicted peak of `cfg` (resolved for its placement) against `limits`. Suggestions are
/// computed only when it does not fit.
inline FitVerdict check_memory_fit(const Deck& deck, const RunConfig& cfg, const std::vector<MemoryLimit>& limits) {
  FitVerdict v;
  const ModelSection& model = cfg.model;
  const DataFootprint data = data_footprint(cfg);
  const int rpn = cfg.placement.ranks_per_node;
  const Prediction p = predict(model, run_shape(cfg, cfg.fsdp.sharding_strategy, data));
  v.per_rank = p.total_bytes;
  v.per_node = p.total_bytes * rpn;
  v.phase = p.peak_phase;
  v.limit = tightest(limits);
  if (!v.limit || v.per_node <= v.limit->bytes) return v;
  v.fits = false;
  const std::int64_t budget = v.limit->bytes;
  for (auto s : fsdp::kShardingStrategies) {
    if (s == cfg.fsdp.sharding_strategy) continue;
    try {
      const auto q = predict(model, run_shape(cfg, s, data));
      if (q.total_bytes * rpn <= budget)
        v.suggestions.push_back("fsdp.sharding_strategy = \"" + std::string(to_string(s)) + "\" (" + detail::mib_text(q.total_bytes) + " per rank)");
    } catch (const std::exception&) {  // not possible at this placement
    }
  }
  const RunShape run = run_shape(cfg, cfg.fsdp.sharding_strategy, data);
  if (run.batch > 1) {
    const auto batch = largest_fitting(1, run.batch - 1, [&](std::int64_t b) {
      RunShape x = run;
      x.batch = b;
      return predict(model, x).total_bytes * rpn <= budget;
    });
    if (batch > 0) v.suggestions.push_back("data.batch_size = " + std::to_string(batch) + " (with data.global_batch_size to keep the global batch)");
  }
  if (run.test_batch > 1) {
    const auto test_batch = largest_fitting(1, run.test_batch - 1, [&](std::int64_t b) {
      RunShape x = run;
      x.test_batch = b;
      return predict(model, x).total_bytes * rpn <= budget;
    });
    if (test_batch > 0) v.suggestions.push_back("data.test_batch_size = " + std::to_string(test_batch));
  }
  if (run.batch > 1 && run.test_batch > 1) {  // both smaller, when neither alone is enough
    const auto both = largest_fitting(1, std::max(run.batch, run.test_batch) - 1, [&](std::int64_t b) {
      RunShape x = run;
      x.batch = std::min(run.batch, b);
      x.test_batch = std::min(run.test_batch, b);
      return predict(model, x).total_bytes * rpn <= budget;
    });
    if (both > 0 && v.suggestions.empty()) v.suggestions.push_back("data.batch_size and data.test_batch_size at most " + std::to_string(both));
  }
  // More nodes (the same ranks per node), or fewer ranks on each node.
  auto placed = [&](int nodes, int ranks_per_node) -> std::optional<std::int64_t> {
    Placement pl = cfg.placement;
    pl.nodes = nodes;
    pl.ranks_per_node = ranks_per_node;
    pl.world_size = nodes * ranks_per_node;
    try {
      const RunConfig c = resolve_run_config(deck, pl);
      return predict(model, run_shape(c, c.fsdp.sharding_strategy, data_footprint(c))).total_bytes;
    } catch (const std::exception&) {
      return std::nullopt;
    }
  };
  const int nodes = cfg.placement.nodes;
  for (int n = nodes + 1; n <= nodes * 16 && n <= nodes + 64; ++n)
    if (const auto per_rank = placed(n, rpn); per_rank && *per_rank * rpn <= budget) {
      v.suggestions.push_back(std::to_string(n) + " nodes of " + std::to_string(rpn) + " ranks (" + detail::mib_text(*per_rank) + " per rank)");
      break;
    }
  for (int r = rpn - 1; r >= 1; --r)
    if (const auto per_rank = placed(nodes, r); per_rank && *per_rank * r <= budget) {
      v.suggestions.push_back(std::to_string(r) + " ranks per node on " + std::to_string(nodes) + " node(s) (" + detail::mib_text(*per_rank) +
                              " per rank)");
      break;
    }
  return v;
}

/// One line for the echo: "predicted peak 812 MiB per rank x 2 ranks = 1624 MiB on this node; limit
/// 23710 MiB (MemAvailable ...)".
inline std::string fit_summary(const FitVerdict& v, int ranks_per_node) {
  return "predicted peak " + detail::mib_text(v.per_rank) + " per rank (" + v.phase + ") x " + std::to_string(ranks_per_node) +
         " rank(s) = " + detail::mib_text(v.per_node) + " on this node; " +
         (v.limit ? "limit " + detail::mib_text(v.limit->bytes) + " (" + v.limit->source + ")" : std::string("no memory limit found"));
}

/// The refusal's text: the prediction, the limit and what would fit.
inline std::string fit_refusal(const FitVerdict& v, int ranks_per_node) {
  std::string text = "the run will not fit in memory: " + fit_summary(v, ranks_per_node) + ". ";
  if (v.suggestions.empty()) {
    text += "Nothing tried fits (other strategies, a smaller data.batch_size, more nodes, fewer ranks per node): use a smaller model";
  } else {
    text += "What would fit: ";
    for (std::size_t i = 0; i < v.suggestions.size(); ++i) text += (i ? "; " : "") + v.suggestions[i];
  }
  return text + ". fsdp-plan DECK --np N shows the whole plan; run.memory_check = \"warn\" runs it anyway";
}

}  // namespace fsdp::app
