#!/usr/bin/env bash
# Asynchronous against synchronous checkpoints (docs/performance.md): a GPT of about 250M parameters
# (fp32 Adam, FULL_SHARD, SHARDED_STATE_DICT), saving every CKPT_EVERY steps. Both modes alternate
# within each repetition. From each run's summary.json: the time training was held per save (the
# whole save when synchronous; the copy to the host plus any wait for the previous write when
# asynchronous; the copy and the wait are read from the run's log), each write's duration, and the
# median step time with and without a write in flight.
#   bench/async_checkpoint.sh [OUT_DIR]       (default build/bench/async_ckpt)
# Environment: ASYNC_NP (default "2 4"), ASYNC_REPS (default 3), ASYNC_STEPS (18), CKPT_EVERY (8): saves at
# steps 8 and 16, both followed by training (the run's end waits for the last write, outside any step).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/build/bench/async_ckpt}
TRAIN=${FSDP_TRAIN:-$ROOT/build/bin/fsdp-train}
STEPS=${ASYNC_STEPS:-18} EVERY=${CKPT_EVERY:-8} REPS=${ASYNC_REPS:-3}
mkdir -p "$OUT"
export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1

if [[ -z ${ASYNC_REPORT_ONLY:-} ]]; then  # ASYNC_REPORT_ONLY=1: the table from OUT_DIR's runs only
  for np in ${ASYNC_NP:-2 4}; do
    for rep in $(seq "$REPS"); do
      for mode in sync async; do
        name=np${np}_${mode}_$rep dir=$OUT/np${np}_${mode}_$rep
        rm -rf "$dir"
        cmd=(mpirun --oversubscribe --allow-run-as-root -np "$np" "$TRAIN" "$ROOT/inputs/gpt_tokens.toml"
             --set run.out_dir="$dir" --set run.max_steps="$STEPS" --set run.threads=1 --set log.every_steps=1 --set log.progress=plain
             --set model.d_model=1024 --set model.n_heads=16 --set model.n_layers=20 --set model.dropout=0.0
             --set data.num_samples=512 --set data.batch_size=1 --set data.test_samples=8 --set data.test_batch_size=8
             --set optim.kind=adam --set optim.clip_grad_norm=0 --set optim.warmup_steps=0 --set optim.schedule=constant
             --set fsdp.sharding_strategy=FULL_SHARD --set fsdp.deferred_init=true
             --set checkpoint.every_steps="$EVERY" --set checkpoint.keep_last=1 --set checkpoint.save_final=false --set checkpoint.resume=none
             --set checkpoint.async=$([[ $mode == async ]] && echo true || echo false))
        echo "\$ ${cmd[*]}" >"$OUT/$name.log"
        "${cmd[@]}" >>"$OUT/$name.log" 2>&1 || { tail -20 "$OUT/$name.log"; exit 1; }
        rm -rf "$dir/checkpoints"
        echo "$name done"
      done
    done
  done
fi

/usr/bin/python3 - "$OUT" "$REPS" ${ASYNC_NP:-2 4} <<'EOF' | tee "$OUT/results.md"
import json, re, statistics, sys
out, reps, nps = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
med = statistics.median
def saves(log):  # per asynchronous save: (copy s, wait for the previous write s), from the run's log
    pat = re.compile(r"writing in the background \(training held [0-9.]+ s: ([0-9.]+) s copying the state, ([0-9.]+) s waiting")
    return [(float(a), float(b)) for a, b in pat.findall(open(log).read())]
print("| ranks | sync save s (training held) | async: copy s | copy / sync save | async: wait for the previous write s (1st, 2nd save) | "
      "async write s (1st save, training alongside) | median step ms, sync run | median step ms, write in flight | staging reserved once s | "
      "peak RSS MiB sync / async | params |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for np in nps:
    sync = [json.load(open(f"{out}/np{np}_sync_{r}/summary.json")) for r in range(1, reps + 1)]
    asyn = [json.load(open(f"{out}/np{np}_async_{r}/summary.json")) for r in range(1, reps + 1)]
    logs = [saves(f"{out}/np{np}_async_{r}.log") for r in range(1, reps + 1)]
    held_sync = med([h for s in sync for h in s["checkpoints"]["held_s"]])
    copy = med([c for run in logs for c, _ in run])
    wait1 = med([run[0][1] for run in logs])
    wait2 = med([run[1][1] for run in logs])
    write1 = med([s["checkpoints"]["write_s"][0] for s in asyn])
    reserve = med([s["checkpoints"]["reserve_s"] for s in asyn])
    step_plain = med([s["step_ms_median"] for s in sync])
    step_writing = med([s["checkpoints"]["step_ms_median_while_writing"] for s in asyn])
    rss_sync = med([max(s["peak_rss_mb"]) for s in sync])
    rss_async = med([max(s["peak_rss_mb"]) for s in asyn])
    print(f"| {np} | {held_sync:.2f} | {copy:.2f} | {copy / held_sync:.3f} | {wait1:.2f}, {wait2:.2f} | {write1:.1f} | "
          f"{step_plain:.0f} | {step_writing:.0f} | {reserve:.2f} | {rss_sync:.0f} / {rss_async:.0f} | {sync[0]['params']:,} |")
EOF
