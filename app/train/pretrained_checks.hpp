// What a checkpoint or pretrained weights say of their model, against the deck's (app layer): the
// sizes that differ when a load does not fit, a Hugging Face folder without safetensors weights, and a
// config.json beside the weights that describes another model. Local: the Checkpointer agrees on them.
#pragma once

#include <fsdp/io/checkpoint_tools.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "deck.hpp"
#include "hf_export.hpp"
#include "run_config.hpp"

namespace fsdp::app {

/// The [model] sizes in which `file` differs from `deck`: a checkpoint's stored deck, or the
/// config.json beside a safetensors file (Hugging Face GPT-2's names). Empty when neither tells:
/// the list of tensors is the error then.
inline std::vector<std::string> model_size_differences(const Deck& deck, const std::filesystem::path& file) {
  namespace fs = std::filesystem;
  std::vector<std::string> out;
  try {
    if (file.extension() == ".h5" || fs::exists(file / fsdp::ckpt::local_rank_file(0))) {
      const fs::path h5 = fs::is_directory(file) ? file / fsdp::ckpt::local_rank_file(0) : file;  // LOCAL: every rank file stores the deck
      std::string text;
      for (const auto& [name, value] : fsdp::ckpt::inspect_file(h5.string()).attributes)
        if (name == "deck") text = value;
      if (text.empty()) return out;
      const Deck stored = Deck::parse(text, h5.string() + " (its stored deck)");
      // The keys that decide the tensors' shapes: the others (hf_config, kept as a comment; rotary
      // settings; the tokens an export keeps) never explain a mismatch.
      static const std::set<std::string> shapes = {"model.kind",           "model.vocab_size",    "model.vocab_pad_multiple", "model.context",
                                                   "model.d_model",        "model.n_heads",       "model.n_kv_heads",         "model.head_dim",
                                                   "model.n_layers",       "model.mlp_ratio",     "model.intermediate_size",  "model.hidden_sizes",
                                                   "model.tie_embeddings", "model.attention_bias"};
      for (const auto& spec : deck_schema()) {
        if (!shapes.count(spec.key)) continue;
        const std::string a = format_value(stored.entry(spec.key).value), b = format_value(deck.entry(spec.key).value);
        if (a != b) out.push_back(spec.key + ": " + a + " in the file, " + b + " in the deck");
      }
      return out;
    }
    std::ifstream in((fs::is_directory(file) ? file : file.parent_path()) / "config.json");
    if (!in) return out;
    const auto config = nlohmann::json::parse(in);
    const std::pair<const char*, const char*> sizes[] = {{"n_embd", "model.d_model"},
                                                         {"n_layer", "model.n_layers"},
                                                         {"n_head", "model.n_heads"},
                                                         {"n_positions", "model.context"},
                                                         {"vocab_size", "model.vocab_size"}};
    for (const auto& [name, key] : sizes) {
      if (!config.contains(name) || !config[name].is_number_integer()) continue;
      const std::int64_t theirs = config[name].template get<std::int64_t>(), ours = deck.get_int(key);
      if (theirs != ours)
        out.push_back(std::string(key) + ": " + std::to_string(theirs) + " in the file's config.json (" + name + "), " + std::to_string(ours) +
                      " in the deck");
    }
  } catch (const std::exception&) {
    // The sizes only help; the tensors the library named are the error.
  }
  return out;
}

/// A Hugging Face folder (config.json) without safetensors weights is not a checkpoint folder: a
/// DeckError says so, naming the weights it holds (pytorch_model.bin, ...), which fsdp does not read.
inline void refuse_a_model_folder_without_safetensors(const std::filesystem::path& folder) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(folder, ec) || !fs::exists(folder / "config.json", ec) || fs::exists(folder / fsdp::ckpt::kLatestName, ec) ||
      !fsdp::ckpt::list_checkpoints(folder).empty())
    return;
  std::string weights;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    const auto ext = entry.path().extension().string();
    if (ext == ".bin" || ext == ".pt" || ext == ".pth" || ext == ".gguf" || ext == ".ckpt")
      weights += (weights.empty() ? "" : ", ") + entry.path().filename().string();
  }
  throw DeckError("checkpoint.init_from: '" + folder.string() + "' is a Hugging Face model folder without model.safetensors or " +
                  "model.safetensors.index.json" + (weights.empty() ? std::string() : " (it holds " + weights + ", which fsdp does not read)") +
                  ": fsdp reads safetensors weights; save them as such (save_pretrained(..., safe_serialization=True))");
}

/// Pretrained weights whose config.json describes another model than the deck's (a deck written by
/// hand: another rope_theta, norm epsilon, tying of the head, ...) would load, since the shapes agree,
/// and train and export another model: refused (DeckError) naming each key with both values. A tied
/// GPT would also pass over an untied export's trained lm_head.weight. With checkpoint.init_allow_missing
/// (a model grown from a smaller one's weights) the differences are a warning (`root` prints it).
/// Returns the comparison (its metadata: what only an export and generation read, for a warning);
/// nothing without a config.json.
inline std::optional<PretrainedConfigDifferences> refuse_another_model_in_config_json(const Deck& deck, const RunConfig& cfg, bool root,
                                                                                      const std::filesystem::path& source) {
  auto differences = pretrained_config_differences(deck, source);
  if (!differences || differences->model.empty()) return differences;
  std::string list;
  for (const auto& d : differences->model) list += "\n  " + d;
  const auto folder = std::filesystem::path(differences->file).parent_path().string();
  // checkpoint.init_allow_missing grows a model from a smaller one's weights: its sizes differ by
  // choice. Never a tied model over an untied head: the file's trained lm_head.weight would be passed over.
  const bool untied_into_tied = std::any_of(differences->model.begin(), differences->model.end(),
                                            [](const std::string& d) { return d.rfind("tie_word_embeddings", 0) == 0; }) &&
                                cfg.model.tie_embeddings;
  if (cfg.checkpoint.init_allow_missing && !untied_into_tied) {
    if (root)
      std::printf("warning: %s describes another model than the deck's (checkpoint.init_allow_missing = true):%s\n", differences->file.c_str(),
                  list.c_str());
    return differences;
  }
  throw DeckError("checkpoint.init_from: " + differences->file + " describes another model than the deck's:" + list + "\nmodel.hf_config = '" +
                  folder + "' builds the model it describes");
}

}  // namespace fsdp::app
