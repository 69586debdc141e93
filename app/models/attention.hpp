// The attention scores both decoders share (app layer, LibTorch).
#pragma once

#include <torch/torch.h>

#include <limits>

namespace fsdp::app {

/// scale q k^T with the `blocked` positions at -inf, for q (b, h, t, hd) and k (b, h, s, hd): (b, h, t, s).
/// The scale goes on q (t x hd per head, not t x s) and the mask is written into the product in place,
/// so the b h t s scores get no pass of their own: a division and masked_fill after the product made two
/// more forward and two more backward. The product's backward needs q and k only, never the scores.
/// (baddbmm's alpha would spare the pass over q too, but LibTorch 1.13's small-matrix path reads its
/// input even at beta 0.)
inline torch::Tensor masked_scores(const torch::Tensor& q, const torch::Tensor& k, double scale, const torch::Tensor& blocked) {
  return torch::matmul(q * scale, k.transpose(-2, -1)).masked_fill_(blocked, -std::numeric_limits<float>::infinity());
}

}  // namespace fsdp::app
