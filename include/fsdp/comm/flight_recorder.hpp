// A collective flight recorder (comm layer, std + nlohmann-json), as c10d's and torchtitan's: each
// process keeps its last N collectives (the n-th of its communicator, kind, bytes, FSDP unit, step,
// thread, start and end). When a collective deadline fires, a fatal signal arrives or the job ends on
// an error, each rank writes them to <dir>/flight_rank<R>.json; first_disagreement() compares the
// ranks' files and names the first collective at which they part: a rank that never issued it, or
// one that issued another.
//
// A communicator's name is its lineage ("world/split#0"): communicators are created collectively, so
// the k-th split of a communicator has the same name on every member; with the members' world ranks it
// identifies the communicator across ranks.
#pragma once

#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/core/text.hpp"

namespace fsdp {

struct FlightRecord {
  std::uint64_t seq = 0;  ///< the n-th collective of its communicator in this process (from 1)
  int comm = -1;          ///< index into the recorder's communicators
  const char* kind = "";  ///< "all_gather", "all_reduce", ... (a string literal)
  std::int64_t bytes = 0;
  int unit = -1;
  std::int64_t step = 0;
  std::uint64_t thread = 0;
  double start_s = 0, end_s = -1;  ///< seconds since the recorder started; end < 0: not finished
};

/// A communicator as the recorder knows it.
struct FlightComm {
  std::string name;
  std::vector<int> world_ranks;  ///< its members, by world rank
  std::string key() const { return name + "{" + comma_separated(world_ranks) + "}"; }
};

class FlightRecorder {
 public:
  static FlightRecorder& instance() {
    static FlightRecorder r;
    return r;
  }

  /// Keeps the last `capacity` collectives (0: off) and dumps to `dir` as world rank `rank` of
  /// `world_size`.
  void configure(std::size_t capacity, const std::string& dir, int rank, int world_size) {
    std::lock_guard<std::mutex> lock(mutex_);
    ring_.assign(capacity, FlightRecord{});
    next_ = 0;
    dir_ = dir;
    rank_ = rank;
    world_size_ = world_size;
    enabled_ = capacity > 0;
    std::error_code ec;  // a dump of an earlier run in the same folder must not be read as this run's
    if (enabled_ && !dir_.empty()) std::filesystem::remove(dump_path(rank_), ec);
  }
  bool enabled() const noexcept { return enabled_; }
  int rank() const noexcept { return rank_; }

  /// The name of the `n`-th child communicator made from `parent` by `how` ("split", "node"): every
  /// member calls it in the same order, so the names agree.
  std::string child_name(const std::string& parent, const char* how) {
    std::lock_guard<std::mutex> lock(mutex_);
    return parent + "/" + how + "#" + std::to_string(children_[parent + "/" + how]++);
  }

  /// Registers a communicator (idempotent for the same name and members); its index.
  int register_comm(const std::string& name, std::vector<int> world_ranks) {
    std::lock_guard<std::mutex> lock(mutex_);
    FlightComm c{name, std::move(world_ranks)};
    const auto key = c.key();
    if (const auto it = comm_index_.find(key); it != comm_index_.end()) return it->second;
    comms_.push_back(std::move(c));
    return comm_index_[key] = static_cast<int>(comms_.size()) - 1;
  }

  /// Records the start of a collective on communicator `comm`; the ticket for end().
  std::int64_t begin(int comm, const char* kind, std::int64_t bytes, int unit, std::int64_t step) {
    if (!enabled_ || comm < 0) return -1;
    std::lock_guard<std::mutex> lock(mutex_);
    FlightRecord r;
    r.seq = ++seq_[comm];
    r.comm = comm;
    r.kind = kind;
    r.bytes = bytes;
    r.unit = unit;
    r.step = step;
    r.thread = std::hash<std::thread::id>{}(std::this_thread::get_id());
    r.start_s = now_s();
    const std::int64_t ticket = next_++;
    ring_[static_cast<std::size_t>(ticket) % ring_.size()] = r;
    return ticket;
  }
  /// Records the end of the collective of `ticket` (if it is still in the ring).
  void end(std::int64_t ticket) {
    if (ticket < 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (next_ - ticket > static_cast<std::int64_t>(ring_.size())) return;
    ring_[static_cast<std::size_t>(ticket) % ring_.size()].end_s = now_s();
  }

  /// RAII: begin() on construction, end() on destruction.
  class Scope {
   public:
    Scope(int comm, const char* kind, std::int64_t bytes, int unit, std::int64_t step)
        : ticket_(instance().begin(comm, kind, bytes, unit, step)), exceptions_(std::uncaught_exceptions()) {}
    /// A collective left by an exception (a deadline, a peer's failure) stays unfinished in the record.
    ~Scope() {
      if (std::uncaught_exceptions() <= exceptions_) instance().end(ticket_);
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    std::int64_t ticket_;
    int exceptions_;
  };

  /// The records, oldest first.
  std::vector<FlightRecord> records() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<FlightRecord> out;
    const std::int64_t first = std::max<std::int64_t>(0, next_ - static_cast<std::int64_t>(ring_.size()));
    for (std::int64_t t = first; t < next_; ++t) out.push_back(ring_[static_cast<std::size_t>(t) % ring_.size()]);
    return out;
  }
  /// The oldest collective that has begun and not ended (still in the ring), with its communicator's key.
  std::optional<std::pair<FlightRecord, std::string>> oldest_unfinished() const {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::int64_t first = std::max<std::int64_t>(0, next_ - static_cast<std::int64_t>(ring_.size()));
    for (std::int64_t t = first; t < next_; ++t) {
      const auto& r = ring_[static_cast<std::size_t>(t) % ring_.size()];
      if (r.end_s < 0) return std::make_pair(r, comms_.at(static_cast<std::size_t>(r.comm)).key());
    }
    return std::nullopt;
  }
  /// Seconds since the recorder started (the clock of start_s and end_s).
  double now() const { return now_s(); }
  std::vector<FlightComm> comms() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return comms_;
  }

  /// This rank's records as JSON: {"rank", "comms": [{"name", "ranks"}], "collectives": [...]}.
  nlohmann::ordered_json to_json() const {
    nlohmann::ordered_json j;
    j["rank"] = rank_;
    j["comms"] = nlohmann::ordered_json::array();
    for (const auto& c : comms()) j["comms"].push_back({{"name", c.name}, {"ranks", c.world_ranks}});
    j["collectives"] = nlohmann::ordered_json::array();
    for (const auto& r : records())
      j["collectives"].push_back({{"seq", r.seq},
                                  {"comm", r.comm},
                                  {"kind", r.kind},
                                  {"bytes", r.bytes},
                                  {"unit", r.unit},
                                  {"step", r.step},
                                  {"thread", r.thread},
                                  {"start_s", r.start_s},
                                  {"end_s", r.end_s < 0 ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(r.end_s)}});
    return j;
  }

  /// The dump's path for world rank `rank`.
  std::filesystem::path dump_path(int rank) const { return std::filesystem::path(dir_) / ("flight_rank" + std::to_string(rank) + ".json"); }

  /// Writes this rank's dump (under a temporary name, then renamed). The path, or nothing when off or
  /// the file cannot be written.
  std::optional<std::filesystem::path> dump() const {
    if (!enabled_ || dir_.empty()) return std::nullopt;
    const auto path = dump_path(rank_);
    // A temporary of this thread's own: a SIGTERM dump and a deadline's may run at once; the last rename wins.
    const auto tmp = path.string() + ".tmp" + std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id()));
    std::error_code ec;
    {
      std::ofstream out(tmp);
      out << to_json().dump(1) << "\n";
      out.close();
      if (!out) {  // a full disk: no partial temporary stays behind
        std::filesystem::remove(tmp, ec);
        return std::nullopt;
      }
    }
    std::filesystem::rename(tmp, path, ec);
    if (ec) {
      std::filesystem::remove(tmp, ec);
      return std::nullopt;
    }
    return path;
  }

  /// Dumps, waits up to `wait_s` for the dumps of every world rank, and returns the analysis of those
  /// found (first_disagreement), or a note of what is missing; "" when off.
  std::string dump_and_compare(double wait_s) const;

 private:
  FlightRecorder() : t0_(std::chrono::steady_clock::now()) {}
  double now_s() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count(); }

  mutable std::mutex mutex_;
  std::vector<FlightRecord> ring_;
  std::int64_t next_ = 0;
  std::map<int, std::uint64_t> seq_;
  std::vector<FlightComm> comms_;
  std::map<std::string, int> comm_index_;
  std::map<std::string, int> children_;
  std::string dir_;
  int rank_ = 0, world_size_ = 1;
  bool enabled_ = false;
  std::chrono::steady_clock::time_point t0_;
};

/// One rank's dump, read back.
struct FlightDump {
  int rank = 0;
  std::vector<FlightComm> comms;
  struct Entry {
    std::uint64_t seq = 0;
    std::string comm;  ///< FlightComm::key()
    std::string kind;
    std::int64_t bytes = 0, step = 0;
    int unit = -1;
    bool finished = false;
  };
  std::vector<Entry> collectives;
};

inline FlightDump parse_flight_dump(const nlohmann::json& j) {
  FlightDump d;
  d.rank = j.at("rank").get<int>();
  for (const auto& c : j.at("comms")) d.comms.push_back({c.at("name").get<std::string>(), c.at("ranks").get<std::vector<int>>()});
  for (const auto& e : j.at("collectives")) {
    FlightDump::Entry x;
    x.seq = e.at("seq").get<std::uint64_t>();
    x.comm = d.comms.at(e.at("comm").get<std::size_t>()).key();
    x.kind = e.at("kind").get<std::string>();
    x.bytes = e.at("bytes").get<std::int64_t>();
    x.step = e.at("step").get<std::int64_t>();
    x.unit = e.at("unit").get<int>();
    x.finished = !e.at("end_s").is_null();
    d.collectives.push_back(std::move(x));
  }
  return d;
}

namespace detail {
inline std::string describe_entry(const FlightDump::Entry& e) {
  return e.kind + " (" + std::to_string(e.bytes) + " bytes, step " + std::to_string(e.step) +
         (e.unit >= 0 ? ", unit " + std::to_string(e.unit) : "") + (e.finished ? "" : ", not finished") + ")";
}
}  // namespace detail

/// The first collective at which the ranks' dumps disagree, as a sentence; "" when they agree. For
/// each communicator, over the sequence numbers every member's ring still holds: a member that never
/// issued a collective another member did (its last one there named), or members that issued
/// different collectives (kind or size) as the same one.
inline std::string first_disagreement(const std::vector<FlightDump>& dumps) {
  struct Seen {
    std::map<std::uint64_t, FlightDump::Entry> by_seq;
    std::uint64_t first = 0, last = 0;
  };
  std::map<std::string, std::map<int, Seen>> comms;  // comm key -> rank -> its entries
  std::map<std::string, std::vector<int>> members;
  for (const auto& d : dumps) {
    for (const auto& c : d.comms) members[c.key()] = c.world_ranks;
    for (const auto& e : d.collectives) {
      auto& s = comms[e.comm][d.rank];
      if (s.by_seq.empty() || e.seq < s.first) s.first = e.seq;
      s.last = std::max(s.last, e.seq);
      s.by_seq[e.seq] = e;
    }
  }
  std::set<int> dumped;
  for (const auto& d : dumps) dumped.insert(d.rank);
  std::string best;
  std::uint64_t best_seq = 0;
  for (const auto& [key, by_rank] : comms) {
    std::uint64_t from = 1, to = 0;
    std::vector<int> ranks;
    for (int r : members[key])
      if (dumped.count(r)) ranks.push_back(r);
    for (int r : ranks) {
      const auto it = by_rank.find(r);
      if (it != by_rank.end()) {
        from = std::max(from, it->second.first);
        to = std::max(to, it->second.last);
      }
    }
    for (std::uint64_t seq = from; seq <= to; ++seq) {
      std::map<std::string, std::vector<int>> issued;  // description -> ranks
      std::vector<int> missing;
      const FlightDump::Entry* any = nullptr;
      for (int r : ranks) {
        const auto it = by_rank.find(r);
        if (it == by_rank.end() || !it->second.by_seq.count(seq)) {
          missing.push_back(r);
          continue;
        }
        const auto& entry = it->second.by_seq.at(seq);
        any = &entry;
        issued[entry.kind + " of " + std::to_string(entry.bytes) + " bytes"].push_back(r);
      }
      if (missing.empty() && issued.size() <= 1) continue;
      std::string text = "flight recorder: collective #" + std::to_string(seq) + " of communicator " + key + ": ";
      if (issued.size() > 1) {
        bool first = true;
        for (const auto& [what, rs] : issued) {
          text += (first ? "" : " while ") + std::string("rank(s) ") + comma_separated(rs) + " issued " + what;
          first = false;
        }
        text += " (different collectives at the same place)";
      } else {
        text += "rank(s) " + comma_separated(issued.begin()->second) + " issued " + detail::describe_entry(*any) + "; rank(s) " +
                comma_separated(missing) + " never did";
        for (int r : missing) {
          const auto it = by_rank.find(r);
          if (it != by_rank.end() && !it->second.by_seq.empty()) {
            const auto& last = it->second.by_seq.rbegin()->second;
            text += " (rank " + std::to_string(r) + "'s last there: #" + std::to_string(last.seq) + " " + detail::describe_entry(last) + ")";
          }
          // Where that rank is instead: its collectives not finished, on any communicator.
          for (const auto& d : dumps)
            if (d.rank == r)
              for (const auto& e : d.collectives)
                if (!e.finished)
                  text += "; rank " + std::to_string(r) + " waits in #" + std::to_string(e.seq) + " of " + e.comm + ": " + detail::describe_entry(e);
        }
      }
      if (best.empty() || seq < best_seq) {
        best = text;
        best_seq = seq;
      }
      break;
    }
  }
  return best;
}

inline std::string FlightRecorder::dump_and_compare(double wait_s) const {
  const int world_size = world_size_;
  const auto mine = dump();
  if (!mine) return "";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
  std::vector<int> absent;
  for (;;) {
    absent.clear();
    for (int r = 0; r < world_size; ++r)
      if (!std::filesystem::exists(dump_path(r))) absent.push_back(r);
    if (absent.empty() || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::vector<FlightDump> dumps;
  for (int r = 0; r < world_size; ++r) {
    try {
      std::ifstream in(dump_path(r));
      if (in) dumps.push_back(parse_flight_dump(nlohmann::json::parse(in)));
    } catch (const std::exception&) {  // a rank's dump half written: left out
    }
  }
  std::string text = first_disagreement(dumps);
  if (text.empty()) text = "flight recorder: the " + std::to_string(dumps.size()) + " dump(s) found agree";
  if (!absent.empty()) text += " (no dump from " + std::to_string(absent.size()) + " rank(s), e.g. rank " + std::to_string(absent.front()) + ")";
  return text + "; dumps in " + dir_;
}

}  // namespace fsdp
