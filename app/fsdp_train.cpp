// fsdp-train: the batch application. Reads a TOML input deck, trains with FSDP under mpirun or srun,
// evaluates every epoch, writes metrics.csv, summary.json and checkpoints, resumes from `latest`.
//   mpirun -np N build/bin/fsdp-train inputs/mnist_fsdp.toml [--set section.key=value ...] [--dry-run | --eval-only]
// Policy: problems found before training (deck, data, environment, checkpoint to resume) are agreed
// between the ranks and end every rank with exit code 2 and one message from rank 0; an error during
// training aborts the whole job (MPI_Abort) so that no rank is left waiting in a collective.
#include <CLI/CLI.hpp>
#include <fsdp/fsdp.hpp>

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "deck.hpp"
#include "plan/fit_check.hpp"
#include "plan/measured.hpp"
#include "run_config.hpp"
#include "train/build.hpp"
#include "train/ranks.hpp"
#include "train/signals.hpp"
#include "train/timing.hpp"
#include "train/generate_text.hpp"
#include "train/trainer.hpp"

using fsdp::MpiComm;
using namespace fsdp::app;

#if FSDP_TRAIN_LINKS_JEMALLOC
// jemalloc's settings from the start (read at its first allocation; MALLOC_CONF in the environment
// overrides them): large blocks in the threads' arenas with the small ones, where freed extents are
// reused and merged, instead of a separate arena that gives them back at once (page faults every step),
// and freed pages kept (run.malloc = "reuse", the default; apply_malloc_policy sets the deck's choice).
// Measured in docs/performance.md, "the allocator behind reuse".
extern "C" {
const char* malloc_conf = "oversize_threshold:0,dirty_decay_ms:-1,muzzy_decay_ms:-1";
}
#endif

namespace {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DeckError("cannot read deck '" + path + "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// The deck: rank 0 reads it, every rank parses the same text (and so fails the same way).
Deck read_deck(MpiComm& world, const std::string& deck_path, const std::vector<std::string>& overrides) {
  std::string text;
  on_all_ranks(world, [&] {
    if (world.rank() == 0) text = read_text_file(deck_path);
  });
  text = fsdp::broadcast_string(world, text);
  std::optional<Deck> parsed;
  on_all_ranks(world, [&] { parsed = Deck::parse(text, deck_path, overrides); });
  return std::move(*parsed);
}

/// The deck resolved for this placement: every default, `auto` and check between keys decided once.
/// The autos decided from this rank's cores must agree on every rank (the engine splits communicators
/// for the worker): any rank without a spare core turns the overlap off for all.
RunConfig resolve_on_every_rank(MpiComm& world, const MpiComm::Placement& placement, const Deck& deck) {
  std::optional<RunConfig> resolved;
  on_all_ranks(world, [&] {
    auto here = placement_of_this_rank(placement);
    here.gpu = probe_gpu();
    resolved = resolve_run_config(deck, here);
  });
  auto& f = resolved->fsdp;
  double no_spare[2] = {f.overlap_grad_reduce ? 0.0 : 1.0,
                        f.backward_prefetch_auto && f.backward_prefetch == fsdp::BackwardPrefetch::NO_PREFETCH ? 1.0 : 0.0};
  world.all_reduce(no_spare, no_spare, 2, fsdp::DType::kFloat64, fsdp::ReduceOp::kMax);
  f.overlap_grad_reduce = no_spare[0] == 0.0;
  if (f.backward_prefetch_auto && no_spare[1] != 0.0) {
    f.backward_prefetch = fsdp::BackwardPrefetch::NO_PREFETCH;
    f.backward_prefetch_name = "NO_PREFETCH";
  }
  return std::move(*resolved);
}

/// The run's predicted memory against this node's limits, before anything is built (run.memory_check).
std::optional<FitVerdict> check_fit(MpiComm& world, const MpiComm::Placement& placement, const Deck& deck, const RunConfig& cfg) {
  std::optional<FitVerdict> fit;
  on_all_ranks(world, [&] {
    if (cfg.run.memory_check == MemoryCheck::kOff) return;
    fit = check_memory_fit(deck, cfg, memory_limits());
    if (!fit->fits && cfg.run.memory_check == MemoryCheck::kRefuse) throw DeckError(fit_refusal(*fit, cfg.placement.ranks_per_node));
  });
  if (fit && !fit->fits && placement.local_rank == 0)
    std::fprintf(stderr, "fsdp-train: warning: %s\n", fit_refusal(*fit, cfg.placement.ranks_per_node).c_str());
  return fit;
}

/// What a failing rank leaves behind: the flight recorder (dumped on fatal signals) and the watchdog.
void configure_diagnostics(MpiComm& world, const RunConfig& cfg) {
  fsdp::FlightRecorder::instance().configure(static_cast<std::size_t>(cfg.comm.flight_recorder_entries), cfg.run.out_dir, world.rank(), world.size());
  fsdp::CollectiveWatchdog::instance().configure(cfg.comm.timeout_s, world.rank());
  for (int sig : {SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL}) std::signal(sig, dump_flight_and_die);
}

/// Threads, the allocator policy (before the model exists: its shards, gathered units and gradients
/// are allocated from here on) and the seed.
void configure_compute(const Deck& deck, const RunConfig& cfg) {
  set_compute_threads(cfg.run.threads);  // LibTorch's pool and OpenBLAS's
  if (!apply_malloc_policy(cfg.run.malloc)) {
    const std::string where = deck.entry("run.malloc").where;
    throw DeckError((where.empty() ? "" : where + ": ") + "run.malloc = \"" + std::string(to_string(cfg.run.malloc)) + "\": " + kTrainAllocatorName +
                    " refused it");
  }
  torch::manual_seed(cfg.run.seed);
}

/// One run: the deck, the process, then a Trainer over the chosen communicator.
int run(MpiComm& world, const std::string& deck_path, const std::vector<std::string>& overrides, bool dry_run, bool eval_only,
        GenerateRequest* generate = nullptr) {
  const auto wall_start = Clock::now();
  const auto placement = world.placement();  // collective: asked once, by every rank
  const Deck deck = read_deck(world, deck_path, overrides);
  const RunConfig cfg = resolve_on_every_rank(world, placement, deck);
  const RunSetup setup{world, placement, deck, cfg, deck_path, check_fit(world, placement, deck, cfg), wall_start};
  configure_diagnostics(world, cfg);
  const TerminateDumper terminate_dumper;
  // log.trace: every rank records its timeline and writes it when the run ends, however it ends.
  fsdp::Tracer::instance().enable(cfg.log.trace && !dry_run);
  const TraceWriter trace_writer{cfg.run.out_dir, world.rank()};
  configure_compute(deck, cfg);
  return with_communicator(cfg, [&]<class Comm>() {
    Trainer<Comm> trainer(setup);
    trainer.build(/*with_data=*/generate == nullptr);  // generation reads no data
    if (dry_run) return trainer.dry_run();
    if (eval_only) return trainer.evaluate_only();
    if (generate) return generate_text(trainer, world, cfg, *generate);
    if (!trainer.resume()) {
      trainer.finish_completed_run();
      return 0;
    }
    trainer.train();
    trainer.finish();
    return 0;
  });
}

}  // namespace

/// LibTorch's OpenMP pool (libgomp) and OpenBLAS's threads share the rank's cores: a libgomp thread that
/// has finished its part of an operation spins for the next one by default and takes the core an
/// OpenBLAS thread needs for the matrix product running meanwhile. With 2 threads per rank that made a
/// step 2-3x slower (docs/performance.md, "Two thread pools"). libgomp reads OMP_WAIT_POLICY only when
/// it loads, before main: so when it is unset and the process is not yet re-executed, set it to PASSIVE
/// and re-execute once, before MPI starts. An OMP_WAIT_POLICY the user set is kept, and a rank with
/// one CPU to itself at most (bound to one core, mpirun's default for 2 or fewer ranks, or as many ranks
/// on the node as it has CPUs: one compute thread) is not re-executed.
void wait_passively_in_openmp(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr) return;
  cpu_set_t cpus;
  if (sched_getaffinity(0, sizeof cpus, &cpus) != 0) return;
  int ranks_here = 1;  // the launcher's word, before MPI can say
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"})
    if (const char* v = std::getenv(name); v && std::atoi(v) > 0) {
      ranks_here = std::atoi(v);
      break;
    }
  if (CPU_COUNT(&cpus) / ranks_here <= 1) return;
  if (setenv("OMP_WAIT_POLICY", "PASSIVE", 1) != 0) return;
  execv("/proc/self/exe", argv);  // returns only on failure: then training goes on, only slower
  unsetenv("OMP_WAIT_POLICY");
}

int main(int argc, char** argv) {
  wait_passively_in_openmp(argv);
  // Called as fsdp-generate (a link to this program): text from a trained model instead of training.
  const bool generating = std::filesystem::path(argv[0]).filename() == "fsdp-generate";
  CLI::App cli{generating ? "fsdp-generate: continue a prompt with the model of a deck (its latest checkpoint, checkpoint.resume's, or "
                            "checkpoint.init_from), sharded over the ranks"
                          : "fsdp-train: train a model with Fully Sharded Data Parallel from a TOML input deck",
               generating ? "fsdp-generate" : "fsdp-train"};
  std::string deck_path;
  std::vector<std::string> overrides;
  bool dry_run = false, check_plan = false, eval_only = false;
  GenerateRequest g;
  std::string ids;
  cli.add_option("DECK", deck_path, "the input deck (TOML)")->required();
  cli.add_option("--set", overrides, "override a deck value: section.key=value (repeatable)");
  if (generating) {
    cli.add_option("--prompt", g.prompt_text, "the prompt as text (needs --tokenizer)");
    cli.add_option("--ids", ids, "the prompt as token ids, separated by commas or spaces");
    cli.add_option("--tokenizer", g.tokenizer, "tokenizer.json (or its folder): encodes --prompt and decodes the output");
    cli.add_option("--max-new-tokens", g.options.max_new_tokens, "tokens to generate at most (and model.context in all)")
        ->check(CLI::Range(1, 1000000));
    cli.add_option("--temperature", g.options.temperature, "0: greedy (argmax); else sample from softmax(logits / temperature)")
        ->check(CLI::Range(0.0, 100.0));
    cli.add_option("--top-k", g.options.top_k, "sample among the k most likely tokens only (0: all)")->check(CLI::Range(0, 100000000));
    cli.add_option("--top-p", g.options.top_p, "sample among the fewest most likely tokens whose probabilities reach p")->check(CLI::Range(0.0, 1.0));
    cli.add_option("--seed", g.options.seed, "the sampling generator's seed (the same on every rank)");
    cli.add_flag(
        "--no-kv-cache", [&](std::int64_t) { g.options.kv_cache = false; }, "recompute every position at every step");
    cli.add_flag(
        "--no-stop", [&](std::int64_t) { g.stop_at_eos = false; }, "do not stop at model.eos_token_id");
  }
  if (!generating) cli.add_flag("--dry-run", dry_run, "validate, print the echo and stop");
  if (!generating)
    cli.add_flag("--eval-only", eval_only,
                 "evaluate the run's latest checkpoint (or checkpoint.resume's, or checkpoint.init_from) on the validation data and stop: "
                 "loss, perplexity and tokens/s, printed and added to summary.json; trains nothing, writes no checkpoint or deck.toml");
  if (!generating)
    cli.add_flag("--check-plan", check_plan, "build the deck's model (no MPI) and check fsdp-plan's closed-form description against it");
  try {
    cli.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return cli.exit(e) == 0 ? 0 : kExitBadInput;
  }
  if (const auto parsed = parse_token_ids(ids)) {
    g.options.prompt = *parsed;
  } else {
    std::fprintf(stderr, "fsdp-generate: error: --ids \"%s\" is not a list of integers\n", ids.c_str());
    return kExitBadInput;
  }
  if (check_plan) {
    try {
      return check_plan_model(deck_path, overrides);
    } catch (const fsdp::ConfigError& e) {
      std::fprintf(stderr, "fsdp-train: error: %s\n", e.what());
      return kExitBadInput;
    }
  }
  end_with_the_launcher();
  std::unique_ptr<fsdp::MpiEnvironment> env;
  try {
    // MPI_THREAD_MULTIPLE: prefetched all-gathers run on the engine's collective worker thread.
    env = std::make_unique<fsdp::MpiEnvironment>(&argc, &argv, MPI_THREAD_MULTIPLE);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-train: error: %s\n", e.what());
    return kExitFailure;
  }
  auto world = MpiComm::world();
  try {
    return run(world, deck_path, overrides, dry_run, eval_only, generating ? &g : nullptr);
  } catch (const RankError& e) {
    // Agreed between all ranks: rank 0 reports, everyone exits.
    if (world.rank() == 0) std::fprintf(stderr, e.code == kExitStopped ? "fsdp-train: %s\n" : "fsdp-train: error: %s\n", e.what());
    return e.code ? e.code : e.bad_input ? kExitBadInput : kExitFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-train: error on rank %d: %s\n", world.rank(), e.what());
    if (const auto path = fsdp::FlightRecorder::instance().dump())
      std::fprintf(stderr, "fsdp-train: rank %d's last collectives: %s\n", world.rank(), path->c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, kExitFailure);  // other ranks may be waiting in a collective
    return kExitFailure;
  }
}
