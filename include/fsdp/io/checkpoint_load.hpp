// Loading and resuming (io layer): every rank reads its own parts (or rank 0 reads and broadcasts),
// all ranks agree that every read succeeded, and only then the model, optimizer and train state
// change; resume_from_latest() falls back past unreadable checkpoints.
#pragma once

#include <algorithm>

#include "fsdp/io/checkpoint_state.hpp"

namespace fsdp {

namespace detail {

// ---- load -------------------------------------------------------------------------------------

/// The dtype optimizer state dataset `ds_path` was stored in: a floating type as it is (bf16 moments
/// load into fp32 ones and back), anything else as `param_dtype` (so that the read reports it).
inline c10::ScalarType optimizer_state_dtype_stored(hid_t file, const std::string& path, const std::string& ds_path, c10::ScalarType param_dtype) {
  h5::Id ds = h5::open_dataset(file, ds_path, path);
  switch (tensor_element_type(ds, path + ":" + ds_path)) {
    case h5::ElementType::kFloat32: return c10::ScalarType::Float;
    case h5::ElementType::kFloat64: return c10::ScalarType::Double;
    case h5::ElementType::kFloat16: return c10::ScalarType::Half;
    case h5::ElementType::kBFloat16: return c10::ScalarType::BFloat16;
    default: return param_dtype;
  }
}

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
    if (shape != u.shapes[i] || stored != element_type_of(dst.scalar_type())) {
      problems.push_back(ds_path + " (file " + shape_text(shape) + " " + h5::element_type_name(stored) + ", expected " + shape_text(u.shapes[i]) +
                         " " + h5::element_type_name(element_type_of(dst.scalar_type())) + ")");
      return;
    }
    const ParamSlice p = u.layout.slice_in(static_cast<std::int64_t>(i), {lo, hi});
    char* out = static_cast<char*>(dst.data_ptr()) + p.shard_offset * static_cast<std::int64_t>(dst.element_size());
    h5::read_flat_range(ds, u.shapes[i], p.param_offset, p.param_offset + p.numel, stored, out, "checkpoint '" + path + "' dataset " + ds_path);
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
  // The unit's state names are those of any of its parameters: every parameter must have each (one
  // whose group is missing is named below), and none at all means saved before the unit had state.
  std::vector<std::string> names;
  std::string stored_at;  // a parameter's group that holds state
  for (const auto& n : u.param_names) {
    const std::string g = optim_path(n);
    if (!h5::exists(file, g)) continue;
    if (stored_at.empty()) stored_at = g;
    for (auto& name : h5::list_names(file, g))
      if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(std::move(name));
  }
  if (stored_at.empty()) return s;
  s.has_optim = true;
  h5::Id g = h5::open_group(file, stored_at, path);
  s.optim_step = h5::read_int_attribute(g, "step", "checkpoint '" + path + "' group " + stored_at);
  for (const auto& name : names) {
    // Optimizer state is read in the dtype it was stored in (bf16 moments, or the parameters'); the
    // load converts it to the optimizer's.
    std::string first_state;
    for (const auto& n : u.param_names)
      if (first_state.empty() && h5::exists(file, optim_path(n) + "/" + name)) first_state = optim_path(n) + "/" + name;
    const auto state_dtype = optimizer_state_dtype_stored(file, path, first_state, dtype);
    auto t = torch::zeros({hi - lo}, torch::TensorOptions().dtype(state_dtype));
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
  // A tensor or group deleted by hand: damage (a resume falls back), as fsdp-ckpt verify reports it.
  if (const auto missing = ckpt::missing_tensors(file, path)) throw CheckpointError(*missing);
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
  std::string local_save;  // LOCAL: the save this rank's file comes from (ckpt::local_save_of)
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
  if (!problems.empty()) throw CheckpointError(checkpoint_mismatch_message(path, problems), kMismatchId);
  const auto world = h5::read_int_attribute(file, "world_size", "checkpoint '" + path + "'");
  s.meta = read_meta(file, path, engine.rank(), world == engine.world_size() ? world : -1);
  use_rank_local_buffers(named_buffers_of(engine), s.buffers, s.meta, path);
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
      if (!unexpected.empty()) throw CheckpointError(checkpoint_mismatch_message(path, unexpected), kMismatchId);
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
        if (!problems.empty()) throw CheckpointError(checkpoint_mismatch_message(path, problems), kMismatchId);
      });
    }
    agree(world, error);
    Packer names;
    names.i64(full.has_optim ? 1 : 0);
    names.i64(full.optim_step);
    names.i64(static_cast<std::int64_t>(full.optim.size()));
    for (const auto& [n, t] : full.optim) {
      names.str(n);
      names.i64(static_cast<std::int64_t>(t.scalar_type()));
    }
    const std::string header = broadcast_string(world, names.bytes);
    Unpacker un{header};
    StagedUnit mine;
    mine.has_optim = un.i64() != 0;
    mine.optim_step = un.i64();
    const auto n_states = un.i64();
    const auto dtype = u.dtype;
    auto share = [&](torch::Tensor t, c10::ScalarType t_dtype) {
      if (!t.defined()) t = torch::empty({u.layout.padded_numel()}, torch::TensorOptions().dtype(t_dtype));
      world.broadcast(t.data_ptr(), t.numel(), to_comm_dtype(t.scalar_type()), 0);
      return t.narrow(0, u.own_range().begin, u.own_range().numel()).clone();
    };
    mine.flat = share(full.flat, dtype);
    for (std::int64_t k = 0; k < n_states; ++k) {
      const std::string name = un.str();
      const auto state_dtype = static_cast<c10::ScalarType>(un.i64());
      mine.optim.emplace_back(name, share(reader ? full.optim[static_cast<std::size_t>(k)].second : torch::Tensor(), state_dtype));
    }
    s.units.push_back(std::move(mine));
  }
  for (const auto& [name, b] : named_buffers_of(engine)) {
    auto t = torch::empty(b.sizes(), b.options());
    if (reader) {
      error = capture_error([&] {
        std::vector<std::string> buffer_problems;
        auto value = read_buffer(file, path, model_path(name), b, buffer_problems);
        if (!buffer_problems.empty()) throw CheckpointError(checkpoint_mismatch_message(path, buffer_problems), kMismatchId);
        t.copy_(value);
      });
    }
    agree(world, error);
    if (t.numel() > 0) world.broadcast(t.data_ptr(), t.numel(), to_comm_dtype(t.scalar_type()), 0);
    s.buffers.push_back(t);
  }
  // Per-rank rows: rank 0 reads every row of those saved at this world size and broadcasts them.
  std::vector<std::pair<std::string, torch::Tensor>> every_rank;
  if (reader) {
    error = capture_error([&] {
      for (const auto& dataset : rank_row_datasets(file)) {
        h5::Id ds = h5::open_dataset(file, dataset, path);
        const auto dims = h5::dataset_dims(ds);
        if (dims.size() != 2 || dims[0] != world.size()) continue;
        auto all = torch::empty({dims[0], dims[1]}, torch::kUInt8);
        h5::read_flat_range(ds, dims, 0, all.numel(), h5::ElementType::kUInt8, all.data_ptr(), "checkpoint '" + path + "' dataset " + dataset);
        every_rank.emplace_back(dataset, std::move(all));
      }
    });
  }
  agree(world, error);
  Packer index;
  for (const auto& [dataset, all] : every_rank) {
    index.str(dataset);
    index.i64(all.size(1));
  }
  const std::string shared = broadcast_string(world, index.bytes);
  Unpacker un{shared};
  for (std::size_t k = 0; un.pos < shared.size(); ++k) {
    const std::string dataset = un.str();
    const auto n = un.i64();
    auto all = reader ? every_rank[k].second : torch::empty({world.size(), n}, torch::kUInt8);
    if (all.numel() > 0) world.broadcast(all.data_ptr(), all.numel(), DType::kUInt8, 0);
    s.meta.rows.emplace(dataset, all[world.rank()].clone());
  }
  use_rank_local_buffers(named_buffers_of(engine), s.buffers, s.meta, path);
  return s;
}

template <class Engine>
Staged read_local_file(Engine& engine, const torch::optim::Optimizer* opt, const std::string& dir) {
  Staged s;
  const std::string path = (std::filesystem::path(dir) / ckpt::local_rank_file(engine.rank())).string();
  h5::Id file = h5::open_file_readonly(path);
  check_root(file, path, engine, StateDictType::LOCAL_STATE_DICT);
  s.local_save = ckpt::local_save_of(file, path);
  for (const auto& up : engine.sharded_units()) {
    const auto& u = up;
    StagedUnit su;
    if (u.param_names.empty()) {
      s.units.push_back(su);
      continue;
    }
    const std::string base = "/units/" + std::to_string(u.index);
    const auto dtype = u.dtype;
    auto read_flat = [&](const std::string& p, c10::ScalarType t_dtype) {
      h5::Id ds = h5::open_dataset(file, p, path);
      const auto dims = h5::dataset_dims(ds);
      if (dims != std::vector<std::int64_t>{u.layout.shard_numel()})
        throw CheckpointError("checkpoint '" + path + "' dataset " + p + " has " + shape_text(dims) + " elements, expected [" +
                              std::to_string(u.layout.shard_numel()) + "]");
      auto t = torch::empty({u.layout.shard_numel()}, torch::TensorOptions().dtype(t_dtype));
      h5::read_flat_range(ds, dims, 0, t.numel(), element_type_of(t_dtype), t.data_ptr(), "checkpoint '" + path + "' dataset " + p);
      return t;
    };
    su.flat = read_flat(base + "/flat", dtype);
    if (opt && h5::exists(file, base + "/optim")) {
      su.has_optim = true;
      h5::Id og = h5::open_group(file, base + "/optim", path);
      su.optim_step = h5::read_int_attribute(og, "step", "checkpoint '" + path + "' group " + base + "/optim");
      for (const auto& name : h5::list_names(file, base + "/optim")) {
        const std::string p = base + "/optim/" + name;
        su.optim.emplace_back(name, read_flat(p, optimizer_state_dtype_stored(file, path, p, dtype)));
      }
    }
    s.units.push_back(std::move(su));
  }
  std::vector<std::string> problems;
  for (const auto& [name, b] : named_buffers_of(engine)) s.buffers.push_back(read_buffer(file, path, model_path(name), b, problems));
  if (!problems.empty()) throw CheckpointError(checkpoint_mismatch_message(path, problems), kMismatchId);
  s.meta = read_meta(file, path, 0, 1);
  return s;
}

/// Moves staged values into the model and optimizer. Local; cannot fail half way except on
/// programming errors (checked before: optimizer kind, group count).
template <class Engine>
void apply_staged(Engine& engine, torch::optim::Optimizer* opt, Staged& s, TrainState* state, bool load_rng_state) {
  torch::NoGradGuard no_grad;
  const auto& units = engine.sharded_units();
  for (std::size_t i = 0; i < units.size(); ++i) {
    auto& u = units[i];
    if (u.param_names.empty()) continue;
    u.shard.detach().copy_(s.units[i].flat);  // bumps the version counter: a gathered copy is refreshed
  }
  if (opt) {
    for (std::size_t i = 0; i < units.size(); ++i)
      if (s.optimizer_states[i]) opt->state()[optimizer_state_key(units[i].optimized)] = std::move(s.optimizer_states[i]);
    if (!s.meta.lrs.empty())
      for (std::size_t g = 0; g < opt->param_groups().size(); ++g) opt->param_groups()[g].options().set_lr(s.meta.lrs[g]);
  }
  const auto buffers = live_buffers_of(engine);
  for (std::size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(s.buffers[i]);  // converts to a mixed-precision buffer_dtype
  std::pair<bool, bool> restored{false, false};
  if (load_rng_state) restored = restore_rng_rows(s.meta.rows, engine.compute_device());
  if (state) {
    *state = s.meta.train;
    state->rng_restored = restored.first;
    state->device_rng_restored = restored.second;
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
  if (type == StateDictType::LOCAL_STATE_DICT) {
    // Rank files copied in from another save would restore the ranks to different steps, which then
    // wait on each other's collectives: a damaged checkpoint, as verify reports it.
    const std::string first = broadcast_string(world, staged.local_save);
    error = detail::capture_error([&] {
      if (staged.local_save != first)
        throw CheckpointError("LOCAL checkpoint '" + path + "': " + ckpt::local_rank_file(world.rank()) + " comes from another save (" +
                              staged.local_save + ") than " + ckpt::local_rank_file(0) + " (" + first + ")");
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
      // Checkpoints hold shard-shaped state, read into host memory; the optimizer keeps it where the
      // parameter it updates lives (a GPU, or the host under offload), in the dtype it keeps state in
      // (a checkpoint with fp32 moments loads into bf16 moments and back).
      const auto state_dtype = optimizer_state_dtype(*optimizer, units[i].optimized);
      for (auto& [name, t] : view.tensors) t = units[i].optimized_part_of(t).to(units[i].optimized.device(), state_dtype);
      try {
        staged.optimizer_states[i] = make_optimizer_state(*optimizer, view);
      } catch (const ConfigError& e) {
        throw CheckpointError("checkpoint '" + path + "': " + message_without_id(e), detail::kMismatchId);
      }
    }
  });
  detail::agree(world, error);
  detail::apply_staged(engine, optimizer, staged, state, options.load_rng_state);
}

/// What checkpoint_candidates() found in a checkpoint folder.
struct CheckpointCandidates {
  std::vector<std::string> names;
  std::vector<std::string> notes;
  std::int64_t existing = 0;
};

namespace detail {

/// `lines` as rank 0 has them, on every rank.
template <class Comm>
void share_lines(Comm& world, std::vector<std::string>& lines) {
  std::string text;
  for (const auto& l : lines) text += l + "\n";
  text = broadcast_string(world, text);
  lines.clear();
  for (std::size_t at = 0; at < text.size();) {
    const auto end = text.find('\n', at);
    lines.push_back(text.substr(at, end - at));
    at = end + 1;
  }
}

}  // namespace detail

/// The checkpoints of `dir` in the order a resume tries them: the one `latest` names, then the older
/// ones; with `latest` absent or damaged (empty, garbage, naming a missing file), every checkpoint,
/// newest first. `notes` says what was wrong with `latest` and which newer checkpoints are not
/// candidates; `existing` counts every checkpoint there. Rank 0 reads the folder, every rank gets the
/// same lists. Collective.
template <class Comm>
CheckpointCandidates checkpoint_candidates(Comm& world, const std::string& dir) {
  CheckpointCandidates c;
  // A failure on rank 0 (an unreadable folder) is agreed before the broadcasts.
  const auto inspected = detail::capture_error([&] {
    if (world.rank() != 0) return;
    const auto latest = ckpt::inspect_latest(dir);
    const auto all = ckpt::list_checkpoints(dir);
    c.existing = static_cast<std::int64_t>(all.size());
    if (latest.state == ckpt::LatestPointer::State::kDamaged && !all.empty())
      c.notes.push_back(std::string(ckpt::kLatestName) + ": " + latest.problem + "; trying every checkpoint, newest first");
    for (const auto& [step, name] : ckpt::run_checkpoints(dir)) c.names.push_back(name);
    if (latest.state == ckpt::LatestPointer::State::kValid)
      for (const auto& [step, name] : all)
        if (step > *ckpt::step_of(latest.name))
          c.notes.push_back(name + ": newer than latest (from an abandoned run or an interrupted commit); not loaded");
  });
  detail::agree(world, inspected);
  detail::share_lines(world, c.names);
  detail::share_lines(world, c.notes);
  world.broadcast(&c.existing, 1, DType::kInt64, 0);
  return c;
}

/// Tries `load(path)` on checkpoint_candidates(dir) in turn and returns the first path that loads, with
/// notes on what was skipped: an unreadable checkpoint (corrupt, truncated, incomplete) is noted and the
/// next older one tried; any other error stops (a checkpoint of another model or optimizer,
/// detail::kMismatchId: the folder belongs to another run). `load` is collective and fails on every rank
/// alike (load_checkpoint agrees). An empty path: the folder has no checkpoint. When checkpoints exist
/// but none loads, a CheckpointError lists why, then `advice`: a run never starts over silently.
/// Collective.
template <class Comm, class Load>
ResumeResult load_newest_usable(Comm& world, const std::string& dir, Load&& load, const std::string& advice) {
  const auto found = checkpoint_candidates(world, dir);
  ResumeResult result;
  result.skipped = found.notes;
  for (const auto& name : found.names) {
    const std::string path = (std::filesystem::path(dir) / name).string();
    try {
      load(path);
    } catch (const CheckpointError& e) {
      if (e.id() == detail::kMismatchId) throw;
      result.skipped.push_back(name + ": " + message_without_id(e));
      continue;
    }
    result.path = path;
    return result;
  }
  if (found.existing > 0) {
    std::string why;
    for (const auto& s : result.skipped) why += "\n  " + s;
    throw CheckpointError("none of the " + std::to_string(found.existing) + " checkpoint(s) in '" + dir + "' can be loaded:" + why + "\n" + advice);
  }
  return result;
}

/// Loads the newest usable checkpoint in `dir` (load_newest_usable). Checkpoints past the one loaded are
/// moved to `dir/abandoned/` so that this run's saves never replace them. Returns the path loaded and
/// notes on what was skipped or moved; an empty path means the folder has no checkpoint (a fresh
/// start). Collective.
template <class Engine>
ResumeResult resume_from_latest(Engine& engine, torch::optim::Optimizer* optimizer, const std::string& dir, TrainState* state = nullptr,
                                const CheckpointOptions& options = {}) {
  auto& world = engine.comm();
  detail::arrive_together(world, options, "resume_from_latest");
  auto load = [&](const std::string& path) {
    try {
      load_checkpoint(engine, optimizer, path, state, options);
    } catch (const CheckpointError& e) {
      if (e.id() != detail::kMismatchId) throw;
      throw CheckpointError(
          message_without_id(e) + ". The checkpoint folder '" + dir + "' holds another run: use another folder, or start fresh without resuming",
          detail::kMismatchId);
    }
  };
  ResumeResult result = load_newest_usable(
      world, dir, load, "Repair or move them (fsdp-ckpt verify names the damage), or start fresh with checkpoint.resume = \"none\"");
  if (result.path.empty()) return result;
  // Checkpoints past the one resumed from belong to another trajectory: this run's saves at those
  // steps must not replace them.
  const std::string name = std::filesystem::path(result.path).filename().string();
  std::optional<std::string> error = detail::capture_error([&] {
    if (world.rank() == 0) result.set_aside = ckpt::set_aside_checkpoints_after(dir, *ckpt::step_of(name));
  });
  detail::agree(world, error);
  detail::share_lines(world, result.set_aside);
  for (const auto& moved : result.set_aside) {
    const std::string where = std::string("moved to ") + ckpt::kSetAsideName + "/";
    const auto noted = std::find_if(result.skipped.begin(), result.skipped.end(), [&](const std::string& s) { return s.rfind(moved + ":", 0) == 0; });
    if (noted != result.skipped.end())
      *noted += "; " + where;
    else
      result.skipped.push_back(moved + ": past the checkpoint resumed from (another trajectory); " + where);
  }
  return result;
}

}  // namespace fsdp
