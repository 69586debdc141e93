// The keys and values a language model keeps between the forwards of one generation (fsdp-generate):
// each forward then takes only the new tokens, at positions after the cached ones. Shared by a model
// and its attention modules, like the document layout; off (and empty) for training and evaluation.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace fsdp::app {

struct KvCache {
  bool on = false;
  std::int64_t length = 0;                  ///< tokens cached (the position of the next one)
  std::vector<torch::Tensor> keys, values;  ///< per layer: [batch, kv heads, length, head_dim]

  void clear() {
    length = 0;
    keys.clear();
    values.clear();
  }
  /// Layer `layer`'s keys and values with the new ones [batch, heads, t, head_dim] appended, kept for
  /// the next forward.
  std::pair<torch::Tensor, torch::Tensor> append(std::size_t layer, torch::Tensor k, torch::Tensor v) {
    if (keys.size() <= layer) {
      keys.resize(layer + 1);
      values.resize(layer + 1);
    }
    if (keys[layer].defined()) {
      k = torch::cat({keys[layer], k}, 2);
      v = torch::cat({values[layer], v}, 2);
    }
    keys[layer] = k;
    values[layer] = v;
    return {k, v};
  }
  /// Where t new queries must not look among `past` cached keys and themselves: later tokens.
  static torch::Tensor blocked(std::int64_t t, std::int64_t past, const torch::Device& device) {
    return torch::ones({t, past + t}, torch::TensorOptions().dtype(torch::kBool).device(device)).triu(past + 1);
  }
};
using SharedKvCache = std::shared_ptr<KvCache>;

}  // namespace fsdp::app
