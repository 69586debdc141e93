// Input decks (app layer): helpers shared by the schema (deck_schema.cpp) and the parser (deck.cpp):
// text, names and the index of schema keys. Internal to the fsdp_deck library.
#pragma once

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "deck.hpp"

namespace fsdp::app::detail {

using I = std::int64_t;
using Ints = std::vector<std::int64_t>;
using Floats = std::vector<double>;

inline std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

inline bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

inline std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

/// Optimal string alignment distance (Levenshtein plus adjacent transpositions).
inline int edit_distance(const std::string& a, const std::string& b) {
  const std::size_t n = a.size(), m = b.size();
  std::vector<std::vector<int>> d(n + 1, std::vector<int>(m + 1));
  for (std::size_t i = 0; i <= n; ++i) d[i][0] = static_cast<int>(i);
  for (std::size_t j = 0; j <= m; ++j) d[0][j] = static_cast<int>(j);
  for (std::size_t i = 1; i <= n; ++i) {
    for (std::size_t j = 1; j <= m; ++j) {
      const int cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[n][m];
}

/// How far `word` (lower case) is from `known`, -1 if not close: twice the edit distance (at most 1
/// for short words, 2 otherwise), 3 for a prefix either way, 5 for a part of `known`.
inline int closeness(const std::string& word, const std::string& known) {
  const int tolerance = word.size() <= 4 ? 1 : 2;
  int best = -1;
  auto take = [&](int score) {
    if (best < 0 || score < best) best = score;
  };
  const int d = edit_distance(word, known);
  if (d <= tolerance) take(2 * d);
  if (word.size() >= 3 && known.size() >= 3 && (starts_with(known, word) || starts_with(word, known))) take(3);
  if (word.size() >= 4 && known.find(word) != std::string::npos) take(5);
  return best;
}

inline std::string closest_of(const std::string& word, const std::vector<std::string>& known) {
  int best = -1;
  std::string out;
  for (const auto& k : known) {
    const int c = closeness(lower(word), lower(k));
    if (c >= 0 && (best < 0 || c < best)) best = c, out = k;
  }
  return out;
}

inline std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (std::size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

/// A number for messages: 1, -1, 0.5, 1e-05 (no forced ".0").
inline std::string format_number(double x) {
  if (std::isfinite(x) && x == std::floor(x) && std::fabs(x) < 1e15) return std::to_string(static_cast<long long>(x));
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, x);
  return std::string(buf, r.ptr);
}

/// A float as TOML writes it, reading back to the same double: 1.0, 0.7, 1e-05.
inline std::string toml_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, x);
  std::string s(buf, r.ptr);
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

inline std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04X", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

inline const char* type_name(KeyType t) {
  switch (t) {
    case KeyType::kInt: return "integer";
    case KeyType::kFloat: return "float";
    case KeyType::kBool: return "boolean";
    case KeyType::kString: return "string";
    case KeyType::kIntArray: return "integer array";
    case KeyType::kFloatArray: return "float array";
    case KeyType::kTables: return "array of tables";
  }
  return "?";
}

inline const char* expected(KeyType t) {
  switch (t) {
    case KeyType::kInt: return "an integer";
    case KeyType::kFloat: return "a number";
    case KeyType::kBool: return "a boolean (true or false)";
    case KeyType::kString: return "a string";
    case KeyType::kIntArray: return "an array of integers";
    case KeyType::kFloatArray: return "an array of numbers";
    case KeyType::kTables: return "an array of tables";
  }
  return "?";
}

/// One problem with a value; `text` is "<key>: <message>".
struct Issue {
  std::string text;
  int line = 0;    // for sorting problems found in the deck
  int column = 0;  // TOML syntax errors only
};

/// Range, choices (normalized in place) and array size of a value of `spec`; for an array of tables,
/// each field of each table against its field spec (deck.cpp).
void check_value(const KeySpec& spec, Value& v, std::vector<Issue>& issues, int line);

/// Arrays of tables (deck_tables.cpp; reading one from TOML is in deck_toml.hpp): the checks of every
/// table's fields, the value as TOML writes it, and the fields for the reference.
void check_tables(const KeySpec& spec, Tables& tables, std::vector<Issue>& issues, int line);
std::string format_tables(const Tables& tables);
std::string describe_fields(const KeySpec& spec);

/// Schema key -> its index in deck_schema().
const std::map<std::string, std::size_t>& key_index();

/// The schema's keys of [model] (deck_schema_model.cpp), and of [comm], [checkpoint] (saves, then
/// weights in and out), [eval] and [log] (deck_schema_outputs.cpp), in the reference's order;
/// make_schema in deck_schema.cpp calls them.
void add_model_keys(std::vector<KeySpec>& s);
void add_comm_keys(std::vector<KeySpec>& s);
void add_checkpoint_keys(std::vector<KeySpec>& s);
void add_weights_in_and_out_keys(std::vector<KeySpec>& s);
void add_eval_keys(std::vector<KeySpec>& s);
void add_log_keys(std::vector<KeySpec>& s);

}  // namespace fsdp::app::detail
