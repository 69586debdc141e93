#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (AddressSanitizer + UndefinedBehaviorSanitizer) and runs each
# for a bounded time on its seed corpus (fuzz/corpus/<target>). A crash leaves its input in
# fuzz/crashes/<target>/ and makes the script fail: add that input to the target's corpus as a
# regression case once the bug is fixed.
#   fuzz/run.sh [SECONDS_PER_TARGET] [BUILD_DIR]
set -euo pipefail
SECONDS_PER_TARGET=${1:-20}
SRC=$(cd "$(dirname "$0")/.." && pwd)
OUT=${2:-$SRC/build/fuzz}
mkdir -p "$OUT"
CXX=${FUZZ_CXX:-clang++}
if ! command -v "$CXX" >/dev/null || ! echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, unsigned long) { return 0; }' |
     "$CXX" -x c++ -fsanitize=fuzzer - -o "$OUT/probe" 2>/dev/null; then
  echo "SKIP: $CXX with libFuzzer is not available (make deps installs clang and libclang-rt-14-dev)"
  exit 77
fi
FLAGS=(-std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -DOMPI_SKIP_MPICXX=1)
INC=(-I"$SRC/include" -I"$SRC/app" $(pkg-config --cflags hdf5-openmpi))
# toml++ as users run it: Debian's compiled library (its internal debug assertions are off there).
"$CXX" "${FLAGS[@]}" "${INC[@]}" $(pkg-config --cflags tomlplusplus) "$SRC/fuzz/deck_fuzz.cpp" "$SRC/app/deck.cpp" "$SRC/app/deck_tables.cpp" "$SRC/app/deck_schema.cpp" "$SRC/app/deck_schema_outputs.cpp" "$SRC/app/deck_schema_model.cpp" "$SRC/app/hf_config.cpp" -o "$OUT/deck_fuzz" \
  $(pkg-config --libs tomlplusplus)
"$CXX" "${FLAGS[@]}" "${INC[@]}" "$SRC/fuzz/ckpt_fuzz.cpp" -o "$OUT/ckpt_fuzz" $(pkg-config --libs hdf5-openmpi)
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0}  # see -detect_leaks below
status=0
for target in deck ckpt; do
  mkdir -p "$OUT/corpus_$target" "$SRC/fuzz/crashes/$target"
  echo "fuzzing $target for $SECONDS_PER_TARGET s"
  # -detect_leaks=0: libhdf5 leaks small blocks on some error paths of malformed files; that is not
  # a crash and not ours to fix. Crashes, memory errors and undefined behaviour still fail.
  if ! "$OUT/${target}_fuzz" -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 -detect_leaks=0 \
       -artifact_prefix="$SRC/fuzz/crashes/$target/" "$OUT/corpus_$target" "$SRC/fuzz/corpus/$target" >"$OUT/$target.log" 2>&1; then
    tail -40 "$OUT/$target.log"
    echo "FAIL: $target fuzzer found a crash (input in fuzz/crashes/$target/)"
    status=1
  else
    grep -E "stat::number_of_executed_units|cov:" "$OUT/$target.log" | tail -2
  fi
done
((status == 0)) && echo "fuzzing passed"
exit $status
