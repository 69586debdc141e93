// Hugging Face tokenizer.json, byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2): encode and decode.
// Plain C++20 with ICU (Unicode regular expressions and NFC) and nlohmann-json; no LibTorch, no MPI.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/errors.hpp"

namespace fsdp::app {

/// A tokenizer file that cannot be read or is of a kind not supported; text that is not UTF-8. Id
/// "fsdp.tokenizer".
class TokenizerError : public fsdp::ConfigError {
 public:
  explicit TokenizerError(const std::string& what) : ConfigError(what, "fsdp.tokenizer") {}
};

/// The byte offset of the first sequence in `text` that is not UTF-8; nullopt when it all is.
std::optional<std::size_t> first_invalid_utf8(std::string_view text);

/// `bytes` with each sequence that is not UTF-8 replaced by U+FFFD (as transformers decodes).
std::string printable_utf8(std::string_view bytes);

/// A byte-level BPE tokenizer as the `tokenizers` library defines it in tokenizer.json:
///  - normalizer: none or NFC;
///  - pre_tokenizer: ByteLevel (its GPT-2 regular expression when use_regex, add_prefix_space), a
///    Split on a regular expression (behavior Isolated, not inverted), Digits (SmolLM2's: each digit
///    a piece of its own, or runs of digits), or a Sequence of those;
///  - model: BPE with vocab and merges (as "a b" strings or ["a", "b"] pairs), ignore_merges; no
///    dropout, byte fallback, subword prefix or word suffix;
///  - added_tokens: matched in the text before anything else (leftmost, longest first), whatever the
///    normalizer does.
/// Anything else is a TokenizerError naming the file and the key. The post-processor (BOS/EOS
/// templates) is not applied by encode: fsdp-tokenize separates documents itself; fsdp-generate puts
/// leading_special_ids() before a text prompt. Thread-safe after load.
class Tokenizer {
 public:
  /// Reads `path` (a tokenizer.json, or a folder holding one).
  static Tokenizer load(const std::string& path);
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  /// The ids of `text` (UTF-8; TokenizerError naming the byte offset of the first invalid sequence).
  std::vector<std::int32_t> encode(std::string_view text) const;
  /// The UTF-8 bytes of `ids` (added tokens as their text); an id outside the vocabulary is a TokenizerError.
  std::string decode(const std::vector<std::int32_t>& ids) const;
  /// One more than the largest id (of the vocabulary and the added tokens).
  std::int64_t vocab_size() const noexcept;
  /// The id of a token by its text (a vocabulary entry as written in the file, or an added token).
  std::optional<std::int32_t> token_id(std::string_view token) const;
  /// Where it was read from.
  const std::string& path() const noexcept;
  /// The special tokens the file's post-processor (TemplateProcessing) puts before a text, as
  /// `tokenizer(text)` does in transformers: Llama 3's <|begin_of_text|>; empty for GPT-2's.
  const std::vector<std::int32_t>& leading_special_ids() const noexcept;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp::app
