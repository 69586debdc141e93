// fsdp-train (app layer): a language model's loss, the cross-entropy of its logits against the next
// tokens. Autograd's log_softmax + nll_loss holds three logits-sized tensors at the start of backward
// (log_softmax's saved result, nll_loss's gradient and log_softmax's gradient: 94 MiB for 256 tokens
// of a 32000-word vocabulary); this one builds the logits' gradient in the buffer of the saved result.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <stdexcept>

namespace fsdp::app {

namespace detail {

/// The forward is log_softmax + nll_loss itself (the same loss, bit for bit). The backward writes
/// softmax * s - s at the target (s = g, or g / rows under mean) into the log-probabilities' buffer,
/// the value log_softmax's backward computes from nll_loss's gradient: the same bits away from the
/// targets (where the vocabulary is a multiple of 8), within one rounding of s at them (LibTorch's
/// kernel fuses that multiply and subtraction).
struct TokenCrossEntropy : public torch::autograd::Function<TokenCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets, bool sum) {
    at::Tensor log_probs = torch::log_softmax(logits, 1);
    at::Tensor loss = torch::nll_loss(log_probs, targets, {}, sum ? at::Reduction::Sum : at::Reduction::Mean);
    // Kept out of save_for_backward: backward overwrites it with the gradient, so a second backward
    // over the same graph (retain_graph) finds it gone and says so.
    ctx->saved_data["log_probs"] = log_probs;
    ctx->saved_data["sum"] = sum;
    ctx->save_for_backward({targets});
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto kept = ctx->saved_data.find("log_probs");
    if (kept == ctx->saved_data.end())
      throw std::logic_error("token cross-entropy: a second backward over the same graph (its buffer became the first one's gradient)");
    at::Tensor grad = kept->second.toTensor();
    ctx->saved_data.erase(kept);
    const at::Tensor targets = ctx->get_saved_variables()[0].unsqueeze(1);
    at::Tensor scale = grads[0];
    if (!ctx->saved_data["sum"].toBool()) scale = scale / at::full({}, static_cast<double>(targets.size(0)), scale.options());
    grad.exp_().mul_(scale);  // nll_loss's gradient sums to -s over each row
    grad.scatter_(1, targets, grad.gather(1, targets) - scale);
    return {grad, at::Tensor(), at::Tensor()};
  }
};

}  // namespace detail

/// Cross-entropy of `logits` [rows, vocabulary] against `targets` [rows] (token ids, never ignored),
/// summed or averaged over the rows: nll_loss(log_softmax(logits)), whose backward holds one
/// logits-sized tensor instead of three (no second-order gradient through it: the engine refuses
/// create_graph anyway). Without a gradient it is the plain expression.
inline at::Tensor token_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, bool sum) {
  if (!torch::GradMode::is_enabled() || !logits.requires_grad())
    return torch::nll_loss(torch::log_softmax(logits, 1), targets, {}, sum ? at::Reduction::Sum : at::Reduction::Mean);
  return detail::TokenCrossEntropy::apply(logits, targets, sum);
}

}  // namespace fsdp::app
