// The models fsdp-train builds from a deck (app layer, LibTorch): the one table from ModelKind to each
// kind's LibTorch model (app/models/<kind>.hpp). What the planner knows of each is its family
// (app/models/families.hpp).
#pragma once

#include <fsdp/fsdp.hpp>
#include <torch/torch.h>

#include <memory>

#include "models/app_model.hpp"
#include "models/cnn.hpp"
#include "models/gpt.hpp"
#include "models/llama.hpp"
#include "models/mlp.hpp"
#include "run_config.hpp"

namespace fsdp::app {

/// A model kind's LibTorch side: building it from the deck's [model] (each layer released as built
/// with `deferred`, fsdp.deferred_init) and initializing one module it holds, as the engine does
/// unit by unit under fsdp.deferred_init.
struct TorchModel {
  std::shared_ptr<AppModel> (*build)(const ModelSection& m, bool deferred);
  void (*init_module)(torch::nn::Module& m);
};

inline TorchModel torch_model(ModelKind kind) {
  switch (kind) {
    case ModelKind::kCnn: return {&TutorialCnnImpl::build, &init_default_module};
    case ModelKind::kMlp: return {&MlpImpl::build, &init_default_module};
    case ModelKind::kTransformer: return {&GptImpl::build, &init_gpt_module};
    case ModelKind::kLlama: return {&LlamaImpl::build, &LlamaImpl::init_llama_module};
  }
  throw ConfigError("model.kind " + std::to_string(static_cast<int>(kind)) + " has no LibTorch model");
}

/// The deck's model (deferred: released as built, initialized by the engine).
inline std::shared_ptr<AppModel> build_model(const ModelSection& m, bool deferred = false) { return torch_model(m.kind).build(m, deferred); }

}  // namespace fsdp::app
