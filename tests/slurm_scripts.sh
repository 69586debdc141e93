#!/usr/bin/env bash
# slurm/run_step.sh's decisions without a Slurm (the real one runs in tests/slurm_e2e.sh): fake
# `mpirun`, `scontrol` and `fsdp-train` on PATH record what the script does.
#   - SIGUSR1: the step stops with exit 3 and the job is requeued; an array task by its own name
#     (ARRAY_TASK), never the whole array;
#   - SIGTERM (scancel, preemption): exit 3 passed on, no requeue (a cancelled job stays cancelled);
#   - a requeue that fails (sbatch --no-requeue) or a job past FSDP_MAX_REQUEUES: exit 3, not 0;
#   - the banner under `set -u` with Slurm's variables missing (salloc without -n).
#   tests/slurm_scripts.sh SOURCE_DIR WORK_DIR
set -uo pipefail
SRC=$1 WORK=$2
rm -rf "$WORK" && mkdir -p "$WORK/bin"
fail() { echo "FAIL: $*"; exit 1; }
cat >"$WORK/bin/fsdp-train" <<'SH'
#!/usr/bin/env bash
# Trains until a signal, then "saves" and exits 3 as fsdp-train does.
trap 'echo "stopped by signal SIGUSR1"; exit 3' USR1
trap 'echo "stopped by signal SIGTERM"; exit 3' TERM
echo "training $*"
while true; do sleep 0.05; done
SH
cat >"$WORK/bin/mpirun" <<'SH'
#!/usr/bin/env bash
# Passes signals on to the ranks as Open MPI's mpirun does (USR1, TERM). The traps come first: the
# test signals once the rank says it trains, which may be before a trap set after the start.
child=""
trap '[[ -n $child ]] && kill -USR1 $child' USR1
trap '[[ -n $child ]] && kill -TERM $child' TERM
"$@" &
child=$!
while kill -0 $child 2>/dev/null; do wait $child; rc=$?; done
exit $rc
SH
cat >"$WORK/bin/scontrol" <<'SH'
#!/usr/bin/env bash
echo "$*" >>"$SCONTROL_LOG"
exit "${SCONTROL_RC:-0}"
SH
chmod +x "$WORK/bin/"*
export PATH="$WORK/bin:$PATH" FSDP_BIN=$WORK/bin FSDP_LAUNCHER=mpirun SCONTROL_LOG=$WORK/scontrol.log

# step NAME SIGNAL [VAR=VALUE ...]: one fsdp_run_step in a shell of its own, signalled once training
# runs; prints the return code.
step() {
  local name=$1 signal=$2; shift 2
  : >"$SCONTROL_LOG"
  # shellcheck disable=SC2016  # expanded by the inner shell
  env "$@" bash -c 'set -uo pipefail; source "$0/slurm/run_step.sh"; fsdp_run_step deck.toml; echo "rc=$?"' "$SRC" >"$WORK/$name.log" 2>&1 &
  local shell=$!
  for ((i = 0; i < 200; i++)); do grep -qs "^training" "$WORK/$name.log" && break; sleep 0.05; done
  grep -q "^training" "$WORK/$name.log" || { cat "$WORK/$name.log"; fail "$name: the step did not start"; }
  kill "-$signal" "$shell"
  wait "$shell"
}
expect() {  # expect NAME PATTERN
  grep -Eq "$2" "$WORK/$1.log" || { cat "$WORK/$1.log"; fail "$1: no '$2'"; }
}

step usr1 USR1 SLURM_JOB_ID=41
expect usr1 "requeueing job 41"; expect usr1 "rc=0"
[[ $(cat "$SCONTROL_LOG") == "requeue 41" ]] || fail "usr1: scontrol got '$(cat "$SCONTROL_LOG")'"
echo "ok: SIGUSR1 requeues the job"

step array USR1 SLURM_JOB_ID=17 SLURM_ARRAY_JOB_ID=17 SLURM_ARRAY_TASK_ID=1
[[ $(cat "$SCONTROL_LOG") == "requeue 17_1" ]] || fail "array: scontrol got '$(cat "$SCONTROL_LOG")', not the task's own name 17_1"
echo "ok: an array task is requeued by its own name (17_1), not the array (17)"

step term TERM SLURM_JOB_ID=42
expect term "got SIGTERM, passing it on \(no requeue\)"; expect term "rc=3"
[[ ! -s $SCONTROL_LOG ]] || fail "term: scontrol was called: $(cat "$SCONTROL_LOG")"
echo "ok: SIGTERM (scancel) stops with exit 3 and no requeue"

step norequeue USR1 SLURM_JOB_ID=43 SCONTROL_RC=1
expect norequeue "the requeue of job 43 failed: the checkpoint is saved; submit the same command again to continue"; expect norequeue "rc=3"
echo "ok: a failed requeue ends the job with exit 3"

step capped USR1 SLURM_JOB_ID=44 SLURM_RESTART_COUNT=5 FSDP_MAX_REQUEUES=5
expect capped "not requeueing job 44: restarted 5 times already \(FSDP_MAX_REQUEUES=5\)"; expect capped "rc=3"
[[ ! -s $SCONTROL_LOG ]] || fail "capped: scontrol was called"
echo "ok: FSDP_MAX_REQUEUES bounds the requeues"

# shellcheck disable=SC2016  # expanded by the inner shell
env -i PATH="$PATH" SLURM_JOB_ID=45 SLURM_JOB_START_TIME=1000 SLURM_JOB_END_TIME=1060 \
  bash -c 'set -uo pipefail; source "$0/slurm/run_step.sh"; fsdp_job_banner' "$SRC" >"$WORK/banner.log" 2>&1 ||
  { cat "$WORK/banner.log"; fail "banner: failed with Slurm's variables missing"; }
expect banner "^job 45 \(\?\), restart 0"
expect banner "tasks \? \(\? per node\)"
expect banner "warning: the job's time limit \(60 s\) is not longer than the checkpoint signal's lead \(120 s"
echo "ok: the banner stands missing variables and warns of a time limit within the signal's lead"
# slurm/sweep_summary.py over a sweep made in $WORK with a relative --out, read from another folder:
# a point with a summary, one without, one whose summary is not an object, one whose losses are NaN
# after skipped steps, and one rewritten from its last checkpoint (its loss not measured: null).
mkdir -p "$WORK/sw/decks" "$WORK/elsewhere"
printf 'index\toverrides\tdeck\tout_dir\n' >"$WORK/sw/manifest.tsv"
for i in 0 1 2 3 4 5; do
  printf '%s\toptim.lr=%s\tsw/decks/point_000%s.toml\tsw/runs/point_000%s\n' "$i" "$i" "$i" "$i" >>"$WORK/sw/manifest.tsv"
  mkdir -p "$WORK/sw/runs/point_000$i"
done
echo '{"steps": 8, "final_train_loss": 0.5, "test_loss": 0.6}' >"$WORK/sw/runs/point_0000/summary.json"
echo '[1, 2]' >"$WORK/sw/runs/point_0002/summary.json"
echo '{"steps": 8, "skipped_steps": 2, "final_train_loss": null, "test_loss": NaN}' >"$WORK/sw/runs/point_0003/summary.json"
echo '{"steps": 8, "final_train_loss": null}' >"$WORK/sw/runs/point_0004/summary.json"
mkdir -p "$WORK/sw/runs/point_0005"
echo '{"steps": 8, "final_train_loss": 0.5, "test_loss": null}' >"$WORK/sw/runs/point_0005/summary.json"
(cd "$WORK/elsewhere" && "$SRC/slurm/sweep_summary.py" ../sw/manifest.tsv) >"$WORK/summary.log" 2>&1
rc=$?
[[ $rc == 1 ]] || { cat "$WORK/summary.log"; fail "sweep_summary.py: exit $rc, not 1 for failed points"; }
expect summary "6 points, 2 ok, 4 failed"
expect summary "point 5 \\(optim.lr=5\\) failed: non-finite test_loss in"
expect summary "^\| 0 \| optim.lr=0 \| ok \| 8 \| 0.5 \| 0.6 \|"
expect summary "point 1 \(optim.lr=1\) failed: .*point_0001/summary.json"
expect summary "point 2 \(optim.lr=2\) failed: .*point_0002/summary.json is not a JSON object"
expect summary "point 3 \(optim.lr=3\) failed: non-finite final_train_loss, test_loss in"
for bad in "$WORK/none.tsv" "$WORK/bin/scontrol"; do
  "$SRC/slurm/sweep_summary.py" "$bad" >"$WORK/summary_bad.log" 2>&1
  rc=$?
  [[ $rc == 2 ]] || { cat "$WORK/summary_bad.log"; fail "sweep_summary.py $bad: exit $rc, not 2"; }
done
expect summary_bad "is not a manifest fsdp-sweep wrote"
# An output that cannot be written: exit 2 naming it, nothing left under its name.
"$SRC/slurm/sweep_summary.py" "$WORK/sw/manifest.tsv" --csv "$WORK/no_such_dir/s.csv" >"$WORK/summary_nodir.log" 2>&1
rc=$?
[[ $rc == 2 ]] || { cat "$WORK/summary_nodir.log"; fail "sweep_summary.py with an unwritable --csv: exit $rc, not 2"; }
expect summary_nodir "cannot write .*no_such_dir/s.csv"
echo "ok: sweep_summary.py finds the runs from any folder and names failed, malformed and non-finite points"
echo "all slurm script cases passed"
