#!/usr/bin/env bash
# The Slurm scripts against a real Slurm on localhost (../shared/tools/slurm-local.sh: munge, slurmctld
# and two emulated nodes): a 2-node x 2-task hybrid run, a 3-point sweep array with its summary table,
# a preempted job (SIGUSR1) that checkpoints, requeues, resumes and ends with the weights of an
# uninterrupted run, a run continued on fewer nodes (--nodes=min-max, data.global_batch_size), two
# jobs on one run directory (the second refused) and runs larger than their --mem / --mem-per-cpu (refused).
# Every wait is bounded; the cluster is torn down on exit, also on failure.
#   tests/slurm_e2e.sh SOURCE_DIR BUILD_BIN WORK_DIR
set -uo pipefail
SRC=$1 BIN=$2 WORK=$3
SLURM_LOCAL=${SLURM_LOCAL:-$SRC/../shared/tools/slurm-local.sh}
if [[ ! -x $SLURM_LOCAL && ! -f $SLURM_LOCAL ]]; then
  echo "SKIP: $SLURM_LOCAL not found"
  exit 77
fi
if [[ $(id -u) != 0 ]]; then
  echo "SKIP: the localhost Slurm daemons need root"
  exit 77
fi
rm -rf "$WORK" && mkdir -p "$WORK"
export SLURM_LOCAL_DIR=$WORK/cluster SLURM_LOCAL_NODES=2
fail() { echo "FAIL: $*"; exit 1; }
down() { bash "$SLURM_LOCAL" down >/dev/null 2>&1 || true; }
trap down EXIT
bash "$SLURM_LOCAL" install >"$WORK/install.log" 2>&1 || { cat "$WORK/install.log"; fail "slurm-local install"; }
timeout 120 bash "$SLURM_LOCAL" up >"$WORK/up.log" 2>&1 || { cat "$WORK/up.log"; fail "slurm-local up"; }
eval "$(bash "$SLURM_LOCAL" env)"
cd "$SRC"
export FSDP_BIN=$BIN
DECK=inputs/ci_tiny.toml

wait_state() {  # wait_state JOBID PATTERN SECONDS: until `scontrol show job` matches
  local jid=$1 pattern=$2 limit=$3 i
  for ((i = 0; i < limit; i++)); do
    scontrol show job "$jid" 2>/dev/null | grep -Eq "$pattern" && return 0
    sleep 1
  done
  scontrol show job "$jid"
  return 1
}
final_state() { scontrol show job "$1" | grep -oE "JobState=[A-Z]+" | head -1; }

# 1. train.sbatch on 2 nodes x 2 tasks, HYBRID_SHARD with one shard group per node.
jid=$(sbatch --parsable --nodes=2 --ntasks-per-node=2 --output="$WORK/%x_%j.out" slurm/train.sbatch "$DECK" \
  --set run.out_dir="$WORK/hybrid" --set fsdp.sharding_strategy=HYBRID_SHARD) || fail "sbatch train.sbatch"
wait_state "$jid" "JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT)" 180 || fail "job $jid did not end"
[[ $(final_state "$jid") == JobState=COMPLETED ]] || { cat "$WORK/fsdp_$jid.out"; fail "job $jid: $(final_state "$jid")"; }
s=$(cat "$WORK/hybrid/summary.json")
for want in '"world_size": 4' '"nodes": 2' '"ranks_per_node": 2' '"strategy": "HYBRID_SHARD"' '"shard_group_size": 2' '"replica_groups": 2'; do
  grep -q "$want" <<<"$s" || { echo "$s"; fail "summary.json lacks $want"; }
done
grep -q "nodes 2: c\[1-2\]" "$WORK/fsdp_$jid.out" || fail "the job banner does not show the nodes"
echo "ok: 2 nodes x 2 tasks, hybrid groups of 2, summary as expected"

# 2. A 3-point sweep as a job array, then one table of the three summaries.
"$BIN/fsdp-sweep" "$DECK" --grid optim.lr=1e-3,2e-3,3e-3 --set run.max_steps=8 --set checkpoint.every_steps=0 --out "$WORK/sweep" \
  >"$WORK/sweep.log" || fail "fsdp-sweep"
jid=$(sbatch --parsable --array=0-2 --output="$WORK/%x_%A_%a.out" slurm/sweep.sbatch "$WORK/sweep/manifest.tsv") || fail "sbatch sweep.sbatch"
for t in 0 1 2; do
  wait_state "${jid}_$t" "JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT)" 180 || fail "array task $t did not end"
  [[ $(final_state "${jid}_$t") == JobState=COMPLETED ]] || { cat "$WORK"/fsdp-sweep_"${jid}"_$t.out; fail "array task $t failed"; }
done
slurm/sweep_summary.py "$WORK/sweep/manifest.tsv" >"$WORK/sweep_summary.log" || { cat "$WORK/sweep_summary.log"; fail "sweep_summary.py"; }
grep -q "3 points, 3 ok, 0 failed" "$WORK/sweep_summary.log" || { cat "$WORK/sweep_summary.log"; fail "the summary lacks 3 ok points"; }
[[ $(grep -c '^| [0-9]' "$WORK/sweep/summary.md") == 3 ]] || fail "summary.md does not have 3 rows"
[[ $(wc -l <"$WORK/sweep/summary.csv") == 4 ]] || fail "summary.csv does not have a header and 3 rows"
echo "ok: sweep of 3 points, summary table with 3 rows"

# 3. Preemption: SIGUSR1 to the batch script mid-run -> checkpoint, exit 3, requeue, resume from latest;
#    the final weights equal an uninterrupted run's.
#    The signal must arrive before the job's 200 steps are done: ci_tiny's 52k-parameter MLP takes under
#    5 ms a step on a quiet machine, so this run widens it to 670k parameters (about 30 ms a step) and
#    signals at step 20, leaving 180 steps for the signal to travel scancel -> slurmctld -> batch script
#    -> ranks. The checkpoint it stops at may be any step, also past the periodic one at 100.
long=(--set fsdp.sharding_strategy=HYBRID_SHARD --set run.max_steps=200 --set run.epochs=100 --set checkpoint.every_steps=100
      --set log.every_steps=10 --set "model.hidden_sizes=[512,512]")
ref=$(sbatch --parsable --nodes=2 --ntasks-per-node=2 --output="$WORK/%x_%j.out" slurm/train.sbatch "$DECK" "${long[@]}" \
  --set run.out_dir="$WORK/straight") || fail "sbatch reference"
jid=$(sbatch --parsable --nodes=2 --ntasks-per-node=2 --output="$WORK/%x_%j.out" slurm/train.sbatch "$DECK" "${long[@]}" \
  --set run.out_dir="$WORK/preempted") || fail "sbatch preempted"
for ((i = 0; i < 3000; i++)); do grep -q "step 20/" "$WORK/fsdp_$jid.out" 2>/dev/null && break; sleep 0.05; done
grep -q "step 20/" "$WORK/fsdp_$jid.out" || { cat "$WORK/fsdp_$jid.out"; fail "the job to preempt did not reach step 20"; }
scancel --signal=USR1 --batch "$jid" || fail "scancel --signal=USR1"
wait_state "$jid" "Restarts=1" 120 || { cat "$WORK/fsdp_$jid.out"; fail "job $jid was not requeued (did it end before the signal came?)"; }
# Slurm holds a requeued job for about two minutes (BeginTime), long enough for the nodes to clean up
# the old job step. A test need not wait that long, but must let the nodes become idle first.
for ((i = 0; i < 60; i++)); do
  [[ -z $(sinfo -h -o '%T' | grep -v idle) ]] && break
  sleep 1
done
sleep 2
scontrol update JobId="$jid" StartTime=now >/dev/null 2>&1 || true
wait_state "$jid" "JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT)" 300 || fail "requeued job $jid did not end"
[[ $(final_state "$jid") == JobState=COMPLETED ]] || { cat "$WORK/fsdp_$jid.out"; fail "requeued job: $(final_state "$jid")"; }
out=$(cat "$WORK/fsdp_$jid.out")
for want in "got SIGUSR1" "stopped by signal SIGUSR1 after step" "exited with code 3" "requeueing job $jid" "restart 1" \
            "resumed from .*/step_[0-9]+\\.h5 at step [0-9]+" "exited with code 0"; do
  grep -Eq "$want" <<<"$out" || { echo "$out"; fail "the preempted job's output lacks '$want'"; }
done
wait_state "$ref" "JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT)" 300 || fail "reference job did not end"
[[ $(final_state "$ref") == JobState=COMPLETED ]] || { cat "$WORK/fsdp_$ref.out"; fail "reference job failed"; }
"$BIN/fsdp-ckpt" diff "$WORK/preempted/checkpoints" "$WORK/straight/checkpoints" >"$WORK/preempt.diff" ||
  { cat "$WORK/preempt.diff"; fail "the preempted and requeued run ended with other weights"; }
echo "ok: preempted, checkpointed, requeued, resumed: final weights equal the uninterrupted run's"

# 4. Fewer nodes: a job on 2 nodes x 2 tasks stops at step 4; with node c2 drained (a failed node), the
#    same deck resubmitted with --nodes=1-2 runs on the node that remains (2 ranks instead of 4) and,
#    with data.global_batch_size fixed, ends with the weights of an uninterrupted run (within 1e-5;
#    SGD with momentum, see tests/resize_e2e.cmake).
elastic=(--set data.batch_size=16 --set data.global_batch_size=64 --set optim.kind=sgd --set optim.lr=0.05 --set optim.momentum=0.9
         --set checkpoint.every_steps=4 --set checkpoint.keep_last=0)
OMPI_MCA_mpi_yield_when_idle=1 mpirun --oversubscribe --allow-run-as-root -np 2 "$BIN/fsdp-train" "$DECK" "${elastic[@]}" \
  --set run.max_steps=8 --set run.out_dir="$WORK/elastic_ref" >"$WORK/elastic_ref.out" 2>&1 || { cat "$WORK/elastic_ref.out"; fail "reference run"; }
for ((i = 0; i < 60; i++)); do
  [[ -z $(sinfo -h -o '%T' | grep -v idle) ]] && break
  sleep 1
done
jid=$(sbatch --parsable --nodes=2 --ntasks-per-node=2 --output="$WORK/%x_%j.out" slurm/train.sbatch "$DECK" "${elastic[@]}" \
  --set run.max_steps=4 --set run.out_dir="$WORK/elastic") || fail "sbatch on 2 nodes"
wait_state "$jid" "JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT)" 180 || fail "job $jid did not end"
[[ $(final_state "$jid") == JobState=COMPLETED ]] || { cat "$WORK/fsdp_$jid.out"; fail "job $jid: $(final_state "$jid")"; }
for ((i = 0; i < 60; i++)); do
  [[ -z $(sinfo -h -o '%T' | grep -v idle) ]] && break
  sleep 1
done
scontrol update NodeName=c2 State=DRAIN Reason="elastic test" || fail "drain c2"
jid=$(sbatch --parsable --nodes=1-2 --ntasks-per-node=2 --output="$WORK/%x_%j.out" slurm/train.sbatch "$DECK" "${elastic[@]}" \
  --set run.max_steps=8 --set run.out_dir="$WORK/elastic") || fail "sbatch --nodes=1-2"
wait_state "$jid" "JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT)" 180 || fail "job $jid did not end"
scontrol update NodeName=c2 State=RESUME >/dev/null 2>&1 || true
[[ $(final_state "$jid") == JobState=COMPLETED ]] || { cat "$WORK/fsdp_$jid.out"; fail "job $jid: $(final_state "$jid")"; }
out=$(cat "$WORK/fsdp_$jid.out")
for want in "world size 2 on 1 node" "global batch 64 = 16 per rank x 2 ranks x 2 micro-batches" "resumed from .*/step_00000004.h5 at step 4"; do
  grep -Eq "$want" <<<"$out" || { echo "$out"; fail "the job on the remaining node lacks '$want'"; }
done
"$BIN/fsdp-ckpt" diff "$WORK/elastic/checkpoints" "$WORK/elastic_ref/checkpoints" --rtol 1e-5 >"$WORK/elastic.diff" ||
  { cat "$WORK/elastic.diff"; fail "the run continued on fewer nodes ended with other weights"; }
echo "ok: 4 ranks on 2 nodes, then 2 ranks on the node that remained (--nodes=1-2): weights of the uninterrupted run"

# 5. Two jobs on one run directory (a sweep point submitted twice): the second job ends at once with
#    exit code 2 naming the first job; the first is not disturbed (cancelled here to save time).
for ((i = 0; i < 60; i++)); do
  [[ -z $(sinfo -h -o '%T' | grep -v idle) ]] && break
  sleep 1
done
first=$(sbatch --parsable --nodes=1 --ntasks-per-node=1 --output="$WORK/%x_%j.out" slurm/train.sbatch "$DECK" "${long[@]}" \
  --set run.max_steps=100000 --set run.epochs=1000 --set run.out_dir="$WORK/twice") || fail "sbatch first"
for ((i = 0; i < 1200; i++)); do grep -q "step 10/" "$WORK/fsdp_$first.out" 2>/dev/null && break; sleep 0.1; done
grep -q "step 10/" "$WORK/fsdp_$first.out" || { cat "$WORK/fsdp_$first.out"; fail "the first job did not start training"; }
second=$(sbatch --parsable --nodes=1 --ntasks-per-node=1 --output="$WORK/%x_%j.out" slurm/train.sbatch "$DECK" \
  --set run.out_dir="$WORK/twice") || fail "sbatch second"
wait_state "$second" "JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT)" 120 || fail "job $second did not end"
[[ $(final_state "$second") == JobState=FAILED ]] || { cat "$WORK/fsdp_$second.out"; fail "the second job: $(final_state "$second")"; }
grep -Eq "ExitCode=2:" <(scontrol show job "$second") || { scontrol show job "$second"; fail "the second job's exit code is not 2"; }
grep -Eq "run directory '.*twice' is in use by another run \(host .*, pid [0-9]+, Slurm job $first" "$WORK/fsdp_$second.out" ||
  { cat "$WORK/fsdp_$second.out"; fail "the second job does not name the first"; }
[[ $(final_state "$first") == JobState=RUNNING ]] || { cat "$WORK/fsdp_$first.out"; fail "the first job was disturbed: $(final_state "$first")"; }
# scancel's SIGTERM: the ranks checkpoint and stop, and the job stays cancelled (no requeue).
scancel "$first"
wait_state "$first" "JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT|PENDING)" 120 || fail "job $first did not end after scancel"
[[ $(final_state "$first") == JobState=CANCELLED ]] && grep -q "Restarts=0" <(scontrol show job "$first") ||
  { cat "$WORK/fsdp_$first.out"; scontrol show job "$first"; fail "the cancelled job $first came back: $(final_state "$first")"; }
for ((i = 0; i < 100; i++)); do grep -q "got SIGTERM, passing it on (no requeue)" "$WORK/fsdp_$first.out" && break; sleep 0.2; done
grep -q "got SIGTERM, passing it on (no requeue)" "$WORK/fsdp_$first.out" || { cat "$WORK/fsdp_$first.out"; fail "job $first: no SIGTERM line"; }
echo "ok: a second job on a held run directory failed with exit code 2 naming the first job; scancel of the first cancelled it for good"

# 6. A run that will not fit in its allocation: a GPT predicted at about 1 GiB per rank, 2 ranks, under
#    --mem=900 (the job's SLURM_MEM_PER_NODE) or --mem-per-cpu=450: every rank exits 2 before building
#    anything, naming the prediction, the Slurm limit and what would fit; the job fails with exit code 2
#    (not the OOM killer).
big=(--set model.kind=transformer --set data.kind=tokens --set model.d_model=256 --set model.n_layers=12 --set model.context=64)
for mem in --mem=900 --mem-per-cpu=450; do
  jid=$(sbatch --parsable --nodes=1 --ntasks-per-node=2 "$mem" --output="$WORK/%x_%j.out" slurm/train.sbatch "$DECK" "${big[@]}" \
    --set run.out_dir="$WORK/fit") || fail "sbatch $mem"
  wait_state "$jid" "JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT)" 120 || fail "job $jid ($mem) did not end"
  [[ $(final_state "$jid") == JobState=FAILED ]] || { cat "$WORK/fsdp_$jid.out"; fail "$mem: $(final_state "$jid")"; }
  grep -Eq "ExitCode=2:" <(scontrol show job "$jid") || { scontrol show job "$jid"; fail "$mem: the job's exit code is not 2"; }
  [[ $mem == --mem=900 ]] && limit="limit 900 MiB \(Slurm --mem \(SLURM_MEM_PER_NODE=900 MiB\)\)" ||
    limit="limit [0-9]+ MiB \(Slurm --mem-per-cpu \(SLURM_MEM_PER_CPU=450 MiB x [0-9]+"
  pattern="the run will not fit in memory: predicted peak [0-9]+ MiB per rank .* x 2 rank\(s\) = [0-9]+ MiB on this node; $limit"
  [[ $(grep -Ec "$pattern" "$WORK/fsdp_$jid.out") -ge 1 ]] || { cat "$WORK/fsdp_$jid.out"; fail "$mem: the refusal does not name the prediction and the limit"; }
  grep -q "What would fit: data.batch_size" "$WORK/fsdp_$jid.out" || { cat "$WORK/fsdp_$jid.out"; fail "$mem: no suggestion of what would fit"; }
done
echo "ok: runs larger than their --mem or --mem-per-cpu were refused with exit code 2 before they started"
echo "all slurm cases passed"
