#!/usr/bin/env python3
"""Whole-model comparison of two safetensors files (the GPU kit's checks, docs/gpu.md): the relative
error ||A - B|| / ||B|| over all tensors concatenated (float64 sums), and whether every byte is equal.
Needs numpy only (reads the format itself: 8-byte header length, JSON header, raw little-endian data).

  model_diff.py A B [--rtol R]      exit 0 when the relative error is <= R (default 1e-5)
  model_diff.py A B --bitwise       exit 0 when every tensor is equal bit for bit

Prints one line: the error, the tensor with the largest error of its own, and bitwise equality."""
import argparse, os, sys

import numpy as np

# The header reader of the project's own safetensors comparison (no torch, no safetensors package needed).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from safetensors_diff import read as read_safetensors  # noqa: E402

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "U8": np.uint8}


def read(path):
    header, data = read_safetensors(path)
    out = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        raw = data[begin:end]
        if e["dtype"] == "BF16":  # the upper half of a float32
            values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            values = np.frombuffer(raw, dtype=np.dtype(DTYPES[e["dtype"]]).newbyteorder("<"))
        out[name] = (e["dtype"], tuple(e["shape"]), raw, values.reshape(e["shape"]).astype(np.float64))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--bitwise", action="store_true")
    args = p.parse_args()
    a, b = read(args.a), read(args.b)
    if set(a) != set(b):
        print("the files hold different tensors: only in A %s, only in B %s" % (sorted(set(a) - set(b)), sorted(set(b) - set(a))))
        return 1
    for name in sorted(a):
        if a[name][:2] != b[name][:2]:
            print("%s: %s %s in A, %s %s in B" % (name, a[name][0], a[name][1], b[name][0], b[name][1]))
            return 1
    diff = sum(float(np.sum((a[k][3] - b[k][3]) ** 2)) for k in a)
    ref = sum(float(np.sum(b[k][3] ** 2)) for k in b)
    err = (diff ** 0.5) / max(ref ** 0.5, 1e-30)
    per = {k: float(np.linalg.norm(a[k][3] - b[k][3])) / max(float(np.linalg.norm(b[k][3])), 1e-30) for k in a}
    worst = max(per, key=per.get)
    bitwise = all(a[k][2] == b[k][2] for k in a)
    print("relative error of the whole model %.3g over %d tensors (largest of one tensor: %s %.3g); bitwise equal: %s"
          % (err, len(a), worst, per[worst], "yes" if bitwise else "no"))
    if args.bitwise:
        return 0 if bitwise else 1
    return 0 if err <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(main())
