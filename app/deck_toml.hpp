// Input decks (app layer): what deck.cpp and deck_tables.cpp share of reading TOML nodes. Internal to
// the fsdp_deck library; the only deck header that includes toml++.
#pragma once

#include <toml++/toml.h>

#include <optional>
#include <string>
#include <vector>

#include "deck_detail.hpp"

namespace fsdp::app::detail {

/// What a TOML node is, for "expected X, got Y".
std::string describe(const toml::node& n);
inline int line_of(const toml::node& n) { return static_cast<int>(n.source().begin.line); }

/// A TOML array of tables as a value of the kTables key `spec`: each table's keys among its fields
/// (an unknown one named with the closest field), the required fields given, defaults filled in, each
/// field converted to its type; nullopt with issues.
std::optional<Value> tables_from_node(const KeySpec& spec, const toml::node& n, std::vector<Issue>& issues);

}  // namespace fsdp::app::detail
