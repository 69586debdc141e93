// Host-to-host copies of a checkpoint's state (io layer): split over threads while training waits for
// them (copy_all), or carried out beside training by whichever thread asks for work (BackgroundCopy).
// Both are bound by memory bandwidth, which one thread does not fill.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#ifdef __linux__
#include <sched.h>
#endif

namespace fsdp::detail {

/// The CPUs this process may run on (its affinity mask where the system says, else every core).
inline int allowed_cpus() {
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

/// The threads a capture copies with: the training's own (idle while it waits for the copy) and the
/// core the asynchronous writer runs on, within the CPUs this process may use.
inline int default_copy_threads() { return std::max(1, std::min(at::get_num_threads() + 1, allowed_cpus())); }

/// Below a few MiB a thread (or a chunk taken by another thread) costs more than it saves.
inline constexpr std::size_t kMinCopyBytesPerThread = std::size_t{4} << 20;

/// Host (destination, source) pairs of one dtype, contiguous and of equal size, as bytes laid end to
/// end, so that any byte range of them can be copied with memcpy.
class HostCopyPlan {
 public:
  /// Adds the pair when it is such a host pair; false (nothing added) otherwise.
  bool add(const torch::Tensor& dst, const torch::Tensor& src) {
    if (!dst.is_cpu() || !src.is_cpu() || dst.scalar_type() != src.scalar_type() || dst.numel() != src.numel() || !dst.is_contiguous() ||
        !src.is_contiguous())
      return false;
    const auto bytes = static_cast<std::size_t>(src.numel()) * src.element_size();
    pieces_.push_back({static_cast<char*>(dst.data_ptr()), static_cast<const char*>(src.data_ptr()), bytes});
    total_ += bytes;
    return true;
  }
  std::size_t bytes() const noexcept { return total_; }
  /// Copies the bytes [begin, end) of the pairs laid end to end. Any thread; disjoint ranges at once.
  void copy_range(std::size_t begin, std::size_t end) const noexcept {
    std::size_t at = 0;
    for (const auto& p : pieces_) {
      const std::size_t lo = std::max(begin, at), hi = std::min(end, at + p.bytes);
      if (lo < hi) std::memcpy(p.dst + (lo - at), p.src + (lo - at), hi - lo);
      at += p.bytes;
      if (at >= end) break;
    }
  }

 private:
  struct Piece {
    char* dst;
    const char* src;
    std::size_t bytes;
  };
  std::vector<Piece> pieces_;
  std::size_t total_ = 0;
};

/// Runs work(0) on this thread and work(1) .. work(threads - 1) on as many helper threads, and returns
/// once all have ended; a helper that cannot be started is run here.
template <class Work>
void run_on_threads(int threads, Work&& work) {
  std::vector<std::thread> helpers;
  helpers.reserve(static_cast<std::size_t>(std::max(threads, 1)));  // no allocation (and throw) once threads run
  for (int t = 1; t < threads; ++t) {
    try {
      helpers.emplace_back([&work, t] { work(t); });
    } catch (...) {  // no thread (or no memory for one) to be had
      work(t);
    }
  }
  work(0);
  for (auto& h : helpers) h.join();
}

/// Copies each (destination, source) pair: host pairs with memcpy, their bytes split evenly over
/// `threads` threads (this one and threads - 1 helpers, each given at least `min_bytes_per_thread`);
/// any other pair (a GPU source, say) is copied by LibTorch on this thread first.
inline void copy_all(const std::vector<std::pair<torch::Tensor, torch::Tensor>>& copies, int threads,
                     std::size_t min_bytes_per_thread = kMinCopyBytesPerThread) {
  HostCopyPlan plan;
  for (const auto& [dst, src] : copies)
    if (src.defined() && src.numel() > 0 && !plan.add(dst, src)) torch::Tensor(dst).copy_(src);
  const std::size_t total = plan.bytes();
  threads = static_cast<int>(
      std::clamp<std::size_t>(total / std::max<std::size_t>(min_bytes_per_thread, 1), 1, static_cast<std::size_t>(std::max(threads, 1))));
  run_on_threads(threads, [&](int t) { plan.copy_range(total * t / threads, total * (t + 1) / threads); });
}

/// A host copy carried out beside training, in chunks: the asynchronous writer copies in the background
/// (help()) and the training thread, before it changes a source, takes the chunks still left, with
/// helpers, and waits for the rest (finish()). It holds the sources until the copy ends, so their
/// memory outlives it whatever their owner frees meanwhile. It also notes whether a source was written
/// in place before the copy ended: best effort, from LibTorch's version counters, which in-place
/// operations bump once they are done and writes through .data() or data pointers do not.
class BackgroundCopy {
 public:
  BackgroundCopy(HostCopyPlan plan, std::vector<torch::Tensor> sources, std::size_t chunk_bytes = kMinCopyBytesPerThread)
      : plan_(std::move(plan)),
        sources_(std::move(sources)),
        chunk_bytes_(std::max<std::size_t>(chunk_bytes, 1)),
        chunks_((plan_.bytes() + chunk_bytes_ - 1) / chunk_bytes_) {
    for (const auto& s : sources_)
      if (!s.is_inference()) versions_.emplace_back(s.unsafeGetTensorImpl()->version_counter(), s._version());
    if (chunks_ == 0) finished_ = true;
  }
  BackgroundCopy(const BackgroundCopy&) = delete;
  BackgroundCopy& operator=(const BackgroundCopy&) = delete;

  /// Copies chunks until none is left to take. Any thread, any number of them at once.
  void help() noexcept {
    for (std::size_t c = next_.fetch_add(1); c < chunks_; c = next_.fetch_add(1)) {
      plan_.copy_range(c * chunk_bytes_, std::min(plan_.bytes(), (c + 1) * chunk_bytes_));
      if (copied_.fetch_add(1) + 1 == chunks_) {
        // The last chunk: whether a source moved is decided now, before finish() lets anyone go on.
        changed_ = std::any_of(versions_.begin(), versions_.end(), [](const auto& v) { return v.first.current_version() != v.second; });
        sources_.clear();  // the copy no longer reads them: not kept alive until the next capture
        versions_.clear();
        std::lock_guard lock(mutex_);
        finished_ = true;
        all_copied_.notify_all();
      }
    }
  }
  /// help() on this thread and `threads` - 1 helpers (while chunks are left), then waits until the
  /// chunks other threads took are copied.
  void finish(int threads = 1) {
    if (threads > 1 && next_.load() < chunks_) run_on_threads(threads, [this](int) { help(); });
    help();
    std::unique_lock lock(mutex_);
    all_copied_.wait(lock, [this] { return finished_; });
  }
  /// Whether every byte is copied. Any thread.
  bool finished() const {
    std::lock_guard lock(mutex_);
    return finished_;
  }
  /// After finish(): whether a source was written in place before its copy ended (the copy may mix
  /// old and new values).
  bool sources_changed() const noexcept { return changed_; }
  std::size_t bytes() const noexcept { return plan_.bytes(); }

 private:
  HostCopyPlan plan_;
  std::vector<torch::Tensor> sources_;
  std::vector<std::pair<c10::VariableVersion, std::uint32_t>> versions_;  // each source's counter and its version at the start
  std::size_t chunk_bytes_, chunks_;
  std::atomic<std::size_t> next_{0}, copied_{0};
  bool changed_ = false;  // written before finished_ is set under the mutex, read after finish()
  mutable std::mutex mutex_;
  std::condition_variable all_copied_;
  bool finished_ = false;
};

}  // namespace fsdp::detail
