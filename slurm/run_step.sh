# Runs one fsdp-train job step inside a Slurm batch script, with preemption handling:
#   source slurm/run_step.sh; fsdp_run_step DECK [ARGS...]
# The batch script asks Slurm for SIGUSR1 before the time limit (#SBATCH --signal=B:USR1@N) or gets
# it from `scancel --signal=USR1 --batch`; this forwards it to the ranks, which save a checkpoint at the
# next step boundary and exit 3; the job is then requeued and, started again, resumes from `latest`.
# SIGTERM (scancel, preemption, the time limit itself) takes the same path without the requeue: a
# cancelled job stays cancelled, and a preempted one is requeued by Slurm itself.
# FSDP_MAX_REQUEUES (default 50) bounds the requeues of one job: a time limit shorter than the
# signal's lead would otherwise stop and requeue every run at once, forever.

fsdp_run_step() {
  local deck=$1; shift
  local step_pid="" rc requeue_asked=0  # set before the traps: a signal may come before the step starts
  local launch
  if [[ $FSDP_LAUNCHER == mpirun ]]; then
    launch=(mpirun)
  else
    # shellcheck disable=SC2206  # FSDP_SRUN_ARGS is a list of options, split on purpose
    launch=(srun "--mpi=$FSDP_SRUN_MPI" $FSDP_SRUN_ARGS)
  fi
  trap 'requeue_asked=1; echo "$(date -u +%FT%TZ) slurm: got SIGUSR1, asking the ranks to checkpoint and stop"; kill -USR1 "$step_pid" 2>/dev/null' USR1
  trap 'requeue_asked=0; echo "$(date -u +%FT%TZ) slurm: got SIGTERM, passing it on (no requeue)"; kill -TERM "$step_pid" 2>/dev/null' TERM
  "${launch[@]}" "$FSDP_BIN/fsdp-train" "$deck" "$@" &
  step_pid=$!
  # `wait` returns early when a trapped signal arrives: wait again until the step has really ended.
  while true; do
    wait "$step_pid"
    rc=$?
    kill -0 "$step_pid" 2>/dev/null || break
  done
  trap - USR1 TERM
  echo "$(date -u +%FT%TZ) fsdp-train exited with code $rc"
  ((rc == 3 && requeue_asked)) || return "$rc"
  # Stopped on SIGUSR1 with a checkpoint saved: run again later from `latest`. An array task is
  # requeued by its own name: the array's id alone would requeue every task of the array.
  local job=$SLURM_JOB_ID
  [[ -n ${SLURM_ARRAY_JOB_ID:-} && -n ${SLURM_ARRAY_TASK_ID:-} ]] && job=${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}
  local restarts=${SLURM_RESTART_COUNT:-0} most=${FSDP_MAX_REQUEUES:-50}
  if ((restarts >= most)); then
    echo "$(date -u +%FT%TZ) not requeueing job $job: restarted $restarts times already (FSDP_MAX_REQUEUES=$most); is --time longer than the --signal lead?" \
      "The checkpoint is saved: submit the same command again to continue" >&2
    return 3
  fi
  echo "$(date -u +%FT%TZ) requeueing job $job"
  if ! scontrol requeue "$job"; then
    # Requeueing disabled (sbatch --no-requeue, a site's JobRequeue=0): the job must not end as
    # COMPLETED with its training unfinished.
    echo "$(date -u +%FT%TZ) the requeue of job $job failed: the checkpoint is saved; submit the same command again to continue" >&2
    return 3
  fi
  return 0
}

fsdp_job_banner() {
  # Every variable may be missing (salloc without -n sets no SLURM_NTASKS) under `set -u`.
  echo "job ${SLURM_JOB_ID:-?}${SLURM_ARRAY_TASK_ID:+ array task $SLURM_ARRAY_TASK_ID} (${SLURM_JOB_NAME:-?}), restart ${SLURM_RESTART_COUNT:-0}"
  echo "nodes ${SLURM_JOB_NUM_NODES:-?}: ${SLURM_JOB_NODELIST:-?}; tasks ${SLURM_NTASKS:-?} (${SLURM_NTASKS_PER_NODE:-?} per node)"
  echo "started $(date -u +%FT%TZ) in $PWD"
  # A time limit within the checkpoint signal's lead stops every run at once (Slurm 23.02+ sets these).
  if [[ -n ${SLURM_JOB_START_TIME:-} && -n ${SLURM_JOB_END_TIME:-} ]] && ((SLURM_JOB_END_TIME - SLURM_JOB_START_TIME <= ${FSDP_SIGNAL_LEAD_S:-120})); then
    echo "warning: the job's time limit ($((SLURM_JOB_END_TIME - SLURM_JOB_START_TIME)) s) is not longer than the checkpoint signal's lead" \
      "(${FSDP_SIGNAL_LEAD_S:-120} s, #SBATCH --signal=B:USR1@120): each run stops at once; give a longer --time" >&2
  fi
}
