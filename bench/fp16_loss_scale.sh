#!/usr/bin/env bash
# fp16 gradients with dynamic loss scaling against fp32 and bf16 (docs/performance.md): the GPT of
# inputs/gpt_tokens.toml (0.8M parameters, d_model 128, 4 blocks) at 2 ranks, AdamW, 300 steps, the
# three settings alternating within each repetition; fp16_reduce computes in fp32 and reduces the
# gradients in fp16 (fp16 arithmetic needs a GPU: LibTorch's CPU kernels lack it). Reports the final
# training loss against fp32's, the steps skipped on overflow, the final scale, the reduce-scatter bytes
# and the median step time.
#   bench/fp16_loss_scale.sh [OUT_DIR]      (default build/bench/fp16)
# Environment: FP16_REPS (default 3), FP16_STEPS (default 300), FP16_REPORT_ONLY.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/build/bench/fp16}
TRAIN=${FSDP_TRAIN:-$ROOT/build/bin/fsdp-train}
REPS=${FP16_REPS:-3} STEPS=${FP16_STEPS:-300}
mkdir -p "$OUT"
export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1
for rep in $(seq "$REPS"); do
  [[ -n ${FP16_REPORT_ONLY:-} ]] && break  # FP16_REPORT_ONLY=1: the table from OUT_DIR's runs only
  for mp in no bf16 fp16_reduce; do
    dir=$OUT/${mp}_$rep
    rm -rf "$dir"
    cmd=(mpirun --oversubscribe --allow-run-as-root -np 2 "$TRAIN" "$ROOT/inputs/gpt_tokens.toml" --set fsdp.mixed_precision="$mp"
         --set run.max_steps="$STEPS" --set run.threads=1 --set optim.warmup_steps=10 --set log.progress=none
         --set checkpoint.every_steps=0 --set checkpoint.save_final=false --set checkpoint.resume=none --set run.out_dir="$dir")
    echo "\$ ${cmd[*]}" >"$OUT/${mp}_$rep.log"
    "${cmd[@]}" >>"$OUT/${mp}_$rep.log" 2>&1 || { tail -20 "$OUT/${mp}_$rep.log"; exit 1; }
    echo "${mp}_$rep done"
  done
done
/usr/bin/python3 - "$OUT" "$REPS" <<'PY' | tee "$OUT/results.md"
import json, statistics, sys
out, reps = sys.argv[1], int(sys.argv[2])
med = statistics.median
runs = {mp: [json.load(open(f"{out}/{mp}_{r}/summary.json")) for r in range(1, reps + 1)] for mp in ("no", "bf16", "fp16_reduce")}
base = med([s["final_train_loss"] for s in runs["no"]])
print("| fsdp.mixed_precision | final train loss (median) | / fp32 | steps skipped on overflow | final loss scale | reduce-scatter bytes per rank | median step ms |")
print("|---|---:|---:|---:|---:|---:|---:|")
for mp, ss in runs.items():
    loss = med([s["final_train_loss"] for s in ss])
    print(f"| {mp} | {loss:.6f} | {loss / base:.5f} | {med([s.get('overflow_steps', 0) for s in ss]):.0f} | "
          f"{ss[0].get('loss_scale', '')} | {ss[0]['comm']['reduce_scatter']['bytes']} | {med([s['step_ms_median'] for s in ss]):.1f} |")
PY
