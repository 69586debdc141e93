#!/usr/bin/env bash
# fsdp-train trains exactly as PyTorch does (docs/interop.md, "Equal to PyTorch"): a PyTorch reference
# (tests/pytorch_reference.py, GPT-2 from torch.nn with Hugging Face's names) and fsdp-train start from
# the same safetensors file and train on the same llm.c shard (dropout 0, AdamW with weight-decay
# groups, clipping, warmup then cosine) for 20 steps with a global batch of 12, at np 1, 2 and 3 under
# FULL_SHARD and at np 4 under HYBRID_SHARD (two groups of 2). fsdp-train's export equals PyTorch's
# final weights within 1e-5 relative over the whole model (per tensor, Adam turns the summation-order
# rounding of near-zero gradients, e.g. attention's key bias, into larger relative errors of that one
# tensor), and its logged loss of every step equals PyTorch's to the 6 digits metrics.csv prints. The
# reverse: PyTorch's loss of fsdp-train's exported weights on the validation shard equals fsdp-train's
# own evaluation.
#   tests/pytorch_equivalence.sh SOURCE_DIR BUILD_BIN WORK_DIR
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
REF=("$PY" "$SRC/tests/pytorch_reference.py")
model=(--vocab 97 --context 16 --d-model 32 --heads 4 --layers 2 --activation gelu_tanh)

# 20 steps x 12 sequences x 16 tokens (+1): 3841 training tokens; 801 validation tokens.
"$PY" "$SRC/tests/make_token_shards.py" "$WORK/train" --tokens 3841 || fail "make train shard"
"$PY" "$SRC/tests/make_token_shards.py" "$WORK/val" --tokens 801 --seed 2 || fail "make val shard"
"${REF[@]}" init "$WORK/init.safetensors" "${model[@]}" --seed 3 || fail "reference init"
"${REF[@]}" train --init "$WORK/init.safetensors" --data "$WORK/train_*.bin" --out "$WORK/reference.safetensors" \
  --losses "$WORK/reference_losses.json" "${model[@]}" || fail "reference training"

deck=(--set model.kind=transformer --set model.vocab_size=97 --set model.vocab_pad_multiple=32 --set model.context=16
      --set model.d_model=32 --set model.n_heads=4 --set model.n_layers=2 --set model.mlp_ratio=4 --set model.dropout=0
      --set model.activation=gelu_tanh --set model.tie_embeddings=true
      --set data.kind=token-shards --set "data.path=$WORK/train_*.bin" --set "data.val_path=$WORK/val_*.bin" --set data.shuffle=false
      --set data.global_batch_size=12 --set data.batch_size=12 --set data.test_batch_size=64
      --set optim.kind=adamw --set optim.lr=3e-3 --set optim.lr_min=3e-4 --set "optim.betas=[0.9, 0.95]" --set optim.weight_decay=0.1
      --set 'optim.no_decay=["bias", "norm", "embedding"]' --set optim.clip_grad_norm=1.0 --set optim.schedule=cosine
      --set optim.warmup_steps=4 --set run.max_steps=20 --set run.epochs=1 --set run.threads=1
      --set checkpoint.init_from="$WORK/init.safetensors" --set checkpoint.export=hf --set checkpoint.export_names=hf-gpt2
      --set checkpoint.every_steps=0 --set log.every_steps=1 --set log.progress=plain)

for setting in "1 FULL_SHARD" "2 FULL_SHARD" "3 FULL_SHARD" "4 HYBRID_SHARD"; do
  read -r np strategy <<<"$setting"
  out="$WORK/np${np}_$strategy"
  "${MPI[@]}" -np "$np" "$BIN/fsdp-train" "$SRC/inputs/gpt_tokens.toml" "${deck[@]}" --set fsdp.sharding_strategy="$strategy" \
    --set run.out_dir="$out" >"$out.log" 2>&1 || { cat "$out.log"; fail "fsdp-train at np $np $strategy"; }
  grep -q "initialized the model from .*init.safetensors (hf-gpt2 names)" "$out.log" || { cat "$out.log"; fail "no pretrained start"; }
  "${REF[@]}" compare "$out/hf/model.safetensors" "$WORK/reference.safetensors" --rtol 1e-5 ||
    fail "np $np $strategy: the weights differ from PyTorch's"
  "$PY" "$SRC/tests/equivalence_checks.py" losses "$out/metrics.csv" "$WORK/reference_losses.json" ||
    fail "np $np $strategy: the losses differ from PyTorch's"
  # The reverse: PyTorch evaluates fsdp-train's export as fsdp-train evaluated itself.
  torch_eval=$("${REF[@]}" eval --model "$out/hf/model.safetensors" --data "$WORK/val_*.bin" "${model[@]}") || fail "reference eval"
  "$PY" "$SRC/tests/equivalence_checks.py" eval "$out/summary.json" "$torch_eval" ||
    fail "np $np $strategy: PyTorch's evaluation of the export differs"
  echo "ok: np $np $strategy equals PyTorch"
done
echo "all PyTorch equivalence cases passed"
