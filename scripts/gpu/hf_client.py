#!/usr/bin/env python3
"""A real client of fsdp-train's Hugging Face export (the GPU kit's check hf_gpt2_client, docs/gpu.md):
transformers.GPT2LMHeadModel.from_pretrained(FOLDER) computes the logits of every validation sequence
of the llm.c token shards GLOB (sequence i: tokens [i*T, i*T+T], targets shifted by one, as fsdp-train
reads them), and from them the mean cross-entropy, which must be within --rtol (relative) of the
test_loss fsdp-train's own evaluation wrote to summary.json. fsdp-train writes no logits, so its
evaluation of the same tokens is what the logits are held to. fp32, TF32 off.

  hf_client.py FOLDER --data GLOB --context T --expect LOSS [--rtol 1e-4] [--device cuda] [--batch 32]

Prints one JSON line (loss, expected, relative difference, tokens, versions); exit 0 within --rtol."""
import argparse, glob, json, sys

import numpy as np
import torch
import torch.nn.functional as F


def read_tokens(pattern):
    """llm.c shards in name order: 256 int32 header (magic 20240520: uint16 tokens, 20240801: uint32)."""
    files = sorted(glob.glob(pattern))
    if not files:
        sys.exit("no files match " + pattern)
    parts = []
    for path in files:
        header = np.fromfile(path, dtype="<i4", count=256)
        width = {20240520: "<u2", 20240801: "<u4"}[int(header[0])]
        parts.append(np.fromfile(path, dtype=width, count=int(header[2]), offset=1024).astype(np.int64))
    return torch.from_numpy(np.concatenate(parts))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--data", required=True)
    p.add_argument("--context", type=int, required=True)
    p.add_argument("--expect", type=float, required=True)
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=32)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import transformers
    from transformers import GPT2LMHeadModel

    try:  # the explicit attention fsdp-train computes; older transformers have no such argument
        model = GPT2LMHeadModel.from_pretrained(a.folder, attn_implementation="eager")
    except TypeError:
        model = GPT2LMHeadModel.from_pretrained(a.folder)
    model = model.float().to(a.device).eval()
    tokens = read_tokens(a.data)
    t = a.context
    n = (len(tokens) - 1) // t
    total, count = 0.0, 0
    with torch.no_grad():
        for first in range(0, n, a.batch):
            rows = range(first, min(n, first + a.batch))
            x = torch.stack([tokens[i * t:i * t + t] for i in rows]).to(a.device)
            y = torch.stack([tokens[i * t + 1:i * t + t + 1] for i in rows]).to(a.device)
            logits = model(x).logits.float()
            total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum").item()
            count += y.numel()
    loss = total / count
    rel = abs(loss - a.expect) / max(abs(a.expect), 1e-30)
    print(json.dumps({"loss": loss, "expected": a.expect, "relative_difference": rel, "tokens": count, "device": a.device,
                      "transformers": transformers.__version__, "torch": torch.__version__}))
    return 0 if rel <= a.rtol else 1


if __name__ == "__main__":
    sys.exit(main())
