// libFuzzer target: the input-deck parser. Any text must either parse or fail with a DeckError (a
// ConfigError); a parsed deck must survive the to_toml() round trip with the same values.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "deck.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  fsdp::app::Deck deck;
  try {
    deck = fsdp::app::Deck::parse(text, "fuzz.toml");
  } catch (const fsdp::ConfigError&) {
    return 0;  // rejected with a clear error: fine
  }
  const auto again = fsdp::app::Deck::parse(deck.to_toml(), "fuzz-roundtrip.toml");
  for (std::size_t i = 0; i < deck.entries().size(); ++i)
    if (deck.entries()[i].value != again.entries()[i].value) std::abort();  // the echo must re-run the same job
  return 0;
}
