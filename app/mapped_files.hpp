// fsdp-train (app layer, std and POSIX only): the input files the run has memory-mapped (token data),
// so that a SIGBUS handler can name the one a fault hit. A mapped file truncated under a running job,
// or whose storage fails, turns a read of it into SIGBUS instead of an error a read could return.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

namespace fsdp::app::mapped_files {

struct Mapping {
  std::atomic<const unsigned char*> begin{nullptr};  ///< set last, cleared first: the handler reads without a lock
  std::size_t bytes = 0;
  char path[1024] = {};
};
inline constexpr std::size_t kMappings = 4096;  // more files than that are mapped but not named
inline Mapping g_mappings[kMappings];
inline std::mutex g_mappings_mutex;

/// A mapping of `bytes` of `path` at `begin` (not named when every slot is taken).
inline void add(const unsigned char* begin, std::size_t bytes, const std::string& path) {
  const std::lock_guard<std::mutex> lock(g_mappings_mutex);
  for (auto& m : g_mappings) {
    if (m.begin.load(std::memory_order_relaxed) != nullptr) continue;
    m.bytes = bytes;
    path.copy(m.path, sizeof m.path - 1);
    m.path[std::min(path.size(), sizeof m.path - 1)] = '\0';
    m.begin.store(begin, std::memory_order_release);
    return;
  }
}

/// The mapping at `begin` is about to be unmapped.
inline void remove(const unsigned char* begin) {
  const std::lock_guard<std::mutex> lock(g_mappings_mutex);
  for (auto& m : g_mappings)
    if (m.begin.load(std::memory_order_relaxed) == begin) m.begin.store(nullptr, std::memory_order_release);
}

/// From a SIGBUS handler (write(2) only): "rank R: SIGBUS reading 'PATH' at byte offset N: ..." when
/// `address` lies in a mapped file; nothing otherwise.
inline void describe_fault(const void* address, int rank) {
  const auto* a = static_cast<const unsigned char*>(address);
  auto put = [](const char* s) {
    std::size_t n = 0;
    while (s[n]) ++n;
    [[maybe_unused]] const auto ignored = ::write(STDERR_FILENO, s, n);
  };
  auto put_number = [&](std::uint64_t v) {
    char digits[24];
    char* p = digits + sizeof digits;
    *--p = '\0';
    do *--p = static_cast<char>('0' + v % 10);
    while ((v /= 10) != 0);
    put(p);
  };
  for (const auto& m : g_mappings) {
    const unsigned char* begin = m.begin.load(std::memory_order_acquire);
    if (begin == nullptr || a < begin || a >= begin + m.bytes) continue;
    put("fsdp-train: rank ");
    put_number(static_cast<std::uint64_t>(rank < 0 ? 0 : rank));
    put(": SIGBUS reading '");
    put(m.path);
    put("' at byte offset ");
    put_number(static_cast<std::uint64_t>(a - begin));
    put(": the file was truncated, or its storage failed, while the job read it (input files must not change during a run)\n");
    return;
  }
}

}  // namespace fsdp::app::mapped_files
