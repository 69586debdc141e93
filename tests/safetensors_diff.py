#!/usr/bin/env python3
"""Compares two safetensors files tensor by tensor, without torch or the safetensors package:
same names, shapes and dtypes, and values within --rtol relative to each tensor's max |B|
(0: bit for bit). Prints one line per differing tensor; exit 0 if they match, 1 if not."""
import argparse, array, json, struct, sys

FORMATS = {"F32": "f", "F64": "d", "I64": "q", "I32": "i"}


def read(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return header, data


def values(entry, data):
    begin, end = entry["data_offsets"]
    raw = data[begin:end]
    if entry["dtype"] not in FORMATS:
        return raw
    a = array.array(FORMATS[entry["dtype"]])
    a.frombytes(raw)
    return a


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rtol", type=float, default=0.0)
    args = p.parse_args()
    ha, da = read(args.a)
    hb, db = read(args.b)
    ok = True
    if set(ha) != set(hb):
        print("names differ: only in A %s, only in B %s" % (sorted(set(ha) - set(hb)), sorted(set(hb) - set(ha))))
        return 1
    for name in sorted(ha):
        ea, eb = ha[name], hb[name]
        if ea["shape"] != eb["shape"] or ea["dtype"] != eb["dtype"]:
            print("%s: %s %s in A, %s %s in B" % (name, ea["dtype"], ea["shape"], eb["dtype"], eb["shape"]))
            ok = False
            continue
        va, vb = values(ea, da), values(eb, db)
        if isinstance(va, bytes):
            if va != vb:
                print("%s: bytes differ" % name)
                ok = False
            continue
        scale = max((abs(x) for x in vb), default=0.0)
        worst = max((abs(x - y) for x, y in zip(va, vb)), default=0.0)
        if worst > args.rtol * scale:
            print("%s: max |A-B| %.3g, max |B| %.3g" % (name, worst, scale))
            ok = False
    print("files match" if ok else "files differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
