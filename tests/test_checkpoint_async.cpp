// Asynchronous checkpoints (run at np = 1..4, part of test_checkpoint): the file an asynchronous save
// writes while training goes on is, byte for byte, the one a synchronous save writes at the same step
// (the creation time aside, which the test sets equal), for every state dict type and strategy; saves queue one at a time (or
// behind a running write, with two host copies) and prune only after committing; a failed background write reaches every rank and leaves `latest` alone.
#include <boost/test/unit_test.hpp>

#include <fsdp/io/async_checkpoint.hpp>

#include <atomic>
#include <chrono>
#include <thread>
#include <tuple>

#include "checkpoint_harness.hpp"
#include "issuing_comm.hpp"

namespace {

using Async = fsdp::AsyncCheckpointer<Engine>;

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

/// The bytes of checkpoint file `path` as if it had been created at the time `like` was (the one
/// attribute in which two saves of the same state differ): a copy with `like`'s `created` value.
std::string bytes_as_if_created_like(const std::string& path, const std::string& like) {
  std::string created;
  {
    fsdp::h5::Id file = fsdp::h5::open_file_readonly(like);
    created = fsdp::h5::read_string_attribute(file, "created", like);
  }
  const std::string copy = path + ".created_like";
  fs::copy_file(path, copy, fs::copy_options::overwrite_existing);
  {
    fsdp::h5::Id fapl = fsdp::h5::file_access();
    fsdp::h5::Id file(H5Fopen(copy.c_str(), H5F_ACC_RDWR, fapl), "open " + copy);
    fsdp::h5::Id attribute(H5Aopen(file, "created", H5P_DEFAULT), "open created");
    fsdp::h5::Id type(H5Aget_type(attribute), "type of created");
    BOOST_TEST_REQUIRE(H5Tget_size(type) == created.size());
    BOOST_TEST_REQUIRE(H5Awrite(attribute, type, created.data()) >= 0);
  }
  std::string bytes = file_bytes(copy);
  fs::remove(copy);
  return bytes;
}

/// Every file of checkpoint `path` (a file, or a LOCAL folder's rank files).
std::vector<std::string> files_of(const std::string& path) {
  if (!fs::is_directory(path)) return {path};
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(path)) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

BOOST_AUTO_TEST_CASE(async_save_writes_the_bytes_a_sync_save_writes_while_training_goes_on) {
  auto world = MpiComm::world();
  // Every strategy, and the hybrid one with its optimizer state sharded over the world; each with the
  // copy at the save and in the background (shards and optimizer state copied while the next steps'
  // forwards and backwards run, each update waiting for it first).
  std::vector<std::tuple<ShardingStrategy, bool, bool>> cases;
  for (const bool background : {false, true}) {
    for (const auto strategy : kStrategies) cases.emplace_back(strategy, false, background);
    cases.emplace_back(ShardingStrategy::HYBRID_SHARD, true, background);
  }
  auto options_of = [&](ShardingStrategy strategy, bool over_world) {
    auto o = options_for(strategy, world.size(), true);
    if (over_world) o.optimizer_sharding = fsdp::OptimizerSharding::WORLD;
    return o;
  };
  for (const auto type : {StateDictType::SHARDED_STATE_DICT, StateDictType::FULL_STATE_DICT, StateDictType::LOCAL_STATE_DICT}) {
    for (const auto& [strategy, over_world, background] : cases) {
      BOOST_TEST_CONTEXT(fsdp::to_string(type) << " " << strategy << (over_world ? " (optimizer over the world)" : "") << " at world size "
                                               << world.size() << (background ? ", copied in the background" : "")) {
        TempDir dir(world);
        torch::manual_seed(99 + world.rank());
        auto model = fsdp::make_fsdp(make_net(3), world, options_of(strategy, over_world));
        auto opt = make_adam(*model);
        for (int s = 0; s < 3; ++s) train_step(*model, *opt, s);
        fsdp::CheckpointOptions o;
        o.state_dict_type = type;
        const fsdp::TrainState state{.step = 3, .epoch = 0, .sample_index = 3, .scheduler = {{"lr", 1e-2}}, .deck = "[run]\n"};
        const auto sync = fsdp::save_checkpoint(*model, opt.get(), dir / "sync", state, o);
        const auto expected = full_state(*model, opt.get());
        // HDF5 stamps objects with the second of their creation unless told not to: make it another second once.
        if (type == StateDictType::SHARDED_STATE_DICT && strategy == ShardingStrategy::FULL_SHARD && !over_world && !background)
          std::this_thread::sleep_for(std::chrono::milliseconds(1100));

        Async async(*model);
        async.set_copy_in_background(background);
        // The write is held half way until training has moved on: parameters, optimizer state, learning
        // rate, buffers and the RNG all change while the I/O thread writes.
        std::atomic<bool> trained{false};
        auto held = o;
        held.on_stage = [&](const std::string& stage, std::int64_t) {
          while (stage == "writing" && !trained.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        };
        const auto start = async.save(*model, opt.get(), dir / "async", state, held);
        BOOST_TEST(!start.previous.has_value());
        BOOST_TEST(async.in_flight());
        // Host shards and Adam's moments go to the background; all of them at the save when the next
        // forward rewrites the shards from the optimizer's parts (sharded over the world).
        const auto units = model->sharded_units();
        const bool parts = std::any_of(units.begin(), units.end(), [](const auto& u) { return u.optimizer_sharded_over_replicas(); });
        BOOST_TEST((start.background_bytes > 0u) == (background && !parts));
        for (auto& g : opt->param_groups()) g.options().set_lr(0.5);
        for (int s = 3; s < 6; ++s) train_step(*model, *opt, s, [&] { async.wait_for_copies(); });
        BOOST_TEST(!async.copying());
        trained = true;
        const auto done = async.wait();
        BOOST_REQUIRE(done.has_value());
        BOOST_TEST(!async.in_flight());
        BOOST_TEST(done->path == dir / "async/step_00000003.h5");
        BOOST_TEST(fsdp::ckpt::read_latest(dir / "async").value_or("") == "step_00000003.h5");
        BOOST_TEST(async.staging_bytes() > 0);

        if (world.rank() == 0) {
          const auto a = files_of(sync.path), b = files_of(done->path);
          BOOST_TEST_REQUIRE(a.size() == b.size());
          for (std::size_t i = 0; i < a.size(); ++i) {
            BOOST_TEST(fs::path(a[i]).filename() == fs::path(b[i]).filename());
            BOOST_TEST((file_bytes(a[i]) == bytes_as_if_created_like(b[i], a[i])), b[i] << " has the bytes of " << a[i] << " (but for `created`)");
          }
        }
        world.barrier();
        // And it loads back the state of step 3.
        auto loaded = fsdp::make_fsdp(make_net(42), world, options_of(strategy, over_world));
        auto opt2 = make_adam(*loaded);
        fsdp::load_checkpoint(*loaded, opt2.get(), done->path, nullptr, o);
        check_equal(expected, full_state(*loaded, opt2.get()), "the asynchronous checkpoint holds step 3");
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(async_saves_queue_one_at_a_time_and_resume_exactly) {
  auto world = MpiComm::world();
  TempDir dir(world);
  const auto options = options_for(ShardingStrategy::FULL_SHARD, world.size(), true);
  torch::manual_seed(7 + world.rank());
  auto straight = fsdp::make_fsdp(make_net(3), world, options);
  auto opt = make_adam(*straight);
  for (int s = 0; s < 9; ++s) train_step(*straight, *opt, s);
  const auto expected = full_state(*straight, opt.get());

  fsdp::CheckpointOptions o;
  o.keep_last = 2;
  {
    torch::manual_seed(7 + world.rank());
    auto first = fsdp::make_fsdp(make_net(3), world, options);
    auto opt1 = make_adam(*first);
    Async async(*first);
    std::vector<std::string> collected;
    for (int s = 0; s < 6; ++s) {
      train_step(*first, *opt1, s);
      if (const auto r = async.poll()) collected.push_back(r->path);
      if ((s + 1) % 2 == 0) {
        const auto start = async.save(*first, opt1.get(), dir.path, {.step = s + 1}, o);
        if (start.previous) collected.push_back(start.previous->path);  // a save still running was waited for
      }
    }
    if (const auto r = async.wait()) collected.push_back(r->path);
    BOOST_TEST(collected.size() == 3u);
    BOOST_TEST(collected.back() == dir / "step_00000006.h5");
    BOOST_TEST(!async.poll().has_value());
  }
  BOOST_TEST(fsdp::ckpt::read_latest(dir.path).value_or("") == "step_00000006.h5");
  BOOST_TEST(fs::exists(dir / "step_00000004.h5"));
  BOOST_TEST(!fs::exists(dir / "step_00000002.h5"), "keep_last = 2 pruned the oldest after the newest was committed");

  torch::manual_seed(1);
  auto second = fsdp::make_fsdp(make_net(5), world, options);
  auto opt2 = make_adam(*second);
  fsdp::TrainState state;
  fsdp::resume_from_latest(*second, opt2.get(), dir.path, &state, o);
  BOOST_TEST(state.step == 6);
  for (auto s = state.step; s < 9; ++s) train_step(*second, *opt2, static_cast<int>(s));
  check_equal(expected, full_state(*second, opt2.get()), "9 steps straight == 6 + asynchronous saves + resume + 3");
}

// checkpoint.async_when_writing = "queue": with two host copies a save taken while the previous write
// still runs is copied at once, without waiting, and written after it; both hold their own step and
// `latest` ends on the newer. With both copies busy, the next save waits for the oldest write; a
// failed write cancels the one queued behind it.
BOOST_AUTO_TEST_CASE(two_host_copies_queue_a_save_behind_a_running_write) {
  auto world = MpiComm::world();
  TempDir dir(world);
  const auto options = options_for(ShardingStrategy::FULL_SHARD, world.size(), true);
  torch::manual_seed(7 + world.rank());
  auto model = fsdp::make_fsdp(make_net(3), world, options);
  auto opt = make_adam(*model);
  train_step(*model, *opt, 0);
  Async one(*model);
  one.reserve(*model, opt.get());
  Async async(*model, 2);
  async.reserve(*model, opt.get());
  BOOST_TEST(async.staging_bytes() == 2 * one.staging_bytes());

  // The first write is held at its start until the second save has been taken.
  std::atomic<bool> release{false};
  fsdp::CheckpointOptions held;
  held.on_stage = [&](const std::string& stage, std::int64_t step) {
    while (stage == "writing" && step == 1 && !release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  const auto at_step1 = full_state(*model, opt.get());
  const auto first = async.save(*model, opt.get(), dir.path, {.step = 1}, held);
  BOOST_TEST(!first.queued);
  train_step(*model, *opt, 1);
  const auto at_step2 = full_state(*model, opt.get());
  const auto second = async.save(*model, opt.get(), dir.path, {.step = 2}, held);
  BOOST_TEST(second.queued);
  BOOST_TEST(!second.previous.has_value(), "the second copy took it: nothing was waited for");
  BOOST_TEST(async.saves_in_flight() == 2);
  BOOST_TEST(async.every_copy_busy());
  BOOST_TEST(!fsdp::ckpt::read_latest(dir.path).has_value(), "nothing committed while the first write is held");
  train_step(*model, *opt, 2);
  release = true;
  const auto r1 = async.wait();
  const auto r2 = async.wait();
  BOOST_REQUIRE((r1.has_value() && r2.has_value()));
  BOOST_TEST(r1->path == dir / "step_00000001.h5");
  BOOST_TEST(r2->path == dir / "step_00000002.h5");
  BOOST_TEST(!async.in_flight());
  BOOST_TEST(fsdp::ckpt::read_latest(dir.path).value_or("") == "step_00000002.h5");
  for (const auto& [path, expected] : {std::pair{r1->path, &at_step1}, std::pair{r2->path, &at_step2}}) {
    auto loaded = fsdp::make_fsdp(make_net(42), world, options);
    auto opt2 = make_adam(*loaded);
    fsdp::load_checkpoint(*loaded, opt2.get(), path, nullptr, {});
    check_equal(*expected, full_state(*loaded, opt2.get()), "the checkpoint holds its own step's state");
  }

  // Two saves in flight: a third waits for the oldest and reports it; the queue stays in order.
  async.save(*model, opt.get(), dir.path, {.step = 3});
  async.save(*model, opt.get(), dir.path, {.step = 4});
  const auto third = async.save(*model, opt.get(), dir.path, {.step = 5});
  BOOST_REQUIRE(third.previous.has_value());
  BOOST_TEST(third.previous->path == dir / "step_00000003.h5");
  BOOST_TEST(third.queued);
  std::vector<std::string> rest;
  while (async.in_flight()) rest.push_back(async.wait()->path);
  BOOST_TEST(rest == (std::vector<std::string>{dir / "step_00000004.h5", dir / "step_00000005.h5"}), boost::test_tools::per_element());
  BOOST_TEST(fsdp::ckpt::read_latest(dir.path).value_or("") == "step_00000005.h5");

  // A failed write: the save queued behind it is not written either; both failures reach every rank
  // in order, and `latest` stays on the last good one.
  fsdp::CheckpointOptions failing;
  const int failing_rank = world.size() - 1;
  failing.on_stage = [&](const std::string& stage, std::int64_t step) {
    if (stage == "writing" && step == 6 && world.rank() == failing_rank) throw std::runtime_error("disk on fire");
  };
  async.save(*model, opt.get(), dir.path, {.step = 6}, failing);
  async.save(*model, opt.get(), dir.path, {.step = 7});
  std::vector<std::string> messages;
  while (async.in_flight()) {
    try {
      async.wait();
    } catch (const fsdp::CheckpointError& e) {
      messages.push_back(e.what());
    }
  }
  BOOST_TEST_REQUIRE(messages.size() == 2u);
  BOOST_TEST(messages[0].find("disk on fire") != std::string::npos, messages[0]);
  BOOST_TEST(messages[1].find("not written, the background save before it failed") != std::string::npos, messages[1]);
  BOOST_TEST(fsdp::ckpt::read_latest(dir.path).value_or("") == "step_00000005.h5");
  world.barrier();
  BOOST_TEST(!fs::exists(dir / "step_00000007.h5"));
}

BOOST_AUTO_TEST_CASE(a_failed_background_write_fails_on_every_rank_and_keeps_latest) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt = make_adam(*model);
  train_step(*model, *opt, 0);
  Async async(*model);
  async.save(*model, opt.get(), dir.path, {.step = 1});
  BOOST_TEST(async.wait().has_value());

  train_step(*model, *opt, 1);
  fsdp::CheckpointOptions failing;
  const int failing_rank = world.size() - 1;
  failing.on_stage = [&](const std::string& stage, std::int64_t) {
    if (stage == "writing" && world.rank() == failing_rank) throw std::runtime_error("disk on fire");
  };
  async.save(*model, opt.get(), dir.path, {.step = 2}, failing);
  train_step(*model, *opt, 2);  // the step boundary where the failure is learnt
  std::string message;
  try {
    while (!async.poll()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  } catch (const fsdp::CheckpointError& e) {
    message = e.what();
  }
  BOOST_TEST(message.find("disk on fire") != std::string::npos, message);
  BOOST_TEST(!async.in_flight());
  BOOST_TEST(fsdp::ckpt::read_latest(dir.path).value_or("") == "step_00000001.h5");
  BOOST_TEST(!fs::exists(dir / "step_00000002.h5"));
  // A failure learnt by the next save instead: that save throws it and starts nothing.
  async.save(*model, opt.get(), dir.path, {.step = 2}, failing);
  message.clear();
  try {
    async.save(*model, opt.get(), dir.path, {.step = 3});
  } catch (const fsdp::CheckpointError& e) {
    message = e.what();
  }
  BOOST_TEST(message.find("disk on fire") != std::string::npos, message);
  BOOST_TEST(!async.in_flight());
  BOOST_TEST(fsdp::ckpt::read_latest(dir.path).value_or("") == "step_00000001.h5");
  world.barrier();
  if (world.rank() == 0) BOOST_TEST(fsdp::ckpt::verify(dir / "step_00000001.h5").ok());
  // The next save works again.
  async.save(*model, opt.get(), dir.path, {.step = 3});
  BOOST_TEST(async.wait().has_value());
  BOOST_TEST(fsdp::ckpt::read_latest(dir.path).value_or("") == "step_00000003.h5");
}

// On a GPU the engine's collectives are stream-ordered and it never waits for them; a checkpoint or an
// export must, before it reads the state (a collective the lane's watcher aborted leaves values that
// must not be saved), and a failure there on one rank fails every rank, nothing committed. A
// communicator stands in for NcclComm's host wait: counted, and failing on the last rank on demand.
BOOST_AUTO_TEST_CASE(checkpoints_and_exports_wait_for_the_engines_stream_ordered_collectives_before_reading) {
  auto world = MpiComm::world();
  TempDir dir(world);
  torch::manual_seed(7 + world.rank());
  auto model = fsdp::make_fsdp(make_net(3), IssuingComm(world), options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  IssuingComm::host_waits = 0;
  IssuingComm::fail_on_rank = -1;
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    F::mse_loss(model->forward(torch::randn({4, 11})), torch::randn({4, 11})).backward();
    opt.step();
  }
  BOOST_TEST(IssuingComm::host_waits == 0);  // training never waits for the stream

  fsdp::save_checkpoint(*model, &opt, dir.path, {.step = 2});
  BOOST_TEST(IssuingComm::host_waits >= 1);
  IssuingComm::host_waits = 0;
  fsdp::AsyncCheckpointer<std::remove_reference_t<decltype(*model)>> async(*model);
  fsdp::CheckpointOptions full;
  full.state_dict_type = fsdp::StateDictType::FULL_STATE_DICT;
  async.save(*model, &opt, dir.path, {.step = 3}, full);
  BOOST_TEST(IssuingComm::host_waits >= 2);  // before the copy, and after it (its gathers)
  BOOST_TEST(async.wait().has_value());
  IssuingComm::host_waits = 0;
  fsdp::save_safetensors(*model, dir / "model.safetensors");
  BOOST_TEST(IssuingComm::host_waits >= 1);

  // The last rank's communicator was aborted: every rank's save fails with its message, nothing is committed.
  IssuingComm::fail_on_rank = world.size() - 1;
  const auto names_the_abort = [](const fsdp::CheckpointError& e) {
    return std::string(e.what()).find("the NCCL communicator was aborted") != std::string::npos;
  };
  BOOST_CHECK_EXCEPTION(fsdp::save_checkpoint(*model, &opt, dir.path, {.step = 4}), fsdp::CheckpointError, names_the_abort);
  BOOST_CHECK_EXCEPTION(async.save(*model, &opt, dir.path, {.step = 5}), fsdp::CheckpointError, names_the_abort);
  BOOST_CHECK_EXCEPTION(fsdp::save_safetensors(*model, dir / "later.safetensors"), fsdp::CheckpointError, names_the_abort);
  IssuingComm::fail_on_rank = -1;
  BOOST_TEST(fsdp::ckpt::read_latest(dir.path).value_or("") == "step_00000003.h5");
  BOOST_TEST(!fs::exists(dir / "step_00000004.h5"));
  BOOST_TEST(!fs::exists(dir / "step_00000005.h5"));
  BOOST_TEST(!fs::exists(dir / "later.safetensors"));
}

// A background copy the I/O thread has not begun (held at "copying"): the update's wait_for_copies()
// copies it all on the training thread, and the checkpoint is the state at the save. Without that
// wait, the optimizer's in-place update reaches the sources first: the save fails on every rank,
// naming the cause, and writes nothing.
BOOST_AUTO_TEST_CASE(a_background_copy_is_finished_by_the_update_and_a_missed_wait_fails_the_save) {
  auto world = MpiComm::world();
  TempDir dir(world);
  torch::manual_seed(5 + world.rank());
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt = make_adam(*model);
  for (int s = 0; s < 3; ++s) train_step(*model, *opt, s);
  const auto expected = full_state(*model, opt.get());
  Async async(*model);
  async.set_copy_in_background(true);
  std::atomic<bool> release{false};
  fsdp::CheckpointOptions held;
  held.on_stage = [&](const std::string& stage, std::int64_t) {
    while (stage == "copying" && !release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  const auto start = async.save(*model, opt.get(), dir / "fenced", {.step = 3}, held);
  BOOST_TEST(start.background_bytes > 0u);
  BOOST_TEST(async.copying());
  train_step(*model, *opt, 3, [&] {
    async.wait_for_copies();
    BOOST_TEST(!async.copying());
  });
  release = true;
  const auto done = async.wait();
  BOOST_REQUIRE(done.has_value());
  auto loaded = fsdp::make_fsdp(make_net(42), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt2 = make_adam(*loaded);
  fsdp::load_checkpoint(*loaded, opt2.get(), done->path);
  check_equal(expected, full_state(*loaded, opt2.get()), "the checkpoint holds step 3");

  release = false;
  async.save(*model, opt.get(), dir / "missed", {.step = 4}, held);
  train_step(*model, *opt, 4);  // no wait_for_copies() before the update
  release = true;
  BOOST_CHECK_EXCEPTION(async.wait(), fsdp::CheckpointError, [](const fsdp::CheckpointError& e) {
    return std::string(e.what()).find("cannot save checkpoint step 4: the state was updated while it was being copied") != std::string::npos;
  });
  BOOST_TEST(!async.in_flight());
  BOOST_TEST(!fs::exists(fs::path(dir / "missed") / "step_00000004.h5"));
  BOOST_TEST(!fsdp::ckpt::read_latest(dir / "missed").has_value());
}

// A capture's copy (fsdp::detail::copy_all): host pairs split over threads byte by byte, whatever the
// split falls on (pieces of odd sizes and dtypes); other pairs (here a non-contiguous source) by LibTorch.
BOOST_AUTO_TEST_CASE(a_capture_copies_every_byte_on_any_number_of_threads) {
  torch::manual_seed(7);
  const std::vector<torch::Tensor> sources{torch::randn({1'500'001}),
                                           torch::randint(1 << 30, {500'003}, torch::kLong),
                                           torch::randn({3'000'007}).to(torch::kBFloat16),
                                           torch::randn({400, 300}).t(),  // not contiguous
                                           torch::empty({0}),
                                           torch::randn({5})};
  for (const int threads : {1, 2, 3, 4, 7}) {
    std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;
    for (const auto& s : sources) copies.emplace_back(torch::zeros(s.sizes(), s.options()), s);
    fsdp::detail::copy_all(copies, threads);
    for (std::size_t i = 0; i < copies.size(); ++i)
      BOOST_TEST(torch::equal(copies[i].first, copies[i].second), "pair " << i << " with " << threads << " threads");
  }
  BOOST_TEST(fsdp::detail::default_copy_threads() >= 1);
  BOOST_TEST(fsdp::detail::default_copy_threads() <= fsdp::detail::allowed_cpus());
}

// The same with every split in play: a minimum of 1 KiB per thread lets each thread count take its share.
BOOST_AUTO_TEST_CASE(a_capture_splits_its_copy_over_every_thread_it_is_given) {
  torch::manual_seed(8);
  const std::vector<torch::Tensor> sources{torch::randn({10'001}), torch::randint(1 << 20, {3'333}, torch::kInt), torch::randn({7})};
  for (const int threads : {2, 3, 5, 8}) {
    std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;
    for (const auto& s : sources) copies.emplace_back(torch::zeros(s.sizes(), s.options()), s);
    fsdp::detail::copy_all(copies, threads, /*min_bytes_per_thread=*/1024);
    for (std::size_t i = 0; i < copies.size(); ++i)
      BOOST_TEST(torch::equal(copies[i].first, copies[i].second), "pair " << i << " with " << threads << " threads");
  }
}

// A background copy (fsdp::detail::BackgroundCopy): chunks taken by any number of threads at once copy
// every byte (finish() with helpers of its own too); finish() returns only once all are copied; a
// source written in place before the copy ends (here: before it began) is reported, one written after
// it is not.
BOOST_AUTO_TEST_CASE(a_background_copy_copies_every_byte_and_notices_a_source_written_meanwhile) {
  torch::manual_seed(9);
  const std::vector<torch::Tensor> sources{torch::randn({100'003}), torch::randn({4'097}).to(torch::kBFloat16), torch::randn({3})};
  auto plan_of = [&](std::vector<torch::Tensor>& staged) {
    fsdp::detail::HostCopyPlan plan;
    staged.clear();
    for (const auto& s : sources) {
      staged.push_back(torch::zeros(s.sizes(), s.options()));
      BOOST_TEST_REQUIRE(plan.add(staged.back(), s));
    }
    return plan;
  };
  BOOST_TEST(!fsdp::detail::HostCopyPlan().add(torch::zeros({4}), torch::zeros({2, 2}).t().contiguous().t()));  // not contiguous
  BOOST_TEST(!fsdp::detail::HostCopyPlan().add(torch::zeros({4}, torch::kDouble), torch::zeros({4})));          // another dtype
  for (const int helpers : {0, 1, 3}) {
    std::vector<torch::Tensor> staged;
    fsdp::detail::BackgroundCopy copy(plan_of(staged), sources, /*chunk_bytes=*/1000);
    BOOST_TEST(!copy.finished());
    std::vector<std::thread> threads;
    for (int h = 0; h < helpers; ++h) threads.emplace_back([&] { copy.help(); });
    copy.finish(/*threads=*/helpers + 1);
    BOOST_TEST(copy.finished());
    for (std::size_t i = 0; i < sources.size(); ++i) BOOST_TEST(torch::equal(staged[i], sources[i]), "source " << i << ", " << helpers << " helpers");
    for (auto& t : threads) t.join();
    BOOST_TEST(!copy.sources_changed());
  }
  {
    std::vector<torch::Tensor> staged;
    fsdp::detail::BackgroundCopy copy(plan_of(staged), sources, 1000);
    copy.help();
    sources[2].add_(1);  // after the last chunk: not the copy's concern
    copy.finish();
    BOOST_TEST(!copy.sources_changed());
    sources[2].sub_(1);
  }
  {
    std::vector<torch::Tensor> staged;
    fsdp::detail::BackgroundCopy copy(plan_of(staged), sources, 1000);
    sources[1].mul_(1);  // an update before the copy ended
    copy.finish();
    BOOST_TEST(copy.sources_changed());
  }
  fsdp::detail::BackgroundCopy nothing(fsdp::detail::HostCopyPlan(), {});
  BOOST_TEST(nothing.finished());
  nothing.finish();
}
