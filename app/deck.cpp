// Input decks of fsdp-train (app layer): the schema, TOML parsing and validation, --set overrides,
// the echo table, the resolved deck as TOML and the generated reference (docs/deck_reference.md).
#include "deck.hpp"

#include <toml++/toml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <regex>
#include <sstream>

namespace fsdp::app {

std::string DeckError::join(const std::vector<std::string>& problems) {
  if (problems.size() == 1) return problems.front();
  std::string out = std::to_string(problems.size()) + " problems:";
  for (const auto& p : problems) out += "\n" + p;
  return out;
}

namespace {

using I = std::int64_t;
using Ints = std::vector<std::int64_t>;
using Floats = std::vector<double>;

// ---- the schema ------------------------------------------------------------------------------

std::vector<KeySpec> make_schema() {
  using T = KeyType;
  std::vector<KeySpec> s;
  // [run]
  s.push_back(
      {.key = "run.name", .type = T::kString, .default_value = "fsdp", .description = "name of the run; the default run.out_dir is runs/<run.name>"});
  s.push_back({.key = "run.seed",
               .type = T::kInt,
               .default_value = I{1},
               .min = 0,
               .description = "random seed: initial weights (the same on every rank), data order, dropout"});
  s.push_back({.key = "run.epochs", .type = T::kInt, .default_value = I{2}, .min = 1, .description = "passes over the training data"});
  s.push_back({.key = "run.max_steps",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .description = "stop after this many optimizer steps; 0: run all of run.epochs"});
  s.push_back({.key = "run.out_dir",
               .type = T::kString,
               .default_value = "",
               .description = "output folder (resolved deck, metrics, checkpoints); empty: runs/<run.name>"});
  s.push_back({.key = "run.threads",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .description = "intra-op threads per rank; 0: the node's cores divided by the ranks on the node"});
  s.push_back({.key = "run.malloc_mmap_threshold_mib",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .max = I{32},
               .description = "memory: allocations of at least this many MiB get their own mapping and go back to the system "
                              "when freed (glibc's M_MMAP_THRESHOLD, fixed); peak RSS then follows the bytes live, at the cost of "
                              "page faults on every large allocation. 0: glibc's default, a threshold that rises to 32 MiB and "
                              "keeps freed memory in the heap (docs/performance.md)"});
  s.push_back({.key = "run.on_nonfinite",
               .type = T::kString,
               .default_value = "stop",
               .choices = {"stop", "skip"},
               .description = "a non-finite loss or gradient norm on any rank: stop (exit code 4, no checkpoint of the poisoned state) "
                              "or skip the step (no optimizer update)"});
  // [model]
  s.push_back({.key = "model.kind",
               .type = T::kString,
               .default_value = "cnn",
               .choices = {"cnn", "mlp", "transformer"},
               .description = "cnn (the PyTorch FSDP tutorial's MNIST net), mlp, or transformer (decoder-only, for data.kind tokens or text)"});
  s.push_back(
      {.key = "model.dropout",
       .type = T::kFloat,
       .default_value = std::monostate{},
       .min = 0,
       .max = 1,
       .description = "every dropout probability of the model; unset: each model's own (cnn 0.25 and 0.5, mlp none, transformer 0.1); 0: none",
       .max_exclusive = true});
  s.push_back({.key = "model.hidden_sizes",
               .type = T::kIntArray,
               .default_value = Ints{512, 256},
               .min = 1,
               .description = "mlp: widths of the hidden layers"});
  s.push_back(
      {.key = "model.vocab_size", .type = T::kInt, .default_value = I{256}, .min = 1, .description = "transformer: vocabulary size (256: bytes)"});
  s.push_back({.key = "model.context", .type = T::kInt, .default_value = I{64}, .min = 1, .description = "transformer: tokens per sequence"});
  s.push_back({.key = "model.d_model",
               .type = T::kInt,
               .default_value = I{128},
               .min = 1,
               .description = "transformer: width of the residual stream, a multiple of model.n_heads"});
  s.push_back({.key = "model.n_heads", .type = T::kInt, .default_value = I{4}, .min = 1, .description = "transformer: attention heads per block"});
  s.push_back({.key = "model.n_layers", .type = T::kInt, .default_value = I{4}, .min = 1, .description = "transformer: number of blocks"});
  s.push_back({.key = "model.mlp_ratio",
               .type = T::kInt,
               .default_value = I{4},
               .min = 1,
               .description = "transformer: width of each block's MLP as a multiple of model.d_model"});
  s.push_back({.key = "model.tie_embeddings",
               .type = T::kBool,
               .default_value = true,
               .description = "transformer: the output projection shares the token embedding's weights"});
  // [data]
  s.push_back({.key = "data.kind",
               .type = T::kString,
               .default_value = "fashion-mnist",
               .choices = {"fashion-mnist", "mnist", "tokens", "text"},
               .description = "fashion-mnist or mnist (IDX files in data.path), tokens (synthetic sequences), text (a file, one token per byte)"});
  s.push_back({.key = "data.path",
               .type = T::kString,
               .default_value = "/usr/share/datasets/fashion-mnist",
               .description = "folder of the IDX files (fashion-mnist, mnist) or the text file (text); unused for tokens"});
  s.push_back({.key = "data.batch_size",
               .type = T::kInt,
               .default_value = I{64},
               .min = 1,
               .description = "training samples per rank and step (the global batch is batch_size x ranks)"});
  s.push_back(
      {.key = "data.test_batch_size", .type = T::kInt, .default_value = I{1000}, .min = 1, .description = "evaluation samples per rank and batch"});
  s.push_back({.key = "data.shuffle",
               .type = T::kBool,
               .default_value = true,
               .description = "reshuffle the training samples every epoch (seeded by run.seed)"});
  s.push_back({.key = "data.num_workers",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .description = "background loading threads per rank; 0: load on the training thread"});
  s.push_back({.key = "data.train_samples",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .description = "use only the first this many training samples (sequences for tokens and text); 0: all"});
  s.push_back({.key = "data.test_samples",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .description = "use only the first this many test samples; 0: all"});
  s.push_back(
      {.key = "data.num_samples", .type = T::kInt, .default_value = I{4096}, .min = 1, .description = "tokens: number of synthetic sequences"});
  // [optim]
  s.push_back({.key = "optim.kind",
               .type = T::kString,
               .default_value = "adadelta",
               .choices = {"sgd", "adam", "adamw", "adadelta"},
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
               .choices = {"constant", "step", "cosine"},
               .description = "learning-rate schedule: constant; step (times optim.gamma after every epoch); cosine (down to 0 at the last step)"});
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
               .description = "linear warmup from 0 to optim.lr over this many optimizer steps"});
  s.push_back({.key = "optim.clip_grad_norm",
               .type = T::kFloat,
               .default_value = 0.0,
               .min = 0,
               .description = "clip the global gradient norm to this value; 0: no clipping"});
  s.push_back({.key = "optim.grad_accum_steps",
               .type = T::kInt,
               .default_value = I{1},
               .min = 1,
               .description = "micro-batches accumulated per optimizer step"});
  // [fsdp]
  s.push_back({.key = "fsdp.sharding_strategy",
               .type = T::kString,
               .default_value = "FULL_SHARD",
               .choices = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"},
               .description = "FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), NO_SHARD (DDP), HYBRID_SHARD and HYBRID_SHARD_ZERO2 "
                              "(shard inside a group of fsdp.shard_group_size ranks, replicate across groups)"});
  s.push_back({.key = "fsdp.auto_wrap_policy",
               .type = T::kString,
               .default_value = "NO_WRAP",
               .choices = {"NO_WRAP", "SIZE_BASED_WRAP", "TRANSFORMER_BASED_WRAP"},
               .description = "which submodules become FSDP units: none but the root; those of fsdp.min_num_params parameters or more; "
                              "modules of the fsdp.transformer_layer_cls_to_wrap types"});
  s.push_back({.key = "fsdp.min_num_params",
               .type = T::kInt,
               .default_value = I{100000},
               .min = 1,
               .description = "SIZE_BASED_WRAP: wrap a submodule holding at least this many parameters"});
  s.push_back({.key = "fsdp.transformer_layer_cls_to_wrap",
               .type = T::kString,
               .default_value = "TransformerBlock",
               .description = "TRANSFORMER_BASED_WRAP: module type names to wrap, comma-separated or an array of strings "
                              "([\"TransformerBlock\", \"Other\"]); each must be a type the model has",
               .names_list = true});
  s.push_back({.key = "fsdp.backward_prefetch",
               .type = T::kString,
               .default_value = "NO_PREFETCH",
               .choices = {"NO_PREFETCH", "BACKWARD_PRE", "BACKWARD_POST"},
               .description = "overlap: issue the next unit's all-gather when the current unit's backward begins (BACKWARD_PRE) or "
                              "when its gradients are ready (BACKWARD_POST), on a collective worker thread"});
  s.push_back({.key = "fsdp.forward_prefetch",
               .type = T::kBool,
               .default_value = false,
               .description = "overlap: issue the next unit's all-gather (previous step's order) when a unit's forward begins"});
  s.push_back({.key = "fsdp.limit_all_gathers",
               .type = T::kInt,
               .default_value = I{1},
               .min = 0,
               .description = "at most this many prefetched units in flight or gathered ahead of use (bounds the memory "
                              "prefetching adds); 0: no limit"});
  s.push_back({.key = "fsdp.overlap_grad_reduce",
               .type = T::kString,
               .default_value = "auto",
               .choices = {"auto", "true", "false"},
               .description = "overlap: reduce each unit's gradients on a collective worker thread while backward goes on "
                              "(like DDP's buckets); false: on the computing thread as each unit finishes; auto: overlap when the "
                              "rank has a core to spare for the worker (its CPUs > run.threads and ranks per node x run.threads < "
                              "the node's cores). Same results either way; a TOML boolean is accepted too"});
  s.push_back({.key = "fsdp.reshard_after_forward",
               .type = T::kString,
               .default_value = "auto",
               .choices = {"auto", "true", "false"},
               .description = "free a unit's gathered parameters after its forward; auto: the strategy decides "
                              "(true for FULL_SHARD and HYBRID_SHARD); a TOML boolean is accepted too"});
  s.push_back({.key = "fsdp.shard_group_size",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .description = "hybrid strategies: ranks per shard group; 0: the ranks of a node"});
  s.push_back({.key = "fsdp.offload_params",
               .type = T::kBool,
               .default_value = false,
               .description = "PyTorch's CPUOffload: parameter shards, gradients and optimizer state stay in host memory and the optimizer "
                              "steps there; a unit is copied to the GPU for compute (with backend nccl). On CPU runs they are in host "
                              "memory anyway: accepted, same results"});
  s.push_back({.key = "fsdp.mixed_precision",
               .type = T::kString,
               .default_value = "no",
               .choices = {"no", "bf16", "fp16"},
               .description = "bf16/fp16: parameters all-gathered and used, gradients reduced, buffers kept in that dtype; the optimizer keeps fp32 "
                              "master shards (fp16 has no loss scaling yet)"});
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
  s.push_back({.key = "fsdp.backend",
               .type = T::kString,
               .default_value = "auto",
               .choices = {"auto", "mpi", "nccl"},
               .description = "communication: mpi (CPU tensors), nccl (GPU tensors: needs a CUDA LibTorch, a visible GPU and an "
                              "fsdp-train built with NCCL; a clear error otherwise), auto (nccl when all that holds, else mpi)"});
  // [comm]
  s.push_back({.key = "comm.timeout_s",
               .type = T::kFloat,
               .default_value = 600.0,
               .min = 0,
               .description = "deadline of every collective, like NCCL's watchdog: a rank waiting longer names the collective, unit and "
                              "step and ends the job (exit code 6); 0: no deadline"});
  // [checkpoint]
  s.push_back(
      {.key = "checkpoint.dir", .type = T::kString, .default_value = "", .description = "checkpoint folder; empty: <run.out_dir>/checkpoints"});
  s.push_back({.key = "checkpoint.every_steps",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .description = "save every this many optimizer steps; 0: only at the end (checkpoint.save_final)"});
  s.push_back({.key = "checkpoint.state_dict_type",
               .type = T::kString,
               .default_value = "SHARDED_STATE_DICT",
               .choices = {"SHARDED_STATE_DICT", "FULL_STATE_DICT", "LOCAL_STATE_DICT"},
               .description = "SHARDED (every rank writes its part of one file), FULL (rank 0 writes), LOCAL (a file per rank; "
                              "loads at the same world size only)"});
  s.push_back({.key = "checkpoint.keep_last",
               .type = T::kInt,
               .default_value = I{0},
               .min = 0,
               .description = "keep the newest this many checkpoints; 0: keep all"});
  s.push_back({.key = "checkpoint.resume",
               .type = T::kString,
               .default_value = "auto",
               .description = "auto: continue from the newest readable checkpoint in checkpoint.dir, if any (one of another model or optimizer "
                              "is an error; a finished run trains nothing); none: start fresh; anything else: a checkpoint file, LOCAL "
                              "folder, or checkpoint folder (its latest) to load"});
  s.push_back({.key = "checkpoint.save_final", .type = T::kBool, .default_value = true, .description = "save a checkpoint after the last step"});
  s.push_back({.key = "checkpoint.rank0_only",
               .type = T::kBool,
               .default_value = true,
               .description = "FULL_STATE_DICT loading: rank 0 reads the file and broadcasts it unit by unit"});
  // [log]
  s.push_back(
      {.key = "log.every_steps", .type = T::kInt, .default_value = I{10}, .min = 1, .description = "print the loss every this many optimizer steps"});
  s.push_back({.key = "log.progress",
               .type = T::kString,
               .default_value = "auto",
               .choices = {"auto", "live", "plain", "none"},
               .description = "auto: a live line when started directly on a terminal, plain lines under mpirun/srun or into files; live, plain; "
                              "none: no progress output"});
  s.push_back({.key = "log.metrics_file",
               .type = T::kString,
               .default_value = "metrics.csv",
               .description = "CSV of the metrics of every logged step, relative to run.out_dir; empty: none"});
  s.push_back({.key = "log.trace",
               .type = T::kBool,
               .default_value = false,
               .description = "write a Chrome trace-event timeline per rank (trace_rank<R>.json: steps, forward/backward per unit, "
                              "all-gather, reduce-scatter, optimizer, checkpoint, memory counters; open in Perfetto) and the memory "
                              "timeline memory_rank<R>.csv (for fsdp-plot)"});
  return s;
}

// ---- small helpers ---------------------------------------------------------------------------

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

/// Optimal string alignment distance (Levenshtein plus adjacent transpositions).
int edit_distance(const std::string& a, const std::string& b) {
  const std::size_t n = a.size(), m = b.size();
  std::vector<std::vector<int>> d(n + 1, std::vector<int>(m + 1));
  for (std::size_t i = 0; i <= n; ++i) d[i][0] = static_cast<int>(i);
  for (std::size_t j = 0; j <= m; ++j) d[0][j] = static_cast<int>(j);
  for (std::size_t i = 1; i <= n; ++i) {
    for (std::size_t j = 1; j <= m; ++j) {
      const int cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[n][m];
}

/// How far `word` (lower case) is from `known`, -1 if not close: twice the edit distance (at most 1
/// for short words, 2 otherwise), 3 for a prefix either way, 5 for a part of `known`.
int closeness(const std::string& word, const std::string& known) {
  const int tolerance = word.size() <= 4 ? 1 : 2;
  int best = -1;
  auto take = [&](int score) {
    if (best < 0 || score < best) best = score;
  };
  const int d = edit_distance(word, known);
  if (d <= tolerance) take(2 * d);
  if (word.size() >= 3 && known.size() >= 3 && (starts_with(known, word) || starts_with(word, known))) take(3);
  if (word.size() >= 4 && known.find(word) != std::string::npos) take(5);
  return best;
}

std::string closest_of(const std::string& word, const std::vector<std::string>& known) {
  int best = -1;
  std::string out;
  for (const auto& k : known) {
    const int c = closeness(lower(word), lower(k));
    if (c >= 0 && (best < 0 || c < best)) best = c, out = k;
  }
  return out;
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (std::size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

/// A number for messages: 1, -1, 0.5, 1e-05 (no forced ".0").
std::string format_number(double x) {
  if (std::isfinite(x) && x == std::floor(x) && std::fabs(x) < 1e15) return std::to_string(static_cast<long long>(x));
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, x);
  return std::string(buf, r.ptr);
}

/// A float as TOML writes it, reading back to the same double: 1.0, 0.7, 1e-05.
std::string toml_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, x);
  std::string s(buf, r.ptr);
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04X", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

const char* type_name(KeyType t) {
  switch (t) {
    case KeyType::kInt: return "integer";
    case KeyType::kFloat: return "float";
    case KeyType::kBool: return "boolean";
    case KeyType::kString: return "string";
    case KeyType::kIntArray: return "integer array";
    case KeyType::kFloatArray: return "float array";
  }
  return "?";
}

const char* expected(KeyType t) {
  switch (t) {
    case KeyType::kInt: return "an integer";
    case KeyType::kFloat: return "a number";
    case KeyType::kBool: return "a boolean (true or false)";
    case KeyType::kString: return "a string";
    case KeyType::kIntArray: return "an array of integers";
    case KeyType::kFloatArray: return "an array of numbers";
  }
  return "?";
}

/// What a TOML node is, for "expected X, got Y".
std::string describe(const toml::node& n) {
  if (auto* s = n.as_string()) return "a string (" + toml_string(s->get()) + ")";
  if (auto* i = n.as_integer()) return "an integer (" + std::to_string(i->get()) + ")";
  if (auto* f = n.as_floating_point()) return "a float (" + toml_float(f->get()) + ")";
  if (auto* b = n.as_boolean()) return std::string("a boolean (") + (b->get() ? "true" : "false") + ")";
  if (n.is_array_of_tables()) return "an array of tables";
  if (n.is_array()) return "an array";
  if (n.is_table()) return "a table";
  if (n.is_date()) return "a date";
  if (n.is_time()) return "a time";
  if (n.is_date_time()) return "a date-time";
  return "an unknown value";
}

int line_of(const toml::node& n) { return static_cast<int>(n.source().begin.line); }

// ---- values: conversion and checks -----------------------------------------------------------

/// One problem with a value; `text` is "<key>: <message>".
struct Issue {
  std::string text;
  int line = 0;    // for sorting problems found in the deck
  int column = 0;  // TOML syntax errors only
};

/// Range, choices (normalized in place) and array size.
void check_value(const KeySpec& spec, Value& v, std::vector<Issue>& issues, int line) {
  const std::size_t before = issues.size();
  auto range = [&](double x, const std::string& label) {
    if (!std::isfinite(x)) {
      issues.push_back({label + ": " + format_number(x) + " is not a finite number", line});
      return;
    }
    if (spec.min) {
      if (spec.min_exclusive && !(x > *spec.min))
        issues.push_back({label + ": " + format_number(x) + " must be greater than " + format_number(*spec.min), line});
      else if (!spec.min_exclusive && x < *spec.min)
        issues.push_back({label + ": " + format_number(x) + " is below the minimum " + format_number(*spec.min), line});
    }
    if (spec.max) {
      if (spec.max_exclusive && !(x < *spec.max))
        issues.push_back({label + ": " + format_number(x) + " must be less than " + format_number(*spec.max), line});
      else if (!spec.max_exclusive && x > *spec.max)
        issues.push_back({label + ": " + format_number(x) + " is above the maximum " + format_number(*spec.max), line});
    }
  };
  auto size = [&](std::size_t n) {
    if (spec.array_size != 0 && n != spec.array_size)
      issues.push_back({spec.key + ": expected " + std::to_string(spec.array_size) + " elements, got " + std::to_string(n), line});
  };
  if (auto* i = std::get_if<std::int64_t>(&v)) {
    range(static_cast<double>(*i), spec.key);
  } else if (auto* d = std::get_if<double>(&v)) {
    range(*d, spec.key);
  } else if (auto* ia = std::get_if<Ints>(&v)) {
    size(ia->size());
    for (std::size_t k = 0; k < ia->size(); ++k) range(static_cast<double>((*ia)[k]), spec.key + "[" + std::to_string(k) + "]");
  } else if (auto* fa = std::get_if<Floats>(&v)) {
    size(fa->size());
    for (std::size_t k = 0; k < fa->size(); ++k) range((*fa)[k], spec.key + "[" + std::to_string(k) + "]");
  } else if (auto* s = std::get_if<std::string>(&v)) {
    if (!spec.choices.empty()) {
      const auto it = std::find_if(spec.choices.begin(), spec.choices.end(), [&](const std::string& c) { return lower(c) == lower(*s); });
      if (it == spec.choices.end()) {
        std::string msg = spec.key + ": " + toml_string(*s) + " is not one of " + join(spec.choices, ", ");
        if (auto near = closest_of(*s, spec.choices); !near.empty()) msg += " (did you mean " + near + "?)";
        issues.push_back({msg, line});
      } else {
        *s = *it;
      }
    }
  }
}

/// A TOML node as a value of `spec` (type conversion only), or nullopt with issues.
std::optional<Value> from_node(const KeySpec& spec, const toml::node& n, std::vector<Issue>& issues) {
  auto wrong = [&](const std::string& label, const toml::node& got, const char* want) {
    issues.push_back({label + ": expected " + want + ", got " + describe(got), line_of(got)});
    return std::nullopt;
  };
  switch (spec.type) {
    case KeyType::kInt:
      if (auto* i = n.as_integer()) return Value{i->get()};
      return wrong(spec.key, n, expected(spec.type));
    case KeyType::kFloat:
      if (auto* f = n.as_floating_point()) return Value{f->get()};
      if (auto* i = n.as_integer()) return Value{static_cast<double>(i->get())};
      return wrong(spec.key, n, expected(spec.type));
    case KeyType::kBool:
      if (auto* b = n.as_boolean()) return Value{b->get()};
      return wrong(spec.key, n, expected(spec.type));
    case KeyType::kString: {
      if (auto* s = n.as_string()) return Value{s->get()};
      if (const auto* a = n.as_array(); a && spec.names_list) {  // stored as the comma-separated text it stands for
        std::vector<std::string> names;
        bool ok = true;
        for (std::size_t k = 0; k < a->size(); ++k) {
          const toml::node& e = *a->get(k);
          if (auto* name = e.as_string())
            names.push_back(name->get());
          else
            ok = false, wrong(spec.key + "[" + std::to_string(k) + "]", e, "a string");
        }
        if (!ok) return std::nullopt;
        return Value{join(names, ", ")};
      }
      const bool bool_choices = std::find(spec.choices.begin(), spec.choices.end(), "true") != spec.choices.end();
      if (auto* b = n.as_boolean(); b && bool_choices) return Value{std::string(b->get() ? "true" : "false")};
      return wrong(spec.key, n, expected(spec.type));
    }
    case KeyType::kIntArray:
    case KeyType::kFloatArray: {
      const auto* a = n.as_array();
      if (!a) return wrong(spec.key, n, expected(spec.type));
      Ints ints;
      Floats floats;
      bool ok = true;
      for (std::size_t k = 0; k < a->size(); ++k) {
        const toml::node& e = *a->get(k);
        const std::string label = spec.key + "[" + std::to_string(k) + "]";
        if (spec.type == KeyType::kIntArray) {
          if (auto* i = e.as_integer())
            ints.push_back(i->get());
          else
            ok = false, wrong(label, e, "an integer");
        } else {
          if (auto* f = e.as_floating_point())
            floats.push_back(f->get());
          else if (auto* i = e.as_integer())
            floats.push_back(static_cast<double>(i->get()));
          else
            ok = false, wrong(label, e, "a number");
        }
      }
      if (!ok) return std::nullopt;
      return spec.type == KeyType::kIntArray ? Value{std::move(ints)} : Value{std::move(floats)};
    }
  }
  return std::nullopt;
}

/// A programmatic value as a value of `spec` (the conversions a deck allows), or a message.
std::optional<std::string> coerce(const KeySpec& spec, Value& v) {
  if (std::holds_alternative<std::monostate>(v)) {
    if (std::holds_alternative<std::monostate>(spec.default_value)) return std::nullopt;
    return spec.key + ": cannot be unset";
  }
  switch (spec.type) {
    case KeyType::kInt:
      if (std::holds_alternative<I>(v)) return std::nullopt;
      break;
    case KeyType::kFloat:
      if (auto* i = std::get_if<I>(&v)) v = static_cast<double>(*i);
      if (std::holds_alternative<double>(v)) return std::nullopt;
      break;
    case KeyType::kBool:
      if (std::holds_alternative<bool>(v)) return std::nullopt;
      break;
    case KeyType::kString:
      if (auto* b = std::get_if<bool>(&v); b && std::find(spec.choices.begin(), spec.choices.end(), "true") != spec.choices.end())
        v = std::string(*b ? "true" : "false");
      if (std::holds_alternative<std::string>(v)) return std::nullopt;
      break;
    case KeyType::kIntArray:
      if (std::holds_alternative<Ints>(v)) return std::nullopt;
      break;
    case KeyType::kFloatArray:
      if (auto* ia = std::get_if<Ints>(&v)) v = Floats(ia->begin(), ia->end());
      if (std::holds_alternative<Floats>(v)) return std::nullopt;
      break;
  }
  static const char* const kHeld[] = {"unset", "an integer", "a float", "a boolean", "a string", "an integer array", "a float array"};
  return spec.key + ": expected " + expected(spec.type) + ", got " + kHeld[v.index()] + " (" + format_value(v) + ")";
}

std::string unknown_key_message(const std::string& key) {
  const auto dot = key.find('.');
  std::string msg = dot == std::string::npos ? "unknown key outside any section" : "unknown key";
  if (auto near = did_you_mean(key); !near.empty()) return msg + " (did you mean " + near + "?)";
  if (dot != std::string::npos) {
    const std::string section = key.substr(0, dot);
    std::vector<std::string> names;
    for (const auto& s : deck_schema())
      if (s.section() == section) names.push_back(s.name());
    if (!names.empty()) return msg + " (the keys of [" + section + "] are " + join(names, ", ") + ")";
    return msg + " (the sections are " + join(deck_sections(), ", ") + ")";
  }
  return msg + " (keys belong in a section: " + join(deck_sections(), ", ") + ")";
}

/// Parses one "section.key=value" override into (spec, value); issues are "<key>: <message>".
std::optional<std::pair<const KeySpec*, Value>> parse_override(const std::string& text, std::vector<Issue>& issues) {
  const auto eq = text.find('=');
  if (eq == std::string::npos) {
    issues.push_back({trim(text) + ": expected section.key=value"});
    return std::nullopt;
  }
  const std::string key = trim(text.substr(0, eq));
  const std::string raw = trim(text.substr(eq + 1));
  const KeySpec* spec = find_key(key);
  if (!spec) {
    issues.push_back({(key.empty() ? "(empty key)" : key) + ": " + unknown_key_message(key)});
    return std::nullopt;
  }
  std::optional<Value> value;
  const std::string doc = "v = " + raw;
  bool parsed = false;
  try {
    const toml::table t = toml::parse(std::string_view(doc), std::string_view("--set"));
    if (t.size() == 1 && t.contains("v")) {
      const toml::node& n = *t.get("v");
      parsed = true;
      if (spec->type == KeyType::kString && !n.is_string() && !(spec->names_list && n.is_array())) {
        value = Value{raw};  // a string key takes the text as written (run.name=2024, reshard_after_forward=true)
      } else {
        std::vector<Issue> found;
        value = from_node(*spec, n, found);
        for (auto& f : found) issues.push_back({f.text});
        if (!value) return std::nullopt;
      }
    }
  } catch (const toml::parse_error&) {}
  if (!parsed) {
    if (spec->type != KeyType::kString) {
      issues.push_back({spec->key + ": expected " + expected(spec->type) + ", got a string (" + toml_string(raw) + ")"});
      return std::nullopt;
    }
    value = Value{raw};
  }
  std::vector<Issue> found;
  check_value(*spec, *value, found, 0);
  for (auto& f : found) issues.push_back({f.text});
  if (!found.empty()) return std::nullopt;
  return std::make_pair(spec, std::move(*value));
}

const std::map<std::string, std::size_t>& key_index() {
  static const std::map<std::string, std::size_t> index = [] {
    std::map<std::string, std::size_t> m;
    const auto& s = deck_schema();
    for (std::size_t i = 0; i < s.size(); ++i) m.emplace(s[i].key, i);
    return m;
  }();
  return index;
}

std::string source_name(Source s) {
  switch (s) {
    case Source::kDefault: return "default";
    case Source::kDeck: return "deck";
    case Source::kSet: return "--set";
  }
  return "?";
}

/// Checks between keys; each problem blames the entry most likely at fault.
void cross_check(const Deck& deck, std::vector<std::string>& problems) {
  auto where = [&](const Entry& e) { return e.where.empty() ? deck.path() : e.where; };
  auto explicit_ = [](const Entry& e) { return e.source != Source::kDefault; };
  const Entry& model = deck.entry("model.kind");
  const Entry& data = deck.entry("data.kind");
  const bool transformer = deck.get_string("model.kind") == "transformer";
  const std::string& dk = deck.get_string("data.kind");
  const bool token_data = dk == "tokens" || dk == "text";
  if (transformer != token_data) {
    const bool blame_model = explicit_(model) && (!explicit_(data) || (model.source == Source::kSet && data.source != Source::kSet));
    if (blame_model) {
      problems.push_back(where(model) + ": model.kind: " + format_value(model.value) + " needs data.kind " +
                         (transformer ? "\"tokens\" or \"text\"" : "\"fashion-mnist\" or \"mnist\"") + " (data.kind is " + format_value(data.value) +
                         ")");
    } else {
      problems.push_back(where(data) + ": data.kind: " + format_value(data.value) + " needs model.kind " +
                         (token_data ? "\"transformer\"" : "\"cnn\" or \"mlp\"") + " (model.kind is " + format_value(model.value) + ")");
    }
  }
  {
    const Entry& group = deck.entry("fsdp.shard_group_size");
    const std::string& strategy = deck.get_string("fsdp.sharding_strategy");
    if (deck.get_int("fsdp.shard_group_size") != 0 && strategy != "HYBRID_SHARD" && strategy != "HYBRID_SHARD_ZERO2")
      problems.push_back(where(group) + ": fsdp.shard_group_size: applies to HYBRID_SHARD and HYBRID_SHARD_ZERO2 only (fsdp.sharding_strategy is \"" +
                         strategy + "\"); leave it at 0");
  }
  if (transformer) {
    const std::int64_t d = deck.get_int("model.d_model"), h = deck.get_int("model.n_heads");
    if (d % h != 0) {
      const Entry& heads = deck.entry("model.n_heads");
      const Entry& blamed = explicit_(heads) ? heads : explicit_(deck.entry("model.d_model")) ? deck.entry("model.d_model") : model;
      problems.push_back(where(blamed) + ": " + blamed.spec->key + ": model.n_heads = " + std::to_string(h) +
                         " does not divide model.d_model = " + std::to_string(d));
    }
  }
}

}  // namespace

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

std::string format_value(const Value& v) {
  struct {
    std::string operator()(std::monostate) const { return "(unset)"; }
    std::string operator()(std::int64_t i) const { return std::to_string(i); }
    std::string operator()(double d) const { return toml_float(d); }
    std::string operator()(bool b) const { return b ? "true" : "false"; }
    std::string operator()(const std::string& s) const { return toml_string(s); }
    std::string operator()(const Ints& a) const {
      std::vector<std::string> parts;
      for (auto i : a) parts.push_back(std::to_string(i));
      return "[" + join(parts, ", ") + "]";
    }
    std::string operator()(const Floats& a) const {
      std::vector<std::string> parts;
      for (auto d : a) parts.push_back(toml_float(d));
      return "[" + join(parts, ", ") + "]";
    }
  } visitor;
  return std::visit(visitor, v);
}

// ---- Deck ------------------------------------------------------------------------------------

Deck::Deck() : path_("(defaults)") {
  for (const auto& spec : deck_schema()) entries_.push_back({&spec, spec.default_value, Source::kDefault, 0, ""});
}

Deck Deck::parse(const std::string& text, const std::string& path, const std::vector<std::string>& overrides) {
  Deck deck;
  deck.path_ = path;
  deck.text_ = text;
  std::vector<Issue> issues;  // from the deck, sorted by line below
  try {
    const toml::table root = toml::parse(std::string_view(text), std::string_view(path));
    for (auto&& [k, node] : root) {
      const std::string section(k.str());
      const bool known = std::find(deck_sections().begin(), deck_sections().end(), section) != deck_sections().end();
      if (!known) {
        if (node.is_table() || node.is_array_of_tables()) {
          std::string msg = section + ": unknown section";
          if (auto near = closest_of(section, deck_sections()); !near.empty())
            msg += " (did you mean " + near + "?)";
          else
            msg += " (the sections are " + join(deck_sections(), ", ") + ")";
          issues.push_back({msg, line_of(node)});
        } else {
          issues.push_back({section + ": " + unknown_key_message(section), line_of(node)});
        }
        continue;
      }
      const toml::table* table = node.as_table();
      if (!table) {
        issues.push_back({section + ": expected a table [" + section + "], got " + describe(node), line_of(node)});
        continue;
      }
      for (auto&& [k2, value_node] : *table) {
        const std::string key = section + "." + std::string(k2.str());
        const KeySpec* spec = find_key(key);
        if (!spec) {
          issues.push_back({key + ": " + unknown_key_message(key), line_of(value_node)});
          continue;
        }
        const std::size_t before = issues.size();
        auto value = from_node(*spec, value_node, issues);
        if (!value) continue;
        check_value(*spec, *value, issues, line_of(value_node));
        if (issues.size() != before) continue;
        Entry& e = deck.mutable_entry(key);
        e.value = std::move(*value);
        e.source = Source::kDeck;
        e.line = line_of(value_node);
        e.where = path + ":" + std::to_string(e.line);
      }
    }
  } catch (const toml::parse_error& err) {
    const auto& at = err.source().begin;
    issues.push_back({"TOML syntax error: " + std::string(err.description()), static_cast<int>(at.line), static_cast<int>(at.column)});
  }
  std::stable_sort(issues.begin(), issues.end(), [](const Issue& a, const Issue& b) { return a.line < b.line; });
  std::vector<std::string> problems;
  for (const auto& i : issues)
    problems.push_back(path + ":" + std::to_string(i.line) + (i.column ? ":" + std::to_string(i.column) : "") + ": " + i.text);

  // Overrides: each independent of the deck's problems, reported after them.
  for (const auto& o : overrides) {
    std::vector<Issue> found;
    auto parsed = parse_override(o, found);
    for (const auto& f : found) problems.push_back("--set " + o + ": " + f.text);
    if (!parsed) continue;
    Entry& e = deck.mutable_entry(parsed->first->key);
    e.value = std::move(parsed->second);
    e.source = Source::kSet;
    e.line = 0;
    e.where = "--set " + o;
    deck.overrides_.push_back("--set " + o);
  }
  if (problems.empty()) cross_check(deck, problems);
  if (!problems.empty()) throw DeckError(problems);
  return deck;
}

Deck Deck::from_file(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw DeckError("cannot read deck '" + path + "': it is a folder, not a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DeckError("cannot read deck '" + path + "': " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw DeckError("cannot read deck '" + path + "': read error");
  return parse(text.str(), path, overrides);
}

void Deck::apply_overrides(const std::vector<std::string>& overrides, const std::string& label, Source s) {
  Deck next = *this;
  std::vector<std::string> problems;
  for (const auto& o : overrides) {
    std::vector<Issue> found;
    auto parsed = parse_override(o, found);
    for (const auto& f : found) problems.push_back(label + " " + o + ": " + f.text);
    if (!parsed) continue;
    Entry& e = next.mutable_entry(parsed->first->key);
    e.value = std::move(parsed->second);
    e.source = s;
    e.line = 0;
    e.where = label + " " + o;
    next.overrides_.push_back(label + " " + o);
  }
  if (problems.empty()) cross_check(next, problems);
  if (!problems.empty()) throw DeckError(problems);
  *this = std::move(next);
}

const Entry& Deck::entry(const std::string& key) const {
  const auto& index = key_index();
  const auto it = index.find(key);
  if (it == index.end()) throw DeckError(key + ": " + unknown_key_message(key));
  return entries_[it->second];
}

Entry& Deck::mutable_entry(const std::string& key) { return const_cast<Entry&>(entry(key)); }

const Entry& Deck::typed_entry(const std::string& key, KeyType type, const char* getter) const {
  const auto& index = key_index();
  const auto it = index.find(key);
  if (it == index.end()) throw DeckError(std::string(getter) + "(\"" + key + "\"): " + unknown_key_message(key));
  const Entry& e = entries_[it->second];
  if (e.spec->type != type)
    throw DeckError(std::string(getter) + "(\"" + key + "\"): " + key + " is a " + type_name(e.spec->type) + " key, not a " + type_name(type) +
                    " key");
  if (std::holds_alternative<std::monostate>(e.value))
    throw DeckError(std::string(getter) + "(\"" + key + "\"): " + key + " is unset (check is_set() first)");
  return e;
}

std::int64_t Deck::get_int(const std::string& key) const { return std::get<I>(typed_entry(key, KeyType::kInt, "get_int").value); }
double Deck::get_float(const std::string& key) const { return std::get<double>(typed_entry(key, KeyType::kFloat, "get_float").value); }
bool Deck::get_bool(const std::string& key) const { return std::get<bool>(typed_entry(key, KeyType::kBool, "get_bool").value); }
const std::string& Deck::get_string(const std::string& key) const {
  return std::get<std::string>(typed_entry(key, KeyType::kString, "get_string").value);
}
const std::vector<std::int64_t>& Deck::get_int_array(const std::string& key) const {
  return std::get<Ints>(typed_entry(key, KeyType::kIntArray, "get_int_array").value);
}
const std::vector<double>& Deck::get_float_array(const std::string& key) const {
  return std::get<Floats>(typed_entry(key, KeyType::kFloatArray, "get_float_array").value);
}

bool Deck::is_set(const std::string& key) const { return !std::holds_alternative<std::monostate>(entry(key).value); }

void Deck::set(const std::string& key, Value v, Source s) {
  Entry& e = mutable_entry(key);
  if (auto msg = coerce(*e.spec, v)) throw DeckError(*msg);
  if (!std::holds_alternative<std::monostate>(v)) {
    std::vector<Issue> issues;
    check_value(*e.spec, v, issues, 0);
    if (!issues.empty()) {
      std::vector<std::string> problems;
      for (const auto& i : issues) problems.push_back(i.text);
      throw DeckError(problems);
    }
  }
  e.value = std::move(v);
  e.source = s;
  e.line = 0;
  e.where = "set()";
}

std::string Deck::out_dir() const {
  const auto& dir = get_string("run.out_dir");
  return dir.empty() ? "runs/" + get_string("run.name") : dir;
}

std::string Deck::checkpoint_dir() const {
  const auto& dir = get_string("checkpoint.dir");
  return dir.empty() ? (std::filesystem::path(out_dir()) / "checkpoints").string() : dir;
}

std::string Deck::echo_table() const {
  std::size_t wk = 3, wv = 5;
  std::vector<std::string> values;
  for (const auto& e : entries_) {
    values.push_back(format_value(e.value));
    wk = std::max(wk, e.spec->key.size());
    wv = std::max(wv, values.back().size());
  }
  std::ostringstream out;
  auto row = [&](const std::string& a, const std::string& b, const std::string& c) {
    out << a << std::string(wk - a.size() + 2, ' ') << b << std::string(wv - b.size() + 2, ' ') << c << "\n";
  };
  row("key", "value", "source");
  row(std::string(wk, '-'), std::string(wv, '-'), "-------");
  for (std::size_t i = 0; i < entries_.size(); ++i) row(entries_[i].spec->key, values[i], source_name(entries_[i].source));
  return out.str();
}

std::string Deck::to_toml() const {
  auto one_line = [](std::string s) {
    std::replace(s.begin(), s.end(), '\n', ' ');
    std::replace(s.begin(), s.end(), '\r', ' ');
    return s;
  };
  std::ostringstream out;
  out << "# fsdp deck, resolved: every key with its value; unset keys are comments.\n";
  out << "# From: " << one_line(path_) << "\n";
  for (const auto& o : overrides_) out << "# Override: " << one_line(o) << "\n";
  out << "# Keys, types and defaults: docs/deck_reference.md\n";
  std::string section;
  for (const auto& e : entries_) {
    if (e.spec->section() != section) {
      section = e.spec->section();
      out << "\n[" << section << "]\n";
    }
    if (std::holds_alternative<std::monostate>(e.value))
      out << "# " << e.spec->name() << " = (unset)\n";
    else
      out << e.spec->name() << " = " << format_value(e.value) << "\n";
  }
  return out.str();
}

// ---- the reference ---------------------------------------------------------------------------

std::string reference_markdown() {
  // A table cell: '|' escaped; a word holding <placeholder> in backticks, so it is not read as HTML.
  auto cell = [](const std::string& s) {
    std::string out;
    for (char c : s) out += c == '|' ? std::string("\\|") : std::string(1, c);
    return std::regex_replace(out, std::regex("([^ `]*<[^> ]+>[^ `;,)]*)"), "`$1`");
  };
  std::ostringstream md;
  md << "# Deck reference\n\n"
     << "<!-- Generated from the schema in app/deck.cpp; do not edit. Regenerate with\n"
     << "     build/bin/fsdp-sweep --print-reference > docs/deck_reference.md\n"
     << "     The test test_deck fails when this file and the schema disagree. -->\n\n"
     << "`fsdp-train` reads every setting from an input deck, a [TOML](https://toml.io) file. This page\n"
     << "lists every key. `fsdp-sweep` writes one deck per point of a parameter grid.\n\n"
     << "## How decks work\n\n"
     << "- **Sections and keys.** A deck has the sections below, each a TOML table (`[optim]`), holding\n"
     << "  `name = value` lines. A key is named `section.name` (`optim.lr`) in messages and on the command\n"
     << "  line. Every key has a default, so an empty deck is a valid deck; a deck names only what it changes.\n"
     << "  Unknown sections and keys are errors, with the closest known name suggested.\n"
     << "- **Types.** integer, float, boolean, string, and arrays of integers or floats. An integer is\n"
     << "  accepted where a float is expected (`lr = 1`). A key with choices takes one of the listed\n"
     << "  strings in any case (`full_shard` is stored as `FULL_SHARD`). Ranges are inclusive unless\n"
     << "  written with `>`, `<` or a parenthesis; an array's range applies to each element.\n"
     << "- **`--set section.key=value`** on the command line overrides the deck, in order, after it is\n"
     << "  read. The value is read as a TOML value (`--set optim.lr=1e-3`, `--set optim.betas=[0.9,0.99]`,\n"
     << "  `--set data.shuffle=false`, `--set 'run.name=\"a b\"'`); text that is not a TOML value, and any\n"
     << "  value of a string key, is taken as the string itself (`--set run.out_dir=runs/a`,\n"
     << "  `--set fsdp.sharding_strategy=SHARD_GRAD_OP`).\n"
     << "- **Sources.** The run's log echoes every key with its value and where it came from: `deck`,\n"
     << "  `--set` or `default`. The resolved deck (every key, as TOML) is written to the run's output\n"
     << "  folder; reading it again gives the same run.\n"
     << "- **Unset.** A default of *(unset)* means the program decides (e.g. `model.dropout`: each model's\n"
     << "  own values). An empty string default is derived from other keys as its description says\n"
     << "  (`run.out_dir` is `runs/<run.name>`, `checkpoint.dir` is `<run.out_dir>/checkpoints`).\n"

     << "- **Errors.** Every problem of a deck and its `--set` options is reported at once, one per line,\n"
     << "  as `<file>:<line>: <key>: <message>` (`--set <text>: <key>: <message>` for an override), e.g.\n"
     << "  `inputs/a.toml:7: optim.lr: -1 must be greater than 0` or\n"
     << "  `inputs/a.toml:3: optim.lrr: unknown key (did you mean optim.lr?)`. A TOML syntax error gives\n"
     << "  `<file>:<line>:<column>`. Some keys are checked together: `model.kind = \"transformer\"` goes with\n"
     << "  `data.kind` `tokens` or `text` (and the image models with `fashion-mnist` or `mnist`), and\n"
     << "  `model.n_heads` must divide `model.d_model`.\n\n"
     << "```toml\n"
     << "# inputs/example.toml\n"
     << "[run]\nname = \"fmnist-sgo\"\nepochs = 3\n\n"
     << "[optim]\nkind = \"adamw\"\nlr = 1e-3\n\n"
     << "[fsdp]\nsharding_strategy = \"SHARD_GRAD_OP\"\n"
     << "```\n";
  for (const auto& section : deck_sections()) {
    md << "\n## [" << section << "]\n\n"
       << "| key | type | default | range / choices | description |\n"
       << "|---|---|---|---|---|\n";
    for (const auto& s : deck_schema()) {
      if (s.section() != section) continue;
      std::string range;
      if (!s.choices.empty()) {
        std::vector<std::string> parts;
        for (const auto& c : s.choices) parts.push_back("`" + c + "`");
        range = join(parts, ", ");
      } else if (s.min && s.max) {
        range = std::string(s.min_exclusive ? "(" : "[") + format_number(*s.min) + ", " + format_number(*s.max) + (s.max_exclusive ? ")" : "]");
      } else if (s.min) {
        range = std::string(s.min_exclusive ? "> " : ">= ") + format_number(*s.min);
      } else if (s.max) {
        range = std::string(s.max_exclusive ? "< " : "<= ") + format_number(*s.max);
      }
      if (s.array_size) range += (range.empty() ? "" : "; ") + std::to_string(s.array_size) + " elements";
      if (range.empty()) range = "any";
      const std::string def = std::holds_alternative<std::monostate>(s.default_value) ? "*(unset)*" : "`" + format_value(s.default_value) + "`";
      const std::string& description = s.description;
      md << "| `" << s.name() << "` | " << (s.names_list ? "string or string array" : type_name(s.type)) << " | " << cell(def) << " | " << cell(range)
         << " | " << cell(description) << " |\n";
    }
  }
  return md.str();
}

}  // namespace fsdp::app
