// The data layer of fsdp-train (see data.hpp): IDX reading through zlib, sampling, token data.
#include "data.hpp"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>

namespace fsdp::app {
namespace {

namespace fs = std::filesystem;

std::string hex_byte(unsigned v) {
  static constexpr char kDigits[] = "0123456789ABCDEF";
  return std::string("0x") + kDigits[(v >> 4) & 0xF] + kDigits[v & 0xF];
}

// DataError unless `path` names an existing file (not a directory): gzopen would "open" a directory
// and only fail on the first read, with a less helpful message.
void require_file(const std::string& path) {
  std::error_code ec;
  const auto st = fs::status(path, ec);
  if (!fs::exists(st)) throw DataError(path + ": file not found");
  if (fs::is_directory(st)) throw DataError(path + ": is a directory, not a file");
}

// ---- zlib reading ----

struct GzCloser {
  void operator()(gzFile_s* f) const { gzclose_r(f); }
};
using GzFile = std::unique_ptr<gzFile_s, GzCloser>;

// Reads up to `n` bytes (fewer only at the end of the stream). gzread takes an unsigned int length,
// so large reads go in chunks. Throws on a corrupt stream (bad gzip header, CRC mismatch, ...).
std::size_t gz_read(gzFile f, std::uint8_t* out, std::size_t n, const std::string& path) {
  constexpr std::size_t kChunk = std::size_t{1} << 30;
  std::size_t got = 0;
  while (got < n) {
    const auto want = static_cast<unsigned>(std::min(n - got, kChunk));
    const int r = gzread(f, out + got, want);
    if (r < 0) {
      int errnum = 0;
      const char* msg = gzerror(f, &errnum);
      throw DataError(path + ": cannot read (" + (errnum == Z_ERRNO ? std::strerror(errno) : msg) + "): corrupt or not a gzip/IDX file");
    }
    got += static_cast<std::size_t>(r);
    if (static_cast<unsigned>(r) < want) break;  // end of stream
  }
  return got;
}

// zlib reports a gzip stream cut short as Z_BUF_ERROR ("unexpected end of file") but still returns the
// bytes before the cut: callers add this note so "truncated" says why.
std::string gz_truncation_note(gzFile f) {
  int errnum = 0;
  gzerror(f, &errnum);
  return errnum == Z_BUF_ERROR ? " (the gzip stream ends early: truncated .gz file)" : "";
}

const char* idx_type_name(unsigned type) {
  switch (type) {
    case 0x08: return "unsigned byte";
    case 0x09: return "signed byte";
    case 0x0B: return "int16";
    case 0x0C: return "int32";
    case 0x0D: return "float32";
    case 0x0E: return "float64";
    default: return nullptr;
  }
}

std::string dims_string(const std::vector<std::int64_t>& dims) {
  std::string s;
  for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? " x " : "") + std::to_string(dims[i]);
  return s;
}

// ---- random numbers: integer-only, so identical across standard libraries ----

// Uniform in [0, bound), bound >= 1, without modulo bias: reject the lowest 2^64 mod bound values so
// the accepted range is a whole number of copies of [0, bound).
std::uint64_t uniform_below(std::mt19937_64& rng, std::uint64_t bound) {
  const std::uint64_t threshold = (0 - bound) % bound;  // = 2^64 mod bound
  for (;;) {
    const std::uint64_t r = rng();
    if (r >= threshold) return r % bound;
  }
}

// Successor probabilities of the synthetic Markov chain, in percent; the rest is uniform noise.
constexpr std::array<int, 4> kSuccessorPercent = {50, 25, 10, 5};

int num_successors(int vocab) { return std::min<int>(vocab, static_cast<int>(kSuccessorPercent.size())); }

// Windows of length context + 1 starting at multiples of context inside [begin, end) of `ids`.
TokenSplit make_windows(const std::vector<std::int32_t>& ids, std::int64_t begin, std::int64_t end, std::int64_t context, int vocab) {
  TokenSplit split;
  split.length = context + 1;
  split.vocab = vocab;
  const std::int64_t part = end - begin;
  split.n = part >= context + 1 ? (part - 1) / context : 0;
  split.tokens.reserve(static_cast<std::size_t>(split.n * split.length));
  for (std::int64_t i = 0; i < split.n; ++i) {
    const auto first = ids.begin() + (begin + i * context);
    split.tokens.insert(split.tokens.end(), first, first + split.length);
  }
  return split;
}

}  // namespace

// ---- IDX ----------------------------------------------------------------------------------------

IdxArray read_idx(const std::string& path) {
  require_file(path);
  GzFile file(gzopen(path.c_str(), "rb"));  // reads gzip and, transparently, uncompressed files
  if (!file) throw DataError(path + ": cannot open: " + std::strerror(errno));
  gzbuffer(file.get(), 1u << 17);

  std::array<std::uint8_t, 4> magic{};
  if (gz_read(file.get(), magic.data(), 4, path) < 4)
    throw DataError(path + ": not an IDX file: shorter than the 4-byte magic" + gz_truncation_note(file.get()));
  const auto magic_text = hex_byte(magic[0]) + " " + hex_byte(magic[1]) + " " + hex_byte(magic[2]) + " " + hex_byte(magic[3]);
  const char* type_name = idx_type_name(magic[2]);
  if (magic[0] != 0 || magic[1] != 0 || type_name == nullptr || magic[3] == 0)
    throw DataError(path + ": not an IDX file (bad magic " + magic_text + "; expected 0x00 0x00 <element type> <number of dimensions>)");
  if (magic[2] != 0x08)
    throw DataError(path + ": unsupported IDX element type " + hex_byte(magic[2]) + " (" + type_name + "); only 0x08 (unsigned byte) is supported");

  const int ndims = magic[3];
  std::vector<std::uint8_t> raw(static_cast<std::size_t>(4 * ndims));
  if (gz_read(file.get(), raw.data(), raw.size(), path) < raw.size())
    throw DataError(path + ": truncated: the file ends inside the " + std::to_string(ndims) + " dimensions of the IDX header" +
                    gz_truncation_note(file.get()));
  IdxArray out;
  std::int64_t expected = 1;
  for (int d = 0; d < ndims; ++d) {
    const std::uint8_t* b = raw.data() + 4 * d;  // big-endian uint32
    const std::int64_t dim = (std::int64_t{b[0]} << 24) | (std::int64_t{b[1]} << 16) | (std::int64_t{b[2]} << 8) | b[3];
    out.dims.push_back(dim);
    // Guard the product: 255 dims of 2^32 - 1 would overflow; nothing real comes near 2^48 bytes.
    if (dim != 0 && expected > (std::int64_t{1} << 48) / dim)
      throw DataError(path + ": IDX dimensions too large to be real: " + dims_string(out.dims) + " ...");
    expected *= dim;
  }

  // Grow the buffer as data arrives instead of trusting the header up front: a corrupt header then
  // gives "truncated", not a failed multi-terabyte allocation.
  constexpr std::int64_t kStep = std::int64_t{64} << 20;
  out.data.reserve(static_cast<std::size_t>(std::min(expected, kStep)));
  std::int64_t got = 0;
  while (got < expected) {
    const std::int64_t want = std::min(expected - got, kStep);
    out.data.resize(static_cast<std::size_t>(got + want));
    const auto r = static_cast<std::int64_t>(gz_read(file.get(), out.data.data() + got, static_cast<std::size_t>(want), path));
    got += r;
    if (r < want) break;
  }
  if (got < expected)
    throw DataError(path + ": truncated: dims " + dims_string(out.dims) + " expected " + std::to_string(expected) + " bytes of data, found " +
                    std::to_string(got) + gz_truncation_note(file.get()));

  std::int64_t trailing = 0;
  std::array<std::uint8_t, 4096> scratch{};
  for (std::size_t r; (r = gz_read(file.get(), scratch.data(), scratch.size(), path)) > 0;) trailing += static_cast<std::int64_t>(r);
  if (trailing > 0)
    throw DataError(path + ": trailing garbage: " + std::to_string(trailing) + " bytes after the " + std::to_string(expected) +
                    " bytes of data (dims " + dims_string(out.dims) + ")");
  // All data is there but the gzip trailer (CRC, length) is missing: the file is still damaged.
  if (const auto note = gz_truncation_note(file.get()); !note.empty()) throw DataError(path + ": truncated" + note);
  return out;
}

ImageSplit load_mnist_split(const std::string& dir, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  // The uncompressed name first: it is what a user who unpacked the files has, and it reads faster.
  auto find = [&](const std::string& stem, const char* what) {
    const std::array<std::string, 2> names = {stem, stem + ".gz"};
    for (const auto& name : names) {
      const auto path = (fs::path(dir) / name).string();
      std::error_code ec;
      if (fs::exists(path, ec)) return path;
    }
    std::error_code ec;
    throw DataError(std::string("MNIST ") + (train ? "train" : "test") + " " + what + " not found in " + dir +
                    (fs::is_directory(dir, ec) ? "" : " (no such directory)") + ": tried " + names[0] + ", " + names[1]);
  };
  const auto images_path = find(prefix + "-images-idx3-ubyte", "images");
  const auto labels_path = find(prefix + "-labels-idx1-ubyte", "labels");

  auto images = read_idx(images_path);
  if (images.dims.size() != 3)
    throw DataError(images_path + ": expected 3 dimensions (n x rows x cols), found " + std::to_string(images.dims.size()) + " (" +
                    dims_string(images.dims) + ")");
  if (images.dims[0] == 0 || images.dims[1] == 0 || images.dims[2] == 0)
    throw DataError(images_path + ": empty images (" + dims_string(images.dims) + ")");
  auto labels = read_idx(labels_path);
  if (labels.dims.size() != 1)
    throw DataError(labels_path + ": expected 1 dimension (n labels), found " + std::to_string(labels.dims.size()) + " (" + dims_string(labels.dims) +
                    ")");
  if (labels.dims[0] != images.dims[0])
    throw DataError("count mismatch: " + images_path + " has " + std::to_string(images.dims[0]) + " images but " + labels_path + " has " +
                    std::to_string(labels.dims[0]) + " labels");

  ImageSplit split;
  for (std::size_t i = 0; i < labels.data.size(); ++i)
    if (labels.data[i] >= split.num_classes)
      throw DataError(labels_path + ": label " + std::to_string(labels.data[i]) + " at index " + std::to_string(i) + " is out of range [0, " +
                      std::to_string(split.num_classes) + ")");
  split.n = images.dims[0];
  split.rows = images.dims[1];
  split.cols = images.dims[2];
  split.images = std::move(images.data);
  split.labels = std::move(labels.data);
  return split;
}

// ---- sampling -----------------------------------------------------------------------------------

std::vector<std::int64_t> random_permutation(std::int64_t n, std::uint64_t seed) {
  if (n < 0) throw DataError("random_permutation: n must be >= 0, got " + std::to_string(n));
  std::vector<std::int64_t> p(static_cast<std::size_t>(n));
  std::iota(p.begin(), p.end(), std::int64_t{0});
  std::mt19937_64 rng(seed);
  for (std::int64_t i = n - 1; i > 0; --i) {  // Fisher-Yates: p[i] uniform among the first i + 1
    const auto j = static_cast<std::int64_t>(uniform_below(rng, static_cast<std::uint64_t>(i) + 1));
    std::swap(p[static_cast<std::size_t>(i)], p[static_cast<std::size_t>(j)]);
  }
  return p;
}

DistributedSampler::DistributedSampler(std::int64_t n, int num_replicas, int rank, bool shuffle, std::uint64_t seed)
    : n_(n), num_replicas_(num_replicas), rank_(rank), shuffle_(shuffle), seed_(seed) {
  if (n < 0) throw DataError("DistributedSampler: n must be >= 0, got " + std::to_string(n));
  if (num_replicas < 1) throw DataError("DistributedSampler: num_replicas must be >= 1, got " + std::to_string(num_replicas));
  if (rank < 0 || rank >= num_replicas)
    throw DataError("DistributedSampler: rank " + std::to_string(rank) + " out of range [0, " + std::to_string(num_replicas) + ")");
}

DistributedSampler::DistributedSampler(std::int64_t n, int num_replicas, int rank, EpochOrder order)
    : DistributedSampler(n, num_replicas, rank, false, 0) {
  if (!order) throw DataError("DistributedSampler: no epoch order given");
  order_ = std::move(order);
}

std::int64_t DistributedSampler::num_samples() const { return (n_ + num_replicas_ - 1) / num_replicas_; }

std::vector<std::int64_t> DistributedSampler::indices() const {
  std::vector<std::int64_t> order;
  if (order_) {
    order = order_(epoch_);
    if (static_cast<std::int64_t>(order.size()) != n_)
      throw DataError("DistributedSampler: epoch order of " + std::to_string(order.size()) + " indices for " + std::to_string(n_) + " samples");
  } else if (shuffle_) {
    // Unsigned wrap-around is intended (a negative epoch is just another seed), as in PyTorch.
    order = random_permutation(n_, seed_ + static_cast<std::uint64_t>(epoch_));
  } else {
    order.resize(static_cast<std::size_t>(n_));
    std::iota(order.begin(), order.end(), std::int64_t{0});
  }
  std::vector<std::int64_t> mine;
  mine.reserve(static_cast<std::size_t>(num_samples()));
  // Positions >= n are padding: order[pos % n] repeats the first indices, cyclically when the padding
  // is longer than n (n < num_replicas), exactly like PyTorch's `indices * ceil(...)`.
  for (std::int64_t pos = rank_; pos < total_size(); pos += num_replicas_) mine.push_back(order[static_cast<std::size_t>(pos % n_)]);
  return mine;
}

std::int64_t num_batches(std::int64_t num_samples, std::int64_t batch) {
  if (batch < 1) throw DataError("batch size must be >= 1, got " + std::to_string(batch));
  if (num_samples < 0) throw DataError("num_samples must be >= 0, got " + std::to_string(num_samples));
  return (num_samples + batch - 1) / batch;
}

std::vector<std::int64_t> batch_indices(const std::vector<std::int64_t>& indices, std::int64_t batch, std::int64_t step) {
  const auto size = static_cast<std::int64_t>(indices.size());
  const auto steps = num_batches(size, batch);
  if (step < 0 || step >= steps)
    throw DataError("batch step " + std::to_string(step) + " out of range [0, " + std::to_string(steps) + ") for " + std::to_string(size) +
                    " samples in batches of " + std::to_string(batch));
  const auto begin = indices.begin() + step * batch;
  return {begin, begin + std::min(batch, size - step * batch)};
}

// ---- tokens -------------------------------------------------------------------------------------

TokenSplit make_synthetic_tokens(std::int64_t num_sequences, std::int64_t context, int vocab, std::uint64_t seed, std::uint64_t chain_seed) {
  if (num_sequences < 0) throw DataError("synthetic tokens: num_sequences must be >= 0, got " + std::to_string(num_sequences));
  if (context < 1) throw DataError("synthetic tokens: context must be >= 1, got " + std::to_string(context));
  if (vocab < 1) throw DataError("synthetic tokens: vocab must be >= 1, got " + std::to_string(vocab));
  if (num_sequences > 0 && context + 1 > (std::int64_t{1} << 40) / num_sequences)
    throw DataError("synthetic tokens: " + std::to_string(num_sequences) + " x " + std::to_string(context + 1) + " tokens is too many");

  // The chain: successors[v * k + j] is the j-th likely successor of v. Each row is a partial
  // Fisher-Yates draw over one shared array; any starting order gives a uniform k-subset, and it costs
  // O(vocab * k) instead of O(vocab^2) for large vocabularies.
  const int k = num_successors(vocab);
  std::vector<std::int32_t> pool(static_cast<std::size_t>(vocab));
  std::iota(pool.begin(), pool.end(), 0);
  std::vector<std::int32_t> successors(static_cast<std::size_t>(vocab) * k);
  std::mt19937_64 chain_rng(chain_seed);
  for (int v = 0; v < vocab; ++v) {
    for (int j = 0; j < k; ++j) {
      const auto pick = j + static_cast<int>(uniform_below(chain_rng, static_cast<std::uint64_t>(vocab - j)));
      std::swap(pool[j], pool[pick]);
      successors[static_cast<std::size_t>(v) * k + j] = pool[j];
    }
  }

  TokenSplit out;
  out.n = num_sequences;
  out.length = context + 1;
  out.vocab = vocab;
  out.tokens.resize(static_cast<std::size_t>(out.n * out.length));
  std::mt19937_64 rng(seed);
  auto* t = out.tokens.data();
  for (std::int64_t s = 0; s < out.n; ++s) {
    std::int32_t token = static_cast<std::int32_t>(uniform_below(rng, static_cast<std::uint64_t>(vocab)));
    *t++ = token;
    for (std::int64_t i = 1; i < out.length; ++i) {
      const auto r = static_cast<int>(uniform_below(rng, 100));
      int j = 0;
      for (int cum = 0; j < k; ++j) {
        cum += kSuccessorPercent[static_cast<std::size_t>(j)];
        if (r < cum) break;
      }
      token = j < k ? successors[static_cast<std::size_t>(token) * k + j]
                    : static_cast<std::int32_t>(uniform_below(rng, static_cast<std::uint64_t>(vocab)));
      *t++ = token;
    }
  }
  return out;
}

double synthetic_token_entropy(int vocab) {
  if (vocab < 1) throw DataError("synthetic tokens: vocab must be >= 1, got " + std::to_string(vocab));
  // Successors are distinct, so every row has the same distribution: successor j gets w_j plus its
  // share of the noise, the vocab - k other tokens the noise share only.
  const int k = num_successors(vocab);
  double noise = 1.0;
  for (int j = 0; j < k; ++j) noise -= kSuccessorPercent[static_cast<std::size_t>(j)] / 100.0;
  const double share = noise / vocab;
  auto term = [](double p) { return p > 0 ? -p * std::log(p) : 0.0; };
  double h = (vocab - k) * term(share);
  for (int j = 0; j < k; ++j) h += term(kSuccessorPercent[static_cast<std::size_t>(j)] / 100.0 + share);
  return h;
}

TextCorpus load_text(const std::string& path, std::int64_t context, int max_vocab) {
  if (context < 1) throw DataError(path + ": context must be >= 1, got " + std::to_string(context));
  if (context > (std::numeric_limits<std::int64_t>::max() - 1) / 10) throw DataError(path + ": context " + std::to_string(context) + " is too large");
  if (max_vocab < 1) throw DataError(path + ": max_vocab must be >= 1, got " + std::to_string(max_vocab));
  require_file(path);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(path + ": cannot open: " + std::strerror(errno));
  const std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw DataError(path + ": read error");
  if (bytes.empty()) throw DataError(path + ": file is empty");

  std::array<bool, 256> seen{};
  for (const auto b : bytes) seen[b] = true;
  TextCorpus corpus;
  std::array<std::int32_t, 256> id{};
  for (int b = 0; b < 256; ++b) {
    if (!seen[static_cast<std::size_t>(b)]) continue;
    id[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(corpus.vocab.size());
    corpus.vocab.push_back(static_cast<std::uint8_t>(b));
  }
  const int vocab = static_cast<int>(corpus.vocab.size());
  if (vocab > max_vocab) throw DataError(path + ": " + std::to_string(vocab) + " distinct bytes, more than max_vocab = " + std::to_string(max_vocab));

  // The test part is ceil(size / 10) bytes and needs context + 1 of them: size >= 10 * context + 1
  // (the train part is then larger). Refused rather than returning an empty split.
  const auto size = static_cast<std::int64_t>(bytes.size());
  const std::int64_t train_bytes = size / 10 * 9 + size % 10 * 9 / 10;  // floor(9 size / 10), no overflow
  if (size - train_bytes < context + 1)
    throw DataError(path + ": too short: " + std::to_string(size) + " bytes; context " + std::to_string(context) + " needs at least " +
                    std::to_string(10 * context + 1) + " bytes (90/10 train/test split, one window of context + 1 characters each)");

  std::vector<std::int32_t> ids(bytes.size());
  std::transform(bytes.begin(), bytes.end(), ids.begin(), [&](std::uint8_t b) { return id[b]; });
  corpus.train = make_windows(ids, 0, train_bytes, context, vocab);
  corpus.test = make_windows(ids, train_bytes, size, context, vocab);
  return corpus;
}

// ---- token shards -------------------------------------------------------------------------------

TokenFormat parse_token_format(const std::string& name) {
  for (const auto& [format, known] : ChoiceNames<TokenFormat>::kNames)
    if (name == known) return format;
  throw DataError("token format must be llmc, uint16 or uint32, got '" + name + "'");
}

}  // namespace fsdp::app
