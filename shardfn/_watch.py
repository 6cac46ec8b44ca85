"""Fail fast: when a rank fails, dies, returns early or stalls, the others stop with its name.

Note [fail fast]
~~~~~~~~~~~~~~~~
A gloo collective blocks until every rank has joined it, and a blocked wait cannot be interrupted
from another thread (`ProcessGroup.abort()` does not wake it). What does end it is a peer's
connections closing, which fails the wait at once, or the process group's own timeout. So:

* a rank that raises (inside `sf.launch`, or anywhere under torchrun) writes "rank r failed:
  <exception>" to the job's store, then its process ends (or, under `sf.launch`, drops its process
  group first); a rank that returns from its function writes "rank r returned" the same way;
* a rank whose shardfn call fails with a communication error reads the store and raises
  `RankError` naming the rank and what happened to it: failed (with its exception), returned from
  its function (a collective called on some ranks only), died without a word (its process is gone:
  `os._exit`, a signal, out of memory), or stalled (the collective timed out while that rank was
  running its own code, or computing without waiting on any collective);
* every rank's heartbeat thread writes, once a second, where the rank is (outside shardfn, inside
  a shardfn call, waiting on a collective): that is what names a stalled rank.

The collective timeout is the process group's: `SHARDFN_TIMEOUT` seconds (default 600) for groups
that shardfn starts (`sf.mesh`, `sf.launch`), `sf.launch(..., timeout=)` for launched ranks. The
store is the job's own (`MASTER_ADDR:MASTER_PORT`, as torchrun and `sf.launch` set them); without
one (a single process), errors pass through unchanged. Nothing here runs on the hot path but two
attribute writes per wait.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Iterator

import torch.distributed as dist

__all__ = [
    "RankError",
    "collective_timeout",
    "startup_timeout",
    "watched",
    "waiting",
    "explain",
    "report_failure",
    "report_returned",
    "leave_when_waited_on",
]

TIMEOUT_ENV = "SHARDFN_TIMEOUT"
STARTUP_TIMEOUT_ENV = "SHARDFN_STARTUP_TIMEOUT"
LAUNCHED_ENV = "SHARDFN_LAUNCHED"
"""Set in ranks that `sf.launch` started."""
DEFAULT_TIMEOUT_S = 600.0
BEAT_S = 1.0
"""How often each rank's heartbeat says where it is."""


class RankError(RuntimeError):
    """Another rank failed, died, returned early or stalled, so this rank (or the launch) stops.

    Attributes:
        rank: the rank at fault (None when it cannot be told).
        kind: "failed", "died", "returned" or "stalled".
    """

    def __init__(self, message: str, rank: int | None = None, kind: str = "failed"):
        super().__init__(message)
        self.rank, self.kind = rank, kind

    def __reduce__(self):
        return (RankError, (str(self), self.rank, self.kind))


RankError.__module__ = "shardfn"  # as users name it: sf.RankError


def exception_text(exc: BaseException) -> str:
    """`exc` for a message that names it: "ValueError: bad shape". A `RankError`'s own message is
    already such a sentence (it names the rank and what happened), so it is not prefixed again."""
    return str(exc) if isinstance(exc, RankError) else f"{type(exc).__name__}: {exc}"


def collective_timeout() -> datetime.timedelta:
    """The timeout for process groups that shardfn starts: `SHARDFN_TIMEOUT` seconds, default 600."""
    return _seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, "the collective timeout")


def startup_timeout() -> datetime.timedelta:
    """How long the ranks of a job that shardfn starts wait for each other to arrive:
    `SHARDFN_STARTUP_TIMEOUT` seconds as given; unset, 600 or the collective timeout if longer
    (Note [start-up] in `_mesh.py`)."""
    collective = collective_timeout()
    if os.environ.get(STARTUP_TIMEOUT_ENV) is None:
        return max(collective, datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
    return _seconds(STARTUP_TIMEOUT_ENV, DEFAULT_TIMEOUT_S, "the start-up timeout")


def _seconds(env: str, default: float, what: str) -> datetime.timedelta:
    raw = os.environ.get(env)
    if raw is None:
        return datetime.timedelta(seconds=default)
    try:
        s = float(raw)
    except ValueError:
        s = -1.0
    if not 0 < s < float("inf"):
        raise ValueError(f"{env}={raw!r}: give {what} in seconds, e.g. {env}=300")
    return datetime.timedelta(seconds=s)


class _Where:
    """Where this rank is, read by the heartbeat thread: the shardfn call it is in (None: the
    user's own code) since when, and since when it waits on a collective (None: not waiting)."""

    op: str | None = None
    since: float = 0.0
    waiting: float | None = None


WHERE = _Where()


@contextlib.contextmanager
def watched(op: str, mark: bool = True) -> Iterator[None]:
    """Marks a shardfn call that issues collectives; a communication error inside becomes a
    `RankError` naming the rank at fault, when the store tells. With `mark=False` (a thread other
    than the one the heartbeat describes) only the error is explained, as `op`'s."""
    outer = WHERE.op if mark else None
    if outer is None and mark:
        WHERE.op, WHERE.since = op, time.time()
        _ensure_started()
    try:
        yield
    except RankError:
        raise
    except (RuntimeError, TimeoutError) as e:
        if not _communication_error(e):
            raise
        clear = explain(e, op if outer is None else outer)
        if clear is e:
            raise
        raise clear from e
    finally:
        if outer is None and mark:
            WHERE.op, WHERE.waiting = None, None


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Marks a blocking wait on a collective (for the heartbeat)."""
    WHERE.waiting = time.time()
    try:
        yield
    finally:
        WHERE.waiting = None


class _Watch:
    """This rank's link to the job's store: reports, and the heartbeat thread."""

    def __init__(self, host: str, port: int, rank: int, world: int, prefix: str):
        self.rank, self.world, self.prefix = rank, world, prefix
        self.host, self.port = host, port
        self.store = self._connect()
        self.store.set(f"pid/{rank}", f"{socket.gethostname()} {os.getpid()}")
        self._beat_store = self._connect()
        self._stop = threading.Event()
        self._beat()
        threading.Thread(target=self._beating, name="shardfn-heartbeat", daemon=True).start()

    def _connect(self):
        store = dist.TCPStore(
            self.host, self.port, is_master=False, timeout=datetime.timedelta(seconds=5), wait_for_workers=False
        )
        return dist.PrefixStore(self.prefix, store)

    def _beat(self) -> None:
        w = WHERE
        self._beat_store.set(f"seen/{self.rank}", json.dumps([time.time(), w.op, w.since, w.waiting]))

    def _beating(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return

    def get(self, key: str) -> str | None:
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store is gone
            return None


_WATCH: list = []  # [] not started, [None] unavailable, [_Watch]


def _prefix() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"shardfn-watch/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _ensure_started() -> "_Watch | None":
    if _WATCH:
        return _WATCH[0]
    w = None
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and host and port:
        try:
            w = _Watch(host, int(port), dist.get_rank(), dist.get_world_size(), _prefix())
        except Exception:  # noqa: BLE001 - no reachable store: errors pass through unchanged
            w = None
    _WATCH.append(w)
    if w is not None:
        _install_hooks()
    return w


def start() -> None:
    """Starts the watch now (the process group must be up); idempotent."""
    _ensure_started()


def _install_hooks() -> None:
    """Under torchrun nobody wraps the script: an uncaught exception reports itself, and a normal
    exit reports "returned", so peers still waiting on this rank learn why."""
    if os.environ.get(LAUNCHED_ENV):  # a launched rank: its trampoline reports (shardfn/_launch.py)
        return
    previous = sys.excepthook
    failed = []

    def hook(tp, value, tb):
        failed.append(True)
        report_failure(value)
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if path and not os.path.exists(path):  # torchrun's summary then shows this exception
            import traceback

            text = "".join(traceback.format_exception(tp, value, tb))
            with contextlib.suppress(Exception):
                with open(path, "w") as f:
                    json.dump({"message": {"message": f"{tp.__name__}: {value}",
                                           "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}, f)
        previous(tp, value, tb)

    def at_exit() -> None:
        if not failed:
            with contextlib.suppress(BaseException):
                report_returned()

    sys.excepthook = hook
    atexit.register(at_exit)


FAILED_HERE = [False]  # whether this rank failed (its process group is then left to the exit)


def report_failure(exc: BaseException) -> None:
    """Tells the other ranks that this rank failed with `exc` (the first report in a job wins)."""
    FAILED_HERE[0] = True
    w = _WATCH[0] if _WATCH else None
    if w is None or isinstance(exc, RankError) or _communication_error(exc):
        return  # a consequence of another rank's failure, not a cause
    text = f"{w.rank}\n{exception_text(exc)}"
    try:
        w.store.compare_set("failed", "", text)
    except Exception:  # noqa: BLE001 - the store is gone: nothing to tell
        pass


def report_step(exc: BaseException | None) -> None:
    """Records that this rank's train step raised `exc` (None: a step succeeded since). The caller
    may catch it and go on; a peer left waiting on this rank in vain then learns why (`explain`)."""
    w = _WATCH[0] if _WATCH else None
    if w is None or (exc is None and not _STEP_FAILED[0]):
        return
    if exc is not None and (isinstance(exc, RankError) or _communication_error(exc)):
        return
    try:
        if exc is None:
            w.store.delete_key(f"stepfailed/{w.rank}")
            _STEP_FAILED[0] = False
        else:
            w.store.set(f"stepfailed/{w.rank}", exception_text(exc))
            _STEP_FAILED[0] = True
    except Exception:  # noqa: BLE001 - the store is gone: nothing to tell
        pass


_STEP_FAILED = [False]  # whether this rank's last step raised (its record is in the store)


def report_returned() -> None:
    """Tells the other ranks that this rank's function returned (it joins no more collectives)."""
    w = _WATCH[0] if _WATCH else None
    if w is None:
        return
    try:
        w.store.set(f"returned/{w.rank}", "1")
    except Exception:  # noqa: BLE001
        pass


def leave_when_waited_on() -> None:
    """After this rank's function returned: a rank still blocked on a collective waits on this
    rank, which will never join it. No call can wake that wait, but closed connections fail it at
    once, so this process ends as soon as it sees such a rank (its result is already handed over).

    Call it from the main thread. The process ends by interrupting the main thread's wait for
    the launcher (a signal whose handler raises `SystemExit(0)`), not with `os._exit`: a process
    that dies inside that wait (a multiprocessing Event) leaves it counted as sleeping, and the
    launcher's later `set()` waits for it to wake, forever. `os._exit(0)` is the fallback.
    """
    w = _WATCH[0] if _WATCH else None
    if w is None:
        return
    leaving = threading.Event()
    previous = signal.getsignal(signal.SIGUSR2)

    def on_signal(signum, frame):  # noqa: ANN001 - a signal handler's signature
        if not leaving.is_set():
            if callable(previous):
                previous(signum, frame)
            return
        # Only inside the launcher's wait: the result is handed over by then (not mid-write).
        if frame is not None and frame.f_code.co_filename.endswith(os.path.join("multiprocessing", "synchronize.py")):
            raise SystemExit(0)

    signal.signal(signal.SIGUSR2, on_signal)
    main = threading.main_thread().ident

    def leave() -> None:
        leaving.set()
        for _ in range(10):
            signal.pthread_kill(main, signal.SIGUSR2)
            time.sleep(0.5)
        os._exit(0)  # the main thread was never where the signal could end it

    def run() -> None:
        others = [r for r in range(w.world) if r != w.rank]
        while True:
            time.sleep(BEAT_S / 2)
            if w.get("failed") is not None:
                return
            now = time.time()
            for r in others:
                seen = w.get(f"seen/{r}")
                if seen is None or w.get(f"returned/{r}") is not None:
                    continue
                t, _, _, waiting = json.loads(seen)
                if waiting is not None and now - waiting > 2 * BEAT_S and now - t < 3 * BEAT_S:
                    leave()
                    return

    threading.Thread(target=run, name="shardfn-linger", daemon=True).start()


def _alive(desc: str | None) -> bool | None:
    """Whether the process `"host pid"` lives (None: it cannot be told from here)."""
    if not desc:
        return None
    host, pid = desc.rsplit(" ", 1)
    if host != socket.gethostname():
        return None
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return None


def explain(err: BaseException, op: str) -> BaseException:
    """A `RankError` naming the rank at fault for communication error `err` in shardfn call `op`,
    or `err` itself when the store tells nothing."""
    w = _WATCH[0] if _WATCH else None
    if w is None:
        return err
    me, others = w.rank, [r for r in range(w.world) if r != w.rank]
    failed = w.get("failed")
    if failed is None:
        time.sleep(0.2)  # a rank that fails reports before its connections close; give it a moment
        failed = w.get("failed")
    if failed is not None:
        rank, what = failed.split("\n", 1)
        return RankError(f"rank {rank} failed: {what} (rank {me} stopped in {op})", int(rank), "failed")
    # A peer whose last step raised and which went on: the root cause, even once it returned.
    stepped = [(r, w.get(f"stepfailed/{r}")) for r in others]
    stepped = [(r, what) for r, what in stepped if what is not None]
    if stepped:
        r, what = stepped[0]
        return RankError(
            f"rank {r}'s train step raised {what}, and rank {r} went on (the exception was caught) while rank {me} "
            f"waited on it in {op}: the ranks are out of step. Let a step's exception end the function on every "
            "rank, or restart the processes",
            r,
            "failed",
        )
    returned = [r for r in others if w.get(f"returned/{r}") is not None]
    if returned:
        return RankError(
            f"rank {_names(returned)} returned from its function while rank {me} waited on it in {op}: a collective "
            "must be called on every rank (`if rank == 0: sf.gather(x)` runs it on one). Call it on every rank and "
            "use the result where you need it",
            returned[0],
            "returned",
        )
    dead = [r for r in others if _alive(w.get(f"pid/{r}")) is False]
    if dead:
        return RankError(
            f"rank {_names(dead)} died without raising an exception (its process exited: os._exit, a signal, or "
            f"out of memory) while rank {me} was in {op}",
            dead[0],
            "died",
        )
    msg = str(err)
    if isinstance(err, TimeoutError) or "Timed out" in msg or "timeout" in msg.lower():
        now, outside, computing, silent = time.time(), [], [], []
        for r in others:
            seen = w.get(f"seen/{r}")
            if seen is None:
                silent.append((r, None))
                continue
            t, rop, since, waiting = json.loads(seen)
            if now - t > 3 * BEAT_S + 1:
                silent.append((r, now - t))
            elif rop is None:
                outside.append((r, now - t if not since else now - max(since, 0)))
            elif waiting is None:
                computing.append((r, rop, now - since))
        limit = _pg_timeout_s()
        lim = f" (the collective timeout: {limit:.0f} s; set {TIMEOUT_ENV} or sf.launch(..., timeout=))" if limit else ""
        if outside:
            r = outside[0][0]
            return RankError(
                f"rank {_names([r for r, _ in outside])} stalled: it is running its own code, outside any shardfn call, "
                f"while rank {me} timed out waiting on it in {op}{lim}",
                r,
                "stalled",
            )
        if computing:
            r, rop, for_s = computing[0]
            return RankError(
                f"rank {r} stalled: it has been in {rop} for {for_s:.0f} s without reaching the collective that rank "
                f"{me} timed out on in {op}{lim}",
                r,
                "stalled",
            )
        if silent:
            r = silent[0][0]
            return RankError(
                f"rank {r} stopped reporting (hung, or its host is gone) while rank {me} timed out in {op}{lim}",
                r,
                "stalled",
            )
    return err


def _communication_error(e: BaseException) -> bool:
    """Whether `e` is a collective that failed (a peer's connection closed, or a timeout)."""
    if isinstance(e, TimeoutError):
        return True
    msg = str(e)
    return any(s in msg for s in ("gloo", "Connection closed", "Connection reset", "Timed out", "NCCL", "Broken pipe"))


def _names(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _pg_timeout_s() -> float | None:
    return PG_TIMEOUT_S


PG_TIMEOUT_S: float | None = None
"""The timeout of the process group shardfn started on this rank (None: started by the user)."""
