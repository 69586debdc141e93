// How NcclComm's ranks find each other and their device (comm layer; CUDA runtime + NCCL, no LibTorch):
// the launcher's node-local rank and the device it picks, and the Slurm bootstrap's id file on a shared
// filesystem (the MPI bootstrap broadcasts the id instead). Include fsdp/comm/nccl_comm.hpp, not this file.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>

#include "fsdp/comm/nccl_calls.hpp"
#include "fsdp/core/device_choice.hpp"
#include "fsdp/core/text.hpp"  // fnv1a64

namespace fsdp {
namespace detail {

/// An integer from the environment; nullopt when unset, CommError when set but not an integer.
inline std::optional<long> env_int(const char* name) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0')
    throw CommError(std::string("environment variable ") + name + "=\"" + s + "\" is not an integer", "fsdp.comm.bootstrap");
  return v;
}

/// The node-local rank the launcher gives this process: SLURM_LOCALID, else OMPI_COMM_WORLD_LOCAL_RANK, else -1.
inline int launcher_local_rank() {
  if (auto v = env_int("SLURM_LOCALID")) return static_cast<int>(*v);
  if (auto v = env_int("OMPI_COMM_WORLD_LOCAL_RANK")) return static_cast<int>(*v);
  return -1;
}

/// The device for a rank (choose_device() on the devices CUDA shows this process), or CommError.
inline int pick_device(int requested, int local_rank) {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  const std::string who = "rank " + std::to_string(process_rank()) + ": ";
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string visible_text = visible ? std::string(", CUDA_VISIBLE_DEVICES=") + visible : std::string();
  if (rc != cudaSuccess || count == 0)
    throw CommError(who + "no CUDA device for NCCL (cudaGetDeviceCount: " +
                    (rc == cudaSuccess ? std::string("0 devices") : std::string(cudaGetErrorName(rc)) + ": " + cudaGetErrorString(rc)) +
                    visible_text + ")");
  try {
    return choose_device(requested, local_rank, count);
  } catch (const ConfigError& e) {
    const std::string text = e.what();  // "[fsdp.config] ...": the id becomes fsdp.comm
    throw CommError(who + text.substr(text.find("] ") + 2) + visible_text);
  }
}

// ---- the id file of the Slurm bootstrap -----------------------------------------------------------
// Format: one text line "fsdp-nccl-id v1 <tag>\n" followed by the NCCL_UNIQUE_ID_BYTES raw bytes.
// The tag names the job, step and task count, so a file left behind by another job is never used.

inline constexpr const char* kIdFileMagic = "fsdp-nccl-id v1 ";

/// The tag of this Slurm job step: "job=<SLURM_JOB_ID> restart=<SLURM_RESTART_COUNT> step=<SLURM_STEP_ID>
/// ntasks=<n>". A requeued job keeps its id and step numbers but not its restart count, so a file left
/// by the job's previous run is never taken for this one.
inline std::string id_file_tag(int ntasks) {
  auto text = [](const char* name, const char* unset) {
    const char* s = std::getenv(name);
    return std::string(s != nullptr && *s != '\0' ? s : unset);
  };
  return "job=" + text("SLURM_JOB_ID", "-") + " restart=" + text("SLURM_RESTART_COUNT", "0") + " step=" + text("SLURM_STEP_ID", "-") +
         " ntasks=" + std::to_string(ntasks);
}

inline std::string errno_text() { return std::strerror(errno); }

/// Writes `id` under `path` atomically: a temporary name in the same folder, fsync, rename.
inline void write_id_file(const std::string& path, const std::string& tag, const ncclUniqueId& id) {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  const std::string tmp = path + ".tmp." + host + "." + std::to_string(static_cast<long>(getpid()));
  const std::string who = "rank " + std::to_string(process_rank()) + ": NCCL id file " + path;
  const std::string header = std::string(kIdFileMagic) + tag + "\n";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw CommError(who + ": cannot create " + tmp + ": " + errno_text(), "fsdp.comm.bootstrap");
  std::string bytes = header;
  bytes.append(id.internal, sizeof id.internal);
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const std::string why = errno_text();
      ::close(fd);
      ::unlink(tmp.c_str());
      throw CommError(who + ": cannot write " + tmp + ": " + why, "fsdp.comm.bootstrap");
    }
    done += static_cast<std::size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw CommError(who + ": cannot sync " + tmp + ": " + why, "fsdp.comm.bootstrap");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw CommError(who + ": cannot rename " + tmp + " to it: " + why, "fsdp.comm.bootstrap");
  }
}

/// Waits up to timeout_s for rank 0's id file with this job's tag and returns the id. A file with
/// another tag (another job's) is ignored; the error says so if nothing better arrives in time.
inline ncclUniqueId read_id_file(const std::string& path, const std::string& tag, double timeout_s) {
  const std::string header = std::string(kIdFileMagic) + tag + "\n";
  const std::size_t expect = header.size() + NCCL_UNIQUE_ID_BYTES;
  const Deadline deadline(timeout_s > 0 ? timeout_s : 1e-9);
  std::string seen;  // the header of a file that is not ours, for the error
  for (;;) {
    if (FILE* f = std::fopen(path.c_str(), "rb")) {
      std::string bytes(expect + 1, '\0');
      const std::size_t got = std::fread(bytes.data(), 1, bytes.size(), f);
      std::fclose(f);
      if (got == expect && bytes.compare(0, header.size(), header) == 0) {
        ncclUniqueId id;
        std::memcpy(id.internal, bytes.data() + header.size(), NCCL_UNIQUE_ID_BYTES);
        return id;
      }
      std::size_t len = std::min<std::size_t>(got, 200);
      const std::size_t eol = bytes.find('\n');
      if (eol != std::string::npos && eol < len) len = eol;
      seen = len > 0 ? bytes.substr(0, len) : std::string("<empty file>");
    }
    if (deadline.passed()) {
      std::string text = "rank " + std::to_string(process_rank()) + ": no NCCL id for this job in " + path + " after " + seconds_text(timeout_s) +
                         " s (expected \"" + header.substr(0, header.size() - 1) + "\"";
      text += seen.empty() ? std::string("; the file never appeared: did rank 0 start, and is the folder on a filesystem every node shares?)")
                           : "; found \"" + seen + "\": a file of another job or a partial write; use a path unique to the job step)";
      throw CommError(text, "fsdp.comm.bootstrap");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

/// FNV-1a of this host's name: the same on every rank of a node.
inline std::int64_t host_hash() {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  return static_cast<std::int64_t>(fnv1a64(host));
}

}  // namespace detail
}  // namespace fsdp
