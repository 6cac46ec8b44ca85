"""Shared fixtures: one pool of gloo ranks per world size, for the whole session.

Starting ranks costs time, so the session keeps a pool per world size and every test runs its
checks on it; a pool's ranks are forked from the warm server that `sf.launch` uses under
`SHARDFN_WARM_LAUNCH=1`, which the suite sets (Note [warm ranks] in `shardfn/_launch.py`), so the new
pool that follows a failure starts in a fraction of a second. Each test starts from the process-wide state a fresh process has (Note [process-wide
state] in `shardfn/_process.py`), in this process and in the pools' ranks. Every call has a hard
deadline (the pool's timeout) and the ranks' process group a short timeout, so a deadlock fails in
seconds. A failed call kills its pool; the next test gets a new one.
"""

from __future__ import annotations

import gc
import os

import pytest

from shardfn import _process
from shardfn._pool import RankPool

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHARDFN_WARM_LAUNCH", "1")  # sf.launch here and in the notebooks' kernels: Note [warm ranks]

_LIVE: dict[int, RankPool] = {}

# torch's and shardfn's modules, imported above, out of every collection: the suite's full passes
# would otherwise walk them again and again (the pools' ranks do the same, RankPool(warm=True)).
gc.freeze()


@pytest.fixture(autouse=True)
def _process_state():
    """Each test starts from the process-wide state a fresh process has, here and in the ranks."""
    _process.reset()
    for pool in _LIVE.values():
        if pool.alive:
            pool.run(_process.reset, timeout=30)
    yield
    _process.reset()


@pytest.fixture(scope="session")
def pools():
    """`pools(world_size)` -> a live RankPool, shared by every test of the session."""

    def get(world_size: int) -> RankPool:
        pool = _LIVE.get(world_size)
        if pool is None or not pool.alive:
            pool = _LIVE[world_size] = RankPool(world_size, timeout=120, pg_timeout=60, warm=True)
        return pool

    yield get
    for pool in _LIVE.values():
        pool.close(kill=True)  # nothing to finish: every call has returned
    _LIVE.clear()
