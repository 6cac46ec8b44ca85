"""`sf.launch`: run a function on N ranks from a script or a notebook cell, and get every result.

Note [launch]
~~~~~~~~~~~~~
The ranks are started by PyTorch's own launcher machinery, `torch.distributed.launcher`'s
`elastic_launch` (what torchrun runs): fresh spawned interpreters, a rendezvous on a free port,
each rank's output streamed with a `[rankN]` prefix, a monitor that stops every rank as soon as one
fails, and no process left behind when the call returns, fails or is interrupted. shardfn adds:

* the function, its arguments and the results travel with cloudpickle, so functions and classes
  defined in a notebook cell work; what cannot cross a process boundary (a DeviceMesh, a process
  group or a DTensor made in this process) is refused before anything starts, with the fix;
* each rank runs under a trampoline (`_rank_main`) that starts the process group with the
  collective timeout, reports a failure or a return to the other ranks through the job's store,
  and drops its process group on the way out, so a rank still waiting on it fails at once with
  an error naming it (Note [fail fast] in `shardfn/_watch.py`);
* a failure is re-raised here as `RankError` naming the rank that caused it (not the ranks that
  stopped because of it), with that rank's exception as its cause and its traceback in the
  message.

Spawned ranks start from nothing: a process group, a mesh or CUDA state of the calling process
never leaks into them. Under torchrun (or any job whose ranks are already running) `launch` calls
the function on this rank and all-gathers the results instead.
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing
import os
import pickle
import signal
import tempfile
import time
import traceback
import uuid
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import _watch
from ._watch import RankError

__all__ = ["launch"]



def launch(fn: Callable[..., Any], *args: Any, nprocs: int = 2, timeout: float | None = None, **kwargs: Any) -> list:
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
        nprocs: the number of ranks.
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
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"sf.launch(..., nprocs={nprocs!r}): nprocs is a positive int, the number of ranks")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"sf.launch(..., timeout={timeout!r}): the collective timeout is a positive number of seconds")
    if _in_job():
        return _run_in_job(fn, args, kwargs)
    if torch.cuda.is_available() and nprocs > torch.cuda.device_count():
        raise ValueError(
            f"sf.launch(..., nprocs={nprocs}) with {torch.cuda.device_count()} GPU(s): each rank takes one GPU. Use "
            "nprocs <= the GPU count, or CUDA_VISIBLE_DEVICES='' for CPU ranks"
        )
    payload = _dumps((fn, args, kwargs), "the function and its arguments")
    return _spawn(payload, nprocs, timeout)


def _in_job() -> bool:
    """Whether this process is already one rank of a multi-rank job (torchrun, a launched rank)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return True
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _run_in_job(fn: Callable, args: tuple, kwargs: dict) -> list:
    from ._mesh import ensure_process_group

    ensure_process_group()
    out = fn(*args, **kwargs)
    results: list = [None] * dist.get_world_size()
    with _watch.watched("sf.launch (gathering the results)"):
        dist.all_gather_object(results, out)
    return results


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

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, o):
            why = _refuse(o)
            if why is not None:
                raise ValueError(f"{what} cannot be sent to another process: it holds {why}")
            return super().reducer_override(o)

    buf = io.BytesIO()
    try:
        Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - pickling errors come in many types
        raise ValueError(f"{what} cannot be sent to another process: {type(e).__name__}: {e}") from e
    return buf.getvalue()


# ---- the ranks -----------------------------------------------------------------------------------


def _rank_main(payload: bytes, errdir: str, threads: int) -> bytes:
    """What each launched rank runs (Note [launch])."""
    import cloudpickle

    from ._mesh import ensure_process_group

    os.environ[_watch.LAUNCHED_ENV] = "1"
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads)
    rank = int(os.environ["RANK"])
    try:
        ensure_process_group()
        fn, args, kwargs = cloudpickle.loads(payload)
        out = fn(*args, **kwargs)
        blob = _dumps(out, f"rank {rank}'s result")
    except BaseException as e:
        _watch.report_failure(e)
        _write_error(errdir, rank, e)
        raise  # the process ends, its connections close, and ranks waiting on it fail at once
    _watch.report_returned()
    _watch.leave_when_waited_on()
    return blob


def _write_error(errdir: str, rank: int, e: BaseException) -> None:
    tb = "".join(traceback.format_exception(e))
    try:
        exc = _dumps(e, "the exception")
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its text is enough
        exc = None
    path = os.path.join(errdir, f"{rank}")
    with open(path + ".tmp", "wb") as f:
        pickle.dump({"time": time.time(), "traceback": tb, "exc": exc, "secondary": isinstance(e, RankError)}, f)
    os.replace(path + ".tmp", path)



# ---- the launching process -----------------------------------------------------------------------


_SIGNALS = [getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, n)]


def _spawn(payload: bytes, nprocs: int, timeout: float | None) -> list:
    import cloudpickle
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    threads = max(1, (os.cpu_count() or 1) // nprocs)
    env = {_watch.TIMEOUT_ENV: str(float(timeout))} if timeout is not None else {}
    with tempfile.TemporaryDirectory(prefix="shardfn-launch-") as tmp, _quiet_elastic(), _kept_signals(), _env(env):
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
            start_method="spawn",
            logs_specs=DefaultLogsSpecs(log_dir=os.path.join(tmp, "logs"), redirects=Std.ALL, tee=Std.ALL),
            log_line_prefix_template="[rank${rank}]: ",
        )
        try:
            out = elastic_launch(config, _rank_main)(payload, errdir, threads)
        except ChildFailedError as e:
            raise _culprit(e, errdir) from _cause(errdir)
        except SignalException as e:
            if e.sigval == signal.SIGINT:
                raise KeyboardInterrupt from None
            raise
    return [cloudpickle.loads(out[r]) for r in range(nprocs)]


def _cause(errdir: str) -> BaseException | None:
    first = _first_error(errdir)
    if first is None or first[1]["exc"] is None:
        return None
    try:
        exc = pickle.loads(first[1]["exc"])
    except Exception:  # noqa: BLE001 - a class the launching process cannot import
        return None
    exc.add_note(f"(raised on rank {first[0]}; its traceback is in the RankError above)")
    return exc


def _first_error(errdir: str) -> tuple[int, dict] | None:
    """The root failure: the earliest error that is not a consequence of another rank's."""
    found = []
    for name in os.listdir(errdir):
        if name.isdigit():
            with open(os.path.join(errdir, name), "rb") as f:
                found.append((int(name), pickle.load(f)))
    if not found:
        return None
    found.sort(key=lambda x: (x[1]["secondary"], x[1]["time"]))  # a RankError is a consequence
    return found[0]


def _culprit(e: Exception, errdir: str) -> RankError:
    first = _first_error(errdir)
    if first is not None and not first[1]["secondary"]:
        rank, info = first
        return RankError(f"rank {rank} failed; every rank was stopped. Its traceback:\n\n{info['traceback']}", rank, "failed")
    failures = getattr(e, "failures", {})
    died = sorted((f.local_rank, f.exitcode) for f in failures.values() if f.local_rank is not None and not _has_file(errdir, f.local_rank))
    if died:
        rank, code = died[0]
        how = f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.Signals._value2member_map_ else f"exit code {code}"
        return RankError(
            f"rank {rank} died without raising an exception ({how}: os._exit, a signal, or out of memory); every rank "
            "was stopped",
            rank,
            "died",
        )
    if first is not None:  # only consequences: the first names the rank at fault
        rank, info = first
        exc = pickle.loads(info["exc"]) if info["exc"] is not None else None
        culprit = getattr(exc, "rank", None)
        kind = getattr(exc, "kind", "failed")
        return RankError(f"{exc if exc is not None else 'a rank failed'} (seen by rank {rank}); every rank was stopped", culprit, kind)
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


@contextlib.contextmanager
def _env(extra: dict[str, str]):
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
