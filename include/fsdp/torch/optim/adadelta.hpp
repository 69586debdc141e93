// Adadelta (Zeiler 2012) for LibTorch, which lacks it in 1.13 (torch layer).
// Same update and defaults as torch.optim.Adadelta: lr 1.0, rho 0.9, eps 1e-6, weight_decay 0.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "fsdp/torch/torch_compat.hpp"

namespace fsdp::optim {

struct AdadeltaOptions : public torch::optim::OptimizerCloneableOptions<AdadeltaOptions> {
  AdadeltaOptions(double lr = 1.0) : lr_(lr) {}  // NOLINT: implicit like LibTorch's options
  TORCH_ARG(double, lr) = 1.0;
  TORCH_ARG(double, rho) = 0.9;
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, weight_decay) = 0;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  void serialize(torch::serialize::InputArchive& archive) override {
    for (const char* key : {"lr", "rho", "eps", "weight_decay"}) {
      c10::IValue v;
      archive.read(key, v);
      const double d = v.toDouble();
      if (std::string(key) == "lr")
        lr_ = d;
      else if (std::string(key) == "rho")
        rho_ = d;
      else if (std::string(key) == "eps")
        eps_ = d;
      else
        weight_decay_ = d;
    }
  }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    archive.write("lr", c10::IValue(lr_));
    archive.write("rho", c10::IValue(rho_));
    archive.write("eps", c10::IValue(eps_));
    archive.write("weight_decay", c10::IValue(weight_decay_));
  }
};

struct AdadeltaParamState : public torch::optim::OptimizerCloneableParamState<AdadeltaParamState> {
  TORCH_ARG(torch::Tensor, square_avg);
  TORCH_ARG(torch::Tensor, acc_delta);
  TORCH_ARG(int64_t, step) = 0;

 public:
  void serialize(torch::serialize::InputArchive& archive) override {
    archive.read("square_avg", square_avg_);
    archive.read("acc_delta", acc_delta_);
    c10::IValue s;
    archive.read("step", s);
    step_ = s.toInt();
  }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    archive.write("square_avg", square_avg_);
    archive.write("acc_delta", acc_delta_);
    archive.write("step", c10::IValue(step_));
  }
};

class Adadelta : public torch::optim::Optimizer {
 public:
  explicit Adadelta(std::vector<torch::optim::OptimizerParamGroup> groups, AdadeltaOptions defaults = {})
      : Optimizer(std::move(groups), std::make_unique<AdadeltaOptions>(defaults)) {
    TORCH_CHECK(defaults.lr() >= 0, "Invalid learning rate: ", defaults.lr());
    TORCH_CHECK(defaults.rho() >= 0 && defaults.rho() <= 1, "Invalid rho value: ", defaults.rho());
    TORCH_CHECK(defaults.eps() >= 0, "Invalid epsilon value: ", defaults.eps());
    TORCH_CHECK(defaults.weight_decay() >= 0, "Invalid weight_decay value: ", defaults.weight_decay());
  }
  explicit Adadelta(std::vector<torch::Tensor> params, AdadeltaOptions defaults = {})
      : Adadelta({torch::optim::OptimizerParamGroup(std::move(params))}, defaults) {}

  torch::Tensor step(LossClosure closure = nullptr) override {
    torch::NoGradGuard no_grad;
    torch::Tensor loss;
    if (closure) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    for (auto& group : param_groups_) {
      const auto& o = static_cast<const AdadeltaOptions&>(group.options());
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto grad = p.grad();
        TORCH_CHECK(!grad.is_sparse(), "Adadelta does not support sparse gradients");
        const auto key = torch_compat::optimizer_state_key(p);
        auto it = state_.find(key);
        if (it == state_.end()) {
          auto s = std::make_unique<AdadeltaParamState>();
          s->square_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
          s->acc_delta(torch::zeros_like(p, at::MemoryFormat::Preserve));
          it = state_.emplace(key, std::move(s)).first;
        }
        auto& s = static_cast<AdadeltaParamState&>(*it->second);
        s.step(s.step() + 1);
        if (o.weight_decay() != 0) grad = grad.add(p, o.weight_decay());
        auto& square_avg = s.square_avg();
        auto& acc_delta = s.acc_delta();
        square_avg.mul_(o.rho()).addcmul_(grad, grad, 1 - o.rho());
        auto std_dev = square_avg.add(o.eps()).sqrt_();
        auto delta = acc_delta.add(o.eps()).sqrt_().div_(std_dev).mul_(grad);
        acc_delta.mul_(o.rho()).addcmul_(delta, delta, 1 - o.rho());
        p.add_(delta, -o.lr());
      }
    }
    return loss;
  }

  void save(torch::serialize::OutputArchive& archive) const override { serialize(*this, archive); }
  void load(torch::serialize::InputArchive& archive) override { serialize(*this, archive); }

 private:
  template <typename Self, typename Archive>
  static void serialize(Self& self, Archive& archive) {
    _TORCH_OPTIM_SERIALIZE_WITH_TEMPLATE_ARG(Adadelta);
  }
};

}  // namespace fsdp::optim
