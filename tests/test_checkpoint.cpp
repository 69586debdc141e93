// HDF5 checkpoints (run at np = 1..4): save with every strategy and load at every smaller world size
// and another strategy, FULL and LOCAL round trips, bit-exact resume, loading into a plain module,
// edge cases. The files themselves (corrupt and truncated files, keep_last and the latest pointer,
// h5dump, saves on some ranks only) are in test_checkpoint_files.cpp, part of the same executable.
#define BOOST_TEST_MODULE fsdp_checkpoint
#include <boost/test/unit_test.hpp>

#include "checkpoint_harness.hpp"

using CheckpointFixture = TorchMpiFixture<>;
BOOST_TEST_GLOBAL_FIXTURE(CheckpointFixture);

// ---- tests ------------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(sharded_save_loads_at_every_smaller_world_size_and_other_strategies) {
  auto world = MpiComm::world();
  TempDir dir(world);
  for (std::size_t si = 0; si < kStrategies.size(); ++si) {
    const auto strategy = kStrategies[si];
    BOOST_TEST_CONTEXT("saved with " << strategy << " at world size " << world.size()) {
      auto model = fsdp::make_fsdp(make_net(3), world, options_for(strategy, world.size(), true));
      auto opt = make_adam(*model);
      for (int s = 0; s < 3; ++s) train_step(*model, *opt, s);
      const auto expected = full_state(*model, opt.get());
      const auto expected_elsewhere = with_rank0_buffers(world, expected);  // rank-local buffers at another world size
      fsdp::TrainState state;
      state.step = 3;
      state.epoch = 1;
      state.sample_index = 24;
      state.scheduler = {{"last_epoch", 3}, {"base_lr", 1e-2}};
      state.data = {{"mixture_draws", 1000000000007}, {"source_1_epoch", 2}};
      state.deck = "[run]\nname = \"t\"\n";
      const std::string sub = "s" + std::to_string(si);
      const auto saved = fsdp::save_checkpoint(*model, opt.get(), dir / sub, state);
      BOOST_TEST(saved.path == dir / (sub + "/step_00000003.h5"));
      BOOST_TEST(fs::exists(saved.path));

      for (int k = 1; k <= world.size(); ++k) {
        auto sub_comm = world.split(world.rank() < k ? 0 : 1, world.rank());
        if (world.rank() >= k) continue;
        const auto load_strategy = kStrategies[(si + static_cast<std::size_t>(k)) % kStrategies.size()];
        BOOST_TEST_CONTEXT("loaded with " << load_strategy << " at world size " << k) {
          auto loaded = fsdp::make_fsdp(make_net(99), sub_comm, options_for(load_strategy, k, k % 2 == 0));
          auto opt2 = make_adam(*loaded);
          fsdp::TrainState got;
          fsdp::load_checkpoint(*loaded, opt2.get(), saved.path, &got);
          check_equal(k == world.size() ? expected : expected_elsewhere, full_state(*loaded, opt2.get()), "parameters, buffers and optimizer state");
          BOOST_TEST(got.step == 3);
          BOOST_TEST(got.epoch == 1);
          BOOST_TEST(got.sample_index == 24);
          BOOST_TEST(got.scheduler.at("base_lr") == 1e-2);
          BOOST_TEST((got.data == state.data));  // the application's data counters, whatever the state dict type
          BOOST_TEST(got.deck == state.deck);
          BOOST_TEST(got.rng_restored == (k == world.size()));
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(full_state_dict_round_trip_rank0_only_and_every_rank) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt = make_adam(*model);
  for (int s = 0; s < 2; ++s) train_step(*model, *opt, s);
  const auto expected = full_state(*model, opt.get());
  fsdp::CheckpointOptions o;
  o.state_dict_type = StateDictType::FULL_STATE_DICT;
  const auto saved = fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 2}, o);
  for (bool rank0_only : {true, false}) {
    BOOST_TEST_CONTEXT("rank0_only " << rank0_only) {
      auto loaded = fsdp::make_fsdp(make_net(5), world, options_for(ShardingStrategy::SHARD_GRAD_OP, world.size(), false));
      auto opt2 = make_adam(*loaded);
      o.rank0_only = rank0_only;
      fsdp::load_checkpoint(*loaded, opt2.get(), saved.path, nullptr, o);
      check_equal(expected, full_state(*loaded, opt2.get()), "full round trip");
    }
  }
}

BOOST_AUTO_TEST_CASE(local_state_dict_same_plan_only) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt = make_adam(*model);
  train_step(*model, *opt, 0);
  const auto expected = full_state(*model, opt.get());
  fsdp::CheckpointOptions o;
  o.state_dict_type = StateDictType::LOCAL_STATE_DICT;
  const auto saved = fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 1}, o);
  BOOST_TEST(fs::is_directory(saved.path));
  BOOST_TEST(fs::exists(fs::path(saved.path) / fsdp::ckpt::local_rank_file(world.rank())));
  // SHARD_GRAD_OP shards exactly like FULL_SHARD: same plan.
  auto same = fsdp::make_fsdp(make_net(8), world, options_for(ShardingStrategy::SHARD_GRAD_OP, world.size(), true));
  auto opt2 = make_adam(*same);
  fsdp::load_checkpoint(*same, opt2.get(), saved.path, nullptr, o);
  check_equal(expected, full_state(*same, opt2.get()), "local round trip");
  // Another wrapping is another plan: refused on every rank, naming the plan.
  auto other = fsdp::make_fsdp(make_net(8), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), false));
  auto opt3 = make_adam(*other);
  const auto before = full_state(*other, nullptr);
  try {
    fsdp::load_checkpoint(*other, opt3.get(), saved.path, nullptr, o);
    BOOST_ERROR("loading a LOCAL checkpoint into another plan must fail");
  } catch (const fsdp::CheckpointError& e) {
    const std::string what = e.what();
    BOOST_TEST(what.find("plan") != std::string::npos, what);
    BOOST_TEST(what.find("rank_0000") != std::string::npos, what);
  }
  check_equal(before, full_state(*other, nullptr), "a refused load changes nothing");
}

BOOST_AUTO_TEST_CASE(resume_is_bit_exact) {
  auto world = MpiComm::world();
  for (auto type : {StateDictType::SHARDED_STATE_DICT, StateDictType::FULL_STATE_DICT, StateDictType::LOCAL_STATE_DICT}) {
    BOOST_TEST_CONTEXT(fsdp::to_string(type)) {
      TempDir dir(world);
      torch::manual_seed(1234 + world.rank());  // dropout draws differ per rank, as in a real run
      auto straight = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
      auto opt = make_adam(*straight);
      torch::manual_seed(1234 + world.rank());
      for (int s = 0; s < 10; ++s) train_step(*straight, *opt, s);
      const auto expected = full_state(*straight, opt.get());

      fsdp::CheckpointOptions o;
      o.state_dict_type = type;
      {
        auto first = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
        auto opt1 = make_adam(*first);
        torch::manual_seed(1234 + world.rank());
        for (int s = 0; s < 5; ++s) train_step(*first, *opt1, s);
        fsdp::save_checkpoint(*first, opt1.get(), dir.path, {.step = 5, .epoch = 0, .sample_index = 5}, o);
      }
      torch::manual_seed(777);  // the restarted job's RNG starts elsewhere
      auto second = fsdp::make_fsdp(make_net(42), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
      auto opt2 = make_adam(*second);
      fsdp::TrainState state;
      const auto resumed = fsdp::resume_from_latest(*second, opt2.get(), dir.path, &state, o);
      BOOST_TEST(resumed.path == dir / "step_00000005.h5");
      BOOST_TEST(resumed.skipped.empty());
      BOOST_TEST(state.rng_restored);
      for (auto s = state.step; s < 10; ++s) train_step(*second, *opt2, static_cast<int>(s));
      check_equal(expected, full_state(*second, opt2.get()), "10 steps straight == 5 + save + load + 5");
    }
  }
}

BOOST_AUTO_TEST_CASE(full_file_loads_into_a_plain_module) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt = make_adam(*model);
  for (int s = 0; s < 2; ++s) train_step(*model, *opt, s);
  model->eval();
  const auto x = torch::randn({5, 11}, at::detail::createCPUGenerator(9));
  torch::Tensor fsdp_out;
  {
    torch::NoGradGuard ng;
    fsdp_out = model->forward(x);
  }
  fsdp::CheckpointOptions full;
  full.state_dict_type = StateDictType::FULL_STATE_DICT;
  const auto full_path = fsdp::save_checkpoint(*model, opt.get(), dir / "full", {.step = 2}, full).path;
  const auto sharded_path = fsdp::save_checkpoint(*model, opt.get(), dir / "sharded", {.step = 2}).path;
  if (world.rank() == 0) {
    for (const auto& path : {full_path, sharded_path}) {
      auto plain = make_net(11);
      fsdp::load_full_state_dict(*plain, path);
      plain->eval();
      torch::NoGradGuard ng;
      BOOST_TEST(torch::equal(plain->forward(x), fsdp_out), path);
    }
    // Strict checks name every problem and change nothing.
    struct Other : torch::nn::Module {
      Other() {
        register_module("fc1", torch::nn::Linear(11, 23));
        register_module("fc9", torch::nn::Linear(4, 4));
        register_module("fc2", torch::nn::Linear(23, 7));
      }
    } other;
    try {
      fsdp::load_full_state_dict(other, full_path);
      BOOST_ERROR("a different module must be refused");
    } catch (const fsdp::CheckpointError& e) {
      const std::string what = e.what();
      BOOST_TEST(what.find("missing fc9.weight") != std::string::npos, what);
      BOOST_TEST(what.find("unexpected bn.running_mean") != std::string::npos, what);
      BOOST_TEST(what.find("mismatched fc2.weight (file [23, 23] float32, module [7, 23] float32)") != std::string::npos, what);
    }
  }
  world.barrier();
}

BOOST_AUTO_TEST_CASE(buffers_stay_each_ranks_own_and_every_kind_of_checkpoint_gives_them_back) {
  // BufferSync::NONE, PyTorch FSDP's behaviour: BatchNorm's running statistics follow each rank's own
  // data. A checkpoint keeps every rank's copy of a buffer that differs (/rank_local/<buffer>), so a
  // load at the saving world size gives each rank its own; at another every rank takes rank 0's.
  // AVERAGE keeps them equal on every rank, and the file holds them once.
  auto world = MpiComm::world();
  TempDir dir(world);
  for (auto sync : {fsdp::BufferSync::NONE, fsdp::BufferSync::AVERAGE}) {
    auto options = options_for(ShardingStrategy::FULL_SHARD, world.size(), true);
    options.buffer_sync = sync;
    torch::manual_seed(1234 + world.rank());
    auto model = fsdp::make_fsdp(make_net(3), world, options);
    auto opt = make_adam(*model);
    for (int s = 0; s < 2; ++s) train_step(*model, *opt, s);
    const auto own = full_state(*model, opt.get());
    const auto rank0 = with_rank0_buffers(world, own);
    int differ = torch::equal(own.at("buffer/bn.running_mean"), rank0.at("buffer/bn.running_mean")) ? 0 : 1;
    world.all_reduce(&differ, &differ, 1, fsdp::DType::kInt32, fsdp::ReduceOp::kMax);
    BOOST_TEST(differ == (sync == fsdp::BufferSync::NONE && world.size() > 1 ? 1 : 0), "running statistics differ between ranks");
    for (auto type : {StateDictType::SHARDED_STATE_DICT, StateDictType::FULL_STATE_DICT, StateDictType::LOCAL_STATE_DICT}) {
      BOOST_TEST_CONTEXT(fsdp::to_string(sync) << " " << fsdp::to_string(type) << " at world size " << world.size()) {
        fsdp::CheckpointOptions o;
        o.state_dict_type = type;
        const auto sub = std::string(fsdp::to_string(sync)) + fsdp::to_string(type);
        const auto saved = fsdp::save_checkpoint(*model, opt.get(), dir / sub, {.step = 2}, o);
        if (type != StateDictType::LOCAL_STATE_DICT && world.rank() == 0) {
          fsdp::h5::Id file = fsdp::h5::open_file_readonly(saved.path);
          BOOST_TEST(fsdp::h5::exists(file, "/rank_local/bn.running_mean") == (differ == 1));
          BOOST_TEST(fsdp::h5::exists(file, "/rank_local/bn.running_var") == (differ == 1));
          BOOST_TEST(!fsdp::h5::exists(file, "/rank_local/bn.num_batches_tracked"), "the same on every rank: stored once");
        }
        world.barrier();
        auto loaded = fsdp::make_fsdp(make_net(9), world, options);
        auto opt2 = make_adam(*loaded);
        fsdp::load_checkpoint(*loaded, opt2.get(), saved.path, nullptr, o);
        check_equal(own, full_state(*loaded, opt2.get()), "at the saving world size: each rank's own buffers");
        if (type == StateDictType::LOCAL_STATE_DICT) {  // merged into one file: the differing buffers keep every rank's copy
          const auto merged = dir / (sub + ".h5");
          if (world.rank() == 0) fsdp::ckpt::merge_local(saved.path, merged);
          world.barrier();
          auto from_merged = fsdp::make_fsdp(make_net(9), world, options);
          auto opt4 = make_adam(*from_merged);
          fsdp::CheckpointOptions full;
          full.state_dict_type = StateDictType::FULL_STATE_DICT;
          fsdp::load_checkpoint(*from_merged, opt4.get(), merged, nullptr, full);
          check_equal(own, full_state(*from_merged, opt4.get()), "merged LOCAL checkpoint: each rank's own buffers");
        }
        if (type == StateDictType::LOCAL_STATE_DICT || world.size() == 1) continue;  // every rank alike
        auto fewer = world.split(world.rank() < world.size() - 1 ? 0 : 1, world.rank());
        if (world.rank() == world.size() - 1) continue;  // the last barrier is fewer's
        auto smaller = fsdp::make_fsdp(make_net(9), fewer, options_for(ShardingStrategy::FULL_SHARD, fewer.size(), true));
        auto opt3 = make_adam(*smaller);
        fsdp::TrainState state;
        fsdp::load_checkpoint(*smaller, opt3.get(), saved.path, &state, o);
        BOOST_TEST(!state.rng_restored);
        const auto got = full_state(*smaller, nullptr);
        for (const auto& name : {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"})
          BOOST_TEST(torch::equal(got.at(std::string("buffer/") + name), rank0.at(std::string("buffer/") + name)),
                     "at another world size: rank 0's " << name);
        fewer.barrier();
      }
    }
    world.barrier();
  }
}

/// Edge cases: a root unit without parameters (every layer wrapped), a bool and an int buffer, an
/// empty parameter, fp64 parameters, a frozen parameter.
struct EdgeImpl : torch::nn::Module {
  explicit EdgeImpl(bool with_empty = true) {
    a = register_module("a", torch::nn::Linear(5, 7));
    b = register_module("b", torch::nn::Linear(7, 3));
    a->to(torch::kDouble);
    b->to(torch::kDouble);
    b->bias.set_requires_grad(false);  // a frozen parameter: saved and loaded, no optimizer state
    empty = with_empty ? register_parameter("empty", torch::zeros({0, 4}, torch::kDouble)) : torch::zeros({0}, torch::kDouble);
    mask = register_buffer("mask", torch::tensor({true, false, true}));
    counter = register_buffer("counter", torch::tensor({7, 8}, torch::kLong));
  }
  torch::Tensor forward(torch::Tensor x) { return fsdp::forward(b, torch::tanh(fsdp::forward(a, x))) * mask.to(torch::kDouble) + empty.sum(); }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::Tensor empty, mask, counter;
};
TORCH_MODULE(Edge);

BOOST_AUTO_TEST_CASE(edge_cases_round_trip_in_every_kind) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto make = [&](int seed) {
    torch::manual_seed(seed);
    auto net = Edge().ptr();
    FsdpOptions o;
    o.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear"});
    o.buffer_sync = fsdp::BufferSync::NONE;  // the bool buffer cannot be averaged
    return fsdp::make_fsdp(net, world, o);
  };
  auto model = make(1);
  BOOST_TEST(model->sharded_units()[0].param_names.size() == 1u);  // only the empty parameter stays in the root
  auto opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto x = torch::randn({4, 5}, torch::kDouble);
  opt->zero_grad();
  model->forward(x).sum().backward();
  opt->step();
  std::map<std::string, torch::Tensor> expected;
  for (auto& [n, t] : model->full_parameters()) expected[n] = t;
  for (auto type : {StateDictType::SHARDED_STATE_DICT, StateDictType::FULL_STATE_DICT, StateDictType::LOCAL_STATE_DICT}) {
    BOOST_TEST_CONTEXT(fsdp::to_string(type)) {
      fsdp::CheckpointOptions o;
      o.state_dict_type = type;
      o.keep_last = 1;
      // The same step twice: the second save replaces the first (LOCAL: an atomic folder swap).
      fsdp::save_checkpoint(*model, opt.get(), dir / fsdp::to_string(type), {.step = 1}, o);
      const auto saved = fsdp::save_checkpoint(*model, opt.get(), dir / fsdp::to_string(type), {.step = 1}, o);
      auto loaded = make(2);
      {
        torch::NoGradGuard ng;
        loaded->module()->mask.fill_(false);
        loaded->module()->counter.fill_(0);
      }
      auto opt2 = std::make_unique<torch::optim::SGD>(loaded->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      fsdp::load_checkpoint(*loaded, opt2.get(), saved.path, nullptr, o);
      for (auto& [n, t] : loaded->full_parameters()) BOOST_TEST(torch::equal(expected.at(n), t), n);
      BOOST_TEST(torch::equal(loaded->module()->mask, torch::tensor({true, false, true})));
      BOOST_TEST(torch::equal(loaded->module()->counter, torch::tensor({7, 8}, torch::kLong)));
      if (type != StateDictType::LOCAL_STATE_DICT && world.rank() == 0) {
        auto plain = Edge();
        fsdp::load_full_state_dict(*plain, saved.path);
        BOOST_TEST(torch::equal(plain->a->weight, expected.at("a.weight")));
        BOOST_TEST(torch::equal(plain->mask, torch::tensor({true, false, true})));
      }
      world.barrier();
    }
  }
}

BOOST_AUTO_TEST_CASE(a_root_unit_without_parameters_round_trips) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto make = [&](int seed) {
    torch::manual_seed(seed);
    FsdpOptions o;
    o.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear"});
    o.buffer_sync = fsdp::BufferSync::NONE;
    return fsdp::make_fsdp(std::make_shared<EdgeImpl>(false), world, o);
  };
  auto model = make(1);
  BOOST_TEST(model->sharded_units()[0].empty());
  for (auto type : {StateDictType::SHARDED_STATE_DICT, StateDictType::FULL_STATE_DICT, StateDictType::LOCAL_STATE_DICT}) {
    fsdp::CheckpointOptions o;
    o.state_dict_type = type;
    const auto saved = fsdp::save_checkpoint(*model, nullptr, dir / fsdp::to_string(type), {.step = 3}, o);
    auto loaded = make(2);
    fsdp::load_checkpoint(*loaded, nullptr, saved.path, nullptr, o);
    const auto a = model->full_parameters(), b = loaded->full_parameters();
    for (std::size_t i = 0; i < a.size(); ++i) BOOST_TEST(torch::equal(a[i].second, b[i].second), fsdp::to_string(type) << " " << a[i].first);
  }
}

BOOST_AUTO_TEST_CASE(optimizer_state_sharded_over_the_world_round_trips_and_resumes_exactly) {
  // fsdp.optimizer_sharding = world stores optimizer state shaped like the shards (the replicas' parts
  // gathered), so SHARDED and FULL checkpoints move freely between it and every other strategy and
  // world size, and a LOCAL one between it and the same plan with the optimizer sharded over the group.
  auto world = MpiComm::world();
  TempDir dir(world);
  auto world_sharded = [&](MpiComm comm, int seed, int group) {
    auto o = options_for(ShardingStrategy::HYBRID_SHARD, comm.size(), true);
    o.shard_group_size = group;
    o.optimizer_sharding = fsdp::OptimizerSharding::WORLD;
    return fsdp::make_fsdp(make_net(seed), std::move(comm), o);
  };
  std::vector<int> groups = {1};
  if (world.size() % 2 == 0 && world.size() > 2) groups.push_back(2);
  for (const int group : groups) {
    for (auto type : {StateDictType::SHARDED_STATE_DICT, StateDictType::FULL_STATE_DICT, StateDictType::LOCAL_STATE_DICT}) {
      BOOST_TEST_CONTEXT("group " << group << " " << fsdp::to_string(type) << " at world size " << world.size()) {
        fsdp::CheckpointOptions o;
        o.state_dict_type = type;
        torch::manual_seed(1234 + world.rank());
        auto straight = world_sharded(world, 3, group);
        auto opt = make_adam(*straight);
        for (int s = 0; s < 3; ++s) train_step(*straight, *opt, s);
        const auto at_save = full_state(*straight, opt.get());
        const auto at_save_elsewhere = with_rank0_buffers(world, at_save);  // rank-local buffers at another world size
        const std::string sub = "w" + std::to_string(group) + fsdp::to_string(type);
        const auto saved = fsdp::save_checkpoint(*straight, opt.get(), dir / sub, {.step = 3}, o);
        for (int s = 3; s < 5; ++s) train_step(*straight, *opt, s);
        const auto expected = full_state(*straight, opt.get());

        // Resumed with the same layout: bit for bit.
        auto resumed = world_sharded(world, 42, group);
        auto opt2 = make_adam(*resumed);
        fsdp::TrainState state;
        fsdp::load_checkpoint(*resumed, opt2.get(), saved.path, &state, o);
        BOOST_TEST(state.rng_restored);
        check_equal(at_save, full_state(*resumed, opt2.get()), "loaded into the same layout");
        for (int s = 3; s < 5; ++s) train_step(*resumed, *opt2, s);
        check_equal(expected, full_state(*resumed, opt2.get()), "5 steps straight == 3 + save + load + 2");

        if (type == StateDictType::LOCAL_STATE_DICT) {
          auto by_group = fsdp::make_fsdp(make_net(8), world, [&] {
            auto g = options_for(ShardingStrategy::HYBRID_SHARD, world.size(), true);
            g.shard_group_size = group;
            return g;
          }());
          auto opt3 = make_adam(*by_group);
          fsdp::load_checkpoint(*by_group, opt3.get(), saved.path, nullptr, o);
          check_equal(at_save, full_state(*by_group, opt3.get()), "LOCAL into the optimizer sharded over the group");
          continue;
        }
        // Into every other strategy, at every smaller world size.
        for (int k = 1; k <= world.size(); ++k) {
          auto sub_comm = world.split(world.rank() < k ? 0 : 1, world.rank());
          if (world.rank() >= k) continue;
          for (const auto strategy : kStrategies) {
            BOOST_TEST_CONTEXT("loaded with " << strategy << " at world size " << k) {
              auto loaded = fsdp::make_fsdp(make_net(99), sub_comm, options_for(strategy, k, k % 2 == 0));
              auto opt3 = make_adam(*loaded);
              fsdp::load_checkpoint(*loaded, opt3.get(), saved.path, nullptr, o);
              check_equal(k == world.size() ? at_save : at_save_elsewhere, full_state(*loaded, opt3.get()),
                          "parameters, buffers and optimizer state");
            }
          }
          // ... and back: a checkpoint of another strategy into the world-sharded optimizer.
          auto plain = fsdp::make_fsdp(make_net(99), sub_comm, options_for(ShardingStrategy::FULL_SHARD, k, true));
          auto opt4 = make_adam(*plain);
          fsdp::load_checkpoint(*plain, opt4.get(), saved.path, nullptr, o);
          const std::string again = dir / (sub + "_k" + std::to_string(k));
          const auto resaved = fsdp::save_checkpoint(*plain, opt4.get(), again, {.step = 3}, o);
          auto back = world_sharded(sub_comm, 7, 1);
          auto opt5 = make_adam(*back);
          fsdp::load_checkpoint(*back, opt5.get(), resaved.path, nullptr, o);
          check_equal(k == world.size() ? at_save : at_save_elsewhere, full_state(*back, opt5.get()),
                      "from FULL_SHARD into optimizer_sharding = world");
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(bf16_moments_resume_exactly_and_load_into_either_setting) {
  // optim.state_dtype = "bf16": the moments are stored as they are (bf16 datasets), a resume repeats
  // the straight run bit for bit (the rounding draws from the step and the element's place), and a
  // checkpoint loads into fp32 moments and back.
  auto world = MpiComm::world();
  auto make_bf16_adam = [](Engine& e) {
    return std::make_unique<fsdp::optim::AdamBf16Moments>(e.parameters(), torch::optim::AdamOptions(1e-2), fsdp::optim::places_in_units(e));
  };
  auto make_model = [&world](int seed) {
    return fsdp::make_fsdp(make_net(seed), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  };
  auto optimizer_entries = [](const std::map<std::string, torch::Tensor>& state) {
    std::map<std::string, torch::Tensor> out;
    for (const auto& [k, v] : state)
      if (k.rfind("optim/", 0) == 0 && k.find("/step") == std::string::npos) out[k] = v;
    return out;
  };
  for (auto type : {StateDictType::SHARDED_STATE_DICT, StateDictType::FULL_STATE_DICT, StateDictType::LOCAL_STATE_DICT}) {
    BOOST_TEST_CONTEXT(fsdp::to_string(type)) {
      TempDir dir(world);
      fsdp::CheckpointOptions o;
      o.state_dict_type = type;
      auto straight = make_model(3);
      auto opt = make_bf16_adam(*straight);
      torch::manual_seed(1234 + world.rank());
      for (int s = 0; s < 6; ++s) train_step(*straight, *opt, s);
      const auto expected = full_state(*straight, opt.get());

      std::map<std::string, torch::Tensor> at_save;
      std::string saved;
      {
        auto first = make_model(3);
        auto opt1 = make_bf16_adam(*first);
        torch::manual_seed(1234 + world.rank());
        for (int s = 0; s < 3; ++s) train_step(*first, *opt1, s);
        at_save = full_state(*first, opt1.get());
        saved = fsdp::save_checkpoint(*first, opt1.get(), dir.path, {.step = 3, .epoch = 0, .sample_index = 3}, o).path;
      }
      const auto moments = optimizer_entries(at_save);
      BOOST_TEST_REQUIRE(!moments.empty());
      for (const auto& [k, v] : moments) BOOST_TEST((v.scalar_type() == torch::kBFloat16), k);
      if (type != StateDictType::LOCAL_STATE_DICT && world.rank() == 0) {  // stored as they are
        fsdp::h5::Id file = fsdp::h5::open_file_readonly(saved);
        fsdp::h5::Id ds = fsdp::h5::open_dataset(file, "/optim/fc1.weight/exp_avg", saved);
        BOOST_TEST((fsdp::detail::tensor_element_type(ds, saved) == fsdp::h5::ElementType::kBFloat16));
      }

      torch::manual_seed(777);
      auto second = make_model(42);
      auto opt2 = make_bf16_adam(*second);
      fsdp::TrainState state;
      fsdp::resume_from_latest(*second, opt2.get(), dir.path, &state, o);
      for (auto s = state.step; s < 6; ++s) train_step(*second, *opt2, static_cast<int>(s));
      check_equal(expected, full_state(*second, opt2.get()), "6 steps straight == 3 + save + load + 3, bf16 moments");

      // Into torch's Adam: fp32 moments holding the bf16 values exactly.
      auto into_fp32 = make_model(42);
      auto adam = make_adam(*into_fp32);
      fsdp::load_checkpoint(*into_fp32, adam.get(), saved, nullptr, o);
      auto as_fp32 = optimizer_entries(full_state(*into_fp32, adam.get()));
      std::map<std::string, torch::Tensor> widened;
      for (const auto& [k, v] : moments) widened[k] = v.to(torch::kFloat);
      check_equal(widened, as_fp32, "bf16 moments loaded into fp32 moments");
      for (const auto& [k, v] : as_fp32) BOOST_TEST((v.scalar_type() == torch::kFloat), k);

      // And back: that fp32 state, saved and loaded into bf16 moments, is the same bf16 values.
      TempDir back(world);
      const auto fp32_saved = fsdp::save_checkpoint(*into_fp32, adam.get(), back.path, {.step = 3, .epoch = 0, .sample_index = 3}, o).path;
      auto into_bf16 = make_model(43);
      auto opt3 = make_bf16_adam(*into_bf16);
      fsdp::load_checkpoint(*into_bf16, opt3.get(), fp32_saved, nullptr, o);
      check_equal(moments, optimizer_entries(full_state(*into_bf16, opt3.get())), "fp32 moments loaded into bf16 moments");
    }
  }
}
