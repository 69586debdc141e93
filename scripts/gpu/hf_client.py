#!/usr/bin/env python3
"""A real client of fsdp-train's Hugging Face export (the GPU kit's check hf_gpt2_client, docs/gpu.md):
transformers.GPT2LMHeadModel.from_pretrained(FOLDER) computes the logits of every validation sequence
of the llm.c token shards GLOB (sequence i: tokens [i*T, i*T+T], targets shifted by one, as fsdp-train
reads them), and from them the mean cross-entropy, which must be within --rtol (relative) of the
test_loss fsdp-train's own evaluation wrote to summary.json. fsdp-train writes no logits, so its
evaluation of the same tokens is what the logits are held to. fp32, TF32 off.

  hf_client.py FOLDER --data GLOB --context T --expect LOSS [--rtol 1e-4] [--device cuda] [--batch 32]

Prints one JSON line (loss, expected, relative difference, tokens, versions); exit 0 within --rtol."""
import argparse, json, os, sys

import torch
import torch.nn.functional as F

# The token reader the project's PyTorch reference uses (llm.c shards in name order, as fsdp-train reads them).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from pytorch_reference import read_tokens  # noqa: E402


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
