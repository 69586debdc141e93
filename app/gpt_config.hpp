// The GPT model's size and options (app layer, std only): models.hpp builds it with LibTorch, the memory
// planner (app/plan/) describes it in closed form.
#pragma once

#include <cstdint>

namespace fsdp::app {

struct GptConfig {
  std::int64_t vocab_size = 256, context = 64, d_model = 128, n_heads = 4, n_layers = 4, mlp_ratio = 4;
  double dropout = 0.1;
  bool tie_embeddings = true;
  bool deferred = false;  ///< fsdp.deferred_init: layers released as built, initialized by init_module()
};

}  // namespace fsdp::app
