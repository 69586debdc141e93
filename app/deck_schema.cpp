// Input decks (app layer): the schema (every key with its type, default, range, choices and
// description) and lookups in it (find_key, did_you_mean); the reference it generates is in
// deck_reference.cpp.
#include <algorithm>
#include <map>

#include "choices.hpp"
#include "deck.hpp"
#include "deck_detail.hpp"
#include "fsdp/core/strategy.hpp"

namespace fsdp::app {

namespace {
// fsdp.sharding_strategy takes the core's strategy names.
std::vector<std::string> strategy_names() {
  std::vector<std::string> names;
  for (auto s : fsdp::kShardingStrategies) names.emplace_back(fsdp::to_string(s));
  return names;
}
}  // namespace

using namespace detail;

namespace {

// ---- the schema ------------------------------------------------------------------------------

// One function per deck section (the largest in parts), in the order of the reference.
void add_run_keys(std::vector<KeySpec>& s) {
  using T = KeyType;
  s.push_back(
      {.key = "run.name", .type = T::kString, .default_value = "fsdp", .description = "name of the run; the default run.out_dir is runs/<run.name>"});
  s.push_back({.key = "run.seed",
               .type = T::kInt,
               .default_value = I{1},
               .min = 0,
               .description = "random seed: initial weights (the same on every rank), data order, dropout"});
  s.push_back({.key = "run.epochs", .type = T::kInt, .default_value = I{2}, .min = 1, .max = 1e6, .description = "passes over the training data"});
  s.push_back({.key = "run.max_steps",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = 1e12,
               .description = "stop after this many optimizer steps; 0: run all of run.epochs"});
  s.push_back({.key = "run.out_dir",
               .type = T::kString,
               .default_value = "",
               .description = "output folder (resolved deck, metrics, checkpoints); empty: runs/<run.name>"});
  s.push_back({.key = "run.threads",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = 4096,
               .description = "threads per rank, LibTorch's and OpenBLAS's; 0: the node's cores divided by the ranks on the node, at most "
                              "the CPUs the rank may run on (its affinity mask: Open MPI's mpirun binds each of 2 or fewer ranks to one core)"});
  s.push_back({.key = "run.malloc",
               .type = T::kString,
               .default_value = "reuse",
               .choices = choice_names<MallocPolicy>(),
               .description = "what the allocator does with freed memory (fsdp-train links jemalloc where the build found it, else "
                              "glibc's malloc; summary.json's \"allocator\" says which). reuse: keeps it for the next step, so a step "
                              "touches no new page once the first steps are done; peak RSS is the high-water mark of what was held. "
                              "return: gives it back to the system at once (glibc: blocks of 1 MiB or more get their own mapping); "
                              "peak RSS follows the bytes live, but every large allocation page-faults (costly under "
                              "virtualization). untouched: the allocator as its environment sets it (MALLOC_CONF for jemalloc, "
                              "whose built-in settings are reuse's; GLIBC_TUNABLES for glibc). docs/performance.md"});
  s.push_back({.key = "run.memory_check",
               .type = T::kString,
               .default_value = "refuse",
               .choices = choice_names<MemoryCheck>(),
               .description = "before anything is built, fsdp-plan's predicted peak per rank x the ranks on the node is compared with "
                              "the node's tightest limit (cgroup, Slurm --mem or --mem-per-cpu, MemAvailable): refuse (exit 2 with "
                              "what would fit), warn, or off"});
  s.push_back({.key = "run.on_nonfinite",
               .type = T::kString,
               .default_value = "stop",
               .choices = {"stop", "skip"},
               .description = "a non-finite loss or gradient norm on any rank: stop (exit code 4, no checkpoint of the poisoned state) "
                              "or skip the step (no optimizer update)"});
  s.push_back({.key = "run.rss_growth_warn_mib",
               .type = T::kInt,
               .default_value = I{1024},
               .min = 0,
               .max = 1048576,
               .description = "warn when a rank's resident memory has grown this many MiB since warm-up (its first progress log 100 "
                              "steps into the process), and again after each further step of this size; 0: never. "
                              "docs/reliability.md, \"Long runs\""});
}

void add_data_keys(std::vector<KeySpec>& s) {
  using T = KeyType;
  s.push_back({.key = "data.kind",
               .type = T::kString,
               .default_value = "fashion-mnist",
               .choices = choice_names<DataKind>(),
               .description = "fashion-mnist or mnist (IDX files in data.path), tokens (synthetic sequences), text (a file, one token per "
                              "byte), token-shards (llm.c or nanoGPT token files matched by the glob data.path, read memory-mapped), indexed (a "
                              "Megatron-LM / GPT-NeoX indexed dataset: data.path.bin and data.path.idx, read memory-mapped)"});
  s.push_back({.key = "data.path",
               .type = T::kString,
               .default_value = "/usr/share/datasets/fashion-mnist",
               .description = "folder of the IDX files (fashion-mnist, mnist), the text file (text), or a glob of token files "
                              "(token-shards: sorted by name and read as one stream), or an indexed dataset's prefix (indexed: the path without "
                              ".bin / .idx; naming either file works too); unused for tokens"});
  s.push_back(
      {.key = "data.sources",
       .type = T::kTables,
       .default_value = Tables{},
       .description = "a weighted mixture of token files in place of data.path (token-shards, indexed): samples are drawn "
                      "from the source furthest below its share of all drawn so far (Megatron-LM's blend), each source "
                      "reshuffled in its own epochs; an epoch is as many draws as all sources hold (with data.global_batch_size, "
                      "its whole global batches are trained). docs/data.md",
       .fields = {
           {.key = "path", .type = T::kString, .description = "as data.path: a glob or an indexed dataset's prefix", .required = true},
           {.key = "kind", .type = T::kString, .choices = {"token-shards", "indexed"}, .description = "how the source is stored; unset: data.kind"},
           {.key = "weight",
            .type = T::kFloat,
            .default_value = 1.0,
            .min = 0,
            .description = "its share is weight / the sum of the weights",
            .min_exclusive = true}}});
  s.push_back({.key = "data.batch_size",
               .type = T::kInt,
               .default_value = I{64},
               .min = 1,
               .max = 1e8,
               .description = "training samples per rank and micro-batch (the global batch is batch_size x ranks x "
                              "optim.grad_accum_steps); with data.global_batch_size, the largest micro-batch per rank (a resume may change "
                              "it: the steps stay the same)"});
  s.push_back({.key = "data.global_batch_size",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = 1e12,
               .description = "samples per optimizer step over all ranks, whatever the world size (torchtitan's name): each rank "
                              "takes micro-batches of at most data.batch_size and accumulates as many as needed, so a run resumed "
                              "on fewer or more ranks continues the same training; an epoch is its whole global batches (the last "
                              "partial one is not trained); 0: data.batch_size x ranks x optim.grad_accum_steps"});
  s.push_back({.key = "data.test_batch_size",
               .type = T::kInt,
               .default_value = I{1000},
               .min = 1,
               .max = 1e8,
               .description = "evaluation samples per rank and batch"});
  s.push_back({.key = "data.shuffle",
               .type = T::kBool,
               .default_value = true,
               .description = "reshuffle the training samples every epoch (seeded by run.seed)"});
  s.push_back({.key = "data.num_workers",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = 1024,
               .description = "background loading threads per rank; 0: load on the training thread"});
  s.push_back({.key = "data.train_samples",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = 1e15,
               .description = "use only the first this many training samples (sequences for tokens and text); 0: all. With "
                              "data.sources: an epoch of the mixture is this many draws (each epoch draws the next ones)"});
  s.push_back({.key = "data.test_samples",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = 1e15,
               .description = "use only the first this many test samples; 0: all"});
  s.push_back({.key = "data.num_samples",
               .type = T::kInt,
               .default_value = I{4096},
               .min = 1,
               .max = 1e9,
               .description = "tokens: number of synthetic sequences"});
  s.push_back({.key = "data.val_path",
               .type = T::kString,
               .default_value = "",
               .description = "the evaluation split: a glob of token files (token-shards) or an indexed dataset's prefix (indexed); "
                              "empty: no evaluation"});
  s.push_back({.key = "data.document_mask",
               .type = T::kBool,
               .default_value = false,
               .description = "document-aware packing (transformer, llama): attention never crosses the start of a document inside a "
                              "packed sequence and positions restart at 0 in each; a document begins at every data.eot_token (llm.c's "
                              "shards and fsdp-tokenize put it before each document) or, without one, where an indexed dataset's .idx "
                              "says, and at the start of each sequence"});
  s.push_back({.key = "data.eot_token",
               .type = T::kInt,
               .default_value = I{-1},
               .min = -1,
               .max = 1e9,
               .description = "the token that begins every document, for data.document_mask (GPT-2's <|endoftext|>: 50256); -1: none (indexed "
                              "data: the .idx's document boundaries)"});
  s.push_back({.key = "data.token_format",
               .type = T::kString,
               .default_value = "llmc",
               .choices = choice_names<TokenFormat>(),
               .description = "token-shards: llmc (llm.c's shards: a 256 x int32 header, magic 20240520 with uint16 or 20240801 with uint32 "
                              "tokens), or headerless little-endian uint16 or uint32 tokens (nanoGPT's train.bin and val.bin)"});
}

void add_optimizer_keys(std::vector<KeySpec>& s) {
  using T = KeyType;
  s.push_back({.key = "optim.kind",
               .type = T::kString,
               .default_value = "adadelta",
               .choices = choice_names<OptimizerKind>(),
               .description = "optimizer (the PyTorch FSDP tutorial: adadelta, lr 1.0, step schedule with gamma 0.7)"});
  s.push_back({.key = "optim.lr",
               .type = T::kFloat,
               .default_value = 1.0,
               .min = 0,
               .description = "learning rate (the peak, after optim.warmup_steps)",
               .min_exclusive = true});
  s.push_back({.key = "optim.weight_decay",
               .type = T::kFloat,
               .default_value = 0.0,
               .min = 0,
               .description = "weight decay (decoupled for adamw, L2 otherwise)"});
  s.push_back(
      {.key = "optim.momentum", .type = T::kFloat, .default_value = 0.0, .min = 0, .max = 1, .description = "sgd: momentum", .max_exclusive = true});
  s.push_back({.key = "optim.betas",
               .type = T::kFloatArray,
               .default_value = Floats{0.9, 0.999},
               .min = 0,
               .max = 1,
               .description = "adam, adamw: decay rates of the running averages (beta1, beta2)",
               .max_exclusive = true,
               .array_size = 2});
  s.push_back({.key = "optim.schedule",
               .type = T::kString,
               .default_value = "step",
               .choices = choice_names<LrSchedule>(),
               .description = "learning-rate schedule after the warmup: constant; step (times optim.gamma after every epoch, not below "
                              "optim.lr_min); cosine (down to optim.lr_min at the last step); wsd (warmup-stable-decay: optim.lr, then "
                              "over the last optim.decay_fraction of the steps linearly down to optim.lr_min)"});
  s.push_back({.key = "optim.lr_min",
               .type = T::kFloat,
               .default_value = 0.0,
               .min = 0,
               .description = "the learning rate the step, cosine and wsd schedules end at (a floor); below optim.lr"});
  s.push_back({.key = "optim.decay_fraction",
               .type = T::kFloat,
               .default_value = 0.2,
               .min = 0,
               .max = 1,
               .description = "wsd: the last fraction of the steps, in which the learning rate decays",
               .min_exclusive = true});
  s.push_back({.key = "optim.no_decay",
               .type = T::kString,
               .default_value = "",
               .description = "adamw: parameters without weight decay, any of bias, norm (LayerNorm, RMSNorm and BatchNorm weights), embedding "
                              "(embedding tables and what they are tied to); nanoGPT and llm.c: [\"bias\", \"norm\"]",
               .names_list = true});
  s.push_back({.key = "optim.gamma",
               .type = T::kFloat,
               .default_value = 0.7,
               .min = 0,
               .description = "step schedule: factor applied to the learning rate after every epoch",
               .min_exclusive = true});
  s.push_back({.key = "optim.warmup_steps",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = 1e12,
               .description = "linear warmup from 0 to optim.lr over this many optimizer steps"});
  s.push_back({.key = "optim.state_dtype",
               .type = T::kString,
               .default_value = "fp32",
               .choices = choice_names<StateDtype>(),
               .description = "adam, adamw: the dtype of the moments exp_avg and exp_avg_sq. bf16 keeps them in half the bytes (12 instead "
                              "of 16 bytes per parameter with the fp32 master shard and gradient); the update is computed in fp32 and "
                              "the moments are rounded back stochastically. Checkpoints store them as they are and load into either "
                              "setting; CPU shards only (a GPU run needs fsdp.offload_params)"});
  s.push_back({.key = "optim.clip_grad_norm",
               .type = T::kFloat,
               .default_value = 0.0,
               .min = 0,
               .description = "clip the global gradient norm to this value; 0: no clipping"});
}

void add_gradient_accumulation_keys(std::vector<KeySpec>& s) {
  using T = KeyType;
  s.push_back({.key = "optim.grad_accum_steps",
               .type = T::kInt,
               .default_value = I{1},
               .min = 1,
               .max = 1e6,
               .description = "micro-batches accumulated per optimizer step"});
  s.push_back({.key = "optim.accum_reduce",
               .type = T::kString,
               .default_value = "last",
               .choices = {"last", "every"},
               .description = "with optim.grad_accum_steps > 1: reduce the gradients once, after the last micro-batch (each unit "
                              "keeps an unsharded gradient between micro-batches: the least communication), or after every "
                              "micro-batch (reduce-scattered into the shard as each unit's backward ends: no unsharded gradient "
                              "outlives its backward, the least memory; one reduction per micro-batch)"});
}

void add_sharding_keys(std::vector<KeySpec>& s) {
  using T = KeyType;
  s.push_back({.key = "fsdp.sharding_strategy",
               .type = T::kString,
               .default_value = "FULL_SHARD",
               .choices = strategy_names(),
               .description = "FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), NO_SHARD (DDP), HYBRID_SHARD and HYBRID_SHARD_ZERO2 "
                              "(shard inside a group of fsdp.shard_group_size ranks, replicate across groups)"});
  s.push_back({.key = "fsdp.auto_wrap_policy",
               .type = T::kString,
               .default_value = "NO_WRAP",
               .choices = choice_names<WrapPolicy>(),
               .description = "which submodules become FSDP units: none but the root; those of fsdp.min_num_params parameters or more; "
                              "modules of the fsdp.transformer_layer_cls_to_wrap types"});
  s.push_back({.key = "fsdp.min_num_params",
               .type = T::kInt,
               .default_value = I{100000},
               .min = 1,
               .max = 1e15,
               .description = "SIZE_BASED_WRAP: wrap a submodule holding at least this many parameters"});
  s.push_back({.key = "fsdp.transformer_layer_cls_to_wrap",
               .type = T::kString,
               .default_value = "auto",
               .description = "TRANSFORMER_BASED_WRAP: module type names to wrap, comma-separated or an array of strings "
                              "([\"TransformerBlock\", \"Other\"]); each must be a type the model has. auto: the model's layer "
                              "(TransformerBlock; llama: LlamaDecoderLayer; the mlp and cnn have none: name their types), and with untied embeddings "
                              "also Embedding and LmHead (each vocabulary-sized "
                              "matrix its own unit, gathered only while it is used, instead of staying gathered in the root unit all "
                              "step; a LOCAL_STATE_DICT checkpoint of the former layout does not load into the new one)",
               .names_list = true});
}

void add_overlap_and_resharding_keys(std::vector<KeySpec>& s) {
  using T = KeyType;
  s.push_back({.key = "fsdp.backward_prefetch",
               .type = T::kString,
               .default_value = "auto",
               .choices = {"auto", "NO_PREFETCH", "BACKWARD_PRE", "BACKWARD_POST"},
               .description = "overlap: issue the next unit's all-gather when the current unit's backward begins (BACKWARD_PRE) or "
                              "when its gradients are ready (BACKWARD_POST), on a collective worker thread; auto: BACKWARD_PRE when "
                              "every rank has a core to spare for the worker (the rule of fsdp.overlap_grad_reduce, agreed by all ranks), "
                              "NO_PREFETCH otherwise; on NCCL (no worker: the GPU's streams overlap) auto is BACKWARD_PRE"});
  s.push_back({.key = "fsdp.forward_prefetch",
               .type = T::kBool,
               .default_value = false,
               .description = "overlap: issue the next unit's all-gather (previous step's order) when a unit's forward begins"});
  s.push_back({.key = "fsdp.limit_all_gathers",
               .type = T::kInt,
               .default_value = I{1},
               .min = 0,
               .max = 1e6,
               .description = "at most this many prefetched units in flight or gathered ahead of use (bounds the memory "
                              "prefetching adds); 0: no limit"});
  s.push_back({.key = "fsdp.overlap_grad_reduce",
               .type = T::kString,
               .default_value = "auto",
               .choices = {"auto", "true", "false"},
               .description = "overlap: reduce each unit's gradients on a collective worker thread while backward goes on "
                              "(like DDP's buckets); false: on the computing thread as each unit finishes; auto: overlap when the "
                              "rank has a core to spare for the worker (its CPUs > run.threads and ranks per node x run.threads < "
                              "the node's cores); on NCCL the reductions are queued on the GPU's communication stream instead and "
                              "auto is true. Same results either way; a TOML boolean is accepted too"});
  s.push_back({.key = "fsdp.reshard_after_forward",
               .type = T::kString,
               .default_value = "auto",
               .choices = {"auto", "true", "false", "node"},
               .description = "free a unit's gathered parameters after its forward; auto: the strategy decides "
                              "(true for FULL_SHARD and HYBRID_SHARD); a TOML boolean is accepted too. A group size N "
                              "(or node: the ranks of a node) keeps them sharded over groups of N consecutive ranks instead, "
                              "so that backward all-gathers inside the group (FSDP2's integer reshard_after_forward); N "
                              "divides the shard group size and is smaller",
               .count_choice = true});
  s.push_back({.key = "fsdp.shard_group_size",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = 1e6,
               .description = "hybrid strategies: ranks per shard group; 0: the ranks of a node"});
  s.push_back({.key = "fsdp.optimizer_sharding",
               .type = T::kString,
               .default_value = "group",
               .choices = {"group", "world"},
               .description = "hybrid strategies: who splits the optimizer state and fp32 master weights; group: the shard "
                              "group, like the parameters; world: every rank (Megatron-FSDP's HFSDP): gradients are "
                              "reduce-scattered across the replicas instead of all-reduced, each rank steps 1/world of the state, "
                              "and the updated parts are all-gathered back into the group shards before the next forward. The same "
                              "training (within 1e-5); per rank the optimizer state and gradients shrink by the number of replica groups"});
}

void add_precision_and_backend_keys(std::vector<KeySpec>& s) {
  using T = KeyType;
  s.push_back({.key = "fsdp.offload_params",
               .type = T::kBool,
               .default_value = false,
               .description = "PyTorch's CPUOffload: parameter shards, gradients and optimizer state stay in host memory and the optimizer "
                              "steps there; a unit is copied to the GPU for compute (with backend nccl). On CPU runs they are in host "
                              "memory anyway: accepted, same results"});
  s.push_back({.key = "fsdp.mixed_precision",
               .type = T::kString,
               .default_value = "no",
               .choices = choice_names<Precision>(),
               .description = "bf16/fp16: parameters all-gathered and used, gradients reduced, buffers kept in that dtype; the optimizer keeps fp32 "
                              "master shards; fp16 needs a GPU (backend nccl: LibTorch's CPU kernels have no fp16 arithmetic). "
                              "fp16_reduce: fp32 compute, gradients reduced in fp16 (half the reduction bytes). Both fp16 modes "
                              "scale the loss (fsdp.loss_scale)"});
  s.push_back({.key = "fsdp.loss_scale",
               .type = T::kString,
               .default_value = "dynamic",
               .choices = {"dynamic", "off"},
               .description = "fp16 and fp16_reduce: multiply the loss by a scale before backward so small gradients do not underflow, divide the "
                              "gradients by it before clipping and the step; a step whose gradients overflowed on any rank is skipped "
                              "(counted in metrics.csv and summary.json) and the scale halved; it doubles after "
                              "fsdp.loss_scale_growth_interval good steps (PyTorch's ShardedGradScaler). The scale is saved in checkpoints"});
  s.push_back({.key = "fsdp.loss_scale_init",
               .type = T::kFloat,
               .default_value = 65536.0,
               .min = 1,
               .description = "the first loss scale of the fp16 modes (at least 1, the scale's floor; a power of two keeps the "
                              "unscaling exact)"});
  s.push_back({.key = "fsdp.loss_scale_growth_interval",
               .type = T::kInt,
               .default_value = I{2000},
               .min = 1,
               .max = 1e12,
               .description = "fp16: good steps in a row before the loss scale doubles"});
  s.push_back({.key = "fsdp.activation_checkpointing",
               .type = T::kBool,
               .default_value = false,
               .description = "recompute each nested unit's forward in backward instead of keeping its activations (dropout replayed exactly)"});
  s.push_back({.key = "fsdp.deferred_init",
               .type = T::kBool,
               .default_value = false,
               .description = "memory-bounded construction: each layer's storage is released as it is built and the engine "
                              "initializes the model unit by unit (seeded by run.seed and each module's name), so no rank ever holds "
                              "the whole unsharded model; the values are the same at any world size (but not those of the default "
                              "initialization)"});
  s.push_back({.key = "fsdp.sync_module_states",
               .type = T::kBool,
               .default_value = true,
               .description = "broadcast rank 0's parameters and buffers at start, so every rank starts identical"});
  s.push_back({.key = "fsdp.buffer_sync",
               .type = T::kString,
               .default_value = "none",
               .choices = {"none", "average"},
               .description = "buffers (BatchNorm running statistics) during training; none: each rank keeps its own, as "
                              "PyTorch FSDP does (checkpoints keep every rank's copy of a buffer that differs, so a resume at the same "
                              "world size is exact; at another, every rank takes rank 0's); average: floating-point buffers are "
                              "averaged over the world after every training forward (one collective per buffer), so every rank holds "
                              "the same"});
  s.push_back({.key = "fsdp.backend",
               .type = T::kString,
               .default_value = "auto",
               .choices = choice_names<Backend>(),
               .description = "communication: mpi (CPU tensors), nccl (GPU tensors: needs a CUDA LibTorch, a visible GPU and an "
                              "fsdp-train built with NCCL; a clear error otherwise), auto (nccl when all that holds, else mpi)"});
  s.push_back({.key = "fsdp.cuda_device",
               .type = T::kInt,
               .default_value = I{-1},
               .min = -1,
               .max = 1024,
               .description = "backend nccl: the CUDA device index every rank uses (after CUDA_VISIBLE_DEVICES); -1: the only "
                              "visible device when a rank sees one (srun --gpus-per-task=1, --gpu-bind), else the node-local rank "
                              "modulo the visible devices (mpirun, srun showing every GPU)"});
}

std::vector<KeySpec> make_schema() {
  std::vector<KeySpec> s;
  add_run_keys(s);
  add_model_keys(s);
  add_data_keys(s);
  add_optimizer_keys(s);
  add_gradient_accumulation_keys(s);
  add_sharding_keys(s);
  add_overlap_and_resharding_keys(s);
  add_precision_and_backend_keys(s);
  add_comm_keys(s);
  add_checkpoint_keys(s);
  add_weights_in_and_out_keys(s);
  add_eval_keys(s);
  add_log_keys(s);
  return s;
}

}  // namespace

namespace detail {
const std::map<std::string, std::size_t>& key_index() {
  static const std::map<std::string, std::size_t> index = [] {
    std::map<std::string, std::size_t> m;
    const auto& s = deck_schema();
    for (std::size_t i = 0; i < s.size(); ++i) m.emplace(s[i].key, i);
    return m;
  }();
  return index;
}
}  // namespace detail

// ---- schema access ---------------------------------------------------------------------------

const std::vector<KeySpec>& deck_schema() {
  static const std::vector<KeySpec> schema = make_schema();
  return schema;
}

const std::vector<std::string>& deck_sections() {
  static const std::vector<std::string> sections = [] {
    std::vector<std::string> out;
    for (const auto& s : deck_schema())
      if (std::find(out.begin(), out.end(), s.section()) == out.end()) out.push_back(s.section());
    return out;
  }();
  return sections;
}

const KeySpec* find_key(const std::string& key) {
  const auto& index = key_index();
  const auto it = index.find(key);
  return it == index.end() ? nullptr : &deck_schema()[it->second];
}

std::string did_you_mean(const std::string& key) {
  const auto dot = key.find('.');
  const std::string section = dot == std::string::npos ? "" : lower(key.substr(0, dot));
  const std::string name = lower(dot == std::string::npos ? key : key.substr(dot + 1));
  int best = -1;
  std::string out;
  for (const auto& spec : deck_schema()) {
    const int c = closeness(name, lower(spec.name()));
    if (c < 0) continue;
    const std::string s = lower(spec.section());
    // The same section first, then a section that is a typo away (or none given), then any.
    const int penalty = s == section ? 0 : (section.empty() || edit_distance(section, s) <= 2) ? 2 : 4;
    if (best < 0 || c + penalty < best) best = c + penalty, out = spec.key;
  }
  return out;
}

}  // namespace fsdp::app
