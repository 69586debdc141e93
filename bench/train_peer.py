#!/usr/bin/python3
"""PyTorch peer of fsdp-train for `make bench`: the same model, data, batch, optimizer and threads.

    mpirun -np N /usr/bin/python3 bench/train_peer.py DECK.toml [--set section.key=value ...]
           --out-dir DIR [--warmup 5] [--wrapper ddp|fsdp|none] [--init-file PATH]

Run with Debian's /usr/bin/python3 (python3-torch 1.13, CPU, the same libtorch_cpu.so.1.13 and system
BLAS as fsdp-train). Ranks come from Open MPI's environment (OMPI_COMM_WORLD_RANK / _SIZE);
torch.distributed uses gloo with a file:// rendezvous (no TCP port to collide with other jobs).

It reads the same TOML deck as fsdp-train (same --set syntax) and builds, in plain PyTorch:
  - model.kind = "cnn": the FSDP tutorial CNN exactly as app/models.hpp TutorialCnn;
  - model.kind = "transformer": the GPT of app/models.hpp (pre-norm blocks, tied head, GPT-2 init);
  - model.kind = "llama": the Llama of app/models/llama.hpp (fp32 RMSNorm, rotate_half rotary positions,
    k/v heads repeated for grouped-query attention, SwiGLU; Hugging Face's init: N(0, 0.02), unit norms);
  - data: Fashion-MNIST/MNIST IDX files normalized as fsdp-train does, or the synthetic token chain of
    app/data.cpp, reproduced bit for bit (std::mt19937_64 and the same rejection sampling), and the
    same DistributedSampler order (seeded Fisher-Yates), so every rank trains on exactly the samples
    fsdp-train's rank trains on;
  - optimizer sgd/adam/adamw/adadelta with the deck's lr (warmup + schedule as fsdp-train), weight
    decay, betas, momentum, gradient clipping.
--wrapper ddp (default): DistributedDataParallel over gloo (broadcast_buffers=False: the only buffer,
the causal mask, is constant; fsdp-train does not re-broadcast buffers either).
--wrapper fsdp: torch.distributed.fsdp.FullyShardedDataParallel on CPU with in-process patches (see
fsdp_cpu_patches below); --set fsdp.sharding_strategy picks its strategy.
--wrapper none: plain PyTorch, one process (no wrapper, no collective): the yardstick at np 1.

Timing matches fsdp-train's: a step is timed from before zero_grad (batch assembly included) to after
optimizer.step() on rank 0. The first --warmup steps are excluded; step_ms_median is the median of the
rest and samples_per_s = global batch x measured steps / their summed time. Writes DIR/summary.json
with the keys of fsdp-train's summary (world_size, threads_per_rank, strategy, params, steps,
step_ms_median, samples_per_s, tokens_per_s, peak_rss_mb per rank) plus step_ms (every step) and the
BLAS library mapped into the process, the GEMM probe of fsdp-train (gemm_probe: one thread's rate at the
model's products and at a fixed 512^3 one, rank 0 before training), and every step's breakdown (phases_ms: forward with the loss,
backward, optimizer with clipping, all_reduce: DDP's gradient all-reduces from the first bucket's launch
to the last one's completion, timed by a comm hook that does what DDP's default does; minor_faults from getrusage), as fsdp-train's
metrics.csv columns.
"""
import argparse
import gzip
import json
import math
import os
import resource
import statistics
import sys
import time
import tomllib

import numpy as np

# ---------------------------------------------------------------------------------------------------
# Deck: the keys this peer uses, with fsdp-train's defaults (docs/deck_reference.md).
DEFAULTS = {
    "run.name": "fsdp", "run.seed": 1, "run.epochs": 2, "run.max_steps": 0, "run.threads": 0, "run.out_dir": "",
    "model.kind": "cnn", "model.dropout": None, "model.hidden_sizes": [512, 256], "model.vocab_size": 256, "model.context": 64,
    "model.d_model": 128, "model.n_heads": 4, "model.n_layers": 4, "model.mlp_ratio": 4, "model.tie_embeddings": True,
    "model.n_kv_heads": 0, "model.head_dim": 0, "model.intermediate_size": 0, "model.norm_eps": 1e-5, "model.rope_theta": 10000.0,
    "model.attention_bias": False, "model.rope_scaling": "none",
    "data.kind": "fashion-mnist", "data.path": "/usr/share/datasets/fashion-mnist", "data.batch_size": 64, "data.shuffle": True,
    "data.train_samples": 0, "data.num_samples": 4096,
    "optim.kind": "adadelta", "optim.lr": 1.0, "optim.weight_decay": 0.0, "optim.momentum": 0.0, "optim.betas": [0.9, 0.999],
    "optim.schedule": "step", "optim.gamma": 0.7, "optim.warmup_steps": 0, "optim.clip_grad_norm": 0.0, "optim.grad_accum_steps": 1,
    "fsdp.sharding_strategy": "FULL_SHARD", "fsdp.auto_wrap_policy": "NO_WRAP", "fsdp.min_num_params": 100000,
    "fsdp.transformer_layer_cls_to_wrap": "TransformerBlock", "fsdp.mixed_precision": "no", "fsdp.activation_checkpointing": False,
}
# Keys the peer cannot honour: they must stay at these values.
REQUIRED = {"optim.grad_accum_steps": 1, "fsdp.mixed_precision": "no", "fsdp.activation_checkpointing": False, "model.rope_scaling": "none"}


def load_deck(path, overrides):
    with open(path, "rb") as f:
        doc = tomllib.load(f)
    flat = {}
    for section, table in doc.items():
        for key, value in table.items():
            flat[f"{section}.{key}"] = value
    for item in overrides:
        key, _, text = item.partition("=")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        if isinstance(DEFAULTS.get(key), str) and not isinstance(value, str):
            value = text
        flat[key] = value
    deck = dict(DEFAULTS)
    deck.update(flat)
    for key in ("model.kind", "data.kind", "optim.kind", "optim.schedule"):
        deck[key] = str(deck[key]).lower()
    for key in ("fsdp.sharding_strategy", "fsdp.auto_wrap_policy"):
        deck[key] = str(deck[key]).upper()
    for key, want in REQUIRED.items():
        if deck[key] != want:
            raise SystemExit(f"train_peer.py: {key} = {deck[key]!r} is not supported by the peer (only {want!r})")
    return deck


# ---------------------------------------------------------------------------------------------------
# std::mt19937_64 (the standard fixes its output), twisted with numpy, and app/data.cpp's integer-only
# sampling on top of it.
class MT19937_64:
    N, M = 312, 156
    MATRIX_A = np.uint64(0xB5026F5AA96619E9)
    UPPER, LOWER = np.uint64(0xFFFFFFFF80000000), np.uint64(0x7FFFFFFF)

    def __init__(self, seed):
        mask = (1 << 64) - 1
        mt = [seed & mask]
        for i in range(1, self.N):
            prev = mt[-1]
            mt.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & mask)
        self.mt = np.array(mt, dtype=np.uint64)
        self.out = []
        self.pos = 0

    def _twist(self):
        mt, n, m = self.mt, self.N, self.M
        one = np.uint64(1)

        def mix(cur, nxt, far):
            y = (cur & self.UPPER) | (nxt & self.LOWER)
            return far ^ (y >> one) ^ np.where((y & one) == one, self.MATRIX_A, np.uint64(0))

        mt[: n - m] = mix(mt[: n - m], mt[1 : n - m + 1], mt[m:n])  # reads old values only
        mt[n - m : n - 1] = mix(mt[n - m : n - 1], mt[n - m + 1 : n], mt[0 : m - 1])  # reads block 1's new values
        mt[n - 1 : n] = mix(mt[n - 1 : n], mt[0:1], mt[m - 1 : m])
        y = mt.copy()
        y ^= (y >> np.uint64(29)) & np.uint64(0x5555555555555555)
        y ^= (y << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
        y ^= (y << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
        y ^= y >> np.uint64(43)
        self.out = y.tolist()
        self.pos = 0

    def __call__(self):
        if self.pos >= self.N:
            self._twist()
        elif not self.out:
            self._twist()
        v = self.out[self.pos]
        self.pos += 1
        return v


def uniform_below(rng, bound):
    threshold = ((1 << 64) - bound) % bound  # 2^64 mod bound
    while True:
        r = rng()
        if r >= threshold:
            return r % bound


def random_permutation(n, seed):
    p = list(range(n))
    rng = MT19937_64(seed)
    for i in range(n - 1, 0, -1):
        j = uniform_below(rng, i + 1)
        p[i], p[j] = p[j], p[i]
    return p


SUCCESSOR_PERCENT = [50, 25, 10, 5]
DEFAULT_CHAIN_SEED = 0x5EEDC4A100000001


def synthetic_tokens(num_sequences, context, vocab, seed, chain_seed=DEFAULT_CHAIN_SEED):
    k = min(vocab, len(SUCCESSOR_PERCENT))
    pool = list(range(vocab))
    successors = [0] * (vocab * k)
    chain = MT19937_64(chain_seed)
    for v in range(vocab):
        for j in range(k):
            pick = j + uniform_below(chain, vocab - j)
            pool[j], pool[pick] = pool[pick], pool[j]
            successors[v * k + j] = pool[j]
    cum = np.cumsum(SUCCESSOR_PERCENT[:k]).tolist()
    length = context + 1
    out = np.empty(num_sequences * length, dtype=np.int32)
    rng = MT19937_64(seed)
    t = 0
    for _ in range(num_sequences):
        token = uniform_below(rng, vocab)
        out[t] = token
        t += 1
        for _ in range(1, length):
            r = uniform_below(rng, 100)
            j = 0
            while j < k and r >= cum[j]:
                j += 1
            token = successors[token * k + j] if j < k else uniform_below(rng, vocab)
            out[t] = token
            t += 1
    return out.reshape(num_sequences, length)


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    ndims = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * d : 8 + 4 * d], "big") for d in range(ndims)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndims).reshape(dims)


def load_images(folder, prefix):
    def find(stem):
        for name in (stem, stem + ".gz"):
            if os.path.exists(os.path.join(folder, name)):
                return os.path.join(folder, name)
        raise SystemExit(f"train_peer.py: {stem}[.gz] not found in {folder}")

    return read_idx(find(f"{prefix}-images-idx3-ubyte")), read_idx(find(f"{prefix}-labels-idx1-ubyte"))


class DistributedSampler:
    """app/data.cpp's DistributedSampler: rank r takes positions r, r+N, ... of the epoch's order."""

    def __init__(self, n, replicas, rank, shuffle, seed):
        self.n, self.replicas, self.rank, self.shuffle, self.seed = n, replicas, rank, shuffle, seed

    def num_samples(self):
        return (self.n + self.replicas - 1) // self.replicas

    def indices(self, epoch):
        order = random_permutation(self.n, (self.seed + epoch) % (1 << 64)) if self.shuffle else list(range(self.n))
        total = self.num_samples() * self.replicas
        return [order[pos % self.n] for pos in range(self.rank, total, self.replicas)]


# ---------------------------------------------------------------------------------------------------
# Models: app/models.hpp in Python, same modules in the same order.
def build_model(deck, torch):
    nn, F = torch.nn, torch.nn.functional
    kind = deck["model.kind"]
    dropout = deck["model.dropout"]

    class TutorialCnn(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 32, 3, 1)
            self.conv2 = nn.Conv2d(32, 64, 3, 1)
            self.dropout1 = nn.Dropout(0.25 if dropout is None else dropout)
            self.dropout2 = nn.Dropout(0.5 if dropout is None else dropout)
            self.fc1 = nn.Linear(9216, 128)
            self.fc2 = nn.Linear(128, 10)

        def forward(self, x):
            x = torch.relu(self.conv1(x))
            x = torch.relu(self.conv2(x))
            x = self.dropout1(F.max_pool2d(x, 2))
            x = torch.relu(self.fc1(x.flatten(1)))
            x = self.fc2(self.dropout2(x))
            return F.log_softmax(x, 1)

    class Mlp(nn.Module):
        def __init__(self, hidden):
            super().__init__()
            self.p = 0.0 if dropout is None else dropout
            widths = [784] + list(hidden)
            self.n_hidden = len(hidden)
            for i in range(len(hidden)):
                setattr(self, f"fc{i + 1}", nn.Linear(widths[i], widths[i + 1]))
            self.out = nn.Linear(widths[-1], 10)

        def forward(self, x):
            x = x.flatten(1)
            for i in range(self.n_hidden):  # by attribute: an FSDP wrapper replaces the attribute
                x = torch.relu(getattr(self, f"fc{i + 1}")(x))
                if self.p > 0:
                    x = F.dropout(x, self.p, self.training)
            return F.log_softmax(self.out(x), 1)

    d, heads, ctx, vocab = deck["model.d_model"], deck["model.n_heads"], deck["model.context"], deck["model.vocab_size"]
    p = 0.1 if dropout is None else dropout

    def init_normal(module, keep):
        """Weights N(0, 0.02), biases zero; the parameters `keep` names (the norms) as they are."""
        with torch.no_grad():
            for name, prm in module.named_parameters():
                if keep(name):
                    continue
                if name.endswith("bias"):
                    prm.zero_()
                else:
                    prm.normal_(0, 0.02)

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.register_buffer("mask", torch.ones(ctx, ctx).tril().view(1, 1, ctx, ctx))

        def forward(self, x):
            b, t, dd = x.shape
            hd = dd // heads
            q, k, v = (y.view(b, t, heads, hd).transpose(1, 2) for y in self.qkv(x).split(dd, 2))
            att = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(hd)
            att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
            att = F.dropout(torch.softmax(att, -1), p, self.training)
            y = torch.matmul(att, v).transpose(1, 2).contiguous().view(b, t, dd)
            return F.dropout(self.proj(y), p, self.training)

    class TransformerBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = CausalSelfAttention()
            self.ln2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, deck["model.mlp_ratio"] * d)
            self.out = nn.Linear(deck["model.mlp_ratio"] * d, d)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            h = self.out(F.gelu(self.fc(self.ln2(x))))
            return x + F.dropout(h, p, self.training)

    class LmHead(nn.Module):
        def __init__(self, tied):
            super().__init__()
            self.weight = tied if tied is not None else nn.Parameter(torch.empty(vocab, d))

        def forward(self, x):
            return F.linear(x, self.weight)

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            if d % heads:
                raise SystemExit("model.d_model must be divisible by model.n_heads")
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(ctx, d)
            self.n_layers = deck["model.n_layers"]
            for i in range(self.n_layers):
                setattr(self, f"block{i}", TransformerBlock())
            self.ln_f = nn.LayerNorm(d)
            self.head = LmHead(self.tok.weight if deck["model.tie_embeddings"] else None)
            init_normal(self, keep=lambda name: "ln" in name)  # GPT-2 initialization, as GptImpl

        def forward(self, idx):
            t = idx.size(1)
            x = self.tok(idx) + self.pos(torch.arange(t, dtype=torch.long)).unsqueeze(0)
            x = F.dropout(x, p, self.training)
            for i in range(self.n_layers):  # by attribute: an FSDP wrapper replaces the attribute
                x = getattr(self, f"block{i}")(x)
            return self.head(self.ln_f(x))

    n_kv = deck["model.n_kv_heads"] or heads
    hd = deck["model.head_dim"] or d // heads
    inter = deck["model.intermediate_size"] or deck["model.mlp_ratio"] * d
    eps, theta, qkv_bias = deck["model.norm_eps"], deck["model.rope_theta"], bool(deck["model.attention_bias"])

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            xf = x.float()
            return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def rotate_half(x):
        half = x.size(-1) // 2
        return torch.cat([-x[..., half:], x[..., :half]], -1)

    class LlamaAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(d, heads * hd, bias=qkv_bias)
            self.k_proj = nn.Linear(d, n_kv * hd, bias=qkv_bias)
            self.v_proj = nn.Linear(d, n_kv * hd, bias=qkv_bias)
            self.o_proj = nn.Linear(heads * hd, d, bias=False)
            inv_freq = 1.0 / torch.pow(torch.tensor(theta, dtype=torch.float32), torch.arange(0, hd, 2).float() / hd)
            angles = torch.outer(torch.arange(ctx, dtype=torch.float32), inv_freq)
            angles = torch.cat([angles, angles], -1)
            self.cos, self.sin = angles.cos(), angles.sin()
            self.blocked = torch.ones(ctx, ctx, dtype=torch.bool).triu(1)

        def forward(self, x):
            b, t, _ = x.shape
            q = self.q_proj(x).view(b, t, heads, hd).transpose(1, 2)
            k = self.k_proj(x).view(b, t, n_kv, hd).transpose(1, 2)
            v = self.v_proj(x).view(b, t, n_kv, hd).transpose(1, 2)
            cos, sin = self.cos[:t], self.sin[:t]
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if n_kv != heads:
                k = k.repeat_interleave(heads // n_kv, 1)
                v = v.repeat_interleave(heads // n_kv, 1)
            att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            att = torch.softmax(att.masked_fill(self.blocked[:t, :t], float("-inf")), -1, dtype=torch.float32).to(q.dtype)
            return self.o_proj(torch.matmul(att, v).transpose(1, 2).reshape(b, t, heads * hd))

    class LlamaMlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(d, inter, bias=False)
            self.up_proj = nn.Linear(d, inter, bias=False)
            self.down_proj = nn.Linear(inter, d, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class LlamaDecoderLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = RMSNorm()
            self.self_attn = LlamaAttention()
            self.post_attention_layernorm = RMSNorm()
            self.mlp = LlamaMlp()

        def forward(self, x):
            x = x + self.self_attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, d)
            self.n_layers = deck["model.n_layers"]
            for i in range(self.n_layers):
                setattr(self, f"layer{i}", LlamaDecoderLayer())
            self.norm = RMSNorm()
            self.head = LmHead(self.embed_tokens.weight if deck["model.tie_embeddings"] else None)
            init_normal(self, keep=lambda name: name.endswith("norm.weight"))  # Hugging Face's, as app/models/llama.hpp's

        def forward(self, idx):
            x = self.embed_tokens(idx)
            for i in range(self.n_layers):  # by attribute: an FSDP wrapper replaces the attribute
                x = getattr(self, f"layer{i}")(x)
            return self.head(self.norm(x))

    if kind == "cnn":
        return TutorialCnn(), None
    if kind == "llama":
        return Llama(), LlamaDecoderLayer
    if kind == "mlp":
        return Mlp(deck["model.hidden_sizes"]), None
    return Gpt(), TransformerBlock


def fsdp_unit_numels(net, deck):
    """Parameter counts of the FSDP units fsdp-train forms from the deck's wrap policy (root last):
    NO_WRAP one unit; TRANSFORMER_BASED_WRAP the modules of the named classes; SIZE_BASED_WRAP every
    non-root module holding at least fsdp.min_num_params parameters not already in a nested unit.
    Shared (tied) parameters count once, in the first unit that reaches them."""
    seen = set()

    def own(module):
        n = 0
        for prm in module.parameters(recurse=False):
            if id(prm) not in seen:
                seen.add(id(prm))
                n += prm.numel()
        return n

    units = []
    policy = deck["fsdp.auto_wrap_policy"]
    names = {n.strip() for n in str(deck["fsdp.transformer_layer_cls_to_wrap"]).split(",") if n.strip()}

    def visit(module, is_root):  # returns the parameters left for the enclosing unit
        if policy == "TRANSFORMER_BASED_WRAP" and not is_root and type(module).__name__ in names:
            units.append(own(module) + sum(visit(c, True) for c in module.children()))  # all of it is this unit
            return 0
        rest = own(module) + sum(visit(c, False) for c in module.children())
        if policy == "SIZE_BASED_WRAP" and not is_root and rest >= deck["fsdp.min_num_params"]:
            units.append(rest)
            return 0
        return rest

    root = visit(net, True)
    return units + [root]


def lr_at(deck, step, epoch, total_steps):
    """fsdp-train's lr_at: linear warmup, then constant / step (gamma^epoch) / cosine to 0."""
    base, warmup = deck["optim.lr"], deck["optim.warmup_steps"]
    if step < warmup:
        return base * (step + 1) / warmup
    schedule = deck["optim.schedule"]
    if schedule == "step":
        return base * deck["optim.gamma"] ** epoch
    if schedule == "cosine":
        span = max(1, total_steps - warmup - 1)
        return base * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / span)))
    return base


def build_optimizer(deck, params, torch):
    kind, lr, wd = deck["optim.kind"], deck["optim.lr"], deck["optim.weight_decay"]
    betas = tuple(deck["optim.betas"])
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=deck["optim.momentum"], weight_decay=wd)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, betas=betas, weight_decay=wd)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=wd)
    return torch.optim.Adadelta(params, lr=lr, weight_decay=wd)


# ---------------------------------------------------------------------------------------------------
# PyTorch FSDP on CPU: in-process patches (tried for `make bench`; see docs/performance.md).
def fsdp_cpu_patches(torch):
    """Makes torch 1.13's FullyShardedDataParallel importable and runnable on a CPU-only build with gloo.
    Returns a list of what was patched. Raises whatever the next obstacle is."""
    import contextlib
    import dataclasses

    done = []
    # 1. Python 3.11 refuses a dataclass instance as a field default unless its class is hashable:
    #    torch/distributed/_shard/sharded_tensor/metadata.py has `tensor_properties: TensorProperties =
    #    TensorProperties(...)`. Decorate TensorProperties with unsafe_hash=True while it is imported.
    original = dataclasses.dataclass

    def patched(cls=None, /, **kw):
        def wrap(c):
            if c.__name__ == "TensorProperties" and c.__module__.startswith("torch.distributed._shard"):
                kw2 = dict(kw, unsafe_hash=True)
                return original(**kw2)(c)
            return original(**kw)(c)

        return wrap if cls is None else wrap(cls)

    dataclasses.dataclass = patched
    try:
        import torch.distributed.fsdp  # noqa: F401
    finally:
        dataclasses.dataclass = original
    done.append("dataclass TensorProperties made hashable during import (Python 3.11)")

    # 2. CUDA streams and events: FSDP 1.13 creates streams in _lazy_init and orders work with
    #    wait_stream / record_stream / events. On CPU everything runs in program order: no-ops.
    class FakeStream:
        def wait_stream(self, other):
            pass

        def synchronize(self):
            pass

        def wait_event(self, event):
            pass

        def record_event(self, event=None):
            return FakeEvent()

    class FakeEvent:
        def __init__(self, *a, **k):
            pass

        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        def query(self):
            return True

        def wait(self, stream=None):
            pass

    torch.cuda.Stream = FakeStream
    torch.cuda.Event = FakeEvent
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.cuda.current_stream = lambda device=None: FakeStream()
    torch.cuda.synchronize = lambda device=None: None
    torch.Tensor.record_stream = lambda self, stream: None
    # clip_grad_norm_ moves the local norm with .cuda(): on this CPU-only build that only raises.
    torch.Tensor.cuda = lambda self, *a, **k: self
    done.append("torch.cuda Stream/Event/stream/current_stream/synchronize, Tensor.record_stream and Tensor.cuda replaced by no-ops")

    fsdp_mod = sys.modules["torch.distributed.fsdp.fully_sharded_data_parallel"]
    # _init_streams asserts torch.cuda.is_available(): replace it.
    def _init_streams(self):
        self._streams["all_gather"] = FakeStream()
        self._streams["post_backward"] = FakeStream()
        self._streams["pre_all_gather"] = FakeStream()

    FSDP = fsdp_mod.FullyShardedDataParallel
    FSDP._init_streams = _init_streams
    # The compute device is always "cuda:<current>" in 1.13: make it the CPU.
    FSDP._get_compute_device = lambda self, module, ignored_params, device_from_device_id: torch.device("cpu")
    # _lazy_init refuses to run without CUDA ("FSDP does not support CPU only execution"): let it
    # believe CUDA is there while it runs.
    original_lazy_init = FSDP._lazy_init

    def _lazy_init(self):
        saved = torch.cuda.is_available
        torch.cuda.is_available = lambda: True
        try:
            return original_lazy_init(self)
        finally:
            torch.cuda.is_available = saved

    FSDP._lazy_init = _lazy_init
    done.append("FullyShardedDataParallel: compute device cpu, _init_streams and _lazy_init without the CUDA checks")

    # 3. gloo has neither _all_gather_base nor reduce_scatter: emulate both with what it has.
    import torch.distributed as dist

    def all_gather_base(output, inp, group=None, async_op=False):
        chunks = list(output.chunk(dist.get_world_size(group)))
        dist.all_gather(chunks, inp.contiguous(), group=group)
        return None

    def reduce_scatter_base(output, inp, op=dist.ReduceOp.SUM, group=None, async_op=False):
        buf = inp.clone()
        dist.all_reduce(buf, op=op, group=group)
        output.copy_(buf.chunk(dist.get_world_size(group))[dist.get_rank(group)])
        return None

    for mod in (dist, fsdp_mod, sys.modules.get("torch.distributed.fsdp.flat_param"), sys.modules.get("torch.distributed.fsdp._utils")):
        if mod is None:
            continue
        if hasattr(mod, "_all_gather_base") or mod is dist:
            mod._all_gather_base = all_gather_base
        if hasattr(mod, "_reduce_scatter_base") or mod is dist:
            mod._reduce_scatter_base = reduce_scatter_base
    done.append("dist._all_gather_base -> all_gather into chunks; dist._reduce_scatter_base -> all_reduce + slice (gloo lacks both)")
    return done


# ---------------------------------------------------------------------------------------------------
# The GEMM probe of app/train/gemm_probe.hpp, on this side: the same rule, products and timing.
PROBE_MAX_DIM, PROBE_SHAPES, PROBE_FIXED = 1024, 4, ("fixed", 512, 512, 512)


def model_gemm_shapes(net, rows, torch):
    """The forward products (rows, inner, cols) of the model's linear layers and LM head, each dimension capped
    at PROBE_MAX_DIM, distinct shapes, those doing the most FLOPs per step first (the first PROBE_SHAPES)."""
    uses = []
    for name, mod in net.named_modules():
        w = getattr(mod, "weight", None)
        if not (isinstance(mod, torch.nn.Linear) or type(mod).__name__ == "LmHead") or w is None or w.dim() != 2:
            continue
        cols, inner = w.shape
        shape = (min(rows, PROBE_MAX_DIM), min(inner, PROBE_MAX_DIM), min(cols, PROBE_MAX_DIM))
        full = 2.0 * rows * inner * cols
        use = next((u for u in uses if u[1] == shape), None)
        if use:
            use[2] += full
        else:
            uses.append([name, shape, full])
    uses.sort(key=lambda u: -u[2])  # stable, as std::stable_sort
    return [(u[0],) + u[1] for u in uses[:PROBE_SHAPES]]


def openblas_thread_calls():
    """OpenBLAS's thread setter and getter in this process (torch.set_num_threads does not reach them)."""
    import ctypes
    for path in blas_in_process():
        if "openblas" in os.path.basename(path):
            lib = ctypes.CDLL(path)
            return lib.openblas_set_num_threads, lib.openblas_get_num_threads
    return None, None


def gemm_probe(model_shapes, torch):
    """One thread (LibTorch's and OpenBLAS's): each product as F.linear runs it, one warm-up, then repetitions
    until 30 ms and 3 of them; the best one counts. The peak is the best of the model's products."""
    set_blas, get_blas = openblas_thread_calls()
    threads, blas = torch.get_num_threads(), get_blas() if get_blas else None
    torch.set_num_threads(1)
    if set_blas:
        set_blas(1)

    def time_linear(shape):
        name, r, k, c = shape
        with torch.no_grad():
            x, w = torch.full((r, k), 0.5), torch.full((c, k), 0.25)
            torch.nn.functional.linear(x, w)
            best, spent, reps = float("inf"), 0.0, 0
            while reps < 3 or spent < 0.03:
                t0 = time.perf_counter()
                torch.nn.functional.linear(x, w)
                dt = time.perf_counter() - t0
                best, spent, reps = min(best, dt), spent + dt, reps + 1
        return {"name": name, "rows": r, "inner": k, "cols": c, "gflops_per_thread": 2.0 * r * k * c / best / 1e9}
    try:
        fixed = time_linear(PROBE_FIXED)
        shapes = [time_linear(s) for s in model_shapes]
    finally:
        torch.set_num_threads(threads)
        if set_blas and blas:
            set_blas(blas)
    peak = max([s["gflops_per_thread"] for s in shapes] or [fixed["gflops_per_thread"]])
    return {"threads": 1, "peak_gflops_per_thread": peak, "fixed": fixed, "shapes": shapes}


def blas_in_process():
    libs = set()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if "blas" in path or "lapack" in path:
                libs.add(os.path.realpath(path))
    return sorted(libs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("deck")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--wrapper", choices=["ddp", "fsdp", "none"], default="ddp")
    ap.add_argument("--init-file", default="")
    args = ap.parse_args()
    deck = load_deck(args.deck, args.overrides)

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    local_size = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", str(size)))

    import torch
    import torch.distributed as dist

    patches = []
    if args.wrapper == "fsdp":
        patches = fsdp_cpu_patches(torch)

    os.makedirs(args.out_dir, exist_ok=True)
    init_file = os.path.abspath(args.init_file or os.path.join(args.out_dir, "gloo_rendezvous"))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    threads = deck["run.threads"] or max(1, (os.cpu_count() or 1) // local_size)
    torch.set_num_threads(threads)
    seed = deck["run.seed"]
    torch.manual_seed(seed)

    # Data, as fsdp-train's load_dataset / make_batch.
    kind = deck["data.kind"]
    t_data = time.perf_counter()
    if kind in ("fashion-mnist", "mnist"):
        images, labels = load_images(deck["data.path"], "train")
        test_images, test_labels = load_images(deck["data.path"], "t10k")  # held like fsdp-train does (memory)
        mean, std = (0.1307, 0.3081) if kind == "mnist" else (0.2860, 0.3530)
        scale, shift = np.float32(1.0 / (255.0 * std)), np.float32(mean / std)
        n_train = images.shape[0]
        tokens = None
    elif kind == "tokens":
        n_train = deck["data.num_samples"]
        tokens = synthetic_tokens(n_train, deck["model.context"], deck["model.vocab_size"], seed)
    else:
        raise SystemExit(f"train_peer.py: data.kind = {kind!r} is not supported by the peer")
    if deck["data.train_samples"] > 0:
        n_train = min(n_train, deck["data.train_samples"])
    t_data = time.perf_counter() - t_data

    def make_batch(idx):
        if tokens is None:
            x = torch.from_numpy(images[idx].astype(np.float32) * scale - shift).unsqueeze(1)
            y = torch.from_numpy(labels[idx].astype(np.int64))
            return x, y
        seqs = torch.from_numpy(tokens[idx].astype(np.int64))
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()

    def loss_of(out, y):
        if tokens is None:
            return torch.nn.functional.nll_loss(out, y)
        return torch.nn.functional.nll_loss(torch.log_softmax(out.reshape(-1, out.size(-1)), 1), y.reshape(-1))

    net, block_cls = build_model(deck, torch)
    probe_shapes = model_gemm_shapes(net, deck["data.batch_size"] * (deck["model.context"] if tokens is not None else 1), torch)  # before any wrapper
    params = sum(p.numel() for p in net.parameters())
    units = fsdp_unit_numels(net, deck)
    assert sum(units) == params, (units, params)
    strategy = "DDP"
    allreduce_span = [None, None]  # this step's first bucket launch and last completion
    if args.wrapper == "none":
        if size != 1:
            raise SystemExit("train_peer.py: --wrapper none runs one process (plain PyTorch), not %d" % size)
        model = net
        strategy = "plain PyTorch (no wrapper)"
    elif args.wrapper == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(net, broadcast_buffers=False)
        if size > 1:
            def timed_allreduce(state, bucket):  # DDP's default: the bucket summed over ranks, divided by the world size
                if allreduce_span[0] is None:
                    allreduce_span[0] = time.perf_counter()
                fut = dist.all_reduce(bucket.buffer().div_(size), async_op=True).get_future()

                def done(f):
                    allreduce_span[1] = time.perf_counter()
                    return f.value()[0]
                return fut.then(done)
            model.register_comm_hook(None, timed_allreduce)
    else:
        import functools
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

        policy = None
        if deck["fsdp.auto_wrap_policy"] == "SIZE_BASED_WRAP":
            policy = functools.partial(size_based_auto_wrap_policy, min_num_params=deck["fsdp.min_num_params"])
        elif deck["fsdp.auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP" and block_cls is not None:
            policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block_cls})
        strategy = deck["fsdp.sharding_strategy"]
        model = FSDP(net, sharding_strategy=getattr(ShardingStrategy, strategy), auto_wrap_policy=policy, device_id=None)
        strategy = "torch FSDP " + strategy
    optimizer = build_optimizer(deck, model.parameters(), torch)
    clip = deck["optim.clip_grad_norm"]

    batch = deck["data.batch_size"]
    # Before training, on rank 0 while the others wait (fsdp-train probes on each node's first rank).
    probe = gemm_probe(probe_shapes, torch) if rank == 0 else None
    dist.barrier()
    sampler = DistributedSampler(n_train, size, rank, deck["data.shuffle"], seed)
    steps_per_epoch = (sampler.num_samples() + batch - 1) // batch
    total_steps = steps_per_epoch * deck["run.epochs"]
    if deck["run.max_steps"] > 0:
        total_steps = min(total_steps, deck["run.max_steps"])
    if rank == 0:
        print(f"train_peer.py: {strategy}, {size} rank(s) x {threads} thread(s), torch {torch.__version__}, "
              f"model {deck['model.kind']} with {params} parameters, data {kind} ({n_train} train samples, loaded in {t_data:.2f} s), "
              f"batch {batch} per rank, {total_steps} steps ({args.warmup} warm-up), optimizer {deck['optim.kind']}", flush=True)
        for p in patches:
            print(f"  patch: {p}", flush=True)

    model.train()
    step_ms, losses = [], []
    phases_ms = {k: [] for k in ("forward", "backward", "optimizer", "all_reduce")}
    minor_faults = []
    step = 0
    train_start = time.perf_counter()
    for epoch in range(deck["run.epochs"]):
        if step >= total_steps:
            break
        idx = sampler.indices(epoch)
        for k in range(steps_per_epoch):
            if step >= total_steps:
                break
            t0 = time.perf_counter()
            lr = lr_at(deck, step, epoch, total_steps)
            for g in optimizer.param_groups:
                g["lr"] = lr
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            allreduce_span[:] = [None, None]
            optimizer.zero_grad()
            x, y = make_batch(idx[k * batch : (k + 1) * batch])
            t_fwd = time.perf_counter()
            loss = loss_of(model(x), y)
            t_bwd = time.perf_counter()
            loss.backward()
            losses.append(loss.item())
            t_opt = time.perf_counter()
            if clip > 0:
                if args.wrapper == "fsdp":
                    model.clip_grad_norm_(clip)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            step += 1
            t_end = time.perf_counter()
            step_ms.append(1000 * (t_end - t0))
            phases_ms["forward"].append(1000 * (t_bwd - t_fwd))
            phases_ms["backward"].append(1000 * (t_opt - t_bwd))
            phases_ms["optimizer"].append(1000 * (t_end - t_opt))
            # The buckets run one after another on gloo's thread: the span from the first launch to the last completion.
            phases_ms["all_reduce"].append(1000 * (allreduce_span[1] - allreduce_span[0]) if allreduce_span[1] is not None else 0.0)
            minor_faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0)
    train_s = time.perf_counter() - train_start

    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    all_rss = [torch.zeros(1, dtype=torch.float64) for _ in range(size)]
    dist.all_gather(all_rss, rss)
    last = torch.tensor([statistics.mean(losses[-10:]) if losses else float("nan")], dtype=torch.float64)
    dist.all_reduce(last)
    if rank == 0:
        measured = step_ms[args.warmup :] if len(step_ms) > args.warmup else step_ms
        global_batch = batch * size
        per_s = global_batch * len(measured) / (sum(measured) / 1000.0)
        summary = {
            "name": deck["run.name"], "tool": "train_peer.py", "wrapper": args.wrapper, "world_size": size, "threads_per_rank": threads,
            "strategy": strategy, "params": params, "steps": step, "warmup_steps": min(args.warmup, len(step_ms)),
            "final_train_loss": last.item() / size, "train_s": train_s,
            "step_ms_median": statistics.median(measured), "step_ms": step_ms,
            "samples_per_s": per_s, "peak_rss_mb": [r.item() for r in all_rss],
            "torch_version": torch.__version__, "python": sys.version.split()[0], "blas": blas_in_process(),
            "torch_threads": torch.get_num_threads(), "patches": patches, "losses": losses,
            "unit_numels": units, "global_batch": global_batch, "phases_ms": phases_ms, "minor_faults": minor_faults,
            "gemm_probe": probe,
        }
        if tokens is not None:
            summary["tokens_per_s"] = per_s * deck["model.context"]
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(f"train_peer.py: {step} steps, median step {summary['step_ms_median']:.1f} ms (after {summary['warmup_steps']} warm-up), "
              f"{per_s:.0f} samples/s, peak RSS per rank (MiB): {' '.join(f'{r:.0f}' for r in summary['peak_rss_mb'])}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0 and os.path.exists(init_file):
        try:
            os.remove(init_file)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
