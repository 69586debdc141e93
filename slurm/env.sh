# Site settings for fsdp's Slurm scripts: the one file to edit for a new cluster.
# Sourced by train.sbatch and sweep.sbatch (and by slurm/run_step.sh) on the batch node.

# Modules or environment your site needs, e.g.:
# module load openmpi/4.1 hdf5/1.10-openmpi
# module load cuda/12 nccl               # GPU builds

# Where the fsdp binaries are (default: build/bin of the checkout the job was submitted from).
export FSDP_ROOT=${FSDP_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
export FSDP_BIN=${FSDP_BIN:-$FSDP_ROOT/build/bin}

# How srun starts MPI ranks. Debian's Open MPI 4.1 works with pmix (pmi2 and none do not); check
# `srun --mpi=list` on your site. Alternatively set FSDP_LAUNCHER="mpirun" to start the ranks with
# mpirun inside the allocation.
export FSDP_SRUN_MPI=${FSDP_SRUN_MPI:-pmix}
export FSDP_LAUNCHER=${FSDP_LAUNCHER:-srun}

# Extra srun options. --kill-on-bad-exit=1 ends the whole step as soon as one rank fails (e.g. a rank
# that hit the collective deadline, comm.timeout_s), instead of leaving the others to their own
# deadline. Add e.g. "--cpu-bind=cores"; fsdp-train uses the cores of a node divided by its ranks as
# intra-op threads unless the deck sets run.threads.
export FSDP_SRUN_ARGS=${FSDP_SRUN_ARGS:---kill-on-bad-exit=1}

# Oversubscribed test clusters (more ranks than cores) need ranks that yield while they wait.
# export OMPI_MCA_mpi_yield_when_idle=1

# GPU/NCCL settings belong here too, e.g.:
# export NCCL_SOCKET_IFNAME=ib0
# export NCCL_IB_HCA=mlx5
