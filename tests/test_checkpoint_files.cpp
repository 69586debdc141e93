// HDF5 checkpoint files (run at np = 1..4, part of test_checkpoint): corrupt and truncated files,
// keep_last and the latest pointer, the schema h5dump reads, saves called on some ranks only or failing
// on one, checkpoints newer than latest, and a checkpoint of another run.
#include <boost/test/unit_test.hpp>

#include <fstream>

#include "checkpoint_harness.hpp"

/// Where dataset `name`'s first chunk is stored in `file`, and its stored size.
std::pair<haddr_t, hsize_t> first_chunk_of(const std::string& file, const std::string& name) {
  haddr_t addr = 0;
  hsize_t size = 0;
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  hid_t d = H5Dopen2(f, name.c_str(), H5P_DEFAULT);
  hid_t space = H5Dget_space(d);
  unsigned mask = 0;
  std::vector<hsize_t> offset(8, 0);
  const herr_t found = H5Dget_chunk_info(d, space, 0, offset.data(), &mask, &addr, &size);
  H5Sclose(space);
  H5Dclose(d);
  H5Fclose(f);
  BOOST_REQUIRE(found >= 0);
  return {addr, size};
}

/// Flips one byte inside the stored data of dataset `name` (its first chunk).
void flip_byte_in_dataset(const std::string& file, const std::string& name) {
  const haddr_t addr = first_chunk_of(file, name).first;
  std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
  io.seekg(static_cast<std::streamoff>(addr + 8));
  char c = 0;
  io.read(&c, 1);
  c = static_cast<char>(c ^ 0x40);
  io.seekp(static_cast<std::streamoff>(addr + 8));
  io.write(&c, 1);
}

/// Rewrites the stored size of dataset `name`'s only chunk in its layout message to `bytes` (a damaged
/// chunk index); returns false if the size could not be found next to the chunk's address.
bool shrink_stored_chunk(const std::string& file, const std::string& name, std::uint64_t bytes) {
  const auto [addr, size] = first_chunk_of(file, name);
  std::ifstream in(file, std::ios::binary);
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto le64 = [](std::uint64_t v) {
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
    return out;
  };
  const std::string size_bytes = le64(size), addr_bytes = le64(addr);
  for (std::size_t at = data.find(size_bytes); at != std::string::npos; at = data.find(size_bytes, at + 1)) {
    if (data.substr(at + 8, 40).find(addr_bytes) == std::string::npos) continue;
    data.replace(at, 8, le64(bytes));
    std::ofstream(file, std::ios::binary | std::ios::trunc) << data;
    return true;
  }
  return false;
}

BOOST_AUTO_TEST_CASE(a_chunk_shorter_than_its_checksum_is_refused_not_read) {
  // libhdf5 1.10's Fletcher32 filter reads out of bounds on such a chunk (found by fuzz/run.sh).
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt = make_adam(*model);
  train_step(*model, *opt, 0);
  const auto saved = fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 1}).path;
  const std::string damaged = dir / "short_chunk.h5";
  std::int64_t patched = 0;
  if (world.rank() == 0) {
    fs::copy_file(saved, damaged);
    patched = shrink_stored_chunk(damaged, "/model/fc2.weight", 2) ? 1 : 0;
  }
  world.broadcast(&patched, 1, fsdp::DType::kInt64, 0);
  BOOST_REQUIRE(patched == 1);
  const auto report = fsdp::ckpt::verify(damaged);
  BOOST_REQUIRE(!report.ok());
  BOOST_TEST(report.problems[0].find("/model/fc2.weight") != std::string::npos, report.problems[0]);
  BOOST_TEST(report.problems[0].find("stored as 2 bytes") != std::string::npos, report.problems[0]);
  auto fresh = fsdp::make_fsdp(make_net(4), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt2 = make_adam(*fresh);
  try {
    fsdp::load_checkpoint(*fresh, opt2.get(), damaged);
    BOOST_ERROR("a damaged chunk index must be refused");
  } catch (const fsdp::CheckpointError& e) {
    BOOST_TEST(std::string(e.what()).find("/model/fc2.weight") != std::string::npos, e.what());
  }
}

BOOST_AUTO_TEST_CASE(corrupt_and_truncated_files_are_refused_and_resume_falls_back) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt = make_adam(*model);
  train_step(*model, *opt, 0);
  fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 1});
  const auto at_step1 = full_state(*model, opt.get());
  train_step(*model, *opt, 1);
  const auto step2 = fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 2}).path;
  const std::string truncated = dir / "truncated.h5", flipped = dir / "flipped.h5";
  if (world.rank() == 0) {
    fs::copy_file(step2, truncated);
    fs::resize_file(truncated, fs::file_size(truncated) / 2);
    fs::copy_file(step2, flipped);
    flip_byte_in_dataset(flipped, "/model/fc2.weight");
  }
  world.barrier();
  auto fresh = fsdp::make_fsdp(make_net(4), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt2 = make_adam(*fresh);
  const auto before = full_state(*fresh, nullptr);
  for (const auto& [path, expect] : std::vector<std::pair<std::string, std::string>>{{truncated, "truncated.h5"}, {flipped, "/model/fc2.weight"}}) {
    try {
      fsdp::load_checkpoint(*fresh, opt2.get(), path);
      BOOST_ERROR(path << " must be refused");
    } catch (const fsdp::CheckpointError& e) {
      const std::string what = e.what();
      BOOST_TEST(what.find(expect) != std::string::npos, what);
    }
  }
  check_equal(before, full_state(*fresh, nullptr), "refused loads change nothing");
  // Corrupt the newest checkpoint itself: resume falls back to step 1 and says why.
  world.barrier();
  if (world.rank() == 0) flip_byte_in_dataset(step2, "/model/fc2.weight");
  world.barrier();
  fsdp::TrainState state;
  const auto resumed = fsdp::resume_from_latest(*fresh, opt2.get(), dir.path, &state);
  BOOST_TEST(resumed.path == dir / "step_00000001.h5");
  BOOST_REQUIRE(resumed.skipped.size() == 1u);
  BOOST_TEST(resumed.skipped[0].find("step_00000002.h5") == 0u, resumed.skipped[0]);
  BOOST_TEST(state.step == 1);
  check_equal(at_step1, full_state(*fresh, opt2.get()), "fell back to step 1");
}

BOOST_AUTO_TEST_CASE(latest_pointer_and_keep_last) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  fsdp::CheckpointOptions o;
  o.keep_last = 2;
  for (int step = 1; step <= 4; ++step) {
    const auto r = fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = step}, o);
    BOOST_TEST(fsdp::ckpt::read_latest(dir.path).value() == fsdp::ckpt::checkpoint_name(step));
    if (step >= 3 && world.rank() == 0) BOOST_TEST(r.pruned == std::vector<std::string>{fsdp::ckpt::checkpoint_name(step - 2)});
  }
  world.barrier();
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path)) names.insert(e.path().filename().string());
  BOOST_TEST((names == std::set<std::string>{"latest", "step_00000003.h5", "step_00000004.h5"}));
  world.barrier();
}

// A folder given where one checkpoint is read (fsdp-ckpt, checkpoint.resume = a folder): `latest` names
// it; a damaged `latest` is refused, naming it and the checkpoints there, newest first. What resume and
// --eval-only try instead (checkpoint_candidates): every checkpoint, newest first, with a note on `latest`.
BOOST_AUTO_TEST_CASE(a_damaged_latest_is_named_where_one_checkpoint_is_read) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  for (int step = 1; step <= 3; ++step) fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = step});
  BOOST_TEST(fsdp::ckpt::checkpoint_at(dir.path) == fs::path(dir.path) / fsdp::ckpt::checkpoint_name(3));
  world.barrier();
  if (world.rank() == 0) std::ofstream(dir / "latest") << "garbage\n";
  world.barrier();
  std::string message;
  try {
    fsdp::ckpt::checkpoint_at(dir.path);
  } catch (const fsdp::CheckpointError& e) {
    message = e.what();
  }
  BOOST_TEST(message.find("latest' holds 'garbage', not a checkpoint name: it names no checkpoint to read") != std::string::npos, message);
  BOOST_TEST(message.find("(newest first: step_00000003.h5, step_00000002.h5, step_00000001.h5)") != std::string::npos, message);
  const auto found = fsdp::checkpoint_candidates(world, dir.path);
  BOOST_TEST((found.names == std::vector<std::string>{"step_00000003.h5", "step_00000002.h5", "step_00000001.h5"}));
  BOOST_TEST(found.existing == 3);
  BOOST_TEST_REQUIRE(found.notes.size() == 1u);
  BOOST_TEST(found.notes[0] == "latest: holds 'garbage', not a checkpoint name; trying every checkpoint, newest first");
  world.barrier();
}

BOOST_AUTO_TEST_CASE(keep_last_never_prunes_the_newest_checkpoint_that_verifies) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  fsdp::CheckpointOptions o;
  o.keep_last = 1;
  fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = 1}, o);
  fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = 2}, o);
  // Step 3 is damaged after it was written (a disk that returns other bytes): keep_last must leave
  // step 2, the newest checkpoint that still verifies, instead of pruning it.
  o.on_stage = [&](const std::string& stage, std::int64_t step) {
    if (stage != "written" || step != 3 || world.rank() != 0) return;
    for (const auto& e : fs::directory_iterator(dir.path))
      if (e.path().filename().string().find("step_00000003.h5") != std::string::npos) flip_byte_in_dataset(e.path().string(), "/model/fc2.weight");
  };
  const auto r = fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = 3}, o);
  world.barrier();
  BOOST_TEST(r.pruned.empty());
  BOOST_TEST(fs::exists(dir / "step_00000002.h5"));
  BOOST_TEST(!fsdp::ckpt::verify(dir / "step_00000003.h5").ok());
  // A resume falls back to it (and sets the damaged step 3 aside).
  fsdp::TrainState state;
  fsdp::resume_from_latest(*model, nullptr, dir.path, &state);
  BOOST_TEST(state.step == 2);
  // Once a good checkpoint is newer, the old one goes as keep_last says.
  o.on_stage = nullptr;
  const auto r3 = fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = 3}, o);
  world.barrier();
  if (world.rank() == 0) BOOST_TEST((r3.pruned == std::vector<std::string>{"step_00000002.h5"}));
  BOOST_TEST(fsdp::ckpt::verify(dir / "step_00000003.h5").ok());
}

BOOST_AUTO_TEST_CASE(h5dump_reads_the_schema) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt = make_adam(*model);
  train_step(*model, *opt, 0);
  const auto path = fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 1, .deck = "x = 1"}).path;
  if (world.rank() == 0) {
    std::string out;
    FILE* pipe = popen(("h5dump -A " + path + " 2>&1").c_str(), "r");
    BOOST_REQUIRE(pipe);
    char buf[4096];
    while (std::size_t n = fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
    BOOST_TEST(pclose(pipe) == 0, out.substr(0, 2000));
    for (const char* expected : {"GROUP \"model\"", "DATASET \"fc1.weight\"", "DATASET \"tied.weight\"", "DATASET \"bn.running_mean\"",
                                 "GROUP \"optim\"", "DATASET \"exp_avg_sq\"", "ATTRIBUTE \"plan_hash\"", "\"fsdp-checkpoint\"",
                                 "\"SHARDED_STATE_DICT\"", "GROUP \"rng\"", "ATTRIBUTE \"sample_index\""})
      BOOST_TEST(out.find(expected) != std::string::npos, expected);
    // The weights themselves, verified (Fletcher32) by h5dump.
    pipe = popen(("h5dump -d /model/fc1.weight " + path + " 2>&1").c_str(), "r");
    out.clear();
    while (std::size_t n = fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
    BOOST_TEST(pclose(pipe) == 0, out.substr(0, 2000));
    BOOST_TEST(out.find("DATASPACE  SIMPLE { ( 23, 11 ) / ( 23, 11 ) }") != std::string::npos, out.substr(0, 400));
  }
  world.barrier();
}

BOOST_AUTO_TEST_CASE(save_on_some_ranks_only_is_reported_not_a_hang) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  if (world.size() == 1) {
    BOOST_TEST(fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = 1}).bytes > 0);
    return;
  }
  fsdp::CheckpointOptions o;
  o.collective_timeout_s = 1;
  if (world.rank() == 0) {
    try {
      fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = 1}, o);
      BOOST_ERROR("a save on rank 0 alone must fail");
    } catch (const fsdp::CommError& e) {
      const std::string what = e.what();
      BOOST_TEST(what.find("fsdp.comm.deadline") != std::string::npos, what);
      BOOST_TEST(what.find("save_checkpoint") != std::string::npos, what);
    }
    BOOST_TEST(!fs::exists(dir / "latest"));
    std::ofstream(dir / "rank0_gave_up").put('1');
  } else {
    // Only once rank 0 has given up, however long a loaded machine keeps it: a barrier entered
    // earlier would complete the save's own.
    for (int i = 0; i < 6000 && !fs::exists(dir / "rank0_gave_up"); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    BOOST_TEST_REQUIRE(fs::exists(dir / "rank0_gave_up"));
    world.barrier_within(60, "matching the abandoned barrier");  // completes rank 0's pending one
  }
}

BOOST_AUTO_TEST_CASE(checkpoints_newer_than_latest_are_neither_loaded_nor_pruned) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  fsdp::CheckpointOptions o;
  o.keep_last = 1;
  for (int step : {10, 20}) fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = step}, o);
  // A restart from step 5 of another run: its saves must not delete or load step 20.
  fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = 5}, o);
  fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = 6}, o);
  world.barrier();
  BOOST_TEST(fs::exists(dir / "step_00000020.h5"));
  BOOST_TEST(!fs::exists(dir / "step_00000005.h5"));
  fsdp::TrainState state;
  const auto r = fsdp::resume_from_latest(*model, nullptr, dir.path, &state);
  BOOST_TEST(r.path == dir / "step_00000006.h5");
  BOOST_TEST(state.step == 6);
  BOOST_REQUIRE(r.skipped.size() == 1u);
  BOOST_TEST(r.skipped[0].find("step_00000020.h5: newer than latest") == 0u, r.skipped[0]);
}

BOOST_AUTO_TEST_CASE(a_failure_on_one_rank_in_the_middle_of_a_save_fails_every_rank) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt = make_adam(*model);
  train_step(*model, *opt, 0);
  fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 1});
  const int victim = world.size() - 1;
  for (auto type : {StateDictType::SHARDED_STATE_DICT, StateDictType::FULL_STATE_DICT, StateDictType::LOCAL_STATE_DICT}) {
    fsdp::CheckpointOptions o;
    o.state_dict_type = type;
    o.on_stage = [&](const std::string& stage, std::int64_t) {
      if (stage == "writing" && world.rank() == victim) throw std::runtime_error("disk full (simulated)");
    };
    try {
      fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 2}, o);
      BOOST_ERROR(fsdp::to_string(type) << ": the save must fail on every rank");
    } catch (const fsdp::CheckpointError& e) {
      const std::string what = e.what();
      BOOST_TEST(what.find("disk full (simulated)") != std::string::npos, what);
    }
    BOOST_TEST(fsdp::ckpt::read_latest(dir.path).value() == "step_00000001.h5");
    BOOST_TEST(!fs::exists(dir / "step_00000002.h5"));
  }
}

BOOST_AUTO_TEST_CASE(resume_stops_at_a_checkpoint_of_another_run) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto adam = make_adam(*model);
  train_step(*model, *adam, 0);
  fsdp::save_checkpoint(*model, adam.get(), dir.path, {.step = 1});
  // Readable, but written with another optimizer: not skipped (that would start a second run in the
  // same folder), an error on every rank.
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  try {
    fsdp::resume_from_latest(*model, &sgd, dir.path);
    BOOST_ERROR("resuming with another optimizer must fail");
  } catch (const fsdp::CheckpointError& e) {
    const std::string what = e.what();
    BOOST_TEST(e.id() == "fsdp.ckpt.mismatch");
    BOOST_TEST(what.find("holds Adam state but the optimizer is SGD") != std::string::npos, what);
    BOOST_TEST(what.find("(reported by rank") == std::string::npos, what);  // every rank found it
  }
}

BOOST_AUTO_TEST_CASE(a_gpu_generator_row_is_saved_by_gpu_runs_and_ignored_by_cpu_runs) {
  // A GPU run's checkpoint holds /rng/cuda next to /rng/cpu (the rows come from the captured state); a
  // CPU run loading it restores its CPU generator and leaves the device's alone. The GPU side itself
  // (capturing and setting a CUDA generator) needs a device: docs/gpu.md.
  fsdp::detail::RngState captured;
  captured.cpu = fsdp::detail::generator_state(at::detail::getDefaultCPUGenerator());
  captured.device_of = c10::Device(c10::DeviceType::CUDA, 1);
  captured.device = torch::arange(16, torch::kUInt8);
  const auto rows = fsdp::detail::rng_rows(captured);
  BOOST_REQUIRE(rows.size() == 2u);
  BOOST_TEST(rows[0].dataset == "/rng/cpu");
  BOOST_TEST(rows[1].dataset == "/rng/cuda");
  BOOST_TEST(torch::equal(rows[1].bytes, captured.device));
  BOOST_TEST(fsdp::detail::rng_rows(fsdp::detail::capture_rng_state(torch::kCPU)).size() == 1u, "a CPU run saves /rng/cpu only");

  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  for (auto type : {StateDictType::SHARDED_STATE_DICT, StateDictType::FULL_STATE_DICT, StateDictType::LOCAL_STATE_DICT}) {
    BOOST_TEST_CONTEXT(fsdp::to_string(type)) {
      fsdp::CheckpointOptions o;
      o.state_dict_type = type;
      const auto saved = fsdp::save_checkpoint(*model, nullptr, dir / fsdp::to_string(type), {.step = 1}, o);
      // Add the row a GPU run would have written, as HDF5 holds it: [world, n] (a LOCAL rank file: [1, n]).
      const bool local = type == StateDictType::LOCAL_STATE_DICT;
      if (local || world.rank() == 0) {
        const auto file_path = local ? (fs::path(saved.path) / fsdp::ckpt::local_rank_file(world.rank())).string() : saved.path;
        fsdp::h5::Id file(H5Fopen(file_path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), "open " + file_path);
        const std::int64_t n_rows = local ? 1 : world.size();
        auto rows_of_gpu = torch::arange(n_rows * 16, torch::kUInt8);
        fsdp::detail::write_rank_rows(file, "/rng/cuda", rows_of_gpu.view({n_rows, 16}), n_rows, 0, false, H5P_DEFAULT);
      }
      world.barrier();
      const auto cpu_before = fsdp::detail::generator_state(at::detail::getDefaultCPUGenerator());
      torch::randn({5});  // moves the CPU generator on: the load must put it back
      auto loaded = fsdp::make_fsdp(make_net(4), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
      fsdp::TrainState state;
      fsdp::load_checkpoint(*loaded, nullptr, saved.path, &state, o);
      BOOST_TEST(state.rng_restored);
      BOOST_TEST(!state.device_rng_restored, "a CPU computation has no device generator to restore");
      BOOST_TEST(torch::equal(fsdp::detail::generator_state(at::detail::getDefaultCPUGenerator()), cpu_before));
      if (local && world.rank() == 0) {  // merged into one file: every rank's GPU row comes along
        const auto merged = dir / "merged.h5";
        fsdp::ckpt::merge_local(saved.path, merged);
        fsdp::h5::Id file = fsdp::h5::open_file_readonly(merged);
        fsdp::h5::Id ds = fsdp::h5::open_dataset(file, "/rng/cuda", merged);
        BOOST_TEST((fsdp::h5::dataset_dims(ds) == std::vector<std::int64_t>{world.size(), 16}));
      }
      world.barrier();
    }
  }
}

BOOST_AUTO_TEST_CASE(a_local_checkpoint_mixed_from_two_saves_is_refused_and_resume_falls_back) {
  // A rank file copied in from another save would restore the ranks to different steps, which then
  // wait on each other's collectives until the deadline.
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt = make_adam(*model);
  fsdp::CheckpointOptions o;
  o.state_dict_type = StateDictType::LOCAL_STATE_DICT;
  train_step(*model, *opt, 0);
  const auto first = fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 1}, o).path;
  const auto at_step1 = full_state(*model, opt.get());
  train_step(*model, *opt, 1);
  const auto second = fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 2}, o).path;
  const int copied = world.size() - 1;  // a rank other than 0, whose file is compared with rank 0's (none at np 1)
  const std::string file = fsdp::ckpt::local_rank_file(copied);
  world.barrier();
  if (world.rank() == 0) {
    if (copied > 0) {
      fs::copy_file(fs::path(first) / file, fs::path(second) / file, fs::copy_options::overwrite_existing);
      const auto report = fsdp::ckpt::verify(second);
      BOOST_TEST(!report.ok());
      const std::string said = report.problems.empty() ? "" : report.problems.back();
      BOOST_TEST(said.find(file + "' comes from another save (step 1, written ") != std::string::npos, said);
      BOOST_TEST(said.find(") than rank 0's (step 2, written ") != std::string::npos, said);
    }
    const std::string merged = dir / "merged.h5";
    try {
      fsdp::ckpt::merge_local(second, merged);
      BOOST_TEST(copied == 0, "a merge of rank files from two saves must fail");
    } catch (const fsdp::CheckpointError& e) {
      BOOST_TEST(std::string(e.what()).find("comes from another save") != std::string::npos, e.what());
    }
    // The output never replaces a rank file, nor lands in the folder, nor is a folder.
    for (const auto& [out, expect] : std::vector<std::pair<std::string, std::string>>{
             {(fs::path(first) / fsdp::ckpt::local_rank_file(0)).string(), "lies inside the LOCAL checkpoint"},
             {(fs::path(first) / "merged.h5").string(), "lies inside the LOCAL checkpoint"},
             {dir.path, "is a folder"}}) {
      BOOST_CHECK_EXCEPTION(fsdp::ckpt::merge_local(first, out), fsdp::CheckpointError,
                            [&](const fsdp::CheckpointError& e) { return std::string(e.what()).find(expect) != std::string::npos; });
    }
    BOOST_TEST(fsdp::ckpt::verify(first).ok(), "the refused merges left the input whole");
    BOOST_TEST(!fs::exists(fs::path(first) / "merged.h5"));
  }
  world.barrier();
  auto fresh = fsdp::make_fsdp(make_net(4), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt2 = make_adam(*fresh);
  if (copied > 0) {
    const auto before = full_state(*fresh, opt2.get());
    try {
      fsdp::load_checkpoint(*fresh, opt2.get(), second, nullptr, o);
      BOOST_ERROR("a LOCAL checkpoint mixed from two saves must be refused on every rank");
    } catch (const fsdp::CheckpointError& e) {
      BOOST_TEST(std::string(e.what()).find(file + " comes from another save (step 1") != std::string::npos, e.what());
    }
    check_equal(before, full_state(*fresh, opt2.get()), "a refused load changes nothing");
  }
  // A resume reads it as damaged: the save before it loads.
  fsdp::TrainState state;
  const auto resumed = fsdp::resume_from_latest(*fresh, opt2.get(), dir.path, &state, o);
  if (copied > 0) {
    BOOST_TEST(resumed.path == first);
    BOOST_TEST(state.step == 1);
    check_equal(at_step1, full_state(*fresh, opt2.get()), "fell back to step 1");
  }
}

BOOST_AUTO_TEST_CASE(missing_optimizer_state_is_named_never_a_crash_nor_a_reset) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt = make_adam(*model);
  train_step(*model, *opt, 0);
  const auto saved = fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 1}).path;
  std::string first_param;  // the first parameter of a unit: its group once decided the unit's state names
  for (const auto& u : model->sharded_units())
    if (first_param.empty() && !u.param_names.empty()) first_param = u.param_names.front();
  const std::string group = fsdp::detail::optim_path(first_param);
  auto fresh = fsdp::make_fsdp(make_net(4), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt2 = make_adam(*fresh);
  // Deleted by hand, the file is incomplete (damage: a resume falls back); with its tensor count
  // rewritten to match, each missing tensor is named.
  const std::vector<std::tuple<std::string, bool, std::string>> cases = {{group + "/exp_avg", false, "is incomplete: "},
                                                                         {group + "/exp_avg", true, group + "/exp_avg (missing)"},
                                                                         {group, true, group + "/exp_avg (missing)"}};
  for (const auto& [removed, recounted, named] : cases) {
    BOOST_TEST_CONTEXT(removed << (recounted ? ", recounted" : "")) {
      const std::string edited = dir / "edited.h5";
      if (world.rank() == 0) {
        fs::copy_file(saved, edited, fs::copy_options::overwrite_existing);
        fsdp::h5::Id f(H5Fopen(edited.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), "open " + edited);
        BOOST_REQUIRE(H5Ldelete(f, removed.c_str(), H5P_DEFAULT) >= 0);
        if (recounted) {
          const auto datasets = fsdp::h5::list_datasets(f);
          BOOST_REQUIRE(H5Adelete(f, "num_tensors") >= 0);
          fsdp::h5::write_attribute(f, "num_tensors",
                                    static_cast<std::int64_t>(std::count_if(datasets.begin(), datasets.end(), fsdp::ckpt::counted_tensor)));
        }
      }
      world.barrier();
      try {
        fsdp::load_checkpoint(*fresh, opt2.get(), edited);
        BOOST_ERROR("a checkpoint without " << removed << " must be refused");
      } catch (const fsdp::CheckpointError& e) {
        BOOST_TEST(std::string(e.what()).find(named) != std::string::npos, e.what());
      }
    }
  }
  // Adam's state without one of the moments its step reads is refused by name, not built half.
  fsdp::OptimizerStateView half{.tensors = {{"exp_avg_sq", torch::zeros({4})}}, .step = 3};
  BOOST_CHECK_EXCEPTION(fsdp::make_optimizer_state(*opt, half), fsdp::ConfigError, [](const fsdp::ConfigError& e) {
    return std::string(e.what()).find("optimizer state 'exp_avg' of a Adam optimizer is missing") != std::string::npos;
  });
  // ... and the state its options make a step read: amsgrad's running maximum.
  auto w = torch::zeros({4}, torch::requires_grad());
  torch::optim::Adam amsgrad({w}, torch::optim::AdamOptions(1e-3).amsgrad(true));
  fsdp::OptimizerStateView moments{.tensors = {{"exp_avg", torch::zeros({4})}, {"exp_avg_sq", torch::zeros({4})}}, .step = 3};
  BOOST_CHECK_NO_THROW(fsdp::make_optimizer_state(*opt, moments));
  BOOST_CHECK_EXCEPTION(fsdp::make_optimizer_state(amsgrad, moments), fsdp::ConfigError, [](const fsdp::ConfigError& e) {
    return std::string(e.what()).find("optimizer state 'max_exp_avg_sq' of a Adam optimizer is missing") != std::string::npos;
  });
}

BOOST_AUTO_TEST_CASE(a_step_attribute_changed_after_the_save_and_a_folder_as_latest_are_named) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  const auto saved = fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = 8}).path;
  const std::string edited = dir / "edited.h5";
  if (world.rank() == 0) {
    fs::copy_file(saved, edited);
    fsdp::h5::Id f(H5Fopen(edited.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), "open " + edited);
    BOOST_REQUIRE(H5Adelete(f, "step") >= 0);
    fsdp::h5::write_attribute(f, "step", std::int64_t{12});
  }
  world.barrier();
  const std::string expect = "its step attribute is 12 and /train's step 8";
  if (world.rank() == 0) {
    const auto report = fsdp::ckpt::verify(edited);
    BOOST_TEST((report.problems.size() == 1u && report.problems[0].find(expect) != std::string::npos));
  }
  BOOST_CHECK_EXCEPTION(fsdp::load_checkpoint(*model, nullptr, edited), fsdp::CheckpointError,
                        [&](const fsdp::CheckpointError& e) { return std::string(e.what()).find(expect) != std::string::npos; });
  // `latest` made a folder: damaged, as an unreadable pointer is, never an I/O exception.
  world.barrier();
  if (world.rank() == 0) {
    fs::remove(fs::path(dir.path) / fsdp::ckpt::kLatestName);
    fs::create_directory(fs::path(dir.path) / fsdp::ckpt::kLatestName);
    const auto latest = fsdp::ckpt::inspect_latest(dir.path);
    BOOST_TEST((latest.state == fsdp::ckpt::LatestPointer::State::kDamaged));
    BOOST_TEST(latest.problem == "is not a file");
    BOOST_TEST(!fsdp::ckpt::read_latest(dir.path).has_value());
  }
  world.barrier();
  auto fresh = fsdp::make_fsdp(make_net(4), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  fsdp::TrainState state;
  const auto resumed = fsdp::resume_from_latest(*fresh, nullptr, dir.path, &state);
  BOOST_TEST(resumed.path == saved);
  BOOST_TEST(state.step == 8);
}
