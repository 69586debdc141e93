// fsdp-sweep: one fsdp-train deck per point of a parameter grid, plus a manifest for a Slurm job array.
//   fsdp-sweep DECK --grid key=v1,v2 [--grid ...] [--set key=value ...] --out DIR [--dry-run]
// The points are the cartesian product of the grids (the last --grid varies fastest). Each point is
// the deck, then the --set options, then the point's values, then run.out_dir = DIR/runs/point_NNNN
// (unless a grid sets run.out_dir). Every point is validated before anything is written; one invalid
// point writes nothing. Writes DIR/decks/point_NNNN.toml and DIR/manifest.tsv
// (index, overrides, deck, out_dir). Exit status: 0 done, 2 bad input, 1 a file could not be written.
//   fsdp-sweep --print-reference   prints docs/deck_reference.md (generated from the schema)
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "deck.hpp"
#include "run_config.hpp"
#include "fsdp/output_file.hpp"
#include "fsdp/version.hpp"

namespace fs = std::filesystem;
using fsdp::app::Deck;
using fsdp::app::DeckError;
using fsdp::app::resolve_run_section;

namespace {

/// Bad command-line input: exit status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

/// "a,b,[1,2],'x,y'" -> a | b | [1,2] | 'x,y': commas inside brackets or quotes do not split.
std::vector<std::string> split_values(const std::string& list) {
  std::vector<std::string> out;
  std::string current;
  int depth = 0;
  char quote = 0;
  for (char c : list) {
    if (quote) {
      if (c == quote) quote = 0;
    } else if (c == '"' || c == '\'') {
      quote = c;
    } else if (c == '[' || c == '{') {
      ++depth;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    } else if (c == ',' && depth == 0) {
      out.push_back(trim(current));
      current.clear();
      continue;
    }
    current += c;
  }
  out.push_back(trim(current));
  return out;
}

struct Axis {
  std::string key;
  std::vector<std::string> values;
};

Axis parse_grid(const std::string& text) {
  const auto eq = text.find('=');
  if (eq == std::string::npos) throw UsageError("--grid '" + text + "': expected section.key=v1,v2,...");
  Axis axis{trim(text.substr(0, eq)), {}};
  if (!fsdp::app::find_key(axis.key)) {
    std::string msg = "--grid '" + text + "': unknown key '" + axis.key + "'";
    if (auto near = fsdp::app::did_you_mean(axis.key); !near.empty()) msg += " (did you mean " + near + "?)";
    throw UsageError(msg);
  }
  const std::string list = trim(text.substr(eq + 1));
  if (list.empty()) throw UsageError("--grid '" + text + "': no values (expected " + axis.key + "=v1,v2,...)");
  axis.values = split_values(list);
  for (std::size_t i = 0; i < axis.values.size(); ++i)
    if (axis.values[i].empty()) throw UsageError("--grid '" + text + "': value " + std::to_string(i + 1) + " is empty");
  return axis;
}

/// Two values of one axis that the deck reads alike (0.1 twice, 1e-3 and 0.001) would train the same
/// run twice, in two folders: a UsageError naming them. A value the deck refuses is left to the points.
void refuse_repeated_values(const Deck& base, const Axis& axis) {
  std::vector<std::string> read;
  for (std::size_t i = 0; i < axis.values.size(); ++i) {
    std::string value;
    try {
      Deck d = base;
      d.apply_overrides({axis.key + "=" + axis.values[i]}, "--grid");
      value = fsdp::app::format_value(d.entry(axis.key).value);
    } catch (const DeckError&) {
      value = "\n(invalid) " + axis.values[i];
    }
    for (std::size_t j = 0; j < i; ++j)
      if (read[j] == value)
        throw UsageError("--grid " + axis.key + ": value " + std::to_string(i + 1) + " (" + axis.values[i] + ") is value " + std::to_string(j + 1) +
                         " (" + axis.values[j] + ") again: the two points would train the same run");
    read.push_back(value);
  }
}

/// The most points one sweep writes.
constexpr std::size_t kMaxPoints = 100000;

/// A Slurm job array's default size limit (MaxArraySize = 1001: indices 0-1000).
constexpr std::size_t kSlurmArrayLimit = 1001;

struct Point {
  std::vector<std::string> overrides;  // key=value, one per axis
  std::string name;                    // point_0003
  std::string deck_path;               // DIR/decks/point_0003.toml
  std::string toml;
  std::string out_dir;
  std::string checkpoint_dir;  // resolved: checkpoint.dir, relative to out_dir
};

std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (std::size_t i = 0; i < v.size(); ++i) out += (i ? " " : "") + v[i];
  return out;
}

/// manifest.tsv's text: one line a point.
std::string manifest_of(const std::vector<Point>& points) {
  std::string tsv = "index\toverrides\tdeck\tout_dir\n";
  for (std::size_t i = 0; i < points.size(); ++i)
    tsv += std::to_string(i) + "\t" + joined(points[i].overrides) + "\t" + points[i].deck_path + "\t" + points[i].out_dir + "\n";
  return tsv;
}

/// Two points that would share a run folder or a checkpoint folder would resume each other's
/// checkpoints: a UsageError naming them (nothing is written).
void refuse_shared_folders(const std::vector<Point>& points) {
  std::map<std::string, std::string> owner;  // folder -> the first point using it
  std::vector<std::string> clashes;
  auto claim = [&](const std::string& folder, const Point& p, const char* what) {
    const std::string key = fs::weakly_canonical(fs::absolute(folder)).string();
    const auto [it, fresh] = owner.emplace(key, p.name);
    if (!fresh && it->second != p.name) clashes.push_back(it->second + " and " + p.name + " share the " + what + " " + folder);
  };
  for (const auto& p : points) {
    claim(p.out_dir, p, "run folder");
    if (fs::weakly_canonical(fs::absolute(p.checkpoint_dir)) != fs::weakly_canonical(fs::absolute(fs::path(p.out_dir) / "checkpoints")))
      claim(p.checkpoint_dir, p, "checkpoint folder");
  }
  if (clashes.empty()) return;
  std::string msg = "points would share folders (each would resume the other's checkpoints); nothing was written:";
  for (const auto& c : clashes) msg += "\n  " + c;
  throw UsageError(msg);
}

/// `out` may hold this grid's points (a rerun of the same sweep, which continues them) but not
/// another grid's, nor this grid's points with other decks (a changed --set or base deck), unless
/// `continue_other`: a UsageError naming the manifest or the first deck that differs otherwise.
void refuse_another_grids_folder(const std::string& out, const std::vector<Point>& points, bool continue_other) {
  if (continue_other) return;
  const fs::path manifest = fs::path(out) / "manifest.tsv";
  std::ifstream in(manifest);
  if (!in) return;
  const std::string existing((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (existing != manifest_of(points))
    throw UsageError("'" + manifest.string() + "' lists another grid's points (other keys, values or decks); their runs under '" + out +
                     "' would be reported under this grid's decks. Use another --out, or --continue to write this grid there anyway");
  // The keys that decide the training, as a resume compares them: comments, the base deck's path
  // and keys a newer version added at their defaults do not count.
  for (const auto& p : points) {
    std::ifstream deck(p.deck_path);
    if (!deck) continue;
    const std::string written((std::istreambuf_iterator<char>(deck)), std::istreambuf_iterator<char>());
    std::string changed;
    try {
      const Deck before = Deck::parse(written, p.deck_path), now = Deck::parse(p.toml, p.name);
      auto changes = fsdp::app::trajectory_changes(before, now);
      // A resume may take other micro-batches under one data.global_batch_size; a run of the grid may
      // not: its throughput and memory are what it reports.
      const std::string batch_before = format_value(before.entry("data.batch_size").value),
                        batch_now = format_value(now.entry("data.batch_size").value);
      if (batch_before != batch_now && std::none_of(changes.begin(), changes.end(), [](const auto& c) { return c.key == "data.batch_size"; }))
        changes.push_back({"data.batch_size", batch_before, batch_now});
      for (const auto& c : changes) changed += "\n  " + c.key + ": " + c.before + " there, " + c.now + " now";
    } catch (const DeckError& e) {
      changed = "\n  it cannot be read: " + std::string(e.what());
    }
    if (!changed.empty())
      throw UsageError("'" + p.deck_path + "' holds another deck than this sweep writes for " + p.name +
                       " (a changed --set or base deck):" + changed +
                       "\nRuns made with it would be reported under the new one. Use another --out, or --continue to write the new decks "
                       "there anyway (a resume then names each key that changed)");
  }
}

/// --out must be a folder or become one: a file at it or above it is refused before anything is
/// printed or written (fs::create_directories would fail only after the table).
void refuse_a_file_in_the_way(const std::string& out) {
  std::error_code ec;
  const fs::path target = fs::absolute(out, ec);
  fs::path p = target;
  while (!fs::exists(p, ec) && p != p.parent_path()) p = p.parent_path();  // the nearest part that exists
  if (fs::exists(p, ec) && !fs::is_directory(p, ec))
    throw UsageError("--out '" + out + "': '" + p.string() + "' is a file, not a folder" + (p == target ? "" : " (on the way to it)"));
}

/// Every point of the grid over `base`, each validated; a UsageError listing every invalid point
/// (nothing is written then).
std::vector<Point> grid_points(const Deck& base, const std::vector<Axis>& axes, const std::string& out) {
  std::size_t count = 1;
  for (const auto& a : axes) {
    // Every point is built and validated in memory first: a grid past this is a typo or a job for
    // several sweeps (and no Slurm array takes it whole).
    if (a.values.size() > kMaxPoints / count) {
      std::string sizes;
      for (const auto& b : axes) sizes += (sizes.empty() ? "" : " x ") + std::to_string(b.values.size());
      throw UsageError("the grid has " + sizes + " points, more than the " + std::to_string(kMaxPoints) +
                       " fsdp-sweep writes; split it into several sweeps");
    }
    count *= a.values.size();
  }
  const int digits = std::max<int>(4, static_cast<int>(std::to_string(count - 1).size()));
  bool grid_sets_out_dir = false;
  for (const auto& a : axes) grid_sets_out_dir |= a.key == "run.out_dir";
  std::vector<Point> points;
  std::vector<std::string> problems;
  std::vector<std::size_t> digit(axes.size(), 0);  // mixed-radix counter, the last axis fastest
  for (std::size_t index = 0; index < count; ++index) {
    Point p;
    for (std::size_t a = 0; a < axes.size(); ++a) p.overrides.push_back(axes[a].key + "=" + axes[a].values[digit[a]]);
    const std::string number = std::to_string(index);
    p.name = "point_" + std::string(static_cast<std::size_t>(digits) - std::min<std::size_t>(digits, number.size()), '0') + number;
    p.deck_path = (fs::path(out) / "decks" / (p.name + ".toml")).string();
    try {
      Deck d = base;
      d.apply_overrides(p.overrides, "--grid");
      if (!grid_sets_out_dir) d.set("run.out_dir", (fs::path(out) / "runs" / p.name).string());
      p.out_dir = resolve_run_section(d).out_dir;
      p.checkpoint_dir = d.checkpoint_dir();
      p.toml = d.to_toml();
      for (const auto& field : {joined(p.overrides), p.deck_path, p.out_dir})
        if (field.find_first_of("\t\n\r") != std::string::npos) throw DeckError("a tab or line break in '" + field + "' would break manifest.tsv");
    } catch (const DeckError& e) {
      problems.push_back(p.name + " (" + joined(p.overrides) + "):");
      for (const auto& line : e.problems()) problems.push_back("    " + line);
    }
    points.push_back(std::move(p));
    for (std::size_t a = axes.size(); a-- > 0;) {
      if (++digit[a] < axes[a].values.size()) break;
      digit[a] = 0;
    }
  }
  if (!problems.empty()) {
    std::size_t bad = 0;
    for (const auto& line : problems) bad += line.rfind("    ", 0) != 0;
    std::string msg = std::to_string(bad) + " of " + std::to_string(count) + " points are invalid; nothing was written:";
    for (const auto& line : problems) msg += "\n  " + line;
    throw UsageError(msg);
  }
  return points;
}

void print_points(const std::vector<Point>& points) {
  std::size_t wo = 9, wd = 4;
  for (const auto& p : points) wo = std::max(wo, joined(p.overrides).size()), wd = std::max(wd, p.deck_path.size());
  std::printf("%-5s  %-*s  %-*s  %s\n", "index", static_cast<int>(wo), "overrides", static_cast<int>(wd), "deck", "out_dir");
  for (std::size_t i = 0; i < points.size(); ++i)
    std::printf("%5zu  %-*s  %-*s  %s\n", i, static_cast<int>(wo), joined(points[i].overrides).c_str(), static_cast<int>(wd),
                points[i].deck_path.c_str(), points[i].out_dir.c_str());
}

/// The points' decks and manifest.tsv under `out`, and how to run them as a Slurm job array.
int write_points(const std::vector<Point>& points, const std::string& out) {
  const std::size_t count = points.size();
  const fs::path manifest = fs::path(out) / "manifest.tsv";
  try {
    fs::create_directories(fs::path(out) / "decks");
    for (const auto& p : points) fsdp::write_file_atomically(p.deck_path, p.toml);
    fsdp::write_file_atomically(manifest, manifest_of(points));  // last: a manifest names decks that exist
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-sweep: %s\n", e.what());
    return 1;
  }
  std::printf("\nwrote %zu deck%s under %s and %s\n", count, count == 1 ? "" : "s", (fs::path(out) / "decks").c_str(), manifest.c_str());
  // Quoted for the shell: a folder name with spaces or quotes stays one argument.
  std::string quoted = "'";
  for (const char c : manifest.string()) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  quoted += "'";
  std::printf("Slurm job array, one task per point (run from this folder; slurm/sweep.sbatch checkpoints and requeues):\n");
  if (count <= kSlurmArrayLimit) {
    std::printf("  sbatch --array=0-%zu slurm/sweep.sbatch %s\n", count - 1, quoted.c_str());
  } else {
    // Past Slurm's default MaxArraySize: several arrays, each offset into the manifest.
    for (std::size_t first = 0; first < count; first += kSlurmArrayLimit)
      std::printf("  sbatch --array=0-%zu --export=ALL,FSDP_SWEEP_OFFSET=%zu slurm/sweep.sbatch %s\n", std::min(count - first, kSlurmArrayLimit) - 1,
                  first, quoted.c_str());
    std::printf("(%zu points: more than Slurm's default MaxArraySize of %zu array tasks)\n", count, kSlurmArrayLimit);
  }
  std::printf("  slurm/sweep_summary.py %s    # one table of every summary.json\n", quoted.c_str());
  return 0;
}

int sweep(const std::string& deck_path, const std::vector<std::string>& grids, const std::vector<std::string>& sets, const std::string& out,
          bool dry_run, bool continue_other) {
  std::vector<Axis> axes;
  for (const auto& g : grids) {
    axes.push_back(parse_grid(g));
    for (std::size_t i = 0; i + 1 < axes.size(); ++i)
      if (axes[i].key == axes.back().key) throw UsageError("--grid: " + axes.back().key + " is given twice");
  }
  refuse_a_file_in_the_way(out);
  const Deck base = Deck::from_file(deck_path, sets);
  for (const auto& a : axes) refuse_repeated_values(base, a);
  // Every point first: build and validate them all, write nothing unless all are good.
  const std::vector<Point> points = grid_points(base, axes, out);
  refuse_shared_folders(points);
  refuse_another_grids_folder(out, points, continue_other);
  if (const auto& set = base.entry("run.out_dir");
      set.source != fsdp::app::Source::kDefault && std::none_of(axes.begin(), axes.end(), [](const Axis& a) { return a.key == "run.out_dir"; }))
    std::printf("note: run.out_dir (%s) is each point's own: %s\n", set.where.c_str(), (fs::path(out) / "runs" / "point_N").c_str());
  print_points(points);
  if (dry_run) {
    std::printf("\n%zu point%s valid; nothing written (--dry-run)\n", points.size(), points.size() == 1 ? "" : "s");
    return 0;
  }
  return write_points(points, out);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"One fsdp-train deck per point of a parameter grid, and a manifest for a Slurm job array (fsdp " + std::string(fsdp::kVersion) + ")",
               "fsdp-sweep"};
  std::string deck_path, out;
  std::vector<std::string> grids, sets;
  bool dry_run = false, print_reference = false, continue_other = false;
  app.add_option("deck", deck_path, "the base deck (TOML)");
  app.add_option("--grid", grids, "KEY=V1,V2,...: one axis of the grid; values are read like --set values (repeatable)")->allow_extra_args(false);
  app.add_option("--set", sets, "KEY=VALUE: override the base deck for every point (repeatable)")->allow_extra_args(false);
  app.add_option("--out", out, "output folder: DIR/decks/point_NNNN.toml, DIR/manifest.tsv, runs in DIR/runs/point_NNNN");
  app.add_flag("--dry-run", dry_run, "validate every point and print the table; write nothing");
  app.add_flag("--continue", continue_other, "write this grid into an --out that holds another grid's points");
  app.add_flag("--print-reference", print_reference, "print docs/deck_reference.md")->group("");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  try {
    if (print_reference) {
      std::cout << fsdp::app::reference_markdown();
      return 0;
    }
    if (deck_path.empty()) throw UsageError("the base deck is missing (fsdp-sweep DECK --grid key=v1,v2 --out DIR)");
    if (out.empty()) throw UsageError("--out DIR is missing");
    return sweep(deck_path, grids, sets, out, dry_run, continue_other);
  } catch (const DeckError& e) {
    std::fprintf(stderr, "fsdp-sweep: %s\n", e.what());
    return 2;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "fsdp-sweep: %s\n", e.what());
    return 2;
  }
}
