// The sharding engine against single-process training on the same global batch (run at np = 1..4).
// Every rank computes the single-process reference itself (same seed, whole global batch), trains
// the FSDP model on its slice of the batch, gathers the full parameters and compares. One executable,
// one file per feature: this one (the module) has every strategy, policy, training control, optimizer,
// offload, frozen parameters and bf16 against the reference; test_engine_units.cpp the units, state
// and errors; test_engine_memory.cpp what is resident when; test_engine_overlap.cpp prefetching,
// overlapped reductions and autograd corner cases.
#define BOOST_TEST_MODULE fsdp_engine
#include <boost/test/unit_test.hpp>

#include "engine_harness.hpp"

using EngineFixture = TorchMpiFixture<MPI_THREAD_MULTIPLE>;  // prefetching runs collectives on a worker thread
BOOST_TEST_GLOBAL_FIXTURE(EngineFixture);

BOOST_AUTO_TEST_CASE(every_strategy_and_policy_matches_single_process) {
  const int world = MpiComm::world().size();
  for (auto kind : {ModelKind::kMlp, ModelKind::kCnn}) {
    for (auto optim : {OptimKind::kSgd, OptimKind::kAdam}) {
      const auto ref = train_reference(kind, optim, world);
      for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD}) {
        for (const auto& [policy_name, policy] : policies()) {
          BOOST_TEST_CONTEXT("np=" << world << " model=" << name_of(kind) << " optim=" << name_of(optim) << " strategy=" << fsdp::to_string(strategy)
                                   << " policy=" << policy_name) {
            FsdpOptions options;
            options.sharding_strategy = strategy;
            options.auto_wrap_policy = policy;
            const auto got = train_fsdp(kind, optim, options);
            BOOST_TEST(got.params.size() == (kind == ModelKind::kMlp ? 10u : 8u));
            const double err = compare(got.params, ref.params);
            BOOST_TEST(err <= 1e-5);
            check_ranks_agree(got.params);
          }
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(hybrid_strategies_match_single_process_for_every_group_size) {
  const int world = MpiComm::world().size();
  for (auto kind : {ModelKind::kMlp, ModelKind::kCnn}) {
    const auto ref = train_reference(kind, OptimKind::kAdam, world);
    for (int group = 1; group <= world; ++group) {
      if (world % group != 0) continue;
      for (auto strategy : {ShardingStrategy::HYBRID_SHARD, ShardingStrategy::HYBRID_SHARD_ZERO2}) {
        BOOST_TEST_CONTEXT("np=" << world << " group=" << group << " model=" << name_of(kind) << " strategy=" << fsdp::to_string(strategy)) {
          FsdpOptions options;
          options.sharding_strategy = strategy;
          options.shard_group_size = group;
          options.auto_wrap_policy = AutoWrapPolicy::size_based(200);
          const auto got = train_fsdp(kind, OptimKind::kAdam, options);
          BOOST_TEST(compare(got.params, ref.params) <= 1e-5);
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(training_controls_match_single_process) {
  const int world = MpiComm::world().size();
  const std::vector<std::pair<std::string, Setup>> setups = {
      {"clip", Setup{.clip = 0.05}},
      {"accumulate3", Setup{.accum = 3}},
      {"clip+accumulate2", Setup{.clip = 0.05, .accum = 2}},
      {"sync_module_states", Setup{.different_init = true}},
  };
  for (const auto& [setup_name, setup] : setups) {
    for (auto optim : {OptimKind::kSgd, OptimKind::kAdam}) {
      const auto ref = train_reference(ModelKind::kMlp, optim, world, setup);
      for (const auto& [strategy, group] : strategies_and_groups(world)) {
        BOOST_TEST_CONTEXT("np=" << world << " " << setup_name << " optim=" << name_of(optim) << " strategy=" << strategy << " group=" << group) {
          FsdpOptions options;
          options.sharding_strategy = strategy;
          options.shard_group_size = group;
          options.auto_wrap_policy = AutoWrapPolicy::size_based(200);
          options.sync_module_states = setup.different_init;
          const auto got = train_fsdp(ModelKind::kMlp, optim, options, setup);
          BOOST_TEST(compare(got.params, ref.params) <= 1e-5);
          BOOST_TEST_REQUIRE(got.norms.size() == ref.norms.size());
          for (std::size_t i = 0; i < got.norms.size(); ++i) {
            BOOST_TEST(got.norms[i] == ref.norms[i], boost::test_tools::tolerance(1e-5));
            BOOST_TEST(got.norms[i] > setup.clip);  // clipping was active
          }
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(other_optimizers_run_on_shards) {
  const int world = MpiComm::world().size();
  for (auto optim : {OptimKind::kAdamW, OptimKind::kAdagrad, OptimKind::kRmsprop, OptimKind::kAdadelta}) {
    BOOST_TEST_CONTEXT("np=" << world << " optim=" << name_of(optim)) {
      const auto ref = train_reference(ModelKind::kMlp, optim, world);
      FsdpOptions options;
      options.auto_wrap_policy = AutoWrapPolicy::size_based(200);
      BOOST_TEST(compare(train_fsdp(ModelKind::kMlp, optim, options).params, ref.params) <= 1e-5);
    }
  }
}

BOOST_AUTO_TEST_CASE(cpu_offload_on_a_cpu_device_gives_identical_results) {
  // offload_params keeps shards, gradients and optimizer state in host memory; on a CPU compute device
  // that is where they are anyway, so every strategy must give bit-identical parameters to no offload
  // (and match single-process training like any run).
  const int world = MpiComm::world().size();
  const auto ref = train_reference(ModelKind::kCnn, OptimKind::kAdam, world);
  for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD}) {
    BOOST_TEST_CONTEXT("np=" << world << " strategy=" << fsdp::to_string(strategy)) {
      FsdpOptions options;
      options.sharding_strategy = strategy;
      options.auto_wrap_policy = AutoWrapPolicy::size_based(200);
      const auto plain = train_fsdp(ModelKind::kCnn, OptimKind::kAdam, options);
      options.offload_params = true;
      const auto offloaded = train_fsdp(ModelKind::kCnn, OptimKind::kAdam, options);
      BOOST_TEST(compare(offloaded.params, ref.params) <= 1e-5);
      for (const auto& [name, t] : offloaded.params) BOOST_TEST(torch::equal(t, plain.params.at(name)), "offload changed " << name);
    }
  }
}

BOOST_AUTO_TEST_CASE(frozen_parameters_match_single_process) {
  const int world = MpiComm::world().size();
  Setup setup;
  setup.freeze = true;
  setup.clip = 0.5;  // frozen parameters must not count in the norm either
  for (auto kind : {ModelKind::kMlp, ModelKind::kCnn}) {
    const auto ref = train_reference(kind, OptimKind::kAdam, world, setup);
    for (const auto& [strategy, group] : strategies_and_groups(world)) {
      for (const auto& [policy_name, policy] : policies()) {
        BOOST_TEST_CONTEXT("np=" << world << " model=" << name_of(kind) << " strategy=" << fsdp::to_string(strategy) << " group=" << group
                                 << " policy=" << policy_name) {
          FsdpOptions options;
          options.sharding_strategy = strategy;
          options.shard_group_size = group;
          options.auto_wrap_policy = policy;
          const auto got = train_fsdp(kind, OptimKind::kAdam, options, setup);
          BOOST_TEST(compare(got.params, ref.params) <= 1e-5);
          for (std::size_t i = 0; i < got.norms.size(); ++i)
            BOOST_TEST(std::abs(got.norms[i] - ref.norms[i]) <= 1e-5 * ref.norms[i], "norm of step " << i);
        }
      }
    }
  }
  // Frozen parameters: no gradient, no optimizer state, not in parameters().
  auto net = std::static_pointer_cast<MlpImpl>(make_model(ModelKind::kMlp));
  freeze(*net);
  FsdpOptions options;
  options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear", "Scale", "TiedOut"});
  auto model = fsdp::make_fsdp(net, MpiComm::world(), options);
  std::int64_t trainable_shard = 0, frozen_units = 0;
  for (const auto& u : model->units()) {
    if (u.frozen)
      ++frozen_units;
    else
      trainable_shard += u.shard_numel;
  }
  BOOST_TEST(frozen_units == 3);  // root (tied fc1.weight), fc2 (bias), scale (alpha)
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  auto x = torch::randn({4, 13});
  opt.zero_grad();
  model->forward(x).sum().backward();
  opt.step();
  const auto m = model->memory_stats(&opt);
  BOOST_TEST(m.grad_bytes == trainable_shard * 4);
  BOOST_TEST(m.optimizer_state_bytes == 2 * trainable_shard * 4);
  {
    auto full = model->summon_full_params();
    BOOST_TEST(torch::equal(net->fc1->weight, net->tied->weight));
    BOOST_TEST(!net->fc1->weight.requires_grad());
  }
  BOOST_TEST(model->describe().find("frozen") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(bf16_mixed_precision_tracks_fp32_and_halves_the_bytes) {
  auto world = MpiComm::world();
  const int n = world.size();
  constexpr int kMpSteps = 50;
  struct Run {
    std::vector<double> losses;
    fsdp::CommCounters first_step;
  };
  auto train = [&](const fsdp::MixedPrecision& mp, ShardingStrategy strategy, int group, fsdp::OptimizerSharding optimizer_sharding) {
    auto net = std::static_pointer_cast<MlpImpl>(make_model(ModelKind::kMlp));
    FsdpOptions options;
    options.sharding_strategy = strategy;
    options.shard_group_size = group;
    options.optimizer_sharding = optimizer_sharding;
    options.auto_wrap_policy = AutoWrapPolicy::size_based(200);
    options.mixed_precision = mp;
    auto model = fsdp::make_fsdp(net, world, options);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(3e-3));
    for (const auto& p : model->parameters()) BOOST_TEST((p.scalar_type() == torch::kFloat), "master shards stay fp32");
    Run run;
    for (int step = 0; step < kMpSteps; ++step) {
      auto batch = global_batch(ModelKind::kMlp, step % 8, kLocalRows * n);
      auto x = batch.x.narrow(0, world.rank() * kLocalRows, kLocalRows);
      auto y = batch.y.narrow(0, world.rank() * kLocalRows, kLocalRows);
      model->comm().reset_counters();
      model->shard_comm().reset_counters();
      model->replica_comm().reset_counters();
      opt.zero_grad();
      auto out = model->forward(x);
      if (mp.param_dtype) BOOST_TEST((out.scalar_type() == *mp.param_dtype));
      auto loss = F::mse_loss(out.to(torch::kFloat), y);
      loss.backward();
      opt.step();
      if (step == 0) run.first_step = model->comm_counters();
      float global = loss.item<float>();
      world.all_reduce(&global, &global, 1, fsdp::DType::kFloat32, fsdp::ReduceOp::kAvg);
      run.losses.push_back(global);
    }
    // Inside summon_full_params the parameters are the full-precision masters.
    const auto full = model->full_parameters();
    {
      auto scope = model->summon_full_params();
      BOOST_TEST((net->fc2->weight.scalar_type() == torch::kFloat));
      BOOST_TEST(torch::equal(net->fc2->weight, std::find_if(full.begin(), full.end(), [](auto& p) { return p.first == "fc2.weight"; })->second));
    }
    return run;
  };
  std::vector<std::tuple<ShardingStrategy, int, fsdp::OptimizerSharding>> cases;
  for (const auto& [strategy, group] : strategies_and_groups(n)) {
    cases.emplace_back(strategy, group, fsdp::OptimizerSharding::GROUP);
    if (strategy == ShardingStrategy::HYBRID_SHARD && group < n) cases.emplace_back(strategy, group, fsdp::OptimizerSharding::WORLD);
  }
  for (const auto& [strategy, group, optimizer_sharding] : cases) {
    BOOST_TEST_CONTEXT("np=" << n << " strategy=" << fsdp::to_string(strategy) << " group=" << group << " optimizer over "
                             << fsdp::to_string(optimizer_sharding)) {
      const auto fp32 = train({}, strategy, group, optimizer_sharding);
      const auto bf16 = train(fsdp::MixedPrecision::bf16(), strategy, group, optimizer_sharding);
      // Documented tolerance: the bf16 loss stays within 5% (+1e-3) of the fp32 loss at every step.
      for (int step = 0; step < kMpSteps; ++step)
        BOOST_TEST(std::abs(bf16.losses[step] - fp32.losses[step]) <= 0.05 * fp32.losses[step] + 1e-3,
                   "step " << step << ": bf16 " << bf16.losses[step] << " vs fp32 " << fp32.losses[step]);
      BOOST_TEST(bf16.losses.back() < 0.9 * bf16.losses.front(), "bf16 training learns: " << bf16.losses.front() << " -> " << bf16.losses.back());
      // The collectives of the model move exactly half the bytes (the loss average above is not counted).
      BOOST_TEST(2 * bf16.first_step.all_gather_bytes == fp32.first_step.all_gather_bytes);
      BOOST_TEST(2 * bf16.first_step.reduce_scatter_bytes == fp32.first_step.reduce_scatter_bytes);
      BOOST_TEST(2 * bf16.first_step.all_reduce_bytes == fp32.first_step.all_reduce_bytes);
      const auto moved = bf16.first_step.all_gather_bytes + bf16.first_step.reduce_scatter_bytes + bf16.first_step.all_reduce_bytes;
      BOOST_TEST((moved > 0u || n == 1));
    }
  }
}

BOOST_AUTO_TEST_CASE(reshard_after_forward_group_gathers_backward_inside_the_group_and_changes_no_result) {
  // FSDP2's integer reshard_after_forward: after a training forward each rank keeps 1/g of a unit, and
  // backward all-gathers it inside its group of g ranks. The same values are gathered, so the result
  // is bit-identical to resharding fully; what backward gathered over the shard group moves into the
  // groups instead (each rank then sends world/g times its shard). Shard groups without a smaller
  // divisor (1, 2 and 3 ranks) refuse it.
  const int world = MpiComm::world().size();
  for (const auto kind : {ModelKind::kMlp, ModelKind::kCnn}) {
    for (const auto& [prefetch, bf16, checkpointing] :
         {std::tuple{false, false, false}, std::tuple{true, false, false}, std::tuple{false, true, false}, std::tuple{true, false, true}}) {
      BOOST_TEST_CONTEXT("np=" << world << " model=" << name_of(kind) << " prefetch=" << prefetch << " bf16=" << bf16
                               << " activation checkpointing=" << checkpointing) {
        FsdpOptions options;
        options.sharding_strategy = ShardingStrategy::FULL_SHARD;
        options.auto_wrap_policy = kind == ModelKind::kCnn ? AutoWrapPolicy::module_types({"Conv2d", "Linear"}) : AutoWrapPolicy::size_based(200);
        if (prefetch) options.backward_prefetch = fsdp::BackwardPrefetch::BACKWARD_PRE;
        if (bf16) options.mixed_precision = fsdp::MixedPrecision::bf16();
        options.activation_checkpointing = checkpointing;
        if (world < 4) {
          options.reshard_after_forward_group = 2;
          BOOST_CHECK_EXCEPTION(train_fsdp(kind, OptimKind::kAdam, options), fsdp::ConfigError, [&](const fsdp::ConfigError& e) {
            return std::string(e.what()).find("reshard_after_forward_group: 2 does not divide the shard group of " + std::to_string(world)) !=
                   std::string::npos;
          });
          continue;
        }
        const auto plain = train_fsdp(kind, OptimKind::kAdam, options);
        options.reshard_after_forward_group = 2;
        const auto kept = train_fsdp(kind, OptimKind::kAdam, options);
        for (const auto& [name, t] : kept.params) BOOST_TEST(torch::equal(t, plain.params.at(name)), "a kept group shard changed " << name);
        BOOST_TEST(plain.forward_group.all_gather_bytes == 0u);
        BOOST_TEST(kept.forward_group.all_gather_bytes > 0u);
        const auto moved_out_of_shard_group = plain.comm.all_gather_bytes - (kept.comm.all_gather_bytes - kept.forward_group.all_gather_bytes);
        BOOST_TEST(moved_out_of_shard_group * static_cast<std::uint64_t>(world / 2) == kept.forward_group.all_gather_bytes);
      }
    }
  }
  FsdpOptions contradictory;
  contradictory.reshard_after_forward = false;
  contradictory.reshard_after_forward_group = 2;
  BOOST_CHECK_THROW(train_fsdp(ModelKind::kMlp, OptimKind::kAdam, contradictory), fsdp::ConfigError);
}

BOOST_AUTO_TEST_CASE(optimizer_state_sharded_over_the_world_matches_single_process) {
  // HFSDP: parameters sharded inside each group, optimizer state over every rank. Gradients are
  // reduce-scattered across the replicas instead of all-reduced and the updated parts all-gathered
  // back, so the trajectory equals single-process training (whole-model error, see compare()) while
  // each rank holds 1/world of the optimizer state instead of 1/group.
  const int world = MpiComm::world().size();
  const std::vector<std::pair<std::string, Setup>> setups = {{"plain", Setup{}}, {"clip+accumulate2", Setup{.clip = 0.05, .accum = 2}}};
  for (const auto kind : {ModelKind::kMlp, ModelKind::kCnn}) {
    for (const auto optim : {OptimKind::kAdam, OptimKind::kSgd}) {
      for (const auto& [setup_name, setup] : setups) {
        if (kind == ModelKind::kCnn && (setup_name != "plain" || optim != OptimKind::kAdam)) continue;
        const auto ref = train_reference(kind, optim, world, setup);
        for (int group = 1; group <= world; ++group) {
          if (world % group != 0) continue;
          for (const auto strategy : {ShardingStrategy::HYBRID_SHARD, ShardingStrategy::HYBRID_SHARD_ZERO2}) {
            for (const bool overlap : {false, true}) {
              if (strategy == ShardingStrategy::HYBRID_SHARD_ZERO2 && overlap) continue;  // overlap, prefetch and checkpointing: under HYBRID_SHARD
              BOOST_TEST_CONTEXT("np=" << world << " group=" << group << " model=" << name_of(kind) << " optim=" << name_of(optim) << " "
                                       << setup_name << " strategy=" << strategy << " overlap, prefetch, activation checkpointing=" << overlap) {
                FsdpOptions options;
                options.sharding_strategy = strategy;
                options.shard_group_size = group;
                options.auto_wrap_policy = AutoWrapPolicy::size_based(200);
                options.overlap_grad_reduce = overlap;
                options.backward_prefetch = overlap ? fsdp::BackwardPrefetch::BACKWARD_PRE : fsdp::BackwardPrefetch::NO_PREFETCH;
                options.activation_checkpointing = overlap;  // and the anchor of a recomputed unit is the optimizer's part
                const auto by_group = train_fsdp(kind, optim, options, setup);
                options.optimizer_sharding = fsdp::OptimizerSharding::WORLD;
                const auto by_world = train_fsdp(kind, optim, options, setup);
                BOOST_TEST(compare(by_world.params, ref.params) <= 1e-5);
                check_ranks_agree(by_world.params);
                BOOST_TEST_REQUIRE(by_world.norms.size() == ref.norms.size());
                for (std::size_t i = 0; i < by_world.norms.size(); ++i)
                  BOOST_TEST(by_world.norms[i] == ref.norms[i], boost::test_tools::tolerance(1e-5));
                // Each replica updates ceil(shard / replicas) elements of each unit's group shard.
                const std::int64_t replicas = world / group;
                BOOST_TEST(by_world.optimized_elements * replicas >= by_group.optimized_elements);
                BOOST_TEST(by_world.optimized_elements * replicas < by_group.optimized_elements + replicas * 16);
                if (optim == OptimKind::kAdam)  // exp_avg and exp_avg_sq of what the rank updates
                  BOOST_TEST(by_world.optimizer_state_bytes == 2 * 4 * by_world.optimized_elements);
              }
            }
          }
        }
      }
    }
  }
  for (const auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD}) {
    FsdpOptions options;
    options.sharding_strategy = strategy;
    options.optimizer_sharding = fsdp::OptimizerSharding::WORLD;
    BOOST_CHECK_EXCEPTION(train_fsdp(ModelKind::kMlp, OptimKind::kAdam, options), fsdp::ConfigError, [](const fsdp::ConfigError& e) {
      return std::string(e.what()).find("applies to the hybrid strategies") != std::string::npos;
    });
  }
}

BOOST_AUTO_TEST_CASE(a_slice_kept_for_a_backward_that_never_came_is_not_used_after_a_step) {
  // A forward with gradients on but no backward, then an SGD step: LibTorch's SGD writes the shards
  // through .data(), which leaves their version counters alone, so a slice kept by that forward must
  // not stand in for the updated shard in the next forward.
  const int world = MpiComm::world().size();
  if (world < 4) return;  // reshard_after_forward_group needs a shard group with a smaller divisor
  auto run = [&](int kept_group) {
    auto net = std::static_pointer_cast<MlpImpl>(make_model(ModelKind::kMlp));
    FsdpOptions options;
    options.auto_wrap_policy = AutoWrapPolicy::size_based(200);
    options.reshard_after_forward_group = kept_group;
    auto model = fsdp::make_fsdp(net, MpiComm::world(), options);
    auto opt = make_optimizer(OptimKind::kSgd, model->parameters());
    const int r = MpiComm::world().rank();
    auto batch = global_batch(ModelKind::kMlp, 0, kLocalRows * world);
    auto x = batch.x.narrow(0, r * kLocalRows, kLocalRows), y = batch.y.narrow(0, r * kLocalRows, kLocalRows);
    loss_of(ModelKind::kMlp, model->forward(x), y).backward();
    opt->step();                                           // momentum established
    (void)loss_of(ModelKind::kMlp, model->forward(x), y);  // slices kept, no backward
    opt->step();                                           // zero gradients, but momentum moves the weights
    opt->zero_grad();
    loss_of(ModelKind::kMlp, model->forward(x), y).backward();
    opt->step();
    return model->full_parameters();
  };
  const auto plain = run(0), kept = run(2);
  for (std::size_t i = 0; i < plain.size(); ++i) BOOST_TEST(torch::equal(plain[i].second, kept[i].second), "stale kept slice in " << plain[i].first);
}

BOOST_AUTO_TEST_CASE(a_replica_part_past_a_small_shard_is_padding) {
  // One element over 3 replicas: parts [0, 1), [1, 2), [2, 3); the last two lie past the shard.
  fsdp::ShardedUnit u;
  u.param_names = {"alpha"};
  u.shapes = {{1}};
  u.layout = fsdp::FlatLayout({1}, 1);
  u.replicas = 3;
  const auto shard_like = torch::full({1}, 7.0);
  for (int q = 0; q < 3; ++q) {
    u.replica_rank = q;
    const auto part = u.optimized_part_of(shard_like);
    BOOST_TEST(part.numel() == 1);
    BOOST_TEST(part.item<double>() == (q == 0 ? 7.0 : 0.0));
  }
  u.replicas = 1;
  BOOST_TEST(u.optimized_part_of(shard_like).is_same(shard_like));
}
