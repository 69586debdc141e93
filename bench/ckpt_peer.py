#!/usr/bin/python3
"""PyTorch peer of fsdp_ckpt_bench: torch.save / torch.load of the same model and Adam state.

    mpirun --oversubscribe --allow-run-as-root -np 2 /usr/bin/python3 bench/ckpt_peer.py [--width 2048] [--layers 16] [--reps 3]

Run it with Debian's /usr/bin/python3 (python3-torch 1.13). Ranks come from Open MPI's environment
(OMPI_COMM_WORLD_RANK / _SIZE); torch.distributed (gloo, 127.0.0.1) provides barriers and broadcasts.

The model is plain PyTorch, not FSDP: PyTorch's FSDP in 1.13 does not run here without patches (it
fails to import on Python 3.11 and needs CUDA streams). Every rank therefore holds the full model and
full Adam state, like a DDP replica. Rows:
  torch.save per rank, full replica   every rank saves model + optimizer state_dict to its own file (N x the bytes)
  torch.save rank 0 alone             the analogue of FULL_STATE_DICT; loading: rank 0 reads, broadcasts over gloo
  torch.save per rank, 1/N slice      each rank saves a contiguous 1/N of every flattened tensor (the bytes
                                      fsdp LOCAL_STATE_DICT writes); slices are cut before the timer starts
Every save ends with flush + os.fsync; every timed operation is bracketed by barriers and timed on
rank 0; before each one rank 0 runs sync and drops the page cache (if it can). Loads include
load_state_dict into the model and optimizer (optimizer.load_state_dict deep-copies its state).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist


def build(width, layers):
    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
            self.scale = torch.nn.Parameter(torch.ones(width))  # same parameters as fsdp_ckpt_bench's model

        def forward(self, x):
            for layer in self.fc:
                x = torch.relu(layer(x))
            return x * self.scale

    return Stack()


def flush_caches(drop):
    os.sync()
    if not drop:
        return False
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def save_fsync(obj, path):
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="")
    ap.add_argument("--no-drop-caches", action="store_true")
    ap.add_argument("--port", default="29517")
    args = ap.parse_args()

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.set_num_threads(1)
    torch.manual_seed(0)

    # The folder: rank 0 makes it and tells the others.
    made = [args.dir]
    if rank == 0 and not args.dir:
        made = [tempfile.mkdtemp(prefix="fsdp_ckpt_peer.", dir="/tmp")]
    dist.broadcast_object_list(made, src=0)
    folder = made[0]

    model = build(args.width, args.layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    opt.zero_grad()
    model(torch.randn(8, args.width)).pow(2).mean().backward()
    opt.step()
    numel = sum(p.numel() for p in model.parameters())
    payload = 3 * 4 * numel

    ref = [p.detach().clone() for p in model.parameters()]
    ref_sq = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]

    def scramble():
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
                opt.state[p]["exp_avg_sq"].zero_()

    def verify(what, part=lambda t: t):
        bad = sum(
            0 if torch.equal(part(p.detach()), part(r)) and torch.equal(part(opt.state[p]["exp_avg_sq"]), part(s)) else 1
            for p, r, s in zip(model.parameters(), ref, ref_sq)
        )
        t = torch.tensor([bad])
        dist.all_reduce(t)
        if t.item():
            raise RuntimeError(f"{what}: loaded state differs in {t.item()} tensors")

    dropped = [False]

    def timed(f):
        ok = torch.tensor([0])
        if rank == 0:
            ok[0] = 1 if flush_caches(not args.no_drop_caches) else 0
        dist.broadcast(ok, 0)
        dropped[0] = bool(ok.item())
        dist.barrier()
        t0 = time.perf_counter()
        f()
        dist.barrier()
        return time.perf_counter() - t0

    def remove(path, everyone=False):
        if (everyone or rank == 0) and os.path.exists(path):
            os.remove(path)
        dist.barrier()

    def full_state():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def apply_full(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    if rank == 0:
        print(f"# ckpt_peer.py: {size} ranks, {args.layers} Linear({args.width}, {args.width}) layers + a scale = {numel} parameters "
              f"({4 * numel / 1e6:.1f} MB fp32), plain replica (no FSDP), Adam, torch {torch.__version__}, python {sys.version.split()[0]}")
        print(f"# payload (parameters + exp_avg + exp_avg_sq): {payload} bytes = {payload / 1e6:.1f} MB; reps {args.reps}; dir {folder}; "
              f"torch threads {torch.get_num_threads()}", flush=True)

    rows = []
    extra = []

    # (a) every rank saves its full replica.
    path = os.path.join(folder, f"replica_rank{rank}.pt")
    save_t, load_t, read_t = [], [], []
    nbytes = 0
    for _ in range(args.reps):
        remove(path, everyone=True)
        save_t.append(timed(lambda: save_fsync(full_state(), path)))
        nbytes = os.path.getsize(path)
        scramble()
        box = {}

        def load():
            t0 = time.perf_counter()
            sd = torch.load(path, map_location="cpu")
            box["read"] = time.perf_counter() - t0
            apply_full(sd)

        load_t.append(timed(load))
        read_t.append(box["read"])
        verify("replica")
    remove(path, everyone=True)
    total = torch.tensor([nbytes])
    dist.all_reduce(total)
    rows.append(("torch.save per rank, full replica (DDP-style)", f"all {size}", total.item(), save_t, load_t))
    extra.append(("torch.save per rank, full replica", read_t))

    # (b) rank 0 alone saves; loading: rank 0 reads and applies, then broadcasts every tensor.
    path = os.path.join(folder, "full.pt")
    save_t, load_t, read_t = [], [], []
    for _ in range(args.reps):
        remove(path)
        save_t.append(timed(lambda: save_fsync(full_state(), path) if rank == 0 else None))
        if rank == 0:
            nbytes = os.path.getsize(path)
        scramble()
        box = {"read": 0.0}

        def load():
            if rank == 0:
                t0 = time.perf_counter()
                sd = torch.load(path, map_location="cpu")
                box["read"] = time.perf_counter() - t0
                apply_full(sd)
            for p in model.parameters():
                dist.broadcast(p.data, 0)
                dist.broadcast(opt.state[p]["exp_avg"], 0)
                dist.broadcast(opt.state[p]["exp_avg_sq"], 0)

        load_t.append(timed(load))
        read_t.append(box["read"])
        verify("rank 0")
    remove(path)
    total = torch.tensor([nbytes if rank == 0 else 0])
    dist.all_reduce(total)
    rows.append(("torch.save rank 0 alone (load: rank 0 reads, gloo broadcast)", "rank 0", total.item(), save_t, load_t))
    extra.append(("torch.save rank 0 alone", read_t))

    # (c) every rank saves a 1/N slice of every flattened tensor (LOCAL's bytes).
    def my_slice(t):
        flat = t.detach().reshape(-1)
        n = (flat.numel() + size - 1) // size
        return flat[rank * n: min((rank + 1) * n, flat.numel())]

    params = list(model.parameters())
    slices = {}
    for i, p in enumerate(params):
        slices[f"{i}.param"] = my_slice(p).clone()
        slices[f"{i}.exp_avg"] = my_slice(opt.state[p]["exp_avg"]).clone()
        slices[f"{i}.exp_avg_sq"] = my_slice(opt.state[p]["exp_avg_sq"]).clone()
    path = os.path.join(folder, f"slice_rank{rank}.pt")
    save_t, load_t, read_t = [], [], []
    for _ in range(args.reps):
        remove(path, everyone=True)
        save_t.append(timed(lambda: save_fsync(slices, path)))
        nbytes = os.path.getsize(path)
        scramble()
        box = {}

        def load():
            t0 = time.perf_counter()
            sd = torch.load(path, map_location="cpu")
            box["read"] = time.perf_counter() - t0
            with torch.no_grad():
                for i, p in enumerate(params):
                    my_slice(p).copy_(sd[f"{i}.param"])
                    my_slice(opt.state[p]["exp_avg"]).copy_(sd[f"{i}.exp_avg"])
                    my_slice(opt.state[p]["exp_avg_sq"]).copy_(sd[f"{i}.exp_avg_sq"])

        load_t.append(timed(load))
        read_t.append(box["read"])
        verify("slice", my_slice)  # each rank restores its own slice only
    remove(path, everyone=True)
    total = torch.tensor([nbytes])
    dist.all_reduce(total)
    rows.append(("torch.save per rank, 1/N slice of each tensor (LOCAL's bytes)", f"all {size}", total.item(), save_t, load_t))
    extra.append(("torch.save per rank, 1/N slice", read_t))

    if rank == 0:
        state = ("not dropped (--no-drop-caches); sync only" if args.no_drop_caches else
                 "dropped (sync; echo 3 > /proc/sys/vm/drop_caches)" if dropped[0] else
                 "could NOT be dropped (sync only): loads may read from the page cache")
        print(f"\npage cache before each timed operation: {state}\n")
        print("| method | writers | bytes | save best s | save median s | save GB/s | load best s | load median s | load GB/s |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, writers, b, s, l in rows:
            print(f"| {name} | {writers} | {b / 1e6:.1f} MB | {min(s):.3f} | {statistics.median(s):.3f} | {b / 1e9 / min(s):.2f} | "
                  f"{min(l):.3f} | {statistics.median(l):.3f} | {b / 1e9 / min(l):.2f} |")
        print("\ntorch.load alone on rank 0 (part of the load column), best / median s:\n")
        for name, r in extra:
            print(f"- {name}: {min(r):.3f} / {statistics.median(r):.3f}")
        sys.stdout.flush()
        if not args.dir:
            os.rmdir(folder)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
