// Adam and AdamW whose moments are stored in bf16 (torch layer): with fp32 master weights and
// gradients a parameter then costs 12 bytes instead of 16. The update runs in fp32, in one pass over
// each parameter (no temporaries the size of a shard). The moments are rounded back to bf16
// stochastically: round-to-nearest would freeze exp_avg_sq, because with beta2 = 0.999 a step moves it
// by at most 0.1%, under half of bf16's relative spacing of 0.8%. The random bits come from a hash of
// each element's place in the model and the step, so a result does not depend on the world size, the
// thread count or a resume in between.
#pragma once

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/errors.hpp"
#include "fsdp/torch/torch_compat.hpp"

namespace fsdp::optim {

/// Where a parameter's first element lies in the model: `stream` names the flat tensor it is part of
/// (an FSDP unit), `offset` the element's position there. Elements at the same place get the same
/// rounding on every rank and at every world size.
struct ElementPlace {
  std::uint64_t stream = 0;
  std::int64_t offset = 0;
};
/// The place of an optimizer parameter; unset: a parameter's index in the optimizer, offset 0.
using PlaceOfParameter = std::function<ElementPlace(const torch::Tensor&)>;

namespace detail {

/// A 32-bit integer hash with full avalanche (Chris Wellons' lowbias32), cheap enough per element.
constexpr std::uint32_t hash32(std::uint32_t x) noexcept {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

/// `value` rounded to bf16 up or down with probability proportional to its distance from each:
/// `random16` (uniform in [0, 65536)) is added below the bits bf16 keeps. NaN stays a NaN.
inline std::uint16_t float_to_bf16_stochastic(float value, std::uint32_t random16) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
  if ((u & 0x7fffffffU) > 0x7f800000U) return static_cast<std::uint16_t>((u >> 16) | 0x40);
  return static_cast<std::uint16_t>((u + random16) >> 16);
}

/// The rounding seed of one parameter at one step.
constexpr std::uint32_t step_seed(const ElementPlace& place, std::int64_t step) noexcept {
  const std::uint64_t s = place.stream * 0x9e3779b97f4a7c15ULL ^ static_cast<std::uint64_t>(step) * 0xc2b2ae3d27d4eb4fULL;
  return hash32(static_cast<std::uint32_t>(s ^ (s >> 32)));
}

/// The per-step constants of one parameter's update.
struct Bf16MomentsStep {
  float b1, b2, one_minus_b1, one_minus_b2, step_size, bias_correction2_sqrt, eps, l2, decay_factor;
  std::uint32_t seed, first_element_offset;
};

// One pass over [begin, end): restrict and a plain loop let the compiler vectorize it (with
// -fno-math-errno, which fsdp::fsdp sets: GCC keeps sqrt scalar where it may set errno), for AVX2 as
// well where the CPU has it (ATen's own kernels choose AVX2 at run time too). Each element is
// computed alone and nothing is contracted into FMAs (-ffp-contract=off, also set by fsdp::fsdp: a
// vector body and its scalar tail could contract differently), so neither the instruction set nor
// where a shard or thread split falls changes a result.
// Not under ThreadSanitizer (GCC's macro, clang's feature): its runtime is not up yet when the loader
// runs the clones' resolver, and the process dies at start.
#if defined(__SANITIZE_THREAD__)
#define FSDP_BF16_MOMENTS_CLONES 0
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FSDP_BF16_MOMENTS_CLONES 0
#endif
#endif
#if !defined(FSDP_BF16_MOMENTS_CLONES) && defined(__x86_64__) && defined(__GNUC__)
#define FSDP_BF16_MOMENTS_CLONES 1
#endif
#if FSDP_BF16_MOMENTS_CLONES
__attribute__((target_clones("avx2", "default")))
#endif
inline void
bf16_moments_update(const Bf16MomentsStep c, float* __restrict param, const float* __restrict g, std::uint16_t* __restrict m,
                    std::uint16_t* __restrict v, std::int64_t begin, std::int64_t end) {
  for (std::int64_t i = begin; i < end; ++i) {
    const float x = param[i] * c.decay_factor;
    const float gi = g[i] + c.l2 * x;
    const float mi = c.b1 * std::bit_cast<float>(std::uint32_t{m[i]} << 16) + c.one_minus_b1 * gi;
    const float vi = c.b2 * std::bit_cast<float>(std::uint32_t{v[i]} << 16) + c.one_minus_b2 * gi * gi;
    const float denom = std::sqrt(vi) / c.bias_correction2_sqrt + c.eps;
    param[i] = x - c.step_size * (mi / denom);
    const std::uint32_t random = hash32(c.seed ^ ((c.first_element_offset + static_cast<std::uint32_t>(i)) * 0x9e3779b9U));
    m[i] = float_to_bf16_stochastic(mi, random & 0xffffU);
    v[i] = float_to_bf16_stochastic(vi, random >> 16);
  }
}

/// The LibTorch types that go with torch::optim::Adam or AdamW (decoupled: AdamW's decay).
template <class TorchAdam>
struct AdamTypes {
  static constexpr bool kDecoupled = std::is_same_v<TorchAdam, torch::optim::AdamW>;
  static_assert(kDecoupled || std::is_same_v<TorchAdam, torch::optim::Adam>);
  using Options = std::conditional_t<kDecoupled, torch::optim::AdamWOptions, torch::optim::AdamOptions>;
  using State = std::conditional_t<kDecoupled, torch::optim::AdamWParamState, torch::optim::AdamParamState>;
};

}  // namespace detail

/// torch::optim::Adam or torch::optim::AdamW with bf16 moments. It is one of them (optimizer_kind()
/// and checkpoints say "Adam" / "AdamW", and its state is theirs with bf16 tensors), so a checkpoint
/// loads into either setting. CPU parameters in fp32 only; amsgrad is not supported.
template <class TorchAdam>
class Bf16MomentsAdam : public TorchAdam {
  static constexpr bool kDecoupled = detail::AdamTypes<TorchAdam>::kDecoupled;

 public:
  using Options = typename detail::AdamTypes<TorchAdam>::Options;
  using State = typename detail::AdamTypes<TorchAdam>::State;
  static constexpr c10::ScalarType kStateDtype = c10::ScalarType::BFloat16;

  Bf16MomentsAdam(std::vector<torch::Tensor> params, const Options& defaults, PlaceOfParameter place_of = {})
      : TorchAdam(std::move(params), defaults), place_of_(std::move(place_of)) {
    if (defaults.amsgrad()) throw ConfigError("bf16 optimizer moments: amsgrad is not supported");
    std::int64_t index = 0;
    for (const auto& g : this->param_groups())
      for (const auto& p : g.params()) {
        if (p.defined() && p.numel() > 0 && (!p.device().is_cpu() || p.scalar_type() != c10::ScalarType::Float))
          throw ConfigError("bf16 optimizer moments: parameter " + std::to_string(index) + " is " + c10::toString(p.scalar_type()) + " on " +
                            p.device().str() + "; they update fp32 parameters on the CPU only");
        ++index;
      }
  }

  torch::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) override {
    torch::NoGradGuard no_grad;
    torch::Tensor loss;
    if (closure) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    // Everything is checked and placed before anything changes: a refusal leaves the step unapplied.
    struct Pending {
      torch::Tensor* param;
      const Options* options;
      ElementPlace place;
    };
    std::vector<Pending> pending;
    std::uint64_t index = 0;
    for (auto& group : this->param_groups()) {
      const auto& o = static_cast<const Options&>(group.options());
      for (auto& p : group.params()) {
        const std::uint64_t position = index++;
        if (!p.grad().defined() || p.numel() == 0) continue;
        const auto& g = p.grad();
        if (g.is_sparse() || !g.device().is_cpu() || g.scalar_type() != c10::ScalarType::Float || g.numel() != p.numel() || !p.is_contiguous())
          throw ConfigError("bf16 optimizer moments: parameter " + std::to_string(position) +
                            " needs a contiguous parameter and a dense fp32 CPU gradient of its size; the gradient is " +
                            c10::toString(g.scalar_type()) + " on " + g.device().str());
        pending.push_back({&p, &o, place_of_ ? place_of_(p) : ElementPlace{position, 0}});
      }
    }
    for (auto& [p, o, place] : pending) update(*p, *o, place);
    return loss;
  }

 private:
  State& state_of(const torch::Tensor& p) {
    auto& states = this->state();
    const auto key = torch_compat::optimizer_state_key(p);
    auto it = states.find(key);
    if (it == states.end()) {
      auto s = std::make_unique<State>();
      s->exp_avg(torch::zeros({p.numel()}, p.options().dtype(kStateDtype)).view_as(p));
      s->exp_avg_sq(torch::zeros({p.numel()}, p.options().dtype(kStateDtype)).view_as(p));
      it = states.emplace(key, std::move(s)).first;
    }
    auto& s = static_cast<State&>(*it->second);
    // State loaded in another dtype (an fp32 checkpoint) is kept in bf16 from here on.
    if (s.exp_avg().scalar_type() != kStateDtype || !s.exp_avg().is_contiguous()) s.exp_avg(s.exp_avg().to(kStateDtype).contiguous());
    if (s.exp_avg_sq().scalar_type() != kStateDtype || !s.exp_avg_sq().is_contiguous()) s.exp_avg_sq(s.exp_avg_sq().to(kStateDtype).contiguous());
    return s;
  }

  void update(torch::Tensor& p, const Options& o, const ElementPlace& place) {
    auto& s = state_of(p);
    s.step(s.step() + 1);
    const auto grad = p.grad().contiguous();
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    const double bias_correction1 = 1 - std::pow(beta1, static_cast<double>(s.step()));
    const double bias_correction2 = 1 - std::pow(beta2, static_cast<double>(s.step()));
    // AdamW decays the parameter before the update (x 1 exactly otherwise); Adam adds L2 to the gradient.
    const detail::Bf16MomentsStep c{static_cast<float>(beta1),
                                    static_cast<float>(beta2),
                                    static_cast<float>(1 - beta1),
                                    static_cast<float>(1 - beta2),
                                    static_cast<float>(o.lr() / bias_correction1),
                                    static_cast<float>(std::sqrt(bias_correction2)),
                                    static_cast<float>(o.eps()),
                                    static_cast<float>(kDecoupled ? 0.0 : o.weight_decay()),
                                    static_cast<float>(kDecoupled ? 1 - o.lr() * o.weight_decay() : 1.0),
                                    detail::step_seed(place, s.step()),
                                    static_cast<std::uint32_t>(place.offset)};
    float* const param = p.data_ptr<float>();
    const float* const g = grad.data_ptr<float>();
    auto* const m = reinterpret_cast<std::uint16_t*>(s.exp_avg().data_ptr());
    auto* const v = reinterpret_cast<std::uint16_t*>(s.exp_avg_sq().data_ptr());
    // Written through pointers: the moments' version counters say so, as an in-place operation's would
    // (a background checkpoint copy checks them).
    s.exp_avg().unsafeGetTensorImpl()->bump_version();
    s.exp_avg_sq().unsafeGetTensorImpl()->bump_version();
    at::parallel_for(0, p.numel(), 1 << 14,
                     [&](std::int64_t begin, std::int64_t end) { detail::bf16_moments_update(c, param, g, m, v, begin, end); });
  }

  PlaceOfParameter place_of_;
};

using AdamBf16Moments = Bf16MomentsAdam<torch::optim::Adam>;
using AdamWBf16Moments = Bf16MomentsAdam<torch::optim::AdamW>;

/// The places of an FSDP engine's optimizer parameters (each unit's shard, or its replica part): the
/// unit's index and where the part starts in the unit's flat parameter. With them every world size
/// and strategy rounds an element alike. Local.
template <class Engine>
PlaceOfParameter places_in_units(Engine& engine) {
  std::map<const c10::TensorImpl*, ElementPlace> places;
  for (const auto& u : engine.sharded_units())
    if (u.optimized.defined())
      places[u.optimized.unsafeGetTensorImpl()] = {static_cast<std::uint64_t>(u.index), u.own_range().begin + u.optimized_range().begin};
  return [places = std::move(places)](const torch::Tensor& p) {
    const auto it = places.find(p.unsafeGetTensorImpl());
    if (it == places.end()) throw ConfigError("bf16 optimizer moments: a parameter that is not an FSDP unit's shard");
    return it->second;
  };
}

}  // namespace fsdp::optim
