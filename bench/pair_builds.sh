#!/bin/bash
# Two builds of fsdp-train and PyTorch DDP on one deck, run in turn with the order rotating, so that a
# slower step of the product can be told from a slower machine. `make bench` pairs fsdp-train with
# its peers within one run only: its ratios from two days also compare two machines (this one changes
# speed, and its CPU model, between sessions). Each round runs the three once; the report is the
# median of the per-round ratios with their range.
#
#   bench/pair_builds.sh OLD_FSDP_TRAIN NEW_FSDP_TRAIN [ROUNDS] [OUT]
#
# An older build: `git worktree add /tmp/old <commit>`, then configure and build its fsdp-train there.
# Environment (defaults): PAIR_DECK (bench/decks/cnn.toml), PAIR_NP (2), PAIR_GLOBAL_BATCH (64, split
# over the ranks), PAIR_THREADS (1 per rank; ranks x threads <= cores), PAIR_STEPS (40 timed after
# PAIR_WARMUP = 3), PAIR_STRATEGY (FULL_SHARD). The environment is make bench's: Open MPI's default
# single copy (OMPI_MCA_btl_vader_single_copy_mechanism=none where make bench's probe chose none: its
# single_copy.txt), OMP_WAIT_POLICY=PASSIVE, the same OpenBLAS threads on both sides.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if (($# < 2)); then
  echo "usage: $0 OLD_FSDP_TRAIN NEW_FSDP_TRAIN [ROUNDS] [OUT]" >&2
  exit 2
fi
old=$(realpath "$1") new=$(realpath "$2") rounds=${3:-9} out=${4:-$ROOT/build/pair_builds}
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "$0: ROUNDS '$rounds' is not a whole number >= 1" >&2; exit 2; }
for bin in "$old" "$new"; do
  [[ -x $bin ]] || { echo "$0: $bin is not an executable fsdp-train" >&2; exit 2; }
done
deck=$(realpath "${PAIR_DECK:-$ROOT/bench/decks/cnn.toml}")
np=${PAIR_NP:-2} threads=${PAIR_THREADS:-1} warmup=${PAIR_WARMUP:-3}
global_batch=${PAIR_GLOBAL_BATCH:-64}
((global_batch % np == 0)) || { echo "$0: PAIR_GLOBAL_BATCH $global_batch does not split over $np ranks" >&2; exit 2; }
per_rank=$((global_batch / np))
mkdir -p "$out"
: >"$out/rounds.txt"

export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_btl=self,vader OMP_NUM_THREADS=$threads OMP_WAIT_POLICY=PASSIVE \
  OPENBLAS_NUM_THREADS=$threads FSDP_COMM_SKEW_PROBE=1 PYTHONDONTWRITEBYTECODE=1
mpirun=(mpirun --oversubscribe --allow-run-as-root)
((threads > 1)) && mpirun+=(--bind-to none)
sets=(--set "data.batch_size=$per_rank" --set "run.threads=$threads" --set "run.max_steps=$((warmup + ${PAIR_STEPS:-40}))")

median_ms() { /usr/bin/python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['step_ms_median'])" "$1/summary.json"; }
fsdp() {  # tag binary
  local dir=$out/$1
  rm -rf "$dir" && mkdir -p "$dir"
  "${mpirun[@]}" -np "$np" "$2" "$deck" --set "run.out_dir=$dir" "${sets[@]}" --set "fsdp.sharding_strategy=${PAIR_STRATEGY:-FULL_SHARD}" \
    --set "log.timing_warmup_steps=$warmup" >"$dir.log" 2>&1 || { echo "$0: $1 failed, see $dir.log" >&2; exit 1; }
  median_ms "$dir"
}
ddp() {  # tag
  local dir=$out/$1
  rm -rf "$dir" && mkdir -p "$dir"
  "${mpirun[@]}" -np "$np" /usr/bin/python3 "$ROOT/bench/train_peer.py" "$deck" --set "run.out_dir=$dir" "${sets[@]}" \
    --set fsdp.sharding_strategy=NO_SHARD --out-dir "$dir" --warmup "$warmup" --wrapper ddp --init-file "$dir/gloo_rendezvous" \
    >"$dir.log" 2>&1 || { echo "$0: $1 failed, see $dir.log" >&2; exit 1; }
  median_ms "$dir"
}

for ((i = 1; i <= rounds; i++)); do
  case $((i % 3)) in
    1) o=$(fsdp "old$i" "$old"); n=$(fsdp "new$i" "$new"); d=$(ddp "ddp$i") ;;
    2) n=$(fsdp "new$i" "$new"); d=$(ddp "ddp$i"); o=$(fsdp "old$i" "$old") ;;
    0) d=$(ddp "ddp$i"); o=$(fsdp "old$i" "$old"); n=$(fsdp "new$i" "$new") ;;
  esac
  echo "$i $o $n $d" | tee -a "$out/rounds.txt"
done

/usr/bin/python3 - "$out/rounds.txt" "$old" "$new" "$deck" "$np" <<'EOF' | tee "$out/results.md"
import statistics, sys
rows = [[float(x) for x in line.split()[1:]] for line in open(sys.argv[1]) if line.strip()]
old, new, ddp = zip(*rows)
def paired(a, b):
    r = [x / y for x, y in zip(a, b)]
    return f"{statistics.median(r):.3f} x [{min(r):.3f}-{max(r):.3f}]"
print(f"{sys.argv[4]} at np {sys.argv[5]}, {len(rows)} rounds (median step ms, ratios per round)")
print(f"- old {sys.argv[2]}: {statistics.median(old):.1f} ms, {paired(old, ddp)} DDP")
print(f"- new {sys.argv[3]}: {statistics.median(new):.1f} ms, {paired(new, ddp)} DDP")
print(f"- PyTorch DDP: {statistics.median(ddp):.1f} ms")
print(f"- new / old: {paired(new, old)}")
EOF
