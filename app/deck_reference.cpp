// Input decks (app layer): the reference generated from the schema, docs/deck_reference.md
// (fsdp-sweep --print-reference).
#include <regex>
#include <sstream>

#include "deck.hpp"
#include "deck_detail.hpp"

namespace fsdp::app {

using namespace detail;

std::string reference_markdown() {
  // A table cell: '|' escaped; a word holding <placeholder> in backticks, so it is not read as HTML.
  auto cell = [](const std::string& s) {
    std::string out;
    for (char c : s) out += c == '|' ? std::string("\\|") : std::string(1, c);
    return std::regex_replace(out, std::regex("([^ `]*<[^> ]+>[^ `;,)]*)"), "`$1`");
  };
  std::ostringstream md;
  md << "# Deck reference\n\n"
     << "<!-- Generated from the schema in app/deck_schema.cpp; do not edit. Regenerate with\n"
     << "     build/bin/fsdp-sweep --print-reference > docs/deck_reference.md\n"
     << "     The test test_deck fails when this file and the schema disagree. -->\n\n"
     << "`fsdp-train` reads every setting from an input deck, a [TOML](https://toml.io) file. This page\n"
     << "lists every key. `fsdp-sweep` writes one deck per point of a parameter grid.\n\n"
     << "## How decks work\n\n"
     << "- **Sections and keys.** A deck has the sections below, each a TOML table (`[optim]`), holding\n"
     << "  `name = value` lines. A key is named `section.name` (`optim.lr`) in messages and on the command\n"
     << "  line. Every key has a default, so an empty deck is a valid deck; a deck names only what it changes.\n"
     << "  Unknown sections and keys are errors, with the closest known name suggested.\n"
     << "- **Types.** integer, float, boolean, string, arrays of integers or floats, and arrays of tables\n"
     << "  (`[[data.sources]]` blocks, or inline: `sources = [{ path = \"a\", weight = 3 }, { path = \"b\" }]`,\n"
     << "  each table with the fields listed). An integer is\n"
     << "  accepted where a float is expected (`lr = 1`). A key with choices takes one of the listed\n"
     << "  strings in any case (`full_shard` is stored as `FULL_SHARD`). Ranges are inclusive unless\n"
     << "  written with `>`, `<` or a parenthesis; an array's range applies to each element.\n"
     << "- **`--set section.key=value`** on the command line overrides the deck, in order, after it is\n"
     << "  read. The value is read as a TOML value (`--set optim.lr=1e-3`, `--set optim.betas=[0.9,0.99]`,\n"
     << "  `--set data.shuffle=false`, `--set 'run.name=\"a b\"'`); text that is not a TOML value, and any\n"
     << "  value of a string key, is taken as the string itself (`--set run.out_dir=runs/a`,\n"
     << "  `--set fsdp.sharding_strategy=SHARD_GRAD_OP`).\n"
     << "- **Sources.** The run's log echoes every key with its value and where it came from: `deck`,\n"
     << "  `--set` or `default`. The resolved deck (every key, as TOML) is written to the run's output\n"
     << "  folder; reading it again gives the same run.\n"
     << "- **Unset.** A default of *(unset)* means the program decides (e.g. `model.dropout`: each model's\n"
     << "  own values). An empty string default is derived from other keys as its description says\n"
     << "  (`run.out_dir` is `runs/<run.name>`, `checkpoint.dir` is `<run.out_dir>/checkpoints`).\n"

     << "- **Errors.** Every problem of a deck and its `--set` options is reported at once, one per line,\n"
     << "  as `<file>:<line>: <key>: <message>` (`--set <text>: <key>: <message>` for an override), e.g.\n"
     << "  `inputs/a.toml:7: optim.lr: -1 must be greater than 0` or\n"
     << "  `inputs/a.toml:3: optim.lrr: unknown key (did you mean optim.lr?)`. A TOML syntax error gives\n"
     << "  `<file>:<line>:<column>`. Some keys are checked together: `model.kind = \"transformer\"` goes with\n"
     << "  `data.kind` `tokens` or `text` (and the image models with `fashion-mnist` or `mnist`), and\n"
     << "  `model.n_heads` must divide `model.d_model`.\n\n"
     << "```toml\n"
     << "# inputs/example.toml\n"
     << "[run]\nname = \"fmnist-sgo\"\nepochs = 3\n\n"
     << "[optim]\nkind = \"adamw\"\nlr = 1e-3\n\n"
     << "[fsdp]\nsharding_strategy = \"SHARD_GRAD_OP\"\n"
     << "```\n";
  for (const auto& section : deck_sections()) {
    md << "\n## [" << section << "]\n\n"
       << "| key | type | default | range / choices | description |\n"
       << "|---|---|---|---|---|\n";
    for (const auto& s : deck_schema()) {
      if (s.section() != section) continue;
      std::string range;
      if (!s.choices.empty()) {
        std::vector<std::string> parts;
        for (const auto& c : s.choices) parts.push_back("`" + c + "`");
        range = join(parts, ", ");
      } else if (s.min && s.max) {
        range = std::string(s.min_exclusive ? "(" : "[") + format_number(*s.min) + ", " + format_number(*s.max) + (s.max_exclusive ? ")" : "]");
      } else if (s.min) {
        range = std::string(s.min_exclusive ? "> " : ">= ") + format_number(*s.min);
      } else if (s.max) {
        range = std::string(s.max_exclusive ? "< " : "<= ") + format_number(*s.max);
      }
      if (s.array_size) range += (range.empty() ? "" : "; ") + std::to_string(s.array_size) + " elements";
      if (s.type == KeyType::kTables) range = "each table: " + describe_fields(s);
      if (range.empty()) range = "any";
      const std::string def = std::holds_alternative<std::monostate>(s.default_value) ? "*(unset)*" : "`" + format_value(s.default_value) + "`";
      const std::string& description = s.description;
      md << "| `" << s.name() << "` | "
         << (s.names_list        ? "string or string array"
             : s.scalar_as_array ? "integer or integer array"
                                 : type_name(s.type))
         << " | " << cell(def) << " | " << cell(range) << " | " << cell(description) << " |\n";
    }
  }
  return md.str();
}

}  // namespace fsdp::app
