// Every model kind's family (app layer, std only): the one table from ModelKind to what the app and
// the planner know of it. A new kind adds its enum value and names (choices.hpp), its family file and
// LibTorch model (app/models/), one line here and one in app/models.hpp's torch_model, and its schema
// description (model.kind's, in deck_schema_model.cpp).
#pragma once

#include <string>

#include "models/cnn_family.hpp"
#include "models/gpt_family.hpp"
#include "models/llama_family.hpp"
#include "models/mlp_family.hpp"

namespace fsdp::app {

inline const ModelFamily& model_family(ModelKind kind) {
  static const CnnFamily cnn;
  static const MlpFamily mlp;
  static const GptFamily gpt;
  static const LlamaFamily llama;
  switch (kind) {
    case ModelKind::kCnn: return cnn;
    case ModelKind::kMlp: return mlp;
    case ModelKind::kTransformer: return gpt;
    case ModelKind::kLlama: return llama;
  }
  throw ConfigError("model.kind " + std::to_string(static_cast<int>(kind)) + " has no family");
}

/// The module tree of the deck's model in closed form, and its parameter count by formula.
inline ModelDesc describe_model(const ModelSection& m) { return model_family(m.kind).describe(m); }
inline std::int64_t closed_form_num_params(const ModelSection& m) { return model_family(m.kind).num_params(m); }

/// The model kinds of language models (or of the others), as a message lists them: "\"cnn\" or \"mlp\"".
inline std::string model_kinds_named(bool language_models) {
  std::string out, last;
  for (const auto& [kind, name] : ChoiceNames<ModelKind>::kNames) {
    if (model_family(kind).language_model() != language_models) continue;
    if (!last.empty()) out += (out.empty() ? "" : ", ") + last;
    last = "\"" + std::string(name) + "\"";
  }
  return out.empty() ? last : out + " or " + last;
}

}  // namespace fsdp::app
