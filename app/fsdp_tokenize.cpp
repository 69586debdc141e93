// fsdp-tokenize: text to llm.c token shards with a Hugging Face tokenizer.json, in parallel over ranks.
//   mpirun -np N fsdp-tokenize --tokenizer smollm2/tokenizer.json --out data/corpus [--val-fraction 0.01]
//                              [--separator "<|endoftext|>"] [--text-key text] [--shard-tokens 100000000] INPUT...
// Documents: each .jsonl / .json input holds one JSON object per line (its --text-key string is the
// document); any other input is one document. Every document is preceded by the separator token (as
// llm.c's scripts do). Document i goes to validation when ceil((i + 1) f) > ceil(i f) for
// --val-fraction f: the first document and then every 1/f-th (evenly spread; the same at every world
// size; never none when f > 0). Output: OUT_train_000000.bin, ...
// and OUT_val_000000.bin, ... as llm.c shards (uint16 below a vocabulary of 65537, else uint32), the
// same bytes at any number of ranks. Rank r tokenizes the r-th contiguous block of documents and
// writes its tokens into the shards at their places; the shards are published (renamed in) only once
// every rank has written and synced its part. Errors (a bad tokenizer, input that is not UTF-8 or
// JSON, existing outputs) end every rank with exit 2 naming the file, line and byte offset.
#include <fcntl.h>
#include <glob.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "data.hpp"
#include "fsdp/comm/agree.hpp"
#include "fsdp/comm/mpi_comm.hpp"
#include "fsdp/output_file.hpp"
#include "text/tokenizer.hpp"

using namespace fsdp::app;
namespace fs = std::filesystem;

namespace {

constexpr int kExitFailure = 1, kExitBadInput = 2;

/// A problem every rank agrees on: exit 2 (bad input) or 1 (an output that could not be written).
struct Agreed {
  std::string message;
  int code;
};

/// Runs `f` on every rank; if any rank failed, every rank throws the lowest failing rank's message.
template <class F>
void on_all_ranks(fsdp::MpiComm& world, F&& f) {
  std::optional<std::string> error;
  bool output = false;
  try {
    f();
  } catch (const fsdp::OutputError& e) {
    error = e.what();
    output = true;
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (const auto failure = fsdp::agree_on_failure(world, error, output))
    throw Agreed{failure->message, failure->flagged ? kExitFailure : kExitBadInput};
}

bool is_json_lines(const std::string& path) { return path.ends_with(".jsonl") || path.ends_with(".json"); }

/// Documents per input: one for a text file, its non-empty lines for JSON lines.
std::int64_t count_documents(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec))
    throw fsdp::ConfigError("input '" + path + "' is a folder: give the files in it (e.g. " + (fs::path(path) / "*.jsonl").string() + ")",
                            "fsdp.tokenize");
  // Every input is read twice (counted here, then read by the rank its documents fall to): a pipe,
  // a device or stdin would be consumed by the first read, or belong to rank 0 alone.
  if (fs::exists(path, ec) && !fs::is_regular_file(path, ec))
    throw fsdp::ConfigError("input '" + path + "' is not a regular file (a pipe, a device or stdin): fsdp-tokenize reads each input twice, on " +
                                "any rank; write it to a file first",
                            "fsdp.tokenize");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw fsdp::ConfigError("cannot read input '" + path + "': " + std::strerror(errno), "fsdp.tokenize");
  if (!is_json_lines(path)) return 1;
  std::int64_t n = 0;
  for (std::string line; std::getline(in, line);) n += line.find_first_not_of(" \t\r") != std::string::npos;
  if (in.bad())
    throw fsdp::ConfigError("cannot read input '" + path + "': a read error after " + std::to_string(n) + " document(s)", "fsdp.tokenize");
  return n;
}

/// The shard files of one split: the tokens [k S, (k + 1) S) of the split in shard k.
struct Split {
  std::string name;                   // "train" / "val"
  std::int64_t total = 0, first = 0;  // tokens of all ranks; where this rank's begin
  std::vector<std::int32_t> tokens;   // this rank's, in document order
};

std::string shard_path(const std::string& out, const std::string& split, std::int64_t k) {
  char suffix[32];
  std::snprintf(suffix, sizeof suffix, "_%s_%06lld.bin", split.c_str(), static_cast<long long>(k));
  return out + suffix;
}
std::string temporary(const std::string& path) {
  const fs::path p(path);
  return (p.parent_path() / ("." + p.filename().string() + ".tmp")).string();
}

/// Rank 0's shards while it creates and publishes them (temporary and final names), for a signal to
/// take back: the first `renamed` are published under their final names, the rest are temporaries.
/// `armed` while there is something to take back. A global, filled before it is armed and kept to the
/// end: a signal on another thread may still read it after the run disarmed it.
struct ShardsInFlight {
  std::vector<std::pair<std::string, std::string>> shards;
  std::atomic<std::size_t> renamed{0};
  std::atomic<bool> armed{false};
};
ShardsInFlight shards_in_flight;
static_assert(std::atomic<bool>::is_always_lock_free && std::atomic<std::size_t>::is_always_lock_free);

/// SIGINT, SIGTERM, SIGHUP: no shard stays behind, temporary or half of a corpus, then the signal's own
/// end (its exit status). Only async-signal-safe calls: unlink, signal, raise.
extern "C" void remove_shards_and_end(int signal_number) {
  if (shards_in_flight.armed.load()) {
    const auto& shards = shards_in_flight.shards;
    const std::size_t renamed = shards_in_flight.renamed.load();
    for (std::size_t i = 0; i < shards.size(); ++i) ::unlink((i < renamed ? shards[i].second : shards[i].first).c_str());
  }
  ::signal(signal_number, SIG_DFL);
  ::raise(signal_number);
}

/// `text` matched literally by glob(3): its wildcards and backslashes escaped (an --out may hold them).
std::string glob_literal(const std::string& text) {
  std::string out;
  for (const char c : text) {
    if (c == '*' || c == '?' || c == '[' || c == ']' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

/// Removes `.OUT_{train,val}_*.bin.tmp`: an interrupted run's (killed before it could) or a failed one's.
/// Returns how many there were.
std::size_t remove_temporaries(const std::string& out) {
  std::size_t removed = 0;
  for (const char* split : {"train", "val"}) {
    glob_t g{};
    const std::string prefix = (fs::path(out).parent_path() / ("." + fs::path(out).filename().string() + "_" + split + "_")).string();
    const std::string pattern = glob_literal(prefix) + "*.bin.tmp";
    if (::glob(pattern.c_str(), 0, nullptr, &g) == 0)
      for (std::size_t i = 0; i < g.gl_pathc; ++i) removed += std::remove(g.gl_pathv[i]) == 0;
    ::globfree(&g);
  }
  return removed;
}

void write_at(int fd, const void* data, std::size_t bytes, off_t offset, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, p, bytes, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw fsdp::OutputError("cannot write " + path + ": " + std::strerror(n < 0 ? errno : EIO));
    p += n;
    bytes -= static_cast<std::size_t>(n);
    offset += n;
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App cli{"fsdp-tokenize: text to llm.c token shards with a Hugging Face tokenizer.json, in parallel over ranks", "fsdp-tokenize"};
  std::string tokenizer_path, out, separator, text_key = "text";
  std::vector<std::string> inputs;
  double val_fraction = 0.01;
  std::int64_t shard_tokens = 100'000'000;
  cli.add_option("--tokenizer", tokenizer_path, "tokenizer.json (or the folder holding it)")->required();
  cli.add_option("--out", out, "output prefix: OUT_train_000000.bin, OUT_val_000000.bin, ...")->required();
  cli.add_option("--val-fraction", val_fraction, "share of the documents for validation, spread evenly (0: none)")->check(CLI::Range(0.0, 1.0));
  cli.add_option("--separator", separator, "token before every document (default: <|endoftext|> where the tokenizer has it)");
  cli.add_option("--text-key", text_key, "the text's key in JSON lines inputs");
  cli.add_option("--shard-tokens", shard_tokens, "tokens per shard (llm.c's 100M)")->check(CLI::Range(std::int64_t{1}, std::int64_t{2'000'000'000}));
  cli.add_option("INPUT", inputs, "text files (one document each) or .jsonl files (one per line)")->required();
  try {
    cli.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return cli.exit(e) == 0 ? 0 : kExitBadInput;
  }
  // CLI::Range lets NaN through (every comparison with it is false); an empty prefix writes _train_*.
  const std::string prefix = fs::path(out).filename().string();
  if (std::isnan(val_fraction) || prefix.empty() || prefix == "." || prefix == "..") {
    std::fprintf(stderr, "fsdp-tokenize: %s\n",
                 std::isnan(val_fraction)
                     ? "--val-fraction: 'nan' is not a number in [0, 1]"
                     : ("--out '" + out + "': give a prefix for the shards' names (OUT_train_000000.bin), not a folder").c_str());
    return kExitBadInput;
  }
  fsdp::MpiEnvironment env(&argc, &argv);
  struct sigaction on_signal {};
  on_signal.sa_handler = remove_shards_and_end;
  for (const int signal_number : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction before {};
    // An ignored signal stays ignored (nohup, a background job): the run goes on as before.
    if (::sigaction(signal_number, nullptr, &before) == 0 && before.sa_handler == SIG_IGN) continue;
    ::sigaction(signal_number, &on_signal, nullptr);
  }
  auto world = fsdp::MpiComm::world();
  const bool root = world.rank() == 0;
  const int ranks = world.size();
  try {
    const auto start = std::chrono::steady_clock::now();
    std::optional<Tokenizer> tok;
    std::int32_t separator_id = 0;
    on_all_ranks(world, [&] {
      tok.emplace(Tokenizer::load(tokenizer_path));
      const std::string name = separator.empty() ? "<|endoftext|>" : separator;
      const auto id = tok->token_id(name);
      if (!id)
        throw TokenizerError(tok->path() + " has no token \"" + name + "\"" +
                             (separator.empty() ? ": name the token that separates documents with --separator (Llama 3: \"<|end_of_text|>\")" : ""));
      separator_id = *id;
    });
    // Existing outputs are never replaced piecemeal: a glob over OUT_train_*.bin would mix two runs.
    on_all_ranks(world, [&] {
      if (!root) return;
      for (const char* split : {"train", "val"}) {
        glob_t g{};
        const std::string pattern = out + "_" + split + "_*.bin";
        const int rc = ::glob((glob_literal(out + "_" + split + "_") + "*.bin").c_str(), 0, nullptr, &g);
        const std::string first = rc == 0 && g.gl_pathc > 0 ? g.gl_pathv[0] : "";
        ::globfree(&g);
        if (!first.empty())
          throw fsdp::ConfigError("'" + first + "' exists: remove the shards of " + pattern + " or choose another --out", "fsdp.tokenize");
      }
      std::error_code ec;
      const fs::path folder = fs::path(out).parent_path().empty() ? fs::path(".") : fs::path(out).parent_path();
      if (fs::create_directories(folder, ec); ec)
        throw fsdp::ConfigError("--out '" + out + "': cannot create the folder '" + folder.string() + "': " + ec.message(), "fsdp.tokenize");
      if (const std::size_t stale = remove_temporaries(out))
        std::printf("fsdp-tokenize: removed %zu temporary shard(s) .%s_*.bin.tmp of a run that did not finish (runs must not share an --out)\n",
                    stale, fs::path(out).filename().c_str());
    });
    // Documents per input, counted by the inputs' owners (input k: rank k mod N).
    std::vector<std::int64_t> counts(inputs.size(), 0);
    on_all_ranks(world, [&] {
      for (std::size_t k = static_cast<std::size_t>(world.rank()); k < inputs.size(); k += static_cast<std::size_t>(ranks))
        counts[k] = count_documents(inputs[k]);
    });
    if (!counts.empty())
      world.all_reduce(counts.data(), counts.data(), static_cast<std::int64_t>(counts.size()), fsdp::DType::kInt64, fsdp::ReduceOp::kSum);
    std::int64_t documents = 0;
    for (const auto c : counts) documents += c;
    const std::int64_t mine_begin = documents * world.rank() / ranks, mine_end = documents * (world.rank() + 1) / ranks;

    Split train{"train"}, val{"val"};
    on_all_ranks(world, [&] {
      std::int64_t doc = 0;  // global index of the next document
      for (std::size_t k = 0; k < inputs.size() && doc < mine_end; ++k) {
        if (doc + counts[k] <= mine_begin) {
          doc += counts[k];
          continue;
        }
        auto add = [&](const std::string& text, const std::string& where) {
          const bool is_val = std::ceil(static_cast<double>(doc + 1) * val_fraction) > std::ceil(static_cast<double>(doc) * val_fraction);
          auto& split = is_val ? val : train;
          split.tokens.push_back(separator_id);
          try {
            const auto ids = tok->encode(text);
            split.tokens.insert(split.tokens.end(), ids.begin(), ids.end());
          } catch (const TokenizerError& e) {
            throw fsdp::ConfigError(where + ": " + fsdp::message_without_id(e), "fsdp.tokenize");
          }
        };
        std::ifstream in(inputs[k], std::ios::binary);
        if (!in) throw fsdp::ConfigError("cannot read input '" + inputs[k] + "'", "fsdp.tokenize");
        if (!is_json_lines(inputs[k])) {
          if (doc >= mine_begin) {
            std::string text;
            try {
              text.assign(std::istreambuf_iterator<char>(in), {});
            } catch (const std::exception& e) {  // the stream buffer throws on a read error
              throw fsdp::ConfigError("cannot read input '" + inputs[k] + "': " + e.what(), "fsdp.tokenize");
            }
            if (in.bad()) throw fsdp::ConfigError("cannot read input '" + inputs[k] + "': a read error", "fsdp.tokenize");
            add(text, "input '" + inputs[k] + "'");
          }
          ++doc;
          continue;
        }
        std::int64_t line_no = 0;
        for (std::string line; doc < mine_end && std::getline(in, line);) {
          ++line_no;
          if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
          if (doc >= mine_begin) {
            const std::string where = "input '" + inputs[k] + "' line " + std::to_string(line_no);
            if (const auto bad = first_invalid_utf8(line))
              throw fsdp::ConfigError(where + ": not UTF-8 at byte offset " + std::to_string(*bad) + " of the line", "fsdp.tokenize");
            const auto js = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
            if (js.is_discarded() || !js.is_object() || !js.contains(text_key) || !js[text_key].is_string())
              throw fsdp::ConfigError(where + ": not a JSON object with a string \"" + text_key + "\"", "fsdp.tokenize");
            add(js[text_key].get<std::string>(), where);
          }
          ++doc;
        }
        if (in.bad())
          throw fsdp::ConfigError("cannot read input '" + inputs[k] + "': a read error after line " + std::to_string(line_no), "fsdp.tokenize");
      }
    });
    for (Split* s : {&train, &val}) {
      std::int64_t n = static_cast<std::int64_t>(s->tokens.size());
      world.all_reduce(&n, &s->total, 1, fsdp::DType::kInt64, fsdp::ReduceOp::kSum);
      std::vector<std::int64_t> all(static_cast<std::size_t>(ranks));
      world.all_gather(&n, all.data(), 1, fsdp::DType::kInt64);
      for (int r = 0; r < world.rank(); ++r) s->first += all[static_cast<std::size_t>(r)];
    }
    on_all_ranks(world, [&] {
      if (train.total == 0)
        throw fsdp::ConfigError("no training tokens: " + std::to_string(documents) + " document(s), " +
                                    (documents == 0 ? std::string("none in the inputs") : "all of them for validation (--val-fraction)"),
                                "fsdp.tokenize");
    });
    const bool wide = tok->vocab_size() > 65536;
    const int width = wide ? 4 : 2;
    // Rank 0 creates every shard under a temporary name with its header and full size; then each rank
    // writes its tokens at their places, and syncs; then rank 0 renames them in.
    std::vector<std::pair<std::string, std::string>> shards;  // temporary, final
    std::vector<std::int64_t> shard_counts;                   // tokens in each
    for (const Split* s : {&train, &val})
      for (std::int64_t k = 0; k * shard_tokens < s->total; ++k) {
        const std::string path = shard_path(out, s->name, k);
        shards.emplace_back(temporary(path), path);
        shard_counts.push_back(std::min(shard_tokens, s->total - k * shard_tokens));
      }
    if (root) {
      shards_in_flight.shards = shards;
      shards_in_flight.armed = true;
    }
    struct Disarm {  // published or taken back: a later signal has nothing to remove
      ~Disarm() { shards_in_flight.armed = false; }
    } disarm;
    on_all_ranks(world, [&] {
      if (!root) return;
      for (std::size_t i = 0; i < shards.size(); ++i) {
        const std::string& tmp = shards[i].first;
        std::vector<std::int32_t> header(256, 0);
        header[0] = wide ? kLlmcMagicUint32 : kLlmcMagicUint16;
        header[1] = wide ? kLlmcVersionUint32 : kLlmcVersionUint16;
        header[2] = static_cast<std::int32_t>(shard_counts[i]);
        const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd < 0) throw fsdp::OutputError("cannot create " + tmp + ": " + std::strerror(errno));
        try {
          write_at(fd, header.data(), header.size() * 4, 0, tmp);
          if (::ftruncate(fd, kLlmcHeaderBytes + shard_counts[i] * width) != 0)
            throw fsdp::OutputError("cannot size " + tmp + ": " + std::strerror(errno));
        } catch (...) {
          ::close(fd);
          throw;
        }
        ::close(fd);
      }
      // Test hook (tokenize_e2e): a signal while every temporary shard exists.
      if (const char* raise_signal = std::getenv("FSDP_TEST_TOKENIZE_RAISE")) ::raise(std::atoi(raise_signal));
    });
    on_all_ranks(world, [&] {
      for (const Split* s : {&train, &val}) {
        std::int64_t done = 0;
        const auto n = static_cast<std::int64_t>(s->tokens.size());
        while (done < n) {
          const std::int64_t pos = s->first + done, k = pos / shard_tokens;
          const std::int64_t take = std::min(n - done, (k + 1) * shard_tokens - pos);
          std::vector<unsigned char> bytes(static_cast<std::size_t>(take * width));
          for (std::int64_t t = 0; t < take; ++t)
            for (int b = 0; b < width; ++b)
              bytes[static_cast<std::size_t>(t * width + b)] =
                  static_cast<unsigned char>(static_cast<std::uint32_t>(s->tokens[static_cast<std::size_t>(done + t)]) >> (8 * b));
          const std::string tmp = temporary(shard_path(out, s->name, k));
          // Test hook (tokenize_e2e): this rank's write fails after every shard exists.
          if (const char* fail = std::getenv("FSDP_TEST_TOKENIZE_FAIL_ON_RANK"); fail && std::atoi(fail) == world.rank())
            throw fsdp::OutputError("cannot write " + tmp + ": test hook FSDP_TEST_TOKENIZE_FAIL_ON_RANK");
          const int fd = ::open(tmp.c_str(), O_WRONLY | O_CLOEXEC);
          if (fd < 0) throw fsdp::OutputError("cannot open " + tmp + ": " + std::strerror(errno));
          try {
            write_at(fd, bytes.data(), bytes.size(), static_cast<off_t>(kLlmcHeaderBytes + (pos - k * shard_tokens) * width), tmp);
            if (::fsync(fd) != 0) throw fsdp::OutputError("cannot sync " + tmp + ": " + std::strerror(errno));
          } catch (...) {
            ::close(fd);
            throw;
          }
          ::close(fd);
          done += take;
        }
      }
    });
    on_all_ranks(world, [&] {
      if (!root) return;
      for (const auto& [tmp, path] : shards) {  // rank 0's headers and sizes, synced before any is renamed
        const int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
        const bool synced = fd >= 0 && ::fsync(fd) == 0;
        const int err = errno;
        if (fd >= 0) ::close(fd);
        if (!synced) throw fsdp::OutputError("cannot sync " + tmp + ": " + std::strerror(err));
      }
      for (std::size_t i = 0; i < shards.size(); ++i) {
        const auto& [tmp, path] = shards[i];
        std::error_code ec;
        fs::rename(tmp, path, ec);
        if (ec) {  // no corpus is left half published: the shards renamed so far go again
          for (std::size_t j = 0; j < i; ++j) fs::remove(shards[j].second, ec);
          throw fsdp::OutputError("cannot rename " + tmp + " to " + path + ": " + ec.message());
        }
        shards_in_flight.renamed = i + 1;
        // Test hook (tokenize_e2e): a signal when this many shards are published.
        if (const char* at = std::getenv("FSDP_TEST_TOKENIZE_RAISE_AFTER_RENAMES"); at && std::strtoull(at, nullptr, 10) == i + 1) ::raise(SIGTERM);
      }
      fsdp::detail::fsync_folder(fs::path(out).parent_path());
    });
    if (root) {
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::printf(
          "fsdp-tokenize: %lld documents, %lld train and %lld validation tokens (%s) in %zu shard(s) %s_{train,val}_*.bin; %.0f tokens/s on %d "
          "rank(s)\n",
          static_cast<long long>(documents), static_cast<long long>(train.total), static_cast<long long>(val.total), wide ? "uint32" : "uint16",
          shards.size(), out.c_str(), static_cast<double>(train.total + val.total) / std::max(seconds, 1e-9), ranks);
    }
    return 0;
  } catch (const Agreed& e) {
    if (root) {
      std::fprintf(stderr, "fsdp-tokenize: error: %s\n", e.message.c_str());
      remove_temporaries(out);  // nothing half written stays behind under a temporary name either
    }
    return e.code;
  }
}
