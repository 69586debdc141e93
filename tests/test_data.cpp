// The data layer of fsdp-train (app/data.hpp): IDX files (raw and gzip) and their errors, MNIST splits,
// the DistributedSampler and its world-size invariance, token data, the text reader, the Prefetcher
// (token files: test_token_files.cpp).
// No MPI, no LibTorch.
#define BOOST_TEST_MODULE fsdp_data
#include <boost/test/unit_test.hpp>

#include <zlib.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <stdexcept>
#include <thread>

#include "data.hpp"
#include "data_test_helpers.hpp"

namespace fs = std::filesystem;
using namespace fsdp::app;
using fsdp::test::Bytes;
using fsdp::test::expect_data_error;
using fsdp::test::TempDir;
using fsdp::test::write_raw;

namespace {

Bytes idx_bytes(std::uint8_t type, const std::vector<std::uint32_t>& dims, const Bytes& data) {
  Bytes out = {0, 0, type, static_cast<std::uint8_t>(dims.size())};
  for (const auto d : dims)
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<std::uint8_t>(d >> shift));
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

void write_gz(const std::string& path, const Bytes& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  BOOST_TEST_REQUIRE(f != nullptr);
  if (!bytes.empty()) BOOST_TEST_REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) == static_cast<int>(bytes.size()));
  BOOST_TEST_REQUIRE(gzclose(f) == Z_OK);
}

Bytes read_raw(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

Bytes pattern(std::size_t n, unsigned mul = 7) {
  Bytes b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>(i * mul + 3);
  return b;
}

std::vector<std::int64_t> sorted(std::vector<std::int64_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

// ---- IDX ----------------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(idx_round_trip_raw_and_gzip) {
  TempDir dir;
  const auto data = pattern(3 * 2 * 5);
  const auto file = idx_bytes(0x08, {3, 2, 5}, data);
  write_raw(dir / "a.idx", file);
  write_gz(dir / "a.idx.gz", file);
  for (const auto* name : {"a.idx", "a.idx.gz"}) {
    const auto a = read_idx(dir / name);
    BOOST_TEST(a.dims == (std::vector<std::int64_t>{3, 2, 5}), name);
    BOOST_TEST(a.data == data, name);
  }
  BOOST_TEST(read_raw(dir / "a.idx.gz")[0] == 0x1F);  // really compressed
  // Large dims (big-endian > 255) and an empty array.
  write_gz(dir / "b.gz", idx_bytes(0x08, {70000}, pattern(70000, 13)));
  BOOST_TEST(read_idx(dir / "b.gz").data == pattern(70000, 13));
  write_raw(dir / "empty", idx_bytes(0x08, {0, 28}, {}));
  const auto e = read_idx(dir / "empty");
  BOOST_TEST(e.dims == (std::vector<std::int64_t>{0, 28}));
  BOOST_TEST(e.data.empty());
}

BOOST_AUTO_TEST_CASE(idx_errors_name_the_file_and_the_problem) {
  TempDir dir;
  expect_data_error([&] { read_idx(dir / "nope.idx"); }, {"nope.idx", "not found"});
  expect_data_error([&] { read_idx(dir.path.string()); }, {"is a directory"});

  write_raw(dir / "text", {'h', 'e', 'l', 'l', 'o', '\n'});
  expect_data_error([&] { read_idx(dir / "text"); }, {"text", "not an IDX file", "bad magic 0x68 0x65"});
  write_gz(dir / "short.gz", {0, 0});
  expect_data_error([&] { read_idx(dir / "short.gz"); }, {"short.gz", "not an IDX file"});
  write_raw(dir / "nodims", idx_bytes(0x08, {}, {}));
  expect_data_error([&] { read_idx(dir / "nodims"); }, {"bad magic"});

  write_gz(dir / "float.gz", idx_bytes(0x0D, {2}, Bytes(8)));
  expect_data_error([&] { read_idx(dir / "float.gz"); }, {"float.gz", "unsupported IDX element type 0x0D (float32)"});

  // Data shorter than the dims say, raw and gzip.
  auto file = idx_bytes(0x08, {3, 10}, pattern(30));
  file.erase(file.end() - 10, file.end());
  write_raw(dir / "trunc", file);
  write_gz(dir / "trunc.gz", file);
  for (const auto* name : {"trunc", "trunc.gz"})
    expect_data_error([&] { read_idx(dir / name); }, {name, "truncated", "expected 30 bytes of data, found 20"});
  write_raw(dir / "trunc_dims", {0, 0, 8, 3, 0, 0, 0, 5, 0, 0});
  expect_data_error([&] { read_idx(dir / "trunc_dims"); }, {"truncated", "dimensions"});

  // A .gz file cut short: some data decompresses, then the stream ends.
  write_gz(dir / "full.gz", idx_bytes(0x08, {5000}, pattern(5000, 31)));
  auto gz = read_raw(dir / "full.gz");
  write_raw(dir / "cut.gz", Bytes(gz.begin(), gz.begin() + static_cast<std::ptrdiff_t>(gz.size() / 2)));
  expect_data_error([&] { read_idx(dir / "cut.gz"); }, {"cut.gz", "truncated", "gzip stream ends early"});
  // All data present, only the gzip trailer (CRC, length) missing: still damaged.
  write_raw(dir / "notrailer.gz", Bytes(gz.begin(), gz.end() - 4));
  expect_data_error([&] { read_idx(dir / "notrailer.gz"); }, {"notrailer.gz", "truncated"});
  // A flipped byte in the compressed data.
  gz[gz.size() / 2] ^= 0xFF;
  write_raw(dir / "flip.gz", gz);
  BOOST_CHECK_THROW(read_idx(dir / "flip.gz"), DataError);

  auto longer = idx_bytes(0x08, {4}, pattern(4));
  longer.insert(longer.end(), {1, 2, 3});
  write_gz(dir / "trailing.gz", longer);
  expect_data_error([&] { read_idx(dir / "trailing.gz"); }, {"trailing.gz", "trailing garbage: 3 bytes after the 4 bytes"});
}

// ---- MNIST splits -------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(mnist_split_from_a_fake_directory) {
  TempDir dir;
  const Bytes labels = {0, 9, 3, 3, 7};
  write_gz(dir / "train-images-idx3-ubyte.gz", idx_bytes(0x08, {5, 4, 3}, pattern(60)));
  write_gz(dir / "train-labels-idx1-ubyte.gz", idx_bytes(0x08, {5}, labels));
  write_raw(dir / "t10k-images-idx3-ubyte", idx_bytes(0x08, {2, 4, 3}, pattern(24, 5)));
  write_raw(dir / "t10k-labels-idx1-ubyte", idx_bytes(0x08, {2}, {1, 2}));

  const auto train = load_mnist_split(dir.path.string(), true);
  BOOST_TEST(train.n == 5);
  BOOST_TEST(train.rows == 4);
  BOOST_TEST(train.cols == 3);
  BOOST_TEST(train.num_classes == 10);
  BOOST_TEST(train.images == pattern(60));
  BOOST_TEST(train.labels == labels);
  const auto test = load_mnist_split(dir.path.string(), false);
  BOOST_TEST(test.n == 2);
  BOOST_TEST(test.images == pattern(24, 5));

  // Count mismatch: both files named.
  write_raw(dir / "t10k-labels-idx1-ubyte", idx_bytes(0x08, {3}, {1, 2, 3}));
  expect_data_error([&] { load_mnist_split(dir.path.string(), false); },
                    {"count mismatch", "t10k-images-idx3-ubyte has 2 images", "t10k-labels-idx1-ubyte has 3 labels"});
  // A label out of range.
  write_raw(dir / "t10k-labels-idx1-ubyte", idx_bytes(0x08, {2}, {1, 10}));
  expect_data_error([&] { load_mnist_split(dir.path.string(), false); }, {"t10k-labels-idx1-ubyte", "label 10 at index 1 is out of range [0, 10)"});
  // Images that are not 3-D.
  write_raw(dir / "t10k-images-idx3-ubyte", idx_bytes(0x08, {2, 12}, pattern(24)));
  expect_data_error([&] { load_mnist_split(dir.path.string(), false); }, {"t10k-images-idx3-ubyte", "expected 3 dimensions"});
  // A missing file lists the names tried.
  fs::remove(dir.path / "train-labels-idx1-ubyte.gz");
  expect_data_error([&] { load_mnist_split(dir.path.string(), true); },
                    {"train labels not found", "train-labels-idx1-ubyte, train-labels-idx1-ubyte.gz"});
  expect_data_error([&] { load_mnist_split(dir / "nowhere", true); }, {"no such directory"});
}

BOOST_AUTO_TEST_CASE(real_fashion_mnist_if_installed) {
  const char* env = std::getenv("FSDP_FASHION_MNIST_DIR");
  const std::string dir = env ? env : "/usr/share/datasets/fashion-mnist";
  if (!fs::is_directory(dir)) {
    BOOST_TEST_MESSAGE("skipped: " << dir << " not found (Debian package dataset-fashion-mnist)");
    return;
  }
  const auto train = load_mnist_split(dir, true);
  const auto test = load_mnist_split(dir, false);
  BOOST_TEST(train.n == 60000);
  BOOST_TEST(test.n == 10000);
  for (const auto* s : {&train, &test}) {
    BOOST_TEST(s->rows == 28);
    BOOST_TEST(s->cols == 28);
    BOOST_TEST(s->images.size() == static_cast<std::size_t>(s->n * 28 * 28));
    BOOST_TEST(*std::max_element(s->labels.begin(), s->labels.end()) == 9);
    // Fashion-MNIST is balanced: every class has exactly n / 10 examples.
    std::array<std::int64_t, 10> count{};
    for (const auto l : s->labels) ++count[l];
    for (const auto c : count) BOOST_TEST(c == s->n / 10);
  }
}

// ---- sampler ------------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(permutation_is_fixed_across_platforms) {
  // mt19937_64 and our integer-only Fisher-Yates are fully specified: these values hold everywhere.
  // (If this fails, every seeded run's data order changed: resumed runs would no longer match.)
  BOOST_TEST(random_permutation(10, 42) == (std::vector<std::int64_t>{1, 7, 9, 0, 3, 8, 4, 2, 5, 6}));
  for (std::int64_t n : {0, 1, 2, 7, 100}) {
    auto p = random_permutation(n, 7);
    std::vector<std::int64_t> iota(static_cast<std::size_t>(n));
    std::iota(iota.begin(), iota.end(), std::int64_t{0});
    BOOST_TEST(sorted(p) == iota);
  }
}

BOOST_AUTO_TEST_CASE(sampler_partitions_and_pads_like_pytorch) {
  for (std::int64_t n = 0; n <= 23; ++n) {
    for (int replicas = 1; replicas <= 5; ++replicas) {
      for (const bool shuffle : {false, true}) {
        // The reference: PyTorch's recipe written out on the same global order.
        std::vector<std::int64_t> order(static_cast<std::size_t>(n));
        std::iota(order.begin(), order.end(), std::int64_t{0});
        if (shuffle) order = random_permutation(n, 11 + 3);
        const std::int64_t per_rank = (n + replicas - 1) / replicas;
        std::vector<std::int64_t> all;
        for (int r = 0; r < replicas; ++r) {
          DistributedSampler s(n, replicas, r, shuffle, 11);
          s.set_epoch(3);
          BOOST_TEST(s.num_samples() == per_rank);
          const auto mine = s.indices();
          BOOST_TEST_REQUIRE(static_cast<std::int64_t>(mine.size()) == per_rank);
          for (std::int64_t j = 0; j < per_rank; ++j) {
            const auto pos = r + j * replicas;
            BOOST_TEST(mine[static_cast<std::size_t>(j)] == order[static_cast<std::size_t>(pos % n)]);
          }
          all.insert(all.end(), mine.begin(), mine.end());
        }
        // Every index appears; only the padding (total - n of them) repeats.
        std::set<std::int64_t> distinct(all.begin(), all.end());
        BOOST_TEST(static_cast<std::int64_t>(distinct.size()) == n);
        BOOST_TEST(static_cast<std::int64_t>(all.size()) == per_rank * replicas);
        if (n % replicas == 0) BOOST_TEST(static_cast<std::int64_t>(all.size()) == n);  // disjoint cover
      }
    }
  }
  // Padding repeats the first indices, cyclically when n < replicas.
  std::vector<std::int64_t> got;
  for (int r = 0; r < 8; ++r) got.push_back(DistributedSampler(3, 8, r, false, 0).indices().at(0));
  BOOST_TEST(got == (std::vector<std::int64_t>{0, 1, 2, 0, 1, 2, 0, 1}));
  BOOST_CHECK_THROW(DistributedSampler(10, 0, 0, true, 0), DataError);
  BOOST_CHECK_THROW(DistributedSampler(10, 2, 2, true, 0), DataError);
  BOOST_CHECK_THROW(DistributedSampler(-1, 2, 0, true, 0), DataError);
}

BOOST_AUTO_TEST_CASE(sampler_is_seeded_and_reshuffles_per_epoch) {
  DistributedSampler a(1000, 3, 1, true, 5), b(1000, 3, 1, true, 5), c(1000, 3, 1, true, 6);
  const auto e0 = a.indices();
  BOOST_TEST(e0 == b.indices());  // same seed, same epoch
  BOOST_TEST(e0 != c.indices());  // another seed
  a.set_epoch(1);
  BOOST_TEST(a.epoch() == 1);
  BOOST_TEST(a.indices() != e0);  // next epoch reshuffles
  a.set_epoch(0);
  BOOST_TEST(a.indices() == e0);  // and is reproducible
  DistributedSampler plain(10, 3, 1, false, 5);
  plain.set_epoch(4);  // no shuffle: the epoch does not matter
  BOOST_TEST(plain.indices() == (std::vector<std::int64_t>{1, 4, 7, 0}));
}

BOOST_AUTO_TEST_CASE(n_ranks_at_batch_b_see_what_one_rank_sees_at_batch_n_b) {
  for (int world = 1; world <= 4; ++world) {
    for (std::int64_t b : {1, 3, 8}) {
      const std::int64_t n = world * b * 5;
      DistributedSampler single(n, 1, 0, true, 99);
      for (std::int64_t epoch = 0; epoch < 3; ++epoch) {
        single.set_epoch(epoch);
        const auto big = single.indices();
        std::vector<std::vector<std::int64_t>> per_rank;
        for (int r = 0; r < world; ++r) {
          DistributedSampler s(n, world, r, true, 99);
          s.set_epoch(epoch);
          per_rank.push_back(s.indices());
          BOOST_TEST(num_batches(s.num_samples(), b) == num_batches(n, world * b));
        }
        for (std::int64_t k = 0; k < num_batches(n, world * b); ++k) {
          std::vector<std::int64_t> merged;
          for (const auto& mine : per_rank) {
            const auto part = batch_indices(mine, b, k);
            BOOST_TEST(static_cast<std::int64_t>(part.size()) == b);
            merged.insert(merged.end(), part.begin(), part.end());
          }
          BOOST_TEST(sorted(merged) == sorted(batch_indices(big, world * b, k)),
                     "world " << world << " b " << b << " epoch " << epoch << " step " << k);
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(batches_are_consecutive_chunks) {
  const std::vector<std::int64_t> idx = {9, 8, 7, 6, 5, 4, 3};
  BOOST_TEST(num_batches(7, 3) == 3);
  BOOST_TEST(num_batches(0, 3) == 0);
  BOOST_TEST(batch_indices(idx, 3, 0) == (std::vector<std::int64_t>{9, 8, 7}));
  BOOST_TEST(batch_indices(idx, 3, 2) == (std::vector<std::int64_t>{3}));
  BOOST_CHECK_THROW(batch_indices(idx, 3, 3), DataError);
  BOOST_CHECK_THROW(num_batches(7, 0), DataError);
}

// ---- tokens -------------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(synthetic_tokens_are_deterministic_in_range_and_learnable) {
  const auto a = make_synthetic_tokens(50, 16, 37, 1);
  BOOST_TEST(a.n == 50);
  BOOST_TEST(a.length == 17);
  BOOST_TEST(a.vocab == 37);
  BOOST_TEST(a.tokens.size() == 50u * 17u);
  BOOST_TEST(a.tokens == make_synthetic_tokens(50, 16, 37, 1).tokens);
  BOOST_TEST(a.tokens != make_synthetic_tokens(50, 16, 37, 2).tokens);
  for (const auto t : a.tokens) BOOST_TEST_REQUIRE((t >= 0 && t < 37));
  // A prefix of the sequences does not depend on how many are made.
  const auto more = make_synthetic_tokens(80, 16, 37, 1);
  BOOST_TEST(std::equal(a.tokens.begin(), a.tokens.end(), more.tokens.begin()));
  // Golden values: the data is the same on every platform.
  const auto g = make_synthetic_tokens(1, 7, 50, 3);
  BOOST_TEST(g.tokens == (std::vector<std::int32_t>{17, 13, 44, 45, 19, 35, 6, 44}));

  // The empirical conditional entropy of a long sample matches synthetic_token_entropy, well below a
  // uniform guess (so a model has something to learn), and two seeds follow the same chain.
  const int vocab = 16;
  auto bigram_entropy = [&](std::uint64_t seed) {
    const auto s = make_synthetic_tokens(4000, 64, vocab, seed);
    std::map<std::pair<int, int>, double> pair_count;
    std::map<int, double> prev_count;
    double total = 0;
    for (std::int64_t i = 0; i < s.n; ++i)
      for (std::int64_t j = 1; j < s.length; ++j) {
        const int p = s.tokens[static_cast<std::size_t>(i * s.length + j - 1)];
        const int t = s.tokens[static_cast<std::size_t>(i * s.length + j)];
        pair_count[{p, t}] += 1;
        prev_count[p] += 1;
        total += 1;
      }
    double h = 0;
    for (const auto& [pt, c] : pair_count) h -= c / total * std::log(c / prev_count[pt.first]);
    return std::pair{h, pair_count};
  };
  const auto [h1, pairs1] = bigram_entropy(10);
  const auto [h2, pairs2] = bigram_entropy(20);
  const double h = synthetic_token_entropy(vocab);
  BOOST_TEST(std::abs(h1 - h) < 0.02, h1 << " vs " << h);
  BOOST_TEST(std::abs(h2 - h) < 0.02, h2 << " vs " << h);
  BOOST_TEST(h < std::log(vocab) - 1.0);
  // Same chain: the most likely successor of every token agrees between the two seeds.
  for (int p = 0; p < vocab; ++p) {
    auto top = [&](const std::map<std::pair<int, int>, double>& pc) {
      int best = -1;
      double best_c = -1;
      for (int t = 0; t < vocab; ++t)
        if (auto it = pc.find({p, t}); it != pc.end() && it->second > best_c) best = t, best_c = it->second;
      return best;
    };
    BOOST_TEST(top(pairs1) == top(pairs2));
  }
  BOOST_TEST(make_synthetic_tokens(3, 4, 16, 10, 1).tokens != make_synthetic_tokens(3, 4, 16, 10, 2).tokens);
  BOOST_TEST(synthetic_token_entropy(1) == 0.0);
  for (const auto t : make_synthetic_tokens(20, 5, 1, 0).tokens) BOOST_TEST(t == 0);
  BOOST_CHECK_THROW(make_synthetic_tokens(1, 0, 5, 0), DataError);
  BOOST_CHECK_THROW(make_synthetic_tokens(1, 4, 0, 0), DataError);
}

// ---- text ---------------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(text_corpus_vocab_splits_and_windows) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 20; ++i) text += "the quick brown fox " + std::to_string(i) + "\n";
  write_raw(dir / "a.txt", Bytes(text.begin(), text.end()));
  const std::int64_t context = 8;
  const auto c = load_text(dir / "a.txt", context, 256);

  std::set<char> distinct(text.begin(), text.end());
  BOOST_TEST(c.vocab == Bytes(distinct.begin(), distinct.end()));  // sorted distinct bytes
  const auto size = static_cast<std::int64_t>(text.size());
  const auto train_bytes = size * 9 / 10;
  for (const auto* s : {&c.train, &c.test}) {
    BOOST_TEST(s->length == context + 1);
    BOOST_TEST(s->vocab == static_cast<int>(c.vocab.size()));
    BOOST_TEST(s->tokens.size() == static_cast<std::size_t>(s->n * s->length));
  }
  BOOST_TEST(c.train.n == (train_bytes - 1) / context);
  BOOST_TEST(c.test.n == (size - train_bytes - 1) / context);
  // Window i of a split decodes to the characters at offset + i * context.
  auto decode = [&](const TokenSplit& s, std::int64_t i) {
    std::string out;
    for (std::int64_t j = 0; j < s.length; ++j)
      out += static_cast<char>(c.vocab[static_cast<std::size_t>(s.tokens[static_cast<std::size_t>(i * s.length + j)])]);
    return out;
  };
  for (std::int64_t i = 0; i < c.train.n; ++i) BOOST_TEST(decode(c.train, i) == text.substr(static_cast<std::size_t>(i * context), context + 1));
  for (std::int64_t i = 0; i < c.test.n; ++i)
    BOOST_TEST(decode(c.test, i) == text.substr(static_cast<std::size_t>(train_bytes + i * context), context + 1));

  // Exactly 10 * context + 1 bytes is the shortest file that works; one less is refused.
  write_raw(dir / "min.txt", Bytes(static_cast<std::size_t>(10 * context + 1), 'x'));
  const auto m = load_text(dir / "min.txt", context, 256);
  BOOST_TEST(m.test.n == 1);
  BOOST_TEST(m.vocab == Bytes{'x'});
  write_raw(dir / "short.txt", Bytes(static_cast<std::size_t>(10 * context), 'x'));
  expect_data_error([&] { load_text(dir / "short.txt", context, 256); }, {"short.txt", "too short", "at least 81 bytes"});
  write_raw(dir / "empty.txt", {});
  expect_data_error([&] { load_text(dir / "empty.txt", context, 256); }, {"empty.txt", "empty"});
  expect_data_error([&] { load_text(dir / "missing.txt", context, 256); }, {"missing.txt", "not found"});
  expect_data_error([&] { load_text(dir / "a.txt", context, 5); }, {"a.txt", "more than max_vocab = 5"});
}

// ---- Prefetcher ---------------------------------------------------------------------------------

namespace {

// A batch whose making takes an index-dependent, uneven time, so workers finish out of order.
std::vector<std::int64_t> slow_batch(std::int64_t i) {
  std::this_thread::sleep_for(std::chrono::microseconds((i * 7919) % 5 * 300));
  return {i, i * i, 1000 - i};
}

}  // namespace

BOOST_AUTO_TEST_CASE(prefetcher_matches_synchronous_loading) {
  const std::int64_t n = 40;
  std::vector<std::vector<std::int64_t>> expected;
  for (std::int64_t i = 0; i < n; ++i) expected.push_back(slow_batch(i));
  for (const int workers : {0, 1, 3}) {
    for (const int depth : {1, 2, 4}) {
      Prefetcher<std::vector<std::int64_t>> p(n, slow_batch, workers, depth);
      std::vector<std::vector<std::int64_t>> got;
      while (auto b = p.next()) got.push_back(std::move(*b));
      BOOST_TEST((got == expected), "workers " << workers << " depth " << depth);
      BOOST_TEST(!p.next().has_value());
    }
  }
  Prefetcher<int> empty(
      0, [](std::int64_t) { return 1; }, 2);
  BOOST_TEST(!empty.next().has_value());
  // Move-only batches work.
  Prefetcher<std::unique_ptr<int>> owned(
      3, [](std::int64_t i) { return std::make_unique<int>(static_cast<int>(i)); }, 2);
  for (int i = 0; i < 3; ++i) BOOST_TEST(**owned.next() == i);
  BOOST_CHECK_THROW(Prefetcher<int>(
                        1, [](std::int64_t) { return 1; }, -1),
                    DataError);
  BOOST_CHECK_THROW(Prefetcher<int>(
                        1, [](std::int64_t) { return 1; }, 1, 0),
                    DataError);
}

BOOST_AUTO_TEST_CASE(prefetcher_rethrows_in_order_and_stops_cleanly) {
  for (const int workers : {0, 1, 3}) {
    std::atomic<std::int64_t> highest{-1};
    auto make = [&](std::int64_t i) {
      std::int64_t h = highest.load();
      while (i > h && !highest.compare_exchange_weak(h, i)) {}
      if (i == 5) throw std::runtime_error("bad batch 5");
      return slow_batch(i);
    };
    Prefetcher<std::vector<std::int64_t>> p(100, make, workers, 3);
    for (std::int64_t i = 0; i < 5; ++i) BOOST_TEST(p.next()->at(0) == i);  // batches before the failure
    for (int again = 0; again < 2; ++again) {
      try {
        p.next();
        BOOST_ERROR("no exception, workers " << workers);
      } catch (const std::runtime_error& e) {
        BOOST_TEST(std::string(e.what()) == "bad batch 5");
      }
    }
    // Bounded: nothing was made more than depth + workers past the failure.
    BOOST_TEST(highest.load() < 5 + 3 + workers);
  }
  // Destroying a prefetcher with batches in flight and unconsumed does not hang.
  for (int round = 0; round < 20; ++round) {
    Prefetcher<std::vector<std::int64_t>> p(1000, slow_batch, 3, 4);
    p.next();
  }
}
