#!/usr/bin/env bash
# make check-gpu: the GPU tests (ctest -L gpu). Succeeds only when the tests that need a device ran and
# passed: on a machine without a usable GPU they are skipped, and then nothing was verified, which is a
# failure here, not a pass (docs/gpu.md).
#   scripts/check_gpu.sh BUILD_DIR
set -uo pipefail
BUILD_DIR=${1:-build}
cd "$BUILD_DIR" || exit 1
log=$(mktemp)
ctest -L gpu --output-on-failure --no-tests=error 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
# The tests that need a CUDA device; the others (the id file, the skip itself) run anywhere.
device_tests=(test_nccl_np1 test_nccl_np2 test_engine_gpu_np1 test_engine_gpu_np2)
ran=0
for t in "${device_tests[@]}"; do
  grep -Eq "Test +#[0-9]+: $t \.+ +Passed" "$log" && ran=$((ran + 1))
done
rm -f "$log"
if ((status != 0)); then
  echo "check-gpu: FAILED (see above)"
  exit "$status"
fi
if ((ran == 0)); then
  echo "check-gpu: every test that needs a GPU was skipped (${device_tests[*]}): NOTHING WAS VERIFIED." \
       "It needs a visible CUDA device per rank and a LibTorch built with CUDA (Torch_DIR); see docs/gpu.md"
  exit 1
fi
echo "check-gpu: passed; ${ran} of ${#device_tests[@]} device tests ran on a GPU"
