// model.hf_config: a Hugging Face config.json read as [model] keys (app layer, std + nlohmann-json).
// The deck applies the values (source "hf_config"); a deck key that contradicts one is an error
// naming both. What this reader does not know how to build exactly is refused, never approximated.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "deck.hpp"

namespace fsdp::app {

/// One [model] key a config.json decides.
struct HfConfigValue {
  std::string key;  ///< "model.d_model"
  Value value;
  std::string hf_key;  ///< "hidden_size"
};

/// What a config.json says of the model.
struct HfConfigModel {
  std::string path;          ///< the config.json read
  std::string architecture;  ///< "LlamaForCausalLM"
  std::vector<HfConfigValue> values;
};

/// The config.json that model.hf_config `path` names: the file, or config.json in the folder.
std::string hf_config_file(const std::string& path);

/// Reads model.hf_config `path`. DeckError naming the file and key: unreadable, not JSON, a missing
/// or mistyped key, an architecture or option that is not supported (the supported ones listed).
HfConfigModel read_hf_config(const std::string& path);

/// The architectures read: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, GPT2LMHeadModel.
const std::vector<std::string>& hf_architectures();

}  // namespace fsdp::app
