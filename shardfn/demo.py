"""A sharded training run of a small GPT on CPU ranks: loss, memory per rank, step time.

    python -m shardfn.demo                      # launches 2 CPU ranks (gloo) with sf.launch
    python -m shardfn.demo --ranks 3 --steps 100
    torchrun --nproc_per_node 2 -m shardfn.demo # under torchrun, each rank runs it

The data are arithmetic token sequences (x_t = a + b*t mod vocab), so the loss visibly falls from
log(vocab) as the model learns the rule.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

# -- settings -----------------------------------------------------------------------------------
VOCAB, BLOCK, LAYERS, HEADS, D = 128, 32, 4, 4, 128
BATCH_PER_RANK = 16
LR = 3e-3


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    a = torch.randint(0, VOCAB, (BATCH_PER_RANK, 1), generator=g)
    b = torch.randint(1, 8, (BATCH_PER_RANK, 1), generator=g)
    seq = (a + b * torch.arange(BLOCK + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def _peak_rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _local_bytes(tree) -> int:
    from torch.distributed.tensor import DTensor

    leaves = [x.to_local() if isinstance(x, DTensor) else x for x in torch.utils._pytree.tree_leaves(tree)]
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor))


def train(steps: int, strategy: str) -> dict:
    """Runs on every rank; returns this rank's summary."""
    import shardfn as sf
    from shardfn.models import GPT, GPTConfig

    mesh = sf.mesh(dp=-1)
    rank, world = mesh.get_local_rank(), mesh.size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(GPTConfig(vocab=VOCAB, block_size=BLOCK, n_layer=LAYERS, n_head=HEADS, d=D))
    apply, params = sf.functionalize(model, units=r"blocks\.\d+")
    full_bytes = sum(p.numel() * p.element_size() for p in torch.utils._pytree.tree_leaves(params))

    def loss_fn(params, batch):
        x, y = batch
        return F.cross_entropy(apply(params, x).flatten(0, 1), y.flatten())

    step = sf.train_step(loss_fn, sf.optim.adamw(LR, weight_decay=0.01), mesh, strategy=strategy, max_grad_norm=1.0)
    state = step.init(params)
    del params
    held = _local_bytes(state.params) + _local_bytes(step.grads) + _local_bytes(state.opt_state)
    if rank == 0:
        print(
            f"shardfn demo: GPT {LAYERS}x{D}, {full_bytes / 4 / 1e6:.2f}M params, {world} ranks, {strategy}, "
            f"batch {BATCH_PER_RANK}/rank"
        )
        print(
            f"rank 0 holds {held / 2**20:.1f} MiB of params + grads + AdamW state "
            f"(unsharded: {4 * full_bytes / 2**20:.1f} MiB)"
        )
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, _batch(i, rank, world))
        times.append(time.perf_counter() - t0)
        if rank == 0 and (i % 5 == 0 or i == steps - 1):
            print(
                f"step {i:3d}  loss {metrics['loss'].item():.4f}  grad_norm {metrics['grad_norm'].item():.3f}  "
                f"time {1000 * times[-1]:.0f} ms  peak RSS {_peak_rss_mb():.0f} MB",
                flush=True,
            )
    times.sort()
    summary = dict(rank=rank, loss=metrics["loss"].item(), median_ms=1000 * times[len(times) // 2], peak_rss_mb=_peak_rss_mb(), held_mib=held / 2**20)
    if rank == 0:
        print(f"done: final loss {summary['loss']:.4f} (start ~{math.log(VOCAB):.2f}), median step {summary['median_ms']:.0f} ms")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks to launch (under torchrun: the job's)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--strategy", default="full_shard", choices=["full_shard", "shard_grad_op", "no_shard"])
    args = parser.parse_args()
    import shardfn as sf

    t0 = time.perf_counter()
    results = sf.launch(train, args.steps, args.strategy, nprocs=args.ranks)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    for r in results:
        print(f"rank {r['rank']}: holds {r['held_mib']:.1f} MiB sharded state, peak RSS {r['peak_rss_mb']:.0f} MB, median step {r['median_ms']:.0f} ms")
    print(f"total wall time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
