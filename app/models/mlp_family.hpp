// The MLP's family (app layer, std only): 784 -> model.hidden_sizes... -> 10 with ReLU (and dropout,
// default none), log-softmax. Its LibTorch model is app/models/mlp.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "models/family.hpp"

namespace fsdp::app {

class MlpFamily final : public ImageClassifierFamily {
 public:
  ModelKind kind() const override { return ModelKind::kMlp; }
  std::vector<std::string> layer_classes(const ModelSection&) const override { return {}; }  // no repeated layer

  ModelDesc describe(const ModelSection& m) const override {
    ModelDesc d;
    d.kind = kind();
    const int root = d.add(-1, "", "Mlp", "Mlp");
    std::int64_t in = kPixels;
    for (std::size_t i = 0; i < m.hidden_sizes.size(); ++i) {
      detail::describe_linear(d, root, "fc" + std::to_string(i + 1), in, m.hidden_sizes[i]);
      in = m.hidden_sizes[i];
    }
    detail::describe_linear(d, root, "out", in, kClasses);
    return d;
  }

  std::int64_t num_params(const ModelSection& m) const override {
    std::int64_t n = 0, in = kPixels;
    for (auto h : m.hidden_sizes) {
      n += in * h + h;
      in = h;
    }
    return n + in * kClasses + kClasses;
  }
  /// Linear layers only: 6 per parameter (the biases' few FLOPs counted alike).
  double flops_per_sample(const ModelSection&, std::int64_t num_params) const override { return 6.0 * static_cast<double>(num_params); }

  SizeEstimate size_estimate(const ModelSection& m, long double batch) const override {
    SizeEstimate e{.keys = "model.hidden_sizes"};
    long double in = kPixels;
    for (const auto h : m.hidden_sizes) {
      e.params += in * static_cast<long double>(h) + static_cast<long double>(h);
      e.activations += 4 * batch * static_cast<long double>(h);
      in = static_cast<long double>(h);
    }
    e.params += in * kClasses + kClasses;
    return e;
  }

  /// Every hidden width scaled by one factor, the first set to the knob's value.
  std::vector<SizeKnob> size_knobs(const ModelSection&) const override {
    SizeKnob width{.name = "hidden_sizes", .note = "every hidden width scaled by one factor", .column = -28};
    width.with = [](ModelSection m, std::int64_t first) {
      const double scale = static_cast<double>(first) / static_cast<double>(m.hidden_sizes.front());
      for (auto& h : m.hidden_sizes) h = std::max<std::int64_t>(1, std::llround(static_cast<double>(h) * scale));
      m.hidden_sizes.front() = first;
      return m;
    };
    width.shown = [](const ModelSection& m) {
      std::string s;
      for (auto h : m.hidden_sizes) s += (s.empty() ? "[" : ", ") + std::to_string(h);
      return s + "]";
    };
    return {width};
  }

 protected:
  void trace_layers(TraceBuilder& b, const ModelSection& m, std::int64_t batch, int eb, bool training, int x, std::int64_t x_bytes) const override {
    constexpr int input = 0;
    auto keep = [](int v) { return v == input ? -1 : v; };  // the batch is the loop's, never dropped here
    const double p = training ? m.dropout.value_or(0.0) : 0.0;
    for (std::size_t i = 0; i < m.hidden_sizes.size(); ++i) {
      const std::int64_t hb = batch * m.hidden_sizes[i] * eb;
      const int y = b.linear("fc" + std::to_string(i + 1), x, x_bytes, hb);
      int r = b.op(hb, {}, {y, keep(x)}, {}, 2 * hb, /*save_out=*/true);  // relu saves its result
      if (p > 0) {
        const int dd = b.op(hb, {}, {r}, {}, 2 * hb);
        b.aux(hb);  // the dropout mask (a float tensor) saved by the multiplication
        r = dd;
      }
      x = r;
      x_bytes = hb;
    }
    const int y = b.linear("out", x, x_bytes, batch * kClasses * eb);
    trace_loss(b, batch, eb, y, keep(x));
  }
};

}  // namespace fsdp::app
