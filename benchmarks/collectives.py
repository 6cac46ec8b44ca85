"""gloo's own all-gather and reduce-scatter against shardfn's point-to-point ones: time and memory.

    .venv/bin/python benchmarks/collectives.py          # about 30 seconds on the 2-core CPU machine

On WORLD CPU ranks (gloo over loopback, one torch thread each, `MALLOC_MMAP_THRESHOLD_=65536` so
that freed buffers leave the RSS), each collective runs on the flat buffer of one MLP unit of
bench.py (Linear(2048, 2048): 16.8 MB gathered), synchronously, REPEATS times after WARMUP; the
table gives the median time (max over ranks) and the peak RSS growth during the timed calls (VmHWM
after - VmHWM reset right before; max over ranks), for each mode of `shardfn._collectives`:

  native    torch.distributed.all_gather_single / reduce_scatter_single, as gloo implements them
  in_place  the reduce-scatter of a scratch input as an in-place all-reduce (gloo's algorithm
            without its clone)
  p2p       point-to-point messages (Note [gloo collectives]), shardfn's default on gloo
"""

from __future__ import annotations

import os
import sys
import time

from _proc import status_kb  # benchmarks/_proc.py, beside this script

# -- settings -----------------------------------------------------------------------------------
WORLD = 2
NUMEL = 2048 * 2048  # the gathered (full) buffer, fp32
WARMUP, REPEATS = 3, 15
MODES = ("native", "in_place", "p2p")


def run(mode: str) -> dict:
    import gc

    import torch
    import torch.distributed as dist

    from shardfn import _collectives as C

    torch.set_num_threads(1)
    world, group = dist.get_world_size(), dist.group.WORLD
    n = NUMEL // world * world
    full, shard = torch.randn(n), torch.randn(n // world)
    out = {}
    with C.gloo_collectives(mode):
        calls = {
            "all-gather": lambda: C.all_gather(full, shard, group, async_op=False),
            "reduce-scatter": lambda: C.reduce_scatter(shard, full, group, async_op=False, scratch=True),
        }
        for name, fn in calls.items():
            for _ in range(WARMUP):
                fn()
            gc.collect()
            dist.barrier()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            base = status_kb("VmHWM")
            times = []
            for _ in range(REPEATS):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            times.sort()
            out[name] = (1000 * times[len(times) // 2], (status_kb("VmHWM") - base) / 1024)
    return out


def main() -> None:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from shardfn._pool import RankPool

    rows = {}
    with RankPool(WORLD, timeout=300) as pool:
        for mode in MODES:
            res = pool.run(run, mode)
            for name in res[0]:
                rows[(name, mode)] = (max(r[name][0] for r in res), max(r[name][1] for r in res))
    mb = NUMEL * 4 / 1e6
    print(f"world {WORLD}, one unit of {mb:.1f} MB (fp32, gathered size), median of {REPEATS} synchronous calls")
    print("| collective | mode | median ms | peak RSS growth MB |")
    print("|---|---|---:|---:|")
    for (name, mode), (ms, growth) in rows.items():
        if name == "all-gather" and mode == "in_place":
            continue  # the same call as native
        print(f"| {name} | {mode} | {ms:.1f} | {growth:.0f} |")


if __name__ == "__main__":
    main()
