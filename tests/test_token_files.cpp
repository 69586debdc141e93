// Token files of fsdp-train (app/data.hpp, TokenStream): llm.c shards and nanoGPT's headerless files,
// Megatron-LM / GPT-NeoX indexed datasets of every integer dtype code, and the errors that name the file
// and byte offset. No MPI, no LibTorch.
#define BOOST_TEST_MODULE fsdp_token_files
#include <boost/test/unit_test.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "data.hpp"
#include "data_test_helpers.hpp"

using namespace fsdp::app;
using fsdp::test::Bytes;
using fsdp::test::expect_data_error;
using fsdp::test::TempDir;
using fsdp::test::write_raw;

// ---- token shards (llm.c, nanoGPT) ----------------------------------------------------------------

namespace {

void put_le(Bytes& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

/// An llm.c shard: 256 int32 header (magic, version, count), then the tokens.
Bytes llmc_shard(const std::vector<std::uint32_t>& tokens, bool wide, std::int32_t magic = 0, std::int32_t version = -1, std::int64_t count = -1) {
  Bytes out;
  std::vector<std::int32_t> header(256, 0);
  header[0] = magic ? magic : wide ? kLlmcMagicUint32 : kLlmcMagicUint16;
  header[1] = version >= 0 ? version : wide ? kLlmcVersionUint32 : kLlmcVersionUint16;
  header[2] = static_cast<std::int32_t>(count >= 0 ? count : static_cast<std::int64_t>(tokens.size()));
  for (const auto h : header) put_le(out, static_cast<std::uint32_t>(h), 4);
  for (const auto t : tokens) put_le(out, t, wide ? 4 : 2);
  return out;
}

Bytes headerless(const std::vector<std::uint32_t>& tokens, bool wide) {
  Bytes out;
  for (const auto t : tokens) put_le(out, t, wide ? 4 : 2);
  return out;
}

std::vector<std::uint32_t> iota_tokens(std::uint32_t first, std::size_t n, std::uint32_t vocab) {
  std::vector<std::uint32_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = (first + static_cast<std::uint32_t>(i)) % vocab;
  return t;
}

}  // namespace

BOOST_AUTO_TEST_CASE(token_shards_of_every_format_read_as_one_stream) {
  TempDir dir;
  // Two llm.c shards, v1 (uint16) and v7 (uint32): the stream is their concatenation, in name order.
  write_raw(dir / "train_000001.bin", llmc_shard(iota_tokens(10, 7, 97), true));
  write_raw(dir / "train_000000.bin", llmc_shard(iota_tokens(0, 10, 97), false));
  const auto s = TokenStream::open(dir / "train_*.bin", TokenFormat::kLlmc);
  BOOST_TEST(s.num_files() == 2u);
  BOOST_TEST(s.size() == 17);
  for (std::int64_t i = 0; i < 17; ++i) BOOST_TEST(s.at(i) == static_cast<std::uint32_t>(i));
  // A sample that crosses the file boundary.
  std::vector<std::int64_t> out(5);
  s.read(8, 5, out.data());
  BOOST_TEST((out == std::vector<std::int64_t>{8, 9, 10, 11, 12}));
  BOOST_TEST(s.where(10) == "file '" + (dir / "train_000001.bin") + "' at byte offset 1024");
  BOOST_TEST(s.where(3) == "file '" + (dir / "train_000000.bin") + "' at byte offset 1030");
  // Samples of T + 1 tokens, consecutive samples sharing one token: floor((17 - 1) / 4) = 4.
  BOOST_TEST(token_stream_samples(s, 4) == 4);
  // nanoGPT's headerless files, uint16 and uint32, hold the same tokens.
  write_raw(dir / "train.bin", headerless(iota_tokens(0, 17, 97), false));
  write_raw(dir / "wide.bin", headerless(iota_tokens(0, 17, 97), true));
  for (const auto& [name, format] :
       {std::pair{std::string("train.bin"), TokenFormat::kUint16}, std::pair{std::string("wide.bin"), TokenFormat::kUint32}}) {
    const auto h = TokenStream::open(dir / name, format);
    BOOST_TEST(h.size() == 17);
    for (std::int64_t i = 0; i < 17; ++i) BOOST_TEST(h.at(i) == s.at(i));
  }
  BOOST_TEST((parse_token_format("uint32") == TokenFormat::kUint32));
  expect_data_error([] { parse_token_format("int8"); }, {"llmc, uint16 or uint32", "int8"});
  // Moving keeps the mappings valid.
  TokenStream moved = TokenStream::open(dir / "train.bin", TokenFormat::kUint16);
  TokenStream target = std::move(moved);
  BOOST_TEST(target.at(16) == 16u);
  BOOST_TEST(moved.size() == 0);
}

BOOST_AUTO_TEST_CASE(bad_token_files_name_the_file_and_offset) {
  TempDir dir;
  expect_data_error([&] { TokenStream::open(dir / "none_*.bin", TokenFormat::kLlmc); }, {"no token files match", "none_*.bin"});
  write_raw(dir / "magic.bin", llmc_shard(iota_tokens(0, 4, 97), false, 12345));
  expect_data_error([&] { TokenStream::open(dir / "magic.bin", TokenFormat::kLlmc); }, {"magic.bin", "magic 12345 at byte offset 0", "20240520"});
  write_raw(dir / "version.bin", llmc_shard(iota_tokens(0, 4, 97), false, 0, 3));
  expect_data_error([&] { TokenStream::open(dir / "version.bin", TokenFormat::kLlmc); }, {"version.bin", "version 3 at byte offset 4"});
  write_raw(dir / "count.bin", llmc_shard(iota_tokens(0, 4, 97), false, 0, -1, 5));
  expect_data_error([&] { TokenStream::open(dir / "count.bin", TokenFormat::kLlmc); },
                    {"count.bin", "has 1032 bytes", "(byte offset 8) counts 5 tokens", "1034 bytes"});
  write_raw(dir / "short.bin", Bytes(100, 0));
  expect_data_error([&] { TokenStream::open(dir / "short.bin", TokenFormat::kLlmc); }, {"short.bin", "less than llm.c's header"});
  write_raw(dir / "odd.bin", Bytes(7, 1));
  expect_data_error([&] { TokenStream::open(dir / "odd.bin", TokenFormat::kUint16); }, {"odd.bin", "7 bytes", "2-byte tokens"});
  // An llm.c shard read as headerless tokens: its header would be trained on.
  write_raw(dir / "llmc.bin", llmc_shard(iota_tokens(0, 4, 97), true));
  for (const auto format : {TokenFormat::kUint16, TokenFormat::kUint32})
    expect_data_error([&] { TokenStream::open(dir / "llmc.bin", format); },
                      {"llmc.bin' starts with llm.c's header (magic 20240801 at byte offset 0)", "data.token_format = \"llmc\""});
  write_raw(dir / "empty.bin", {});
  expect_data_error([&] { TokenStream::open(dir / "empty.bin", TokenFormat::kUint16); }, {"empty.bin", "is empty"});
  // A token past the vocabulary: the file and the byte offset of that token.
  auto tokens = iota_tokens(0, 20, 97);
  tokens[13] = 97;
  write_raw(dir / "vocab_000000.bin", llmc_shard(iota_tokens(0, 5, 97), false));
  write_raw(dir / "vocab_000001.bin", llmc_shard(tokens, false));
  const auto s = TokenStream::open(dir / "vocab_*.bin", TokenFormat::kLlmc);
  s.check_vocab(0, 18, 97);  // the bad token is stream index 18: outside this range
  expect_data_error([&] { s.check_vocab(10, 25, 97); },
                    {"token 97 in file '" + (dir / "vocab_000001.bin") + "' at byte offset 1050", "not below model.vocab_size 97"});
}

// ---- Megatron-LM / GPT-NeoX indexed datasets --------------------------------------------------------

namespace {

/// An indexed dataset as megatron/core/datasets/indexed_dataset.py lays it out: the index (magic,
/// version, dtype code, counts, int32 lengths, int64 byte pointers, int64 document indices) and the
/// data file (the sequences back to back, `width` bytes per token, little-endian).
struct Indexed {
  Bytes idx, bin;
};

Indexed megatron(const std::vector<std::vector<std::int64_t>>& sequences, const std::vector<std::int64_t>& document_indices, std::uint8_t code,
                 int width) {
  Indexed out;
  for (const char c : std::string("MMIDIDX\0\0", 9)) out.idx.push_back(static_cast<std::uint8_t>(c));
  put_le(out.idx, 1, 8);
  out.idx.push_back(code);
  put_le(out.idx, sequences.size(), 8);
  put_le(out.idx, document_indices.size(), 8);
  for (const auto& s : sequences) put_le(out.idx, s.size(), 4);
  std::uint64_t pointer = 0;
  for (const auto& s : sequences) {
    put_le(out.idx, pointer, 8);
    pointer += s.size() * static_cast<std::uint64_t>(width);
  }
  for (const auto d : document_indices) put_le(out.idx, static_cast<std::uint64_t>(d), 8);
  for (const auto& s : sequences)
    for (const auto t : s) put_le(out.bin, static_cast<std::uint64_t>(t), width);
  return out;
}

void write_indexed(const TempDir& dir, const std::string& name, const Indexed& d) {
  write_raw(dir / (name + ".idx"), d.idx);
  write_raw(dir / (name + ".bin"), d.bin);
}

const std::vector<std::vector<std::int64_t>> kSequences = {{1, 2, 3}, {4, 5}, {6, 7, 8, 9}};
const std::vector<std::int64_t> kDocuments = {0, 2, 3};  // two documents: sequences 0-1 and sequence 2

/// Overwrites `bytes` at `offset` with the little-endian `value`.
void poke(Bytes& bytes, std::size_t offset, std::uint64_t value, int width) {
  for (int i = 0; i < width; ++i) bytes.at(offset + static_cast<std::size_t>(i)) = static_cast<std::uint8_t>(value >> (8 * i));
}

}  // namespace

BOOST_AUTO_TEST_CASE(indexed_datasets_of_every_integer_dtype_read_as_one_stream) {
  TempDir dir;
  for (const auto& [code, width] : std::vector<std::pair<std::uint8_t, int>>{{1, 1}, {2, 1}, {3, 2}, {4, 4}, {5, 8}, {8, 2}}) {
    BOOST_TEST_CONTEXT("dtype code " << int(code)) {
      const std::string name = "corpus_" + std::to_string(code);
      write_indexed(dir, name, megatron(kSequences, kDocuments, code, width));
      // The prefix, or either file's name.
      for (const std::string& path : {dir / name, dir / (name + ".bin"), dir / (name + ".idx")}) {
        const auto s = TokenStream::open_indexed(path);
        BOOST_TEST(s.size() == 9);
        BOOST_TEST(s.num_files() == 1u);
        BOOST_TEST(s.file_path(0) == dir / (name + ".bin"));
        for (std::int64_t i = 0; i < 9; ++i) BOOST_TEST(s.at(i) == i + 1);
        std::vector<std::int64_t> out(4);
        s.read(2, 4, out.data());  // across the first sequence's end
        BOOST_TEST((out == std::vector<std::int64_t>{3, 4, 5, 6}));
        BOOST_TEST((s.document_starts() == std::vector<std::int64_t>{0, 5, 9}));
        BOOST_TEST(s.where(5) == "file '" + dir / (name + ".bin") + "' at byte offset " + std::to_string(5 * width));
        BOOST_TEST(token_stream_samples(s, 4) == 2);
        s.check_vocab(0, 9, 10);
        expect_data_error(
            [&] { s.check_vocab(0, 9, 9); },
            {"token 9 in file '" + dir / (name + ".bin") + "' at byte offset " + std::to_string(8 * width), "not below model.vocab_size 9"});
      }
    }
  }
  // A signed dtype's negative token is named as such; empty documents and sequences are allowed.
  write_indexed(dir, "signed", megatron({{3, -2}, {}, {1}}, {0, 1, 1, 3}, 2, 1));
  const auto s = TokenStream::open_indexed(dir / "signed");
  BOOST_TEST(s.size() == 3);
  BOOST_TEST((s.document_starts() == std::vector<std::int64_t>{0, 2, 3}));
  expect_data_error([&] { s.check_vocab(0, 3, 97); }, {"token -2 in file '" + dir / "signed.bin" + "' at byte offset 1 is negative"});
  // Large ids of a 32-bit vocabulary (Llama 3's 128256) survive int32 and uint16 stops at 65535.
  write_indexed(dir, "wide", megatron({{128255, 70000}}, {0, 1}, 4, 4));
  BOOST_TEST(TokenStream::open_indexed(dir / "wide").at(0) == 128255);
  // A .bin longer than its index describes: the rest is not read.
  auto longer = megatron(kSequences, kDocuments, 8, 2);
  longer.bin.insert(longer.bin.end(), {0xff, 0xff});
  write_indexed(dir, "longer", longer);
  BOOST_TEST(TokenStream::open_indexed(dir / "longer").size() == 9);
  // ... but a .bin holding exactly the index's tokens at another width is another dtype's.
  auto wider = megatron(kSequences, kDocuments, 8, 2);
  wider.bin.resize(wider.bin.size() * 2);
  write_indexed(dir, "wider", wider);
  expect_data_error([&] { TokenStream::open_indexed(dir / "wider"); },
                    {"'" + dir / "wider.bin" + "' has 36 bytes: the 9 tokens of its index '" + dir / "wider.idx" + "' at 4 bytes each",
                     "the index's dtype has 2", "different datasets or dtypes"});
}

BOOST_AUTO_TEST_CASE(bad_indexed_datasets_name_the_file_and_offset) {
  TempDir dir;
  const auto good = megatron(kSequences, kDocuments, 8, 2);
  const std::string idx = dir / "bad.idx";
  auto bad = [&](const std::string& what, const Indexed& d, const std::vector<std::string>& parts) {
    BOOST_TEST_CONTEXT(what) {
      write_indexed(dir, "bad", d);
      expect_data_error([&] { TokenStream::open_indexed(dir / "bad"); }, parts);
    }
  };
  expect_data_error([&] { TokenStream::open_indexed(dir / "missing"); }, {"cannot open Megatron index '" + dir / "missing.idx" + "'"});
  auto d = good;
  d.idx[0] = 'X';
  bad("magic", d, {"index '" + idx + "' at byte offset 0", "not a Megatron indexed dataset"});
  d = good;
  poke(d.idx, 9, 2, 8);
  bad("version", d, {"index '" + idx + "' at byte offset 9: version 2", "reads version 1"});
  for (const auto [code, why] :
       std::vector<std::pair<int, std::string>>{{6, "floating-point"}, {7, "floating-point"}, {9, "not one of Megatron's"}}) {
    d = good;
    d.idx[17] = static_cast<std::uint8_t>(code);
    bad("dtype " + std::to_string(code), d, {"byte offset 17: dtype code " + std::to_string(code), why});
  }
  d = good;
  d.idx.resize(20);
  bad("short header", d, {"index '" + idx + "' has 20 bytes, less than the 34-byte header"});
  d = good;
  d.idx.resize(d.idx.size() - 8);
  bad("truncated index", d, {"index '" + idx + "' has " + std::to_string(good.idx.size() - 8) + " bytes, too few for the 3 sequences"});
  d = good;
  poke(d.idx, 34 + 4, static_cast<std::uint32_t>(-1), 4);
  bad("negative length", d, {"byte offset 38: sequence 1 has length -1"});
  d = good;
  poke(d.idx, 34 + 12 + 8 * 2, 12, 8);  // sequence 2 should start at byte 10
  bad("gap", d, {"byte offset 62: sequence 2 starts at byte 12", "not at byte 10", "back to back"});
  d = good;
  d.bin.resize(16);
  bad("short .bin", d, {"byte offset 62: sequence 2 ends at byte 18, past the end of '" + dir / "bad.bin" + "' (16 bytes)"});
  d = megatron(kSequences, {1, 2, 3}, 8, 2);
  bad("first document index", d, {"byte offset 70: document index 0 is 1, not 0"});
  d = megatron(kSequences, {0, 2, 1, 3}, 8, 2);
  bad("decreasing", d, {"byte offset 86: document index 2 is 1", "must not decrease"});
  d = megatron(kSequences, {0, 2}, 8, 2);
  bad("last document index", d, {"byte offset 78: the last document index is 2, not the sequence count 3"});
  d = megatron(kSequences, {}, 8, 2);
  bad("no document indices", d, {"index '" + idx + "' at byte offset 26: 0 document indices", "at least the first, 0"});
  d = megatron({{}, {}}, {0, 2}, 8, 2);
  d.bin = {0};
  bad("no tokens", d, {"holds no tokens"});
  write_raw(dir / "nobin.idx", good.idx);
  expect_data_error([&] { TokenStream::open_indexed(dir / "nobin"); }, {"cannot open Megatron data file '" + dir / "nobin.bin" + "'"});
}
