// Input decks of fsdp-train (app layer): TOML parsing and validation against the schema
// (deck_schema.cpp), --set overrides, the checks between keys, the echo table and the resolved deck as TOML.
#include "deck.hpp"

#include "fsdp/core/strategy.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

#include "deck_detail.hpp"
#include "deck_toml.hpp"
#include "models/families.hpp"

namespace fsdp::app {

using namespace detail;

std::string DeckError::join(const std::vector<std::string>& problems) {
  if (problems.size() == 1) return problems.front();
  std::string out = std::to_string(problems.size()) + " problems:";
  for (const auto& p : problems) out += "\n" + p;
  return out;
}

namespace detail {

std::string describe(const toml::node& n) {
  if (auto* s = n.as_string()) return "a string (" + toml_string(s->get()) + ")";
  if (auto* i = n.as_integer()) return "an integer (" + std::to_string(i->get()) + ")";
  if (auto* f = n.as_floating_point()) return "a float (" + toml_float(f->get()) + ")";
  if (auto* b = n.as_boolean()) return std::string("a boolean (") + (b->get() ? "true" : "false") + ")";
  if (n.is_array_of_tables()) return "an array of tables";
  if (n.is_array()) return "an array";
  if (n.is_table()) return "a table";
  if (n.is_date()) return "a date";
  if (n.is_time()) return "a time";
  if (n.is_date_time()) return "a date-time";
  return "an unknown value";
}

// ---- values: conversion and checks -----------------------------------------------------------

void check_value(const KeySpec& spec, Value& v, std::vector<Issue>& issues, int line) {
  auto range = [&](double x, const std::string& label) {
    if (!std::isfinite(x)) {
      issues.push_back({label + ": " + format_number(x) + " is not a finite number", line});
      return;
    }
    if (spec.min) {
      if (spec.min_exclusive && !(x > *spec.min))
        issues.push_back({label + ": " + format_number(x) + " must be greater than " + format_number(*spec.min), line});
      else if (!spec.min_exclusive && x < *spec.min)
        issues.push_back({label + ": " + format_number(x) + " is below the minimum " + format_number(*spec.min), line});
    }
    if (spec.max) {
      if (spec.max_exclusive && !(x < *spec.max))
        issues.push_back({label + ": " + format_number(x) + " must be less than " + format_number(*spec.max), line});
      else if (!spec.max_exclusive && x > *spec.max)
        issues.push_back({label + ": " + format_number(x) + " is above the maximum " + format_number(*spec.max), line});
    }
  };
  auto size = [&](std::size_t n) {
    if (spec.array_size != 0 && n != spec.array_size)
      issues.push_back({spec.key + ": expected " + std::to_string(spec.array_size) + " elements, got " + std::to_string(n), line});
  };
  if (auto* i = std::get_if<std::int64_t>(&v)) {
    range(static_cast<double>(*i), spec.key);
  } else if (auto* d = std::get_if<double>(&v)) {
    range(*d, spec.key);
  } else if (auto* ia = std::get_if<Ints>(&v)) {
    size(ia->size());
    for (std::size_t k = 0; k < ia->size(); ++k) range(static_cast<double>((*ia)[k]), spec.key + "[" + std::to_string(k) + "]");
  } else if (auto* fa = std::get_if<Floats>(&v)) {
    size(fa->size());
    for (std::size_t k = 0; k < fa->size(); ++k) range((*fa)[k], spec.key + "[" + std::to_string(k) + "]");
  } else if (auto* tables = std::get_if<Tables>(&v)) {
    check_tables(spec, *tables, issues, line);
  } else if (auto* s = std::get_if<std::string>(&v)) {
    const bool count =
        spec.count_choice && !s->empty() && s->size() < 10 && std::all_of(s->begin(), s->end(), [](char c) { return c >= '0' && c <= '9'; });
    if (count && std::stoll(*s) < 2) issues.push_back({spec.key + ": " + *s + " is below the minimum group size 2", line});
    if (!spec.choices.empty() && !count) {
      const auto it = std::find_if(spec.choices.begin(), spec.choices.end(), [&](const std::string& c) { return lower(c) == lower(*s); });
      if (it == spec.choices.end()) {
        std::string msg =
            spec.key + ": " + toml_string(*s) + " is not one of " + join(spec.choices, ", ") + (spec.count_choice ? " or a group size" : "");
        if (auto near = closest_of(*s, spec.choices); !near.empty()) msg += " (did you mean " + near + "?)";
        issues.push_back({msg, line});
      } else {
        *s = *it;
      }
    }
  }
}

}  // namespace detail

namespace {

/// A TOML node as a value of `spec` (type conversion only), or nullopt with issues.
std::optional<Value> from_node(const KeySpec& spec, const toml::node& n, std::vector<Issue>& issues) {
  auto wrong = [&](const std::string& label, const toml::node& got, const char* want) {
    issues.push_back({label + ": expected " + want + ", got " + describe(got), line_of(got)});
    return std::nullopt;
  };
  switch (spec.type) {
    case KeyType::kInt:
      if (auto* i = n.as_integer()) return Value{i->get()};
      return wrong(spec.key, n, expected(spec.type));
    case KeyType::kFloat:
      if (auto* f = n.as_floating_point()) return Value{f->get()};
      if (auto* i = n.as_integer()) return Value{static_cast<double>(i->get())};
      return wrong(spec.key, n, expected(spec.type));
    case KeyType::kBool:
      if (auto* b = n.as_boolean()) return Value{b->get()};
      return wrong(spec.key, n, expected(spec.type));
    case KeyType::kString: {
      if (auto* s = n.as_string()) return Value{s->get()};
      if (const auto* a = n.as_array(); a && spec.names_list) {  // stored as the comma-separated text it stands for
        std::vector<std::string> names;
        bool ok = true;
        for (std::size_t k = 0; k < a->size(); ++k) {
          const toml::node& e = *a->get(k);
          if (auto* name = e.as_string())
            names.push_back(name->get());
          else
            ok = false, wrong(spec.key + "[" + std::to_string(k) + "]", e, "a string");
        }
        if (!ok) return std::nullopt;
        return Value{join(names, ", ")};
      }
      const bool bool_choices = std::find(spec.choices.begin(), spec.choices.end(), "true") != spec.choices.end();
      if (auto* b = n.as_boolean(); b && bool_choices) return Value{std::string(b->get() ? "true" : "false")};
      if (auto* i = n.as_integer(); i && spec.count_choice) return Value{std::to_string(i->get())};
      return wrong(spec.key, n, expected(spec.type));
    }
    case KeyType::kIntArray:
    case KeyType::kFloatArray: {
      const auto* a = n.as_array();
      if (auto* i = n.as_integer(); i && spec.scalar_as_array) return Value{Ints{i->get()}};
      if (!a) return wrong(spec.key, n, expected(spec.type));
      Ints ints;
      Floats floats;
      bool ok = true;
      for (std::size_t k = 0; k < a->size(); ++k) {
        const toml::node& e = *a->get(k);
        const std::string label = spec.key + "[" + std::to_string(k) + "]";
        if (spec.type == KeyType::kIntArray) {
          if (auto* i = e.as_integer())
            ints.push_back(i->get());
          else
            ok = false, wrong(label, e, "an integer");
        } else {
          if (auto* f = e.as_floating_point())
            floats.push_back(f->get());
          else if (auto* i = e.as_integer())
            floats.push_back(static_cast<double>(i->get()));
          else
            ok = false, wrong(label, e, "a number");
        }
      }
      if (!ok) return std::nullopt;
      return spec.type == KeyType::kIntArray ? Value{std::move(ints)} : Value{std::move(floats)};
    }
    case KeyType::kTables: return tables_from_node(spec, n, issues);
  }
  return std::nullopt;
}

/// A programmatic value as a value of `spec` (the conversions a deck allows), or a message.
std::optional<std::string> coerce(const KeySpec& spec, Value& v) {
  if (std::holds_alternative<std::monostate>(v)) {
    if (std::holds_alternative<std::monostate>(spec.default_value)) return std::nullopt;
    return spec.key + ": cannot be unset";
  }
  switch (spec.type) {
    case KeyType::kInt:
      if (std::holds_alternative<I>(v)) return std::nullopt;
      break;
    case KeyType::kFloat:
      if (auto* i = std::get_if<I>(&v)) v = static_cast<double>(*i);
      if (std::holds_alternative<double>(v)) return std::nullopt;
      break;
    case KeyType::kBool:
      if (std::holds_alternative<bool>(v)) return std::nullopt;
      break;
    case KeyType::kString:
      if (auto* b = std::get_if<bool>(&v); b && std::find(spec.choices.begin(), spec.choices.end(), "true") != spec.choices.end())
        v = std::string(*b ? "true" : "false");
      if (std::holds_alternative<std::string>(v)) return std::nullopt;
      break;
    case KeyType::kIntArray:
      if (auto* i = std::get_if<I>(&v); i && spec.scalar_as_array) v = Ints{*i};
      if (std::holds_alternative<Ints>(v)) return std::nullopt;
      break;
    case KeyType::kFloatArray:
      if (auto* ia = std::get_if<Ints>(&v)) v = Floats(ia->begin(), ia->end());
      if (std::holds_alternative<Floats>(v)) return std::nullopt;
      break;
    case KeyType::kTables:
      if (std::holds_alternative<Tables>(v)) return std::nullopt;
      break;
  }
  static const char* const kHeld[] = {"unset",    "an integer",       "a float",       "a boolean",
                                      "a string", "an integer array", "a float array", "an array of tables"};
  return spec.key + ": expected " + expected(spec.type) + ", got " + kHeld[v.index()] + " (" + format_value(v) + ")";
}

std::string unknown_key_message(const std::string& key) {
  const auto dot = key.find('.');
  std::string msg = dot == std::string::npos ? "unknown key outside any section" : "unknown key";
  if (auto near = did_you_mean(key); !near.empty()) return msg + " (did you mean " + near + "?)";
  if (dot != std::string::npos) {
    const std::string section = key.substr(0, dot);
    std::vector<std::string> names;
    for (const auto& s : deck_schema())
      if (s.section() == section) names.push_back(s.name());
    if (!names.empty()) return msg + " (the keys of [" + section + "] are " + join(names, ", ") + ")";
    return msg + " (the sections are " + join(deck_sections(), ", ") + ")";
  }
  return msg + " (keys belong in a section: " + join(deck_sections(), ", ") + ")";
}

/// Whether `raw` holds a run of 19 digits or more (underscores allowed): called once TOML refused the
/// value, that is a number too large for a 64-bit integer, which --set would otherwise call a string.
bool has_overlong_integer(const std::string& raw) {
  std::size_t run = 0;
  for (char c : raw) {
    run = std::isdigit(static_cast<unsigned char>(c)) ? run + 1 : (c == '_' ? run : 0);
    if (run >= 19) return true;
  }
  return false;
}

/// Parses one "section.key=value" override into (spec, value); issues are "<key>: <message>".
std::optional<std::pair<const KeySpec*, Value>> parse_override(const std::string& text, std::vector<Issue>& issues) {
  const auto eq = text.find('=');
  if (eq == std::string::npos) {
    issues.push_back({trim(text) + ": expected section.key=value"});
    return std::nullopt;
  }
  const std::string key = trim(text.substr(0, eq));
  const std::string raw = trim(text.substr(eq + 1));
  const KeySpec* spec = find_key(key);
  if (!spec) {
    issues.push_back({(key.empty() ? "(empty key)" : key) + ": " + unknown_key_message(key)});
    return std::nullopt;
  }
  std::optional<Value> value;
  const std::string doc = "v = " + raw;
  bool parsed = false;
  try {
    const toml::table t = toml::parse(std::string_view(doc), std::string_view("--set"));
    if (t.size() == 1 && t.contains("v")) {
      const toml::node& n = *t.get("v");
      parsed = true;
      if (spec->type == KeyType::kString && !n.is_string() && !(spec->names_list && n.is_array())) {
        value = Value{raw};  // a string key takes the text as written (run.name=2024, reshard_after_forward=true)
      } else {
        std::vector<Issue> found;
        value = from_node(*spec, n, found);
        for (auto& f : found) issues.push_back({f.text});
        if (!value) return std::nullopt;
      }
    }
  } catch (const toml::parse_error&) {}
  if (!parsed) {
    if ((spec->type == KeyType::kInt || spec->type == KeyType::kIntArray) && has_overlong_integer(raw)) {
      issues.push_back({spec->key + ": " + raw + ": a number too large for a 64-bit integer" +
                        (spec->max ? " (at most " + format_number(*spec->max) + " here)" : std::string())});
      return std::nullopt;
    }
    if (spec->type != KeyType::kString) {
      issues.push_back({spec->key + ": expected " + expected(spec->type) + ", got a string (" + toml_string(raw) + ")"});
      return std::nullopt;
    }
    value = Value{raw};
  }
  std::vector<Issue> found;
  check_value(*spec, *value, found, 0);
  for (auto& f : found) issues.push_back({f.text});
  if (!found.empty()) return std::nullopt;
  return std::make_pair(spec, std::move(*value));
}

std::string source_name(Source s) {
  switch (s) {
    case Source::kDefault: return "default";
    case Source::kDeck: return "deck";
    case Source::kSet: return "--set";
    case Source::kHfConfig: return "hf_config";
  }
  return "?";
}

/// Checks between keys; each problem blames the entry most likely at fault.
void cross_check(const Deck& deck, std::vector<std::string>& problems) {
  auto where = [&](const Entry& e) { return e.where.empty() ? deck.path() : e.where; };
  auto explicit_ = [](const Entry& e) { return e.source != Source::kDefault; };
  const Entry& model = deck.entry("model.kind");
  const Entry& data = deck.entry("data.kind");
  const auto kind = find_choice<ModelKind>(deck.get_string("model.kind"));
  if (!kind) return;  // an unknown kind is its own problem, already reported
  const ModelFamily& family = model_family(*kind);
  const bool language_model = family.language_model();
  const std::string& dk = deck.get_string("data.kind");
  const bool token_data = is_token_data(dk);
  if (language_model != token_data) {
    const bool blame_model = explicit_(model) && (!explicit_(data) || (model.source == Source::kSet && data.source != Source::kSet));
    if (blame_model) {
      problems.push_back(where(model) + ": model.kind: " + format_value(model.value) + " needs data.kind " +
                         (language_model ? "\"tokens\", \"text\", \"token-shards\" or \"indexed\"" : "\"fashion-mnist\" or \"mnist\"") +
                         " (data.kind is " + format_value(data.value) + ")");
    } else {
      problems.push_back(where(data) + ": data.kind: " + format_value(data.value) + " needs model.kind " + model_kinds_named(token_data) +
                         " (model.kind is " + format_value(model.value) + ")");
    }
  }
  family.cross_check(deck, problems);
}

}  // namespace

std::string format_value(const Value& v) {
  struct {
    std::string operator()(std::monostate) const { return "(unset)"; }
    std::string operator()(std::int64_t i) const { return std::to_string(i); }
    std::string operator()(double d) const { return toml_float(d); }
    std::string operator()(bool b) const { return b ? "true" : "false"; }
    std::string operator()(const std::string& s) const { return toml_string(s); }
    std::string operator()(const Ints& a) const {
      std::vector<std::string> parts;
      for (auto i : a) parts.push_back(std::to_string(i));
      return "[" + join(parts, ", ") + "]";
    }
    std::string operator()(const Floats& a) const {
      std::vector<std::string> parts;
      for (auto d : a) parts.push_back(toml_float(d));
      return "[" + join(parts, ", ") + "]";
    }
    std::string operator()(const Tables& t) const { return format_tables(t); }
  } visitor;
  return std::visit(visitor, v);
}

// ---- Deck ------------------------------------------------------------------------------------

Deck::Deck() : path_("(defaults)") {
  for (const auto& spec : deck_schema()) entries_.push_back({&spec, spec.default_value, Source::kDefault, 0, ""});
}

Deck Deck::parse(const std::string& text, const std::string& path, const std::vector<std::string>& overrides) {
  Deck deck;
  deck.path_ = path;
  deck.text_ = text;
  std::vector<Issue> issues;  // from the deck, sorted by line below
  try {
    const toml::table root = toml::parse(std::string_view(text), std::string_view(path));
    for (auto&& [k, node] : root) {
      const std::string section(k.str());
      const bool known = std::find(deck_sections().begin(), deck_sections().end(), section) != deck_sections().end();
      if (!known) {
        if (node.is_table() || node.is_array_of_tables()) {
          std::string msg = section + ": unknown section";
          if (auto near = closest_of(section, deck_sections()); !near.empty())
            msg += " (did you mean " + near + "?)";
          else
            msg += " (the sections are " + join(deck_sections(), ", ") + ")";
          issues.push_back({msg, line_of(node)});
        } else {
          issues.push_back({section + ": " + unknown_key_message(section), line_of(node)});
        }
        continue;
      }
      const toml::table* table = node.as_table();
      if (!table) {
        issues.push_back({section + ": expected a table [" + section + "], got " + describe(node), line_of(node)});
        continue;
      }
      for (auto&& [k2, value_node] : *table) {
        const std::string key = section + "." + std::string(k2.str());
        const KeySpec* spec = find_key(key);
        if (!spec) {
          issues.push_back({key + ": " + unknown_key_message(key), line_of(value_node)});
          continue;
        }
        const std::size_t before = issues.size();
        auto value = from_node(*spec, value_node, issues);
        if (!value) continue;
        check_value(*spec, *value, issues, line_of(value_node));
        if (issues.size() != before) continue;
        Entry& e = deck.mutable_entry(key);
        e.value = std::move(*value);
        e.source = Source::kDeck;
        e.line = line_of(value_node);
        e.where = path + ":" + std::to_string(e.line);
      }
    }
  } catch (const toml::parse_error& err) {
    const auto& at = err.source().begin;
    issues.push_back({"TOML syntax error: " + std::string(err.description()), static_cast<int>(at.line), static_cast<int>(at.column)});
  }
  std::stable_sort(issues.begin(), issues.end(), [](const Issue& a, const Issue& b) { return a.line < b.line; });
  std::vector<std::string> problems;
  for (const auto& i : issues)
    problems.push_back(path + ":" + std::to_string(i.line) + (i.column ? ":" + std::to_string(i.column) : "") + ": " + i.text);

  // Overrides: each independent of the deck's problems, reported after them.
  for (const auto& o : overrides) {
    std::vector<Issue> found;
    auto parsed = parse_override(o, found);
    for (const auto& f : found) problems.push_back("--set " + o + ": " + f.text);
    if (!parsed) continue;
    Entry& e = deck.mutable_entry(parsed->first->key);
    e.value = std::move(parsed->second);
    e.source = Source::kSet;
    e.line = 0;
    e.where = "--set " + o;
    deck.overrides_.push_back("--set " + o);
  }
  if (problems.empty()) deck.apply_hf_config(problems);
  if (problems.empty()) cross_check(deck, problems);
  if (!problems.empty()) throw DeckError(problems);
  return deck;
}

std::string Deck::read_text(const std::string& path) {
  // A folder opens as a stream that reads nothing: it would be an empty deck, the default job.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw DeckError("cannot read deck '" + path + "': it is a folder, not a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DeckError("cannot read deck '" + path + "': " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw DeckError("cannot read deck '" + path + "': read error");
  return text.str();
}

Deck Deck::from_file(const std::string& path, const std::vector<std::string>& overrides) { return parse(read_text(path), path, overrides); }

void Deck::apply_overrides(const std::vector<std::string>& overrides, const std::string& label, Source s) {
  Deck next = *this;
  std::vector<std::string> problems;
  for (const auto& o : overrides) {
    std::vector<Issue> found;
    auto parsed = parse_override(o, found);
    for (const auto& f : found) problems.push_back(label + " " + o + ": " + f.text);
    if (!parsed) continue;
    Entry& e = next.mutable_entry(parsed->first->key);
    e.value = std::move(parsed->second);
    e.source = s;
    e.line = 0;
    e.where = label + " " + o;
    next.overrides_.push_back(label + " " + o);
  }
  if (problems.empty()) next.apply_hf_config(problems);
  if (problems.empty()) cross_check(next, problems);
  if (!problems.empty()) throw DeckError(problems);
  *this = std::move(next);
}

const Entry& Deck::entry(const std::string& key) const {
  const auto& index = key_index();
  const auto it = index.find(key);
  if (it == index.end()) throw DeckError(key + ": " + unknown_key_message(key));
  return entries_[it->second];
}

Entry& Deck::mutable_entry(const std::string& key) { return const_cast<Entry&>(entry(key)); }

const Entry& Deck::typed_entry(const std::string& key, KeyType type, const char* getter) const {
  const auto& index = key_index();
  const auto it = index.find(key);
  if (it == index.end()) throw DeckError(std::string(getter) + "(\"" + key + "\"): " + unknown_key_message(key));
  const Entry& e = entries_[it->second];
  if (e.spec->type != type)
    throw DeckError(std::string(getter) + "(\"" + key + "\"): " + key + " is a " + type_name(e.spec->type) + " key, not a " + type_name(type) +
                    " key");
  if (std::holds_alternative<std::monostate>(e.value))
    throw DeckError(std::string(getter) + "(\"" + key + "\"): " + key + " is unset (check is_set() first)");
  return e;
}

std::int64_t Deck::get_int(const std::string& key) const { return std::get<I>(typed_entry(key, KeyType::kInt, "get_int").value); }
double Deck::get_float(const std::string& key) const { return std::get<double>(typed_entry(key, KeyType::kFloat, "get_float").value); }
bool Deck::get_bool(const std::string& key) const { return std::get<bool>(typed_entry(key, KeyType::kBool, "get_bool").value); }
const std::string& Deck::get_string(const std::string& key) const {
  return std::get<std::string>(typed_entry(key, KeyType::kString, "get_string").value);
}
const std::vector<std::int64_t>& Deck::get_int_array(const std::string& key) const {
  return std::get<Ints>(typed_entry(key, KeyType::kIntArray, "get_int_array").value);
}
const std::vector<double>& Deck::get_float_array(const std::string& key) const {
  return std::get<Floats>(typed_entry(key, KeyType::kFloatArray, "get_float_array").value);
}
const Tables& Deck::get_tables(const std::string& key) const { return std::get<Tables>(typed_entry(key, KeyType::kTables, "get_tables").value); }

bool Deck::is_set(const std::string& key) const { return !std::holds_alternative<std::monostate>(entry(key).value); }

void Deck::set(const std::string& key, Value v, Source s) {
  Entry& e = mutable_entry(key);
  if (auto msg = coerce(*e.spec, v)) throw DeckError(*msg);
  if (!std::holds_alternative<std::monostate>(v)) {
    std::vector<Issue> issues;
    check_value(*e.spec, v, issues, 0);
    if (!issues.empty()) {
      std::vector<std::string> problems;
      for (const auto& i : issues) problems.push_back(i.text);
      throw DeckError(problems);
    }
  }
  e.value = std::move(v);
  e.source = s;
  e.line = 0;
  e.where = "set()";
}

std::string Deck::out_dir() const {
  const auto& dir = get_string("run.out_dir");
  return dir.empty() ? "runs/" + get_string("run.name") : dir;
}

std::string Deck::checkpoint_dir() const {
  // Outputs resolve against run.out_dir, as checkpoint.export and log.metrics_file do: each point of a
  // sweep gets its own checkpoints, whatever folder it was started from.
  const std::filesystem::path dir = get_string("checkpoint.dir");
  if (dir.empty()) return (std::filesystem::path(out_dir()) / "checkpoints").string();
  return dir.is_absolute() ? dir.string() : (std::filesystem::path(out_dir()) / dir).string();
}

std::string Deck::echo_table() const {
  std::size_t wk = 3, wv = 5;
  std::vector<std::string> values;
  for (const auto& e : entries_) {
    values.push_back(format_value(e.value));
    wk = std::max(wk, e.spec->key.size());
    wv = std::max(wv, values.back().size());
  }
  std::ostringstream out;
  auto row = [&](const std::string& a, const std::string& b, const std::string& c) {
    out << a << std::string(wk - a.size() + 2, ' ') << b << std::string(wv - b.size() + 2, ' ') << c << "\n";
  };
  row("key", "value", "source");
  row(std::string(wk, '-'), std::string(wv, '-'), "-------");
  for (std::size_t i = 0; i < entries_.size(); ++i) row(entries_[i].spec->key, values[i], source_name(entries_[i].source));
  return out.str();
}

std::string Deck::to_toml() const {
  auto one_line = [](std::string s) {
    std::replace(s.begin(), s.end(), '\n', ' ');
    std::replace(s.begin(), s.end(), '\r', ' ');
    return s;
  };
  std::ostringstream out;
  out << "# fsdp deck, resolved: every key with its value; unset keys are comments.\n";
  out << "# From: " << one_line(path_) << "\n";
  for (const auto& o : overrides_) out << "# Override: " << one_line(o) << "\n";
  out << "# Keys, types and defaults: docs/deck_reference.md\n";
  std::string section;
  for (const auto& e : entries_) {
    if (e.spec->section() != section) {
      section = e.spec->section();
      out << "\n[" << section << "]\n";
    }
    if (std::holds_alternative<std::monostate>(e.value))
      out << "# " << e.spec->name() << " = (unset)\n";
    else if (e.spec->key == "model.hf_config" && !std::get<std::string>(e.value).empty())
      out << "# " << e.spec->name() << " = " << format_value(e.value) << "  (read at the start: its values are the keys below)\n";
    else
      out << e.spec->name() << " = " << format_value(e.value) << "\n";
  }
  return out.str();
}

}  // namespace fsdp::app
