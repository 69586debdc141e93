// Adam and AdamW with fp32 moments in one pass over each parameter (torch layer). LibTorch's
// torch::optim::Adam and AdamW run eight to ten element-wise kernels per parameter (decay, two for
// each moment, sqrt, divide, add, addcdiv) and allocate two shard-sized temporaries (three for Adam's
// L2 decay); this reads the
// parameter, its gradient and both moments once and writes three of them once. Each element gets
// ATen's own arithmetic in ATen's order, with a fused multiply-add where ATen's vectorized add and
// addcmul kernels have one, so where ATen runs its vectorized kernels the update is LibTorch's bit for
// bit (tests/test_engine_bf16_moments.cpp: measured on AVX-512 and AVX2); with ATen's scalar kernels
// (a CPU without AVX2, ATEN_CPU_CAPABILITY=default), to rounding. The state is
// LibTorch's (fp32 exp_avg and exp_avg_sq), so checkpoints move freely between the two.
#pragma once

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/torch/optim/bf16_moments_adam.hpp"  // FSDP_BF16_MOMENTS_CLONES, detail::AdamTypes
#include "fsdp/torch/torch_compat.hpp"

namespace fsdp::optim {

namespace detail {

/// The per-step constants of one parameter's fp32 update, each as ATen rounds its scalar to float.
struct OnePassAdamStep {
  float decay_factor, l2, b1, one_minus_b1, b2, one_minus_b2, bias_correction2_sqrt, eps, minus_step_size;
  bool add_l2;  ///< Adam with weight_decay != 0 (its float may round to 0: ATen still adds 0 * p)
};

// As bf16_moments_update: a plain loop the compiler vectorizes, no contraction beyond the explicit
// std::fma calls (where ATen's kernels contract), so the instruction set does not change a result.
// The vector clone needs FMA as well as AVX2 (x86-64-v3): without it each std::fma is a libm call.
#if FSDP_BF16_MOMENTS_CLONES
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
inline void
one_pass_adam_update(const OnePassAdamStep c, float* __restrict param, const float* __restrict g, float* __restrict m, float* __restrict v,
                     std::int64_t begin, std::int64_t end) {
  for (std::int64_t i = begin; i < end; ++i) {
    const float x = param[i] * c.decay_factor;                   // AdamW: p.mul_(1 - lr wd)
    const float gi = c.add_l2 ? std::fma(x, c.l2, g[i]) : g[i];  // Adam: grad.add(p, wd) where wd != 0
    const float mi = std::fma(gi, c.one_minus_b1, m[i] * c.b1);
    const float vi = std::fma(c.one_minus_b2 * gi, gi, v[i] * c.b2);  // addcmul: self + value * t1 * t2, contracted
    const float denom = std::sqrt(vi) / c.bias_correction2_sqrt + c.eps;
    param[i] = x + c.minus_step_size * mi / denom;  // addcdiv: self + value * t1 / t2
    m[i] = mi;
    v[i] = vi;
  }
}

}  // namespace detail

/// torch::optim::Adam or torch::optim::AdamW updating each fp32 CPU parameter in one pass (fsdp-train's
/// adam and adamw). It is one of them: its options, state, optimizer_kind() and checkpoints are
/// theirs. Where a step holds anything the pass does not cover (amsgrad, a parameter on a GPU or not in
/// fp32, a gradient that is sparse or not contiguous, a state of another dtype or shape) the whole step
/// is LibTorch's own.
template <class TorchAdam>
class OnePassAdam : public TorchAdam {
  static constexpr bool kDecoupled = detail::AdamTypes<TorchAdam>::kDecoupled;

 public:
  using Options = typename detail::AdamTypes<TorchAdam>::Options;
  using State = typename detail::AdamTypes<TorchAdam>::State;

  OnePassAdam(std::vector<torch::Tensor> params, const Options& defaults) : TorchAdam(std::move(params), defaults) {}
  OnePassAdam(std::vector<torch::optim::OptimizerParamGroup> groups, const Options& defaults) : TorchAdam(std::move(groups), defaults) {}

  torch::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) override {
    torch::NoGradGuard no_grad;
    torch::Tensor loss;
    if (closure) {  // first: it may make the gradients the check below looks at
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    if (!one_pass_covers_step()) {
      TorchAdam::step(nullptr);
      return loss;
    }
    for (auto& group : this->param_groups()) {
      const auto& o = static_cast<const Options&>(group.options());
      for (auto& p : group.params())
        if (p.grad().defined()) update(p, o);
    }
    return loss;
  }

 private:
  static bool fp32_cpu(const torch::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == c10::ScalarType::Float && t.is_contiguous(); }

  /// Every parameter with a gradient is an fp32 CPU tensor with a dense gradient of its layout, and
  /// its state (if any) fp32 moments of its size.
  bool one_pass_covers_step() {
    for (auto& group : this->param_groups()) {
      if (static_cast<const Options&>(group.options()).amsgrad()) return false;
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        const auto& g = p.grad();
        if (!fp32_cpu(p) || g.is_sparse() || !fp32_cpu(g) || g.sizes() != p.sizes()) return false;
        const auto it = this->state().find(torch_compat::optimizer_state_key(p));
        if (it == this->state().end()) continue;
        const auto& s = static_cast<const State&>(*it->second);
        if (!fp32_cpu(s.exp_avg()) || !fp32_cpu(s.exp_avg_sq()) || s.exp_avg().sizes() != p.sizes() || s.exp_avg_sq().sizes() != p.sizes())
          return false;
      }
    }
    return true;
  }

  State& state_of(const torch::Tensor& p) {
    auto& states = this->state();
    const auto key = torch_compat::optimizer_state_key(p);
    auto it = states.find(key);
    if (it == states.end()) {  // what LibTorch's first step creates
      auto s = std::make_unique<State>();
      s->step(0);
      s->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      s->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      it = states.emplace(key, std::move(s)).first;
    }
    return static_cast<State&>(*it->second);
  }

  void update(torch::Tensor& p, const Options& o) {
    auto& s = state_of(p);
    s.step(s.step() + 1);
    // LibTorch's arithmetic of the scalars: in double, each rounded to float where a kernel takes it.
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    const double bias_correction1 = 1 - std::pow(beta1, static_cast<double>(s.step()));
    const double bias_correction2 = 1 - std::pow(beta2, static_cast<double>(s.step()));
    const double wd = o.weight_decay();
    const detail::OnePassAdamStep c{static_cast<float>(kDecoupled && wd != 0 ? 1 - o.lr() * wd : 1.0),
                                    static_cast<float>(kDecoupled ? 0.0 : wd),
                                    static_cast<float>(beta1),
                                    static_cast<float>(1 - beta1),
                                    static_cast<float>(beta2),
                                    static_cast<float>(1 - beta2),
                                    static_cast<float>(std::sqrt(bias_correction2)),
                                    static_cast<float>(o.eps()),
                                    static_cast<float>(-(o.lr() / bias_correction1)),
                                    !kDecoupled && wd != 0};
    float* const param = p.template data_ptr<float>();
    const float* const g = p.grad().template data_ptr<float>();
    float* const m = s.exp_avg().template data_ptr<float>();
    float* const v = s.exp_avg_sq().template data_ptr<float>();
    // Written through pointers: the version counters say so, as in-place operations' would (a
    // background checkpoint copy checks them).
    p.unsafeGetTensorImpl()->bump_version();
    s.exp_avg().unsafeGetTensorImpl()->bump_version();
    s.exp_avg_sq().unsafeGetTensorImpl()->bump_version();
    at::parallel_for(0, p.numel(), 1 << 14,
                     [&](std::int64_t begin, std::int64_t end) { detail::one_pass_adam_update(c, param, g, m, v, begin, end); });
  }
};

using OnePassAdamL2 = OnePassAdam<torch::optim::Adam>;
using OnePassAdamW = OnePassAdam<torch::optim::AdamW>;

}  // namespace fsdp::optim
