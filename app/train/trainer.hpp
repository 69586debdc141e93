// fsdp-train (app layer): the Trainer owns one run's state (the resolved deck, data, engine,
// optimizer, schedule, checkpointer, metrics and the totals its summary is made of) and has small
// verbs: build, resume, step, evaluate, save, finish. fsdp-train makes one and loops (train()).
// Every verb that runs collectives is called by every rank in the same order.
#pragma once

#include <fsdp/fsdp.hpp>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "data.hpp"
#include "deck.hpp"
#include "models.hpp"
#include "models/families.hpp"
#include "plan/fit_check.hpp"
#include "run_config.hpp"
#include "train/build.hpp"
#include "train/checkpointer.hpp"
#include "train/dataset.hpp"
#include "train/echo.hpp"
#include "train/run_setup.hpp"
#include "train/eval_only.hpp"
#include "train/gemm_probe.hpp"
#include "train/generate.hpp"
#include "train/metrics_log.hpp"
#include "train/mixture_state.hpp"
#include "train/ranks.hpp"
#include "train/schedule.hpp"
#include "train/signals.hpp"
#include "train/step.hpp"
#include "train/steps_plan.hpp"
#include "train/summary.hpp"
#include "train/timing.hpp"
#include "train/weight_decay.hpp"

namespace fsdp::app {

template <class Comm>
class Trainer {
 public:
  using Engine = fsdp::FullyShardedDataParallel<AppModel, Comm>;

  explicit Trainer(const RunSetup& setup) : s_(setup), world_(setup.world), cfg_(setup.cfg), root_(setup.world.rank() == 0) {}

  /// Reads the data (unless !with_data: generation), builds the model, engine and optimizer, prints the echo and checks that every
  /// rank runs the same job. Collective.
  void build(bool with_data = true) {
    if (with_data) on_all_ranks(world_, [&] { data_ = load_dataset(cfg_, world_.rank(), world_.size()); });
    data_loaded_ = with_data;
    on_all_ranks(world_, [&] {
      auto net = build_model(cfg_);
      check_layer_classes(cfg_, *net);
      model_ = make_engine<Engine>(net, world_, cfg_);
      optimizer_ = build_optimizer(cfg_, *model_);
      if (!cfg_.optim.no_decay.empty()) decay_mask_.emplace(*model_, cfg_.optim.no_decay);
    });
    print_echo(*model_, s_, data_loaded_ ? &data_ : nullptr);
    check_same_job(world_, s_.deck, model_->plan_hash());
  }

  /// --dry-run: leaves an existing run alone; writes the resolved deck only into a new out_dir.
  int dry_run() {
    const std::filesystem::path out_dir = cfg_.run.out_dir;
    bool wrote = false;
    on_all_ranks(world_, [&] {
      if (!root_ || std::filesystem::exists(out_dir / "deck.toml")) return;
      std::filesystem::create_directories(out_dir);
      fsdp::write_file_atomically(out_dir / "deck.toml", s_.deck.to_toml());
      wrote = true;
    });
    if (root_)
      std::printf("dry run: stopping after the echo%s\n",
                  wrote ? (" (resolved deck in " + (out_dir / "deck.toml").string() + ")").c_str() : " (existing deck.toml left as it is)");
    return 0;
  }

  /// Takes the run directory and the state to start from (latest checkpoint, a named one, or fresh),
  /// and derives the schedule. False when the run already reached its last step. Collective.
  bool resume() {
    checkpointer_ = std::make_unique<Checkpointer<Engine>>(cfg_, s_.deck, world_, *model_, optimizer_.get());
    checkpointer_->take_run_directory();
    start_ = checkpointer_->resume();
    next_epoch_ = start_.epoch;  // where the data stands (also for a finished run's summary)
    next_sample_index_ = start_.sample_index;
    plan_schedule();
    data_changes_ = check_data_position(world_, data_, cfg_, start_);
    if (!schedule_.global_batch_change.empty()) data_changes_.insert(data_changes_.begin(), schedule_.global_batch_change);
    checkpointer_->say_resumed();                                               // after every check: a refused resume does not say it resumed
    if (start_.step > 0 && start_.step >= schedule_.total_steps) return false;  // a rerun of a finished job
    fsdp::create_adam_state_ahead(*optimizer_);                                 // what no checkpoint gave, before training's transient tensors
    return true;
  }

  /// A rerun of a finished job (resume() said so): trains nothing; what the run's end did not write
  /// (the export, summary.json: a full disk, a killed job) is written now from the last checkpoint, so
  /// is an export whose settings the deck changed (its names, type, files, config.json's tokens), what
  /// exists is kept, and the line says which. Collective.
  void finish_completed_run() {
    namespace fs = std::filesystem;
    const fs::path summary = fs::path(cfg_.run.out_dir) / "summary.json";
    const std::string export_path = cfg_.checkpoint.export_path.empty() ? "" : export_file(cfg_.checkpoint.export_path).string();
    std::int64_t missing[2] = {0, 0};  // rank 0's view of the folder decides for all
    std::vector<std::string> export_changes;
    on_all_ranks(world_, [&] {
      if (!root_) return;
      // One file, or a split export's index (written last), and a Hugging Face export's config.json
      // (written after the weights: a job killed between the two has none).
      const auto form = export_path.empty() ? std::nullopt : hf_export_form(cfg_.model, cfg_.checkpoint.export_names);
      const bool weights = fs::exists(export_path) || fs::exists(fsdp::safetensors::index_path(export_path));
      if (!export_path.empty() && weights) export_changes = checkpointer_->export_settings_changes();
      missing[0] = !export_path.empty() && (!weights || (form && !fs::exists(config_folder(export_path) / "config.json")) || !export_changes.empty());
      // A summary.json that --eval-only made holds no training figures: the training's is still missing.
      missing[1] = !fs::exists(summary) || !summary_has_training(summary);
    });
    world_.broadcast(missing, 2, fsdp::DType::kInt64, 0);
    progress_ = ProgressStyle::of(cfg_.log.progress);
    step_ = start_.step;
    train_start_ = Clock::now();
    comm_start_ = model_->comm_counters();
    if (missing[0]) checkpointer_->export_model(/*quiet=*/true);
    if (missing[1]) write_summary_again(world_, s_.placement, cfg_, *model_, totals());
    if (!root_) return;
    std::string did;
    if (missing[0] && export_changes.empty()) did += "; wrote the missing export " + export_path;
    if (!export_changes.empty()) {
      did += "; wrote the export " + export_path + " again (";
      for (std::size_t i = 0; i < export_changes.size(); ++i) did += (i ? ", " : "") + export_changes[i];
      did += ")";
    }
    if (missing[1]) did += "; wrote the missing summary.json";
    if (did.empty()) did = "; its outputs are all there";
    std::printf(
        "nothing to train: the run in %s already reached step %lld of %lld%s (train again with a new run.out_dir or checkpoint.resume = \"none\")\n",
        cfg_.run.out_dir.c_str(), static_cast<long long>(start_.step), static_cast<long long>(schedule_.total_steps), did.c_str());
  }

  /// --eval-only (train/eval_only.hpp): the model as it stands, evaluated; nothing trained. Collective.
  int evaluate_only() { return app::evaluate_only(world_, s_.deck, cfg_, *model_, data_, eval_chunk()); }
  /// fsdp-generate (train/generate.hpp): the model loaded as --eval-only loads it, then `o`. Collective.
  Generated generate(const GenerateOptions& o) {
    const std::string source = Checkpointer<Engine>(cfg_, s_.deck, world_, *model_, nullptr).load_for_evaluation("nothing to generate from");
    if (root_) std::printf("model: %s\n", source.c_str());
    return generate_tokens(*model_, *model_->module(), world_, cfg_, o);
  }

  /// Every epoch from the resumed position to the last step, stopping early on a signal (exit 3).
  void train() {
    begin_training();
    bool done = step_ >= schedule_.total_steps;
    for (std::int64_t epoch = start_.epoch; epoch < cfg_.run.epochs && !done; ++epoch) done = train_epoch(epoch);
  }

  /// The last checkpoint, the background write, the export and summary.json. Collective.
  void finish() {
    if (cfg_.checkpoint.save_final) save();
    {
      Timed t(phases_.checkpoint, "checkpoint");
      checkpointer_->wait_background(progress_.quiet);
    }
    {
      Timed t(phases_.checkpoint, "export");
      checkpointer_->export_model(progress_.quiet);
    }
    write_summary(world_, s_.placement, cfg_, *model_, totals());
    say_a_stop_signal_came_late(world_);
  }

 private:
  // ---- build ----------------------------------------------------------------------------------

  /// The sampler and step counts (steps_plan.hpp: a checkpoint of another global batch is refused).
  void plan_schedule() {
    sampler_.emplace(training_sampler(data_, cfg_, world_.size(), world_.rank()));
    schedule_ = plan_training_schedule(cfg_, data_.train_size(), sampler_->num_samples(), world_.size(), root_, start_);
    const auto& p = schedule_;
    if (root_ && start_.step == 0)
      for (const auto& w : schedule_warnings(cfg_, p.steps_per_epoch, p.total_steps, data_.train_size(), p.global_batch, data_.has_test))
        std::printf("warning: %s\n", w.c_str());
  }

  // ---- the loop -------------------------------------------------------------------------------

  /// Opens metrics.csv, continues fp16's loss scale and installs the stop signals.
  void begin_training() {
    progress_ = ProgressStyle::of(cfg_.log.progress);
    write_metrics_ = !cfg_.log.metrics_file.empty();
    metrics_path_ = std::filesystem::path(cfg_.run.out_dir) / cfg_.log.metrics_file;
    on_all_ranks(world_, [&] {
      if (root_ && write_metrics_) metrics_.open(metrics_path_, start_.step);
      if (root_ && write_metrics_ && data_.blend) mixture_log_.open(metrics_path_.parent_path() / "sources.csv", start_.step);
    });
    // Before the clock starts: the probe takes a few tenths of a second on a host's first start.
    utilization_ = measure_utilization(world_, cfg_, model_->num_params(), model_->compute_device().is_cpu());
    window_.reset();
    train_start_ = Clock::now();
    step_ = start_.step;
    comm_start_ = model_->comm_counters();
    rank_watch_.emplace(world_.size(), cfg_.run.rss_growth_warn_mib, start_.step);
    model_->train();
    restore_loss_scale();
    next_epoch_ = start_.epoch;
    next_sample_index_ = start_.sample_index;
    stop_after_the_step_on_signals();
    eval_chunk_ = eval_chunk();
  }

  /// The tokens a language model predicts per sample (model.context); 0 for images.
  std::int64_t tokens_per_sample() const { return data_.tokens ? data_.sequence_length() - 1 : 0; }
  /// A language model evaluates its batch in chunks whose logits stay small (its family's eval_chunk).
  std::int64_t eval_chunk() const { return data_.tokens ? model_family(cfg_.model.kind).eval_chunk(cfg_.model, cfg_.data.test_batch_size) : 0; }

  /// fp16's loss scale, continued from the checkpoint when it has one.
  void restore_loss_scale() {
    if (!cfg_.fsdp.loss_scale) return;
    scaler_.emplace(*cfg_.fsdp.loss_scale);
    const auto saved = start_.scheduler.find("loss_scale"), good = start_.scheduler.find("loss_scale_good_steps");
    if (saved == start_.scheduler.end() || good == start_.scheduler.end()) return;
    try {
      scaler_->restore(saved->second, static_cast<std::int64_t>(good->second));
    } catch (const fsdp::ConfigError& e) {
      throw RankError(std::string("the checkpoint resumed from: /train/scheduler: ") + e.what(), true);
    }
  }

  /// One epoch's steps from the resumed micro-batch on; true when the run reached its last step.
  bool train_epoch(std::int64_t epoch) {
    const auto& p = schedule_;
    sampler_->set_epoch(epoch);
    const auto idx = sampler_->indices();
    // Resuming inside an epoch: skip the micro-batches already trained (global sample count).
    std::int64_t first_micro = 0;
    if (epoch == start_.epoch && start_.sample_index > 0) first_micro = start_.sample_index / (p.batch * world_.size());
    const std::int64_t micro_end = p.steps_per_epoch * p.accum;
    Prefetcher<Batch> loader(
        std::max<std::int64_t>(0, micro_end - first_micro),
        [&, first_micro](std::int64_t k) {
          const auto begin = std::min(static_cast<std::size_t>((first_micro + k) * p.batch), idx.size());
          const auto end = std::min(begin + static_cast<std::size_t>(p.batch), idx.size());
          Batch b = make_batch(data_, true, idx, begin, end);
          b.sample_lines = sample_log_.lines(epoch, idx, begin, end, world_.size());
          return b;
        },
        static_cast<int>(cfg_.data.num_workers));
    bool done = false;
    for (std::int64_t micro = first_micro; micro < micro_end && !done; micro += p.accum) done = step(loader, epoch, micro, micro_end);
    if (progress_.live && root_ && !progress_.quiet) std::printf("\n");
    return done;
  }

  /// One optimizer step and what follows it: evaluation, the progress line, checkpoints, a stop on a
  /// signal. True when it was the run's last step.
  bool step(Prefetcher<Batch>& loader, std::int64_t epoch, std::int64_t micro, std::int64_t micro_end) {
    const auto step_start = Clock::now();
    fsdp::CollectiveWatchdog::instance().set_step(step_ + 1);
    const double lr = lr_at(cfg_, step_, epoch, schedule_.total_steps);
    for (auto& g : optimizer_->param_groups()) g.options().set_lr(lr);
    const bool writing_checkpoint = checkpointer_->writing();
    StepBreakdown breakdown;
    const double waited_before = model_->communication_wait_seconds();
    run_slow_rank_and_leak_test_hooks(world_.rank());
    const StepOutcome outcome = measured_step(loader, lr, breakdown);
    window_.busy += seconds_since(step_start) - (model_->communication_wait_seconds() - waited_before);
    count_outcome(outcome, epoch);
    ++step_;
    step_ms_.push_back(1000 * seconds_since(step_start));
    if (writing_checkpoint) step_ms_while_writing_.push_back(step_ms_.back());
    if (auto& tracer = fsdp::Tracer::instance(); tracer.enabled())
      tracer.complete("step " + std::to_string(step_), "step", tracer.to_us(step_start), tracer.now_us(), {{"step", static_cast<double>(step_)}});
    window_.loss += outcome.loss;
    ++window_.steps;
    window_.samples += outcome.samples;
    const bool epoch_ends = micro + schedule_.accum >= micro_end;
    next_epoch_ = epoch_ends ? epoch + 1 : epoch;
    next_sample_index_ = epoch_ends ? 0 : (micro + schedule_.accum) * schedule_.batch * world_.size();
    const bool done = step_ >= schedule_.total_steps;
    // An evaluation after this step (eval.every_steps and the last step; by default the epoch's last
    // step), before the log line that reports it; its time is not training time.
    std::optional<EvalResult> step_eval;
    if (data_.has_test && ((cfg_.eval.every_steps > 0 ? step_ % cfg_.eval.every_steps == 0 : epoch_ends) || done)) {
      const auto pause_start = Clock::now();
      step_eval = evaluate(epoch, step_);
      window_.pause += seconds_since(pause_start);
    }
    if (step_ % cfg_.log.every_steps == 0 || done)
      log_progress(epoch, lr, breakdown, step_eval);
    else if (step_eval && root_ && write_metrics_)
      metrics_.eval_row(step_, epoch + 1, *step_eval, data_.tokens);
    checkpointer_->poll_background(progress_.quiet);  // a failed background write stops every rank here
    checkpointer_->reserve_staging(phases_.checkpoint);
    if (outcome.stop_signal) stop_on_signal(outcome.stop_signal);
    if (cfg_.checkpoint.every_steps > 0 && step_ % cfg_.checkpoint.every_steps == 0 && !(done && cfg_.checkpoint.save_final)) {
      if (progress_.live && root_ && !progress_.quiet) std::printf("\n");
      const auto pause_start = Clock::now();
      save(/*may_skip=*/!done);  // the run's last save is never skipped
      window_.pause += seconds_since(pause_start);
    }
    return done;
  }

  /// take_step with the step's breakdown (phases, collectives, page faults) and all-gather bytes.
  StepOutcome measured_step(Prefetcher<Batch>& loader, double lr, StepBreakdown& breakdown) {
    const Phases before = phases_;
    const auto comm_before = model_->comm_counters();
    const auto group_before = model_->forward_group_counters();
    const long faults_before = minor_page_faults();
    const StepOutcome outcome = take_step(loader, lr);
    const auto comm_after = model_->comm_counters();
    step_all_gather_.total += comm_after.all_gather_bytes - comm_before.all_gather_bytes;
    step_all_gather_.inside_reshard_group += model_->forward_group_counters().all_gather_bytes - group_before.all_gather_bytes;
    breakdown = {1000 * (phases_.forward - before.forward),
                 1000 * (phases_.backward - before.backward),
                 1000 * (phases_.optimizer - before.optimizer),
                 1000 * (comm_after.all_gather_seconds - comm_before.all_gather_seconds),
                 1000 * (comm_after.reduce_scatter_seconds - comm_before.reduce_scatter_seconds),
                 1000 * (comm_after.all_reduce_seconds - comm_before.all_reduce_seconds),
                 minor_page_faults() - faults_before};
    return outcome;
  }

  /// The step's micro-batches, clipping and update, skipped when any rank saw a non-finite loss or
  /// gradient norm or, under fp16 loss scaling, overflowed gradients. One small all-reduce decides
  /// that, and carries a stop request and whether the step's collectives failed on some rank.
  /// Collective.
  StepOutcome take_step(Prefetcher<Batch>& loader, double lr) {
    StepOutcome out;
    std::optional<Timed> optimizer_time;  // clipping and the update
    bool overflowed = false;
    double norm = 0.0;
    const auto comm_failure = comm_failure_of<Engine>(
        [&] {
          forward_backward(loader, out);
          zeroed_.fill_missing(*optimizer_);
          optimizer_time.emplace(phases_.optimizer, "optimizer");
          overflowed = scaler_ && model_->unscale_grads(scaler_->scale());  // agreed by every rank
          const double clip = cfg_.optim.clip_grad_norm;
          norm = clip > 0 && !overflowed ? model_->clip_grad_norm(clip) : 0.0;
          // The step's collectives settled before the optimizer uses their results.
          model_->synchronize_collectives();
        },
        test_hook_at("FSDP_TEST_FAIL_COLLECTIVES", world_.rank(), step_ + 1), world_.rank());
    std::int64_t flags[3] = {g_stop_signal, std::isfinite(out.loss) && std::isfinite(norm) ? 0 : 1, comm_failure ? 1 : 0};
    world_.all_reduce(flags, flags, 3, fsdp::DType::kInt64, fsdp::ReduceOp::kMax);
    if (flags[2] != 0) agree(world_, comm_failure, /*bad_input=*/false);  // every rank throws the failing rank's message
    out.stop_signal = flags[0];
    out.nonfinite = flags[1] != 0;
    // An overflow is what loss scaling expects now and then: skip and back off. A non-finite loss is not,
    // nor an overflow at the floor of the scale (gradients that are inf or NaN at any scale): both go to
    // run.on_nonfinite.
    if (overflowed && scaler_->at_floor()) out.nonfinite = true;
    out.overflowed = overflowed && !out.nonfinite;
    if (scaler_ && !out.nonfinite) scaler_->update(overflowed);
    if (!out.nonfinite && !out.overflowed) {
      checkpointer_->wait_for_copies();                                  // a background copy of the state must end before the state changes
      if (decay_mask_) decay_mask_->apply(lr, cfg_.optim.weight_decay);  // optim.no_decay: adamw's decay, element by element
      optimizer_->step();
    }
    release_gradients(*optimizer_);  // free through evaluation, saves and the next forward
    return out;
  }

  /// The step's micro-batches: forward, loss (divided by their count) and backward; gradients reduced
  /// after the last one or, with optim.accum_reduce = every, after each.
  void forward_backward(Prefetcher<Batch>& loader, StepOutcome& out) {
    const std::int64_t accum = schedule_.accum;  // no gradients here: take_step released the last step's
    for (std::int64_t a = 0; a < accum; ++a) {
      std::optional<Batch> b;
      {
        Timed t(phases_.data, "data");
        b = loader.next();
      }
      if (!b) throw std::runtime_error("data loader ended early");
      sample_log_.append(b->sample_lines);
      std::optional<typename Engine::NoSyncScope> no_sync;
      if (a + 1 < accum && !cfg_.optim.reduce_every_micro_batch) no_sync.emplace(model_->no_sync());  // reduce once, on the last micro-batch
      torch::Tensor loss;
      {
        Timed t(phases_.forward, "forward + loss");
        Batch on_device = std::move(*b).to(model_->compute_device());
        loss = loss_of(data_, forward_batch(*model_, on_device), on_device.y) / static_cast<double>(accum);
      }
      {
        Timed t(phases_.backward, "backward");
        (scaler_ ? loss * scaler_->scale() : loss).backward();
      }
      out.loss += loss.template item<double>();
      out.samples += b->samples;
    }
  }

  /// Counts skipped and overflowed steps; a non-finite step stops the run unless run.on_nonfinite = skip.
  void count_outcome(const StepOutcome& outcome, std::int64_t epoch) {
    samples_trained_ += outcome.samples;
    if (outcome.nonfinite && !cfg_.run.skip_nonfinite)
      throw RankError("non-finite loss or gradient norm at step " + std::to_string(step_ + 1) + " (epoch " + std::to_string(epoch + 1) +
                          "); stopped without saving the poisoned state (run.on_nonfinite = \"skip\" skips such steps)",
                      kExitNonFinite);
    if (outcome.nonfinite || outcome.overflowed) {
      ++skipped_steps_;
      ++window_.skipped;
    }
    if (outcome.overflowed) ++overflow_steps_;
    if (outcome.nonfinite && root_)
      std::printf("warning: non-finite loss or gradient norm at step %lld: step skipped\n", static_cast<long long>(step_ + 1));
  }

  /// The progress line and metrics.csv row of the window ending at this step. Collective.
  void log_progress(std::int64_t epoch, double lr, const StepBreakdown& breakdown, const std::optional<EvalResult>& step_eval) {
    double stats[2] = {window_.loss / static_cast<double>(window_.steps), static_cast<double>(window_.samples)};
    RankReport ranks;
    // Test hooks (docs/reliability.md): one rank skips this collective, or issues another one.
    if (test_hook_at("FSDP_TEST_SKIP_COLLECTIVE", world_.rank(), step_)) {
    } else if (test_hook_at("FSDP_TEST_OTHER_COLLECTIVE", world_.rank(), step_)) {
      world_.barrier();
    } else {
      world_.all_reduce(stats, stats, 2, fsdp::DType::kFloat64, fsdp::ReduceOp::kSum);
      ranks = rank_watch_->observe(world_, step_, window_.busy, window_.steps);
    }
    const double loss_avg = stats[0] / world_.size();
    const double rate = stats[1] / std::max(1e-9, seconds_since(window_.start) - window_.pause);
    const std::optional<double> mfu = utilization_.at(rate);
    last_loss_ = loss_avg;
    if (root_) {
      const double elapsed = seconds_since(train_start_);
      const double eta = elapsed / static_cast<double>(step_ - start_.step) * static_cast<double>(schedule_.total_steps - step_);
      // Language models count tokens (model.context per sequence), as llm.c and nanoGPT report.
      const char* unit = data_.tokens ? "tokens/s" : "samples/s";
      const double shown_rate = data_.tokens ? rate * static_cast<double>(tokens_per_sample()) : rate;
      if (!progress_.quiet) {
        // Several ranks: the slowest one's own work per step beyond the others' (what they waited).
        char slowest[64] = "";
        if (world_.size() > 1) std::snprintf(slowest, sizeof slowest, "  slowest rank %d +%.1f ms/step", ranks.slowest_rank, ranks.others_waited_ms);
        char utilization[32] = "";
        if (mfu) std::snprintf(utilization, sizeof utilization, "  MFU %.1f%%", 100 * *mfu);
        std::printf("%sepoch %lld step %lld/%lld  loss %.4f  lr %.3g  %.0f %s%s  ETA %s%s%s", progress_.live ? "\r" : "",
                    static_cast<long long>(epoch + 1), static_cast<long long>(step_), static_cast<long long>(schedule_.total_steps), loss_avg, lr,
                    shown_rate, unit, utilization, format_duration(eta).c_str(), slowest, progress_.live ? "   " : "\n");
        std::fflush(stdout);
      }
      for (const auto& warning : ranks.warnings) std::printf("%s%s\n", progress_.live && !progress_.quiet ? "\n" : "", warning.c_str());
      if (write_metrics_)
        metrics_.row(step_, epoch + 1, loss_avg, lr, rate, step_ms_.back(), elapsed, breakdown,
                     scaler_ ? std::optional<double>(scaler_->scale()) : std::nullopt, window_.skipped, ranks, step_eval, tokens_per_sample(), mfu);
      if (write_metrics_ && data_.blend) mixture_log_.rows(step_, mixture_shares(data_, cfg_, next_epoch_, next_sample_index_));
    }
    window_.reset();
  }

  /// One evaluation (eval.max_batches bounds it), reported on the progress stream. Collective.
  EvalResult evaluate(std::int64_t epoch, std::int64_t at_step) {
    if (progress_.live && root_ && !progress_.quiet) std::printf("\n");
    Timed t(phases_.eval, "eval");
    last_eval_ = app::evaluate(*model_, data_, cfg_.data.test_batch_size, world_, cfg_.eval.max_batches, eval_chunk_);
    evaluated_ = true;
    eval_step_ = at_step;
    if (rank_watch_) rank_watch_->first_time_restarts_warmup(RankWatch::Occasion::kEvaluation, at_step);
    if (root_ && !progress_.quiet) {
      if (data_.tokens)
        std::printf("epoch %lld step %lld: eval loss %.4f, perplexity %.2f, accuracy %.2f%% (%lld tokens)\n", static_cast<long long>(epoch + 1),
                    static_cast<long long>(at_step), last_eval_.loss, std::exp(last_eval_.loss), 100 * last_eval_.accuracy,
                    static_cast<long long>(last_eval_.samples));
      else
        std::printf("epoch %lld step %lld: test loss %.4f, accuracy %.2f%% (%lld samples)\n", static_cast<long long>(epoch + 1),
                    static_cast<long long>(at_step), last_eval_.loss, 100 * last_eval_.accuracy, static_cast<long long>(last_eval_.samples));
      std::fflush(stdout);
    }
    return last_eval_;
  }

  /// A checkpoint of the current state: where a run restarted from it continues (the next epoch and
  /// global sample), the schedule's and fp16 loss scale's state. A periodic save `may_skip` under
  /// checkpoint.async_when_writing = "skip"; the final one and a stop's never do. Collective.
  void save(bool may_skip = false) {
    fsdp::TrainState s;
    s.step = step_;
    s.epoch = next_epoch_;
    s.sample_index = next_sample_index_;
    store_data_position(data_, next_epoch_, next_sample_index_, s);
    s.scheduler = {{"lr", lr_at(cfg_, step_, next_epoch_, schedule_.total_steps)},
                   {"total_steps", static_cast<double>(schedule_.total_steps)},
                   {"global_batch", static_cast<double>(schedule_.global_batch)}};
    if (scaler_) {  // powers of two and small counts: exact as doubles
      s.scheduler["loss_scale"] = scaler_->scale();
      s.scheduler["loss_scale_good_steps"] = static_cast<double>(scaler_->good_steps());
    }
    checkpointer_->save(s, phases_.checkpoint, progress_.quiet, may_skip);
    if (rank_watch_) rank_watch_->first_time_restarts_warmup(RankWatch::Occasion::kSave, step_);
  }

  /// A stop signal reached some rank: save, wait for the write and stop every rank with exit 3.
  [[noreturn]] void stop_on_signal(std::int64_t signo) {
    save();
    checkpointer_->wait_background(progress_.quiet);
    throw RankError("stopped by signal " + stop_signal_name(signo) + " after step " + std::to_string(step_) + "; checkpoint saved in " +
                        checkpointer_->dir().string() + ": rerun the same command to continue",
                    kExitStopped);
  }

  // ---- the end --------------------------------------------------------------------------------

  RunTotals totals() {
    RunTotals t;
    t.backend = to_string(cfg_.fsdp.backend_resolved);
    t.out_dir = cfg_.run.out_dir;
    if (write_metrics_) t.metrics_path = metrics_path_;
    t.steps = step_;
    t.resumed_from_step = start_.step;
    t.resume_changed = checkpointer_->resume_changes();
    t.resume_changed.insert(t.resume_changed.end(), data_changes_.begin(), data_changes_.end());
    t.sources = mixture_shares(data_, cfg_, next_epoch_, next_sample_index_);
    t.skipped_steps = skipped_steps_;
    t.overflow_steps = overflow_steps_;
    if (scaler_) t.loss_scale = scaler_->scale();
    t.samples_trained = samples_trained_;
    t.tokens_per_sample = tokens_per_sample();
    t.flops_per_token = model_family(cfg_.model.kind).flops_per_token(cfg_.model, model_->num_params());
    t.utilization = utilization_;
    t.samples_per_step = schedule_.global_batch;
    t.timing_warmup_steps = cfg_.log.timing_warmup_steps;
    t.last_loss = last_loss_;
    if (evaluated_) {
      t.eval = last_eval_;
      t.eval_step = eval_step_;
    }
    t.wall_s = seconds_since(s_.wall_start);
    t.train_elapsed_s = seconds_since(train_start_);
    t.phases = phases_;
    t.step_ms = std::move(step_ms_);
    t.checkpoints = {checkpointer_->asynchronous(),  checkpointer_->reserve_seconds(),  checkpointer_->held_seconds(),
                     checkpointer_->write_seconds(), std::move(step_ms_while_writing_), checkpointer_->skipped_saves()};
    t.comm_start = comm_start_;
    t.step_all_gather = step_all_gather_;
    t.overlap_grad_reduce = cfg_.fsdp.overlap_grad_reduce;
    if (rank_watch_) {
      t.rss_growth_mib = rank_watch_->growth_mib();
      t.rss_warm_step = rank_watch_->warm_since_step();
    }
    return t;
  }

  // ---- state ----------------------------------------------------------------------------------

  const RunSetup& s_;
  MpiComm& world_;
  const RunConfig& cfg_;
  const bool root_;
  Dataset data_;
  std::shared_ptr<Engine> model_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  ZeroedGradients zeroed_;                     // the updates zero_grad() gave, with the gradients released between steps
  std::optional<WeightDecayMask> decay_mask_;  // optim.no_decay
  std::unique_ptr<Checkpointer<Engine>> checkpointer_;
  fsdp::TrainState start_;  // the state resumed from (step 0 for a fresh run)
  std::optional<DistributedSampler> sampler_;
  TrainingSchedule schedule_;
  std::optional<fsdp::DynamicLossScale> scaler_;  // fp16's loss scale
  ProgressStyle progress_;
  bool write_metrics_ = false;
  std::filesystem::path metrics_path_;
  MetricsLog metrics_;
  MixtureLog mixture_log_;                 // sources.csv, for data.sources
  SampleLog sample_log_{world_.rank()};    // test hook FSDP_TEST_SAMPLE_LOG
  std::vector<std::string> data_changes_;  // a resumed run's data counters that differ (checkpoint.resume_changed = "allow")
  std::int64_t eval_chunk_ = 0;
  bool data_loaded_ = true;

  // What the run did so far: the summary is made of these.
  Phases phases_;
  std::vector<double> step_ms_, step_ms_while_writing_;  // the latter: steps begun while a checkpoint was written in the background
  LogWindow window_;
  Clock::time_point train_start_;
  std::int64_t step_ = 0, samples_trained_ = 0, skipped_steps_ = 0, overflow_steps_ = 0;
  std::int64_t next_epoch_ = 0, next_sample_index_ = 0;  // where a run restarted from the current state continues
  double last_loss_ = std::nan("");
  EvalResult last_eval_;
  bool evaluated_ = false;
  std::int64_t eval_step_ = 0;
  fsdp::CommCounters comm_start_;
  StepAllGather step_all_gather_;        // training steps' all-gathers (evaluation's not counted)
  std::optional<RankWatch> rank_watch_;  // resident memory and the slowest rank, per log window
  Utilization utilization_;              // MFU: the model's FLOPs per sample and the run's peak (GEMM probe)
};

}  // namespace fsdp::app
