// What the engine keeps resident and when (run at np = 1..4, part of test_engine): sharded memory,
// freeing after forward, eval, memory-bounded construction, no_sync, reshard_after_forward.
#include <boost/test/unit_test.hpp>

#include "engine_harness.hpp"

struct DeepImpl : torch::nn::Module {
  DeepImpl() {
    for (int i = 0; i < 4; ++i) layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(256, 256)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) {
      x = torch::relu(fsdp::forward(l, x));
      if (after_layer) after_layer();
    }
    return x;
  }
  std::vector<torch::nn::Linear> layers;
  std::function<void()> after_layer;  // lets a test look at memory inside forward
};

BOOST_AUTO_TEST_CASE(memory_is_sharded) {
  auto world = MpiComm::world();
  auto measure = [&](ShardingStrategy strategy) {
    torch::manual_seed(3);
    auto net = std::make_shared<DeepImpl>();
    FsdpOptions options;
    options.sharding_strategy = strategy;
    options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear"});
    auto model = fsdp::make_fsdp(net, world, options);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      model->forward(torch::randn({4, 256})).sum().backward();
      opt.step();
    }
    BOOST_TEST(model->memory_stats().gathered_param_bytes == 0);  // between steps nothing is gathered
    return model->memory_stats(&opt);
  };
  const auto full = measure(ShardingStrategy::FULL_SHARD);
  const auto replicated = measure(ShardingStrategy::NO_SHARD);
  const int64_t n = world.size();
  // params + grads + Adam's two moments, each 1/N of the unsharded flat parameters.
  const int64_t unsharded_state = 4 * full.unsharded_param_bytes;
  BOOST_TEST(full.shard_param_bytes * n == full.unsharded_param_bytes);
  BOOST_TEST(full.grad_bytes == full.shard_param_bytes);
  BOOST_TEST(full.optimizer_state_bytes == 2 * full.shard_param_bytes);
  BOOST_TEST(full.gathered_param_bytes == 0);
  BOOST_TEST(full.total() <= unsharded_state / n + full.largest_unit_bytes);
  BOOST_TEST(full.total() * n == unsharded_state);
  BOOST_TEST(replicated.total() == 4 * replicated.unsharded_param_bytes);
  // N x the sharded state is the replicated state plus padding (< N elements per unit, 4 tensors).
  BOOST_TEST(full.total() * n >= replicated.total());
  BOOST_TEST(full.total() * n - replicated.total() <= 4 * 4 * (n - 1) * 5);
}

BOOST_AUTO_TEST_CASE(full_shard_frees_each_unit_after_its_forward) {
  auto world = MpiComm::world();
  const int64_t unit_bytes = fsdp::padded_numel(256 * 256 + 256, world.size()) * 4;
  for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP}) {
    for (bool promise : {false, true}) {
      BOOST_TEST_CONTEXT("strategy=" << strategy << " all_units_called_through_forward=" << promise) {
        torch::manual_seed(3);
        auto net = std::make_shared<DeepImpl>();
        FsdpOptions options;
        options.sharding_strategy = strategy;
        options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear"});
        options.all_units_called_through_forward = promise;
        auto model = fsdp::make_fsdp(net, world, options);
        torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
        for (int step = 0; step < 2; ++step) {
          std::vector<int64_t> gathered;
          net->after_layer = [&] { gathered.push_back(model->memory_stats().gathered_param_bytes); };
          opt.zero_grad();
          auto loss = model->forward(torch::randn({4, 256})).sum();
          BOOST_TEST_REQUIRE(gathered.size() == 4u);
          for (std::size_t i = 0; i < gathered.size(); ++i) {
            int64_t expect = 0;  // one rank: the shard is the full parameter, nothing extra is held
            if (world.size() > 1) {
              if (strategy == ShardingStrategy::SHARD_GRAD_OP)  // kept for backward; the first forward gathers all up front
                expect = (step == 0 && !promise ? 4 : static_cast<int64_t>(i + 1)) * unit_bytes;
              else if (step == 0 && !promise)
                expect = static_cast<int64_t>(3 - i) * unit_bytes;  // first forward: not yet run ones
              else
                expect = 0;  // each layer freed right after its forward
            }
            BOOST_TEST(gathered[i] == expect, "step " << step << " after layer " << i);
          }
          net->after_layer = nullptr;
          loss.backward();
          opt.step();
          BOOST_TEST(model->memory_stats().gathered_param_bytes == 0);  // backward frees everything at its end
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(eval_under_no_grad_frees_parameters) {
  auto world = MpiComm::world();
  for (const auto& [strategy, group] : strategies_and_groups(world.size())) {
    for (auto s : {strategy, ShardingStrategy::HYBRID_SHARD_ZERO2}) {
      BOOST_TEST_CONTEXT(fsdp::to_string(s) << " group " << group) {
        auto net = std::static_pointer_cast<MlpImpl>(make_model(ModelKind::kMlp));
        FsdpOptions options;
        options.sharding_strategy = s;
        options.shard_group_size = group;
        options.auto_wrap_policy = AutoWrapPolicy::size_based(200);
        auto model = fsdp::make_fsdp(net, world, options);
        for (int round = 0; round < 2; ++round) {  // a training step, then evaluation
          model->train();
          model->forward(torch::randn({2, 13})).sum().backward();
          model->eval();
          torch::NoGradGuard no_grad;
          auto out = model->forward(torch::randn({2, 13}));
          BOOST_TEST(out.sizes() == (std::vector<int64_t>{2, 13}));
          BOOST_TEST(model->memory_stats().gathered_param_bytes == 0);
        }
      }
    }
  }
}

namespace {
/// Five Linear units and a BatchNorm (buffers) under the root; with `meta`, each layer's storage is
/// released (fsdp::defer_init) right after it is built, so the whole model never exists in memory.
struct WideImpl : torch::nn::Module {
  explicit WideImpl(bool meta) {
    auto place = [meta](auto module) {
      if (meta) fsdp::defer_init(*module);
      return module;
    };
    for (int i = 0; i < 5; ++i) layers.push_back(register_module("fc" + std::to_string(i), place(torch::nn::Linear(64, 64))));
    norm = register_module("norm", place(torch::nn::BatchNorm1d(64)));
    head = register_module("head", place(torch::nn::Linear(64, 4)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = torch::relu(fsdp::forward(l, x));
    return head(norm(x));
  }
  std::vector<torch::nn::Linear> layers;
  torch::nn::BatchNorm1d norm{nullptr};
  torch::nn::Linear head{nullptr};
};

/// Bytes of parameter storage the module's tree holds right now (meta and freed storage count 0).
std::int64_t live_param_bytes(torch::nn::Module& m) {
  std::int64_t bytes = 0;
  std::set<const void*> seen;
  for (const auto& p : m.parameters(/*recurse=*/true)) {
    if (!p.has_storage()) continue;
    const void* key = p.storage().unsafeGetStorageImpl();
    if (seen.insert(key).second) bytes += static_cast<std::int64_t>(p.storage().nbytes());
  }
  return bytes;
}
}  // namespace

BOOST_AUTO_TEST_CASE(memory_bounded_construction_with_deferred_init) {
  auto world = MpiComm::world();
  std::int64_t worst_live = 0;
  torch::nn::Module* root = nullptr;
  auto init = [&](torch::nn::Module& m, const std::string&) {
    if (root) worst_live = std::max(worst_live, live_param_bytes(*root));
    if (auto* linear = m.as<torch::nn::Linear>()) linear->reset_parameters();
    if (auto* bn = m.as<torch::nn::BatchNorm1d>()) {
      bn->reset_running_stats();
      bn->reset_parameters();
      bn->running_mean.fill_(0.5);  // something the default init would not give
    }
  };
  for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD}) {
    BOOST_TEST_CONTEXT("np=" << world.size() << " strategy=" << fsdp::to_string(strategy)) {
      std::map<std::string, torch::Tensor> results[2];
      for (bool meta : {false, true}) {
        FsdpOptions options;
        options.sharding_strategy = strategy;
        options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear"});
        options.param_init_fn = init;
        options.init_seed = 99;
        auto net = std::make_shared<WideImpl>(meta);
        root = meta ? net.get() : nullptr;
        worst_live = 0;
        torch::manual_seed(5);
        auto model = fsdp::make_fsdp(net, world, options);
        root = nullptr;
        if (meta) {
          // At any init call the tree held at most one unit's unsharded parameters (a Linear(64, 64)),
          // where units are sharded; NO_SHARD and one rank keep every parameter whole by definition.
          const std::int64_t unit = (64 * 64 + 64) * 4, all = 5 * unit + (64 * 4 + 4) * 4 + 2 * 64 * 4;
          const bool sharded = strategy != ShardingStrategy::NO_SHARD && world.size() > 1;
          BOOST_TEST(worst_live <= (sharded ? unit : all), "live parameter bytes during construction: " << worst_live);
          for (const auto& b : net->buffers()) BOOST_TEST(b.storage().nbytes() > 0u);
        }
        torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
        for (int step = 0; step < 3; ++step) {
          auto gen = at::make_generator<at::CPUGeneratorImpl>(77 + step);
          auto x = torch::randn({4 * world.size(), 64}, gen).narrow(0, 4 * world.rank(), 4);
          opt.zero_grad();
          model->forward(x).pow(2).mean().backward();
          opt.step();
        }
        for (auto& [name, t] : model->full_parameters()) results[meta ? 1 : 0][name] = t;
        auto buffers = net->named_buffers();
        BOOST_TEST(buffers["norm.running_var"].defined());
      }
      for (const auto& [name, t] : results[0]) BOOST_TEST(torch::equal(t, results[1].at(name)), "meta-built differs in " << name);
    }
  }
  // A meta module without param_init_fn is refused.
  try {
    fsdp::make_fsdp(std::make_shared<WideImpl>(true), world, FsdpOptions{});
    BOOST_FAIL("expected a ConfigError");
  } catch (const fsdp::ConfigError& e) {
    BOOST_TEST(std::string(e.what()).find("param_init_fn") != std::string::npos, e.what());
  }
}

BOOST_AUTO_TEST_CASE(no_sync_moves_no_gradient_bytes) {
  auto world = MpiComm::world();
  for (const auto& [strategy, group] : strategies_and_groups(world.size())) {
    for (bool overlap : {false, true}) {
      BOOST_TEST_CONTEXT("strategy=" << strategy << " group=" << group << " overlap_grad_reduce=" << overlap) {
        auto net = std::static_pointer_cast<MlpImpl>(make_model(ModelKind::kMlp));
        FsdpOptions options;
        options.sharding_strategy = strategy;
        options.shard_group_size = group;
        options.overlap_grad_reduce = overlap;
        options.auto_wrap_policy = AutoWrapPolicy::size_based(200);
        auto model = fsdp::make_fsdp(net, world, options);
        auto reduced_bytes = [&] {
          // All of the engine's communicators: overlapped reductions run on the worker's duplicates.
          const auto c = model->comm_counters();
          return c.reduce_scatter_bytes + c.all_reduce_bytes;
        };
        const auto before = reduced_bytes();
        {
          auto scope = model->no_sync();
          model->forward(torch::randn({2, 13})).sum().backward();
        }
        BOOST_TEST(reduced_bytes() == before);  // gradients stayed local
        for (const auto& p : model->parameters()) BOOST_TEST(!p.grad().defined());
        BOOST_TEST(model->memory_stats().grad_bytes > 0);  // ... in the unsharded accumulators
        model->forward(torch::randn({2, 13})).sum().backward();
        if (world.size() > 1) BOOST_TEST(reduced_bytes() > before);
        for (const auto& p : model->parameters()) BOOST_TEST(p.grad().defined());
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(reshard_after_forward_overrides_the_strategy) {
  auto world = MpiComm::world();
  const int64_t unit_bytes = fsdp::padded_numel(256 * 256 + 256, world.size()) * 4;
  for (auto [strategy, reshard] : {std::pair{ShardingStrategy::FULL_SHARD, false}, std::pair{ShardingStrategy::SHARD_GRAD_OP, true}}) {
    BOOST_TEST_CONTEXT("strategy=" << strategy << " reshard_after_forward=" << reshard) {
      torch::manual_seed(3);
      auto net = std::make_shared<DeepImpl>();
      FsdpOptions options;
      options.sharding_strategy = strategy;
      options.reshard_after_forward = reshard;
      options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear"});
      options.all_units_called_through_forward = true;
      auto model = fsdp::make_fsdp(net, world, options);
      std::vector<int64_t> gathered;
      net->after_layer = [&] { gathered.push_back(model->memory_stats().gathered_param_bytes); };
      auto loss = model->forward(torch::randn({4, 256})).sum();
      BOOST_TEST_REQUIRE(gathered.size() == 4u);
      for (std::size_t i = 0; i < 4; ++i) {
        const int64_t expect = world.size() == 1 || reshard ? 0 : static_cast<int64_t>(i + 1) * unit_bytes;
        BOOST_TEST(gathered[i] == expect);
      }
      net->after_layer = nullptr;
      loss.backward();
      BOOST_TEST(model->memory_stats().gathered_param_bytes == 0);
    }
  }
}

// fsdp::create_adam_state_ahead: the state Adam's and AdamW's first step would create, made before the
// first forward (so that it does not take the holes the first backward leaves), gives the same bits;
// optimizers it does not know keep creating their own.
BOOST_AUTO_TEST_CASE(adam_state_created_ahead_updates_as_the_lazy_one) {
  auto make = [] {
    torch::manual_seed(11);
    return std::vector<torch::Tensor>{torch::randn({6, 3}).requires_grad_(), torch::randn({0}).requires_grad_(), torch::randn({4}).requires_grad_()};
  };
  auto train = [](torch::optim::Optimizer& opt, std::vector<torch::Tensor>& p) {
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      torch::manual_seed(70 + step);
      (p[0].mul(torch::randn({6, 3})).sum() + p[1].sum() + p[2].pow(3).sum()).backward();
      opt.step();
    }
  };
  auto lazy = make(), ahead = make(), ahead_w = make(), lazy_w = make();
  torch::optim::Adam lazy_opt(lazy, torch::optim::AdamOptions(1e-2).amsgrad(true).weight_decay(0.1));
  torch::optim::Adam ahead_opt(ahead, torch::optim::AdamOptions(1e-2).amsgrad(true).weight_decay(0.1));
  torch::optim::AdamW lazy_w_opt(lazy_w, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  torch::optim::AdamW ahead_w_opt(ahead_w, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  BOOST_TEST(fsdp::create_adam_state_ahead(ahead_opt) == 3);
  BOOST_TEST(fsdp::create_adam_state_ahead(ahead_w_opt) == 3);
  BOOST_TEST(fsdp::create_adam_state_ahead(ahead_w_opt) == 0);                // nothing twice
  BOOST_TEST(fsdp::optimizer_state_bytes(ahead_opt) == 3 * (6 * 3 + 4) * 4);  // exp_avg, exp_avg_sq, max_exp_avg_sq
  BOOST_TEST(fsdp::optimizer_state_bytes(ahead_w_opt) == 2 * (6 * 3 + 4) * 4);
  const auto& created = static_cast<const torch::optim::AdamWParamState&>(*ahead_w_opt.state().at(fsdp::optimizer_state_key(ahead_w[0])));
  const void* moments = created.exp_avg().data_ptr();  // the step must use this state, not make its own
  train(lazy_opt, lazy);
  train(ahead_opt, ahead);
  train(lazy_w_opt, lazy_w);
  train(ahead_w_opt, ahead_w);
  for (std::size_t i = 0; i < lazy.size(); ++i) {
    BOOST_TEST(torch::equal(lazy[i], ahead[i]), "Adam parameter " << i);
    BOOST_TEST(torch::equal(lazy_w[i], ahead_w[i]), "AdamW parameter " << i);
  }
  const auto& state = static_cast<const torch::optim::AdamParamState&>(*ahead_opt.state().at(fsdp::optimizer_state_key(ahead[0])));
  BOOST_TEST(state.step() == 3);
  BOOST_TEST(ahead_opt.state().size() == 3);
  BOOST_TEST(ahead_w_opt.state().size() == 3);
  const auto& used = static_cast<const torch::optim::AdamWParamState&>(*ahead_w_opt.state().at(fsdp::optimizer_state_key(ahead_w[0])));
  BOOST_TEST(used.exp_avg().data_ptr() == moments);
  BOOST_TEST(used.step() == 3);
  std::vector<torch::Tensor> other = make();
  torch::optim::SGD sgd(other, torch::optim::SGDOptions(1e-2).momentum(0.9).dampening(0.5));  // its first step copies the gradient
  BOOST_TEST(fsdp::create_adam_state_ahead(sgd) == 0);
  BOOST_TEST(sgd.state().empty());
}

// A vocabulary-sized output projection (one parameter, a unit of its own), as fsdp-train's LM head.
// A vocabulary-sized output projection whose forward reads its weight `reads` times.
struct VocabHeadImpl : torch::nn::Module {
  VocabHeadImpl(int64_t d, int64_t vocab, bool releasing, int reads) : torch::nn::Module("VocabHead"), releasing(releasing), reads(reads) {
    weight = register_parameter("weight", torch::randn({vocab, d}) * 0.02);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y;
    for (int r = 0; r < reads; ++r) {
      auto input = x * static_cast<double>(r + 1);
      auto out = releasing ? fsdp::linear_releasing_weight(*this, input, weight) : torch::nn::functional::linear(input, weight);
      y = y.defined() ? y + out : out;
    }
    return y;
  }
  torch::Tensor weight;
  bool releasing;
  int reads;
};
TORCH_MODULE(VocabHead);

/// Calls `run` before the node it is added to runs (a tensor hook would stay on the first step's node).
struct BeforeNode : torch::autograd::FunctionPreHook {
  explicit BeforeNode(std::function<void()> run) : run(std::move(run)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    run();
    return grads;
  }
  std::function<void()> run;
};

/// Three steps of Adam on `net` under `options`, watching the engine when `watched`'s gradient reaches
/// its unit's node (before it is reduced).
struct WatchedRun {
  std::vector<std::pair<std::string, torch::Tensor>> finals;
  std::vector<int64_t> gathered_at_gradient;  // one per backward
  int64_t released_before_gradient = 0;
  std::uint64_t all_gather_bytes = 0;
};

template <class Net>
WatchedRun train_watching(const std::shared_ptr<Net>& net, const torch::Tensor& watched, const FsdpOptions& options,
                          const std::function<torch::Tensor()>& make_input, bool twice_over_one_graph = false) {
  auto world = MpiComm::world();
  auto model = fsdp::make_fsdp(net, world, options);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  WatchedRun run;
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(100 + step * world.size() + world.rank());
    opt.zero_grad();
    auto loss = model->forward(make_input()).pow(2).mean();
    watched.grad_fn()->add_pre_hook(
        std::make_unique<BeforeNode>([&] { run.gathered_at_gradient.push_back(model->memory_stats().gathered_param_bytes); }));
    if (twice_over_one_graph) loss.backward({}, /*retain_graph=*/true);
    loss.backward();
    opt.step();
  }
  run.finals = model->full_parameters();
  run.released_before_gradient = model->overlap_stats().released_before_gradient;
  run.all_gather_bytes = model->comm_counters().all_gather_bytes;
  return run;
}

void check_same_bits(const WatchedRun& plain, const WatchedRun& lean) {
  BOOST_TEST_REQUIRE(plain.finals.size() == lean.finals.size());
  for (std::size_t i = 0; i < plain.finals.size(); ++i)
    BOOST_TEST(torch::equal(plain.finals[i].second, lean.finals[i].second), plain.finals[i].first << ": the same bits as the plain calls");
}

struct BodyAndHeadImpl : torch::nn::Module {
  BodyAndHeadImpl(bool releasing, int reads) {
    body = register_module("body", torch::nn::Linear(32, 32));
    head = register_module("head", VocabHead(32, 500, releasing, reads));
  }
  torch::Tensor forward(torch::Tensor x) { return fsdp::forward(head, torch::tanh(fsdp::forward(body, x))); }
  torch::nn::Linear body{nullptr};
  VocabHead head{nullptr};
};

// The head's backward computes its input's gradient, lets the engine free the gathered weight, then
// computes the weight's gradient: under a sharding strategy that gathers, the two vocabulary-sized
// matrices are never held at once; the products are F::linear's own (the same bits). The engine frees
// nothing while another node may still read the weight: a second read in the same forward (freed
// after the last), a recomputation (activation checkpointing), a graph kept for a second backward.
BOOST_AUTO_TEST_CASE(a_head_frees_its_gathered_weight_before_its_gradient_exists) {
  auto world = MpiComm::world();
  const int64_t head_bytes = fsdp::padded_numel(500 * 32, world.size()) * 4;
  struct Case {
    ShardingStrategy strategy;
    fsdp::BackwardPrefetch prefetch = fsdp::BackwardPrefetch::NO_PREFETCH;
    int reads = 1;
    bool checkpointed = false;
    bool twice_over_one_graph = false;
  };
  using fsdp::BackwardPrefetch;
  const std::vector<Case> cases = {
      {ShardingStrategy::FULL_SHARD},
      {ShardingStrategy::SHARD_GRAD_OP},
      {ShardingStrategy::NO_SHARD},
      {ShardingStrategy::FULL_SHARD, BackwardPrefetch::BACKWARD_PRE},
      {ShardingStrategy::FULL_SHARD, BackwardPrefetch::BACKWARD_POST},
      {ShardingStrategy::FULL_SHARD, BackwardPrefetch::NO_PREFETCH, /*reads=*/2},
      {ShardingStrategy::FULL_SHARD, BackwardPrefetch::NO_PREFETCH, 1, /*checkpointed=*/true},
      {ShardingStrategy::FULL_SHARD, BackwardPrefetch::NO_PREFETCH, 1, false, /*twice_over_one_graph=*/true},
  };
  for (const auto& c : cases) {
    BOOST_TEST_CONTEXT("strategy=" << c.strategy << " prefetch=" << c.prefetch << " reads=" << c.reads << (c.checkpointed ? " checkpointed" : "")
                                   << (c.twice_over_one_graph ? " retain_graph" : "") << " at world size " << world.size()) {
      std::vector<WatchedRun> runs;
      for (const bool releasing : {false, true}) {
        torch::manual_seed(5);
        auto net = std::make_shared<BodyAndHeadImpl>(releasing, c.reads);
        FsdpOptions options;
        options.sharding_strategy = c.strategy;
        options.backward_prefetch = c.prefetch;
        options.activation_checkpointing = c.checkpointed;
        options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear", "VocabHead"});
        runs.push_back(train_watching(
            net, net->head->weight, options,
            [] {
              return torch::randn({2, 6, 32});
            },
            c.twice_over_one_graph));
      }
      check_same_bits(runs[0], runs[1]);
      BOOST_TEST(runs[0].released_before_gradient == 0);
      // Once per step (the first of two backwards over one graph; the second re-gathers it).
      const bool releases = world.size() > 1 && c.strategy != ShardingStrategy::NO_SHARD && !c.checkpointed;
      BOOST_TEST(runs[1].released_before_gradient == (releases ? 3 : 0));
      BOOST_TEST(runs[1].all_gather_bytes == runs[0].all_gather_bytes, "no all-gather more");
      const std::size_t backwards = c.twice_over_one_graph ? 6 : 3;
      BOOST_TEST_REQUIRE(runs[0].gathered_at_gradient.size() == backwards);
      BOOST_TEST_REQUIRE(runs[1].gathered_at_gradient.size() == backwards);
      for (std::size_t b = 0; b < backwards; ++b) {
        const bool freed = releases && (!c.twice_over_one_graph || b % 2 == 0);
        BOOST_TEST(runs[1].gathered_at_gradient[b] == runs[0].gathered_at_gradient[b] - (freed ? head_bytes : 0), "backward " << b);
      }
    }
  }
}

// The reads of a weight read twice are counted until backward ends, across forwards: an evaluation
// forward between a training forward and its backward, or a second training forward whose loss is
// added to the first, frees nothing while a read is to come (the same bits as F::linear).
BOOST_AUTO_TEST_CASE(a_weight_read_twice_stays_gathered_until_its_last_read_across_forwards) {
  auto world = MpiComm::world();
  for (const bool summed : {false, true}) {
    BOOST_TEST_CONTEXT((summed ? "two forwards, one backward" : "an evaluation forward before the backward") << " at world size " << world.size()) {
      std::vector<std::vector<std::pair<std::string, torch::Tensor>>> finals;
      for (const bool releasing : {false, true}) {
        torch::manual_seed(7);
        auto net = std::make_shared<BodyAndHeadImpl>(releasing, /*reads=*/2);
        FsdpOptions options;
        options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear", "VocabHead"});
        auto model = fsdp::make_fsdp(net, world, options);
        torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
        for (int step = 0; step < 3; ++step) {
          torch::manual_seed(300 + step * world.size() + world.rank());
          opt.zero_grad();
          auto loss = model->forward(torch::randn({2, 6, 32})).pow(2).mean();
          if (summed) {
            loss = loss + model->forward(torch::randn({2, 6, 32})).pow(2).mean();
          } else {
            torch::NoGradGuard evaluation;
            (void)model->forward(torch::randn({2, 6, 32}));
          }
          BOOST_REQUIRE_NO_THROW(loss.backward());
          opt.step();
        }
        finals.push_back(model->full_parameters());
      }
      BOOST_TEST_REQUIRE(finals[0].size() == finals[1].size());
      for (std::size_t i = 0; i < finals[0].size(); ++i)
        BOOST_TEST(torch::equal(finals[0][i].second, finals[1][i].second), finals[0][i].first << ": the same bits as F::linear");
    }
  }
}

struct EmbeddingAndBodyImpl : torch::nn::Module {
  explicit EmbeddingAndBodyImpl(bool declared) : declared(declared) {
    tok = register_module("tok", torch::nn::Embedding(500, 32));
    body = register_module("body", torch::nn::Linear(32, 32));
  }
  torch::Tensor forward(torch::Tensor idx) {
    auto x = fsdp::forward(tok, idx);
    if (declared) fsdp::backward_reads_no_parameter(*tok);
    return fsdp::forward(body, torch::tanh(x));
  }
  torch::nn::Embedding tok{nullptr};
  torch::nn::Linear body{nullptr};
  bool declared;
};

// An embedding's backward reads only its indices: declared so, its unit is all-gathered once per step
// (for forward, and not prefetched for backward) and not held beside its gradient at the end of
// backward; the same bits as without.
BOOST_AUTO_TEST_CASE(an_embedding_declared_so_is_not_gathered_for_backward) {
  auto world = MpiComm::world();
  const int64_t embedding_bytes = fsdp::padded_numel(500 * 32, world.size()) * 4;
  using fsdp::BackwardPrefetch;
  struct Case {
    ShardingStrategy strategy;
    BackwardPrefetch prefetch = BackwardPrefetch::NO_PREFETCH;
    bool checkpointed = false;  // a checkpointed unit runs its forward again in backward: the declaration is then ignored
  };
  const std::vector<Case> cases = {{ShardingStrategy::FULL_SHARD},
                                   {ShardingStrategy::NO_SHARD},
                                   {ShardingStrategy::FULL_SHARD, BackwardPrefetch::BACKWARD_PRE},
                                   {ShardingStrategy::FULL_SHARD, BackwardPrefetch::BACKWARD_POST},
                                   {ShardingStrategy::FULL_SHARD, BackwardPrefetch::NO_PREFETCH, /*checkpointed=*/true}};
  for (const auto& c : cases) {
    BOOST_TEST_CONTEXT("strategy=" << c.strategy << " prefetch=" << c.prefetch << (c.checkpointed ? " checkpointed" : "") << " at world size "
                                   << world.size()) {
      std::vector<WatchedRun> runs;
      for (const bool declared : {false, true}) {
        torch::manual_seed(6);
        auto net = std::make_shared<EmbeddingAndBodyImpl>(declared);
        FsdpOptions options;
        options.sharding_strategy = c.strategy;
        options.backward_prefetch = c.prefetch;
        options.activation_checkpointing = c.checkpointed;
        options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear", "Embedding"});
        runs.push_back(train_watching(net, net->tok->weight, options, [] { return torch::randint(500, {2, 6}, torch::kLong); }));
      }
      check_same_bits(runs[0], runs[1]);
      const bool gathers = world.size() > 1 && c.strategy == ShardingStrategy::FULL_SHARD && !c.checkpointed;
      // One all-gather of this rank's shard of the embedding fewer per step.
      const std::uint64_t saved = gathers ? 3 * static_cast<std::uint64_t>(embedding_bytes / world.size()) : 0;
      BOOST_TEST(runs[0].all_gather_bytes - runs[1].all_gather_bytes == saved);
      BOOST_TEST_REQUIRE(runs[0].gathered_at_gradient.size() == 3u);
      BOOST_TEST_REQUIRE(runs[1].gathered_at_gradient.size() == 3u);
      for (std::size_t s = 0; s < 3; ++s)
        BOOST_TEST(runs[1].gathered_at_gradient[s] == runs[0].gathered_at_gradient[s] - (gathers ? embedding_bytes : 0), "step " << s);
    }
  }
}
