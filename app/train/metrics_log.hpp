// fsdp-train (app layer): metrics.csv, one row per logged step (rank 0 writes it).
#pragma once

#include <algorithm>
#include <cctype>
#include <cmath>
#include <optional>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdp/output_file.hpp"
#include "train/dataset.hpp"
#include "train/rank_watch.hpp"
#include "train/timing.hpp"

namespace fsdp::app {

/// The data rows of a CSV log (a row begins with its step) up to `resumed_step`: what a resumed run
/// keeps (a crashed run may have logged past its checkpoint); none for a fresh run.
inline std::vector<std::string> rows_up_to(const std::filesystem::path& path, std::int64_t resumed_step) {
  std::vector<std::string> kept;
  if (resumed_step <= 0) return kept;
  std::ifstream old(path);
  for (std::string line; std::getline(old, line);)
    if (!line.empty() && std::isdigit(static_cast<unsigned char>(line[0])) && std::stoll(line) <= resumed_step) kept.push_back(line);
  return kept;
}

/// The training loss and the evaluation loss metrics.csv logged for `step` (empty where none was):
/// what a rerun of a finished run puts in the summary.json it writes again, since a checkpoint holds
/// neither.
struct LoggedLosses {
  std::optional<double> train, eval;
};
inline LoggedLosses logged_losses_at(const std::filesystem::path& path, std::int64_t step) {
  auto number = [](const std::string& cell) -> std::optional<double> {
    char* end = nullptr;
    const double v = std::strtod(cell.c_str(), &end);
    if (cell.empty() || *end != '\0') return std::nullopt;
    return v;
  };
  LoggedLosses out;
  for (const auto& row : rows_up_to(path, step)) {
    std::vector<std::string> cells;
    std::istringstream in(row);
    for (std::string cell; std::getline(in, cell, ',');) cells.push_back(cell);
    if (cells.size() < 8 || cells[0] != std::to_string(step)) continue;
    if (const auto v = number(cells[2])) out.train = v;  // step,epoch,loss,...: the window's loss
    if (const auto v = number(cells[7])) out.eval = v;   // ...,eval_loss
  }
  return out;
}

/// metrics.csv: step, epoch, loss, lr, samples per second, step ms and elapsed seconds per logged step,
/// the step's breakdown, fp16's loss scale after the step (empty without loss scaling) and the steps
/// skipped since the previous row (non-finite or, under loss scaling, overflowed gradients); the
/// largest resident memory of any rank (MiB), the slowest rank of the window and how long the others
/// waited for it per step (RankWatch); the evaluation's loss (and perplexity for language models) on
/// the row of the step it followed (a row of its own, train columns empty, when that step logged nothing);
/// a language model's tokens per second (samples per second x model.context; empty for images); the
/// window's model FLOP utilization last (empty on a GPU).
class MetricsLog {
 public:
  /// Starts the file at `path`; resuming at `resumed_step` > 0 keeps the rows up to that step (a crashed
  /// run may have logged past it). The file is replaced atomically, then every row is appended and
  /// checked at once (LineAppendFile): a full disk stops the run with an OutputError naming the file,
  /// and the file still ends with a complete row.
  static constexpr long kColumns = 23;
  void open(const std::filesystem::path& path, std::int64_t resumed_step) {
    std::filesystem::create_directories(path.parent_path());
    const auto kept = rows_up_to(path, resumed_step);
    std::ostringstream text;
    text << "step,epoch,loss,lr,samples_per_s,step_ms,elapsed_s,eval_loss,eval_ppl,"
            "forward_ms,backward_ms,optimizer_ms,all_gather_ms,reduce_scatter_ms,all_reduce_ms,minor_faults,loss_scale,skipped_in_window,"
            "rss_mib,slowest_rank,others_waited_ms,tokens_per_s,mfu\n";
    // Rows of a file written before the later columns existed get them empty.
    for (const auto& l : kept)
      text << l << std::string(static_cast<std::size_t>(std::max<long>(0, kColumns - 1 - std::count(l.begin(), l.end(), ','))), ',') << "\n";
    out_.open(path, text.str());
  }
  /// A logged step: the window's loss and rate, and this step's time and its breakdown on rank 0.
  /// `tokens_per_sample` (model.context for a language model, 0 otherwise) gives tokens_per_s.
  void row(std::int64_t step, std::int64_t epoch, double loss, double lr, double rate, double step_ms, double elapsed_s, const StepBreakdown& parts,
           std::optional<double> loss_scale, std::int64_t skipped, const RankReport& ranks, const std::optional<EvalResult>& eval = std::nullopt,
           std::int64_t tokens_per_sample = 0, std::optional<double> mfu = std::nullopt) {
    const bool language_model = tokens_per_sample > 0;
    std::ostringstream r;
    r << step << "," << epoch << "," << loss << "," << lr << "," << rate << "," << step_ms << "," << elapsed_s << ",";
    eval_cells(r, eval, language_model);
    r << "," << parts.forward_ms << "," << parts.backward_ms << "," << parts.optimizer_ms << "," << parts.all_gather_ms << ","
      << parts.reduce_scatter_ms << "," << parts.all_reduce_ms << "," << parts.minor_faults << ",";
    if (loss_scale) r << *loss_scale;
    r << "," << skipped << "," << ranks.max_rss_mib << "," << ranks.slowest_rank << "," << ranks.others_waited_ms << ",";
    if (language_model) r << rate * static_cast<double>(tokens_per_sample);
    r << ",";
    if (mfu) r << *mfu;
    r << "\n";
    out_.append(r.str());
  }
  /// An evaluation after a step that logged no row.
  void eval_row(std::int64_t step, std::int64_t epoch, const EvalResult& eval, bool language_model) {
    std::ostringstream r;
    r << step << "," << epoch << ",,,,,,";
    eval_cells(r, eval, language_model);
    r << ",,,,,,,,,,,,,,\n";
    out_.append(r.str());
  }

 private:
  static void eval_cells(std::ostream& out, const std::optional<EvalResult>& eval, bool language_model) {
    if (eval) {
      out << eval->loss << ",";
      if (language_model) out << std::exp(eval->loss);
    } else {
      out << ",";
    }
  }
  fsdp::LineAppendFile out_;
};

}  // namespace fsdp::app
