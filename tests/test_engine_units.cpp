// The engine's units and state (run at np = 1..4, part of test_engine): units follow the wrap policy,
// summon_full_params, buffers, and the configuration errors.
#include <boost/test/unit_test.hpp>

#include "engine_harness.hpp"

BOOST_AUTO_TEST_CASE(units_follow_the_policy_and_print_as_a_tree) {
  auto world = MpiComm::world();
  FsdpOptions options;
  options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear", "Scale", "TiedOut"});
  auto net = std::static_pointer_cast<MlpImpl>(make_model(ModelKind::kMlp));
  auto model = fsdp::make_fsdp(net, world, options);
  const auto units = model->units();
  // root, fc1, fc2, gated.fc, scale, fc3, tied
  BOOST_TEST_REQUIRE(units.size() == 7u);
  BOOST_TEST(units[0].module_path == "");
  BOOST_TEST(units[1].module_path == "fc1");
  // The tied weight is used by fc1 and tied: it belongs to their common ancestor, the root.
  BOOST_TEST(units[1].param_names == std::vector<std::string>{"fc1.bias"});
  BOOST_TEST((std::find(units[0].param_names.begin(), units[0].param_names.end(), "fc1.weight") != units[0].param_names.end()));
  BOOST_TEST(units[6].param_names.empty());
  BOOST_TEST(units[4].numel == 1);
  BOOST_TEST(units[4].shard_numel == 1);
  BOOST_TEST(units[4].padded_numel == world.size());
  BOOST_TEST(model->num_params() == static_cast<int64_t>(13 * 37 + 37 + 37 * 29 + 29 + 29 * 29 + 29 + 29 + 1 + 29 * 37 + 37));
  const std::string text = model->describe();
  BOOST_TEST(text.find("[unit 0, root") != std::string::npos);
  BOOST_TEST(text.find("(fc2): torch::nn::Linear(in_features=37, out_features=29, bias=true)  [unit 2") != std::string::npos, text);
  std::ostringstream printed;
  printed << *model;
  BOOST_TEST(printed.str().find("FullyShardedDataParallel(strategy=FULL_SHARD") == 0u);

  // Units called directly (not through fsdp::forward) are reported as gathered with the root.
  auto cnn = std::static_pointer_cast<CnnImpl>(make_model(ModelKind::kCnn));
  FsdpOptions cnn_options;
  cnn_options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear", "Conv2d"});
  auto wrapped = fsdp::make_fsdp(cnn, world, cnn_options);
  wrapped->forward(torch::randn({2, 1, 10, 10}));
  const auto cu = wrapped->units();
  BOOST_TEST(cu[1].called_through_hook);   // conv1
  BOOST_TEST(!cu[3].called_through_hook);  // fc1
  BOOST_TEST(wrapped->describe().find("gathered with root") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(summon_full_params_reads_and_writes_back) {
  // Both ways the engine keeps a unit: `full` apart from the shard (sharded; offloaded at any group
  // size), or the shard itself (a group of one: NO_SHARD, also with the optimizer over the world).
  auto world = MpiComm::world();
  std::vector<std::pair<std::string, FsdpOptions>> cases;
  for (const auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::NO_SHARD}) {
    FsdpOptions o;
    o.sharding_strategy = strategy;
    cases.emplace_back(fsdp::to_string(strategy), o);
    o.offload_params = true;
    cases.emplace_back(std::string(fsdp::to_string(strategy)) + " offload", o);
  }
  FsdpOptions world_parts;
  world_parts.sharding_strategy = ShardingStrategy::HYBRID_SHARD;
  world_parts.shard_group_size = 1;
  world_parts.optimizer_sharding = fsdp::OptimizerSharding::WORLD;
  cases.emplace_back("HYBRID_SHARD group 1, optimizer over the world", world_parts);
  for (auto& [name, options] : cases) {
    BOOST_TEST_CONTEXT(name << " at np=" << world.size()) {
      auto net = std::static_pointer_cast<MlpImpl>(make_model(ModelKind::kMlp));
      const auto fc2_before = net->fc2->weight.detach().clone();
      options.auto_wrap_policy = AutoWrapPolicy::size_based(200);
      auto model = fsdp::make_fsdp(net, world, options);
      {
        auto scope = model->summon_full_params(/*writeback=*/true);
        BOOST_TEST(torch::equal(net->fc2->weight.detach(), fc2_before));
        torch::NoGradGuard no_grad;
        net->fc2->bias.fill_(1.5);
      }
      BOOST_TEST(model->memory_stats().gathered_param_bytes == 0);
      {
        auto scope = model->summon_full_params();
        BOOST_TEST(net->fc2->bias.detach().eq(1.5).all().item<bool>());
        torch::NoGradGuard no_grad;
        net->fc2->bias.fill_(-7);  // not written back
      }
      const auto params = model->full_parameters();
      for (const auto& [param, t] : params)
        if (param == "fc2.bias") BOOST_TEST(t.eq(1.5).all().item<bool>());
    }
  }
}

BOOST_AUTO_TEST_CASE(averaged_buffers_stay_identical_across_ranks_and_own_ones_follow_each_ranks_data) {
  auto world = MpiComm::world();
  struct BnImpl : torch::nn::Module {
    BnImpl() {
      fc = register_module("fc", torch::nn::Linear(6, 8));
      bn = register_module("bn", torch::nn::BatchNorm1d(8));
    }
    torch::Tensor forward(torch::Tensor x) { return bn->forward(fc->forward(x)); }
    torch::nn::Linear fc{nullptr};
    torch::nn::BatchNorm1d bn{nullptr};
  };
  for (auto sync : {fsdp::BufferSync::AVERAGE, fsdp::BufferSync::NONE}) {
    torch::manual_seed(5);
    auto net = std::make_shared<BnImpl>();
    FsdpOptions options;
    options.buffer_sync = sync;
    auto model = fsdp::make_fsdp(net, world, options);
    torch::manual_seed(100 + world.rank());  // different data on every rank
    for (int step = 0; step < 3; ++step) model->forward(torch::randn({4, 6}) * (world.rank() + 1)).sum().backward();
    for (const auto& b : net->named_buffers()) {
      auto mine = b.value().to(torch::kDouble).contiguous();
      auto sum = mine.clone();
      world.all_reduce(sum.data_ptr(), sum.data_ptr(), sum.numel(), fsdp::DType::kFloat64, fsdp::ReduceOp::kSum);
      const double spread = (sum - mine * world.size()).abs().max().item<double>();
      if (sync == fsdp::BufferSync::AVERAGE || b.key() == "bn.num_batches_tracked" || world.size() == 1)
        BOOST_TEST(spread < 1e-9, fsdp::to_string(sync) << ": buffer " << b.key() << " differs across ranks");
      else
        BOOST_TEST(spread > 1e-6, "NONE: buffer " << b.key() << " follows this rank's data");
    }
  }
}

namespace {
struct StridedBufferImpl : torch::nn::Module {
  StridedBufferImpl() {
    fc = register_module("fc", torch::nn::Linear(4, 3));
    stat = register_buffer("stat", torch::zeros({4, 3}).t());  // a transposed view: not contiguous
  }
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
  torch::nn::Linear fc{nullptr};
  torch::Tensor stat;
};
}  // namespace

BOOST_AUTO_TEST_CASE(strided_buffers_are_synchronized) {
  auto world = MpiComm::world();
  auto net = std::make_shared<StridedBufferImpl>();
  BOOST_TEST(!net->stat.is_contiguous());
  FsdpOptions options;
  options.sync_module_states = true;  // broadcasts the strided buffer at construction
  options.buffer_sync = fsdp::BufferSync::AVERAGE;
  auto model = fsdp::make_fsdp(net, world, options);
  {
    torch::NoGradGuard no_grad;
    net->stat.fill_(static_cast<float>(world.rank()));
  }
  model->train();
  (void)model->forward(torch::randn({2, 4}));  // training forward: floating buffers are averaged
  BOOST_TEST(!net->stat.is_contiguous());
  BOOST_TEST(torch::equal(net->stat, torch::full({3, 4}, static_cast<float>(world.size() - 1) / 2.0f)));
}

BOOST_AUTO_TEST_CASE(configuration_errors_are_clear) {
  auto world = MpiComm::world();
  BOOST_CHECK_THROW(fsdp::parse_sharding_strategy("FULLSHARD"), fsdp::ConfigError);
  BOOST_TEST(fsdp::parse_sharding_strategy("shard_grad_op") == ShardingStrategy::SHARD_GRAD_OP);
  BOOST_CHECK_THROW(AutoWrapPolicy::size_based(0), fsdp::ConfigError);
  if (world.size() == 3) {
    FsdpOptions options;
    options.sharding_strategy = ShardingStrategy::HYBRID_SHARD;
    options.shard_group_size = 2;
    try {
      fsdp::make_fsdp(std::static_pointer_cast<MlpImpl>(make_model(ModelKind::kMlp)), world, options);
      BOOST_FAIL("expected a ConfigError");
    } catch (const fsdp::ConfigError& e) {
      BOOST_TEST(std::string(e.what()).find("not divisible by shard_group_size 2") != std::string::npos);
    }
  }
}

BOOST_AUTO_TEST_CASE(compute_device_must_suit_the_communicator) {
  auto world = MpiComm::world();
  auto net = std::static_pointer_cast<MlpImpl>(make_model(ModelKind::kMlp));
  FsdpOptions options;
  options.device = torch::Device(torch::kCUDA, 0);
  try {
    fsdp::make_fsdp(net, world, options);
    BOOST_FAIL("expected a ConfigError");
  } catch (const fsdp::ConfigError& e) {
    BOOST_TEST(std::string(e.what()).find("moves host memory only (MpiComm): use NcclComm for GPUs") != std::string::npos, e.what());
  }
  options.device = torch::Device(torch::kCPU);
  auto model = fsdp::make_fsdp(std::static_pointer_cast<MlpImpl>(make_model(ModelKind::kMlp)), world, options);
  BOOST_TEST(model->compute_device() == torch::Device(torch::kCPU));
  // Moving or casting the wrapped model would part the shards from the parameters: refused.
  const auto before = model->full_parameters();
  for (const auto& attempt : std::vector<std::function<void()>>{[&] { model->to(torch::kDouble); }, [&] { model->to(torch::Device(torch::kCPU)); },
                                                                [&] { model->to(torch::Device(torch::kCPU), torch::kHalf); }})
    BOOST_CHECK_EXCEPTION(attempt(), fsdp::ConfigError,
                          [](const fsdp::ConfigError& e) { return std::string(e.what()).find("cannot move or change dtype") != std::string::npos; });
  const auto after = model->full_parameters();
  for (std::size_t i = 0; i < before.size(); ++i) BOOST_TEST(torch::equal(before[i].second, after[i].second));
}

BOOST_AUTO_TEST_CASE(unscale_grads_divides_every_shard_and_every_rank_sees_one_ranks_overflow) {
  auto world = MpiComm::world();
  for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::NO_SHARD}) {
    BOOST_TEST_CONTEXT("np=" << world.size() << " strategy=" << fsdp::to_string(strategy)) {
      FsdpOptions options;
      options.sharding_strategy = strategy;
      options.auto_wrap_policy = AutoWrapPolicy::size_based(200);
      options.mixed_precision = fsdp::MixedPrecision::fp16_reduce();
      BOOST_TEST(options.mixed_precision.fp16_gradients());
      auto model = fsdp::make_fsdp(std::static_pointer_cast<MlpImpl>(make_model(ModelKind::kMlp)), world, options);
      const auto batch = global_batch(ModelKind::kMlp, 0, kLocalRows);
      auto backward = [&] {
        for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
        (loss_of(ModelKind::kMlp, model->forward(batch.x), batch.y) * 1024).backward();
      };
      backward();
      std::vector<torch::Tensor> scaled;
      for (auto& p : model->parameters()) scaled.push_back(p.grad().clone());
      BOOST_TEST(!model->unscale_grads(1024));
      const auto params = model->parameters();
      for (std::size_t i = 0; i < params.size(); ++i) BOOST_TEST(torch::equal(params[i].grad(), scaled[i] / 1024));  // a power of two: exact
      // One rank's gradient overflows: every rank learns it from the same call.
      backward();
      if (world.rank() == world.size() - 1) model->parameters().front().mutable_grad()[0] = std::numeric_limits<float>::infinity();
      BOOST_TEST(model->unscale_grads(1024));
      BOOST_CHECK_THROW(model->unscale_grads(0), fsdp::ConfigError);
    }
  }
}

namespace stale_weights {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    a = register_module("a", torch::nn::Linear(8, 8));
    b = register_module("b", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fsdp::forward(b, torch::tanh(fsdp::forward(a, x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Net);

}  // namespace stale_weights

// A graph kept (retain_graph) across an optimizer step saved the old weights; its second backward
// would silently use the refilled new ones. The refill after a step moves the parameters' version
// counters, so autograd refuses that backward as it would after an in-place update in PyTorch.
// Within one step a unit is gathered again for backward (FULL_SHARD) and for further forwards
// without moving them, so those stay legal.
BOOST_AUTO_TEST_CASE(a_graph_kept_across_an_optimizer_step_is_refused_not_run_on_new_weights) {
  auto world = MpiComm::world();
  for (const auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD}) {
    for (const bool sgd : {true, false}) {
      BOOST_TEST_CONTEXT(to_string(strategy) << (sgd ? " SGD" : " Adam")) {
        torch::manual_seed(5);
        FsdpOptions options;
        options.sharding_strategy = strategy;
        options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear"});
        auto model = fsdp::make_fsdp(stale_weights::Net(), world, options);
        auto opt = make_optimizer(sgd ? OptimKind::kSgd : OptimKind::kAdam, model->parameters());
        const auto x = torch::randn({4, 8});
        // Two forwards, then both backwards, in one step: legal.
        auto first = model->forward(x).pow(2).sum();
        auto second = model->forward(x * 2).pow(2).sum();
        first.backward({}, /*retain_graph=*/true);
        second.backward();
        opt->step();
        opt->zero_grad();
        (void)model->forward(x).sum();  // refills every unit with the stepped weights
        bool refused = false;
        try {
          first.backward();
        } catch (const c10::Error& e) {
          refused = std::string(e.what()).find("modified by an inplace operation") != std::string::npos;
          BOOST_TEST(refused, e.what());
        }
        // Units never refilled (NO_SHARD, every unit at world size 1) share the shard's version:
        // Adam's in-place update moves it; LibTorch's SGD writes through .data(), which no version
        // counter sees, so there the kept graph runs as it would over a plain LibTorch model.
        const bool refilled = strategy != ShardingStrategy::NO_SHARD && world.size() > 1;
        BOOST_TEST(refused == (refilled || !sgd));
      }
    }
  }
}

// A parameter tensor kept from module() after its unit was resharded has no storage: reading it is
// LibTorch's error, not a read of freed memory.
BOOST_AUTO_TEST_CASE(a_parameter_kept_across_a_reshard_fails_loudly_when_read) {
  auto world = MpiComm::world();
  if (world.size() == 1) return;  // nothing is resharded
  torch::manual_seed(5);
  FsdpOptions options;
  options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear"});
  auto net = stale_weights::Net();
  auto model = fsdp::make_fsdp(net, world, options);
  model->forward(torch::randn({4, 8})).sum().backward();
  const torch::Tensor kept = net->a->weight;
  BOOST_TEST(kept.sizes() == torch::IntArrayRef({8, 8}));  // the shape stays readable
  try {
    (void)kept.sum().item<float>();
    BOOST_FAIL("expected an error");
  } catch (const c10::Error& e) {
    BOOST_TEST(std::string(e.what()).find("doesn't have storage") != std::string::npos, e.what());
  }
  // Inside summon_full_params, and in the next forward, it holds values again.
  {
    auto scope = model->summon_full_params();
    BOOST_TEST(std::isfinite(kept.sum().item<float>()));
  }
  BOOST_CHECK_THROW((void)kept.sum().item<float>(), c10::Error);
  model->forward(torch::randn({4, 8})).sum().backward();
}

// What stays legal around the version moves above: a graph backwarded twice without a step (and two
// losses over one forward), two forwards before their two backwards at every step with the optimizer
// sharded over the world (its parts are all-gathered at each forward), and a read-only
// summon_full_params between a forward and its backward.
BOOST_AUTO_TEST_CASE(graphs_kept_within_a_step_stay_usable) {
  auto world = MpiComm::world();
  const int n = world.size();
  std::vector<std::pair<ShardingStrategy, int>> cases = {
      {ShardingStrategy::FULL_SHARD, 0}, {ShardingStrategy::SHARD_GRAD_OP, 0}, {ShardingStrategy::NO_SHARD, 0}};
  for (int g = 1; g < n; ++g)
    if (n % g == 0) cases.push_back({ShardingStrategy::HYBRID_SHARD, g});
  for (const auto& [strategy, group] : cases) {
    BOOST_TEST_CONTEXT(to_string(strategy) << " group " << group) {
      torch::manual_seed(5);
      FsdpOptions options;
      options.sharding_strategy = strategy;
      options.shard_group_size = group;
      if (strategy == ShardingStrategy::HYBRID_SHARD) options.optimizer_sharding = fsdp::OptimizerSharding::WORLD;
      options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear"});
      auto model = fsdp::make_fsdp(stale_weights::Net(), world, options);
      auto opt = make_optimizer(OptimKind::kAdam, model->parameters());
      const auto x = torch::randn({4, 8});
      const auto grads = [&] {
        std::vector<torch::Tensor> out;
        for (const auto& p : model->parameters()) out.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
        return out;
      };
      // The same graph twice: the second backward adds the same gradient again.
      opt->zero_grad();
      auto loss = model->forward(x).pow(2).sum();
      loss.backward({}, /*retain_graph=*/true);
      const auto once = grads();
      BOOST_CHECK_NO_THROW(loss.backward());
      const auto twice = grads();
      for (std::size_t i = 0; i < once.size(); ++i) BOOST_TEST(torch::equal(twice[i], once[i] * 2), "parameter " << i);
      // Two losses over one forward.
      opt->zero_grad();
      auto out = model->forward(x);
      out.pow(2).sum().backward({}, /*retain_graph=*/true);
      BOOST_CHECK_NO_THROW(out.sum().backward());
      opt->step();
      // Two forwards, then their two backwards, at two steps in a row (the parts are synchronized at
      // each forward after a step).
      for (int step = 0; step < 2; ++step) {
        opt->zero_grad();
        auto first = model->forward(x).pow(2).sum();
        auto second = model->forward(x * 2).pow(2).sum();
        BOOST_CHECK_NO_THROW(first.backward());
        BOOST_CHECK_NO_THROW(second.backward());
        opt->step();
      }
      // A read-only summon between a forward and its backward.
      opt->zero_grad();
      auto kept = model->forward(x).pow(2).sum();
      { auto scope = model->summon_full_params(); }
      BOOST_CHECK_NO_THROW(kept.backward());
    }
  }
}
