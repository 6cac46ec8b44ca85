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
* every rank's watch thread writes, twice a second, where the rank is (outside shardfn, inside
  a shardfn call, waiting on a collective): that is what names a stalled rank.

On several nodes the same holds with what Note [fail fast across nodes] adds.

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
import faulthandler
import gc
import io
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Iterator, NamedTuple

import torch.distributed as dist

# Note [fail fast across nodes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# On one node torchrun's agent ends every worker as soon as one fails, and the job's store (the
# agent's own, MASTER_ADDR:MASTER_PORT) outlives them all. Across nodes neither holds. Each node's
# agent watches only its own workers: when node 0's worker fails, node 0's agent stops its other
# workers and exits, and nothing tells node 1's agent (with max_restarts 0 it never looks at the
# rendezvous again, unless the rendezvous store was node 0's agent's too and its next read fails).
# And the job's store is hosted by node 0's agent, so it is gone a moment later: the record of who
# failed went with it, a rank of node 1 whose collective failed could name nobody, and the check
# "is its process still there" (/proc) only ever saw the ranks of its own host. So, when torchrun
# says the job spans several nodes (GROUP_WORLD_SIZE > 1):
#
# * a second store: the first rank of the last node hosts a TCPStore of its own and announces it in
#   the job's store; every rank's watch thread connects to it, and every report, heartbeat and
#   verdict goes to both stores. Whichever node fails, one of the two outlives it (the job's store
#   on node 0, the second store on the last node); a store whose host is gone is left alone, one
#   slow to answer is reconnected (Note [store links]);
# * each rank says who it is (`who/r`: host, pid, node), and errors name the rank with its node:
#   "rank 0 (node 0) failed: ...";
# * a rank on another node is told dead by its heartbeat, not /proc: after a closed connection,
#   the rank waits STALE_BEATS beats (1.5 s) for the job's verdict, or for peers whose heartbeat does
#   not change in that time (by this rank's clock; clocks of different nodes are never compared);
#   those that went silent, and did not return, died (of one node's ranks, the first to go silent,
#   by their own node's clock, is named first). A silent heartbeat alone decides nothing: a rank in
#   a long call that holds the GIL stops beating too, so only a closed connection or a timed-out
#   collective makes a rank look;
# * whatever a rank finds is published as the job's verdict (`failed`: the rank at fault, its kind,
#   the sentence; the first written wins, in both stores), and every rank's watch thread reads the
#   verdict each beat. A rank that nothing told within GRACE_S of the verdict (no RankError was
#   raised in it: it runs its own code, or waits on a rank that waits too, or it is the stalled
#   rank itself) says so on stderr and in torchrun's error file, and ends its process, so its node's
#   agent ends too. A rank named stalled counts from when it was asked for its stack (Note [a
#   stalled rank shows where]): the rank that named it publishes the verdict next, and may be gone,
#   with its store, before this rank reads it. A rank that caught a RankError, returned, or failed
#   itself is left alone;
# * a rank whose script ends by an uncaught exception skips the interpreter's finalization
#   (Note [a failed rank ends at once]), which under load took longer than the rest of the stop.
#
# On one node nothing of this runs: the agent stops every rank, and messages stay as they were.

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
BEAT_S = 0.5
"""How often each rank's heartbeat says where it is."""
STALE_BEATS = 3
"""A rank on another node whose heartbeat has not changed for this many beats is not beating."""
GRACE_S = 3.0
"""On several nodes: how long a rank that nothing told of the job's verdict keeps running."""
STACK_WAIT_S = 5.0
"""How long a rank that names another stalled waits for that rank's stack (Note [a stalled rank shows where])."""
STACK_FRAMES = 12
"""The innermost frames of a stalled rank's main thread that its error shows."""
STORE_TIMEOUT_S = 2.0
"""The watch's store calls give up after this long (a store whose host is gone)."""


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
    failed_group: object = None  # the process group of the wait that last failed (None: not known)


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
        TOLD[0] = True
        raise clear from e
    finally:
        if outer is None and mark:
            WHERE.op, WHERE.waiting = None, None


@contextlib.contextmanager
def waiting(group: object = None) -> Iterator[None]:
    """Marks a blocking wait on a collective (for the heartbeat); `group`, the process group waited
    on when known, is kept if the wait fails, so that a stall is looked for among its ranks."""
    WHERE.waiting, WHERE.failed_group = time.time(), None
    try:
        yield
    except BaseException:
        WHERE.failed_group = group
        raise
    finally:
        WHERE.waiting = None


# Note [store links]
# ~~~~~~~~~~~~~~~~~~
# The watch talks to the job's store (and, on several nodes, the second store) over TCP
# connections whose calls give up after STORE_TIMEOUT_S. A call that fails because the connection
# closed (`DistNetworkError`: reset, broken pipe) means the store's host is gone: that link is
# dead, never asked again. A call that fails otherwise (a timeout: a store slow to answer, as
# under the load of many ranks starting at once) says nothing of the host, and the connection may
# still hold the late answer, which the next call would read as its own: so the link is remade,
# a new connection, and the call tried once more on it; only a link that cannot be remade is dead.
# Before, any failure left a link dead for good, so one slow answer at start-up cut a rank off the
# job's store for the rest of the job, and a verdict that later lived only there (the other store's
# node gone) never reached it: a stalled node-0 rank ran on until its agent stopped it, 22 s late.


class _Gone(Exception):
    """A store link that is dead (Note [store links])."""


class _Link:
    """One connection to a store (a `PrefixStore` over a `TCPStore` client), remade once when a
    call on it fails other than by its connection closing (Note [store links])."""

    REMAKE_S = 1.0
    """How long a new connection may take to open, where the old one timed out (TCPStore's connect
    tries twice: about 1.5 s to give up on a host that is gone)."""
    LONGEST_CALL_S = 2 * STORE_TIMEOUT_S + 2 * REMAKE_S
    """The longest a call can take: it times out, a new connection opens, the call times out again
    (the watch thread's join at exit waits this long)."""

    def __init__(self, host: str, port: int, prefix: str):
        self.host, self.port, self.prefix = host, port, prefix
        self.dead = False
        self.remade = 0  # how many times the connection was remade (tests read it)
        self.store = self._connect(STORE_TIMEOUT_S)

    def _connect(self, open_s: float):
        store = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=open_s))
        store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
        return dist.PrefixStore(self.prefix, store)

    def call(self, fn):
        """`fn(store)`, or `_Gone` when the store's host is gone."""
        if self.dead:
            raise _Gone
        try:
            return fn(self.store)
        except dist.DistNetworkError:  # its connection closed: the host is gone
            self.dead = True
            raise _Gone from None
        except Exception:  # noqa: BLE001 - a timeout, or a connection left mid-answer
            pass
        try:
            self.store = self._connect(self.REMAKE_S)
            self.remade += 1
            return fn(self.store)
        except Exception:  # noqa: BLE001 - it cannot be reached: gone
            self.dead = True
            raise _Gone from None


class _Watch:
    """This rank's link to the job's stores: reports, verdicts, and the watch thread (Notes [fail
    fast], [fail fast across nodes]).

    `stores` are the main thread's connections, `_own` the watch thread's (a connection is used by
    one thread at a time): the job's store first, then, on several nodes, the second store once
    it is announced. A link whose store's host is gone is not asked again (Note [store links])."""

    def __init__(self, host: str, port: int, rank: int, world: int, prefix: str):
        self.rank, self.world, self.prefix = rank, world, prefix
        self.host, self.port = host, port
        self.node, self.multi = node_name(), nodes_in_job() > 1
        self.stores = [_Link(host, port, prefix)]
        self._own = [_Link(host, port, prefix)]
        self._whos: dict[int, list] = {}
        self.verdict_seen: float | None = None  # when the watch thread first read a verdict, or was named stalled
        self.named_by: str | None = None  # the rank that named this one stalled
        self._server = None
        for link in self.stores:
            self._introduce(link)
        self._thread: threading.Thread | None = None
        if self.multi and _hosts_second_store():
            # Note [fail fast across nodes]: the store that outlives node 0's agent.
            addr = _address_towards(host, port)
            with contextlib.suppress(Exception):  # none: the job's store alone, as on one node
                self._server = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False,
                                             timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
                self.stores[0].call(lambda st: st.set("second-store", f"{addr} {self._server.port}"))
        self._stop = threading.Event()
        self._beat()
        atexit.register(_stop_at_exit, self)  # before the hooks' handler: runs after it (last in, first out)
        self._thread = threading.Thread(target=self._watching, name="shardfn-watch", daemon=True)
        self._thread.start()

    def _introduce(self, link: "_Link") -> None:
        link.call(lambda st: st.set(f"pid/{self.rank}", f"{socket.gethostname()} {os.getpid()}"))
        link.call(lambda st: st.set(f"who/{self.rank}", json.dumps([socket.gethostname(), os.getpid(), self.node])))

    # -- the watch thread ---------------------------------------------------------------------

    def _beat(self) -> None:
        w = WHERE
        beat = json.dumps([time.time(), w.op, w.since, w.waiting])
        for link in self._live(self._own):
            with contextlib.suppress(_Gone):
                link.call(lambda st: st.set(f"seen/{self.rank}", beat))

    def _watching(self) -> None:
        while not self._stop.wait(BEAT_S):
            self._beat()
            asked = self.get(f"dump/{self.rank}")
            if asked is not None:
                self.delete(f"dump/{self.rank}")
                self._dump_stacks(asked)
            if not self.multi:
                continue
            if asked is not None and self.verdict_seen is None:
                self.named_by = asked
                # Named stalled: the job stops on this rank, whether or not its verdict reaches
                # this rank (the store it was written to may be gone by the next beat).
                self.verdict_seen = time.monotonic()
            if len(self._own) == 1:
                self._join_second_store()
            if self.verdict_seen is None and self.get("failed") is not None:
                self.verdict_seen = time.monotonic()
            if self.verdict_seen is not None and time.monotonic() - self.verdict_seen > GRACE_S:
                if not (FAILED_HERE[0] or TOLD[0] or RETURNED[0]):
                    self._stop_this_rank()
                    return

    def _join_second_store(self) -> None:
        where = self.get("second-store")
        if where is None:
            return
        addr, port = where.rsplit(" ", 1)
        try:
            mine, theirs = _Link(addr, int(port), self.prefix), _Link(addr, int(port), self.prefix)
            self._introduce(mine)
        except Exception:  # noqa: BLE001 - its host is gone already
            return
        self._own.append(mine)
        self.stores.append(theirs)

    def _dump_stacks(self, asked: str) -> None:
        """Note [a stalled rank shows where]: this rank was named stalled (by `asked`); where its
        main thread is goes to the store, for the rank that named it, and every thread's stack to
        its stderr (torchrun's log of this rank)."""
        frame = sys._current_frames().get(threading.main_thread().ident)
        where = "".join(traceback.format_stack(frame)[-STACK_FRAMES:]) if frame is not None else "(no Python frame)\n"
        self.set(f"stack/{self.rank}", where[-4000:])
        print(f"shardfn: {self.who(self.rank)} was named stalled by {asked}; where each of its threads is now:",
              file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # a stderr that is closed or has no file descriptor
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    def stack_of(self, rank: int, wait_s: float) -> str | None:
        """Rank `rank`'s main-thread stack, once it has answered `dump/rank` (within `wait_s`)."""
        end = time.monotonic() + wait_s
        while True:
            where = self.get(f"stack/{rank}")
            if where is not None:
                self.delete(f"stack/{rank}")
                return where
            if time.monotonic() > end:
                return None
            time.sleep(BEAT_S / 5)

    def _stop_this_rank(self) -> None:
        """Ends this rank, which was told nothing in GRACE_S since a verdict (it runs its own code,
        or waits on a rank that waits too): the job has stopped on another rank, or on this one."""
        verdict = self.verdict()
        me = self.who(self.rank)
        if verdict is None and self.named_by is not None:  # the verdict's store went with its writer
            verdict = {"rank": self.rank, "text": f"{me} stalled: {self.named_by} timed out waiting on it"}
        text = verdict["text"] if verdict else "another rank failed"
        msg = (f"shardfn: {text}. {me[0].upper()}{me[1:]} is stopped: the job's other ranks stopped on "
               f"{'it' if verdict and verdict['rank'] == self.rank else 'that rank'} (Note [fail fast across nodes])")
        print(msg, file=sys.stderr, flush=True)
        _write_error_file("RankError", msg, msg)
        os._exit(1)

    # -- reads and writes ---------------------------------------------------------------------

    def _live(self, links: list) -> "list[_Link]":
        return [link for link in list(links) if not link.dead]

    def _read(self, links: list, key: str) -> str | None:
        for link in self._live(links):
            with contextlib.suppress(_Gone):
                got = link.call(lambda st: st.get(key).decode() if st.check([key]) else None)
                if got is not None:
                    return got
        return None

    def _mine(self) -> list:
        """The connections of the calling thread: the watch thread's own, or the others'."""
        return self._own if threading.current_thread() is self._thread else self.stores

    def get(self, key: str) -> str | None:
        """`key` from the first store that has it."""
        return self._read(self._mine(), key)

    def seen(self, r: int) -> list | None:
        """Rank `r`'s freshest heartbeat over the stores: [time, op, since, waiting]."""
        beats = []
        for st in self._live(self._mine()):
            v = self._read([st], f"seen/{r}")
            if v is not None:
                beats.append(json.loads(v))
        return max(beats, key=lambda b: b[0]) if beats else None

    def set(self, key: str, value: str) -> None:
        for link in self._live(self._mine()):
            with contextlib.suppress(_Gone):
                link.call(lambda st: st.set(key, value))

    def delete(self, key: str) -> None:
        for link in self._live(self._mine()):
            with contextlib.suppress(_Gone):
                link.call(lambda st: st.delete_key(key))

    def publish(self, rank: int | None, kind: str, text: str) -> dict:
        """Writes the job's verdict (the first one written wins, in every store); returns the one
        that stands."""
        mine = json.dumps({"rank": rank, "kind": kind, "text": text})
        standing = None
        for link in self._live(self._mine()):
            try:
                got = link.call(lambda st: st.compare_set("failed", "", mine).decode())
            except _Gone:
                continue
            standing = standing or got
        return _verdict(standing or mine)

    def verdict(self) -> dict | None:
        raw = self.get("failed")
        return None if raw is None else _verdict(raw)

    def who(self, r: int) -> str:
        """"rank r", with its node on several nodes: "rank r (node n)"."""
        if not self.multi:
            return f"rank {r}"
        rec = self._who(r)
        return f"rank {r} (node {rec[2]})" if rec else f"rank {r}"

    def _who(self, r: int) -> list | None:
        if r not in self._whos:
            raw = self.get(f"who/{r}")
            if raw is None:
                return None
            self._whos[r] = json.loads(raw)
        return self._whos[r]

    def same_node(self, r: int) -> bool:
        rec = self._who(r)
        return rec is None or (rec[0] == socket.gethostname() and rec[2] == self.node)

    def died(self, r: int) -> bool:
        """Whether rank `r`'s process is gone, as told from here: on this node, from /proc."""
        return _alive(self.get(f"pid/{r}")) is False


def _verdict(raw: str) -> dict:
    try:
        v = json.loads(raw)
    except ValueError:
        v = None
    if not isinstance(v, dict):  # an older writer's "rank\ntext"
        rank, what = raw.split("\n", 1)
        v = {"rank": int(rank), "kind": "failed", "text": f"rank {rank} failed: {what}"}
    return v


def _stop_at_exit(w: _Watch) -> None:
    """The watch thread ends before the interpreter does (Note [watch thread at exit]); a process
    that ends by `os._exit` (Note [a failed rank ends at once]) is not finalized: it waits for none."""
    w._stop.set()
    if _ENDING_AT_ONCE[0]:
        return
    for t in [w._thread, *_LINGER]:
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(_Link.LONGEST_CALL_S + BEAT_S)


# Note [watch thread at exit]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A daemon thread still running when the interpreter finalizes is ended by CPython (3.13 and
# older) with `pthread_exit` as soon as it takes the GIL again. If that happens as it comes back
# from a call into torch that released the GIL, such as a store `set`, the thread is unwound from
# inside pybind11's `gil_scoped_release` destructor, which is `noexcept`: `std::terminate`, and
# the process ends with SIGABRT, "terminate called without an active exception", after all its
# work was done (pytorch/pytorch#38228; `docs/exit-abort.md` has a ten-line reproduction that
# aborts every time). The watch thread calls the store once or twice a beat, so a rank's exit met
# it now and then; under torchrun on several nodes the abort failed a finished job's node, whose
# agent then never reached the exit barrier the other node's agent waits in (300 s). So the watch
# thread, and the thread that waits for a rank to be waited on (`leave_when_waited_on`), are
# stopped and joined by an exit handler, while the interpreter is whole; they only ever wait on
# an Event between calls.


def _write_error_file(name: str, message: str, text: str) -> None:
    """torchrun's error file for this rank, if none is written yet (its summary shows it)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and not os.path.exists(path):
        with contextlib.suppress(Exception):
            with open(path, "w") as f:
                json.dump({"message": {"message": f"{name}: {message}",
                                       "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}, f)


def node_name() -> str:
    """This rank's node: torchrun's GROUP_RANK, else the host name."""
    return os.environ.get("GROUP_RANK") or socket.gethostname()


def nodes_in_job() -> int:
    """How many nodes torchrun started the job on (GROUP_WORLD_SIZE; 1 where it is not set)."""
    try:
        return max(1, int(os.environ.get("GROUP_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _hosts_second_store() -> bool:
    """Whether this rank hosts the job's second store: the first rank of the last node."""
    return os.environ.get("GROUP_RANK") == str(nodes_in_job() - 1) and os.environ.get("LOCAL_RANK", "0") == "0"


def _address_towards(host: str, port: int) -> str:
    """This host's address on the route to `host` (where the other nodes reach it)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError:
        return socket.getfqdn()


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
        # torchrun's summary then shows this exception
        _write_error_file(tp.__name__, str(value), "".join(traceback.format_exception(tp, value, tb)))
        previous(tp, value, tb)
        # Note [a failed rank ends at once]; not where another hook wraps this one (it may have more
        # to do after it), nor for an interrupt (which ends by SIGINT)
        if nodes_in_job() > 1 and sys.excepthook is hook and not issubclass(tp, KeyboardInterrupt):
            _end_failed_process(1)

    def at_exit() -> None:
        if not failed:
            with contextlib.suppress(BaseException):
                report_returned()

    sys.excepthook = hook
    atexit.register(at_exit)


# Note [a stalled rank shows where]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A rank named stalled (it was in its own code, or in a shardfn call without waiting on a
# collective, while a peer's collective timed out) knows nothing of it: the peers' errors say that
# it stalled, not where. So the rank that names it also writes `dump/r` in the job's store, and
# every rank's watch thread looks for its own each beat (one store read); the stalled rank's watch
# thread then writes its main thread's innermost frames to `stack/r`, which the naming rank waits
# for (STACK_WAIT_S, paid only when a stall is named) and puts in its `RankError`, and prints the
# stack of each of its threads (faulthandler, so a thread in native code shows too) to its stderr,
# once per naming; the stalled rank carries on as before. A rank that does not answer in time (its
# host gone, its watch thread starved) leaves the error as it was.


# Note [a failed rank ends at once]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A node's agent ends once its ranks have exited, and a rank that failed has exited only when
# CPython has finalized it: every module and object of a torch process torn down, then the C++
# destructors (process groups, stores). On a 2-core machine running ~10 processes per core that
# took 2 to 9 s after the rank's last exit handler (measured: the error named in 2-4 s, node 1's
# agent gone 9-15 s after the fault); on GPUs the destructor of a communicator whose peer is dead
# can wait far longer. Little of it is useful to a job that has failed. So on several nodes
# (Note [fail fast across nodes]) a rank whose script ends by an uncaught exception ends as CPython
# would, up to the finalization: the exception printed, torchrun's error file written, the
# interpreter's thread shutdown (non-daemon threads joined, executors shut down) and every exit
# handler run (logging's files among them), every file object still open flushed (a script's
# `open()` left unclosed keeps what it wrote), the standard streams flushed; then `os._exit(1)`, the
# exit status of an uncaught exception. What only the finalization does is lost, as on a kill: a
# compressed file left open ends without its trailer, a temporary file is left behind; close them
# (a `with` block) to keep them whole. A rank that ends normally or by an interrupt, one whose
# excepthook another hook wraps, and every rank on one node, exit as before. The watch thread's
# exit handler does not wait for a store call in flight here (Note [watch thread at exit] is about
# a finalization, which `os._exit` skips): a call to the store of a node that is gone could
# otherwise hold the exit for seconds.


def _end_failed_process(code: int) -> None:
    """Ends this failed process as the interpreter would, without its finalization (Note [a
    failed rank ends at once]); returns, to the interpreter's own exit, where CPython lacks the
    functions that run the thread shutdown and the exit handlers."""
    shutdown, run_exit = getattr(threading, "_shutdown", None), getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or run_exit is None or threading.current_thread() is not threading.main_thread():
        return
    _ENDING_AT_ONCE[0] = True  # the exit handlers need not wait for the watch thread: no finalization follows
    with contextlib.suppress(BaseException):
        shutdown()
    with contextlib.suppress(BaseException):
        run_exit()
    with contextlib.suppress(BaseException):
        for f in gc.get_objects():  # the file objects a script left open (tracked by the collector)
            if isinstance(f, io.IOBase) and not f.closed and f.writable():
                with contextlib.suppress(BaseException):
                    f.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code)


FAILED_HERE = [False]  # whether this rank failed (its process group is then left to the exit)
TOLD = [False]  # whether a RankError was raised here (this rank's code knows the job stopped)
RETURNED = [False]  # whether this rank reported that its function returned
_LINGER: list = []  # the thread of leave_when_waited_on, joined at exit with the watch thread
_ENDING_AT_ONCE = [False]  # whether this process ends by os._exit after its exit handlers


def report_failure(exc: BaseException) -> None:
    """Tells the other ranks that this rank failed with `exc` (the first report in a job wins)."""
    FAILED_HERE[0] = True
    w = _WATCH[0] if _WATCH else None
    if w is None or isinstance(exc, RankError) or _communication_error(exc):
        return  # a consequence of another rank's failure, not a cause
    w.publish(w.rank, "failed", f"{w.who(w.rank)} failed: {exception_text(exc)}")


def report_step(exc: BaseException | None) -> None:
    """Records that this rank's train step raised `exc` (None: a step succeeded since). The caller
    may catch it and go on; a peer left waiting on this rank in vain then learns why (`explain`).

    Every step that ends is counted, and a failure is recorded with its step's number: a step that
    raised on every rank (a refusal the ranks agreed on, a user error each rank met) leaves them in
    step, and is no explanation of a later stall (Note [out of step])."""
    _STEPS_ENDED[0] += 1
    w = _WATCH[0] if _WATCH else None
    if w is None or (exc is None and not _STEP_FAILED[0]):
        return
    if exc is not None and (isinstance(exc, RankError) or _communication_error(exc)):
        return
    if exc is None:
        w.delete(f"stepfailed/{w.rank}")
        _STEP_FAILED[0] = 0
    else:
        w.set(f"stepfailed/{w.rank}", f"{_STEPS_ENDED[0]} {exception_text(exc)}")
        _STEP_FAILED[0] = _STEPS_ENDED[0]


_STEPS_ENDED = [0]  # how many train steps this rank has ended, each way
_STEP_FAILED = [0]  # the number of this rank's last step if it raised (its record is in the store), else 0


# Note [out of step]
# ~~~~~~~~~~~~~~~~~~
# A rank whose step raised, and whose code caught the exception and went on, is at another point of
# the program than its peers: they wait in that step's collectives for it, or it waits in the next
# step's for them. When a wait times out, that failure is the cause to name. But a step that raised
# on every rank (the ranks ran different units, a debug-mode shape check, a refusal each rank made)
# leaves them together, and a later stall has another cause: so a failure is named only when the
# rank that asks did not fail the same step (the ranks count the steps they end alike: each ends
# every step it starts, one way or the other). Taking every failure for the cause named the wrong
# rank, and kept the stalled rank from being asked where it was.
def _failed_step(raw: str | None) -> "tuple[int, str] | None":
    """A `stepfailed/` record: (the step's number, what it raised)."""
    if raw is None:
        return None
    n, _, what = raw.partition(" ")
    return int(n), what


def report_returned() -> None:
    """Tells the other ranks that this rank's function returned (it joins no more collectives)."""
    w = _WATCH[0] if _WATCH else None
    RETURNED[0] = True
    if w is None:
        return
    w.set(f"returned/{w.rank}", "1")


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
        while not w._stop.wait(BEAT_S / 2):  # Note [watch thread at exit]
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

    linger = threading.Thread(target=run, name="shardfn-linger", daemon=True)
    _LINGER.append(linger)
    linger.start()


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
    or `err` itself when the stores tell nothing. On several nodes the rank is named with its node,
    and what this rank found is published as the job's verdict (Note [fail fast across nodes])."""
    w = _WATCH[0] if _WATCH else None
    if w is None:
        return err
    found = _explain(w, err, op)
    if found is None:
        return err
    rank, kind, culprit, observed = found.rank, found.kind, found.culprit, found.observed
    # Note [a stalled rank shows where]: asked by the rank that found the stall; a rank that read it
    # in the job's verdict (whose text holds the stack already) asks nobody, least of all itself.
    if kind == "stalled" and rank is not None and rank != w.rank and not found.from_verdict:
        w.delete(f"stack/{rank}")
        w.set(f"dump/{rank}", w.who(w.rank))
        where = w.stack_of(rank, STACK_WAIT_S)
        if where is not None:
            observed = f"{observed}. {w.who(rank)[0].upper()}{w.who(rank)[1:]} was here (its main thread, innermost last):\n{where.rstrip()}"
    if w.multi and kind != "verdict":
        v = w.publish(rank, kind, f"{culprit} {observed}")
        if v["text"] != f"{culprit} {observed}":  # another rank's verdict came first: the job's cause
            rank, kind, culprit, observed = v["rank"], v["kind"], v["text"], f"({w.who(w.rank)} stopped in {op})"
    return RankError(f"{culprit} {observed}", rank, "failed" if kind == "verdict" else kind)


class _Found(NamedTuple):
    """What `_explain` found: the rank at fault, its kind, what happened to it, what this rank saw,
    and whether it was read in the job's verdict (another rank found it)."""

    rank: int | None
    kind: str
    culprit: str
    observed: str
    from_verdict: bool = False


def _explain(w: _Watch, err: BaseException, op: str) -> "_Found | None":
    """What this rank can tell of the rank at fault, or None."""
    me, others = w.who(w.rank), [r for r in range(w.world) if r != w.rank]
    v = w.verdict()
    if v is None:
        time.sleep(0.2)  # a rank that fails reports before its connections close; give it a moment
        v = w.verdict()
    if v is not None:
        return _Found(v["rank"], "verdict" if v["kind"] == "failed" else v["kind"], v["text"], f"({me} stopped in {op})", True)
    # A peer whose last step raised and which went on: the root cause, even once it returned.
    failed = {r: _failed_step(w.get(f"stepfailed/{r}")) for r in others}
    stepped = [(r, f[1]) for r, f in failed.items() if f is not None and f[0] != _STEP_FAILED[0]]
    if stepped:
        r, what = stepped[0]
        return _Found(r, "failed", f"{w.who(r)}'s train step raised {what}, and rank {r} went on (the exception was caught)",
                f"while {me} waited on it in {op}: the ranks are out of step. Let a step's exception end the function "
                "on every rank, or restart the processes")
    returned = [r for r in others if w.get(f"returned/{r}") is not None]
    if returned:
        return _Found(returned[0], "returned", f"{', '.join(w.who(r) for r in returned)} returned from its function",
                f"while {me} waited on it in {op}: a collective must be called on every rank (`if rank == 0: "
                "sf.gather(x)` runs it on one). Call it on every rank and use the result where you need it")
    dead = [r for r in others if w.same_node(r) and w.died(r)]
    how = "its process exited: os._exit, a signal, or out of memory"
    timed_out = isinstance(err, TimeoutError) or "Timed out" in str(err) or "timeout" in str(err).lower()
    if not dead and w.multi and not timed_out:
        v, dead = _silent_elsewhere(w, [r for r in others if not w.same_node(r)])
        if v is not None:
            return _Found(v["rank"], "verdict" if v["kind"] == "failed" else v["kind"], v["text"], f"({me} stopped in {op})", True)
        how = "its connections closed and its heartbeat stopped: os._exit, a signal, out of memory, or its node is gone"
    if dead:
        return _Found(dead[0], "died", f"{', '.join(w.who(r) for r in dead)} died without raising an exception ({how})",
                f"while {me} was in {op}")
    alone = not all(f is not None and f[0] == _STEP_FAILED[0] for f in failed.values())
    # This rank's own last step raised and it went on: its peers are elsewhere. That is the cause
    # before any peer that looks stalled: a peer seen in a step or a collective is one this rank
    # left (a peer that died, returned, or failed a step of its own is named above).
    if _STEP_FAILED[0] and alone:
        what = (_failed_step(w.get(f"stepfailed/{w.rank}")) or (0, "an exception"))[1]
        return _Found(w.rank, "failed", f"{me}'s last train step raised {what}, and {me} went on (the exception was caught)",
                      f"and then failed to meet the other ranks in {op}: the ranks are out of step. Let a step's exception "
                      "end the function on every rank, or restart the processes")
    if timed_out:
        now, outside, computing, silent = time.time(), [], [], []
        for r in _peers_waited_on(others):
            seen = w.seen(r)
            if seen is None:
                silent.append((r, None))
                continue
            t, rop, since, waiting = seen
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
            return _Found(r, "stalled", f"{', '.join(w.who(q) for q, _ in outside)} stalled: it is running its own code, "
                    "outside any shardfn call,", f"while {me} timed out waiting on it in {op}{lim}")
        if computing:
            r, rop, for_s = computing[0]
            return _Found(r, "stalled", f"{w.who(r)} stalled: it has been in {rop} for {for_s:.0f} s",
                    f"without reaching the collective that {me} timed out on in {op}{lim}")
        if silent:
            r = silent[0][0]
            return _Found(r, "stalled", f"{w.who(r)} stopped reporting (hung, or its host is gone)",
                    f"while {me} timed out in {op}{lim}")
    return None


def _silent_elsewhere(w: _Watch, remote: list[int]) -> "tuple[dict | None, list[int]]":
    """After a closed connection on several nodes: waits up to STALE_BEATS beats for the job's
    verdict, or for ranks on other nodes whose heartbeats do not change (told by this rank's
    clock, not by comparing clocks across nodes). Returns (verdict, silent ranks, the first to
    fall silent first: the last beats of one node's ranks share its clock)."""
    if not remote:
        return None, []
    first = {r: w.seen(r) for r in remote}
    t0 = time.monotonic()
    while True:
        time.sleep(BEAT_S / 2)
        v = w.verdict()
        if v is not None:
            return v, []
        if time.monotonic() - t0 >= STALE_BEATS * BEAT_S:
            break
    silent = [r for r in remote if first[r] is not None and w.seen(r) == first[r]
              and w.get(f"returned/{r}") is None]
    return None, sorted(silent, key=lambda r: (first[r][0], r))


def _peers_waited_on(others: list[int]) -> list[int]:
    """Of `others`, the ranks of the process group whose wait timed out, when it is known (a rank
    outside it cannot be the one it waited for); all of them otherwise."""
    group, WHERE.failed_group = WHERE.failed_group, None
    if group is None or not dist.is_initialized():
        return others
    try:
        members = set(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError):  # a group already destroyed
        return others
    return [r for r in others if r in members] or others


def _communication_error(e: BaseException) -> bool:
    """Whether `e` is a collective that failed (a peer's connection closed, or a timeout)."""
    if isinstance(e, TimeoutError):
        return True
    msg = str(e)
    return any(s in msg for s in ("gloo", "Connection closed", "Connection reset", "Timed out", "NCCL", "Broken pipe",
                                  "pair closure"))  # gloo's "Application timeout caused pair closure"


def _names(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _pg_timeout_s() -> float | None:
    return PG_TIMEOUT_S


PG_TIMEOUT_S: float | None = None
"""The timeout of the process group shardfn started on this rank (None: started by the user)."""
