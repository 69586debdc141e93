// fsdp-generate (fsdp-train --generate): text from a trained language model. The model is loaded as
// --eval-only loads it (the run's latest checkpoint, checkpoint.resume's, or checkpoint.init_from: a
// safetensors export or a Hugging Face folder) and stays sharded: every rank runs each forward, its
// units gathered as in training. Greedy or sampled (temperature, top-k, top-p) with a seeded generator
// of our own, so every rank draws the same token; rank 0's choice is broadcast all the same.
#pragma once

#include <fsdp/fsdp.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "models/app_model.hpp"
#include "run_config.hpp"
#include "train/checkpointer.hpp"
#include "train/ranks.hpp"

namespace fsdp::app {

struct GenerateOptions {
  std::vector<std::int64_t> prompt;  ///< token ids
  std::int64_t max_new_tokens = 64;
  double temperature = 0;  ///< 0: greedy (argmax)
  std::int64_t top_k = 0;  ///< 0: all tokens
  double top_p = 1;        ///< nucleus: the fewest most likely tokens whose probabilities reach top_p
  std::uint64_t seed = 0;
  bool kv_cache = true;
  std::vector<std::int64_t> stop_tokens;  ///< any of them ends the generation when drawn (model.eos_token_id)
};

/// The next token from one position's logits (host, fp32): argmax at temperature 0, else a draw from
/// the softmax of logits / temperature restricted to the top_k most likely and to the nucleus top_p.
inline std::int64_t pick_token(const torch::Tensor& logits, const GenerateOptions& o, std::mt19937_64& rng) {
  const auto l = logits.to(torch::kCPU, torch::kDouble).contiguous();
  const double* v = l.data_ptr<double>();
  const auto n = l.numel();
  // A NaN counts as least likely (and keeps the ordering strict); equal logits go by id, so every rank
  // and run orders them alike.
  const auto key = [&](std::int64_t i) { return std::isnan(v[i]) ? -std::numeric_limits<double>::infinity() : v[i]; };
  const auto before = [&](std::int64_t a, std::int64_t b) { return key(a) > key(b) || (key(a) == key(b) && a < b); };
  if (o.temperature <= 0) {  // greedy: one pass, no sort of the vocabulary every token
    std::int64_t best = 0;
    for (std::int64_t i = 1; i < n; ++i)
      if (before(i, best)) best = i;
    return best;
  }
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  // Most likely first: only the top_k need ordering when top_k is set.
  const std::size_t sorted = o.top_k > 0 ? std::min<std::size_t>(order.size(), static_cast<std::size_t>(o.top_k)) : order.size();
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(sorted), order.end(), before);
  std::size_t keep = sorted;
  std::vector<double> p(keep);
  for (std::size_t i = 0; i < keep; ++i) p[i] = std::exp((key(order[i]) - key(order.front())) / o.temperature);
  double total = std::accumulate(p.begin(), p.end(), 0.0);
  if (o.top_p < 1) {
    double sum = 0;
    std::size_t nucleus = 0;
    while (nucleus < keep && sum < o.top_p * total) sum += p[nucleus++];
    keep = std::max<std::size_t>(nucleus, 1);
    total = std::accumulate(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(keep), 0.0);
  }
  const double u = std::uniform_real_distribution<double>(0, total)(rng);
  double sum = 0;
  for (std::size_t i = 0; i < keep; ++i)
    if ((sum += p[i]) > u) return order[i];
  return order[keep - 1];
}

/// What a generation produced: the new tokens and how fast.
struct Generated {
  std::vector<std::int64_t> tokens;
  double seconds = 0;
  bool cached = false;  ///< whether the KV cache was used
};

/// Generates after `o.prompt` with `engine` (collective: every rank calls it with the same options).
/// Stops at max_new_tokens, the stop token, or model.context. The KV cache is on when asked for and the
/// model has one; with data.document_mask and data.eot_token it is off (the layout is computed over the
/// whole sequence: a separator in the text begins a document); without a separator a prompt is one document.
template <class Engine>
Generated generate_tokens(Engine& engine, AppModel& model, MpiComm& world, const RunConfig& cfg, const GenerateOptions& o) {
  KvCache* cache = model.kv_cache();
  const bool cached = o.kv_cache && cache && cfg.model.document_token < 0;
  if (cache) {
    cache->clear();
    cache->on = cached;
  }
  engine.eval();
  torch::NoGradGuard no_grad;
  std::mt19937_64 rng(o.seed);
  std::vector<std::int64_t> sequence = o.prompt;
  Generated out;
  out.cached = cached;
  const auto start = std::chrono::steady_clock::now();
  std::size_t fed = 0;  // tokens the cache holds
  while (static_cast<std::int64_t>(out.tokens.size()) < o.max_new_tokens && static_cast<std::int64_t>(sequence.size()) < cfg.model.context) {
    const std::size_t from = cached ? fed : 0;
    const auto input = torch::tensor(std::vector<std::int64_t>(sequence.begin() + static_cast<std::ptrdiff_t>(from), sequence.end()), torch::kLong)
                           .view({1, -1})
                           .to(engine.compute_device());
    const auto logits = engine.forward(input);
    fed = sequence.size();
    std::int64_t next = pick_token(logits[0][logits.size(1) - 1], o, rng);
    world.broadcast(&next, 1, fsdp::DType::kInt64, 0);  // every rank continues with rank 0's token
    sequence.push_back(next);
    out.tokens.push_back(next);
    if (std::find(o.stop_tokens.begin(), o.stop_tokens.end(), next) != o.stop_tokens.end()) break;
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (cache) {
    cache->on = false;
    cache->clear();
  }
  engine.train();
  return out;
}

}  // namespace fsdp::app
