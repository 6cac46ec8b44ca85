"""The rank pool: a failing or hanging rank stops every rank within a bounded time, naming it."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from shardfn._pool import RankError, RankPool


def rank_raises_on_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("bad input on rank 1")
    t = torch.zeros(1)
    dist.all_reduce(t)  # rank 0 would wait here for rank 1 forever
    return 0


def rank_hangs() -> None:
    if dist.get_rank() == 0:
        time.sleep(60)
    dist.barrier()


def test_failing_rank_stops_all_and_is_named():
    pool = RankPool(2, timeout=30, pg_timeout=30)
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 raised:(.|\n)*ValueError: bad input on rank 1"):
        pool.run(rank_raises_on_1)
    assert time.monotonic() - t0 < 10
    assert not pool.alive
    with pytest.raises(RankError, match="stopped"):
        pool.run(rank_raises_on_1)


def test_hanging_rank_times_out():
    pool = RankPool(2, timeout=30, pg_timeout=30)
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"gave no answer within 3 s"):
        pool.run(rank_hangs, timeout=3)
    assert time.monotonic() - t0 < 10
    assert not pool.alive


def rank_pure_function() -> float:
    """A hand-written pure function (no functionalize): the whole tree is the root unit."""
    import shardfn as sf

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    params = {"w": torch.randn(7, 5), "b": torch.zeros(5)}
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    x, y = torch.randn(4 * world, 7), torch.randn(4 * world, 5)

    def loss_fn(p, batch):
        xb, yb = batch
        return ((xb @ p["w"] + p["b"] - yb) ** 2).mean()

    step = sf.train_step(loss_fn, sf.optim.sgd(0.1, momentum=0.9), sf.mesh(dp=-1))
    state = step.init(params)
    opt = torch.optim.SGD(ref.values(), lr=0.1, momentum=0.9)
    for _ in range(3):
        state, _ = step(state, (x.chunk(world)[rank], y.chunk(world)[rank]))
        opt.zero_grad()
        loss_fn(ref, (x, y)).backward()
        opt.step()
    full = sf.gather(state.params)
    return max(((full[k] - ref[k].detach()).norm() / ref[k].detach().norm()).item() for k in full)


def test_train_step_on_a_plain_pure_function(pools):
    assert max(pools(3).run(rank_pure_function)) < 1e-6
