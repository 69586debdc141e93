// The engine's units equal the core's plan of fsdp-plan's closed-form description, for fsdp-train's
// own models (part of test_engine, np 1..4): the engine describes the built torch module, fsdp-plan
// describes the model from the deck alone, and both go through fsdp::plan_units.
#include <boost/test/unit_test.hpp>

#include "engine_harness.hpp"
#include "models.hpp"
#include "plan/model_check.hpp"

namespace app_model_tests {

struct Case {
  std::string name;
  fsdp::app::ModelSection shape;
  fsdp::app::WrapDesc wrap;
};

std::vector<Case> cases() {
  fsdp::app::ModelSection cnn{.kind = fsdp::app::ModelKind::kCnn};
  fsdp::app::ModelSection mlp{.kind = fsdp::app::ModelKind::kMlp, .hidden_sizes = {96, 33, 7}};
  fsdp::app::ModelSection gpt{.kind = fsdp::app::ModelKind::kTransformer};
  gpt.vocab_size = 61;
  gpt.context = 8;
  gpt.d_model = 16;
  gpt.n_heads = 2;
  gpt.n_layers = 3;
  fsdp::app::ModelSection untied = gpt;
  untied.tie_embeddings = false;
  fsdp::app::ModelSection padded = untied;  // 61 tokens in 64 rows
  padded.vocab_pad_multiple = 16;
  const fsdp::app::WrapDesc none{};
  const fsdp::app::WrapDesc blocks{.policy = fsdp::app::WrapPolicy::TRANSFORMER_BASED_WRAP, .types = {"TransformerBlock"}};
  auto size = [](std::int64_t n) { return fsdp::app::WrapDesc{.policy = fsdp::app::WrapPolicy::SIZE_BASED_WRAP, .min_num_params = n}; };
  return {{"cnn none", cnn, none},
          {"cnn size", cnn, size(20000)},
          {"mlp none", mlp, none},
          {"mlp size", mlp, size(500)},
          {"gpt none", gpt, none},
          {"gpt blocks", gpt, blocks},
          {"gpt size", gpt, size(1000)},
          {"untied gpt blocks", untied, blocks},
          {"padded untied gpt size", padded, size(1000)},
          {"gpt linears", gpt, {.policy = fsdp::app::WrapPolicy::TRANSFORMER_BASED_WRAP, .types = {"Linear", "LayerNorm"}}}};
}

fsdp::AutoWrapPolicy policy_of(const fsdp::app::WrapDesc& w) {
  if (w.policy == fsdp::app::WrapPolicy::SIZE_BASED_WRAP) return fsdp::AutoWrapPolicy::size_based(w.min_num_params);
  if (w.policy == fsdp::app::WrapPolicy::TRANSFORMER_BASED_WRAP) return fsdp::AutoWrapPolicy::module_types(w.types);
  return fsdp::AutoWrapPolicy::none();
}

}  // namespace app_model_tests

BOOST_AUTO_TEST_CASE(the_engines_units_equal_fsdp_plans_for_the_app_models) {
  using namespace app_model_tests;
  const int world = MpiComm::world().size();
  for (const auto& c : cases()) {
    for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::NO_SHARD}) {
      BOOST_TEST_CONTEXT(c.name << " " << fsdp::to_string(strategy)) {
        const auto planned = fsdp::app::plan_units(fsdp::app::describe_model(c.shape), c.wrap, strategy == ShardingStrategy::NO_SHARD ? 1 : world);
        FsdpOptions options;
        options.sharding_strategy = strategy;
        options.auto_wrap_policy = policy_of(c.wrap);
        auto engine = fsdp::make_fsdp(std::static_pointer_cast<fsdp::app::AppModel>(fsdp::app::build_model(c.shape)), MpiComm::world(), options);
        const auto units = engine->units();
        BOOST_TEST_REQUIRE(units.size() == planned.size());
        for (std::size_t i = 0; i < units.size(); ++i) {
          BOOST_TEST(units[i].module_path == planned[i].path);
          BOOST_TEST(units[i].parent == planned[i].parent);
          BOOST_TEST(units[i].param_names == planned[i].params);
          BOOST_TEST(units[i].numel == planned[i].numel);
          BOOST_TEST(units[i].padded_numel == planned[i].padded);
          BOOST_TEST(units[i].shard_numel == planned[i].shard);
        }
      }
    }
  }
}

#include "train/weight_decay.hpp"

// optim.no_decay: the engine's AdamW without decay plus WeightDecayMask equals single-process AdamW with
// two real parameter groups (decay on the Linear weights only; none on biases, LayerNorms, embeddings
// and the tied head), within 1e-5 over the whole model (see compare()).
BOOST_AUTO_TEST_CASE(no_decay_equals_adamw_parameter_groups) {
  auto world = MpiComm::world();
  const int n = world.size(), r = world.rank();
  fsdp::app::GptConfig c;
  c.vocab_size = 61;
  c.vocab_pad_multiple = 8;  // 64 rows: padding in the embedding
  c.context = 8;
  c.d_model = 16;
  c.n_heads = 2;
  c.n_layers = 2;
  c.dropout = 0;
  c.gelu_tanh = true;
  const double lr = 1e-2, wd = 0.1;
  constexpr std::int64_t kRows = 3;
  auto make = [&] {
    torch::manual_seed(7);
    return std::make_shared<fsdp::app::GptImpl>(c);
  };
  auto batch = [&](int step) {
    torch::manual_seed(100 + step);
    return torch::randint(0, c.vocab_size, {kRows * n, c.context + 1}, torch::kLong);
  };
  auto lm_loss = [&](const torch::Tensor& logits, const torch::Tensor& y) {
    return torch::nll_loss(torch::log_softmax(logits.reshape({-1, logits.size(-1)}), 1), y.reshape({-1}));
  };
  auto is_decayed = [](const std::string& name) {  // the Linear weights of the blocks
    for (const char* suffix : {".attn.qkv.weight", ".attn.proj.weight", ".fc.weight", ".out.weight"})
      if (name.size() > std::strlen(suffix) && name.compare(name.size() - std::strlen(suffix), std::strlen(suffix), suffix) == 0) return true;
    return false;
  };

  auto ref = make();
  std::vector<torch::Tensor> decay, keep;
  std::int64_t decayed_numel = 0;
  for (const auto& p : ref->named_parameters()) {
    if (p.key() == "head.weight") continue;  // tied to tok.weight: listed once
    (is_decayed(p.key()) ? decay : keep).push_back(p.value());
    if (is_decayed(p.key())) decayed_numel += p.value().numel();
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(lr).weight_decay(wd)));
  groups.emplace_back(keep, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(lr).weight_decay(0)));
  torch::optim::AdamW ref_opt(std::move(groups), torch::optim::AdamWOptions(lr));

  FsdpOptions options;
  options.auto_wrap_policy = fsdp::AutoWrapPolicy::module_types({"TransformerBlock"});
  auto net = make();
  auto model = fsdp::make_fsdp(net, world, options);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(lr).weight_decay(0));
  fsdp::app::WeightDecayMask mask(*model, {"bias", "norm", "embedding"});
  std::int64_t decaying = mask.decaying_elements();
  world.all_reduce(&decaying, &decaying, 1, fsdp::DType::kInt64, fsdp::ReduceOp::kSum);
  BOOST_TEST(decaying == decayed_numel);  // every decayed element once, at every world size, padding excluded

  for (int step = 0; step < 4; ++step) {
    const auto tokens = batch(step);
    ref_opt.zero_grad();
    lm_loss(ref->forward(tokens.narrow(1, 0, c.context)), tokens.narrow(1, 1, c.context)).backward();
    ref_opt.step();
    const auto local = tokens.narrow(0, r * kRows, kRows);
    opt.zero_grad();
    lm_loss(model->forward(local.narrow(1, 0, c.context)), local.narrow(1, 1, c.context)).backward();
    mask.apply(lr, wd);
    opt.step();
  }
  std::map<std::string, torch::Tensor> ref_params;
  for (const auto& p : ref->named_parameters()) ref_params[p.key()] = p.value().detach().clone();
  std::map<std::string, torch::Tensor> got;
  for (auto& [name, t] : model->full_parameters()) got[name] = t;
  compare(got, ref_params);
  // Without the mask the same run decays everything: the exemption matters.
  BOOST_TEST(decaying < model->num_params());
}

#include "train/step.hpp"

// fsdp-train frees the gradients after each update (release_gradients) instead of LibTorch 1.13's
// zero_grad(), which keeps them zeroed; a parameter that had a gradient before and has none in this step
// gets zeros (ZeroedGradients), one that never had one stays skipped. The same steps give the same bits:
// AdamW's decay and moments of a parameter unused in a step move as they did with a zeroed gradient,
// and a parameter first used at step 2 is untouched before it, as with zero_grad().
BOOST_AUTO_TEST_CASE(released_gradients_update_as_zeroed_ones) {
  auto make = [] {
    torch::manual_seed(3);
    return std::vector<torch::Tensor>{torch::randn({5, 4}).requires_grad_(), torch::randn({7}).requires_grad_(), torch::randn({3}).requires_grad_()};
  };
  auto kept = make(), released = make();
  const auto untouched = released[2].detach().clone();
  torch::optim::AdamW kept_opt(kept, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  torch::optim::AdamW released_opt(released, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  fsdp::app::ZeroedGradients zeroed;
  for (int step = 0; step < 5; ++step) {
    const bool second_used = step != 1 && step != 2;  // unused in two steps, after and before a used one
    const bool third_used = step >= 2;                // no gradient before step 2
    auto loss = [&](const std::vector<torch::Tensor>& p) {
      torch::manual_seed(50 + step);
      auto l = p[0].mul(torch::randn({5, 4})).sum();
      if (second_used) l = l + p[1].pow(2).sum();
      if (third_used) l = l + p[2].pow(2).sum();
      return l;
    };
    kept_opt.zero_grad();
    loss(kept).backward();
    kept_opt.step();
    fsdp::app::release_gradients(released_opt);
    BOOST_TEST(!released[0].grad().defined());
    loss(released).backward();
    BOOST_TEST(released[1].grad().defined() == second_used);
    zeroed.fill_missing(released_opt);
    BOOST_TEST(released[1].grad().defined());                // zeros when unused: it had a gradient at step 0
    BOOST_TEST(released[2].grad().defined() == third_used);  // none before its first use
    released_opt.step();
    fsdp::app::release_gradients(released_opt);
    if (!third_used) BOOST_TEST(torch::equal(released[2], untouched));
    for (std::size_t i = 0; i < kept.size(); ++i) {
      BOOST_TEST(!released[i].grad().defined());
      BOOST_TEST(torch::equal(kept[i], released[i]), "parameter " << i << " after step " << step);
    }
  }
  BOOST_TEST(released_opt.state().size() == kept_opt.state().size());
}
