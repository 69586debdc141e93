// Checkpoint names, the `latest` pointer, atomic commit and pruning (io layer, no LibTorch).
// See docs/checkpoint_format.md.
//
// A checkpoint is written under a hidden temporary name, flushed and fsynced, renamed to
// step_<8 digits>.h5, the directory is fsynced, and only then is `latest` replaced (written to a
// temporary file, fsynced, renamed). A crash at any point leaves the previous checkpoint and
// `latest` intact.
#pragma once

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <stdio.h>  // renameat2, RENAME_EXCHANGE (glibc >= 2.28)
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <ctime>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "fsdp/errors.hpp"
#include "fsdp/output_file.hpp"
#include "fsdp/file_tree.hpp"

namespace fsdp {

namespace ckpt {

inline constexpr const char* kFormatName = "fsdp-checkpoint";
/// Per-rank copies of buffers that differ between ranks: /rank_local/<buffer>, (world x bytes) uint8.
inline constexpr const char* kRankLocalGroup = "/rank_local";
inline constexpr std::int64_t kFormatVersion = 1;
inline constexpr const char* kLatestName = "latest";

/// "step_00001234.h5"
inline std::string checkpoint_name(std::int64_t step) {
  if (step < 0) throw ConfigError("checkpoint step must be >= 0, got " + std::to_string(step));
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld.h5", static_cast<long long>(step));
  return buf;
}

/// The step encoded in a checkpoint name, or nothing if `name` is not one.
inline std::optional<std::int64_t> step_of(const std::string& name) {
  if (name.size() < 11 || name.rfind("step_", 0) != 0 || name.substr(name.size() - 3) != ".h5") return std::nullopt;
  const std::string digits = name.substr(5, name.size() - 8);
  if (digits.empty() || digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c); }))
    return std::nullopt;  // more than 18 digits could overflow: not a name fsdp writes
  return std::stoll(digits);
}

/// Name of the per-rank file inside a LOCAL_STATE_DICT checkpoint folder.
inline std::string local_rank_file(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank_%05d.h5", rank);
  return buf;
}

inline std::string errno_text() { return std::strerror(errno); }

/// fsync of a file or directory; a failure is an error (data may not be on disk).
inline void fsync_path(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw CheckpointError("cannot open '" + path.string() + "' to fsync it: " + errno_text());
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // EINVAL: the file system cannot fsync this kind of file (some do not for directories).
  if (rc != 0 && err != EINVAL) throw CheckpointError("fsync of '" + path.string() + "' failed: " + std::strerror(err));
}

/// fsync of every regular file under `dir`, then of `dir` itself.
inline void fsync_tree(const std::filesystem::path& dir) {
  if (std::filesystem::is_directory(dir))
    for (const auto& entry : std::filesystem::directory_iterator(dir))
      if (entry.is_regular_file()) fsync_path(entry.path());
  fsync_path(dir);
}

/// Hidden temporary name under which `name` is written before the commit.
inline std::string temporary_name(const std::string& name) { return "." + name + ".tmp"; }

/// Claims `bytes` of disk for `path` (created or truncated) before a collective write into it:
/// parallel HDF5 cannot fail one rank's write inside a collective call without leaving the others
/// waiting, so a full disk, a quota or a file size limit (ulimit -f) must show here, with a clear
/// error, rather than halfway through. The space is handed back when the writer truncates `path`.
/// File systems without fallocate are checked against their free space and the size limit.
/// `checkpoint` names the save in messages.
inline void reserve_space(const std::filesystem::path& path, std::int64_t bytes, const std::string& checkpoint) {
  auto fail = [&](const std::string& why) {
    std::error_code ignored;
    std::filesystem::remove(path, ignored);
    throw CheckpointError("cannot save checkpoint '" + checkpoint + "': it needs about " + std::to_string((bytes + 1048575) / 1048576) + " MiB and " +
                          why);
  };
  // The size limit first: fallocate past it raises SIGXFSZ, which kills a process that does not ignore it.
  struct rlimit limit {};
  const bool limited = ::getrlimit(RLIMIT_FSIZE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY;
  if (limited && limit.rlim_cur < static_cast<rlim_t>(bytes))
    throw CheckpointError("cannot save checkpoint '" + checkpoint + "': it needs about " + std::to_string((bytes + 1048575) / 1048576) +
                          " MiB and the file size limit (ulimit -f) is " + std::to_string(limit.rlim_cur / 1024) + " KiB");
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw CheckpointError("cannot save checkpoint '" + checkpoint + "': cannot create '" + path.string() + "': " + std::strerror(errno));
  const int rc = ::fallocate(fd, 0, 0, static_cast<off_t>(bytes));
  const int err = rc == 0 ? 0 : errno;
  ::close(fd);
  if (err == 0) return;
  if (err != EOPNOTSUPP && err != ENOSYS) fail(std::string("the file system refused it: ") + std::strerror(err));
  struct statvfs fs {};
  if (::statvfs(path.parent_path().empty() ? "." : path.parent_path().c_str(), &fs) == 0 &&
      static_cast<long double>(fs.f_bavail) * fs.f_frsize < static_cast<long double>(bytes))
    fail("only " + std::to_string(static_cast<long long>(static_cast<long double>(fs.f_bavail) * fs.f_frsize / 1048576)) + " MiB are free");
}

/// Writes `text` to `path` atomically (fsdp::write_file_atomically), as a checkpoint's file: a failure
/// is a CheckpointError.
inline void write_file_atomically(const std::filesystem::path& path, const std::string& text) {
  try {
    fsdp::write_file_atomically(path, text);
  } catch (const OutputError& e) {
    throw CheckpointError(message_without_id(e));
  }
}

/// The checkpoint name `latest` points to, if the pointer exists.
inline std::optional<std::string> read_latest(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(dir / kLatestName, ec)) return std::nullopt;  // a folder reads as an I/O error
  std::ifstream in(dir / kLatestName);
  if (!in) return std::nullopt;
  std::string name;
  std::getline(in, name);
  while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
  if (name.empty()) return std::nullopt;
  return name;
}

/// Committed checkpoints in `dir` (files or LOCAL folders named step_*.h5), newest step first.
inline std::vector<std::pair<std::int64_t, std::string>> list_checkpoints(const std::filesystem::path& dir) {
  std::vector<std::pair<std::int64_t, std::string>> out;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return out;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (const auto step = step_of(name)) out.emplace_back(*step, name);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

/// What the `latest` pointer of a checkpoint folder says.
struct LatestPointer {
  enum class State { kAbsent, kValid, kDamaged };
  State state = State::kAbsent;
  std::string name;     ///< kValid: the checkpoint it names (which exists)
  std::string problem;  ///< kDamaged: what is wrong with it, for messages
};

/// Reads `latest`: absent, valid (names a checkpoint that exists) or damaged (empty, not a checkpoint
/// name, or naming one that does not exist).
inline LatestPointer inspect_latest(const std::filesystem::path& dir) {
  LatestPointer p;
  std::error_code ec;
  if (!std::filesystem::exists(dir / kLatestName, ec)) return p;
  p.state = LatestPointer::State::kDamaged;
  if (!std::filesystem::is_regular_file(dir / kLatestName, ec)) {  // reading a folder throws from the stream
    p.problem = "is not a file";
    return p;
  }
  std::ifstream in(dir / kLatestName);
  if (!in) {
    p.problem = "cannot be read";
    return p;
  }
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  const std::string shown = text.size() > 40 ? text.substr(0, 40) + "..." : text;
  if (text.empty())
    p.problem = "is empty";
  else if (!step_of(text) || text.find('/') != std::string::npos)
    p.problem = "holds '" + shown + "', not a checkpoint name";
  else if (!std::filesystem::exists(dir / text, ec))
    p.problem = "names " + text + ", which does not exist";
  else {
    p.state = LatestPointer::State::kValid;
    p.name = text;
  }
  return p;
}

/// The checkpoint `path` names as users give one: a checkpoint file, a LOCAL_STATE_DICT folder (its
/// rank files), or a folder with `latest` (the checkpoint it names). Anything else is a CheckpointError
/// that says what `path` is instead: missing, a run directory (its checkpoints are in checkpoints/), the
/// `latest` pointer itself, an empty `latest`, or a folder without checkpoints.
inline std::filesystem::path checkpoint_at(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string quoted = "'" + path.string() + "'";
  if (!fs::exists(path, ec)) throw CheckpointError(quoted + " does not exist");
  if (!fs::is_directory(path, ec)) {
    if (path.filename() != kLatestName) return path;
    const auto name = read_latest(path.parent_path().empty() ? fs::path(".") : path.parent_path());
    throw CheckpointError(quoted + " is the pointer file `latest`, not a checkpoint: give its folder '" + path.parent_path().string() + "'" +
                          (name ? " or the checkpoint it names, '" + (path.parent_path() / *name).string() + "'" : std::string()));
  }
  if (fs::exists(path / kLatestName, ec)) {
    const auto latest = inspect_latest(path);
    if (latest.state == LatestPointer::State::kValid) return path / latest.name;
    const auto found = list_checkpoints(path);
    std::string listed;
    for (std::size_t i = 0; i < found.size() && i < 3; ++i) listed += (i ? ", " : "") + found[i].second;
    throw CheckpointError("'" + (path / kLatestName).string() + "' " + latest.problem + ": it names no checkpoint to read" +
                          (found.empty()
                               ? std::string("; the folder holds none either")
                               : "; name one of the checkpoints there instead (newest first: " + listed + (found.size() > 3 ? ", ..." : "") + ")"));
  }
  for (const auto& entry : fs::directory_iterator(path, ec)) {  // a LOCAL_STATE_DICT checkpoint (verify and load name a missing rank)
    const std::string name = entry.path().filename().string();
    if (name.rfind("rank_", 0) == 0 && entry.path().extension() == ".h5") return path;
  }
  if (fs::exists(path / "checkpoints" / kLatestName, ec) || fs::exists(path / "deck.toml", ec))
    throw CheckpointError(quoted + " is a run directory, not a checkpoint; its checkpoints are in '" + (path / "checkpoints").string() + "'");
  const auto found = list_checkpoints(path);
  throw CheckpointError(quoted + " holds no checkpoint to read: no `latest`" +
                        (found.empty() ? std::string(" and no step_*.h5") : ", though it has " + found.front().second + ": name that file"));
}

/// Moves the fully written `dir/.name.tmp` to `dir/name` and points `latest` at it. Rank 0 only.
inline void commit(const std::filesystem::path& dir, const std::string& name) {
  const auto tmp = dir / temporary_name(name);
  const auto final_path = dir / name;
  std::error_code ec;
  if (std::filesystem::is_directory(tmp)) {
    fsync_tree(tmp);
    if (std::filesystem::exists(final_path) && ::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_path.c_str(), RENAME_EXCHANGE) == 0) {
      // Swapped atomically: the new folder is in place, the old one now sits under the temporary name.
      fsdp::remove_tree(tmp, ec);
      ec.clear();
    } else if (std::filesystem::exists(final_path)) {
      // No RENAME_EXCHANGE on this file system: move the old folder aside for the instant of the rename.
      const auto old = dir / ("." + name + ".old");
      fsdp::remove_tree(old, ec);
      std::filesystem::rename(final_path, old, ec);
      if (ec) throw CheckpointError("cannot move '" + final_path.string() + "' aside: " + ec.message());
      std::filesystem::rename(tmp, final_path, ec);
      if (ec) throw CheckpointError("cannot rename '" + tmp.string() + "' to '" + final_path.string() + "': " + ec.message());
      fsdp::remove_tree(old, ec);
    } else {
      std::filesystem::rename(tmp, final_path, ec);
    }
  } else {
    fsync_path(tmp);
    std::filesystem::rename(tmp, final_path, ec);  // atomic, also over an older file of the same name
  }
  if (ec) throw CheckpointError("cannot rename '" + tmp.string() + "' to '" + final_path.string() + "': " + ec.message());
  fsync_path(dir);
  write_file_atomically(dir / kLatestName, name + "\n");
}

/// Committed checkpoints that belong to the run `latest` names, newest first: `latest` itself, then
/// those with a smaller step. Checkpoints with a larger step than `latest` come from an abandoned run
/// (a restart from an older step) or a crash between a commit's rename and its `latest` update; they
/// are neither loaded by resume nor counted or deleted by keep_last. Without a valid `latest` (absent
/// or damaged): all of them.
inline std::vector<std::pair<std::int64_t, std::string>> run_checkpoints(const std::filesystem::path& dir) {
  const auto latest = inspect_latest(dir);
  auto all = list_checkpoints(dir);
  if (latest.state != LatestPointer::State::kValid) return all;
  const auto latest_step = *step_of(latest.name);
  std::vector<std::pair<std::int64_t, std::string>> out{{latest_step, latest.name}};
  for (auto& c : all)
    if (c.first < latest_step) out.push_back(std::move(c));
  return out;
}

/// Where checkpoints of another trajectory are moved so that a run never writes over them.
inline constexpr const char* kSetAsideName = "abandoned";

/// Moves every checkpoint of `dir` with a step above `step` into `dir/abandoned/` (a name taken there
/// already gets the time appended): they belong to a trajectory this run does not continue, and its
/// own saves at those steps must not replace them. Returns the names moved. Rank 0 only.
inline std::vector<std::string> set_aside_checkpoints_after(const std::filesystem::path& dir, std::int64_t step) {
  std::vector<std::string> moved;
  const auto aside = dir / kSetAsideName;
  for (const auto& [s, name] : list_checkpoints(dir)) {
    if (s <= step) continue;
    std::error_code ec;
    std::filesystem::create_directories(aside, ec);
    if (ec) throw CheckpointError("cannot create '" + aside.string() + "' to keep checkpoints of another run: " + ec.message());
    auto target = aside / name;
    if (std::filesystem::exists(target, ec)) target = aside / (name + "." + std::to_string(std::time(nullptr)));
    std::filesystem::rename(dir / name, target, ec);
    if (ec) throw CheckpointError("cannot move '" + (dir / name).string() + "' to '" + target.string() + "': " + ec.message());
    moved.push_back(name);
  }
  if (!moved.empty()) {
    fsync_path(aside);
    fsync_path(dir);
  }
  return moved;
}

/// Deletes all but the newest `keep_last` checkpoints of the run (see run_checkpoints), never the one
/// `latest` names, and never the newest checkpoint that `verifies` (a read of its checksums): when
/// the kept ones all fail it, the newest older one that passes stays too, so that a damaged newest
/// checkpoint never leaves the run without a good one. `verifies` runs only when something would be
/// deleted, newest first, until one passes. keep_last <= 0 keeps everything. Returns the names
/// removed. Rank 0 only.
inline std::vector<std::string> prune(const std::filesystem::path& dir, int keep_last,
                                      const std::function<bool(const std::filesystem::path&)>& verifies = {}) {
  std::vector<std::string> removed;
  if (keep_last <= 0) return removed;
  const auto latest = inspect_latest(dir);
  const auto all = run_checkpoints(dir);
  if (all.size() <= static_cast<std::size_t>(keep_last)) return removed;
  std::optional<std::size_t> newest_good;
  if (verifies)
    for (std::size_t i = 0; i < all.size() && !newest_good; ++i)
      if (verifies(dir / all[i].second)) newest_good = i;
  for (std::size_t i = static_cast<std::size_t>(keep_last); i < all.size(); ++i) {
    if (all[i].second == latest.name || newest_good == i) continue;
    std::error_code ec;
    fsdp::remove_tree(dir / all[i].second, ec);
    if (ec) throw CheckpointError("cannot remove old checkpoint '" + (dir / all[i].second).string() + "': " + ec.message());
    removed.push_back(all[i].second);
  }
  if (!removed.empty()) fsync_path(dir);
  return removed;
}

/// "0x0123456789abcdef"
inline std::string hex64(std::uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

/// Current UTC time as ISO 8601.
inline std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace ckpt
}  // namespace fsdp
