"""Checkpoint save and load: `sf.save` / `sf.load` vs `torch.distributed.checkpoint` on an FSDP2 model.

Launch (from the repository root; about a minute on the 2-core CPU machine):

    .venv/bin/python benchmarks/checkpoint_bench.py
    .venv/bin/python benchmarks/checkpoint_bench.py --reps 5 --dir /tmp/ckbench

Both sides hold the benchmark GPT of `benchmarks/bench.py` (vocab 8192, T 128, 4 blocks, d 256)
with AdamW state after 2 training steps, on 2 CPU ranks (gloo), and write parameters and both AdamW
moments:

  shardfn   sf.save(state, path) / sf.load(path, like=state): the train step's state, committed
            atomically (Note [checkpoint commit] in shardfn/_checkpoint.py)
  fsdp2     fully_shard on each block, then the root; torch.optim.AdamW(fused=True);
            get_state_dict(model, opt) + dcp.save({"model", "optim"}) /
            get_state_dict + dcp.load + set_state_dict (the recipe of the DCP tutorial)

Each side runs in a fresh pool of ranks with MALLOC_MMAP_THRESHOLD_=65536 (freed tensors leave the
RSS). Each repetition saves to a new folder and loads it back into the live state; a time is the
max over ranks of one call (a barrier before it), reported as the median over repetitions. Peak
growth: VmHWM after the call minus VmRSS right before it (VmHWM reset by writing 5 to
/proc/self/clear_refs), the max over ranks and repetitions.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _proc import status_kb  # noqa: E402  benchmarks/_proc.py, beside this script

CFG = dict(vocab=8192, block_size=128, n_layer=4, n_head=4, d=256)
BATCH = 8
TRAIN_STEPS = 2


def _batch(step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1_000_003 * (step + 1) + rank)
    seq = torch.randint(0, CFG["vocab"], (BATCH, CFG["block_size"] + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _model():
    import torch

    from shardfn.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG))


def _measure(fn) -> tuple[float, float]:
    """(seconds, peak RSS growth in MB) of `fn()` on this rank."""
    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_kb("VmRSS")
    t = time.perf_counter()
    fn()
    t = time.perf_counter() - t
    peak = status_kb("VmHWM")
    dist.barrier()
    return t, (peak - before) / 1024


def run(impl: str, root: str, reps: int) -> dict:
    """On each rank: build and train `impl`, then `reps` saves, each loaded back."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.nn import functional as F

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    rank = dist.get_rank()
    net = _model()
    if impl == "shardfn":
        import shardfn as sf

        apply, params = sf.functionalize(net, units=r"blocks\.\d+")

        def loss_fn(params, batch):
            x, y = batch
            return F.cross_entropy(apply(params, x).flatten(0, 1), y.flatten())

        step = sf.train_step(loss_fn, sf.optim.adamw(1e-3, weight_decay=0.01), sf.mesh(dp=-1), apply=apply)
        box = [step.init(params)]
        del params
        for i in range(TRAIN_STEPS):
            box[0], _ = step(box[0], _batch(i, rank))

        def save(path):
            sf.save(box[0], path)

        def load(path):
            box[0] = sf.load(path, like=box[0])
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
        for i in range(TRAIN_STEPS):
            opt.zero_grad(set_to_none=True)
            x, y = _batch(i, rank)
            F.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()
            opt.step()

        def save(path):
            msd, osd = get_state_dict(net, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

        def load(path):
            msd, osd = get_state_dict(net, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=path)
            set_state_dict(net, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    out = {"save_s": [], "save_mb": [], "load_s": [], "load_mb": [], "bytes": 0}
    for r in range(reps):
        path = os.path.join(root, f"{impl}_{r}")
        t, mb = _measure(lambda: save(path))
        out["save_s"].append(t)
        out["save_mb"].append(mb)
        t, mb = _measure(lambda: load(path))
        out["load_s"].append(t)
        out["load_mb"].append(mb)
        out["bytes"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    out["rss_mb"] = status_kb("VmRSS") / 1024
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary folder, removed after)")
    args = p.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from shardfn._pool import RankPool

    root = args.dir or tempfile.mkdtemp(prefix="ckbench-")
    os.makedirs(root, exist_ok=True)
    rows = []
    try:
        for impl in ("shardfn", "fsdp2"):
            with RankPool(args.world, timeout=900) as pool:
                res = pool.run(run, impl, root, args.reps)
            per_rep = lambda key: [max(r[key][i] for r in res) for i in range(args.reps)]  # noqa: E731
            rows.append((
                impl,
                statistics.median(per_rep("save_s")) * 1e3,
                max(per_rep("save_mb")),
                statistics.median(per_rep("load_s")) * 1e3,
                max(per_rep("load_mb")),
                res[0]["bytes"] / 2**20,
            ))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"world {args.world}, benchmark GPT {CFG}, AdamW state after {TRAIN_STEPS} steps, {args.reps} repetitions\n")
    print("| | save (ms) | save peak growth (MB) | load (ms) | load peak growth (MB) | on disk (MB) |")
    print("|---|---|---|---|---|---|")
    names = {"shardfn": "`sf.save` / `sf.load`", "fsdp2": "FSDP2 + `dcp.save` / `dcp.load`"}
    for impl, ss, sm, ls, lm, size in rows:
        print(f"| {names[impl]} | {ss:.0f} | {sm:.1f} | {ls:.0f} | {lm:.1f} | {size:.1f} |")


if __name__ == "__main__":
    main()
