// fsdp-train (app layer): the run's data in memory (images or token sequences), its batches as tensors,
// the loss, and the evaluation every epoch.
#pragma once

#include <fsdp/fsdp.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <cstdint>
#include <string>
#include <vector>

#include "data.hpp"
#include "train/cross_entropy.hpp"
#include "mixture.hpp"
#include "models/families.hpp"
#include "run_config.hpp"

namespace fsdp::app {

// ---- data ---------------------------------------------------------------------------------------

/// Token sequences read from a memory-mapped stream (token-shards, indexed): sample i is tokens [i*T, i*T + T].
struct StreamSplit {
  std::shared_ptr<const TokenStream> stream;
  std::int64_t n = 0, length = 0;  ///< samples, tokens per sample (T + 1)
};

/// The training data of one run: images (classification) or token sequences (language modelling),
/// held in memory or (token-shards, indexed) read from memory-mapped files.
struct Dataset {
  bool tokens = false;
  bool streamed = false;  ///< token-shards, indexed: train_stream / test_stream instead of *_tokens
  ImageSplit train_images, test_images;
  TokenSplit train_tokens, test_tokens;
  StreamSplit train_stream, test_stream;
  /// data.sources: each source's samples, numbered one after the other (Blend::offset); the blend
  /// orders them (train_stream is unused).
  std::vector<StreamSplit> train_sources;
  std::shared_ptr<Blend> blend;
  std::int64_t mixture_size = 0;  ///< samples per epoch of the mixture: all sources' (data.train_samples: at most that)
  /// data.document_mask without data.eot_token: batches carry where the .idx says documents begin.
  bool document_starts = false;
  bool has_test = true;
  /// data.kind "text": the distinct bytes its token ids number, as one number (0 for other data): a
  /// text that gained or lost a character maps every id to another one.
  std::int64_t text_vocabulary = 0;
  double mean = 0, stddev = 1;  // image normalization
  std::int64_t train_size() const { return blend ? mixture_size : streamed ? train_stream.n : tokens ? train_tokens.n : train_images.n; }
  std::int64_t test_size() const { return streamed ? test_stream.n : tokens ? test_tokens.n : test_images.n; }
  /// Tokens per sample (inputs and targets together) of a language model's data.
  std::int64_t sequence_length() const { return streamed ? (blend ? train_sources.front().length : train_stream.length) : train_tokens.length; }
  /// The stream and sample of training sample `index` (a mixture's concatenated numbering).
  std::pair<const StreamSplit*, std::int64_t> train_sample(std::int64_t index) const {
    if (!blend) return {&train_stream, index};
    const std::size_t s = blend->source_of(index);
    return {&train_sources[s], index - blend->offset(s)};
  }
};

/// token-shards: the files of the glob `path`; indexed: the Megatron dataset `path` (.bin + .idx); as
/// samples of model.context + 1 tokens. Every token is checked against model.vocab_size, each rank its
/// 1/world of the stream (the failure is agreed by the caller).
inline StreamSplit open_token_split(const RunConfig& cfg, const std::string& path, int rank, int world, DataKind kind) {
  StreamSplit split;
  auto stream =
      std::make_shared<TokenStream>(kind == DataKind::kIndexed ? TokenStream::open_indexed(path) : TokenStream::open(path, cfg.data.token_format));
  const std::int64_t total = stream->size();
  stream->check_vocab(total * rank / world, total * (rank + 1) / world, cfg.model.vocab_size);
  split.n = token_stream_samples(*stream, cfg.model.context);
  split.length = cfg.model.context + 1;
  if (split.n == 0)
    throw DataError("the token files of '" + path + "' hold " + std::to_string(total) +
                    " tokens, fewer than one sample of model.context + 1 = " + std::to_string(split.length));
  split.stream = std::move(stream);
  return split;
}

/// open_token_split of the deck's `key` (data.path, data.val_path): its errors start with the key.
inline StreamSplit open_token_split_of(const char* key, const RunConfig& cfg, const std::string& path, int rank, int world, DataKind kind) {
  try {
    return open_token_split(cfg, path, rank, world, kind);
  } catch (const DataError& e) {
    throw DataError(std::string(key) + ": " + fsdp::message_without_id(e));
  }
}

/// Loads the run's data; `rank` of `world` scans its share of token files for ids past the vocabulary.
inline Dataset load_dataset(const RunConfig& cfg, int rank = 0, int world = 1) {
  Dataset d;
  const DataKind kind = cfg.data.kind;
  const bool lm = is_token_data(kind);
  if (lm != model_family(cfg.model.kind).language_model())
    throw DeckError("data.kind = \"" + to_string(kind) + "\" needs model.kind = " + model_kinds_named(lm) + " (it is \"" + to_string(cfg.model.kind) +
                    "\")");
  if (kind == DataKind::kFashionMnist || kind == DataKind::kMnist) {
    d.train_images = load_mnist_split(cfg.data.path, true);
    d.test_images = load_mnist_split(cfg.data.path, false);
    if (d.train_images.rows != 28 || d.train_images.cols != 28)
      throw DataError("'" + cfg.data.path + "' holds " + std::to_string(d.train_images.rows) + "x" + std::to_string(d.train_images.cols) +
                      " images; the models take 28x28");
    // Normalization constants of the tutorial (MNIST) and the same statistics for Fashion-MNIST.
    d.mean = kind == DataKind::kMnist ? 0.1307 : 0.2860;
    d.stddev = kind == DataKind::kMnist ? 0.3081 : 0.3530;
  } else if (kind == DataKind::kTokens) {
    d.tokens = true;
    const auto n = cfg.data.num_samples;
    const auto context = cfg.model.context;
    const int vocab = static_cast<int>(cfg.model.vocab_size);
    const auto seed = cfg.run.seed;
    d.train_tokens = make_synthetic_tokens(n, context, vocab, seed);
    d.test_tokens = make_synthetic_tokens(std::max<std::int64_t>(n / 10, 1), context, vocab, seed + 1000003);
  } else if (is_token_file_data(kind)) {
    d.tokens = d.streamed = true;
    if (cfg.data.sources.empty()) {
      d.train_stream = open_token_split_of("data.path", cfg, cfg.data.path, rank, world, kind);
    } else {
      std::vector<double> weights;
      std::vector<std::int64_t> sizes;
      for (std::size_t i = 0; i < cfg.data.sources.size(); ++i) {
        const auto& source = cfg.data.sources[i];
        try {
          d.train_sources.push_back(open_token_split(cfg, source.path, rank, world, source.kind));
        } catch (const DataError& e) {
          throw DataError("data.sources[" + std::to_string(i) + "] ('" + source.path + "'): " + fsdp::message_without_id(e));
        }
        weights.push_back(source.weight);
        sizes.push_back(d.train_sources.back().n);
      }
      d.blend = std::make_shared<Blend>(weights, sizes, cfg.data.shuffle, cfg.run.seed);
      d.mixture_size = d.blend->total_size();
    }
    d.has_test = !cfg.data.val_path.empty();
    if (d.has_test) d.test_stream = open_token_split_of("data.val_path", cfg, cfg.data.val_path, rank, world, kind);
    d.document_starts = cfg.model.document_mask && cfg.model.document_token < 0;  // the deck checked the training data is indexed
    if (d.document_starts && d.has_test && d.test_stream.stream->document_starts().empty())
      throw DataError("data.val_path '" + cfg.data.val_path + "': data.document_mask without data.eot_token takes document boundaries from an " +
                      "indexed dataset's .idx, and this validation data (data.kind \"" + to_string(kind) + "\") has none");
  } else {
    d.tokens = true;
    auto corpus = load_text(cfg.data.path, cfg.model.context, static_cast<int>(cfg.model.vocab_size));
    // FNV-1a over the sorted distinct bytes, kept positive: equal vocabularies give equal numbers.
    std::uint64_t fingerprint = 1469598103934665603ull;
    for (const std::uint8_t byte : corpus.vocab) fingerprint = (fingerprint ^ byte) * 1099511628211ull;
    d.text_vocabulary = static_cast<std::int64_t>(fingerprint >> 2) | 1;
    d.train_tokens = std::move(corpus.train);
    d.test_tokens = std::move(corpus.test);
    d.has_test = d.test_tokens.n > 0;
  }
  const auto limit_train = cfg.data.train_samples, limit_test = cfg.data.test_samples;
  auto cut_images = [](ImageSplit& s, std::int64_t n) {
    if (n <= 0 || n >= s.n) return;
    s.n = n;
    s.images.resize(static_cast<std::size_t>(n * s.rows * s.cols));
    s.labels.resize(static_cast<std::size_t>(n));
  };
  auto cut_tokens = [](TokenSplit& s, std::int64_t n) {
    if (n <= 0 || n >= s.n) return;
    s.n = n;
    s.tokens.resize(static_cast<std::size_t>(n * s.length));
  };
  cut_images(d.train_images, limit_train);
  cut_images(d.test_images, limit_test);
  cut_tokens(d.train_tokens, limit_train);
  cut_tokens(d.test_tokens, limit_test);
  if (limit_train > 0) d.train_stream.n = std::min(d.train_stream.n, limit_train);
  if (limit_train > 0) d.mixture_size = std::min(d.mixture_size, limit_train);
  if (limit_test > 0) d.test_stream.n = std::min(d.test_stream.n, limit_test);
  return d;
}

/// The training sampler: each rank's share of every epoch, in a seeded per-epoch shuffle or, for a
/// mixture, in the blend's next draws.
inline DistributedSampler training_sampler(const Dataset& d, const RunConfig& cfg, int world, int rank) {
  if (!d.blend) return DistributedSampler(d.train_size(), world, rank, cfg.data.shuffle, cfg.run.seed);
  return DistributedSampler(d.train_size(), world, rank,
                            [blend = d.blend, n = d.train_size()](std::int64_t epoch) { return blend->draws(epoch * n, n); });
}

struct Batch {
  torch::Tensor x, y;
  /// Dataset::document_starts: (samples, t) bool, true at each input token that begins a document.
  torch::Tensor begins;
  std::string sample_lines;  ///< test hook FSDP_TEST_SAMPLE_LOG: the batch's samples, written when a step takes it
  std::int64_t samples = 0;
  /// The batch on `device` (the engine's compute device; a no-op on CPU).
  Batch to(const torch::Device& device) && {
    if (x.device() != device) x = x.to(device), y = y.to(device);
    if (begins.defined() && begins.device() != device) begins = begins.to(device);
    return std::move(*this);
  }
};

/// Marks in `begins` (t of them) the tokens [first, first + t) of `stream` that begin a document.
inline void mark_document_starts(const TokenStream& stream, std::int64_t first, std::int64_t t, bool* begins) {
  const auto& starts = stream.document_starts();
  for (auto it = std::lower_bound(starts.begin(), starts.end(), first); it != starts.end() && *it < first + t; ++it) begins[*it - first] = true;
}

/// The model's output for batch `b`: its document starts (if any) go to the model's layout first.
template <class Engine>
torch::Tensor forward_batch(Engine& model, const Batch& b) {
  DocumentLayout* documents = b.begins.defined() ? model.module()->documents() : nullptr;
  if (b.begins.defined() && !documents)
    throw ConfigError("a batch carries document starts, but the model keeps no document layout (data.document_mask)");
  if (documents) documents->given_begins = b.begins;
  try {
    return model.forward(b.x);
  } catch (...) {
    if (documents) documents->given_begins = torch::Tensor();  // a forward that failed before using them must not pass them on
    throw;
  }
}

inline Batch make_batch(const Dataset& d, bool train, const std::vector<std::int64_t>& idx, std::size_t begin, std::size_t end) {
  Batch b;
  const auto n = static_cast<std::int64_t>(end - begin);
  b.samples = n;
  if (!d.tokens) {
    const ImageSplit& s = train ? d.train_images : d.test_images;
    const std::int64_t pixels = s.rows * s.cols;
    auto x = torch::empty({n, 1, s.rows, s.cols}, torch::kFloat32);
    auto y = torch::empty({n}, torch::kLong);
    float* xp = x.data_ptr<float>();
    std::int64_t* yp = y.data_ptr<std::int64_t>();
    const float scale = static_cast<float>(1.0 / (255.0 * d.stddev)), shift = static_cast<float>(d.mean / d.stddev);
    for (std::int64_t i = 0; i < n; ++i) {
      const auto k = idx[begin + static_cast<std::size_t>(i)];
      const std::uint8_t* src = s.images.data() + k * pixels;
      for (std::int64_t p = 0; p < pixels; ++p) xp[i * pixels + p] = static_cast<float>(src[p]) * scale - shift;
      yp[i] = s.labels[static_cast<std::size_t>(k)];
    }
    b.x = x;
    b.y = y;
  } else if (d.streamed) {
    const std::int64_t length = d.sequence_length();
    auto all = torch::empty({n, length}, torch::kLong);
    std::int64_t* p = all.data_ptr<std::int64_t>();
    torch::Tensor begins;
    if (d.document_starts) begins = torch::zeros({n, length - 1}, torch::kBool);
    for (std::int64_t i = 0; i < n; ++i) {
      const auto k = idx[begin + static_cast<std::size_t>(i)];
      const auto [s, sample] = train ? d.train_sample(k) : std::pair<const StreamSplit*, std::int64_t>{&d.test_stream, k};
      s->stream->read(sample * (length - 1), length, p + i * length);  // consecutive samples share one token
      if (begins.defined()) mark_document_starts(*s->stream, sample * (length - 1), length - 1, begins.data_ptr<bool>() + i * (length - 1));
    }
    b.begins = begins;
    b.x = all.narrow(1, 0, length - 1).contiguous();
    b.y = all.narrow(1, 1, length - 1).contiguous();
  } else {
    const TokenSplit& s = train ? d.train_tokens : d.test_tokens;
    auto all = torch::empty({n, s.length}, torch::kLong);
    std::int64_t* p = all.data_ptr<std::int64_t>();
    for (std::int64_t i = 0; i < n; ++i) {
      const auto k = idx[begin + static_cast<std::size_t>(i)];
      for (std::int64_t t = 0; t < s.length; ++t) p[i * s.length + t] = s.tokens[static_cast<std::size_t>(k * s.length + t)];
    }
    b.x = all.narrow(1, 0, s.length - 1).contiguous();
    b.y = all.narrow(1, 1, s.length - 1).contiguous();
  }
  return b;
}

inline torch::Tensor loss_of(const Dataset& d, const torch::Tensor& model_out, const torch::Tensor& y, bool sum = false) {
  const auto reduction = sum ? torch::Reduction::Sum : torch::Reduction::Mean;
  const auto out = model_out.to(torch::kFloat);  // under mixed precision the model answers in bf16/fp16; the loss is fp32
  if (!d.tokens) return torch::nll_loss(out, y, {}, reduction);
  return token_cross_entropy(out.reshape({-1, out.size(-1)}), y.reshape({-1}), sum);
}

struct EvalResult {
  double loss = 0, accuracy = 0;
  std::int64_t samples = 0;
};

/// The tutorial's test(): loss summed and correct predictions counted on each rank, reduced; at most
/// `max_batches` batches per rank (0: the whole split). For a language model the loss is per token.
/// Each batch runs as forwards of at most `chunk` samples (0: the whole batch), the same number on
/// every rank: a language model's logits stay small whatever the batch.
template <class Engine>
inline EvalResult evaluate(Engine& model, const Dataset& d, std::int64_t batch, MpiComm& world, std::int64_t max_batches = 0,
                           std::int64_t chunk = 0) {
  model.eval();
  torch::NoGradGuard no_grad;
  // Rank r takes samples r, r+N, ...: every sample exactly once (no padding).
  std::vector<std::int64_t> idx;
  for (std::int64_t i = world.rank(); i < d.test_size(); i += world.size()) idx.push_back(i);
  // Every rank runs the same number of (collective) forwards, the last ones possibly empty: as many
  // pieces per batch as the fullest rank's batch needs (not data.test_batch_size's, which may be far
  // larger than a rank's share of the test set).
  std::int64_t most[2] = {(static_cast<std::int64_t>(idx.size()) + batch - 1) / batch,
                          std::min<std::int64_t>(batch, static_cast<std::int64_t>(idx.size()))};
  world.all_reduce(most, most, 2, fsdp::DType::kInt64, fsdp::ReduceOp::kMax);
  std::int64_t batches = most[0];
  if (max_batches > 0) batches = std::min(batches, max_batches);
  if (chunk <= 0 || chunk > batch) chunk = batch;
  const std::int64_t pieces = std::max<std::int64_t>(1, (most[1] + chunk - 1) / chunk);
  double sums[3] = {0, 0, 0};  // loss, correct, count
  for (std::int64_t k = 0; k < batches * pieces; ++k) {
    const auto batch_begin = std::min(static_cast<std::size_t>(k / pieces * batch), idx.size());
    const auto batch_end = std::min(batch_begin + static_cast<std::size_t>(batch), idx.size());
    const auto begin = std::min(batch_begin + static_cast<std::size_t>(k % pieces * chunk), batch_end);
    const auto end = std::min(begin + static_cast<std::size_t>(chunk), batch_end);
    Batch b = make_batch(d, false, idx, begin, end).to(model.compute_device());
    if (b.samples == 0) {  // keep the collectives in step with an empty batch
      b = make_batch(d, false, std::vector<std::int64_t>{0}, 0, 1).to(model.compute_device());
      forward_batch(model, b);
      continue;
    }
    torch::Tensor out = forward_batch(model, b);
    sums[0] += loss_of(d, out, b.y, true).item<double>();
    sums[1] += out.argmax(-1).eq(b.y).sum().item<double>();
    sums[2] += static_cast<double>(b.y.numel());
  }
  world.all_reduce(sums, sums, 3, fsdp::DType::kFloat64, fsdp::ReduceOp::kSum);
  model.train();
  return {sums[2] > 0 ? sums[0] / sums[2] : 0, sums[2] > 0 ? sums[1] / sums[2] : 0, static_cast<std::int64_t>(sums[2])};
}

}  // namespace fsdp::app
