"""What shardfn's training options cost and save: peak memory and step time per configuration.

    .venv/bin/python benchmarks/options.py            # about 2 minutes on the 2-core CPU machine

Each configuration trains the GPT of bench.py (4 blocks, d=256, T=128, vocab 8192) with
`strategy="full_shard"` on 2 CPU ranks, in a FRESH pool of ranks (nothing another configuration
allocated can hide a peak), with `MALLOC_MMAP_THRESHOLD_=65536` so freed tensors leave the RSS.
Peak memory = VmHWM after the measured steps - RSS right after resetting VmHWM (write 5 to
/proc/self/clear_refs) once set-up and warm-up are done; the max over ranks. The micro-batch is the
same in every row (MICRO sequences per rank): accumulation rows take `k` of them per step.
"""

from __future__ import annotations

import os
import sys
import time

from _proc import status_kb  # benchmarks/_proc.py, beside this script

# -- settings -----------------------------------------------------------------------------------
WORLD = 2
MICRO = 8  # sequences per rank per micro-batch
WARMUP, STEPS = 2, 4
CONFIGS = [  # (label, train_step keyword arguments, micro-batches per step)
    ("baseline", {}, 1),
    ("remat=True", {"remat": True}, 1),
    ("accumulation_steps=2", {"accumulation_steps": 2}, 2),
    ("accumulation_steps=4", {"accumulation_steps": 4}, 4),
    ("accumulation_steps=4, local", {"accumulation_steps": 4, "accumulation": "local"}, 4),
    ("bf16 (MixedPrecision)", {"mp": True}, 1),
]


def run(kwargs: dict, k: int) -> dict:
    import gc

    import torch
    import torch.distributed as dist
    from torch.nn import functional as F

    import shardfn as sf
    from shardfn.models import GPT, GPTConfig

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=8192, block_size=128, n_layer=4, n_head=4, d=256))
    apply, params = sf.functionalize(model, units=r"blocks\.\d+")

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply(p, x).flatten(0, 1).float(), y.flatten())

    kwargs = dict(kwargs)
    if kwargs.pop("mp", False):
        kwargs["mixed_precision"] = sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    step = sf.train_step(loss_fn, sf.optim.adamw(1e-3, weight_decay=0.01), sf.mesh(dp=-1), **kwargs)
    state = step.init(params)
    del params
    g = torch.Generator().manual_seed(rank)
    batches = []
    for _ in range(WARMUP + STEPS):
        seq = torch.randint(0, 8192, (MICRO * k, 129), generator=g)
        batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    for b in batches[:WARMUP]:
        state, _ = step(state, b)
    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status_kb("VmHWM")
    times = []
    for b in batches[WARMUP:]:
        dist.barrier()
        t0 = time.perf_counter()
        state, m = step(state, b)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"growth_mb": (status_kb("VmHWM") - base) / 1024, "ms": 1000 * times[len(times) // 2], "loss": m["loss"].item()}


def main() -> None:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from shardfn._pool import RankPool

    rows = []
    for label, kwargs, k in CONFIGS:
        with RankPool(WORLD, timeout=600) as pool:
            res = pool.run(run, kwargs, k)
        rows.append((label, k, max(r["growth_mb"] for r in res), max(r["ms"] for r in res)))
        print(f"  {label}: done", file=sys.stderr, flush=True)
    print(f"GPT 4x256, T=128, full_shard, world {WORLD}, micro-batch {MICRO} sequences per rank; median of {STEPS} steps")
    print("| configuration | micro-batches per step | peak RSS growth MB | median step ms | ms per micro-batch |")
    print("|---|---:|---:|---:|---:|")
    for label, k, mb, ms in rows:
        print(f"| {label} | {k} | {mb:.0f} | {ms:.0f} | {ms / k:.0f} |")


if __name__ == "__main__":
    main()
