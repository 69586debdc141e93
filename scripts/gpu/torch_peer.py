#!/usr/bin/env python3
"""The PyTorch side of the GPU kit's speed check (docs/gpu.md, "The GPU kit"): fsdp-train's GPT (as
app/models.hpp builds it: learned positions, pre-norm blocks with explicit causal attention, GPT-2's
tanh GELU, LM head tied to the padded token embedding, logits cut to the vocabulary, fp32 loss) trained
on one GPU on synthetic tokens of the same shape, in plain PyTorch eager (fp32 parameters under
torch.autocast bf16) or under FSDP2 (torch.distributed.fsdp.fully_shard at world size 1, each block and
the root, MixedPrecisionPolicy bf16 parameters and reductions, as fsdp-train's bf16). AdamW, gradient
clipping at 1.0, the loss read every step (as fsdp-train logs it).

  torch_peer.py --mode eager|fsdp2 --batch B [--context 1024 --layers 12 --d-model 768 --heads 12
                --vocab 50257 --vocab-pad 64] [--steps 15 --warmup 5] [--peak-tflops 989]

Prints one JSON line: tokens/s (batch x context / median step), the median step, model FLOP utilization
(nanoGPT's and fsdp-train's estimate: 6 N + 12 L d T FLOPs per token, N every parameter once, over
--peak-tflops), torch.cuda.max_memory_allocated and max_memory_reserved. Out of memory: a JSON line
with "error" and exit code 3."""
import argparse, json, math, os, socket, statistics, sys, time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads, context):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.register_buffer("blocked", torch.ones(context, context).tril() == 0, persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, 2)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(self.blocked[:t, :t], float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).contiguous().view(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, vocab, pad, context, d, heads, layers):
        super().__init__()
        self.vocab = vocab
        rows = (vocab + pad - 1) // pad * pad
        self.tok = nn.Embedding(rows, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads, context) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if "ln" in name:
                continue
            nn.init.zeros_(p) if name.endswith("bias") else nn.init.normal_(p, 0, 0.02)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device)).unsqueeze(0)
        for b in self.blocks:
            x = b(x)
        return F.linear(self.ln_f(x), self.tok.weight)[..., :self.vocab]  # the LM head is the embedding


def loss_of(logits, y):
    """fsdp-train's: log-softmax in fp32, mean negative log-likelihood of every target."""
    return F.nll_loss(F.log_softmax(logits.float().reshape(-1, logits.size(-1)), 1), y.reshape(-1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["eager", "fsdp2"], required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--vocab-pad", type=int, default=64)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=0.0)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # fsdp-train's default too (bf16 GEMMs are unaffected)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.manual_seed(1)
    out = {"implementation": "PyTorch %s %s" % (torch.__version__, "eager (autocast bf16)" if a.mode == "eager" else "FSDP2 fully_shard (bf16)"),
           "mode": a.mode, "batch": a.batch, "context": a.context, "device_name": torch.cuda.get_device_name(device)}
    try:
        model = Gpt(a.vocab, a.vocab_pad, a.context, a.d_model, a.heads, a.layers).to(device)
        params = sum(t.numel() for t in {id(t): t for t in model.parameters()}.values())
        if a.mode == "fsdp2":
            import torch.distributed as dist
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            with socket.socket() as s:  # a free port for the world of one
                s.bind(("127.0.0.1", 0))
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
            dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            for b in model.blocks:
                fully_shard(b, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
        gen = torch.Generator(device=device).manual_seed(2)
        times = []
        for step in range(a.warmup + a.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            tokens = torch.randint(0, a.vocab, (a.batch, a.context + 1), device=device, generator=gen)
            x, y = tokens[:, :-1], tokens[:, 1:]
            opt.zero_grad(set_to_none=True)
            if a.mode == "eager":
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = loss_of(model(x), y)
            else:
                loss = loss_of(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss.item()
            torch.cuda.synchronize()
            if step >= a.warmup:
                times.append(time.perf_counter() - start)
    except torch.cuda.OutOfMemoryError as e:
        out["error"] = "out of memory at batch %d: %s" % (a.batch, str(e).splitlines()[0])
        print(json.dumps(out))
        return 3
    median = statistics.median(times)
    tokens_per_s = a.batch * a.context / median
    flops_per_token = 6.0 * params + 12.0 * a.layers * a.d_model * a.context
    out.update(params=params, steps=len(times), step_ms_median=1000 * median, tokens_per_s=tokens_per_s,
               model_flops_per_token=flops_per_token,
               mfu=flops_per_token * tokens_per_s / (a.peak_tflops * 1e12) if a.peak_tflops > 0 else None,
               max_memory_allocated_mib=torch.cuda.max_memory_allocated(device) / 2**20,
               max_memory_reserved_mib=torch.cuda.max_memory_reserved(device) / 2**20, final_loss=loss.item())
    print(json.dumps(out))
    if a.mode == "fsdp2":
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
