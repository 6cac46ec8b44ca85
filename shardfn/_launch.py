"""`sf.launch`: run a function on N ranks from a script or a notebook cell, and get every result.

Note [launch]
~~~~~~~~~~~~~
The ranks are started by PyTorch's own launcher machinery, `torch.distributed.launcher`'s
`elastic_launch` (what torchrun runs): fresh spawned interpreters (or forks of a warm server, Note [warm ranks]), a rendezvous on a free port,
each rank's output streamed with a `[rankN]` prefix, a monitor that stops every rank as soon as one
fails, and no rank left behind when the call returns, fails or is interrupted. shardfn adds:

* the function, its arguments and the results travel with cloudpickle, so functions and classes
  defined in a notebook cell work; what cannot cross a process boundary (a DeviceMesh, a process
  group or a DTensor made in this process) is refused before anything starts, with the fix;
* each rank runs under a trampoline (`_rank_main`) that starts the process group with the
  collective timeout and reports a failure or a return to the other ranks through the job's
  store; a rank that failed ends its process (its connections close, so ranks waiting on it fail
  at once), and a rank that returned while another still waits on it in a collective ends its
  process too (Note [fail fast] in `shardfn/_watch.py`). `sys.exit` and `KeyboardInterrupt` inside
  the function count as failures (torch's launcher would take them for a result that never comes);
* the error that names the root cause is chosen over the others: a real failure, then a rank that
  died or never started the function, then the `RankError`s of the ranks that stopped because of
  it, then bare communication errors;
* a failure is re-raised here as `RankError` naming the rank that caused it (not the ranks that
  stopped because of it), with that rank's exception as its cause and its traceback in the
  message;
* each rank also writes its result to the launch's folder before returning, so a process that
  dies while it ends, after every rank returned (a crash in the interpreter's teardown), does
  not cost the results: they are returned, and stderr says what happened.

Launched ranks start from nothing: a process group, a mesh or CUDA state of the calling process
never leaks into them. A launched rank is shardfn's own process, so once torch and shardfn are
imported it moves every object made so far out of the garbage collector's reach (`gc.freeze()`):
the modules live until the process ends anyway, and without this every full collection, and the
last one at exit, walks their few hundred thousand objects (about 1 s of a trivial 2-rank
launch's 4 s was the ranks' exit). What the function makes is collected as usual. Under torchrun (or any job whose ranks are already running) `launch` calls
the function on this rank and all-gathers the results instead.

Note [warm ranks]
~~~~~~~~~~~~~~~~~
A fresh interpreter spends about 3 s of CPU importing torch, DTensor and shardfn before a rank can
start. With `SHARDFN_WARM_LAUNCH=1` on Linux (a test suite, a notebook that launches again and
again) the ranks are started the way Python's `forkserver` start method does it, with shardfn
preloaded (`set_forkserver_preload`): the first launch of a process starts one server process,
which imports shardfn and waits; every rank of every launch is forked from it and then prepares
itself as a spawned rank does (the caller's `sys.path`, working directory and main script; the
modules the server imported stay the server's copies). A 2-rank launch after the first takes about
0.3 s instead of 2-4 s. The server holds nothing but imported modules: no process group, no CUDA
state, no user object; it ends once the launching process and every rank forked from it have
ended. (If other code started Python's forkserver first, that server is used as it is.)

It is not the default, because a forked rank is not a fresh interpreter. What shardfn puts right:
its `os.environ` becomes the caller's (plus what torch's launcher sets); its torch and NumPy
random generators are seeded afresh from the OS, as a new interpreter's are (Python's `random`
reseeds itself after a fork); it ends with `os._exit`, as every forkserver child does, so once
its result is delivered it does what an interpreter's exit does, in its order: joins its non-daemon
threads (`threading._shutdown`), then runs its `atexit` handlers (the process group's orderly
destroy, Note [orderly exit] in `_mesh.py`, and the user's); and it ends itself once the caller
is gone or a zombie (torch's launcher only watches its parent, which is the server).
The server is used only while the caller's environment is the one it started with (what a
process reads as it starts, such as glibc's `MALLOC_*` settings, cannot change later; a changed
environment means fresh interpreters) and only in the process that started it. What stays the
server's: the hash seed of `str` (a `set` of names iterates in the same order on every rank, where
torchrun's ranks differ), the umask, resource limits, CPU affinity and niceness as they were when
it started, and the modules it imported (shardfn, torch: an edit to them shows in fresh
interpreters only).
"""

from __future__ import annotations

import contextlib
import io
import linecache
import logging
import math
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
import types
import uuid
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import _collectives as C
from . import _watch
from ._files import write_atomically
from ._watch import RankError

__all__ = ["launch"]



def launch(fn: Callable[..., Any], *args: Any, nprocs: int | None = None, timeout: float | None = None, **kwargs: Any) -> list:
    """Runs `fn(*args, **kwargs)` on `nprocs` ranks and returns every rank's result, rank 0's first.

    Each rank is a fresh process with the default process group started (gloo on CPU; NCCL with
    one GPU per rank where there are GPUs), so `fn` calls `sf.mesh(dp=-1)` and trains as under
    torchrun. Works from a Jupyter cell with functions and classes defined in the notebook; each
    rank's prints appear prefixed with `[rankN]`. Under torchrun it calls `fn` on this rank and
    returns the results of all ranks.

    Args:
        fn: the function every rank runs.
        *args, **kwargs: its arguments (they travel with cloudpickle; `fn` cannot take arguments
            named `nprocs` or `timeout`: bind those with `functools.partial`).
        nprocs: the number of ranks (default 2); under torchrun, the job's (a different number is an error).
        timeout: the collective timeout in seconds: a rank that waits longer on a collective stops,
            naming the rank that stalled (default: `SHARDFN_TIMEOUT`, else 600).

    Returns:
        `[result of rank 0, result of rank 1, ...]`.

    Raises:
        RankError: a rank raised, died, returned while others waited on it, or stalled; it names
            that rank, carries its exception as `__cause__` and its traceback in the message.
            Every rank has been stopped by then.

    Example:
        >>> def train(steps):
        ...     mesh = sf.mesh(dp=-1)
        ...     ...
        ...     return losses
        >>> losses_per_rank = sf.launch(train, 10, nprocs=2)
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            "sf.launch was called while a launched rank was importing the main script: guard the call with "
            '`if __name__ == "__main__":` (each rank imports the script to find your function)'
        )
    if not callable(fn):
        raise ValueError(f"sf.launch(fn, ...): fn must be callable, got {type(fn).__name__}")
    if nprocs is not None and (isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1):
        raise ValueError(f"sf.launch(..., nprocs={nprocs!r}): nprocs is a positive int, the number of ranks")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf):
        raise ValueError(f"sf.launch(..., timeout={timeout!r}): the collective timeout is a positive, finite number of seconds")
    _watch.startup_timeout()  # a bad SHARDFN_TIMEOUT or SHARDFN_STARTUP_TIMEOUT is refused here, before anything starts
    if _in_job():
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
        if nprocs is not None and nprocs != world:
            raise ValueError(
                f"sf.launch(..., nprocs={nprocs}) in a job of {world} ranks (torchrun): the job's ranks run fn. Drop "
                "nprocs, or start the job with that many ranks"
            )
        return _run_in_job(fn, args, kwargs)
    nprocs = 2 if nprocs is None else nprocs
    if torch.cuda.is_available() and nprocs > torch.cuda.device_count():
        raise ValueError(
            f"sf.launch(..., nprocs={nprocs}) with {torch.cuda.device_count()} GPU(s): each rank takes one GPU. Use "
            "nprocs <= the GPU count, or CUDA_VISIBLE_DEVICES='' for CPU ranks"
        )
    payload = _dumps((fn, args, kwargs), "the function and its arguments")
    return _spawn(payload, nprocs, timeout)


def _in_job() -> bool:
    """Whether this process is already one rank of a multi-rank job (torchrun, a launched rank).

    A partial torchrun environment is a `ValueError` (`_mesh.job_env`): launching fresh ranks from
    it would hide a job that was meant to run across nodes.
    """
    from ._mesh import job_env

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    job = job_env()
    return job is not None and job[1] > 1


def _run_in_job(fn: Callable, args: tuple, kwargs: dict) -> list:
    from ._mesh import ensure_process_group

    ensure_process_group()
    out = fn(*args, **kwargs)
    return C.all_gather_object(out, "sf.launch (gathering the results)")


# ---- pickling across the process boundary --------------------------------------------------------


def _refuse(obj: Any) -> str | None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    if not type(obj).__module__.startswith("torch"):
        return None
    if isinstance(obj, DTensor):
        return "a DTensor (its shards live on this process's mesh); pass full tensors, or shard inside the function"
    if isinstance(obj, DeviceMesh):
        return "a DeviceMesh of this process; build it inside the function with sf.mesh(dp=-1)"
    if isinstance(obj, dist.ProcessGroup):
        return "a process group of this process; the ranks start their own"
    return None


def _dumps(obj: Any, what: str) -> bytes:
    import cloudpickle

    sent: set[str] = set()  # source files whose lines (a notebook cell's) already travel

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, o):
            why = _refuse(o)
            if why is not None:
                raise ValueError(f"{what} cannot be sent to another process: it holds {why}")
            if isinstance(o, types.CodeType) and o.co_filename != _DYNAMIC:
                # cloudpickle sends code under the file name "<dynamic-code>": a rank's traceback would
                # show neither the user's file nor its lines. The name goes along, put back on load,
                # with the lines of a source that is no file (a notebook cell, which linecache holds).
                name, lines = o.co_filename, None
                if not os.path.isfile(name):
                    entry = linecache.cache.get(name)
                    if entry is None or len(entry) < 3:
                        return super().reducer_override(o)
                    lines = None if name in sent else list(entry[2])
                    sent.add(name)
                return _code_in_file, (o.replace(co_filename=_DYNAMIC), name, lines)
            return super().reducer_override(o)

    buf = io.BytesIO()
    try:
        Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - pickling errors come in many types
        raise ValueError(f"{what} cannot be sent to another process: {type(e).__name__}: {e}") from e
    return buf.getvalue()


_DYNAMIC = "<dynamic-code>"
"""The file name cloudpickle gives code it sends by value."""


def _code_in_file(code: types.CodeType, filename: str, lines: list[str] | None) -> types.CodeType:
    """`code` as defined in `filename` (its tracebacks show that file's lines); `lines`: the source
    of a file that is not on disk (a notebook cell), for linecache."""
    if lines is not None and filename not in linecache.cache:
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)  # mtime None: kept by checkcache
    return code.replace(co_filename=filename)


# ---- the ranks -----------------------------------------------------------------------------------


_BORN_ENV = dict(os.environ)
"""This process's environment when shardfn was imported: in a rank forked from the warm server, the
server's; in a spawned rank, the caller's. Torch's launcher sets its variables after this."""


def _take_env(caller: dict[str, str]) -> None:
    """Makes this rank's `os.environ` the caller's, plus what torch's launcher set (Note [warm ranks])."""
    want = {**caller, **{k: v for k, v in os.environ.items() if _BORN_ENV.get(k) != v}}
    for k in [k for k in os.environ if k not in want]:
        del os.environ[k]
    for k, v in want.items():
        if os.environ.get(k) != v:
            os.environ[k] = v


def _as_a_fresh_process(caller: int) -> None:
    """What a rank forked from the warm server does to behave as a fresh interpreter (Note [warm ranks])."""
    import atexit
    import threading
    from multiprocessing.util import Finalize

    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()

    def exit_as_an_interpreter() -> None:
        threading._shutdown()  # as an interpreter's exit: executors told to stop, non-daemon threads joined
        atexit._run_exitfuncs()  # then the exit handlers

    Finalize(None, exit_as_an_interpreter, exitpriority=-1)  # once the result is delivered

    def end_with_the_caller() -> None:
        while True:
            time.sleep(1.0)
            if _watch._alive(f"{socket.gethostname()} {caller}") is False:  # gone, or a zombie
                os._exit(1)

    threading.Thread(target=end_with_the_caller, name="shardfn-caller-watch", daemon=True).start()


def _rank_main(payload: bytes, errdir: str, threads: int, timeout: float | None, env: dict[str, str], forked: bool,
               caller: int) -> bytes:
    """What each launched rank runs (Note [launch])."""
    import gc

    import cloudpickle

    from ._mesh import ensure_process_group

    _take_env(env)
    if forked:  # Note [warm ranks]
        _as_a_fresh_process(caller)
    gc.freeze()  # the start-up's objects (torch's modules): out of every collection (Note [launch])
    os.environ[_watch.LAUNCHED_ENV] = "1"
    if timeout is not None:
        os.environ[_watch.TIMEOUT_ENV] = repr(float(timeout))
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads)
    rank = int(os.environ["RANK"])
    try:
        ensure_process_group()
        fn, args, kwargs = cloudpickle.loads(payload)
        open(os.path.join(errdir, f"{rank}.started"), "w").close()
        out = fn(*args, **kwargs)
        from ._checkpoint import _settle

        _settle()  # an asynchronous save still in flight is finished (and its failure is this rank's)
        blob = _dumps(out, f"rank {rank}'s result")
    except BaseException as e:
        if isinstance(e, (SystemExit, KeyboardInterrupt)):
            # torch's launcher takes these for a success without a result and would wait forever.
            how = f"sys.exit({e.code!r})" if isinstance(e, SystemExit) else "KeyboardInterrupt"
            e = _Stopped(f"rank {rank} stopped with {how} inside the launched function: return from it instead "
                         "(the other ranks may be waiting on this one in a collective)")
        elif _watch._communication_error(e):
            e = _watch.explain(e, "a torch.distributed call of the launched function")
        _watch.report_failure(e)
        _write_error(errdir, rank, e)
        raise e from None  # the process ends, its connections close, and ranks waiting on it fail at once
    _write_result(errdir, rank, blob)
    _watch.report_returned()
    _watch.leave_when_waited_on()
    return blob


def _write_result(errdir: str, rank: int, blob: bytes) -> None:
    """The result, also kept on disk: a process that dies in its teardown after this still
    delivers it (`_results_if_all_returned`)."""
    write_atomically(os.path.join(errdir, f"{rank}.result"), blob)


class _Stopped(RuntimeError):
    """A launched rank called sys.exit or was interrupted inside its function."""


def _write_error(errdir: str, rank: int, e: BaseException) -> None:
    tb = "".join(traceback.format_exception(e))
    try:
        exc = _dumps(e, "the exception")
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its text is enough
        exc = None
    path = os.path.join(errdir, f"{rank}")
    # How much it says about the rank at fault: a real failure, a RankError naming one, a bare
    # communication error (which only says that some rank went away).
    weight = 0 if not isinstance(e, RankError) and not _watch._communication_error(e) else 1 if isinstance(e, RankError) else 2
    write_atomically(path, pickle.dumps({"time": time.time(), "traceback": tb, "exc": exc, "weight": weight,
                                          "text": _watch.exception_text(e)}))



# ---- the launching process -----------------------------------------------------------------------


_SIGNALS = [getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, n)]
WARM_ENV = "SHARDFN_WARM_LAUNCH"
"""Set to 1, `sf.launch` forks its ranks from a warm server (Note [warm ranks])."""
_WARM: tuple[int, dict[str, str]] | None = None
"""The process that started the warm server, and the environment it started with."""
_VOLATILE = ("PYTEST_CURRENT_TEST", "TORCHELASTIC_SIGNALS_TO_HANDLE")
"""Variables a tool changes on its own between launches (pytest at each test, torch's launcher in the
caller at its first launch) and nothing reads as a process starts: they do not keep the warm server
from being used."""


def start_method(warm: bool | None = None) -> str:
    """"forkserver" where ranks may come from this process's warm server, else "spawn" (Note [warm
    ranks]); `warm=None` asks `SHARDFN_WARM_LAUNCH`."""
    global _WARM
    if warm is None:
        warm = os.environ.get(WARM_ENV, "") == "1"
    if not warm or not sys.platform.startswith("linux"):  # forking after `import torch` is unsafe on macOS
        return "spawn"
    env = {k: v for k, v in os.environ.items() if k not in _VOLATILE}
    if _WARM is None:
        multiprocessing.get_context("forkserver").set_forkserver_preload(["shardfn"])
        _WARM = (os.getpid(), env)
    return "forkserver" if _WARM == (os.getpid(), env) else "spawn"


def _spawn(payload: bytes, nprocs: int, timeout: float | None) -> list:
    import cloudpickle
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    threads = max(1, (os.cpu_count() or 1) // nprocs)
    method = start_method()
    with tempfile.TemporaryDirectory(prefix="shardfn-launch-") as tmp, _quiet_elastic(), _kept_signals():
        errdir = os.path.join(tmp, "errors")
        os.mkdir(errdir)
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nprocs,
            run_id=uuid.uuid4().hex,
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            max_restarts=0,
            monitor_interval=0.05,
            start_method=method,
            logs_specs=DefaultLogsSpecs(log_dir=os.path.join(tmp, "logs"), redirects=Std.ALL, tee=Std.ALL),
            log_line_prefix_template="[rank${rank}]: ",
        )
        try:
            out = elastic_launch(config, _rank_main)(payload, errdir, threads, timeout, dict(os.environ), method == "forkserver",
                                                        os.getpid())
        except ChildFailedError as e:
            blobs = _results_if_all_returned(e, errdir, nprocs)
            if blobs is None:
                raise _culprit(e, errdir, nprocs) from _cause(errdir)
            out = dict(enumerate(blobs))
        except SignalException as e:
            if e.sigval == signal.SIGINT:
                raise KeyboardInterrupt from None
            raise
    return [cloudpickle.loads(out[r]) for r in range(nprocs)]


def _results_if_all_returned(e: Exception, errdir: str, nprocs: int) -> list[bytes] | None:
    """Every rank's result when every rank returned from the function and a failure came only
    after that, while the process ended (e.g. a SIGABRT in the interpreter's teardown); else None.

    The function ran to completion on every rank, so its results stand; what went wrong is said
    on stderr.
    """
    paths = [os.path.join(errdir, f"{r}.result") for r in range(nprocs)]
    if not all(os.path.exists(p) for p in paths) or any(_has_file(errdir, r) for r in range(nprocs)):
        return None
    failures = getattr(e, "failures", {})
    said = ", ".join(f"rank {f.local_rank} (exit code {f.exitcode})" for f in failures.values()) or "a rank"
    print(f"shardfn: {said} failed while its process ended, after every rank had returned from the function; "
          "the results are complete", file=sys.stderr)
    blobs = []
    for p in paths:
        with open(p, "rb") as f:
            blobs.append(f.read())
    return blobs


def _cause(errdir: str) -> BaseException | None:
    first = _first_error(errdir)
    if first is None or first[1]["weight"] == 2:
        return None
    rank, info = first
    exc = None
    if info["exc"] is not None:
        try:
            exc = pickle.loads(info["exc"])
        except Exception:  # noqa: BLE001 - e.g. a constructor that takes other arguments
            exc = None
    if exc is None:
        exc = RuntimeError(f"(stand-in for an exception that could not be sent back) {info['text']}")
    exc.add_note(f"(raised on rank {rank}; its traceback is in the RankError above)")
    return exc


def _first_error(errdir: str) -> tuple[int, dict] | None:
    """The error that says most about the root failure: a real failure before a RankError naming a
    rank, before a bare communication error; the earliest of a kind."""
    found = []
    for name in os.listdir(errdir):
        if name.isdigit():
            with open(os.path.join(errdir, name), "rb") as f:
                found.append((int(name), pickle.load(f)))
    if not found:
        return None
    found.sort(key=lambda x: (x[1]["weight"], x[1]["time"]))
    return found[0]


def _culprit(e: Exception, errdir: str, nprocs: int) -> RankError:
    first = _first_error(errdir)
    if first is not None and first[1]["weight"] == 0:
        rank, info = first
        return RankError(f"rank {rank} failed; every rank was stopped. Its traceback:\n\n{info['traceback']}", rank, "failed")
    failures = getattr(e, "failures", {})
    died = sorted((f.local_rank, f.exitcode) for f in failures.values() if f.local_rank is not None and not _has_file(errdir, f.local_rank))
    if died:
        rank, code = died[0]
        if not os.path.exists(os.path.join(errdir, f"{rank}.started")):
            return RankError(
                f"rank {rank} exited with code {code} before running the function (see its output above: often an error "
                "while importing the main script, e.g. a script without `if __name__ == \"__main__\":`); every rank was "
                "stopped",
                rank,
                "died",
            )
        signame = signal.Signals(-code).name if code < 0 and -code in signal.Signals._value2member_map_ else None
        causes = {
            "SIGKILL": "often the out-of-memory killer",
            "SIGABRT": "with gloo, often a collective mismatch: the ranks ran different collectives (a model or unit "
                       "called more times on some ranks than on others), or one collective on tensors of different sizes "
                       "(gloo's 'EnforceNotMet ... N vs M': an sf.all_gather of batch shares of unequal size, which, "
                       "as in JAX, needs one shape on every rank); the rank's output above says which",
        }
        how = (f"killed by {signame}: {causes.get(signame, 'a signal')}" if signame
               else f"exit code {code}: os._exit, a signal, or out of memory")
        return RankError(
            f"rank {rank} died without raising an exception ({how}); every rank was stopped",
            rank,
            "died",
        )
    if first is not None:  # only consequences: the first names the rank at fault
        rank, info = first
        exc = None
        if info["exc"] is not None:
            try:
                exc = pickle.loads(info["exc"])
            except Exception:  # noqa: BLE001
                exc = None
        culprit, kind = getattr(exc, "rank", None), getattr(exc, "kind", "failed")
        return RankError(f"{info['text']} (seen by rank {rank}); every rank was stopped", culprit, kind)
    return RankError(f"a rank failed; every rank was stopped: {e}")


def _has_file(errdir: str, rank: int) -> bool:
    return os.path.exists(os.path.join(errdir, str(rank)))


@contextlib.contextmanager
def _quiet_elastic():
    """The launcher's own logging would repeat every failure; `launch` reports it once."""
    logs = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
    old = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(logs, old):
            log.setLevel(level)


@contextlib.contextmanager
def _kept_signals():
    """The launcher installs its own signal handlers; the caller's (a notebook kernel's Ctrl-C) come back."""
    import threading

    main = threading.current_thread() is threading.main_thread()
    old = {s: signal.getsignal(s) for s in _SIGNALS} if main else {}
    try:
        yield
    finally:
        for s, h in old.items():
            if h is not None:
                signal.signal(s, h)
