// fsdp-train (app layer): the threads a rank computes with. LibTorch's intra-op pool and the BLAS
// library are two pools: torch::set_num_threads does not reach OpenBLAS (Debian's LibTorch calls the
// system BLAS for every fp32 matrix product), which otherwise starts one thread per core in every rank.
#pragma once

#include <dlfcn.h>
#include <torch/torch.h>

namespace fsdp::app {

namespace detail {
/// OpenBLAS's thread setters, looked up at run time: LibTorch links the generic libblas.so.3, which the
/// system may point at another BLAS (reference BLAS has no threads; then these are null).
struct BlasThreadCalls {
  void (*set)(int) = nullptr;
  int (*get)() = nullptr;
  BlasThreadCalls() {
    set = reinterpret_cast<void (*)(int)>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
    get = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  }
};
inline const BlasThreadCalls& blas_thread_calls() {
  static const BlasThreadCalls calls;
  return calls;
}
}  // namespace detail

/// OpenBLAS's thread count; 1 when the BLAS has no thread setting.
inline int blas_threads() {
  const auto& calls = detail::blas_thread_calls();
  return calls.get ? calls.get() : 1;
}

/// run.threads: LibTorch's pool and OpenBLAS's both get `threads`.
inline void set_compute_threads(int threads) {
  torch::set_num_threads(threads);
  if (const auto& calls = detail::blas_thread_calls(); calls.set) calls.set(threads);
}

/// Computes on one thread for its scope (a per-thread measurement), then restores both pools.
class OneComputeThread {
 public:
  OneComputeThread() : torch_(torch::get_num_threads()), blas_(blas_threads()) { set_compute_threads(1); }
  ~OneComputeThread() {
    torch::set_num_threads(torch_);
    if (const auto& calls = detail::blas_thread_calls(); calls.set) calls.set(blas_);
  }
  OneComputeThread(const OneComputeThread&) = delete;
  OneComputeThread& operator=(const OneComputeThread&) = delete;

 private:
  int torch_, blas_;
};

}  // namespace fsdp::app
