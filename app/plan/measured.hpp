// Memory planning (app layer): the measured constants of the memory model (the process baseline, glibc's
// mmap thresholds, the heap's fragmentation under glibc and under jemalloc); docs/planning.md says how
// each was measured.
#pragma once

#include <cstdint>

namespace fsdp::app {

/// The resident memory of an fsdp-train rank before any data or model exists (LibTorch, Open MPI,
/// the C++ runtime), in MiB. Measured on the development machine (Debian 12, LibTorch 1.13 CPU, Open
/// MPI 4.1, 2 ranks on one node) as the peak RSS of a run whose data and model are negligible, minus
/// what the plan predicts for them (178.5 MiB peak RSS, 0.0 MiB predicted); tests/plan_e2e.cmake
/// measures it again on every run. fsdp-plan --baseline-mib overrides it.
inline constexpr double kDefaultBaselineMib = 178.0;

/// glibc's largest dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit): larger blocks are
/// always mapped and unmapped; smaller ones may come from the heap, which keeps freed memory.
inline constexpr std::int64_t kMmapThresholdMaxBytes = std::int64_t{32} << 20;
inline constexpr std::int64_t kMmapThresholdStartBytes = std::int64_t{128} << 10;
/// run.malloc = "reuse" (M_MMAP_MAX = 0): no block is ever mapped; "return": blocks of 1 MiB or more are.
inline constexpr std::int64_t kNeverMapped = INT64_MAX;
inline constexpr std::int64_t kReturnThresholdBytes = std::int64_t{1} << 20;

/// Resident heap per byte of the heap's live high-water mark. glibc places 64-byte-aligned tensor
/// blocks (posix_memalign) so that a freed block rarely takes the next request of the same size, and
/// small objects settle in the holes: the heap grows past its live bytes. Measured by tracing every
/// malloc/free of fsdp-train (docs/planning.md): 1.47 for a GPT whose blocks all live on the heap, 1.75
/// for an MLP with 12-16 MiB units. fsdp-plan --heap-factor overrides it.
inline constexpr double kDefaultHeapFactor = 1.5;
/// The same under run.malloc = "reuse", where every block, large ones included, lives on the heap and
/// a step's blocks find their freed predecessors of the same size: peak RSS minus the baseline against
/// the heap's live high-water mark in tests/plan_e2e.cmake was 1.14-1.20 (MLP, NO_SHARD), 1.22-1.34
/// (MLP, FULL_SHARD), 1.38-1.43 (GPT, FULL_SHARD) and 1.48 (bench/decks/gpt6m.toml, one process):
/// a GPT's many mid-sized activations fragment more than an MLP's few large blocks.
inline constexpr double kReuseHeapFactorGpt = 1.45;
inline constexpr double kReuseHeapFactor = 1.3;
/// The Llama's: its q, k/v, SwiGLU and score blocks are more sizes than the GPT's. Measured at np 2
/// (a 6.5M-parameter Llama, 4 layers, 6 heads, 2 KV heads; docs/planning.md): 1.61 FULL_SHARD, 1.47
/// NO_SHARD, 1.68 at context 256 and batch 16, 1.62 bf16, 1.52 tied with an 8192-token vocabulary.
inline constexpr double kReuseHeapFactorLlama = 1.6;
/// With activation checkpointing a layer's forward runs again inside the backward, interleaving its
/// short-lived blocks with the gradients' and fragmenting the heap further, the more so the larger the
/// activations are against the state: one factor for the whole heap missed by up to 16% (1.65-2.26
/// measured). The activations' bytes take this factor instead, the rest their family's. Fitted at np 2
/// on the GPT and the Llama of tests/plan_e2e.cmake (contexts 64-256, batches 8-32, 4 and 8 layers,
/// grouped heads or not, FULL_SHARD and NO_SHARD; docs/planning.md): 2.33 by least squares, the same
/// for both families; every case within 6% of the largest rank's peak RSS.
inline constexpr double kReuseHeapFactorCheckpointedActivations = 2.3;

/// fsdp-train built with jemalloc (app_build.hpp), under its settings (app/fsdp_train.cpp: large blocks
/// in the threads' arenas, where a freed extent serves the next request or merges with its neighbours)
/// with freed pages kept (run.malloc = "reuse"): resident memory per byte of the live high-water mark,
/// one factor for every family and for activation checkpointing. Measured (docs/planning.md): 1.06-1.10
/// GPT, 1.13-1.15 Llama, 1.19-1.25 Llama with activation checkpointing, 1.21-1.24 MLP (the cases of
/// tests/plan_e2e.cmake at 2 ranks), 1.13 NO_SHARD and 1.30 FULL_SHARD on the 134M GPT at 4 ranks
/// (bench/lean_memory.sh): 1.2 predicts each within 7%.
inline constexpr double kJemallocReuseHeapFactor = 1.2;
/// jemalloc's smallest "large" size class (with 4 KiB pages): blocks from here on are extents of pages
/// of their own, which run.malloc = "return" (decay time 0) gives back when they are freed.
inline constexpr std::int64_t kJemallocLargeBytes = std::int64_t{16} << 10;

}  // namespace fsdp::app
