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
  fsdp::app::ModelShape shape;
  fsdp::app::WrapDesc wrap;
};

std::vector<Case> cases() {
  fsdp::app::ModelShape cnn{.kind = "cnn"};
  fsdp::app::ModelShape mlp{.kind = "mlp", .hidden_sizes = {96, 33, 7}};
  fsdp::app::ModelShape gpt{.kind = "transformer"};
  gpt.gpt.vocab_size = 61;
  gpt.gpt.context = 8;
  gpt.gpt.d_model = 16;
  gpt.gpt.n_heads = 2;
  gpt.gpt.n_layers = 3;
  fsdp::app::ModelShape untied = gpt;
  untied.gpt.tie_embeddings = false;
  const fsdp::app::WrapDesc none{};
  const fsdp::app::WrapDesc blocks{.policy = "TRANSFORMER_BASED_WRAP", .types = {"TransformerBlock"}};
  auto size = [](std::int64_t n) { return fsdp::app::WrapDesc{.policy = "SIZE_BASED_WRAP", .min_num_params = n}; };
  return {{"cnn none", cnn, none},
          {"cnn size", cnn, size(20000)},
          {"mlp none", mlp, none},
          {"mlp size", mlp, size(500)},
          {"gpt none", gpt, none},
          {"gpt blocks", gpt, blocks},
          {"gpt size", gpt, size(1000)},
          {"untied gpt blocks", untied, blocks},
          {"gpt linears", gpt, {.policy = "TRANSFORMER_BASED_WRAP", .types = {"Linear", "LayerNorm"}}}};
}

fsdp::AutoWrapPolicy policy_of(const fsdp::app::WrapDesc& w) {
  if (w.policy == "SIZE_BASED_WRAP") return fsdp::AutoWrapPolicy::size_based(w.min_num_params);
  if (w.policy == "TRANSFORMER_BASED_WRAP") return fsdp::AutoWrapPolicy::module_types(w.types);
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
        auto engine = fsdp::make_fsdp(std::static_pointer_cast<fsdp::app::AppModel>(fsdp::app::build_app_model(c.shape)), MpiComm::world(), options);
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
