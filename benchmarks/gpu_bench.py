"""One-GPU benchmark: a ~1B-parameter GPT in bf16 with shardfn, FSDP2 and plain PyTorch, eager and compiled.

    python benchmarks/gpu_bench.py                    # every implementation, defaults below
    python benchmarks/gpu_bench.py --impls shardfn,shardfn_compile --steps 20
    torchrun --nproc_per_node 8 benchmarks/gpu_bench.py   # the same on 8 GPUs (NCCL)

Each implementation trains the same model (same seed, same batches) with AdamW, bf16 compute and
fp32 master weights, gradients reduced in fp32; it prints the median step time, tokens/s and
TFLOP/s per GPU (6 N + 12 L T d FLOPs per token, the usual estimate), the allocator's peak memory
during steps, and the first step's time (with a compiled implementation, most of it compiling).
The compiled ones: `shardfn_compile` is `sf.train_step(..., compile=True)` (each unit's forward
and backward compiled, Note [compiled units]); `fsdp2_compile` is torchtitan's recipe, each block
`torch.compile`d and then `fully_shard`ed; `pytorch_compile` is the whole model compiled.
Run alone on the GPU; implementations run one after another in this process, each after the last
one's memory has been released.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

# -- settings -----------------------------------------------------------------------------------
D, LAYERS, HEADS, VOCAB, T = 2048, 18, 16, 32768, 1024  # ~0.97B params
BATCH = 8  # per GPU
STEPS, WARMUP = 10, 3
LR = 3e-4


def _flops_per_step(n_params: int, batch: int) -> float:
    return batch * T * (6 * n_params + 12 * LAYERS * T * D)


def _model():
    from shardfn.models import GPT, GPTConfig

    torch.manual_seed(0)
    with torch.device("cuda"):
        return GPT(GPTConfig(vocab=VOCAB, block_size=T, n_layer=LAYERS, n_head=HEADS, d=D))


def _batches(n: int, rank: int):
    g = torch.Generator(device="cuda").manual_seed(1 + rank)
    for _ in range(n):
        x = torch.randint(0, VOCAB, (BATCH, T), device="cuda", generator=g)
        yield x, torch.roll(x, -1, dims=1)


def _loss(logits, y):
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def run_shardfn(mesh, rank, compile: bool = False):
    import shardfn as sf

    model = _model()
    apply, params = sf.functionalize(model, units=r"blocks\.\d+")
    n = sum(p.numel() for p in torch.utils._pytree.tree_leaves(params))

    def loss_fn(p, batch):
        x, y = batch
        return _loss(apply(p, x), y)

    step = sf.train_step(
        loss_fn, sf.optim.adamw(LR, weight_decay=0.1), mesh,
        mixed_precision=sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), compile=compile,
    )
    state = step.init(params)
    del params

    def one(batch):
        nonlocal state
        state, m = step(state, batch)
        return m["loss"]

    return n, one


def run_fsdp2(mesh, rank, compile: bool = False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model()
    n = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        if compile:  # torchtitan: each block compiled, then sharded
            block.compile(fullgraph=True)
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)

    def one(batch):
        x, y = batch
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return n, one


def run_plain(mesh, rank, compile: bool = False):
    model = _model()
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)
    forward = torch.compile(model) if compile else model

    def one(batch):
        x, y = batch
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = forward(x)
        loss = _loss(logits, y)
        loss.backward()
        if dist.get_world_size() > 1:  # plain data parallel, for completeness
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return n, one


IMPLS = {
    "shardfn": run_shardfn,
    "shardfn_compile": functools.partial(run_shardfn, compile=True),
    "fsdp2": run_fsdp2,
    "fsdp2_compile": functools.partial(run_fsdp2, compile=True),
    "pytorch": run_plain,
    "pytorch_compile": functools.partial(run_plain, compile=True),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--warmup", type=int, default=WARMUP)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench.py needs a CUDA GPU; see benchmarks/bench.py for the CPU benchmark")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    import shardfn as sf

    mesh = sf.mesh(dp=-1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    for name in args.impls.split(","):
        gc.collect()
        torch.cuda.empty_cache()
        n, one = IMPLS[name](mesh, rank)
        batches = list(_batches(args.warmup + args.steps, rank))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        one(batches[0])  # with a compiled implementation, most of it compiling
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        for b in batches[1 : args.warmup]:
            one(b)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for b in batches[args.warmup :]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            losses.append(one(b))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        times.sort()
        med = times[len(times) // 2]
        peak = torch.cuda.max_memory_allocated() / 2**30
        tflops = _flops_per_step(n, BATCH) / med / 1e12
        rows.append((name, n, med * 1e3, BATCH * T / med, tflops, peak, first, losses[-1].item()))
        del one
    if rank == 0:
        print(f"GPT d={D} L={LAYERS} T={T} vocab={VOCAB}, batch {BATCH}/GPU, {world} GPU(s), bf16, AdamW")
        print("| impl | params | median step ms | tokens/s per GPU | TFLOP/s per GPU | peak GiB | first step s | last loss |")
        print("|---|---|---|---|---|---|---|---|")
        for name, n, ms, tok, tf, pk, first, loss in rows:
            print(f"| {name} | {n / 1e9:.2f}B | {ms:.1f} | {tok:.0f} | {tf:.1f} | {pk:.1f} | {first:.1f} | {loss:.4f} |")
        speed = {name: tok for name, _, _, tok, *_ in rows}
        if "shardfn" in speed and "shardfn_compile" in speed:  # the bar: +12% over eager, and FSDP2 + compile's
            print(f"shardfn compile=True: {speed['shardfn_compile'] / speed['shardfn']:.3f}x shardfn eager's tokens/s"
                  + (f", {speed['shardfn_compile'] / speed['fsdp2_compile']:.3f}x FSDP2 + per-block compile's"
                     if "fsdp2_compile" in speed else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
