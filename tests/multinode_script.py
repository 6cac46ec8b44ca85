"""The multi-node recipe's training script, for tests/test_multinode.py: run on every "node" as

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        --rdzv-id JOB tests/multinode_script.py OUT

It trains the test GPT a few steps with `hybrid_shard` on `sf.mesh(replicate=-1, shard=-1)` and with
`full_shard` on `sf.mesh(dp=-1)`, each rank on its share of the global batch, through `sf.launch`
(which under torchrun calls the function on each rank and returns every rank's result). Rank 0
writes every rank's result to OUT (torch.save); the test compares it with the single-process
reference.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import shardfn as sf
from reference import OPT, global_batch, local_batch, make_loss_fn, make_model, units_of

STEPS = 3


def train() -> dict:
    out: dict = {"env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")}}
    meshes = {"hybrid_shard": sf.mesh(replicate=-1, shard=-1), "full_shard": sf.mesh(dp=-1)}
    rank, world = dist.get_rank(), dist.get_world_size()
    hybrid = meshes["hybrid_shard"]
    out["layout"] = hybrid.mesh.tolist()
    out["groups"] = {a: dist.get_process_group_ranks(hybrid.get_group(a)) for a in ("replicate", "shard")}
    for strategy, mesh in meshes.items():
        model = make_model("gpt")
        apply, params = sf.functionalize(model, units=units_of("gpt"))
        step = sf.train_step(make_loss_fn("gpt", apply), sf.optim.adamw(**OPT), mesh, strategy=strategy)
        state = step.init(params)
        losses = []
        for i in range(STEPS):
            state, metrics = step(state, local_batch(global_batch("gpt", i, world), rank, world))
            losses.append(float(metrics["loss"]))
        full = sf.to_state_dict(sf.gather(state.params), apply)
        out[strategy] = {
            "losses": losses,
            "describe": str(sf.describe(state)),
            "params": {n: t.detach().clone() for n, t in full.items()} if rank == 0 else None,
        }
    return out


if __name__ == "__main__":
    results = sf.launch(train)
    if dist.get_rank() == 0:
        torch.save(results, sys.argv[1])
