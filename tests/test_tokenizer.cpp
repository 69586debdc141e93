// Hugging Face byte-level BPE (app/text/tokenizer.hpp) on tokenizer.json files this test writes, with
// hand-checked ids: merges by rank, GPT-2's and Llama 3's pre-tokenizer expressions (whitespace runs,
// digit groups, contractions), added tokens inside text, UTF-8 byte symbols, NFC, ignore_merges, both
// ways of writing merges, decoding, and the errors that name the file, key or byte offset. The whole
// pipeline against an independent Python implementation: tokenize_e2e.
#define BOOST_TEST_MODULE fsdp_tokenizer
#include <boost/test/unit_test.hpp>

#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data_test_helpers.hpp"
#include "text/tokenizer.hpp"

using fsdp::app::printable_utf8;
using fsdp::app::Tokenizer;
using fsdp::app::TokenizerError;
using fsdp::test::TempDir;
using json = nlohmann::json;
using Ids = std::vector<std::int32_t>;

namespace {

const char* kLlama3Pattern = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

/// GPT-2's byte symbol of byte `b` (bytes_to_unicode), as UTF-8.
std::string symbol(int b) {
  int next = 256;
  for (int x = 0; x < 256; ++x) {
    const bool printable = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255);
    const int cp = printable ? x : next++;
    if (x == b) {
      std::string out;
      if (cp < 0x80) {
        out += static_cast<char>(cp);
      } else {
        out += static_cast<char>(0xC0 | (cp >> 6));
        out += static_cast<char>(0x80 | (cp & 0x3F));
      }
      return out;
    }
  }
  return "";
}

/// A tokenizer.json: the 256 byte symbols with id = byte value, then one id per merge (256, 257, ...)
/// and `extra` vocabulary entries; <|endoftext|> is the added token 1000.
json tokenizer_json(const std::vector<std::pair<std::string, std::string>>& merges, bool pairs = false,
                    const std::vector<std::pair<std::string, int>>& extra = {}) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[symbol(b)] = b;
  json m = json::array();
  int id = 256;
  for (const auto& [a, b] : merges) {
    vocab[a + b] = id++;
    m.push_back(pairs ? json::array({a, b}) : json(a + " " + b));
  }
  for (const auto& [token, i] : extra) vocab[token] = i;
  return {{"version", "1.0"},
          {"added_tokens", json::array({{{"id", 1000}, {"content", "<|endoftext|>"}, {"special", true}}})},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
          {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"vocab", vocab}, {"merges", m}}}};
}

std::string write(const TempDir& dir, const std::string& name, const json& j) {
  const std::string path = dir / name;
  std::ofstream(path) << j.dump();
  return path;
}

// Ġ is the space's symbol; "Ġt he" builds " the".
const std::vector<std::pair<std::string, std::string>> kMerges = {{"Ġ", "t"}, {"h", "e"}, {"Ġt", "he"}, {"l", "l"}, {"he", "ll"}};

template <class F>
void expect_tokenizer_error(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    BOOST_ERROR("no TokenizerError; expected one containing '" << parts.front() << "'");
  } catch (const TokenizerError& e) {
    const std::string what = e.what();
    BOOST_TEST(e.id() == "fsdp.tokenizer");
    for (const auto& p : parts) BOOST_TEST(what.find(p) != std::string::npos, "'" << p << "' not in: " << what);
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(gpt2_byte_level_bpe_by_hand) {
  TempDir dir;
  const auto tok = Tokenizer::load(write(dir, "tokenizer.json", tokenizer_json(kMerges)));
  BOOST_TEST(tok.vocab_size() == 1001);
  // h e l l o: "he" (rank 1), then "ll" (3), then "hell" (4); o stays.
  BOOST_TEST(tok.encode("hello") == (Ids{260, 'o'}), boost::test_tools::per_element());
  BOOST_TEST(tok.encode(" the") == (Ids{258}), boost::test_tools::per_element());
  // Two spaces before a word: the first is a piece of its own (\s+(?!\S)), the second begins " world".
  BOOST_TEST(tok.encode("hello the  world") == (Ids{260, 'o', 258, ' ', ' ', 'w', 'o', 'r', 'l', 'd'}), boost::test_tools::per_element());
  // Trailing whitespace, a digit run (one piece), a contraction.
  BOOST_TEST(tok.encode("it's 2026  ") == (Ids{'i', 't', '\'', 's', ' ', '2', '0', '2', '6', ' ', ' '}), boost::test_tools::per_element());
  // Added tokens are matched in the text before anything else.
  BOOST_TEST(tok.encode("a<|endoftext|> the") == (Ids{'a', 1000, 258}), boost::test_tools::per_element());
  // é is two UTF-8 bytes, each its own symbol: 0xC3 and 0xA9.
  BOOST_TEST(tok.encode("\xC3\xA9") == (Ids{0xC3, 0xA9}), boost::test_tools::per_element());
  // Without NFC a decomposed é stays e + U+0301 (0xCC 0x81).
  BOOST_TEST(tok.encode("e\xCC\x81") == (Ids{'e', 0xCC, 0x81}), boost::test_tools::per_element());
  // Decoding gives the bytes back, added tokens as their text.
  for (const std::string s : {"hello the  world", "a<|endoftext|> the", "\xF0\x9F\x99\x82 \xD0\x9F\xD1\x80\xD0\xB8", "\t\r\n x"})
    BOOST_TEST(tok.decode(tok.encode(s)) == s);
  BOOST_TEST(*tok.token_id("<|endoftext|>") == 1000);
  BOOST_TEST(*tok.token_id("Ġthe") == 258);
  BOOST_TEST(!tok.token_id("nope"));
  expect_tokenizer_error(
      [&] {
        tok.encode(
            "ab\xFF"
            "cd");
      },
      {"not UTF-8 at byte offset 2"});
  expect_tokenizer_error([&] { tok.decode({999}); }, {"token id 999 is not in the vocabulary"});
  // A folder holding tokenizer.json names the same file.
  BOOST_TEST(Tokenizer::load(dir.path.string()).encode("hello") == tok.encode("hello"), boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(llama3_split_nfc_ignore_merges_and_pair_merges) {
  TempDir dir;
  // Llama 3's expression before a ByteLevel without its own; merges written as pairs; "Ġworld" is in
  // the vocabulary without a merge path: ignore_merges takes it whole.
  auto merges = kMerges;
  merges.emplace_back("'", "R");  // 261 and 262: merges only inside one piece, so they show where the pieces end
  merges.emplace_back("E", "X");
  auto j = tokenizer_json(merges, /*pairs=*/true, {{"Ġworld", 300}});
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers", json::array({{{"type", "Split"}, {"pattern", {{"Regex", kLlama3Pattern}}}, {"behavior", "Isolated"}, {"invert", false}},
                                     {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
  j["model"]["ignore_merges"] = true;
  j["normalizer"] = {{"type", "NFC"}};
  const auto tok = Tokenizer::load(write(dir, "llama3.json", j));
  // Digits in groups of at most three.
  BOOST_TEST(tok.encode("1234567") == (Ids{'1', '2', '3', '4', '5', '6', '7'}), boost::test_tools::per_element());
  BOOST_TEST(tok.encode(" world") == (Ids{300}), boost::test_tools::per_element());
  // Contractions are matched whatever their case: "they", "'RE" (one piece), " the"; "they" merges "he".
  BOOST_TEST(tok.encode("they'RE the") == (Ids{'t', 257, 'y', 261, 'E', 258}), boost::test_tools::per_element());
  // The contraction ends the piece ("'RE", then "X": no EX merge); without one, punctuation and the
  // letters after it are one piece ("'RAX").
  BOOST_TEST(tok.encode("'REX") == (Ids{261, 'E', 'X'}), boost::test_tools::per_element());
  BOOST_TEST(tok.encode("'REEX") == (Ids{261, 'E', 262}), boost::test_tools::per_element());
  BOOST_TEST(tok.encode("'RAX") == (Ids{261, 'A', 'X'}), boost::test_tools::per_element());
  // NFC: the decomposed é becomes the precomposed one.
  BOOST_TEST(tok.encode("e\xCC\x81") == (Ids{0xC3, 0xA9}), boost::test_tools::per_element());
  // Line ends stay with what precedes them ([\r\n]* after punctuation; \s*[\r\n]+).
  BOOST_TEST(tok.decode(tok.encode("a.\r\n\n b")) == "a.\r\n\n b");
}

BOOST_AUTO_TEST_CASE(smollm2_digits_one_by_one) {
  TempDir dir;
  auto merges = kMerges;
  merges.emplace_back("2", "0");  // 261: a digit merge that Digits(individual_digits) never lets apply
  auto j = tokenizer_json(merges);
  const auto whole = Tokenizer::load(write(dir, "runs.json", j));
  BOOST_TEST(whole.encode("2026") == (Ids{261, '2', '6'}), boost::test_tools::per_element());
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers", json::array({{{"type", "Digits"}, {"individual_digits", true}},
                                                       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}})}};
  const auto digits = Tokenizer::load(write(dir, "digits.json", j));
  BOOST_TEST(digits.encode("2026") == (Ids{'2', '0', '2', '6'}), boost::test_tools::per_element());
  BOOST_TEST(digits.encode("x20 the") == (Ids{'x', '2', '0', 258}), boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(unsupported_tokenizers_are_named) {
  TempDir dir;
  expect_tokenizer_error([&] { Tokenizer::load(dir / "missing.json"); }, {"cannot read the tokenizer", "missing.json"});
  std::ofstream(dir / "garbage.json") << "{not json";
  expect_tokenizer_error([&] { Tokenizer::load(dir / "garbage.json"); }, {"garbage.json: not JSON"});
  auto check = [&](const std::string& name, json j, const std::vector<std::string>& parts) {
    BOOST_TEST_CONTEXT(name) {
      expect_tokenizer_error([&] { Tokenizer::load(write(dir, name + ".json", j)); }, parts);
    }
  };
  auto j = tokenizer_json(kMerges);
  j["model"]["type"] = "Unigram";
  check("unigram", j, {"unigram.json: model.type: \"Unigram\" is not supported"});
  j = tokenizer_json(kMerges);
  j["model"]["byte_fallback"] = true;
  check("fallback", j, {"model.byte_fallback", "SentencePiece"});
  j = tokenizer_json(kMerges);
  j["pre_tokenizer"] = {{"type", "Metaspace"}};
  check("metaspace", j, {"pre_tokenizer.type: \"Metaspace\" is not supported"});
  j = tokenizer_json(kMerges);
  j["normalizer"] = {{"type", "Lowercase"}};
  check("lowercase", j, {"normalizer.type: \"Lowercase\" is not supported"});
  j = tokenizer_json(kMerges);
  j["model"]["merges"] = json::array({"a b c"});
  check("merges", j, {"model.merges[0]", "\"a b c\" is not two symbols"});
  j = tokenizer_json(kMerges);
  j["added_tokens"][0]["lstrip"] = true;
  check("lstrip", j, {"added_tokens (\"<|endoftext|>\").lstrip: is not supported"});
  j = tokenizer_json(kMerges);
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  check("regex", j, {"pre_tokenizer.pattern.Regex: the regular expression does not compile"});
  j = tokenizer_json(kMerges);
  j["model"].erase("vocab");
  check("novocab", j, {"novocab.json: not a tokenizer.json of the tokenizers library"});
}

BOOST_AUTO_TEST_CASE(what_would_give_other_ids_is_refused_by_name) {
  TempDir dir;
  auto check = [&](const std::string& name, json j, const std::vector<std::string>& parts) {
    BOOST_TEST_CONTEXT(name) {
      expect_tokenizer_error([&] { Tokenizer::load(write(dir, name + ".json", j)); }, parts);
    }
  };
  // A BPE whose pre-tokenizer has no ByteLevel step reads text as characters, not byte symbols.
  auto j = tokenizer_json(kMerges);
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", R"(\s+)"}}}, {"behavior", "Isolated"}};
  check("split_only", j, {"split_only.json: pre_tokenizer: has no ByteLevel step"});
  j = tokenizer_json(kMerges);
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", json::array()}};
  check("empty_sequence", j, {"pre_tokenizer: has no ByteLevel step"});
  j = tokenizer_json(kMerges);
  j["model"]["fuse_unk"] = true;
  check("fuse_unk", j, {"model.fuse_unk: fusing unknown characters is not supported"});
  // Ids that would index past any table: named, never an allocation of billions of entries.
  j = tokenizer_json(kMerges);
  j["model"]["vocab"]["neg"] = -5;
  check("negative_id", j, {"model.vocab (\"neg\"): -5 is not a token id"});
  j = tokenizer_json(kMerges);
  j["added_tokens"][0]["id"] = 3000000000LL;
  check("huge_id", j, {"added_tokens (\"<|endoftext|>\").id: 3000000000 is not a token id"});
  // A TemplateProcessing post-processor's leading special tokens (Llama 3's BOS), also inside a Sequence.
  j = tokenizer_json(kMerges);
  j["added_tokens"].push_back({{"id", 1001}, {"content", "<|begin_of_text|>"}, {"special", true}});
  j["post_processor"] = {
      {"type", "Sequence"},
      {"processors", json::array({{{"type", "ByteLevel"}},
                                  {{"type", "TemplateProcessing"},
                                   {"single", json::array({{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
                                                           {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
                                   {"special_tokens", {{"<|begin_of_text|>", {{"id", "<|begin_of_text|>"}, {"ids", json::array({1001})}}}}}}})}};
  BOOST_TEST((Tokenizer::load(write(dir, "bos.json", j)).leading_special_ids() == std::vector<std::int32_t>{1001}));
  BOOST_TEST(Tokenizer::load(write(dir, "plain.json", tokenizer_json(kMerges))).leading_special_ids().empty());
}

BOOST_AUTO_TEST_CASE(long_whitespace_runs_and_broken_utf8_in_output) {
  TempDir dir;
  const auto tok = Tokenizer::load(write(dir, "t.json", tokenizer_json(kMerges)));
  // ICU's default backtracking stack ended at some 400,000 newlines.
  const std::string text = std::string(600000, '\n') + "x";
  const auto ids = tok.encode(text);
  BOOST_TEST(tok.decode(ids) == text);
  // Bytes that are not UTF-8 print as U+FFFD, one for a sequence cut short.
  BOOST_TEST(printable_utf8("H\xF0\x9F\x87") == "H\xEF\xBF\xBD");
  BOOST_TEST(printable_utf8("a\xC3(b") == "a\xEF\xBF\xBD(b");
  // One per maximal ill-formed subpart, as Python's errors="replace": an overlong form and a
  // surrogate byte by byte.
  BOOST_TEST(printable_utf8("\xC0\x80") == "\xEF\xBF\xBD\xEF\xBF\xBD");
  BOOST_TEST(printable_utf8("\xED\xA0\x80") == "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  BOOST_TEST(printable_utf8(std::string("a\0b", 3)) == std::string("a\0b", 3));
}
