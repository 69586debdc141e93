// fsdp-ckpt: inspect, verify, merge and diff fsdp checkpoints (no MPI launch needed).
//   fsdp-ckpt inspect PATH          attributes and a table of tensors (name, shape, dtype, bytes)
//   fsdp-ckpt verify PATH           checksums and completeness; exit 0 if good, 1 if not
//   fsdp-ckpt merge LOCAL_DIR OUT   LOCAL_STATE_DICT folder -> one FULL_STATE_DICT file
//   fsdp-ckpt diff A B              max abs / rel difference per tensor; exit 0 if within --atol/--rtol
//   fsdp-ckpt export CKPT OUT       the model's tensors as a safetensors file (--dtype fp32|bf16|fp16,
//                                   --names native|hf|hf-gpt2: a Hugging Face folder with config.json,
//                                   --max-shard-size: split as save_pretrained does)
// PATH may be a checkpoint file, a LOCAL folder, or a checkpoint folder holding `latest` (diff takes
// files: merge a LOCAL folder first).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <filesystem>
#include <string>

#include "deck.hpp"
#include "fsdp/io/checkpoint_tools.hpp"
#include "fsdp/io/safetensors_export.hpp"
#include "fsdp/version.hpp"
#include "hf_export.hpp"
#include "run_config.hpp"

namespace fs = std::filesystem;

namespace {

/// A folder with a `latest` pointer stands for the checkpoint it names.
/// The checkpoint a command line names (fsdp::ckpt::checkpoint_at): a folder without one, a run
/// directory or the `latest` file is refused, saying what it is.
std::string resolve(const std::string& path) { return fsdp::ckpt::checkpoint_at(path).string(); }

/// The model a checkpoint holds, from the deck it stores (hf exports need its heads, vocabulary and
/// activation, which the tensors alone do not tell).
fsdp::app::ModelSection model_of_checkpoint(const std::string& checkpoint) {
  std::string file = checkpoint;
  if (fs::is_directory(checkpoint)) {  // LOCAL: every rank file stores the deck
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(checkpoint))
      if (e.path().extension() == ".h5") files.push_back(e.path().string());
    if (files.empty()) throw fsdp::CheckpointError("'" + checkpoint + "' holds no checkpoint files");
    std::sort(files.begin(), files.end());
    file = files.front();
  }
  std::string deck_text;
  for (const auto& [k, v] : fsdp::ckpt::inspect_file(file).attributes)
    if (k == "deck") deck_text = v;
  if (deck_text.empty()) throw fsdp::CheckpointError("checkpoint '" + file + "' stores no deck: it does not say which model it holds");
  return fsdp::app::resolve_model_section(fsdp::app::Deck::parse(deck_text, file + " (its deck)"));
}

std::string human_bytes(std::int64_t b) {
  char buf[32];
  if (b >= (1 << 30))
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / 1073741824.0);
  else if (b >= (1 << 20))
    std::snprintf(buf, sizeof buf, "%.2f MiB", b / 1048576.0);
  else if (b >= 1024)
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  else
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(b));
  return buf;
}

void print_file(const fsdp::ckpt::FileInfo& info, bool show_deck) {
  std::printf("%s\n", info.path.c_str());
  for (const auto& [k, v] : info.attributes) {
    if (k == "deck" && !show_deck) {
      std::size_t lines = v.empty() ? 0 : 1;
      for (char c : v) lines += c == '\n';
      std::printf("  %-18s (%zu lines; --deck prints it)\n", k.c_str(), lines);
    } else {
      std::printf("  %-18s %s\n", k.c_str(), v.c_str());
    }
  }
  std::size_t width = 6;
  for (const auto& t : info.tensors) width = std::max(width, t.path.size());
  std::printf("\n  %-*s  %-20s %-9s %12s %12s\n", static_cast<int>(width), "tensor", "shape", "dtype", "bytes", "on disk");
  std::int64_t total = 0, stored = 0;
  for (const auto& t : info.tensors) {
    std::printf("  %-*s  %-20s %-9s %12lld %12lld", static_cast<int>(width), t.path.c_str(), fsdp::ckpt::shape_text(t.shape).c_str(), t.dtype.c_str(),
                static_cast<long long>(t.bytes), static_cast<long long>(t.stored_bytes));
    for (const auto& a : t.aliases) std::printf("  (also %s)", a.c_str());
    std::printf("\n");
    total += t.bytes;
    stored += t.stored_bytes;
  }
  std::printf("  %zu tensors, %s (%s on disk)\n", info.tensors.size(), human_bytes(total).c_str(), human_bytes(stored).c_str());
}

int inspect_command(const std::string& path, bool show_deck) {
  const std::string p = resolve(path);
  if (fs::is_directory(p)) {
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(p))
      if (e.path().extension() == ".h5") files.push_back(e.path().string());
    std::sort(files.begin(), files.end());
    std::printf("LOCAL_STATE_DICT folder %s: %zu rank files\n\n", p.c_str(), files.size());
    for (const auto& f : files) {
      print_file(fsdp::ckpt::inspect_file(f), show_deck);
      std::printf("\n");
    }
  } else {
    print_file(fsdp::ckpt::inspect_file(p), show_deck);
  }
  return 0;
}

int verify_command(const std::string& path) {
  const auto report = fsdp::ckpt::verify(resolve(path));
  for (const auto& problem : report.problems) std::printf("FAIL %s\n", problem.c_str());
  std::printf("%s: %s (%lld tensors, %s checked)\n", report.path.c_str(), report.ok() ? "OK" : "CORRUPT OR INCOMPLETE",
              static_cast<long long>(report.tensors_checked), human_bytes(report.bytes_checked).c_str());
  return report.ok() ? 0 : 1;
}

int export_command(const std::string& path, const std::string& out, const std::string& export_dtype, const std::string& export_names,
                   const std::optional<std::string>& max_shard_size) {
  const std::string source = resolve(path);
  const auto file = fsdp::app::export_file(out);
  // The deck's default size, for a folder; an OUT ending in .safetensors is one file unless asked.
  const std::string size_text = max_shard_size.value_or(
      file == fs::path(out) ? std::string("0") : std::get<std::string>(fsdp::app::find_key("checkpoint.export_max_shard_size")->default_value));
  const auto max_bytes = fsdp::app::parse_byte_size(size_text);
  if (!max_bytes) throw fsdp::ConfigError("--max-shard-size " + size_text + ": not a size (\"5GB\", \"500MB\", \"2GiB\", bytes, \"0\")");
  // --dtype's names are the deck's checkpoint.export_dtype names; none given: as stored.
  const auto config_dtype = export_dtype.empty() ? fsdp::app::ExportDtype::kAsTrained : fsdp::app::parse_choice<fsdp::app::ExportDtype>(export_dtype);
  const auto names = fsdp::app::parse_choice<fsdp::app::ExportNames>(export_names);
  std::optional<fsdp::app::HfForm> form;
  if (names != fsdp::app::ExportNames::kNative) {
    try {
      form = fsdp::app::hf_export_form(model_of_checkpoint(source), names);
    } catch (const fsdp::ConfigError& e) {
      throw fsdp::ConfigError("--names " + export_names + ": checkpoint '" + source + "': " + fsdp::message_without_id(e));
    }
    fsdp::app::check_config_json_replaceable(file, form->config, "export into a folder of its own (OUT a folder or a path in one)");
  }
  const auto result = fsdp::ckpt::export_safetensors(
      source, file.string(), {.dtype = export_dtype, .naming = form && form->naming ? &*form->naming : nullptr, .max_file_bytes = *max_bytes});
  if (form) fsdp::app::write_hf_config(file, form->config, config_dtype);
  std::printf("exported %lld tensors of %s to %s (%s names, %s%s)\n", static_cast<long long>(result.tensors), source.c_str(), result.path.c_str(),
              export_names.c_str(), result.files > 1 ? (std::to_string(result.files) + " files, ").c_str() : "", human_bytes(result.bytes).c_str());
  return 0;
}

int diff_command(const std::string& a, const std::string& b, double atol, double rtol) {
  for (const auto& p : {resolve(a), resolve(b)})
    if (fs::is_directory(p))
      throw fsdp::CheckpointError("'" + p + "' is a LOCAL_STATE_DICT folder; diff compares single files: `fsdp-ckpt merge " + p + " OUT.h5` first");
  const auto rows = fsdp::ckpt::diff(resolve(a), resolve(b));
  std::size_t width = 6;
  for (const auto& r : rows) width = std::max(width, r.path.size());
  std::printf("%-*s  %-10s %14s %14s\n", static_cast<int>(width), "tensor", "status", "max abs", "max rel");
  bool same = true;
  for (const auto& r : rows) {
    const bool within = (r.status == "ok" || r.status == "differs") && r.max_abs <= atol + rtol * r.max_b;
    same = same && within;
    // One tolerance for the verdict and each tensor's status: a difference inside --atol/--rtol is "within".
    const std::string status = r.status == "differs" && within ? "within" : r.status;
    std::printf("%-*s  %-10s %14.6g %14.6g\n", static_cast<int>(width), r.path.c_str(), status.c_str(), r.max_abs, r.max_rel);
  }
  std::printf("%s\n", same ? "checkpoints match" : "checkpoints differ");
  return same ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Inspect, verify, merge and diff fsdp HDF5 checkpoints (fsdp " + std::string(fsdp::kVersion) + ")", "fsdp-ckpt"};
  app.require_subcommand(1);
  std::string path, out, a, b;
  bool show_deck = false;
  double atol = 0, rtol = 0;

  auto* inspect = app.add_subcommand("inspect", "attributes and a table of tensors");
  inspect->add_option("PATH", path, "checkpoint file, LOCAL folder, or folder with `latest`")->required();
  inspect->add_flag("--deck", show_deck, "print the stored input deck");
  auto* verify = app.add_subcommand("verify", "checksums and completeness (exit 0: good, 1: problems)");
  verify->add_option("PATH", path, "checkpoint file, LOCAL folder, or folder with `latest`")->required();
  auto* merge = app.add_subcommand("merge", "LOCAL_STATE_DICT folder -> one FULL_STATE_DICT file");
  merge->add_option("LOCAL_DIR", path, "a LOCAL_STATE_DICT checkpoint folder")->required();
  merge->add_option("OUT", out, "the file to write")->required();
  auto* diff = app.add_subcommand(
      "diff", "per tensor: max |A-B| and max |A-B| / max |B|; exit 0 if every tensor has max |A-B| <= atol + rtol * max |B|, else 1");
  diff->add_option("A", a, "checkpoint file, or folder with `latest`")->required();
  diff->add_option("B", b, "checkpoint file, or folder with `latest`")->required();
  // CLI::NonNegativeNumber's message spells out DBL_MAX in 309 digits.
  const CLI::Validator non_negative(
      [](const std::string& text) {
        double x = -1;
        return CLI::detail::lexical_cast(text, x) && x >= 0 ? std::string() : "'" + text + "' is not a number >= 0";
      },
      "NUMBER >= 0");
  diff->add_option("--atol,--tolerance", atol, "absolute tolerance (default 0: identical)")->check(non_negative);
  diff->add_option("--rtol", rtol, "relative tolerance, against the tensor's max |B| (default 0)")->check(non_negative);

  std::string export_dtype, export_names = "native", max_shard_size;
  auto* exporter = app.add_subcommand("export", "the model's parameters and buffers as a safetensors file (PyTorch, Hugging Face)");
  exporter->add_option("CKPT", path, "SHARDED or FULL checkpoint file, LOCAL folder, or folder with `latest`")->required();
  exporter->add_option("OUT", out, "the .safetensors file to write, or a folder (model.safetensors in it)")->required();
  exporter->add_option("--dtype", export_dtype, "floating-point tensors as fp32, bf16 or fp16 (default: as stored)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  exporter
      ->add_option("--names", export_names,
                   "native (the model's own names) or hf (Hugging Face's names of the model's family and config.json beside the "
                   "weights: a folder from_pretrained reads; a transformer as GPT2LMHeadModel, a llama as LlamaForCausalLM or, with "
                   "q/k/v biases, Qwen2ForCausalLM); hf-gpt2: hf for a transformer")
      ->check(CLI::IsMember(fsdp::app::choice_names<fsdp::app::ExportNames>()));
  exporter->add_option("--max-shard-size", max_shard_size,
                       "split a larger export as save_pretrained does: <stem>-00001-of-0000N.safetensors and "
                       "<stem>.safetensors.index.json (\"500MB\", \"2GiB\", bytes; \"0\": one file; default: 5GB for a folder, "
                       "one file for an OUT ending in .safetensors)");

  // CLI11 reads an unknown command as a missing one ("A subcommand is required").
  if (argc > 1 && argv[1][0] != '-') {
    std::string known;
    bool found = false;
    for (const auto* sub : app.get_subcommands({})) {
      known += (known.empty() ? "" : ", ") + sub->get_name();
      found = found || sub->get_name() == argv[1];
    }
    if (!found) {
      std::fprintf(stderr, "fsdp-ckpt: unknown command '%s' (%s; --help for more)\n", argv[1], known.c_str());
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help: 0; a bad command line is bad input, as in the other tools
  }
  try {
    if (*inspect) return inspect_command(path, show_deck);
    if (*verify) return verify_command(path);
    if (*merge) {
      fsdp::ckpt::merge_local(resolve(path), out);
      std::printf("merged %s into %s\n", path.c_str(), out.c_str());
      return 0;
    }
    if (*exporter)
      return export_command(path, out, export_dtype, export_names,
                            exporter->count("--max-shard-size") ? std::optional<std::string>(max_shard_size) : std::nullopt);
    if (*diff) return diff_command(a, b, atol, rtol);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-ckpt: %s\n", e.what());
    return 2;
  }
  return 0;
}
