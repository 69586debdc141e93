#!/usr/bin/env bash
# Failure modes of fsdp-train under mpirun (docs/reliability.md): each case provokes one failure and
# checks the exit code, the message, the time to exit and that the last checkpoint still verifies.
#   tests/reliability_e2e.sh TRAIN CKPT_TOOL DECK WORK_DIR
set -uo pipefail
TRAIN=$1 CKPT=$2 DECK=$3 WORK=$4
MPI=(mpirun --oversubscribe --allow-run-as-root)
rm -rf "$WORK" && mkdir -p "$WORK"
fail() { echo "FAIL: $*"; exit 1; }
expect() {  # expect RC PATTERN LOGFILE
  local rc=$1 pattern=$2 log=$3
  [[ $(cat "$log.rc") == "$rc" ]] || { cat "$log"; fail "exit code $(cat "$log.rc"), expected $rc ($log)"; }
  grep -Eq "$pattern" "$log" || { cat "$log"; fail "no '$pattern' in $log"; }
  echo "ok: exit $rc, '$pattern'"
}
run() {  # run LOG ARGS...: runs in the foreground, records the exit code
  local log=$1; shift
  timeout 300 "$@" >"$log" 2>&1
  echo $? >"$log.rc"
}
short=(--set checkpoint.every_steps=0 --set checkpoint.keep_last=0)

# 1. Ranks with different decks: refused before the first training collective, exit 2 on every rank.
run "$WORK/differ.log" "${MPI[@]}" -np 1 "$TRAIN" "$DECK" --set run.out_dir="$WORK/differ" : \
  -np 1 "$TRAIN" "$DECK" --set run.out_dir="$WORK/differ" --set optim.lr=0.5
expect 2 "rank 1 runs a different job than rank 0: its resolved deck differs" "$WORK/differ.log"

# 2. A non-finite loss stops every rank with exit 4; the last checkpoint (step 1) is the newest and verifies.
run "$WORK/nan.log" "${MPI[@]}" -np 2 "$TRAIN" "$DECK" --set run.out_dir="$WORK/nan" --set optim.kind=sgd --set optim.lr=1e25 \
  --set checkpoint.every_steps=1
expect 4 "non-finite loss or gradient norm at step 2 .*stopped without saving" "$WORK/nan.log"
[[ $(cat "$WORK/nan/checkpoints/latest") == step_00000001.h5 ]] || fail "latest is not step 1 after the non-finite step"
"$CKPT" verify "$WORK/nan/checkpoints" >/dev/null || fail "the last checkpoint does not verify"
echo "ok: latest = step_00000001.h5 verifies"
#    ... or skips such steps when asked to.
run "$WORK/skip.log" "${MPI[@]}" -np 2 "$TRAIN" "$DECK" --set run.out_dir="$WORK/skip" --set optim.kind=sgd --set optim.lr=1e25 \
  --set run.on_nonfinite=skip "${short[@]}"
expect 0 "step skipped" "$WORK/skip.log"
grep -Eq '"skipped_steps": [1-9]' "$WORK/skip/summary.json" || fail "summary.json does not count skipped steps"

# 3. The checkpoint folder cannot be written (a file is in the way): exit 2 naming it, no hang.
touch "$WORK/blocked"
run "$WORK/blocked.log" "${MPI[@]}" -np 2 "$TRAIN" "$DECK" --set run.out_dir="$WORK/blk" --set checkpoint.dir="$WORK/blocked/ckpt"
expect 2 "cannot create checkpoint folder '$WORK/blocked/ckpt'" "$WORK/blocked.log"

# 4. A straight run to 300 steps, the reference for the interrupted ones.
long=(--set run.max_steps=300 --set run.epochs=100 --set log.every_steps=50 --set checkpoint.every_steps=25 --set checkpoint.keep_last=2)
run "$WORK/straight.log" "${MPI[@]}" -np 2 "$TRAIN" "$DECK" --set run.out_dir="$WORK/straight" "${long[@]}"
expect 0 "test accuracy" "$WORK/straight.log"

# 5. SIGUSR1 (sbatch --signal) to mpirun, SIGTERM (Slurm's time limit) to the ranks: every rank
#    finishes its step, a checkpoint is saved, exit 3; rerunning the command ends with the same weights.
interrupt() {  # interrupt NAME SIGNAL TARGET_PATTERN
  local name=$1 sig=$2 pattern=$3
  local start=$SECONDS
  ( timeout 300 "${MPI[@]}" -np 2 "$TRAIN" "$DECK" --set run.out_dir="$WORK/$name" "${long[@]}" >"$WORK/$name.log" 2>&1
    echo $? >"$WORK/$name.log.rc" ) &
  local job=$!
  for _ in $(seq 200); do grep -q "step 50/" "$WORK/$name.log" 2>/dev/null && break; sleep 0.1; done
  pkill "-$sig" -f "$pattern"
  wait $job
  expect 3 "stopped by signal SIG$sig after step [0-9]+; checkpoint saved" "$WORK/$name.log"
  echo "ok: exited $((SECONDS - start)) s after the start"
  "$CKPT" verify "$WORK/$name/checkpoints" >/dev/null || fail "$name: the checkpoint does not verify"
  run "$WORK/$name.2.log" "${MPI[@]}" -np 2 "$TRAIN" "$DECK" --set run.out_dir="$WORK/$name" "${long[@]}"
  expect 0 "resumed from .* at step [0-9]+" "$WORK/$name.2.log"
  "$CKPT" diff "$WORK/$name/checkpoints" "$WORK/straight/checkpoints" >"$WORK/$name.diff" || { cat "$WORK/$name.diff"; fail "$name: resumed weights differ"; }
  echo "ok: $name resumed to the straight run's weights, bit for bit"
}
interrupt usr1 USR1 "^mpirun.*$WORK/usr1"
interrupt term TERM "^[^ ]*fsdp-train .*$WORK/term"

# 6. A rank killed with SIGKILL: mpirun ends the job at once, naming the lost rank; the last checkpoint
#    verifies and resuming from it reproduces the straight run's final weights.
start=$SECONDS
( timeout 300 "${MPI[@]}" -np 2 "$TRAIN" "$DECK" --set run.out_dir="$WORK/kill" "${long[@]}" >"$WORK/kill.log" 2>&1
  echo $? >"$WORK/kill.log.rc" ) &
job=$!
for _ in $(seq 200); do grep -q "step 100/" "$WORK/kill.log" 2>/dev/null && break; sleep 0.1; done
victim=$(pgrep -f "^[^ ]*fsdp-train .*$WORK/kill" | tail -1)
kill -KILL "$victim"
wait $job
[[ $(cat "$WORK/kill.log.rc") != 0 ]] || fail "the job survived a killed rank"
grep -Eq "rank 1|exited on signal 9|Killed" "$WORK/kill.log" || { cat "$WORK/kill.log"; fail "no message naming the lost rank"; }
(( SECONDS - start < 60 )) || fail "the job took $((SECONDS - start)) s to end after a rank was killed"
echo "ok: killed rank ended the job with exit $(cat "$WORK/kill.log.rc") within $((SECONDS - start)) s"
"$CKPT" verify "$WORK/kill/checkpoints" >/dev/null || fail "the last checkpoint after a kill does not verify"
run "$WORK/kill.2.log" "${MPI[@]}" -np 2 "$TRAIN" "$DECK" --set run.out_dir="$WORK/kill" "${long[@]}"
expect 0 "resumed from" "$WORK/kill.2.log"
"$CKPT" diff "$WORK/kill/checkpoints" "$WORK/straight/checkpoints" >/dev/null || fail "weights after a kill and resume differ"
echo "ok: resumed after the kill to the straight run's weights, bit for bit"
echo "all reliability cases passed"
