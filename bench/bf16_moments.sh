#!/usr/bin/env bash
# Adam's moments in bf16 against fp32 (optim.state_dtype, docs/performance.md "bf16 optimizer
# moments"): the 29.5M GPT of make bench (bench/decks/gpt30m.toml: AdamW, betas 0.9/0.95, clipping,
# constant lr 3e-4, seeded Markov-chain tokens) trained STEPS steps with each setting, the same data
# and seed, one rank of one thread each, both at once (one core each). Compares the training-loss
# curves (moving averages over WINDOW steps), the final evaluation loss and the optimizer's time.
#   bench/bf16_moments.sh [OUT_DIR]          (default build/bench/bf16_moments)
# Environment: BF16_STEPS (default 1000), BF16_WINDOW (default 50), BF16_BATCH (default 8).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/build/bench/bf16_moments}
TRAIN=${FSDP_TRAIN:-$ROOT/build/bin/fsdp-train}
STEPS=${BF16_STEPS:-1000}
WINDOW=${BF16_WINDOW:-50}
BATCH=${BF16_BATCH:-8}
mkdir -p "$OUT"
export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1

pids=()
core=0
for dtype in fp32 bf16; do
  dir=$OUT/$dtype
  rm -rf "$dir"
  cmd=(taskset -c "$core" "$TRAIN" "$ROOT/bench/decks/gpt30m.toml" --set run.out_dir="$dir" --set run.max_steps="$STEPS"
       --set run.threads=1 --set data.batch_size="$BATCH" --set data.num_samples=$((STEPS * BATCH)) --set data.test_samples=256
       --set log.every_steps=1 --set log.progress=none --set optim.state_dtype="$dtype")
  echo "\$ ${cmd[*]}" | tee "$OUT/$dtype.log"
  "${cmd[@]}" >>"$OUT/$dtype.log" 2>&1 &
  pids+=($!)
  core=$(((core + 1) % $(getconf _NPROCESSORS_ONLN)))  # not nproc: it reads OMP_NUM_THREADS
done
for p in "${pids[@]}"; do wait "$p"; done

/usr/bin/python3 - "$OUT" "$WINDOW" <<'EOF' | tee "$OUT/results.md"
import csv, json, statistics, sys
out, window = sys.argv[1], int(sys.argv[2])
rows = {d: list(csv.DictReader(open(f"{out}/{d}/metrics.csv"))) for d in ("fp32", "bf16")}
summary = {d: json.load(open(f"{out}/{d}/summary.json")) for d in rows}
loss = {d: [float(r["loss"]) for r in rows[d] if r["loss"]] for d in rows}
n = min(len(loss["fp32"]), len(loss["bf16"]))
def moving(xs):
    return [sum(xs[i - window:i]) / window for i in range(window, n + 1)]
a, b = moving(loss["fp32"][:n]), moving(loss["bf16"][:n])
rel = [abs(y - x) / x for x, y in zip(a, b)]
worst = max(range(len(rel)), key=rel.__getitem__)
opt = {d: statistics.median(float(r["optimizer_ms"]) for r in rows[d][3:]) for d in rows}
print(f"| | fp32 moments | bf16 moments | bf16 / fp32 |")
print(f"|---|---:|---:|---:|")
print(f"| steps | {len(loss['fp32'])} | {len(loss['bf16'])} | |")
print(f"| first {window} steps' mean training loss | {a[0]:.4f} | {b[0]:.4f} | {b[0] / a[0]:.4f} |")
print(f"| last {window} steps' mean training loss | {a[-1]:.4f} | {b[-1]:.4f} | {b[-1] / a[-1]:.4f} |")
print(f"| final evaluation loss | {summary['fp32']['test_loss']:.4f} | {summary['bf16']['test_loss']:.4f} | {summary['bf16']['test_loss'] / summary['fp32']['test_loss']:.4f} |")
print(f"| optimizer step, median ms | {opt['fp32']:.1f} | {opt['bf16']:.1f} | {opt['bf16'] / opt['fp32']:.2f} |")
print(f"| peak RSS MiB | {summary['fp32']['peak_rss_mb'][0]:.0f} | {summary['bf16']['peak_rss_mb'][0]:.0f} | |")
print()
print(f"Largest difference of the {window}-step moving averages: {100 * rel[worst]:.3f}% "
      f"(steps {worst + 1}-{worst + window}: {a[worst]:.4f} fp32, {b[worst]:.4f} bf16); "
      f"mean over the curve {100 * sum(rel) / len(rel):.3f}%.")
EOF
echo "wrote $OUT/results.md"
