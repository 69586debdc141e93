// Adam and AdamW with bf16 moments (fsdp::optim::Bf16MomentsAdam, optim.state_dtype = "bf16"): the
// stochastic rounding, the state's bytes, how close it tracks fp32 moments, and that every strategy at
// every world size equals single-process training with the same optimizer (whole-model error). And the
// fp32 one-pass Adam and AdamW (fsdp::optim::OnePassAdam, fsdp-train's default): LibTorch's update.
#include <boost/test/unit_test.hpp>

#include "engine_harness.hpp"

namespace {

using fsdp::optim::detail::float_to_bf16_stochastic;

float bf16_value(std::uint16_t bits) { return std::bit_cast<float>(std::uint32_t{bits} << 16); }

/// The element places of `fsdp_model`'s units, by parameter name, for a plain module's optimizer: the
/// single-process reference then rounds each element as the sharded run does.
template <class Engine>
fsdp::optim::PlaceOfParameter places_by_name(Engine& fsdp_model, const torch::nn::Module& plain) {
  std::map<std::string, fsdp::optim::ElementPlace> by_name;
  for (const auto& u : fsdp_model.sharded_units())
    for (std::size_t i = 0; i < u.param_names.size(); ++i)
      by_name[u.param_names[i]] = {static_cast<std::uint64_t>(u.index), u.layout.param_offset(static_cast<std::int64_t>(i))};
  for (const auto& [name, aliases] : fsdp_model.tied_parameter_aliases())
    for (const auto& alias : aliases) by_name[alias] = by_name.at(name);
  std::map<const c10::TensorImpl*, fsdp::optim::ElementPlace> places;
  for (const auto& p : plain.named_parameters()) places[p.value().unsafeGetTensorImpl()] = by_name.at(p.key());
  return [places](const torch::Tensor& p) { return places.at(p.unsafeGetTensorImpl()); };
}

std::unique_ptr<torch::optim::Optimizer> make_bf16_adamw(std::vector<torch::Tensor> params, fsdp::optim::PlaceOfParameter places) {
  // The harness's AdamW settings (make_optimizer), with bf16 moments.
  return std::make_unique<fsdp::optim::AdamWBf16Moments>(std::move(params), torch::optim::AdamWOptions(1e-2).weight_decay(0.05).eps(1e-6),
                                                         std::move(places));
}

/// train_fsdp's loop over `model` with `opt` (MLP, kSteps steps on this rank's rows of each global batch).
template <class Engine>
void train_mlp(Engine& model, torch::nn::Module& net, torch::optim::Optimizer& opt, int world, int rank) {
  for (int step = 0; step < kSteps; ++step) {
    set_gate(net, step % 2 == 0);
    auto batch = global_batch(ModelKind::kMlp, step, kLocalRows * world);
    opt.zero_grad();
    auto x = batch.x.narrow(0, rank * kLocalRows, kLocalRows), y = batch.y.narrow(0, rank * kLocalRows, kLocalRows);
    loss_of(ModelKind::kMlp, model.forward(x), y).backward();
    opt.step();
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(bf16_stochastic_rounding_is_unbiased_and_exact_where_it_can_be) {
  // A value bf16 holds comes back unchanged whatever the random bits.
  for (const float exact : {0.0f, 1.5f, -3.25f, 0x1p-70f, 65536.0f})
    for (std::uint32_t r : {0U, 1U, 0x7fffU, 0x8000U, 0xffffU}) BOOST_TEST(bf16_value(float_to_bf16_stochastic(exact, r)) == exact);
  // Over every random draw the mean is the value itself (rounded up for `low` of 65536 draws).
  for (const float value : {1.0f + 0.3f / 128, -2.7182817f, 3.1415927e-5f, 0.1f}) {
    double sum = 0;
    for (std::uint32_t r = 0; r < 65536; ++r) sum += bf16_value(float_to_bf16_stochastic(value, r));
    BOOST_TEST(sum / 65536 == static_cast<double>(value), boost::test_tools::tolerance(1e-7));
    // and each draw is one of the two neighbours
    const float down = bf16_value(float_to_bf16_stochastic(value, 0)), up = bf16_value(float_to_bf16_stochastic(value, 0xffff));
    BOOST_TEST(std::abs(down) <= std::abs(value));
    BOOST_TEST(std::abs(up) >= std::abs(value));
  }
  BOOST_TEST(std::isnan(bf16_value(float_to_bf16_stochastic(std::numeric_limits<float>::quiet_NaN(), 0xffff))));
  BOOST_TEST(std::isinf(bf16_value(float_to_bf16_stochastic(std::numeric_limits<float>::infinity(), 0xffff))));
}

BOOST_AUTO_TEST_CASE(bf16_moments_are_unbiased_over_many_steps) {
  // 2^17 elements see the same gradients for 300 steps: the mean of their bf16 moments stays on the
  // moments computed in double (each element's rounding errors are independent draws), and so does
  // the mean update. Round-to-nearest would hold exp_avg_sq still once a step moves it by less than
  // half a bf16 spacing (beta2 = 0.999).
  const std::int64_t n = std::int64_t{1} << 17;
  auto p = torch::zeros({n}).requires_grad_();
  const double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  fsdp::optim::AdamBf16Moments opt({p}, torch::optim::AdamOptions(lr).betas({beta1, beta2}).eps(eps));
  double m = 0, v = 0, x = 0;
  auto gen = at::detail::createCPUGenerator(3);
  for (int step = 1; step <= 300; ++step) {
    const double g = 0.05 + torch::rand({1}, gen).item<double>() * (step < 150 ? 1.0 : 0.1);  // the gradients shrink half way
    p.mutable_grad() = torch::full({n}, g);
    opt.step();
    m = beta1 * m + (1 - beta1) * g;
    v = beta2 * v + (1 - beta2) * g * g;
    x -= lr / (1 - std::pow(beta1, step)) * m / (std::sqrt(v / (1 - std::pow(beta2, step))) + eps);
  }
  const auto view = fsdp::optimizer_state_view(*opt.state().at(fsdp::optimizer_state_key(p)));
  const double mean_m = view.tensors[0].second.to(torch::kDouble).mean().item<double>();
  const double mean_v = view.tensors[1].second.to(torch::kDouble).mean().item<double>();
  const double mean_x = p.detach().to(torch::kDouble).mean().item<double>();
  BOOST_TEST(mean_m == m, boost::test_tools::tolerance(2e-4));
  BOOST_TEST(mean_v == v, boost::test_tools::tolerance(2e-4));
  BOOST_TEST(mean_x == x, boost::test_tools::tolerance(2e-4));
}

BOOST_AUTO_TEST_CASE(bf16_moments_take_half_the_bytes_and_track_fp32_moments) {
  const int world = MpiComm::world().size();
  const int rank = MpiComm::world().rank();
  FsdpOptions options;
  options.auto_wrap_policy = AutoWrapPolicy::size_based(200);
  const auto fp32 = train_fsdp(ModelKind::kMlp, OptimKind::kAdamW, options);

  auto net = std::static_pointer_cast<MlpImpl>(make_model(ModelKind::kMlp));
  auto model = fsdp::make_fsdp(net, MpiComm::world(), options);
  auto opt = make_bf16_adamw(model->parameters(), fsdp::optim::places_in_units(*model));
  BOOST_TEST(fsdp::optimizer_kind(*opt) == "AdamW");  // checkpoints name it as AdamW: they load into either setting
  train_mlp(*model, *net, *opt, world, rank);
  std::map<std::string, torch::Tensor> bf16;
  for (auto& [name, t] : model->full_parameters()) bf16[name] = t;

  std::int64_t elements = 0;
  for (const auto& p : model->parameters()) {
    elements += p.numel();
    const auto view = fsdp::optimizer_state_view(*opt->state().at(fsdp::optimizer_state_key(p)));
    BOOST_TEST(view.step == kSteps);
    for (const auto& [name, t] : view.tensors) BOOST_TEST((t.scalar_type() == torch::kBFloat16), name);
  }
  BOOST_TEST(model->memory_stats(opt.get()).optimizer_state_bytes == 2 * 2 * elements);  // two moments of 2 bytes
  BOOST_TEST(fp32.optimizer_state_bytes == 2 * 4 * elements);                            // fp32 moments: 2 x 4 bytes
  // The moments differ from fp32's by bf16's rounding (a relative 2^-8 per element per step); after a
  // few steps the whole model is within a few 1e-4 of fp32 moments, and not equal to it.
  const double err = relative_error_of_model(bf16, fp32.params);
  BOOST_TEST(err < 2e-3);
  BOOST_TEST(err > 0.0);
  BOOST_TEST_MESSAGE("np=" << world << " bf16 against fp32 moments: whole-model relative error " << err);
}

BOOST_AUTO_TEST_CASE(bf16_moments_round_by_place_and_step_alone) {
  // The same gradients give bit-identical parameters and moments whether a tensor is updated whole,
  // in shard-like pieces placed where they lie, or on more threads (n spans several of the update's
  // parallel chunks of 2^14): the rounding follows the element.
  const std::int64_t n = 70001;
  auto gen = at::detail::createCPUGenerator(99);
  const auto init = torch::randn({n}, gen);
  std::vector<torch::Tensor> grads;
  for (int step = 0; step < 5; ++step) grads.push_back(torch::randn({n}, gen) * (step + 1));
  auto run = [&](const std::vector<std::int64_t>& cuts, int threads) {
    std::vector<torch::Tensor> pieces;
    std::map<const c10::TensorImpl*, fsdp::optim::ElementPlace> places;
    for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
      pieces.push_back(init.narrow(0, cuts[k], cuts[k + 1] - cuts[k]).clone().requires_grad_());
      places[pieces.back().unsafeGetTensorImpl()] = {5, cuts[k]};
    }
    fsdp::optim::AdamWBf16Moments opt(pieces, torch::optim::AdamWOptions(1e-2).weight_decay(0.1),
                                      [&places](const torch::Tensor& p) { return places.at(p.unsafeGetTensorImpl()); });
    const int before = at::get_num_threads();
    at::set_num_threads(threads);
    for (const auto& g : grads) {
      for (std::size_t k = 0; k < pieces.size(); ++k) pieces[k].mutable_grad() = g.narrow(0, cuts[k], cuts[k + 1] - cuts[k]).clone();
      opt.step();
    }
    at::set_num_threads(before);
    std::vector<torch::Tensor> params, m, v;
    for (const auto& p : pieces) {
      params.push_back(p.detach());
      const auto view = fsdp::optimizer_state_view(*opt.state().at(fsdp::optimizer_state_key(p)));
      m.push_back(view.tensors[0].second.view(torch::kInt16));
      v.push_back(view.tensors[1].second.view(torch::kInt16));
    }
    return std::vector<torch::Tensor>{torch::cat(params), torch::cat(m), torch::cat(v)};
  };
  const auto whole = run({0, n}, 1);
  for (const auto& [cuts, threads] :
       std::vector<std::pair<std::vector<std::int64_t>, int>>{{{0, 23334, 46668, n}, 1}, {{0, 1, 500, n}, 1}, {{0, n}, 2}, {{0, 35000, n}, 2}}) {
    const auto got = run(cuts, threads);
    BOOST_TEST_CONTEXT(cuts.size() - 1 << " piece(s), " << threads << " thread(s)") {
      for (std::size_t i = 0; i < whole.size(); ++i) BOOST_TEST(torch::equal(got[i], whole[i]));
    }
  }
  // Another place is another draw: the rounding does differ somewhere.
  auto shifted = [&] {
    auto p = init.clone().requires_grad_();
    fsdp::optim::AdamWBf16Moments opt({p}, torch::optim::AdamWOptions(1e-2).weight_decay(0.1), [](const torch::Tensor&) {
      return fsdp::optim::ElementPlace{5, 1};
    });
    for (const auto& g : grads) {
      p.mutable_grad() = g.clone();
      opt.step();
    }
    return p.detach();
  }();
  BOOST_TEST(!torch::equal(shifted, whole[0]));
}

BOOST_AUTO_TEST_CASE(bf16_moments_match_single_process_at_every_world_size_and_strategy) {
  // Each element rounds by its place in its unit, so a sharded run rounds as the single-process
  // reference does. Not to 1e-5 always, though: where the reductions' summation order moves a moment
  // across a rounding threshold (about once in 10^4 element-steps), that element differs by one bf16
  // step. So the bound is relative: the sharded run must be far closer to the reference than the
  // reference is to itself with every element's random draw moved to its neighbour's place (what a
  // rounding that followed the rank rather than the element would give).
  const int world = MpiComm::world().size();
  const int rank = MpiComm::world().rank();
  for (const auto& [strategy, group] : strategies_and_groups(world)) {
    for (const auto sharding : {fsdp::OptimizerSharding::GROUP, fsdp::OptimizerSharding::WORLD}) {
      const bool hybrid = strategy == ShardingStrategy::HYBRID_SHARD || strategy == ShardingStrategy::HYBRID_SHARD_ZERO2;
      if (sharding == fsdp::OptimizerSharding::WORLD && !hybrid) continue;
      BOOST_TEST_CONTEXT("np=" << world << " strategy=" << strategy << " group=" << group
                               << " optimizer over the world=" << (sharding == fsdp::OptimizerSharding::WORLD)) {
        FsdpOptions options;
        options.sharding_strategy = strategy;
        options.shard_group_size = group;
        options.optimizer_sharding = sharding;
        options.auto_wrap_policy = AutoWrapPolicy::size_based(200);
        auto net = std::static_pointer_cast<MlpImpl>(make_model(ModelKind::kMlp));
        auto model = fsdp::make_fsdp(net, MpiComm::world(), options);
        auto opt = make_bf16_adamw(model->parameters(), fsdp::optim::places_in_units(*model));
        train_mlp(*model, *net, *opt, world, rank);
        std::map<std::string, torch::Tensor> got;
        for (auto& [name, t] : model->full_parameters()) got[name] = t;

        // The reference: the whole global batch in one process, each element placed as in the units
        // (or `shift` elements on).
        auto reference = [&](std::int64_t shift) {
          auto plain = std::static_pointer_cast<MlpImpl>(make_model(ModelKind::kMlp));
          auto placed = places_by_name(*model, *plain);
          auto ref_opt = make_bf16_adamw(unique_parameters(*plain), [placed, shift](const torch::Tensor& p) {
            auto place = placed(p);
            place.offset += shift;
            return place;
          });
          for (int step = 0; step < kSteps; ++step) {
            set_gate(*plain, step % 2 == 0);
            auto batch = global_batch(ModelKind::kMlp, step, kLocalRows * world);
            ref_opt->zero_grad();
            loss_of(ModelKind::kMlp, plain->forward(batch.x), batch.y).backward();
            for (auto& p : plain->parameters())
              if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
            ref_opt->step();
          }
          std::map<std::string, torch::Tensor> out;
          for (const auto& p : plain->named_parameters()) out[p.key()] = p.value().detach().clone();
          return out;
        };
        const auto ref = reference(0);
        const double err = relative_error_of_model(got, ref);
        const double other_draws = relative_error_of_model(reference(1), ref);
        BOOST_TEST(err < 0.1 * other_draws);
        if (rank == 0) BOOST_TEST_MESSAGE("np=" << world << ": whole-model error " << err << ", with other draws " << other_draws);
        check_ranks_agree(got);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(one_bf16_moment_step_is_torchs_adam_step) {
  // From the same state (bf16 moments widened to fp32 for torch), one step of Adam (L2 decay) and of
  // AdamW (decoupled decay) gives torch's parameters to rounding, and moments within one bf16
  // spacing of torch's fp32 ones. Two earlier steps make the bias corrections differ from 1.
  auto gen = at::detail::createCPUGenerator(11);
  const auto init = torch::randn({5000}, gen);
  std::vector<torch::Tensor> grads;
  for (int i = 0; i < 3; ++i) grads.push_back(torch::randn({5000}, gen));
  auto check = [&](auto* ours_type, auto* torch_type, const auto& options) {
    using Ours = std::remove_pointer_t<decltype(ours_type)>;
    using Torch = std::remove_pointer_t<decltype(torch_type)>;
    auto p = init.clone().requires_grad_();
    Ours ours({p}, options);
    for (int i = 0; i < 2; ++i) {
      p.mutable_grad() = grads[static_cast<std::size_t>(i)].clone();
      ours.step();
    }
    auto q = p.detach().clone().requires_grad_();
    Torch reference({q}, options);
    auto view = fsdp::optimizer_state_view(*ours.state().at(fsdp::optimizer_state_key(p)));
    for (auto& [name, t] : view.tensors) t = t.to(torch::kFloat);
    reference.state()[fsdp::optimizer_state_key(q)] = fsdp::make_optimizer_state(reference, view);
    p.mutable_grad() = grads[2].clone();
    q.mutable_grad() = grads[2].clone();
    ours.step();
    reference.step();
    BOOST_TEST(relative_error_of_model({{"p", p.detach()}}, {{"p", q.detach()}}) < 1e-6);
    const auto got = fsdp::optimizer_state_view(*ours.state().at(fsdp::optimizer_state_key(p)));
    const auto want = fsdp::optimizer_state_view(*reference.state().at(fsdp::optimizer_state_key(q)));
    BOOST_TEST(got.step == 3);
    BOOST_TEST(want.step == 3);
    for (std::size_t k = 0; k < 2; ++k) {
      const auto diff = (got.tensors[k].second.to(torch::kFloat) - want.tensors[k].second).abs();
      BOOST_TEST((diff <= want.tensors[k].second.abs() / 128 + 1e-30).all().template item<bool>(), got.tensors[k].first);
    }
  };
  check(static_cast<fsdp::optim::AdamBf16Moments*>(nullptr), static_cast<torch::optim::Adam*>(nullptr),
        torch::optim::AdamOptions(1e-2).betas({0.8, 0.95}).weight_decay(0.1).eps(1e-6));
  check(static_cast<fsdp::optim::AdamWBf16Moments*>(nullptr), static_cast<torch::optim::AdamW*>(nullptr),
        torch::optim::AdamWOptions(1e-2).betas({0.8, 0.95}).weight_decay(0.1).eps(1e-6));
}

BOOST_AUTO_TEST_CASE(bf16_moments_refuse_what_they_cannot_update) {
  auto double_param = torch::zeros({4}, torch::kDouble).requires_grad_();
  BOOST_CHECK_EXCEPTION(fsdp::optim::AdamWBf16Moments({double_param}, torch::optim::AdamWOptions(1e-3)), fsdp::ConfigError,
                        [](const fsdp::ConfigError& e) { return std::string(e.what()).find("fp32 parameters on the CPU") != std::string::npos; });
  auto p = torch::zeros({4}).requires_grad_();
  BOOST_CHECK_EXCEPTION(fsdp::optim::AdamBf16Moments({p}, torch::optim::AdamOptions(1e-3).amsgrad(true)), fsdp::ConfigError,
                        [](const fsdp::ConfigError& e) { return std::string(e.what()).find("amsgrad") != std::string::npos; });
  // A gradient it cannot use is refused before any parameter changes.
  auto a = torch::ones({3}).requires_grad_(), b = torch::ones({3}).requires_grad_();
  fsdp::optim::AdamWBf16Moments opt({a, b}, torch::optim::AdamWOptions(1e-1));
  a.mutable_grad() = torch::ones({3});
  b.mutable_grad() = torch::ones({3}, torch::kDouble);
  BOOST_CHECK_EXCEPTION(opt.step(), fsdp::ConfigError,
                        [](const fsdp::ConfigError& e) { return std::string(e.what()).find("dense fp32 CPU gradient") != std::string::npos; });
  BOOST_TEST(torch::equal(a.detach(), torch::ones({3})));
  BOOST_TEST(opt.state().empty());
}

namespace {

/// Where ATen runs its vectorized (AVX2 or AVX-512) kernels, whose add and addcmul contract into fused
/// multiply-adds as fsdp::optim::OnePassAdam does; with its scalar ones the two agree to rounding.
/// ATen picks AVX2 and up where the CPU has AVX2 and FMA, unless ATEN_CPU_CAPABILITY=default.
bool aten_kernels_fuse_multiply_add() {
  const char* capability = std::getenv("ATEN_CPU_CAPABILITY");
  if (capability && std::string(capability) == "default") return false;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/// at::set_num_threads(n) until the end of the scope, whatever ends it.
struct AtenThreads {
  explicit AtenThreads(int n) : before(at::get_num_threads()) { at::set_num_threads(n); }
  ~AtenThreads() { at::set_num_threads(before); }
  AtenThreads(const AtenThreads&) = delete;
  AtenThreads& operator=(const AtenThreads&) = delete;
  int before;
};

/// Version-counter increments of each moment per step: the one pass bumps each once; LibTorch's
/// mul_ and add_ (addcmul_) twice. Which path ran, seen from outside.
constexpr std::int64_t kOnePassWrites = 1, kLibTorchWrites = 2;

/// `steps` steps of `Ours` and of `Torch` from the same parameters and gradients; checks that both
/// end with the same parameters and state (bit for bit where ATen fuses, see above) and that `Ours`
/// took the path `writes_per_step` says (kOnePassWrites or kLibTorchWrites).
template <class Ours, class Torch, class Options>
void check_same_steps_as_torch(const Options& options, int steps, std::int64_t writes_per_step, const std::string& what) {
  BOOST_TEST_CONTEXT(what) {
    auto gen = at::detail::createCPUGenerator(5);
    // Sizes with vector tails, a parameter without a gradient, two groups.
    const std::vector<std::int64_t> sizes = {1, 7, 100003, 33};
    std::vector<torch::Tensor> ours_params, torch_params;
    for (auto n : sizes) {
      auto init = torch::randn({n}, gen);
      ours_params.push_back(init.clone().requires_grad_());
      torch_params.push_back(init.clone().requires_grad_());
    }
    auto group_of = [&](std::vector<torch::Tensor>& ps) {
      Options second = options;
      second.lr(options.lr() * 0.5);
      std::vector<torch::optim::OptimizerParamGroup> groups;
      groups.emplace_back(std::vector<torch::Tensor>{ps[0], ps[1], ps[3]});
      groups.emplace_back(std::vector<torch::Tensor>{ps[2]}, std::make_unique<Options>(second));
      return groups;
    };
    Ours ours(group_of(ours_params), options);
    Torch reference(group_of(torch_params), options);
    for (int step = 0; step < steps; ++step) {
      for (std::size_t i = 0; i < sizes.size() - 1; ++i) {
        const auto g = torch::randn({sizes[i]}, gen) * (step % 3 == 0 ? 1e-3 : 1.0);
        ours_params[i].mutable_grad() = g.clone();
        torch_params[i].mutable_grad() = g.clone();
      }
      ours.step();
      reference.step();
    }
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const auto& p = ours_params[i];
      const auto& q = torch_params[i];
      if (aten_kernels_fuse_multiply_add())
        BOOST_TEST(torch::equal(p, q), "parameter " << i);
      else
        BOOST_TEST(relative_error_of_model({{"p", p.detach()}}, {{"p", q.detach()}}) < 1e-6);
      const bool has_state = ours.state().count(fsdp::optimizer_state_key(p)) == 1;
      BOOST_TEST(has_state == (i + 1 < sizes.size()), "parameter " << i << ": a state exactly where a gradient came");
      BOOST_TEST(has_state == (reference.state().count(fsdp::optimizer_state_key(q)) == 1));
      if (!has_state) continue;
      const auto got = fsdp::optimizer_state_view(*ours.state().at(fsdp::optimizer_state_key(p)));
      const auto want = fsdp::optimizer_state_view(*reference.state().at(fsdp::optimizer_state_key(q)));
      BOOST_TEST(got.step == steps);
      BOOST_TEST(want.step == steps);
      BOOST_REQUIRE_EQUAL(got.tensors.size(), want.tensors.size());
      for (std::size_t k = 0; k < got.tensors.size(); ++k) {
        const auto& [name, tensor] = got.tensors[k];
        BOOST_TEST(name == want.tensors[k].first);
        BOOST_TEST(tensor.scalar_type() == torch::kFloat);
        if (name == "exp_avg" || name == "exp_avg_sq")
          BOOST_TEST(tensor._version() == writes_per_step * steps, name << " of parameter " << i << ": the path taken");
        if (aten_kernels_fuse_multiply_add()) BOOST_TEST(torch::equal(tensor, want.tensors[k].second), name);
      }
    }
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(one_pass_adam_is_libtorchs_update_bit_for_bit) {
  using fsdp::optim::OnePassAdamL2;
  using fsdp::optim::OnePassAdamW;
  // One thread: each element's update reads that element alone, so where parallel_for splits cannot
  // change it; and ThreadSanitizer cannot see libgomp's barriers once an earlier case made its pool.
  const AtenThreads one(1);
  check_same_steps_as_torch<OnePassAdamW, torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(0.1), 12,
                                                               kOnePassWrites, "AdamW with decay");
  check_same_steps_as_torch<OnePassAdamW, torch::optim::AdamW>(torch::optim::AdamWOptions(3e-4).weight_decay(0), 12, kOnePassWrites,
                                                               "AdamW without decay");
  check_same_steps_as_torch<OnePassAdamL2, torch::optim::Adam>(torch::optim::AdamOptions(1e-2).betas({0.8, 0.99}).weight_decay(0.1).eps(1e-6), 12,
                                                               kOnePassWrites, "Adam with L2");
  check_same_steps_as_torch<OnePassAdamL2, torch::optim::Adam>(torch::optim::AdamOptions(1e-3), 12, kOnePassWrites, "Adam");
}

BOOST_AUTO_TEST_CASE(one_pass_adam_leaves_what_it_does_not_cover_to_libtorch) {
  const AtenThreads one(1);  // as above
  // amsgrad: LibTorch's own step, max_exp_avg_sq and all.
  check_same_steps_as_torch<fsdp::optim::OnePassAdamW, torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true), 5,
                                                                            kLibTorchWrites, "AdamW with amsgrad");
  // A step holding one parameter the pass cannot take is LibTorch's for every parameter, the same bits:
  // a double parameter, a gradient that is not contiguous.
  const std::vector<std::string> cases = {"a double parameter", "a non-contiguous gradient"};
  for (const auto& odd : cases) {
    BOOST_TEST_CONTEXT(odd) {
      auto a = torch::linspace(-1, 1, 12).view({3, 4}).requires_grad_();
      auto b = (odd == "a double parameter" ? torch::ones({4, 3}, torch::kDouble) : torch::ones({4, 3})).requires_grad_();
      auto c = a.detach().clone().requires_grad_(), d = b.detach().clone().requires_grad_();
      fsdp::optim::OnePassAdamW ours({a, b}, torch::optim::AdamWOptions(1e-1).weight_decay(0.1));
      torch::optim::AdamW reference({c, d}, torch::optim::AdamWOptions(1e-1).weight_decay(0.1));
      for (int step = 1; step <= 3; ++step) {
        const auto ga = torch::full({3, 4}, 0.5 * step);
        a.mutable_grad() = ga.clone();
        c.mutable_grad() = ga.clone();
        const auto gb = odd == "a non-contiguous gradient" ? torch::full({3, 4}, -0.25 * step).t() : torch::full({4, 3}, -0.25 * step, b.options());
        BOOST_TEST(gb.is_contiguous() == (odd != "a non-contiguous gradient"));
        b.mutable_grad() = gb.clone();
        d.mutable_grad() = gb.clone();
        ours.step();
        reference.step();
      }
      BOOST_TEST(torch::equal(a, c));
      BOOST_TEST(torch::equal(b, d));
      const auto state_a = fsdp::optimizer_state_view(*ours.state().at(fsdp::optimizer_state_key(a)));
      BOOST_TEST(state_a.tensors[0].second._version() == 3 * kLibTorchWrites, "the fp32 parameter's step was LibTorch's too");
    }
  }
  // It is a torch::optim::AdamW: the checkpoint code names it so.
  fsdp::optim::OnePassAdamW named({torch::zeros({2}).requires_grad_()}, torch::optim::AdamWOptions(1e-3));
  BOOST_TEST(fsdp::optimizer_kind(named) == "AdamW");
}

// A closure that makes the gradients runs before the pass looks at them: here they are the first
// gradients of a double parameter, which the pass must leave to LibTorch.
BOOST_AUTO_TEST_CASE(one_pass_adam_runs_the_closure_before_it_checks_the_gradients) {
  const AtenThreads one(1);
  auto p = torch::linspace(-1, 1, 10, torch::kDouble).requires_grad_();
  auto q = p.detach().clone().requires_grad_();
  fsdp::optim::OnePassAdamL2 ours({p}, torch::optim::AdamOptions(1e-2).weight_decay(0.01));
  torch::optim::Adam reference({q}, torch::optim::AdamOptions(1e-2).weight_decay(0.01));
  auto closure_of = [](torch::optim::Optimizer& opt, const torch::Tensor& x) {
    return [&opt, x] {
      opt.zero_grad();
      auto l = (x * x).sum();
      l.backward();
      return l;
    };
  };
  for (int step = 0; step < 3; ++step) {
    BOOST_TEST(ours.step(closure_of(ours, p)).defined(), "the closure's loss comes back");
    reference.step(closure_of(reference, q));
  }
  BOOST_TEST(torch::equal(p, q));
  const auto state = fsdp::optimizer_state_view(*ours.state().at(fsdp::optimizer_state_key(p)));
  BOOST_TEST(state.tensors[0].second._version() == 3 * kLibTorchWrites, "LibTorch's step ran");
}
