// fsdp-train's token files (data.hpp, TokenStream): llm.c shards, nanoGPT's headerless files and
// Megatron-LM / GPT-NeoX indexed datasets, memory-mapped and read as one stream of tokens.
#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

#include "data.hpp"
#include "mapped_files.hpp"

namespace fsdp::app {
namespace {

std::int32_t le_int32(const unsigned char* p) {
  return static_cast<std::int32_t>(static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 | static_cast<std::uint32_t>(p[2]) << 16 |
                                   static_cast<std::uint32_t>(p[3]) << 24);
}

std::uint64_t le_uint64(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int b = 7; b >= 0; --b) v = v << 8 | p[b];
  return v;
}

/// Token `t` of a run of `e` elements starting at `p` (little-endian).
std::int64_t element_at(const unsigned char* p, std::int64_t t, TokenElement e) {
  switch (e) {
    case TokenElement::kUint8: return p[t];
    case TokenElement::kInt8: return static_cast<std::int8_t>(p[t]);
    case TokenElement::kInt16: return static_cast<std::int16_t>(static_cast<std::uint16_t>(p[2 * t] | p[2 * t + 1] << 8));
    case TokenElement::kUint16: return static_cast<std::uint16_t>(p[2 * t] | p[2 * t + 1] << 8);
    case TokenElement::kInt32: return le_int32(p + 4 * t);
    case TokenElement::kUint32: return static_cast<std::uint32_t>(le_int32(p + 4 * t));
    case TokenElement::kInt64: return static_cast<std::int64_t>(le_uint64(p + 8 * t));
  }
  return 0;
}

/// The whole of `path`, mapped read-only; DataError naming it (as `what`) when it cannot be.
std::pair<const unsigned char*, std::size_t> map_whole_file(const std::string& path, const char* what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw DataError(std::string("cannot open ") + what + " '" + path + "': " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw DataError(std::string(what) + " '" + path + "' is not a regular file");
  }
  const auto bytes = static_cast<std::size_t>(st.st_size);
  if (bytes == 0) {
    ::close(fd);
    throw DataError(std::string(what) + " '" + path + "' is empty");
  }
  void* m = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) throw DataError(std::string("cannot map ") + what + " '" + path + "': " + std::strerror(errno));
  mapped_files::add(static_cast<const unsigned char*>(m), bytes, path);
  return {static_cast<const unsigned char*>(m), bytes};
}

void unmap_file(const unsigned char* map, std::size_t bytes) {
  mapped_files::remove(map);
  ::munmap(const_cast<unsigned char*>(map), bytes);
}

/// Megatron's dtype codes (megatron/core/datasets/indexed_dataset.py, DType; GPT-NeoX uses the same).
std::optional<TokenElement> element_of_code(unsigned code) {
  switch (code) {
    case 1: return TokenElement::kUint8;
    case 2: return TokenElement::kInt8;
    case 3: return TokenElement::kInt16;
    case 4: return TokenElement::kInt32;
    case 5: return TokenElement::kInt64;
    case 8: return TokenElement::kUint16;
    default: return std::nullopt;
  }
}

}  // namespace

int token_element_bytes(TokenElement e) noexcept {
  switch (e) {
    case TokenElement::kUint8:
    case TokenElement::kInt8: return 1;
    case TokenElement::kInt16:
    case TokenElement::kUint16: return 2;
    case TokenElement::kInt32:
    case TokenElement::kUint32: return 4;
    case TokenElement::kInt64: return 8;
  }
  return 1;
}

TokenStream TokenStream::open(const std::string& pattern, TokenFormat format) {
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
  std::vector<std::string> paths;
  for (std::size_t i = 0; rc == 0 && i < g.gl_pathc; ++i) paths.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  if (rc == GLOB_NOMATCH || paths.empty()) throw DataError("no token files match '" + pattern + "'");
  if (rc != 0) throw DataError("cannot list the token files of '" + pattern + "': " + std::strerror(errno));
  std::sort(paths.begin(), paths.end());
  TokenStream stream;
  for (const auto& path : paths) {
    File f;
    f.path = path;
    std::tie(f.map, f.map_bytes) = map_whole_file(path, "token file");
    stream.files_.push_back(f);  // owned from here: the destructor unmaps it if a check below throws
    File& file = stream.files_.back();
    const auto bytes = static_cast<std::int64_t>(file.map_bytes);
    if (format == TokenFormat::kLlmc) {
      if (bytes < kLlmcHeaderBytes)
        throw DataError("token file '" + path + "' has " + std::to_string(bytes) + " bytes, less than llm.c's header of " +
                        std::to_string(kLlmcHeaderBytes) + " (data.token_format = \"llmc\"; headerless files are \"uint16\" or \"uint32\")");
      const std::int32_t magic = le_int32(file.map), version = le_int32(file.map + 4), count = le_int32(file.map + 8);
      if (magic == kLlmcMagicUint16) {
        file.element = TokenElement::kUint16;
        if (version != kLlmcVersionUint16)
          throw DataError("token file '" + path + "': version " + std::to_string(version) + " at byte offset 4; llm.c's uint16 shards (magic " +
                          std::to_string(kLlmcMagicUint16) + ") have version " + std::to_string(kLlmcVersionUint16));
      } else if (magic == kLlmcMagicUint32) {
        file.element = TokenElement::kUint32;
        if (version != kLlmcVersionUint32)
          throw DataError("token file '" + path + "': version " + std::to_string(version) + " at byte offset 4; llm.c's uint32 shards (magic " +
                          std::to_string(kLlmcMagicUint32) + ") have version " + std::to_string(kLlmcVersionUint32));
      } else {
        throw DataError("token file '" + path + "': magic " + std::to_string(magic) + " at byte offset 0 is not llm.c's (" +
                        std::to_string(kLlmcMagicUint16) + " or " + std::to_string(kLlmcMagicUint32) +
                        "); headerless files are data.token_format = \"uint16\" or \"uint32\"");
      }
      if (count < 0) throw DataError("token file '" + path + "': token count " + std::to_string(count) + " at byte offset 8");
      file.data_offset = kLlmcHeaderBytes;
      file.tokens = count;
      const int width = token_element_bytes(file.element);
      const std::int64_t expected = kLlmcHeaderBytes + static_cast<std::int64_t>(count) * width;
      if (bytes != expected)
        throw DataError("token file '" + path + "' has " + std::to_string(bytes) + " bytes; its header (byte offset 8) counts " +
                        std::to_string(count) + " tokens of " + std::to_string(width) + " bytes, " + std::to_string(expected) +
                        " bytes with the header");
    } else {
      file.element = format == TokenFormat::kUint16 ? TokenElement::kUint16 : TokenElement::kUint32;
      const int width = token_element_bytes(file.element);
      // An llm.c shard read headerless would train on its header and, at the other width, on halves or
      // pairs of its tokens.
      if (bytes >= kLlmcHeaderBytes) {
        const std::int32_t magic = le_int32(file.map), version = le_int32(file.map + 4);
        if ((magic == kLlmcMagicUint16 && version == kLlmcVersionUint16) || (magic == kLlmcMagicUint32 && version == kLlmcVersionUint32))
          throw DataError("token file '" + path + "' starts with llm.c's header (magic " + std::to_string(magic) +
                          " at byte offset 0): it is data.token_format = \"llmc\", not \"" + (format == TokenFormat::kUint16 ? "uint16" : "uint32") +
                          "\"");
      }
      if (bytes % width != 0)
        throw DataError("token file '" + path + "' has " + std::to_string(bytes) + " bytes, not a whole number of " + std::to_string(width) +
                        "-byte tokens");
      file.tokens = bytes / width;
    }
    if (file.tokens == 0) throw DataError("token file '" + path + "' holds no tokens");
    file.first = stream.total_;
    stream.total_ += file.tokens;
  }
  return stream;
}

TokenStream TokenStream::open_indexed(const std::string& prefix_or_file) {
  std::string prefix = prefix_or_file;
  for (const char* ext : {".bin", ".idx"})
    if (prefix.size() > 4 && prefix.ends_with(ext)) prefix.resize(prefix.size() - 4);
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  const auto [idx, idx_bytes] = map_whole_file(idx_path, "Megatron index");
  struct Unmap {
    const unsigned char* map;
    std::size_t bytes;
    ~Unmap() { unmap_file(map, bytes); }
  } unmap_idx{idx, idx_bytes};
  const auto in_idx = [&](std::int64_t offset) { return "index '" + idx_path + "' at byte offset " + std::to_string(offset); };
  const auto size = static_cast<std::int64_t>(idx_bytes);
  if (size < kIndexedHeaderBytes)
    throw DataError("index '" + idx_path + "' has " + std::to_string(size) + " bytes, less than the " + std::to_string(kIndexedHeaderBytes) +
                    "-byte header of a Megatron indexed dataset");
  if (std::string_view(reinterpret_cast<const char*>(idx), kIndexedMagic.size()) != kIndexedMagic)
    throw DataError(in_idx(0) + ": not a Megatron indexed dataset (its magic is \"MMIDIDX\" and two zero bytes)");
  if (const std::uint64_t version = le_uint64(idx + 9); version != kIndexedVersion)
    throw DataError(in_idx(9) + ": version " + std::to_string(version) + "; fsdp reads version " + std::to_string(kIndexedVersion));
  const unsigned code = idx[17];
  const auto element = element_of_code(code);
  if (!element)
    throw DataError(in_idx(17) + ": dtype code " + std::to_string(code) +
                    (code == 6 || code == 7 ? " is a floating-point type, not token ids"
                                            : " is not one of Megatron's (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16)"));
  const std::uint64_t sequences = le_uint64(idx + 18), documents = le_uint64(idx + 26);
  // Lengths (int32), pointers (int64) and document indices (int64); a multimodal index adds one mode
  // byte per sequence, which text training does not use.
  const std::uint64_t limit = static_cast<std::uint64_t>(size);
  if (sequences > limit / 12 || documents > limit / 8 || kIndexedHeaderBytes + 12 * sequences + 8 * documents > limit)
    throw DataError("index '" + idx_path + "' has " + std::to_string(size) + " bytes, too few for the " + std::to_string(sequences) +
                    " sequences (byte offset 18) and " + std::to_string(documents) + " document indices (byte offset 26) its header counts");
  const auto n = static_cast<std::int64_t>(sequences), d = static_cast<std::int64_t>(documents);
  const std::int64_t lengths_at = kIndexedHeaderBytes, pointers_at = lengths_at + 4 * n, documents_at = pointers_at + 8 * n;

  TokenStream stream;
  File f;
  f.path = bin_path;
  std::tie(f.map, f.map_bytes) = map_whole_file(bin_path, "Megatron data file");
  stream.files_.push_back(f);
  File& file = stream.files_.back();
  file.element = *element;
  const int width = token_element_bytes(file.element);
  const auto bin_bytes = static_cast<std::int64_t>(file.map_bytes);
  // fsdp reads the sequences as one stream: each starts where the one before ends (as Megatron's
  // writer and its merge tool lay them out).
  std::int64_t tokens = 0;
  std::vector<std::int64_t> sequence_starts(static_cast<std::size_t>(n) + 1);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int32_t length = le_int32(idx + lengths_at + 4 * i);
    if (length < 0) throw DataError(in_idx(lengths_at + 4 * i) + ": sequence " + std::to_string(i) + " has length " + std::to_string(length));
    const auto pointer = static_cast<std::int64_t>(le_uint64(idx + pointers_at + 8 * i));
    if (pointer != tokens * width)
      throw DataError(in_idx(pointers_at + 8 * i) + ": sequence " + std::to_string(i) + " starts at byte " + std::to_string(pointer) + " of '" +
                      bin_path + "', not at byte " + std::to_string(tokens * width) +
                      (i == 0 ? std::string(", the file's start") : " where sequence " + std::to_string(i - 1) + " ends") +
                      "; fsdp reads the sequences back to back");
    sequence_starts[static_cast<std::size_t>(i)] = tokens;
    tokens += length;
    if (tokens * width > bin_bytes)
      throw DataError(in_idx(pointers_at + 8 * i) + ": sequence " + std::to_string(i) + " ends at byte " + std::to_string(tokens * width) +
                      ", past the end of '" + bin_path + "' (" + std::to_string(bin_bytes) + " bytes)");
  }
  sequence_starts[static_cast<std::size_t>(n)] = tokens;
  // Bytes past the last sequence are not read (as Megatron's reader), but a .bin that holds exactly the
  // index's token count at another width is another dtype's: read at this one, every token would be wrong.
  for (const int other : {1, 2, 4, 8})
    if (other != width && tokens > 0 && bin_bytes == tokens * other)
      throw DataError("'" + bin_path + "' has " + std::to_string(bin_bytes) + " bytes: the " + std::to_string(tokens) + " tokens of its index '" +
                      idx_path + "' at " + std::to_string(other) + " bytes each, where the index's dtype has " + std::to_string(width) +
                      ": the .bin and .idx are of different datasets or dtypes");
  // Document indices: 0, then the sequence index that ends each document (the next one's first).
  // Megatron's writer always writes the leading 0; without it its reader counts -1 documents.
  if (d == 0) throw DataError(in_idx(26) + ": 0 document indices; a Megatron index holds at least the first, 0, and one per document's end");
  for (std::int64_t k = 0; k < d; ++k) {
    const auto at = static_cast<std::int64_t>(le_uint64(idx + documents_at + 8 * k));
    const std::int64_t before = k == 0 ? 0 : static_cast<std::int64_t>(le_uint64(idx + documents_at + 8 * (k - 1)));
    const bool ok = k == 0 ? at == 0 : at >= before && at <= n;
    if (!ok)
      throw DataError(in_idx(documents_at + 8 * k) + ": document index " + std::to_string(k) + " is " + std::to_string(at) +
                      (k == 0 ? ", not 0" : "; the indices must not decrease and stay within the " + std::to_string(n) + " sequences"));
    if (k == 0 || at != before) stream.document_starts_.push_back(sequence_starts[static_cast<std::size_t>(at)]);
  }
  if (d > 0 && static_cast<std::int64_t>(le_uint64(idx + documents_at + 8 * (d - 1))) != n)
    throw DataError(in_idx(documents_at + 8 * (d - 1)) + ": the last document index is " +
                    std::to_string(le_uint64(idx + documents_at + 8 * (d - 1))) + ", not the sequence count " + std::to_string(n));
  if (stream.document_starts_.back() != tokens) stream.document_starts_.push_back(tokens);
  if (tokens == 0) throw DataError("indexed dataset '" + prefix + "' (" + idx_path + ") holds no tokens");
  file.tokens = tokens;
  stream.total_ = tokens;
  return stream;
}

TokenStream::TokenStream(TokenStream&& other) noexcept
    : files_(std::move(other.files_)), document_starts_(std::move(other.document_starts_)), total_(std::exchange(other.total_, 0)) {
  other.files_.clear();
}

TokenStream& TokenStream::operator=(TokenStream&& other) noexcept {
  if (this != &other) {
    for (const auto& f : files_) unmap_file(f.map, f.map_bytes);
    files_ = std::move(other.files_);
    other.files_.clear();
    document_starts_ = std::move(other.document_starts_);
    total_ = std::exchange(other.total_, 0);
  }
  return *this;
}

TokenStream::~TokenStream() {
  for (const auto& f : files_) unmap_file(f.map, f.map_bytes);
}

std::size_t TokenStream::file_of(std::int64_t i) const {
  if (i < 0 || i >= total_) throw DataError("token " + std::to_string(i) + " is outside the stream of " + std::to_string(total_) + " tokens");
  const auto it = std::upper_bound(files_.begin(), files_.end(), i, [](std::int64_t v, const File& f) { return v < f.first; });
  return static_cast<std::size_t>(std::distance(files_.begin(), it) - 1);
}

std::int64_t TokenStream::at(std::int64_t i) const {
  const File& f = files_[file_of(i)];
  return element_at(f.map + f.data_offset, i - f.first, f.element);
}

void TokenStream::read(std::int64_t first, std::int64_t n, std::int64_t* out) const {
  if (n <= 0) return;
  std::size_t k = file_of(first);
  for (std::int64_t done = 0; done < n;) {
    const File& f = files_.at(k);
    const std::int64_t begin = first + done - f.first;
    const std::int64_t take = std::min(n - done, f.tokens - begin);
    const unsigned char* p = f.map + f.data_offset;
    if (f.element == TokenElement::kUint16)  // llm.c's and most Megatron corpora: the common case unrolled
      for (std::int64_t t = 0; t < take; ++t) out[done + t] = p[2 * (begin + t)] | p[2 * (begin + t) + 1] << 8;
    else
      for (std::int64_t t = 0; t < take; ++t) out[done + t] = element_at(p, begin + t, f.element);
    done += take;
    ++k;
  }
}

std::string TokenStream::where(std::int64_t i) const {
  const File& f = files_[file_of(i)];
  return "file '" + f.path + "' at byte offset " + std::to_string(f.data_offset + (i - f.first) * token_element_bytes(f.element));
}

void TokenStream::check_vocab(std::int64_t first, std::int64_t last, std::int64_t vocab) const {
  first = std::max<std::int64_t>(first, 0);
  last = std::min(last, total_);
  if (first >= last) return;
  for (std::size_t k = file_of(first); k < files_.size() && files_[k].first < last; ++k) {
    const File& f = files_[k];
    const std::int64_t begin = std::max(first, f.first) - f.first, end = std::min(last, f.first + f.tokens) - f.first;
    const unsigned char* p = f.map + f.data_offset;
    for (std::int64_t t = begin; t < end; ++t) {
      const std::int64_t v = element_at(p, t, f.element);
      if (v < 0 || v >= vocab)
        throw DataError("token " + std::to_string(v) + " in " + where(f.first + t) +
                        (v < 0 ? " is negative" : " is not below model.vocab_size " + std::to_string(vocab)));
    }
  }
}

}  // namespace fsdp::app
