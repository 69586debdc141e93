// The attention scores both decoders share (app layer, LibTorch).
#pragma once

#include <torch/torch.h>

#include <limits>

namespace fsdp::app {

/// scale q k^T with the `blocked` positions at -inf, for q (b, h, t, hd) and k (b, h, s, hd): (b, h, t, s).
/// The scale goes on q (t x hd per head, not t x s) and the mask is added to the product in place, so
/// the b h t s scores get no pass of their own: a division and masked_fill after the product made two
/// more forward and two more backward. The mask is added as 0 and -inf (built at the mask's own size,
/// which broadcasts over the heads): ATen's masked_fill_ with a broadcast bool mask takes as long as
/// the product itself and its backward another pass, where a vectorized add takes a tenth and passes
/// the gradient through. The scores are the same bits (x + 0 = x, x + -inf = -inf); the softmax's
/// gradient is already zero where it is blocked. In fp16 a blocked score may overflow to inf, which
/// the add would turn into NaN: fp16 keeps masked_fill_. The product's backward needs q and k only.
/// (baddbmm's alpha would spare the pass over q too, but LibTorch 1.13's small-matrix path reads its
/// input even at beta 0.)
inline torch::Tensor masked_scores(const torch::Tensor& q, const torch::Tensor& k, double scale, const torch::Tensor& blocked) {
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  torch::Tensor scores = torch::matmul(q * scale, k.transpose(-2, -1));
  if (scores.scalar_type() == torch::kHalf) return scores.masked_fill_(blocked, kMinusInf);
  return scores.add_(torch::zeros(blocked.sizes(), q.options()).masked_fill_(blocked, kMinusInf));
}

}  // namespace fsdp::app
