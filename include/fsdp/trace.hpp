// Timeline tracing in the Chrome trace-event format (opens in Perfetto and chrome://tracing).
//
// One Tracer per process records complete events ("X": name, category, start, duration, a few
// integer arguments) and counters ("C": e.g. memory). Off by default: a disabled tracer costs one
// relaxed atomic load per would-be event, so the hooks stay in the hot path. Events are coarse (one
// per unit per phase per step), so a mutex-guarded vector is enough. The JSON is written with
// nlohmann/json (escaping, numbers) only when the trace is saved; recording needs std only.
#pragma once

#if !__has_include(<nlohmann/json.hpp>)
#error "fsdp/trace.hpp needs nlohmann/json (Debian: nlohmann-json3-dev; scripts/deps.sh installs it)"
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <nlohmann/json.hpp>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/errors.hpp"
#include "fsdp/output_file.hpp"

namespace fsdp {

class Tracer {
 public:
  using Clock = std::chrono::steady_clock;

  struct Event {
    std::string name;
    const char* category;  // a string literal
    char phase;            // 'X' complete event, 'C' counter
    std::int64_t start_us;
    std::int64_t duration_us;
    std::uint32_t thread;
    std::vector<std::pair<const char*, double>> args;  // keys are string literals
  };

  static Tracer& instance() {
    static Tracer tracer;
    return tracer;
  }

  bool enabled() const noexcept { return enabled_.load(std::memory_order_relaxed); }
  void enable(bool on = true) noexcept { enabled_.store(on, std::memory_order_relaxed); }

  /// Microseconds since the tracer was created (the process's trace clock).
  std::int64_t now_us() const noexcept { return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - origin_).count(); }

  std::int64_t to_us(Clock::time_point t) const noexcept { return std::chrono::duration_cast<std::chrono::microseconds>(t - origin_).count(); }

  void complete(std::string name, const char* category, std::int64_t start_us, std::int64_t end_us,
                std::vector<std::pair<const char*, double>> args = {}) {
    if (!enabled()) return;
    add({std::move(name), category, 'X', start_us, std::max<std::int64_t>(0, end_us - start_us), thread_index(), std::move(args)});
  }

  void counter(std::string name, std::vector<std::pair<const char*, double>> values) {
    if (!enabled()) return;
    add({std::move(name), "memory", 'C', now_us(), 0, 0, std::move(values)});
  }

  std::size_t size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return events_.size();
  }

  std::vector<Event> events() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return events_;
  }

  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    events_.clear();
  }

  /// Writes {"traceEvents": [...]} with process id `rank` (one trace per rank; Perfetto merges
  /// several files opened together), one event per line. Throws Error when the file cannot be written.
  /// Writes the timeline to `path` (atomically: never a truncated trace); OutputError on failure.
  void write_json(const std::string& path, int rank) const {
    std::ostringstream out;
    out << R"({"displayTimeUnit":"ms","traceEvents":[)" << '\n';
    write_event(out, {{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
    out << ",\n";
    write_event(out, {{"name", "process_sort_index"}, {"ph", "M"}, {"pid", rank}, {"args", {{"sort_index", rank}}}});
    for (const auto& e : events()) {
      Json event = {{"name", e.name}, {"cat", e.category}, {"ph", std::string(1, e.phase)}, {"ts", e.start_us}, {"pid", rank}, {"tid", e.thread}};
      if (e.phase == 'X') event["dur"] = e.duration_us;
      if (!e.args.empty()) {
        Json& args = event["args"];
        for (const auto& [key, value] : e.args) args[key] = number(value);
      }
      out << ",\n";
      write_event(out, event);
    }
    out << "\n]}\n";
    write_file_atomically(path, out.str());
  }

 private:
  Tracer() = default;

  void add(Event e) {
    std::lock_guard<std::mutex> lock(mutex_);
    events_.push_back(std::move(e));
  }

  static std::uint32_t thread_index() {
    static std::atomic<std::uint32_t> next{0};
    thread_local const std::uint32_t mine = next.fetch_add(1);
    return mine;
  }

  using Json = nlohmann::ordered_json;  // keys in the order written: name, cat, ph, ts, ...

  /// One event, compact; a name that is not valid UTF-8 gets U+FFFD rather than failing the write.
  static void write_event(std::ostream& out, const Json& event) { out << event.dump(-1, ' ', false, Json::error_handler_t::replace); }

  /// Whole numbers (bytes, unit indices) as JSON integers, others as doubles; NaN and infinities
  /// become null, as JSON has no spelling for them.
  static Json number(double v) {
    if (std::isfinite(v) && v == std::trunc(v) && std::fabs(v) < 9007199254740992.0) return static_cast<std::int64_t>(v);
    return v;
  }

  std::atomic<bool> enabled_{false};
  Clock::time_point origin_ = Clock::now();
  mutable std::mutex mutex_;
  std::vector<Event> events_;
};

/// Records one complete event from construction to destruction (when tracing is on).
class TraceScope {
 public:
  TraceScope(const char* name, const char* category, std::vector<std::pair<const char*, double>> args = {})
      : name_(name),
        category_(category),
        args_(std::move(args)),
        active_(Tracer::instance().enabled()),
        start_(active_ ? Tracer::instance().now_us() : 0) {}
  TraceScope(std::string name, const char* category, std::vector<std::pair<const char*, double>> args = {})
      : owned_(std::move(name)),
        name_(nullptr),
        category_(category),
        args_(std::move(args)),
        active_(Tracer::instance().enabled()),
        start_(active_ ? Tracer::instance().now_us() : 0) {}
  ~TraceScope() {
    if (!active_) return;
    auto& t = Tracer::instance();
    t.complete(name_ ? std::string(name_) : std::move(owned_), category_, start_, t.now_us(), std::move(args_));
  }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  std::string owned_;
  const char* name_;
  const char* category_;
  std::vector<std::pair<const char*, double>> args_;
  bool active_;
  std::int64_t start_;
};

}  // namespace fsdp
