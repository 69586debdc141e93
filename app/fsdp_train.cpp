// fsdp-train: the batch application. Reads a TOML input deck, trains with FSDP under mpirun or srun,
// evaluates every epoch, writes metrics.csv, summary.json and checkpoints, resumes from `latest`.
//   mpirun -np N build/bin/fsdp-train inputs/mnist_fsdp.toml [--set section.key=value ...] [--dry-run]
// Policy: problems found before training (deck, data, environment, checkpoint to resume) are agreed
// between the ranks and end every rank with exit code 2 and one message from rank 0; an error during
// training aborts the whole job (MPI_Abort) so that no rank is left waiting in a collective.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <fsdp/fsdp.hpp>
#ifdef FSDP_WITH_NCCL
#include <fsdp/comm/nccl_comm.hpp>
#endif
#include <malloc.h>
#include <sched.h>
#include <semaphore.h>
#include <sys/resource.h>

#include <csignal>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "data.hpp"
#include "deck.hpp"
#include "models.hpp"
#include "run_config.hpp"
#include "plan/fit_check.hpp"
#include "plan/measured.hpp"
#include "train/build.hpp"
#include "train/checkpointer.hpp"
#include "train/step.hpp"
#include "train/signals.hpp"
#include "train/summary.hpp"
#include "train/dataset.hpp"
#include "train/metrics_log.hpp"
#include "train/ranks.hpp"
#include "train/timing.hpp"
#include "train/weight_decay.hpp"

namespace fs = std::filesystem;
using fsdp::MpiComm;
using namespace fsdp::app;

namespace {

/// A test hook "RANK:STEP" in environment variable `name` that names this rank and step.
bool test_hook_at(const char* name, int rank, std::int64_t step) {
  const char* v = std::getenv(name);
  if (!v || !*v) return false;
  int r = -1;
  long long s = -1;
  return std::sscanf(v, "%d:%lld", &r, &s) == 2 && r == rank && s == step;
}

/// The engine over communicator `Comm`: MpiComm (CPU tensors) or, built with NCCL, NcclComm (GPUs).
template <class Comm>
using EngineOver = fsdp::FullyShardedDataParallel<AppModel, Comm>;
std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DeckError("cannot read deck '" + path + "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// ---- the run ------------------------------------------------------------------------------------

int run(int argc, char** argv, MpiComm& world, const std::string& deck_path, const std::vector<std::string>& overrides, bool dry_run) {
  const auto wall_start = Clock::now();
  const bool root = world.rank() == 0;
  const auto placement = world.placement();

  // 1. The deck: rank 0 reads it, every rank parses the same text (and so fails the same way).
  std::string text;
  on_all_ranks(world, [&] {
    if (root) text = read_text_file(deck_path);
  });
  text = fsdp::detail::broadcast_string(world, text);
  std::optional<Deck> parsed;
  on_all_ranks(world, [&] { parsed = Deck::parse(text, deck_path, overrides); });
  const Deck& deck = *parsed;
  // The deck resolved for this placement: every default, `auto` and check between keys decided once.
  std::optional<RunConfig> resolved;
  on_all_ranks(world, [&] {
    auto here = placement_of_this_rank(placement);
    here.gpu = probe_gpu();
    resolved = resolve_run_config(deck, here);
  });
  // The autos decided from this rank's cores must agree on every rank (the engine splits communicators
  // for the worker): any rank without a spare core turns the overlap off for all.
  {
    auto& f = resolved->fsdp;
    double no_spare[2] = {f.overlap_grad_reduce ? 0.0 : 1.0, f.backward_prefetch_auto && f.backward_prefetch == fsdp::BackwardPrefetch::NO_PREFETCH ? 1.0 : 0.0};
    world.all_reduce(no_spare, no_spare, 2, fsdp::DType::kFloat64, fsdp::ReduceOp::kMax);
    f.overlap_grad_reduce = no_spare[0] == 0.0;
    if (f.backward_prefetch_auto && no_spare[1] != 0.0) {
      f.backward_prefetch = fsdp::BackwardPrefetch::NO_PREFETCH;
      f.backward_prefetch_name = "NO_PREFETCH";
    }
  }
  const RunConfig& cfg = *resolved;
  // The run's predicted memory against this node's limits, before anything is built (run.memory_check).
  std::optional<FitVerdict> fit;
  on_all_ranks(world, [&] {
    if (cfg.run.memory_check == "off") return;
    fit = check_memory_fit(deck, cfg, memory_limits());
    if (!fit->fits && cfg.run.memory_check == "refuse") throw DeckError(fit_refusal(*fit, cfg.placement.ranks_per_node));
  });
  if (fit && !fit->fits && placement.local_rank == 0)
    std::fprintf(stderr, "fsdp-train: warning: %s\n", fit_refusal(*fit, cfg.placement.ranks_per_node).c_str());

  const std::string name = cfg.run.name;
  const fs::path out_dir = cfg.run.out_dir;
  fsdp::FlightRecorder::instance().configure(static_cast<std::size_t>(cfg.comm.flight_recorder_entries), out_dir.string(), world.rank(),
                                             world.size());
  fsdp::CollectiveWatchdog::instance().configure(cfg.comm.timeout_s, world.rank());
  for (int sig : {SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL}) std::signal(sig, dump_flight_and_die);
  const TerminateDumper terminate_dumper;
  // log.trace: every rank records its timeline and writes it when the run ends, however it ends.
  fsdp::Tracer::instance().enable(cfg.log.trace && !dry_run);
  const TraceWriter trace_writer{out_dir, world.rank()};
  const int threads = cfg.run.threads;
  torch::set_num_threads(threads);
  // Before the model exists: its shards, gathered units and gradients are allocated from here on.
  if (!apply_malloc_policy(cfg.run.malloc))
    throw DeckError(deck.entry("run.malloc").where + ": run.malloc = \"" + cfg.run.malloc + "\": glibc's mallopt refused it");
  const bool overlap_grad_reduce = cfg.fsdp.overlap_grad_reduce;
  torch::manual_seed(cfg.run.seed);

  // 2. The communicator, data (each rank reads the files itself) and the model.
  const std::string& backend = cfg.fsdp.backend_resolved;
  // The rest runs with the engine over the chosen communicator.
  auto train = [&](auto comm_type) -> int {
    using Comm = typename decltype(comm_type)::type;
    using Engine = EngineOver<Comm>;
    Dataset data;
    on_all_ranks(world, [&] { data = load_dataset(cfg, world.rank(), world.size()); });
    std::shared_ptr<Engine> model;
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    std::optional<WeightDecayMask> decay_mask;  // optim.no_decay
    on_all_ranks(world, [&] {
      auto net = build_model(cfg);
      check_layer_classes(cfg, *net);
      auto options = fsdp_options(cfg);
      options.overlap_grad_reduce = overlap_grad_reduce;
      if constexpr (std::is_same_v<Comm, MpiComm>) {
        model = std::make_shared<Engine>(net, world, options);
      } else {  // NCCL: this rank's GPU on its node; NCCL's own deadline is comm.timeout_s
        fsdp::NcclOptions nccl;
        nccl.timeout_s = cfg.comm.timeout_s;
        nccl.device = cfg.fsdp.cuda_device;  // -1: fsdp::choose_device from what this rank sees
        auto comm = fsdp::NcclComm::from_mpi(world, nccl);
        options.device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(comm.device()));
        model = std::make_shared<Engine>(net, comm, options);
      }
      optimizer = build_optimizer(cfg, *model);
      if (!cfg.optim.no_decay.empty()) decay_mask.emplace(*model, cfg.optim.no_decay);
    });

    // 3. Echo: the resolved deck and what follows from it.
    const auto units = model->units();
    std::int64_t shard_numel = 0, padding = 0;
    for (const auto& u : units) {
      shard_numel += u.shard_numel;
      padding += u.padded_numel - u.numel;
    }
    std::int64_t optimized_numel = 0;  // what this rank's optimizer updates: the shards, or their replica parts
    for (const auto& p : model->parameters()) optimized_numel += p.numel();
    const std::int64_t state_bytes = training_state_bytes(shard_numel, optimized_numel, cfg.optim.state_copies());
    if (root) {
      std::printf("fsdp-train %s: deck %s\n\n%s\n", fsdp::kVersion, deck_path.c_str(), deck.echo_table().c_str());
      std::printf("  world size %d on %d node(s), %d rank(s) per node, %d thread(s) per rank\n", world.size(), placement.nodes, placement.local_size,
                  threads);
      std::printf("  backend %s (fsdp.backend = %s), compute on %s%s\n", backend.c_str(), cfg.fsdp.backend.c_str(),
                  model->compute_device().str().c_str(), cfg.fsdp.offload_params ? ", parameter shards offloaded to host memory" : "");
      if (fit) std::printf("  memory: %s\n", fit_summary(*fit, cfg.placement.ranks_per_node).c_str());
      std::printf("  strategy %s, shard group %d, %zu unit(s), %lld parameters\n", to_string(model->sharding_strategy()), model->shard_group_size(),
                  units.size(), static_cast<long long>(model->num_params()));
      std::printf("  per rank: %lld shard elements (%lld padding in all units), expected %.2f MiB of params + grads + optimizer state\n",
                  static_cast<long long>(shard_numel), static_cast<long long>(padding), state_bytes / 1048576.0);
      std::printf("  data %s: %lld train, %lld test samples; global batch %lld = %lld per rank x %d ranks x %lld micro-batches; out_dir %s\n\n",
                  cfg.data.kind.c_str(), static_cast<long long>(data.train_size()), static_cast<long long>(data.test_size()),
                  static_cast<long long>(cfg.data.batch_size * world.size() * cfg.optim.grad_accum_steps), static_cast<long long>(cfg.data.batch_size),
                  world.size(), static_cast<long long>(cfg.optim.grad_accum_steps), out_dir.c_str());
      std::fflush(stdout);
    }
    check_same_job(world, deck, model->plan_hash());
    if (dry_run) {
      // A dry run leaves an existing run alone; it writes the resolved deck only into a new out_dir.
      bool wrote = false;
      on_all_ranks(world, [&] {
        if (!root || fs::exists(out_dir / "deck.toml")) return;
        fs::create_directories(out_dir);
        std::ofstream(out_dir / "deck.toml") << deck.to_toml();
        wrote = true;
      });
      if (root)
        std::printf("dry run: stopping after the echo%s\n",
                    wrote ? (" (resolved deck in " + (out_dir / "deck.toml").string() + ")").c_str() : " (existing deck.toml left as it is)");
      return 0;
    }
    // 4. The run directory and the state to start from.
    Checkpointer<Engine> checkpointer(cfg, deck, world, *model, optimizer.get());
    checkpointer.take_run_directory();
    const fsdp::TrainState state = checkpointer.resume();

    // 5. Train.
    const std::int64_t batch = cfg.data.batch_size;
    const std::int64_t accum = cfg.optim.grad_accum_steps;
    const std::int64_t epochs = cfg.run.epochs;
    const std::int64_t max_steps = cfg.run.max_steps;
    const double clip = cfg.optim.clip_grad_norm;
    const std::int64_t log_every = cfg.log.every_steps;
    const std::int64_t ckpt_every = cfg.checkpoint.every_steps;
    DistributedSampler sampler(data.train_size(), world.size(), world.rank(), cfg.data.shuffle, cfg.run.seed);
    const std::int64_t micro_per_epoch = (sampler.num_samples() + batch - 1) / batch;
    const std::int64_t steps_per_epoch = micro_per_epoch / accum;
    if (steps_per_epoch == 0)
      throw RankError("data.batch_size x optim.grad_accum_steps exceeds the samples per rank (" + std::to_string(sampler.num_samples()) + ")", true);
    const std::int64_t global_batch = batch * accum * world.size();
    if (state.sample_index % global_batch != 0)
      throw RankError("the checkpoint resumed from stopped " + std::to_string(state.sample_index) + " samples into epoch " +
                          std::to_string(state.epoch + 1) + ", not a whole number of this run's global batches of " + std::to_string(global_batch) +
                          " (data.batch_size " + std::to_string(batch) + " x " + std::to_string(world.size()) + " ranks x optim.grad_accum_steps " +
                          std::to_string(accum) + "): set data.global_batch_size to the global batch it was trained with",
                      true);
    const std::int64_t total_steps = max_steps > 0 ? std::min(max_steps, steps_per_epoch * epochs) : steps_per_epoch * epochs;
    if (state.step > 0 && state.step >= total_steps) {
      // A rerun of a finished job: nothing to do, and its results stay as they are.
      if (root)
        std::printf(
            "nothing to train: the run in %s already reached step %lld of %lld; its summary.json is kept (train again with a new "
            "run.out_dir or checkpoint.resume = \"none\")\n",
            out_dir.c_str(), static_cast<long long>(state.step), static_cast<long long>(total_steps));
      return 0;
    }
    const std::string progress_mode = cfg.log.progress;
    // auto: a live line only for a process started directly on a terminal. Under mpirun or srun the
    // ranks' stdout is a pseudo-terminal even when the job's output goes to a file.
    const bool launched = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK") || std::getenv("SLURM_PROCID");
    const bool live = progress_mode == "live" || (progress_mode == "auto" && isatty(STDOUT_FILENO) && !launched);
    const bool quiet = progress_mode == "none";

    const bool write_metrics = !cfg.log.metrics_file.empty();
    const fs::path metrics_path = out_dir / cfg.log.metrics_file;
    MetricsLog metrics;
    on_all_ranks(world, [&] {
      if (root && write_metrics) metrics.open(metrics_path, state.step);
    });

    Phases phases;
    std::vector<double> step_ms, step_ms_while_writing;  // the latter: steps begun while a checkpoint was written in the background
    double last_loss = std::nan(""), window_loss = 0;
    std::int64_t window_steps = 0, window_samples = 0;
    auto window_start = Clock::now();
    double window_pause = 0;  // checkpoint and evaluation time inside the current logging window
    const auto train_start = Clock::now();
    std::int64_t step = state.step;
    std::int64_t samples_trained = 0;
    EvalResult last_eval;
    bool evaluated = false;
    const auto comm_start = model->comm_counters();
    StepAllGather step_all_gather;  // training steps' all-gathers (evaluation's not counted)
    model->train();

    // fp16's loss scale, continued from the checkpoint when it has one.
    std::optional<fsdp::DynamicLossScale> scaler;
    if (cfg.fsdp.loss_scale) {
      scaler.emplace(*cfg.fsdp.loss_scale);
      const auto saved = state.scheduler.find("loss_scale"), good = state.scheduler.find("loss_scale_good_steps");
      if (saved != state.scheduler.end() && good != state.scheduler.end()) {
        try {
          scaler->restore(saved->second, static_cast<std::int64_t>(good->second));
        } catch (const fsdp::ConfigError& e) {
          throw RankError(std::string("the checkpoint resumed from: /train/scheduler: ") + e.what(), true);
        }
      }
    }
    std::int64_t overflow_steps = 0, window_skipped = 0;

    // Where a run restarted from the current state continues: the next epoch and global sample.
    std::int64_t next_epoch = state.epoch, next_sample_index = state.sample_index;
    const bool save_final = cfg.checkpoint.save_final;
    auto save = [&] {
      fsdp::TrainState s;
      s.step = step;
      s.epoch = next_epoch;
      s.sample_index = next_sample_index;
      s.scheduler = {{"lr", lr_at(cfg, step, next_epoch, total_steps)}, {"total_steps", static_cast<double>(total_steps)}};
      if (scaler) {  // powers of two and small counts: exact as doubles
        s.scheduler["loss_scale"] = scaler->scale();
        s.scheduler["loss_scale_good_steps"] = static_cast<double>(scaler->good_steps());
      }
      checkpointer.save(s, phases.checkpoint, quiet);
    };

    // SIGTERM (Slurm's time limit, scancel) and SIGUSR1 (sbatch --signal): finish the step, save, exit 3.
    std::signal(SIGTERM, request_stop);
    std::signal(SIGUSR1, request_stop);
    // Past a file size limit (ulimit -f) a write then fails with EFBIG and the save reports it, instead
    // of SIGXFSZ killing the rank in the middle of a checkpoint.
    std::signal(SIGXFSZ, SIG_IGN);
    const bool skip_nonfinite = cfg.run.skip_nonfinite;
    const std::int64_t eval_every = cfg.eval.every_steps;
    // A language model evaluates its batch in chunks whose logits stay small (GptConfig::eval_chunk).
    const std::int64_t eval_chunk = data.tokens && cfg.model.kind == "transformer" ? gpt_config(cfg.model).eval_chunk(cfg.data.test_batch_size) : 0;
    std::int64_t eval_step = 0;
    // One evaluation (eval.max_batches bounds it), reported on the progress stream.
    auto run_evaluation = [&](std::int64_t epoch, std::int64_t at_step) {
      if (live && root && !quiet) std::printf("\n");
      Timed t(phases.eval, "eval");
      last_eval = evaluate(*model, data, cfg.data.test_batch_size, world, cfg.eval.max_batches, eval_chunk);
      evaluated = true;
      eval_step = at_step;
      if (root && !quiet) {
        if (data.tokens)
          std::printf("epoch %lld step %lld: eval loss %.4f, perplexity %.2f, accuracy %.2f%% (%lld tokens)\n", static_cast<long long>(epoch + 1),
                      static_cast<long long>(at_step), last_eval.loss, std::exp(last_eval.loss), 100 * last_eval.accuracy,
                      static_cast<long long>(last_eval.samples));
        else
          std::printf("epoch %lld step %lld: test loss %.4f, accuracy %.2f%% (%lld samples)\n", static_cast<long long>(epoch + 1),
                      static_cast<long long>(at_step), last_eval.loss, 100 * last_eval.accuracy, static_cast<long long>(last_eval.samples));
        std::fflush(stdout);
      }
      return last_eval;
    };
    std::int64_t skipped_steps = 0;

    bool done = step >= total_steps;
    for (std::int64_t epoch = state.epoch; epoch < epochs && !done; ++epoch) {
      sampler.set_epoch(epoch);
      const auto idx = sampler.indices();
      // Resuming inside an epoch: skip the micro-batches already trained (global sample count).
      std::int64_t first_micro = 0;
      if (epoch == state.epoch && state.sample_index > 0) first_micro = state.sample_index / (batch * world.size());
      const int workers = static_cast<int>(cfg.data.num_workers);
      const std::int64_t micro_end = steps_per_epoch * accum;
      Prefetcher<Batch> loader(
          std::max<std::int64_t>(0, micro_end - first_micro),
          [&, first_micro](std::int64_t k) {
            const auto begin = static_cast<std::size_t>((first_micro + k) * batch);
            return make_batch(data, true, idx, std::min(begin, idx.size()), std::min(begin + static_cast<std::size_t>(batch), idx.size()));
          },
          workers);
      for (std::int64_t micro = first_micro; micro < micro_end && !done; micro += accum) {
        const auto step_start = Clock::now();
        fsdp::CollectiveWatchdog::instance().set_step(step + 1);
        const double lr = lr_at(cfg, step, epoch, total_steps);
        for (auto& g : optimizer->param_groups()) g.options().set_lr(lr);
        std::function<void()> decay;
        if (decay_mask) decay = [&, lr] { decay_mask->apply(lr, cfg.optim.weight_decay); };
        const Phases phases_before = phases;
        const auto comm_before = model->comm_counters();
        const auto group_before = model->forward_group_counters();
        const long faults_before = minor_page_faults();
        const bool writing_checkpoint = checkpointer.writing();
        const StepOutcome outcome = train_step(*model, *optimizer, data, loader, accum, cfg.optim.reduce_every_micro_batch, clip,
                                                 scaler ? &*scaler : nullptr, g_stop_signal, world, phases, decay,
                                                 test_hook_at("FSDP_TEST_FAIL_COLLECTIVES", world.rank(), step + 1));
        const auto comm_after = model->comm_counters();
        step_all_gather.total += comm_after.all_gather_bytes - comm_before.all_gather_bytes;
        step_all_gather.inside_reshard_group += model->forward_group_counters().all_gather_bytes - group_before.all_gather_bytes;
        const StepBreakdown breakdown{1000 * (phases.forward - phases_before.forward),
                                      1000 * (phases.backward - phases_before.backward),
                                      1000 * (phases.optimizer - phases_before.optimizer),
                                      1000 * (comm_after.all_gather_seconds - comm_before.all_gather_seconds),
                                      1000 * (comm_after.reduce_scatter_seconds - comm_before.reduce_scatter_seconds),
                                      1000 * (comm_after.all_reduce_seconds - comm_before.all_reduce_seconds),
                                      minor_page_faults() - faults_before};
        samples_trained += outcome.samples;
        if (outcome.nonfinite && !skip_nonfinite)
          throw RankError("non-finite loss or gradient norm at step " + std::to_string(step + 1) + " (epoch " + std::to_string(epoch + 1) +
                              "); stopped without saving the poisoned state (run.on_nonfinite = \"skip\" skips such steps)",
                          kExitNonFinite);
        if (outcome.nonfinite || outcome.overflowed) {
          ++skipped_steps;
          ++window_skipped;
        }
        if (outcome.overflowed) ++overflow_steps;
        const double loss_sum = outcome.loss;
        const std::int64_t samples = outcome.samples;
        const std::int64_t flags[2] = {outcome.stop_signal, outcome.nonfinite ? 1 : 0};
        if (flags[1] && root) std::printf("warning: non-finite loss or gradient norm at step %lld: step skipped\n", static_cast<long long>(step + 1));
        ++step;
        step_ms.push_back(1000 * seconds_since(step_start));
        if (writing_checkpoint) step_ms_while_writing.push_back(step_ms.back());
        if (auto& tracer = fsdp::Tracer::instance(); tracer.enabled())
          tracer.complete("step " + std::to_string(step), "step", tracer.to_us(step_start), tracer.now_us(), {{"step", static_cast<double>(step)}});
        window_loss += loss_sum;
        ++window_steps;
        window_samples += samples;
        if (micro + accum >= micro_end) {
          next_epoch = epoch + 1;
          next_sample_index = 0;
        } else {
          next_epoch = epoch;
          next_sample_index = (micro + accum) * batch * world.size();
        }
        done = step >= total_steps;
        // An evaluation after this step (eval.every_steps and the last step; by default the epoch's last
        // step), before the log line that reports it; its time is not training time.
        std::optional<EvalResult> step_eval;
        const bool epoch_ends = micro + accum >= micro_end;
        if (data.has_test && (eval_every > 0 ? step % eval_every == 0 : epoch_ends) || (data.has_test && done)) {
          const auto pause_start = Clock::now();
          step_eval = run_evaluation(epoch, step);
          window_pause += seconds_since(pause_start);
        }
        if (step % log_every == 0 || done) {
          double stats[2] = {window_loss / static_cast<double>(window_steps), static_cast<double>(window_samples)};
          // Test hooks (docs/reliability.md): one rank skips this collective, or issues another one.
          if (test_hook_at("FSDP_TEST_SKIP_COLLECTIVE", world.rank(), step)) {
          } else if (test_hook_at("FSDP_TEST_OTHER_COLLECTIVE", world.rank(), step)) {
            world.barrier();
          } else {
            world.all_reduce(stats, stats, 2, fsdp::DType::kFloat64, fsdp::ReduceOp::kSum);
          }
          const double loss_avg = stats[0] / world.size();
          const double rate = stats[1] / std::max(1e-9, seconds_since(window_start) - window_pause);
          last_loss = loss_avg;
          if (root) {
            const double elapsed = seconds_since(train_start);
            const double eta = elapsed / static_cast<double>(step - state.step) * static_cast<double>(total_steps - step);
            // Language models count tokens (model.context per sequence), as llm.c and nanoGPT report.
            const char* unit = data.tokens ? "tokens/s" : "samples/s";
            const double shown_rate = data.tokens ? rate * static_cast<double>(data.sequence_length() - 1) : rate;
            if (!quiet) {
              std::printf("%sepoch %lld step %lld/%lld  loss %.4f  lr %.3g  %.0f %s  ETA %s%s", live ? "\r" : "", static_cast<long long>(epoch + 1),
                          static_cast<long long>(step), static_cast<long long>(total_steps), loss_avg, lr, shown_rate, unit,
                          format_duration(eta).c_str(), live ? "   " : "\n");
              std::fflush(stdout);
            }
            if (write_metrics) metrics.row(step, epoch + 1, loss_avg, lr, rate, step_ms.back(), elapsed, breakdown,
                                          scaler ? std::optional<double>(scaler->scale()) : std::nullopt, window_skipped, step_eval, data.tokens);
          }
          window_loss = 0;
          window_steps = 0;
          window_samples = 0;
          window_skipped = 0;
          window_start = Clock::now();
          window_pause = 0;
        } else if (step_eval && root && write_metrics) {
          metrics.eval_row(step, epoch + 1, *step_eval, data.tokens);
        }
        checkpointer.poll_background(quiet);  // a failed background write stops every rank here
        checkpointer.reserve_staging(phases.checkpoint);
        if (flags[0]) {
          save();
          checkpointer.wait_background(quiet);
          throw RankError(std::string("stopped by signal ") +
                              (flags[0] == SIGTERM   ? "SIGTERM"
                               : flags[0] == SIGUSR1 ? "SIGUSR1"
                                                     : std::to_string(flags[0])) +
                              " after step " + std::to_string(step) + "; checkpoint saved in " + checkpointer.dir().string() +
                              ": rerun the same command to continue",
                          kExitStopped);
        }
        if (ckpt_every > 0 && step % ckpt_every == 0 && !(done && save_final)) {
          if (live && root && !quiet) std::printf("\n");
          const auto pause_start = Clock::now();
          save();
          window_pause += seconds_since(pause_start);  // throughput counts training only
        }
      }
      if (live && root && !quiet) std::printf("\n");

    }
    if (save_final) save();
    {
      Timed t(phases.checkpoint, "checkpoint");
      checkpointer.wait_background(quiet);
    }
    {
      Timed t(phases.checkpoint, "export");
      checkpointer.export_model(quiet);
    }

    // 6. Summary.
    RunTotals totals;
    totals.backend = backend;
    totals.out_dir = out_dir;
    if (write_metrics) totals.metrics_path = metrics_path;
    totals.steps = step;
    totals.resumed_from_step = state.step;
    totals.skipped_steps = skipped_steps;
    totals.overflow_steps = overflow_steps;
    if (scaler) totals.loss_scale = scaler->scale();
    totals.samples_trained = samples_trained;
    totals.tokens_per_sample = data.tokens ? data.sequence_length() - 1 : 0;
    if (cfg.model.kind == "transformer") totals.flops_per_token = gpt_config(cfg.model).flops_per_token(model->num_params());
    totals.last_loss = last_loss;
    if (evaluated) {
      totals.eval = last_eval;
      totals.eval_step = eval_step;
    }
    totals.wall_s = seconds_since(wall_start);
    totals.train_elapsed_s = seconds_since(train_start);
    totals.phases = phases;
    totals.step_ms = std::move(step_ms);
    totals.checkpoints = {checkpointer.asynchronous(), checkpointer.reserve_seconds(), checkpointer.held_seconds(), checkpointer.write_seconds(),
                          std::move(step_ms_while_writing)};
    totals.comm_start = comm_start;
    totals.step_all_gather = step_all_gather;
    totals.overlap_grad_reduce = overlap_grad_reduce;
    write_summary(world, placement, cfg, *model, totals);
    return 0;
  };  // train

  (void)argc;
  (void)argv;
  if (backend == "nccl") {
#ifdef FSDP_WITH_NCCL
    return train(std::type_identity<fsdp::NcclComm>{});
#else
    throw std::logic_error("fsdp.backend resolved to nccl in a build without NCCL");  // resolve_run_config refuses it
#endif
  }
  return train(std::type_identity<MpiComm>{});
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App cli{"fsdp-train: train a model with Fully Sharded Data Parallel from a TOML input deck", "fsdp-train"};
  std::string deck_path;
  std::vector<std::string> overrides;
  bool dry_run = false, check_plan = false;
  cli.add_option("DECK", deck_path, "the input deck (TOML)")->required();
  cli.add_option("--set", overrides, "override a deck value: section.key=value (repeatable)");
  cli.add_flag("--dry-run", dry_run, "validate, print the echo and stop");
  cli.add_flag("--check-plan", check_plan, "build the deck's model (no MPI) and check fsdp-plan's closed-form description against it");
  try {
    cli.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return cli.exit(e) == 0 ? 0 : kExitBadInput;
  }
  if (check_plan) {
    try {
      return check_plan_model(deck_path, overrides);
    } catch (const fsdp::ConfigError& e) {
      std::fprintf(stderr, "fsdp-train: error: %s\n", e.what());
      return kExitBadInput;
    }
  }
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
    return run(argc, argv, world, deck_path, overrides, dry_run);
  } catch (const RankError& e) {
    // Agreed between all ranks: rank 0 reports, everyone exits.
    if (world.rank() == 0) std::fprintf(stderr, e.code == kExitStopped ? "fsdp-train: %s\n" : "fsdp-train: error: %s\n", e.what());
    return e.code ? e.code : e.bad_input ? kExitBadInput : kExitFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-train: error on rank %d: %s\n", world.rank(), e.what());
    if (const auto path = fsdp::FlightRecorder::instance().dump()) std::fprintf(stderr, "fsdp-train: rank %d's last collectives: %s\n", world.rank(), path->c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, kExitFailure);  // other ranks may be waiting in a collective
    return kExitFailure;
  }
}
