// fsdp-generate's request on the command line: the prompt (text through a tokenizer, or ids), its
// checks on every rank, and what rank 0 prints (app/train/generate.hpp generates).
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "models/families.hpp"
#include "train/generate.hpp"
#include "train/ranks.hpp"
#include "train/trainer.hpp"
#if FSDP_HAVE_TOKENIZER
#include "text/tokenizer.hpp"
#endif

namespace fsdp::app {

#if FSDP_HAVE_TOKENIZER
using PromptTokenizer = Tokenizer;
#else
struct PromptTokenizer {};  // built without ICU: prompts and output as token ids only
#endif

/// fsdp-generate's request: options and where the prompt comes from.
struct GenerateRequest {
  GenerateOptions options;
  std::string prompt_text, tokenizer;
  bool stop_at_eos = true;
};

/// Token ids separated by commas or spaces; nullopt unless every word is a whole integer and no comma
/// stands without an id before and after it ("1,,2" would be a token lost to a typo).
inline std::optional<std::vector<std::int64_t>> parse_token_ids(std::string text) {
  bool id_since_comma = false;
  for (auto& c : text) {
    if (c == ',') {
      if (!id_since_comma) return std::nullopt;
      id_since_comma = false;
      c = ' ';
    } else if (c != ' ' && c != '\t') {
      id_since_comma = true;
    }
  }
  if (!id_since_comma && text.find_first_not_of(" \t") != std::string::npos) return std::nullopt;  // a trailing comma
  std::istringstream in(text);
  std::vector<std::int64_t> ids;
  for (std::string word; in >> word;) {
    std::int64_t v = 0;
    const auto [end, ec] = std::from_chars(word.data(), word.data() + word.size(), v);
    if (ec != std::errc() || end != word.data() + word.size()) return std::nullopt;
    ids.push_back(v);
  }
  return ids;
}

/// The prompt's ids: --ids as given, or --prompt through the tokenizer (every rank reads it alike).
inline std::optional<PromptTokenizer> prepare_prompt(MpiComm& world, GenerateRequest& g) {
  std::optional<PromptTokenizer> tok;
  on_all_ranks(world, [&] {
    if (g.tokenizer.empty()) {
      if (!g.prompt_text.empty()) throw DeckError("fsdp-generate: --prompt needs --tokenizer (tokenizer.json); or give the prompt as --ids");
      return;
    }
#if FSDP_HAVE_TOKENIZER
    tok.emplace(Tokenizer::load(g.tokenizer));
    if (!g.prompt_text.empty()) {
      auto ids = tok->encode(g.prompt_text);
      // As transformers' tokenizer(prompt): the post-processor's leading special tokens (Llama's BOS),
      // unless the prompt already begins with them.
      const auto& lead = tok->leading_special_ids();
      const bool begins_so = ids.size() >= lead.size() && std::equal(lead.begin(), lead.end(), ids.begin());
      if (!begins_so) ids.insert(ids.begin(), lead.begin(), lead.end());
      g.options.prompt.assign(ids.begin(), ids.end());
    }
#else
    throw DeckError("fsdp-generate: this build has no tokenizer (ICU was not found): give the prompt as --ids");
#endif
  });
  return tok;
}

/// `ids` as text; an id the tokenizer lacks (a model vocabulary padded past it) shows as <id>, bytes
/// that are not UTF-8 (a sequence cut short) as U+FFFD.
inline std::string decoded(const PromptTokenizer& tok, const std::vector<std::int32_t>& ids) {
#if FSDP_HAVE_TOKENIZER
  try {
    return printable_utf8(tok.decode(ids));
  } catch (const TokenizerError&) {
    std::string text;
    for (const auto id : ids) {
      try {
        text += tok.decode({id});
      } catch (const TokenizerError&) {
        text += "<" + std::to_string(id) + ">";
      }
    }
    return printable_utf8(text);
  }
#else
  (void)tok;
  (void)ids;
  return {};
#endif
}

/// fsdp-generate: the deck's model (as --eval-only loads it) continues the prompt; rank 0 prints.
template <class Comm>
int generate_text(Trainer<Comm>& trainer, MpiComm& world, const RunConfig& cfg, GenerateRequest& g) {
  const auto tok = prepare_prompt(world, g);
  on_all_ranks(world, [&] {
    if (!model_family(cfg.model.kind).language_model())
      throw DeckError("fsdp-generate: model.kind \"" + to_string(cfg.model.kind) + "\" is not a language model");
    if (g.options.prompt.empty()) throw DeckError("fsdp-generate: an empty prompt (give --prompt with --tokenizer, or --ids)");
    if (static_cast<std::int64_t>(g.options.prompt.size()) >= cfg.model.context)
      throw DeckError("fsdp-generate: the prompt has " + std::to_string(g.options.prompt.size()) + " tokens, model.context is " +
                      std::to_string(cfg.model.context));
    for (const auto id : g.options.prompt)
      if (id < 0 || id >= cfg.model.vocab_size)
        throw DeckError("fsdp-generate: token " + std::to_string(id) + " of the prompt is not below model.vocab_size " +
                        std::to_string(cfg.model.vocab_size));
  });
  if (g.stop_at_eos) g.options.stop_tokens = cfg.model.eos_token_ids;
  const auto out = trainer.generate(g.options);
  if (world.rank() != 0) return 0;
  const auto& o = g.options;
  const std::string how = o.temperature <= 0 ? "greedy"
                                             : "temperature " + std::to_string(o.temperature) + ", top-k " + std::to_string(o.top_k) + ", top-p " +
                                                   std::to_string(o.top_p) + ", seed " + std::to_string(o.seed);
  std::printf("generated %zu tokens after a prompt of %zu (%s), %s, %d rank(s): %.1f tokens/s\n", out.tokens.size(), o.prompt.size(), how.c_str(),
              out.cached ? "KV cache" : "no KV cache", world.size(), out.seconds > 0 ? static_cast<double>(out.tokens.size()) / out.seconds : 0.0);
  std::string ids;
  for (const auto t : out.tokens) ids += (ids.empty() ? "" : " ") + std::to_string(t);
  std::printf("ids: %s\n", ids.c_str());
  if (tok) {
    std::vector<std::int32_t> all(o.prompt.begin(), o.prompt.end());
    all.insert(all.end(), out.tokens.begin(), out.tokens.end());
    const std::string text = decoded(*tok, all);
    std::printf("text:\n");
    std::fwrite(text.data(), 1, text.size(), stdout);  // whole, NUL bytes included
    std::printf("\n");
  }
  return 0;
}

}  // namespace fsdp::app
