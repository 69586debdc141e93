// Exports as Hugging Face folders (app layer, std + nlohmann-json): where the weights go, the Hugging
// Face form of the model (its family's names and config.json), and config.json written beside the
// weights without ever replacing another model's. fsdp-ckpt export and fsdp-train's checkpoint.export
// both decide through here.
#pragma once

#include <nlohmann/json.hpp>

#include <cctype>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "choices.hpp"
#include "fsdp/errors.hpp"
#include "fsdp/output_file.hpp"
#include "hf_config.hpp"
#include "models/families.hpp"
#include "run_config.hpp"

namespace fsdp::app {

/// The torch_dtype of config.json for an export dtype (fp32 training: as trained is fp32).
inline std::string hf_torch_dtype(ExportDtype export_dtype) {
  switch (export_dtype) {
    case ExportDtype::kBf16: return "bfloat16";
    case ExportDtype::kFp16: return "float16";
    case ExportDtype::kFp32:
    case ExportDtype::kAsTrained: break;
  }
  return "float32";
}

/// Where an export goes: `path` itself when it names a .safetensors file, else model.safetensors in
/// the folder `path`. config.json goes beside it.
inline std::filesystem::path export_file(const std::string& path) {
  const std::filesystem::path p(path);
  if (p.extension() == ".safetensors") return p;
  return p / "model.safetensors";
}

/// The folder an export's config.json goes to: the weights' own (a bare file name: the current one).
inline std::filesystem::path config_folder(const std::filesystem::path& weights) {
  const auto folder = weights.parent_path();
  return folder.empty() ? std::filesystem::path(".") : folder;
}

/// save_pretrained's max_shard_size spelling: "5GB", "500MB", "2GiB", "800KB", a number of bytes; a
/// decimal prefix (KB, MB, GB, TB) counts in powers of 1000, a binary one (KiB ... TiB) in 1024. "0":
/// never split. Nothing for what is not a size.
inline std::optional<std::int64_t> parse_byte_size(const std::string& text) {
  static const std::regex size(R"(\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*)", std::regex::icase);
  std::smatch m;
  if (!std::regex_match(text, m, size)) return std::nullopt;
  const double number = std::stod(m[1].str());
  std::string unit = m[2].str();
  for (auto& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  static const std::map<std::string, double> scale = {
      {"", 1},      {"B", 1},        {"KB", 1e3},        {"MB", 1e6},           {"GB", 1e9},
      {"TB", 1e12}, {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  const double bytes = number * scale.at(unit);
  // Past int64, or a fraction of a byte that would read as "0" (never split).
  if (bytes >= 9.2e18 || (bytes > 0 && bytes < 1)) return std::nullopt;
  return static_cast<std::int64_t>(bytes);
}

/// The Hugging Face form an export with `names` writes: none for native names; hf-gpt2 only for a
/// GPT; hf for the model's own family. ConfigError where the model has none (the message is the
/// reason alone: the caller names what asked).
inline std::optional<HfForm> hf_export_form(const ModelSection& model, ExportNames names) {
  if (names == ExportNames::kNative) return std::nullopt;
  if (names == ExportNames::kHfGpt2 && model.kind != ModelKind::kTransformer)
    throw ConfigError("hf-gpt2 names a GPT-2; model.kind is \"" + to_string(model.kind) + "\" (hf: its own family's names)", "fsdp.names");
  auto form = model_family(model.kind).hf_form(model);
  if (!form)
    throw ConfigError("model.kind \"" + to_string(model.kind) + "\" has no Hugging Face architecture; export with native names", "fsdp.names");
  return form;
}

/// How the config.json beside pretrained weights (checkpoint.init_from) describes another model than
/// the deck builds: a deck written by hand, without model.hf_config, whose rope_theta, norm epsilon or
/// head tying differ would otherwise train and export another model without a word. Each line names
/// the Hugging Face key, the file's value and the deck's, as both would be exported.
struct PretrainedConfigDifferences {
  std::string file;                   ///< the config.json compared
  std::vector<std::string> model;     ///< keys that change what the model computes
  std::vector<std::string> metadata;  ///< keys only an export and generation read (positions, bos, eos)
};

/// Compares the config.json beside `weights` (a .safetensors file, its index or their folder) with the
/// deck's model. Nothing where there is no config.json. A config.json this program cannot build
/// exactly is the DeckError read_hf_config gives, naming the file and key.
inline std::optional<PretrainedConfigDifferences> pretrained_config_differences(const Deck& deck, const std::filesystem::path& weights) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path file = (fs::is_directory(weights, ec) ? weights : config_folder(weights)) / "config.json";
  if (!fs::exists(file, ec)) return std::nullopt;
  const HfConfigModel config = read_hf_config(file.string());
  Deck described = deck;  // the deck with every value the file decides taken from the file
  for (const auto& v : config.values) described.set(v.key, v.value, Source::kHfConfig);
  const ModelSection ours = resolve_model_section(deck), theirs = resolve_model_section(described);
  PretrainedConfigDifferences out{file.string(), {}, {}};
  if (ours.kind != theirs.kind) {
    out.model.push_back("architectures: " + config.architecture + " in the file; model.kind \"" + to_string(ours.kind) + "\" in the deck");
    return out;
  }
  const auto form = model_family(ours.kind).hf_form(ours);
  if (!form) return out;
  const auto mine = form->config, file_s = model_family(theirs.kind).hf_form(theirs)->config;
  static const std::set<std::string> kMetadata = {"max_position_embeddings", "bos_token_id", "eos_token_id"};
  auto deck_key = [&](const std::string& hf) {
    for (const auto& v : config.values)
      if (v.hf_key == hf || v.hf_key.rfind(hf + ".", 0) == 0) return " (" + v.key + ")";
    return std::string();
  };
  std::set<std::string> keys;
  for (auto it = mine.begin(); it != mine.end(); ++it) keys.insert(it.key());
  for (auto it = file_s.begin(); it != file_s.end(); ++it) keys.insert(it.key());
  for (const auto& k : keys) {
    const std::string a = mine.contains(k) ? mine.at(k).dump() : "none", b = file_s.contains(k) ? file_s.at(k).dump() : "none";
    if (a != b) (kMetadata.count(k) ? out.metadata : out.model).push_back(k + deck_key(k) + ": " + b + " in the file, " + a + " by the deck");
  }
  return out;
}

/// config.json's text for an export in `export_dtype`.
inline std::string hf_config_text(nlohmann::ordered_json config, ExportDtype export_dtype) {
  config["torch_dtype"] = hf_torch_dtype(export_dtype);
  return config.dump(2) + "\n";
}

/// Refuses, before anything is written, to replace a config.json beside `weights` that describes
/// another model (a downloaded model's, another run's export): it belongs to other weights. This
/// model's own config (a re-export, also in another dtype: torch_dtype aside, keys in any order) is
/// replaced. (fsdp-train's rerun of a finished run replaces its own export's without asking here.) `how` says what to do instead. ConfigError.
inline void check_config_json_replaceable(const std::filesystem::path& weights, const nlohmann::ordered_json& config, const std::string& how) {
  const auto path = config_folder(weights) / "config.json";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return;
  std::ifstream in(path, std::ios::binary);
  auto old = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  auto ours = nlohmann::json::parse(config.dump());
  const bool comparable = old.is_object();
  if (comparable) {
    old.erase("torch_dtype");
    ours.erase("torch_dtype");
  }
  if (!comparable || old != ours)
    throw fsdp::ConfigError("'" + path.string() + "' exists and describes another model than this export's (a downloaded model's or another " +
                            "export's config): not replaced, nothing written; " + how);
}

/// Writes config.json beside `weights` (atomically; OutputError on failure).
inline void write_hf_config(const std::filesystem::path& weights, const nlohmann::ordered_json& config, ExportDtype export_dtype) {
  const std::filesystem::path dir = config_folder(weights);
  std::filesystem::create_directories(dir);
  fsdp::write_file_atomically(dir / "config.json", hf_config_text(config, export_dtype));
}

}  // namespace fsdp::app
