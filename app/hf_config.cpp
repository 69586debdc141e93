// model.hf_config: see hf_config.hpp.
#include "hf_config.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

namespace fsdp::app {

namespace {

using Json = nlohmann::json;

/// Reads one config.json, collecting every problem before throwing them together.
class Reader {
 public:
  Reader(const Json& j, std::string path) : j_(j), path_(std::move(path)) {}

  bool has(const char* key) const { return j_.contains(key) && !j_.at(key).is_null(); }
  const Json& raw(const char* key) const { return j_.at(key); }
  /// Written in the file, null included (null and absent mean different defaults to transformers).
  bool written(const char* key) const { return j_.contains(key); }

  /// An integer key (required unless `fallback` is given).
  std::int64_t integer(const char* key, std::optional<std::int64_t> fallback = std::nullopt) {
    if (!has(key)) {
      if (!fallback) problem(key, "missing");
      return fallback.value_or(0);
    }
    const Json& v = j_.at(key);
    if (!v.is_number_integer() || v.get<std::int64_t>() < 1) {
      problem(key, v.dump() + " is not a whole number >= 1");
      return fallback.value_or(0);
    }
    return v.get<std::int64_t>();
  }
  double number(const char* key, double fallback) {
    if (!has(key)) return fallback;
    const Json& v = j_.at(key);
    if (!v.is_number() || !std::isfinite(v.get<double>())) {
      problem(key, v.dump() + " is not a number");
      return fallback;
    }
    return v.get<double>();
  }
  bool boolean(const char* key, bool fallback) {
    if (!has(key)) return fallback;
    const Json& v = j_.at(key);
    if (!v.is_boolean()) {
      problem(key, v.dump() + " is not true or false");
      return fallback;
    }
    return v.get<bool>();
  }
  std::string text(const char* key, const std::string& fallback) {
    if (!has(key)) return fallback;
    const Json& v = j_.at(key);
    if (!v.is_string()) {
      problem(key, v.dump() + " is not a string");
      return fallback;
    }
    return v.get<std::string>();
  }

  void set(const char* model_key, Value v, const std::string& hf_key) { out_.values.push_back({model_key, std::move(v), hf_key}); }
  void problem(const std::string& key, const std::string& what) { problems_.push_back(path_ + ": " + key + ": " + what); }
  /// A setting this program does not build: named, with what is supported.
  void unsupported(const std::string& key, const std::string& what) { problem(key, what + " is not supported (" + supported_ + ")"); }
  void supported(std::string what) { supported_ = std::move(what); }

  /// The object under `key` (a problem if it is not one), read with this reader's file name.
  Reader nested(const char* key) {
    static const Json empty = Json::object();
    const Json& v = j_.at(key);
    if (!v.is_object()) problem(key, v.dump() + " is not an object");
    return Reader(v.is_object() ? v : empty, path_ + ": " + key);
  }
  /// The object under `key`, or an empty one where `key` is absent or null.
  Reader nested_or_empty(const char* key) {
    static const Json empty = Json::object();
    return has(key) ? nested(key) : Reader(empty, path_ + ": " + key);
  }
  /// A nested reader's problems become this one's.
  void absorb(const Reader& other) { problems_.insert(problems_.end(), other.problems_.begin(), other.problems_.end()); }

  HfConfigModel& model() { return out_; }
  const std::vector<std::string>& problems() const { return problems_; }

 private:
  const Json& j_;
  std::string path_, supported_;
  HfConfigModel out_;
  std::vector<std::string> problems_;
};

std::string prefix_of(const std::string& object, const std::string& key) { return object + "." + key; }

/// LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM: model.kind = "llama".
void read_llama_family(Reader& r, const std::string& architecture) {
  const bool qwen2 = architecture == "Qwen2ForCausalLM", mistral = architecture == "MistralForCausalLM";
  r.supported("model.kind = \"llama\" builds RMSNorm, rotary positions, grouped-query attention and a SwiGLU MLP without other biases");
  r.set("model.kind", std::string("llama"), "architectures");
  r.set("model.vocab_size", r.integer("vocab_size"), "vocab_size");
  const auto d = r.integer("hidden_size"), heads = r.integer("num_attention_heads");
  r.set("model.d_model", d, "hidden_size");
  r.set("model.n_layers", r.integer("num_hidden_layers"), "num_hidden_layers");
  r.set("model.n_heads", heads, "num_attention_heads");
  // Absent, LlamaConfig takes the query heads; Qwen2Config and MistralConfig take fixed numbers of
  // their largest models (32, 8), which a smaller model's file always states: required there.
  r.set("model.n_kv_heads", qwen2 || mistral ? r.integer("num_key_value_heads") : r.integer("num_key_value_heads", heads), "num_key_value_heads");
  // Set even where the file leaves it to hidden_size / num_attention_heads, so that a deck's other
  // value is a contradiction rather than a silently different model.
  if (r.has("head_dim"))
    r.set("model.head_dim", r.integer("head_dim"), "head_dim");
  else if (heads > 0 && d % heads != 0)
    r.problem("num_attention_heads", std::to_string(heads) + " does not divide hidden_size " + std::to_string(d) + " and head_dim is missing");
  else if (heads > 0)
    r.set("model.head_dim", d / heads, "hidden_size / num_attention_heads");
  r.set("model.intermediate_size", r.integer("intermediate_size"), "intermediate_size");
  r.set("model.norm_eps", r.number("rms_norm_eps", 1e-6), "rms_norm_eps");
  // transformers 5 writes the rotary settings as rope_parameters {rope_theta, rope_type, ...}; earlier
  // releases as rope_theta and rope_scaling {rope_type (or type), ...}.
  const bool parameters = r.has("rope_parameters");
  Reader rope = parameters ? r.nested("rope_parameters") : r.nested_or_empty("rope_scaling");
  r.set("model.rope_theta", parameters ? rope.number("rope_theta", r.number("rope_theta", 10000.0)) : r.number("rope_theta", 10000.0),
        parameters ? "rope_parameters.rope_theta" : "rope_theta");
  // transformers' LlamaConfig, Qwen2Config and MistralConfig all default to an untied head.
  r.set("model.tie_embeddings", r.boolean("tie_word_embeddings", false), "tie_word_embeddings");
  // Qwen2 always biases q, k and v; Llama's attention_bias biases o_proj too, which we do not build.
  if (qwen2)
    r.set("model.attention_bias", true, "architectures");
  else if (r.boolean("attention_bias", false))
    r.unsupported("attention_bias", "true (biases on q, k, v and o_proj)");
  else
    r.set("model.attention_bias", false, "attention_bias");
  if (r.boolean("mlp_bias", false)) r.unsupported("mlp_bias", "true");
  if (const auto act = r.text("hidden_act", "silu"); act != "silu") r.unsupported("hidden_act", "\"" + act + "\" (silu is)");
  if (r.number("attention_dropout", 0) != 0) r.unsupported("attention_dropout", "a non-zero value");
  if (r.number("partial_rotary_factor", 1) != 1) r.unsupported("partial_rotary_factor", "a value other than 1");
  for (const char* moe : {"num_local_experts", "num_experts", "num_experts_per_tok"})
    if (r.has(moe)) r.unsupported(moe, "a mixture of experts");
  if (r.has("max_position_embeddings")) r.set("model.max_positions", r.integer("max_position_embeddings"), "max_position_embeddings");
  for (const auto& [key, model_key] : {std::pair{"bos_token_id", "model.bos_token_id"}, std::pair{"eos_token_id", "model.eos_token_id"}})
    if (r.has(key) && r.raw(key).is_number_integer() && r.raw(key).get<std::int64_t>() >= 0) r.set(model_key, r.raw(key).get<std::int64_t>(), key);
  // Llama 3.1's instruct models end a turn at any of a list of tokens.
  if (r.has("eos_token_id") && r.raw("eos_token_id").is_array()) {
    const auto& list = r.raw("eos_token_id");
    if (std::all_of(list.begin(), list.end(), [](const auto& id) { return id.is_number_integer() && id.template get<std::int64_t>() >= 0; }))
      r.set("model.eos_token_id", list.get<std::vector<std::int64_t>>(), "eos_token_id");
    else
      r.problem("eos_token_id", list.dump() + " is not a list of token ids");
  }
  // Mistral's window applies whenever it is set, Qwen2's only with use_sliding_window; absent, both
  // configs' default is 4096; null: none.
  if (mistral || (qwen2 && r.boolean("use_sliding_window", false)))
    r.set("model.sliding_window", !r.written("sliding_window") ? 4096 : r.has("sliding_window") ? r.integer("sliding_window") : 0, "sliding_window");
  const char* where = parameters ? "rope_parameters" : "rope_scaling";
  r.supported("rope type \"llama3\" is, and the default");
  const std::string type = rope.text("rope_type", rope.text("type", "default"));
  if (!parameters && !r.has("rope_scaling")) {
    r.set("model.rope_scaling", std::string("none"), "rope_scaling");
  } else if (type == "default") {
    r.set("model.rope_scaling", std::string("none"), parameters ? "rope_parameters.rope_type" : "rope_scaling.rope_type");
  } else if (type != "llama3") {
    r.unsupported(where, "type \"" + type + "\"");
  } else {
    // Every key of the type is required, as transformers requires it.
    auto required = [&](const char* key) {
      if (!rope.has(key)) rope.problem(key, "missing (rope type llama3 needs factor, low_freq_factor, high_freq_factor)");
      return rope.number(key, 1);
    };
    const std::string prefix = std::string(where) + ".";
    r.set("model.rope_scaling", std::string("llama3"), (prefix + "rope_type").c_str());
    r.set("model.rope_scaling_factor", required("factor"), (prefix + "factor").c_str());
    r.set("model.rope_low_freq_factor", required("low_freq_factor"), (prefix + "low_freq_factor").c_str());
    r.set("model.rope_high_freq_factor", required("high_freq_factor"), (prefix + "high_freq_factor").c_str());
    r.set("model.rope_original_context", rope.integer("original_max_position_embeddings"), (prefix + "original_max_position_embeddings").c_str());
  }
  if (parameters && rope.number("partial_rotary_factor", 1) != 1) r.unsupported(prefix_of(where, "partial_rotary_factor"), "a value other than 1");
  r.absorb(rope);
}

/// GPT2LMHeadModel: model.kind = "transformer".
void read_gpt2(Reader& r) {
  r.supported("model.kind = \"transformer\" builds GPT-2's blocks");
  r.set("model.kind", std::string("transformer"), "architectures");
  r.set("model.vocab_size", r.integer("vocab_size"), "vocab_size");
  // The learned positions have exactly n_positions rows: the context is the file's.
  r.set("model.context", r.integer("n_positions", r.integer("n_ctx", 1024)), "n_positions");
  const auto d = r.integer("n_embd");
  r.set("model.d_model", d, "n_embd");
  r.set("model.n_layers", r.integer("n_layer"), "n_layer");
  r.set("model.n_heads", r.integer("n_head"), "n_head");
  const auto inner = r.integer("n_inner", 4 * d);
  if (d > 0 && inner % d != 0)
    r.unsupported("n_inner", std::to_string(inner) + ", not a multiple of n_embd " + std::to_string(d) + " (model.mlp_ratio is a whole number)");
  else if (d > 0)
    r.set("model.mlp_ratio", inner / d, "n_inner");
  const auto act = r.text("activation_function", "gelu_new");
  if (act == "gelu_new" || act == "gelu_pytorch_tanh")
    r.set("model.activation", std::string("gelu_tanh"), "activation_function");
  else if (act == "gelu")
    r.set("model.activation", std::string("gelu"), "activation_function");
  else
    r.unsupported("activation_function", "\"" + act + "\" (gelu_new, gelu_pytorch_tanh and gelu are)");
  r.set("model.tie_embeddings", r.boolean("tie_word_embeddings", true), "tie_word_embeddings");
  if (r.number("layer_norm_epsilon", 1e-5) != 1e-5) r.unsupported("layer_norm_epsilon", "a value other than 1e-5");
  if (!r.boolean("scale_attn_weights", true)) r.unsupported("scale_attn_weights", "false");
  if (r.boolean("scale_attn_by_inverse_layer_idx", false)) r.unsupported("scale_attn_by_inverse_layer_idx", "true");
}

}  // namespace

const std::vector<std::string>& hf_architectures() {
  static const std::vector<std::string> names = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "GPT2LMHeadModel"};
  return names;
}

std::string hf_config_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return (std::filesystem::path(path) / "config.json").string();
  return path;
}

HfConfigModel read_hf_config(const std::string& path) {
  const std::string file = hf_config_file(path);
  std::ifstream in(file, std::ios::binary);
  if (!in) throw DeckError(file + ": cannot read the Hugging Face config (model.hf_config): " + std::strerror(errno));
  const Json j = Json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) throw DeckError(file + ": not a JSON object: not a Hugging Face config.json (model.hf_config)");
  Reader r(j, file);
  std::string architecture;
  if (j.contains("architectures") && j.at("architectures").is_array() && j.at("architectures").size() == 1 && j.at("architectures")[0].is_string())
    architecture = j.at("architectures")[0].get<std::string>();
  std::string supported;
  for (const auto& a : hf_architectures()) supported += (supported.empty() ? "" : ", ") + a;
  if (architecture.empty())
    r.problem("architectures", "missing or not one name (" + supported + " are read)");
  else if (architecture == "GPT2LMHeadModel")
    read_gpt2(r);
  else if (architecture == "LlamaForCausalLM" || architecture == "Qwen2ForCausalLM" || architecture == "MistralForCausalLM")
    read_llama_family(r, architecture);
  else
    r.problem("architectures", "\"" + architecture + "\" is not supported (" + supported + " are)");
  if (!r.problems().empty()) throw DeckError(r.problems());
  HfConfigModel out = std::move(r.model());
  out.path = file;
  out.architecture = architecture;
  return out;
}

void Deck::apply_hf_config(std::vector<std::string>& problems) {
  // A config applied before (an earlier parse, another --set of model.hf_config) is undone first.
  for (auto& e : entries_)
    if (e.source == Source::kHfConfig) e = Entry{e.spec, e.spec->default_value, Source::kDefault, 0, ""};
  const Entry& named = entry("model.hf_config");
  const std::string& path = std::get<std::string>(named.value);
  if (path.empty()) return;
  const std::string origin = (named.where.empty() ? path_ : named.where) + ": model.hf_config";
  HfConfigModel config;
  try {
    config = read_hf_config(path);
  } catch (const DeckError& e) {
    for (const auto& p : e.problems()) problems.push_back(origin + ": " + p);
    return;
  }
  Deck probe;  // each value checked and normalized as the deck's own would be
  for (const auto& v : config.values) {
    const std::string from = config.path + ": " + v.hf_key;
    try {
      probe.set(v.key, v.value, Source::kHfConfig);
    } catch (const DeckError& e) {
      for (const auto& p : e.problems()) problems.push_back(from + ": " + p);
      continue;
    }
    const Value& value = probe.entry(v.key).value;
    Entry& e = mutable_entry(v.key);
    if (e.source != Source::kDefault) {
      if (format_value(e.value) != format_value(value))
        problems.push_back(e.where + ": " + v.key + ": " + format_value(e.value) + " contradicts " + v.hf_key + " = " + format_value(value) + " in " +
                           config.path + " (" + origin + "); leave " + v.key + " out of the deck");
      continue;
    }
    e = Entry{e.spec, value, Source::kHfConfig, 0, from};
  }
}

}  // namespace fsdp::app
