#!/usr/bin/env bash
# Soak (docs/reliability.md, "Long runs"): 10,000 steps of a small MLP at np 2 with evaluations and
# checkpoints along the way; resident memory must stay flat after warm-up. Prints the slope of the
# largest rank's RSS (metrics.csv's rss_mib, logged every 100 steps) in bytes per 1000 steps, fitted
# by least squares after step 1000 (the first evaluation and checkpoint), and fails past 1 MiB per
# 1000 steps.
#   tests/soak.sh TRAIN DECK WORK_DIR
set -uo pipefail
TRAIN=$1 DECK=$2 WORK=$3
rm -rf "$WORK" && mkdir -p "$WORK"
fail() { echo "FAIL: $*"; exit 1; }
timeout 900 mpirun --oversubscribe --allow-run-as-root -np 2 "$TRAIN" "$DECK" --set run.out_dir="$WORK/run" --set run.max_steps=10000 \
  --set run.epochs=1000 --set log.every_steps=100 --set log.progress=none --set eval.every_steps=1000 --set checkpoint.every_steps=1000 \
  --set checkpoint.keep_last=2 >"$WORK/soak.log" 2>&1 || { tail -20 "$WORK/soak.log"; fail "the soak run failed"; }
grep -q "warning: rank .*resident memory grew" "$WORK/soak.log" && fail "fsdp-train warned of growing resident memory"
python3 - "$WORK/run/metrics.csv" "$WORK/run/summary.json" <<'PY' || exit 1
import csv, json, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["rss_mib"]]
steps = [int(r["step"]) for r in rows]
if not steps or steps[-1] != 10000: sys.exit(f"FAIL: metrics.csv ends at step {steps[-1] if steps else None}, not 10000")
pts = [(s, float(r["rss_mib"])) for s, r in zip(steps, rows) if s > 1000]
n = len(pts); mx = sum(s for s, _ in pts) / n; my = sum(m for _, m in pts) / n
slope = sum((s - mx) * (m - my) for s, m in pts) / sum((s - mx) ** 2 for s, _ in pts)  # MiB per step
per_1000 = slope * 1000 * 1048576
growth = json.load(open(sys.argv[2]))["rss_growth_mib"]
print(f"soak: {n} samples of rss_mib after step 1000 (the first evaluation and checkpoint) to 10000: {min(m for _, m in pts):.1f} .. {max(m for _, m in pts):.1f} MiB, "
      f"slope {per_1000:.0f} bytes per 1000 steps; growth since warm-up per rank (MiB): {growth}")
if per_1000 > 1048576: sys.exit("FAIL: resident memory grows by more than 1 MiB per 1000 steps")
PY
echo "soak passed"
