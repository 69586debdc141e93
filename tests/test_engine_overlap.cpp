// The engine's overlap and autograd corner cases (run at np = 1..4, part of test_engine): prefetching,
// overlapped gradient reductions, a unit called twice, a forward without backward, a failed backward,
// a backward after the model is gone, activation checkpointing, counters read from another thread.
#include <boost/test/unit_test.hpp>

#include <atomic>
#include <thread>

#include "engine_harness.hpp"

BOOST_AUTO_TEST_CASE(prefetching_overlaps_and_changes_no_result) {
  // Prefetched all-gathers run on the collective worker over a duplicate communicator; the parameters
  // must be bit-identical to the run without prefetching, for every strategy that gathers.
  const int world = MpiComm::world().size();
  const auto ref = train_reference(ModelKind::kCnn, OptimKind::kAdam, world);
  std::vector<ShardingStrategy> strategies = {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP};
  if (world % 2 == 0 && world > 2) strategies.push_back(ShardingStrategy::HYBRID_SHARD);
  struct Prefetch {
    fsdp::BackwardPrefetch backward;
    bool forward;
    int limit;
  };
  for (auto strategy : strategies) {
    FsdpOptions options;
    options.sharding_strategy = strategy;
    options.shard_group_size = strategy == ShardingStrategy::HYBRID_SHARD ? 2 : 0;
    options.auto_wrap_policy = AutoWrapPolicy::module_types({"Conv2d", "Linear"});
    const auto plain = train_fsdp(ModelKind::kCnn, OptimKind::kAdam, options);
    BOOST_TEST(plain.overlap.prefetched == 0);
    for (const auto& p : {Prefetch{fsdp::BackwardPrefetch::BACKWARD_PRE, false, 1}, Prefetch{fsdp::BackwardPrefetch::BACKWARD_POST, false, 1},
                          Prefetch{fsdp::BackwardPrefetch::NO_PREFETCH, true, 1}, Prefetch{fsdp::BackwardPrefetch::BACKWARD_PRE, true, 0}}) {
      BOOST_TEST_CONTEXT("np=" << world << " strategy=" << fsdp::to_string(strategy) << " backward_prefetch=" << fsdp::to_string(p.backward)
                               << " forward_prefetch=" << p.forward << " limit=" << p.limit) {
        options.backward_prefetch = p.backward;
        options.forward_prefetch = p.forward;
        options.limit_all_gathers = p.limit;
        const auto got = train_fsdp(ModelKind::kCnn, OptimKind::kAdam, options);
        BOOST_TEST(compare(got.params, ref.params) <= 1e-5);
        for (const auto& [name, t] : got.params) BOOST_TEST(torch::equal(t, plain.params.at(name)), "prefetching changed " << name);
        // Units are re-gathered in backward only when the strategy frees them after forward.
        const bool regathers = strategy != ShardingStrategy::SHARD_GRAD_OP;
        if (world > 1 && (regathers || p.forward)) BOOST_TEST(got.overlap.prefetched > 0);
        if (world == 1) BOOST_TEST(got.overlap.prefetched == 0);  // nothing to gather
      }
    }
  }
  BOOST_CHECK_THROW(fsdp::parse_backward_prefetch("BACKWARDS"), fsdp::ConfigError);
  BOOST_TEST(fsdp::parse_backward_prefetch("backward_post") == fsdp::BackwardPrefetch::BACKWARD_POST);
}

BOOST_AUTO_TEST_CASE(overlapped_gradient_reductions_change_no_result) {
  // Reductions on the collective worker (overlap_grad_reduce) against reductions on the computing thread:
  // bit-identical parameters for every strategy, with and without prefetching and accumulation, and
  // the overlap statistics say which path ran.
  const int world = MpiComm::world().size();
  for (const auto kind : {ModelKind::kMlp, ModelKind::kCnn}) {
    for (const auto& [strategy, group] : strategies_and_groups(world)) {
      for (const auto& [prefetch, accum] : {std::pair{false, 1}, std::pair{true, 1}, std::pair{false, 2}}) {
        BOOST_TEST_CONTEXT("np=" << world << " model=" << static_cast<int>(kind) << " strategy=" << strategy << " group=" << group
                                 << " prefetch=" << prefetch << " accumulate=" << accum) {
          FsdpOptions options;
          options.sharding_strategy = strategy;
          options.shard_group_size = group;
          options.auto_wrap_policy = kind == ModelKind::kCnn ? AutoWrapPolicy::module_types({"Conv2d", "Linear"}) : AutoWrapPolicy::size_based(200);
          if (prefetch) options.backward_prefetch = fsdp::BackwardPrefetch::BACKWARD_PRE;
          const Setup setup{.accum = accum};
          options.overlap_grad_reduce = false;
          const auto sync = train_fsdp(kind, OptimKind::kAdam, options, setup);
          options.overlap_grad_reduce = true;
          const auto overlapped = train_fsdp(kind, OptimKind::kAdam, options, setup);
          for (const auto& [name, t] : overlapped.params) BOOST_TEST(torch::equal(t, sync.params.at(name)), "overlapped reduction changed " << name);
          BOOST_TEST(sync.overlap.reductions_overlapped == 0);
          BOOST_TEST(sync.overlap.reductions_synchronous > 0);
          if (world > 1) {
            BOOST_TEST(overlapped.overlap.reductions_overlapped == sync.overlap.reductions_synchronous);
            BOOST_TEST(overlapped.overlap.reductions_synchronous == 0);
          } else {
            BOOST_TEST(overlapped.overlap.reductions_overlapped == 0);  // nothing to reduce across ranks
          }
        }
      }
    }
  }
}

/// A layer applied twice per forward (weights shared across "depth").
struct TwiceImpl : torch::nn::Module {
  TwiceImpl() {
    a = register_module("a", torch::nn::Linear(8, 8));
    b = register_module("b", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::tanh(fsdp::forward(a, x));
    x = torch::tanh(fsdp::forward(a, x));
    return fsdp::forward(b, x);
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};

/// Trains TwiceImpl; with `dropped_forward`, every step also runs a forward whose output is dropped
/// (no backward) between the optimizer step and the next training forward.
std::map<std::string, torch::Tensor> train_twice(const std::optional<FsdpOptions>& options, bool dropped_forward) {
  auto world = MpiComm::world();
  torch::manual_seed(11);
  auto net = std::make_shared<TwiceImpl>();
  std::shared_ptr<fsdp::FullyShardedDataParallel<TwiceImpl, MpiComm>> model;
  if (options) model = fsdp::make_fsdp(net, world, *options);
  auto opt = make_optimizer(OptimKind::kAdam, options ? model->parameters() : net->parameters());
  const int n = options ? world.size() : 1;
  const int r = options ? world.rank() : 0;
  for (int step = 0; step < kSteps; ++step) {
    auto gen = at::detail::createCPUGenerator(500 + step);
    auto x = torch::randn({2 * world.size(), 8}, gen);
    auto local = x.narrow(0, r * (2 * world.size() / n), 2 * world.size() / n);
    opt->zero_grad();
    (options ? model->forward(local) : net->forward(local)).pow(2).mean().backward();
    opt->step();
    if (dropped_forward) (void)(options ? model->forward(local) : net->forward(local));  // grad enabled, never backwarded
  }
  std::map<std::string, torch::Tensor> out;
  if (options) {
    for (auto& [name, t] : model->full_parameters()) out[name] = t;
  } else {
    for (const auto& p : net->named_parameters()) out[p.key()] = p.value().detach().clone();
  }
  return out;
}

BOOST_AUTO_TEST_CASE(unit_called_twice_and_forward_without_backward) {
  const int world = MpiComm::world().size();
  for (bool dropped : {false, true}) {
    const auto ref = train_twice(std::nullopt, dropped);
    for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD}) {
      for (bool promise : {false, true}) {
        BOOST_TEST_CONTEXT("np=" << world << " strategy=" << strategy << " dropped_forward=" << dropped << " promise=" << promise) {
          FsdpOptions options;
          options.sharding_strategy = strategy;
          options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear"});
          options.all_units_called_through_forward = promise;
          BOOST_TEST(compare(train_twice(options, dropped), ref) <= 1e-5);
        }
      }
    }
  }
}

/// TwiceImpl (a unit called twice per forward) trained with two backward passes per optimizer step
/// accumulating into the shards' grads (no zero_grad between them), and at step 1 a backward that
/// throws first (from a hook on the input, after every unit's reduction was issued), then zero_grad.
std::map<std::string, torch::Tensor> train_twice_accumulating(const FsdpOptions& options, bool throw_once) {
  auto world = MpiComm::world();
  torch::manual_seed(11);
  auto net = std::make_shared<TwiceImpl>();
  auto model = fsdp::make_fsdp(net, world, options);
  auto opt = make_optimizer(OptimKind::kAdam, model->parameters());
  for (int step = 0; step < kSteps; ++step) {
    auto gen = at::detail::createCPUGenerator(700 + step + 13 * world.rank());
    if (throw_once && step == 1) {
      auto x = torch::randn({2, 8}, gen).requires_grad_(true);
      x.register_hook([](const torch::Tensor&) -> torch::Tensor { throw std::runtime_error("a hook failed"); });
      BOOST_CHECK_THROW(model->forward(x).pow(2).mean().backward(), std::exception);
    }
    opt->zero_grad();
    for (int pass = 0; pass < 2; ++pass) model->forward(torch::randn({2, 8}, gen)).pow(2).mean().backward();
    opt->step();
  }
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, t] : model->full_parameters()) out[name] = t;
  return out;
}

BOOST_AUTO_TEST_CASE(overlapped_reductions_accumulate_like_autograd_and_survive_a_failed_backward) {
  // Two UnitGather nodes of one unit feed one AccumulateGrad, which adds their sum to an existing
  // grad: the overlapped path must do the same arithmetic. A backward that throws never runs its
  // end-of-backward callback: its overlapped reductions must not reach the next step.
  const int world = MpiComm::world().size();
  for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD}) {
    for (bool throw_once : {false, true}) {
      BOOST_TEST_CONTEXT("np=" << world << " strategy=" << strategy << " throw_once=" << throw_once) {
        FsdpOptions options;
        options.sharding_strategy = strategy;
        options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear"});
        options.overlap_grad_reduce = false;
        const auto sync = train_twice_accumulating(options, throw_once);
        options.overlap_grad_reduce = true;
        const auto overlapped = train_twice_accumulating(options, throw_once);
        for (const auto& [name, t] : overlapped) BOOST_TEST(torch::equal(t, sync.at(name)), "overlapped reduction changed " << name);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(a_communicators_counters_read_while_another_thread_runs_its_collectives) {
  // What the engine's comm_counters() does while its collective worker reduces: one thread runs
  // collectives, the other reads the counters meanwhile (the ThreadSanitizer pass, sanitizer_tsan,
  // reports a race here if the counters are not synchronized).
  auto world = MpiComm::world();
  auto comm = world.split(0, world.rank());
  constexpr int kCalls = 200;
  std::atomic<bool> done{false};
  std::thread collectives([&] {
    double v = 1;
    for (int i = 0; i < kCalls; ++i) comm.all_reduce(&v, &v, 1, fsdp::DType::kFloat64, fsdp::ReduceOp::kMax);
    done = true;
  });
  std::uint64_t last = 0, reads = 0;
  bool monotonic = true;
  do {
    const auto calls = comm.counters().calls;
    monotonic = monotonic && calls >= last;
    last = calls;
    ++reads;
  } while (!done);
  collectives.join();
  BOOST_TEST(monotonic);
  BOOST_TEST(reads > 0u);
  BOOST_TEST(comm.counters().calls == static_cast<std::uint64_t>(kCalls));
}

BOOST_AUTO_TEST_CASE(counters_read_while_the_worker_reduces) {
  // comm_counters() on the training thread while the collective worker's overlapped reductions update
  // its communicators' counters (the ThreadSanitizer pass, sanitizer_tsan, checks there is no race).
  auto world = MpiComm::world();
  FsdpOptions options;
  options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear"});
  options.overlap_grad_reduce = true;
  auto model = fsdp::make_fsdp(std::static_pointer_cast<MlpImpl>(make_model(ModelKind::kMlp)), world, options);
  std::vector<std::uint64_t> seen;
  auto x = torch::randn({3, 13}).requires_grad_(true);
  x.register_hook([&](const torch::Tensor&) { seen.push_back(model->comm_counters().calls); });  // late in backward
  model->forward(x).sum().backward();
  const auto after = model->comm_counters().calls;
  BOOST_REQUIRE(seen.size() == 1u);
  BOOST_TEST(seen[0] <= after);
  if (world.size() > 1) BOOST_TEST(after > 0u);
}

BOOST_AUTO_TEST_CASE(backward_after_the_model_is_destroyed_is_an_error) {
  auto world = MpiComm::world();
  torch::manual_seed(11);
  auto net = std::make_shared<TwiceImpl>();
  FsdpOptions options;
  options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear"});
  auto model = fsdp::make_fsdp(net, world, options);
  auto loss = model->forward(torch::randn({2, 8})).sum();
  model.reset();
  try {
    loss.backward();
    BOOST_FAIL("expected an error");
  } catch (const std::exception& e) {
    BOOST_TEST(std::string(e.what()).find("already destroyed") != std::string::npos, e.what());
  }
}

BOOST_AUTO_TEST_CASE(double_backward_through_a_unit_is_an_error_not_a_wrong_derivative) {
  auto world = MpiComm::world();
  torch::manual_seed(11);
  auto net = std::make_shared<TwiceImpl>();
  FsdpOptions options;
  options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear"});
  auto model = fsdp::make_fsdp(net, world, options);
  auto loss = model->forward(torch::randn({2, 8})).pow(2).sum();
  try {
    (void)torch::autograd::grad({loss}, model->parameters(), {}, /*retain_graph=*/true, /*create_graph=*/true);
    BOOST_FAIL("expected an error");
  } catch (const std::exception& e) {
    BOOST_TEST(std::string(e.what()).find("create_graph") != std::string::npos, e.what());
  }
  // The model still trains after the refused backward.
  model->zero_grad();
  model->forward(torch::randn({2, 8})).sum().backward();
  for (const auto& p : model->parameters()) BOOST_TEST(p.grad().defined());
}

/// Blocks with dropout inside, for activation checkpointing.
struct DropBlockImpl : torch::nn::Module {
  DropBlockImpl(int64_t in, int64_t out, double p) : p_(p) { fc = register_module("fc", torch::nn::Linear(in, out)); }
  torch::Tensor forward(const torch::Tensor& x) {
    return F::dropout(torch::tanh(fsdp::forward(fc, x)), F::DropoutFuncOptions().p(p_).training(is_training()));
  }
  torch::nn::Linear fc{nullptr};
  double p_;
};
TORCH_MODULE(DropBlock);

struct DropNetImpl : torch::nn::Module {
  explicit DropNetImpl(double p) {
    b1 = register_module("b1", DropBlock(13, 31, p));
    b2 = register_module("b2", DropBlock(31, 17, p));
    b3 = register_module("b3", DropBlock(17, 13, 0.0));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fsdp::forward(b3, fsdp::forward(b2, fsdp::forward(b1, x))); }
  DropBlock b1{nullptr}, b2{nullptr}, b3{nullptr};
};
TORCH_MODULE(DropNet);

BOOST_AUTO_TEST_CASE(activation_checkpointing_replays_dropout_and_matches) {
  auto world = MpiComm::world();
  const int n = world.size();
  auto train = [&](double p, bool ac, ShardingStrategy strategy, int group, bool nested_linear) {
    torch::manual_seed(11);
    auto net = DropNet(p).ptr();
    FsdpOptions options;
    options.sharding_strategy = strategy;
    options.shard_group_size = group;
    options.auto_wrap_policy = nested_linear ? AutoWrapPolicy::module_types({"DropBlock", "Linear"}) : AutoWrapPolicy::module_types({"DropBlock"});
    options.activation_checkpointing = ac;
    auto model = fsdp::make_fsdp(net, world, options);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
    torch::manual_seed(100 + world.rank());  // each rank its own dropout masks
    for (int step = 0; step < kSteps; ++step) {
      auto batch = global_batch(ModelKind::kMlp, step, kLocalRows * n);
      opt.zero_grad();
      F::mse_loss(model->forward(batch.x.narrow(0, world.rank() * kLocalRows, kLocalRows)), batch.y.narrow(0, world.rank() * kLocalRows, kLocalRows))
          .backward();
      opt.step();
    }
    std::map<std::string, torch::Tensor> out;
    for (auto& [name, t] : model->full_parameters()) out[name] = t;
    return out;
  };
  for (const auto& [strategy, group] : strategies_and_groups(n)) {
    for (bool nested : {false, true}) {
      BOOST_TEST_CONTEXT("np=" << n << " strategy=" << fsdp::to_string(strategy) << " group=" << group << " nested=" << nested) {
        // With dropout: recomputation replays the RNG, so the result is bit-identical to no checkpointing.
        const auto plain = train(0.3, false, strategy, group, nested);
        const auto checkpointed = train(0.3, true, strategy, group, nested);
        for (const auto& [name, t] : plain) BOOST_TEST(torch::equal(t, checkpointed.at(name)), name);
        // And it changes nothing in the math: without dropout it matches single-process training.
        torch::manual_seed(11);
        auto ref_net = DropNet(0.0).ptr();
        torch::optim::Adam ref_opt(ref_net->parameters(), torch::optim::AdamOptions(1e-2));
        for (int step = 0; step < kSteps; ++step) {
          auto batch = global_batch(ModelKind::kMlp, step, kLocalRows * n);
          ref_opt.zero_grad();
          F::mse_loss(ref_net->forward(batch.x), batch.y).backward();
          ref_opt.step();
        }
        std::map<std::string, torch::Tensor> ref;
        for (const auto& p : ref_net->named_parameters()) ref[p.key()] = p.value().detach().clone();
        BOOST_TEST(compare(train(0.0, true, strategy, group, nested), ref) <= 1e-5);
      }
    }
  }
}

namespace ancestor_weight {
/// The parent's weight (tied) plus a bias of its own, so the head is a unit with parameters (recomputed).
struct HeadImpl : torch::nn::Module {
  explicit HeadImpl(torch::Tensor shared) {
    weight = register_parameter("weight", std::move(shared));
    bias = register_parameter("bias", torch::zeros({weight.size(0)}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::nn::functional::linear(x, weight.t(), bias); }
  torch::Tensor weight, bias;
};
TORCH_MODULE(Head);
/// A unit whose checkpointed child unit uses the parent's weight (tied): the weight belongs to the
/// parent unit, which FULL_SHARD frees after its forward and re-gathers for its backward, in the middle
/// of which the child's recomputation runs its own (nested) backward. With `parent_computes` false the
/// parent uses none of its parameters itself: its own backward node never runs.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(bool parent_computes) : parent_computes(parent_computes) {
    fc = register_module("fc", torch::nn::Linear(13, 13));
    head = register_module("head", Head(fc->weight));
  }
  torch::Tensor forward(torch::Tensor x) {
    if (!parent_computes) return torch::tanh(fsdp::forward(head, x));
    auto z = fc->forward(x);
    // Its gradient comes after the head's recomputed backward, before this unit's own node.
    if (throw_in_backward && z.requires_grad())
      z.register_hook([](const torch::Tensor& g) -> torch::Tensor { throw std::runtime_error("injected"); });
    auto h = torch::tanh(z);
    return h + fsdp::forward(head, torch::dropout(h, 0.0, is_training()));
  }
  bool parent_computes;
  bool throw_in_backward = false;
  torch::nn::Linear fc{nullptr};
  Head head{nullptr};
};
TORCH_MODULE(Block);
struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool parent_computes) {
    b1 = register_module("b1", Block(parent_computes));
    b2 = register_module("b2", Block(parent_computes));
    out = register_module("out", torch::nn::Linear(13, 11));
  }
  torch::Tensor forward(torch::Tensor x) { return out->forward(fsdp::forward(b2, fsdp::forward(b1, x))); }
  Block b1{nullptr}, b2{nullptr};
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(Net);
}  // namespace ancestor_weight

BOOST_AUTO_TEST_CASE(a_checkpointed_unit_using_its_parents_weight_trains_like_one_process) {
  auto world = MpiComm::world();
  const int n = world.size();
  const int64_t rows = 3;
  auto batch = [&](int step) {
    auto gen = at::detail::createCPUGenerator(900 + step);
    return std::pair{torch::randn({rows * n, 13}, gen), torch::randn({rows * n, 11}, gen)};
  };
  for (const bool parent_computes : {true, false}) {
    torch::manual_seed(21);
    auto ref_net = ancestor_weight::Net(parent_computes).ptr();
    torch::optim::Adam ref_opt(unique_parameters(*ref_net), torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < 4; ++step) {
      const auto [x, y] = batch(step);
      ref_opt.zero_grad();
      F::mse_loss(ref_net->forward(x), y).backward();
      ref_opt.step();
    }
    std::map<std::string, torch::Tensor> ref;
    for (const auto& p : ref_net->named_parameters()) ref[p.key()] = p.value().detach().clone();
    for (const auto& [strategy, group] : strategies_and_groups(n)) {
      std::uint64_t reduced_without_checkpointing = 0;  // bytes reduced in the last step: each unit once
      for (const auto& [overlap, checkpointing] : {std::pair{false, false}, std::pair{false, true}, std::pair{true, true}}) {
        BOOST_TEST_CONTEXT("np=" << n << " strategy=" << fsdp::to_string(strategy) << " group=" << group << " overlap=" << overlap
                                 << " activation checkpointing=" << checkpointing << " parent computes=" << parent_computes) {
          torch::manual_seed(21);
          auto net = ancestor_weight::Net(parent_computes).ptr();
          FsdpOptions options;
          options.sharding_strategy = strategy;
          options.shard_group_size = group;
          options.auto_wrap_policy = AutoWrapPolicy::module_types({"Block", "Head"});
          options.activation_checkpointing = checkpointing;
          options.overlap_grad_reduce = overlap;
          auto model = fsdp::make_fsdp(net, world, options);
          BOOST_TEST(model->units().size() == 5u);  // root, b1, b1.head, b2, b2.head
          torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
          std::uint64_t reduced = 0;
          for (int step = 0; step < 4; ++step) {
            const auto [x, y] = batch(step);
            const auto before = model->comm_counters();
            opt.zero_grad();
            F::mse_loss(model->forward(x.narrow(0, world.rank() * rows, rows)), y.narrow(0, world.rank() * rows, rows)).backward();
            opt.step();
            const auto after = model->comm_counters();
            reduced = after.reduce_scatter_bytes + after.all_reduce_bytes - before.reduce_scatter_bytes - before.all_reduce_bytes;
          }
          if (!checkpointing) reduced_without_checkpointing = reduced;
          BOOST_TEST(reduced == reduced_without_checkpointing, "the parent unit is reduced once, not again from the recomputation");
          std::map<std::string, torch::Tensor> got;
          for (auto& [name, t] : model->full_parameters()) got[name] = t;
          BOOST_TEST(compare(got, ref) <= 1e-5);
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(a_backward_that_throws_after_a_recomputation_leaves_nothing_for_the_next_step) {
  // The head's recomputed backward keeps the parent's share of the gradient for the parent's own
  // node; a backward that throws before that node runs must not carry it into the next step.
  auto world = MpiComm::world();
  const int64_t rows = 3;
  auto run = [&](bool fail_once) {
    torch::manual_seed(21);
    auto net = ancestor_weight::Net(true).ptr();
    FsdpOptions options;
    options.auto_wrap_policy = AutoWrapPolicy::module_types({"Block", "Head"});
    options.activation_checkpointing = true;
    auto model = fsdp::make_fsdp(net, world, options);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    auto gen = at::detail::createCPUGenerator(77 + world.rank());
    for (int step = 0; step < 3; ++step) {
      if (fail_once && step == 1) {
        net->b1->throw_in_backward = true;
        opt.zero_grad();
        BOOST_CHECK_THROW(model->forward(torch::ones({rows, 13})).sum().backward(), std::exception);  // draws nothing from gen
        net->b1->throw_in_backward = false;
      }
      opt.zero_grad();
      model->forward(torch::randn({rows, 13}, gen)).sum().backward();
      opt.step();
    }
    std::map<std::string, torch::Tensor> out;
    for (auto& [name, t] : model->full_parameters()) out[name] = t;
    return out;
  };
  const auto clean = run(false);
  const auto after_failure = run(true);
  for (const auto& [name, t] : clean) BOOST_TEST(torch::equal(t, after_failure.at(name)), name);
}

namespace one_parameter_units {

/// A parameter added to an activation of its own shape (a rank's micro-batch of 3 rows): autograd hands
/// the same gradient tensor to the parameter and to the activation's producer.
struct OffsetImpl : torch::nn::Module {
  OffsetImpl() : torch::nn::Module("Offset") { shift = register_parameter("shift", torch::linspace(-0.5, 0.5, 36).view({3, 12})); }
  torch::Tensor forward(const torch::Tensor& x) { return x + shift; }
  torch::Tensor shift;
};
TORCH_MODULE(Offset);

/// Units of one parameter each whose sizes divide by 1-4 ranks (no padding): their gradients are
/// reduce-scattered where autograd left them (FlatUnit::grad_as_flat) instead of packed into a copy.
struct NetImpl : torch::nn::Module {
  NetImpl() : torch::nn::Module("OneParameterNet") {
    emb = register_module("emb", torch::nn::Embedding(24, 6));
    proj = register_module("proj", torch::nn::Linear(torch::nn::LinearOptions(6, 12).bias(false)));
    offset = register_module("offset", Offset());
    out = register_module("out", torch::nn::Linear(torch::nn::LinearOptions(12, 24).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    auto h = torch::tanh(fsdp::forward(proj, fsdp::forward(emb, idx)));  // (b, 12)
    return fsdp::forward(out, fsdp::forward(offset, h));
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear proj{nullptr}, out{nullptr};
  Offset offset{nullptr};
};
TORCH_MODULE(Net);

struct Batch {
  torch::Tensor x, y;
};
inline Batch batch_of(int step, std::int64_t rows) {
  auto g = torch::make_generator<at::CPUGeneratorImpl>(100 + step);
  return {torch::randint(24, {rows}, g, torch::kLong), torch::randint(24, {rows}, g, torch::kLong)};
}

struct Trained {
  std::map<std::string, torch::Tensor> params;
  std::int64_t reduced_in_place = 0;
};

inline Trained train(const std::optional<FsdpOptions>& options, int accum) {
  auto world = MpiComm::world();
  const int n = options ? world.size() : 1, r = options ? world.rank() : 0;
  const std::int64_t rows = 3;
  torch::manual_seed(11);
  Net net;
  std::shared_ptr<fsdp::FullyShardedDataParallel<NetImpl, MpiComm>> model;
  if (options) model = fsdp::make_fsdp(net.ptr(), world, *options);
  auto params = model ? model->parameters() : net->parameters();
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1).momentum(0.9));  // not Adam: it would hide a scaled gradient
  for (int step = 0; step < 3; ++step) {
    const auto b = batch_of(step, rows * world.size() * accum);
    opt.zero_grad();
    if (!model) {  // the single process takes the global batch as the same chunks of 3 rows (Offset's shape)
      const std::int64_t chunks = world.size() * accum;
      for (std::int64_t c = 0; c < chunks; ++c)
        (torch::nn::functional::cross_entropy(net->forward(b.x.narrow(0, c * rows, rows)), b.y.narrow(0, c * rows, rows)) / chunks).backward();
    } else {
      for (int micro = 0; micro < accum; ++micro) {
        const auto x = b.x.narrow(0, (micro * n + r) * rows, rows), y = b.y.narrow(0, (micro * n + r) * rows, rows);
        auto loss = torch::nn::functional::cross_entropy(model->forward(x), y) / accum;
        std::optional<decltype(model->no_sync())> scope;
        if (micro + 1 < accum) scope.emplace(model->no_sync());
        loss.backward();
      }
    }
    opt.step();
  }
  Trained out;
  if (model) {
    for (auto& [name, t] : model->full_parameters()) out.params[name] = t;
    out.reduced_in_place = model->overlap_stats().reduced_in_place;
  } else {
    for (const auto& p : net->named_parameters()) out.params[p.key()] = p.value().detach().clone();
  }
  return out;
}

}  // namespace one_parameter_units

BOOST_AUTO_TEST_CASE(one_parameter_units_reduce_autograds_gradient_and_match) {
  using namespace one_parameter_units;
  const int world = MpiComm::world().size();
  for (int accum : {1, 2}) {
    const auto ref = train(std::nullopt, accum);
    for (bool overlap : {false, true}) {
      for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD}) {
        BOOST_TEST_CONTEXT("np=" << world << " accum=" << accum << " overlap=" << overlap << " strategy=" << fsdp::to_string(strategy)) {
          FsdpOptions options;
          options.sharding_strategy = strategy;
          options.auto_wrap_policy = AutoWrapPolicy::module_types({"Embedding", "Linear", "Offset"});
          options.overlap_grad_reduce = overlap;
          const auto got = train(options, accum);
          BOOST_TEST(compare(got.params, ref.params) <= 1e-5);
          // Every unit here has one parameter and no padding: reduced in place when the group has more
          // than one rank and nothing was accumulated under no_sync (which packs a copy to add into).
          const bool in_place = world > 1 && strategy != ShardingStrategy::NO_SHARD && accum == 1;
          BOOST_TEST((got.reduced_in_place > 0) == in_place);
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(the_rng_state_a_recomputation_replays_is_every_generator_the_unit_draws_from) {
  // On the CPU: the CPU generator only (a GPU computation adds that device's generator, the same calls).
  torch::manual_seed(5);
  const auto captured = fsdp::detail::capture_rng_state(torch::Device(torch::kCPU));
  BOOST_TEST(!captured.device.defined());
  const auto first = torch::rand({16});
  (void)torch::rand({3});
  fsdp::detail::restore_rng_state(captured);
  BOOST_TEST(torch::equal(torch::rand({16}), first));
}
