#!/usr/bin/python3
"""`make bench`: fsdp-train against PyTorch (DDP and PyTorch's own FSDP) on the same models, data, batch
and threads, interleaved in one run; collective bandwidth inside training against raw MPI at the same
sizes; checkpoint save/load bandwidth against raw sequential I/O.

    /usr/bin/python3 bench/run_bench.py            (what `make bench` runs, after `make build`)
    BENCH_QUICK=1 /usr/bin/python3 bench/run_bench.py      smoke test: 1 repetition, few steps, small checkpoint

Writes build/bench/results.json and build/bench/results.md (runs and logs under build/bench/runs and
build/bench/logs). Environment knobs (defaults in brackets; BENCH_QUICK=1 changes them as noted):
  BENCH_REPS [3; quick 1]       repetitions; each runs every configuration once, in a shuffled order
  BENCH_WARMUP [3; quick 2]     warm-up steps per run, excluded from every median on both sides
  BENCH_STEPS [cnn 20, gpt 15, gpt6m 8, gpt30m 6, llama30m 6, gpt125m 4; quick 4]   measured steps per run
  BENCH_NP [1,2,4]              world sizes
  BENCH_MODELS [cnn,gpt,gpt6m,gpt30m,llama30m,gpt125m; quick cnn,gpt,gpt6m]   models (decks bench/decks/<model>.toml)
  BENCH_TORCH_FSDP [1]          0: skip the PyTorch FSDP peer
  BENCH_CKPT [1]                0: skip the checkpoint benchmark
  BENCH_CKPT_ARGS ["--width 2048 --layers 8 --reps 3"; quick "--width 1024 --layers 4 --reps 1"]
  BENCH_OUT [build/bench]
  BENCH_SINGLE_COPY [probed]    default: Open MPI's single-copy mechanism between a node's ranks (CMA), as users' jobs get
                                it; none: every message through vader's queues. Unset: default where a 2-rank probe runs cleanly
  BENCH_REPORT_ONLY [0]         1: run nothing; rebuild results.md/json from the runs and logs an earlier (interrupted) run left in BENCH_OUT

Every run: `mpirun -np N` of build/bin/fsdp-train DECK --set ... or of /usr/bin/python3 bench/train_peer.py
DECK --set ... with the same --set list (global batch split over the ranks, run.threads, run.max_steps,
fsdp.sharding_strategy), OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = run.threads = max(1, cores / N). A
step's time is rank 0's time from before zero_grad (batch assembly included) to after the optimizer
step, on both sides: for fsdp-train from metrics.csv (log.every_steps = 1), for the peer from its
summary. Per run: the median of the steps after the warm-up and samples/s = global batch x measured
steps / their summed time. Per configuration: the median over the repetitions.
"""
import json
import os
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_BIN = os.path.join(ROOT, "build", "bin")
BIN = BUILD_BIN  # main() points this at a private copy of the binaries (a rebuild during the run cannot swap them)
PY = "/usr/bin/python3"
MPIRUN = ["mpirun", "--oversubscribe", "--allow-run-as-root"]
CORES = os.cpu_count() or 1

QUICK = os.environ.get("BENCH_QUICK", "0") not in ("", "0")


def env_int(name, default):
    v = os.environ.get(name, "")
    return int(v) if v.strip() else default


def env_list(name, default):
    v = os.environ.get(name, "")
    return [x.strip() for x in v.split(",") if x.strip()] if v.strip() else default


REPS = env_int("BENCH_REPS", 1 if QUICK else 3)
WARMUP = env_int("BENCH_WARMUP", 2 if QUICK else 3)
NPS = [int(x) for x in env_list("BENCH_NP", ["1", "2", "4"])]
MODEL_NAMES = env_list("BENCH_MODELS", ["cnn", "gpt", "gpt6m"] if QUICK else ["cnn", "gpt", "gpt6m", "gpt30m", "llama30m", "gpt125m"])
TORCH_FSDP = env_int("BENCH_TORCH_FSDP", 1) != 0
CKPT = env_int("BENCH_CKPT", 1) != 0
REPORT_ONLY = env_int("BENCH_REPORT_ONLY", 0) != 0
CKPT_ARGS = os.environ.get("BENCH_CKPT_ARGS", "--width 1024 --layers 4 --reps 1" if QUICK else "--width 2048 --layers 8 --reps 3")
OUT = os.path.abspath(os.environ.get("BENCH_OUT", os.path.join(ROOT, "build", "bench")))
RUN_TIMEOUT_S = 600

MODELS = {
    "cnn": {"deck": "bench/decks/cnn.toml", "global_batch": 64, "steps": 20,
            "title": "Tutorial CNN (model.kind = \"cnn\"), Fashion-MNIST, Adam, SIZE_BASED_WRAP 20000"},
    "gpt": {"deck": "bench/decks/gpt.toml", "global_batch": 16, "steps": 15,
            "title": "GPT-style decoder (model.kind = \"transformer\"), synthetic tokens, AdamW + clipping, TRANSFORMER_BASED_WRAP"},
    # GPTs of the sizes users train (issue: models that matter): fewer configurations, a breakdown per phase.
    "gpt6m": {"deck": "bench/decks/gpt6m.toml", "global_batch": 16, "steps": 8, "sized": True,
              "title": "GPT of 5.8M parameters (d_model 256, 6 blocks, context 128, vocabulary 4096), AdamW + clipping"},
    "gpt30m": {"deck": "bench/decks/gpt30m.toml", "global_batch": 8, "steps": 6, "sized": True,
               "title": "GPT of 29.5M parameters (d_model 512, 8 blocks, context 128, vocabulary 8192), AdamW + clipping"},
    "llama30m": {"deck": "bench/decks/llama30m.toml", "global_batch": 8, "steps": 6, "sized": True,
                 "title": "Llama of 29.4M parameters (d_model 512, 8 layers, 8 heads, 4 KV heads, SwiGLU 1536, context 128, vocabulary 8192), AdamW + clipping"},
    # At 4 ranks only FULL_SHARD and DDP: four NO_SHARD replicas of 124M (about 4.3 GiB each) crowd a shared 24 GiB machine.
    "gpt125m": {"deck": "bench/decks/gpt125m.toml", "global_batch": 4, "steps": 4, "sized": True,
                "only_at": {4: ["fsdp FULL_SHARD", "PyTorch DDP"]},
                "title": "GPT-2 small's widths, 124M parameters (d_model 768, 12 blocks, vocabulary 50257), context 64, AdamW + clipping"},
}

# (label, runner, strategy, minimum world size[, extra fsdp-train --set values])
# Reductions on the computing thread unless a configuration says otherwise (the deck's default, auto,
# would decide by the cores this machine has to spare; the tables should not depend on it).
SYNC = ("fsdp.overlap_grad_reduce=false",)
PREFETCH = ("fsdp.backward_prefetch=BACKWARD_PRE", "fsdp.forward_prefetch=true") + SYNC
OVERLAP_REDUCE = ("fsdp.overlap_grad_reduce=true",)
CONFIGS = [
    ("fsdp FULL_SHARD", "fsdp", "FULL_SHARD", 1, SYNC),
    ("fsdp FULL_SHARD + prefetch", "fsdp", "FULL_SHARD", 2, PREFETCH),  # collective worker thread: overlap
    ("fsdp FULL_SHARD + prefetch + overlapped reduction", "fsdp", "FULL_SHARD", 2, PREFETCH[:2] + OVERLAP_REDUCE),
    ("fsdp SHARD_GRAD_OP", "fsdp", "SHARD_GRAD_OP", 2, SYNC),  # identical to FULL_SHARD's work at 1 rank: skipped there
    ("fsdp NO_SHARD", "fsdp", "NO_SHARD", 1, SYNC),
    ("fsdp NO_SHARD + overlapped reduction", "fsdp", "NO_SHARD", 2, OVERLAP_REDUCE),  # DDP's bucket overlap
    ("PyTorch DDP", "ddp", "NO_SHARD", 1),
    ("PyTorch FSDP FULL_SHARD", "torch-fsdp", "FULL_SHARD", 1),
    ("PyTorch, no wrapper", "plain", "NO_SHARD", 1),  # one process only: the yardstick of the engine's cost
    # One process with np 2's per-rank batch: FULL_SHARD at np 2 against it is the cost of sharding.
    ("fsdp FULL_SHARD, np 2's per-rank batch", "fsdp", "FULL_SHARD", 1, SYNC),
]
# The configurations of the sized GPTs, and those that run at np 1 only.
SIZED_CONFIGS = {"fsdp FULL_SHARD", "fsdp FULL_SHARD + prefetch + overlapped reduction", "fsdp NO_SHARD", "PyTorch DDP",
                 "PyTorch, no wrapper", "fsdp FULL_SHARD, np 2's per-rank batch"}
NP1_ONLY = {"PyTorch, no wrapper", "fsdp FULL_SHARD, np 2's per-rank batch"}
# Not run on the original small models (their tables stay as they were).
SIZED_ONLY = {"PyTorch, no wrapper", "fsdp FULL_SHARD, np 2's per-rank batch"}


# The reference of a (model, np) group, the first of these it runs: every other configuration of the group
# runs next to it (pairs_of_repetition), and its step-time ratio is taken pair by pair.
REFERENCES = ("PyTorch, no wrapper", "PyTorch DDP")


def pairs_of_repetition(plan, rep):
    """Repetition `rep`'s runs in order, [(model, np, cfg, pair)]. The (model, np) groups come in a seeded
    shuffled order. Inside a group the configurations other than the reference go two at a time around one
    run of the reference, [a, ref, b], each of a and b adjacent to it; the next repetition swaps them,
    [b, ref, a], so that every configuration runs before its reference in one repetition and after it in the
    next (a lone last one: [x, ref], then [ref, x]). A slow spell of the machine then lands on both sides of
    a pair, or shows as a gap between the pair's GEMM probes. pair: the index of the trio in its group."""
    groups = {}
    for model, np_, cfg in plan:
        groups.setdefault((model, np_), []).append(cfg)
    keys = list(groups)
    random.Random(1000 + rep).shuffle(keys)
    runs = []
    for model, np_ in keys:
        cfgs = groups[(model, np_)]
        ref = next((c for name in REFERENCES for c in cfgs if c[0] == name), None)
        others = [c for c in cfgs if c is not ref]
        if ref is None:
            runs += [(model, np_, c, None) for c in others]
            continue
        flip = rep % 2 == 1
        for j in range(0, len(others), 2):
            chunk = others[j:j + 2]
            if len(chunk) == 2:
                a, b = (chunk[1], chunk[0]) if flip else (chunk[0], chunk[1])
                order = [a, ref, b]
            else:
                order = [ref, chunk[0]] if flip else [chunk[0], ref]
            runs += [(model, np_, c, j // 2) for c in order]
    return runs


def runs_config(model, np_, cfg):
    """Whether configuration `cfg` runs for `model` at `np_` ranks."""
    if np_ < cfg[3] or (cfg[0] in NP1_ONLY and np_ != 1):
        return False
    if MODELS[model].get("sized"):
        if np_ == 1:  # one process: the engine against plain PyTorch (DDP and NO_SHARD would repeat them)
            return cfg[0] in {"fsdp FULL_SHARD", "PyTorch, no wrapper", "fsdp FULL_SHARD, np 2's per-rank batch"}
        return cfg[0] in SIZED_CONFIGS and cfg[0] in MODELS[model].get("only_at", {}).get(np_, [cfg[0]])
    return cfg[0] not in SIZED_ONLY


# Open MPI's single-copy mechanism between ranks of a node (vader's CMA here), as users' jobs get it by
# default; "none" (every message through the shared-memory queues, two copies) only where a probe shows
# the kernel refusing it (a container without ptrace rights: vader then aborts the job). main() sets it.
SINGLE_COPY = "none"


def base_env(threads):
    env = dict(os.environ)
    env.pop("OMPI_MCA_btl_vader_single_copy_mechanism", None)
    if SINGLE_COPY == "none":
        env["OMPI_MCA_btl_vader_single_copy_mechanism"] = "none"
    env.update({
        "OMPI_MCA_mpi_yield_when_idle": "1",  # ranks that wait give up the core (needed when oversubscribed)
        "OMPI_MCA_btl": "self,vader",
        "OMP_NUM_THREADS": str(threads),
        # libgomp's idle threads otherwise spin on the cores OpenBLAS's threads compute on (fsdp-train sets
        # this for itself when unset; the peer gets the same: docs/performance.md, "Two thread pools").
        "OMP_WAIT_POLICY": "PASSIVE",
        "OPENBLAS_NUM_THREADS": str(threads),
        "PYTHONDONTWRITEBYTECODE": "1",
        # fsdp-train: a timed barrier before each collective, so that its seconds are the transfer alone and
        # the waiting for the slowest rank is reported apart (summary.json comm.skew_s); costs a few us per call.
        "FSDP_COMM_SKEW_PROBE": "1",
    })
    return env


def sh(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def probe_single_copy():
    """Open MPI's default single-copy mechanism ("default") where 2 ranks exchange 4 MiB with CMA asked
    for by name, so that a refusal shows (left to its default, vader falls back to two copies silently);
    "none" where they cannot. BENCH_SINGLE_COPY=default|none decides instead. Both sides of every pair
    run with the same setting (gloo, DDP's transport, does not use it). Logged in logs/single_copy_probe.log."""
    forced = os.environ.get("BENCH_SINGLE_COPY")
    if forced:
        if forced not in ("default", "none"):
            sys.exit(f"run_bench.py: BENCH_SINGLE_COPY={forced}: expected default or none")
        return forced
    out = os.path.join(OUT, "single_copy_probe.json")
    cmd = MPIRUN + ["-np", "2", os.path.join(BIN, "fsdp_mpi_bandwidth"), "--sizes", str(1 << 20), "--reps", "3", "--warmup", "1",
                    "--min-seconds", "0.01", "--out", out]
    env = dict(os.environ, OMPI_MCA_btl="self,vader", OMPI_MCA_mpi_yield_when_idle="1", OMPI_MCA_btl_vader_single_copy_mechanism="cma")
    try:
        p = sh(cmd, cwd=ROOT, env=env, timeout=120)
        text, refused = p.stdout + p.stderr, p.returncode != 0 or "errno" in p.stderr.lower()
    except subprocess.TimeoutExpired:
        text, refused = "timed out after 120 s", True
    with open(os.path.join(OUT, "logs", "single_copy_probe.log"), "w") as f:
        f.write("$ OMPI_MCA_btl_vader_single_copy_mechanism=cma " + " ".join(cmd) + "\n" + text)
    return "none" if refused else "default"


def log(msg):
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------------
# Machine facts

def machine_facts():
    facts = {"cores": CORES}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                facts["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                facts["memory_gib"] = round(int(line.split()[1]) / 1048576, 1)
    except OSError:
        pass
    facts["kernel"] = os.uname().release

    def ldd(path, pattern):
        out = sh(["ldd", path]).stdout
        return sorted({f"{m.group(1)} => {os.path.realpath(m.group(2))}" for m in re.finditer(r"(\S*(?:" + pattern + r")\S*) => (\S+)", out)})

    facts["fsdp_train_libs"] = ldd(os.path.join(BIN, "fsdp-train"), "blas|lapack|torch_cpu")
    torch_c = sh([PY, "-c", "import torch._C as c; print(c.__file__)"]).stdout.strip()
    facts["python_torch_libs"] = ldd(torch_c, "blas|lapack|torch_cpu") if torch_c else []
    facts["libblas.so.3"] = os.path.realpath("/lib/x86_64-linux-gnu/libblas.so.3")
    info = sh([PY, "-c", "import torch, sys; print(torch.__version__); print(sys.version.split()[0]); "
                        "print([l for l in torch.__config__.show().splitlines() if 'BLAS' in l or 'CPU capability' in l])"]).stdout.splitlines()
    if len(info) >= 3:
        facts["torch_version"], facts["python_version"], facts["torch_config"] = info[0], info[1], info[2]
    facts["mpirun"] = sh(["mpirun", "--version"]).stdout.splitlines()[0] if shutil.which("mpirun") else "missing"
    rev = sh(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"]).stdout.strip()
    dirty = sh(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
    facts["commit"] = rev + (" (+ uncommitted changes)" if dirty else "")
    facts["date_utc"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return facts


def loadavg():
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


# ---------------------------------------------------------------------------------------------------
# One training run

def run_training(model, np_, cfg, rep, steps, pair=None):
    label, runner, strategy = cfg[0], cfg[1], cfg[2]
    extra = list(cfg[4]) if len(cfg) > 4 else []
    m = MODELS[model]
    # The one process with np 2's per-rank batch also gets np 2's threads per rank: it measures sharding's cost.
    threads = max(1, CORES // (2 if "np 2's per-rank batch" in label else np_))
    slug = label.lower().replace(" ", "_")
    # A reference runs once per pair of its group: each run its own folder and log.
    run_tag = f"rep{rep}" + (f"_pair{pair}" if pair is not None and label in REFERENCES else "")
    out_dir = os.path.join(OUT, "runs", model, f"np{np_}", slug, run_tag)
    if not REPORT_ONLY:
        shutil.rmtree(out_dir, ignore_errors=True)
        os.makedirs(out_dir, exist_ok=True)
    per_rank = m["global_batch"] // (2 if "np 2's per-rank batch" in label else np_)
    sets = [f"run.out_dir={out_dir}", f"data.batch_size={per_rank}", f"run.threads={threads}",
            f"run.max_steps={WARMUP + steps}", f"fsdp.sharding_strategy={strategy}"] + extra
    if runner == "fsdp":
        sets.append(f"log.timing_warmup_steps={WARMUP}")  # its own summary's median then matches this report's
    set_args = [a for s in sets for a in ("--set", s)]
    deck = os.path.join(ROOT, m["deck"])
    # Each rank on as many cores as it has threads (mpirun binds a rank to one core by default).
    mpirun = MPIRUN + (["--bind-to", "none"] if threads > 1 else [])
    if runner == "fsdp":
        cmd = mpirun + ["-np", str(np_), os.path.join(BIN, "fsdp-train"), deck] + set_args
    else:
        cmd = mpirun + ["-np", str(np_), PY, os.path.join(ROOT, "bench", "train_peer.py"), deck] + set_args + \
              ["--out-dir", out_dir, "--warmup", str(WARMUP), "--wrapper", "ddp" if runner == "ddp" else "fsdp",
               "--init-file", os.path.join(out_dir, "gloo_rendezvous")]
        cmd[cmd.index("--wrapper") + 1] = {"ddp": "ddp", "plain": "none"}.get(runner, "fsdp")
    log_path = os.path.join(OUT, "logs", f"{model}_np{np_}_{slug}_{run_tag}.log")
    for attempt in range(0 if REPORT_ONLY else 2):  # one retry when mpirun could not start the processes at all
        t0 = time.time()
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=base_env(threads), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = 124, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            text += f"\n[run_bench] timed out after {RUN_TIMEOUT_S} s"
        wall = time.time() - t0
        if rc == 0 or "failed to start" not in text:
            break
        time.sleep(5)
    if REPORT_ONLY:  # the earlier run's log and output folder
        text = open(log_path).read() if os.path.exists(log_path) else "[run_bench] no log of this run"
        rc, wall = (0 if os.path.exists(os.path.join(out_dir, "summary.json")) else 1), 0.0
    else:
        with open(log_path, "w") as f:
            f.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n" + text)
    res = {"model": model, "np": np_, "config": label, "rep": rep, "pair": pair, "threads": threads, "rc": rc, "wall_s": wall,
           "command": " ".join(shlex.quote(c) for c in cmd), "log": os.path.relpath(log_path, ROOT)}
    summary_path = os.path.join(out_dir, "summary.json")
    if rc != 0 or not os.path.exists(summary_path):
        lines = [l for l in text.splitlines() if re.search(r"\w", l) and "warn" not in l.lower()]
        err = [l for l in lines if re.search(r"Error|error|refused|Abort|unable|failed", l)]
        res["error"] = (err[-1] if err else (lines[-1] if lines else f"exit code {rc}")).strip()[:300]
        return res
    s = json.load(open(summary_path))
    breakdown = {}  # per step: forward, backward, optimizer, each collective (ms), minor page faults
    if runner == "fsdp":
        step_ms = []
        with open(os.path.join(out_dir, "metrics.csv")) as f:
            header = f.readline().strip().split(",")
            col = header.index("step_ms")
            parts = [c for c in ("forward_ms", "backward_ms", "optimizer_ms", "all_gather_ms", "reduce_scatter_ms", "all_reduce_ms", "minor_faults")
                     if c in header]
            for line in f:
                cells = line.strip().split(",")
                if not cells[col]:
                    continue  # an evaluation row
                step_ms.append(float(cells[col]))
                for c in parts:
                    breakdown.setdefault(c.replace("_ms", ""), []).append(float(cells[header.index(c)]))
        res["fsdp_summary"] = {k: s.get(k) for k in ("step_ms_median", "samples_per_s", "tokens_per_s", "train_s", "wall_s", "steps")}
        res["comm"] = s.get("comm")
        res["phases"] = s.get("phases")
        res["overlap"] = s.get("overlap")
    else:
        step_ms = s["step_ms"]
        breakdown = dict(s.get("phases_ms") or {})
        if s.get("minor_faults"):
            breakdown["minor_faults"] = s["minor_faults"]
        res["unit_numels"] = s.get("unit_numels")
        res["blas"] = s.get("blas")
        res["torch_threads"] = s.get("torch_threads")
        res["losses"] = s.get("losses")
        res["patches"] = s.get("patches")
    res["params"] = s.get("params")
    probe = s.get("gemm_probe") or {}
    res["probe_fixed_gflops"] = (probe.get("fixed") or {}).get("gflops_per_thread")  # the same 512^3 product in every run
    res["probe_peak_gflops"] = probe.get("peak_gflops_per_thread")  # one thread at the model's products: MFU's denominator
    res["model_flops_per_sample"] = s.get("model_flops_per_sample")  # fsdp-train's count (the peer has the same model)
    res["steps"] = len(step_ms)
    measured = step_ms[WARMUP:] if len(step_ms) > WARMUP else step_ms
    res["step_ms"] = step_ms
    res["step_ms_median"] = statistics.median(measured)
    res["breakdown_median"] = {k: statistics.median(v[WARMUP:] if len(v) > WARMUP else v) for k, v in breakdown.items() if v}
    res["samples_per_s"] = per_rank * np_ * len(measured) / (sum(measured) / 1000.0)
    res["peak_rss_mb"] = s.get("peak_rss_mb")
    return res


# ---------------------------------------------------------------------------------------------------
# Raw MPI bandwidth at the unit sizes

def run_mpi_bandwidth(np_, sizes):
    out = os.path.join(OUT, f"mpi_bandwidth_np{np_}.json")
    cmd = MPIRUN + ["-np", str(np_), os.path.join(BIN, "fsdp_mpi_bandwidth"), "--sizes", ",".join(str(s) for s in sizes),
                    "--reps", "5" if QUICK else "30", "--warmup", "2" if QUICK else "5", "--min-seconds", "0.05" if QUICK else "0.3",
                    "--out", out]
    if REPORT_ONLY:
        if not os.path.exists(out):
            return {"error": f"no {out} from the earlier run", "command": " ".join(cmd)}
        data = json.load(open(out))
        data["command"] = " ".join(shlex.quote(c) for c in cmd)
        return data
    try:
        p = sh(cmd, cwd=ROOT, env=base_env(1), timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {RUN_TIMEOUT_S} s", "command": " ".join(cmd)}
    with open(os.path.join(OUT, "logs", f"mpi_bandwidth_np{np_}.log"), "w") as f:
        f.write("$ " + " ".join(cmd) + "\n" + p.stdout + p.stderr)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout).strip()[-300:], "command": " ".join(cmd)}
    data = json.load(open(out))
    data["command"] = " ".join(shlex.quote(c) for c in cmd)
    return data


def unit_weights(strategy, nunits):
    """How often each unit (root last) runs each collective per training step in fsdp-train."""
    nested = nunits - 1
    if strategy == "FULL_SHARD":  # nested units: gathered in forward and again in backward; the root stays gathered
        return {"all_gather": [2] * nested + [1], "reduce_scatter": [1] * nunits}
    if strategy == "SHARD_GRAD_OP":
        return {"all_gather": [1] * nunits, "reduce_scatter": [1] * nunits}
    return {"all_reduce": [1] * nunits}


# Raw kinds per collective: MPI's own, what fsdp::MpiComm runs (the reference for "training / raw"),
# and for all-gathers the same with cold caches and a fresh output buffer (as inside training).
RAW_KIND = {"all_gather": ["allgather", "fsdp_all_gather", "fsdp_all_gather_fresh_cold"],
            "reduce_scatter": ["reduce_scatter_block", "fsdp_reduce_scatter"], "all_reduce": ["allreduce", "fsdp_all_reduce"]}


# ---------------------------------------------------------------------------------------------------
# Checkpoint benchmark (bench/run_ckpt_bench.sh, reused as it is)

def parse_ckpt_output(text):
    rows, page_cache = [], []
    for line in text.splitlines():
        if line.startswith("page cache before each timed operation"):
            page_cache.append(line.split(":", 1)[1].strip())
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(cells) != 9 or cells[0] == "method" or cells[2].startswith("-"):
            continue
        try:
            mb = float(cells[2].split()[0])
            row = {"method": cells[0], "writers": cells[1], "bytes": mb * 1e6,
                   "save_best_s": float(cells[3]) if cells[3] != "-" else None, "save_median_s": float(cells[4]) if cells[4] != "-" else None,
                   "load_best_s": float(cells[6]) if cells[6] != "-" else None, "load_median_s": float(cells[7]) if cells[7] != "-" else None}
        except ValueError:
            continue
        rows.append(row)
    by_method = {r["method"]: r for r in rows}
    raw_all = next((r for r in rows if r["method"].startswith("raw") and "rank 0 alone" not in r["method"]), None)
    raw_0 = next((r for r in rows if r["method"].startswith("raw") and "rank 0 alone" in r["method"]), None)
    for r in rows:
        ref = raw_0 if r["writers"] == "rank 0" else raw_all
        for op in ("save", "load"):
            t = r[f"{op}_best_s"]
            r[f"{op}_gbps"] = r["bytes"] / 1e9 / t if t else None
            rt = ref and ref[f"{op}_best_s"]
            r[f"{op}_of_raw"] = (r[f"{op}_gbps"] / (ref["bytes"] / 1e9 / rt)) if (rt and t) else None
    # --rss-probe rows: | method | ranks | weights MiB | rank 0 growth | others max |; medians of the repetitions.
    probes = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(cells) != 5 or not cells[1].isdigit():
            continue
        probes.setdefault((cells[0], int(cells[1]), float(cells[2])), []).append(
            (float(cells[3]), float(cells[4]) if cells[4] != "-" else None))
    rss = []
    for (method, ranks, weights), v in probes.items():
        others = [o for _, o in v if o is not None]
        rss.append({"method": method, "ranks": ranks, "weights_mib": weights, "reps": len(v),
                    "rank0_mib": statistics.median(r for r, _ in v), "others_mib": statistics.median(others) if others else None})
    return {"rows": list(by_method.values()), "page_cache": page_cache, "rss": rss}


def run_ckpt(np_):
    env = base_env(1)
    env["BENCH_ARGS"] = CKPT_ARGS
    cmd = ["sh", os.path.join(ROOT, "bench", "run_ckpt_bench.sh"), str(np_)]
    t0 = time.time()
    p = sh(cmd, cwd=ROOT, env=env, timeout=1200)
    with open(os.path.join(OUT, "logs", f"ckpt_np{np_}.log"), "w") as f:
        f.write(f"$ BENCH_ARGS='{CKPT_ARGS}' " + " ".join(cmd) + "\n" + p.stdout + p.stderr)
    res = parse_ckpt_output(p.stdout)
    res.update({"np": np_, "args": CKPT_ARGS, "rc": p.returncode, "wall_s": time.time() - t0,
                "command": f"BENCH_ARGS='{CKPT_ARGS}' bench/run_ckpt_bench.sh {np_}"})
    if p.returncode != 0:
        res["error"] = (p.stderr or p.stdout).strip()[-300:]
    return res


# ---------------------------------------------------------------------------------------------------
# Aggregation and report

def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v, f="{:.1f}"):
    return "-" if v is None else f.format(v)


def pair_up(runs):
    """Each run's MFU (the model's training FLOPs per sample, counted by fsdp-train, x samples/s over its own GEMM
    probe's per-thread peak x threads x ranks) and, for a configuration run next to its group's reference, the
    step-time ratio to that very reference run (< 1: faster) and which of the two ran first."""
    flops = {}
    for r in runs:
        if r.get("model_flops_per_sample"):
            flops.setdefault(r["model"], r["model_flops_per_sample"])
    ok = [r for r in runs if "error" not in r]
    for r in ok:
        peak = r.get("probe_peak_gflops")
        if flops.get(r["model"]) and peak:
            r["mfu"] = flops[r["model"]] * r["samples_per_s"] / (peak * 1e9 * r["threads"] * r["np"])
    order = {id(r): i for i, r in enumerate(runs)}
    for r in ok:
        if r.get("pair") is None or r["config"] in REFERENCES or "per-rank batch" in r["config"]:
            continue  # the per-rank batch one is compared with FULL_SHARD at np 2 (step_vs_one_process), not with its trio's reference
        ref = next((x for x in ok if x["config"] in REFERENCES and (x["model"], x["np"], x["rep"], x["pair"]) ==
                    (r["model"], r["np"], r["rep"], r["pair"])), None)
        if ref:
            r["pair_ref"] = ref["config"]
            r["pair_ratio"] = r["step_ms_median"] / ref["step_ms_median"]
            r["pair_ref_step_ms"] = ref["step_ms_median"]
            r["pair_ran_first"] = order[id(r)] < order[id(ref)]
            r["pair_ref_probe_fixed_gflops"] = ref.get("probe_fixed_gflops")


def aggregate(runs):
    pair_up(runs)
    groups = {}
    for r in runs:
        groups.setdefault((r["model"], r["np"], r["config"]), []).append(r)
    agg = []
    for (model, np_, config), rs in groups.items():
        ok = [r for r in rs if "error" not in r]
        a = {"model": model, "np": np_, "config": config, "threads": rs[0]["threads"], "reps_ok": len(ok), "reps": len(rs),
             "oversubscribed": np_ * rs[0]["threads"] > CORES}
        if ok:
            a["step_ms_median"] = med([r["step_ms_median"] for r in ok])
            a["samples_per_s"] = med([r["samples_per_s"] for r in ok])
            a["peak_rss_mb_max"] = med([max(r["peak_rss_mb"]) for r in ok])
            a["peak_rss_mb_per_rank"] = [med([r["peak_rss_mb"][i] for r in ok]) for i in range(np_)]
            a["params"] = ok[0]["params"]
            a["step_ms_median_per_rep"] = [r["step_ms_median"] for r in ok]
            a["mfu"] = med([r.get("mfu") for r in ok])
            probes = [r["probe_fixed_gflops"] for r in ok if r.get("probe_fixed_gflops")]
            if probes:
                a["probe_fixed_gflops"] = {"median": med(probes), "min": min(probes), "max": max(probes)}
            ratios = [r["pair_ratio"] for r in ok if r.get("pair_ratio") is not None]
            if ratios:
                a["pair"] = {"ref": next(r["pair_ref"] for r in ok if r.get("pair_ref")), "pairs": len(ratios),
                             "median": med(ratios), "min": min(ratios), "max": max(ratios)}
            a["breakdown"] = {k: med([r.get("breakdown_median", {}).get(k) for r in ok]) for k in ok[0].get("breakdown_median", {})}
            if ok[0].get("overlap"):  # time the computing thread waited for unit all-gathers, per step (avg over ranks)
                a["exposed_all_gather_ms_per_step"] = med([1000 * r["overlap"]["exposed_all_gather_s"]["avg"] / r["steps"] for r in ok])
                a["prefetched_per_step"] = med([r["overlap"]["prefetched"] / r["steps"] for r in ok])
                if "exposed_reduce_s" in ok[0]["overlap"]:  # time it waited for overlapped gradient reductions
                    a["exposed_reduce_ms_per_step"] = med([1000 * r["overlap"]["exposed_reduce_s"]["avg"] / r["steps"] for r in ok])
                    a["reductions_overlapped_per_step"] = med([r["overlap"]["reductions_overlapped"] / r["steps"] for r in ok])
            if ok[0].get("comm"):
                a["comm"] = {}
                for kind in ("all_gather", "reduce_scatter", "all_reduce", "broadcast"):
                    b = med([r["comm"][kind]["bytes"] for r in ok])
                    s = med([r["comm"][kind]["seconds"] for r in ok])
                    gbps = med([(r["comm"][kind]["bytes"] * (np_ if kind == "all_gather" else 1)) / r["comm"][kind]["seconds"] / 1e9
                                for r in ok if r["comm"][kind]["seconds"] > 0])
                    a["comm"][kind] = {"bytes": b, "seconds": s, "gbps": gbps, "seconds_per_step": s / ok[0]["steps"] if s is not None else None}
                a["skew_ms_per_step"] = med([1000 * r["comm"].get("skew_s", 0) / r["steps"] for r in ok])
        else:
            a["error"] = rs[-1]["error"]
        agg.append(a)
    # Ratio to the DDP peer of the same model and world size (throughput; > 1: faster than DDP).
    for a in agg:
        ddp = next((b for b in agg if b["model"] == a["model"] and b["np"] == a["np"] and b["config"] == "PyTorch DDP"), None)
        if ddp and a.get("samples_per_s") and ddp.get("samples_per_s"):
            a["throughput_vs_ddp"] = a["samples_per_s"] / ddp["samples_per_s"]
    # Step-time ratios of the sized GPTs (< 1: fsdp-train faster): against DDP at the same np, against plain
    # PyTorch at np 1, and FULL_SHARD at np 2 against one process with the same per-rank batch.
    def find(model, np_, config):
        return next((b for b in agg if b["model"] == model and b["np"] == np_ and b["config"] == config and b.get("step_ms_median")), None)
    for a in agg:
        if not a.get("step_ms_median") or not a["config"].startswith("fsdp"):
            continue
        ddp, plain = find(a["model"], a["np"], "PyTorch DDP"), find(a["model"], 1, "PyTorch, no wrapper")
        if ddp and a["np"] >= 2:
            a["step_vs_ddp"] = a["step_ms_median"] / ddp["step_ms_median"]
        if plain and a["np"] == 1 and "per-rank batch" not in a["config"]:
            a["step_vs_plain"] = a["step_ms_median"] / plain["step_ms_median"]
        one = find(a["model"], 1, "fsdp FULL_SHARD, np 2's per-rank batch")
        if one and a["np"] == 2 and a["config"] == "fsdp FULL_SHARD":
            a["step_vs_one_process"] = a["step_ms_median"] / one["step_ms_median"]
    order = {c[0]: i for i, c in enumerate(CONFIGS)}
    agg.sort(key=lambda a: (MODEL_NAMES.index(a["model"]), a["np"], order[a["config"]]))
    return agg


def bandwidth_rows(agg, units, mpi):
    rows = []
    for a in agg:
        if not a.get("comm") or a["np"] < 2 or a["model"] not in units or a["np"] not in mpi or "error" in mpi[a["np"]]:
            continue
        if "+" in a["config"]:  # prefetching and overlapped reductions run on the worker's communicators, beside computation
            continue
        strategy = a["config"].split()[-1]
        weights = unit_weights(strategy, len(units[a["model"]]))
        sizes = {s["numel"]: s for s in mpi[a["np"]]["sizes"]}
        for kind, w in weights.items():
            c = a["comm"][kind]
            row = {"model": a["model"], "np": a["np"], "config": a["config"], "collective": kind,
                   "bytes_per_step": c["bytes"] * (a["np"] if kind == "all_gather" else 1) / (WARMUP + MODELS[a["model"]]["steps"]) if c["bytes"] else 0,
                   "seconds_per_step": c["seconds_per_step"], "train_gbps": c["gbps"], "skew_ms_per_step": a.get("skew_ms_per_step")}
            for raw in RAW_KIND[kind]:
                num = sum(wi * sizes[n]["bytes"] for wi, n in zip(w, units[a["model"]]))
                den = sum(wi * sizes[n]["kinds"][raw]["median_s"] for wi, n in zip(w, units[a["model"]]))
                row[f"raw_{raw}_gbps"] = num / den / 1e9 if den else None
            warm = row.get(f"raw_{RAW_KIND[kind][1]}_gbps")
            row["train_of_raw"] = (c["gbps"] / warm) if (c["gbps"] and warm) else None
            cold = row.get(f"raw_{RAW_KIND[kind][2]}_gbps") if len(RAW_KIND[kind]) > 2 else None
            row["train_of_raw_cold"] = (c["gbps"] / cold) if (c["gbps"] and cold) else None
            rows.append(row)
    return rows


def paired_cell(a):
    """The median of a configuration's per-pair step ratios with their range: "0.93 x DDP [0.90-0.97, 3 pairs]"."""
    p = a.get("pair")
    if not p:
        return "-"
    ref = {"PyTorch DDP": "DDP", "PyTorch, no wrapper": "plain"}[p["ref"]]
    return f"{p['median']:.2f} x {ref} [{p['min']:.2f}-{p['max']:.2f}, {p['pairs']} pair{'s' if p['pairs'] > 1 else ''}]"


def probe_cell(a):
    p = a.get("probe_fixed_gflops")
    return f"{p['median']:.0f} [{p['min']:.0f}-{p['max']:.0f}]" if p else "-"


def write_report(results):
    md = []
    f = results["machine"]
    md.append("# make bench: fsdp-train against PyTorch\n")
    md.append(f"{'**Smoke test (BENCH_QUICK=1): reduced steps and repetitions; numbers are not measurements.**' if QUICK else ''}\n")
    md.append("## Machine and settings\n")
    md.append(f"- {f.get('cpu', '?')}, {f['cores']} cores, {f.get('memory_gib', '?')} GiB, Linux {f['kernel']}; {f['date_utc']}; "
              f"load average {results['loadavg_start']} at the start, {results['loadavg_end']} at the end (the machine is shared)")
    md.append(f"- commit {f['commit']}; torch {f.get('torch_version', '?')} (Python {f.get('python_version', '?')}); {f['mpirun']}")
    md.append("- Open MPI between the training runs' ranks: btl self,vader, single-copy mechanism " +
              {"default": "Open MPI's default (CMA works here), as a user's job gets it",
               "none": "none (every message through the shared-memory queues: the probe or BENCH_SINGLE_COPY=none)"}.get(
                  f.get("single_copy"), "not recorded") + "; the checkpoint and memory scripts run with none")
    md.append(f"- BLAS: libblas.so.3 -> {f['libblas.so.3']}; fsdp-train links {', '.join(f['fsdp_train_libs'])}; "
              f"python torch links {', '.join(f['python_torch_libs'])}; mapped in the peer: {', '.join(results.get('peer_blas') or ['?'])}")
    md.append(f"- threads: run.threads = torch.set_num_threads = OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = max(1, {f['cores']} / ranks): "
              + ", ".join(f"np {n}: {max(1, CORES // n)}" + (" (oversubscribed: " + str(n) + " ranks on " + str(CORES) + " cores)" if n * max(1, CORES // n) > CORES else "")
                          for n in results["settings"]["np"]))
    s = results["settings"]
    md.append(f"- {s['reps']} repetition(s); each runs every (model, np) group once, the groups in a shuffled order, and inside a group every "
              "configuration next to the group's reference (PyTorch DDP; plain PyTorch at np 1 where it runs), two configurations around one "
              "reference run, before it in one repetition and after it in the next (bench/run_bench.py pairs_of_repetition); "
              f"{s['warmup']} warm-up steps per run excluded; measured steps per run: " + ", ".join(f"{k} {v}" for k, v in s["steps"].items())
              + "; the tables give the median over the repetitions, and \"paired\" the median of the ratios to the adjacent reference run "
              "with their range")
    md.append("- GEMM probe: every run, ours and the peer's, times one thread's fp32 `linear` at a fixed 512x512x512 (the column: GFLOP/s, "
              "median [range] of the runs; a low one marks a run taken while the machine was slow) and at the model's four largest "
              "products (each dimension capped at 1024); MFU = the model's training FLOPs per sample (fsdp-train's count: 6 N + "
              "12 L d T per token, the CNN's convolutions and linears x 3) x samples/s / (the best of the model's products x threads x ranks)")
    md.append("- step time: rank 0, from before zero_grad (batch assembly included) to after the optimizer step; samples/s = global batch x "
              "measured steps / their summed time; peak RSS = getrusage maxrss per rank (MiB), the largest rank shown")
    md.append(f"- command: `{s['command']}`; total time of this run: {results['elapsed_s'] / 60:.1f} min\n")

    for model in MODEL_NAMES:
        m = MODELS[model]
        rows = [a for a in results["training"] if a["model"] == model]
        if not rows:
            continue
        params = next((a["params"] for a in rows if a.get("params")), None)
        md.append(f"## {m['title']}\n")
        md.append(f"Deck `{m['deck']}`; {params} parameters (the peer's count asserted equal: "
                  f"{'yes' if results['params_match'].get(model) else 'NO'}); global batch {m['global_batch']} "
                  f"({'sequences' if model.startswith('gpt') else 'images'}), split over the ranks.\n")
        if m.get("sized"):
            md.append("Step time ratios (< 1: fsdp-train faster): against PyTorch DDP at the same np; at np 1 against plain PyTorch "
                      "(no wrapper); FULL_SHARD at np 2 against fsdp-train in one process with the same per-rank batch (the cost of "
                      "sharding). Breakdown: rank 0's median per step, forward with the loss, backward, optimizer with clipping, the "
                      "collectives' seconds (fsdp-train: metrics.csv, blocking collectives inside those phases, and in the prefetch + "
                      "overlapped reduction rows the worker thread's collectives, which run beside computation; the DDP peer: its "
                      "gradient all-reduces from the first bucket's launch to the last one's completion, overlapped with backward), minor page faults (getrusage).\n")
            md.append("| np | configuration | median step ms | ratio | paired | MFU | GEMM probe GFLOP/s | forward ms | backward ms | optimizer ms | "
                      "all-gather ms | reduce-scatter ms | all-reduce ms | minor faults | peak RSS MiB (max rank) |")
            md.append("|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for a in rows:
                if "error" in a:
                    md.append(f"| {a['np']} | {a['config']} | failed: {a['error']} | | | | | | | | | | | | |")
                    continue
                ratios = []
                if a.get("step_vs_ddp") is not None:
                    ratios.append(f"{a['step_vs_ddp']:.2f} x DDP")
                if a.get("step_vs_plain") is not None:
                    ratios.append(f"{a['step_vs_plain']:.2f} x plain")
                if a.get("step_vs_one_process") is not None:
                    ratios.append(f"{a['step_vs_one_process']:.2f} x one process")
                b = a.get("breakdown", {})
                md.append(f"| {a['np']} | {a['config']} | {fmt(a['step_ms_median'])} | {'; '.join(ratios) or '-'} | "
                          f"{paired_cell(a) if 'per-rank batch' not in a['config'] else '-'} | {fmt(a.get('mfu'), '{:.0%}')} | {probe_cell(a)} | {fmt(b.get('forward'))} | "
                          f"{fmt(b.get('backward'))} | {fmt(b.get('optimizer'))} | {fmt(b.get('all_gather'))} | {fmt(b.get('reduce_scatter'))} | "
                          f"{fmt(b.get('all_reduce'))} | {fmt(b.get('minor_faults'), '{:.0f}')} | {fmt(a['peak_rss_mb_max'], '{:.0f}')} |")
            md.append("")
            continue
        md.append("| np | threads/rank | configuration | median step ms | samples/s | peak RSS MiB (max rank) | throughput / DDP peer | "
                  "paired step ratio | MFU | GEMM probe GFLOP/s |")
        md.append("|---:|---:|---|---:|---:|---:|---:|---|---:|---:|")
        for a in rows:
            over = " (oversubscribed)" if a["oversubscribed"] else ""
            if "error" in a:
                md.append(f"| {a['np']} | {a['threads']}{over} | {a['config']} | failed: {a['error']} | | | | | | |")
                continue
            md.append(f"| {a['np']} | {a['threads']}{over} | {a['config']} | {fmt(a['step_ms_median'])} | {fmt(a['samples_per_s'])} | "
                      f"{fmt(a['peak_rss_mb_max'], '{:.0f}')} | {fmt(a.get('throughput_vs_ddp'), '{:.2f}')} | {paired_cell(a)} | "
                      f"{fmt(a.get('mfu'), '{:.0%}')} | {probe_cell(a)} |")
        md.append("")

    md.append("## Pairs\n")
    md.append("Every configuration's run against the reference run next to it (same repetition and trio), with both runs' GEMM "
              "probe (one thread, 512x512x512, GFLOP/s): a pair whose probes differ much was taken while the machine changed speed.\n")
    md.append("| model | np | rep | configuration | ran | step ms | reference | reference step ms | ratio | probe | reference's probe |")
    md.append("|---|---:|---:|---|---|---:|---|---:|---:|---:|---:|")
    for r in results["runs"]:
        if r.get("pair_ratio") is None:
            continue
        md.append(f"| {r['model']} | {r['np']} | {r['rep'] + 1} | {r['config']} | {'first' if r['pair_ran_first'] else 'second'} | "
                  f"{r['step_ms_median']:.1f} | {r['pair_ref']} | {r['pair_ref_step_ms']:.1f} | {r['pair_ratio']:.3f} | "
                  f"{fmt(r.get('probe_fixed_gflops'), '{:.0f}')} | {fmt(r.get('pair_ref_probe_fixed_gflops'), '{:.0f}')} |")
    md.append("")

    md.append("## Overlap: exposed communication\n")
    md.append("Time the computing thread waited for unit all-gathers (summary.json \"overlap\": synchronous all-gathers in full, "
              "prefetched ones only while waiting for the worker) and for gradient reductions (synchronous: the reduce-scatter / "
              "all-reduce seconds; overlapped: only the wait at the end of backward), per step, averaged over ranks (reductions: "
              "rank 0's collective seconds when synchronous). Prefetch: BACKWARD_PRE and forward prefetch issue the next unit's "
              "all-gather on the collective worker thread (fsdp.limit_all_gathers = 1); overlapped reduction "
              "(fsdp.overlap_grad_reduce = true): each unit's reduce-scatter / all-reduce runs on the worker while backward goes on.\n")
    md.append("| model | np | configuration | exposed all-gather ms/step | prefetched all-gathers/step | exposed reduction ms/step | "
              "overlapped reductions/step | median step ms |")
    md.append("|---|---:|---|---:|---:|---:|---:|---:|")
    for a in results["training"]:
        if a.get("exposed_all_gather_ms_per_step") is None or not a["config"].startswith("fsdp") or a["np"] < 2:
            continue
        overlapped = (a.get("reductions_overlapped_per_step") or 0) > 0
        if overlapped:
            reduce_ms = a.get("exposed_reduce_ms_per_step")
        else:
            kinds = a.get("comm") or {}
            reduce_ms = sum(1000 * (kinds.get(k, {}).get("seconds_per_step") or 0) for k in ("reduce_scatter", "all_reduce")) if kinds else None
        md.append(f"| {a['model']} | {a['np']} | {a['config']} | {fmt(a['exposed_all_gather_ms_per_step'], '{:.2f}')} | "
                  f"{fmt(a.get('prefetched_per_step'), '{:.1f}')} | {fmt(reduce_ms, '{:.2f}')} | "
                  f"{fmt(a.get('reductions_overlapped_per_step'), '{:.1f}')} | {fmt(a.get('step_ms_median'))} |")
    md.append("")

    md.append("## Collective bandwidth inside training against raw MPI at the same sizes\n")
    md.append("In training: rank 0's bytes / seconds inside the blocking collectives (summary.json \"comm\", training + a one-batch "
              "evaluation), bytes counted as the full (padded) buffer: all-gather output, reduce-scatter input, all-reduce buffer. "
              "Raw: bench/mpi_bandwidth.cpp (fsdp_mpi_bandwidth) at each unit's padded size, median of repetitions, slowest rank, "
              "combined with the number of calls per unit and step (FULL_SHARD: nested units gathered twice, the root once; "
              "SHARD_GRAD_OP: once; one reduction per unit). fsdp reduce-scatters with a ring of MPI_Sendrecv (fsdp::MpiComm), "
              "the last raw column for reduce_scatter; MPI_Allgather for all_gather. The in-training time includes waiting for the "
              "slowest rank.\n")
    md.append("Every fsdp-train run sets FSDP_COMM_SKEW_PROBE=1: a timed barrier before each collective takes the waiting for "
              "the slowest rank out of the collectives' seconds (reported as skew, all collectives of the step together).\n")
    md.append("Raw with cold caches (all-gather): the same fsdp::MpiComm::all_gather into an output buffer allocated for the call, "
              "after a 64 MiB buffer was written outside the timed span, as inside training, where the computation between two "
              "gathers evicts the shard, the gathered buffer and MPI's shared-memory segments from the caches.\n")
    md.append("| model | np | configuration | collective | MB per step (eval included) | ms per step | skew ms per step (all collectives) | "
              "in training GB/s | raw MPI GB/s | raw fsdp::MpiComm GB/s | raw fsdp::MpiComm, cold caches GB/s | training / raw (fsdp::MpiComm) | "
              "training / raw, cold caches |")
    md.append("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results["bandwidth"]:
        raws = RAW_KIND[r["collective"]]
        md.append(f"| {r['model']} | {r['np']} | {r['config']} | {r['collective']} | {r['bytes_per_step'] / 1e6:.2f} | "
                  f"{fmt(r['seconds_per_step'] and 1000 * r['seconds_per_step'], '{:.2f}')} | {fmt(r.get('skew_ms_per_step'), '{:.2f}')} | "
                  f"{fmt(r['train_gbps'], '{:.2f}')} | "
                  f"{fmt(r.get('raw_' + raws[0] + '_gbps'), '{:.2f}')} | {fmt(r.get('raw_' + raws[1] + '_gbps'), '{:.2f}')} | "
                  f"{fmt(r.get('raw_' + raws[2] + '_gbps') if len(raws) > 2 else None, '{:.2f}')} | "
                  f"{fmt(r['train_of_raw'], '{:.0%}')} | {fmt(r.get('train_of_raw_cold'), '{:.0%}')} |")
    for np_, d in sorted(results["mpi_bandwidth"].items()):
        if "error" in d:
            md.append(f"\nfsdp_mpi_bandwidth at np {np_} failed: {d['error']}")
    md.append("\nRaw MPI per size (GB/s, median):\n")
    md.append("| np | numel | MB | MPI_Allgather | MPI_Reduce_scatter_block | fsdp all_gather | fsdp all_gather, fresh buffer | "
              "fsdp all_gather, cold caches | fsdp all_gather, both | fsdp reduce_scatter (ring) | MPI_Allreduce | fsdp all_reduce (ring + all-gather) |")
    md.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for np_, d in sorted(results["mpi_bandwidth"].items()):
        for s in d.get("sizes", []):
            k = s["kinds"]
            md.append(f"| {np_} | {s['numel']} | {s['bytes'] / 1e6:.2f} | {k['allgather']['gbps']:.2f} | {k['reduce_scatter_block']['gbps']:.2f} | "
                      f"{k['fsdp_all_gather']['gbps']:.2f} | {k['fsdp_all_gather_fresh']['gbps']:.2f} | {k['fsdp_all_gather_cold']['gbps']:.2f} | "
                      f"{k['fsdp_all_gather_fresh_cold']['gbps']:.2f} | {k['fsdp_reduce_scatter']['gbps']:.2f} | {k['allreduce']['gbps']:.2f} | "
                      f"{k['fsdp_all_reduce']['gbps']:.2f} |")
    md.append("")

    ck = results.get("checkpoint")
    if ck:
        md.append("## Checkpoint save/load against raw sequential I/O of the same bytes\n")
        md.append(f"`{ck['command']}` (bench/ckpt_bench.cpp and bench/ckpt_peer.py; every save fsyncs; page cache before each "
                  f"timed operation: {'; '.join(sorted(set(ck['page_cache']))) or '?'}). GB/s from the best of the repetitions; "
                  "\"of raw\": against raw write()+fsync / read() by the same writers (all ranks, one file each; or rank 0 alone).\n")
        if "error" in ck:
            md.append(f"failed: {ck['error']}\n")
        md.append("| method | writers | MB | save s | save GB/s | save of raw | load s | load GB/s | load of raw |")
        md.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in ck["rows"]:
            md.append(f"| {r['method']} | {r['writers']} | {r['bytes'] / 1e6:.1f} | {fmt(r['save_best_s'], '{:.3f}')} | {fmt(r['save_gbps'], '{:.2f}')} | "
                      f"{fmt(r['save_of_raw'], '{:.0%}')} | {fmt(r['load_best_s'], '{:.3f}')} | {fmt(r['load_gbps'], '{:.2f}')} | {fmt(r['load_of_raw'], '{:.0%}')} |")
        md.append("")
        if ck.get("rss"):
            md.append("Peak RSS growth of one weights load (fsdp_ckpt_bench --rss-probe, a fresh process each, median of the repetitions):\n")
            md.append("| weights load | ranks | weights MiB | rank 0 MiB | other ranks, max MiB | reps |")
            md.append("|---|---:|---:|---:|---:|---:|")
            for r in ck["rss"]:
                md.append(f"| {r['method']} | {r['ranks']} | {r['weights_mib']:.1f} | {r['rank0_mib']:.1f} | {fmt(r['others_mib'], '{:.1f}')} | {r['reps']} |")
            md.append("")

    md.append("## PyTorch FSDP on CPU\n")
    md.append(results["torch_fsdp_status"] + "\n")
    md.append("## Notes\n")
    for n in results["notes"]:
        md.append(f"- {n}")
    md.append("\nCommands of every run: build/bench/results.json (\"runs\"[].command); logs in build/bench/logs/.")
    with open(os.path.join(OUT, "results.md"), "w") as fobj:
        fobj.write("\n".join(md) + "\n")


def main():
    t_start = time.time()
    for exe in ("fsdp-train", "fsdp_mpi_bandwidth") + (("fsdp_ckpt_bench",) if CKPT else ()):
        if not os.access(os.path.join(BUILD_BIN, exe), os.X_OK):
            sys.exit(f"run_bench.py: {os.path.join(BUILD_BIN, exe)} is missing: run `make build` first (or `make bench`)")
    global BIN
    BIN = os.path.join(OUT, "bin")
    if not REPORT_ONLY:
        shutil.rmtree(os.path.join(OUT, "runs"), ignore_errors=True)
        shutil.rmtree(os.path.join(OUT, "logs"), ignore_errors=True)
        os.makedirs(os.path.join(OUT, "logs"), exist_ok=True)
        shutil.rmtree(BIN, ignore_errors=True)
        os.makedirs(BIN)
        for exe in ("fsdp-train", "fsdp_mpi_bandwidth"):
            shutil.copy2(os.path.join(BUILD_BIN, exe), os.path.join(BIN, exe))
    steps = {m: env_int("BENCH_STEPS", 4 if QUICK else MODELS[m]["steps"]) for m in MODEL_NAMES}
    for m in MODEL_NAMES:
        MODELS[m]["steps"] = steps[m]
    global SINGLE_COPY
    chosen = os.path.join(OUT, "single_copy.txt")  # what the runs used, for a later BENCH_REPORT_ONLY=1
    if REPORT_ONLY:
        SINGLE_COPY = open(chosen).read().strip() if os.path.exists(chosen) else "unknown"
    else:
        SINGLE_COPY = probe_single_copy()
        with open(chosen, "w") as f:
            f.write(SINGLE_COPY + "\n")
    facts = machine_facts()
    facts["single_copy"] = SINGLE_COPY
    la_start = loadavg()
    configs = [c for c in CONFIGS if TORCH_FSDP or c[1] != "torch-fsdp"]
    plan = [(m, n, c) for m in MODEL_NAMES for n in NPS for c in configs if runs_config(m, n, c)]
    log(f"# make bench{' (BENCH_QUICK=1)' if QUICK else ''}: {len(plan)} configurations x {REPS} repetition(s) in pairs, {WARMUP} warm-up + "
        f"{', '.join(f'{k} {v}' for k, v in steps.items())} measured steps; load average {la_start}; output {OUT}")

    runs = []
    schedule = [(rep, run) for rep in range(REPS) for run in pairs_of_repetition(plan, rep)]
    for k, (rep, (model, np_, cfg, pair)) in enumerate(schedule, 1):
        r = run_training(model, np_, cfg, rep, steps[model], pair)
        runs.append(r)
        if "error" in r:
            log(f"[{k}/{len(schedule)}] rep {rep + 1} {model} np={np_} {cfg[0]}: FAILED ({r['error']}), {r['wall_s']:.1f} s; log {r['log']}")
        else:
            log(f"[{k}/{len(schedule)}] rep {rep + 1} {model} np={np_} {cfg[0]}: median step {r['step_ms_median']:.1f} ms, "
                f"{r['samples_per_s']:.1f} samples/s, peak RSS {max(r['peak_rss_mb']):.0f} MiB, GEMM probe {fmt(r.get('probe_fixed_gflops'))} "
                f"GFLOP/s, wall {r['wall_s']:.1f} s")
    t_train = time.time() - t_start

    # Parameter counts: the peer's (PyTorch model) must equal fsdp-train's.
    params_match, units = {}, {}
    for model in MODEL_NAMES:
        fs = {r["params"] for r in runs if r["model"] == model and "error" not in r and r["config"].startswith("fsdp")}
        pe = {r["params"] for r in runs if r["model"] == model and "error" not in r and r["config"].startswith("PyTorch")}
        params_match[model] = len(fs) == 1 and fs == pe
        u = next((r["unit_numels"] for r in runs if r["model"] == model and r.get("unit_numels")), None)
        if u:
            units[model] = u
        log(f"# {model}: parameters fsdp-train {sorted(fs)}, PyTorch peer {sorted(pe)}: {'equal' if params_match[model] else 'DIFFERENT'}; "
            f"FSDP units (numel, root last): {u}")
    if not all(params_match.values()):
        log("run_bench.py: ERROR: parameter counts differ between fsdp-train and the PyTorch peer (see above)")

    # Raw MPI bandwidth at the padded unit sizes of every model.
    mpi = {}
    for np_ in [n for n in NPS if n >= 2]:
        sizes = sorted({n for u in units.values() for n in u}, reverse=True)
        if sizes:
            mpi[np_] = run_mpi_bandwidth(np_, sizes)
            log(f"# fsdp_mpi_bandwidth np={np_}: {'failed: ' + mpi[np_]['error'] if 'error' in mpi[np_] else 'done'}")
            # numel -> padded mapping is per world size; fsdp_mpi_bandwidth pads itself.

    ckpt = None
    if CKPT:
        ckpt_np = 2 if CORES >= 2 else 1
        log(f"# checkpoint benchmark: BENCH_ARGS='{CKPT_ARGS}' bench/run_ckpt_bench.sh {ckpt_np}")
        ckpt = run_ckpt(ckpt_np)
        log(f"# checkpoint benchmark: {len(ckpt['rows'])} rows, {ckpt['wall_s']:.0f} s" + (f", FAILED: {ckpt['error']}" if "error" in ckpt else ""))

    agg = aggregate(runs)
    bw = bandwidth_rows(agg, units, mpi)

    # PyTorch FSDP status: did it run, and does it train like DDP (same init, data and dropout draws)?
    tf_runs = [r for r in runs if r["config"].startswith("PyTorch FSDP")]
    tf_ok = [r for r in tf_runs if "error" not in r]
    loss_diffs = []
    for r in tf_ok:
        d = next((x for x in runs if x["config"] == "PyTorch DDP" and x["model"] == r["model"] and x["np"] == r["np"] and x["rep"] == r["rep"]
                  and "error" not in x), None)
        if d and d.get("losses") and r.get("losses"):
            loss_diffs.append(max(abs(a - b) for a, b in zip(d["losses"], r["losses"])))
    patches = next((r["patches"] for r in tf_ok if r.get("patches")), [])
    if not TORCH_FSDP:
        tf_status = "Not run (BENCH_TORCH_FSDP=0)."
    elif tf_ok and len(tf_ok) == len(tf_runs):
        tf_status = ("Works on CPU with in-process patches in bench/train_peer.py (`fsdp_cpu_patches`), PyTorch's FSDP code itself "
                     "unchanged: " + "; ".join(patches) + ". "
                     f"Its per-step losses equal the DDP peer's of the same repetition (max |difference| {max(loss_diffs) if loss_diffs else float('nan'):.2e}: "
                     "same initial weights, data and dropout draws). Caveats: gloo has no reduce-scatter, so every gradient reduction "
                     "is an all-reduce of the full buffer plus a slice (twice the traffic of a reduce-scatter), and its all-gather "
                     "goes through gloo's list all_gather; streams are no-ops, so nothing overlaps; FULL_SHARD only.")
    elif tf_runs:
        tf_status = "Fails on CPU even with the in-process patches: " + "; ".join(sorted({r["error"] for r in tf_runs if "error" in r}))
    else:
        tf_status = "Not run."

    notes = [
        "model.kind for the GPT model is \"transformer\" in fsdp-train's decks (there is no \"gpt\" kind); app/models.hpp GptImpl.",
        "fsdp-train runs with log.timing_warmup_steps = the bench's warm-up, so its own summary.json step_ms_median is this "
        "report's; its samples_per_s/tokens_per_s count all steps over train_s, so this report recomputes both sides from "
        "per-step times after the warm-up (fsdp-train's metrics.csv with log.every_steps = 1; the peer's step_ms). fsdp-train's "
        "own values are kept in results.json (runs[].fsdp_summary).",
        "The peer uses the data of fsdp-train bit for bit: the synthetic token chain and the DistributedSampler order are "
        "re-implemented on std::mt19937_64 (checked against app/data.cpp), images normalized the same way; each rank of both "
        "trains on the same samples at each step.",
        "fsdp-train per step also runs one 2-element all-reduce (non-finite/stop flags) inside the step, and, outside the "
        "timed step, the logging all-reduce (log.every_steps = 1); the DDP peer uses broadcast_buffers=False (the only buffer, "
        "the causal mask, is constant) and otherwise DDP's defaults (25 MiB buckets, overlap of all-reduce with backward).",
        "Peak RSS includes each process's runtime: the Python interpreter and torch's Python modules on the peer side, which "
        "fsdp-train does not carry; both hold the training and test images (or tokens) in memory.",
        "PyTorch FSDP 1.13 NO_SHARD's clip_grad_norm_ sums the (replicated) squared norms over ranks (seen while checking the "
        "patches: losses then differ from DDP); the benchmark runs PyTorch FSDP with FULL_SHARD only.",
    ]
    results = {
        "quick": QUICK, "machine": facts, "loadavg_start": la_start, "loadavg_end": loadavg(),
        "settings": {"command": " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("BENCH_")) + " make bench"
                     if any(k.startswith("BENCH_") for k in os.environ) else "make bench",
                     "reps": REPS, "warmup": WARMUP, "steps": steps, "np": NPS, "models": {m: MODELS[m] for m in MODEL_NAMES},
                     "configs": [c[0] for c in configs], "ckpt_args": CKPT_ARGS if CKPT else None},
        "params_match": params_match, "unit_numels": units,
        "peer_blas": next((r["blas"] for r in runs if r.get("blas")), None),
        "training": agg, "bandwidth": bw, "mpi_bandwidth": mpi, "checkpoint": ckpt,
        "torch_fsdp_status": tf_status, "torch_fsdp_loss_max_abs_diff_vs_ddp": max(loss_diffs) if loss_diffs else None,
        "notes": notes, "runs": runs, "elapsed_s": time.time() - t_start, "training_elapsed_s": t_train,
    }
    with open(os.path.join(OUT, "results.json"), "w") as fobj:
        json.dump(results, fobj, indent=1)
    write_report(results)
    log(f"# done in {results['elapsed_s'] / 60:.1f} min (training runs {t_train / 60:.1f} min): {os.path.join(OUT, 'results.md')} and results.json")
    print(open(os.path.join(OUT, "results.md")).read())
    failed = [r for r in runs if "error" in r and not r["config"].startswith("PyTorch FSDP")]
    return 1 if failed or not all(params_match.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
