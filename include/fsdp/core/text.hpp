// fsdp core (std only): hashes and short texts that every layer builds the same way.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace fsdp {

/// 64-bit FNV-1a, constexpr; used for plan hashes that must agree across ranks and runs.
constexpr std::uint64_t fnv1a64(std::string_view text, std::uint64_t seed = 14695981039346656037ull) noexcept {
  std::uint64_t h = seed;
  for (char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

/// The integers of `values` separated by commas ("0,2,3"), for messages and keys.
template <class Integers>
std::string comma_separated(const Integers& values) {
  std::string text;
  bool first = true;
  for (const auto v : values) {
    // Appended piece by piece: `(first ? "" : ",") + std::to_string(v)` trips GCC 12's
    // -Wstringop-overflow false positive on the inlined string insert.
    if (!first) text += ',';
    text += std::to_string(v);
    first = false;
  }
  return text;
}

}  // namespace fsdp
