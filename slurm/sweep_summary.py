#!/usr/bin/env python3
"""Collects the summary.json of every point of a sweep into one table.

    slurm/sweep_summary.py sweeps/a/manifest.tsv [--csv OUT.csv] [--markdown OUT.md]

Reads the manifest fsdp-sweep wrote (index, overrides, deck, out_dir), prints a Markdown table with
one row per point (its overrides and the main metrics of its summary.json) and writes the same as CSV
and Markdown next to the manifest (summary.csv, summary.md) unless told otherwise. A point without a
readable summary.json, or whose losses are not finite, is reported as failed; the exit code is 1 if
any point failed, 2 for a manifest that cannot be read or an output that cannot be written (each is
written through a temporary: an earlier one stays whole), 0 otherwise. The manifest's relative paths
are those of the folder fsdp-sweep ran in: read from there, or found from the manifest's own place.
"""
import argparse
import csv
import io
import json
import math
import os
import sys
import tempfile

COLUMNS = ["world_size", "nodes", "steps", "final_train_loss", "test_loss", "test_accuracy", "wall_s", "step_ms_median", "samples_per_s", "tokens_per_s"]


def write_atomically(path, text):
    """Writes `text` to `path` through a temporary beside it: a full disk or a kill leaves the old file
    (or none), never a truncated one under its real name."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # as open() would make it, not mkstemp's 0600
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def run_folder(manifest, deck, out_dir):
    """Where a point's run is. out_dir is relative to the folder fsdp-sweep ran in, found from the
    manifest's own place: it lies in --out, as each deck's folder <out>/decks does. An --out that goes
    up with .. cannot be walked back: then the current folder, as when run from where fsdp-sweep ran."""
    if os.path.isabs(out_dir):
        return out_dir
    out = os.path.normpath(os.path.dirname(os.path.dirname(deck)))
    parts = [] if out == "." else out.split(os.sep)
    if os.path.isabs(out) or ".." in parts:
        return out_dir
    root = os.path.dirname(os.path.abspath(manifest))
    for _ in parts:
        root = os.path.dirname(root)
    return os.path.join(root, out_dir)


def non_finite(summary):
    """The loss fields of summary.json that are not finite: a NaN or infinity, or null (how a NaN is
    written). test_loss is written only after an evaluation, so a null there is always one; a null
    final_train_loss is one only in a run that skipped steps (else a loss not measured: a summary
    rewritten from the last checkpoint)."""
    bad = []
    for key in ("final_train_loss", "test_loss"):
        if key not in summary:
            continue
        v = summary[key]
        measured_null = v is None and (key == "test_loss" or summary.get("skipped_steps", 0))
        if measured_null or (isinstance(v, float) and not math.isfinite(v)):
            bad.append(key)
    return bad


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifest")
    parser.add_argument("--csv")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    base = os.path.dirname(os.path.abspath(args.manifest))
    try:
        with open(args.manifest, newline="") as f:
            points = list(csv.DictReader(f, delimiter="\t"))
    except OSError as e:
        print(f"sweep_summary.py: cannot read the manifest: {e}", file=sys.stderr)
        return 2
    missing = [c for c in ("index", "overrides", "deck", "out_dir") if points and c not in points[0]]
    if not points or missing:
        what = "no points" if not points else "no column " + ", ".join(missing)
        print(f"sweep_summary.py: {args.manifest} is not a manifest fsdp-sweep wrote ({what})", file=sys.stderr)
        return 2
    rows, failed = [], []
    for point in points:
        out_dir = run_folder(args.manifest, point["deck"], point["out_dir"])
        summary_path = os.path.join(out_dir, "summary.json")
        row = {"index": point["index"], "overrides": point["overrides"], "status": "ok"}
        try:
            with open(summary_path) as s:
                summary = json.load(s)
            if not isinstance(summary, dict):
                raise ValueError(f"{summary_path} is not a JSON object")
            for c in COLUMNS:
                row[c] = summary.get(c, "")
            if non_finite(summary):
                row["status"] = "non-finite"
                failed.append((point["index"], point["overrides"], "non-finite " + ", ".join(non_finite(summary)) + " in " + summary_path))
        except (OSError, ValueError) as e:
            row["status"] = "failed"
            failed.append((point["index"], point["overrides"], str(e)))
        rows.append(row)
    columns = ["index", "overrides", "status"] + [c for c in COLUMNS if any(r.get(c, "") != "" for r in rows)]
    csv_path = args.csv or os.path.join(base, "summary.csv")
    md_path = args.markdown or os.path.join(base, "summary.md")
    table = io.StringIO(newline="")
    w = csv.DictWriter(table, fieldnames=columns, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)

    def cell(v):
        return f"{v:.6g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |")
    markdown = "\n".join(lines) + "\n"
    for path, text in ((csv_path, table.getvalue()), (md_path, markdown)):
        try:
            write_atomically(path, text)
        except OSError as e:
            print(f"sweep_summary.py: cannot write {path}: {e.strerror or e} (an earlier {os.path.basename(path)} is left as it was)", file=sys.stderr)
            return 2
    print(markdown, end="")
    print(f"{len(rows)} points, {len(rows) - len(failed)} ok, {len(failed)} failed; wrote {csv_path} and {md_path}")
    for index, overrides, why in failed:
        print(f"point {index} ({overrides}) failed: {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
