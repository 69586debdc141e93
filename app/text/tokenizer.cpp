// Byte-level BPE from a Hugging Face tokenizer.json (tokenizer.hpp).
#include "text/tokenizer.hpp"

#include <unicode/normalizer2.h>
#include <unicode/regex.h>
#include <unicode/unistr.h>
#include <unicode/utf8.h>

#include <algorithm>
#include <array>
#include <climits>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <unordered_map>

namespace fsdp::app {
namespace {

using json = nlohmann::json;

/// The regular expression of the ByteLevel pre-tokenizer with use_regex (GPT-2's).
constexpr std::string_view kByteLevelPattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string utf8_of(char32_t cp) {
  std::string out;
  icu::UnicodeString(static_cast<UChar32>(cp)).toUTF8String(out);
  return out;
}

/// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for 256, 257, ... in
/// byte order, so that every byte is a visible character of the vocabulary.
std::array<char32_t, 256> byte_code_points() {
  std::array<char32_t, 256> cp{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    cp[static_cast<std::size_t>(b)] = printable ? static_cast<char32_t>(b) : next++;
  }
  return cp;
}

std::string to_utf8(const icu::UnicodeString& s) {
  std::string out;
  s.toUTF8String(out);
  return out;
}

/// The pieces of `text` that `pattern` matches and the gaps between them, in order (tokenizers'
/// Split with behavior "Isolated").
std::vector<std::string> split_isolated(const std::string& text, const icu::RegexPattern& pattern) {
  const icu::UnicodeString u = icu::UnicodeString::fromUTF8(text);
  UErrorCode status = U_ZERO_ERROR;
  std::unique_ptr<icu::RegexMatcher> m(pattern.matcher(u, status));
  // ICU's backtracking stack stops at 8 MB by default: \s+(?!\S) over a run of some 400,000 spaces
  // or newlines would fail where tokenizers encodes it. No limit (a finite one of 1 GiB still failed
  // at 600,000 newlines): it grows with the run, on the heap, as tokenizers' own does.
  if (U_SUCCESS(status)) m->setStackLimit(0, status);
  if (U_FAILURE(status)) throw TokenizerError(std::string("cannot match the pre-tokenizer's expression: ") + u_errorName(status));
  std::vector<std::string> pieces;
  int32_t at = 0;
  while (m->find(status) && U_SUCCESS(status)) {
    const int32_t begin = m->start(status), end = m->end(status);
    if (end == begin) continue;  // an empty match splits nothing
    if (begin > at) pieces.push_back(to_utf8(u.tempSubStringBetween(at, begin)));
    pieces.push_back(to_utf8(u.tempSubStringBetween(begin, end)));
    at = end;
  }
  if (U_FAILURE(status)) throw TokenizerError(std::string("cannot match the pre-tokenizer's expression: ") + u_errorName(status));
  if (at < u.length()) pieces.push_back(to_utf8(u.tempSubStringBetween(at)));
  return pieces;
}

/// The UTF-8 characters of `s`, each as its own string.
std::vector<std::string> characters(const std::string& s) {
  std::vector<std::string> out;
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const auto n = static_cast<int32_t>(s.size());
  for (int32_t i = 0; i < n;) {
    const int32_t start = i;
    UChar32 c = 0;
    U8_NEXT(p, i, n, c);
    out.emplace_back(s, static_cast<std::size_t>(start), static_cast<std::size_t>(i - start));
  }
  return out;
}

}  // namespace

/// One step of the pre-tokenizer: a split on `regex`, after which (ByteLevel) a space may be prepended.
struct PreStep {
  std::unique_ptr<icu::RegexPattern> regex;  // null: no split
  bool prefix_space = false;                 // ByteLevel's add_prefix_space
};

/// How far past the number of vocabulary entries an id may lie (added tokens after the vocabulary,
/// reserved ranges): further is a damaged file.
constexpr std::int64_t kIdsBeyondVocab = 1 << 20;

struct Tokenizer::Impl {
  std::string path;
  const icu::Normalizer2* nfc = nullptr;  // the NFC normalizer, when the file asks for it
  std::vector<PreStep> steps;
  bool byte_level = false;                    // a ByteLevel step maps the text to byte symbols (required)
  std::int64_t vocab_entries = 0;             // model.vocab's entries: ids past them by more than kIdsBeyondVocab are refused
  std::vector<std::int32_t> leading_special;  // the post-processor's special tokens before a sequence (BOS)
  bool ignore_merges = false;
  std::optional<std::int32_t> unk;
  std::unordered_map<std::string, std::int32_t> vocab;
  std::vector<std::string> token_of_id;                           // "" for ids that are not vocabulary entries
  std::unordered_map<std::string, int> merge_rank;                // "left\0right"
  std::vector<std::pair<std::string, std::int32_t>> added;        // longest content first
  std::array<std::vector<std::size_t>, 256> added_by_first_byte;  // indices into `added`, longest first
  std::unordered_map<std::int32_t, std::string> added_content;
  std::array<std::string, 256> byte_symbol;
  std::unordered_map<char32_t, std::uint8_t> symbol_byte;
  std::int64_t size = 0;

  [[noreturn]] void fail(const std::string& key, const std::string& why) const { throw TokenizerError(path + ": " + key + ": " + why); }

  std::unique_ptr<icu::RegexPattern> compile(const std::string& key, std::string_view pattern) const {
    UParseError where{};
    UErrorCode status = U_ZERO_ERROR;
    std::unique_ptr<icu::RegexPattern> p(icu::RegexPattern::compile(icu::UnicodeString::fromUTF8(pattern), 0, where, status));
    if (U_FAILURE(status))
      fail(key, "the regular expression does not compile (" + std::string(u_errorName(status)) + " at offset " + std::to_string(where.offset) + ")");
    return p;
  }

  void add_pre_tokenizer(const json& pt, const std::string& key) {
    const std::string type = pt.value("type", "");
    if (type == "Sequence") {
      const auto& list = pt.at("pretokenizers");
      for (std::size_t i = 0; i < list.size(); ++i) add_pre_tokenizer(list[i], key + ".pretokenizers[" + std::to_string(i) + "]");
    } else if (type == "ByteLevel") {
      byte_level = true;
      PreStep s;
      s.prefix_space = pt.value("add_prefix_space", false);
      if (pt.value("use_regex", true)) s.regex = compile(key, kByteLevelPattern);
      steps.push_back(std::move(s));
    } else if (type == "Digits") {  // digits isolated, one by one or in runs (tokenizers: char::is_numeric, \p{N})
      PreStep s;
      s.regex = compile(key, pt.value("individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)");
      steps.push_back(std::move(s));
    } else if (type == "Split") {
      const auto& pattern = pt.at("pattern");
      if (!pattern.contains("Regex")) fail(key + ".pattern", "only a Regex pattern is supported (a String pattern is not)");
      if (pt.value("behavior", "") != "Isolated") fail(key + ".behavior", "\"" + pt.value("behavior", "") + "\" is not supported (Isolated only)");
      if (pt.value("invert", false)) fail(key + ".invert", "an inverted split is not supported");
      PreStep s;
      s.regex = compile(key + ".pattern.Regex", pattern.at("Regex").get<std::string>());
      steps.push_back(std::move(s));
    } else {
      fail(key + ".type", "\"" + type + "\" is not supported (ByteLevel, Split, Digits, Sequence; byte-level BPE tokenizers only)");
    }
  }

  /// `id` as a token id: an integer from 0 to past the vocabulary's entries by kIdsBeyondVocab
  /// (a damaged file otherwise, not a reason to allocate gigabytes); `key` names it.
  std::int32_t checked_id(const json& id, const std::string& key) const {
    const std::int64_t most = vocab_entries + kIdsBeyondVocab;
    if (!id.is_number_integer() || id.get<std::int64_t>() < 0 || id.get<std::int64_t>() >= most)
      fail(key, id.dump() + " is not a token id (0 to " + std::to_string(most - 1) + " for " + std::to_string(vocab_entries) + " entries)");
    return id.get<std::int32_t>();
  }

  /// The special tokens a TemplateProcessing post-processor puts before a single sequence (Llama's
  /// <|begin_of_text|>, <s>); a Sequence of processors is searched. Others (ByteLevel: offsets only) add none.
  void read_post_processor(const json& pp, const std::string& key) {
    if (!pp.is_object()) return;
    const std::string type = pp.value("type", "");
    if (type == "Sequence") {
      const auto& list = pp.at("processors");
      for (std::size_t i = 0; i < list.size(); ++i) read_post_processor(list[i], key + ".processors[" + std::to_string(i) + "]");
      return;
    }
    if (type != "TemplateProcessing") return;
    const auto special = pp.value("special_tokens", json::object());
    for (const auto& item : pp.at("single")) {
      if (item.contains("Sequence")) break;
      if (!item.contains("SpecialToken")) continue;
      const std::string name = item["SpecialToken"].at("id").get<std::string>();
      if (special.contains(name)) {
        for (const auto& id : special[name].at("ids")) leading_special.push_back(checked_id(id, key + ".special_tokens[\"" + name + "\"].ids"));
      } else {
        fail(key + ".special_tokens", "has no \"" + name + "\", which the single template names");
      }
    }
  }

  void load(const json& j) {
    const auto& model = j.at("model");
    const std::string type = model.value("type", "");
    if (type != "BPE") fail("model.type", "\"" + type + "\" is not supported (byte-level BPE only)");
    if (model.contains("dropout") && !model["dropout"].is_null()) fail("model.dropout", "BPE dropout is not supported");
    if (model.value("byte_fallback", false)) fail("model.byte_fallback", "byte fallback (SentencePiece-style BPE) is not supported");
    if (model.value("fuse_unk", false)) fail("model.fuse_unk", "fusing unknown characters is not supported");
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(k) && model[k].is_string() && !model[k].get<std::string>().empty()) fail(std::string("model.") + k, "is not supported");
    ignore_merges = model.value("ignore_merges", false);
    // Ids index a table of every token: a negative one or one far past the vocabulary's size is a
    // damaged file, not a reason to allocate gigabytes.
    const auto& entries = model.at("vocab");
    vocab_entries = static_cast<std::int64_t>(entries.size());
    for (const auto& [token, id] : entries.items()) {
      vocab.emplace(token, checked_id(id, "model.vocab (\"" + token + "\")"));
      size = std::max<std::int64_t>(size, id.get<std::int64_t>() + 1);
    }
    const auto& merges = model.at("merges");
    for (std::size_t i = 0; i < merges.size(); ++i) {
      std::string left, right;
      if (merges[i].is_string()) {
        const std::string m = merges[i].get<std::string>();
        const auto space = m.find(' ');
        if (space == std::string::npos || m.find(' ', space + 1) != std::string::npos)
          fail("model.merges[" + std::to_string(i) + "]", "\"" + m + "\" is not two symbols separated by one space");
        left = m.substr(0, space);
        right = m.substr(space + 1);
      } else {
        left = merges[i].at(0).get<std::string>();
        right = merges[i].at(1).get<std::string>();
      }
      merge_rank.emplace(left + '\0' + right, static_cast<int>(i));
    }
    for (const auto& a : j.value("added_tokens", json::array())) {
      const std::string content = a.at("content").get<std::string>();
      for (const char* flag : {"lstrip", "rstrip", "single_word"})
        if (a.value(flag, false)) fail("added_tokens (\"" + content + "\")." + flag, "is not supported");
      const auto id = checked_id(a.at("id"), "added_tokens (\"" + content + "\").id");
      added.emplace_back(content, id);
      added_content[id] = content;
      size = std::max<std::int64_t>(size, std::int64_t{id} + 1);
    }
    std::stable_sort(added.begin(), added.end(), [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
    for (std::size_t i = 0; i < added.size(); ++i)
      if (!added[i].first.empty()) added_by_first_byte[static_cast<unsigned char>(added[i].first[0])].push_back(i);
    if (model.contains("unk_token") && model["unk_token"].is_string()) {
      const auto it = vocab.find(model["unk_token"].get<std::string>());
      if (it != vocab.end()) unk = it->second;
    }
    if (j.contains("normalizer") && !j["normalizer"].is_null()) {
      const std::string n = j["normalizer"].value("type", "");
      if (n != "NFC") fail("normalizer.type", "\"" + n + "\" is not supported (none or NFC)");
      UErrorCode status = U_ZERO_ERROR;
      nfc = icu::Normalizer2::getNFCInstance(status);
      if (U_FAILURE(status)) fail("normalizer", std::string("ICU has no NFC normalizer: ") + u_errorName(status));
    }
    if (!j.contains("pre_tokenizer") || j["pre_tokenizer"].is_null()) fail("pre_tokenizer", "is missing: a byte-level BPE needs ByteLevel");
    add_pre_tokenizer(j["pre_tokenizer"], "pre_tokenizer");
    // Without ByteLevel the text would still be read as byte symbols, and every character outside
    // them would become the unknown token without a word.
    if (!byte_level) fail("pre_tokenizer", "has no ByteLevel step: this reader handles byte-level BPE tokenizers only");
    if (j.contains("post_processor")) read_post_processor(j["post_processor"], "post_processor");
    token_of_id.assign(static_cast<std::size_t>(size), "");
    for (const auto& [token, id] : vocab) token_of_id.at(static_cast<std::size_t>(id)) = token;
    const auto cps = byte_code_points();
    for (int b = 0; b < 256; ++b) {
      byte_symbol[static_cast<std::size_t>(b)] = utf8_of(cps[static_cast<std::size_t>(b)]);
      symbol_byte[cps[static_cast<std::size_t>(b)]] = static_cast<std::uint8_t>(b);
    }
  }

  // Pieces seen before (words recur): their ids. Bounded; cleared when full.
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<std::int32_t>> cache;
  static constexpr std::size_t kCacheEntries = 1 << 20;

  /// BPE of one pre-tokenized piece (its bytes already mapped to symbols), appended to `out`.
  void bpe(const std::string& mapped, std::vector<std::int32_t>& out) const {
    {
      const std::lock_guard<std::mutex> lock(cache_mutex);
      if (const auto it = cache.find(mapped); it != cache.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    const std::size_t first = out.size();
    bpe_uncached(mapped, out);
    const std::lock_guard<std::mutex> lock(cache_mutex);
    if (cache.size() >= kCacheEntries) cache.clear();
    cache.emplace(mapped, std::vector<std::int32_t>(out.begin() + static_cast<std::ptrdiff_t>(first), out.end()));
  }

  void bpe_uncached(const std::string& mapped, std::vector<std::int32_t>& out) const {
    if (ignore_merges)
      if (const auto it = vocab.find(mapped); it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    std::vector<std::string> symbols = characters(mapped);
    while (symbols.size() > 1) {
      int best = INT_MAX;
      std::size_t at = 0;
      for (std::size_t i = 0; i + 1 < symbols.size(); ++i)
        if (const auto it = merge_rank.find(symbols[i] + '\0' + symbols[i + 1]); it != merge_rank.end() && it->second < best) {
          best = it->second;
          at = i;
        }
      if (best == INT_MAX) break;
      const std::string left = symbols[at], right = symbols[at + 1];
      std::vector<std::string> merged;
      merged.reserve(symbols.size());
      for (std::size_t i = 0; i < symbols.size();) {
        if (i + 1 < symbols.size() && symbols[i] == left && symbols[i + 1] == right) {
          merged.push_back(left + right);
          i += 2;
        } else {
          merged.push_back(std::move(symbols[i++]));
        }
      }
      symbols = std::move(merged);
    }
    for (const auto& s : symbols) {
      const auto it = vocab.find(s);
      if (it != vocab.end()) {
        out.push_back(it->second);
      } else if (unk) {
        out.push_back(*unk);
      } else {
        throw TokenizerError(path + ": the symbol \"" + s + "\" is not in model.vocab and there is no model.unk_token");
      }
    }
  }

  /// Normalization, pre-tokenization and BPE of text between added tokens.
  void encode_plain(const std::string& text, std::vector<std::int32_t>& out) const {
    if (text.empty()) return;
    std::vector<std::string> pieces{text};
    if (nfc) {
      UErrorCode status = U_ZERO_ERROR;
      pieces[0] = to_utf8(nfc->normalize(icu::UnicodeString::fromUTF8(text), status));
      if (U_FAILURE(status)) throw TokenizerError(path + ": NFC normalization failed: " + u_errorName(status));
    }
    for (const auto& step : steps) {
      if (step.prefix_space)
        for (auto& p : pieces)
          if (p.empty() || p[0] != ' ') p.insert(p.begin(), ' ');
      if (!step.regex) continue;
      std::vector<std::string> next;
      for (const auto& p : pieces)
        for (auto& q : split_isolated(p, *step.regex)) next.push_back(std::move(q));
      pieces = std::move(next);
    }
    for (const auto& p : pieces) {
      std::string mapped;
      for (const char c : p) mapped += byte_symbol[static_cast<unsigned char>(c)];
      bpe(mapped, out);
    }
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& path) {
  namespace fs = std::filesystem;
  auto impl = std::make_unique<Impl>();
  impl->path = fs::is_directory(path) ? (fs::path(path) / "tokenizer.json").string() : path;
  std::ifstream in(impl->path, std::ios::binary);
  if (!in) throw TokenizerError("cannot read the tokenizer '" + impl->path + "'");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    throw TokenizerError(impl->path + ": not JSON: " + e.what());
  }
  try {
    impl->load(j);
  } catch (const json::exception& e) {
    throw TokenizerError(impl->path + ": not a tokenizer.json of the tokenizers library: " + e.what());
  }
  return Tokenizer(std::move(impl));
}

std::optional<std::size_t> first_invalid_utf8(std::string_view text) {
  const auto* p = reinterpret_cast<const uint8_t*>(text.data());
  const auto n = static_cast<int64_t>(text.size());
  for (int64_t i = 0; i < n;) {
    const int64_t start = i;
    UChar32 c = 0;
    U8_NEXT(p, i, n, c);
    if (c < 0) return static_cast<std::size_t>(start);
  }
  return std::nullopt;
}

std::vector<std::int32_t> Tokenizer::encode(std::string_view text) const {
  if (const auto bad = first_invalid_utf8(text)) throw TokenizerError("the text is not UTF-8 at byte offset " + std::to_string(*bad));
  std::vector<std::int32_t> out;
  std::size_t at = 0, plain = 0;
  while (at < text.size()) {
    const std::pair<std::string, std::int32_t>* hit = nullptr;
    for (const std::size_t k : impl_->added_by_first_byte[static_cast<unsigned char>(text[at])]) {  // longest first
      const auto& a = impl_->added[k];
      if (text.compare(at, a.first.size(), a.first) == 0) {
        hit = &a;
        break;
      }
    }
    if (!hit) {
      ++at;
      continue;
    }
    impl_->encode_plain(std::string(text.substr(plain, at - plain)), out);
    out.push_back(hit->second);
    at += hit->first.size();
    plain = at;
  }
  impl_->encode_plain(std::string(text.substr(plain)), out);
  return out;
}

std::string Tokenizer::decode(const std::vector<std::int32_t>& ids) const {
  std::string out;
  for (const auto id : ids) {
    if (const auto it = impl_->added_content.find(id); it != impl_->added_content.end()) {
      out += it->second;
      continue;
    }
    if (id < 0 || id >= impl_->size || impl_->token_of_id[static_cast<std::size_t>(id)].empty())
      throw TokenizerError(impl_->path + ": token id " + std::to_string(id) + " is not in the vocabulary");
    const std::string& token = impl_->token_of_id[static_cast<std::size_t>(id)];
    std::string bytes;
    bool mapped = true;
    const icu::UnicodeString u = icu::UnicodeString::fromUTF8(token);
    for (int32_t i = 0; i < u.length() && mapped;) {
      const UChar32 c = u.char32At(i);
      const auto it = impl_->symbol_byte.find(static_cast<char32_t>(c));
      if (it == impl_->symbol_byte.end())
        mapped = false;
      else
        bytes += static_cast<char>(it->second);
      i += U16_LENGTH(c);
    }
    out += mapped ? bytes : token;  // a token of characters outside the byte map stands for itself (as tokenizers decodes it)
  }
  return out;
}

std::int64_t Tokenizer::vocab_size() const noexcept { return impl_->size; }

std::optional<std::int32_t> Tokenizer::token_id(std::string_view token) const {
  for (const auto& [content, id] : impl_->added)
    if (content == token) return id;
  const auto it = impl_->vocab.find(std::string(token));
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

const std::string& Tokenizer::path() const noexcept { return impl_->path; }

const std::vector<std::int32_t>& Tokenizer::leading_special_ids() const noexcept { return impl_->leading_special; }

std::string printable_utf8(std::string_view bytes) {
  // One U+FFFD per maximal ill-formed subpart, as Python's and Rust's lossy decoders (ICU's U8_NEXT
  // consumes exactly that).
  std::string out;
  const auto* s = reinterpret_cast<const uint8_t*>(bytes.data());
  const auto n = static_cast<int32_t>(std::min<std::size_t>(bytes.size(), INT32_MAX));
  for (int32_t i = 0; i < n;) {
    const int32_t start = i;
    UChar32 c = 0;
    U8_NEXT(s, i, n, c);
    if (c < 0)
      out += "\xEF\xBF\xBD";
    else
      out.append(bytes.substr(static_cast<std::size_t>(start), static_cast<std::size_t>(i - start)));
  }
  return out;
}

}  // namespace fsdp::app
