// The house's measure of "equals single-process training" (no test framework: the GPU suite uses it
// too): the relative error of the whole model, ||a - b|| / ||b|| over every parameter together. Per
// tensor it would not hold: under Adam a tensor whose gradients are nearly zero turns summation-order
// noise (another GEMM blocking, another batch size, another GPU kernel) into a large relative error of
// that one tensor.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

/// ||got - want|| / ||want|| over every parameter of `got` (each must be in `want`, same shape).
inline double relative_error_of_model(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want) {
  double diff_sq = 0, want_sq = 0;
  for (const auto& [name, t] : got) {
    const auto& w = want.at(name);
    diff_sq += std::pow((t - w).norm().item<double>(), 2);
    want_sq += std::pow(w.norm().item<double>(), 2);
  }
  return std::sqrt(diff_sq) / std::max(std::sqrt(want_sq), 1e-12);
}
