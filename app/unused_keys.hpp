// Input decks (app layer): keys a deck sets to a value its other choices never read. A user who set
// them expects them to act, so fsdp-train's echo and fsdp-plan say so (a warning; the run goes on).
#pragma once

#include <string>
#include <vector>

#include "deck.hpp"

namespace fsdp::app {

/// One line per wrapping key set to other than its default while fsdp.auto_wrap_policy does not use
/// it ("<where>: fsdp.min_num_params = 1000 is set, but ..."). A resolved deck (every key written,
/// at its default where not set) gives none.
inline std::vector<std::string> unused_key_warnings(const Deck& deck) {
  std::vector<std::string> out;
  const std::string& policy = deck.get_string("fsdp.auto_wrap_policy");
  const auto unused = [&](const char* key, const char* reader) {
    const Entry& e = deck.entry(key);
    if (policy == reader || e.source == Source::kDefault || e.value == e.spec->default_value) return;
    out.push_back((e.where.empty() ? deck.path() : e.where) + ": " + key + " = " + format_value(e.value) + " is set, but fsdp.auto_wrap_policy = \"" +
                  policy + "\" does not read it (" + reader + " does)");
  };
  unused("fsdp.transformer_layer_cls_to_wrap", "TRANSFORMER_BASED_WRAP");
  unused("fsdp.min_num_params", "SIZE_BASED_WRAP");
  return out;
}

}  // namespace fsdp::app
