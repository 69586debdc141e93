#!/usr/bin/env bash
# Optimizer state over the shard group or over the world (docs/performance.md, "HFSDP"): the 124M GPT of
# bench/decks/gpt125m.toml (AdamW, clipping, every block a unit) at 4 ranks under HYBRID_SHARD with shard
# groups of 2 ranks (2 replica groups) and of 1 rank (4 replica groups), fsdp.optimizer_sharding = group
# against world, alternating within each repetition. Per configuration: the median over the
# repetitions of the largest per-rank peak RSS (summary.json) beside fsdp-plan's prediction for the same
# command line, the training state fsdp-train expects per rank, and the median step time.
#   bench/optimizer_sharding.sh [OUT_DIR]     (default build/bench/optimizer_sharding)
# Environment: OPT_REPS (default 3), OPT_STEPS (default 8), OPT_GROUPS (default "2 1").
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/build/bench/optimizer_sharding}
TRAIN=${FSDP_TRAIN:-$ROOT/build/bin/fsdp-train}
PLAN=${FSDP_PLAN:-$ROOT/build/bin/fsdp-plan}
REPS=${OPT_REPS:-3} STEPS=${OPT_STEPS:-8}
mkdir -p "$OUT"
export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1
deck=$ROOT/bench/decks/gpt125m.toml

for rep in $(seq "$REPS"); do
  for group in ${OPT_GROUPS:-2 1}; do
    for sharding in group world; do
      name=g${group}_${sharding}_$rep dir=$OUT/g${group}_${sharding}_$rep
      rm -rf "$dir"
      args=(--set fsdp.sharding_strategy=HYBRID_SHARD --set fsdp.shard_group_size="$group" --set fsdp.optimizer_sharding="$sharding"
            --set data.batch_size=2 --set run.max_steps="$STEPS" --set log.progress=plain --set run.out_dir="$dir")
      cmd=(mpirun --oversubscribe --allow-run-as-root -np 4 "$TRAIN" "$deck" "${args[@]}")
      echo "\$ ${cmd[*]}" >"$OUT/$name.log"
      "${cmd[@]}" >>"$OUT/$name.log" 2>&1 || { tail -20 "$OUT/$name.log"; exit 1; }
      "$PLAN" "$deck" --np 4 "${args[@]}" >"$OUT/$name.plan"
      echo "$name done"
    done
  done
done

/usr/bin/python3 - "$OUT" "$REPS" ${OPT_GROUPS:-2 1} <<'PY' | tee "$OUT/results.md"
import json, re, statistics, sys
out, reps, groups = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
med = statistics.median
def num(path, pattern):
    return float(re.search(pattern, open(path).read()).group(1))
print("| shard group | replicas | optimizer_sharding | expected state MiB per rank | peak RSS MiB per rank, max over ranks (median of runs) | fsdp-plan MiB | median step ms | step / group's |")
print("|---:|---:|---|---:|---:|---:|---:|---:|")
for g in groups:
    step_group = None
    for sharding in ("group", "world"):
        runs = [f"{out}/g{g}_{sharding}_{r}" for r in range(1, reps + 1)]
        summaries = [json.load(open(f"{d}/summary.json")) for d in runs]
        peak = med([max(s["peak_rss_mb"]) for s in summaries])
        step = med([s["step_ms_median"] for s in summaries])
        state = num(f"{runs[0]}.log", r"expected ([0-9.]+) MiB of params")
        plan = num(f"{runs[0]}.plan", r"predicted peak RSS per rank: ([0-9.]+) MiB")
        step_group = step_group or step
        print(f"| {g} | {4 // int(g)} | {sharding} | {state:.0f} | {peak:.0f} | {plan:.0f} | {step:.0f} | {step / step_group:.2f} |")
PY
