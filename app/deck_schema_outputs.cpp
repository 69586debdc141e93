// Input decks (app layer): the schema's keys of the [comm], [checkpoint], [eval] and [log] sections
// (the run's communication deadlines and its outputs); deck_schema.cpp holds the others and the lookups.
#include "choices.hpp"
#include "deck.hpp"
#include "deck_detail.hpp"

namespace fsdp::app::detail {

void add_comm_keys(std::vector<KeySpec>& s) {
  using T = KeyType;
  s.push_back({.key = "comm.flight_recorder_entries",
               .type = T::kInt,
               .default_value = I{2000},
               .min = 0,
               .max = 1e8,
               .description = "each rank keeps its last this many collectives and dumps them to <run.out_dir>/flight_rank<R>.json "
                              "when a collective deadline fires, a fatal signal arrives or the job ends on an error; the deadline's "
                              "message names the first collective at which the ranks parted (docs/reliability.md); 0: off"});
  s.push_back({.key = "comm.timeout_s",
               .type = T::kFloat,
               .default_value = 600.0,
               .min = 0,
               .description = "deadline of every collective, like NCCL's watchdog: a rank waiting longer names the collective, unit and "
                              "step and ends the job (exit code 6); 0: no deadline"});
}

void add_checkpoint_keys(std::vector<KeySpec>& s) {
  using T = KeyType;
  s.push_back({.key = "checkpoint.dir",
               .type = T::kString,
               .default_value = "",
               .description = "checkpoint folder; empty: <run.out_dir>/checkpoints; a relative path is relative to run.out_dir (as every "
                              "output's: checkpoint.export, log.metrics_file; inputs such as data.path and checkpoint.init_from are "
                              "relative to the current folder)"});
  s.push_back({.key = "checkpoint.every_steps",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = 1e12,
               .description = "save every this many optimizer steps; 0: only at the end (checkpoint.save_final)"});
  s.push_back({.key = "checkpoint.state_dict_type",
               .type = T::kString,
               .default_value = "SHARDED_STATE_DICT",
               .choices = choice_names<StateDictType>(),
               .description = "SHARDED (every rank writes its part of one file), FULL (rank 0 writes), LOCAL (a file per rank; "
                              "loads at the same world size only)"});
  s.push_back({.key = "checkpoint.keep_last",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = 1e6,
               .description = "keep the newest this many checkpoints; 0: keep all"});
  s.push_back({.key = "checkpoint.resume",
               .type = T::kString,
               .default_value = "auto",
               .description = "auto: continue from the newest readable checkpoint in checkpoint.dir, if any (one of another model or optimizer "
                              "is an error; a finished run trains nothing); none: start fresh; anything else: a checkpoint file, LOCAL "
                              "folder, or checkpoint folder (its latest) to load"});
  s.push_back({.key = "checkpoint.resume_changed",
               .type = T::kString,
               .default_value = "refuse",
               .choices = choice_names<ResumeChanged>(),
               .description =
                   "resuming with a deck whose keys that decide the training differ from the checkpoint's stored deck "
                   "([model], [data] but its evaluation and loading keys, [optim] but optim.state_dtype, run.seed): refuse (exit 2 naming each key "
                   "with both values) or allow (each printed as a warning and listed in summary.json's resume_changed); "
                   "other keys (logging, run.max_steps, evaluation and checkpoint cadence, performance settings) may "
                   "always change"});
  s.push_back({.key = "checkpoint.save_final", .type = T::kBool, .default_value = true, .description = "save a checkpoint after the last step"});
  s.push_back({.key = "checkpoint.async",
               .type = T::kBool,
               .default_value = false,
               .description = "copy the state to host memory and write the checkpoint on an I/O thread while training goes on "
                              "(`latest` moves once it is on disk; host memory: one more copy of the rank's shards and optimizer "
                              "state, two with checkpoint.async_when_writing = \"queue\")"});
  s.push_back({.key = "checkpoint.async_when_writing",
               .type = T::kString,
               .default_value = "queue",
               .choices = choice_names<AsyncWhenWriting>(),
               .description = "checkpoint.async: what a save does while the previous one is still being written. queue: a second "
                              "host copy takes it at once and it is written after the previous one (a save that finds both copies "
                              "busy waits for the older write); wait: training waits for the previous write (one host copy); skip: "
                              "the save is skipped with a warning (one host copy; the run's last save and a save on a stop signal wait)"});
  s.push_back({.key = "checkpoint.async_copy",
               .type = T::kString,
               .default_value = "background",
               .choices = choice_names<AsyncCopy>(),
               .description = "checkpoint.async: when a save copies the shards and optimizer state to host memory. background: "
                              "the I/O thread copies them beside the next step's forward and backward, and the optimizer step "
                              "waits for what is left (state on a GPU, the buffers, the RNG state and, with fsdp.optimizer_sharding "
                              "= \"world\", everything are copied at the save); at_save: training waits for the whole copy at the save"});
  s.push_back({.key = "checkpoint.rank0_only",
               .type = T::kBool,
               .default_value = true,
               .description = "FULL_STATE_DICT loading: rank 0 reads the file and broadcasts it unit by unit"});
}

void add_weights_in_and_out_keys(std::vector<KeySpec>& s) {
  using T = KeyType;
  s.push_back({.key = "checkpoint.init_from",
               .type = T::kString,
               .default_value = "",
               .description = "a fresh run starts from these weights (not their optimizer state or step): a .safetensors file, a folder "
                              "with model.safetensors or model.safetensors.index.json (a Hugging Face model), or a checkpoint file or "
                              "folder; fsdp's own or Hugging Face GPT-2 names, recognized from the file. Each rank reads only its "
                              "shards. A run that resumes from its own checkpoint ignores it"});
  s.push_back({.key = "checkpoint.init_allow_missing",
               .type = T::kBool,
               .default_value = false,
               .description = "checkpoint.init_from may lack parameters (they keep their initialization and are listed); otherwise a "
                              "missing one is an error"});
  s.push_back({.key = "checkpoint.export",
               .type = T::kString,
               .default_value = "",
               .description = "after the last step, write the model as safetensors from the live shards (every rank writes its own "
                              "part): a .safetensors file, or a folder (model.safetensors, and config.json for hf names); relative "
                              "to run.out_dir; empty: no export"});
  s.push_back({.key = "checkpoint.export_names",
               .type = T::kString,
               .default_value = "native",
               .choices = choice_names<ExportNames>(),
               .description = "names in the export: the model's own (native), or Hugging Face's of its family (hf: a folder with "
                              "config.json that from_pretrained reads; transformer: GPT2LMHeadModel, llama: LlamaForCausalLM, or "
                              "Qwen2ForCausalLM with model.attention_bias); hf-gpt2: hf for a transformer"});
  s.push_back({.key = "checkpoint.export_max_shard_size",
               .type = T::kString,
               .default_value = "5GB",
               .description = "an export larger than this is split as save_pretrained splits it: <stem>-00001-of-0000N.safetensors "
                              "and <stem>.safetensors.index.json (\"500MB\", \"2GiB\", bytes; \"0\": one file); unset, a "
                              "checkpoint.export ending in .safetensors is one file"});
  s.push_back({.key = "checkpoint.export_dtype",
               .type = T::kString,
               .default_value = "auto",
               .choices = choice_names<ExportDtype>(),
               .description = "floating-point tensors of the export in this type; auto: as trained"});
}

void add_eval_keys(std::vector<KeySpec>& s) {
  using T = KeyType;
  s.push_back({.key = "eval.every_steps",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = 1e12,
               .description = "evaluate every this many optimizer steps and after the last; 0: after every epoch"});
  s.push_back({.key = "eval.max_batches",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = 1e12,
               .description = "evaluate on at most this many batches (data.test_batch_size per rank) of the evaluation split; 0: all"});
}

void add_log_keys(std::vector<KeySpec>& s) {
  using T = KeyType;
  s.push_back({.key = "log.every_steps",
               .type = T::kInt,
               .default_value = I{10},
               .min = 1,
               .max = 1e12,
               .description = "print the loss every this many optimizer steps"});
  s.push_back({.key = "log.progress",
               .type = T::kString,
               .default_value = "auto",
               .choices = choice_names<ProgressMode>(),
               .description = "auto: a live line when started directly on a terminal, plain lines under mpirun/srun or into files; live, plain; "
                              "none: no progress output"});
  s.push_back({.key = "log.metrics_file",
               .type = T::kString,
               .default_value = "metrics.csv",
               .description = "CSV of the metrics of every logged step, relative to run.out_dir; empty: none"});
  s.push_back({.key = "log.timing_warmup_steps",
               .type = T::kInt,
               .default_value = I{3},
               .min = 0,
               .max = 1e12,
               .description = "the first steps of a run (or of a resumed run) whose times summary.json reports apart (step_ms_warmup): "
                              "step_ms_median and mfu are of the steps after them, once the heap, caches and page tables are warm"});
  s.push_back({.key = "log.trace",
               .type = T::kBool,
               .default_value = false,
               .description = "write a Chrome trace-event timeline per rank (trace_rank<R>.json: steps, forward/backward per unit, "
                              "all-gather, reduce-scatter, optimizer, checkpoint, memory counters; open in Perfetto) and the memory "
                              "timeline memory_rank<R>.csv (for fsdp-plot)"});
}

}  // namespace fsdp::app::detail
