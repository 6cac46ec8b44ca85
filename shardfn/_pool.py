"""A pool of CPU ranks (gloo) that run functions on request.

Each worker is a spawned process (or one forked from the warm server, `warm=True`) with the default
process group initialized over loopback. The pool sends a function and its arguments to every rank,
and returns every rank's result. A rank that raises, dies or overruns the deadline poisons the pool:
all workers are killed at once (so peers blocked in a collective never hang) and the error names the
failing rank and its traceback.

Used by the test suite (one pool per world size for the session, many checks per start) and by the
benchmarks. Functions and results travel with plain pickle, so functions must be importable by name.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
import traceback
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

__all__ = ["RankPool", "RankError"]


from ._watch import RankError  # a rank failed, died or timed out; every rank of the pool has been stopped


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, conn: Connection, pg_timeout: float, threads: int, env: dict[str, str],
            warm: bool) -> None:
    import torch
    import torch.distributed as dist

    from ._launch import _take_env

    _take_env(env)
    if warm:
        torch.seed()  # a forked rank starts from the server's random state: a fresh one, as a new interpreter's
    torch.set_num_threads(threads)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        conn.send_bytes(pickle.dumps(("ready", None)))
        if warm:
            import gc

            gc.freeze()  # the start-up's objects (torch's modules): out of every collection, as in sf.launch's ranks
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops every rank
        conn.send_bytes(pickle.dumps(("err", traceback.format_exc())))
        return
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            break
        task = pickle.loads(msg)
        if task is None:
            break
        fn, args, kwargs = task
        try:
            out = ("ok", fn(*args, **kwargs))
            payload = pickle.dumps(out)
        except BaseException:  # noqa: BLE001 - reported to the parent, which stops every rank
            payload = pickle.dumps(("err", traceback.format_exc()))
        conn.send_bytes(payload)
    if dist.is_initialized():
        dist.destroy_process_group()


class RankPool:
    """Spawned CPU ranks with a gloo process group, running functions on request.

    Args:
        world_size: number of ranks.
        timeout: default seconds one `run` may take before every rank is killed.
        pg_timeout: the process group's own timeout, in seconds (bounds a collective that never matches).
        threads: torch intra-op threads per rank.
        warm: fork the ranks from the warm server that `sf.launch` uses under
            `SHARDFN_WARM_LAUNCH=1` (Note [warm ranks] in `_launch.py`): a pool then starts in a
            fraction of a second, its ranks sharing the server's hash seed and start-up settings
            and skipping `atexit` (the test suite's pools). Off, each rank is a
            fresh interpreter, as under torchrun (what the benchmarks measure).

    Example:
        >>> with RankPool(2) as pool:
        ...     ranks = pool.run(torch.distributed.get_rank)
        [0, 1]
    """

    def __init__(self, world_size: int, *, timeout: float = 120.0, pg_timeout: float = 60.0, threads: int = 1,
                 warm: bool = False):
        from ._launch import start_method

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        ctx = get_context(start_method(warm=True) if warm else "spawn")
        port = _free_port()
        self._conns: list[Connection] = []
        self._procs = []
        forked = ctx.get_start_method() == "forkserver"
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, world_size, port, child, pg_timeout, threads, dict(os.environ), forked),
                            daemon=True)
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self._collect(timeout, "start-up")

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Runs `fn(*args, **kwargs)` on every rank and returns the results, rank by rank."""
        if not self._procs:
            raise RankError("this pool was stopped after an earlier failure; create a new one")
        msg = pickle.dumps((fn, args, kwargs))
        for c in self._conns:
            c.send_bytes(msg)
        return self._collect(self.timeout if timeout is None else timeout, getattr(fn, "__name__", repr(fn)))

    def _collect(self, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        pending = {c: r for r, c in enumerate(self._conns)}
        while pending:
            left = deadline - time.monotonic()
            ready = wait(list(pending), timeout=max(left, 0)) if left > 0 else []
            if not ready:
                self.close(kill=True)
                raise RankError(f"{what}: rank(s) {sorted(pending.values())} gave no answer within {timeout:.0f} s")
            for c in ready:
                rank = pending.pop(c)
                try:
                    status, value = pickle.loads(c.recv_bytes())
                except (EOFError, OSError):
                    self.close(kill=True)
                    raise RankError(f"{what}: rank {rank} died", rank, "died") from None
                if status == "err":
                    self.close(kill=True)
                    raise RankError(f"{what}: rank {rank} raised:\n{value}", rank)
                results[rank] = value
        return [results[r] for r in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return bool(self._procs)

    def close(self, kill: bool = False) -> None:
        """Stops every rank (politely, or at once with `kill=True`)."""
        if not kill:
            for c in self._conns:
                try:
                    c.send_bytes(pickle.dumps(None))
                except OSError:
                    pass
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(kill=exc[0] is not None)
