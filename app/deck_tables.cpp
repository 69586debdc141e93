// Input decks (app layer): keys whose value is a TOML array of tables (data.sources): reading one,
// checking each table's fields against their specs, writing it back as TOML, and the reference's
// description of its fields.
#include <toml++/toml.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "deck.hpp"
#include "deck_detail.hpp"
#include "deck_toml.hpp"

namespace fsdp::app {

using namespace detail;

const TableField& TableRow::at(const std::string& name) const {
  for (const auto& [field, value] : fields)
    if (field == name) return value;
  throw DeckError("a table has no field '" + name + "'");
}

namespace detail {
namespace {

/// The label of field `name` of table `index` in messages: "data.sources[1].weight".
std::string field_label(const KeySpec& spec, std::size_t index, const std::string& name) {
  return spec.key + "[" + std::to_string(index) + "]" + (name.empty() ? "" : "." + name);
}

/// A scalar TOML node as a value of field `field` (an integer is accepted for a float), or nullopt.
std::optional<TableField> field_from_node(const KeySpec& field, const toml::node& n) {
  switch (field.type) {
    case KeyType::kInt:
      if (auto* i = n.as_integer()) return TableField{i->get()};
      break;
    case KeyType::kFloat:
      if (auto* f = n.as_floating_point()) return TableField{f->get()};
      if (auto* i = n.as_integer()) return TableField{static_cast<double>(i->get())};
      break;
    case KeyType::kBool:
      if (auto* b = n.as_boolean()) return TableField{b->get()};
      break;
    case KeyType::kString:
      if (auto* s = n.as_string()) return TableField{s->get()};
      break;
    default: break;  // fields are scalars (test_deck's schema_is_consistent checks it)
  }
  return std::nullopt;
}

Value as_value(const TableField& f) {
  return std::visit([](const auto& x) -> Value { return x; }, f);
}

/// The fields of table `index` against their specs (range, choices normalized in place, required);
/// problems at `lines[f]` (a field's line in the deck) or else at `line`.
void check_row(const KeySpec& spec, std::size_t index, TableRow& row, std::vector<Issue>& issues, int line, const std::vector<int>& lines = {}) {
  if (row.fields.size() != spec.fields.size()) {  // a programmatic value (Deck::set) of another shape
    issues.push_back({field_label(spec, index, "") + ": expected the fields " + describe_fields(spec), line});
    return;
  }
  for (std::size_t f = 0; f < spec.fields.size(); ++f) {
    KeySpec field = spec.fields[f];
    auto& [name, value] = row.fields[f];
    const int at = f < lines.size() ? lines[f] : line;
    if (name != field.key) {
      issues.push_back({field_label(spec, index, name) + ": expected the field " + field.key + " here", at});
      continue;
    }
    if (std::holds_alternative<std::monostate>(value)) {
      if (field.required) issues.push_back({field_label(spec, index, name) + ": missing (every table of " + spec.key + " gives it)", at});
      continue;
    }
    field.key = field_label(spec, index, name);
    Value v = as_value(value);
    check_value(field, v, issues, at);
    if (auto* s = std::get_if<std::string>(&v)) value = *s;  // choices are stored as listed
  }
}

}  // namespace

std::optional<Value> tables_from_node(const KeySpec& spec, const toml::node& n, std::vector<Issue>& issues) {
  const auto* array = n.as_array();
  if (!array) {
    issues.push_back({spec.key + ": expected an array of tables, got " + describe(n), line_of(n)});
    return std::nullopt;
  }
  std::vector<std::string> names;
  for (const auto& f : spec.fields) names.push_back(f.key);
  Tables tables;
  bool ok = true;
  for (std::size_t k = 0; k < array->size(); ++k) {
    const toml::node& element = *array->get(k);
    const auto* table = element.as_table();
    if (!table) {
      issues.push_back(
          {field_label(spec, k, "") + ": expected a table ({ " + join(names, " = ..., ") + " = ... }), got " + describe(element), line_of(element)});
      ok = false;
      continue;
    }
    for (auto&& [key, value] : *table) {
      const std::string name(key.str());
      if (std::find(names.begin(), names.end(), name) != names.end()) continue;
      std::string msg = field_label(spec, k, name) + ": unknown field";
      if (auto near = closest_of(name, names); !near.empty())
        msg += " (did you mean " + near + "?)";
      else
        msg += " (the fields are " + join(names, ", ") + ")";
      issues.push_back({msg, line_of(value)});
      ok = false;
    }
    TableRow row;
    std::vector<int> lines;
    for (const auto& field : spec.fields) {
      const toml::node* given = table->get(field.key);
      lines.push_back(given ? line_of(*given) : line_of(element));
      if (!given) {
        row.fields.emplace_back(field.key, std::visit(
                                               [](const auto& x) -> TableField {
                                                 using X = std::decay_t<decltype(x)>;
                                                 if constexpr (std::is_constructible_v<TableField, X>)
                                                   return x;
                                                 else
                                                   return std::monostate{};
                                               },
                                               field.default_value));
        continue;
      }
      auto value = field_from_node(field, *given);
      if (!value) {
        issues.push_back({field_label(spec, k, field.key) + ": expected " + expected(field.type) + ", got " + describe(*given), line_of(*given)});
        ok = false;
        continue;
      }
      row.fields.emplace_back(field.key, std::move(*value));
    }
    if (row.fields.size() == spec.fields.size()) {  // every field read: check them too (required, range), all problems at once
      const std::size_t before = issues.size();
      check_row(spec, k, row, issues, line_of(element), lines);
      ok = ok && issues.size() == before;
    }
    tables.push_back(std::move(row));
  }
  if (!ok) return std::nullopt;
  return Value{std::move(tables)};
}

void check_tables(const KeySpec& spec, Tables& tables, std::vector<Issue>& issues, int line) {
  if (spec.array_size != 0 && tables.size() != spec.array_size)
    issues.push_back({spec.key + ": expected " + std::to_string(spec.array_size) + " tables, got " + std::to_string(tables.size()), line});
  for (std::size_t k = 0; k < tables.size(); ++k) check_row(spec, k, tables[k], issues, line);
}

std::string format_tables(const Tables& tables) {
  std::vector<std::string> parts;
  for (const auto& row : tables) {
    std::vector<std::string> fields;
    for (const auto& [name, value] : row.fields)
      if (!std::holds_alternative<std::monostate>(value)) fields.push_back(name + " = " + format_value(as_value(value)));
    parts.push_back(fields.empty() ? "{}" : "{ " + join(fields, ", ") + " }");
  }
  return "[" + join(parts, ", ") + "]";
}

std::string describe_fields(const KeySpec& spec) {
  std::vector<std::string> parts;
  for (const auto& f : spec.fields) {
    std::string text = "`" + f.key + "` " + type_name(f.type);
    if (f.required)
      text += ", required";
    else if (!std::holds_alternative<std::monostate>(f.default_value))
      text += ", default `" + format_value(f.default_value) + "`";
    if (f.min) text += std::string(", ") + (f.min_exclusive ? "> " : ">= ") + format_number(*f.min);
    if (!f.choices.empty()) text += ", one of " + join(f.choices, ", ");
    if (!f.description.empty()) text += ": " + f.description;
    parts.push_back(text);
  }
  return join(parts, "; ");
}

}  // namespace detail
}  // namespace fsdp::app
