#!/usr/bin/env bash
# The largest-model demonstration (docs/performance.md): GPT-style decoders trained with fp32 Adam at
# 4 ranks on this machine, FULL_SHARD against NO_SHARD, built with fsdp.deferred_init (no rank ever
# holds the whole unsharded model). Each run trains a few steps and records the per-rank peak RSS and
# the step time from summary.json.
#   bench/largest_model.sh [OUT_DIR]          (default build/bench/largest)
# Environment: LARGEST_CONFIGS to pick runs (names below), LARGEST_STEPS (default 3).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/build/bench/largest}
TRAIN=${FSDP_TRAIN:-$ROOT/build/bin/fsdp-train}
STEPS=${LARGEST_STEPS:-3}
mkdir -p "$OUT"
export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1

# name strategy d_model n_layers [run.malloc [fsdp.mixed_precision [more settings, key=value,key=value]]]
CONFIGS=(
  "gpt201m_no_shard NO_SHARD 1024 16"
  "gpt252m_no_shard NO_SHARD 1024 20"
  "gpt302m_no_shard NO_SHARD 1024 24"
  "gpt252m_full_shard FULL_SHARD 1024 20"
  "gpt302m_full_shard FULL_SHARD 1024 24"
  "gpt1007m_full_shard FULL_SHARD 2048 20"
  "gpt252m_no_shard_return NO_SHARD 1024 20 return"
  "gpt252m_full_shard_return FULL_SHARD 1024 20 return"
  "gpt1208m_full_shard_bf16 FULL_SHARD 2048 24 return bf16"
  "gpt1309m_full_shard_bf16 FULL_SHARD 2048 26 return bf16"
  # optim.state_dtype = bf16: Adam's moments in 2 bytes each (12 instead of 16 bytes per parameter);
  # activation checkpointing and d_model 1280 keep what is not state small. The same model with fp32
  # moments is refused by fsdp-train's memory check at start.
  "gpt1811m_full_shard_bf16_moments FULL_SHARD 1280 92 return bf16 optim.state_dtype=bf16,fsdp.activation_checkpointing=true"
  "gpt1811m_full_shard_fp32_moments FULL_SHARD 1280 92 return bf16 optim.state_dtype=fp32,fsdp.activation_checkpointing=true"
  "gpt1712m_full_shard_bf16_moments FULL_SHARD 2048 34 return bf16 optim.state_dtype=bf16"
)
wanted=${LARGEST_CONFIGS:-}
printf '| run | strategy | parameters | ranks | peak RSS MiB per rank | median step s | wall s | exit | fsdp-plan MiB per rank |\n|---|---|---:|---:|---|---:|---:|---:|---:|\n' >"$OUT/results.md"
for c in "${CONFIGS[@]}"; do
  read -r name strategy d_model n_layers malloc mp more <<<"$c"
  [[ -z $wanted || " $wanted " == *" $name "* ]] || continue
  dir=$OUT/$name
  rm -rf "$dir"
  cmd=(mpirun --oversubscribe --allow-run-as-root -np 4 "$TRAIN" "$ROOT/inputs/gpt_tokens.toml"
       --set run.out_dir="$dir" --set run.max_steps="$STEPS" --set run.threads=1 --set log.every_steps=1 --set log.progress=plain
       --set model.d_model="$d_model" --set model.n_heads=16 --set model.n_layers="$n_layers" --set model.dropout=0.0
       --set data.num_samples=256 --set data.batch_size=1 --set data.test_samples=8 --set data.test_batch_size=8
       --set optim.kind=adam --set optim.clip_grad_norm=0 --set optim.warmup_steps=0 --set optim.schedule=constant
       --set fsdp.sharding_strategy="$strategy" --set fsdp.deferred_init=true
       --set checkpoint.every_steps=0 --set checkpoint.save_final=false --set checkpoint.resume=none)
  # A fifth field: run.malloc (return: freed large blocks go back to the system).
  [[ -n ${malloc:-} ]] && cmd+=(--set run.malloc="$malloc")
  # A sixth: fsdp.mixed_precision (bf16: the gathered units and activations in half the bytes).
  [[ -n ${mp:-} ]] && cmd+=(--set fsdp.mixed_precision="$mp")
  # A seventh: more deck settings, comma-separated.
  if [[ -n ${more:-} ]]; then
    IFS=, read -ra settings <<<"$more"
    for kv in "${settings[@]}"; do cmd+=(--set "$kv"); done
  fi
  # fsdp-plan's prediction for the same deck and settings, beside the measurement.
  plan=$("${FSDP_PLAN:-$ROOT/build/bin/fsdp-plan}" "${cmd[@]:6}" --np 4 2>/dev/null | grep -oE "predicted peak RSS per rank: [0-9.]+" | grep -oE "[0-9.]+$" || echo "?")
  echo "\$ ${cmd[*]}" | tee "$OUT/$name.log"
  start=$SECONDS
  set +e
  "${cmd[@]}" >>"$OUT/$name.log" 2>&1
  rc=$?
  set -e
  wall=$((SECONDS - start))
  if [[ -f $dir/summary.json ]]; then
    row=$(/usr/bin/python3 - "$dir/summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"{s['params']:,} | {s['world_size']} | {', '.join(f'{r:.0f}' for r in s['peak_rss_mb'])} | {s['step_ms_median'] / 1000:.1f}")
EOF
)
  else
    row="? | 4 | failed: $(grep -m1 -iE 'error|killed|abort' "$OUT/$name.log" | cut -c1-120) | "
  fi
  echo "| $name | $strategy | $row | $wall | $rc | $plan |" | tee -a "$OUT/results.md"
done
echo "wrote $OUT/results.md"
