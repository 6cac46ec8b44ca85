"""Context parallelism on 4 CPU ranks: step time and per-rank peak memory against sequence length.

Launch (from the repository root):

    .venv/bin/python benchmarks/context_parallel.py                    # T = 2K, 8K (about 3 minutes)
    .venv/bin/python benchmarks/context_parallel.py --seqs 2048 8192 32768   # about 10 minutes

The project's GPT (tiny width: d=64, 4 heads, 2 blocks, vocabulary 256), one sequence of T tokens per
data-parallel coordinate, AdamW:

  shardfn cp=4   sf.mesh(cp=4), batch_specs=sf.P(None, "cp"): the sequence cut in head and tail
                 chunks, attention as ring attention over the 4 ranks (one sequence in all)
  shardfn dp=4   sf.mesh(dp=4): every rank holds a whole sequence of T tokens (four sequences in all):
                 what a rank holds without context parallelism
  torchtitan     torch's `context_parallel(mesh, buffers=...)` + FSDP2 `fully_shard` over the 4 ranks,
                 torchtitan's recipe on the same model and sequence. torch rings only its CUDA
                 attention kernels; `_torch_cp_cpu.enable()` hands its CPU flash kernel to the same
                 ring (torch's own `_templated_ring_attention`), nothing else changed

Per row: the step time (the median over the timed steps, the max over ranks), the per-rank peak of
live tensor bytes over the state's construction and two steps (`shardfn._peak`, what
`sf.estimate_memory` is checked against; the most over ranks), the estimate, and the loss of the
first step (shardfn cp=4 and torchtitan train the same sequence, so their losses agree). Then the longest sequence whose estimated peak fits a per-rank budget,
with and without cp (`sf.estimate_memory`, searched over multiples of 256), each checked by a run at
that length (its measured peak against the budget).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402


def _model(T: int):
    from shardfn.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=256, block_size=T, n_layer=2, n_head=4, d=64))


def _step(mode: str, T: int):
    import torch.nn.functional as F

    import shardfn as sf

    mesh = sf.mesh(cp=-1) if mode == "cp" else sf.mesh(dp=-1)
    apply, params = sf.functionalize(_model(T), units=r"blocks\.\d+")

    def loss_fn(p, b):
        ids, y, pos = b
        return F.cross_entropy(apply(p, ids, pos).flatten(0, 1), y.flatten())

    step = sf.train_step(loss_fn, sf.optim.adamw(1e-3), mesh, batch_specs=sf.P(None, "cp") if mode == "cp" else None)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, T), generator=g)
    batch = (ids, torch.roll(ids, -1, 1), torch.arange(T)[None])
    return step, params, batch


def rank_row(mode: str, T: int, steps: int) -> dict:
    import torch.distributed as dist

    import shardfn as sf
    from shardfn._peak import step_peak

    step, params, batch = _step(mode, T)
    est = sf.estimate_memory(step, params, batch=batch).peak
    peak = _max(step_peak(step, params, batch).peak)
    state = step.init(params)
    state, m = step(state, batch)
    loss = float(m["loss"])
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        state, m = step(state, batch)
        float(m["loss"])
        t = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return dict(time=statistics.median(times), peak=peak, est=est, loss=loss)


def rank_estimate(mode: str, T: int) -> int:
    import shardfn as sf

    step, params, batch = _step(mode, T)
    return sf.estimate_memory(step, params, batch=batch).peak


def _max(x: float) -> float:
    import torch.distributed as dist

    t = torch.tensor(float(x), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def rank_torchtitan(T: int, steps: int) -> dict:
    """torchtitan's recipe: FSDP2 over the cp ranks, torch's context_parallel around each step."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.experimental import context_parallel

    import _torch_cp_cpu
    from shardfn._peak import PeakMeter

    _torch_cp_cpu.enable()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    model = _model(T)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, T), generator=g)
    y, pos = torch.roll(ids, -1, 1), torch.arange(T)[None]

    def one_step(opt) -> float:
        bi, by, bp = ids.clone(), y.clone(), pos.clone()  # context_parallel cuts its buffers in place
        with context_parallel(mesh, buffers=[bi, by, bp], buffer_seq_dims=[1, 1, 1]):
            loss = F.cross_entropy(model(bi, bp).flatten(0, 1), by.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    meter = PeakMeter()
    with meter:  # as step_peak: the sharded state built inside, then two steps
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for i in range(2):
            with meter.section(f"step{i}"):
                loss = one_step(opt)
                if i == 0:
                    dist.all_reduce(loss)  # each rank's loss is over its own tokens: the mean of equal shares
                    first = loss.item() / dist.get_world_size()
    peak = _max(max(meter[f"step{i}"].peak for i in range(2)))
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        float(one_step(opt))
        t = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return dict(time=statistics.median(times), peak=peak, loss=first)


def rank_longest(budget: int) -> dict:
    import shardfn as sf

    out = {}
    for mode in ("dp", "cp"):
        lo, hi = 256, 256
        while True:  # grow, then bisect, on multiples of 256
            step, params, batch = _step(mode, hi)
            if sf.estimate_memory(step, params, batch=batch).peak > budget:
                break
            lo, hi = hi, hi * 2
        while hi - lo > 256:
            mid = (lo + hi) // 2 // 256 * 256
            step, params, batch = _step(mode, mid)
            if sf.estimate_memory(step, params, batch=batch).peak > budget:
                hi = mid
            else:
                lo = mid
        out[mode] = lo
    from shardfn._peak import step_peak

    for mode in ("dp", "cp"):  # each checked by a run at its longest sequence
        step, params, batch = _step(mode, out[mode])
        out[f"{mode}_estimate"] = sf.estimate_memory(step, params, batch=batch).peak
        out[f"{mode}_measured"] = _max(step_peak(step, params, batch).peak)
    return out


def main() -> None:
    import shardfn as sf

    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-mib", type=float, default=48.0)
    ap.add_argument("--max-dp-seq", type=int, default=8192, help="longest T run without cp (each rank a whole sequence)")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{'T':>6} {'implementation':16} {'step s':>8} {'peak MiB/rank':>14} {'estimate MiB':>13} {'first loss':>11}")
    for T in a.seqs:
        rows = {}
        for mode, label in (("cp", "shardfn cp=4"), ("tt", "torchtitan cp=4"), ("dp", "shardfn dp=4")):
            if mode == "dp" and T > a.max_dp_seq:
                est = sf.launch(rank_estimate, mode, T, nprocs=4)[0]
                print(f"{T:>6} {label:16} {'-':>8} {'-':>14} {est / 2**20:13.1f}   (estimate only: T > --max-dp-seq)", flush=True)
                continue
            if mode == "tt":
                r = sf.launch(rank_torchtitan, T, a.steps, nprocs=4)[0]
            else:
                r = sf.launch(rank_row, mode, T, a.steps, nprocs=4)[0]
            rows[mode] = r
            est = f"{r['est'] / 2**20:13.1f}" if "est" in r else f"{'-':>13}"
            print(f"{T:>6} {label:16} {r['time']:8.2f} {r['peak'] / 2**20:14.1f} {est} {r['loss']:11.6f}", flush=True)
        d = abs(rows["cp"]["loss"] - rows["tt"]["loss"]) / abs(rows["tt"]["loss"])
        print(f"{T:>6} shardfn cp=4 / torchtitan: time {rows['cp']['time'] / rows['tt']['time']:.2f}x, "
              f"peak {rows['cp']['peak'] / rows['tt']['peak']:.2f}x, first losses rel. diff {d:.1e}", flush=True)
    budget = int(a.budget_mib * 2**20)
    r = sf.launch(rank_longest, budget, nprocs=4)[0]
    print(f"longest sequence within {a.budget_mib:.0f} MiB per rank (sf.estimate_memory, multiples of 256):")
    for mode, label in (("dp", "without cp (dp=4)"), ("cp", "with cp=4")):
        print(f"  {label:18} {r[mode]:>6} tokens: estimated {r[f'{mode}_estimate'] / 2**20:.1f} MiB, "
              f"measured {r[f'{mode}_measured'] / 2**20:.1f} MiB", flush=True)


if __name__ == "__main__":
    main()
