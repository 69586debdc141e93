// Saving a checkpoint (io layer): SHARDED (every rank writes its own boxes of each tensor into one
// file), FULL (rank 0 writes, one unit gathered at a time) and LOCAL (each rank's raw flat shard),
// each under a temporary name, claimed on disk first, fsynced, renamed and pointed at by `latest`.
#pragma once

#include "fsdp/io/checkpoint_state.hpp"
#include "fsdp/io/checkpoint_tools.hpp"
#include "fsdp/file_tree.hpp"

namespace fsdp {

namespace detail {

// ---- save -------------------------------------------------------------------------------------

/// SHARDED: every HDF5 call is collective, so every step is agreed between the ranks: a failure on
/// one rank (disk full on its MPI-IO aggregator, memory) stops all of them at the same call, where
/// they unwind and close the file together instead of waiting in the next collective.
template <class Engine>
std::int64_t write_sharded_file(Engine& engine, const torch::optim::Optimizer* opt, const std::string& path, const TrainState& state,
                                const CheckpointOptions& options, const std::string& created, const std::vector<RankRow>& rows) {
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
        // Only the writer writes its piece; every rank takes part in the collective write.
        const ParamSlice p = writer ? u.layout.slice_in(static_cast<std::int64_t>(i), {lo, hi}) : ParamSlice{};
        const char* data = static_cast<const char*>(src.data_ptr()) + p.shard_offset * static_cast<std::int64_t>(src.element_size());
        h5::write_flat_range(ds, t.shape, p.param_offset, p.param_offset + p.numel, et, data, dxpl, t.path);
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
      const auto view = shard_optimizer_state(engine, opt, up);  // present on every rank alike (checked on entry)
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
    for (const auto& r : rows) write_rank_rows(file, r.dataset, r.bytes, world.size(), world.rank(), true, dxpl);
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
                     const CheckpointOptions& options, const std::string& created, const std::string& deck, const std::vector<RankRow>& rows) {
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
      const auto view = shard_optimizer_state(engine, opt, up);
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
  std::vector<torch::Tensor> every_rank;
  for (const auto& r : rows) every_rank.push_back(gather_rank_rows(world, r));
  on_writer([&] {
    write_train_group(file, state);
    for (std::size_t i = 0; i < rows.size(); ++i) write_rank_rows(file, rows[i].dataset, every_rank[i], world.size(), 0, false, H5P_DEFAULT);
    h5::write_attribute(file, "num_tensors", tensors);
    file.close("cannot close (flush) '" + path + "'");
  });
  agree(world, error);
}

/// LOCAL: each rank writes its own file. Returns this rank's first error; a rank that failed still takes
/// part in the replica gathers of optimizer state sharded over the world, so no rank waits for it.
template <class Engine>
std::optional<std::string> write_local_file(Engine& engine, const torch::optim::Optimizer* opt, const std::string& path, const TrainState& state,
                                            const CheckpointOptions& options, const std::string& created, const std::string& deck,
                                            const std::vector<RankRow>& rows) {
  std::optional<std::string> error;
  auto mine = [&](auto&& f) {
    if (!error) error = capture_error(f);
  };
  h5::Id file;
  mine([&] {
    file = h5::create_file(path);
    write_root_attributes(file, engine, StateDictType::LOCAL_STATE_DICT, state, created, deck);
    h5::write_attribute(file, "rank", engine.rank());
    h5::write_attribute(file, "shard_rank", engine.shard_comm().rank());
    h5::write_attribute(file, "replica_rank", engine.replica_comm().rank());
    std::vector<std::string> aliases;
    for (const auto& [name, others] : engine.tied_parameter_aliases())
      for (const auto& alias : others) aliases.push_back(alias + "=" + name);
    h5::write_attribute(file, "aliases", aliases);
  });
  std::int64_t tensors = 0;
  auto write_flat = [&](const std::string& p, const torch::Tensor& t) {
    const auto src = t.detach().to(torch::kCPU).contiguous();
    const auto et = element_type_of(src.scalar_type());
    h5::Id ds = h5::create_dataset(file, p, et, {src.numel()});
    h5::write_flat_range(ds, {src.numel()}, 0, src.numel(), et, src.data_ptr(), H5P_DEFAULT, p);
    ++tensors;
  };
  for (const auto& u : engine.sharded_units()) {
    const std::string base = "/units/" + std::to_string(u.index);
    mine([&] {
      h5::Id g = h5::require_group(file, base);
      h5::write_attribute(g, "module_path", u.module_path);
      h5::write_attribute(g, "param_names", u.param_names);
      std::vector<std::int64_t> ndims, dims;
      for (const auto& shape : u.shapes) {
        ndims.push_back(static_cast<std::int64_t>(shape.size()));
        dims.insert(dims.end(), shape.begin(), shape.end());
      }
      h5::write_attribute(g, "param_ndims", ndims);
      h5::write_attribute(g, "param_dims", dims);
      h5::write_attribute(g, "numel", u.layout.numel());
      h5::write_attribute(g, "padded_numel", u.layout.padded_numel());
      h5::write_attribute(g, "shard_numel", u.layout.shard_numel());
    });
    if (u.param_names.empty()) continue;
    mine([&] { write_flat(base + "/flat", u.shard); });
    if (const auto view = shard_optimizer_state(engine, opt, u)) {  // present on every rank alike (checked on entry)
      mine([&] {
        for (const auto& [name, t] : view->tensors) write_flat(base + "/optim/" + name, t);
        h5::Id og = h5::require_group(file, base + "/optim");
        h5::write_attribute(og, "step", view->step);
      });
    }
  }
  mine([&] {
    if (options.on_stage) options.on_stage("writing", state.step);
    for (const auto& [name, buffer] : named_buffers_of(engine)) {
      write_buffer(file, name, buffer, true, H5P_DEFAULT);
      ++tensors;
    }
    if (opt) write_optimizer_attributes(file, *opt);
    write_train_group(file, state);
    for (const auto& r : rows) write_rank_rows(file, r.dataset, r.bytes.view({1, -1}), 1, 0, false, H5P_DEFAULT);
    h5::write_attribute(file, "num_tensors", tensors);
    file.close("cannot close (flush) '" + path + "'");
  });
  return error;
}

/// Every rank enters a collective checkpoint call, or the ones that did fail after the deadline.

inline std::int64_t size_on_disk(const std::filesystem::path& p) { return static_cast<std::int64_t>(tree_size_bytes(p)); }

}  // namespace detail

namespace detail {

/// What every rank must agree on before a save makes its first collective HDF5 call: the train state
/// (taken from rank 0), which units have optimizer state and its names, and the RNG rows' sizes.
template <class Engine>
void check_ranks_agree(Engine& engine, const torch::optim::Optimizer* opt, const CheckpointOptions& options, const std::vector<RankRow>& rng) {
  auto& world = engine.comm();
  std::ostringstream os;
  os << to_string(options.state_dict_type) << ";";
  for (const auto& r : rng) os << r.dataset << "=" << r.bytes.numel() << ";";
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

/// The per-rank rows a save writes: the generators' states and, in a file shared by the ranks, the
/// buffers that differ between them. Collective.
template <class Engine>
std::vector<RankRow> rows_to_save(Engine& engine, const CheckpointOptions& options, std::vector<RankRow> rng) {
  if (options.state_dict_type == StateDictType::LOCAL_STATE_DICT) return rng;  // each rank's file holds its own buffers
  for (auto& r : rank_local_buffer_rows(engine.comm(), named_buffers_of(engine))) rng.push_back(std::move(r));
  return rng;
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
/// An upper estimate of a FULL/SHARDED checkpoint file's size, or with `local` of this rank's LOCAL
/// file (its shards, one dataset per unit): every tensor once plus HDF5's object headers, chunk
/// indexes and checksums (under 4 KiB per dataset here) and a spare 64 KiB.
template <class Engine>
std::int64_t expected_file_bytes(Engine& engine, const torch::optim::Optimizer* opt, int world_size, const std::vector<RankRow>& rows,
                                 bool local = false) {
  std::int64_t bytes = 0, datasets = 0;
  for (const auto& up : engine.sharded_units()) {
    if (up.param_names.empty()) continue;
    const auto numel = local ? up.layout.shard_numel() : up.layout.numel();
    const auto count = local ? 1 : static_cast<std::int64_t>(up.param_names.size());
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
  for (const auto& r : rows) {
    bytes += (local ? 1 : world_size) * r.bytes.numel();
    ++datasets;
  }
  return bytes + datasets * 4096 + 65536;
}
}  // namespace detail

template <CheckpointSource Engine>
SaveResult save_checkpoint(Engine& engine, const torch::optim::Optimizer* optimizer, const std::string& dir, const TrainState& state,
                           const CheckpointOptions& options = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  auto& world = engine.comm();
  detail::arrive_together(world, options, "save_checkpoint");
  const TrainState written = detail::broadcast_train_state(world, state);
  auto rng = options.save_rng_state ? detail::rng_rows(detail::saved_rng_state(engine)) : std::vector<detail::RankRow>{};
  detail::check_ranks_agree(engine, optimizer, options, rng);
  detail::settle_shards_of(engine);
  const auto rows = detail::rows_to_save(engine, options, std::move(rng));
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
      fsdp::remove_tree(tmp, ec);  // left over by a save that crashed
      if (!local) ckpt::reserve_space(tmp, detail::expected_file_bytes(engine, optimizer, world.size(), rows), (folder / name).string());
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
      fsdp::remove_tree(path, ignored);
    }
  } cleanup{tmp, world.rank() == 0};
  const std::string created = broadcast_string(world, ckpt::utc_now());
  switch (options.state_dict_type) {
    case StateDictType::SHARDED_STATE_DICT: detail::write_sharded_file(engine, optimizer, tmp.string(), written, options, created, rows); break;
    case StateDictType::FULL_STATE_DICT:
      detail::write_full_file(engine, optimizer, tmp.string(), written, options, created, written.deck, rows);
      break;
    case StateDictType::LOCAL_STATE_DICT: {
      const auto file = tmp / ckpt::local_rank_file(world.rank());
      // Each rank checks its file's space first, as a FULL or SHARDED save does: HDF5 that fails to
      // flush at close cannot shut down cleanly at the process's exit (the space is not held after).
      error = detail::capture_error(
          [&] { ckpt::reserve_space(file, detail::expected_file_bytes(engine, optimizer, world.size(), rows, true), (folder / name).string()); });
      detail::agree(world, error);
      error = detail::write_local_file(engine, optimizer, file.string(), written, options, created, written.deck, rows);
      if (!error) error = detail::capture_error([&] { ckpt::fsync_path(file); });
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
        result.pruned = ckpt::prune(folder, options.keep_last, [](const std::filesystem::path& p) { return ckpt::verify(p.string()).ok(); });
      } catch (const std::exception& e) {
        result.warnings.push_back(message_without_id(e));
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

}  // namespace fsdp
