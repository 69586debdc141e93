// The deck resolved once into typed structs (app layer): see run_config.hpp.
#include "run_config.hpp"

#include <cmath>
#include <cstdio>
#include <filesystem>

#include <algorithm>
#include <sstream>

#include "hf_export.hpp"
#include "models/families.hpp"

namespace fsdp::app {

namespace {

/// "<where>: <key>: " for a message about `key`; the deck's path when the value is a default.
std::string blame(const Deck& deck, const std::string& key) {
  const auto& where = deck.entry(key).where;
  return (where.empty() ? deck.path() : where) + ": " + key + ": ";
}

/// The enum value of choice key `key` (the deck has normalized it to one of the schema's names).
template <DeckChoice E>
E choice(const Deck& deck, const std::string& key) {
  return parse_choice<E>(deck.get_string(key));
}

/// fsdp.overlap_grad_reduce = auto: the collective worker pays only with a core of its own, i.e. when
/// the rank may run on more CPUs than its compute threads and the node's ranks leave cores idle. On
/// NCCL there is no worker (the GPU's streams overlap): auto is on.
bool overlap_pays(bool on_nccl, int rank_cpus, int threads, int ranks_per_node, int node_cores) {
  return on_nccl || (rank_cpus > threads && ranks_per_node * threads < node_cores);
}

/// fsdp.backward_prefetch = auto: prefetched all-gathers run on the same collective worker, so the
/// same rule: BACKWARD_PRE when overlap pays, none otherwise (measured slower on a shared core).
std::string backward_prefetch_resolved(const std::string& value, bool overlap_pays) {
  if (value != "auto") return value;
  return overlap_pays ? "BACKWARD_PRE" : "NO_PREFETCH";
}

/// run.threads = 0: the node's cores shared by its ranks, and no more than the CPUs the rank may run on
/// (Open MPI's mpirun binds each of 2 or fewer ranks to one core: more threads would only take turns on it).
int resolve_threads(const Deck& deck, const Placement& p) {
  const auto threads = static_cast<int>(deck.get_int("run.threads"));
  return threads != 0 ? threads : std::max(1, std::min(p.node_cores / std::max(1, p.ranks_per_node), p.rank_cpus));
}

}  // namespace

std::vector<std::string> split_name_list(const std::string& names) {
  std::vector<std::string> out;
  std::stringstream ss(names);
  for (std::string n; std::getline(ss, n, ',');) {
    n.erase(0, n.find_first_not_of(" \t"));
    n.erase(n.find_last_not_of(" \t") + 1);
    if (!n.empty()) out.push_back(n);
  }
  return out;
}

std::vector<std::string> transformer_layer_classes(const std::string& value, const ModelSection& model) {
  if (value != "auto") return split_name_list(value);
  return model_family(model.kind).layer_classes(model);
}

void check_wrap_classes(const FsdpSection& fsdp, const std::set<std::string>& types, const std::set<std::string>& also_accepted) {
  if (fsdp.auto_wrap_policy != WrapPolicy::TRANSFORMER_BASED_WRAP) return;
  std::string known;
  for (const auto& t : types) known += (known.empty() ? "" : ", ") + t;
  const std::string key =
      (fsdp.transformer_layer_cls_where.empty() ? "" : fsdp.transformer_layer_cls_where + ": ") + "fsdp.transformer_layer_cls_to_wrap: ";
  for (const auto& n : fsdp.transformer_layer_cls_to_wrap)
    if (!types.count(n) && !also_accepted.count(n)) throw DeckError(key + "the model has no module of type \"" + n + "\" (its types: " + known + ")");
}

RunSection resolve_run_section(const Deck& deck, const Placement& placement) {
  RunSection run;
  run.name = deck.get_string("run.name");
  run.seed = static_cast<std::uint64_t>(deck.get_int("run.seed"));
  run.epochs = deck.get_int("run.epochs");
  run.max_steps = deck.get_int("run.max_steps");
  run.out_dir = deck.out_dir();
  run.threads = resolve_threads(deck, placement);
  run.malloc = choice<MallocPolicy>(deck, "run.malloc");
  run.skip_nonfinite = deck.get_string("run.on_nonfinite") == "skip";
  run.memory_check = choice<MemoryCheck>(deck, "run.memory_check");
  run.rss_growth_warn_mib = deck.get_int("run.rss_growth_warn_mib");
  return run;
}

ModelSection resolve_model_section(const Deck& deck) {
  ModelSection model;
  model.kind = choice<ModelKind>(deck, "model.kind");
  if (deck.is_set("model.dropout")) model.dropout = deck.get_float("model.dropout");
  model.hidden_sizes = deck.get_int_array("model.hidden_sizes");
  model.vocab_size = deck.get_int("model.vocab_size");
  model.context = deck.get_int("model.context");
  model.d_model = deck.get_int("model.d_model");
  model.n_heads = deck.get_int("model.n_heads");
  model.n_layers = deck.get_int("model.n_layers");
  model.mlp_ratio = deck.get_int("model.mlp_ratio");
  model.tie_embeddings = deck.get_bool("model.tie_embeddings");
  model.vocab_pad_multiple = deck.get_int("model.vocab_pad_multiple");
  model.activation = choice<Activation>(deck, "model.activation");
  model.recompute_attention = deck.get_bool("model.recompute_attention");
  model.n_kv_heads = deck.get_int("model.n_kv_heads");
  model.head_dim = deck.get_int("model.head_dim");
  model.intermediate_size = deck.get_int("model.intermediate_size");
  model.norm_eps = deck.get_float("model.norm_eps");
  model.rope_theta = deck.get_float("model.rope_theta");
  model.attention_bias = deck.get_bool("model.attention_bias");
  model.rope_scaling = choice<RopeScaling>(deck, "model.rope_scaling");
  model.rope_scaling_factor = deck.get_float("model.rope_scaling_factor");
  model.rope_low_freq_factor = deck.get_float("model.rope_low_freq_factor");
  model.rope_high_freq_factor = deck.get_float("model.rope_high_freq_factor");
  model.rope_original_context = deck.get_int("model.rope_original_context");
  model.max_positions = deck.get_int("model.max_positions");
  model.sliding_window = deck.get_int("model.sliding_window");
  model.bos_token_id = deck.get_int("model.bos_token_id");
  for (const auto id : deck.get_int_array("model.eos_token_id"))
    if (id >= 0) model.eos_token_ids.push_back(id);
  return model;
}

std::optional<BatchSplit> split_global_batch(std::int64_t global, int world_size, std::int64_t max_micro) {
  if (global <= 0 || world_size <= 0 || max_micro <= 0 || global % world_size != 0) return std::nullopt;
  const std::int64_t per_rank = global / world_size;
  for (std::int64_t accum = (per_rank + max_micro - 1) / max_micro; accum <= per_rank; ++accum)
    if (per_rank % accum == 0) return BatchSplit{per_rank / accum, accum};
  return std::nullopt;
}

namespace {
// fsdp.backend: auto is NCCL where this rank has a usable GPU and NCCL is built in, else MPI; "nccl"
// where it cannot run is an error naming why.
Backend resolve_backend(Backend asked, const std::string& where, const std::optional<Placement::Gpu>& gpu) {
  if (!gpu) return asked == Backend::kNccl ? Backend::kNccl : Backend::kMpi;
  if (asked == Backend::kMpi) return asked;
  if (asked == Backend::kAuto) return gpu->built_with_nccl && gpu->usable ? Backend::kNccl : Backend::kMpi;
  const std::string prefix = (where.empty() ? std::string() : where + ": ") + "fsdp.backend = \"nccl\": ";
  if (!gpu->usable) throw DeckError(prefix + "no CUDA device is usable on this rank (" + gpu->why_not + "); use \"mpi\" or \"auto\" on CPUs");
  if (!gpu->built_with_nccl)
    throw DeckError(prefix + "this fsdp-train was built without NCCL (configure with -DFSDP_WITH_NCCL=ON where CUDA and NCCL are installed)");
  return asked;
}
}  // namespace

namespace {

DataSection resolve_data_section(const Deck& deck) {
  DataSection data;
  data.kind = choice<DataKind>(deck, "data.kind");
  data.path = deck.get_string("data.path");
  data.val_path = deck.get_string("data.val_path");
  data.token_format = choice<TokenFormat>(deck, "data.token_format");
  data.batch_size = deck.get_int("data.batch_size");
  data.test_batch_size = deck.get_int("data.test_batch_size");
  data.shuffle = deck.get_bool("data.shuffle");
  data.num_workers = static_cast<int>(deck.get_int("data.num_workers"));
  data.train_samples = deck.get_int("data.train_samples");
  data.test_samples = deck.get_int("data.test_samples");
  data.num_samples = deck.get_int("data.num_samples");
  for (const auto& row : deck.get_tables("data.sources")) {
    DataSource source;
    source.path = std::get<std::string>(row.at("path"));
    const auto& kind = row.at("kind");
    source.kind = std::holds_alternative<std::string>(kind) ? parse_choice<DataKind>(std::get<std::string>(kind)) : data.kind;
    source.weight = std::get<double>(row.at("weight"));
    data.sources.push_back(std::move(source));
  }
  if (!data.sources.empty()) {
    if (!is_token_file_data(data.kind))
      throw DeckError(blame(deck, "data.sources") + "a mixture of token files needs data.kind \"token-shards\" or \"indexed\" (it is \"" +
                      to_string(data.kind) + "\"); each source's kind defaults to it");
    if (deck.entry("data.path").source != Source::kDefault && !data.path.empty())
      throw DeckError(blame(deck, "data.path") +
                      "give data.path or data.sources, not both (data.sources replaces data.path; an empty data.path clears it)");
    data.path.clear();
    // A source given twice would be two sources: its samples twice per mixture epoch, its weight doubled.
    auto same_files = [](const DataSource& a, const DataSource& b) {
      auto form = [](const DataSource& s) {  // an indexed dataset is named by its prefix, .bin or .idx alike
        std::string p = std::filesystem::path(s.path).lexically_normal().string();
        if (s.kind == DataKind::kIndexed && (p.ends_with(".bin") || p.ends_with(".idx"))) p.resize(p.size() - 4);
        return p;
      };
      return a.kind == b.kind && form(a) == form(b);
    };
    for (std::size_t i = 0; i < data.sources.size(); ++i)
      for (std::size_t j = 0; j < i; ++j)
        if (same_files(data.sources[i], data.sources[j]))
          throw DeckError(blame(deck, "data.sources") + "data.sources[" + std::to_string(i) + "] ('" + data.sources[i].path + "') is data.sources[" +
                          std::to_string(j) + "] again: give each source once (with the sum of the weights)");
  }
  return data;
}

/// data.document_mask: the model keeps documents apart, each beginning at data.eot_token or, without
/// one, where the .idx of indexed data says (every source of a mixture indexed).
void resolve_document_mask(const Deck& deck, ModelSection& model, const DataSection& data) {
  model.document_mask = deck.get_bool("data.document_mask");
  model.document_token = -1;
  if (!model.document_mask) return;
  if (model.kind != ModelKind::kTransformer && model.kind != ModelKind::kLlama)
    throw DeckError(blame(deck, "data.document_mask") +
                    "keeps documents apart in attention: it needs model.kind \"transformer\" or \"llama\" (it is \"" + to_string(model.kind) + "\")");
  const auto eot = deck.get_int("data.eot_token");
  if (eot >= model.vocab_size)
    throw DeckError(blame(deck, "data.eot_token") + std::to_string(eot) + " is not below model.vocab_size " + std::to_string(model.vocab_size));
  model.document_token = eot;
  if (eot >= 0) return;
  bool indexed = data.sources.empty() ? data.kind == DataKind::kIndexed : true;
  for (const auto& source : data.sources) indexed = indexed && source.kind == DataKind::kIndexed;
  if (!indexed)
    throw DeckError(blame(deck, "data.eot_token") +
                    "data.document_mask needs the token that begins every document (GPT-2's <|endoftext|>: 50256), or indexed data "
                    "(data.kind = \"indexed\", every source of data.sources indexed), whose .idx says where documents begin");
}

/// The optimizer; with data.global_batch_size, the micro-batch and accumulation over the world.
OptimSection resolve_optim_section(const Deck& deck, const Placement& placement, DataSection& data) {
  OptimSection optim;
  optim.kind = choice<OptimizerKind>(deck, "optim.kind");
  optim.lr = deck.get_float("optim.lr");
  optim.weight_decay = deck.get_float("optim.weight_decay");
  optim.momentum = deck.get_float("optim.momentum");
  optim.betas = deck.get_float_array("optim.betas");
  optim.schedule = choice<LrSchedule>(deck, "optim.schedule");
  optim.gamma = deck.get_float("optim.gamma");
  optim.warmup_steps = deck.get_int("optim.warmup_steps");
  optim.clip_grad_norm = deck.get_float("optim.clip_grad_norm");
  optim.grad_accum_steps = deck.get_int("optim.grad_accum_steps");
  optim.reduce_every_micro_batch = deck.get_string("optim.accum_reduce") == "every";
  optim.lr_min = deck.get_float("optim.lr_min");
  optim.decay_fraction = deck.get_float("optim.decay_fraction");
  optim.no_decay = split_name_list(deck.get_string("optim.no_decay"));
  for (const auto& kind : optim.no_decay)
    if (kind != "bias" && kind != "norm" && kind != "embedding")
      throw DeckError(blame(deck, "optim.no_decay") + "'" + kind + "' is not one of bias, norm, embedding");
  if (!optim.no_decay.empty() && optim.kind != OptimizerKind::kAdamW)
    throw DeckError(blame(deck, "optim.no_decay") + "takes parameters out of adamw's decoupled weight decay; optim.kind is \"" +
                    to_string(optim.kind) + "\"");
  if (optim.lr_min >= optim.lr && optim.schedule != LrSchedule::kConstant)
    throw DeckError(blame(deck, "optim.lr_min") + std::to_string(optim.lr_min) + " must be below optim.lr " + std::to_string(optim.lr));
  if (const auto global = deck.get_int("data.global_batch_size"); global > 0) {
    if (deck.entry("optim.grad_accum_steps").source != Source::kDefault)
      throw DeckError(blame(deck, "optim.grad_accum_steps") + "is derived from data.global_batch_size (" +
                      deck.entry("data.global_batch_size").where + "); set one or the other");
    const auto split = split_global_batch(global, placement.world_size, data.batch_size);
    if (!split)
      throw DeckError(blame(deck, "data.global_batch_size") + std::to_string(global) + " samples do not divide over " +
                      std::to_string(placement.world_size) + " ranks (a multiple of the world size is needed)");
    data.global_batch_size = global;
    data.batch_size = split->micro;
    optim.grad_accum_steps = split->accum;
  }
  optim.state_dtype = choice<StateDtype>(deck, "optim.state_dtype");
  if (optim.state_dtype == StateDtype::kBf16 && optim.kind != OptimizerKind::kAdam && optim.kind != OptimizerKind::kAdamW)
    throw DeckError(blame(deck, "optim.state_dtype") + "\"bf16\" keeps adam's and adamw's moments in bf16; optim.kind is \"" + to_string(optim.kind) +
                    "\"");
  if (optim.kind != OptimizerKind::kSgd && optim.betas.size() != 2)
    throw DeckError(blame(deck, "optim.betas") + "must have 2 values, got " + std::to_string(optim.betas.size()));

  return optim;
}

FsdpSection resolve_fsdp_section(const Deck& deck, const Placement& placement, const RunSection& run, const ModelSection& model) {
  FsdpSection f;
  f.sharding_strategy = parse_sharding_strategy(deck.get_string("fsdp.sharding_strategy"));
  f.auto_wrap_policy = choice<WrapPolicy>(deck, "fsdp.auto_wrap_policy");
  f.min_num_params = deck.get_int("fsdp.min_num_params");
  f.transformer_layer_cls_to_wrap = transformer_layer_classes(deck.get_string("fsdp.transformer_layer_cls_to_wrap"), model);
  f.transformer_layer_cls_where = deck.entry("fsdp.transformer_layer_cls_to_wrap").where;
  if (f.auto_wrap_policy == WrapPolicy::TRANSFORMER_BASED_WRAP && f.transformer_layer_cls_to_wrap.empty())
    throw DeckError(blame(deck, "fsdp.transformer_layer_cls_to_wrap") +
                    (deck.get_string("fsdp.transformer_layer_cls_to_wrap") == "auto"
                         ? "\"auto\" names no layer for model.kind = \"" + std::string(to_string(model.kind)) + "\""
                         : std::string("names no module type")) +
                    ": TRANSFORMER_BASED_WRAP wraps the module types named here; name them, or use fsdp.auto_wrap_policy = \"SIZE_BASED_WRAP\"");
  f.backend = choice<Backend>(deck, "fsdp.backend");
  f.cuda_device = static_cast<int>(deck.get_int("fsdp.cuda_device"));
  f.backend_where = deck.entry("fsdp.backend").where;
  f.backend_resolved = resolve_backend(f.backend, f.backend_where, placement.gpu);
  const bool overlap_auto =
      overlap_pays(f.backend_resolved == Backend::kNccl, placement.rank_cpus, run.threads, placement.ranks_per_node, placement.node_cores);
  f.backward_prefetch_auto = deck.get_string("fsdp.backward_prefetch") == "auto";
  f.backward_prefetch_name = backward_prefetch_resolved(deck.get_string("fsdp.backward_prefetch"), overlap_auto);
  f.backward_prefetch = parse_backward_prefetch(f.backward_prefetch_name);
  f.forward_prefetch = deck.get_bool("fsdp.forward_prefetch");
  f.limit_all_gathers = static_cast<int>(deck.get_int("fsdp.limit_all_gathers"));
  const std::string overlap = deck.get_string("fsdp.overlap_grad_reduce");
  f.overlap_grad_reduce = overlap == "auto" ? overlap_auto : overlap == "true";
  const std::string reshard = deck.get_string("fsdp.reshard_after_forward");
  const bool keep_group = reshard == "node" || std::isdigit(static_cast<unsigned char>(reshard[0]));
  if (reshard != "auto") f.reshard_after_forward_asked = reshard != "false";
  f.reshard_after_forward = f.reshard_after_forward_asked.value_or(reshard_after_forward_default(f.sharding_strategy));
  f.shard_group_size_requested = static_cast<int>(deck.get_int("fsdp.shard_group_size"));
  const int group = f.shard_group_size_requested;
  // Which strategies take a group size, and what it must be, is the core's rule (shard_group_size());
  // a hybrid group that does not divide the world is said here in the deck's words.
  if (is_hybrid(f.sharding_strategy) && group > 0 && placement.world_size % group != 0)
    throw DeckError(blame(deck, "fsdp.shard_group_size") + std::to_string(group) + " does not divide the world size " +
                    std::to_string(placement.world_size));
  try {
    f.shard_group_size = shard_group_size(f.sharding_strategy, placement.world_size, group, placement.ranks_per_node);
  } catch (const ConfigError& e) {
    throw DeckError(blame(deck, "fsdp.shard_group_size") + message_without_id(e));
  }
  if (keep_group) {
    f.reshard_after_forward_group = reshard == "node" ? placement.ranks_per_node : std::stoi(reshard);
    if (const auto why = reshard_group_problem(f.shard_group_size, f.reshard_after_forward_group); !why.empty())
      throw DeckError(blame(deck, "fsdp.reshard_after_forward") +
                      (reshard == "node" ? "node (" + std::to_string(placement.ranks_per_node) + " ranks): " : "") + why);
  }
  f.optimizer_sharding = parse_optimizer_sharding(deck.get_string("fsdp.optimizer_sharding"));
  if (const auto why = optimizer_sharding_problem(f.sharding_strategy, f.optimizer_sharding); !why.empty())
    throw DeckError(blame(deck, "fsdp.optimizer_sharding") + "world: " + why);
  f.offload_params = deck.get_bool("fsdp.offload_params");
  f.mixed_precision = choice<Precision>(deck, "fsdp.mixed_precision");
  f.activation_checkpointing = deck.get_bool("fsdp.activation_checkpointing");
  f.deferred_init = deck.get_bool("fsdp.deferred_init");
  f.sync_module_states = deck.get_bool("fsdp.sync_module_states");
  f.buffer_sync = parse_buffer_sync(deck.get_string("fsdp.buffer_sync"));
  // fsdp-plan probes no GPU (it may plan a GPU job on a login node): only a probed rank, or a deck that
  // asks for the CPU (fsdp.backend = "mpi"), can refuse.
  if (f.mixed_precision == Precision::kFp16 && (f.backend == Backend::kMpi || (placement.gpu && f.backend_resolved != Backend::kNccl)))
    throw DeckError(blame(deck, "fsdp.mixed_precision") +
                    "fp16 computes in half precision, which LibTorch's CPU kernels do not implement (matrix products, LayerNorm, "
                    "softmax); on CPU use bf16, or fp16_reduce (fp32 compute, gradients reduced in fp16)");
  if ((f.mixed_precision == Precision::kFp16 || f.mixed_precision == Precision::kFp16Reduce) && deck.get_string("fsdp.loss_scale") == "dynamic") {
    const double init = deck.get_float("fsdp.loss_scale_init");
    if (!std::isfinite(init)) throw DeckError(blame(deck, "fsdp.loss_scale_init") + "must be finite");
    f.loss_scale = fsdp::LossScaleOptions{.init_scale = init, .growth_interval = deck.get_int("fsdp.loss_scale_growth_interval")};
  }

  return f;
}

CheckpointSection resolve_checkpoint_section(const Deck& deck, const RunSection& run, const ModelSection& model, const CommSection& comm) {
  CheckpointSection ckpt;
  ckpt.dir = deck.checkpoint_dir();
  ckpt.every_steps = deck.get_int("checkpoint.every_steps");
  ckpt.state_dict_type = choice<StateDictType>(deck, "checkpoint.state_dict_type");
  ckpt.keep_last = static_cast<int>(deck.get_int("checkpoint.keep_last"));
  ckpt.resume = deck.get_string("checkpoint.resume");
  ckpt.resume_changed = choice<ResumeChanged>(deck, "checkpoint.resume_changed");
  ckpt.save_final = deck.get_bool("checkpoint.save_final");
  ckpt.asynchronous = deck.get_bool("checkpoint.async");
  ckpt.async_when_writing = choice<AsyncWhenWriting>(deck, "checkpoint.async_when_writing");
  ckpt.async_copy = choice<AsyncCopy>(deck, "checkpoint.async_copy");
  ckpt.rank0_only = deck.get_bool("checkpoint.rank0_only");
  ckpt.collective_timeout_s = comm.timeout_s;
  ckpt.init_from = deck.get_string("checkpoint.init_from");
  ckpt.init_allow_missing = deck.get_bool("checkpoint.init_allow_missing");
  ckpt.export_names = choice<ExportNames>(deck, "checkpoint.export_names");
  ckpt.export_dtype = choice<ExportDtype>(deck, "checkpoint.export_dtype");
  if (const auto path = deck.get_string("checkpoint.export"); !path.empty()) {
    // Relative to the run's folder, like log.metrics_file: each run of a sweep exports its own model.
    ckpt.export_path = std::filesystem::path(path).is_absolute() ? path : (std::filesystem::path(run.out_dir) / path).string();
    if (path.back() == '/') ckpt.export_path += '/';
  }
  try {
    hf_export_form(model, ckpt.export_names);
  } catch (const ConfigError& e) {
    throw DeckError(blame(deck, "checkpoint.export_names") + format_value(deck.entry("checkpoint.export_names").value) + ": " +
                    message_without_id(e));
  }
  const auto shard_size = parse_byte_size(deck.get_string("checkpoint.export_max_shard_size"));
  if (!shard_size)
    throw DeckError(blame(deck, "checkpoint.export_max_shard_size") + format_value(deck.entry("checkpoint.export_max_shard_size").value) +
                    " is not a size (\"5GB\", \"500MB\", \"2GiB\", a number of bytes, \"0\")");
  // A path ending in .safetensors names one file: split only when the deck asks.
  const bool one_file_named = std::filesystem::path(ckpt.export_path).extension() == ".safetensors";
  ckpt.export_max_shard_bytes = one_file_named && deck.entry("checkpoint.export_max_shard_size").source == Source::kDefault ? 0 : *shard_size;

  return ckpt;
}

/// Whether a model and batch of these sizes can be addressed at all: the parameters' training state
/// and a step's activations, estimated in long double before any 64-bit arithmetic (the planner's,
/// the engine's, the data's). Past 2^60 bytes (an exbibyte) no run is possible and that arithmetic
/// would overflow: a DeckError naming the keys instead.
void check_sizes_are_addressable(const Deck& deck, const ModelSection& model, const DataSection& data) {
  constexpr long double kLimit = 1152921504606846976.0L;  // 2^60
  const long double batch = static_cast<long double>(std::max(data.batch_size, data.test_batch_size));
  const auto [params, activations, sizes] = model_family(model.kind).size_estimate(model, batch);
  char text[160];
  if (16 * params > kLimit) {
    std::snprintf(text, sizeof text, "about %.3Lg parameters, whose training state would take %.3Lg bytes", params, 16 * params);
    throw DeckError(deck.path() + ": [model]: the deck's " + to_string(model.kind) + " has " + text + " (" + sizes +
                    "): more than the 2^60 bytes any program here can address");
  }
  if (4 * activations > kLimit) {
    std::snprintf(text, sizeof text, "about %.3Lg bytes of activations per rank", 4 * activations);
    throw DeckError(blame(deck, "data.batch_size") + std::to_string(data.batch_size) + " (data.test_batch_size " +
                    std::to_string(data.test_batch_size) + ") with this model needs " + text +
                    ": more than the 2^60 bytes any program here can address");
  }
}

LogSection resolve_log_section(const Deck& deck) {
  LogSection log;
  log.every_steps = deck.get_int("log.every_steps");
  log.progress = choice<ProgressMode>(deck, "log.progress");
  log.metrics_file = deck.get_string("log.metrics_file");
  log.trace = deck.get_bool("log.trace");
  log.timing_warmup_steps = deck.get_int("log.timing_warmup_steps");
  return log;
}

}  // namespace

RunConfig resolve_run_config(const Deck& deck, const Placement& placement) {
  RunConfig c;
  c.placement = placement;
  c.run = resolve_run_section(deck, placement);
  c.model = resolve_model_section(deck);
  c.data = resolve_data_section(deck);
  resolve_document_mask(deck, c.model, c.data);
  check_sizes_are_addressable(deck, c.model, c.data);
  c.optim = resolve_optim_section(deck, placement, c.data);
  c.fsdp = resolve_fsdp_section(deck, placement, c.run, c.model);
  if (c.optim.state_dtype == StateDtype::kBf16 && c.fsdp.backend_resolved == Backend::kNccl && !c.fsdp.offload_params)
    throw DeckError(blame(deck, "optim.state_dtype") +
                    "\"bf16\" runs its update on the CPU: on a GPU it needs fsdp.offload_params = true (the shards and the optimizer in host "
                    "memory), or optim.state_dtype = \"fp32\"");
  c.comm.timeout_s = deck.get_float("comm.timeout_s");
  c.comm.flight_recorder_entries = deck.get_int("comm.flight_recorder_entries");

  c.eval.every_steps = deck.get_int("eval.every_steps");
  c.eval.max_batches = deck.get_int("eval.max_batches");
  c.checkpoint = resolve_checkpoint_section(deck, c.run, c.model, c.comm);
  c.log = resolve_log_section(deck);
  return c;
}

}  // namespace fsdp::app
