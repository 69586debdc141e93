#!/usr/bin/env bash
# fsdp-tokenize against an independent byte-level BPE (tests/tokenizer_reference.py: GPT-2's encoder.py
# algorithm with Python's `regex` module and unicodedata's NFC, where fsdp uses ICU), on tokenizers of
# four styles the reference writes (GPT-2's ByteLevel expression; SmolLM2's Digits before it; Llama
# 3's Split expression, ignore_merges, merges as pairs; Qwen2's expression with NFC) and documents with Unicode, combining
# marks, whitespace runs, digits, contractions in capitals, CRLF, added tokens inside the text and an
# empty document: the shards are byte for byte the reference's at np 1-4, with a validation
# share. Shards of 100 tokens hold the same stream. A GPT trains on the result. Bad input ends every
# rank with exit 2 naming the file, line and byte offset or the tokenizer's key.
#   tests/tokenize_e2e.sh SOURCE_DIR BUILD_BIN WORK_DIR
set -uo pipefail
SRC=$1 BIN=$2 WORK=$3
PY=/usr/bin/python3
if ! $PY -c "import regex" 2>/dev/null; then
  echo "SKIP: $PY has no regex module (Debian's python3-regex)"
  exit 77
fi
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK" || exit 1
source "$SRC/tests/e2e_common.sh"
export OMPI_MCA_mpi_yield_when_idle=1
MPI=(mpirun --oversubscribe --allow-run-as-root)
REF=("$PY" "$SRC/tests/tokenizer_reference.py")

"$PY" - <<'PY' || fail "writing the documents"
import json
docs = ["Hello world! The theory of the thesis.",
        "  leading spaces,   runs of   spaces \t tabs\t\tand trailing   ",
        "Numbers: 1234567 3.14159 and 42nd; 2026-11-27.",
        "Unicode: caf\u00e9, cafe\u0301 (decomposed), na\u00efve, \u041f\u0440\u0438\u0432\u0435\u0442, \u65e5\u672c\u8a9e, \U0001F642\U0001F680!",
        "DON'T SHOUT, they'RE here. She'll go; we've been; I'm ok; you'd see.",
        "line one\r\nline two\n\n\nafter blank lines\n",
        "special <|endoftext|> inside and <|end_of_text|> too<|begin_of_text|>x",
        "", "a", "The quick brown fox jumps over the lazy dog. " * 5]
with open("docs.jsonl", "w", encoding="utf-8") as f:
    for d in docs:
        f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
open("plain.txt", "w", encoding="utf-8", newline="").write("A whole file is one document.\nWith lines\r\nand   spaces.\n")
PY

for style in gpt2 smollm2 llama3 qwen2; do
  sep="<|endoftext|>"
  [[ $style == llama3 ]] && sep="<|end_of_text|>"
  "${REF[@]}" make "$style.json" --style "$style" || fail "$style: make"
  "${REF[@]}" shards "$style.json" "ref_$style" --separator "$sep" --val-fraction 0.25 docs.jsonl plain.txt || fail "$style: reference"
  for np in 1 2 3 4; do
    out=$("${MPI[@]}" -np $np "$BIN/fsdp-tokenize" --tokenizer "$style.json" --out "out_${style}_np$np" --separator "$sep" \
          --val-fraction 0.25 docs.jsonl plain.txt 2>&1) || fail "$style np $np: $out"
    for split in train val; do
      cmp -s "ref_${style}_${split}_000000.bin" "out_${style}_np${np}_${split}_000000.bin" || fail "$style np $np: the $split shard differs from the reference"
    done
  done
  echo "ok $style: the reference's shards at np 1-4 ($(grep -o '[0-9]* train and [0-9]* validation tokens' <<<"$out"))"
done

# Shards of 100 tokens: the same stream, every shard but the last holding 100.
out=$("${MPI[@]}" -np 3 "$BIN/fsdp-tokenize" --tokenizer gpt2.json --out small --shard-tokens 100 --val-fraction 0.25 docs.jsonl plain.txt 2>&1) ||
  fail "small shards: $out"
"$PY" - <<'PY' || fail "small shards"
import glob, struct, sys
def tokens(paths):
    out, counts = [], []
    for p in paths:
        b = open(p, "rb").read()
        h = struct.unpack("<256i", b[:1024])
        counts.append(h[2])
        out += list(struct.unpack("<%dH" % h[2], b[1024:]))
    return out, counts
small, counts = tokens(sorted(glob.glob("small_train_*.bin")))
ref, _ = tokens(["ref_gpt2_train_000000.bin"])
if small != ref or any(c != 100 for c in counts[:-1]) or len(counts) < 3:
    sys.exit("shards of 100: counts %s, equal %s" % (counts, small == ref))
print("ok shards of 100 tokens:", counts)
PY

# The shards train: a small GPT over the GPT-2-style vocabulary (its size from the tokenizer).
vocab=$("$PY" -c "import json; j = json.load(open('gpt2.json')); print(max(list(j['model']['vocab'].values()) + [t['id'] for t in j['added_tokens']]) + 1)")
out=$("${MPI[@]}" -np 2 "$BIN/fsdp-train" "$SRC/inputs/gpt_tokens.toml" --set data.kind=token-shards --set "data.path=small_train_*.bin" \
      --set "data.val_path=small_val_*.bin" --set model.vocab_size="$vocab" --set model.context=16 --set model.d_model=32 --set model.n_layers=1 \
      --set data.batch_size=2 --set run.max_steps=4 --set run.out_dir=train --set log.progress=plain --set run.threads=1 2>&1) || fail "training: $out"
grep -q "eval loss" <<<"$out" || fail "training: no evaluation: $out"
echo "ok a GPT trains on the shards"

# Bad input: exit 2 on every rank, named.
printf '{"text": "fine"}\n{"text": "bad \xff byte"}\n' >bad_utf8.jsonl
expect_error "not UTF-8" "input 'bad_utf8.jsonl' line 2: not UTF-8 at byte offset 14 of the line" \
  "${MPI[@]}" -np 2 "$BIN/fsdp-tokenize" --tokenizer gpt2.json --out bad1 bad_utf8.jsonl
printf '{"text": "fine"}\n\n[1, 2]\n' >bad_json.jsonl
expect_error "not JSON" "input 'bad_json.jsonl' line 3: not a JSON object with a string \"text\"" \
  "${MPI[@]}" -np 3 "$BIN/fsdp-tokenize" --tokenizer gpt2.json --out bad2 bad_json.jsonl
"$PY" -c "import json; j = json.load(open('gpt2.json')); j['model']['type'] = 'WordPiece'; json.dump(j, open('wordpiece.json', 'w'))"
expect_error "unsupported tokenizer" "wordpiece.json: model.type: \"WordPiece\" is not supported" \
  "${MPI[@]}" -np 2 "$BIN/fsdp-tokenize" --tokenizer wordpiece.json --out bad3 docs.jsonl
expect_error "no separator" "has no token \"<|endoftext|>\": name the token that separates documents with --separator" \
  "${MPI[@]}" -np 2 "$BIN/fsdp-tokenize" --tokenizer llama3.json --out bad4 docs.jsonl
printf 'plain text, then a bad byte \xc3(' >bad_utf8.txt
expect_error "not UTF-8 text" "input 'bad_utf8.txt': the text is not UTF-8 at byte offset 28" \
  "${MPI[@]}" -np 2 "$BIN/fsdp-tokenize" --tokenizer gpt2.json --out bad5 docs.jsonl bad_utf8.txt
expect_error "existing shards" "out_gpt2_np1_train_000000.bin' exists" \
  "${MPI[@]}" -np 2 "$BIN/fsdp-tokenize" --tokenizer gpt2.json --out out_gpt2_np1 docs.jsonl
# A rank whose write fails after every shard exists (a test hook): exit 1 on every rank, and neither the
# temporary files nor any shard stays behind.
out=$(FSDP_TEST_TOKENIZE_FAIL_ON_RANK=1 "${MPI[@]}" -x FSDP_TEST_TOKENIZE_FAIL_ON_RANK -np 3 "$BIN/fsdp-tokenize" --tokenizer gpt2.json \
      --out late --shard-tokens 100 docs.jsonl plain.txt 2>&1)
rc=$?
((rc == 1)) || fail "a failed write: exit code $rc, expected 1: $out"
grep -qF "test hook FSDP_TEST_TOKENIZE_FAIL_ON_RANK" <<<"$out" || fail "a failed write: not named: $out"
ls .late_*.tmp late_*.bin >/dev/null 2>&1 && fail "a failed run left files behind: $(ls .late_* late_*.bin 2>/dev/null)"
echo "ok a write that fails after the shards exist leaves nothing behind"
# A signal while the temporary shards exist (test hooks raise SIGTERM on rank 0 right after creating
# them, and after the first is renamed in): they are removed, the one published too, and the signal
# ends the job. Temporaries a killed run left (written here by
# hand) are removed by the next run, which says so.
FSDP_TEST_TOKENIZE_RAISE=15 "${MPI[@]}" -x FSDP_TEST_TOKENIZE_RAISE -np 1 "$BIN/fsdp-tokenize" --tokenizer gpt2.json \
  --out signalled --shard-tokens 100 docs.jsonl plain.txt >/dev/null 2>&1 && fail "a signalled run exited 0"
ls .signalled_*.tmp signalled_*.bin >/dev/null 2>&1 && fail "a signalled run left files behind: $(ls .signalled_* signalled_*.bin 2>/dev/null)"
FSDP_TEST_TOKENIZE_RAISE_AFTER_RENAMES=1 "${MPI[@]}" -x FSDP_TEST_TOKENIZE_RAISE_AFTER_RENAMES -np 2 "$BIN/fsdp-tokenize" \
  --tokenizer gpt2.json --out published --shard-tokens 100 docs.jsonl plain.txt >/dev/null 2>&1 && fail "a run signalled while publishing exited 0"
ls .published_*.tmp published_*.bin >/dev/null 2>&1 && fail "a run signalled while publishing left: $(ls .published_* published_*.bin 2>/dev/null)"
echo "ok a signal removes the temporary shards, and the published ones of an unfinished corpus"
touch .stale_train_000000.bin.tmp .stale_val_000003.bin.tmp
out=$("${MPI[@]}" -np 2 "$BIN/fsdp-tokenize" --tokenizer gpt2.json --out stale docs.jsonl 2>&1) || fail "stale temporaries: $out"
grep -qF "removed 2 temporary shard(s) .stale_*.bin.tmp of a run that did not finish" <<<"$out" || fail "stale temporaries: not said: $out"
ls .stale_* >/dev/null 2>&1 && fail "stale temporaries stayed: $(ls .stale_*)"
echo "ok an earlier run's temporaries are removed"
# Wildcards in --out are literal: braet_train_000000.bin is not the shard of 'br[ack]et'.
touch braet_train_000000.bin .braet_train_000000.bin.tmp
out=$("${MPI[@]}" -np 1 "$BIN/fsdp-tokenize" --tokenizer gpt2.json --out 'br[ack]et' docs.jsonl 2>&1) || fail "wildcards in --out: $out"
[[ -f 'br[ack]et_train_000000.bin' && -f .braet_train_000000.bin.tmp ]] || fail "wildcards in --out: $(ls -a ./*br* .*br* 2>/dev/null)"
echo "ok wildcards in --out are literal"
mkdir -p a_folder
expect_error "a folder as input" "input 'a_folder' is a folder: give the files in it (e.g. a_folder/*.jsonl)" \
  "${MPI[@]}" -np 2 "$BIN/fsdp-tokenize" --tokenizer gpt2.json --out bad7 docs.jsonl a_folder
expect_error "one document, all of it for validation" "no training tokens: 1 document(s), all of them for validation" \
  "${MPI[@]}" -np 2 "$BIN/fsdp-tokenize" --tokenizer gpt2.json --out bad6 plain.txt
# Every input is read twice, on any rank: a pipe (stdin under mpirun belongs to rank 0 alone) is refused.
expect_error "a pipe as input" "input '/dev/stdin' is not a regular file (a pipe, a device or stdin)" \
  bash -c 'echo hello | "$@"' _ "${MPI[@]}" -np 2 "$BIN/fsdp-tokenize" --tokenizer gpt2.json --out bad8 docs.jsonl /dev/stdin
expect_error "an empty --out" "--out '': give a prefix for the shards' names" "$BIN/fsdp-tokenize" --tokenizer gpt2.json --out "" docs.jsonl
expect_error "a NaN --val-fraction" "--val-fraction: 'nan' is not a number in [0, 1]" \
  "$BIN/fsdp-tokenize" --tokenizer gpt2.json --out bad9 --val-fraction nan docs.jsonl
echo "all tokenize cases passed"
