// Input decks of fsdp-train (app layer): one schema declares every key (type, default, range,
// choices, description); a TOML deck plus `--set section.key=value` overrides are validated against
// it, every problem reported at once with file:line. No LibTorch, no MPI: builds in seconds.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "choices.hpp"
#include "fsdp/errors.hpp"

namespace fsdp::app {

/// A deck that does not parse or validate, or a programming error in reading one (unknown key,
/// wrong getter). what() is "[fsdp.deck] " followed by the problem; with several problems, a count
/// line and then one problem per line.
class DeckError : public fsdp::ConfigError {
 public:
  explicit DeckError(const std::string& what) : ConfigError(what, "fsdp.deck"), problems_{what} {}
  /// Several problems: each one a line of what(), also available one by one from problems().
  explicit DeckError(const std::vector<std::string>& problems) : ConfigError(join(problems), "fsdp.deck"), problems_(problems) {}
  /// Every problem, one per entry, each "<where>: <key>: <message>".
  const std::vector<std::string>& problems() const noexcept { return problems_; }

 private:
  static std::string join(const std::vector<std::string>& problems);
  std::vector<std::string> problems_;
};

/// kTables: a TOML array of tables (`[[data.sources]]` or an inline `[{ ... }, { ... }]`), each table
/// holding the fields its KeySpec declares.
enum class KeyType { kInt, kFloat, kBool, kString, kIntArray, kFloatArray, kTables };

/// A field of one table in an array of tables; std::monostate: not given and no default.
using TableField = std::variant<std::monostate, std::int64_t, double, bool, std::string>;
/// One table of an array of tables: every field its key's KeySpec::fields declares, in that order,
/// by name (monostate where the table gives none and the field has no default).
struct TableRow {
  std::vector<std::pair<std::string, TableField>> fields;
  /// Field `name`; DeckError for a name the key does not declare.
  const TableField& at(const std::string& name) const;
  friend bool operator==(const TableRow&, const TableRow&) = default;
};
using Tables = std::vector<TableRow>;

/// A key's value; std::monostate means unset (only for keys whose default is unset).
using Value = std::variant<std::monostate, std::int64_t, double, bool, std::string, std::vector<std::int64_t>, std::vector<double>, Tables>;

/// One key of the schema.
struct KeySpec {
  std::string key;  ///< "optim.lr" (section.name)
  KeyType type;
  Value default_value{};               ///< monostate: unset by default
  std::optional<double> min{}, max{};  ///< range for numbers and for each array element (inclusive unless *_exclusive)
  std::vector<std::string> choices{};  ///< non-empty: a string must be one of these (any case on input, stored as listed)
  std::string description{};           ///< one line
  bool min_exclusive = false;          ///< the value must be > min (e.g. a learning rate)
  bool max_exclusive = false;          ///< the value must be < max (e.g. a dropout probability)
  std::size_t array_size = 0;          ///< arrays: non-zero = exactly this many elements
  bool names_list = false;             ///< strings: a TOML array of strings is accepted too, stored comma-joined
  bool count_choice = false;           ///< strings with choices: a whole number >= 2 is accepted too, stored as its digits
  bool scalar_as_array = false;        ///< integer arrays: one integer is accepted too, stored as a one-element array
  /// kTables: each table's fields (key = the field's name; a scalar type, default, range, choices).
  std::vector<KeySpec> fields{};
  bool required = false;  ///< a field every table must give

  std::string section() const { return key.substr(0, key.find('.')); }
  std::string name() const { return key.substr(key.find('.') + 1); }
};

/// Every key, grouped by section in the order of the deck reference.
const std::vector<KeySpec>& deck_schema();
/// The sections, in schema order ("run", "model", ...).
const std::vector<std::string>& deck_sections();
/// The schema entry of `key` ("optim.lr"), or nullptr.
const KeySpec* find_key(const std::string& key);
/// The closest known key to an unknown one (edit distance <= 2, a shared prefix, or the same name in
/// another section), or "" if none is close.
std::string did_you_mean(const std::string& key);

/// Where a value came from: the schema, the deck file, an override, or model.hf_config's config.json.
enum class Source { kDefault, kDeck, kSet, kHfConfig };

struct Entry {
  const KeySpec* spec;
  Value value;
  Source source;
  int line = 0;       ///< line in the deck, 0 if not from the deck
  std::string where;  ///< where the value was set, for messages: "inputs/a.toml:7", "--set optim.lr=0.1", "set()"; "" for a default
};

/// A validated deck: every schema key with its value and where the value came from.
class Deck {
 public:
  /// Every key at its default (path "(defaults)").
  Deck();
  /// Parses deck `text` read from `path` (used in messages), then applies `overrides`
  /// ("section.key=value" strings from --set, in order). Every problem is reported, all in one
  /// DeckError, one per line: "<path>:<line>: <key>: <message>" (for --set: "--set <text>: <key>: <message>").
  /// A --set value is parsed as a TOML value; if that fails (or the key is a string key and the
  /// value is not a TOML string) the bare text is the string.
  static Deck parse(const std::string& text, const std::string& path, const std::vector<std::string>& overrides = {});
  /// The text of the deck file at `path`; a missing or unreadable file, or a folder, is a DeckError naming it.
  static std::string read_text(const std::string& path);
  /// Reads and parses the file; a missing or unreadable file, or a folder, is a DeckError naming it.
  static Deck from_file(const std::string& path, const std::vector<std::string>& overrides = {});

  /// Applies more "section.key=value" overrides like --set does (messages say `label`, e.g. "--grid"),
  /// then the checks between keys; every problem in one DeckError, the deck unchanged if any.
  void apply_overrides(const std::vector<std::string>& overrides, const std::string& label = "--set", Source s = Source::kSet);

  // Getters throw DeckError for an unknown key, a key of another type, or an unset value.
  std::int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;
  bool get_bool(const std::string& key) const;
  const std::string& get_string(const std::string& key) const;
  const std::vector<std::int64_t>& get_int_array(const std::string& key) const;
  const std::vector<double>& get_float_array(const std::string& key) const;
  const Tables& get_tables(const std::string& key) const;
  /// False when the value is unset (monostate).
  bool is_set(const std::string& key) const;
  /// The entry of `key` (DeckError if unknown).
  const Entry& entry(const std::string& key) const;
  /// Programmatic override, validated like a deck value (an int is accepted for a float key, a bool
  /// for a string key with choices true/false, monostate only where the default is unset).
  void set(const std::string& key, Value v, Source s = Source::kSet);
  /// Every schema key, in schema order.
  const std::vector<Entry>& entries() const { return entries_; }

  /// run.out_dir, or runs/<run.name> when it is empty.
  std::string out_dir() const;
  /// checkpoint.dir, or <out_dir()>/checkpoints when it is empty.
  std::string checkpoint_dir() const;

  /// Aligned text table: key | value | source (deck / --set / hf_config / default); unset values as "(unset)".
  std::string echo_table() const;
  /// The resolved deck as TOML: every key (unset ones as a comment "# key = (unset)"), sections in
  /// schema order, a header comment. Parsing it again gives the same values (sources become deck);
  /// model.hf_config is a comment, its values written out, so the text stands without the file.
  std::string to_toml() const;
  /// The original deck text.
  std::string text() const { return text_; }
  /// The path the deck was read from (as given to parse / from_file).
  const std::string& path() const { return path_; }
  /// The overrides applied after the deck, in order, each as "<label> section.key=value".
  const std::vector<std::string>& overrides() const { return overrides_; }

 private:
  Entry& mutable_entry(const std::string& key);
  /// model.hf_config: its config.json's values on keys the deck leaves at their defaults (a
  /// contradicting deck value, or a config that cannot be read or built, is a problem). In hf_config.cpp.
  void apply_hf_config(std::vector<std::string>& problems);
  const Entry& typed_entry(const std::string& key, KeyType type, const char* getter) const;

  std::string path_;
  std::string text_;
  std::vector<Entry> entries_;
  std::vector<std::string> overrides_;
};

/// Whether data.kind `kind` names token sequences (for model.kind = "transformer") rather than images.
inline bool is_token_data(const std::string& kind) {
  const auto known = find_choice<DataKind>(kind);
  return known && is_token_data(*known);
}

/// A value as TOML writes it: 1, 0.5, true, "text", [1, 2], [{ path = "a", weight = 0.5 }];
/// "(unset)" for monostate.
std::string format_value(const Value& v);

/// Whether `key` decides the training trajectory: [model], [data] (but its evaluation and loading
/// keys), [optim] and run.seed. A resume compares these with the checkpoint's stored deck.
bool changes_the_trajectory(const std::string& key);

/// One key whose value differs between two decks, as TOML writes each value.
struct KeyChange {
  std::string key, before, now;
};
/// The keys that decide the trajectory whose values differ between `before` (a checkpoint's stored
/// deck) and `now`, in schema order.
std::vector<KeyChange> trajectory_changes(const Deck& before, const Deck& now);
/// The full content of docs/deck_reference.md, generated from deck_schema().
std::string reference_markdown();

}  // namespace fsdp::app
