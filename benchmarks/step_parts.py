"""Where a step's time goes: timers around the parts of one implementation's step, inside its ranks.

`bench.py` times whole steps; this script splits them. It builds the same models and
implementations as `bench.py` (its `_make`, `_batch` and settings), wraps the parts of a step in
timers inside every rank (wall and thread CPU time per call), counts the garbage collector's passes
and the whole process's CPU time, page faults and context switches per step, and prints, for rank 0, each part's calls per step, median time per call and total per step.

    .venv/bin/python benchmarks/step_parts.py                       # DEEP, shardfn and DDP, world 2
    .venv/bin/python benchmarks/step_parts.py --model mlp --impls shardfn,fsdp2,ddp

The timers cost a few microseconds per call, so parts called thousands of times per step read a
little high. Parts nest (the loss function holds the units' forward hooks; the backward holds the
backward hooks and the waits for collectives): the rows do not add up to the step.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def _timed(table: dict, obj, name: str, key: str) -> None:
    f = getattr(obj, name)

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return f(*args, **kwargs)
        finally:
            table[key].append((time.perf_counter() - t0, time.thread_time() - c0))

    setattr(obj, name, wrapper)


def _parts(table: dict, impl: str, it) -> None:
    """Timers on the parts of `it`'s step (an implementation `bench._make` built)."""
    import torch

    import bench

    _timed(table, type(it), "step", "step")
    _timed(table, torch.autograd, "backward", "backward")
    if impl.startswith("shardfn"):
        from shardfn import _core, _engine, _train

        _timed(table, _core.GradientCore, "gradients", "gradients (forward, backward, reductions)")
        _timed(table, _engine.Engine, "begin", "engine: begin (root gather, first prefetch)")
        _timed(table, _engine.Engine, "end", "engine: end (last reductions, frees)")
        _timed(table, _engine.Engine, "pre_forward", "engine: unit pre-forward hook")
        _timed(table, _engine.Engine, "post_forward", "engine: unit post-forward hook")
        _timed(table, _engine.Engine, "_pre_backward", "engine: unit pre-backward hook")
        post = "use_over" if hasattr(_engine.Engine, "use_over") else "_post_backward"  # its name before 3670cdd
        _timed(table, _engine.Engine, post, "engine: unit post-backward")
        if isinstance(it, bench._Shardfn):
            _timed(table, _train.TrainStep, "_optimize", "optimizer update")
            _timed(table, _train.TrainStep, "_donate", "donation of the state")
            holder = type("Holder", (), {})()
            holder.fn = it.ts.core.loss_fn
            _timed(table, holder, "fn", "loss_fn (forward, with the unit hooks)")
            it.ts.core.loss_fn = lambda p, b: holder.fn(p, b)
    else:
        _timed(table, type(it.opt), "step", "optimizer step")
        _timed(table, type(it.opt), "zero_grad", "zero_grad")


def _perf_control(args, rank: int, command: str) -> None:
    """Rank 0 turns `perf record --control` on or off (cpu_split.py), and waits for its ack."""
    if rank != 0 or not args.perf_ctl:
        return
    ctl, ack = args.perf_ctl.split(",")
    with open(ctl, "w") as f:
        f.write(command + "\n")
    with open(ack) as f:
        f.readline()


def rank_main(rank: int, world: int, args, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import bench

    bench._quiet()
    sys.argv = [sys.argv[0]]  # bench.py's defaults
    cfg = bench._cfg(bench._parse())
    it = bench._make(args.impl, args.model, cfg)
    for i in range(args.warmup):
        it.step(bench._batch(args.model, cfg, i, rank))
    table: dict = collections.defaultdict(list)
    _parts(table, args.impl, it)
    passes = collections.Counter()
    seconds = collections.Counter()
    started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            passes[info["generation"]] += 1
            seconds[info["generation"]] += time.perf_counter() - started[0]

    gc.callbacks.append(on_gc)
    usage = collections.Counter()
    _perf_control(args, rank, "enable")
    for i in range(args.steps):
        b = bench._batch(args.model, cfg, args.warmup + i, rank)
        dist.barrier()
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        float(it.step(b))
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        usage["wall ms"] += 1000 * (t1 - t0)
        usage["user ms"] += 1000 * (r1.ru_utime - r0.ru_utime)
        usage["system ms"] += 1000 * (r1.ru_stime - r0.ru_stime)
        usage["page faults"] += r1.ru_minflt - r0.ru_minflt
        usage["context switches (voluntary)"] += r1.ru_nvcsw - r0.ru_nvcsw
        usage["context switches (involuntary)"] += r1.ru_nivcsw - r0.ru_nivcsw
    dist.barrier()
    _perf_control(args, rank, "disable")
    gc.callbacks.remove(on_gc)
    if rank == 0:
        rows = []
        for key, v in table.items():
            wall = sorted(x[0] for x in v)
            cpu = sorted(x[1] for x in v)
            rows.append((key, len(v) / args.steps, wall[len(wall) // 2], cpu[len(cpu) // 2], sum(wall) / args.steps, sum(cpu) / args.steps))
        gcs = {g: (passes[g] / args.steps, seconds[g] / args.steps) for g in sorted(passes)}
        queue.put((rows, gcs, {k: v / args.steps for k, v in usage.items()}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deep", choices=["mlp", "gpt", "deep"])
    p.add_argument("--impls", default="shardfn,ddp", help="any of bench.py's: shardfn, shardfn_vg, shardfn_no_shard, fsdp2, ddp")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--malloc-mmap-threshold", default="65536", help='as bench.py\'s timing ranks; "none": glibc\'s default')
    p.add_argument("--perf-ctl", default="", help="CTL,ACK: fifos of `perf record --control`, enabled around the timed steps (cpu_split.py)")
    args = p.parse_args()
    if args.malloc_mmap_threshold != "none":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = args.malloc_mmap_threshold
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import socket

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    print(f"# {args.model}, world {args.world}, {args.steps} steps after {args.warmup}, rank 0; MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold}")
    for impl in args.impls.split(","):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = ctx.SimpleQueue()
        run = argparse.Namespace(**{**vars(args), "impl": impl})
        mp.start_processes(rank_main, args=(args.world, run, port, queue), nprocs=args.world, start_method="spawn")
        rows, gcs, usage = queue.get()
        print(f"\n## {impl}\n")
        print("| part | calls / step | median ms / call (wall, CPU) | ms / step (wall, CPU) |")
        print("|---|---:|---:|---:|")
        for key, n, w, c, tw, tc in rows:
            print(f"| {key} | {n:.0f} | {1000 * w:.3f}, {1000 * c:.3f} | {1000 * tw:.1f}, {1000 * tc:.1f} |")
        print("\ngarbage collector, per step: " + (", ".join(f"gen {g}: {n:.2f} passes, {1000 * s:.2f} ms" for g, (n, s) in gcs.items()) or "no pass"))
        print("whole process (all threads), per step: " + ", ".join(f"{k} {v:.0f}" for k, v in usage.items()))


if __name__ == "__main__":
    main()
