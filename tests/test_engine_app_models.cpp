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

#include "train/cross_entropy.hpp"

// A language model's loss builds the logits' gradient in log_softmax's buffer (one logits-sized tensor
// in backward instead of three). The loss is autograd's log_softmax + nll_loss's, bit for bit, for both
// reductions and a scaled upstream gradient (the division by the accumulated micro-batches); the
// gradient has the same bits away from the targets where the vocabulary is a multiple of 8, and is
// within one rounding of the upstream scale at the targets (LibTorch fuses that multiply and subtract)
// and, for other vocabularies, in a few elements elsewhere. Confident rows (a large target logit) are
// where the target's rounding shows. A second backward over one graph is refused.
BOOST_AUTO_TEST_CASE(token_cross_entropy_equals_log_softmax_nll_loss) {
  for (const auto& [rows, vocab] : {std::pair<std::int64_t, std::int64_t>{37, 53}, {256, 4096}, {512, 8}}) {
    for (const bool sum : {false, true}) {
      torch::manual_seed(rows + vocab);
      auto base = torch::randn({rows, vocab}) * 4;
      const auto targets = torch::randint(vocab, {rows}, torch::kLong);
      base.scatter_add_(1, targets.unsqueeze(1), torch::full({rows, 1}, 6.0));  // confident rows
      const auto plain_logits = base.clone().requires_grad_(), fused_logits = base.clone().requires_grad_();
      const auto plain = torch::nll_loss(torch::log_softmax(plain_logits, 1), targets, {}, sum ? at::Reduction::Sum : at::Reduction::Mean);
      const auto fused = fsdp::app::token_cross_entropy(fused_logits, targets, sum);
      BOOST_TEST(torch::equal(plain, fused), rows << "x" << vocab << " sum " << sum);
      (plain / 3.0).backward();
      (fused / 3.0).backward();
      const auto& a = plain_logits.grad();
      const auto& b = fused_logits.grad();
      const double scale = (sum ? 1.0 : 1.0 / static_cast<double>(rows)) / 3.0;
      const auto at_target = torch::zeros({rows, vocab}, torch::kBool).scatter_(1, targets.unsqueeze(1), true);
      const auto within_rounding = (a - b).abs().le(std::numeric_limits<float>::epsilon() * (a.abs() + scale));
      BOOST_TEST(within_rounding.all().item<bool>(), rows << "x" << vocab << " sum " << sum);
      if (vocab % 8 == 0) {
        BOOST_TEST(torch::equal(a.masked_select(at_target.logical_not()), b.masked_select(at_target.logical_not())),
                   rows << "x" << vocab << " sum " << sum << ": away from the targets");
      } else {
        BOOST_TEST(a.ne(b).logical_and(at_target.logical_not()).sum().item<std::int64_t>() <= rows * vocab / 1000);
      }
    }
  }
  const auto logits = torch::randn({4, 9}).requires_grad_();
  const auto loss = fsdp::app::token_cross_entropy(logits, torch::randint(9, {4}, torch::kLong), false);
  loss.backward({}, /*retain_graph=*/true);
  BOOST_CHECK_THROW(loss.backward(), std::exception);
  torch::NoGradGuard no_grad;  // evaluation: the plain expression
  BOOST_TEST(!fsdp::app::token_cross_entropy(logits, torch::randint(9, {4}, torch::kLong), true).requires_grad());
}

#include <c10/core/CPUAllocator.h>

#include <mutex>

#include "models/recomputed.hpp"

namespace {

/// LibTorch's CPU allocator with a count of the bytes it holds, installed for one scope: what a forward
/// leaves allocated is what its graph keeps for backward. (Its blocks are the base allocator's, data
/// and context alike, as LibTorch's raw_allocate requires.)
class CountedCpuAllocation final : public at::Allocator {
 public:
  CountedCpuAllocation() : at_start_(live_) {
    BOOST_TEST_REQUIRE(!dynamic_cast<CountedCpuAllocation*>(c10::GetCPUAllocator()), "one counted scope at a time");
    base_ = c10::GetCPUAllocator();
    c10::SetCPUAllocator(this);
  }
  ~CountedCpuAllocation() override { c10::SetCPUAllocator(base_); }
  at::DataPtr allocate(std::size_t n) const override {
    void* data = base_->raw_allocate(n);
    const std::lock_guard<std::mutex> lock(mutex_);  // LibTorch's intra-op threads may allocate
    sizes_[data] = n;
    live_ += static_cast<std::int64_t>(n);
    return {data, data, &release, at::Device(at::kCPU)};
  }
  at::DeleterFnPtr raw_deleter() const override { return &release; }
  std::int64_t live() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return live_ - at_start_;
  }

 private:
  std::int64_t at_start_;
  static void release(void* data) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto found = sizes_.find(data);
    live_ -= static_cast<std::int64_t>(found->second);
    sizes_.erase(found);
    base_->raw_deallocate(data);
  }
  static inline at::Allocator* base_ = nullptr;
  static inline std::map<void*, std::size_t> sizes_;
  static inline std::int64_t live_ = 0;
  static inline std::mutex mutex_;
};

}  // namespace

// GPT's MLP output projection applies the GELU itself and keeps its input only: the same parameters,
// initialization draws, outputs and gradients as Linear(gelu(h)), bit for bit, for both GELUs.
BOOST_AUTO_TEST_CASE(gelu_linear_equals_a_linear_of_the_gelu_bit_for_bit) {
  for (const std::string approximate : {"none", "tanh"}) {
    for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
      for (const bool batched : {true, false}) {  // (batch, tokens, features) as in the GPT, and 2-D
        torch::manual_seed(5);
        torch::nn::Linear plain(48, 16);
        torch::manual_seed(5);
        fsdp::app::GeluLinear fused(48, 16, approximate);
        BOOST_TEST(torch::equal(plain->weight, fused->weight));
        BOOST_TEST(torch::equal(plain->bias, fused->bias));
        plain->to(dtype);
        fused->to(dtype);
        const auto base = (batched ? torch::randn({3, 7, 48}) : torch::randn({21, 48})).mul(2).to(dtype);
        const auto grad = (batched ? torch::randn({3, 7, 16}) : torch::randn({21, 16})).to(dtype);
        const auto h_plain = base.clone().requires_grad_(), h_fused = base.clone().requires_grad_();
        const auto out_plain = plain->forward(F::gelu(h_plain, F::GELUFuncOptions().approximate(approximate)));
        const auto out_fused = fused->forward(h_fused);
        const auto label = approximate + (dtype == torch::kFloat ? " fp32" : " bf16") + (batched ? " 3-D" : " 2-D");
        BOOST_TEST(torch::equal(out_plain, out_fused), label);
        out_plain.backward(grad);
        out_fused.backward(grad);
        BOOST_TEST(torch::equal(h_plain.grad(), h_fused.grad()), label);
        BOOST_TEST(torch::equal(plain->weight.grad(), fused->weight.grad()), label);
        BOOST_TEST(torch::equal(plain->bias.grad(), fused->bias.grad()), label);
      }
    }
  }
}

// Attention whose backward recomputes the probabilities: the plain expression's output, random draws
// (dropout) and gradients, bit for bit, on q, k and v that are views of one projection as in the model.
BOOST_AUTO_TEST_CASE(recomputed_attention_equals_the_plain_expression_bit_for_bit) {
  const std::int64_t b = 2, h = 3, t = 9, hd = 8;
  const auto blocked = torch::ones({t, t}).tril().view({1, 1, t, t}) == 0;
  for (const double p : {0.0, 0.3, 1.0}) {  // at 1 both are the plain expression (F::dropout's zeros)
    torch::manual_seed(11);
    const auto base = torch::randn({b, t, 3 * h * hd});
    const auto grad = torch::randn({b, h, t, hd});
    auto run = [&](bool recomputed, torch::Tensor& qkv) {
      qkv = base.clone().requires_grad_();
      auto parts = qkv.split(h * hd, 2);
      auto heads = [&](const torch::Tensor& y) { return y.view({b, t, h, hd}).transpose(1, 2); };
      const auto q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
      torch::manual_seed(12);
      torch::Tensor y;
      if (recomputed) {
        y = fsdp::app::attend(q, k, v, blocked, 0.35, p);
      } else {
        auto att = torch::softmax(fsdp::app::masked_scores(q, k, 0.35, blocked), -1);
        y = torch::matmul(F::dropout(att, F::DropoutFuncOptions().p(p).training(true)), v);
      }
      const auto next_draw = torch::rand({1});
      y.backward(grad);
      return std::make_pair(y, next_draw);
    };
    torch::Tensor qkv_plain, qkv_fused;
    const auto [y_plain, draw_plain] = run(false, qkv_plain);
    const auto [y_fused, draw_fused] = run(true, qkv_fused);
    BOOST_TEST(torch::equal(y_plain, y_fused), "dropout " << p);
    BOOST_TEST(torch::equal(draw_plain, draw_fused), "dropout " << p << ": the same random draws");
    BOOST_TEST(torch::equal(qkv_plain.grad(), qkv_fused.grad()), "dropout " << p);
    BOOST_TEST(!y_fused.isnan().any().item<bool>(), "dropout " << p);
  }
}

// What the two recomputed parts spare: after forward, the MLP keeps no GELU output (4 bytes per
// element of its input) and attention keeps no probabilities nor matmul's copies of q, k and v
// (with dropout, one byte per score).
BOOST_AUTO_TEST_CASE(recomputed_parts_keep_less_for_backward) {
  torch::manual_seed(3);
  torch::nn::Linear plain(64, 16);
  fsdp::app::GeluLinear fused(64, 16, "none");
  const auto h = torch::randn({4, 10, 64}).requires_grad_();
  auto kept_after = [](const std::function<torch::Tensor()>& forward) {
    CountedCpuAllocation counted;
    const auto out = forward();
    return counted.live() - static_cast<std::int64_t>(out.nbytes());
  };
  const auto mlp_plain = kept_after([&] { return plain->forward(F::gelu(h)); });
  const auto mlp_fused = kept_after([&] { return fused->forward(h); });
  BOOST_TEST(mlp_plain - mlp_fused == static_cast<std::int64_t>(h.nbytes()));
  BOOST_TEST(mlp_fused == 0);

  const std::int64_t b = 2, heads = 4, t = 16, hd = 8;
  const auto blocked = torch::ones({t, t}).tril().view({1, 1, t, t}) == 0;
  const auto qkv = torch::randn({b, t, 3 * heads * hd}).requires_grad_();
  auto split = [&] {
    auto parts = qkv.split(heads * hd, 2);
    std::vector<torch::Tensor> r;
    for (const auto& y : parts) r.push_back(y.view({b, t, heads, hd}).transpose(1, 2));
    return r;
  };
  const auto attn_plain = kept_after([&] {
    const auto s = split();
    return torch::matmul(torch::softmax(fsdp::app::masked_scores(s[0], s[1], 0.35, blocked), -1), s[2]);
  });
  const auto attn_fused = kept_after([&] {
    const auto s = split();
    return fsdp::app::attend(s[0], s[1], s[2], blocked, 0.35, 0.0);
  });
  const std::int64_t probabilities = b * heads * t * t * 4, head_views = b * heads * t * hd * 4;
  BOOST_TEST(attn_plain - attn_fused >= probabilities + 3 * head_views);
  BOOST_TEST(attn_fused == 0);
  const auto attn_dropout = kept_after([&] {  // with dropout: the kept positions, a byte per score
    const auto s = split();
    return fsdp::app::attend(s[0], s[1], s[2], blocked, 0.35, 0.3);
  });
  BOOST_TEST(attn_dropout == b * heads * t * t);
}

// A decoder's loss (the logits squared, in fp32) on `idx` and every parameter's gradient after its backward.
struct LossAndGradients {
  torch::Tensor loss;
  std::vector<torch::Tensor> gradients;
};
LossAndGradients loss_and_gradients(torch::nn::Module& model, const std::function<torch::Tensor()>& forward) {
  LossAndGradients r{.loss = forward().to(torch::kFloat).pow(2).mean(), .gradients = {}};
  r.loss.backward();
  r.loss = r.loss.detach();
  for (const auto& p : model.parameters()) r.gradients.push_back(p.grad().clone());
  return r;
}
void expect_same_bits(const LossAndGradients& a, const LossAndGradients& b, const std::string& label) {
  BOOST_TEST(torch::equal(a.loss, b.loss), label);
  BOOST_TEST_REQUIRE(a.gradients.size() == b.gradients.size());
  for (std::size_t i = 0; i < a.gradients.size(); ++i) BOOST_TEST(torch::equal(a.gradients[i], b.gradients[i]), label << ", parameter " << i);
}

// model.recompute_attention only changes what backward keeps: the GPT's loss and every gradient are
// the same bits with it on (the default) and off, with dropout (the same random draws) and without.
BOOST_AUTO_TEST_CASE(recompute_attention_changes_no_bit_of_the_gpt) {
  for (const double dropout : {0.0, 0.2}) {
    std::vector<LossAndGradients> runs;
    for (const bool recompute : {true, false}) {
      fsdp::app::GptConfig c;
      c.vocab_size = 50;
      c.context = 12;
      c.d_model = 32;
      c.n_heads = 4;
      c.n_layers = 2;
      c.dropout = dropout;
      c.recompute_attention = recompute;
      torch::manual_seed(21);
      auto gpt = std::make_shared<fsdp::app::GptImpl>(c);
      const auto idx = torch::randint(50, {3, 12}, torch::kLong);
      torch::manual_seed(22);
      runs.push_back(loss_and_gradients(*gpt, [&] { return gpt->forward(idx); }));
    }
    expect_same_bits(runs[0], runs[1], "dropout " + std::to_string(dropout));
  }
}

// Llama's MLP down projection applies silu(gate) * up itself and keeps gate and up only: the same
// parameter, initialization draws, output and gradients as Linear(silu(gate) * up), bit for bit, for
// every gradient together and each alone (the others frozen or constant).
BOOST_AUTO_TEST_CASE(swiglu_linear_equals_a_linear_of_silu_gate_times_up_bit_for_bit) {
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (const bool batched : {true, false}) {
      for (const std::string wanted : {"weight gate up", "weight", "gate up", "gate", "up"}) {
        const bool weight_grad = wanted.find("weight") != std::string::npos, gate_grad = wanted.find("gate") != std::string::npos,
                   up_grad = wanted.find("up") != std::string::npos;
        torch::manual_seed(6);
        torch::nn::Linear plain(torch::nn::LinearOptions(40, 12).bias(false));
        torch::manual_seed(6);
        fsdp::app::SwiGluLinear fused(40, 12);
        BOOST_TEST(torch::equal(plain->weight, fused->weight));
        BOOST_TEST(!fused->bias.defined());
        plain->to(dtype);
        fused->to(dtype);
        plain->weight.requires_grad_(weight_grad);
        fused->weight.requires_grad_(weight_grad);
        const auto shape = batched ? std::vector<std::int64_t>{3, 7, 40} : std::vector<std::int64_t>{21, 40};
        const auto gate = torch::randn(shape).mul(3).to(dtype), up = torch::randn(shape).to(dtype);
        const auto grad = (batched ? torch::randn({3, 7, 12}) : torch::randn({21, 12})).to(dtype);
        const auto gate_plain = gate.clone().requires_grad_(gate_grad), up_plain = up.clone().requires_grad_(up_grad);
        const auto gate_fused = gate.clone().requires_grad_(gate_grad), up_fused = up.clone().requires_grad_(up_grad);
        const auto out_plain = plain->forward(torch::silu(gate_plain) * up_plain);
        const auto out_fused = fused->forward(gate_fused, up_fused);
        const std::string label = std::string(dtype == torch::kFloat ? "fp32" : "bf16") + (batched ? " 3-D" : " 2-D") + ", gradients of " + wanted;
        BOOST_TEST(torch::equal(out_plain, out_fused), label);
        out_plain.backward(grad);
        out_fused.backward(grad);
        auto same_gradient = [&](bool asked, const torch::Tensor& a, const torch::Tensor& b) {
          if (asked)
            BOOST_TEST(torch::equal(a.grad(), b.grad()), label);
          else
            BOOST_TEST(!b.grad().defined(), label);
        };
        same_gradient(gate_grad, gate_plain, gate_fused);
        same_gradient(up_grad, up_plain, up_fused);
        same_gradient(weight_grad, plain->weight, fused->weight);
      }
    }
  }
}

// Llama's attention: the softmax in fp32, cast back to q's type, over repeated key and value heads
// (grouped queries). Recomputed in backward, it equals the plain expression bit for bit in fp32 and
// bf16, and keeps no scores: the fp32 probabilities and their cast were 6 bytes per score in bf16.
BOOST_AUTO_TEST_CASE(recomputed_fp32_softmax_attention_equals_the_plain_expression_bit_for_bit) {
  const std::int64_t b = 2, heads = 4, kv_heads = 2, t = 9, hd = 8;
  const auto blocked = torch::ones({t, t}).tril() == 0;
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (const std::string wanted : {"qkv", "q", "v"}) {  // the inputs whose gradient backward computes
      torch::manual_seed(13);
      const auto q0 = torch::randn({b, heads, t, hd}).to(dtype), k0 = torch::randn({b, kv_heads, t, hd}).to(dtype);
      const auto v0 = torch::randn({b, kv_heads, t, hd}).to(dtype), grad = torch::randn({b, heads, t, hd}).to(dtype);
      std::vector<torch::Tensor> outs, leaves_grads;
      std::vector<std::int64_t> kept;
      auto asked = [&](char name) { return wanted.find(name) != std::string::npos; };
      for (const bool recomputed : {false, true}) {
        const auto q = q0.clone().requires_grad_(asked('q')), k = k0.clone().requires_grad_(asked('k')), v = v0.clone().requires_grad_(asked('v'));
        torch::Tensor y;
        const auto kx = k.repeat_interleave(heads / kv_heads, 1), vx = v.repeat_interleave(heads / kv_heads, 1);
        {
          CountedCpuAllocation counted;
          if (recomputed) {
            y = fsdp::app::attend(q, kx, vx, blocked, 0.35, 0.0, true, /*softmax_in_fp32=*/true);
          } else {
            const auto att = torch::softmax(fsdp::app::masked_scores(q, kx, 0.35, blocked), -1, torch::kFloat).to(dtype);
            y = torch::matmul(att, vx);
          }
          kept.push_back(counted.live() - static_cast<std::int64_t>(y.nbytes()));
        }
        y.backward(grad);
        outs.push_back(y);
        for (const auto& leaf : {q, k, v}) leaves_grads.push_back(leaf.grad());
      }
      const std::string label = std::string(dtype == torch::kFloat ? "fp32" : "bf16") + ", gradients of " + wanted;
      BOOST_TEST(torch::equal(outs[0], outs[1]), label);
      for (std::size_t i = 0; i < 3; ++i) {
        if (asked("qkv"[i]))
          BOOST_TEST(torch::equal(leaves_grads[i], leaves_grads[i + 3]), label << ", input " << i);
        else
          BOOST_TEST(!leaves_grads[i + 3].defined(), label << ", input " << i);
      }
      BOOST_TEST(kept[1] == 0, label);  // q and the repeated k and v, which were there before
      const std::int64_t scores = b * heads * t * t;
      if (wanted == "qkv") BOOST_TEST(kept[0] - kept[1] >= scores * (dtype == torch::kFloat ? 4 : 6), label);
    }
  }
}

// What the SwiGLU down projection spares: silu(gate) and the product (two intermediate-size tensors
// per token), which Linear(silu(gate) * up) keeps.
BOOST_AUTO_TEST_CASE(swiglu_linear_keeps_neither_the_silu_nor_the_product) {
  torch::manual_seed(4);
  torch::nn::Linear plain(torch::nn::LinearOptions(64, 16).bias(false));
  fsdp::app::SwiGluLinear fused(64, 16);
  const auto gate = torch::randn({4, 10, 64}).requires_grad_(), up = torch::randn({4, 10, 64}).requires_grad_();
  auto kept_after = [](const std::function<torch::Tensor()>& forward) {
    CountedCpuAllocation counted;
    const auto out = forward();
    return counted.live() - static_cast<std::int64_t>(out.nbytes());
  };
  const auto kept_plain = kept_after([&] { return plain->forward(torch::silu(gate) * up); });
  const auto kept_fused = kept_after([&] { return fused->forward(gate, up); });
  BOOST_TEST(kept_plain - kept_fused == 2 * static_cast<std::int64_t>(gate.nbytes()));
  BOOST_TEST(kept_fused == 0);
}

// A whole Llama (grouped-query heads, untied): model.recompute_attention changes no bit of the loss or
// of any gradient, in fp32 and with bf16 parameters.
BOOST_AUTO_TEST_CASE(recompute_attention_changes_no_bit_of_the_llama) {
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    std::vector<LossAndGradients> runs;
    for (const bool recompute : {true, false}) {
      fsdp::app::LlamaConfig c;
      c.vocab_size = 50;
      c.context = 12;
      c.d_model = 32;
      c.n_heads = 4;
      c.n_kv_heads = 2;
      c.head_dim = 8;
      c.intermediate_size = 40;
      c.n_layers = 2;
      c.tie_embeddings = false;
      c.recompute_attention = recompute;
      torch::manual_seed(23);
      auto llama = std::make_shared<fsdp::app::LlamaImpl>(c);
      llama->to(dtype);
      const auto idx = torch::randint(50, {3, 12}, torch::kLong);
      runs.push_back(loss_and_gradients(*llama, [&] { return llama->forward(idx); }));
    }
    expect_same_bits(runs[0], runs[1], dtype == torch::kFloat ? "fp32" : "bf16");
  }
}
