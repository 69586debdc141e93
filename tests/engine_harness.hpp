// The engine tests' shared part: the models (uneven widths, a tied weight, a scalar unit, a parameter
// used only every other step) and the harness that trains them single-process on the whole global
// batch and with FSDP on each rank's slice, then compares the gathered parameters.
#pragma once

#include <boost/test/unit_test.hpp>

#include <fsdp/fsdp.hpp>

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "model_error.hpp"
#include "torch_common.hpp"

namespace F = torch::nn::functional;
using fsdp::AutoWrapPolicy;
using fsdp::FsdpOptions;
using fsdp::MpiComm;
using fsdp::ShardingStrategy;

// ---- models -----------------------------------------------------------------------------------

/// One scalar parameter: a unit with fewer elements than ranks when wrapped alone.
struct ScaleImpl : torch::nn::Module {
  ScaleImpl() { alpha = register_parameter("alpha", torch::ones({1}) * 0.9); }
  torch::Tensor forward(const torch::Tensor& x) { return x * alpha; }
  torch::Tensor alpha;
};
TORCH_MODULE(Scale);

/// Linear layer with a gate parameter that is used only when `use_gate` is set.
struct GatedLinearImpl : torch::nn::Module {
  GatedLinearImpl(int64_t in, int64_t out) {
    fc = register_module("fc", torch::nn::Linear(in, out));
    gate = register_parameter("gate", torch::randn({out}) * 0.1);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = fc->forward(x);
    return use_gate ? y * torch::sigmoid(gate) : y;
  }
  torch::nn::Linear fc{nullptr};
  torch::Tensor gate;
  bool use_gate = true;
};
TORCH_MODULE(GatedLinear);

/// MLP with uneven widths, a tied weight, a scalar unit and a sometimes-unused parameter.
/// Children are called through fsdp::forward, so nested units free their parameters between passes.
struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(13, 37));
    fc2 = register_module("fc2", torch::nn::Linear(37, 29));
    gated = register_module("gated", GatedLinear(29, 29));
    scale = register_module("scale", Scale());
    fc3 = register_module("fc3", torch::nn::Linear(29, 37));
    tied = register_module("tied", TiedOut(fc1->weight));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fsdp::forward(fc1, x));
    x = torch::relu(fsdp::forward(fc2, x));
    x = torch::tanh(fsdp::forward(gated, x));
    x = fsdp::forward(scale, x);
    x = torch::relu(fsdp::forward(fc3, x));
    return fsdp::forward(tied, x);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
  GatedLinear gated{nullptr};
  Scale scale{nullptr};
  TiedOut tied{nullptr};
};
TORCH_MODULE(Mlp);

/// Small CNN with uneven channel counts. Convolutions go through fsdp::forward; the linear layers are
/// called directly, exercising units that FSDP gathers together with the root.
struct CnnImpl : torch::nn::Module {
  CnnImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 3, 3)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 5, 3)));
    fc1 = register_module("fc1", torch::nn::Linear(5 * 6 * 6, 17));
    fc2 = register_module("fc2", torch::nn::Linear(17, 7));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fsdp::forward(conv1, x));
    x = torch::relu(fsdp::forward(conv2, x));
    x = torch::relu(fc1->forward(x.flatten(1)));
    return F::log_softmax(fc2->forward(x), F::LogSoftmaxFuncOptions(1));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Cnn);

// ---- training harness -------------------------------------------------------------------------

enum class ModelKind { kMlp, kCnn };
enum class OptimKind { kSgd, kAdam, kAdamW, kAdagrad, kRmsprop, kAdadelta };

inline std::string name_of(ModelKind m) { return m == ModelKind::kMlp ? "mlp" : "cnn"; }
inline std::string name_of(OptimKind o) {
  switch (o) {
    case OptimKind::kSgd: return "sgd";
    case OptimKind::kAdam: return "adam";
    case OptimKind::kAdamW: return "adamw";
    case OptimKind::kAdagrad: return "adagrad";
    case OptimKind::kRmsprop: return "rmsprop";
    case OptimKind::kAdadelta: return "adadelta";
  }
  return "?";
}

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(OptimKind kind, std::vector<torch::Tensor> params) {
  switch (kind) {
    case OptimKind::kSgd: return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3));
    case OptimKind::kAdam: return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
    // eps 1e-6: Adam-type updates g/sqrt(v) amplify fp32 summation-order noise of near-zero gradient
    // elements; with the default 1e-8 one bias element of this tiny model reaches 1.5e-5 at np=3.
    case OptimKind::kAdamW: return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.05).eps(1e-6));
    case OptimKind::kAdagrad: return std::make_unique<torch::optim::Adagrad>(params, torch::optim::AdagradOptions(0.05));
    case OptimKind::kRmsprop: return std::make_unique<torch::optim::RMSprop>(params, torch::optim::RMSpropOptions(1e-3).momentum(0.5));
    case OptimKind::kAdadelta: return std::make_unique<fsdp::optim::Adadelta>(params, fsdp::optim::AdadeltaOptions(1.0));
  }
  return nullptr;
}

struct Batch {
  torch::Tensor x, y;
};

/// The global batch of `step`: identical on every rank.
inline Batch global_batch(ModelKind kind, int step, int64_t rows) {
  auto gen = at::detail::createCPUGenerator(1000 + step);
  if (kind == ModelKind::kMlp) return {torch::randn({rows, 13}, gen), torch::randn({rows, 13}, gen)};
  return {torch::randn({rows, 1, 10, 10}, gen), torch::randint(0, 7, {rows}, gen)};
}

inline torch::Tensor loss_of(ModelKind kind, const torch::Tensor& out, const torch::Tensor& y) {
  const auto o = out.scalar_type() == torch::kFloat ? out : out.to(torch::kFloat);  // a mixed-precision model's output
  return kind == ModelKind::kMlp ? F::mse_loss(o, y) : F::nll_loss(o, y);
}

inline void set_gate(torch::nn::Module& model, bool on) {
  for (auto& m : model.modules())
    if (auto* g = dynamic_cast<GatedLinearImpl*>(m.get())) g->use_gate = on;
}

inline std::shared_ptr<torch::nn::Module> make_model(ModelKind kind) {
  torch::manual_seed(7);
  if (kind == ModelKind::kMlp) return Mlp().ptr();
  return Cnn().ptr();
}

/// LibTorch's parameters() lists a tied tensor once per name; an optimizer must see it once.
inline std::vector<torch::Tensor> unique_parameters(const torch::nn::Module& model) {
  std::vector<torch::Tensor> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& p : model.parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  return out;
}

inline constexpr int kSteps = 4;
inline constexpr int64_t kLocalRows = 3;

/// Training controls exercised against the reference.
struct Setup {
  double clip = 0;              ///< clip_grad_norm max_norm (0: off)
  int accum = 1;                ///< micro-batches per step (no_sync for all but the last)
  bool different_init = false;  ///< ranks initialize differently; FSDP syncs from rank 0
  bool freeze = false;          ///< some parameters frozen (requires_grad = false), see freeze()
};

/// Freezes a mix of parameters: a tied weight (both names), a bias next to a trainable weight, a
/// whole one-parameter unit (MLP); the first convolution's weight (CNN).
inline void freeze(torch::nn::Module& model) {
  for (auto& p : model.named_parameters())
    if (p.key() == "fc1.weight" || p.key() == "fc2.bias" || p.key() == "scale.alpha" || p.key() == "conv1.weight") p.value().set_requires_grad(false);
}

inline std::vector<torch::Tensor> trainable(std::vector<torch::Tensor> params) {
  std::vector<torch::Tensor> out;
  for (auto& p : params)
    if (p.requires_grad()) out.push_back(p);
  return out;
}

struct Trained {
  std::map<std::string, torch::Tensor> params;
  std::vector<double> norms;  ///< gradient norms returned by clipping, per step
  fsdp::OverlapStats overlap;
  fsdp::CommCounters comm;                 ///< every collective of the engine
  fsdp::CommCounters forward_group;        ///< of those, the all-gathers inside reshard_after_forward_group's groups
  std::int64_t optimizer_state_bytes = 0;  ///< this rank's, after the last step
  std::int64_t optimized_elements = 0;     ///< elements of this rank's optimizer parameters
};

/// Single-process training on the whole global batch. Parameters that get no gradient in a step get a
/// zero gradient, which is what a flat parameter gives them.
inline Trained train_reference(ModelKind kind, OptimKind optim, int world, const Setup& setup = {}) {
  Trained result;
  auto model = make_model(kind);
  if (setup.freeze) freeze(*model);
  auto opt = make_optimizer(optim, trainable(unique_parameters(*model)));
  for (int step = 0; step < kSteps; ++step) {
    set_gate(*model, step % 2 == 0);
    auto batch = global_batch(kind, step, kLocalRows * world * setup.accum);
    opt->zero_grad();
    torch::Tensor out = kind == ModelKind::kMlp ? std::static_pointer_cast<MlpImpl>(model)->forward(batch.x)
                                                : std::static_pointer_cast<CnnImpl>(model)->forward(batch.x);
    loss_of(kind, out, batch.y).backward();
    for (auto& p : model->parameters())
      if (p.requires_grad() && !p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    if (setup.clip > 0) result.norms.push_back(torch::nn::utils::clip_grad_norm_(trainable(unique_parameters(*model)), setup.clip));
    opt->step();
  }
  for (const auto& p : model->named_parameters()) result.params[p.key()] = p.value().detach().clone();
  return result;
}

template <class Impl, class Comm = MpiComm>
inline Trained train_fsdp_typed(ModelKind kind, OptimKind optim, const FsdpOptions& options, std::shared_ptr<Impl> net, const Setup& setup,
                                Comm world = Comm(MpiComm::world())) {
  Trained result;
  auto model = fsdp::make_fsdp(net, world, options);
  auto opt = make_optimizer(optim, model->parameters());
  const int r = world.rank();
  const int n = world.size();
  for (int step = 0; step < kSteps; ++step) {
    set_gate(*net, step % 2 == 0);
    auto batch = global_batch(kind, step, kLocalRows * n * setup.accum);
    opt->zero_grad();
    for (int micro = 0; micro < setup.accum; ++micro) {
      // Micro-batch `micro` of rank r: rows [(micro * n + r) * b, ... + b) of the global batch.
      auto x = batch.x.narrow(0, (micro * n + r) * kLocalRows, kLocalRows);
      auto y = batch.y.narrow(0, (micro * n + r) * kLocalRows, kLocalRows);
      auto loss = loss_of(kind, model->forward(x), y) / setup.accum;
      if (micro + 1 < setup.accum) {
        auto scope = model->no_sync();
        loss.backward();
      } else {
        loss.backward();
      }
    }
    if (setup.clip > 0) result.norms.push_back(model->clip_grad_norm(setup.clip));
    opt->step();
  }
  for (auto& [name, t] : model->full_parameters()) result.params[name] = t;
  result.optimizer_state_bytes = model->memory_stats(opt.get()).optimizer_state_bytes;
  for (const auto& p : model->parameters()) result.optimized_elements += p.numel();
  result.overlap = model->overlap_stats();
  result.comm = model->comm_counters();
  result.forward_group = model->forward_group_counters();
  return result;
}

inline Trained train_fsdp(ModelKind kind, OptimKind optim, const FsdpOptions& options, const Setup& setup = {}) {
  auto net = make_model(kind);
  if (setup.freeze) freeze(*net);
  if (setup.different_init && MpiComm::world().rank() != 0) {  // rank 0 keeps the reference's weights
    torch::manual_seed(1234 + MpiComm::world().rank());
    torch::NoGradGuard no_grad;
    for (auto& p : net->parameters()) p.copy_(torch::randn_like(p));
  }
  if (kind == ModelKind::kMlp) return train_fsdp_typed(kind, optim, options, std::static_pointer_cast<MlpImpl>(net), setup);
  return train_fsdp_typed(kind, optim, options, std::static_pointer_cast<CnnImpl>(net), setup);
}

/// Checks relative_error_of_model (model_error.hpp) <= 1e-5 and returns it; each tensor's own error
/// is in the message when the check fails.
inline double compare(const std::map<std::string, torch::Tensor>& fsdp_params, const std::map<std::string, torch::Tensor>& ref) {
  std::ostringstream per_tensor;
  for (const auto& [name, t] : fsdp_params) {
    const auto it = ref.find(name);
    BOOST_TEST_REQUIRE((it != ref.end()), "parameter " << name << " missing from the reference");
    BOOST_TEST_REQUIRE((t.sizes() == it->second.sizes()), "shape of " << name);
    per_tensor << " " << name << "=" << (t - it->second).norm().item<double>() / std::max(it->second.norm().item<double>(), 1e-12);
  }
  const double err = relative_error_of_model(fsdp_params, ref);
  BOOST_TEST(err <= 1e-5, "relative error of the whole model: " << err << " (per tensor:" << per_tensor.str() << ")");
  return err;
}

/// Every rank must hold the same gathered parameters.
inline void check_ranks_agree(const std::map<std::string, torch::Tensor>& params) {
  auto world = MpiComm::world();
  for (const auto& [name, t] : params) {
    auto mine = t.contiguous();
    auto hi = mine.clone();
    world.all_reduce(hi.data_ptr(), hi.data_ptr(), hi.numel(), fsdp::DType::kFloat32, fsdp::ReduceOp::kSum);
    BOOST_TEST((hi - mine * world.size()).abs().max().item<double>() < 1e-6, "ranks disagree on " << name);
  }
}

inline std::vector<std::pair<std::string, AutoWrapPolicy>> policies() {
  return {
      {"none", AutoWrapPolicy::none()},
      {"size", AutoWrapPolicy::size_based(200)},
      {"type", AutoWrapPolicy::module_types({"Linear", "Conv2d", "Scale", "TiedOut"})},
      {"predicate", AutoWrapPolicy::custom([](const std::string& fqn, const torch::nn::Module&, int64_t) {
         return fqn == "fc2" || fqn == "gated" || fqn == "scale" || fqn == "conv2";
       })},
  };
}

/// The strategies to check a training control under at this world size (hybrid at every group size).
inline std::vector<std::pair<ShardingStrategy, int>> strategies_and_groups(int world) {
  std::vector<std::pair<ShardingStrategy, int>> out = {
      {ShardingStrategy::FULL_SHARD, 0}, {ShardingStrategy::SHARD_GRAD_OP, 0}, {ShardingStrategy::NO_SHARD, 0}};
  for (int g = 1; g <= world; ++g)
    if (world % g == 0) out.push_back({ShardingStrategy::HYBRID_SHARD, g});
  return out;
}
