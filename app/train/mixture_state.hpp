// fsdp-train (app layer): where the training data stands, in the checkpoint and in the run's reports:
// for a mixture (data.sources) one global draw counter and each source's size, epoch and position, for
// one source its size, stored with every checkpoint and checked on resume; the share each source of a
// mixture has given so far.
#pragma once

#include <fsdp/fsdp.hpp>

#include <cctype>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/output_file.hpp"
#include "mixture.hpp"
#include "run_config.hpp"
#include "train/dataset.hpp"
#include "train/metrics_log.hpp"
#include "train/ranks.hpp"

namespace fsdp::app {

/// The draws a mixture has made when a run stands at sample `sample_index` of `epoch`: the epoch's
/// padding (DistributedSampler's repeats at the end of an epoch) draws nothing new.
inline std::int64_t mixture_draws(const Dataset& d, std::int64_t epoch, std::int64_t sample_index) {
  return epoch * d.mixture_size + std::min(sample_index, d.mixture_size);
}

/// TrainState::data's names: "data_path_samples" (one source of files or text), "text_vocabulary" (a
/// text's distinct bytes as one number, Dataset::text_vocabulary); "mixture_draws", "mixture_size",
/// "source_<i>_samples", "source_<i>_epoch", "source_<i>_position" (a mixture).
inline std::string source_counter(std::size_t source, const char* what) { return "source_" + std::to_string(source) + "_" + what; }

/// A checkpoint's data counters at (epoch, sample_index): of a mixture the draws and each source's epoch
/// and position, and the sizes they were counted with (a source that grew or shrank draws other samples
/// even where its position is the same); of one source read from files (token-shards, indexed) its
/// sample count (files added or removed under a glob move every later sample and the epoch's end), and
/// of a text also its characters (one more or fewer renumbers the tokens).
/// Data made or read whole from the deck's keys (images, synthetic tokens) changes only with them, which
/// the deck's comparison covers.
inline void store_data_position(const Dataset& d, std::int64_t epoch, std::int64_t sample_index, fsdp::TrainState& state) {
  if (!d.blend) {
    if (d.streamed || d.text_vocabulary != 0) state.data["data_path_samples"] = d.train_size();
    if (d.text_vocabulary != 0) state.data["text_vocabulary"] = d.text_vocabulary;
    return;
  }
  const std::int64_t draws = mixture_draws(d, epoch, sample_index);
  state.data["mixture_draws"] = draws;
  state.data["mixture_size"] = d.mixture_size;
  const auto positions = d.blend->positions_after(draws);
  for (std::size_t s = 0; s < positions.size(); ++s) {
    state.data[source_counter(s, "samples")] = d.train_sources[s].n;
    state.data[source_counter(s, "epoch")] = positions[s].epoch;
    state.data[source_counter(s, "position")] = positions[s].position;
  }
}

/// What differs between a resumed checkpoint's data counters and where this deck's data stands at the
/// same epoch and sample: other sources, weights or files (a source that grew or shrank). One line per
/// difference, naming the source; empty when they agree or the checkpoint stored none.
inline std::vector<std::string> data_position_changes(const Dataset& d, const RunConfig& cfg, const fsdp::TrainState& resumed) {
  std::vector<std::string> out;
  if (resumed.data.empty()) return out;
  fsdp::TrainState now;
  store_data_position(d, resumed.epoch, resumed.sample_index, now);
  for (const auto& [name, value] : now.data) {
    const auto it = resumed.data.find(name);
    if (it == resumed.data.end() || it->second == value) continue;  // a counter the checkpoint's version did not write: nothing to compare
    std::string what = name;
    if (!d.blend) what = "data.path ('" + cfg.data.path + "') " + name;
    for (std::size_t s = 0; d.blend && s < cfg.data.sources.size(); ++s)
      if (name.rfind(source_counter(s, ""), 0) == 0) what = "data.sources[" + std::to_string(s) + "] ('" + cfg.data.sources[s].path + "') " + name;
    out.push_back(what + ": " + std::to_string(it->second) + " in the checkpoint, " + std::to_string(value) + " with this deck and data");
  }
  for (const auto& [name, value] : resumed.data)
    if (!now.data.count(name)) out.push_back(name + ": " + std::to_string(value) + " in the checkpoint, none with this deck's data");
  return out;
}

/// Resumed data must stand where the checkpoint's did: other sources, weights or files (a source that
/// grew or shrank) would give other samples from here on. Refused on every rank naming each source (any
/// rank that sees a change stops all) unless checkpoint.resume_changed = "allow": then a warning, and
/// the changes are returned for summary.json. Collective.
inline std::vector<std::string> check_data_position(MpiComm& world, const Dataset& d, const RunConfig& cfg, const fsdp::TrainState& resumed) {
  std::vector<std::string> changes;
  std::string list;
  const std::string data = d.blend ? "the mixture of data.sources" : "the training data";
  on_all_ranks(world, [&] {
    changes = data_position_changes(d, cfg, resumed);
    for (const auto& c : changes) list += "\n  " + c;
    if (!changes.empty() && cfg.checkpoint.resume_changed == ResumeChanged::kRefuse)
      throw DeckError(
          data + " does not stand where the checkpoint's stopped (" +
          (d.blend ? "sources, weights or their files changed" : "its files changed: the samples under data.path, or a text's characters") +
          "):" + list + "\ncheckpoint.resume_changed = \"allow\" continues from here with this deck's data");
  });
  if (!changes.empty() && world.rank() == 0)
    std::printf("warning: %s continues from another position (checkpoint.resume_changed = \"allow\"):%s\n", data.c_str(), list.c_str());
  return changes;
}

/// Each source's part of the draws when the run stands at sample `sample_index` of `epoch`.
inline std::vector<SourceShare> mixture_shares(const Dataset& d, const RunConfig& cfg, std::int64_t epoch, std::int64_t sample_index) {
  std::vector<SourceShare> out;
  if (!d.blend) return out;
  const std::int64_t draws = mixture_draws(d, epoch, sample_index);
  const auto positions = d.blend->positions_after(draws);
  for (std::size_t s = 0; s < positions.size(); ++s) {
    const auto& p = positions[s];
    out.push_back({cfg.data.sources[s].path, cfg.data.sources[s].weight, d.blend->share(s),
                   draws > 0 ? static_cast<double>(p.drawn) / static_cast<double>(draws) : 0.0, p.drawn, p.epoch, p.position});
  }
  return out;
}

/// sources.csv, beside metrics.csv for a mixture: one row per source and logged step: the samples it
/// has given, the share asked and the share given, its epoch and position. Rank 0 writes it, as
/// metrics.csv (a resume keeps the rows up to its step; every row is appended and checked at once).
class MixtureLog {
 public:
  void open(const std::filesystem::path& path, std::int64_t resumed_step) {
    std::ostringstream text;
    text << "step,source,path,weight,share,drawn,drawn_share,source_epoch,source_position\n";
    for (const auto& l : rows_up_to(path, resumed_step)) text << l << "\n";
    out_.open(path, text.str());
  }
  void rows(std::int64_t step, const std::vector<SourceShare>& shares) {
    std::ostringstream r;
    r.precision(9);
    for (std::size_t s = 0; s < shares.size(); ++s) {
      const auto& x = shares[s];
      std::string path;  // a CSV field: quoted, quotes doubled
      for (char c : x.path) path += c == '"' ? std::string("\"\"") : std::string(1, c);
      r << step << "," << s << ",\"" << path << "\"," << x.weight << "," << x.share << "," << x.drawn << "," << x.drawn_share << "," << x.epoch << ","
        << x.position << "\n";
    }
    out_.append(r.str());
  }

 private:
  fsdp::LineAppendFile out_;
};

}  // namespace fsdp::app
