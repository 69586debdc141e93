#!/usr/bin/env python3
"""A PyTorch reference for fsdp-train's model.kind = "llama": a Llama-family decoder written with
torch.nn.functional and Hugging Face's LlamaForCausalLM parameter names (model.embed_tokens,
model.layers.{i}.self_attn.{q,k,v,o}_proj, model.layers.{i}.mlp.{gate,up,down}_proj,
model.layers.{i}.{input,post_attention}_layernorm, model.norm, lm_head absent when tied). Per layer:
RMSNorm in fp32, rotary positions in the rotate_half layout, grouped-query attention by repeating
k/v heads, SwiGLU. Trained single-process on the whole global batch as fsdp-train defines its data,
loss, optimizer (AdamW without decay on biases, norms and embeddings) and schedule; the data, loss,
schedule and safetensors helpers are pytorch_reference.py's.

  llama_reference.py init OUT [model options] [--seed S] [--bf16] [--shards N] [--hf-config]
  llama_reference.py train --init F --data GLOB --out F --losses JSON [model and recipe options]
  llama_reference.py eval --model F --data GLOB [model options] [--batch B]   -> prints the loss
"""
import argparse, json, math, os, sys

import torch
import torch.nn.functional as F

from pytorch_reference import add_subcommands, cmd_compare, evaluate, greedy, loss_of, lr_at, read_safetensors, read_tokens, sample, write_safetensors


def llama3_frequencies(inv_freq, a):
    """Llama 3.1's rope_scaling "llama3", frequency by frequency: a wavelength shorter than
    original / high_freq_factor is kept, one longer than original / low_freq_factor is slowed by the
    factor, and one between is interpolated linearly in original / wavelength between the two."""
    out = []
    for f in inv_freq.tolist():
        wavelength = 2 * math.pi / f
        if wavelength < a.rope_original / a.rope_high:
            out.append(f)
        elif wavelength > a.rope_original / a.rope_low:
            out.append(f / a.rope_factor)
        else:
            w = (a.rope_original / wavelength - a.rope_low) / (a.rope_high - a.rope_low)
            out.append((1 - w) * f / a.rope_factor + w * f)
    return torch.tensor(out, dtype=torch.float32)


def hf_config(a):
    """config.json of the model, as transformers writes it: Qwen2ForCausalLM with q/k/v biases, else
    LlamaForCausalLM."""
    c = {"architectures": ["Qwen2ForCausalLM" if a.bias else "LlamaForCausalLM"], "model_type": "qwen2" if a.bias else "llama",
         "vocab_size": a.vocab, "hidden_size": a.d_model, "intermediate_size": a.intermediate, "num_hidden_layers": a.layers,
         "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim, "hidden_act": "silu",
         "max_position_embeddings": a.max_positions, "rms_norm_eps": a.eps, "rope_theta": a.rope_theta, "rope_scaling": None,
         "tie_word_embeddings": a.tied, "attention_dropout": 0.0, "torch_dtype": "bfloat16" if getattr(a, "bf16", False) else "float32"}
    if not a.bias:
        c.update({"attention_bias": False, "mlp_bias": False})
    if a.rope_factor > 0:
        c["rope_scaling"] = {"rope_type": "llama3", "factor": a.rope_factor, "low_freq_factor": a.rope_low,
                             "high_freq_factor": a.rope_high, "original_max_position_embeddings": a.rope_original}
    return c


def from_hf_config(a):
    """--config: the model's sizes from a config.json, as from_pretrained builds the model from it."""
    with open(a.config) as f:
        c = json.load(f)
    arch = c["architectures"][0]
    if arch not in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
        sys.exit("%s: architecture %s" % (a.config, arch))
    a.vocab, a.d_model, a.layers, a.intermediate = c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    a.heads = c["num_attention_heads"]
    a.kv_heads = c.get("num_key_value_heads", a.heads)
    a.head_dim = c.get("head_dim", a.d_model // a.heads)
    a.eps, a.rope_theta = c.get("rms_norm_eps", 1e-6), c.get("rope_theta", 10000.0)
    a.tied = c.get("tie_word_embeddings", False)
    a.bias = arch == "Qwen2ForCausalLM"
    if c.get("attention_bias") or c.get("mlp_bias") or c.get("hidden_act", "silu") != "silu":
        sys.exit("%s: a layout this reference does not build" % a.config)
    scaling = c.get("rope_scaling")
    a.rope_factor = 0.0
    if scaling:
        if scaling.get("rope_type", scaling.get("type")) != "llama3":
            sys.exit("%s: rope_scaling %s" % (a.config, scaling))
        a.rope_factor, a.rope_low, a.rope_high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        a.rope_original = scaling["original_max_position_embeddings"]


class Llama(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        self.a = a
        d, q, kv, i = a.d_model, a.heads * a.head_dim, a.kv_heads * a.head_dim, a.intermediate
        p = {"model.embed_tokens.weight": (a.vocab, d), "model.norm.weight": (d,)}
        if not a.tied:
            p["lm_head.weight"] = (a.vocab, d)
        for n in range(a.layers):
            h = "model.layers.%d." % n
            p.update({h + "input_layernorm.weight": (d,), h + "post_attention_layernorm.weight": (d,),
                      h + "self_attn.q_proj.weight": (q, d), h + "self_attn.k_proj.weight": (kv, d),
                      h + "self_attn.v_proj.weight": (kv, d), h + "self_attn.o_proj.weight": (d, q),
                      h + "mlp.gate_proj.weight": (i, d), h + "mlp.up_proj.weight": (i, d), h + "mlp.down_proj.weight": (d, i)})
            if a.bias:
                p.update({h + "self_attn.q_proj.bias": (q,), h + "self_attn.k_proj.bias": (kv,), h + "self_attn.v_proj.bias": (kv,)})
        self.shapes = p
        self.params = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(torch.zeros(s)) for k, s in p.items()})

    def __getitem__(self, name):
        return self.params[name.replace(".", "__")]

    def named(self):
        return {k: self[k] for k in self.shapes}

    def load(self, tensors):
        with torch.no_grad():
            if set(tensors) != set(self.shapes):
                sys.exit("tensors differ from the model's: %s" % sorted(set(tensors) ^ set(self.shapes)))
            for k in self.shapes:
                if tuple(tensors[k].shape) != self.shapes[k]:
                    sys.exit("%s: shape %s, expected %s" % (k, tuple(tensors[k].shape), self.shapes[k]))
                self[k].copy_(tensors[k])

    def rms_norm(self, x, name):
        xf = x.float()
        return self[name] * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.a.eps)).to(x.dtype)

    def linear(self, x, name):
        bias = self.params[(name + ".bias").replace(".", "__")] if (name + ".bias") in self.shapes else None
        return F.linear(x, self[name + ".weight"], bias)

    def forward(self, idx):
        a = self.a
        b, t = idx.shape
        hd = a.head_dim
        inv_freq = 1.0 / torch.pow(torch.tensor(a.rope_theta, dtype=torch.float32), torch.arange(0, hd, 2).float() / hd)
        if a.rope_factor > 0:
            inv_freq = llama3_frequencies(inv_freq, a)
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq)
        angles = torch.cat([freqs, freqs], -1)
        cos, sin = angles.cos(), angles.sin()

        def rotate_half(x):
            return torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)

        blocked = torch.ones(t, t, dtype=torch.bool).triu(1)
        x = F.embedding(idx, self["model.embed_tokens.weight"])
        for n in range(a.layers):
            h = "model.layers.%d." % n
            y = self.rms_norm(x, h + "input_layernorm.weight")
            q = self.linear(y, h + "self_attn.q_proj").view(b, t, a.heads, hd).transpose(1, 2)
            k = self.linear(y, h + "self_attn.k_proj").view(b, t, a.kv_heads, hd).transpose(1, 2)
            v = self.linear(y, h + "self_attn.v_proj").view(b, t, a.kv_heads, hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k = k.repeat_interleave(a.heads // a.kv_heads, 1)
            v = v.repeat_interleave(a.heads // a.kv_heads, 1)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            att = att.masked_fill(blocked, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
            o = (att @ v).transpose(1, 2).reshape(b, t, a.heads * hd)
            x = x + self.linear(o, h + "self_attn.o_proj")
            y = self.rms_norm(x, h + "post_attention_layernorm.weight")
            x = x + self.linear(F.silu(self.linear(y, h + "mlp.gate_proj")) * self.linear(y, h + "mlp.up_proj"), h + "mlp.down_proj")
        x = self.rms_norm(x, "model.norm.weight")
        return F.linear(x, self["model.embed_tokens.weight" if a.tied else "lm_head.weight"])


def cmd_init(a):
    torch.manual_seed(a.seed)
    m = Llama(a)
    with torch.no_grad():
        for k, p in m.named().items():
            if k.endswith("norm.weight"):
                p.fill_(1.0)
            else:  # biases too: nonzero, so that their values matter from the first step
                p.normal_(0, 0.02)
    dtype = "BF16" if a.bf16 else "F32"
    if a.hf_config:  # a Hugging Face folder: config.json beside the weights
        folder = a.out if a.shards > 1 else os.path.dirname(a.out) or "."
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(hf_config(a), f, indent=2)
    if a.shards <= 1:
        write_safetensors(a.out, m.named(), dtype)
        return
    # Hugging Face's sharded layout: OUT is a folder of model-0000i-of-0000n.safetensors and an index.
    os.makedirs(a.out, exist_ok=True)
    names = sorted(m.named())
    weight_map = {}
    for i in range(a.shards):
        part = names[i * len(names) // a.shards:(i + 1) * len(names) // a.shards]
        file = "model-%05d-of-%05d.safetensors" % (i + 1, a.shards)
        write_safetensors(os.path.join(a.out, file), {k: m.named()[k] for k in part}, dtype)
        weight_map.update({k: file for k in part})
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def decays(name):
    """optim.no_decay = ["bias", "norm", "embedding"]: decay on the projections' weights only."""
    return name.endswith("_proj.weight") or name == "lm_head.weight"


def cmd_train(a):
    torch.manual_seed(0)
    m = Llama(a)
    m.load(read_safetensors(a.init))
    named = m.named()
    opt = torch.optim.AdamW([{"params": [p for k, p in named.items() if decays(k)], "weight_decay": a.weight_decay},
                             {"params": [p for k, p in named.items() if not decays(k)], "weight_decay": 0.0}],
                            lr=a.lr, betas=(a.beta1, a.beta2), eps=1e-8, foreach=False)
    tokens = read_tokens(a.data)
    losses = []
    for step in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(a, step, a.steps)
        xs, ys = zip(*(sample(tokens, step * a.batch + j, a.context) for j in range(a.batch)))
        opt.zero_grad()
        loss = loss_of(m(torch.stack(xs)), torch.stack(ys))
        loss.backward()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(list(named.values()), a.clip)
        opt.step()
        losses.append(loss.item())
    write_safetensors(a.out, named)
    with open(a.losses, "w") as f:
        json.dump(losses, f)


def cmd_eval(a):
    m = Llama(a)
    m.load(read_safetensors(a.model))
    evaluate(m, a)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def model_args(s):
        s.add_argument("--vocab", type=int, default=97)
        s.add_argument("--context", type=int, default=16)
        s.add_argument("--d-model", type=int, default=32)
        s.add_argument("--heads", type=int, default=4)
        s.add_argument("--kv-heads", type=int, default=2)
        s.add_argument("--head-dim", type=int, default=8)
        s.add_argument("--layers", type=int, default=2)
        s.add_argument("--intermediate", type=int, default=48)
        s.add_argument("--rope-theta", type=float, default=10000.0)
        s.add_argument("--eps", type=float, default=1e-5)
        s.add_argument("--bias", action="store_true", help="q/k/v biases (Qwen2)")
        s.add_argument("--tied", action="store_true", help="lm_head is the embedding")
        s.add_argument("--rope-factor", type=float, default=0.0, help="rope_scaling llama3's factor (0: no scaling)")
        s.add_argument("--rope-low", type=float, default=1.0, help="its low_freq_factor")
        s.add_argument("--rope-high", type=float, default=4.0, help="its high_freq_factor")
        s.add_argument("--rope-original", type=int, default=8192, help="its original_max_position_embeddings")
        s.add_argument("--config", help="a config.json to take the sizes from instead (as from_pretrained does)")

    add_subcommands(p, model_args, init_args=lambda s: (s.add_argument("--bf16", action="store_true", help="store bf16, as Hugging Face does"),
                                                  s.add_argument("--shards", type=int, default=1, help="a folder of this many files and an index"),
                                                  s.add_argument("--hf-config", action="store_true", help="config.json beside the weights"),
                                                  s.add_argument("--max-positions", type=int, default=8192, help="its max_position_embeddings")))
    a = p.parse_args()
    if getattr(a, "config", None):
        from_hf_config(a)
    torch.set_num_threads(1)
    return {"init": cmd_init, "train": cmd_train, "eval": cmd_eval, "compare": cmd_compare,
            "generate": lambda a: greedy(Llama(a), a)}[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main())
