"""shardfn vs FSDP2 vs DDP: step time, peak memory and bytes sent, side by side, on CPU ranks (gloo).

Launch (from the repository root; the defaults take about 5 minutes on the 2-core CPU machine):

    .venv/bin/python benchmarks/bench.py

    .venv/bin/python benchmarks/bench.py --models mlp --rounds 2 --steps 5     # a quicker look
    .venv/bin/python benchmarks/bench.py --impls shardfn,fsdp2 --world 2 --out /tmp/r.png
    .venv/bin/python benchmarks/bench.py --timing-malloc-mmap-threshold none   # time with glibc's default malloc
    .venv/bin/python benchmarks/bench.py --models mlp --profile shardfn        # + torch.profiler's top ops

Every implementation trains the same model from the same initial weights (same seed), on the same
batches (batch i of rank r is the same for all), with AdamW (lr 1e-3, weight decay 0.01) and the same
units (one per `blocks.N`):

  shardfn            sf.train_step(loss_fn, sf.optim.adamw(...), mesh, strategy="full_shard")
  shardfn_no_shard   the same with strategy="no_shard" (compares with DDP)
  fsdp2              torch.distributed.fsdp.fully_shard on each block, then the root;
                     init_device_mesh("cpu", (world,)); torch.optim.AdamW(fused=True)
  ddp                DistributedDataParallel(forward_sync_buffers=False, gradient_as_bucket_view=True);
                     torch.optim.AdamW(fused=True)
  shardfn_step       (opt-in) sf.train_step(..., compile="step"): the forward and backward as one
                     Inductor graph, the gathers and reduce-scatters inside it
  step_graph         (not shardfn; opt-in) the whole step as one graph, a plain-torch prototype of
                     SimpleFSDP's design: DTensor parameters gathered inside the compiled forward,
                     the gathers recomputed in the backward, Inductor bucketing the collectives

Three phases per model:

1. Profile runs, one FRESH pool of ranks per implementation (so nothing another implementation left
   allocated can hide a peak): set-up, MEM_WARMUP steps, gc, then reset VmHWM (write 5 to
   /proc/self/clear_refs) and read the baseline right at the reset, run MEM_STEPS steps, read VmHWM.
   Peak growth = VmHWM after the steps - VmHWM right after the reset. Every process runs with
   MALLOC_MMAP_THRESHOLD_=65536, so freed tensors leave the RSS. The same runs count the bytes each
   rank sends per step (shardfn: shardfn._collectives.STATS; FSDP2: patched torch.distributed
   collectives; DDP: a DDP comm hook that sees each gradient bucket, because DDP's reducer calls
   all-reduce from C++, out of the reach of a Python patch) and log the collectives shardfn issues.
2. Timing: one pool holds every implementation; rounds alternate them (shardfn, shardfn_no_shard,
   fsdp2, ddp, shardfn, ...), each round WARMUP steps then STEPS timed steps, a dist.barrier() before
   each step; a step's time is the max over ranks; the reported time is the median of all timed steps.
   These ranks get MALLOC_MMAP_THRESHOLD_=65536 too by default (flag --timing-malloc-mmap-threshold):
   it makes every allocation over 64 KiB a fresh mmap, whose page faults cost a lot on this VM (the
   plain forward+backward of the MLP takes about twice as long with it), so also read a run with
   `--timing-malloc-mmap-threshold none` (benchmarks/README.md has both).
3. The floor (shardfn strategies), measured in every round next to the implementations: the bare
   collectives shardfn issued in one step (same functions, sizes and order, same group, synchronous,
   preallocated buffers), plus forward+backward of the unsharded plain nn.Module on one rank's batch
   (no communication), plus torch._fused_adamw_ over this rank's shard of every leaf.
   floor = comm + compute + optimizer (no overlap assumed).

Output: a markdown table on stdout, the losses side by side (flagged when they differ by more than
LOSS_RTOL relative), the floor, and a PNG (grouped bars of step time and peak memory).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time

from _proc import status_kb  # benchmarks/_proc.py, beside this script

# -- settings (each one can be overridden by the flag of the same name) ---------------------------
MODELS = "mlp,gpt,deep"
WORLD = 2
IMPLS = "shardfn,shardfn_vg,shardfn_no_shard,fsdp2,ddp"
ROUNDS = 4  # timing rounds; each implementation runs WARMUP + STEPS steps per round
STEPS = 7  # timed steps per round
WARMUP = 3  # untimed steps per round
MEM_WARMUP = 2  # profile run: steps before VmHWM is reset
MEM_STEPS = 3  # profile run: steps whose peak is measured
FLOOR_REPS = 2  # repetitions of each part of the floor per round (the floor runs in every round too)
REMAT = False  # pass remat=True to shardfn
OUT = "benchmarks/results.png"
THREADS = 1  # torch threads per rank
SEED = 0
LR = 1e-3
WEIGHT_DECAY = 0.01
LOSS_RTOL = 1e-5  # losses of the implementations must agree to this (relative)
UNITS = r"blocks\.\d+"
MLP_D, MLP_LAYERS, MLP_BATCH = 2048, 8, 16  # MLP(d, n_layer), batch per rank
GPT_VOCAB, GPT_BLOCK, GPT_LAYERS, GPT_HEADS, GPT_D, GPT_BATCH = 8192, 128, 4, 4, 256, 8
# "deep": many small units (the fixed cost per unit), untied head
DEEP_VOCAB, DEEP_BLOCK, DEEP_LAYERS, DEEP_HEADS, DEEP_D, DEEP_BATCH = 512, 64, 32, 2, 64, 8
MALLOC_MMAP_THRESHOLD = "65536"  # glibc env of the memory runs' ranks; "none": glibc's default (memory then means little)
TIMING_MALLOC_MMAP_THRESHOLD = "same"  # the same env for the timing ranks ("same" as above, a value, or "none")
POOL_TIMEOUT = 900.0  # seconds one call into the ranks may take

NAMES = {
    "shardfn": "shardfn full_shard",
    "shardfn_vg": "shardfn value_and_grad + adamw (by hand)",
    "shardfn_no_shard": "shardfn no_shard",
    "fsdp2": "FSDP2",
    "ddp": "DDP",
    "shardfn_compile": "shardfn full_shard compile=True",
    "shardfn_step": "shardfn full_shard compile=\"step\" (the step as one graph)",
    "fsdp2_compile": "FSDP2 + per-block torch.compile",
    "ddp_compile": "DDP + torch.compile",
    "step_graph": "whole step as one graph (prototype, plain torch)",
}
COMPILED = ("shardfn_compile", "shardfn_step", "fsdp2_compile", "ddp_compile", "step_graph")  # Inductor (C++ on CPU); the first step compiles
STRATEGY = {"shardfn": "full_shard", "shardfn_no_shard": "no_shard"}


# ==================================================================================================
# Rank side: everything below up to "Parent side" runs inside the spawned ranks.
# ==================================================================================================
def _quiet() -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notes, once per rank
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")


def _build(model: str, cfg: dict):
    import torch

    _quiet()

    from shardfn.models import GPT, MLP, GPTConfig

    torch.manual_seed(cfg["seed"])  # identical initial weights for every implementation
    if model == "mlp":
        return MLP(d=cfg["mlp_d"], n_layer=cfg["mlp_layers"])
    k = "deep" if model == "deep" else "gpt"
    return GPT(GPTConfig(vocab=cfg[f"{k}_vocab"], block_size=cfg[f"{k}_block"], n_layer=cfg[f"{k}_layers"], n_head=cfg[f"{k}_heads"], d=cfg[f"{k}_d"], tie=model != "deep"))


def _criterion(model: str):
    from torch.nn import functional as F

    if model == "mlp":
        return lambda out, y: F.mse_loss(out, y)
    return lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())


def _batch(model: str, cfg: dict, step: int, rank: int):
    """Batch `step` of `rank`: the same for every implementation."""
    import torch

    g = torch.Generator().manual_seed(1_000_003 * (step + 1) + rank)
    if model == "mlp":
        B, d = cfg["mlp_batch"], cfg["mlp_d"]
        return torch.randn(B, d, generator=g), torch.randn(B, d, generator=g)
    k = "deep" if model == "deep" else "gpt"
    B, T, V = cfg[f"{k}_batch"], cfg[f"{k}_block"], cfg[f"{k}_vocab"]
    seq = torch.randint(0, V, (B, T + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class _Impl:
    """One implementation's model + optimizer on this rank; `step(batch)` returns the loss (a tensor)."""

    note = ""
    kind = ""

    def step(self, batch):  # pragma: no cover - overridden
        raise NotImplementedError


def _functional(model: str, cfg: dict):
    """The benchmark model as shardfn sees it: (apply, params, loss_fn)."""
    import shardfn as sf

    net = _build(model, cfg)
    crit = _criterion(model)
    apply, params = sf.functionalize(net, units=cfg["units"])

    def loss_fn(params, batch):
        x, y = batch
        return crit(apply(params, x), y)

    return apply, params, loss_fn


class _Shardfn(_Impl):
    def __init__(self, model: str, cfg: dict, strategy: str, compile: bool | str = False):
        import shardfn as sf

        self.kind = "shardfn"
        apply, params, loss_fn = _functional(model, cfg)
        mesh = sf.mesh(dp=-1)
        opt = sf.optim.adamw(cfg["lr"], weight_decay=cfg["weight_decay"])
        self.ts = sf.train_step(loss_fn, opt, mesh, strategy=strategy, remat=cfg["remat"], apply=apply, compile=compile)
        self.state = self.ts.init(params)
        del params

    def step(self, batch):
        self.state, metrics = self.ts(self.state, batch)
        return metrics["loss"]  # already the mean over ranks


class _Torch(_Impl):
    def __init__(self, model: str, cfg: dict, kind: str, comm_hook=None, compile: bool = False):
        import torch
        import torch.distributed as dist

        self.kind = kind
        net = _build(model, cfg)
        self.crit = _criterion(model)
        if kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            if compile:  # torchtitan's recipe: each block compiled whole, then sharded (FSDP2's hooks stay eager)
                for i, block in enumerate(net.blocks):
                    net.blocks[i] = torch.compile(block, fullgraph=True)
            for block in net.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(net, mesh=mesh)
            self.net = net
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            import inspect

            # Buffers are constant here (GPT's mask and positions): no per-forward buffer broadcast.
            sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters else {"broadcast_buffers": False}
            self.net = DDP(net, gradient_as_bucket_view=True, **sync)
            if comm_hook is not None:
                self.net.register_comm_hook(*comm_hook)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"], fused=True)
        if compile and kind == "ddp":  # DDP + torch.compile: dynamo splits the graph at DDP's buckets
            self.net = torch.compile(self.net)

    def step(self, batch):
        x, y = batch
        self.opt.zero_grad(set_to_none=True)
        loss = self.crit(self.net(x), y)
        loss.backward()
        self.opt.step()
        return loss.detach()  # this rank's loss; the parent averages over ranks


class _ShardfnByHand(_Impl):
    """The step a user writes: sf.value_and_grad, then sf.optim.adamw's in-place update."""

    def __init__(self, model: str, cfg: dict):
        import shardfn as sf

        self.kind = "shardfn"
        apply, params, loss_fn = _functional(model, cfg)
        mesh = sf.mesh(dp=-1)
        self.opt = sf.optim.adamw(cfg["lr"], weight_decay=cfg["weight_decay"])
        self.grad_fn = sf.value_and_grad(loss_fn, remat=cfg["remat"], apply=apply)
        self.params = sf.shard(params, sf.specs(params, mesh), mesh)
        self.opt_state = self.opt.init(self.params)
        del params

    def step(self, batch):
        loss, grads = self.grad_fn(self.params, batch)
        self.opt_state = self.opt.step_(grads, self.opt_state, self.params)
        return loss  # the mean over ranks


class _StepGraph(_Impl):
    """A prototype of the step as one graph, as SimpleFSDP (arXiv 2411.00284) builds it, in plain torch:
    each parameter a DTensor split on dim 0 over the ranks; the forward gathers it (`redistribute`
    to Replicate, then `to_local(grad_placements=[Partial()])`, whose backward reduce-scatters the
    gradient); selective checkpointing recomputes the gathers in the backward (full_shard's memory:
    no full parameter is saved for it); Inductor compiles the forward and its backward whole, and
    buckets the all-gathers and the reduce-scatters (`bucket_all_gathers_fx`,
    `bucket_reduce_scatters_fx`) and reorders them against compute; AdamW (fused) updates the
    shards. Not shardfn: a measure of what a whole-step graph could gain over compiled units."""

    note = ("step_graph: a prototype in plain torch (SimpleFSDP's design): its collectives are functional ones "
            "inside the compiled graph, which no Python patch sees, so its bytes are not counted")

    def __init__(self, model: str, cfg: dict):
        import functools

        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
        from torch.func import functional_call
        from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

        self.kind = "step_graph"
        net = _build(model, cfg)
        self.crit = _criterion(model)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        self.params = {k: distribute_tensor(v.detach(), mesh, [Shard(0)]).requires_grad_() for k, v in net.named_parameters()}
        empty: dict[int, torch.nn.Parameter] = {}  # one stand-in per parameter: tied ones stay tied
        for mod in net.modules():  # the module keeps its buffers; its parameters come from `self.params`
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    mod._parameters[name] = empty.setdefault(id(p), torch.nn.Parameter(torch.empty(0), requires_grad=False))
        gathers = (torch.ops._c10d_functional.all_gather_into_tensor.default, torch.ops._c10d_functional.wait_tensor.default)

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_RECOMPUTE if op in gathers else CheckpointPolicy.MUST_SAVE

        def gathered(params, x, y):
            full = {k: v.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()]) for k, v in params.items()}
            return self.crit(functional_call(net, full, (x,)), y)

        def loss(params, x, y):
            return checkpoint(gathered, params, x, y, use_reentrant=False,
                              context_fn=functools.partial(create_selective_checkpoint_contexts, policy))

        self.loss = torch.compile(loss, options={"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all",
                                                 "reorder_for_compute_comm_overlap": True})
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=cfg["lr"], weight_decay=cfg["weight_decay"], fused=True)
        self.world = dist.get_world_size()

    def step(self, batch):
        x, y = batch
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(self.params, x, y)
        (loss / self.world).backward()  # the reduce-scatter sums the ranks' gradients: the mean, as DDP's
        self.opt.step()
        return loss.detach()  # this rank's loss; the parent averages over ranks


def _make(impl: str, model: str, cfg: dict, **kw) -> _Impl:
    if impl == "step_graph":
        return _StepGraph(model, cfg)
    if impl == "shardfn_vg":
        return _ShardfnByHand(model, cfg)
    if impl in STRATEGY:
        return _Shardfn(model, cfg, STRATEGY[impl])
    if impl == "shardfn_compile":
        return _Shardfn(model, cfg, "full_shard", compile=True)
    if impl == "shardfn_step":
        return _Shardfn(model, cfg, "full_shard", compile="step")
    if impl in COMPILED:
        return _Torch(model, cfg, impl.removesuffix("_compile"), compile=True, **kw)
    return _Torch(model, cfg, impl, **kw)


# -- counting the collectives that go through Python ----------------------------------------------
_PATCHED = (
    "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather_single", "reduce_scatter_single",
    "_reduce_scatter_base", "_all_gather_base", "all_gather", "reduce_scatter", "broadcast", "all_to_all_single",
    "all_to_all", "all_reduce_coalesced", "all_gather_coalesced", "reduce", "gather", "scatter", "send", "recv",
    "isend", "irecv", "barrier",
)


class _CommLog:
    """Wraps torch.distributed collectives; while `active`, logs each outermost call and its ring bytes."""

    def __init__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        import shardfn._collectives as C

        self.active = False
        self.depth = 0
        self.calls: list[tuple[str, int, int, str]] = []  # (name, input numel, output numel, dtype)
        self.bytes = 0
        self.names: dict[str, int] = {}
        self.world = dist.get_world_size()
        for name in _PATCHED:
            for mod in (dist, c10d):
                fn = getattr(mod, name, None)
                if fn is not None and not getattr(fn, "_bench_wrapped", False):
                    setattr(mod, name, self._wrap(name, fn))
        # shardfn's own entry points, outermost: on gloo they run as point-to-point messages
        # (Note [gloo collectives]), which the floor replays through the same functions.
        for name in ("all_gather", "all_gather_pieces", "reduce_scatter", "all_reduce"):
            fn = getattr(C, name)
            if not getattr(fn, "_bench_wrapped", False):
                setattr(C, name, self._wrap("shardfn." + name, fn))

    def _wrap(self, name, fn):
        import threading

        def wrapper(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                return fn(*args, **kwargs)  # shardfn's poster thread: inside a call already logged
            outer = self.depth == 0
            if self.active and outer and name != "barrier":
                self._record(name, args, kwargs)
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        wrapper._bench_wrapped = True
        return wrapper

    def _record(self, name, args, kwargs):
        import torch

        ts = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        lists = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
        nb = lambda t: t.numel() * t.element_size()  # noqa: E731
        W = self.world
        if name == "shardfn.all_gather_pieces":  # [(out, inp), ...]: one collective of several buffers
            pieces = args[0]
            self.calls.append((name, tuple(i.numel() for _, i in pieces), tuple(o.numel() for o, _ in pieces), str(pieces[0][1].dtype)))
            self.bytes += sum(nb(o) * (W - 1) // W for o, _ in pieces)
            self.names[name] = self.names.get(name, 0) + 1
            return
        if name in ("all_gather_into_tensor", "all_gather_single", "_all_gather_base", "shardfn.all_gather"):
            out, inp = ts[0], ts[1]
            sent = nb(out) * (W - 1) // W
        elif name in ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "shardfn.reduce_scatter"):
            out, inp = ts[0], ts[1]
            sent = nb(inp) * (W - 1) // W
        elif name in ("all_reduce", "shardfn.all_reduce"):
            out = inp = ts[0]
            sent = 2 * nb(inp) * (W - 1) // W
        else:  # rare here: count the tensors' bytes once
            flat = ts + [t for lst in lists for t in lst]
            out = inp = flat[0] if flat else torch.empty(0)
            sent = sum(nb(t) for t in flat)
        self.calls.append((name, inp.numel(), out.numel(), str(inp.dtype)))
        self.bytes += sent
        self.names[name] = self.names.get(name, 0) + 1


def profile(model: str, impl: str, cfg: dict) -> dict:
    """A short run of one implementation in a fresh process: peak memory, bytes sent, collectives."""
    import torch.distributed as dist

    import shardfn._collectives as C

    rank = dist.get_rank()
    rss_start = status_kb("VmRSS")
    log = _CommLog()
    it = _make(impl, model, cfg)
    step_i = 0
    for _ in range(cfg["mem_warmup"]):
        it.step(_batch(model, cfg, step_i, rank))
        step_i += 1
    batches = [_batch(model, cfg, step_i + i, rank) for i in range(cfg["mem_steps"])]  # made before the reset
    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base_kb = status_kb("VmHWM")  # right at the reset (= VmRSS then)
    rss_at_reset = status_kb("VmRSS")
    C.STATS.reset()
    log.active = True
    first_step_calls = None
    losses = []
    for b in batches:
        n0 = len(log.calls)
        losses.append(float(it.step(b)))
        if first_step_calls is None:
            first_step_calls = log.calls[n0:]
    log.active = False
    hwm_kb = status_kb("VmHWM")
    n = cfg["mem_steps"]
    out = dict(
        rank=rank,
        rss_start_mb=rss_start / 1024,
        base_mb=base_kb / 1024,
        rss_at_reset_mb=rss_at_reset / 1024,
        hwm_mb=hwm_kb / 1024,
        growth_mb=(hwm_kb - base_kb) / 1024,
        py_bytes_per_step=log.bytes / n,
        py_names={k: v / n for k, v in log.names.items()},
        calls=first_step_calls or [],
        sf_bytes_per_step=sum(C.STATS.bytes_sent.values()) / n,
        sf_calls_per_step={k: v / n for k, v in C.STATS.calls.items()},
        note=it.note,
        losses=losses,
        local_param_mb=None,
    )
    if impl in STRATEGY:
        # This rank's shard of each leaf (public API: the DTensors' local tensors), for the optimizer
        # part of the floor: shardfn's fused AdamW runs over exactly these.
        import optree

        local = [x.to_local() for x in optree.tree_leaves(it.state.params)]
        out["local_param_mb"] = sum(t.numel() * t.element_size() for t in local) / 2**20
        out["shard_numels"] = [t.numel() for t in local if t.numel()]
    del it, batches
    gc.collect()
    if impl in ("ddp", "ddp_compile"):
        # DDP's reducer all-reduces its buckets from C++; a comm hook sees every bucket it sends.
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        seen = {"bytes": 0, "buckets": 0, "count": False}
        W = dist.get_world_size()

        def hook(state, bucket):
            if state["count"]:
                buf = bucket.buffer()
                state["bytes"] += 2 * buf.numel() * buf.element_size() * (W - 1) // W
                state["buckets"] += 1
            return default_hooks.allreduce_hook(None, bucket)

        d = _make(impl, model, cfg, comm_hook=(seen, hook))
        d.step(_batch(model, cfg, 0, rank))  # the first step rebuilds the buckets
        seen["count"] = True
        d.step(_batch(model, cfg, 1, rank))
        out["ddp_hook_bytes_per_step"] = seen["bytes"]
        out["ddp_buckets_per_step"] = seen["buckets"]
        out["param_bytes"] = sum(p.numel() * p.element_size() for p in d.net.parameters())
        del d
    return out


_IMPLS: dict[str, _Impl] = {}
_STEP: dict[str, int] = {}


def setup(model: str, impls: list[str], cfg: dict) -> dict:
    """Builds every implementation on this rank (the timing pool keeps them all)."""
    import torch.distributed as dist

    _IMPLS.clear()
    _STEP.clear()
    gc.collect()
    for impl in impls:
        _IMPLS[impl] = _make(impl, model, cfg)
        _STEP[impl] = 0
    dist.barrier()
    return {impl: it.note for impl, it in _IMPLS.items()}


def run_round(model: str, impl: str, warmup: int, steps: int, cfg: dict) -> dict:
    """WARMUP untimed then STEPS timed steps of one implementation; a barrier before each step."""
    import torch.distributed as dist

    rank = dist.get_rank()
    it = _IMPLS[impl]
    times, losses, first = [], [], None
    for i in range(warmup + steps):
        b = _batch(model, cfg, _STEP[impl], rank)
        is_first = _STEP[impl] == 0
        _STEP[impl] += 1
        dist.barrier()
        t0 = time.perf_counter()
        loss = it.step(b)
        t1 = time.perf_counter()
        losses.append(float(loss))
        if is_first:
            first = t1 - t0  # a compiled implementation's compile is in it
        if i >= warmup:
            times.append(t1 - t0)
    return dict(times=times, losses=losses, first=first)


def teardown() -> None:
    _IMPLS.clear()
    gc.collect()


def floor(model: str, calls: list, shard_numels: list[int], cfg: dict) -> dict:
    """Times the parts of the floor on every rank: bare collectives, compute alone, optimizer alone."""
    import torch
    import torch.distributed as dist

    reps = cfg["floor_reps"]
    rank = dist.get_rank()
    dt = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16, "torch.int32": torch.int32}

    def make(n: int, dtype: str):
        return torch.randn(n, dtype=dt[dtype]) if dt[dtype].is_floating_point else torch.zeros(n, dtype=dt[dtype])

    def timed(fn) -> list[float]:
        fn()  # warm-up
        out = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    # 1. The collectives of one shardfn step, same sizes and order, synchronous.
    bufs = []
    for name, n_in, n_out, dtype in calls:
        if name == "shardfn.all_gather_pieces":
            pieces = [(torch.empty(o, dtype=dt[dtype]), make(i, dtype)) for i, o in zip(n_in, n_out)]
            bufs.append((name, pieces, None))
        else:
            bufs.append((name, make(n_in, dtype), torch.empty(n_out, dtype=dt[dtype])))

    import shardfn._collectives as C

    group = dist.group.WORLD

    def comm():
        for name, inp, out in bufs:
            if name == "shardfn.all_gather":  # the functions shardfn called, synchronous
                C.all_gather(out, inp, group, async_op=False)
            elif name == "shardfn.all_gather_pieces":
                C.all_gather_pieces(inp, group).wait()
            elif name == "shardfn.reduce_scatter":
                C.reduce_scatter(out, inp, group, async_op=False, scratch=True)
            elif name == "shardfn.all_reduce":
                C.all_reduce(inp, group)
            elif name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base",
                        "reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"):
                getattr(dist, name)(out, inp)  # the same function shardfn called, synchronous
            elif name == "all_reduce":
                dist.all_reduce(inp)
            else:
                raise RuntimeError(f"floor: no replay for {name}")

    t_comm = timed(comm)
    bufs.clear()
    gc.collect()

    # 2. Forward + backward of the unsharded plain module on one rank's batch: no communication.
    net = _build(model, cfg)
    crit = _criterion(model)
    x, y = _batch(model, cfg, 0, rank)

    def compute():
        net.zero_grad(set_to_none=True)
        crit(net(x), y).backward()

    t_compute = timed(compute)
    net = None  # noqa: F841 (frees the model before the next part)
    gc.collect()

    # 3. The optimizer alone: torch._fused_adamw_ over this rank's shard of every leaf.
    ps = [torch.randn(n) * 0.02 for n in shard_numels]
    gs = [torch.randn(n) * 1e-3 for n in shard_numels]
    ms = [torch.zeros(n) for n in shard_numels]
    vs = [torch.zeros(n) for n in shard_numels]
    steps = [torch.zeros(()) for _ in shard_numels]

    def optim():
        for s in steps:
            s.add_(1)
        torch._fused_adamw_(ps, gs, ms, vs, [], steps, lr=cfg["lr"], beta1=0.9, beta2=0.999,
                            weight_decay=cfg["weight_decay"], eps=1e-8, amsgrad=False, maximize=False)

    with torch.no_grad():
        t_opt = timed(optim)
    return dict(comm=t_comm, compute=t_compute, optim=t_opt)


def torch_profile(model: str, impl: str, cfg: dict, steps: int) -> str:
    """torch.profiler over a few steps of one implementation; rank 0 returns the top of the table."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    it = _make(impl, model, cfg)
    for i in range(2):
        it.step(_batch(model, cfg, i, rank))
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            it.step(_batch(model, cfg, 2 + i, rank))
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25) if rank == 0 else ""


# ==================================================================================================
# Parent side
# ==================================================================================================
class _Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: float):
        self.total, self.done, self.t0 = total, 0.0, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, amount: float, what: str) -> None:
        self.done += amount
        el = time.perf_counter() - self.t0
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        eta = el / frac - el if frac > 0 else float("nan")
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        line = f"[{bar}] {100 * frac:5.1f}%  {el:6.0f}s elapsed, ~{eta:4.0f}s left  {what}"
        if self.tty:
            sys.stderr.write("\r" + line[:150].ljust(150))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _fmt(x: float, nd: int = 0) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _malloc_env(value: str) -> None:
    """Sets MALLOC_MMAP_THRESHOLD_ for the ranks spawned next ('none': unset)."""
    if value == "none":
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    else:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = value


def _version() -> str:
    """The commit of the repository this file is in, and whether shardfn/ has uncommitted changes."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "--no-optional-locks", "-C", root, "status", "--porcelain", "--", "shardfn"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "(commit unknown)"
    return f"at commit {head or '?'}" + (" + uncommitted changes in shardfn/" if dirty else "")


def _cfg(args) -> dict:
    return dict(
        seed=args.seed, lr=args.lr, weight_decay=args.weight_decay, units=UNITS, remat=args.remat,
        mem_warmup=args.mem_warmup, mem_steps=args.mem_steps, floor_reps=args.floor_reps,
        mlp_d=args.mlp_d, mlp_layers=args.mlp_layers, mlp_batch=args.mlp_batch,
        gpt_vocab=args.gpt_vocab, gpt_block=args.gpt_block, gpt_layers=args.gpt_layers, gpt_heads=args.gpt_heads,
        gpt_d=args.gpt_d, gpt_batch=args.gpt_batch,
        deep_vocab=args.deep_vocab, deep_block=args.deep_block, deep_layers=args.deep_layers, deep_heads=args.deep_heads,
        deep_d=args.deep_d, deep_batch=args.deep_batch,
    )


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=MODELS, help="comma-separated: mlp,gpt,deep")
    p.add_argument("--world", type=int, default=WORLD)
    p.add_argument("--impls", default=IMPLS, help="comma-separated: shardfn,shardfn_vg,shardfn_no_shard,fsdp2,ddp, "
                   "and compiled: shardfn_compile,shardfn_step,fsdp2_compile,ddp_compile, and step_graph (the whole step as one "
                   "graph, a plain-torch prototype of SimpleFSDP's design)")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--warmup", type=int, default=WARMUP)
    p.add_argument("--mem-warmup", type=int, default=MEM_WARMUP)
    p.add_argument("--mem-steps", type=int, default=MEM_STEPS)
    p.add_argument("--floor-reps", type=int, default=FLOOR_REPS)
    p.add_argument("--remat", action="store_true", default=REMAT)
    p.add_argument("--out", default=OUT, help="the PNG ('' for none)")
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument("--malloc-mmap-threshold", default=MALLOC_MMAP_THRESHOLD,
                   help="MALLOC_MMAP_THRESHOLD_ for the memory runs' ranks, or 'none' to leave glibc's default")
    p.add_argument("--timing-malloc-mmap-threshold", default=TIMING_MALLOC_MMAP_THRESHOLD,
                   help="MALLOC_MMAP_THRESHOLD_ for the timing ranks: 'same' (as --malloc-mmap-threshold), a value, or 'none'")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--weight-decay", type=float, default=WEIGHT_DECAY)
    p.add_argument("--loss-rtol", type=float, default=LOSS_RTOL)
    p.add_argument("--mlp-d", type=int, default=MLP_D)
    p.add_argument("--mlp-layers", type=int, default=MLP_LAYERS)
    p.add_argument("--mlp-batch", type=int, default=MLP_BATCH)
    p.add_argument("--gpt-vocab", type=int, default=GPT_VOCAB)
    p.add_argument("--gpt-block", type=int, default=GPT_BLOCK)
    p.add_argument("--gpt-layers", type=int, default=GPT_LAYERS)
    p.add_argument("--gpt-heads", type=int, default=GPT_HEADS)
    p.add_argument("--gpt-d", type=int, default=GPT_D)
    p.add_argument("--gpt-batch", type=int, default=GPT_BATCH)
    p.add_argument("--deep-vocab", type=int, default=DEEP_VOCAB)
    p.add_argument("--deep-block", type=int, default=DEEP_BLOCK)
    p.add_argument("--deep-layers", type=int, default=DEEP_LAYERS)
    p.add_argument("--deep-heads", type=int, default=DEEP_HEADS)
    p.add_argument("--deep-d", type=int, default=DEEP_D)
    p.add_argument("--deep-batch", type=int, default=DEEP_BATCH)
    p.add_argument("--profile", default="", help="IMPL: also print torch.profiler's top ops for rank 0 of IMPL (per model)")
    a = p.parse_args()
    a.models = [m for m in a.models.split(",") if m]
    a.impls = [i for i in a.impls.split(",") if i]
    for m in a.models:
        if m not in ("mlp", "gpt", "deep"):
            p.error(f"unknown model {m!r}")
    for i in a.impls:
        if i not in NAMES:
            p.error(f"unknown implementation {i!r}; choose from {','.join(NAMES)}")
    return a


def main() -> None:
    args = _parse()
    # Inherited by every spawned rank: allocations over 64 KiB are mmapped, so freed tensors leave RSS.
    # Spawned ranks inherit os.environ; _malloc_env sets it before each pool is started.
    mem_env = args.malloc_mmap_threshold
    time_env = mem_env if args.timing_malloc_mmap_threshold == "same" else args.timing_malloc_mmap_threshold
    args.mem_env, args.time_env = mem_env, time_env
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
    import torch

    from shardfn._pool import RankPool

    cfg = _cfg(args)
    W = args.world
    t_start = time.perf_counter()
    sf_impls = [i for i in args.impls if i in STRATEGY]
    n_floor = len(sf_impls)
    # Progress in rough "step units": profile runs count as their steps plus a start-up.
    per_model = len(args.impls) * (args.mem_warmup + args.mem_steps + 6) + args.rounds * len(args.impls) * (args.warmup + args.steps) + args.rounds * n_floor * 3
    bar = _Progress(per_model * len(args.models))

    print(f"# shardfn {_version()}")
    print(f"# shardfn benchmark: world {W}, {args.threads} torch thread(s) per rank, torch {torch.__version__}, "
          f"MALLOC_MMAP_THRESHOLD_: memory runs {mem_env}, timing runs {time_env}")
    print(f"# {args.rounds} rounds x ({args.warmup} warm-up + {args.steps} timed) steps per implementation; "
          f"memory: fresh ranks per implementation, {args.mem_warmup} warm-up + {args.mem_steps} measured steps")
    res: dict[str, dict[str, dict]] = {}
    floors: dict[str, dict[str, dict]] = {}
    notes: list[str] = []
    profiles: dict[str, str] = {}
    for model in args.models:
        res[model] = {i: {} for i in args.impls}
        # 1. Profile runs: a fresh pool per implementation.
        for impl in args.impls:
            _malloc_env(mem_env)
            with RankPool(W, timeout=POOL_TIMEOUT, threads=args.threads) as pool:
                out = pool.run(profile, model, impl, cfg)
            r = res[model][impl]
            r["profile"] = out
            r["growth_mb"] = max(o["growth_mb"] for o in out)
            r["hwm_mb"] = max(o["hwm_mb"] for o in out)
            if impl in STRATEGY or impl in ("shardfn_vg", "shardfn_compile"):
                r["sent_mb"] = max(o["sf_bytes_per_step"] for o in out) / 1e6
                r["sent_how"] = "shardfn STATS"
            elif impl in ("ddp", "ddp_compile"):
                r["sent_mb"] = max(o["ddp_hook_bytes_per_step"] + o["py_bytes_per_step"] for o in out) / 1e6
                r["sent_how"] = (f"comm hook: {out[0]['ddp_buckets_per_step']} bucket(s) all-reduced "
                                 f"(+ Python-visible: {out[0]['py_names'] or 'none'})")
            elif impl in ("step_graph", "shardfn_step"):
                r["sent_mb"] = float("nan")
                r["sent_how"] = "functional collectives inside the compiled graph: not counted"
            else:
                r["sent_mb"] = max(o["py_bytes_per_step"] for o in out) / 1e6
                r["sent_how"] = f"patched torch.distributed: {out[0]['py_names']}"
            for o in out:
                if o["note"] and o["note"] not in notes:
                    notes.append(o["note"])
            bar.update(args.mem_warmup + args.mem_steps + 6, f"{model}: memory/bytes run of {impl}")
        # 2. Timing: one pool with every implementation, alternating in rounds.
        _malloc_env(time_env)
        with RankPool(W, timeout=POOL_TIMEOUT, threads=args.threads) as pool:
            pool.run(setup, model, args.impls, cfg)
            floors_raw = {i: {"calls": res[model][i]["profile"][0]["calls"], "raw": {"comm": [], "compute": [], "optim": []}} for i in sf_impls}
            for rnd in range(args.rounds):
                for impl in args.impls:
                    out = pool.run(run_round, model, impl, args.warmup, args.steps, cfg)
                    r = res[model][impl]
                    step_max = [max(ts) for ts in zip(*(o["times"] for o in out))]
                    r.setdefault("times", []).extend(step_max)
                    r.setdefault("round_medians", []).append(_median(step_max))
                    mean_loss = [sum(ls) / W for ls in zip(*(o["losses"] for o in out))]
                    r.setdefault("losses", []).extend(mean_loss)
                    if out[0]["first"] is not None:
                        r["first_ms"] = 1000 * max(o["first"] for o in out)
                    bar.update(args.warmup + args.steps, f"{model}: round {rnd + 1}/{args.rounds} {impl}")
                # 3. The floor of each shardfn strategy, in the same rounds (so the same noise hits it).
                for impl in sf_impls:
                    prof = res[model][impl]["profile"][0]
                    out = pool.run(floor, model, prof["calls"], prof["shard_numels"], cfg)
                    for k in ("comm", "compute", "optim"):
                        floors_raw[impl]["raw"][k].extend(max(v) for v in zip(*(o[k] for o in out)))
                    bar.update(3, f"{model}: round {rnd + 1}/{args.rounds} floor of {impl}")
            pool.run(teardown)
            floors[model] = {k: {kk: vv for kk, vv in v.items() if kk != "raw"} for k, v in floors_raw.items()}
            for impl, parts in floors[model].items():
                for k in ("comm", "compute", "optim"):
                    raw = floors_raw[impl]["raw"][k]
                    parts[k] = _median(raw)
                    parts[k + "_range"] = (min(raw), max(raw)) if raw else (float("nan"),) * 2
            if args.profile:
                profiles[model] = pool.run(torch_profile, model, args.profile, cfg, 3)[0]
        for impl in args.impls:
            r = res[model][impl]
            r["median_ms"] = 1000 * _median(r["times"])
    bar.close()
    wall = time.perf_counter() - t_start
    _report(args, res, floors, notes, profiles, wall)


def _report(args, res, floors, notes, profiles, wall) -> None:
    print()
    print("## Results")
    print()
    print(f"Median step time (max over ranks, {args.rounds * args.steps} timed steps), peak RSS per rank "
          f"(max over ranks), MB sent per step per rank; ratios are this row / FSDP2 and this row / DDP.")
    print()
    print("| model | implementation | median step ms | peak RSS growth MB | abs VmHWM MB | MB sent/step | "
          "time / FSDP2 | time / DDP | memory / FSDP2 (growth, abs) | memory / DDP (growth, abs) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model, rows in res.items():
        f, d = rows.get("fsdp2"), rows.get("ddp")
        for impl, r in rows.items():
            def ratio(key, ref):
                return _fmt(r[key] / ref[key], 2) if ref is not None and ref is not r else "-"

            def mem(ref):
                return f"{ratio('growth_mb', ref)}, {ratio('hwm_mb', ref)}" if ref is not None and ref is not r else "-"

            print(f"| {model.upper()} | {NAMES[impl]} | {_fmt(r['median_ms'])} | {_fmt(r['growth_mb'])} | "
                  f"{_fmt(r['hwm_mb'])} | {_fmt(r['sent_mb'], 1)} | {ratio('median_ms', f)} | {ratio('median_ms', d)} | "
                  f"{mem(f)} | {mem(d)} |")
    compiled = [(m, i) for m, rows in res.items() for i in rows if i in COMPILED]
    if compiled:
        print()
        print("Compiled against eager (Inductor): the first step (compiling, max over ranks), and the "
              "eager step / compiled step speed-up of each pair.")
        print()
        print("| model | implementation | first step s | median step ms | eager / compiled |")
        print("|---|---|---:|---:|---:|")
        for model, impl in compiled:
            rows = res[model]
            eager = rows.get(impl.removesuffix("_compile") if impl not in ("shardfn_compile", "shardfn_step") else "shardfn")
            speed = _fmt(eager["median_ms"] / rows[impl]["median_ms"], 2) if eager is not None else "-"
            print(f"| {model.upper()} | {NAMES[impl]} | {_fmt(rows[impl].get('first_ms', float('nan')) / 1000, 1)} | "
                  f"{_fmt(rows[impl]['median_ms'])} | {speed} |")
    print()
    print("Per-round median step ms (noise check):")
    print()
    for model, rows in res.items():
        for impl, r in rows.items():
            print(f"- {model.upper()} {NAMES[impl]}: " + ", ".join(_fmt(1000 * x) for x in r["round_medians"]))
    print()
    print("How bytes were counted:")
    print()
    for model, rows in res.items():
        for impl, r in rows.items():
            print(f"- {model.upper()} {NAMES[impl]}: {r['sent_how']}")
    print()
    print("Memory per rank (MB): RSS at process start of the profile run / at the VmHWM reset / VmHWM after the steps:")
    print()
    for model, rows in res.items():
        for impl, r in rows.items():
            per = "; ".join(f"rank {o['rank']}: {o['rss_start_mb']:.0f} / {o['base_mb']:.0f} / {o['hwm_mb']:.0f}" for o in r["profile"])
            print(f"- {model.upper()} {NAMES[impl]}: {per}")

    # Losses side by side.
    print()
    print("## Losses (mean over ranks) after the timed steps")
    print()
    print("| model | " + " | ".join(NAMES[i] for i in args.impls) + " | max rel. diff, all steps | ok |")
    print("|---|" + "---:|" * len(args.impls) + "---:|---|")
    loss_ok = True
    for model, rows in res.items():
        seqs = [rows[i]["losses"] for i in args.impls]
        ref = seqs[0]
        diff = max((abs(a - b) / max(abs(b), 1e-12) for s in seqs[1:] for a, b in zip(s, ref)), default=0.0)
        ok = diff <= args.loss_rtol
        loss_ok &= ok
        print(f"| {model.upper()} | " + " | ".join(f"{s[-1]:.7f}" for s in seqs) + f" | {diff:.1e} | {'yes' if ok else 'NO'} |")
    if not loss_ok:
        print()
        print(f"WARNING: the implementations' losses differ by more than {args.loss_rtol:g} relative.")
    # Memory-run losses (first steps) should also agree: they ran the same batches in separate processes.

    if floors:
        print()
        print("## The floor: bare collectives + compute alone + optimizer alone (no overlap)")
        print()
        print(f"Medians of {args.rounds} rounds x {args.floor_reps} repetitions (max over ranks), [min-max] beside them.")
        print()
        print("| model | strategy | collectives replayed | comm ms | fwd+bwd ms | optimizer ms | floor ms | shardfn ms | shardfn / floor |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|")
        for model, fl in floors.items():
            for impl, p in fl.items():
                fl_ms = 1000 * (p["comm"] + p["compute"] + p["optim"])
                p["floor_ms"] = fl_ms
                counts: dict[str, int] = {}
                for c in p["calls"]:
                    counts[c[0]] = counts.get(c[0], 0) + 1
                desc = ", ".join(f"{n} x{k}" for n, k in counts.items())
                sf_ms = res[model][impl]["median_ms"]
                def part(k):
                    lo, hi = p[k + "_range"]
                    return f"{_fmt(1000 * p[k])} [{_fmt(1000 * lo)}-{_fmt(1000 * hi)}]"

                print(f"| {model.upper()} | {STRATEGY[impl]} | {desc} | {part('comm')} | {part('compute')} | "
                      f"{part('optim')} | {_fmt(fl_ms)} | {_fmt(sf_ms)} | {_fmt(sf_ms / fl_ms, 2)} |")
    for n in notes:
        print(f"\nNote: {n}")
    for model, txt in profiles.items():
        print(f"\n## torch.profiler, rank 0, {NAMES[args.profile]}, {model.upper()}, 3 steps\n\n```\n{txt}\n```")
    print(f"\nWall time: {wall:.0f} s")
    if args.out:
        _plot(args, res, floors, args.out)
        print(f"Plot: {args.out}")


def _plot(args, res, floors, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(res)
    impls = args.impls
    colors = {"shardfn": "#1f77b4", "shardfn_vg": "#08306b", "shardfn_no_shard": "#6baed6", "fsdp2": "#ff7f0e", "ddp": "#2ca02c"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    width = 0.8 / len(impls)
    for ax, key, title in ((axes[0], "median_ms", "median step time (ms)"), (axes[1], "hwm_mb", "peak RSS per rank (MB)")):
        for j, impl in enumerate(impls):
            xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(models))]
            vals = [res[m][impl][key] for m in models]
            ax.bar(xs, vals, width, label=NAMES[impl], color=colors.get(impl, f"C{4 + j}"), alpha=0.45 if key == "hwm_mb" else 1.0)
            if key == "hwm_mb":
                grow = [res[m][impl]["growth_mb"] for m in models]
                ax.bar(xs, grow, width * 0.6, color=colors.get(impl, f"C{4 + j}"), edgecolor="black", linewidth=0.5)
                for x, g in zip(xs, grow):
                    ax.text(x, g, f"{g:.0f}", ha="center", va="bottom", fontsize=7)
            for x, v in zip(xs, vals):
                ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
            if key == "median_ms":
                for mi, m in enumerate(models):
                    if impl in floors.get(m, {}):
                        fl = floors[m][impl]["floor_ms"]
                        ax.plot([xs[mi] - width / 2, xs[mi] + width / 2], [fl, fl], color="black", linewidth=1.5)
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels([m.upper() for m in models])
        ax.set_title(title)
        ax.set_ylim(0, 1.3 * max(res[m][i][key] for m in models for i in impls))
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper right", ncol=2)
    axes[0].set_xlabel("black line: the floor (bare collectives + compute + optimizer, no overlap)", fontsize=8)
    axes[1].set_xlabel("light bar: absolute VmHWM; dark narrow bar: growth during the measured steps", fontsize=8)
    fig.suptitle(f"shardfn vs FSDP2 vs DDP, world {args.world}, CPU/gloo, {args.threads} thread/rank, "
                 f"{args.rounds}x{args.steps} timed steps, MALLOC_MMAP_THRESHOLD_ {args.time_env} (timing) / {args.mem_env} (memory)",
                 fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
