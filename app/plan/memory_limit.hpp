// The memory a node's ranks may use (app layer, std only): the cgroup limit of this process (v2
// memory.max or v1 memory.limit_in_bytes, walking up its cgroup path; under Slurm the job step's
// cgroup holds every task of the node), Slurm's --mem (SLURM_MEM_PER_NODE) and --mem-per-cpu
// (SLURM_MEM_PER_CPU x SLURM_CPUS_ON_NODE), and the kernel's MemAvailable. fsdp-train compares a run's
// predicted peak with the smallest of them before it builds anything.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace fsdp::app {

/// One limit on the memory of this node's ranks together.
struct MemoryLimit {
  std::int64_t bytes = 0;
  std::string source;  ///< "cgroup v2 /sys/fs/cgroup/job_1/memory.max", "SLURM_MEM_PER_NODE=4096", "MemAvailable"
};

/// Where the probe looks; tests point it at a fake tree and environment.
struct MemoryProbe {
  std::filesystem::path proc = "/proc";
  std::filesystem::path cgroup = "/sys/fs/cgroup";
  std::function<const char*(const char*)> env = [](const char* name) { return std::getenv(name); };
};

namespace detail {

/// The first whitespace-separated word of a file, if it can be read.
inline std::optional<std::string> first_word(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::string word;
  if (in >> word) return word;
  return std::nullopt;
}

/// A limit of this many bytes or more is none (cgroups write 2^63 rounded to pages; bytes from MiB past
/// it would overflow).
inline constexpr std::int64_t kNoLimitBytes = std::int64_t{1} << 60;

/// The smallest limit in `file` of `dir` and its parents up to `root` ("max" and values from
/// kNoLimitBytes up mean none).
inline std::optional<MemoryLimit> cgroup_limit(const std::filesystem::path& root, std::filesystem::path relative, const std::string& file,
                                               const std::string& version) {
  std::optional<MemoryLimit> best;
  for (;;) {
    const auto p = root / relative / file;
    if (const auto w = first_word(p); w && *w != "max") {
      try {
        const long long v = std::stoll(*w);
        if (v > 0 && v < kNoLimitBytes && (!best || v < best->bytes)) best = MemoryLimit{v, "cgroup " + version + " limit " + p.string()};
      } catch (const std::exception&) {}
    }
    if (relative.empty() || relative == "/" || relative == ".") break;
    relative = relative.parent_path();
    if (relative == "/") relative.clear();
  }
  return best;
}

inline std::optional<std::int64_t> env_int(const MemoryProbe& probe, const char* name) {
  const char* v = probe.env(name);
  if (!v || !*v) return std::nullopt;
  try {
    std::size_t used = 0;
    const long long x = std::stoll(v, &used);
    if (used != std::string(v).size() || x <= 0) return std::nullopt;
    return x;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace detail

/// Every limit found for this node; empty when none is known.
inline std::vector<MemoryLimit> memory_limits(const MemoryProbe& probe = {}) {
  std::vector<MemoryLimit> out;
  // cgroups: "0::/path" (v2), "N:memory:/path" or "N:...,memory,...:/path" (v1).
  std::ifstream cg(probe.proc / "self" / "cgroup");
  for (std::string line; std::getline(cg, line);) {
    const auto a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    std::filesystem::path path = line.substr(b + 1);
    const auto rel = path.relative_path();
    std::optional<MemoryLimit> limit;
    if (line.rfind("0::", 0) == 0) {
      limit = detail::cgroup_limit(probe.cgroup, rel, "memory.max", "v2");
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      // Inside a cgroup namespace the process's own cgroup is the mount's root.
      limit = detail::cgroup_limit(probe.cgroup / "memory", rel, "memory.limit_in_bytes", "v1");
      if (!limit) limit = detail::cgroup_limit(probe.cgroup / "memory", {}, "memory.limit_in_bytes", "v1");
    }
    if (limit) out.push_back(*limit);
  }
  // Slurm: --mem is MiB per node; --mem-per-cpu MiB per allocated CPU of the node; from
  // kNoLimitBytes up no limit, as for cgroups.
  constexpr std::int64_t kNoLimitMib = detail::kNoLimitBytes >> 20;
  if (const auto mem = detail::env_int(probe, "SLURM_MEM_PER_NODE"); mem && *mem < kNoLimitMib)
    out.push_back({*mem << 20, "Slurm --mem (SLURM_MEM_PER_NODE=" + std::to_string(*mem) + " MiB)"});
  if (const auto per_cpu = detail::env_int(probe, "SLURM_MEM_PER_CPU")) {
    const auto cpus = detail::env_int(probe, "SLURM_CPUS_ON_NODE").value_or(1);
    if (*per_cpu < kNoLimitMib / cpus)
      out.push_back({(*per_cpu * cpus) << 20,
                     "Slurm --mem-per-cpu (SLURM_MEM_PER_CPU=" + std::to_string(*per_cpu) + " MiB x " + std::to_string(cpus) + " CPUs on the node)"});
  }
  std::ifstream meminfo(probe.proc / "meminfo");
  for (std::string line; std::getline(meminfo, line);)
    if (line.rfind("MemAvailable:", 0) == 0) {
      std::istringstream in(line.substr(13));
      long long kib = 0;
      if (in >> kib && kib > 0) out.push_back({static_cast<std::int64_t>(kib) << 10, "MemAvailable of the node (/proc/meminfo)"});
    }
  return out;
}

/// The smallest of `limits`, if any.
inline std::optional<MemoryLimit> tightest(const std::vector<MemoryLimit>& limits) {
  std::optional<MemoryLimit> best;
  for (const auto& l : limits)
    if (!best || l.bytes < best->bytes) best = l;
  return best;
}

}  // namespace fsdp::app
