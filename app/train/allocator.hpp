// fsdp-train (app layer): its allocator. run.malloc decides what the allocator the build links
// (app_build.hpp: jemalloc or glibc's malloc) does with freed memory; summary.json reports what it
// runs with.
#pragma once

#include <malloc.h>
#include <sys/types.h>

#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "app_build.hpp"
#include "choices.hpp"
#include "plan/measured.hpp"

namespace fsdp::app {

#if FSDP_TRAIN_LINKS_JEMALLOC
// jemalloc's control interface, declared here: its header redeclares glibc's malloc.h functions.
extern "C" int mallctl(const char* name, void* oldp, std::size_t* oldlenp, void* newp, std::size_t newlen);

/// jemalloc's decay times of every arena, those in use and those made later: how long freed pages stay
/// before they go back to the system (-1: never, 0: at once). False if jemalloc refused one.
inline bool set_jemalloc_decay(long milliseconds) {
  auto ms = static_cast<ssize_t>(milliseconds);
  for (const char* name : {"arenas.dirty_decay_ms", "arenas.muzzy_decay_ms"})
    if (mallctl(name, nullptr, nullptr, &ms, sizeof ms) != 0) return false;
  unsigned arenas = 0;
  std::size_t size = sizeof arenas;
  if (mallctl("arenas.narenas", &arenas, &size, nullptr, 0) != 0) return false;
  for (unsigned i = 0; i < arenas; ++i) {
    for (const char* kind : {"dirty", "muzzy"}) {
      const std::string name = "arena." + std::to_string(i) + "." + kind + "_decay_ms";
      const int rc = mallctl(name.c_str(), nullptr, nullptr, &ms, sizeof ms);
      if (rc != 0 && rc != EFAULT) return false;  // EFAULT: an arena not made yet, which takes the default above
    }
  }
  return true;
}
#endif

/// What the allocator runs with, read back from it (jemalloc: its large-block threshold and the decay
/// times in force for new arenas; glibc: nothing to read), for summary.json.
inline std::vector<std::pair<std::string, std::int64_t>> allocator_settings() {
  std::vector<std::pair<std::string, std::int64_t>> settings;
#if FSDP_TRAIN_LINKS_JEMALLOC
  std::size_t threshold = 0, size = sizeof threshold;
  if (mallctl("opt.oversize_threshold", &threshold, &size, nullptr, 0) == 0)
    settings.emplace_back("oversize_threshold", static_cast<std::int64_t>(threshold));
  for (const char* name : {"arenas.dirty_decay_ms", "arenas.muzzy_decay_ms"}) {
    ssize_t ms = 0;
    size = sizeof ms;
    if (mallctl(name, &ms, &size, nullptr, 0) == 0) settings.emplace_back(std::string(name).substr(7), static_cast<std::int64_t>(ms));
  }
#endif
  return settings;
}

/// run.malloc. "reuse": freed memory stays for the next step, which then touches no new page;
/// "return": freed memory goes back to the system at once (peak RSS follows the live bytes, every
/// large allocation page-faults); "untouched": the allocator as its environment sets it. Under jemalloc
/// (kTrainLinksJemalloc) the decay times say so; under glibc, no block gets its own mapping
/// (M_MMAP_MAX = 0) and the heap is never trimmed, or blocks of 1 MiB or more are mapped and unmapped.
/// False if the allocator refused.
inline bool apply_malloc_policy(MallocPolicy policy) {
#if FSDP_TRAIN_LINKS_JEMALLOC
  switch (policy) {
    case MallocPolicy::kReuse: return set_jemalloc_decay(-1);
    case MallocPolicy::kReturn: return set_jemalloc_decay(0);
    case MallocPolicy::kUntouched: break;
  }
#else
  switch (policy) {
    case MallocPolicy::kReuse: return mallopt(M_MMAP_MAX, 0) == 1 && mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
    case MallocPolicy::kReturn: return mallopt(M_MMAP_THRESHOLD, static_cast<int>(kReturnThresholdBytes)) == 1;
    case MallocPolicy::kUntouched: break;
  }
#endif
  return true;
}

}  // namespace fsdp::app
