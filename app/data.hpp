// The data layer of fsdp-train: IDX (MNIST) readers, a DistributedSampler, synthetic and character-level
// token data, and an ordered background prefetcher. Application layer; plain C++20 + zlib, no LibTorch, no
// MPI, so it builds in seconds and is tested without mpirun.
//
// Everything here is deterministic and platform independent: shuffles and random draws use our own
// integer-only code on std::mt19937_64 (whose output the standard fixes), never std::shuffle or the
// std:: distributions (whose results differ between standard libraries). The same seed gives the same
// data on every machine, which is what makes a resumed run equal an uninterrupted one.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "choices.hpp"
#include "fsdp/errors.hpp"

namespace fsdp::app {

/// Any problem with input data (missing or malformed files, bad sizes). Id "fsdp.data".
class DataError : public fsdp::ConfigError {
 public:
  explicit DataError(const std::string& what) : ConfigError(what, "fsdp.data") {}
};

// ---- IDX / MNIST --------------------------------------------------------------------------------

/// An IDX array (MNIST format): magic 0x00 0x00 <type> <ndims>, big-endian uint32 dims, then the data.
/// Only unsigned bytes (type 0x08) are supported.
struct IdxArray {
  std::vector<std::int64_t> dims;
  std::vector<std::uint8_t> data;  // row-major, product(dims) bytes
};

/// Reads an IDX file, gzip-compressed or not (zlib reads both). Throws DataError naming the file and
/// the problem: missing, not IDX (bad magic), unsupported element type, truncated ("expected N bytes of
/// data, found M"), corrupt gzip stream, trailing bytes after the data.
IdxArray read_idx(const std::string& path);

/// An image classification split: images n x rows x cols (uint8, row-major), labels n (uint8).
struct ImageSplit {
  std::int64_t n = 0, rows = 0, cols = 0;
  std::vector<std::uint8_t> images, labels;
  int num_classes = 10;
};

/// Loads `<dir>/train-images-idx3-ubyte[.gz]` + `<dir>/train-labels-idx1-ubyte[.gz]` (train) or the
/// `t10k-*` pair (the uncompressed name is tried first). Checks images are 3-D with nonzero rows and
/// cols, labels 1-D, the counts agree and every label is < 10. DataError naming the file otherwise;
/// a missing file lists the names tried.
ImageSplit load_mnist_split(const std::string& dir, bool train);

// ---- sampling and batching ----------------------------------------------------------------------

/// A permutation of 0..n-1 drawn by Fisher-Yates from std::mt19937_64(seed): the same on every
/// platform. DataError unless n >= 0.
std::vector<std::int64_t> random_permutation(std::int64_t n, std::uint64_t seed);

/// torch.utils.data.DistributedSampler semantics (drop_last=false): indices 0..n-1, permuted per epoch
/// with seed + epoch when `shuffle` (our own permutation, not torch.randperm's), padded by repeating the
/// first indices (cyclically when n < num_replicas) so the total is num_replicas * num_samples(); rank r
/// takes positions r, r + num_replicas, r + 2 num_replicas, ...
/// The permutation does not depend on num_replicas, so runs at different world sizes see the same
/// global order (see batch_indices).
class DistributedSampler {
 public:
  /// DataError unless n >= 0, num_replicas >= 1 and 0 <= rank < num_replicas.
  DistributedSampler(std::int64_t n, int num_replicas, int rank, bool shuffle, std::uint64_t seed);
  /// Each epoch's global order given by `order(epoch)` instead of a permutation: n indices, each a
  /// sample of the dataset (a mixture's draws, numbered over all its sources, which may hold more
  /// than n samples).
  using EpochOrder = std::function<std::vector<std::int64_t>(std::int64_t epoch)>;
  DistributedSampler(std::int64_t n, int num_replicas, int rank, EpochOrder order);
  /// Selects the permutation of `epoch` (call at the start of every epoch, as in PyTorch).
  void set_epoch(std::int64_t epoch) { epoch_ = epoch; }
  std::int64_t epoch() const { return epoch_; }
  /// This rank's indices for the current epoch; num_samples() of them. Builds the whole permutation
  /// (O(n)): call once per epoch.
  std::vector<std::int64_t> indices() const;
  /// Per rank: ceil(n / num_replicas), the same on every rank (so every rank runs the same steps).
  std::int64_t num_samples() const;
  /// num_replicas * num_samples(): n plus the padding.
  std::int64_t total_size() const { return num_samples() * num_replicas_; }

 private:
  std::int64_t n_;
  int num_replicas_, rank_;
  bool shuffle_;
  std::uint64_t seed_;
  std::int64_t epoch_ = 0;
  EpochOrder order_;
};

/// Number of batches of size `batch` over `num_samples` samples, the last one possibly smaller:
/// ceil(num_samples / batch). DataError unless batch >= 1.
std::int64_t num_batches(std::int64_t num_samples, std::int64_t batch);

/// Batch `step` of a rank: indices[step * batch, min((step + 1) * batch, size)). DataError when step is
/// out of range. With DistributedSampler, N ranks at batch b see at step k exactly the samples one rank
/// at batch N * b sees at step k (when n is a multiple of N * b): both are global positions
/// [k N b, (k + 1) N b) of the same permutation.
std::vector<std::int64_t> batch_indices(const std::vector<std::int64_t>& indices, std::int64_t batch, std::int64_t step);

// ---- token data ---------------------------------------------------------------------------------

/// `n` sequences of `length` tokens in [0, vocab), row-major. For next-token prediction a sequence is
/// context + 1 tokens: inputs [0, context), targets [1, context + 1).
struct TokenSplit {
  std::int64_t n = 0, length = 0;
  int vocab = 0;
  std::vector<std::int32_t> tokens;
};

/// The chain used when none is given: train and test splits made with different `seed`s and this
/// chain come from the same distribution.
inline constexpr std::uint64_t kDefaultChainSeed = 0x5eed'c4a1'0000'0001ULL;

/// Seeded synthetic tokens with learnable structure: `num_sequences` sequences of context + 1 tokens
/// from a fixed random sparse Markov chain. The chain (the "language") depends only on vocab and
/// chain_seed: each token has min(4, vocab) distinct likely successors with probabilities
/// 50/25/10/5 %, and the remaining mass (10 % for vocab >= 4) goes to a uniformly random token. `seed`
/// picks the sequences (the first token of each is uniform). Deterministic; the first m sequences are
/// the same for any num_sequences >= m. DataError unless num_sequences >= 0, context >= 1, vocab >= 1.
TokenSplit make_synthetic_tokens(std::int64_t num_sequences, std::int64_t context, int vocab, std::uint64_t seed,
                                 std::uint64_t chain_seed = kDefaultChainSeed);

/// The conditional entropy of that chain in nats per token: the lowest expected cross-entropy loss on
/// the targets (every target depends on its predecessor only). ln(vocab) is the loss of a uniform guess.
double synthetic_token_entropy(int vocab);

/// A character-level corpus: vocab[i] is the byte of token i.
struct TextCorpus {
  std::vector<std::uint8_t> vocab;
  TokenSplit train, test;
};

/// Reads a text file as bytes: vocabulary = sorted distinct bytes; the first floor(9/10) of the file is
/// train, the rest test; each split holds windows of context + 1 tokens starting at multiples of
/// `context` (consecutive windows share one token: the last target of one is the first input of the
/// next). DataError if the file is missing or empty, has more than max_vocab distinct bytes, or is too
/// short to give both splits a window (it needs at least 10 * context + 1 bytes).
TextCorpus load_text(const std::string& path, std::int64_t context, int max_vocab);

// ---- token shards (llm.c, nanoGPT) ----------------------------------------------------------------

/// How token files store their tokens (TokenFormat, choices.hpp): llm.c shards (a 256 x int32 header:
/// magic 20240520 version 1 with uint16 tokens, or magic 20240801 version 7 with uint32 tokens;
/// header[2] = token count), or headerless little-endian uint16 / uint32 (nanoGPT's train.bin / val.bin).
/// TokenFormat of "llmc", "uint16", "uint32"; DataError otherwise.
TokenFormat parse_token_format(const std::string& name);

inline constexpr std::int32_t kLlmcMagicUint16 = 20240520, kLlmcVersionUint16 = 1;
inline constexpr std::int32_t kLlmcMagicUint32 = 20240801, kLlmcVersionUint32 = 7;
inline constexpr std::int64_t kLlmcHeaderBytes = 256 * 4;

/// How a token file stores one token: llm.c and nanoGPT files hold uint16 or uint32; Megatron's
/// indexed datasets any of its integer dtype codes (uint8 1, int8 2, int16 3, int32 4, int64 5, uint16 8).
enum class TokenElement : std::uint8_t { kUint8, kInt8, kInt16, kUint16, kInt32, kUint32, kInt64 };
int token_element_bytes(TokenElement e) noexcept;

/// Megatron-LM / GPT-NeoX indexed datasets (`prefix.bin` + `prefix.idx`): the index's magic, version
/// and where its fields start.
inline constexpr std::string_view kIndexedMagic{"MMIDIDX\0\0", 9};
inline constexpr std::uint64_t kIndexedVersion = 1;
inline constexpr std::int64_t kIndexedHeaderBytes = 34;  // magic 9, version 8, dtype code 1, two counts 8 + 8

/// Token files read as one stream: the files of a glob (llm.c, nanoGPT), or the sequences of a
/// Megatron indexed dataset in index order. Memory-mapped: nothing is copied into memory, a read
/// touches only the pages of its tokens. Not copyable (it owns the mappings); movable.
class TokenStream {
 public:
  /// Opens every file `pattern` matches, sorted by name. DataError naming the pattern when nothing
  /// matches, and naming the file (and the byte offset of a header field) for a wrong magic or
  /// version, a size that does not match the header's token count, a size that is not a whole number
  /// of tokens, an empty file.
  static TokenStream open(const std::string& pattern, TokenFormat format);
  /// Opens the indexed dataset `prefix` (`prefix.bin` and `prefix.idx`; a path ending in .bin or .idx
  /// names the same pair). DataError naming the file and byte offset for a wrong magic, version or
  /// dtype code (a floating-point dtype is not a token type), an index shorter than its counts, a
  /// negative length, sequences that are not back to back in the .bin, a sequence past the end of the
  /// .bin, document indices that do not run from 0 to the sequence count, or no tokens.
  static TokenStream open_indexed(const std::string& prefix);

  TokenStream() = default;
  TokenStream(TokenStream&& other) noexcept;
  TokenStream& operator=(TokenStream&& other) noexcept;
  TokenStream(const TokenStream&) = delete;
  TokenStream& operator=(const TokenStream&) = delete;
  ~TokenStream();

  /// Tokens in all files.
  std::int64_t size() const noexcept { return total_; }
  std::size_t num_files() const noexcept { return files_.size(); }
  const std::string& file_path(std::size_t i) const { return files_.at(i).path; }
  /// Indexed datasets: where each document starts in the stream, and the stream's size last (the
  /// index's document boundaries); empty for other files.
  const std::vector<std::int64_t>& document_starts() const noexcept { return document_starts_; }
  /// Token `i` of the stream (0 <= i < size()).
  std::int64_t at(std::int64_t i) const;
  /// Tokens [first, first + n) into `out` (possibly across files).
  void read(std::int64_t first, std::int64_t n, std::int64_t* out) const;
  /// "file 'x' at byte offset N": where token `i` is stored, for messages.
  std::string where(std::int64_t i) const;
  /// Checks tokens [first, last) against `vocab`: DataError naming the file and byte offset of the
  /// first token that is negative or >= vocab.
  void check_vocab(std::int64_t first, std::int64_t last, std::int64_t vocab) const;

 private:
  struct File {
    std::string path;
    const unsigned char* map = nullptr;  // the whole file
    std::size_t map_bytes = 0;
    std::int64_t data_offset = 0;  // bytes before the first token
    TokenElement element = TokenElement::kUint16;
    std::int64_t tokens = 0;
    std::int64_t first = 0;  // index of its first token in the stream
  };
  std::size_t file_of(std::int64_t i) const;
  std::vector<File> files_;
  std::vector<std::int64_t> document_starts_;
  std::int64_t total_ = 0;
};

/// Next-token samples over a token stream: sample i is tokens [i*T, i*T + T] (T + 1 tokens: inputs
/// the first T, targets the last T); floor((size - 1) / T) samples.
inline std::int64_t token_stream_samples(const TokenStream& s, std::int64_t context) { return s.size() > 1 ? (s.size() - 1) / context : 0; }

// ---- background loading -------------------------------------------------------------------------

/// Ordered background loading: `num_workers` threads call make(0), make(1), ... make(num_batches - 1)
/// ahead of the consumer, keeping at most `depth` batches made but not yet taken; next() returns them in
/// index order, so the sequence is exactly the synchronous one provided make(i) depends on i only.
/// num_workers = 0 means synchronous (make runs inside next()). An exception from make(i) is rethrown
/// by next() when batch i is due (batches before it are delivered first); after that every next()
/// rethrows it. Not copyable or movable (the threads point at it); the destructor waits for the
/// make() calls in flight and drops unconsumed batches. next() is for one consumer thread.
template <class Batch>
class Prefetcher {
 public:
  Prefetcher(std::int64_t num_batches, std::function<Batch(std::int64_t index)> make, int num_workers, int depth = 4);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  /// The next batch in index order; nullopt after the last.
  std::optional<Batch> next();

 private:
  void work();

  const std::int64_t num_batches_;
  const std::function<Batch(std::int64_t)> make_;
  const std::int64_t depth_;
  std::mutex mutex_;
  std::condition_variable ready_;  // a slot was filled: wakes the consumer
  std::condition_variable space_;  // a slot was freed or we stop: wakes the workers
  // Ring of depth_ slots: batch i lives in slot i % depth_. A worker claims i only when
  // i < consumed_ + depth_, so the slot's previous batch (i - depth_) has been taken.
  std::vector<std::optional<Batch>> slots_;
  std::vector<std::exception_ptr> errors_;
  std::int64_t claimed_ = 0;   // next index a worker will make
  std::int64_t consumed_ = 0;  // next index next() returns
  bool stop_ = false;          // no more claims: destruction or a make() failed
  std::exception_ptr failed_;  // once set, next() rethrows it
  std::vector<std::thread> threads_;
};

// ---- Prefetcher implementation ------------------------------------------------------------------

template <class Batch>
Prefetcher<Batch>::Prefetcher(std::int64_t num_batches, std::function<Batch(std::int64_t)> make, int num_workers, int depth)
    : num_batches_(num_batches), make_(std::move(make)), depth_(depth) {
  if (num_batches < 0) throw DataError("Prefetcher: num_batches must be >= 0, got " + std::to_string(num_batches));
  if (num_workers < 0) throw DataError("Prefetcher: num_workers must be >= 0, got " + std::to_string(num_workers));
  if (depth < 1) throw DataError("Prefetcher: depth must be >= 1, got " + std::to_string(depth));
  if (!make_) throw DataError("Prefetcher: no batch function given");
  slots_.resize(static_cast<std::size_t>(depth));
  errors_.resize(static_cast<std::size_t>(depth));
  threads_.reserve(static_cast<std::size_t>(num_workers));
  try {
    for (int w = 0; w < num_workers; ++w) threads_.emplace_back([this] { work(); });
  } catch (...) {  // thread creation failed: stop the ones started before rethrowing
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    space_.notify_all();
    for (auto& t : threads_) t.join();
    throw;
  }
}

template <class Batch>
Prefetcher<Batch>::~Prefetcher() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  space_.notify_all();
  for (auto& t : threads_) t.join();
}

template <class Batch>
void Prefetcher<Batch>::work() {
  for (;;) {
    std::int64_t index = 0;
    {
      std::unique_lock lock(mutex_);
      space_.wait(lock, [&] { return stop_ || claimed_ >= num_batches_ || claimed_ < consumed_ + depth_; });
      if (stop_ || claimed_ >= num_batches_) return;
      index = claimed_++;
    }
    const auto slot = static_cast<std::size_t>(index % depth_);
    try {
      Batch batch = make_(index);
      std::lock_guard lock(mutex_);
      slots_[slot].emplace(std::move(batch));
    } catch (...) {
      std::lock_guard lock(mutex_);
      errors_[slot] = std::current_exception();
      // Claims go in index order, so every batch before this one is already claimed and still gets
      // delivered; later ones are not worth making.
      stop_ = true;
    }
    ready_.notify_all();
    space_.notify_all();  // wakes idle workers to see stop_
  }
}

template <class Batch>
std::optional<Batch> Prefetcher<Batch>::next() {
  if (failed_) std::rethrow_exception(failed_);
  if (consumed_ >= num_batches_) return std::nullopt;
  if (threads_.empty()) {  // synchronous
    try {
      std::optional<Batch> batch(make_(consumed_));
      ++consumed_;
      return batch;
    } catch (...) {
      failed_ = std::current_exception();
      throw;
    }
  }
  std::optional<Batch> batch;
  {
    std::unique_lock lock(mutex_);
    const auto slot = static_cast<std::size_t>(consumed_ % depth_);
    ready_.wait(lock, [&] { return slots_[slot].has_value() || errors_[slot] != nullptr; });
    if (errors_[slot]) {
      failed_ = errors_[slot];
      std::rethrow_exception(failed_);
    }
    batch.swap(slots_[slot]);  // leaves the slot empty for batch consumed_ + depth_
    ++consumed_;
  }
  space_.notify_all();
  return batch;
}

}  // namespace fsdp::app
