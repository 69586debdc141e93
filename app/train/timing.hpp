// fsdp-train (app layer): wall time per phase, resident memory and durations for the log.
#pragma once

#include <fsdp/fsdp.hpp>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace fsdp::app {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

inline double current_rss_mb() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / 1048576.0;
}

/// Adds the time of its scope to `total`; with log.trace on, also records it as a trace event named
/// `name` (a string literal) and samples the resident memory at its end.
struct Timed {
  explicit Timed(double& total, const char* name = nullptr) : total_(total), name_(name), start_(Clock::now()) {}
  ~Timed() {
    const auto end = Clock::now();
    total_ += std::chrono::duration<double>(end - start_).count();
    auto& tracer = fsdp::Tracer::instance();
    if (name_ && tracer.enabled()) {
      tracer.complete(name_, "app", tracer.to_us(start_), tracer.to_us(end));
      tracer.counter("resident memory", {{"MiB", current_rss_mb()}});
    }
  }
  double& total_;
  const char* name_;
  Clock::time_point start_;
};

/// Per-phase wall time on this rank.
struct Phases {
  double data = 0, forward = 0, backward = 0, optimizer = 0, checkpoint = 0, eval = 0;
};

/// Minor page faults of this process so far (a page touched for the first time since it was mapped).
inline long minor_page_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

/// Where one step's time went on this rank: metrics.csv's breakdown columns.
struct StepBreakdown {
  double forward_ms = 0, backward_ms = 0, optimizer_ms = 0;            ///< forward includes the loss; optimizer includes clipping
  double all_gather_ms = 0, reduce_scatter_ms = 0, all_reduce_ms = 0;  ///< inside blocking collectives (within the phases above)
  long minor_faults = 0;
};

inline double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

inline std::string format_duration(double s) {
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%dh%02dm", static_cast<int>(s / 3600), static_cast<int>(std::fmod(s, 3600) / 60));
  else if (s >= 60)
    std::snprintf(buf, sizeof buf, "%dm%02ds", static_cast<int>(s / 60), static_cast<int>(std::fmod(s, 60)));
  else
    std::snprintf(buf, sizeof buf, "%.1fs", s);
  return buf;
}

/// log.trace: writes this rank's timeline (trace_rank<R>.json) and memory samples (memory_rank<R>.csv)
/// into `dir` when it goes out of scope, however the run ends.
struct TraceWriter {
  std::filesystem::path dir;
  int rank;
  ~TraceWriter() {
    auto& tracer = fsdp::Tracer::instance();
    if (!tracer.enabled()) return;
    try {
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      const auto trace = dir / ("trace_rank" + std::to_string(rank) + ".json");
      tracer.write_json(trace.string(), rank);
      std::ostringstream csv;
      csv << "time_s,counter,mib\n";
      for (const auto& e : tracer.events())
        if (e.phase == 'C' && !e.args.empty()) csv << e.start_us / 1e6 << "," << e.name << "," << e.args.front().second << "\n";
      fsdp::write_file_atomically(dir / ("memory_rank" + std::to_string(rank) + ".csv"), csv.str());
      if (rank == 0) std::printf("wrote %s (and one per rank; open them in https://ui.perfetto.dev)\n", trace.c_str());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fsdp-train: warning: cannot write the trace: %s\n", e.what());
    }
  }
};

}  // namespace fsdp::app
