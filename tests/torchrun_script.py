"""A training script for the torchrun tests: `torchrun --nproc-per-node 2 tests/torchrun_script.py MODE`.

MODE: "ok" (prints every rank's result through sf.launch), "raise" (rank 1 raises at step 2),
"exit" (rank 1 calls os._exit at step 2), "stall" (rank 1 starts its process group 10 s after rank
0, more than the job's collective timeout, which is no stall, then sleeps at step 2, which is one;
torch._dynamo is imported up front, where start-up has its own bound: imported lazily by
`step.init`, after the ranks met, it took rank 1 past the 4 s timeout under load, and rank 1 was
named stalled before step 2),
"subset" (only rank 0 calls sf.gather, then every rank ends).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch._dynamo  # noqa: F401  imported by the first DTensor.from_local of step.init otherwise
import torch.distributed as dist

import shardfn as sf


def train(mode: str) -> float:
    if mode == "stall" and os.environ["RANK"] == "1":
        print("rank 1 starts late", flush=True)
        time.sleep(10)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    apply, params = sf.functionalize(model, units=r"\d+")
    mesh = sf.mesh(dp=-1)
    rank = dist.get_rank()

    def loss_fn(p, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(apply(p, x), y)

    step = sf.train_step(loss_fn, sf.optim.sgd(0.1), mesh)
    state = step.init(params)
    g = torch.Generator().manual_seed(rank)
    for i in range(4):
        if rank == 1 and i == 2:
            if mode == "raise":
                raise ValueError("planted on rank 1 at step 2")
            if mode == "exit":
                os._exit(3)
            if mode == "stall":
                print("rank 1 stalls at step 2", flush=True)
                time.sleep(600)
        batch = (torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g))
        state, metrics = step(state, batch)
    if mode == "subset" and rank == 0:
        sf.gather(state.params)
    return float(metrics["loss"])


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "ok":
        results = sf.launch(train, mode)
        print(f"rank {dist.get_rank()} results {results}", flush=True)
    else:
        train(mode)
