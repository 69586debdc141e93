// data.document_mask (app/models/documents.hpp; part of test_engine, np 1..4): a packed sequence under
// the document mask gives, for every document, the logits the same model gives that document alone
// (positions from 0, nothing seen of the others), for the GPT and the Llama (grouped-query heads); the
// sequence's first tokens continue a document cut by the packing and count as one. Without the mask
// the later documents see the earlier ones. Wrapped by the engine (FULL_SHARD, a unit per block, with
// and without activation checkpointing) the model computes the same logits and gradients.
#include <boost/test/unit_test.hpp>

#include "engine_harness.hpp"
#include "models.hpp"

namespace document_tests {

constexpr std::int64_t kSeparator = 0;

fsdp::app::ModelSection shape(fsdp::app::ModelKind kind, std::int64_t separator) {
  fsdp::app::ModelSection m{.kind = kind};
  m.dropout = 0.0;
  m.vocab_size = 31;
  m.context = 16;
  m.d_model = 16;
  m.n_heads = 2;
  m.n_layers = 2;
  if (kind == fsdp::app::ModelKind::kLlama) m.n_kv_heads = 1;
  m.document_mask = separator >= 0;
  m.document_token = separator;
  return m;
}

/// Two packed rows: a cut document, then documents each beginning with the separator.
torch::Tensor packed() {
  return torch::tensor({5, 6, 7, 0, 8, 9, 10, 11, 0, 12, 13, 0, 14, 15, 16, 17, 0, 21, 22, 23, 24, 25, 0, 26, 27, 28, 29, 30, 0, 1, 2, 3},
                       torch::kLong)
      .view({2, 16});
}

/// Where each row's documents begin: at 0 and at every separator after it.
std::vector<std::int64_t> starts(const torch::Tensor& row) {
  std::vector<std::int64_t> s{0};
  for (std::int64_t i = 1; i < row.size(0); ++i)
    if (row[i].item<std::int64_t>() == kSeparator) s.push_back(i);
  return s;
}

/// The largest difference between the packed logits and each document's own, over every document.
double worst_difference(fsdp::app::AppModel& masked, fsdp::app::AppModel& plain, const torch::Tensor& x) {
  torch::NoGradGuard no_grad;
  const auto logits = masked.forward(x);
  double worst = 0;
  for (std::int64_t r = 0; r < x.size(0); ++r) {
    auto s = starts(x[r]);
    s.push_back(x.size(1));
    for (std::size_t d = 0; d + 1 < s.size(); ++d) {
      const auto doc = x[r].slice(0, s[d], s[d + 1]).unsqueeze(0);
      const auto alone = plain.forward(doc)[0];
      worst = std::max(worst, (logits[r].slice(0, s[d], s[d + 1]) - alone).abs().max().item<double>());
    }
  }
  return worst;
}

}  // namespace document_tests

BOOST_AUTO_TEST_CASE(a_packed_sequence_under_the_document_mask_equals_each_document_alone) {
  using namespace document_tests;
  for (const auto kind : {fsdp::app::ModelKind::kTransformer, fsdp::app::ModelKind::kLlama}) {
    BOOST_TEST_CONTEXT(fsdp::app::to_string(kind)) {
      torch::manual_seed(3);
      auto masked = fsdp::app::build_model(shape(kind, kSeparator));
      torch::manual_seed(3);
      auto plain = fsdp::app::build_model(shape(kind, -1));  // the same weights, one causal sequence
      const auto x = packed();
      BOOST_TEST(worst_difference(*masked, *plain, x) < 1e-5);
      BOOST_TEST(worst_difference(*plain, *plain, x) > 1e-3);  // without the mask the documents see each other
    }
  }
}

BOOST_AUTO_TEST_CASE(document_starts_given_by_the_data_equal_a_separator_at_the_same_places) {
  // data.document_mask without data.eot_token (an indexed dataset's .idx boundaries): the starts go
  // into the model's layout before a forward, which consumes them. Given where the separators are,
  // the logits are those of the separator's model, bit for bit; without starts a sequence is one
  // document (the plain model's logits); starts of another shape are refused.
  using namespace document_tests;
  for (const auto kind : {fsdp::app::ModelKind::kTransformer, fsdp::app::ModelKind::kLlama}) {
    BOOST_TEST_CONTEXT(fsdp::app::to_string(kind)) {
      torch::NoGradGuard no_grad;
      auto from_data_shape = shape(kind, -1);
      from_data_shape.document_mask = true;
      torch::manual_seed(3);
      auto from_data = fsdp::app::build_model(from_data_shape);
      torch::manual_seed(3);
      auto separated = fsdp::app::build_model(shape(kind, kSeparator));
      torch::manual_seed(3);
      auto plain = fsdp::app::build_model(shape(kind, -1));
      const auto x = packed();
      BOOST_TEST_REQUIRE(from_data->documents() != nullptr);
      BOOST_TEST(plain->documents() == nullptr);
      from_data->documents()->given_begins = x.eq(kSeparator);
      BOOST_TEST(torch::equal(from_data->forward(x), separated->forward(x)));
      BOOST_TEST(!from_data->documents()->given_begins.defined());  // consumed
      BOOST_TEST(torch::equal(from_data->forward(x), plain->forward(x)));
      from_data->documents()->given_begins = x.eq(kSeparator).slice(1, 0, 8);
      BOOST_CHECK_THROW(from_data->forward(x), fsdp::ConfigError);
    }
  }
}

BOOST_AUTO_TEST_CASE(the_engine_runs_document_masked_models_as_they_are) {
  using namespace document_tests;
  for (const auto kind : {fsdp::app::ModelKind::kTransformer, fsdp::app::ModelKind::kLlama}) {
    for (const bool checkpointing : {false, true}) {
      BOOST_TEST_CONTEXT(fsdp::app::to_string(kind) << (checkpointing ? " with activation checkpointing" : "")) {
        torch::manual_seed(5);
        auto reference = fsdp::app::build_model(shape(kind, kSeparator));
        torch::manual_seed(5);
        auto net = fsdp::app::build_model(shape(kind, kSeparator));
        FsdpOptions options;
        options.sharding_strategy = ShardingStrategy::FULL_SHARD;
        options.auto_wrap_policy = AutoWrapPolicy::module_types({kind == fsdp::app::ModelKind::kLlama ? "LlamaDecoderLayer" : "TransformerBlock"});
        options.activation_checkpointing = checkpointing;
        auto engine = fsdp::make_fsdp(std::static_pointer_cast<fsdp::app::AppModel>(net), MpiComm::world(), options);
        const auto x = packed();
        const auto want = reference->forward(x);
        const auto got = engine->forward(x);
        BOOST_TEST((got - want).abs().max().item<double>() < 1e-6);
        // One SGD step on the same batch on every rank: the averaged gradient is the single process's.
        torch::optim::SGD ref_opt(unique_parameters(*reference), torch::optim::SGDOptions(0.1));  // the tied head once
        torch::optim::SGD opt(engine->parameters(), torch::optim::SGDOptions(0.1));
        got.pow(2).mean().backward();
        want.pow(2).mean().backward();
        opt.step();
        ref_opt.step();
        std::map<std::string, torch::Tensor> ref_params;
        for (const auto& p : reference->named_parameters()) ref_params[p.key()] = p.value().detach();
        std::map<std::string, torch::Tensor> params;
        for (auto& [name, t] : engine->full_parameters()) params[name] = t;
        BOOST_TEST(compare(params, ref_params) < 1e-5);  // relative, over the whole model
      }
    }
  }
}
