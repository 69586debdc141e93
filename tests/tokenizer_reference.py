#!/usr/bin/env python3
"""An independent byte-level BPE (the algorithm of GPT-2's encoder.py, with the `regex` module and
unicodedata's NFC) to check fsdp's tokenizer (app/text/tokenizer.cpp, which uses ICU) against.

  tokenizer_reference.py make OUT.json --style gpt2|smollm2|llama3|qwen2 [--merges N]
      writes a tokenizer.json in the tokenizers library's format: the 256 byte symbols, N merges
      learnt from a fixed multilingual corpus, and the style's pre-tokenizer, normalizer and added tokens
  tokenizer_reference.py shards TOKENIZER.json OUT --separator TOKEN [--val-fraction F] INPUT...
      what fsdp-tokenize writes for the same inputs: llm.c shards OUT_{train,val}_000000.bin
"""
import argparse, json, struct, sys, unicodedata

import regex

GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN2 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

CORPUS = ("The quick brown fox jumps over the lazy dog. She'll say they're here; we've 1234567 apples!\n"
          "Le cœur a ses raisons que la raison ne connaît point. Ça va très bien, merci.\n"
          "Привет, как дела? Всё хорошо. 日本語のテキストも少し。 Ελληνικά γράμματα. 🙂🚀 emoji too\n"
          "    indented   spaces\tand\ttabs\r\nwindows line end, the the the theory thesis there\n") * 3


def byte_symbols():
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


def style_parts(style):
    if style == "smollm2":  # StarCoder's and SmolLM's: digits one by one, then GPT-2's ByteLevel
        pre = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                     {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
        return GPT2, None, pre, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], False
    if style == "gpt2":
        return GPT2, None, {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}, ["<|endoftext|>"], False
    pattern = LLAMA3 if style == "llama3" else QWEN2
    pre = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    added = ["<|begin_of_text|>", "<|end_of_text|>"] if style == "llama3" else ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return pattern, ({"type": "NFC"} if style == "qwen2" else None), pre, added, style == "llama3"


def make(args):
    pattern, normalizer, pre, added, ignore_merges = style_parts(args.style)
    bs = byte_symbols()
    text = unicodedata.normalize("NFC", CORPUS) if normalizer else CORPUS
    if args.style == "smollm2":
        text = regex.sub(r"(\p{N})", r" \1 ", text)  # the merges learn no digit runs (approximately what Digits does)
    words = [[bs[b] for b in piece.encode("utf-8")] for piece in regex.findall(pattern, text)]
    vocab = {bs[b]: b for b in range(256)}
    merges = []
    while len(merges) < args.merges:  # the most frequent adjacent pair, ties by first appearance
        counts, order = {}, []
        for w in words:
            for a, b in zip(w, w[1:]):
                if (a, b) not in counts:
                    order.append((a, b))
                counts[(a, b)] = counts.get((a, b), 0) + 1
        if not counts:
            break
        best = max(order, key=lambda p: counts[p])
        merges.append(best)
        vocab.setdefault(best[0] + best[1], len(vocab))
        words = [merge_word(w, best) for w in words]
    added_tokens = [{"id": len(vocab) + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                     "normalized": False, "special": True} for i, t in enumerate(added)]
    out = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added_tokens, "normalizer": normalizer,
           "pre_tokenizer": pre, "post_processor": None, "decoder": {"type": "ByteLevel"},
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
                     "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges, "vocab": vocab,
                     # llama3 and qwen2 write merges as pairs (tokenizers >= 0.20), gpt2 as "a b" strings
                     "merges": [a + " " + b for a, b in merges] if args.style == "gpt2" else [[a, b] for a, b in merges]}}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False)


def merge_word(w, pair):
    out, i = [], 0
    while i < len(w):
        if i + 1 < len(w) and (w[i], w[i + 1]) == pair:
            out.append(w[i] + w[i + 1])
            i += 2
        else:
            out.append(w[i])
            i += 1
    return out


class Reference:
    def __init__(self, path):
        j = json.load(open(path, encoding="utf-8"))
        m = j["model"]
        self.vocab = m["vocab"]
        self.ranks = {}
        for i, x in enumerate(m["merges"]):
            a, b = x.split(" ") if isinstance(x, str) else x
            self.ranks[(a, b)] = i
        self.ignore_merges = m.get("ignore_merges", False)
        self.added = sorted(((t["content"], t["id"]) for t in j["added_tokens"]), key=lambda t: -len(t[0]))
        self.nfc = j["normalizer"] is not None
        pre = j["pre_tokenizer"]
        steps = pre["pretokenizers"] if pre["type"] == "Sequence" else [pre]
        def pattern(s):
            if s["type"] == "Split":
                return s["pattern"]["Regex"]
            if s["type"] == "Digits":
                return r"\p{N}" if s.get("individual_digits") else r"\p{N}+"
            return GPT2
        self.patterns = [regex.compile(pattern(s)) for s in steps if s["type"] != "ByteLevel" or s.get("use_regex", True)]
        self.bs = byte_symbols()

    def encode(self, text):
        out, plain, i = [], 0, 0
        while i < len(text):
            hit = next(((c, t) for c, t in self.added if text.startswith(c, i)), None)
            if hit is None:
                i += 1
                continue
            out += self.encode_plain(text[plain:i]) + [hit[1]]
            i += len(hit[0])
            plain = i
        return out + self.encode_plain(text[plain:])

    def encode_plain(self, text):
        if not text:
            return []
        pieces = [unicodedata.normalize("NFC", text) if self.nfc else text]
        for p in self.patterns:
            nxt = []
            for piece in pieces:
                at = 0
                for m in p.finditer(piece):
                    if m.start() == m.end():
                        continue
                    if m.start() > at:
                        nxt.append(piece[at:m.start()])
                    nxt.append(m.group())
                    at = m.end()
                if at < len(piece):
                    nxt.append(piece[at:])
            pieces = nxt
        ids = []
        for piece in pieces:
            word = "".join(self.bs[b] for b in piece.encode("utf-8"))
            if self.ignore_merges and word in self.vocab:
                ids.append(self.vocab[word])
                continue
            symbols = list(word)
            while len(symbols) > 1:
                pairs = [(self.ranks.get((a, b), 1 << 62), k) for k, (a, b) in enumerate(zip(symbols, symbols[1:]))]
                rank, k = min(pairs)
                if rank == 1 << 62:
                    break
                symbols = merge_word(symbols, (symbols[k], symbols[k + 1]))
            ids += [self.vocab[s] for s in symbols]
        return ids


def shards(args):
    ref = Reference(args.tokenizer)
    sep = dict((c, t) for c, t in ref.added).get(args.separator, ref.vocab.get(args.separator))
    docs = []
    for path in args.inputs:
        if path.endswith(".jsonl") or path.endswith(".json"):
            docs += [json.loads(l)["text"] for l in open(path, encoding="utf-8") if l.strip(" \t\r\n")]
        else:
            docs.append(open(path, encoding="utf-8", newline="").read())
    split = {"train": [], "val": []}
    import math
    for i, d in enumerate(docs):
        val = math.ceil((i + 1) * args.val_fraction) > math.ceil(i * args.val_fraction)
        split["val" if val else "train"] += [sep] + ref.encode(d)
    size = max(max(ref.vocab.values()), max(t for _, t in ref.added)) + 1
    wide = size > 65536
    for name, toks in split.items():
        if not toks:
            continue
        header = [20240801 if wide else 20240520, 7 if wide else 1, len(toks)] + [0] * 253
        with open("%s_%s_000000.bin" % (args.out, name), "wb") as f:
            f.write(struct.pack("<256i", *header) + struct.pack("<%d%s" % (len(toks), "I" if wide else "H"), *toks))
    print("reference:", {k: len(v) for k, v in split.items()}, "tokens of", len(docs), "documents")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("out")
    m.add_argument("--style", choices=["gpt2", "smollm2", "llama3", "qwen2"], required=True)
    m.add_argument("--merges", type=int, default=300)
    s = sub.add_parser("shards")
    s.add_argument("tokenizer")
    s.add_argument("out")
    s.add_argument("--separator", required=True)
    s.add_argument("--val-fraction", type=float, default=0.0)
    s.add_argument("inputs", nargs="+")
    a = p.parse_args()
    make(a) if a.cmd == "make" else shards(a)


if __name__ == "__main__":
    main()
