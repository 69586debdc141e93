// Checkpoints of an FSDP model on HDF5 (io layer): SHARDED (one file written by all ranks in parallel
// over MPI-IO), FULL (rank 0 writes, gathering one unit at a time) and LOCAL (a folder with each
// rank's raw flat shard). SHARDED and FULL files share one schema, keyed by parameter names in their
// logical shapes, so any world size and any strategy can load them; see docs/checkpoint_format.md.
//
// Loading reads everything into staging tensors first and the ranks agree that every read succeeded
// before anything in the model or optimizer changes: a corrupt file fails on every rank, leaves the
// model as it was, and lets resume_from_latest() fall back to an older checkpoint.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/comm/agree.hpp"
#include "fsdp/errors.hpp"
#include "fsdp/io/checkpoint_files.hpp"
#include "fsdp/io/checkpoint_tools.hpp"
#include "fsdp/io/h5.hpp"
#include "fsdp/torch/fully_sharded.hpp"
#include "fsdp/torch/optim_state.hpp"
#include "fsdp/version.hpp"

namespace fsdp {

/// What a checkpoint holds and who writes it (names as in PyTorch's StateDictType).
enum class StateDictType {
  FULL_STATE_DICT,     ///< rank 0 gathers one unit at a time and writes one file
  SHARDED_STATE_DICT,  ///< every rank writes its part of one file in parallel (MPI-IO)
  LOCAL_STATE_DICT,    ///< every rank writes its raw flat shard to its own file; same world size and plan only
};

inline const char* to_string(StateDictType t) noexcept {
  switch (t) {
    case StateDictType::FULL_STATE_DICT: return "FULL_STATE_DICT";
    case StateDictType::SHARDED_STATE_DICT: return "SHARDED_STATE_DICT";
    case StateDictType::LOCAL_STATE_DICT: return "LOCAL_STATE_DICT";
  }
  return "?";
}

/// Parses "SHARDED_STATE_DICT", "sharded", "FULL", "local_state_dict", ...
inline StateDictType parse_state_dict_type(const std::string& text) {
  std::string up = text;
  std::transform(up.begin(), up.end(), up.begin(), [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  for (auto t : {StateDictType::FULL_STATE_DICT, StateDictType::SHARDED_STATE_DICT, StateDictType::LOCAL_STATE_DICT}) {
    const std::string name = to_string(t);
    if (up == name || up == name.substr(0, name.find('_'))) return t;
  }
  throw ConfigError("unknown state dict type '" + text + "' (valid: SHARDED_STATE_DICT, FULL_STATE_DICT, LOCAL_STATE_DICT)");
}

/// Training progress stored next to the model: what resuming needs besides parameters and
/// optimizer state.
struct TrainState {
  std::int64_t step = 0;                    ///< optimizer steps taken
  std::int64_t epoch = 0;                   ///< data position: epoch ...
  std::int64_t sample_index = 0;            ///< ... and the next sample within it
  std::map<std::string, double> scheduler;  ///< LR scheduler state (e.g. {"last_epoch": 12, "base_lr": 3e-4})
  std::string deck;                         ///< the input deck text (rank 0's is written)
  /// Set by loading: whether this rank's RNG state was restored (only at the saving world size).
  bool rng_restored = false;
};

struct CheckpointOptions {
  StateDictType state_dict_type = StateDictType::SHARDED_STATE_DICT;
  /// Keep the newest `keep_last` checkpoints in the folder, delete older ones after a commit; 0 keeps all.
  int keep_last = 0;
  /// FULL_STATE_DICT loading: only rank 0 reads the file and broadcasts one unit at a time (the file
  /// may sit on rank 0's disk only). Saving FULL always writes from rank 0 only.
  bool rank0_only = true;
  /// Store and restore each rank's CPU RNG state.
  bool save_rng_state = true;
  /// Save and load first wait at most this long for every rank to arrive; a call made on some ranks
  /// only then fails with CommError (fsdp.comm.deadline) instead of hanging. <= 0 waits forever.
  double collective_timeout_s = 600;
  /// Called on every rank with the step being saved at "writing" (parameters written, files still
  /// open), "written" (files closed, not yet committed) and "committed". For tests that crash a save
  /// half way; leave empty otherwise.
  std::function<void(const std::string& stage, std::int64_t step)> on_stage;
};

struct SaveResult {
  std::string path;                   ///< the committed checkpoint (file or LOCAL folder)
  std::int64_t bytes = 0;             ///< its size on disk
  double seconds = 0;                 ///< wall time of the save on this rank
  std::vector<std::string> pruned;    ///< older checkpoints removed by keep_last
  std::vector<std::string> warnings;  ///< e.g. an old checkpoint that could not be deleted (rank 0)
};

struct ResumeResult {
  std::string path;                  ///< the checkpoint loaded; empty if none was usable
  std::vector<std::string> skipped;  ///< "<name>: <why>" for each newer one that could not be loaded
};

namespace detail {

inline h5::ElementType element_type_of(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return h5::ElementType::kFloat32;
    case c10::ScalarType::Double: return h5::ElementType::kFloat64;
    case c10::ScalarType::Half: return h5::ElementType::kFloat16;
    case c10::ScalarType::BFloat16: return h5::ElementType::kBFloat16;
    case c10::ScalarType::Long: return h5::ElementType::kInt64;
    case c10::ScalarType::Int: return h5::ElementType::kInt32;
    case c10::ScalarType::Byte: return h5::ElementType::kUInt8;
    case c10::ScalarType::Bool: return h5::ElementType::kBool;
    default: throw CheckpointError(std::string("cannot store tensors of dtype ") + c10::toString(t));
  }
}

/// The message of an exception without the "[id] " prefix of fsdp errors.
inline std::string message_of(const std::exception& e) {
  std::string m = e.what();
  if (!m.empty() && m[0] == '[') {
    const auto close = m.find("] ");
    if (close != std::string::npos) m = m.substr(close + 2);
  }
  return m;
}

/// Runs f; an exception becomes its what() ("[id] message" for fsdp errors, so agree() keeps the id).
template <class F>
std::optional<std::string> capture_error(F&& f) {
  try {
    f();
    return std::nullopt;
  } catch (const std::exception& e) {
    return std::string(e.what());
  }
}

/// Splits "[id] message" into id and message (id "fsdp.ckpt" when there is none).
inline std::pair<std::string, std::string> split_error(const std::string& text) {
  if (!text.empty() && text[0] == '[') {
    const auto close = text.find("] ");
    if (close != std::string::npos) return {text.substr(1, close - 1), text.substr(close + 2)};
  }
  return {"fsdp.ckpt", text};
}

/// Id of errors where the checkpoint is readable but belongs to another model, optimizer or plan.
inline constexpr const char* kMismatchId = "fsdp.ckpt.mismatch";

/// Every rank learns whether any rank failed; if so all throw the lowest failing rank's message.
template <Communicator Comm>
void agree(Comm& comm, const std::optional<std::string>& error) {
  const auto failure = agree_on_failure(comm, error);
  if (!failure) return;
  const auto [id, text] = split_error(failure->message);
  const bool everyone = failure->failed_ranks == comm.size();
  throw CheckpointError(everyone ? text : text + " (reported by rank " + std::to_string(failure->rank) + ")",
                        id.rfind("fsdp.ckpt", 0) == 0 ? id : "fsdp.ckpt");
}

/// A little length-prefixed serializer for broadcasting metadata from rank 0.
struct Packer {
  std::string bytes;
  void i64(std::int64_t v) { bytes.append(reinterpret_cast<const char*>(&v), sizeof v); }
  void f64(double v) { bytes.append(reinterpret_cast<const char*>(&v), sizeof v); }
  void str(const std::string& s) {
    i64(static_cast<std::int64_t>(s.size()));
    bytes += s;
  }
};
struct Unpacker {
  const std::string& bytes;
  std::size_t pos = 0;
  template <class T>
  T pod() {
    T v{};
    if (pos + sizeof v > bytes.size()) throw CheckpointError("internal: truncated metadata broadcast");
    std::memcpy(&v, bytes.data() + pos, sizeof v);
    pos += sizeof v;
    return v;
  }
  std::int64_t i64() { return pod<std::int64_t>(); }
  double f64() { return pod<double>(); }
  std::string str() {
    const auto n = static_cast<std::size_t>(i64());
    if (pos + n > bytes.size()) throw CheckpointError("internal: truncated metadata broadcast");
    std::string s = bytes.substr(pos, n);
    pos += n;
    return s;
  }
};

inline torch::Tensor cpu_rng_state() { return at::detail::getDefaultCPUGenerator().get_state(); }
inline void set_cpu_rng_state(const torch::Tensor& state) {
  at::Generator generator = at::detail::getDefaultCPUGenerator();  // shares the default generator
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// Shared with the offline tools: "[2, 3]" and the logical shape of a stored tensor (0-d tensors are
// stored with dims {1} and attribute scalar=1).
using ckpt::detail::logical_shape;
using ckpt::detail::shape_text;

/// The element type of a stored tensor (uint8 datasets with attribute dtype = "bool" are bool).
inline h5::ElementType tensor_element_type(hid_t dataset, const std::string& where) {
  const auto t = h5::stored_element_type(dataset, where);
  if (t == h5::ElementType::kUInt8 && h5::has_attribute(dataset, "dtype") && h5::read_string_attribute(dataset, "dtype", where) == "bool")
    return h5::ElementType::kBool;
  return t;
}

/// Reads a whole buffer, checking its shape and dtype against `like`.
inline torch::Tensor read_buffer(hid_t file, const std::string& path, const std::string& ds_path, const torch::Tensor& like,
                                 std::vector<std::string>& problems) {
  if (!h5::exists(file, ds_path)) {
    problems.push_back(ds_path + " (missing)");
    return {};
  }
  h5::Id ds = h5::open_dataset(file, ds_path, path);
  const auto shape = logical_shape(ds);
  const auto stored = tensor_element_type(ds, "checkpoint '" + path + "' dataset " + ds_path);
  const auto wanted = element_type_of(like.scalar_type());
  if (shape != like.sizes().vec() || stored != wanted) {
    problems.push_back(ds_path + " (file " + shape_text(shape) + " " + h5::element_type_name(stored) + ", model " + shape_text(like.sizes().vec()) +
                       " " + h5::element_type_name(wanted) + ")");
    return {};
  }
  auto t = torch::empty(like.sizes(), like.options().device(torch::kCPU).requires_grad(false));  // staged on the host
  h5::read_flat_range(ds, shape, 0, t.numel(), wanted, t.data_ptr(), "checkpoint '" + path + "' dataset " + ds_path);
  return t;
}

/// The part of parameter `i` of unit `u` inside the flat range [lo, hi) of the unit's padded
/// flat buffer: param-local flat range [begin, end) and where it starts in the range.
struct Piece {
  std::int64_t begin = 0, end = 0;  // within the parameter's flattened elements
  std::int64_t offset = 0;          // of `begin` relative to `lo`
};
inline Piece piece_of(const FlatLayout& layout, std::size_t i, std::int64_t lo, std::int64_t hi) {
  const auto i64 = static_cast<std::int64_t>(i);
  const std::int64_t p0 = layout.param_offset(i64), p1 = p0 + layout.param_numel(i64);
  const std::int64_t a = std::max(lo, p0), b = std::min(hi, p1);
  if (a >= b) return {};
  return {a - p0, b - p0, a - lo};
}

inline std::string model_path(const std::string& fqn) { return "/model/" + fqn; }
inline std::string optim_path(const std::string& fqn) { return "/optim/" + fqn; }

/// What a load reads before touching the model.
struct StagedUnit {
  torch::Tensor flat;  // this rank's shard
  std::vector<std::pair<std::string, torch::Tensor>> optim;
  std::int64_t optim_step = 0;
  bool has_optim = false;
};
struct StagedMeta {
  TrainState train;
  std::string optimizer_kind;  // "" = no optimizer state in the file
  std::vector<double> lrs;
  torch::Tensor rng;  // this rank's CPU RNG state, undefined if not restorable
};

/// The module's buffers by name, as checkpoints hold them: in their own dtype (before mixed
/// precision's buffer_dtype). Loading copies the value back into the live buffer.
template <class Engine>
std::vector<std::pair<std::string, torch::Tensor>> named_buffers_of(Engine& engine) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& b : engine.module()->named_buffers(/*recurse=*/true)) {
    if (!b.value().defined()) continue;
    const auto dtype = engine.checkpoint_buffer_dtype(b.key(), b.value());
    out.emplace_back(b.key(), dtype == b.value().scalar_type() ? b.value() : b.value().detach().to(dtype));
  }
  return out;
}

/// The live buffers, in the order of named_buffers_of().
template <class Engine>
std::vector<torch::Tensor> live_buffers_of(Engine& engine) {
  std::vector<torch::Tensor> out;
  for (const auto& b : engine.module()->named_buffers(/*recurse=*/true))
    if (b.value().defined()) out.push_back(b.value());
  return out;
}

/// The MPI communicator parallel HDF5 writes through: the engine's own (MpiComm), or the MPI
/// communicator over the same ranks that a GPU communicator was bootstrapped from (NcclComm::mpi()).
template <class Comm>
MPI_Comm mpi_handle(Comm& comm) {
  if constexpr (requires {
                  { comm.native() } -> std::convertible_to<MPI_Comm>;
                })
    return comm.native();
  else
    return comm.mpi().native();
}

template <class Engine>
void write_root_attributes(hid_t file, Engine& engine, StateDictType type, const TrainState& state, const std::string& created,
                           const std::string& deck) {
  h5::write_attribute(file, "format", ckpt::kFormatName);
  h5::write_attribute(file, "format_version", ckpt::kFormatVersion);
  h5::write_attribute(file, "state_dict_type", to_string(type));
  h5::write_attribute(file, "step", state.step);
  h5::write_attribute(file, "world_size", engine.world_size());
  h5::write_attribute(file, "shard_group_size", engine.shard_group_size());
  h5::write_attribute(file, "strategy", to_string(engine.sharding_strategy()));
  h5::write_attribute(file, "plan_hash", ckpt::hex64(engine.plan_hash()));
  h5::write_attribute(file, "fsdp_version", kVersion);
  h5::write_attribute(file, "torch_version",
                      std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." + std::to_string(TORCH_VERSION_PATCH));
  h5::write_attribute(file, "created", created);
  h5::write_attribute(file, "deck", deck);
}

inline void write_train_group(hid_t file, const TrainState& state) {
  h5::Id train = h5::require_group(file, "/train");
  h5::write_attribute(train, "step", state.step);
  h5::write_attribute(train, "epoch", state.epoch);
  h5::write_attribute(train, "sample_index", state.sample_index);
  h5::Id sched = h5::require_group(file, "/train/scheduler");
  for (const auto& [k, v] : state.scheduler) h5::write_attribute(sched, k, v);
}

inline void write_optimizer_attributes(hid_t file, const torch::optim::Optimizer& opt) {
  h5::Id g = h5::require_group(file, "/optim");
  h5::write_attribute(g, "kind", optimizer_kind(opt));
  std::vector<double> lrs;
  for (const auto& group : opt.param_groups()) lrs.push_back(group.options().get_lr());
  h5::write_attribute(g, "lr", lrs);
}

/// The optimizer state of a unit's shard, if the optimizer has any for it.
inline std::optional<OptimizerStateView> unit_optimizer_state(const torch::optim::Optimizer* opt, const ShardedUnit& u) {
  if (!opt || !u.shard.defined()) return std::nullopt;
  const auto it = opt->state().find(optimizer_state_key(u.shard));
  if (it == opt->state().end()) return std::nullopt;
  return optimizer_state_view(*it->second);
}

/// Creates /model/<fqn> for each parameter and buffer, /optim/<fqn>/<state>, and hard links for tied
/// parameters; calls write(dataset, fqn, shape, source) for each, where source names what to write.
struct TensorTarget {
  std::string path;
  std::vector<std::int64_t> shape;
  h5::ElementType type;
};

inline h5::Id create_tensor_dataset(hid_t file, const TensorTarget& t, const char* kind) {
  h5::Id ds = h5::create_dataset(file, t.path, t.type, t.shape);
  h5::write_attribute(ds, "kind", kind);
  if (t.type == h5::ElementType::kBool) h5::write_attribute(ds, "dtype", "bool");  // stored as uint8
  if (t.shape.empty()) h5::write_attribute(ds, "scalar", std::int64_t{1});
  return ds;
}

/// Tied parameters are stored once; their other names are hard links to the same dataset.
template <class Engine>
void link_tied_parameters(hid_t file, Engine& engine) {
  for (const auto& [name, aliases] : engine.tied_parameter_aliases())
    for (const auto& alias : aliases)
      h5::check(H5Lcreate_hard(file, model_path(name).c_str(), file, model_path(alias).c_str(), H5P_DEFAULT, H5P_DEFAULT),
                "cannot link " + model_path(alias));
}

/// Creates /model/<name> for a buffer; `writer` ranks write its values (with a collective `dxpl`
/// every rank calls this, the others with nothing selected).
inline void write_buffer(hid_t file, const std::string& name, const torch::Tensor& buffer, bool writer, hid_t dxpl) {
  const auto b = buffer.detach().to(torch::kCPU).contiguous();  // HDF5 reads host memory
  const TensorTarget t{model_path(name), b.sizes().vec(), element_type_of(b.scalar_type())};
  h5::Id ds = create_tensor_dataset(file, t, "buffer");
  h5::write_flat_range(ds, t.shape, 0, writer ? b.numel() : 0, t.type, b.data_ptr(), dxpl, t.path);
}

inline void write_rng_rows(hid_t file, const torch::Tensor& rows, std::int64_t world, int my_row, bool parallel, hid_t dxpl) {
  // rows: in parallel, this rank's state (1 x n); serially, every rank's (world x n).
  const std::int64_t n = rows.size(-1);
  h5::Id ds = h5::create_dataset(file, "/rng/cpu", h5::ElementType::kUInt8, {world, n});
  if (parallel)
    h5::write_flat_range(ds, {world, n}, my_row * n, (my_row + 1) * n, h5::ElementType::kUInt8, rows.data_ptr(), dxpl, "/rng/cpu");
  else
    h5::write_flat_range(ds, {world, n}, 0, world * n, h5::ElementType::kUInt8, rows.data_ptr(), H5P_DEFAULT, "/rng/cpu");
}

/// All ranks' CPU RNG states as a (world x n) uint8 tensor. Collective.
template <Communicator Comm>
torch::Tensor gather_rng_states(Comm& comm) {
  auto mine = cpu_rng_state().contiguous();
  std::int64_t n = mine.numel(), max_n = n;
  comm.all_reduce(&max_n, &max_n, 1, DType::kInt64, ReduceOp::kMax);
  if (max_n != n) throw CheckpointError("RNG state sizes differ between ranks");
  auto all = torch::empty({comm.size(), n}, torch::kUInt8);
  comm.all_gather(mine.data_ptr(), all.data_ptr(), n, DType::kUInt8);
  return all;
}

// ---- save -------------------------------------------------------------------------------------

/// SHARDED: every HDF5 call is collective, so every step is agreed between the ranks: a failure on
/// one rank (disk full on its MPI-IO aggregator, memory) stops all of them at the same call, where
/// they unwind and close the file together instead of waiting in the next collective.
template <class Engine>
std::int64_t write_sharded_file(Engine& engine, const torch::optim::Optimizer* opt, const std::string& path, const TrainState& state,
                                const CheckpointOptions& options, const std::string& created) {
  auto& world = engine.comm();
  auto step = [&world](auto&& f) { agree(world, capture_error(f)); };
  MPI_Comm native = mpi_handle(world);
  h5::Id file, dxpl;
  step([&] {
    file = h5::create_file(path, &native);
    write_root_attributes(file, engine, StateDictType::SHARDED_STATE_DICT, state, created, state.deck);
    dxpl = h5::collective_transfer();
  });
  const bool writer = engine.replica_comm().rank() == 0;  // one copy of each shard is written
  std::int64_t tensors = 0;
  auto write_unit_tensor = [&](const ShardedUnit& u, const torch::Tensor& shard_like, const std::string& prefix, const char* kind) {
    const auto [lo, hi] = u.own_range();
    torch::Tensor src;
    step([&] { src = shard_like.detach().to(torch::kCPU).contiguous(); });  // HDF5 reads host memory
    const auto et = element_type_of(src.scalar_type());
    for (std::size_t i = 0; i < u.param_names.size(); ++i) {
      const TensorTarget t{prefix.empty() ? model_path(u.param_names[i]) : optim_path(u.param_names[i]) + "/" + prefix, u.shapes[i], et};
      step([&] {
        h5::Id ds = create_tensor_dataset(file, t, kind);
        const Piece p = writer ? piece_of(u.layout, i, lo, hi) : Piece{};
        const char* data = static_cast<const char*>(src.data_ptr()) + p.offset * static_cast<std::int64_t>(src.element_size());
        h5::write_flat_range(ds, t.shape, p.begin, p.end, et, data, dxpl, t.path);
      });
      ++tensors;
    }
  };
  for (const auto& up : engine.sharded_units()) {
    if (up.param_names.empty()) continue;
    write_unit_tensor(up, up.shard, "", "parameter");
  }
  step([&] {
    if (options.on_stage) options.on_stage("writing", state.step);
  });
  step([&] { link_tied_parameters(file, engine); });
  for (const auto& [name, buffer] : named_buffers_of(engine)) {
    step([&] { write_buffer(file, name, buffer, world.rank() == 0, dxpl); });
    ++tensors;
  }
  if (opt) {
    step([&] { write_optimizer_attributes(file, *opt); });
    for (const auto& up : engine.sharded_units()) {
      const auto view = unit_optimizer_state(opt, up);  // present on every rank alike (checked on entry)
      if (!view || up.param_names.empty()) continue;
      for (const auto& [name, t] : view->tensors) write_unit_tensor(up, t, name, "optimizer_state");
      step([&] {
        for (const auto& fqn : up.param_names) {
          h5::Id g = h5::require_group(file, optim_path(fqn));
          h5::write_attribute(g, "step", view->step);
        }
      });
    }
  }
  step([&] {
    write_train_group(file, state);
    if (options.save_rng_state) write_rng_rows(file, cpu_rng_state().contiguous(), world.size(), world.rank(), true, dxpl);
    h5::write_attribute(file, "num_tensors", tensors);
    // Global flush: MPI_File_sync on every rank, so data cached on other nodes reaches the file
    // system before rank 0's fsync and the rename.
    h5::check(H5Fflush(file, H5F_SCOPE_GLOBAL), "cannot flush '" + path + "'");
  });
  step([&] { file.close("cannot close '" + path + "'"); });
  return tensors;
}

template <class Engine>
void write_full_file(Engine& engine, const torch::optim::Optimizer* opt, const std::string& path, const TrainState& state,
                     const CheckpointOptions& options, const std::string& created, const std::string& deck) {
  auto& world = engine.comm();
  const bool writer = world.rank() == 0;
  std::optional<std::string> error;  // rank 0's; it keeps taking part in the gathers after a failure
  h5::Id file;
  auto on_writer = [&](auto&& f) {
    if (writer && !error) error = capture_error(f);
  };
  on_writer([&] {
    file = h5::create_file(path);
    write_root_attributes(file, engine, StateDictType::FULL_STATE_DICT, state, created, deck);
  });
  std::int64_t tensors = 0;
  auto write_full = [&](const ShardedUnit& u, const torch::Tensor& flat, const std::string& prefix, const char* kind) {
    const auto et = element_type_of(flat.scalar_type());
    for (std::size_t i = 0; i < u.param_names.size(); ++i) {
      const TensorTarget t{prefix.empty() ? model_path(u.param_names[i]) : optim_path(u.param_names[i]) + "/" + prefix, u.shapes[i], et};
      on_writer([&] {
        h5::Id ds = create_tensor_dataset(file, t, kind);
        const auto i64 = static_cast<std::int64_t>(i);
        const char* data = static_cast<const char*>(flat.data_ptr()) + u.layout.param_offset(i64) * static_cast<std::int64_t>(flat.element_size());
        h5::write_flat_range(ds, t.shape, 0, u.layout.param_numel(i64), et, data, H5P_DEFAULT, t.path);
      });
      ++tensors;
    }
  };
  for (const auto& up : engine.sharded_units()) {  // one unit at a time: memory bounded by the largest unit
    if (up.param_names.empty()) continue;
    const int index = up.index;
    write_full(up, engine.gather_flat(index, up.shard).to(torch::kCPU), "", "parameter");
  }
  agree(world, capture_error([&] {
          if (options.on_stage) options.on_stage("writing", state.step);
        }));
  on_writer([&] {
    link_tied_parameters(file, engine);
    for (const auto& [name, buffer] : named_buffers_of(engine)) write_buffer(file, name, buffer, true, H5P_DEFAULT);
    if (opt) write_optimizer_attributes(file, *opt);
  });
  tensors += static_cast<std::int64_t>(named_buffers_of(engine).size());
  if (opt) {
    for (const auto& up : engine.sharded_units()) {
      const auto view = unit_optimizer_state(opt, up);
      if (!view || up.param_names.empty()) continue;
      for (const auto& [name, t] : view->tensors) write_full(up, engine.gather_flat(up.index, t).to(torch::kCPU), name, "optimizer_state");
      on_writer([&] {
        for (const auto& fqn : up.param_names) {
          h5::Id g = h5::require_group(file, optim_path(fqn));
          h5::write_attribute(g, "step", view->step);
        }
      });
    }
  }
  torch::Tensor rng;
  if (options.save_rng_state) rng = gather_rng_states(world);
  on_writer([&] {
    write_train_group(file, state);
    if (rng.defined()) write_rng_rows(file, rng, world.size(), 0, false, H5P_DEFAULT);
    h5::write_attribute(file, "num_tensors", tensors);
    file.close("cannot close (flush) '" + path + "'");
  });
  agree(world, error);
}

template <class Engine>
void write_local_file(Engine& engine, const torch::optim::Optimizer* opt, const std::string& path, const TrainState& state,
                      const CheckpointOptions& options, const std::string& created, const std::string& deck) {
  h5::Id file = h5::create_file(path);
  write_root_attributes(file, engine, StateDictType::LOCAL_STATE_DICT, state, created, deck);
  h5::write_attribute(file, "rank", engine.rank());
  h5::write_attribute(file, "shard_rank", engine.shard_comm().rank());
  h5::write_attribute(file, "replica_rank", engine.replica_comm().rank());
  std::vector<std::string> aliases;
  for (const auto& [name, others] : engine.tied_parameter_aliases())
    for (const auto& alias : others) aliases.push_back(alias + "=" + name);
  h5::write_attribute(file, "aliases", aliases);
  std::int64_t tensors = 0;
  for (const auto& up : engine.sharded_units()) {
    const auto& u = up;
    const std::string base = "/units/" + std::to_string(u.index);
    h5::Id g = h5::require_group(file, base);
    h5::write_attribute(g, "module_path", u.module_path);
    h5::write_attribute(g, "param_names", u.param_names);
    std::vector<std::int64_t> ndims, dims;
    for (const auto& s : u.shapes) {
      ndims.push_back(static_cast<std::int64_t>(s.size()));
      dims.insert(dims.end(), s.begin(), s.end());
    }
    h5::write_attribute(g, "param_ndims", ndims);
    h5::write_attribute(g, "param_dims", dims);
    h5::write_attribute(g, "numel", u.layout.numel());
    h5::write_attribute(g, "padded_numel", u.layout.padded_numel());
    h5::write_attribute(g, "shard_numel", u.layout.shard_numel());
    if (u.param_names.empty()) continue;
    auto write_flat = [&](const std::string& p, const torch::Tensor& t) {
      const auto src = t.detach().to(torch::kCPU).contiguous();
      const auto et = element_type_of(src.scalar_type());
      h5::Id ds = h5::create_dataset(file, p, et, {src.numel()});
      h5::write_flat_range(ds, {src.numel()}, 0, src.numel(), et, src.data_ptr(), H5P_DEFAULT, p);
      ++tensors;
    };
    write_flat(base + "/flat", u.shard);
    if (const auto view = unit_optimizer_state(opt, u)) {
      for (const auto& [name, t] : view->tensors) write_flat(base + "/optim/" + name, t);
      h5::Id og = h5::require_group(file, base + "/optim");
      h5::write_attribute(og, "step", view->step);
    }
  }
  if (options.on_stage) options.on_stage("writing", state.step);
  for (const auto& [name, buffer] : named_buffers_of(engine)) {
    write_buffer(file, name, buffer, true, H5P_DEFAULT);
    ++tensors;
  }
  if (opt) write_optimizer_attributes(file, *opt);
  write_train_group(file, state);
  if (options.save_rng_state) {
    const auto mine = cpu_rng_state().contiguous().view({1, -1});
    write_rng_rows(file, mine, 1, 0, false, H5P_DEFAULT);
  }
  h5::write_attribute(file, "num_tensors", tensors);
  file.close("cannot close (flush) '" + path + "'");
}

/// Every rank enters a collective checkpoint call, or the ones that did fail after the deadline.
template <Communicator Comm>
void arrive_together(Comm& comm, const CheckpointOptions& options, const char* what) {
  if constexpr (requires { comm.barrier_within(1.0, std::string()); })
    comm.barrier_within(options.collective_timeout_s, what);
  else
    comm.barrier();
}

inline std::int64_t size_on_disk(const std::filesystem::path& p) {
  std::error_code ec;
  if (std::filesystem::is_regular_file(p, ec)) return static_cast<std::int64_t>(std::filesystem::file_size(p, ec));
  std::int64_t total = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(p, ec))
    if (e.is_regular_file()) total += static_cast<std::int64_t>(e.file_size());
  return total;
}

}  // namespace detail

namespace detail {

inline std::string pack_meta(const StagedMeta& m);
inline StagedMeta unpack_meta(const std::string& bytes);

/// What every rank must agree on before a save makes its first collective HDF5 call: the train state
/// (taken from rank 0), which units have optimizer state and its names, and the RNG state size.
template <class Engine>
void check_ranks_agree(Engine& engine, const torch::optim::Optimizer* opt, const CheckpointOptions& options) {
  auto& world = engine.comm();
  std::ostringstream os;
  os << to_string(options.state_dict_type) << ";rng=" << (options.save_rng_state ? cpu_rng_state().numel() : 0) << ";";
  if (opt) {
    os << "groups=" << opt->param_groups().size() << ";";
    for (const auto& up : engine.sharded_units()) {
      const auto view = unit_optimizer_state(opt, up);
      os << "u" << up.index << (view ? ":" : "-");
      if (view)
        for (const auto& [n, t] : view->tensors) os << n << ",";
    }
  }
  std::int64_t hash = static_cast<std::int64_t>(fnv1a64(os.str()) >> 1), low = -hash;
  world.all_reduce(&hash, &hash, 1, DType::kInt64, ReduceOp::kMax);
  world.all_reduce(&low, &low, 1, DType::kInt64, ReduceOp::kMax);
  if (hash != -low)
    throw CheckpointError("save_checkpoint: the ranks differ in optimizer state or RNG state size (" + os.str() + " on rank " +
                          std::to_string(world.rank()) + "); every rank must step the same optimizer");
}

/// rank 0's train state, on every rank.
template <Communicator Comm>
TrainState broadcast_train_state(Comm& comm, const TrainState& state) {
  StagedMeta m;
  m.train = state;
  std::string bytes = comm.rank() == 0 ? pack_meta(m) : std::string();
  return unpack_meta(broadcast_string(comm, bytes)).train;
}

}  // namespace detail

/// Saves the model, optimizer state (if `optimizer`) and `state` as <dir>/step_<state.step>.h5 and
/// points <dir>/latest at it once it is safely on disk. Rank 0's `state` is the one written (step,
/// data position, scheduler values and deck must describe the whole job). Collective over the
/// engine's world; a failure on any rank throws CheckpointError on every rank, leaving the previous
/// checkpoint and `latest` untouched.
namespace detail {
/// An upper estimate of a FULL/SHARDED checkpoint file's size: every tensor once plus HDF5's object
/// headers, chunk indexes and checksums (under 4 KiB per dataset here) and a spare 64 KiB.
template <class Engine>
std::int64_t expected_file_bytes(Engine& engine, const torch::optim::Optimizer* opt, int world_size) {
  std::int64_t bytes = 0, datasets = 0;
  for (const auto& up : engine.sharded_units()) {
    if (up.param_names.empty()) continue;
    const auto numel = up.layout.numel();
    const auto count = static_cast<std::int64_t>(up.param_names.size());
    bytes += numel * static_cast<std::int64_t>(c10::elementSize(up.dtype));
    datasets += count;
    if (const auto view = unit_optimizer_state(opt, up))
      for (const auto& [name, t] : view->tensors) {
        bytes += numel * static_cast<std::int64_t>(t.element_size());
        datasets += count;
      }
  }
  for (const auto& [name, buffer] : named_buffers_of(engine)) {
    bytes += buffer.numel() * static_cast<std::int64_t>(buffer.element_size());
    ++datasets;
  }
  bytes += world_size * cpu_rng_state().numel();
  return bytes + datasets * 4096 + 65536;
}
}  // namespace detail

template <class Engine>
SaveResult save_checkpoint(Engine& engine, const torch::optim::Optimizer* optimizer, const std::string& dir, const TrainState& state,
                           const CheckpointOptions& options = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  auto& world = engine.comm();
  detail::arrive_together(world, options, "save_checkpoint");
  const TrainState written = detail::broadcast_train_state(world, state);
  detail::check_ranks_agree(engine, optimizer, options);
  const std::string name = ckpt::checkpoint_name(written.step);
  const std::filesystem::path folder(dir);
  const auto tmp = folder / ckpt::temporary_name(name);
  const bool local = options.state_dict_type == StateDictType::LOCAL_STATE_DICT;
  // Rank 0 prepares the folder; the others learn whether that worked before creating files in it.
  std::optional<std::string> error;
  if (world.rank() == 0) {
    error = detail::capture_error([&] {
      std::error_code ec;
      std::filesystem::create_directories(folder, ec);
      if (ec) throw CheckpointError("cannot create checkpoint folder '" + dir + "': " + ec.message());
      std::filesystem::remove_all(tmp, ec);  // left over by a save that crashed
      if (!local) ckpt::reserve_space(tmp, detail::expected_file_bytes(engine, optimizer, world.size()), (folder / name).string());
      if (local) {
        std::filesystem::create_directories(tmp, ec);
        if (ec) throw CheckpointError("cannot create '" + tmp.string() + "': " + ec.message());
      }
    });
  }
  detail::agree(world, error);
  // A failed write (disk full, quota, file size limit) leaves a partial temporary: rank 0 deletes it
  // so that the space it holds goes back to the job; `latest` never pointed at it.
  struct RemoveTemporaryOnFailure {
    const std::filesystem::path& path;
    bool armed;
    ~RemoveTemporaryOnFailure() {
      if (!armed) return;
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  } cleanup{tmp, world.rank() == 0};
  const std::string created = detail::broadcast_string(world, ckpt::utc_now());
  switch (options.state_dict_type) {
    case StateDictType::SHARDED_STATE_DICT: detail::write_sharded_file(engine, optimizer, tmp.string(), written, options, created); break;
    case StateDictType::FULL_STATE_DICT: detail::write_full_file(engine, optimizer, tmp.string(), written, options, created, written.deck); break;
    case StateDictType::LOCAL_STATE_DICT: {
      const auto file = tmp / ckpt::local_rank_file(world.rank());
      error = detail::capture_error([&] {
        detail::write_local_file(engine, optimizer, file.string(), written, options, created, written.deck);
        ckpt::fsync_path(file);
      });
      detail::agree(world, error);
      break;
    }
  }
  if (options.on_stage) options.on_stage("written", written.step);
  SaveResult result;
  result.path = (folder / name).string();
  error.reset();
  if (world.rank() == 0) {
    error = detail::capture_error([&] { ckpt::commit(folder, name); });
    if (!error) {
      // The checkpoint is committed: a failure to delete old ones is a warning, not a failed save.
      try {
        result.pruned = ckpt::prune(folder, options.keep_last);
      } catch (const std::exception& e) {
        result.warnings.push_back(detail::message_of(e));
      }
    }
  }
  detail::agree(world, error);
  cleanup.armed = false;
  if (options.on_stage) options.on_stage("committed", written.step);
  result.bytes = detail::size_on_disk(result.path);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

namespace detail {

// ---- load -------------------------------------------------------------------------------------

/// Reads the padded flat range [lo, hi) of unit `u` (and its optimizer state) from a FULL/SHARDED file.
inline StagedUnit read_unit_range(hid_t file, const std::string& path, const ShardedUnit& u, std::int64_t lo, std::int64_t hi,
                                  const torch::optim::Optimizer* opt, std::vector<std::string>& problems) {
  StagedUnit s;
  const auto dtype = u.dtype;
  s.flat = torch::zeros({hi - lo}, torch::TensorOptions().dtype(dtype));
  auto read_into = [&](const std::string& ds_path, std::size_t i, torch::Tensor& dst) {
    h5::Id ds = h5::open_dataset(file, ds_path, path);
    const auto shape = logical_shape(ds);
    const auto stored = tensor_element_type(ds, path + ":" + ds_path);
    if (shape != u.shapes[i] || stored != element_type_of(dtype)) {
      problems.push_back(ds_path + " (file " + shape_text(shape) + " " + h5::element_type_name(stored) + ", model " + shape_text(u.shapes[i]) + " " +
                         h5::element_type_name(element_type_of(dtype)) + ")");
      return;
    }
    const Piece p = piece_of(u.layout, i, lo, hi);
    char* out = static_cast<char*>(dst.data_ptr()) + p.offset * static_cast<std::int64_t>(dst.element_size());
    h5::read_flat_range(ds, u.shapes[i], p.begin, p.end, stored, out, "checkpoint '" + path + "' dataset " + ds_path);
  };
  for (std::size_t i = 0; i < u.param_names.size(); ++i) {
    const std::string p = model_path(u.param_names[i]);
    if (!h5::exists(file, p)) {
      problems.push_back(p + " (missing)");
      continue;
    }
    read_into(p, i, s.flat);
  }
  if (!opt || !h5::exists(file, "/optim")) return s;
  const std::string first = optim_path(u.param_names.front());
  if (!h5::exists(file, first)) return s;  // saved before this unit had optimizer state
  s.has_optim = true;
  h5::Id g = h5::open_group(file, first, path);
  s.optim_step = h5::read_int_attribute(g, "step", "checkpoint '" + path + "' group " + first);
  for (const auto& name : h5::list_names(file, first)) {
    auto t = torch::zeros({hi - lo}, torch::TensorOptions().dtype(dtype));
    for (std::size_t i = 0; i < u.param_names.size(); ++i) {
      const std::string p = optim_path(u.param_names[i]) + "/" + name;
      if (!h5::exists(file, p)) {
        problems.push_back(p + " (missing)");
        continue;
      }
      read_into(p, i, t);
    }
    s.optim.emplace_back(name, t);
  }
  return s;
}

/// Train state, optimizer kind and learning rates, and the RNG rows of a file.
inline StagedMeta read_meta(hid_t file, const std::string& path, int rng_row, std::int64_t rng_rows_expected) {
  StagedMeta m;
  const std::string where = "checkpoint '" + path + "'";
  h5::Id train = h5::open_group(file, "/train", path);
  m.train.step = h5::read_int_attribute(train, "step", where + " /train");
  m.train.epoch = h5::read_int_attribute(train, "epoch", where + " /train");
  m.train.sample_index = h5::read_int_attribute(train, "sample_index", where + " /train");
  h5::Id sched = h5::open_group(file, "/train/scheduler", path);
  for (const auto& k : h5::list_attribute_names(sched)) m.train.scheduler[k] = h5::read_double_attribute(sched, k, where + " /train/scheduler");
  m.train.deck = h5::read_string_attribute(file, "deck", where);
  if (h5::exists(file, "/optim")) {
    h5::Id g = h5::open_group(file, "/optim", path);
    m.optimizer_kind = h5::read_string_attribute(g, "kind", where + " /optim");
    m.lrs = h5::read_double_array_attribute(g, "lr", where + " /optim");
  }
  if (rng_row >= 0 && h5::exists(file, "/rng/cpu")) {
    h5::Id ds = h5::open_dataset(file, "/rng/cpu", path);
    const auto dims = h5::dataset_dims(ds);
    if (dims.size() == 2 && dims[0] == rng_rows_expected) {
      m.rng = torch::empty({dims[1]}, torch::kUInt8);
      h5::read_flat_range(ds, dims, rng_row * dims[1], (rng_row + 1) * dims[1], h5::ElementType::kUInt8, m.rng.data_ptr(),
                          where + " dataset /rng/cpu");
    }
  }
  return m;
}

inline std::string pack_meta(const StagedMeta& m) {
  Packer p;
  p.i64(m.train.step);
  p.i64(m.train.epoch);
  p.i64(m.train.sample_index);
  p.i64(static_cast<std::int64_t>(m.train.scheduler.size()));
  for (const auto& [k, v] : m.train.scheduler) {
    p.str(k);
    p.f64(v);
  }
  p.str(m.train.deck);
  p.str(m.optimizer_kind);
  p.i64(static_cast<std::int64_t>(m.lrs.size()));
  for (double lr : m.lrs) p.f64(lr);
  return p.bytes;
}

inline StagedMeta unpack_meta(const std::string& bytes) {
  Unpacker u{bytes};
  StagedMeta m;
  m.train.step = u.i64();
  m.train.epoch = u.i64();
  m.train.sample_index = u.i64();
  for (std::int64_t n = u.i64(); n > 0; --n) {
    std::string k = u.str();
    m.train.scheduler[k] = u.f64();
  }
  m.train.deck = u.str();
  m.optimizer_kind = u.str();
  for (std::int64_t n = u.i64(); n > 0; --n) m.lrs.push_back(u.f64());
  return m;
}

/// Datasets under /model that no parameter or buffer of the model claims.
template <class Engine>
std::vector<std::string> unexpected_model_tensors(hid_t file, Engine& engine) {
  std::set<std::string> known;
  for (const auto& up : engine.sharded_units())
    for (const auto& n : up.param_names) known.insert(n);
  for (const auto& [name, aliases] : engine.tied_parameter_aliases())
    for (const auto& a : aliases) known.insert(a);
  for (const auto& [name, b] : named_buffers_of(engine)) known.insert(name);
  std::vector<std::string> out;
  for (const auto& n : h5::list_names(file, "/model"))
    if (!known.count(n)) out.push_back(model_path(n) + " (not in the model)");
  return out;
}

inline std::string mismatch_message(const std::string& path, const std::vector<std::string>& problems) {
  std::string m = "checkpoint '" + path + "' does not match the model: ";
  for (std::size_t i = 0; i < problems.size() && i < 20; ++i) m += (i ? "; " : "") + problems[i];
  if (problems.size() > 20) m += "; ... and " + std::to_string(problems.size() - 20) + " more";
  return m;
}

template <class Engine>
void check_root(hid_t file, const std::string& path, Engine& engine, StateDictType expected) {
  const std::string where = "checkpoint '" + path + "'";
  const std::string format = h5::read_string_attribute(file, "format", where);
  if (format != ckpt::kFormatName) throw CheckpointError(where + " is not an fsdp checkpoint (format '" + format + "')");
  const auto version = h5::read_int_attribute(file, "format_version", where);
  if (version > ckpt::kFormatVersion)
    throw CheckpointError(where + " has format version " + std::to_string(version) + "; this build reads up to " +
                          std::to_string(ckpt::kFormatVersion));
  const auto type = parse_state_dict_type(h5::read_string_attribute(file, "state_dict_type", where));
  if (expected == StateDictType::LOCAL_STATE_DICT && type != expected) throw CheckpointError(where + " is not a LOCAL_STATE_DICT rank file");
  if (type == StateDictType::LOCAL_STATE_DICT) {
    const auto world = h5::read_int_attribute(file, "world_size", where);
    const auto plan = h5::read_string_attribute(file, "plan_hash", where);
    if (world != engine.world_size() || plan != ckpt::hex64(engine.plan_hash()))
      throw CheckpointError(where + " is a LOCAL_STATE_DICT checkpoint of world size " + std::to_string(world) + " and plan " + plan +
                                "; this run has world size " + std::to_string(engine.world_size()) + " and plan " + ckpt::hex64(engine.plan_hash()) +
                                ". LOCAL checkpoints load only into the same world size and wrapping; merge it with `fsdp-ckpt merge` "
                                "or save SHARDED_STATE_DICT to change either",
                            detail::kMismatchId);
  }
}

struct Staged {
  std::vector<StagedUnit> units;  // by unit index
  std::vector<torch::Tensor> buffers;
  StagedMeta meta;
  std::vector<std::unique_ptr<torch::optim::OptimizerParamState>> optimizer_states;  // by unit index; null: keep
};

template <class Engine>
Staged read_own_parts(Engine& engine, const torch::optim::Optimizer* opt, const std::string& path) {
  Staged s;
  h5::Id file = h5::open_file_readonly(path);
  check_root(file, path, engine, StateDictType::SHARDED_STATE_DICT);
  std::vector<std::string> problems;
  for (const auto& up : engine.sharded_units()) {
    if (up.param_names.empty()) {
      s.units.emplace_back();
      continue;
    }
    const auto [lo, hi] = up.own_range();
    s.units.push_back(read_unit_range(file, path, up, lo, hi, opt, problems));
  }
  for (const auto& [name, b] : named_buffers_of(engine)) s.buffers.push_back(read_buffer(file, path, model_path(name), b, problems));
  for (auto& p : unexpected_model_tensors(file, engine)) problems.push_back(std::move(p));
  if (!problems.empty()) throw CheckpointError(mismatch_message(path, problems), kMismatchId);
  const auto world = h5::read_int_attribute(file, "world_size", "checkpoint '" + path + "'");
  s.meta = read_meta(file, path, engine.rank(), world == engine.world_size() ? world : -1);
  return s;
}

/// FULL file, rank0_only: rank 0 reads one unit at a time and broadcasts it. Collective.
template <class Engine>
Staged read_on_rank0(Engine& engine, const torch::optim::Optimizer* opt, const std::string& path) {
  auto& world = engine.comm();
  const bool reader = world.rank() == 0;
  Staged s;
  h5::Id file;
  std::vector<std::string> problems;
  std::optional<std::string> error;
  std::string meta_bytes;
  if (reader) {
    error = capture_error([&] {
      file = h5::open_file_readonly(path);
      check_root(file, path, engine, StateDictType::FULL_STATE_DICT);
      auto unexpected = unexpected_model_tensors(file, engine);
      if (!unexpected.empty()) throw CheckpointError(mismatch_message(path, unexpected), kMismatchId);
      const auto saved_world = h5::read_int_attribute(file, "world_size", "checkpoint '" + path + "'");
      meta_bytes = pack_meta(read_meta(file, path, -1, 0));
      (void)saved_world;
    });
  }
  agree(world, error);
  s.meta = unpack_meta(broadcast_string(world, meta_bytes));
  for (const auto& u : engine.sharded_units()) {
    if (u.param_names.empty()) {
      s.units.emplace_back();
      continue;
    }
    StagedUnit full;
    if (reader) {
      error = capture_error([&] {
        full = read_unit_range(file, path, u, 0, u.layout.padded_numel(), opt, problems);
        if (!problems.empty()) throw CheckpointError(mismatch_message(path, problems), kMismatchId);
      });
    }
    agree(world, error);
    Packer names;
    names.i64(full.has_optim ? 1 : 0);
    names.i64(full.optim_step);
    names.i64(static_cast<std::int64_t>(full.optim.size()));
    for (const auto& [n, t] : full.optim) names.str(n);
    const std::string header = broadcast_string(world, names.bytes);
    Unpacker un{header};
    StagedUnit mine;
    mine.has_optim = un.i64() != 0;
    mine.optim_step = un.i64();
    const auto n_states = un.i64();
    const auto dtype = u.dtype;
    auto share = [&](torch::Tensor t) {
      if (!t.defined()) t = torch::empty({u.layout.padded_numel()}, torch::TensorOptions().dtype(dtype));
      world.broadcast(t.data_ptr(), t.numel(), to_comm_dtype(t.scalar_type()), 0);
      return t.narrow(0, u.own_range().begin, u.own_range().numel()).clone();
    };
    mine.flat = share(full.flat);
    for (std::int64_t k = 0; k < n_states; ++k) {
      const std::string name = un.str();
      mine.optim.emplace_back(name, share(reader ? full.optim[static_cast<std::size_t>(k)].second : torch::Tensor()));
    }
    s.units.push_back(std::move(mine));
  }
  for (const auto& [name, b] : named_buffers_of(engine)) {
    auto t = torch::empty(b.sizes(), b.options());
    if (reader) {
      error = capture_error([&] {
        std::vector<std::string> buffer_problems;
        auto value = read_buffer(file, path, model_path(name), b, buffer_problems);
        if (!buffer_problems.empty()) throw CheckpointError(mismatch_message(path, buffer_problems), kMismatchId);
        t.copy_(value);
      });
    }
    agree(world, error);
    if (t.numel() > 0) world.broadcast(t.data_ptr(), t.numel(), to_comm_dtype(t.scalar_type()), 0);
    s.buffers.push_back(t);
  }
  // RNG rows: rank 0 reads them all and broadcasts, if the world size matches.
  std::int64_t rows = 0, n = 0;
  torch::Tensor all;
  if (reader) {
    error = capture_error([&] {
      if (!h5::exists(file, "/rng/cpu")) return;
      h5::Id ds = h5::open_dataset(file, "/rng/cpu", path);
      const auto dims = h5::dataset_dims(ds);
      if (dims.size() != 2 || dims[0] != world.size()) return;
      all = torch::empty({dims[0], dims[1]}, torch::kUInt8);
      h5::read_flat_range(ds, dims, 0, all.numel(), h5::ElementType::kUInt8, all.data_ptr(), "checkpoint '" + path + "' dataset /rng/cpu");
      rows = dims[0];
      n = dims[1];
    });
  }
  agree(world, error);
  world.broadcast(&rows, 1, DType::kInt64, 0);
  world.broadcast(&n, 1, DType::kInt64, 0);
  if (rows > 0) {
    if (!reader) all = torch::empty({rows, n}, torch::kUInt8);
    world.broadcast(all.data_ptr(), all.numel(), DType::kUInt8, 0);
    s.meta.rng = all[world.rank()].clone();
  }
  return s;
}

template <class Engine>
Staged read_local_file(Engine& engine, const torch::optim::Optimizer* opt, const std::string& dir) {
  Staged s;
  const std::string path = (std::filesystem::path(dir) / ckpt::local_rank_file(engine.rank())).string();
  h5::Id file = h5::open_file_readonly(path);
  check_root(file, path, engine, StateDictType::LOCAL_STATE_DICT);
  for (const auto& up : engine.sharded_units()) {
    const auto& u = up;
    StagedUnit su;
    if (u.param_names.empty()) {
      s.units.push_back(su);
      continue;
    }
    const std::string base = "/units/" + std::to_string(u.index);
    const auto dtype = u.dtype;
    auto read_flat = [&](const std::string& p) {
      h5::Id ds = h5::open_dataset(file, p, path);
      const auto dims = h5::dataset_dims(ds);
      if (dims != std::vector<std::int64_t>{u.layout.shard_numel()})
        throw CheckpointError("checkpoint '" + path + "' dataset " + p + " has " + shape_text(dims) + " elements, expected [" +
                              std::to_string(u.layout.shard_numel()) + "]");
      auto t = torch::empty({u.layout.shard_numel()}, torch::TensorOptions().dtype(dtype));
      h5::read_flat_range(ds, dims, 0, t.numel(), element_type_of(dtype), t.data_ptr(), "checkpoint '" + path + "' dataset " + p);
      return t;
    };
    su.flat = read_flat(base + "/flat");
    if (opt && h5::exists(file, base + "/optim")) {
      su.has_optim = true;
      h5::Id og = h5::open_group(file, base + "/optim", path);
      su.optim_step = h5::read_int_attribute(og, "step", "checkpoint '" + path + "' group " + base + "/optim");
      for (const auto& name : h5::list_names(file, base + "/optim")) su.optim.emplace_back(name, read_flat(base + "/optim/" + name));
    }
    s.units.push_back(std::move(su));
  }
  std::vector<std::string> problems;
  for (const auto& [name, b] : named_buffers_of(engine)) s.buffers.push_back(read_buffer(file, path, model_path(name), b, problems));
  if (!problems.empty()) throw CheckpointError(mismatch_message(path, problems), kMismatchId);
  s.meta = read_meta(file, path, 0, 1);
  return s;
}

/// Moves staged values into the model and optimizer. Local; cannot fail half way except on
/// programming errors (checked before: optimizer kind, group count).
template <class Engine>
void apply_staged(Engine& engine, torch::optim::Optimizer* opt, Staged& s, TrainState* state) {
  torch::NoGradGuard no_grad;
  const auto& units = engine.sharded_units();
  for (std::size_t i = 0; i < units.size(); ++i) {
    auto& u = units[i];
    if (u.param_names.empty()) continue;
    u.shard.detach().copy_(s.units[i].flat);  // bumps the version counter: a gathered copy is refreshed
  }
  if (opt) {
    for (std::size_t i = 0; i < units.size(); ++i)
      if (s.optimizer_states[i]) opt->state()[optimizer_state_key(units[i].shard)] = std::move(s.optimizer_states[i]);
    if (!s.meta.lrs.empty())
      for (std::size_t g = 0; g < opt->param_groups().size(); ++g) opt->param_groups()[g].options().set_lr(s.meta.lrs[g]);
  }
  const auto buffers = live_buffers_of(engine);
  for (std::size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(s.buffers[i]);  // converts to a mixed-precision buffer_dtype
  if (s.meta.rng.defined()) set_cpu_rng_state(s.meta.rng);
  if (state) {
    *state = s.meta.train;
    state->rng_restored = s.meta.rng.defined();
  }
}

}  // namespace detail

/// Loads a checkpoint written by save_checkpoint() (a SHARDED or FULL file at any world size and
/// strategy, or a LOCAL folder at the same world size and plan). Checks everything and lets all ranks
/// agree before changing anything; on failure every rank throws CheckpointError naming the file and
/// dataset, and the model, optimizer and `state` are unchanged. Collective.
template <class Engine>
void load_checkpoint(Engine& engine, torch::optim::Optimizer* optimizer, const std::string& path, TrainState* state = nullptr,
                     const CheckpointOptions& options = {}) {
  auto& world = engine.comm();
  detail::arrive_together(world, options, "load_checkpoint");
  // Every rank decides the kind of checkpoint the same way: rank 0 looks, the others are told.
  std::int64_t kind = -1;
  std::optional<std::string> error;
  if (world.rank() == 0) {
    error = detail::capture_error([&] {
      if (std::filesystem::is_directory(path)) {
        kind = static_cast<std::int64_t>(StateDictType::LOCAL_STATE_DICT);
      } else {
        h5::Id file = h5::open_file_readonly(path);
        kind = static_cast<std::int64_t>(parse_state_dict_type(h5::read_string_attribute(file, "state_dict_type", "checkpoint '" + path + "'")));
      }
    });
  }
  detail::agree(world, error);
  world.broadcast(&kind, 1, DType::kInt64, 0);
  const auto type = static_cast<StateDictType>(kind);
  detail::Staged staged;
  if (type == StateDictType::FULL_STATE_DICT && options.rank0_only) {
    staged = detail::read_on_rank0(engine, optimizer, path);  // agrees internally
  } else {
    error = detail::capture_error([&] {
      staged = type == StateDictType::LOCAL_STATE_DICT ? detail::read_local_file(engine, optimizer, path)
                                                       : detail::read_own_parts(engine, optimizer, path);
    });
    detail::agree(world, error);
  }
  staged.optimizer_states.resize(engine.sharded_units().size());
  error = detail::capture_error([&] {
    if (!optimizer) return;
    if (!staged.meta.optimizer_kind.empty() && staged.meta.optimizer_kind != optimizer_kind(*optimizer))
      throw CheckpointError(
          "checkpoint '" + path + "' holds " + staged.meta.optimizer_kind + " state but the optimizer is " + optimizer_kind(*optimizer),
          detail::kMismatchId);
    if (!staged.meta.lrs.empty() && staged.meta.lrs.size() != optimizer->param_groups().size())
      throw CheckpointError("checkpoint '" + path + "' has " + std::to_string(staged.meta.lrs.size()) +
                                " optimizer parameter groups, the optimizer has " + std::to_string(optimizer->param_groups().size()),
                            detail::kMismatchId);
    // Build every optimizer state now, so that applying them below cannot fail half way.
    const auto& units = engine.sharded_units();
    staged.optimizer_states.resize(units.size());
    for (std::size_t i = 0; i < units.size(); ++i) {
      if (units[i].param_names.empty() || !staged.units[i].has_optim) continue;
      OptimizerStateView view;
      view.step = staged.units[i].optim_step;
      view.tensors = staged.units[i].optim;
      try {
        staged.optimizer_states[i] = make_optimizer_state(*optimizer, view);
      } catch (const ConfigError& e) {
        throw CheckpointError("checkpoint '" + path + "': " + detail::message_of(e), detail::kMismatchId);
      }
    }
  });
  detail::agree(world, error);
  detail::apply_staged(engine, optimizer, staged, state);
}

/// Loads the newest usable checkpoint in `dir`: the one `latest` names, else (or if that one is
/// unreadable) the next newest. Returns its path and why newer ones were skipped; an empty path means
/// nothing could be loaded (a fresh start). Collective.
template <class Engine>
ResumeResult resume_from_latest(Engine& engine, torch::optim::Optimizer* optimizer, const std::string& dir, TrainState* state = nullptr,
                                const CheckpointOptions& options = {}) {
  auto& world = engine.comm();
  detail::arrive_together(world, options, "resume_from_latest");
  std::string listing;
  std::string ignored;
  if (world.rank() == 0) {
    for (const auto& [step, name] : ckpt::run_checkpoints(dir)) listing += name + "\n";
    if (const auto latest = ckpt::read_latest(dir)) {
      const auto latest_step = ckpt::step_of(*latest).value_or(-1);
      for (const auto& [step, name] : ckpt::list_checkpoints(dir))
        if (step > latest_step) ignored += name + "\n";
    }
  }
  listing = detail::broadcast_string(world, listing);
  ignored = detail::broadcast_string(world, ignored);
  ResumeResult result;
  for (std::size_t at = 0; at < ignored.size();) {
    const auto end = ignored.find('\n', at);
    result.skipped.push_back(ignored.substr(at, end - at) + ": newer than latest (from an abandoned run or an interrupted commit); not loaded");
    at = end + 1;
  }
  std::size_t start = 0;
  while (start < listing.size()) {
    const auto end = listing.find('\n', start);
    const std::string name = listing.substr(start, end - start);
    start = end + 1;
    const std::string path = (std::filesystem::path(dir) / name).string();
    try {
      load_checkpoint(engine, optimizer, path, state, options);
      result.path = path;
      return result;
    } catch (const CheckpointError& e) {
      // Unreadable (corrupt, truncated, incomplete): fall back to an older one. Readable but written by
      // another model, optimizer or plan: stop, the folder belongs to another run.
      if (e.id() == detail::kMismatchId)
        throw CheckpointError(
            detail::message_of(e) + ". The checkpoint folder '" + dir + "' holds another run: use another folder, or start fresh without resuming",
            detail::kMismatchId);
      result.skipped.push_back(name + ": " + detail::message_of(e));
    }
  }
  return result;
}

/// Mismatches between a file and a plain module.
struct StateDictReport {
  std::vector<std::string> missing;     ///< in the module, not in the file
  std::vector<std::string> unexpected;  ///< in the file, not in the module
  std::vector<std::string> mismatched;  ///< "name (file [..] dtype, module [..] dtype)"
  bool ok() const noexcept { return missing.empty() && unexpected.empty() && mismatched.empty(); }
};

/// Loads the parameters and buffers of a FULL or SHARDED checkpoint file into a plain module, in a
/// single process without MPI (the hfai summon_full_params use case). Strict: any missing,
/// unexpected or mismatched tensor throws a CheckpointError listing them all and changes nothing.
/// With strict=false, missing and unexpected tensors are returned in the report instead (shape or
/// dtype mismatches still throw).
inline StateDictReport load_full_state_dict(torch::nn::Module& module, const std::string& path, bool strict = true) {
  if (std::filesystem::is_directory(path))
    throw CheckpointError("'" + path + "' is a LOCAL_STATE_DICT checkpoint folder; merge it first with `fsdp-ckpt merge " + path + " OUT.h5`");
  h5::Id file = h5::open_file_readonly(path);
  const std::string where = "checkpoint '" + path + "'";
  if (h5::read_string_attribute(file, "format", where) != ckpt::kFormatName) throw CheckpointError(where + " is not an fsdp checkpoint");
  StateDictReport report;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> staged;  // destination, value
  std::set<std::string> names;
  auto take = [&](const std::string& name, const torch::Tensor& dst) {
    names.insert(name);
    const std::string p = detail::model_path(name);
    if (!h5::exists(file, p)) {
      report.missing.push_back(name);
      return;
    }
    h5::Id ds = h5::open_dataset(file, p, path);
    const auto shape = detail::logical_shape(ds);
    const auto stored = detail::tensor_element_type(ds, where + " " + p);
    const auto et = detail::element_type_of(dst.scalar_type());
    if (shape != dst.sizes().vec() || stored != et) {
      report.mismatched.push_back(name + " (file " + detail::shape_text(shape) + " " + h5::element_type_name(stored) + ", module " +
                                  detail::shape_text(dst.sizes().vec()) + " " + h5::element_type_name(et) + ")");
      return;
    }
    auto t = torch::empty(dst.sizes(), dst.options().requires_grad(false));
    h5::read_flat_range(ds, shape, 0, t.numel(), et, t.data_ptr(), where + " dataset " + p);
    staged.emplace_back(dst, t);
  };
  for (const auto& p : module.named_parameters(/*recurse=*/true)) take(p.key(), p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/true))
    if (b.value().defined()) take(b.key(), b.value());
  for (const auto& n : h5::list_names(file, "/model"))
    if (!names.count(n)) report.unexpected.push_back(n);
  const bool fail = !report.mismatched.empty() || (strict && !report.ok());
  if (fail) {
    std::vector<std::string> problems;
    for (const auto& n : report.missing) problems.push_back("missing " + n);
    for (const auto& n : report.unexpected) problems.push_back("unexpected " + n);
    for (const auto& n : report.mismatched) problems.push_back("mismatched " + n);
    throw CheckpointError(detail::mismatch_message(path, problems));
  }
  torch::NoGradGuard no_grad;
  for (auto& [dst, value] : staged) dst.copy_(value);
  return report;
}

}  // namespace fsdp
