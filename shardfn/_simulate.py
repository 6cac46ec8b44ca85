"""`sf.simulate`: one rank of a large job, run for real in this process on a fake process group.

Note [simulated rank]
---------------------
Rank r of an N-rank job computes on its own shards: everything it allocates depends on N and r,
never on what the other ranks hold. PyTorch's fake process group (`FakeStore` and the "fake"
backend) accepts every collective and moves nothing, so one process can run rank r's code for
real, train step included, with its shards, arenas, activations and optimizer state at their true
sizes; built under `sf.meta_device()`, nothing full is ever allocated beyond one unit at a time.
What it measures is memory (and the schedule); the numbers it computes are meaningless. Objects
the ranks exchange (the meta-device init's random state, an agreement check's digests) are this
rank's own on every rank: a fake collective would hand back uninitialized bytes.

What it does not see: a real communication library's own memory (NCCL's buffers and channels,
gloo's internal copies in an all-reduce), since no message is sent; and point-to-point gloo
collectives (Note [gloo collectives]) take the native path, as NCCL does (a unit-sized gather
buffer). `sf.estimate_memory` leaves the same out and keeps `RESERVE` of a budget for it.

The process group is started for the call and destroyed after it, with shardfn's caches of it
(`_collectives._GROUPS`); a process that already has a process group (a rank of a real job) is
refused, since the default group is process-wide.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

__all__ = ["simulate"]


def simulate(fn: Callable[..., Any], *args: Any, world: int, rank: int = 0, **kwargs: Any) -> Any:
    """Runs `fn(*args, **kwargs)` in this process as rank `rank` of a `world`-rank job whose
    collectives move nothing (Note [simulated rank] in `shardfn/_simulate.py`).

    Inside `fn`, `sf.mesh(...)` spans `world` ranks and a train step runs rank `rank`'s share for
    real: measure its memory there (`torch.cuda.max_memory_allocated`, or
    `shardfn._peak.PeakMeter` on the CPU). Values computed are not those of a real job.

    Args:
        fn: what the rank runs; build the model under `sf.meta_device()`.
        world: the job's size (>= 1).
        rank: the rank to run (0 holds the most where splits are uneven).

    Returns:
        What `fn` returns. The process group is destroyed afterwards, also if `fn` raises.

    Raises:
        ValueError: `world` or `rank` out of range, or a process group already runs here.
    """
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
    if dist.is_initialized():
        raise ValueError(
            "sf.simulate starts a fake process group of its own, but this process already has one (it is a rank of "
            "a real job, or called sf.mesh before): run the simulation in a fresh process"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from . import _collectives as C

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        return fn(*args, **kwargs)
    finally:
        C._GROUPS.clear()
        dist.destroy_process_group()
