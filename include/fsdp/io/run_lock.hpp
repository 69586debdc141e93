// One run per run directory (io layer, POSIX): a lock file created with O_EXCL that names its holder
// (host, pid, Slurm job id, start time), held with flock where the file system supports it. A second
// run on the same directory is refused naming the holder; a lock left by a process that is gone (same
// host, pid not alive or flock free) or by an earlier incarnation of the same Slurm job (a requeue)
// is taken over. O_EXCL creation is atomic on NFS v3+, Lustre and GPFS, where flock may not be.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

#include "fsdp/errors.hpp"

namespace fsdp {

/// Who holds a run directory.
struct RunLockHolder {
  std::string host;
  long pid = 0;
  std::string job_id;   ///< SLURM_JOB_ID, "" outside Slurm
  std::string restart;  ///< SLURM_RESTART_COUNT: a requeued job runs again under the same id with a higher count
  std::string started;
  bool flocked = false;  ///< the holder also holds flock on the file (so a free flock means it is gone)
  std::string describe() const {
    return "host " + host + ", pid " + std::to_string(pid) + (job_id.empty() ? std::string() : ", Slurm job " + job_id) +
           (started.empty() ? std::string() : ", since " + started);
  }
};

/// The run directory is held by another live run. what(): "[fsdp.run.lock] ...".
class RunLockError : public ConfigError {
 public:
  RunLockError(const std::string& what, RunLockHolder holder) : ConfigError(what, "fsdp.run.lock"), holder_(std::move(holder)) {}
  const RunLockHolder& holder() const noexcept { return holder_; }

 private:
  RunLockHolder holder_;
};

class RunLock {
 public:
  static constexpr const char* kFileName = ".fsdp-run.lock";

  /// This process as a holder (job id from SLURM_JOB_ID).
  static RunLockHolder this_process() {
    RunLockHolder h;
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    h.host = host;
    h.pid = static_cast<long>(::getpid());
    if (const char* job = std::getenv("SLURM_JOB_ID")) h.job_id = job;
    h.restart = std::getenv("SLURM_RESTART_COUNT") ? std::getenv("SLURM_RESTART_COUNT") : "0";
    const std::time_t t = std::time(nullptr);
    std::tm tm{};
    gmtime_r(&t, &tm);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
    h.started = buf;
    return h;
  }

  /// Takes `dir`'s lock for `me` (creating `dir`), taking over a stale one. Throws RunLockError naming
  /// the holder when another live run has it, ConfigError when the lock file cannot be written.
  /// `role` and `key` name the folder in messages ("run directory", "run.out_dir").
  static RunLock acquire(const std::filesystem::path& dir, const RunLockHolder& me = this_process(), const std::string& role = "run directory",
                         const std::string& key = "run.out_dir") {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) throw ConfigError("cannot create " + role + " '" + dir.string() + "': " + ec.message(), "fsdp.run.lock");
    const auto path = dir / kFileName;
    for (int attempt = 0; attempt < 2; ++attempt) {
      const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
      if (fd >= 0) return RunLock(path, fd, me);
      if (errno != EEXIST)
        throw ConfigError("cannot create the lock of " + role + " '" + dir.string() + "' (" + path.filename().string() + "): " + std::strerror(errno),
                          "fsdp.run.lock");
      const auto holder = read_holder(path);
      if (!holder || !is_stale(path, *holder, me)) {
        const RunLockHolder shown = holder.value_or(RunLockHolder{"(unreadable lock file)", 0, "", "", "", false});
        throw RunLockError(role + " '" + dir.string() + "' is in use by another run (" + shown.describe() + "). Use another " + key +
                               ", or wait for that run to end; if it is certainly gone, delete " + path.string(),
                           shown);
      }
      // Stale: removed only if it still names that holder (another run may have taken it over meanwhile).
      if (const auto now = read_holder(path); now && now->host == holder->host && now->pid == holder->pid && now->started == holder->started)
        std::filesystem::remove(path, ec);
    }
    throw ConfigError("cannot take over the stale run lock '" + path.string() + "': another process keeps recreating it", "fsdp.run.lock");
  }

  RunLock(RunLock&& other) noexcept : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)), me_(std::move(other.me_)) {}
  RunLock& operator=(RunLock&&) = delete;
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  /// Releases the lock: the file is removed if it still names this holder.
  ~RunLock() {
    if (fd_ < 0) return;
    if (const auto holder = read_holder(path_); holder && holder->host == me_.host && holder->pid == me_.pid) {
      std::error_code ec;
      std::filesystem::remove(path_, ec);
    }
    ::close(fd_);
  }

  const std::filesystem::path& path() const noexcept { return path_; }

  /// The holder named in a lock file, if it can be read.
  static std::optional<RunLockHolder> read_holder(const std::filesystem::path& path) {
    std::ifstream in(path);
    if (!in) return std::nullopt;
    RunLockHolder h;
    std::string line;
    while (std::getline(in, line)) {
      const auto eq = line.find('=');
      if (eq == std::string::npos) continue;
      const std::string key = line.substr(0, eq), value = line.substr(eq + 1);
      if (key == "host") h.host = value;
      if (key == "pid") h.pid = std::strtol(value.c_str(), nullptr, 10);
      if (key == "job_id") h.job_id = value;
      if (key == "restart") h.restart = value;
      if (key == "started") h.started = value;
      if (key == "flock") h.flocked = value == "1";
    }
    if (h.host.empty() || h.pid <= 0) return std::nullopt;
    return h;
  }

 private:
  RunLock(std::filesystem::path path, int fd, RunLockHolder me) : path_(std::move(path)), fd_(fd), me_(std::move(me)) {
    // Where flock works, a holder that died without removing the file leaves it free.
    me_.flocked = ::flock(fd_, LOCK_EX | LOCK_NB) == 0;
    std::ostringstream text;
    text << "host=" << me_.host << "\npid=" << me_.pid << "\njob_id=" << me_.job_id << "\nrestart=" << me_.restart << "\nstarted=" << me_.started
         << "\nflock=" << (me_.flocked ? 1 : 0) << "\n";
    const std::string s = text.str();
    const bool written = ::write(fd_, s.data(), s.size()) == static_cast<ssize_t>(s.size()) && ::fsync(fd_) == 0;
    if (!written) {
      const std::string why = std::strerror(errno);
      ::close(fd_);
      fd_ = -1;
      std::error_code ec;
      std::filesystem::remove(path_, ec);
      throw ConfigError("cannot write the run lock '" + path_.string() + "': " + why, "fsdp.run.lock");
    }
  }

  // A lock whose holder cannot be running any more: an earlier incarnation of this Slurm job (a
  // requeue: same id, another restart count; two steps of one allocation share the count), or a
  // process of this host that is gone.
  static bool is_stale(const std::filesystem::path& path, const RunLockHolder& holder, const RunLockHolder& me) {
    if (!me.job_id.empty() && holder.job_id == me.job_id && holder.restart != me.restart) return true;
    if (holder.host != me.host) return false;  // another node: its process cannot be checked from here
    if (::kill(static_cast<pid_t>(holder.pid), 0) != 0 && errno == ESRCH) return true;
    // The pid may have been reused: if the holder held the flock, a free flock means it is gone.
    if (!holder.flocked) return false;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    const bool free = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    ::close(fd);
    return free;
  }

  std::filesystem::path path_;
  int fd_ = -1;
  RunLockHolder me_;
};

}  // namespace fsdp
