#!/usr/bin/env python3
"""Collects the summary.json of every point of a sweep into one table.

    slurm/sweep_summary.py sweeps/a/manifest.tsv [--csv OUT.csv] [--markdown OUT.md]

Reads the manifest fsdp-sweep wrote (index, overrides, deck, out_dir), prints a Markdown table with
one row per point (its overrides and the main metrics of its summary.json) and writes the same as CSV
and Markdown next to the manifest (summary.csv, summary.md) unless told otherwise. A point without a
summary.json is reported as failed; the exit code is 1 if any point failed, 0 otherwise.
"""
import argparse
import csv
import json
import os
import sys

COLUMNS = ["world_size", "nodes", "steps", "final_train_loss", "test_loss", "test_accuracy", "wall_s", "step_ms_median", "samples_per_s", "tokens_per_s"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifest")
    parser.add_argument("--csv")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    base = os.path.dirname(os.path.abspath(args.manifest))
    rows, failed = [], []
    with open(args.manifest, newline="") as f:
        for point in csv.DictReader(f, delimiter="\t"):
            out_dir = point["out_dir"]
            summary_path = os.path.join(out_dir, "summary.json")
            row = {"index": point["index"], "overrides": point["overrides"], "status": "ok"}
            try:
                with open(summary_path) as s:
                    summary = json.load(s)
                for c in COLUMNS:
                    row[c] = summary.get(c, "")
            except (OSError, ValueError) as e:
                row["status"] = "failed"
                failed.append((point["index"], point["overrides"], str(e)))
            rows.append(row)
    columns = ["index", "overrides", "status"] + [c for c in COLUMNS if any(r.get(c, "") != "" for r in rows)]
    csv_path = args.csv or os.path.join(base, "summary.csv")
    md_path = args.markdown or os.path.join(base, "summary.md")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)

    def cell(v):
        return f"{v:.6g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |")
    markdown = "\n".join(lines) + "\n"
    with open(md_path, "w") as f:
        f.write(markdown)
    print(markdown, end="")
    print(f"{len(rows)} points, {len(rows) - len(failed)} ok, {len(failed)} failed; wrote {csv_path} and {md_path}")
    for index, overrides, why in failed:
        print(f"point {index} ({overrides}) failed: {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
