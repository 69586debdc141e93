# Runs one fsdp-train job step inside a Slurm batch script, with preemption handling:
#   source slurm/run_step.sh; fsdp_run_step DECK [ARGS...]
# The batch script asks Slurm for SIGUSR1 before the time limit (#SBATCH --signal=B:USR1@N) or gets
# it from `scancel --signal=USR1 --batch`; this forwards it to the ranks, which save a checkpoint at the
# next step boundary and exit 3; the job is then requeued and, started again, resumes from `latest`.

fsdp_run_step() {
  local deck=$1; shift
  local step_pid rc
  local launch
  if [[ $FSDP_LAUNCHER == mpirun ]]; then
    launch=(mpirun)
  else
    launch=(srun "--mpi=$FSDP_SRUN_MPI" $FSDP_SRUN_ARGS)
  fi
  trap 'echo "$(date -u +%FT%TZ) slurm: got SIGUSR1, asking the ranks to checkpoint and stop"; kill -USR1 "$step_pid" 2>/dev/null' USR1
  trap 'echo "$(date -u +%FT%TZ) slurm: got SIGTERM, passing it on"; kill -TERM "$step_pid" 2>/dev/null' TERM
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
  if ((rc == 3)); then
    # Stopped on request with a checkpoint saved: run again later from `latest`.
    echo "$(date -u +%FT%TZ) requeueing job ${SLURM_JOB_ID}${SLURM_ARRAY_TASK_ID:+ (array task $SLURM_ARRAY_TASK_ID)}"
    scontrol requeue "$SLURM_JOB_ID"  # an array task has its own SLURM_JOB_ID
    return 0
  fi
  return "$rc"
}

fsdp_job_banner() {
  echo "job ${SLURM_JOB_ID}${SLURM_ARRAY_TASK_ID:+ array task $SLURM_ARRAY_TASK_ID} (${SLURM_JOB_NAME}), restart ${SLURM_RESTART_COUNT:-0}"
  echo "nodes ${SLURM_JOB_NUM_NODES}: ${SLURM_JOB_NODELIST}; tasks ${SLURM_NTASKS} (${SLURM_NTASKS_PER_NODE:-?} per node)"
  echo "started $(date -u +%FT%TZ) in $PWD"
}
