#!/usr/bin/env bash
# fsdp-generate (fsdp-train called by that name; docs/data.md, "Text out"): a GPT and a Llama with
# grouped-query heads, trained 20 steps by the PyTorch references (tests/pytorch_reference.py,
# tests/llama_reference.py) and read through checkpoint.init_from, continue a prompt greedily to the
# end of the context exactly as the references' argmax decoding does, at np 1-4, with the KV
# cache and without. A sampled continuation (temperature, top-k, top-p, seeded) is the same at every
# world size and with or without the cache. A prompt as text goes through a tokenizer. Bad requests
# exit 2 on every rank.
#   tests/generate_e2e.sh SOURCE_DIR BUILD_BIN WORK_DIR
set -uo pipefail
SRC=$1 BIN=$2 WORK=$3
PY=/usr/bin/python3
if ! $PY -c "import torch" 2>/dev/null; then
  echo "SKIP: $PY has no torch (Debian's python3-torch)"
  exit 77
fi
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK" || exit 1
source "$SRC/tests/e2e_common.sh"
export OMPI_MCA_mpi_yield_when_idle=1
MPI=(mpirun --oversubscribe --allow-run-as-root)
"$PY" "$SRC/tests/make_token_shards.py" train --tokens 3841 || fail "make train shard"
data=(--set data.kind=token-shards --set "data.path=$WORK/train_*.bin" --set run.threads=1 --set log.progress=plain)
prompt="5,17,33"

ids_of() { sed -n 's/^ids: //p' <<<"$1"; }
for model in gpt llama; do
  if [[ $model == gpt ]]; then
    REF=("$PY" "$SRC/tests/pytorch_reference.py")
    ref_model=(--vocab 97 --context 16 --d-model 32 --heads 4 --layers 2 --activation gelu_tanh)
    deck=("$SRC/inputs/gpt_tokens.toml" --set model.kind=transformer --set model.vocab_size=97 --set model.vocab_pad_multiple=32
          --set model.context=16 --set model.d_model=32 --set model.n_heads=4 --set model.n_layers=2 --set model.mlp_ratio=4
          --set model.dropout=0 --set model.activation=gelu_tanh --set model.tie_embeddings=true)
  else
    REF=("$PY" "$SRC/tests/llama_reference.py")
    ref_model=(--vocab 97 --context 16 --d-model 32 --heads 4 --kv-heads 2 --head-dim 8 --layers 2 --intermediate 48 --rope-theta 10000)
    deck=("$SRC/inputs/llama_tokens.toml" --set model.kind=llama --set model.vocab_size=97 --set model.context=16 --set model.d_model=32
          --set model.n_heads=4 --set model.n_kv_heads=2 --set model.head_dim=0 --set model.intermediate_size=48 --set model.rope_theta=10000
          --set model.n_layers=2 --set model.tie_embeddings=false --set model.attention_bias=false)
  fi
  "${REF[@]}" init "$model.init.safetensors" "${ref_model[@]}" --seed 3 || fail "$model: reference init"
  "${REF[@]}" train --init "$model.init.safetensors" --data "train_*.bin" --out "$model.safetensors" --losses "$model.losses.json" \
    "${ref_model[@]}" || fail "$model: reference training"
  want=$("${REF[@]}" generate --model "$model.safetensors" --ids "$prompt" --new 13 "${ref_model[@]}" | "$PY" -c "import json, sys; print(' '.join(map(str, json.load(sys.stdin)['ids'])))") ||
    fail "$model: reference generation"
  # The deck's data files need not exist: generation reads no data.
  deck+=("${data[@]}" --set "data.path=$WORK/absent_*.bin" --set checkpoint.init_from="$WORK/$model.safetensors" --set run.out_dir="$WORK/$model.out")
  sampled=""
  for np in 1 2 3 4; do
    for cache in "" --no-kv-cache; do
      out=$("${MPI[@]}" -np $np "$BIN/fsdp-generate" "${deck[@]}" --ids "$prompt" --max-new-tokens 20 --no-stop $cache 2>&1) ||
        fail "$model np $np $cache: $out"
      [[ $(ids_of "$out") == "$want" ]] || fail "$model np $np ${cache:-with the KV cache}: greedy ids '$(ids_of "$out")', PyTorch's argmax '$want'"
      grep -q "generated 13 tokens after a prompt of 3 (greedy), .*tokens/s" <<<"$out" || fail "$model: no summary line: $out"
      out=$("${MPI[@]}" -np $np "$BIN/fsdp-generate" "${deck[@]}" --ids "$prompt" --no-stop $cache --temperature 0.9 --top-k 20 --top-p 0.9 \
            --seed 7 2>&1) || fail "$model np $np sampled: $out"
      [[ -z $sampled ]] && sampled=$(ids_of "$out")
      [[ $(ids_of "$out") == "$sampled" ]] || fail "$model np $np ${cache:-with the KV cache}: sampled '$(ids_of "$out")', at np 1 '$sampled'"
    done
  done
  [[ $sampled != "$want" ]] || fail "$model: the sampled continuation is the greedy one: sampling did nothing"
  echo "ok $model: greedy equals PyTorch's argmax ($want) at np 1-4 with and without the KV cache; sampled ($sampled) alike everywhere"
done

# End tokens (model.eos_token_id, one id or a list as Llama 3.1's config.json): the generation stops at
# the first token drawn that is any of them, and includes it.
read -ra greedy <<<"$want"
stops=("${greedy[6]}" "${greedy[3]}")
until_stop=""
for t in "${greedy[@]}"; do
  until_stop+="${until_stop:+ }$t"
  [[ $t == "${stops[0]}" || $t == "${stops[1]}" ]] && break
done
out=$("${MPI[@]}" -np 2 "$BIN/fsdp-generate" "${deck[@]}" --set "model.eos_token_id=[${stops[0]},${stops[1]}]" --ids "$prompt" 2>&1) ||
  fail "end tokens: $out"
[[ $(ids_of "$out") == "$until_stop" ]] || fail "end tokens [${stops[*]}]: ids '$(ids_of "$out")', expected '$until_stop'"
echo "ok the generation stops at the first of the end tokens [${stops[*]}]: $until_stop"

# A prompt as text: a GPT-2-style tokenizer of the test's own (tests/tokenizer_reference.py) encodes it
# and decodes the output (the model above has 97 tokens: the tokenizer's first 97 byte symbols are ids
# 0-96, so an ASCII prompt of them stays inside the vocabulary).
if "$PY" -c "import regex" 2>/dev/null; then
  "$PY" "$SRC/tests/tokenizer_reference.py" make tok.json --style gpt2 --merges 0 || fail "tokenizer"
  out=$("${MPI[@]}" -np 2 "$BIN/fsdp-generate" "${deck[@]}" --tokenizer tok.json --prompt '(+)' --max-new-tokens 5 --no-stop 2>&1) ||
    fail "text prompt: $out"
  grep -q "^text:" <<<"$out" || fail "text prompt: no text: $out"
  grep -q "after a prompt of 3 " <<<"$out" || fail "text prompt: not the 3 tokens of '(+)': $out"
  echo "ok a text prompt through a tokenizer"
  # A tokenizer whose post-processor begins every text with a special token (Llama 3's BOS) puts it
  # before a text prompt, as transformers' tokenizer(prompt) does: the same continuation as those ids.
  "$PY" - <<'PYEOF' || fail "tok_bos.json"
import json
t = json.load(open("tok.json"))
t["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                       "pair": [], "special_tokens": {"<bos>": {"id": "<bos>", "ids": [5], "tokens": ["<bos>"]}}}
json.dump(t, open("tok_bos.json", "w"))
PYEOF
  out=$("${MPI[@]}" -np 2 "$BIN/fsdp-generate" "${deck[@]}" --tokenizer tok_bos.json --prompt '(+)' --max-new-tokens 5 --no-stop 2>&1) ||
    fail "text prompt with a BOS: $out"
  grep -q "after a prompt of 4 " <<<"$out" || fail "text prompt with a BOS: not 4 tokens: $out"
  plain_ids=$("$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]); import tokenizer_reference as r; print(",".join(map(str, r.Reference("tok.json").encode("(+)"))))' \
    "$SRC/tests") || fail "the reference's ids of '(+)'"
  with_ids=$("${MPI[@]}" -np 2 "$BIN/fsdp-generate" "${deck[@]}" --ids "5,$plain_ids" --max-new-tokens 5 --no-stop 2>&1) ||
    fail "the BOS prompt as ids: $with_ids"
  [[ $(ids_of "$out") == "$(ids_of "$with_ids")" ]] || fail "text prompt with a BOS: '$(ids_of "$out")', as ids '$(ids_of "$with_ids")'"
  echo "ok the tokenizer's leading special token begins a text prompt"
fi

expect_error "prompt too long" "the prompt has 16 tokens, model.context is 16" \
  "${MPI[@]}" -np 2 "$BIN/fsdp-generate" "${deck[@]}" --ids "$(seq -s, 1 16)"
expect_error "text without a tokenizer" "--prompt needs --tokenizer" "${MPI[@]}" -np 2 "$BIN/fsdp-generate" "${deck[@]}" --prompt "hello"
expect_error "token past the vocabulary" "token 97 of the prompt is not below model.vocab_size 97" \
  "${MPI[@]}" -np 2 "$BIN/fsdp-generate" "${deck[@]}" --ids "1,97"
expect_error "bad ids" "--ids \"1,x\" is not a list of integers" "$BIN/fsdp-generate" "${deck[@]}" --ids "1,x"
expect_error "not whole integers" "--ids \"1,2x\" is not a list of integers" "$BIN/fsdp-generate" "${deck[@]}" --ids "1,2x"
expect_error "an empty id" "--ids \"1,,2\" is not a list of integers" "$BIN/fsdp-generate" "${deck[@]}" --ids "1,,2"
expect_error "ids and a prompt" "give the prompt as --ids or as --prompt, not both" "$BIN/fsdp-generate" "${deck[@]}" --ids "1,2" --prompt "x"
expect_error "not a language model" "model.kind \"mlp\" is not a language model" \
  "${MPI[@]}" -np 2 "$BIN/fsdp-generate" "$SRC/inputs/ci_tiny.toml" --set run.out_dir="$WORK/cnn" --ids "1,2"
expect_error "a NaN temperature" "--temperature: 'nan' is not a number" "$BIN/fsdp-generate" "${deck[@]}" --ids "1,2" --temperature nan
expect_error "a folder as the deck" "cannot read deck '$WORK': it is a folder, not a file" "$BIN/fsdp-generate" "$WORK" --ids "1,2"
expect_error "nothing to generate from" "nothing to generate from: no checkpoint in $WORK/empty/checkpoints and checkpoint.init_from is empty" \
  "$BIN/fsdp-generate" "${deck[@]}" --set run.out_dir="$WORK/empty" --set checkpoint.init_from= --ids "1,2"
echo "all generation cases passed"
