"""Shared fixtures: one pool of spawned gloo ranks per world size, per test module.

Spawning ranks costs seconds, so each test module keeps a pool per world size and runs many checks
on it. Every call has a hard deadline (the pool's timeout) and the ranks' process group a short
timeout, so a deadlock fails in seconds. A failed call kills its pool; the next test gets a new one.
"""

from __future__ import annotations

import os

import pytest

from shardfn import _process
from shardfn._pool import RankPool

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _process_state():
    """Each test starts from the process-wide state a fresh process has (Note [process-wide state]
    in `shardfn/_process.py`)."""
    _process.reset()
    yield
    _process.reset()


@pytest.fixture(scope="module")
def pools():
    """`pools(world_size)` -> a live RankPool for this module."""
    live: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        pool = live.get(world_size)
        if pool is None or not pool.alive:
            pool = live[world_size] = RankPool(world_size, timeout=120, pg_timeout=60)
        return pool

    yield get
    for pool in live.values():
        pool.close()
