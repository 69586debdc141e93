// fsdp-train (app layer): the run directory and its checkpoints as one collaborator of the run: it
// holds the directory (one run per directory), writes the resolved deck, resumes (from `latest`, a
// given checkpoint, or nothing, keeping checkpoints of other trajectories aside) and saves.
#pragma once

#include <fsdp/fsdp.hpp>
#include <fsdp/io/async_checkpoint.hpp>
#include <fsdp/io/checkpoint_tools.hpp>
#include <fsdp/io/run_lock.hpp>
#include <fsdp/io/safetensors.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "deck.hpp"
#include "gpt2_names.hpp"
#include "hf_export.hpp"
#include "run_config.hpp"
#include "train/pretrained_checks.hpp"
#include "train/ranks.hpp"
#include "train/timing.hpp"

namespace fsdp::app {

template <class Engine>
class Checkpointer {
 public:
  Checkpointer(const RunConfig& cfg, const Deck& deck, MpiComm& world, Engine& model, torch::optim::Optimizer* optimizer)
      : cfg_(cfg),
        deck_(deck),
        deck_text_(deck.to_toml()),
        world_(world),
        root_(world.rank() == 0),
        model_(model),
        optimizer_(optimizer),
        out_dir_(cfg.run.out_dir),
        dir_(cfg.checkpoint.dir) {
    options_.state_dict_type = cfg.checkpoint.state_dict_type;
    options_.keep_last = static_cast<int>(cfg.checkpoint.keep_last);
    options_.rank0_only = cfg.checkpoint.rank0_only;
    options_.collective_timeout_s = cfg.checkpoint.collective_timeout_s;  // comm.timeout_s: a save or load some rank never enters fails in time
    const char* skip = std::getenv("FSDP_TEST_SKIP_SAVE_ON_RANK");
    skip_save_ = skip && *skip && std::atoi(skip) == world.rank();
    // Test hook (docs/reliability.md), "STEP:SECONDS": the write of step STEP's checkpoint pauses that
    // long once its parameters are written, so that a test can kill a rank in the middle of it.
    if (const char* slow = std::getenv("FSDP_TEST_SLOW_CHECKPOINT_WRITE"); slow && *slow) {
      const std::int64_t at_step = std::atoll(slow);
      const char* colon = std::strchr(slow, ':');
      const double pause_s = colon ? std::atof(colon + 1) : 0;
      options_.on_stage = [at_step, pause_s](const std::string& stage, std::int64_t step) {
        if (stage == "writing" && step == at_step) std::this_thread::sleep_for(std::chrono::duration<double>(pause_s));
      };
    }
    // Without any save planned there is nothing to write in the background (a stop signal saves
    // synchronously); a checkpointer without an optimizer only loads (--eval-only, fsdp-generate).
    if (optimizer_ && cfg.checkpoint.asynchronous && (cfg.checkpoint.every_steps > 0 || cfg.checkpoint.save_final))
      on_all_ranks(world_, [&] {
        async_.emplace(model_, cfg.checkpoint.async_copies());
        async_->set_copy_in_background(cfg.checkpoint.async_copy == AsyncCopy::kBackground);
      });
  }

  /// Holds the run directory (a second run on it stops here, exit 2, naming the holder) and writes the
  /// resolved deck there. Collective.
  void take_run_directory() {
    on_all_ranks(world_, [&] {
      if (!root_) return;
      namespace fs = std::filesystem;
      lock_.emplace(fsdp::RunLock::acquire(out_dir_));
      // A checkpoint folder outside the run's folder is guarded too: two runs must not mix checkpoints.
      const fs::path folder = fs::weakly_canonical(dir_), own = fs::weakly_canonical(out_dir_);
      const auto inside = folder.lexically_relative(own);
      if (inside.empty() || *inside.begin() == "..") {
        checkpoint_lock_.emplace(fsdp::RunLock::acquire(dir_, fsdp::RunLock::this_process(), "checkpoint folder", "checkpoint.dir"));
        // ... and when it lies in another run's folder (checkpoint.dir = "../a/checkpoints"), that
        // run's lock too: its checkpoints are the other run's while it runs.
        for (fs::path p = folder.parent_path(); !p.empty() && p != own; p = p.parent_path()) {
          if (fs::exists(p / fsdp::RunLock::kFileName)) {
            owner_lock_.emplace(fsdp::RunLock::acquire(p, fsdp::RunLock::this_process(), "run directory", "checkpoint.dir"));
            break;
          }
          if (p == p.root_path()) break;
        }
      } else if (folder != own && fs::exists(folder / fsdp::RunLock::kFileName)) {  // checkpoint.dir = ".": the run's own lock
        // Another run may hold this run's checkpoint folder as its checkpoint.dir.
        checkpoint_lock_.emplace(fsdp::RunLock::acquire(dir_, fsdp::RunLock::this_process(), "checkpoint folder", "run.out_dir"));
      }
    });
    on_all_ranks(world_, [&] {
      if (!root_) return;
      std::filesystem::create_directories(out_dir_);
      fsdp::write_file_atomically(out_dir_ / "deck.toml", deck_text_);  // an OutputError stops every rank (exit 1)
      check_export_config();
    });
  }

  /// An hf export's config.json would replace another model's at the end of the run: refused now,
  /// before training (ConfigError, exit 2), and again right before the export.
  /// This run's own earlier export there (a rerun's) may replace its config.json whatever it says.
  void check_export_config() const {
    const auto& c = cfg_.checkpoint;
    if (c.export_path.empty() || written_by_this_run(recorded_export_settings())) return;
    if (const auto form = hf_export_form(cfg_.model, c.export_names))
      check_config_json_replaceable(export_file(c.export_path), form->config, "set checkpoint.export to a folder of its own");
  }

  /// The state training starts from (checkpoint.resume: auto, none or a checkpoint). Checkpoints this
  /// run does not continue move to abandoned/ so its saves never replace them. Collective.
  fsdp::TrainState resume() {
    fsdp::TrainState state;
    const std::string& resume = cfg_.checkpoint.resume;
    if (resume == "auto") {
      fsdp::ResumeResult r;
      // A checkpoint of another model or optimizer in this folder stops the run (it is not skipped:
      // training on would mix two runs in one folder).
      on_all_ranks(world_, [&] {
        try {
          r = fsdp::resume_from_latest(model_, optimizer_, dir_.string(), &state, options_);
        } catch (const fsdp::CheckpointError& e) {
          // A deck that changed a model size (model.context, ...) reads as another run; its stored deck
          // names the key, which tells more than the tensors.
          const auto all = fsdp::ckpt::run_checkpoints(dir_);
          if (e.id() != "fsdp.ckpt.mismatch" || all.empty()) throw;
          const std::string newest = (dir_ / all.front().second).string();
          if (model_size_differences(deck_, newest).empty()) throw;
          loading_into_the_decks_model("checkpoint.resume = \"auto\"", newest, [&] { throw; });
        }
      });
      if (root_)
        for (const auto& why : r.skipped) std::printf("warning: skipped checkpoint %s\n", why.c_str());
      if (r.path.empty()) {
        initialize_from_pretrained();
        return state;
      }
      compare_with_the_deck_of(r.path, state.deck);
      resumed_ = r.path + " at step " + std::to_string(state.step);
      return state;
    }
    if (resume != "none") {
      const std::string path = checkpoint_named_on_rank0("checkpoint.resume", resume);
      on_all_ranks(world_, [&] {
        loading_into_the_decks_model("checkpoint.resume", path, [&] { fsdp::load_checkpoint(model_, optimizer_, path, &state, options_); });
      });
      loaded_from_ = path;
      compare_with_the_deck_of(path, state.deck);
      resumed_ = path + " at step " + std::to_string(state.step);
    }
    // Those past the step this run starts from belong to another trajectory; all of them do for a fresh
    // start or a checkpoint taken from another folder.
    std::vector<std::string> moved;
    on_all_ranks(world_, [&] {
      if (!root_) return;
      const bool from_this_folder = resume != "none" && std::filesystem::exists(dir_) &&
                                    std::filesystem::equivalent(std::filesystem::absolute(loaded_from_).parent_path(), dir_);
      moved = fsdp::ckpt::set_aside_checkpoints_after(dir_, from_this_folder ? state.step : -1);
      if (resume == "none" && std::filesystem::exists(dir_ / fsdp::ckpt::kLatestName)) {  // a fresh start: the old pointer goes with its run
        std::filesystem::create_directories(dir_ / fsdp::ckpt::kSetAsideName);
        std::filesystem::rename(dir_ / fsdp::ckpt::kLatestName, dir_ / fsdp::ckpt::kSetAsideName / fsdp::ckpt::kLatestName);
      }
    });
    if (root_ && !moved.empty())
      std::printf("warning: moved %zu checkpoint(s) of another run from %s to %s/ (%s ... %s)\n", moved.size(), dir_.c_str(),
                  fsdp::ckpt::kSetAsideName, moved.back().c_str(), moved.front().c_str());
    if (resume == "none") initialize_from_pretrained();
    return state;
  }

  /// "resumed from <checkpoint> at step N" on rank 0, once every check of the resume passed (the deck's
  /// here, the data's in the Trainer): a refused resume does not say it resumed. Nothing for a fresh start.
  void say_resumed() const {
    if (root_ && !resumed_.empty()) std::printf("resumed from %s\n", resumed_.c_str());
  }

  /// fsdp-train --eval-only and fsdp-generate: loads the weights to read, without taking the run
  /// directory or moving anything: checkpoint.resume's checkpoint when it names one; with "auto" the
  /// newest usable checkpoint of checkpoint.dir, tried as a resume tries them (a damaged `latest` or an
  /// unreadable checkpoint is skipped with a warning), else checkpoint.init_from; with "none"
  /// checkpoint.init_from. Returns what was loaded ("path (step N)"); when there is nothing to load, a
  /// DeckError on every rank whose message starts with `nothing` ("--eval-only: nothing to evaluate");
  /// a CheckpointError when checkpoints exist and none loads. Collective.
  std::string load_for_evaluation(const std::string& nothing) {
    const std::string& resume = cfg_.checkpoint.resume;
    auto options = options_;
    options.rank0_only = false;  // every rank reads its own part
    options.load_rng_state = false;
    const char* key = resume != "auto" && resume != "none" ? "checkpoint.resume" : "checkpoint.dir";
    fsdp::TrainState state;
    auto load = [&](const std::string& path) {
      loading_into_the_decks_model(key, path, [&] { fsdp::load_checkpoint(model_, nullptr, path, &state, options); });
    };
    auto loaded = [&](const std::string& path) { return path + " (step " + std::to_string(state.step) + ")"; };
    if (resume != "auto" && resume != "none") {
      const std::string path = checkpoint_named_on_rank0(key, resume);
      on_all_ranks(world_, [&] { load(path); });
      return loaded(path);
    }
    if (resume == "auto") {
      fsdp::ResumeResult r;
      on_all_ranks(world_,
                   [&] { r = fsdp::load_newest_usable(world_, dir_.string(), load, "Repair or move them (fsdp-ckpt verify names the damage)"); });
      if (root_)
        for (const auto& why : r.skipped) std::printf("warning: skipped checkpoint %s\n", why.c_str());
      if (!r.path.empty()) return loaded(r.path);
    }
    on_all_ranks(world_, [&] {
      if (cfg_.checkpoint.init_from.empty())
        throw DeckError(nothing + ": " + (resume == "none" ? std::string("checkpoint.resume = \"none\"") : "no checkpoint in " + dir_.string()) +
                        " and checkpoint.init_from is empty");
    });
    initialize_from_pretrained();
    return cfg_.checkpoint.init_from;
  }

  /// checkpoint.export: the model as safetensors, written by every rank from its shards (and
  /// config.json for hf names), split above checkpoint.export_max_shard_size. Collective.
  void export_model(bool quiet) {
    const auto& c = cfg_.checkpoint;
    if (c.export_path.empty()) return;
    const auto form = hf_export_form(cfg_.model, c.export_names);
    const TensorNaming* naming = form && form->naming ? &*form->naming : nullptr;
    fsdp::SafetensorsSaveOptions options;
    options.max_file_bytes = c.export_max_shard_bytes;
    switch (c.export_dtype) {
      case ExportDtype::kBf16: options.dtype = torch::kBFloat16; break;
      case ExportDtype::kFp16: options.dtype = torch::kHalf; break;
      case ExportDtype::kFp32: options.dtype = torch::kFloat; break;
      case ExportDtype::kAsTrained: break;
    }
    options.naming = naming;
    options.collective_timeout_s = c.collective_timeout_s;
    options.metadata[kExportSettingsKey] = export_settings();
    const auto file = export_file(c.export_path);
    fsdp::SafetensorsSaveResult r;
    // An earlier export here in Hugging Face form (it recorded config.json's keys) wrote the config.json
    // beside it: an export without one removes it, or transformers would read these weights by it.
    bool earlier_had_config = false;
    on_all_ranks(world_, [&] {
      if (!root_) return;
      check_export_config();
      const auto recorded = recorded_export_settings();
      const auto names = recorded.find("checkpoint.export_names");
      earlier_had_config = !form && written_by_this_run(recorded) && names != recorded.end() && names->second != "\"native\"";
    });
    on_all_ranks(world_, [&] { r = fsdp::save_safetensors(model_, file.string(), options); });
    on_all_ranks(world_, [&] {
      if (root_ && form) write_hf_config(file, form->config, c.export_dtype);
      if (root_ && earlier_had_config) std::filesystem::remove(config_folder(file) / "config.json");
    });
    if (root_ && !quiet)
      std::printf("exported %lld tensors (%s names) to %s (%s%.1f MiB, %.2f s)\n", static_cast<long long>(r.tensors),
                  to_string(c.export_names).c_str(), r.path.c_str(), r.files > 1 ? (std::to_string(r.files) + " files, ").c_str() : "",
                  r.bytes / 1048576.0, r.seconds);
  }

  /// A finished run's export against this deck's export settings (export_settings), as "key: before ->
  /// now" lines: what a rerun of the finished run writes again. An export whose files cannot be read,
  /// or that an older version wrote without the record, counts as changed. Rank 0.
  std::vector<std::string> export_settings_changes() const {
    const auto before = recorded_export_settings();
    if (before.empty()) return {"the export has no record of its settings"};
    std::vector<std::string> changes;
    for (const char* key : export_settings_keys()) {
      const std::string now = format_value(deck_.entry(key).value);
      const auto it = before.find(key);
      const std::string was = it == before.end() ? "(unrecorded)" : it->second;
      if (was != now) changes.push_back(std::string(key) + ": " + was + " -> " + now);
    }
    return changes;
  }

  /// Saves `state` (the deck is added); the time training is held goes to `seconds`. With
  /// checkpoint.async the write goes on in the background after the state is copied to the host;
  /// while the previous write still runs, checkpoint.async_when_writing decides: a second host copy
  /// (queue; both busy: the older write is waited for), a wait, or, for a save that `may_skip`, no
  /// save. A failed save fails on every rank alike (exit 2, the previous checkpoint and `latest`
  /// intact): at once, or for a background write at the step boundary where it is learnt
  /// (poll_background) or at wait_background. Collective.
  void save(fsdp::TrainState state, double& seconds, bool quiet, bool may_skip = false) {
    Timed t(seconds, "checkpoint");
    const auto start = Clock::now();
    state.deck = deck_text_;
    if (skip_save_) {
      // Test hook (docs/reliability.md): this rank never enters the save, like a rank stuck elsewhere; the
      // others give up after comm.timeout_s and abort the job, which ends this rank too.
      std::fprintf(stderr, "fsdp-train: rank %d does not enter the save at step %lld (FSDP_TEST_SKIP_SAVE_ON_RANK)\n", world_.rank(),
                   static_cast<long long>(state.step));
      std::this_thread::sleep_for(std::chrono::seconds(3600));
    }
    if (async_) {
      // in_flight() is the same on every rank: writes are collected only where all ranks agree.
      if (may_skip && cfg_.checkpoint.async_when_writing == AsyncWhenWriting::kSkip && async_->in_flight()) {
        skipped_.push_back(state.step);
        if (root_)
          std::printf("warning: checkpoint %s skipped: the previous one is still being written (checkpoint.async_when_writing = \"skip\")\n",
                      fsdp::ckpt::checkpoint_name(state.step).c_str());
        return;
      }
      if (async_->every_copy_busy())
        if (const auto r = agreed_background_outcome([&] { return async_->wait(); }))
          report(*r, quiet);  // the oldest write: its failure reads as one
      const double waited_s = seconds_since(start);
      fsdp::AsyncSaveStart started;
      on_all_ranks(world_, [&] { deadline_aborts([&] { started = async_->save(model_, optimizer_, dir_.string(), state, options_); }); });
      held_s_.push_back(seconds_since(start));
      if (root_ && !quiet)
        std::printf(
            "checkpoint %s: writing in the background%s (training held %.2f s: %.2f s copying the state, %.2f s waiting for the previous "
            "save%s)\n",
            fsdp::ckpt::checkpoint_name(state.step).c_str(), started.queued ? " after the save still being written" : "", held_s_.back(),
            started.copy_seconds, waited_s, started.background_bytes > 0 ? "; the rest of the copy beside the next step" : "");
      return;
    }
    fsdp::SaveResult r;
    on_all_ranks(world_, [&] { deadline_aborts([&] { r = fsdp::save_checkpoint(model_, optimizer_, dir_.string(), state, options_); }); });
    held_s_.push_back(seconds_since(start));
    report(r, quiet);
  }

  /// checkpoint.async: allocates the host copy of the state once, after the first step (when
  /// every optimizer has its state), so that no save pays for it. Its time goes to `seconds`. Collective.
  void reserve_staging(double& seconds) {
    if (!async_ || staging_reserved_) return;
    Timed t(seconds, "checkpoint");
    const auto start = Clock::now();
    on_all_ranks(world_, [&] { async_->reserve(model_, optimizer_); });
    staging_reserved_ = true;
    reserve_s_ = seconds_since(start);
  }
  double reserve_seconds() const noexcept { return reserve_s_; }

  /// checkpoint.async_copy = "background": before the optimizer step changes the state, the copies of
  /// the saves in flight are finished (this thread takes what is left); the time it takes is added to
  /// the last save's held time. Local.
  void wait_for_copies() {
    if (writing() && async_->copying()) held_s_.back() += async_->wait_for_copies();
  }

  /// Whether a background write is in flight (the same on every rank).
  bool writing() const noexcept { return async_ && async_->in_flight(); }

  /// At a step boundary: collects a background write that has finished on every rank; its failure
  /// stops every rank here (exit 2). Collective while a write is in flight, local otherwise.
  void poll_background(bool quiet) {
    if (!writing()) return;
    if (const auto r = agreed_background_outcome([&] { return async_->poll(); })) report(*r, quiet);
  }

  /// Waits for the background writes in flight, oldest first (before a stop, an export or the end).
  /// Collective while a write is in flight, local otherwise.
  void wait_background(bool quiet) {
    while (writing())
      if (const auto r = agreed_background_outcome([&] { return async_->wait(); })) report(*r, quiet);
  }
  /// Steps whose save checkpoint.async_when_writing = "skip" skipped.
  const std::vector<std::int64_t>& skipped_saves() const noexcept { return skipped_; }

  /// Seconds training was held by each save, and each save's write (in the background or not).
  const std::vector<double>& held_seconds() const noexcept { return held_s_; }
  const std::vector<double>& write_seconds() const noexcept { return write_s_; }
  bool asynchronous() const noexcept { return async_.has_value(); }

  const std::filesystem::path& dir() const noexcept { return dir_; }

  /// The keys that decide the training which this run changed against its checkpoint's deck
  /// (checkpoint.resume_changed = "allow"), "key: before -> now"; summary.json lists them.
  const std::vector<std::string>& resume_changes() const noexcept { return resume_changes_; }

 private:
  /// The deck keys an export depends on besides the weights: its names, types and files, and for a
  /// Hugging Face folder the values its config.json carries that training does not decide. Recorded in
  /// the export's safetensors metadata under kExportSettingsKey as "key = value" lines.
  static constexpr const char* kExportSettingsKey = "fsdp.export_settings";
  std::vector<const char*> export_settings_keys() const {
    std::vector<const char*> keys = {"checkpoint.export_names", "checkpoint.export_dtype", "checkpoint.export_max_shard_size"};
    // A Llama-family config.json carries these; GPT-2's takes its positions and ids from the model.
    if (cfg_.model.kind == ModelKind::kLlama && hf_export_form(cfg_.model, cfg_.checkpoint.export_names))
      for (const char* key : {"model.bos_token_id", "model.eos_token_id", "model.max_positions", "model.sliding_window"}) keys.push_back(key);
    return keys;
  }
  /// The settings, and the run that wrote the export (kExportRunKey: the run folder, absolute).
  std::string export_settings() const {
    std::string text;
    for (const char* key : export_settings_keys()) text += std::string(key) + " = " + format_value(deck_.entry(key).value) + "\n";
    return text + kExportRunKey + " = " + this_run() + "\n";
  }
  static constexpr const char* kExportRunKey = "written_by_run";
  std::string this_run() const { return std::filesystem::absolute(out_dir_).lexically_normal().string(); }
  /// An export whose record is `recorded` is this run's own (a rerun's earlier export): its files and
  /// its config.json are this run's to replace.
  bool written_by_this_run(const std::map<std::string, std::string>& recorded) const {
    const auto run = recorded.find(kExportRunKey);
    return run != recorded.end() && run->second == this_run();
  }
  /// The settings the export now at checkpoint.export recorded ("key" -> "value"); nothing for none, an
  /// unreadable one or one without the record (an earlier version's).
  std::map<std::string, std::string> recorded_export_settings() const {
    const auto file = export_file(cfg_.checkpoint.export_path);
    std::map<std::string, std::string> recorded;
    try {
      const auto shards = fsdp::safetensors::files_of_earlier_export(file);
      const auto header = fsdp::safetensors::read_header((shards.empty() ? file : shards.front()).string());
      const auto it = header.metadata.find(kExportSettingsKey);
      if (it == header.metadata.end()) return recorded;
      std::istringstream lines(it->second);
      for (std::string line; std::getline(lines, line);)
        if (const auto eq = line.find(" = "); eq != std::string::npos) recorded[line.substr(0, eq)] = line.substr(eq + 3);
    } catch (const std::exception&) {  // unreadable: no record
    }
    return recorded;
  }

  /// Runs `load` of `file` (named by the deck's `key`); a file that does not fit the deck's model is a
  /// DeckError that says so with the model sizes that differ first (model_size_differences), then the
  /// library's list of tensors, one a line. Other errors pass unchanged.
  template <class Load>
  void loading_into_the_decks_model(const char* key, const std::string& file, Load&& load) const {
    try {
      load();
    } catch (const fsdp::CheckpointError& e) {
      if (e.id() != "fsdp.ckpt.mismatch") throw;
      // Without a model size that differs, the library's reason stands alone (another world size
      // for a LOCAL checkpoint, another optimizer, a tensor missing).
      const auto sizes = model_size_differences(deck_, file);
      if (sizes.empty()) throw DeckError(std::string(key) + ": " + fsdp::message_without_id(e));
      std::string text = std::string(key) + ": '" + file + "' holds another model than the deck's";
      for (const auto& d : sizes) text += "\n  " + d;
      throw DeckError(text + "\n" + fsdp::message_without_id(e));
    }
  }

  /// A resume whose deck changed a key that decides the training ([model], [data], [optim], run.seed)
  /// is refused on every rank naming each key with both values, unless checkpoint.resume_changed =
  /// "allow" (then each is a warning, kept for summary.json). A stored deck this version cannot read is
  /// a warning: there is nothing to compare. Collective (every rank compares the same texts).
  void compare_with_the_deck_of(const std::string& checkpoint, const std::string& stored) {
    if (stored.empty()) return;
    std::vector<KeyChange> changes;
    try {
      changes = trajectory_changes(Deck::parse(stored, checkpoint + " (its stored deck)"), deck_);
    } catch (const DeckError& e) {
      if (root_) std::printf("warning: the deck stored in %s cannot be compared with this one: %s\n", checkpoint.c_str(), e.what());
      return;
    }
    if (changes.empty()) return;
    std::string list;
    for (const auto& c : changes) list += "\n  " + c.key + ": " + c.before + " in the checkpoint, " + c.now + " now";
    on_all_ranks(world_, [&] {
      if (cfg_.checkpoint.resume_changed == ResumeChanged::kRefuse)
        throw DeckError("checkpoint " + checkpoint + " was trained with another deck; these keys decide the training:" + list +
                        "\ncheckpoint.resume_changed = \"allow\" continues with the new values; a new run.out_dir (or checkpoint.resume = "
                        "\"none\") starts a new run");
    });
    if (root_) std::printf("warning: resuming %s with changed keys (checkpoint.resume_changed = \"allow\"):%s\n", checkpoint.c_str(), list.c_str());
    for (const auto& c : changes) resume_changes_.push_back(c.key + ": " + c.before + " -> " + c.now);
  }

  /// The checkpoint the deck's `key` names (a file, a LOCAL folder, a folder's `latest`), as rank 0
  /// sees it (a FULL file may live on its node-local disk only; the load decides what the others
  /// read); a run directory, the `latest` file itself or a missing file is a DeckError on every rank
  /// saying what it is instead. Collective.
  std::string checkpoint_named_on_rank0(const char* key, const std::filesystem::path& path) {
    std::string resolved;
    on_all_ranks(world_, [&] {
      if (!root_) return;
      try {
        resolved = fsdp::ckpt::checkpoint_at(path).string();
      } catch (const fsdp::CheckpointError& e) {
        throw DeckError(std::string(key) + ": " + fsdp::message_without_id(e));
      }
    });
    return fsdp::broadcast_string(world_, resolved);
  }

  /// checkpoint.init_from for a run that starts fresh: the weights only (the optimizer, step, data
  /// position and RNG stay those of a fresh run). Each rank reads only its shards. Collective.
  void initialize_from_pretrained() {
    const std::string& path = cfg_.checkpoint.init_from;
    if (path.empty()) return;
    namespace fs = std::filesystem;
    const fs::path p(path);
    const bool checkpoint = p.extension() == ".h5" || p.filename() == fsdp::ckpt::kLatestName ||
                            (fs::is_directory(p) && !fs::exists(p / "model.safetensors") && !fs::exists(p / "model.safetensors.index.json"));
    std::string names = "native";
    fsdp::SafetensorsLoadResult r;
    if (checkpoint)
      on_all_ranks(world_, [&] {
        if (root_) refuse_a_model_folder_without_safetensors(p);
      });
    if (checkpoint) {
      auto options = options_;
      options.rank0_only = false;  // every rank reads its own part: no rank holds the whole model
      options.load_rng_state = false;
      const std::string file = checkpoint_named_on_rank0("checkpoint.init_from", p);
      on_all_ranks(world_, [&] {
        loading_into_the_decks_model("checkpoint.init_from", file, [&] { fsdp::load_checkpoint(model_, nullptr, file, nullptr, options); });
      });
    } else {
      std::optional<TensorNaming> naming;
      if (cfg_.model.kind == ModelKind::kLlama) naming = llama_hf_naming(cfg_.model.tie_embeddings);
      std::optional<PretrainedConfigDifferences> config;  // its keys that only an export reads are said after the load
      on_all_ranks(world_, [&] { config = refuse_another_model_in_config_json(deck_, cfg_, root_, p); });
      on_all_ranks(world_, [&] {
        if (!has_hf_gpt2_names(fsdp::safetensors::open_source(path).names())) return;
        if (cfg_.model.kind != ModelKind::kTransformer)
          throw DeckError("checkpoint.init_from: '" + path + "' holds a Hugging Face GPT-2; model.kind is \"" + to_string(cfg_.model.kind) + "\"");
        naming = hf_gpt2_naming(gpt_config(cfg_.model));
        names = kHfGpt2Scheme;
      });
      fsdp::SafetensorsLoadOptions options;
      options.allow_missing = cfg_.checkpoint.init_allow_missing;
      options.naming = naming ? &*naming : nullptr;
      options.collective_timeout_s = cfg_.checkpoint.collective_timeout_s;
      on_all_ranks(world_,
                   [&] { loading_into_the_decks_model("checkpoint.init_from", path, [&] { r = fsdp::load_safetensors(model_, path, options); }); });
      if (root_ && config && !config->metadata.empty()) {
        std::string list;
        for (const auto& m : config->metadata) list += "\n  " + m;
        std::printf("warning: %s says otherwise than the deck of what an export and generation read:%s\nmodel.hf_config = '%s' takes them from it\n",
                    config->file.c_str(), list.c_str(), std::filesystem::path(config->file).parent_path().c_str());
      }
    }
    if (!root_) return;
    std::printf("initialized the model from %s (%s names)\n", path.c_str(), names.c_str());
    for (const auto& [widening, count] : r.widened)  // said once: the weights train in the model's precision from here on
      std::printf("note: %lld tensor(s) of the file widened from %s on load\n", static_cast<long long>(count), widening.c_str());
    if (!r.missing.empty()) {
      std::string list;
      for (const auto& m : r.missing) list += (list.empty() ? "" : ", ") + m;
      std::printf("warning: checkpoint.init_from lacks %zu parameter(s), which keep their initialization: %s\n", r.missing.size(), list.c_str());
    }
  }

  /// A rank that never arrived cannot agree on the failure either: abort (main) instead of waiting.
  template <class F>
  static void deadline_aborts(F&& f) {
    try {
      f();
    } catch (const fsdp::CommError& e) {
      if (e.id() == "fsdp.comm.deadline") throw DeadlineMissed(e.what());
      throw;
    }
  }

  /// The AsyncCheckpointer throws the same CheckpointError on every rank: no further agreement needed.
  template <class F>
  std::optional<fsdp::SaveResult> agreed_background_outcome(F&& f) {
    try {
      std::optional<fsdp::SaveResult> r;
      deadline_aborts([&] { r = f(); });
      return r;
    } catch (const fsdp::CheckpointError& e) {
      throw RankError(
          "the checkpoint written in the background failed: " + fsdp::message_without_id(e) + "; the previous checkpoint is kept as latest", true);
    }
  }

  void report(const fsdp::SaveResult& r, bool quiet) {
    write_s_.push_back(r.seconds);
    if (root_ && !quiet)
      std::printf("checkpoint %s (%.1f MiB, %.2f s%s)\n", r.path.c_str(), r.bytes / 1048576.0, r.seconds, async_ ? " in the background" : "");
    if (root_)
      for (const auto& w : r.warnings) std::printf("warning: %s\n", w.c_str());
  }

  const RunConfig& cfg_;
  const Deck& deck_;
  std::string deck_text_;
  std::vector<std::string> resume_changes_;  // checkpoint.resume_changed = "allow": the keys changed against the checkpoint
  MpiComm& world_;
  bool root_;
  Engine& model_;
  torch::optim::Optimizer* optimizer_;
  std::filesystem::path out_dir_, dir_;
  fsdp::CheckpointOptions options_;
  bool skip_save_ = false;
  std::filesystem::path loaded_from_;                     // checkpoint.resume = <path>: the checkpoint loaded
  std::string resumed_;                                   // "<checkpoint> at step N" once resume() loaded one
  std::optional<fsdp::RunLock> lock_;                     // held until the run ends
  std::optional<fsdp::RunLock> checkpoint_lock_;          // checkpoint.dir outside run.out_dir (or held by another run)
  std::optional<fsdp::RunLock> owner_lock_;               // the run folder checkpoint.dir lies in, another run's
  std::optional<fsdp::AsyncCheckpointer<Engine>> async_;  // checkpoint.async
  std::vector<double> held_s_, write_s_;
  bool staging_reserved_ = false;
  std::vector<std::int64_t> skipped_;  // checkpoint.async_when_writing = "skip": the steps not saved
  double reserve_s_ = 0;
};

}  // namespace fsdp::app
