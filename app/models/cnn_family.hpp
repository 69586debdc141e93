// The PyTorch FSDP tutorial's CNN family (app layer, std only): conv1 1->32 3x3, conv2 32->64 3x3,
// max-pool 2, dropout 0.25, fc1 9216->128, dropout 0.5, fc2 128->10, log-softmax. Fixed sizes: no
// size keys. Its LibTorch model is app/models/cnn.hpp.
#pragma once

#include <string>
#include <vector>

#include "models/family.hpp"

namespace fsdp::app {

class CnnFamily final : public ImageClassifierFamily {
 public:
  ModelKind kind() const override { return ModelKind::kCnn; }
  std::vector<std::string> layer_classes(const ModelSection&) const override { return {}; }  // no repeated layer

  ModelDesc describe(const ModelSection&) const override {
    ModelDesc d;
    d.kind = kind();
    const int root = d.add(-1, "", "TutorialCnn", "TutorialCnn");
    const int c1 = d.add(root, "conv1", "Conv2d", "torch::nn::Conv2d");
    d.param(c1, "weight", {32, 1, 3, 3});
    d.param(c1, "bias", {32});
    const int c2 = d.add(root, "conv2", "Conv2d", "torch::nn::Conv2d");
    d.param(c2, "weight", {64, 32, 3, 3});
    d.param(c2, "bias", {64});
    d.add(root, "dropout1", "Dropout", "torch::nn::Dropout");
    d.add(root, "dropout2", "Dropout", "torch::nn::Dropout");
    detail::describe_linear(d, root, "fc1", 9216, 128);
    detail::describe_linear(d, root, "fc2", 128, kClasses);
    return d;
  }

  static constexpr std::int64_t kNumParams = (32 * 9 + 32) + (64 * 32 * 9 + 64) + (9216 * 128 + 128) + (128 * 10 + 10);
  std::int64_t num_params(const ModelSection&) const override { return kNumParams; }

  /// Forward multiply-adds x 2 (conv1 26x26x32 outputs of 9 products, conv2 24x24x64 of 288, fc1,
  /// fc2), and backward twice the forward, as 6 N counts a linear layer.
  static constexpr double kForwardFlops = 2.0 * (26 * 26 * 32 * 9 + 24 * 24 * 64 * 288 + 9216 * 128 + 128 * kClasses);
  double flops_per_sample(const ModelSection&, std::int64_t) const override { return 3 * kForwardFlops; }

  /// Fixed sizes: the batch's own cap keeps a step small.
  SizeEstimate size_estimate(const ModelSection&, long double) const override { return {}; }

 protected:
  void trace_layers(TraceBuilder& b, const ModelSection& m, std::int64_t batch, int eb, bool training, int x, std::int64_t x_bytes) const override {
    constexpr int input = 0;
    const std::int64_t B = batch;
    const double p1 = training ? m.dropout.value_or(0.25) : 0.0, p2 = training ? m.dropout.value_or(0.5) : 0.0;
    const std::int64_t c1 = B * 32 * 26 * 26 * eb, c2 = B * 64 * 24 * 24 * eb, pool = B * 9216 * eb;
    int y = b.linear("conv1", x, x_bytes, c1);
    int r = b.op(c1, {}, {y, x == input ? -1 : x}, {}, 2 * c1, true);
    y = b.linear("conv2", r, c1, c2);
    int r2 = b.op(c2, {}, {y}, {}, 2 * c2, true);
    b.drop({r});
    int mp = b.op(pool, {r2}, {r2}, {}, pool + c2);  // max_pool2d saves its input and the indices
    b.aux(B * 9216 * 8);
    b.enter("dropout1", mp);
    if (p1 > 0) {
      const int dd = b.op(pool, {}, {mp}, {}, 2 * pool);
      b.aux(pool);
      mp = dd;
    }
    b.exit("dropout1");
    y = b.linear("fc1", mp, pool, B * 128 * eb);
    r = b.op(B * 128 * eb, {}, {y, mp}, {}, 2 * B * 128 * eb, true);
    b.enter("dropout2", r);
    if (p2 > 0) {
      const int dd = b.op(B * 128 * eb, {}, {r}, {}, 2 * B * 128 * eb);
      b.aux(B * 128 * eb);
      r = dd;
    }
    b.exit("dropout2");
    y = b.linear("fc2", r, B * 128 * eb, B * kClasses * eb);
    trace_loss(b, batch, eb, y, r);
  }
};

}  // namespace fsdp::app
