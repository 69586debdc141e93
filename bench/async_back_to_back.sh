#!/usr/bin/env bash
# Back-to-back asynchronous saves (docs/performance.md, issue: a save issued while the previous one is
# still being written): one rank x one thread, so that a core is free for the I/O thread; a GPT of about
# 150M parameters (fp32 Adam, SHARDED_STATE_DICT), saving every CKPT_EVERY steps, more often than a
# write takes. Per repetition, in turn: synchronous saves, then checkpoint.async with each
# checkpoint.async_when_writing policy (a mode NAME_at_save: that policy with checkpoint.async_copy =
# "at_save", the whole copy at the save; otherwise the default "background"). Reported from each
# run's log, metrics.csv and summary.json: the time training was held by each save (synchronous: the
# whole save; asynchronous: the copy plus any wait for a previous write, plus the update's wait for a
# background copy), against the synchronous save; the step after each save against the median step (a
# background copy shares the memory bandwidth with it); the saves skipped; each write's duration.
#   bench/async_back_to_back.sh [OUT_DIR]      (default build/bench/async_back_to_back)
# Environment: B2B_REPS (default 2), B2B_STEPS (7), CKPT_EVERY (2): saves at steps 2, 4 and 6;
# B2B_MODES (default "sync queue wait skip"); B2B_REPORT_ONLY=1: the table from OUT_DIR's runs only.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/build/bench/async_back_to_back}
TRAIN=${FSDP_TRAIN:-$ROOT/build/bin/fsdp-train}
STEPS=${B2B_STEPS:-7} EVERY=${CKPT_EVERY:-2} REPS=${B2B_REPS:-2} MODES=${B2B_MODES:-sync queue wait skip}
mkdir -p "$OUT"
export OMPI_MCA_mpi_yield_when_idle=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

if [[ -z ${B2B_REPORT_ONLY:-} ]]; then
  for rep in $(seq "$REPS"); do
    for mode in $MODES; do
      name=${mode}_$rep dir=$OUT/${mode}_$rep
      rm -rf "$dir"
      policy=()
      [[ $mode == sync ]] || policy=(--set checkpoint.async=true --set checkpoint.async_when_writing="${mode%_at_save}")
      [[ $mode == *_at_save ]] && policy+=(--set checkpoint.async_copy=at_save)
      cmd=(mpirun --allow-run-as-root --bind-to none -np 1 "$TRAIN" "$ROOT/inputs/gpt_tokens.toml"
           --set run.out_dir="$dir" --set run.max_steps="$STEPS" --set run.threads=1 --set log.every_steps=1 --set log.progress=plain
           --set model.d_model=1024 --set model.n_heads=16 --set model.n_layers=12 --set model.dropout=0.0
           --set data.num_samples=512 --set data.batch_size=1 --set data.test_samples=8 --set data.test_batch_size=8
           --set optim.kind=adam --set optim.clip_grad_norm=0 --set optim.warmup_steps=0 --set optim.schedule=constant
           --set checkpoint.every_steps="$EVERY" --set checkpoint.keep_last=1 --set checkpoint.save_final=false --set checkpoint.resume=none
           "${policy[@]}")
      echo "\$ ${cmd[*]}" >"$OUT/$name.log"
      "${cmd[@]}" >>"$OUT/$name.log" 2>&1 || { tail -20 "$OUT/$name.log"; exit 1; }
      rm -rf "$dir/checkpoints"
      echo "$name done"
    done
  done
fi

/usr/bin/python3 - "$OUT" "$REPS" $MODES <<'EOF' | tee "$OUT/results.md"
import csv, json, os, re, statistics, sys
out, reps, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
med = statistics.median
held_line = re.compile(r"writing in the background[^(]*\(training held ([0-9.]+) s: ([0-9.]+) s copying the state[^,]*, ([0-9.]+) s waiting")
runs = {m: [json.load(open(f"{out}/{m}_{r}/summary.json")) for r in range(1, reps + 1)] for m in modes}
sync_save = med([h for s in runs["sync"] for h in s["checkpoints"]["held_s"]]) if "sync" in runs else None
print(f"{reps} repetition(s); saves every {os.environ.get('CKPT_EVERY', '2')} steps; median step (after the warm-up) and the "
      "time training was held per save, each save in order (median over the repetitions)\n")
def steps_after_saves(run_dir, summary):
    """ms of each step that follows a save, less the run's median step."""
    every = int(os.environ.get("CKPT_EVERY", "2"))
    rows = {int(r["step"]): float(r["step_ms"]) for r in csv.DictReader(open(f"{run_dir}/metrics.csv"))}
    return [rows[s + 1] - summary["step_ms_median"] for s in sorted(rows) if s % every == 0 and s + 1 in rows]
print("| mode | median step ms | held per save s (in order) | largest held / sync save | waited for a previous write s (in order) | "
      "step after a save - median step, ms (in order) | saves skipped | write s (median) | peak RSS MiB |")
print("|---|---:|---|---:|---|---|---:|---:|---:|")
for m in modes:
    rs = runs[m]
    n = min(len(s["checkpoints"]["held_s"]) for s in rs)
    held = [med([s["checkpoints"]["held_s"][i] for s in rs]) for i in range(n)]
    waits = "-"
    if m != "sync":
        per_run = [[float(w) for _, _, w in held_line.findall(open(f"{out}/{m}_{r}.log").read())] for r in range(1, reps + 1)]
        k = min(len(p) for p in per_run)
        waits = ", ".join(f"{med([p[i] for p in per_run]):.2f}" for i in range(k))
    after = [steps_after_saves(f"{out}/{m}_{r}", rs[r - 1]) for r in range(1, reps + 1)]
    k = min(len(a) for a in after)
    after_text = ", ".join(f"{med([a[i] for a in after]):+.0f}" for i in range(k)) or "-"
    skipped = med([len(s["checkpoints"].get("skipped_saves", [])) for s in rs])
    ratio = f"{max(held) / sync_save:.3f}" if sync_save and held else "-"
    print(f"| {m} | {med([s['step_ms_median'] for s in rs]):.0f} | {', '.join(f'{h:.2f}' for h in held)} | {ratio} | {waits} | "
          f"{after_text} | {skipped:.0f} | {med([w for s in rs for w in s['checkpoints']['write_s']]):.2f} | {med([max(s['peak_rss_mb']) for s in rs]):.0f} |")
EOF
