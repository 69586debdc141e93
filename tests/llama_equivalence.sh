#!/usr/bin/env bash
# model.kind = "llama" trains exactly as a plain PyTorch Llama does (docs/interop.md, "Llama-family
# models"): tests/llama_reference.py (torch.nn.functional, Hugging Face's names) and fsdp-train start
# from the same safetensors file and train on the same llm.c shard (AdamW without decay on biases,
# norms and embeddings, clipping, warmup then cosine) for 20 steps with a global batch of 12, for two
# models: an untied Llama with grouped-query attention (4 heads, 2 KV heads) and a tied Qwen2-style
# model with q/k/v biases (4 heads, 1 KV head, head_dim 16 != d_model / n_heads), each at np 1, 2 and
# 3 under FULL_SHARD and at np 4 under HYBRID_SHARD. fsdp-train's export equals PyTorch's final
# weights within 1e-5 relative over the whole model, its logged loss of every step equals PyTorch's
# to the 6 digits metrics.csv prints, and PyTorch's loss of the export on the validation shard equals
# fsdp-train's own evaluation. --check-plan: fsdp-plan's closed form equals the built model. Then the
# engine's features on the untied model (below).
#   tests/llama_equivalence.sh SOURCE_DIR BUILD_BIN WORK_DIR
set -uo pipefail
SRC=$1 BIN=$2 WORK=$3
PY=/usr/bin/python3
if ! $PY -c "import torch" 2>/dev/null; then
  echo "SKIP: $PY has no torch (Debian's python3-torch)"
  exit 77
fi
rm -rf "$WORK" && mkdir -p "$WORK"
fail() { echo "FAIL: $*"; exit 1; }
export OMPI_MCA_mpi_yield_when_idle=1
MPI=(mpirun --oversubscribe --allow-run-as-root)
REF=("$PY" "$SRC/tests/llama_reference.py")

# 20 steps x 12 sequences x 16 tokens (+1): 3841 training tokens; 801 validation tokens.
"$PY" "$SRC/tests/make_token_shards.py" "$WORK/train" --tokens 3841 || fail "make train shard"
"$PY" "$SRC/tests/make_token_shards.py" "$WORK/val" --tokens 801 --seed 2 || fail "make val shard"

recipe=(--set data.kind=token-shards --set "data.path=$WORK/train_*.bin" --set "data.val_path=$WORK/val_*.bin" --set data.shuffle=false
        --set data.global_batch_size=12 --set data.batch_size=12 --set data.test_batch_size=64
        --set optim.kind=adamw --set optim.lr=3e-3 --set optim.lr_min=3e-4 --set "optim.betas=[0.9, 0.95]" --set optim.weight_decay=0.1
        --set 'optim.no_decay=["bias", "norm", "embedding"]' --set optim.clip_grad_norm=1.0 --set optim.schedule=cosine
        --set optim.warmup_steps=4 --set run.max_steps=20 --set run.epochs=1 --set run.threads=1 --set checkpoint.export=hf
        --set checkpoint.every_steps=0 --set log.every_steps=1 --set log.progress=plain)

for model in untied_gqa tied_qwen2; do
  case $model in
    untied_gqa)
      ref_model=(--vocab 97 --context 16 --d-model 32 --heads 4 --kv-heads 2 --head-dim 8 --layers 2 --intermediate 48 --rope-theta 10000)
      deck=(--set model.n_kv_heads=2 --set model.head_dim=0 --set model.intermediate_size=48 --set model.rope_theta=10000
            --set model.tie_embeddings=false --set model.attention_bias=false) ;;
    tied_qwen2)
      ref_model=(--vocab 97 --context 16 --d-model 32 --heads 4 --kv-heads 1 --head-dim 16 --layers 2 --intermediate 40 --rope-theta 1000000
                 --eps 1e-6 --bias --tied)
      deck=(--set model.n_kv_heads=1 --set model.head_dim=16 --set model.intermediate_size=40 --set model.rope_theta=1000000
            --set model.norm_eps=1e-6 --set model.tie_embeddings=true --set model.attention_bias=true) ;;
  esac
  deck+=(--set model.kind=llama --set model.vocab_size=97 --set model.context=16 --set model.d_model=32 --set model.n_heads=4
         --set model.n_layers=2 --set checkpoint.init_from="$WORK/$model.init.safetensors")
  "${REF[@]}" init "$WORK/$model.init.safetensors" "${ref_model[@]}" --seed 3 || fail "$model: reference init"
  "${REF[@]}" train --init "$WORK/$model.init.safetensors" --data "$WORK/train_*.bin" --out "$WORK/$model.reference.safetensors" \
    --losses "$WORK/$model.reference_losses.json" "${ref_model[@]}" || fail "$model: reference training"
  "$BIN/fsdp-train" "$SRC/inputs/llama_tokens.toml" "${recipe[@]}" "${deck[@]}" --check-plan || fail "$model: --check-plan"

  for setting in "1 FULL_SHARD" "2 FULL_SHARD" "3 FULL_SHARD" "4 HYBRID_SHARD"; do
    read -r np strategy <<<"$setting"
    out="$WORK/${model}_np${np}_$strategy"
    "${MPI[@]}" -np "$np" "$BIN/fsdp-train" "$SRC/inputs/llama_tokens.toml" "${recipe[@]}" "${deck[@]}" --set fsdp.sharding_strategy="$strategy" \
      --set run.out_dir="$out" >"$out.log" 2>&1 || { cat "$out.log"; fail "$model: fsdp-train at np $np $strategy"; }
    grep -q "initialized the model from .*$model.init.safetensors" "$out.log" || { cat "$out.log"; fail "$model: no pretrained start"; }
    "${REF[@]}" compare "$out/hf/model.safetensors" "$WORK/$model.reference.safetensors" --rtol 1e-5 ||
      fail "$model np $np $strategy: the weights differ from PyTorch's"
    "$PY" "$SRC/tests/equivalence_checks.py" losses "$out/metrics.csv" "$WORK/$model.reference_losses.json" ||
      fail "$model np $np $strategy: the losses differ from PyTorch's"
    torch_eval=$("${REF[@]}" eval --model "$out/hf/model.safetensors" --data "$WORK/val_*.bin" "${ref_model[@]}") || fail "$model: reference eval"
    "$PY" "$SRC/tests/equivalence_checks.py" eval "$out/summary.json" "$torch_eval" ||
      fail "$model np $np $strategy: PyTorch's evaluation of the export differs"
    echo "ok: $model np $np $strategy equals PyTorch"
  done
done

# model.hf_config: a Hugging Face folder (config.json with Llama 3.1's rope_scaling "llama3", whose
# three regimes of wavelength the 4 frequencies of head_dim 8 span at original context 64; weights in
# two files and an index) decides the model, the deck naming only the context. Trained at np 1 and 3
# and exported with Hugging Face's names (checkpoint.export_names = "hf") split into files of at most
# 20KB: equal to PyTorch's training, and PyTorch building the model from the export's own config.json
# (as from_pretrained does) evaluates it as fsdp-train did. fsdp-ckpt export --names hf of the final
# checkpoint writes the same tensors bit for bit and the same config.json; a rerun of the finished job
# accepts its stored deck and trains nothing.
hf=(--vocab 97 --context 16 --d-model 32 --heads 4 --kv-heads 2 --head-dim 8 --layers 2 --intermediate 48 --rope-theta 10000
    --rope-factor 4 --rope-low 1 --rope-high 4 --rope-original 64)
"${REF[@]}" init "$WORK/llama3_hf" "${hf[@]}" --shards 2 --hf-config --seed 5 || fail "llama3: reference init"
"${REF[@]}" train --init "$WORK/llama3_hf" --data "$WORK/train_*.bin" --out "$WORK/llama3.reference.safetensors" \
  --losses "$WORK/llama3.reference_losses.json" "${hf[@]}" || fail "llama3: reference training"
printf '[model]\nhf_config = "%s"\ncontext = 16\n' "$WORK/llama3_hf" >"$WORK/from_hf.toml"
for np in 1 3; do
  out="$WORK/llama3_np$np"
  run_from_hf() {
    "${MPI[@]}" -np "$np" "$BIN/fsdp-train" "$WORK/from_hf.toml" "${recipe[@]}" --set checkpoint.init_from="$WORK/llama3_hf" \
      --set checkpoint.export_names=hf --set checkpoint.export_max_shard_size=20KB --set run.out_dir="$out" "$@"
  }
  run_from_hf >"$out.log" 2>&1 || { cat "$out.log"; fail "llama3: fsdp-train at np $np"; }
  grep -Eq 'model\.rope_scaling +"llama3" +hf_config' "$out.log" || { cat "$out.log"; fail "llama3: the echo does not show rope_scaling from hf_config"; }
  grep -Eq "exported [0-9]+ tensors \(hf names\) to .*model.safetensors.index.json \([0-9]+ files" "$out.log" ||
    { cat "$out.log"; fail "llama3: the export is not split"; }
  [[ ! -e $out/hf/model.safetensors ]] || fail "llama3: a split export left model.safetensors"
  "${REF[@]}" compare "$out/hf" "$WORK/llama3.reference.safetensors" --rtol 1e-5 || fail "llama3 np $np: the weights differ from PyTorch's"
  "$PY" "$SRC/tests/equivalence_checks.py" losses "$out/metrics.csv" "$WORK/llama3.reference_losses.json" ||
    fail "llama3 np $np: the losses differ from PyTorch's"
  torch_eval=$("${REF[@]}" eval --model "$out/hf" --data "$WORK/val_*.bin" --config "$out/hf/config.json") || fail "llama3: reference eval"
  "$PY" "$SRC/tests/equivalence_checks.py" eval "$out/summary.json" "$torch_eval" ||
    fail "llama3 np $np: PyTorch's evaluation of the export, built from its config.json, differs"
  echo "ok: llama3 rope_scaling from model.hf_config at np $np equals PyTorch; the split hf export loads from its own config.json"
done
"$BIN/fsdp-ckpt" export "$out/checkpoints" "$WORK/ckpt_export" --names hf --max-shard-size 20KB >"$WORK/ckpt_export.log" 2>&1 ||
  { cat "$WORK/ckpt_export.log"; fail "fsdp-ckpt export --names hf"; }
# The checkpoint keeps its tensors in name order, the engine in module order: the same tensors, split
# at other places.
"${REF[@]}" compare "$WORK/ckpt_export" "$out/hf" --rtol 0 || fail "fsdp-ckpt export: other tensors than fsdp-train's export"
cmp -s "$WORK/ckpt_export/config.json" "$out/hf/config.json" || fail "fsdp-ckpt export: another config.json than fsdp-train's export"
ls "$WORK/ckpt_export"/model-0000?-of-0000?.safetensors >/dev/null 2>&1 || fail "fsdp-ckpt export: not split"
echo "ok: fsdp-ckpt export --names hf --max-shard-size 20KB: fsdp-train's export's tensors bit for bit and its config.json"
run_from_hf >"$out.rerun.log" 2>&1 || { cat "$out.rerun.log"; fail "llama3: the rerun of the finished job"; }
grep -q "nothing to train: the run in .* already reached step 20 of 20" "$out.rerun.log" || { cat "$out.rerun.log"; fail "llama3: the rerun trained"; }
echo "ok: a rerun of the finished job accepts the checkpoint's stored deck (hf_config written out)"
# A rerun with another token id writes the export again (config.json carries it); one with native
# names removes the Hugging Face config.json it had written beside the weights.
run_from_hf --set model.eos_token_id=7 >"$out.rerun_eos.log" 2>&1 || { cat "$out.rerun_eos.log"; fail "llama3: the rerun with another eos_token_id"; }
grep -q "wrote the export .* again (model.eos_token_id: \[[^)]*\] -> \[7\])" "$out.rerun_eos.log" || { cat "$out.rerun_eos.log"; fail "llama3: the export was not written again"; }
"$PY" -c "import json, sys; assert json.load(open(sys.argv[1]))['eos_token_id'] == 7" "$out/hf/config.json" || fail "llama3: config.json's eos_token_id is not 7"
run_from_hf --set model.eos_token_id=7 --set checkpoint.export_names=native >"$out.rerun_native.log" 2>&1 ||
  { cat "$out.rerun_native.log"; fail "llama3: the rerun with native names"; }
grep -q 'again (checkpoint.export_names: "hf" -> "native"' "$out.rerun_native.log" || { cat "$out.rerun_native.log"; fail "llama3: native names not written"; }
[[ ! -e $out/hf/config.json ]] || fail "llama3: a native export left the Hugging Face config.json beside its weights"
echo "ok: reruns of the finished job write the export again for another eos_token_id and for native names"

# The same folder read by a deck written by hand (the sizes, no model.hf_config): its config.json's
# rope_scaling would be lost without a word; the run is refused, naming the key. The per-layer
# rotary inv_freq tensors older conversions stored are passed over, as transformers does. A folder
# holding pytorch_model.bin instead of safetensors is named as such.
"${REF[@]}" init "$WORK/hand/model.safetensors" "${hf[@]}" --hf-config --seed 5 || fail "hand: reference init"
"$PY" - "$WORK/hand/model.safetensors" <<'PYEOF' || fail "hand: adding inv_freq tensors"
import json, struct, sys
path = sys.argv[1]
data = open(path, "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header, body = json.loads(data[8:8 + n]), data[8 + n:]
for layer in (0, 1):
    header["model.layers.%d.self_attn.rotary_emb.inv_freq" % layer] = {"dtype": "F32", "shape": [4], "data_offsets": [len(body), len(body) + 16]}
    body += struct.pack("<4f", 1.0, 0.1, 0.01, 0.001)
text = json.dumps(header).encode()
open(path, "wb").write(struct.pack("<Q", len(text)) + text + body)
PYEOF
by_hand=(--set model.kind=llama --set model.vocab_size=97 --set model.context=16 --set model.d_model=32 --set model.n_heads=4 --set model.n_kv_heads=2
         --set model.head_dim=8 --set model.intermediate_size=48 --set model.n_layers=2 --set model.rope_theta=10000 --set model.tie_embeddings=false
         --set run.max_steps=1 --set checkpoint.export=)
"${MPI[@]}" -np 2 "$BIN/fsdp-train" "$SRC/inputs/llama_tokens.toml" "${recipe[@]}" "${by_hand[@]}" --set checkpoint.init_from="$WORK/hand" \
  --set run.out_dir="$WORK/hand_run" >"$WORK/hand.log" 2>&1
rc=$?
[[ $rc == 2 ]] && grep -q "hand/config.json describes another model than the deck's:" "$WORK/hand.log" &&
  grep -q '^  rope_scaling (model.rope_scaling): {"rope_type":"llama3",.* in the file, null by the deck' "$WORK/hand.log" ||
  { cat "$WORK/hand.log"; fail "hand: a deck without the folder's rope_scaling was not refused by name (exit $rc)"; }
"${MPI[@]}" -np 2 "$BIN/fsdp-train" "$WORK/from_hf.toml" "${recipe[@]}" --set run.max_steps=1 --set checkpoint.export= \
  --set checkpoint.init_from="$WORK/hand" --set model.hf_config="$WORK/hand" --set run.out_dir="$WORK/hand_hf" >"$WORK/hand_hf.log" 2>&1 ||
  { cat "$WORK/hand_hf.log"; fail "hand: the folder with inv_freq tensors does not load through model.hf_config"; }
mkdir -p "$WORK/bin_only" && cp "$WORK/hand/config.json" "$WORK/bin_only/" && touch "$WORK/bin_only/pytorch_model.bin"
"${MPI[@]}" -np 2 "$BIN/fsdp-train" "$WORK/from_hf.toml" "${recipe[@]}" --set model.hf_config="$WORK/bin_only" \
  --set checkpoint.init_from="$WORK/bin_only" --set run.out_dir="$WORK/bin_only_run" >"$WORK/bin_only.log" 2>&1
rc=$?
[[ $rc == 2 ]] && grep -q "bin_only' is a Hugging Face model folder without model.safetensors or model.safetensors.index.json (it holds pytorch_model.bin, which fsdp does not read)" "$WORK/bin_only.log" ||
  { cat "$WORK/bin_only.log"; fail "bin_only: not named as a folder without safetensors (exit $rc)"; }
echo "ok: a hand-written deck that differs from the folder's config.json is refused by key; inv_freq passed over; pytorch_model.bin named"

# The engine's features on the untied Llama, each against the same PyTorch weights: activation
# checkpointing with deferred initialization, the optimizer sharded over the world (hybrid), gradient
# accumulation reduced every micro-batch; bf16 mixed precision trains (its weights near fp32's); a
# run resumed at step 10 ends bit for bit where the uninterrupted one does (np 3).
model=untied_gqa
ref_model=(--vocab 97 --context 16 --d-model 32 --heads 4 --kv-heads 2 --head-dim 8 --layers 2 --intermediate 48 --rope-theta 10000)
deck=(--set model.kind=llama --set model.vocab_size=97 --set model.context=16 --set model.d_model=32 --set model.n_heads=4 --set model.n_layers=2
      --set model.n_kv_heads=2 --set model.intermediate_size=48 --set model.tie_embeddings=false
      --set checkpoint.init_from="$WORK/$model.init.safetensors" --set checkpoint.keep_last=0)
for setting in "2 checkpointed --set fsdp.activation_checkpointing=true --set fsdp.deferred_init=true" \
               "4 world --set fsdp.sharding_strategy=HYBRID_SHARD --set fsdp.shard_group_size=2 --set fsdp.optimizer_sharding=WORLD" \
               "2 accumulated --set data.batch_size=2 --set optim.accum_reduce=every" \
               "2 bf16 --set fsdp.mixed_precision=bf16"; do
  read -r np name options <<<"$setting"
  # shellcheck disable=SC2086
  "${MPI[@]}" -np "$np" "$BIN/fsdp-train" "$SRC/inputs/llama_tokens.toml" "${recipe[@]}" "${deck[@]}" $options --set run.out_dir="$WORK/$name" \
    >"$WORK/$name.log" 2>&1 || { cat "$WORK/$name.log"; fail "$name: fsdp-train"; }
  rtol=1e-5
  [[ $name == bf16 ]] && rtol=2e-2  # bf16 forward and backward: near fp32's weights, not equal
  "${REF[@]}" compare "$WORK/$name/hf/model.safetensors" "$WORK/$model.reference.safetensors" --rtol $rtol || fail "$name: the weights differ"
  echo "ok: $name (np $np) within $rtol of PyTorch"
done
"${MPI[@]}" -np 3 "$BIN/fsdp-train" "$SRC/inputs/llama_tokens.toml" "${recipe[@]}" "${deck[@]}" --set checkpoint.every_steps=5 \
  --set run.out_dir="$WORK/straight" >"$WORK/straight.log" 2>&1 || { cat "$WORK/straight.log"; fail "straight run"; }
mkdir -p "$WORK/resumed/checkpoints" && cp "$WORK/straight/checkpoints/step_00000010.h5" "$WORK/resumed/checkpoints/" &&
  echo step_00000010.h5 >"$WORK/resumed/checkpoints/latest"
"${MPI[@]}" -np 3 "$BIN/fsdp-train" "$SRC/inputs/llama_tokens.toml" "${recipe[@]}" "${deck[@]}" --set checkpoint.every_steps=5 \
  --set run.out_dir="$WORK/resumed" >"$WORK/resumed.log" 2>&1 || { cat "$WORK/resumed.log"; fail "resumed run"; }
grep -q "resumed from .*step_00000010.h5 at step 10" "$WORK/resumed.log" || { cat "$WORK/resumed.log"; fail "did not resume at step 10"; }
"$BIN/fsdp-ckpt" diff "$WORK/resumed/checkpoints" "$WORK/straight/checkpoints" --atol 0 --rtol 0 >"$WORK/resume.diff" ||
  { cat "$WORK/resume.diff"; fail "the resumed run's final checkpoint differs from the uninterrupted one's"; }
echo "ok: resumed at step 10 (np 3), bit for bit the uninterrupted run's final checkpoint"

# inputs/smollm2_135m_finetune.toml as shipped, from a random folder of SmolLM2-135M's exact shapes in
# bf16 (as Hugging Face stores it, with its config.json), 2 steps at np 2 with a short context: the
# model is the config's, the weights widen to fp32, every one of its 272 tensors loads, the parameter
# count is SmolLM2-135M's and the export holds them beside a config.json of the same model.
mkdir -p "$WORK/smollm2/smollm2-135m"
"${REF[@]}" init "$WORK/smollm2/smollm2-135m/model.safetensors" --vocab 49152 --context 64 --d-model 576 --heads 9 --kv-heads 3 \
  --head-dim 64 --layers 30 --intermediate 1536 --rope-theta 100000 --tied --bf16 --hf-config || fail "smollm2: reference init"
"$PY" "$SRC/tests/make_token_shards.py" "$WORK/smollm2/train" --tokens 4000 --vocab 49152 || fail "smollm2: train shard"
"$PY" "$SRC/tests/make_token_shards.py" "$WORK/smollm2/val" --tokens 1000 --vocab 49152 --seed 2 || fail "smollm2: val shard"
(cd "$WORK/smollm2" && "${MPI[@]}" -np 2 "$BIN/fsdp-train" "$SRC/inputs/smollm2_135m_finetune.toml" --set "data.path=train_*.bin" \
  --set "data.val_path=val_*.bin" --set model.context=64 --set data.global_batch_size=4 --set data.batch_size=2 --set run.max_steps=2 \
  --set eval.max_batches=1 --set checkpoint.every_steps=0 --set log.every_steps=1 --set log.progress=plain --set run.threads=1 \
  --set run.out_dir=run) >"$WORK/smollm2.log" 2>&1 || { cat "$WORK/smollm2.log"; fail "smollm2: fsdp-train"; }
grep -q "initialized the model from smollm2-135m (native names)" "$WORK/smollm2.log" || { cat "$WORK/smollm2.log"; fail "smollm2: no start from the folder"; }
grep -q "272 tensor(s) of the file widened from BF16 to Float" "$WORK/smollm2.log" || { cat "$WORK/smollm2.log"; fail "smollm2: bf16 not widened"; }
# 2 steps of a deck made for 1000: its warmup and evaluations are said not to fit.
grep -q "warning: optim.warmup_steps = 50 is not shorter than the run's 2 steps" "$WORK/smollm2.log" &&
  grep -q "warning: eval.every_steps = 200 is beyond the run's 2 steps: one evaluation, after the last step" "$WORK/smollm2.log" ||
  { cat "$WORK/smollm2.log"; fail "smollm2: no warning that the schedule does not fit"; }
grep -q "exported 272 tensors (hf names)" "$WORK/smollm2.log" || { cat "$WORK/smollm2.log"; fail "smollm2: export"; }
"$PY" -c "import json, sys; c = json.load(open(sys.argv[1])); sys.exit(c['architectures'] != ['LlamaForCausalLM'] or c['hidden_size'] != 576)" \
  "$WORK/smollm2/run/hf/config.json" || fail "smollm2: the export's config.json is not SmolLM2-135M's"
"$PY" -c "import json, sys; p = json.load(open(sys.argv[1]))['params']; print('SmolLM2-135M parameters:', p); sys.exit(p != 134515008)" \
  "$WORK/smollm2/run/summary.json" || fail "smollm2: not SmolLM2-135M's 134,515,008 parameters"
echo "ok: SmolLM2-135M's deck trains 2 steps at np 2 from a bf16 folder of its shapes"
# ... and from the same weights split as Hugging Face splits large models (two files and
# model.safetensors.index.json): the same training, bit for bit.
"${REF[@]}" init "$WORK/smollm2/sharded" --vocab 49152 --context 64 --d-model 576 --heads 9 --kv-heads 3 --head-dim 64 --layers 30 \
  --intermediate 1536 --rope-theta 100000 --tied --bf16 --shards 2 || fail "smollm2: sharded reference init"
(cd "$WORK/smollm2" && "${MPI[@]}" -np 2 "$BIN/fsdp-train" "$SRC/inputs/smollm2_135m_finetune.toml" --set "data.path=train_*.bin" \
  --set "data.val_path=val_*.bin" --set model.context=64 --set data.global_batch_size=4 --set data.batch_size=2 --set run.max_steps=2 \
  --set eval.max_batches=1 --set checkpoint.every_steps=0 --set log.every_steps=1 --set log.progress=plain --set run.threads=1 \
  --set checkpoint.init_from=sharded --set run.out_dir=run_sharded) >"$WORK/smollm2_sharded.log" 2>&1 ||
  { cat "$WORK/smollm2_sharded.log"; fail "smollm2: fsdp-train from the sharded folder"; }
"${REF[@]}" compare "$WORK/smollm2/run_sharded/hf/model.safetensors" "$WORK/smollm2/run/hf/model.safetensors" --rtol 0 ||
  fail "smollm2: training from the sharded folder differs from training from the single file"
echo "ok: from a sharded folder (model.safetensors.index.json), bit for bit the same"
echo "all Llama equivalence cases passed"
