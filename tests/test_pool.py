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
    pool = RankPool(2, timeout=30, pg_timeout=30, warm=True)
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 raised:(.|\n)*ValueError: bad input on rank 1"):
        pool.run(rank_raises_on_1)
    assert time.monotonic() - t0 < 10
    assert not pool.alive
    with pytest.raises(RankError, match="stopped"):
        pool.run(rank_raises_on_1)


def test_hanging_rank_times_out():
    pool = RankPool(2, timeout=30, pg_timeout=30, warm=True)
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"gave no answer within 3 s"):
        pool.run(rank_hangs, timeout=3)
    assert time.monotonic() - t0 < 10
    assert not pool.alive
