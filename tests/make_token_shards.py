#!/usr/bin/env python3
"""Writes token files as llm.c and nanoGPT do, for tests (no numpy, no torch).

  make_token_shards.py OUT_PREFIX --tokens N [--shards K] [--vocab V] [--seed S] [--format llmc16|llmc32|uint16|uint32]
                       [--bad-magic] [--bad-token INDEX]

llm.c: a header of 256 little-endian int32 (magic 20240520 version 1 for uint16 tokens, magic 20240801
version 7 for uint32; header[2] = number of tokens), then the tokens. uint16/uint32: the tokens alone
(nanoGPT's train.bin). The N tokens are split into K files OUT_PREFIX_000000.bin, ... They follow a
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prefix")
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--vocab", type=int, default=97)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--format", default="llmc16", choices=["llmc16", "llmc32", "uint16", "uint32"])
    p.add_argument("--bad-magic", action="store_true", help="write a wrong magic number into the first file")
    p.add_argument("--bad-token", type=int, default=-1, help="token INDEX (of the whole stream) becomes vocab")
    a = p.parse_args()
    toks = tokens(a.tokens, a.vocab, a.seed)
    if a.bad_token >= 0:
        toks[a.bad_token] = a.vocab
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
