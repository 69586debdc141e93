#!/usr/bin/env python3
"""Writes token files as llm.c and nanoGPT do, for tests (no numpy, no torch).

  make_token_shards.py OUT_PREFIX --tokens N [--shards K] [--vocab V] [--seed S]
                       [--format llmc16|llmc32|uint16|uint32|megatron] [--dtype-code C] [--bad-magic] [--bad-token INDEX]
                       [--doc-token T]

llm.c: a header of 256 little-endian int32 (magic 20240520 version 1 for uint16 tokens, magic 20240801
version 7 for uint32; header[2] = number of tokens), then the tokens. uint16/uint32: the tokens alone
(nanoGPT's train.bin). The N tokens are split into K files OUT_PREFIX_000000.bin, ...

megatron: a Megatron-LM / GPT-NeoX indexed dataset OUT_PREFIX.bin + OUT_PREFIX.idx, written from the
format as megatron/core/datasets/indexed_dataset.py documents it (not with fsdp's reader): the index is
the magic b"MMIDIDX\\x00\\x00", u64 version 1, u8 dtype code (--dtype-code: 1 uint8, 2 int8, 3 int16,
4 int32, 5 int64, 8 uint16, the default), u64 sequence count, u64 document count, int32 lengths, int64
byte pointers, int64 document indices (0, then each document's end); the tokens are cut into documents
of 1 to 3 sequences of 5 to 60 tokens (seeded). They follow a
seeded sparse Markov chain, so a model can learn them; the same seed gives the same tokens in every
format."""
import argparse, random, struct


def tokens(n, vocab, seed):
    rng = random.Random(seed)
    nxt = [[rng.randrange(vocab) for _ in range(3)] for _ in range(vocab)]
    t = rng.randrange(vocab)
    out = []
    for _ in range(n):
        out.append(t)
        r = rng.random()
        t = nxt[t][0] if r < 0.6 else nxt[t][1] if r < 0.8 else nxt[t][2] if r < 0.9 else rng.randrange(vocab)
    return out


# Megatron's dtype codes and the struct letters of their types.
MEGATRON_DTYPES = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 8: "H"}


def write_megatron(prefix, toks, code, seed, bad_magic, doc_token=-1):
    rng = random.Random(seed + 7)
    lengths, ends = [], [0]
    while sum(lengths) < len(toks):
        for _ in range(rng.randint(1, 3)):
            lengths.append(min(rng.randint(5, 60), len(toks) - sum(lengths)))
            if sum(lengths) == len(toks):
                break
        ends.append(len(lengths))
    if doc_token >= 0:  # the token begins every document and nothing else
        toks = [doc_token - 1 if t == doc_token else t for t in toks]
        for d in ends[:-1]:
            toks[sum(lengths[:d])] = doc_token
    letter = MEGATRON_DTYPES[code]
    width = struct.calcsize("<" + letter)
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * width
    with open(prefix + ".bin", "wb") as f:
        f.write(struct.pack("<%d%s" % (len(toks), letter), *toks))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" if not bad_magic else b"NOTANIDX\x00")
        f.write(struct.pack("<Q", 1) + struct.pack("<B", code) + struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(ends)))
        f.write(struct.pack("<%di" % len(lengths), *lengths))
        f.write(struct.pack("<%dq" % len(pointers), *pointers))
        f.write(struct.pack("<%dq" % len(ends), *ends))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prefix")
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--vocab", type=int, default=97)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--format", default="llmc16", choices=["llmc16", "llmc32", "uint16", "uint32", "megatron"])
    p.add_argument("--dtype-code", type=int, default=8, choices=sorted(MEGATRON_DTYPES), help="megatron: the dtype code")
    p.add_argument("--bad-magic", action="store_true", help="write a wrong magic number into the first file")
    p.add_argument("--bad-token", type=int, default=-1, help="token INDEX (of the whole stream) becomes vocab")
    p.add_argument("--doc-token", type=int, default=-1,
                   help="megatron: every document's first token becomes DOC_TOKEN (> 0), which appears nowhere else")
    a = p.parse_args()
    toks = tokens(a.tokens, a.vocab, a.seed)
    if a.bad_token >= 0:
        toks[a.bad_token] = a.vocab
    if a.format == "megatron":
        write_megatron(a.prefix, toks, a.dtype_code, a.seed, a.bad_magic, a.doc_token)
        return
    wide = a.format in ("llmc32", "uint32")
    per = (len(toks) + a.shards - 1) // a.shards
    for k in range(a.shards):
        part = toks[k * per:(k + 1) * per]
        with open("%s_%06d.bin" % (a.prefix, k), "wb") as f:
            if a.format.startswith("llmc"):
                header = [0] * 256
                header[0], header[1] = (20240801, 7) if wide else (20240520, 1)
                if a.bad_magic and k == 0:
                    header[0] = 12345
                header[2] = len(part)
                f.write(struct.pack("<256i", *header))
            f.write(struct.pack("<%d%s" % (len(part), "I" if wide else "H"), *part))


if __name__ == "__main__":
    main()
