"""Context parallelism on 4 CPU ranks: step time and per-rank peak memory against sequence length.

Launch (from the repository root):

    .venv/bin/python benchmarks/context_parallel.py                    # T = 2K, 8K
    .venv/bin/python benchmarks/context_parallel.py --seqs 2048 8192 32768 --steps 2

The project's GPT (tiny width: d=64, 4 heads, 2 blocks, vocabulary 256), one sequence of T tokens per
data-parallel coordinate, AdamW:

  shardfn cp=4   sf.mesh(cp=4), batch_specs=sf.P(None, "cp"): the sequence cut in head and tail
                 chunks, attention as ring attention over the 4 ranks (one sequence in all)
  shardfn dp=4   sf.mesh(dp=4): every rank holds a whole sequence of T tokens (four sequences in all):
                 what a rank holds without context parallelism
  torchtitan     torch's `context_parallel(mesh, buffers=...)` + FSDP2 `fully_shard`, torchtitan's
                 recipe: tried on the same model; on a CPU mesh it stops in torch (reported as is)

Per row: the step time (the median over the timed steps, the max over ranks), the per-rank peak of
live tensor bytes over two steps (`shardfn._peak.step_peak`, what `sf.estimate_memory` is checked
against) and the estimate. Then the longest sequence whose estimated peak fits a per-rank budget,
with and without cp (`sf.estimate_memory`, searched over multiples of 256), and a run at that length
with cp that checks the measured peak against the budget.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
    state = step.init(params)
    peak = step_peak(step, state.params, batch).peak
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        state, m = step(state, batch)
        float(m["loss"])
        t = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return dict(time=statistics.median(times), peak=peak, est=est)


def rank_torchtitan(T: int) -> str:
    """torchtitan's recipe: FSDP2 over the cp ranks, torch's context_parallel around the step."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("cp",))
    model = _model(T)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, T), generator=g)
    y, pos = torch.roll(ids, -1, 1), torch.arange(T)[None].clone()
    try:
        with context_parallel(mesh, buffers=[ids, y, pos], buffer_seq_dims=[1, 1, 1]):
            loss = F.cross_entropy(model(ids, pos).flatten(0, 1), y.flatten())
            loss.backward()
        opt.step()
        return "ran"
    except Exception as e:  # noqa: BLE001 - reported as the row's result
        return f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"


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

    step, params, batch = _step("cp", out["cp"])
    out["cp_estimate"] = sf.estimate_memory(step, params, batch=batch).peak
    state = step.init(params)
    out["cp_measured"] = step_peak(step, state.params, batch).peak
    return out


def main() -> None:
    import shardfn as sf

    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-mib", type=float, default=48.0)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{'T':>6} {'implementation':16} {'step s':>8} {'peak MiB/rank':>14} {'estimate MiB':>13}")
    for T in a.seqs:
        for mode, label in (("cp", "shardfn cp=4"), ("dp", "shardfn dp=4")):
            r = sf.launch(rank_row, mode, T, a.steps, nprocs=4)[0]
            print(f"{T:>6} {label:16} {r['time']:8.2f} {r['peak'] / 2**20:14.1f} {r['est'] / 2**20:13.1f}", flush=True)
        print(f"{T:>6} {'torchtitan cp=4':16} {sf.launch(rank_torchtitan, T, nprocs=4)[0]}", flush=True)
    budget = int(a.budget_mib * 2**20)
    r = sf.launch(rank_longest, budget, nprocs=4)[0]
    print(f"longest sequence within {a.budget_mib:.0f} MiB per rank (sf.estimate_memory): without cp {r['dp']}, with cp=4 "
          f"{r['cp']}; a cp run at {r['cp']}: estimated {r['cp_estimate'] / 2**20:.1f} MiB, measured {r['cp_measured'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
