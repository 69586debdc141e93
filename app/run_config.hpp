// The validated deck resolved once into typed structs (app layer, no LibTorch, no MPI): one struct per
// deck section with the deck's values, plus every decision that depends on where the run is placed
// (threads, overlap of gradient reductions, shard group size, resharding, output folders). The programs
// read these fields; only this file and deck.cpp read the Deck by key.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "choices.hpp"
#include "deck.hpp"
#include "gpt_config.hpp"
#include "fsdp/core/loss_scale.hpp"
#include "fsdp/core/strategy.hpp"
#include "fsdp/io/checkpoint_options.hpp"

namespace fsdp::app {

/// Where a run is placed: what the `auto` values depend on.
struct Placement {
  int world_size = 1;
  int nodes = 1;
  int ranks_per_node = 1;
  int node_cores = 1;  ///< hardware threads of the node
  int rank_cpus = 1;   ///< CPUs this rank may run on (its affinity mask)
  /// What this rank can run NCCL on (fsdp-train probes LibTorch and its build); unset where nothing
  /// runs (fsdp-plan): then `auto` means MPI and "nccl" is taken as asked.
  struct Gpu {
    bool usable = false;  ///< a CUDA device is usable by this rank
    std::string why_not;  ///< for the error when it is not
    bool built_with_nccl = false;
  };
  std::optional<Gpu> gpu;
};

struct RunSection {
  std::string name;
  std::uint64_t seed = 1;
  std::int64_t epochs = 2;
  std::int64_t max_steps = 0;                  ///< 0: every epoch
  std::string out_dir;                         ///< resolved: run.out_dir or runs/<run.name>
  int threads = 1;                             ///< resolved: run.threads, or the node's cores over its ranks
  MallocPolicy malloc = MallocPolicy::kReuse;  ///< what malloc does with freed memory
  bool skip_nonfinite = false;                 ///< run.on_nonfinite = "skip"
  MemoryCheck memory_check = MemoryCheck::kRefuse;
  std::int64_t rss_growth_warn_mib = 1024;  ///< 0: never warn
};

struct ModelSection {
  ModelKind kind = ModelKind::kCnn;
  std::optional<double> dropout;  ///< unset: each model's own
  std::vector<std::int64_t> hidden_sizes;
  std::int64_t vocab_size = 256, context = 64, d_model = 128, n_heads = 4, n_layers = 4, mlp_ratio = 4;
  bool tie_embeddings = true;
  std::int64_t vocab_pad_multiple = 1;
  Activation activation = Activation::kGelu;  ///< transformer
  bool recompute_attention = true;            ///< transformer: attention's probabilities recomputed in backward
  // llama (0: derived, see LlamaConfig)
  std::int64_t n_kv_heads = 0, head_dim = 0, intermediate_size = 0;
  double norm_eps = 1e-5, rope_theta = 10000;
  bool attention_bias = false;
  RopeScaling rope_scaling = RopeScaling::kNone;
  double rope_scaling_factor = 8, rope_low_freq_factor = 1, rope_high_freq_factor = 4;
  std::int64_t rope_original_context = 8192;
  std::int64_t max_positions = 0, bos_token_id = -1;
  std::int64_t sliding_window = 0;          ///< model.sliding_window (llama): 0 none; the context is within it
  std::vector<std::int64_t> eos_token_ids;  ///< model.eos_token_id: generation stops at any of them (-1 entries dropped)
  /// data.document_mask: attention keeps documents apart, each beginning at document_token
  /// (data.eot_token) or, with -1, where an indexed dataset's .idx says. From [data], not a [model]
  /// key: the weights do not depend on it.
  bool document_mask = false;
  std::int64_t document_token = -1;
};

/// The transformer of the [model] section (fsdp-train builds it, fsdp-plan describes it).
inline GptConfig gpt_config(const ModelSection& model) {
  GptConfig c;
  c.vocab_size = model.vocab_size;
  c.context = model.context;
  c.d_model = model.d_model;
  c.n_heads = model.n_heads;
  c.n_layers = model.n_layers;
  c.mlp_ratio = model.mlp_ratio;
  c.vocab_pad_multiple = model.vocab_pad_multiple;
  c.dropout = model.dropout.value_or(0.1);
  c.gelu_tanh = model.activation == Activation::kGeluTanh;
  c.recompute_attention = model.recompute_attention;
  c.tie_embeddings = model.tie_embeddings;
  c.document_mask = model.document_mask;
  c.document_token = model.document_token;
  return c;
}

/// One source of a weighted mixture (data.sources): token files read as data.path would be.
struct DataSource {
  std::string path;
  DataKind kind = DataKind::kTokenShards;  ///< token-shards or indexed
  double weight = 1;                       ///< as given; shares are weight / the sum
};

struct DataSection {
  DataKind kind = DataKind::kFashionMnist;
  std::string path;
  std::vector<DataSource> sources;                       ///< data.sources: a mixture in place of path
  std::string val_path;                                  ///< token-shards: validation files (glob); indexed: a dataset prefix
  TokenFormat token_format = TokenFormat::kLlmc;         ///< token-shards
  std::int64_t batch_size = 64, test_batch_size = 1000;  ///< batch_size: resolved per-rank micro-batch
  std::int64_t global_batch_size = 0;                    ///< data.global_batch_size; 0: not fixed
  bool shuffle = true;
  int num_workers = 0;
  std::int64_t train_samples = 0, test_samples = 0, num_samples = 0;
};

struct OptimSection {
  OptimizerKind kind = OptimizerKind::kAdadelta;
  double lr = 1.0, weight_decay = 0, momentum = 0;
  std::vector<double> betas;
  LrSchedule schedule = LrSchedule::kStep;
  double lr_min = 0, decay_fraction = 0.2;
  std::vector<std::string> no_decay;  ///< bias, norm, embedding
  double gamma = 0.7;
  std::int64_t warmup_steps = 0;
  double clip_grad_norm = 0;
  std::int64_t grad_accum_steps = 1;
  bool reduce_every_micro_batch = false;       ///< optim.accum_reduce = every
  StateDtype state_dtype = StateDtype::kFp32;  ///< optim.state_dtype (bf16: adam and adamw only)
  /// Optimizer state tensors per parameter element (for the expected-memory estimate).
  int state_copies() const { return kind == OptimizerKind::kSgd ? (momentum > 0 ? 1 : 0) : 2; }
  /// Bytes of optimizer state per optimized element: state_copies() tensors of 4 or 2 bytes.
  int state_bytes_per_element() const { return state_copies() * (state_dtype == StateDtype::kBf16 ? 2 : 4); }
};

struct FsdpSection {
  ShardingStrategy sharding_strategy = ShardingStrategy::FULL_SHARD;
  WrapPolicy auto_wrap_policy = WrapPolicy::NO_WRAP;
  std::int64_t min_num_params = 0;
  std::vector<std::string> transformer_layer_cls_to_wrap;  ///< the class names, split
  std::string transformer_layer_cls_where;                 ///< where they were set, for messages
  BackwardPrefetch backward_prefetch = BackwardPrefetch::BACKWARD_PRE;
  std::string backward_prefetch_name;   ///< resolved (auto decided), as summary.json reports it
  bool backward_prefetch_auto = false;  ///< the deck said auto (fsdp-train makes the ranks agree)
  bool forward_prefetch = false;
  int limit_all_gathers = 0;
  /// resolved for this rank: "auto" overlaps only where the collective worker gets a core of its own.
  /// Every rank must agree: fsdp-train turns it off everywhere if any rank says false.
  bool overlap_grad_reduce = false;
  bool reshard_after_forward = true;                ///< resolved: "auto" follows the strategy
  std::optional<bool> reshard_after_forward_asked;  ///< unset for "auto" (fsdp-plan compares strategies)
  int reshard_after_forward_group = 0;              ///< a group size or "node": kept sharded over it after forward; 0: off
  int shard_group_size = 1;                         ///< resolved for the placement's world size
  int shard_group_size_requested = 0;
  OptimizerSharding optimizer_sharding = OptimizerSharding::GROUP;
  bool offload_params = false;
  Precision mixed_precision = Precision::kNo;
  /// fp16 or fp16_reduce with fsdp.loss_scale = dynamic: the scaler's settings; unset otherwise.
  std::optional<fsdp::LossScaleOptions> loss_scale;
  bool activation_checkpointing = false;
  bool deferred_init = false;
  bool sync_module_states = true;
  BufferSync buffer_sync = BufferSync::NONE;
  Backend backend = Backend::kAuto;  ///< as asked
  int cuda_device = -1;              ///< fsdp.cuda_device: -1 chooses from what the rank sees (fsdp::choose_device)
  std::string backend_where;
  Backend backend_resolved = Backend::kMpi;  ///< mpi or nccl (auto: nccl where a GPU is usable and NCCL built in)
};

struct CommSection {
  double timeout_s = 600;  ///< every collective deadline: the watchdog, NCCL, the checkpoint barriers
  std::int64_t flight_recorder_entries = 2000;
};

struct CheckpointSection {
  std::string dir;  ///< resolved: checkpoint.dir or <out_dir>/checkpoints
  std::int64_t every_steps = 0;
  StateDictType state_dict_type = StateDictType::SHARDED_STATE_DICT;
  int keep_last = 0;
  std::string resume;  ///< auto, none, or a path
  ResumeChanged resume_changed = ResumeChanged::kRefuse;
  bool save_final = true;
  bool asynchronous = false;  ///< checkpoint.async: written on an I/O thread from a host copy
  AsyncWhenWriting async_when_writing = AsyncWhenWriting::kQueue;
  AsyncCopy async_copy = AsyncCopy::kBackground;
  /// Host copies of the state an asynchronous checkpointer keeps: two to queue a save behind a write.
  int async_copies() const { return async_when_writing == AsyncWhenWriting::kQueue ? 2 : 1; }
  bool rank0_only = false;
  double collective_timeout_s = 600;  ///< comm.timeout_s
  std::string init_from;              ///< a fresh run's weights: a safetensors file or folder, or a checkpoint; empty: none
  bool init_allow_missing = false;
  std::string export_path;  ///< checkpoint.export: safetensors written at the end of training; empty: none
  ExportNames export_names = ExportNames::kNative;
  ExportDtype export_dtype = ExportDtype::kAsTrained;
  std::int64_t export_max_shard_bytes = 0;  ///< checkpoint.export_max_shard_size; 0: one file
};

struct EvalSection {
  std::int64_t every_steps = 0;  ///< 0: after every epoch
  std::int64_t max_batches = 0;  ///< 0: the whole split
};

struct LogSection {
  std::int64_t every_steps = 10;
  ProgressMode progress = ProgressMode::kAuto;
  std::string metrics_file;  ///< empty: none
  bool trace = false;
  std::int64_t timing_warmup_steps = 3;  ///< first steps of a run kept out of summary.json's median step time
};

/// A deck resolved for one placement.
struct RunConfig {
  Placement placement;
  RunSection run;
  ModelSection model;
  DataSection data;
  OptimSection optim;
  FsdpSection fsdp;
  CommSection comm;
  CheckpointSection checkpoint;
  EvalSection eval;
  LogSection log;
};

/// data.global_batch_size over `world_size` ranks: the fewest micro-batches per step (`accum`) of at
/// most `max_micro` samples per rank such that every rank's micro-batch is a whole number of samples.
struct BatchSplit {
  std::int64_t micro = 0, accum = 0;
};
/// nullopt when the global batch does not divide over the ranks.
std::optional<BatchSplit> split_global_batch(std::int64_t global, int world_size, std::int64_t max_micro);

/// Resolves `deck` for `placement`; the checks between keys and the placement (a shard group that does
/// not divide the world size) are DeckErrors naming the key and where it was set.
RunConfig resolve_run_config(const Deck& deck, const Placement& placement);

/// The [run] section alone, for programs that do not place a run (fsdp-sweep's manifest).
RunSection resolve_run_section(const Deck& deck, const Placement& placement = {});

/// The [model] section alone (fsdp-train --check-plan builds the model without placing a run).
ModelSection resolve_model_section(const Deck& deck);

/// fsdp.transformer_layer_cls_to_wrap resolved: the names given, or for "auto" its family's layer_classes
/// (the model's layer type and, with untied embeddings, Embedding and LmHead too; none for the MLP and CNN).
std::vector<std::string> transformer_layer_classes(const std::string& value, const ModelSection& model);

/// Under TRANSFORMER_BASED_WRAP, every name of fsdp.transformer_layer_cls_to_wrap must be a type the
/// model has: one of `types` (short names, listed in the message) or `also_accepted` (e.g. full names).
/// A DeckError naming where the key was set and the model's types otherwise (fsdp-train and fsdp-plan
/// alike; no name at all, "" or "auto" of a model without a repeated layer, is refused when the deck is
/// resolved).
void check_wrap_classes(const FsdpSection& fsdp, const std::set<std::string>& types, const std::set<std::string>& also_accepted = {});

/// The names of a names-list key (fsdp.transformer_layer_cls_to_wrap, optim.no_decay): "A, B" split at
/// commas, blanks dropped.
std::vector<std::string> split_name_list(const std::string& names);

}  // namespace fsdp::app
