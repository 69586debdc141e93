// Parts of the decoders whose backward recomputes a cheap result instead of keeping it from forward
// (app layer, LibTorch): GPT's GELU output (4 x d_model floats per token, which the output projection
// kept for its weight's gradient beside the GELU's input), Llama's SwiGLU product and its silu (two of
// the four intermediate-size tensors per token its MLP kept), and both decoders' attention
// probabilities (heads x context floats per token, with the copies matmul made of q, k and v; in bf16
// Llama's fp32 softmax and its cast take 6 bytes per score). The MLPs keep only their projections'
// outputs, which the plain expressions keep too; attention keeps q, k and v in place of matmul's
// copies. The gradients are the plain expressions', bit for bit. Activation memory per block falls by
// about a third. The MLPs' elementwise recomputation costs no measurable time; the attention's (two
// small batched products and a softmax) 1-8% of a step, so model.recompute_attention can turn it off.
#pragma once

#include <torch/torch.h>

#include <string>

#include "models/attention.hpp"

namespace fsdp::app {

namespace detail {

/// linear(gelu(h), weight, bias), keeping h (which the GELU's backward reads anyway) and not the GELU's
/// output: backward computes it again for the weight's gradient. The products and sums are those of
/// F::linear's backward, in the same form.
struct LinearOfGelu : public torch::autograd::Function<LinearOfGelu> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h, const at::Tensor& weight, const at::Tensor& bias,
                            const std::string& approximate) {
    ctx->save_for_backward({h, weight});
    ctx->saved_data["approximate"] = approximate;
    return torch::nn::functional::linear(at::gelu(h, approximate), weight, bias);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& h = saved[0];
    const at::Tensor& weight = saved[1];
    const std::string approximate = ctx->saved_data["approximate"].toStringRef();
    const at::Tensor grad_2d = grads[0].reshape({-1, grads[0].size(-1)});
    at::Tensor grad_h, grad_weight, grad_bias;
    if (ctx->needs_input_grad(1)) {
      const at::Tensor gelu = at::gelu(h, approximate);  // forward's bits again
      grad_weight = grad_2d.t().mm(gelu.reshape({-1, gelu.size(-1)}));
    }
    if (ctx->needs_input_grad(2)) grad_bias = grad_2d.sum(0);
    if (ctx->needs_input_grad(0)) grad_h = at::gelu_backward(grad_2d.mm(weight).view(h.sizes()), h, approximate);
    return {grad_h, grad_weight, grad_bias, at::Tensor()};
  }
};

/// linear(silu(gate) * up, weight), keeping gate and up (which the product's and the silu's backward
/// read anyway) and not silu(gate) nor the product: backward computes both again. The products are
/// those of F::linear's and mul's backward, in the same form.
struct LinearOfSwiGlu : public torch::autograd::Function<LinearOfSwiGlu> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& weight) {
    ctx->save_for_backward({gate, up, weight});
    return torch::nn::functional::linear(at::silu(gate).mul_(up), weight);  // in place: one intermediate-size buffer in forward
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &gate = saved[0], &up = saved[1], &weight = saved[2];
    const at::Tensor grad_2d = grads[0].reshape({-1, grads[0].size(-1)});
    const at::Tensor silu = at::silu(gate);  // forward's bits again
    at::Tensor grad_gate, grad_up, grad_weight;
    if (ctx->needs_input_grad(2)) {
      const at::Tensor product = silu * up;
      grad_weight = grad_2d.t().mm(product.reshape({-1, product.size(-1)}));
    }
    if (ctx->needs_input_grad(0) || ctx->needs_input_grad(1)) {  // the gate's first: its temporary is gone before grad_up
      const at::Tensor grad_product = grad_2d.mm(weight).view(gate.sizes());
      if (ctx->needs_input_grad(0)) grad_gate = at::silu_backward(grad_product * up, gate);
      if (ctx->needs_input_grad(1)) grad_up = grad_product * silu;
    }
    return {grad_gate, grad_up, grad_weight};
  }
};

/// softmax(scale q k^T, blocked at -inf) over the last dimension; `in_fp32`: computed in fp32 and cast
/// back to q's type (Llama's attention, as Hugging Face's).
inline at::Tensor probabilities(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& blocked, bool in_fp32) {
  const at::Tensor scores = masked_scores(q, k, scale, blocked);
  return in_fp32 ? torch::softmax(scores, -1, torch::kFloat).to(scores.scalar_type()) : torch::softmax(scores, -1);
}

/// probabilities(...) [x dropout's noise] @ v. The forward is the plain expression (its random draws
/// included); backward evaluates it again from q, k and v, with the noise rebuilt from the
/// kept-positions mask, and differentiates that: the same kernels on the same values.
struct RecomputedAttention : public torch::autograd::Function<RecomputedAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& blocked, double scale, double dropout, bool softmax_in_fp32) {
    at::Tensor att = probabilities(q, k, scale, blocked, softmax_in_fp32);
    at::Tensor kept;
    if (dropout > 0) {  // F::dropout on the CPU: a Bernoulli draw, divided by the keep probability, multiplied in
      auto noise = at::empty_like(att).bernoulli_(1 - dropout);
      kept = noise.to(torch::kBool);
      att = att * noise.div_(1 - dropout);
    }
    ctx->save_for_backward({q, k, v, blocked, kept});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["dropout"] = dropout;
    ctx->saved_data["softmax_in_fp32"] = softmax_in_fp32;
    return torch::matmul(att, v);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const double scale = ctx->saved_data["scale"].toDouble(), dropout = ctx->saved_data["dropout"].toDouble();
    torch::AutoGradMode grad_mode(true);
    std::vector<at::Tensor> inputs;
    for (int i = 0; i < 3; ++i) inputs.push_back(saved[static_cast<std::size_t>(i)].detach().requires_grad_(ctx->needs_input_grad(i)));
    at::Tensor att = probabilities(inputs[0], inputs[1], scale, saved[3], ctx->saved_data["softmax_in_fp32"].toBool());
    if (dropout > 0) att = att * saved[4].to(att.scalar_type()).div_(1 - dropout);
    const at::Tensor y = torch::matmul(att, inputs[2]);
    std::vector<at::Tensor> wanted;
    for (const auto& t : inputs)
      if (t.requires_grad()) wanted.push_back(t);
    const auto found = torch::autograd::grad({y}, wanted, {grads[0]});
    torch::autograd::variable_list result;
    std::size_t next = 0;
    for (const auto& t : inputs) result.push_back(t.requires_grad() ? found[next++] : at::Tensor());
    result.resize(7);  // blocked, scale, dropout, softmax_in_fp32: no gradient
    return result;
  }
};

}  // namespace detail

/// The output projection of GPT's MLP, applied to the first projection's output `h`: linear(gelu(h)).
/// A torch::nn::Linear (same parameters, names, initialization and random draws) whose backward
/// recomputes the GELU instead of keeping its output. Its type name is GeluLinear (wrap policies by
/// type see it as that). Called as a torch::nn::LinearImpl (m.as<torch::nn::Linear>(), clone()) it is
/// a plain Linear without the GELU: the models call it only through this type.
struct GeluLinearImpl : torch::nn::LinearImpl {
  GeluLinearImpl(std::int64_t in, std::int64_t out, std::string approximate) : torch::nn::LinearImpl(in, out), approximate_(std::move(approximate)) {}
  void pretty_print(std::ostream& stream) const override {
    stream << "fsdp::app::GeluLinear(in_features=" << options.in_features() << ", out_features=" << options.out_features()
           << ", approximate=" << approximate_ << ")";
  }
  torch::Tensor forward(const torch::Tensor& h) {
    if (!torch::GradMode::is_enabled() || !(h.requires_grad() || weight.requires_grad() || bias.requires_grad()))
      return torch::nn::functional::linear(torch::nn::functional::gelu(h, torch::nn::functional::GELUFuncOptions().approximate(approximate_)), weight,
                                           bias);
    return detail::LinearOfGelu::apply(h, weight, bias, approximate_);
  }
  std::string approximate_;
};
TORCH_MODULE(GeluLinear);

/// The down projection of Llama's SwiGLU MLP, applied to the gate and up projections' outputs:
/// linear(silu(gate) * up), without bias. A torch::nn::Linear (same parameter, name, initialization and
/// random draws) whose backward recomputes the silu and the product instead of keeping them. Its type
/// name is SwiGluLinear. Called as a torch::nn::LinearImpl it is a plain Linear of its one input.
struct SwiGluLinearImpl : torch::nn::LinearImpl {
  SwiGluLinearImpl(std::int64_t in, std::int64_t out) : torch::nn::LinearImpl(torch::nn::LinearOptions(in, out).bias(false)) {}
  void pretty_print(std::ostream& stream) const override {
    stream << "fsdp::app::SwiGluLinear(in_features=" << options.in_features() << ", out_features=" << options.out_features() << ", bias=false)";
  }
  torch::Tensor forward(const torch::Tensor& gate, const torch::Tensor& up) {
    if (!torch::GradMode::is_enabled() || !(gate.requires_grad() || up.requires_grad() || weight.requires_grad()))
      return torch::nn::functional::linear(torch::silu(gate) * up, weight);
    return detail::LinearOfSwiGlu::apply(gate, up, weight);
  }
};
TORCH_MODULE(SwiGluLinear);

/// Causal attention of q (b, h, t, hd) over k and v (b, h, s, hd) with the `blocked` positions masked
/// and dropout `p` on the probabilities (0 outside training), the softmax in fp32 where
/// `softmax_in_fp32` (cast back to q's type); while a gradient is recorded and
/// `recompute` is set (model.recompute_attention), its backward recomputes the probabilities rather
/// than keep them. Not with dropout on another device than the CPU (F::dropout there draws with a fused
/// kernel this does not reproduce) nor at p = 1 (F::dropout's zeros without a draw): the plain
/// expression then.
inline torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& blocked, double scale,
                            double p, bool recompute = true, bool softmax_in_fp32 = false) {
  const bool reproducible_dropout = p <= 0 || (p < 1 && q.device().is_cpu());
  if (recompute && reproducible_dropout && torch::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad()))
    return detail::RecomputedAttention::apply(q, k, v, blocked, scale, p, softmax_in_fp32);
  auto att = detail::probabilities(q, k, scale, blocked, softmax_in_fp32);
  if (p > 0) att = torch::nn::functional::dropout(att, torch::nn::functional::DropoutFuncOptions().p(p).training(true));
  return torch::matmul(att, v);
}

}  // namespace fsdp::app
