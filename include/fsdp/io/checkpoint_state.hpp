// What a checkpoint holds and how it is laid out in the file (io layer, DCP's state_dict and metadata):
// tensor paths and element types, the pieces of a parameter inside a rank's flat shard, buffers, RNG
// rows, the train state and optimizer attributes, staged reads, and the agreement of all ranks on an
// error before anything changes.
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
#include "fsdp/core/text.hpp"
#include "fsdp/errors.hpp"
#include "fsdp/io/checkpoint_files.hpp"
#include "fsdp/io/checkpoint_options.hpp"
#include "fsdp/io/checkpoint_tools.hpp"
#include "fsdp/io/h5.hpp"
#include "fsdp/io/h5_flat_range.hpp"
#include "fsdp/torch/fully_sharded.hpp"
#include "fsdp/torch/optim_state.hpp"
#include "fsdp/torch/rng_state.hpp"
#include "fsdp/version.hpp"

namespace fsdp {

/// What a checkpoint is saved from: a live FullyShardedDataParallel, or a CheckpointSnapshot (its
/// host copy, written in the background). Both declare all of it; a save reads nothing else.
///  - comm(), shard_comm(), replica_comm(): the world and the groups the shards live on;
///  - world_size(), shard_group_size(), sharding_strategy(), plan_hash(): the root attributes;
///  - sharded_units(), tied_parameter_aliases(), gather_flat(unit, shard_like): the model's shards;
///  - checkpoint_buffers(), checkpoint_rng_state(): buffers in their own dtype and the generators;
///  - synchronize_shards(), synchronize_collectives() and kCollectivesMayBePending: what must be
///    brought in or settled before the state is read (nothing, for a snapshot).
template <class S>
concept CheckpointSource = requires(S& s, const S& cs, const torch::Tensor& t) {
  s.comm();
  s.shard_comm();
  s.replica_comm();
  { cs.world_size() } -> std::convertible_to<int>;
  { cs.shard_group_size() } -> std::convertible_to<int>;
  { cs.sharding_strategy() } -> std::same_as<ShardingStrategy>;
  { cs.plan_hash() } -> std::convertible_to<std::uint64_t>;
  { cs.sharded_units() } -> std::convertible_to<std::vector<ShardedUnit>>;
  cs.tied_parameter_aliases();
  { s.gather_flat(0, t) } -> std::convertible_to<torch::Tensor>;
  { cs.checkpoint_buffers() } -> std::convertible_to<std::vector<std::pair<std::string, torch::Tensor>>>;
  { cs.checkpoint_rng_state() } -> std::convertible_to<detail::RngState>;
  s.synchronize_shards();
  s.synchronize_collectives();
  { S::kCollectivesMayBePending } -> std::convertible_to<bool>;
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

// ---- per-rank rows -----------------------------------------------------------------------------
// State that differs between ranks is stored as one (world x bytes) uint8 dataset per item, row r
// written by rank r: the generators (/rng/cpu, and /rng/cuda for a GPU computation) and buffers that
// differ between ranks (/rank_local/<buffer>). A load at the saving world size gives each rank its
// row back; at another world size the rows are not used.

/// One rank's row of a per-rank dataset: a 1-D contiguous uint8 host tensor.
struct RankRow {
  std::string dataset;
  torch::Tensor bytes;
};

using ckpt::kRankLocalGroup;
inline std::string rank_local_path(const std::string& buffer) { return std::string(kRankLocalGroup) + "/" + buffer; }
/// The dataset of a device kind's generator: /rng/cpu, /rng/cuda.
inline std::string rng_path(c10::DeviceType type) { return "/rng/" + c10::DeviceTypeName(type, /*lower_case=*/true); }

/// The rows of a captured RNG state: the CPU generator's and, for a GPU computation, its device's.
inline std::vector<RankRow> rng_rows(const RngState& state) {
  std::vector<RankRow> rows{{rng_path(c10::DeviceType::CPU), state.cpu.contiguous()}};
  if (state.device.defined()) rows.push_back({rng_path(state.device_of.type()), state.device.contiguous()});
  return rows;
}

/// The RNG state a save writes: the one a snapshot captured with the model, a live engine's generators now.
template <class Source>
RngState saved_rng_state(Source& source) {
  return source.checkpoint_rng_state();
}

/// Puts back the generators whose rows `rows` holds: the CPU's, and `compute`'s when it is a GPU and
/// its kind's row is there. Returns {CPU restored, device restored}.
inline std::pair<bool, bool> restore_rng_rows(const std::map<std::string, torch::Tensor>& rows, const c10::Device& compute) {
  std::pair<bool, bool> restored{false, false};
  if (const auto it = rows.find(rng_path(c10::DeviceType::CPU)); it != rows.end()) {
    set_generator_state(at::detail::getDefaultCPUGenerator(), it->second);
    restored.first = true;
  }
  if (compute.is_cpu()) return restored;
  if (const auto it = rows.find(rng_path(compute.type())); it != rows.end()) {
    set_generator_state(default_generator(compute), it->second);
    restored.second = true;
  }
  return restored;
}

/// A buffer's bytes as a row (a host copy; the values are read back by copying the row into a buffer
/// of the same dtype and shape).
inline torch::Tensor bytes_of(const torch::Tensor& t) {
  const auto host = t.detach().to(torch::kCPU).contiguous();
  return host.view({-1}).view(torch::kUInt8).clone();
}

/// The buffers whose values differ between the ranks of `comm` (BufferSync::NONE keeps each rank's
/// own), as rows. Collective; every rank gets the same list of datasets.
template <Communicator Comm>
std::vector<RankRow> rank_local_buffer_rows(Comm& comm, const std::vector<std::pair<std::string, torch::Tensor>>& buffers) {
  std::vector<RankRow> rows;
  if (comm.size() == 1 || buffers.empty()) return rows;
  const auto n = static_cast<std::int64_t>(buffers.size());
  std::vector<torch::Tensor> bytes;
  std::vector<std::int64_t> high(static_cast<std::size_t>(2 * n));  // max of the hash, then max of its negation
  agree(comm, capture_error([&] {                                   // a failed copy on one rank: every rank stops here, none waits below
          for (std::int64_t i = 0; i < n; ++i) {
            bytes.push_back(bytes_of(buffers[static_cast<std::size_t>(i)].second));
            const auto& b = bytes.back();
            const auto hash = static_cast<std::int64_t>(
                fnv1a64(std::string_view(static_cast<const char*>(b.data_ptr()), static_cast<std::size_t>(b.numel()))) >> 1);
            high[static_cast<std::size_t>(i)] = hash;
            high[static_cast<std::size_t>(n + i)] = -hash;
          }
        }));
  comm.all_reduce(high.data(), high.data(), 2 * n, DType::kInt64, ReduceOp::kMax);
  for (std::int64_t i = 0; i < n; ++i)
    if (high[static_cast<std::size_t>(i)] != -high[static_cast<std::size_t>(n + i)])
      rows.push_back({rank_local_path(buffers[static_cast<std::size_t>(i)].first), bytes[static_cast<std::size_t>(i)]});
  return rows;
}

// Shared with the offline tools: "[2, 3]" and the logical shape of a stored tensor (0-d tensors are
// stored with dims {1} and attribute scalar=1).
using ckpt::shape_text;
using ckpt::detail::logical_shape;

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
    problems.push_back(ds_path + " (file " + shape_text(shape) + " " + h5::element_type_name(stored) + ", expected " +
                       shape_text(like.sizes().vec()) + " " + h5::element_type_name(wanted) + ")");
    return {};
  }
  auto t = torch::empty(like.sizes(), like.options().device(torch::kCPU).requires_grad(false));  // staged on the host
  h5::read_flat_range(ds, shape, 0, t.numel(), wanted, t.data_ptr(), "checkpoint '" + path + "' dataset " + ds_path);
  return t;
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
  /// This rank's rows of the per-rank datasets (/rng/..., /rank_local/...), by dataset; only those
  /// stored for this world size.
  std::map<std::string, torch::Tensor> rows;
};

/// Replaces each staged buffer that has a row in `meta` by this rank's saved copy. Checks the size.
inline void use_rank_local_buffers(const std::vector<std::pair<std::string, torch::Tensor>>& named, std::vector<torch::Tensor>& staged,
                                   const StagedMeta& meta, const std::string& path) {
  for (std::size_t i = 0; i < named.size() && i < staged.size(); ++i) {
    const auto it = meta.rows.find(rank_local_path(named[i].first));
    if (it == meta.rows.end() || !staged[i].defined()) continue;
    auto& t = staged[i];
    const auto want = t.numel() * static_cast<std::int64_t>(t.element_size());
    if (it->second.numel() != want)
      throw CheckpointError("checkpoint '" + path + "' dataset " + it->first + " holds " + std::to_string(it->second.numel()) +
                                " bytes per rank; buffer " + named[i].first + " has " + std::to_string(want),
                            kMismatchId);
    if (want > 0) t.copy_(it->second.view(t.scalar_type()).view(t.sizes()));  // the row's bytes are the buffer's
  }
}

/// The module's buffers by name, as checkpoints hold them: in their own dtype (before mixed
/// precision's buffer_dtype): a live engine's, or a snapshot's copies. Loading copies the value back
/// into the live buffer.
template <class Source>
std::vector<std::pair<std::string, torch::Tensor>> named_buffers_of(Source& source) {
  return source.checkpoint_buffers();
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
  if (state.data.empty()) return;
  h5::Id data = h5::require_group(file, "/train/data");
  for (const auto& [k, v] : state.data) h5::write_attribute(data, k, v);
}

inline void write_optimizer_attributes(hid_t file, const torch::optim::Optimizer& opt) {
  h5::Id g = h5::require_group(file, "/optim");
  h5::write_attribute(g, "kind", optimizer_kind(opt));
  std::vector<double> lrs;
  for (const auto& group : opt.param_groups()) lrs.push_back(group.options().get_lr());
  h5::write_attribute(g, "lr", lrs);
}

/// The optimizer state of a unit as the optimizer holds it (shaped like `optimized`), if it has any. Local.
inline std::optional<OptimizerStateView> unit_optimizer_state(const torch::optim::Optimizer* opt, const ShardedUnit& u) {
  const torch::Tensor& key = u.optimized.defined() ? u.optimized : u.shard;
  if (!opt || !key.defined()) return std::nullopt;
  const auto it = opt->state().find(optimizer_state_key(key));
  if (it == opt->state().end()) return std::nullopt;
  return optimizer_state_view(*it->second);
}

/// The optimizer state of a unit shaped like its shard, as checkpoints store it: with the optimizer
/// sharded over the replicas their parts all-gathered (collective over the engine's replica group,
/// every rank alike), otherwise as the optimizer holds it.
template <class Engine>
std::optional<OptimizerStateView> shard_optimizer_state(Engine& engine, const torch::optim::Optimizer* opt, const ShardedUnit& u) {
  auto view = unit_optimizer_state(opt, u);
  if (!view || !u.optimizer_sharded_over_replicas()) return view;
  for (auto& [name, t] : view->tensors) {
    auto room = torch::empty({t.numel() * u.replicas}, t.options());
    all_gather_parts(engine.replica_comm(), t, room);
    t = room.narrow(0, 0, u.layout.shard_numel());
  }
  return view;
}

/// The engine's shards made current before they are read for a checkpoint or an export (the optimizer
/// may have updated replica parts of them, see FullyShardedDataParallel::synchronize_shards). Collective.
template <class Source>
void synchronize_shards_of(Source& source) {
  source.synchronize_shards();
}

/// Whether the source's collectives can be pending when it returns (a GPU communicator's are
/// stream-ordered), so that they must be settled before the state is read.
template <class Source>
constexpr bool collectives_may_be_pending() {
  return Source::kCollectivesMayBePending;
}

/// The source's collectives settled (a failed one throws) before the state is read, so that a
/// checkpoint never holds what an aborted collective left (FullyShardedDataParallel::synchronize_collectives). Local.
template <class Source>
void synchronize_collectives_of(Source& source) {
  if constexpr (collectives_may_be_pending<Source>()) source.synchronize_collectives();
}

/// The MPI communicator over the same ranks as `comm` (itself, or a GPU communicator's bootstrap).
template <class Comm>
MpiComm mpi_of(Comm& comm) {
  if constexpr (std::same_as<std::remove_cvref_t<Comm>, MpiComm>)
    return comm;
  else
    return comm.mpi();
}

/// The shards made current (synchronize_shards_of) and the engine's collectives settled before the
/// state is read. With collectives that may be pending, both run on every rank and a failure on one
/// (its GPU communicator aborted: it throws at once, its peers at their deadline) fails every rank with
/// its message, agreed over MPI (that communicator is unusable). Collective.
template <class Engine>
void settle_shards_of(Engine& engine) {
  if constexpr (collectives_may_be_pending<Engine>()) {
    const auto error = capture_error([&] {
      synchronize_shards_of(engine);
      engine.synchronize_collectives();
    });
    MpiComm mpi = mpi_of(engine.comm());
    agree(mpi, error);
  } else {
    synchronize_shards_of(engine);
  }
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

/// Writes per-rank dataset `dataset` (world x n). In parallel, `rows` is this rank's row (n bytes) and
/// goes to row `my_row`; serially it is every rank's (world x n).
inline void write_rank_rows(hid_t file, const std::string& dataset, const torch::Tensor& rows, std::int64_t world, int my_row, bool parallel,
                            hid_t dxpl) {
  const std::int64_t n = rows.size(-1);
  if (parallel)
    ckpt::detail::write_rank_rows_bytes(file, dataset, world, n, my_row, 1, rows.data_ptr(), dxpl);
  else
    ckpt::detail::write_rank_rows_bytes(file, dataset, world, n, 0, world, rows.data_ptr(), H5P_DEFAULT);
}

/// Every rank's `row` as a (world x n) uint8 tensor. Collective.
template <Communicator Comm>
torch::Tensor gather_rank_rows(Comm& comm, const RankRow& row) {
  auto mine = row.bytes.contiguous();
  std::int64_t n = mine.numel(), max_n = n;
  comm.all_reduce(&max_n, &max_n, 1, DType::kInt64, ReduceOp::kMax);
  if (max_n != n) throw CheckpointError(row.dataset + ": the ranks' sizes differ");
  auto all = torch::empty({comm.size(), n}, torch::kUInt8);
  comm.all_gather(mine.data_ptr(), all.data_ptr(), n, DType::kUInt8);
  return all;
}

/// The per-rank datasets of a file (/rng/..., /rank_local/...).
inline std::vector<std::string> rank_row_datasets(hid_t file) {
  std::vector<std::string> out;
  for (const std::string group : {"/rng", kRankLocalGroup})
    if (h5::exists(file, group))
      for (const auto& name : h5::list_names(file, group)) out.push_back(group + "/" + name);
  return out;
}

/// Row `row` of every per-rank dataset with `rows_expected` rows (the others were saved at another world size).
inline std::map<std::string, torch::Tensor> read_rank_rows(hid_t file, const std::string& path, std::int64_t row, std::int64_t rows_expected) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& dataset : rank_row_datasets(file)) {
    h5::Id ds = h5::open_dataset(file, dataset, path);
    const auto dims = h5::dataset_dims(ds);
    if (dims.size() != 2 || dims[0] != rows_expected || row < 0 || row >= rows_expected) continue;
    auto t = torch::empty({dims[1]}, torch::kUInt8);
    h5::read_flat_range(ds, dims, row * dims[1], (row + 1) * dims[1], h5::ElementType::kUInt8, t.data_ptr(),
                        "checkpoint '" + path + "' dataset " + dataset);
    out.emplace(dataset, std::move(t));
  }
  return out;
}

/// Train state, optimizer kind and learning rates, and row `row` of the file's per-rank datasets.
inline StagedMeta read_meta(hid_t file, const std::string& path, int row, std::int64_t rows_expected) {
  StagedMeta m;
  const std::string where = "checkpoint '" + path + "'";
  h5::Id train = h5::open_group(file, "/train", path);
  m.train.step = h5::read_int_attribute(train, "step", where + " /train");
  // The root's step names the checkpoint (listings, fsdp-ckpt inspect); /train's is the one resumed.
  if (const auto named = h5::read_int_attribute(file, "step", where); named != m.train.step)
    throw CheckpointError(where + ": its step attribute is " + std::to_string(named) + " and /train's step " + std::to_string(m.train.step) +
                          ": one of them was changed after the save");
  m.train.epoch = h5::read_int_attribute(train, "epoch", where + " /train");
  m.train.sample_index = h5::read_int_attribute(train, "sample_index", where + " /train");
  h5::Id sched = h5::open_group(file, "/train/scheduler", path);
  for (const auto& k : h5::list_attribute_names(sched)) m.train.scheduler[k] = h5::read_double_attribute(sched, k, where + " /train/scheduler");
  if (h5::exists(file, "/train/data")) {
    h5::Id data = h5::open_group(file, "/train/data", path);
    for (const auto& k : h5::list_attribute_names(data)) m.train.data[k] = h5::read_int_attribute(data, k, where + " /train/data");
  }
  m.train.deck = h5::read_string_attribute(file, "deck", where);
  if (h5::exists(file, "/optim")) {
    h5::Id g = h5::open_group(file, "/optim", path);
    m.optimizer_kind = h5::read_string_attribute(g, "kind", where + " /optim");
    m.lrs = h5::read_double_array_attribute(g, "lr", where + " /optim");
  }
  if (row >= 0) m.rows = read_rank_rows(file, path, row, rows_expected);
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
  p.i64(static_cast<std::int64_t>(m.train.data.size()));
  for (const auto& [k, v] : m.train.data) {
    p.str(k);
    p.i64(v);
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
  for (std::int64_t n = u.i64(); n > 0; --n) {
    std::string k = u.str();
    m.train.data[k] = u.i64();
  }
  m.train.deck = u.str();
  m.optimizer_kind = u.str();
  for (std::int64_t n = u.i64(); n > 0; --n) m.lrs.push_back(u.f64());
  return m;
}

template <Communicator Comm>
void arrive_together(Comm& comm, const CheckpointOptions& options, const char* what) {
  if constexpr (requires { comm.barrier_within(1.0, std::string()); })
    comm.barrier_within(options.collective_timeout_s, what);
  else
    comm.barrier();
}

/// What does not match between a file and the model, one problem a line (at most 20 named).
/// `source` says what was read: a checkpoint's path, or a description such as "safetensors file '...'".
inline std::string mismatch_message(const std::string& source, const std::vector<std::string>& problems) {
  std::string m = source + " does not match the model:";
  for (std::size_t i = 0; i < problems.size() && i < 20; ++i) m += "\n  " + problems[i];
  if (problems.size() > 20) m += "\n  ... and " + std::to_string(problems.size() - 20) + " more";
  return m;
}
inline std::string checkpoint_mismatch_message(const std::string& path, const std::vector<std::string>& problems) {
  return mismatch_message("checkpoint '" + path + "'", problems);
}

}  // namespace detail

}  // namespace fsdp
