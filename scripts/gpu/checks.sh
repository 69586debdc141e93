# The GPU kit's checks (docs/gpu.md), sourced near the top of scripts/gpu/check: each check_NAME
# runs one check and prints its summary line through result(). They use check's variables (BUILD,
# WORK, LOG, PY, KIT_BIN, DEVICE_OK, REHEARSAL) and helpers (can_run, logged, limit_for, result).
# CHECK_TABLE at the end names every check, what runs it and what it needs built.
# shellcheck shell=bash

# ---- the checks' runs of fsdp-train --------------------------------------------------------------
FT=$BUILD/bin/fsdp-train
MPI1=("$KIT_BIN/mpirun" -np 1 --bind-to none)
# fp32 on the GPU means fp32: no TF32 anywhere (the driver's override), and cuBLAS with a fixed
# workspace, so the same run gives the same bits (fsdp-train has no switches for these).
GPU_ENV=(NVIDIA_TF32_OVERRIDE=0 CUBLAS_WORKSPACE_CONFIG=:4096:8)
DECK_BACKEND=nccl
write_decks() {
  # Token data as llm.c writes it, one Markov chain in 50 shards of 4097 tokens: 49 to train on (300
  # steps of 8 x 64 stay in one epoch), the last one, renamed, to validate on.
  if [[ ! -f $WORK/data/val_000000.bin ]]; then
    rm -rf "$WORK/data" && mkdir -p "$WORK/data"
    "$PY" "$repo/tests/make_token_shards.py" "$WORK/data/train" --tokens $((50 * 4097)) --shards 50 --vocab 97 >>"$LOG" 2>&1
    mv "$WORK/data/train_000049.bin" "$WORK/data/val_000000.bin"
  fi
  cat >"$WORK/gpt.toml" <<EOF
# The GPU kit's small GPT (scripts/gpu/check): GPT-2's layout with a vocabulary of 97, fp32.
[run]
name = "gpu-check"
seed = 3
epochs = 10
max_steps = 20
memory_check = "warn"
[model]
kind = "transformer"
vocab_size = 97
vocab_pad_multiple = 32
context = 64
d_model = 128
n_heads = 4
n_layers = 2
dropout = 0.0
activation = "gelu_tanh"
[data]
kind = "token-shards"
path = "$WORK/data/train_*.bin"
val_path = "$WORK/data/val_*.bin"
batch_size = 8
test_batch_size = 32
[optim]
kind = "adamw"
lr = 1e-3
weight_decay = 0.1
betas = [0.9, 0.95]
schedule = "constant"
warmup_steps = 2
clip_grad_norm = 1.0
[fsdp]
sharding_strategy = "FULL_SHARD"
auto_wrap_policy = "TRANSFORMER_BASED_WRAP"
transformer_layer_cls_to_wrap = "TransformerBlock"
backend = "$DECK_BACKEND"
[checkpoint]
every_steps = 0
save_final = false
export = "hf"
export_names = "hf-gpt2"
[log]
every_steps = 1
progress = "plain"
EOF
}
# train RUN LIMIT_S [--set k=v ...]: fsdp-train at np 1 on the small GPT into $WORK/runs/RUN.
train() {
  local run=$1 limit=$2
  shift 2
  log "--- fsdp-train run $run"
  logged "$(limit_for "$limit")" env "${GPU_ENV[@]}" "${MPI1[@]}" "$FT" "$WORK/gpt.toml" --set run.out_dir="$WORK/runs/$run" "$@"
}
fresh() { rm -rf "$WORK/runs/$1"; }
summary_value() { "$PY" -c 'import json,sys; v=json.load(open(sys.argv[1])).get(sys.argv[2]); print("" if v is None else v)' "$WORK/runs/$1/summary.json" "$2" 2>/dev/null; }
model_diff() { "$PY" "$repo/scripts/gpu/model_diff.py" "$@" 2>&1 | tee -a "$LOG" | tail -1; }

# ---- the checks -----------------------------------------------------------------------------------
ctest_one() {  # ctest_one NAME LIMIT: one CTest test of the build, its output in the log
  logged "$(limit_for "$2")" ctest --test-dir "$BUILD" -R "^$1\$" --verbose --timeout "$2"
}
check_test_nccl_np1() {
  can_run test_nccl_np1 60 test_nccl || return
  if ctest_one test_nccl_np1 240 && check_log | grep -q "Test *#[0-9]*: test_nccl_np1 \.* *Passed"; then
    result ok test_nccl_np1 "every collective, split, stream and deadline case at np 1" "CTest passes (not skipped)"
  else
    result FAIL test_nccl_np1 "$(check_log | grep -E 'error: in|skipped|\(Skipped\)|\(Failed\)|Timeout' | grep -v '^\$' | tail -3 | paste -sd' ' - | cut -c1-240)" "CTest passes"
  fi
}
check_deadline() {
  # test_nccl's deadline_ends_a_collective_that_never_completes (just run by test_nccl_np1) prints
  # "deadline: fsdp.comm.deadline after W s (deadline 2 s, marked aborted after A s): ...": A is our
  # deadline (the host's or the watcher's next look), W - A is NCCL's ncclCommAbort.
  local line criterion="marked aborted within deadline + 0.5 s; the error within 5 s more (ncclCommAbort)"
  line=$(grep -E '^([0-9]+: )?deadline: ' "$LOG" | tail -1 | sed -E 's/^[0-9]+: //')
  if ! built test_nccl; then result skipped deadline "build failed (test_nccl not built)"; return; fi
  ((DEVICE_OK)) || { result FAIL deadline "$DEVICE_WHY"; return; }
  if [[ -z $line ]]; then
    result FAIL deadline "test_nccl printed no deadline line (did test_nccl_np1 run?)" "$criterion"
    return
  fi
  local waited id marked
  id=$(awk '{print $2}' <<<"$line")
  waited=$(awk '{print $4}' <<<"$line")
  marked=$(sed -nE 's/.*marked aborted after ([0-9.-]+) s.*/\1/p' <<<"$line")
  if [[ $id == fsdp.comm.deadline && -n $marked ]] && awk -v w="$waited" -v a="$marked" 'BEGIN { exit !(a >= 1.9 && a <= 2.5 && w - a <= 5.0) }'; then
    result ok deadline "$id after $waited s (deadline 2 s; marked aborted after $marked s, the rest is ncclCommAbort), the host not hung" "$criterion"
  else
    result FAIL deadline "${line:0:200}" "$criterion"
  fi
}
check_test_engine_gpu_np1() {
  can_run test_engine_gpu_np1 60 test_engine_gpu || return
  if ctest_one test_engine_gpu_np1 300 && check_log | grep -q "Test *#[0-9]*: test_engine_gpu_np1 \.* *Passed"; then
    result ok test_engine_gpu_np1 "$(check_log | grep -cE '^([0-9]+: )?ok +np=1 ') cases ok" "every case ok, not skipped"
  else
    # A crash names its last stage and what tests/crash_report.hpp found (the caller of a null call).
    local why
    why="$(check_log | grep -E '^([0-9]+: )?FAIL np=1|skipped|\(Failed\)|Timeout' | head -3)
$(check_log | grep -E '^([0-9]+: )?stage \(rank 0\)' | tail -1)
$(check_log | grep -E 'crash report: (signal|called from|pc 0x)' | head -3)"
    result FAIL test_engine_gpu_np1 "$(grep -v '^$' <<<"$why" | paste -sd' ' - | cut -c1-400)" "every case ok"
  fi
}
check_gpu_equals_cpu() {
  can_run gpu_equals_cpu 40 fsdp-train || return
  fresh gpu_fp32 && fresh cpu_fp32
  train gpu_fp32 120 || { result FAIL gpu_equals_cpu "$(failed_because "fsdp-train on the GPU")"; return; }
  train cpu_fp32 120 --set fsdp.backend=mpi || { result FAIL gpu_equals_cpu "$(failed_because "fsdp-train on the CPU")"; return; }
  local diff
  diff=$(model_diff "$WORK/runs/gpu_fp32/hf/model.safetensors" "$WORK/runs/cpu_fp32/hf/model.safetensors" --rtol 1e-5)
  if [[ $? == 0 ]]; then result ok gpu_equals_cpu "$diff" "whole-model relative error <= 1e-5 after 20 steps (fp32, TF32 off)"
  else result FAIL gpu_equals_cpu "$diff" "whole-model relative error <= 1e-5"; fi
}
check_activation_checkpointing() {
  can_run activation_checkpointing 30 fsdp-train || return
  fresh gpu_dropout && fresh gpu_dropout_ac
  train gpu_dropout 120 --set model.dropout=0.1 || { result FAIL activation_checkpointing "$(failed_because "fsdp-train with dropout")"; return; }
  train gpu_dropout_ac 120 --set model.dropout=0.1 --set fsdp.activation_checkpointing=true ||
    { result FAIL activation_checkpointing "$(failed_because "fsdp-train with activation checkpointing")"; return; }
  local diff
  diff=$(model_diff "$WORK/runs/gpu_dropout_ac/hf/model.safetensors" "$WORK/runs/gpu_dropout/hf/model.safetensors" --bitwise)
  if [[ $? == 0 ]]; then result ok activation_checkpointing "$diff" "bit for bit equal to the run without it (dropout 0.1, CUDA generator replayed)"
  else result FAIL activation_checkpointing "$diff" "bit for bit"; fi
}
check_sharded_resume() {
  can_run sharded_resume 30 fsdp-train || return
  [[ -f $WORK/runs/gpu_dropout/hf/model.safetensors ]] || train gpu_dropout 120 --set model.dropout=0.1
  fresh gpu_resumed
  local save=(--set model.dropout=0.1 --set checkpoint.every_steps=10 --set checkpoint.save_final=true)
  train gpu_resumed 120 "${save[@]}" --set run.max_steps=10 || { result FAIL sharded_resume "$(failed_because "the first 10 steps")"; return; }
  train gpu_resumed 120 "${save[@]}" || { result FAIL sharded_resume "$(failed_because "the resumed run")"; return; }
  local ckpt rng diff
  ckpt=$WORK/runs/gpu_resumed/checkpoints/step_00000010.h5
  rng=$("$PY" -c 'import h5py, sys; f = h5py.File(sys.argv[1], "r"); print("/rng/cuda %s" % (f["rng/cuda"].shape,) if "rng/cuda" in f else "no /rng/cuda")' "$ckpt" 2>&1 | tail -1)
  log "checkpoint $ckpt: $rng"
  check_log | grep -q "resumed from .*step_00000010.h5" || { result FAIL sharded_resume "the second run did not resume from step 10 (check.log)"; return; }
  diff=$(model_diff "$WORK/runs/gpu_resumed/hf/model.safetensors" "$WORK/runs/gpu_dropout/hf/model.safetensors" --bitwise)
  if [[ $? == 0 && $rng == /rng/cuda* ]]; then result ok sharded_resume "$diff; checkpoint holds $rng" "bit for bit equal to 20 uninterrupted steps; /rng/cuda saved"
  else result FAIL sharded_resume "$diff; checkpoint: $rng" "bit for bit; /rng/cuda saved"; fi
}
check_offload_params() {
  can_run offload_params 20 fsdp-train || return
  [[ -f $WORK/runs/gpu_fp32/hf/model.safetensors ]] || train gpu_fp32 120
  fresh gpu_offload
  train gpu_offload 120 --set fsdp.offload_params=true || { result FAIL offload_params "$(failed_because "fsdp-train with offload")"; return; }
  local diff
  # The optimizer then steps on the CPU, whose rounding may differ from the GPU's: the fp32 bar, and
  # whether the bits are equal is reported.
  diff=$(model_diff "$WORK/runs/gpu_offload/hf/model.safetensors" "$WORK/runs/gpu_fp32/hf/model.safetensors" --rtol 1e-5)
  if [[ $? == 0 ]]; then result ok offload_params "$diff" "equal to no offload: whole-model relative error <= 1e-5"
  else result FAIL offload_params "$diff" "whole-model relative error <= 1e-5"; fi
}
long_run() {  # the 300-step runs bf16 and fp16 are held to: fp32, bf16, fp16 (evaluation at the end)
  [[ -f $WORK/runs/long_$1/summary.json ]] && return 0
  fresh "long_$1"
  train "long_$1" 180 --set run.max_steps=300 --set log.every_steps=50 --set fsdp.mixed_precision="$2"
}
check_mixed_precision() {  # check_mixed_precision NAME MODE TOLERANCE
  local name=$1 mode=$2 tol=$3
  can_run "$name" 40 fsdp-train || return
  long_run fp32 no || { result FAIL "$name" "$(failed_because "the fp32 reference run")"; return; }
  long_run "$mode" "$mode" || { result FAIL "$name" "$(failed_because "the $mode run")"; return; }
  local ref got
  ref=$(summary_value long_fp32 test_loss)
  got=$(summary_value "long_$mode" test_loss)
  local verdict
  verdict=$(awk -v a="$got" -v b="$ref" -v t="$tol" 'BEGIN { if (a == "" || b == "") { print "FAIL"; exit } r = (a - b) / b; if (r < 0) r = -r;
                                                           printf "%s %.4f", (r <= t ? "ok" : "FAIL"), r }')
  local extra=""
  [[ $mode == fp16 ]] && extra=", loss scale $(summary_value long_fp16 loss_scale), $(summary_value long_fp16 overflow_steps) overflow steps skipped"
  result "${verdict%% *}" "$name" "validation loss ${got:-?} vs fp32's ${ref:-?} after 300 steps (relative difference ${verdict#* }$extra)" \
    "within $(awk -v t="$tol" 'BEGIN{print t*100}')% of fp32's"
}
check_hf_gpt2_client() {
  can_run hf_gpt2_client 40 fsdp-train || return
  [[ -f $WORK/runs/gpu_fp32/hf/model.safetensors ]] || train gpu_fp32 120
  local expect out
  expect=$(summary_value gpu_fp32 test_loss)
  [[ -n $expect ]] || { result FAIL hf_gpt2_client "no test_loss in the GPU run's summary.json"; return; }
  out=$(timeout "$(limit_for 120)" "$PY" "$repo/scripts/gpu/hf_client.py" "$WORK/runs/gpu_fp32/hf" --data "$WORK/data/val_*.bin" --context 64 \
        --expect "$expect" --rtol 1e-4 2>"$WORK/hf_client.err")
  local rc=$?
  cat "$WORK/hf_client.err" >>"$LOG"
  log "$out"
  [[ -n $out ]] || out="hf_client.py: $(grep -v '^ ' "$WORK/hf_client.err" | tail -1)"
  if ((rc == 0)); then result ok hf_gpt2_client "GPT2LMHeadModel.from_pretrained: ${out:0:220}" "loss of its logits within 1e-4 (relative) of fsdp-train's evaluation"
  else result FAIL hf_gpt2_client "${out:0:240}" "within 1e-4 (relative)"; fi
}

# ---- speed: GPT-2 124M, context 1024, bf16, np 1 ---------------------------------------------------
peak_tflops() {
  if [[ -n ${GPU_PEAK_TFLOPS:-} ]]; then echo "$GPU_PEAK_TFLOPS"; return; fi
  case ${GPU_NAME:-} in
    *H100*PCIe*) echo 756 ;;  # dense bf16
    *H100* | *H200* | *GH200*) echo 989 ;;
    *) echo 0 ;;
  esac
}
# Samples the device's used memory every 100 ms while a command runs; prints the peak in MiB.
with_memory_peak() {
  local file=$1
  shift
  (while :; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1; sleep 0.1; done) >"$file" &
  local sampler=$!
  "$@"
  local rc=$?
  kill "$sampler" 2>/dev/null
  wait "$sampler" 2>/dev/null
  return "$rc"
}
check_speed() {
  can_run speed 90 fsdp-train || return
  ((REHEARSAL)) && { result skipped speed "rehearsal on the CPU: GPT-2 124M needs the GPU"; return; }
  local peak batches base_mib b rc
  peak=$(peak_tflops)
  batches=${GPU_SPEED_BATCHES:-$( ((${GPU_MEM_MIB:-0} > 120000)) && echo "64 48 32 16" || echo "32 24 16 8")}
  base_mib=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
  local gpt2=(--set model.vocab_size=50257 --set model.vocab_pad_multiple=64 --set model.context=1024 --set model.d_model=768
              --set model.n_heads=12 --set model.n_layers=12 --set model.dropout=0 --set data.kind=tokens --set data.num_samples=4096
              --set fsdp.mixed_precision=bf16 --set run.max_steps=15 --set log.every_steps=5 --set checkpoint.export=
              --set run.memory_check=off --set optim.lr=3e-4 --set eval.max_batches=1)
  local chosen=""
  for b in $batches; do
    (($(remaining) >= 60)) || break
    fresh "speed_b$b"
    with_memory_peak "$WORK/mem_fsdp_b$b.txt" train "speed_b$b" 150 "${gpt2[@]}" --set data.batch_size="$b"
    rc=$?
    if ((rc == 0)); then chosen=$b; break; fi
    check_log | grep -q -i "out of memory" || { result FAIL speed "$(failed_because "fsdp-train on GPT-2 124M at batch $b")"; return; }
    log "batch $b does not fit; trying a smaller one"
  done
  [[ -n $chosen ]] || { result FAIL speed "no batch of ($batches) fit or finished in time"; return; }
  local json_fsdp
  json_fsdp=$("$PY" - "$WORK/runs/speed_b$chosen/summary.json" "$chosen" "$peak" <<'PYEOF'
import json, sys
s = json.load(open(sys.argv[1])); b = int(sys.argv[2]); peak = float(sys.argv[3])
tps = b * 1024 / (s["step_ms_median"] / 1000)
print(json.dumps({"implementation": "fsdp-train (NCCL, FULL_SHARD, bf16)", "batch": b, "tokens_per_s": tps, "step_ms_median": s["step_ms_median"],
                  "params": s["params"], "mfu": s["model_flops_per_token"] * tps / (peak * 1e12) if peak > 0 else None}))
PYEOF
)
  log "fsdp-train: $json_fsdp"
  local mode json_eager="" json_fsdp2=""
  for mode in eager fsdp2; do
    (($(remaining) >= 35)) || { log "speed: no time left for PyTorch $mode"; continue; }
    local j
    j=$(with_memory_peak "$WORK/mem_$mode.txt" timeout "$(limit_for 120)" "$PY" "$repo/scripts/gpu/torch_peer.py" --mode "$mode" \
        --batch "$chosen" --peak-tflops "$peak" 2>>"$LOG" | tail -1)
    log "PyTorch $mode: $j"
    [[ $mode == eager ]] && json_eager=$j || json_fsdp2=$j
  done
  # The table: one row per implementation, the device memory peak from nvidia-smi (minus what was in
  # use before), the allocator's peaks where PyTorch reports them.
  "$PY" - "$base_mib" "$WORK/mem_fsdp_b$chosen.txt" "$json_fsdp" "$WORK/mem_eager.txt" "$json_eager" "$WORK/mem_fsdp2.txt" "$json_fsdp2" \
    "${GPU_NAME:-?}" "$peak" >"$WORK/speed.md" 2>>"$LOG" <<'PYEOF'
import json, sys
base = float(sys.argv[1] or 0)
def peak(path):
    try:
        vals = [float(x) for x in open(path).read().split() if x.replace(".", "").isdigit()]
        return "%.0f" % (max(vals) - base) if vals else "?"
    except OSError:
        return "?"
print("GPT-2 124M (context 1024, bf16, np 1) on %s; MFU against %s TFLOP/s dense bf16.\n" % (sys.argv[8], sys.argv[9]))
print("| implementation | batch | tokens/s | MFU | step ms (median) | peak device memory MiB (nvidia-smi) | max allocated / reserved MiB (PyTorch) |")
print("|---|---|---|---|---|---|---|")
for mem, text in zip(sys.argv[2:8:2], sys.argv[3:8:2]):
    try:
        r = json.loads(text)
    except ValueError:
        print("| %s | | | | | | not run |" % (text[:60] or "(no result)")); continue
    if "error" in r:
        print("| %s | %s | %s | | | | |" % (r.get("implementation", r.get("mode")), r.get("batch"), r["error"][:80])); continue
    mfu = "%.1f%%" % (100 * r["mfu"]) if r.get("mfu") else "n/a"
    alloc = "%.0f / %.0f" % (r["max_memory_allocated_mib"], r["max_memory_reserved_mib"]) if "max_memory_allocated_mib" in r else "n/a"
    print("| %s | %d | %.0f | %s | %.1f | %s | %s |" % (r["implementation"], r["batch"], r["tokens_per_s"], mfu, r["step_ms_median"], peak(mem), alloc))
PYEOF
  cat "$WORK/speed.md" | tee -a "$LOG" >"$OUT/speed.md"
  printf '\n## Speed\n\n' >>"$RESULTS"
  cat "$WORK/speed.md" >>"$RESULTS"
  local tps
  tps=$(awk -F'|' 'NR > 4 && /fsdp-train/ {gsub(/ /, "", $4); print $4; exit}' "$WORK/speed.md")
  if [[ -n $json_eager && -n $json_fsdp2 ]]; then
    result ok speed "fsdp-train $tps tokens/s at batch $chosen; table in results.md and speed.md" "measured side by side (no bar)"
  else
    result FAIL speed "fsdp-train $tps tokens/s at batch $chosen; a PyTorch side did not run (check.log)" "all three measured"
  fi
}

# Every check, in the order check runs them: NAME|COMMAND|the targets it needs built.
# GPU_CHECK_ONLY takes the names; a check left out builds nothing and prints no line.
CHECK_TABLE=(
  "test_nccl_np1|check_test_nccl_np1|test_nccl"
  "deadline|check_deadline|test_nccl"
  "test_engine_gpu_np1|check_test_engine_gpu_np1|test_engine_gpu"
  "gpu_equals_cpu|check_gpu_equals_cpu|fsdp-train fsdp-ckpt"
  "activation_checkpointing|check_activation_checkpointing|fsdp-train fsdp-ckpt"
  "sharded_resume|check_sharded_resume|fsdp-train fsdp-ckpt"
  "offload_params|check_offload_params|fsdp-train fsdp-ckpt"
  "bf16|check_mixed_precision bf16 bf16 0.02|fsdp-train fsdp-ckpt"
  "fp16|check_mixed_precision fp16 fp16 0.03|fsdp-train fsdp-ckpt"
  "hf_gpt2_client|check_hf_gpt2_client|fsdp-train fsdp-ckpt"
  "speed|check_speed|fsdp-train fsdp-ckpt"
)
