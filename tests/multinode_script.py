"""The multi-node recipe's training script, for tests/test_multinode.py: run on every "node" as

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        --rdzv-id JOB tests/multinode_script.py OUT

It trains the test GPT a few steps with `hybrid_shard` on `sf.mesh(replicate=-1, shard=-1)` and with
`full_shard` on `sf.mesh(dp=-1)`, each rank on its share of the global batch, through `sf.launch`
(which under torchrun calls the function on each rank and returns every rank's result). Rank 0
writes every rank's result to OUT (torch.save); the test compares it with the single-process
reference.

With `fault MODE FOLDER JOBS DELAY` instead of OUT, the ranks train the test MLP until rank 0 (node 0)
plants a fault at step 2, after writing the time to FOLDER/MODE.mark: "raise" (a ValueError), "exit" (`os._exit(3)`),
"kill" (SIGKILL of its own process) or "stall" (a sleep outside any shardfn call, longer than the
collective timeout). tests/test_multinode.py checks that node 1 stops within seconds, naming
node 0's rank.
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


def faulty(mode: str, folder: str, jobs: int, delay: float) -> None:
    """Trains until rank 0 plants `mode` (see the module's docstring). Every rank of the `jobs`
    jobs started together waits at step 2 until all of them are there (a file per job in
    `folder`), so that no fault meets other jobs' start-ups, and `delay` s more (the jobs' faults
    apart); then rank 0 plants its fault. A RankError's time is kept in `folder`."""
    import glob
    import time

    rank, node = int(os.environ["RANK"]), os.environ["GROUP_RANK"]
    print(f"rank {rank} on node {node}", flush=True)
    # step.init's memory check enters a TorchDispatchMode, whose first use imports torch._dynamo
    # (1.5 s on an idle core, over 4 s beside a suite): imported here, before the job's first
    # collective, so that the stall job's 4 s collective timeout cannot take it for a stall.
    import torch._dynamo  # noqa: F401
    model = make_model("mlp")
    apply, params = sf.functionalize(model, units=units_of("mlp"))
    mesh = sf.mesh(dp=-1)
    world = dist.get_world_size()
    step = sf.train_step(make_loss_fn("mlp", apply), sf.optim.adamw(**OPT), mesh)
    state = step.init(params)
    try:
        for i in range(1000):
            if i == 2:
                open(os.path.join(folder, f"{mode}.ready.{rank}"), "w").close()
                end = time.time() + 120
                while len(glob.glob(os.path.join(folder, "*.ready.*"))) < 2 * jobs and time.time() < end:
                    time.sleep(0.05)
                time.sleep(delay)  # every rank, outside shardfn: nobody waits on a collective meanwhile
            if rank == 0 and i == 2:
                with open(os.path.join(folder, f"{mode}.mark"), "w") as f:
                    f.write(repr(time.time()))
                print(f"rank 0 plants {mode!r}", flush=True)
                if mode == "raise":
                    raise ValueError("planted on node 0")
                if mode == "exit":
                    os._exit(3)
                if mode == "kill":
                    os.kill(os.getpid(), 9)
                if mode == "stall":
                    time.sleep(600)
            state, _ = step(state, local_batch(global_batch("mlp", i, world), rank, world))
    except sf.RankError:
        with open(os.path.join(folder, f"{mode}.named.{rank}"), "w") as f:
            f.write(repr(time.time()))
        raise


if __name__ == "__main__":
    if sys.argv[1] == "fault":
        faulty(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
        sys.exit(0)
    results = sf.launch(train)
    if dist.get_rank() == 0:
        torch.save(results, sys.argv[1])
