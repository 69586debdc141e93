// The MLP (app layer, LibTorch); its family is app/models/mlp_family.hpp.
#pragma once

#include <fsdp/fsdp.hpp>
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/app_model.hpp"
#include "run_config.hpp"

namespace fsdp::app {

/// 784 -> hidden_sizes... -> 10 with ReLU (and dropout, default none), log-softmax.
struct MlpImpl : AppModel {
  MlpImpl(const std::vector<std::int64_t>& hidden_sizes, std::optional<double> dropout, bool deferred = false)
      : AppModel("Mlp"), p_(dropout.value_or(0.0)) {
    std::int64_t in = 784;
    for (std::size_t i = 0; i < hidden_sizes.size(); ++i) {
      layers.push_back(register_module("fc" + std::to_string(i + 1), deferred_if(deferred, torch::nn::Linear(in, hidden_sizes[i]))));
      in = hidden_sizes[i];
    }
    layers.push_back(register_module("out", deferred_if(deferred, torch::nn::Linear(in, 10))));
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = x.flatten(1);
    for (std::size_t i = 0; i + 1 < layers.size(); ++i) {
      x = torch::relu(fsdp::forward(layers[i], x));
      if (p_ > 0) x = F::dropout(x, F::DropoutFuncOptions().p(p_).training(is_training()));
    }
    return F::log_softmax(fsdp::forward(layers.back(), x), F::LogSoftmaxFuncOptions(1));
  }
  std::vector<torch::nn::Linear> layers;
  double p_;

  static std::shared_ptr<AppModel> build(const ModelSection& m, bool deferred) {
    return std::make_shared<MlpImpl>(m.hidden_sizes, m.dropout, deferred);
  }
};

}  // namespace fsdp::app
