// The PyTorch FSDP tutorial's CNN (app layer, LibTorch); its family is app/models/cnn_family.hpp.
#pragma once

#include <fsdp/fsdp.hpp>
#include <torch/torch.h>

#include <memory>
#include <optional>

#include "models/app_model.hpp"
#include "run_config.hpp"

namespace fsdp::app {

/// The CNN of the PyTorch FSDP tutorial (and PyTorch's MNIST example), exactly: conv1 1->32 3x3,
/// conv2 32->64 3x3, max-pool 2, dropout 0.25, fc1 9216->128, dropout 0.5, fc2 128->10, log-softmax.
struct TutorialCnnImpl : AppModel {
  explicit TutorialCnnImpl(std::optional<double> dropout, bool deferred = false) : AppModel("TutorialCnn") {
    conv1 = register_module("conv1", deferred_if(deferred, torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).stride(1))));
    conv2 = register_module("conv2", deferred_if(deferred, torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).stride(1))));
    dropout1 = register_module("dropout1", torch::nn::Dropout(dropout.value_or(0.25)));
    dropout2 = register_module("dropout2", torch::nn::Dropout(dropout.value_or(0.5)));
    fc1 = register_module("fc1", deferred_if(deferred, torch::nn::Linear(9216, 128)));
    fc2 = register_module("fc2", deferred_if(deferred, torch::nn::Linear(128, 10)));
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = torch::relu(fsdp::forward(conv1, x));
    x = torch::relu(fsdp::forward(conv2, x));
    x = fsdp::forward(dropout1, F::max_pool2d(x, F::MaxPool2dFuncOptions(2)));
    x = torch::relu(fsdp::forward(fc1, x.flatten(1)));
    x = fsdp::forward(fc2, fsdp::forward(dropout2, x));
    return F::log_softmax(x, F::LogSoftmaxFuncOptions(1));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Dropout dropout1{nullptr}, dropout2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};

  static std::shared_ptr<AppModel> build(const ModelSection& m, bool deferred) { return std::make_shared<TutorialCnnImpl>(m.dropout, deferred); }
};

}  // namespace fsdp::app
