// fsdp-train --eval-only: the validation loss, perplexity and throughput of a model as it stands (the
// run's latest checkpoint, a named one, or checkpoint.init_from), without training. It takes no run
// lock and moves, writes or removes no checkpoint and no deck.toml: the result is printed and joins
// summary.json under "eval_only".
#pragma once

#include <fsdp/fsdp.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "run_config.hpp"
#include "train/checkpointer.hpp"
#include "train/dataset.hpp"
#include "train/ranks.hpp"
#include "train/summary.hpp"

namespace fsdp::app {

/// Loads the model to evaluate (Checkpointer::load_for_evaluation), evaluates the whole validation
/// split (eval.max_batches bounds it), prints one line and writes summary.json. Returns the exit code.
/// Collective.
template <class Engine>
int evaluate_only(MpiComm& world, const Deck& deck, const RunConfig& cfg, Engine& model, const Dataset& data, std::int64_t eval_chunk) {
  const bool root = world.rank() == 0;
  on_all_ranks(world, [&] {
    if (!data.has_test || data.test_size() == 0) throw DeckError("--eval-only: there is no validation data to evaluate on (data.val_path is empty)");
  });
  Checkpointer<Engine> checkpointer(cfg, deck, world, model, nullptr);
  const std::string source = checkpointer.load_for_evaluation("--eval-only: nothing to evaluate");
  world.barrier();  // the evaluation's time starts together
  const auto start = std::chrono::steady_clock::now();
  const EvalResult r = evaluate(model, data, cfg.data.test_batch_size, world, cfg.eval.max_batches, eval_chunk);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double per_s = seconds > 0 ? static_cast<double>(r.samples) / seconds : 0;
  nlohmann::ordered_json js{{"model", source}, {"world_size", world.size()}, {"loss", r.loss}};
  if (data.tokens) {
    js["perplexity"] = std::exp(r.loss);
    js["accuracy"] = r.accuracy;
    js["tokens"] = r.samples;
    js["tokens_per_s"] = per_s;
  } else {
    js["accuracy"] = r.accuracy;
    js["samples"] = r.samples;
    js["samples_per_s"] = per_s;
  }
  js["seconds"] = seconds;
  // Printed first: a summary.json that cannot be written must not take the result with it.
  if (root) {
    if (data.tokens)
      std::printf("eval-only: %s: eval loss %.4f, perplexity %.2f (per token), accuracy %.2f%%, %lld tokens, %.0f tokens/s\n", source.c_str(), r.loss,
                  std::exp(r.loss), 100 * r.accuracy, static_cast<long long>(r.samples), per_s);
    else
      std::printf("eval-only: %s: test loss %.4f, accuracy %.2f%%, %lld samples, %.0f samples/s\n", source.c_str(), r.loss, 100 * r.accuracy,
                  static_cast<long long>(r.samples), per_s);
    std::fflush(stdout);
  }
  on_all_ranks(world, [&] {
    if (root) write_eval_only_summary(cfg.run.out_dir, js);
  });
  if (root) {
    std::printf("eval-only: written to %s (\"eval_only\")\n", (std::filesystem::path(cfg.run.out_dir) / "summary.json").c_str());
  }
  return 0;
}

}  // namespace fsdp::app
