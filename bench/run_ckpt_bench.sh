#!/bin/sh
# Runs the checkpoint benchmark (fsdp_ckpt_bench) and its PyTorch peer (ckpt_peer.py) with the same
# model at each world size given (default: 2 1); see docs/performance.md.
#   bench/run_ckpt_bench.sh [NP ...]        extra flags for both through BENCH_ARGS, e.g. BENCH_ARGS="--reps 5"
set -eu
cd "$(dirname "$0")/.."
export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none
MPIRUN="mpirun --oversubscribe --allow-run-as-root"
ARGS=${BENCH_ARGS:---width 2048 --layers 16 --reps 3}
[ -x build/bin/fsdp_ckpt_bench ] || { cmake -S . -B build && cmake --build build --target fsdp_ckpt_bench -j2; }
for np in ${@:-2 1}; do
  echo "## np=$np  $(date -u +%FT%TZ)  load average: $(cut -d' ' -f1-3 /proc/loadavg)"
  $MPIRUN -np "$np" build/bin/fsdp_ckpt_bench $ARGS
  $MPIRUN -np "$np" /usr/bin/python3 bench/ckpt_peer.py $ARGS
  # Peak RSS of a weights load, each in a fresh process, interleaved, 3 times each.
  echo "| weights load | ranks | weights MiB | rank 0 peak RSS growth MiB | other ranks, max MiB |"
  for rep in 1 2 3; do
    for how in ranges rank0; do
      $MPIRUN -np "$np" build/bin/fsdp_ckpt_bench $ARGS --rss-probe "$how" | grep '^| '
    done
  done
done
