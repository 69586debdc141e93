#!/usr/bin/python3
"""Every matrix product of one training micro-batch of a GPT or Llama deck, each timed alone on one thread:
what each of the model's GEMMs reaches on this machine, against fsdp-train's GEMM probe.

    /usr/bin/python3 bench/gemm_kernels.py DECK.toml [--set key=value ...] [--batch B] [--min-seconds S]

Runs in Debian's python3-torch 1.13, the same libtorch_cpu.so.1.13 and OpenBLAS as fsdp-train (LibTorch
calls the system BLAS for every fp32 product: linear's addmm, mm, and each matrix of bmm). One thread for
LibTorch and OpenBLAS. Per product: one warm-up, then repetitions for at least --min-seconds, the best one
counts; the product's share of the step's GEMM FLOPs, and the step's GEMM time if every product ran at its
own rate (the ceiling of a step made of nothing else). Prints a Markdown table (docs/performance.md).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_peer  # noqa: E402  (load_deck, openblas_thread_calls, PROBE_FIXED)


def products(deck, batch):
    """(name, operation, shapes, count per micro-batch) of a forward and backward of the deck's model."""
    kind = deck["model.kind"]
    t, d, layers, vocab = deck["model.context"], deck["model.d_model"], deck["model.n_layers"], deck["model.vocab_size"]
    heads = deck["model.n_heads"]
    rows = batch * t
    if kind == "transformer":
        linears = [("qkv", d, 3 * d), ("attention out", d, d), ("MLP up", d, deck["model.mlp_ratio"] * d),
                   ("MLP down", deck["model.mlp_ratio"] * d, d)]
        hd, q_heads = d // heads, heads
    elif kind == "llama":
        hd = deck["model.head_dim"] or d // heads
        kv = deck["model.n_kv_heads"] or heads
        inter = deck["model.intermediate_size"] or deck["model.mlp_ratio"] * d
        linears = [("q", d, heads * hd), ("k, v", d, kv * hd), ("o", heads * hd, d), ("gate, up", d, inter), ("down", inter, d)]
        q_heads = heads
    else:
        raise SystemExit(f"gemm_kernels.py: model.kind = {kind!r}: GPT (transformer) and Llama decks only")
    counts = {"k, v": 2, "gate, up": 2}
    out = []
    for name, n_in, n_out in linears + [("LM head", d, vocab)]:
        per = layers * counts.get(name, 1) if name != "LM head" else 1
        out.append((f"{name} forward", "linear", (rows, n_in, n_out), per))
        out.append((f"{name} input gradient", "mm", (rows, n_out, n_in), per))
        out.append((f"{name} weight gradient", "mm_t", (n_out, rows, n_in), per))
    bh = batch * q_heads
    # Attention scores q k^T and their use att v, then backward's four batched products.
    out.append(("attention q k^T", "bmm", (bh, t, hd, t), layers))
    out.append(("attention att v", "bmm", (bh, t, t, hd), layers))
    out.append(("attention backward (4 products)", "bmm", (bh, t, t, hd), 4 * layers))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("deck")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--batch", type=int, default=0, help="micro-batch (default: the deck's data.batch_size)")
    ap.add_argument("--min-seconds", type=float, default=0.2)
    args = ap.parse_args()
    deck = train_peer.load_deck(args.deck, args.overrides)
    batch = args.batch or deck["data.batch_size"]
    import torch
    torch.set_num_threads(1)
    set_blas, _ = train_peer.openblas_thread_calls()
    if set_blas:
        set_blas(1)

    def best_seconds(fn):
        fn()
        best, spent, reps = float("inf"), 0.0, 0
        while reps < 3 or spent < args.min_seconds:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            best, spent, reps = min(best, dt), spent + dt, reps + 1
        return best

    rows = []
    with torch.no_grad():
        _, m, k, n = train_peer.PROBE_FIXED
        a, b = torch.full((m, k), 0.5), torch.full((n, k), 0.25)
        fixed = 2.0 * m * k * n / best_seconds(lambda: torch.nn.functional.linear(a, b)) / 1e9
        for name, op, shape, count in products(deck, batch):
            if op == "linear":  # y = x W^T + b: addmm
                r, i, o = shape
                x, w, bias = torch.full((r, i), 0.5), torch.full((o, i), 0.25), torch.zeros(o)
                fn, flops = (lambda x=x, w=w, bias=bias: torch.nn.functional.linear(x, w, bias)), 2.0 * r * i * o
            elif op == "mm":  # dX = dY W
                r, o, i = shape
                g, w = torch.full((r, o), 0.5), torch.full((o, i), 0.25)
                fn, flops = (lambda g=g, w=w: torch.mm(g, w)), 2.0 * r * o * i
            elif op == "mm_t":  # dW = dY^T X
                o, r, i = shape
                g, x = torch.full((r, o), 0.5), torch.full((r, i), 0.25)
                fn, flops = (lambda g=g, x=x: torch.mm(g.t(), x)), 2.0 * o * r * i
            else:  # batched: (bh, m, k) x (bh, k, n), as torch.matmul runs 4-D attention
                bh, m_, k_, n_ = shape
                p, q = torch.full((bh, m_, k_), 0.5), torch.full((bh, k_, n_), 0.25)
                fn, flops = (lambda p=p, q=q: torch.matmul(p, q)), 2.0 * bh * m_ * k_ * n_
            rows.append((name, op, shape, count, flops * count, flops / best_seconds(fn) / 1e9))
    total = sum(r[4] for r in rows)
    seconds = sum(r[4] / (r[5] * 1e9) for r in rows)
    print(f"{args.deck}: micro-batch {batch} x context {deck['model.context']}, one thread; torch {torch.__version__}; "
          f"fixed 512x512x512: {fixed:.1f} GFLOP/s\n")
    print("| product | LibTorch op | shape | per micro-batch | share of GEMM FLOPs | GFLOP/s (one thread) |")
    print("|---|---|---|---:|---:|---:|")
    for name, op, shape, count, fl, rate in rows:
        print(f"| {name} | {op} | {' x '.join(str(s) for s in shape)} | {count} | {fl / total:.1%} | {rate:.1f} |")
    print(f"\nAll products: {total / 1e9:.2f} GFLOP per micro-batch, {seconds * 1000:.1f} ms at these rates: "
          f"{total / seconds / 1e9:.1f} GFLOP/s, {total / seconds / 1e9 / fixed:.0%} of the fixed product's rate")


if __name__ == "__main__":
    main()
