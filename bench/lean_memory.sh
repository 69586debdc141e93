#!/usr/bin/env bash
# Memory at default settings (docs/performance.md, "Lean by default"): a 134M-parameter GPT (d_model 768,
# 12 blocks, vocabulary 32000, untied embeddings, context 128) at 4 ranks, FULL_SHARD against NO_SHARD,
# no memory knob set (the bench deck names its wrapped layer type; it is set back to the default, auto),
# evaluation included (data.test_batch_size 1000: each rank's whole share of the test
# set in one batch, evaluated in chunks). Each run trains LEAN_STEPS steps, evaluates, and reports the
# per-rank peak RSS from summary.json beside fsdp-plan's prediction for the same command line.
#   bench/lean_memory.sh [OUT_DIR]      (default build/bench/lean)
# Environment: LEAN_STEPS (default 3), LEAN_STRATEGIES (default "FULL_SHARD NO_SHARD"), LEAN_SET (more
# --set overrides, e.g. "run.malloc=return").
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/build/bench/lean}
TRAIN=${FSDP_TRAIN:-$ROOT/build/bin/fsdp-train}
PLAN=${FSDP_PLAN:-$ROOT/build/bin/fsdp-plan}
STEPS=${LEAN_STEPS:-3}
mkdir -p "$OUT"
export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1

deck=$ROOT/bench/decks/gpt125m.toml
sets=(model.vocab_size=32000 model.tie_embeddings=false model.context=128 fsdp.transformer_layer_cls_to_wrap=auto data.batch_size=2 data.test_batch_size=1000
      data.test_samples=48 run.max_steps="$STEPS" log.progress=plain)
for s in ${LEAN_SET:-}; do sets+=("$s"); done
printf '| strategy | peak RSS MiB per rank (measured) | max | fsdp-plan MiB | exit |\n|---|---|---:|---:|---:|\n' >"$OUT/results.md"
declare -A peak
for strategy in ${LEAN_STRATEGIES:-FULL_SHARD NO_SHARD}; do
  dir=$OUT/$strategy
  rm -rf "$dir"
  args=()
  for s in "${sets[@]}" fsdp.sharding_strategy="$strategy" run.out_dir="$dir"; do args+=(--set "$s"); done
  cmd=(mpirun --oversubscribe --allow-run-as-root -np 4 "$TRAIN" "$deck" "${args[@]}")
  echo "\$ ${cmd[*]}" | tee "$OUT/$strategy.log"
  set +e
  "${cmd[@]}" >>"$OUT/$strategy.log" 2>&1
  rc=$?
  set -e
  predicted=$("$PLAN" "$deck" --np 4 "${args[@]}" | sed -n 's/^predicted peak RSS per rank: \([0-9.]*\) MiB.*/\1/p')
  if [[ -f $dir/summary.json ]]; then
    IFS='|' read -r ranks top < <(/usr/bin/python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['peak_rss_mb']; print(', '.join(f'{x:.0f}' for x in r) + '|' + f'{max(r):.0f}')" "$dir/summary.json")
    peak[$strategy]=$top
  else
    ranks="failed: $(grep -m1 -iE 'error|killed|abort' "$OUT/$strategy.log" | cut -c1-100)"
    top="?"
  fi
  echo "| $strategy | $ranks | $top | $predicted | $rc |" | tee -a "$OUT/results.md"
done
if [[ -n ${peak[FULL_SHARD]:-} && -n ${peak[NO_SHARD]:-} ]]; then
  ratio=$(/usr/bin/python3 -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.2f}')" "${peak[FULL_SHARD]}" "${peak[NO_SHARD]}")
  echo "FULL_SHARD / NO_SHARD peak RSS: $ratio" | tee -a "$OUT/results.md"
fi
