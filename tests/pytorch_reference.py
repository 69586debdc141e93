#!/usr/bin/env python3
"""A PyTorch reference for fsdp-train's GPT: GPT-2 built from torch.nn with Hugging Face's parameter
names and layouts (Conv1D weights stored [in, out], lm_head tied to wte), trained single-process on
the whole global batch exactly as fsdp-train defines its data, loss, optimizer and schedule. Reads and
writes safetensors with json + struct (no safetensors package, no transformers).

  pytorch_reference.py init OUT --vocab V --context T --d-model D --heads H --layers L [--seed S]
  pytorch_reference.py train --init F --data GLOB --out F --losses JSON [model and recipe options]
  pytorch_reference.py eval --model F --data GLOB [model options] [--batch B]   -> prints the loss
  pytorch_reference.py compare A B [--rtol R]   -> whole-model relative error; exit 1 above R
"""
import argparse, glob, json, math, os, struct, sys

import torch
import torch.nn.functional as F

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_safetensors(path):
    """A .safetensors file, or a Hugging Face folder or index: model.safetensors first, else
    model.safetensors.index.json, whose weight_map places each tensor in a file (checked, with its
    metadata's total_size)."""
    if os.path.isdir(path):
        single = os.path.join(path, "model.safetensors")
        path = single if os.path.exists(single) else os.path.join(path, "model.safetensors.index.json")
    if path.endswith(".index.json"):
        with open(path) as f:
            index = json.load(f)
        out, total = {}, 0
        for file in sorted(set(index["weight_map"].values())):
            part = read_one_safetensors(os.path.join(os.path.dirname(path), file))
            for name, t in part.items():
                if index["weight_map"].get(name) != file:
                    sys.exit("%s: tensor %s is in %s, the index says %s" % (path, name, file, index["weight_map"].get(name)))
            total += read_one_safetensors.data_bytes
            out.update(part)
        if set(out) != set(index["weight_map"]):
            sys.exit("%s: the files do not hold %s" % (path, sorted(set(index["weight_map"]) - set(out))))
        if index.get("metadata", {}).get("total_size", total) != total:
            sys.exit("%s: metadata total_size %s, the files hold %d bytes of tensors" % (path, index["metadata"]["total_size"], total))
        return out
    return read_one_safetensors(path)


def read_one_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        t = torch.frombuffer(bytearray(data[begin:end]), dtype=DTYPES[e["dtype"]]) if end > begin else torch.empty(0)
        out[name] = t.reshape(e["shape"]).float().clone()
    read_one_safetensors.data_bytes = len(data)
    return out


def write_safetensors(path, tensors, dtype="F32"):
    """F32, or BF16 as Hugging Face's checkpoints store it."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().float()
        b = t.numpy().tobytes() if dtype == "F32" else t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    text = json.dumps(header).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


# ---- token data, as fsdp-train reads it (llm.c shards, concatenated in name order) -----------------

def read_tokens(pattern):
    files = sorted(glob.glob(pattern))
    if not files:
        sys.exit("no files match " + pattern)
    tokens = []
    for path in files:
        with open(path, "rb") as f:
            raw = f.read()
        magic, version, count = struct.unpack("<3i", raw[:12])
        width = {20240520: 2, 20240801: 4}[magic]
        tokens += list(struct.unpack("<%d%s" % (count, "H" if width == 2 else "I"), raw[1024:1024 + count * width]))
    return torch.tensor(tokens, dtype=torch.long)


def sample(tokens, i, context):
    """Sample i of the stream: tokens [i*T, i*T + T]; inputs the first T, targets the last T."""
    s = tokens[i * context:i * context + context + 1]
    return s[:-1], s[1:]


# ---- the model ------------------------------------------------------------------------------------

class GPT2(torch.nn.Module):
    """GPT-2 with Hugging Face's names: transformer.{wte,wpe,h.{i}.{ln_1,attn.c_attn,attn.c_proj,ln_2,
    mlp.c_fc,mlp.c_proj},ln_f}; Conv1D weights are [in, out] (y = x @ W + b); lm_head is wte."""

    def __init__(self, vocab, context, d, heads, layers, mlp_ratio=4, gelu="tanh"):
        super().__init__()
        self.vocab, self.context, self.d, self.heads, self.layers, self.gelu = vocab, context, d, heads, layers, gelu
        p = {"transformer.wte.weight": (vocab, d), "transformer.wpe.weight": (context, d),
             "transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}
        for i in range(layers):
            h = "transformer.h.%d." % i
            p.update({h + "ln_1.weight": (d,), h + "ln_1.bias": (d,), h + "attn.c_attn.weight": (d, 3 * d), h + "attn.c_attn.bias": (3 * d,),
                      h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,), h + "ln_2.weight": (d,), h + "ln_2.bias": (d,),
                      h + "mlp.c_fc.weight": (d, mlp_ratio * d), h + "mlp.c_fc.bias": (mlp_ratio * d,),
                      h + "mlp.c_proj.weight": (mlp_ratio * d, d), h + "mlp.c_proj.bias": (d,)})
        self.shapes = p
        self.params = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(torch.zeros(s)) for k, s in p.items()})
        self.register_buffer("mask", torch.ones(context, context).tril().view(1, 1, context, context))

    def __getitem__(self, name):
        return self.params[name.replace(".", "__")]

    def named(self):
        return {k: self[k] for k in self.shapes}

    def load(self, tensors):
        with torch.no_grad():
            for k in self.shapes:
                if tuple(tensors[k].shape) != self.shapes[k]:
                    sys.exit("%s: shape %s, expected %s" % (k, tuple(tensors[k].shape), self.shapes[k]))
                self[k].copy_(tensors[k])
            unexpected = set(tensors) - set(self.shapes)
            if unexpected:
                sys.exit("unexpected tensors: %s" % sorted(unexpected))

    def forward(self, idx):
        b, t = idx.shape
        x = F.embedding(idx, self["transformer.wte.weight"]) + F.embedding(torch.arange(t), self["transformer.wpe.weight"]).unsqueeze(0)
        hd = self.d // self.heads
        for i in range(self.layers):
            h = "transformer.h.%d." % i
            a = F.layer_norm(x, (self.d,), self[h + "ln_1.weight"], self[h + "ln_1.bias"], 1e-5)
            q, k, v = (a @ self[h + "attn.c_attn.weight"] + self[h + "attn.c_attn.bias"]).split(self.d, 2)
            q, k, v = (y.view(b, t, self.heads, hd).transpose(1, 2) for y in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
            att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf")).softmax(-1)
            y = (att @ v).transpose(1, 2).contiguous().view(b, t, self.d)
            x = x + (y @ self[h + "attn.c_proj.weight"] + self[h + "attn.c_proj.bias"])
            m = F.layer_norm(x, (self.d,), self[h + "ln_2.weight"], self[h + "ln_2.bias"], 1e-5)
            m = F.gelu(m @ self[h + "mlp.c_fc.weight"] + self[h + "mlp.c_fc.bias"], approximate=self.gelu)
            x = x + (m @ self[h + "mlp.c_proj.weight"] + self[h + "mlp.c_proj.bias"])
        x = F.layer_norm(x, (self.d,), self["transformer.ln_f.weight"], self["transformer.ln_f.bias"], 1e-5)
        return x @ self["transformer.wte.weight"].t()


def model_of(a):
    return GPT2(a.vocab, a.context, a.d_model, a.heads, a.layers, gelu="tanh" if a.activation == "gelu_tanh" else "none")


def loss_of(logits, targets):
    """fsdp-train's loss: log-softmax then the mean negative log-likelihood of every target."""
    return F.nll_loss(F.log_softmax(logits.reshape(-1, logits.size(-1)), 1), targets.reshape(-1))


def lr_at(a, step, total):
    """app/train/schedule.hpp's lr_at: linear warmup, then cosine from lr down to lr_min at the last step."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    span = max(1, total - a.warmup - 1)
    progress = min(1.0, (step - a.warmup) / span)
    return a.lr_min + (a.lr - a.lr_min) * 0.5 * (1 + math.cos(math.pi * progress))


# ---- subcommands ----------------------------------------------------------------------------------

def cmd_init(a):
    torch.manual_seed(a.seed)
    m = model_of(a)
    with torch.no_grad():
        for k, p in m.named().items():
            if k.endswith("bias"):
                p.zero_()
            elif "ln_" in k:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    write_safetensors(a.out, m.named())


def cmd_train(a):
    torch.manual_seed(0)
    m = model_of(a)
    m.load(read_safetensors(a.init))
    # optim.no_decay = ["bias", "norm", "embedding"]: decay on the Conv1D (matrix) weights only.
    decay = [p for k, p in m.named().items() if k.endswith(".weight") and (".attn.c_" in k or ".mlp.c_" in k)]
    keep = [p for k, p in m.named().items() if not (k.endswith(".weight") and (".attn.c_" in k or ".mlp.c_" in k))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay}, {"params": keep, "weight_decay": 0.0}], lr=a.lr,
                            betas=(a.beta1, a.beta2), eps=1e-8, foreach=False)
    tokens = read_tokens(a.data)
    losses = []
    for step in range(a.steps):
        lr = lr_at(a, step, a.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        xs, ys = zip(*(sample(tokens, step * a.batch + j, a.context) for j in range(a.batch)))
        opt.zero_grad()
        loss = loss_of(m(torch.stack(xs)), torch.stack(ys))
        loss.backward()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(list(m.named().values()), a.clip)
        opt.step()
        losses.append(loss.item())
    write_safetensors(a.out, m.named())
    with open(a.losses, "w") as f:
        json.dump(losses, f)


def evaluate(m, a):
    """Prints the validation loss of model `m` over every whole sequence of a.data, a.batch at a time."""
    tokens = read_tokens(a.data)
    n = (len(tokens) - 1) // a.context
    total, count = 0.0, 0
    with torch.no_grad():
        for first in range(0, n, a.batch):
            xs, ys = zip(*(sample(tokens, i, a.context) for i in range(first, min(n, first + a.batch))))
            logits = m(torch.stack(xs))
            y = torch.stack(ys)
            total += F.nll_loss(F.log_softmax(logits.reshape(-1, logits.size(-1)), 1), y.reshape(-1), reduction="sum").item()
            count += y.numel()
    print(json.dumps({"loss": total / count, "tokens": count}))


def cmd_eval(a):
    m = model_of(a)
    m.load(read_safetensors(a.model))
    evaluate(m, a)


def greedy(m, a):
    """Prints the a.new tokens argmax decoding adds to a.ids (recomputing every position each step)."""
    m.load(read_safetensors(a.model))
    seq = [int(t) for t in a.ids.replace(",", " ").split()]
    out = []
    with torch.no_grad():
        for _ in range(a.new):
            nxt = int(m(torch.tensor([seq]))[0, -1].argmax())
            seq.append(nxt)
            out.append(nxt)
    print(json.dumps({"ids": out}))


def cmd_compare(a):
    x, y = read_safetensors(a.a), read_safetensors(a.b)
    if set(x) != set(y):
        sys.exit("names differ: %s" % sorted(set(x) ^ set(y)))
    diff = sum(((x[k] - y[k]) ** 2).sum().item() for k in x)
    ref = sum((y[k] ** 2).sum().item() for k in y)
    err = math.sqrt(diff) / max(math.sqrt(ref), 1e-12)
    worst = max(x, key=lambda k: ((x[k] - y[k]).norm() / max(y[k].norm(), 1e-12)).item())
    print("relative error of the whole model %.3g (largest per tensor: %s %.3g)" %
          (err, worst, ((x[worst] - y[worst]).norm() / max(y[worst].norm(), 1e-12)).item()))
    return 0 if err <= a.rtol else 1


def add_subcommands(p, model_args, init_args=None):
    """init, train, eval and compare, with the model's options from `model_args` (shared with llama_reference.py)."""
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("init")
    s.add_argument("out")
    s.add_argument("--seed", type=int, default=1)
    if init_args:
        init_args(s)
    model_args(s)
    s = sub.add_parser("train")
    for k in ("--init", "--data", "--out", "--losses"):
        s.add_argument(k, required=True)
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--batch", type=int, default=12)
    s.add_argument("--lr", type=float, default=3e-3)
    s.add_argument("--lr-min", type=float, default=3e-4)
    s.add_argument("--warmup", type=int, default=4)
    s.add_argument("--weight-decay", type=float, default=0.1)
    s.add_argument("--beta1", type=float, default=0.9)
    s.add_argument("--beta2", type=float, default=0.95)
    s.add_argument("--clip", type=float, default=1.0)
    model_args(s)
    s = sub.add_parser("eval")
    s.add_argument("--model", required=True)
    s.add_argument("--data", required=True)
    s.add_argument("--batch", type=int, default=64)
    model_args(s)
    s = sub.add_parser("generate")
    s.add_argument("--model", required=True)
    s.add_argument("--ids", required=True, help="the prompt's token ids")
    s.add_argument("--new", type=int, default=8, help="tokens to add")
    model_args(s)
    s = sub.add_parser("compare")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--rtol", type=float, default=1e-5)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def model_args(s):
        s.add_argument("--vocab", type=int, default=97)
        s.add_argument("--context", type=int, default=16)
        s.add_argument("--d-model", type=int, default=32)
        s.add_argument("--heads", type=int, default=4)
        s.add_argument("--layers", type=int, default=2)
        s.add_argument("--activation", default="gelu_tanh", choices=["gelu", "gelu_tanh"])

    add_subcommands(p, model_args)
    a = p.parse_args()
    torch.set_num_threads(1)
    return {"init": cmd_init, "train": cmd_train, "eval": cmd_eval, "compare": cmd_compare,
            "generate": lambda a: greedy(model_of(a), a)}[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main())
