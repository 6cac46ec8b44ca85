"""`sf.save`, `sf.load`, `sf.latest`: sharded checkpoints on `torch.distributed.checkpoint`.

A checkpoint is a folder. The state (a `TrainState`, or any pytree of DTensors, tensors and plain
values) is flattened with optree into one flat dict keyed by dotted paths (`params.blocks.0.w`,
`opt_state.0.mu.blocks.0.w`, `opt_state.0.count`, `step`), so that every tensor of every optimizer
NamedTuple is a named entry of its own and nothing is opaque to `torch.distributed.checkpoint`
(DCP). The persistent buffers of the model the parameters belong to are entries too
(`buffers.bn.running_mean`). DCP writes each rank's shards of the tensors; plain values (the step,
ints and floats in an optimizer state) and a description of every entry go to `shardfn.json`; user
extras to `extras.pt`. DCP reshards on load, so a checkpoint loads at any world size or mesh.

Note [checkpoint commit]
------------------------
A checkpoint must never look complete unless every rank's files are on disk, and a checkpoint that
was complete must stay loadable whatever happens to a later save. So a save never writes into its
final folder:

1. Rank 0 checks that the final path does not exist (a checkpoint is never overwritten in place:
   DCP over an existing folder, interrupted, loads a torn state without error) and picks a fresh
   temporary name next to it, `.<name>.tmp-<token>`, which every rank learns.
2. Every rank writes its shards there with DCP (`sync_files=True`: each file is fsynced before its
   rank reports back). DCP gathers every rank's result on rank 0 and writes `.metadata` only when
   all of them succeeded; a rank that raises makes every rank raise.
3. Rank 0 writes `shardfn.json` and `extras.pt`, fsyncs every file and the folder, renames the
   folder to its final name and fsyncs the parent directory.
4. Rank 0 writes the completion marker `COMPLETE` last (temporary name, fsync, rename, fsync of the
   folder). Only a folder with this marker is a checkpoint: `sf.latest` and `sf.load` ignore or
   refuse anything else. Rank 0 then tells every rank that the commit succeeded (or why not).

A save that raises or is killed at any point before step 4 leaves a hidden temporary folder, or a
final folder without a marker, and the previous checkpoint untouched. `keep=k` deletes older
checkpoints only after the new one is committed, each by renaming it to a hidden name first (a
deletion cut short never leaves a marked but partial folder). It also clears what dead saves left:
hidden temporary folders other than this process's save in flight, and unmarked folders older than
the newest complete checkpoint (a save in flight has not been renamed to its final name before the
newest commit, so such a folder is one whose save died between its rename and its marker). The
folder must be on a filesystem every rank sees (as DCP's own loading at another world size needs).

Note [checkpointed buffers]
---------------------------
A model's buffers (BatchNorm's running statistics) live in the module, not in the train state, yet
a resumed run needs them as much as the parameters. `sf.save` finds the functionalized model whose
parameter names are the state's (`model_of`, or `apply=`) and saves its persistent buffers (those
in its `state_dict`) as entries `buffers.<name>`, from rank 0: the train step keeps them equal on
every rank (Note [buffers]). `sf.load` writes them back into that module's buffers in place. A
checkpoint without buffers (of a model that had none found, or written before buffers were saved)
still loads, strict or not: the module keeps its buffers as they are, and a non-strict load lists
them in `LoadReport.missing_keys`.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import shutil
import sys
import threading
import time
import uuid
import warnings
from typing import Any, Iterator, NamedTuple

import optree

from . import _collectives as C
from . import _donate
from ._files import fsync_dir, fsync_file, replace_synced, temporary_name, write_atomically
from ._meta_init import refuse_unset_buffers
from ._models import model_of, persistent_buffers as _persistent_buffers
from ._spec import placements_for, spec_of
from ._tree import tree_flatten_with_paths
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["save", "load", "latest", "load_extras", "LoadReport", "SaveHandle"]

MARKER = "COMPLETE"
META = "shardfn.json"
EXTRAS = "extras.pt"
FORMAT = 1
_VALUE_TYPES = (bool, int, float, str, type(None))


class LoadReport(NamedTuple):
    """What a non-strict `sf.load` did not load.

    Attributes:
        missing_keys: entries of `like` the checkpoint does not have (they keep their values).
        unexpected_keys: entries of the checkpoint `like` does not have (not read).
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


# -- flattening ----------------------------------------------------------------------------------
def _entry(e: Any) -> str:
    field = getattr(e, "field", None)  # NamedTupleEntry, DataclassEntry: the field's name
    return str(field) if isinstance(field, str) else str(e.entry)


def _flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
    """(dotted keys, leaves, treespec); None leaves (frozen optimizer state) are not leaves."""
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree, none_is_leaf=False)
    keys = [".".join(_entry(e) for e in a) for a in accessors]
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))
        raise ValueError(f"two leaves of the state have the same dotted path {dup!r} (a dict key with a '.'?); rename one")
    return keys, leaves, spec


def _describe_tensor(key: str, x: torch.Tensor) -> dict:
    if x.is_meta:
        raise ValueError(f"state entry {key!r} is on the meta device: it holds no values to save; materialize it first")
    if isinstance(x, DTensor):
        for p in x.placements:
            if not isinstance(p, (Shard, Replicate)) and not _one_box(x):
                raise NotImplementedError(
                    f"state entry {key!r} is a DTensor with placements {x.placements}: only the layouts of a partition spec "
                    "can be saved and resharded; redistribute it first (e.g. x.redistribute(mesh, [Replicate()]))"
                )
    return {"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")}


def _one_box(x: DTensor) -> bool:
    """Whether each rank holds one box of `x` laid out as a partition spec says (Note [layouts of
    a spec] in `shardfn/_spec.py`): what torch.distributed.checkpoint can write and reshard."""
    try:
        return placements_for(spec_of(x.placements, x.device_mesh, x.dim()), x.device_mesh, x.shape) == tuple(x.placements)
    except (NotImplementedError, ValueError):
        return False


def _classify(keys: list[str], leaves: list[Any]) -> tuple[dict[str, torch.Tensor], dict[str, dict], dict[str, Any]]:
    """Splits leaves into tensors (to DCP) and plain values (to JSON); anything else is an error."""
    tensors, described, values = {}, {}, {}
    for k, x in zip(keys, leaves):
        if isinstance(x, torch.Tensor):
            described[k] = _describe_tensor(k, x)
            tensors[k] = x
        elif isinstance(x, _VALUE_TYPES):
            values[k] = x
        else:
            raise ValueError(
                f"state entry {k!r} is a {type(x).__name__}: a checkpoint holds tensors, DTensors, and bool/int/"
                "float/str/None values; convert it (or register its type with optree so its tensors are leaves)"
            )
    return tensors, described, values


BUFFERS = "buffers."  # the dotted prefix of the model's buffers among a checkpoint's entries


def _model_buffers(state: Any, apply: Any, keys: list[str], loading: bool = False) -> tuple[list[str], list[torch.Tensor]]:
    """(entry names, tensors) of the persistent buffers of the model `state`'s parameters belong
    to (Note [checkpointed buffers]); none when no functionalized model has their names. The
    parameters are `state.params`, `state["params"]`, the state itself, or one of its top-level
    entries (`{"model": params, "opt": opt_state}`)."""
    subtrees: list[Any] = []
    for t in (getattr(state, "params", None), state.get("params") if isinstance(state, dict) else None, state):
        if t is not None:
            subtrees.append(t)
    if isinstance(state, dict):
        subtrees += list(state.values())
    elif isinstance(state, (list, tuple)):
        subtrees += list(state)
    info = None
    for tree in subtrees:
        paths = tree_flatten_with_paths(tree)[0]
        if apply is not None and set(paths) != set(getattr(getattr(apply, "info", None), "param_paths", ())):
            continue
        # Only one of several models with these names is the module a train step updates and loads into.
        info = model_of(
            tree, apply, "the state's params", where=lambda i: bool(_persistent_buffers(i)) or (loading and bool(i.unset_buffers)),
            alike=False, reason=" and hold buffers",
            hint="say whose buffers the checkpoint holds with apply=apply (the function sf.functionalize returned for it)",
        )
        if info is not None:
            break
    if info is None:
        if apply is not None:
            model_of(subtrees[0], apply, "the state's params")  # raises: no part of the state is apply's model's
        return [], []
    if loading:  # buffers init="empty" left unset that this checkpoint cannot hold (Note [buffers under init="empty"])
        refuse_unset_buffers(info, "sf.load")
    buffers = _persistent_buffers(info)
    names = [BUFFERS + n for n in buffers]
    clash = sorted(set(names) & set(keys))
    if clash:
        raise ValueError(f"the state has entries {clash[:3]} named like the model's buffers; rename the state's {BUFFERS[:-1]!r} key")
    return names, list(buffers.values())


def _check_extras(x: Any, where: str = "extras") -> Any:
    """A copy of `extras` with tensors on the CPU; refuses what `torch.load(weights_only=True)` cannot read."""
    if isinstance(x, torch.Tensor):
        if x.is_meta or isinstance(x, DTensor):
            raise ValueError(f"{where} is a {'meta tensor' if x.is_meta else 'DTensor'}: extras hold plain tensors; use x.full_tensor()")
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        for k in x:
            if not isinstance(k, (str, int)):
                raise ValueError(f"{where} has a key {k!r} of type {type(k).__name__}: extras' dict keys are str or int")
        return {k: _check_extras(v, f"{where}[{k!r}]") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_check_extras(v, f"{where}[{i}]") for i, v in enumerate(x)) if type(x) in (list, tuple) else _bad_extra(x, where)
    if isinstance(x, _VALUE_TYPES):
        return x
    return _bad_extra(x, where)


def _bad_extra(x: Any, where: str) -> Any:
    raise ValueError(
        f"{where} is a {type(x).__name__}: extras hold tensors, numbers, strings, bools, None and dicts/lists/tuples "
        "of them (e.g. a data loader's state_dict()); convert it"
    )


def _digest(x: Any, h: Any) -> None:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        raw = t.reshape(-1).view(torch.uint8)
        try:
            h.update(raw.numpy().tobytes())
        except (RuntimeError, TypeError):  # torch without numpy
            h.update(bytes(raw.tolist()))
    elif isinstance(x, dict):
        h.update(b"{")
        for k in sorted(x, key=repr):
            h.update(repr(k).encode())
            _digest(x[k], h)
        h.update(b"}")
    elif isinstance(x, (list, tuple)):
        h.update(b"[" if isinstance(x, list) else b"(")
        for v in x:
            _digest(v, h)
        h.update(b"]")
    else:
        h.update(repr(x).encode())


# -- collectives (a single process without a process group is rank 0 of 1) -------------------------
def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: that is meant here."""
    if _dist():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _all_gather(obj: Any) -> list[Any]:
    if not _dist() or dist.get_world_size() == 1:
        return [obj]
    return C.all_gather_object(obj, "sf.save")


def _broadcast(obj: Any, group: Any = None, what: str = "sf.save") -> Any:
    if not _dist() or dist.get_world_size() == 1:
        return obj
    return C.broadcast_object(obj, what, group=group)


_background_group: list[Any] = []  # the process group of background saves, made on the first one


def _save_group() -> Any:
    """A process group of its own for saves in the background thread, whose collectives must never
    interleave with the train step's on the default group (made collectively, on the first
    asynchronous save, which every rank calls)."""
    if not _dist() or dist.get_world_size() == 1:
        return None
    if not _background_group:
        _background_group.append(dist.new_group(backend="gloo"))
    return _background_group[0]


# -- files ---------------------------------------------------------------------------------------
def _marker(path: str) -> dict | None:
    """The completion marker's content, or None if `path` is not a complete checkpoint."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not isinstance(info.get("committed_ns"), int):
        return None
    return info


def _complete(directory: str) -> list[tuple[int, str]]:
    """(commit time, path) of every complete checkpoint directly under `directory`, newest first."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        if name.startswith("."):
            continue  # temporary folders of saves in flight or dead, checkpoints being deleted
        p = os.path.join(directory, name)
        info = _marker(p) if os.path.isdir(p) else None
        if info is not None:
            found.append((info["committed_ns"], p))
    return sorted(found, key=lambda t: (t[0], t[1]), reverse=True)


def _remove(path: str) -> None:
    """Deletes a checkpoint folder: renamed to a hidden name first, so it never looks complete while partly gone."""
    parent, name = os.path.split(path)
    trash = os.path.join(parent, f".{name}.del-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    fsync_dir(parent)
    shutil.rmtree(trash, ignore_errors=True)


def _prune(parent: str, keep: int, just_written: str, own_tmp: str) -> None:
    """Keeps the `keep` newest complete checkpoints under `parent` (`just_written` always among
    them) and clears what dead saves and cut-short deletions left behind (Note [checkpoint commit])."""
    complete = _complete(parent)
    others = [p for _, p in complete if p != just_written]
    for p in others[keep - 1:]:
        _remove(p)
    newest = complete[0][0] if complete else None
    for name in os.listdir(parent):
        p = os.path.join(parent, name)
        if not os.path.isdir(p) or p in (own_tmp, just_written):
            continue
        if name.startswith("."):
            if ".tmp-" in name or ".del-" in name:
                shutil.rmtree(p, ignore_errors=True)
        elif newest is not None and _dead_unmarked(p, newest):
            _remove(p)


def _dead_unmarked(path: str, newest_ns: int) -> bool:
    """Whether `path` is a checkpoint folder whose save died between its rename and its marker:
    written by `sf.save` (it has the description) but unmarked, and last changed before the newest
    complete checkpoint was committed (a save in flight gets its marker right after its rename)."""
    if _marker(path) is not None or not os.path.isfile(os.path.join(path, META)):
        return False
    try:
        return os.stat(path).st_mtime_ns < newest_ns
    except OSError:
        return False


def latest(directory: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directly under `directory`.

    Complete means committed: folders of saves that failed or were killed (hidden temporary
    folders, or a folder without the completion marker) are never returned (Note [checkpoint
    commit] in `shardfn/_checkpoint.py`). Newest is by commit time.

    Args:
        directory: the folder that holds the checkpoint folders (e.g. `"ckpt"` for `"ckpt/step_100"`).

    Returns:
        The checkpoint's path, or None when there is none (or no such folder).

    Example:
        >>> path = sf.latest("ckpt")
        >>> if path is not None:
        ...     state = sf.load(path, like=state)
    """
    found = _complete(os.fspath(directory))
    return found[0][1] if found else None


# -- save ----------------------------------------------------------------------------------------
class SaveHandle:
    """A save, finished or in flight: `wait()` blocks until it is committed and returns its path.

    A failure of an asynchronous save is raised by `wait()`, or by the next `sf.save` or `sf.load`
    of the process if nobody waited.

    Attributes:
        path: the checkpoint's final path.
    """

    def __init__(self, path: str, thread: threading.Thread | None = None):
        self.path = path
        self._thread = thread
        self._error: BaseException | None = None
        self._reported = False

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> str:
        """Blocks until the save is committed; returns its path, or raises why it failed."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None and not self._reported:
            self._reported = True
            raise RuntimeError(f"the asynchronous save to {self.path!r} failed; the previous checkpoint is intact") from self._error
        return self.path


_in_flight: list[SaveHandle] = []  # this process's asynchronous save, if one is running


def _settle() -> None:
    """Waits for this process's asynchronous save in flight, raising its failure here if it failed."""
    while _in_flight:
        handle = _in_flight.pop()
        handle.wait()


def _settle_at_exit() -> None:
    """At interpreter exit: an asynchronous save nobody waited for is finished, not lost (its
    daemon thread would be killed mid-write); a failure is printed, as nobody can catch it."""
    try:
        _settle()
    except RuntimeError as e:
        print(f"shardfn: {e}: {e.__cause__!r}", file=sys.stderr)


atexit.register(_settle_at_exit)  # registered after torch's own: runs before them (last in, first out)


def save(
    state: Any,
    path: str | os.PathLike,
    *,
    extras: dict | None = None,
    keep: int | None = None,
    asynchronous: bool = False,
    apply: Any = None,
) -> SaveHandle:
    """Saves a train state (or any tree of DTensors and tensors) as a sharded checkpoint folder.

    A collective: every rank calls it with the same `path`. Each rank writes only its own shards
    (`torch.distributed.checkpoint`); the parameters, every tensor of the optimizer state, the step,
    any plain values of the tree and the persistent buffers of the model the parameters belong to
    (BatchNorm statistics, as `buffers.<name>`) are saved, each under its dotted path. The checkpoint is
    committed atomically (Note [checkpoint commit]): a save that fails or is killed leaves the
    previous checkpoints as they were, and `sf.latest` never returns it.

    Args:
        state: an `sf.TrainState`, or any pytree whose leaves are DTensors (Shard or Replicate
            placements), tensors (taken as the same on every rank) and bool/int/float/str/None.
        path: the new checkpoint's folder, e.g. `f"ckpt/step_{state.step}"`; it must not exist.
        extras: a dict of tensors, numbers, strings (nested dicts/lists of them), the same on
            every rank, e.g. `{"loader": loader.state_dict()}`; read back by `sf.load_extras`.
        keep: if given, keep only the newest `keep` complete checkpoints in `path`'s parent folder
            (the new one included) once it is committed, and clear the folders dead saves left.
        asynchronous: copy every tensor to CPU memory, return, and write and commit in a
            background thread. The next `sf.save` or `sf.load` waits for it first.
        apply: the `sf.functionalize` function of the model whose buffers to save; by default the
            model whose parameter names are the state's (Note [checkpointed buffers]).

    Returns:
        A `SaveHandle`; `handle.wait()` returns the path once committed (at once when not
        asynchronous).

    Example:
        >>> sf.save(state, f"ckpt/step_{state.step}", extras={"batch": i}, keep=3)
        >>> state = sf.load(sf.latest("ckpt"), like=state)
    """
    _settle()
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a folder path (str or os.PathLike), got {type(path).__name__}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive int (the newest checkpoints to keep, this one included) or None, got {keep!r}")
    final = os.path.abspath(os.fspath(path))
    if os.path.basename(final).startswith("."):
        raise ValueError(f"path {path!r}: names starting with '.' are kept for the temporary folders of saves; choose another name")
    keys, leaves, _ = _flatten(state)
    bkeys, bleaves = _model_buffers(state, apply, keys)
    keys, leaves = keys + bkeys, leaves + bleaves
    tensors, described, values = _classify(keys, leaves)
    extras = _check_extras(extras) if extras is not None else None
    if extras is not None and not isinstance(extras, dict):
        raise ValueError(f"extras must be a dict, got {type(extras).__name__}")
    h = hashlib.sha256()
    # A plain (non-DTensor) tensor is saved from rank 0: its values must be every rank's.
    plain = {k: t for k, t in tensors.items() if not isinstance(t, DTensor)}
    _digest([final, keys, described, values, extras, plain], h)

    # Step 1: every rank agrees on the tree, the extras and the path; rank 0 on whether it is free.
    taken = None
    if _rank() == 0:
        if os.path.lexists(final):
            what = "a complete checkpoint" if _marker(final) is not None else "a folder that is not a complete checkpoint"
            taken = (
                f"{path!r} already exists ({what}): checkpoints are never overwritten in place (an interrupted save "
                "would leave a torn state). Save to a new path, e.g. one named after the step, and use keep= "
                "to delete old ones, or delete this folder first"
            )
    token = uuid.uuid4().hex[:12]
    views = _all_gather((h.hexdigest(), taken, token))
    if views[0][1] is not None:
        raise ValueError(views[0][1])
    if len({v[0] for v in views}) > 1:
        raise ValueError(
            "sf.save was called with a different path, state tree, plain values, plain (non-DTensor) tensors, model buffers or extras on different ranks "
            f"(ranks {[r for r, v in enumerate(views) if v[0] != views[0][0]]} differ from rank 0): every rank "
            "must save the same checkpoint (a plain tensor is saved once, from rank 0: make it a DTensor or the same "
            "on every rank). Extras must be the same on every rank: for per-rank values, "
            "gather them (e.g. dist.all_gather_object) into one list first"
        )
    parent, name = os.path.split(final)
    tmp = os.path.join(parent, f".{name}.tmp-{views[0][2]}")
    meta = {
        "format": FORMAT,
        "tensors": described,
        "values": values,
        "world_size": dist.get_world_size() if _dist() else 1,
        "extras": extras is not None,
        "buffers": bkeys,
        "torch": torch.__version__,
    }
    if asynchronous:
        tensors = {k: _snapshot(t) for k, t in tensors.items()}
        group = _save_group()
        handle = SaveHandle(final)

        def body() -> None:
            try:
                _write(tensors, meta, extras, tmp, final, keep, group)
            except BaseException as e:  # noqa: BLE001 - surfaces at wait() or the next save/load
                handle._error = e

        handle._thread = threading.Thread(target=body, name="shardfn-save", daemon=True)
        handle._thread.start()
        _in_flight.append(handle)
        return handle
    _write(tensors, meta, extras, tmp, final, keep)
    return SaveHandle(final)


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `t` (a DTensor stays a DTensor of the same layout) for a save in the background."""
    if isinstance(t, DTensor):
        local = t._local_tensor.detach().to("cpu", copy=True)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return t.detach().to("cpu", copy=True)


def _write(tensors: dict, meta: dict, extras: dict | None, tmp: str, final: str, keep: int | None, group: Any = None) -> None:
    """Steps 2-4 of Note [checkpoint commit]."""
    parent = os.path.dirname(final)
    if _rank() == 0:
        os.makedirs(parent, exist_ok=True)
    # Step 2: every rank's shards, into the temporary folder (DCP raises on every rank if one fails).
    writer = FileSystemWriter(tmp, sync_files=True, overwrite=False)
    try:
        with _one_process(), C.region("sf.save (torch.distributed.checkpoint)"):
            dcp.save(tensors, storage_writer=writer, process_group=group, no_dist=not _dist())
    except CheckpointException as e:  # a BaseException: make it one that `except Exception` sees
        raise RuntimeError(f"writing the checkpoint {final!r} failed, nothing was committed and the previous checkpoint is intact: {e}") from e
    # Steps 3 and 4, on rank 0; then every rank learns the outcome.
    error = None
    if _rank() == 0:
        try:
            _commit(meta, extras, tmp, final, keep)
        except BaseException as e:  # noqa: BLE001 - reported to every rank below, then raised here
            error = e
    outcome = _broadcast(None if error is None else f"{type(error).__name__}: {error}", group)
    if error is not None:
        raise error
    if outcome is not None:
        raise RuntimeError(f"rank 0 could not commit the checkpoint {final!r} ({outcome}); the previous checkpoint is intact")


def _commit(meta: dict, extras: dict | None, tmp: str, final: str, keep: int | None) -> None:
    parent = os.path.dirname(final)
    write_atomically(os.path.join(tmp, META), json.dumps(meta, indent=1, sort_keys=True).encode())
    if extras is not None:
        tmp_extras = temporary_name(os.path.join(tmp, EXTRAS))
        torch.save(extras, tmp_extras)
        replace_synced(tmp_extras, os.path.join(tmp, EXTRAS))
    for name in os.listdir(tmp):
        fsync_file(os.path.join(tmp, name))
    fsync_dir(tmp)
    if os.path.lexists(final):
        raise ValueError(f"{final!r} appeared while the checkpoint was being written; it was left as it is")
    os.rename(tmp, final)
    fsync_dir(parent)
    write_atomically(os.path.join(final, MARKER), json.dumps({"committed_ns": time.time_ns(), "format": FORMAT}).encode())
    if keep is not None:
        _prune(parent, keep, final, tmp)


# -- load ----------------------------------------------------------------------------------------
def _read_meta(path: str) -> dict:
    """Rank 0 reads the checkpoint's description and every rank gets it (or the same error)."""
    found: dict | str
    if _rank() == 0:
        if _marker(path) is None:
            inner = latest(path) if os.path.isdir(path) else None
            if inner is not None:
                found = f"{path!r} is a folder of checkpoints, not a checkpoint: load sf.latest({path!r}) = {inner!r}"
            elif os.path.isdir(path):
                found = (
                    f"{path!r} is not a complete checkpoint (no {MARKER} marker: a save that failed or was killed "
                    "before it was committed); load sf.latest(<its folder>) instead"
                )
            else:
                found = f"no checkpoint at {path!r}"
        else:
            try:
                with open(os.path.join(path, META)) as f:
                    found = json.load(f)
            except (OSError, ValueError) as e:
                found = f"{path!r} has no readable {META} ({e}): not a checkpoint written by sf.save"
    else:
        found = ""
    found = _broadcast(found, what="sf.load")
    if isinstance(found, str):
        raise ValueError(found)
    if found.get("format") != FORMAT:
        raise ValueError(f"{path!r} has checkpoint format {found.get('format')!r}; this shardfn reads format {FORMAT}")
    return found


def _list(keys: list[str], n: int = 8) -> str:
    return ", ".join(keys[:n]) + (f", ... ({len(keys)} in all)" if len(keys) > n else "")


def _makes_state_later(like: Any) -> bool:
    """Whether `like` holds a wrapped torch optimizer's state with a leaf it has made none for yet."""
    from .optim._torch import TorchOptimizerState

    opt_state = getattr(like, "opt_state", None)
    if opt_state is None and isinstance(like, dict):
        opt_state = like.get("opt_state")
    if opt_state is None:
        return False

    def empty_leaf(tree: Any) -> bool:  # a leaf's state dict is empty (its tree is the parameters')
        if isinstance(tree, dict):
            return not tree or any(empty_leaf(v) for v in tree.values() if isinstance(v, (dict, list, tuple)))
        return isinstance(tree, (list, tuple)) and any(empty_leaf(v) for v in tree)

    nodes = optree.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, TorchOptimizerState), none_is_leaf=True)
    return any(isinstance(x, TorchOptimizerState) and empty_leaf(x.per_leaf) for x in nodes)


def load(path: str | os.PathLike, *, like: Any, strict: bool = True, apply: Any = None) -> Any:
    """Loads a checkpoint into `like`, resharding to its layout; returns the loaded state.

    A collective: every rank calls it with the same `path`. The checkpoint may have been saved at
    any world size or mesh; each rank reads only the parts of each tensor it holds in `like`.
    Tensors are loaded in place: every DTensor and tensor of `like` is overwritten with the
    checkpoint's values (a train step's own parameter buffers included, so the next step trains
    from them) and the same objects are returned, with plain values (the step) taken from the
    checkpoint. The model's buffers saved with it are copied into the module; a checkpoint
    without them leaves the module's buffers as they are (Note [checkpointed buffers]). A save of
    this process still in flight is waited for first.

    Args:
        path: a checkpoint folder written by `sf.save` (see `sf.latest`).
        like: a state of the same structure, e.g. `step.init(params)` in a fresh process.
        strict: if True, the checkpoint and `like` must have exactly the same entries. If False,
            the common entries are loaded, the others of `like` keep their values, and a
            `LoadReport(missing_keys, unexpected_keys)` is returned with the state.
        apply: the `sf.functionalize` function of the model whose buffers to load; by default the
            model whose parameter names are `like`'s.

    Returns:
        The state (`strict=True`), or `(state, LoadReport)` (`strict=False`).

    Raises:
        ValueError: not a complete checkpoint; entries whose shape, dtype or kind differ (always,
            naming them); entries missing or unexpected (when strict).

    Example:
        >>> state = sf.load("ckpt/step_100", like=step.init(params))
        >>> state, report = sf.load(path, like=state, strict=False)
    """
    _settle()
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a checkpoint folder (str or os.PathLike), got {type(path).__name__}")
    path = os.path.abspath(os.fspath(path))
    meta = _read_meta(path)
    keys, leaves, spec = _flatten(like)
    for x in leaves:  # before anything is read: a donated state has no memory of its own
        if _donate.is_donated(x):
            raise _donate.DonatedError(x._local_tensor._message)
    n_state = len(keys)
    bkeys, bleaves = _model_buffers(like, apply, keys, loading=True)
    keys, leaves = keys + bkeys, leaves + bleaves
    tensors, described, values = _classify(keys, leaves)
    saved_t, saved_v = meta["tensors"], meta["values"]
    differ = []
    for k in keys:
        mine = described.get(k)
        if k in saved_t and mine is not None and mine != saved_t[k]:
            differ.append(f"{k}: checkpoint {saved_t[k]['dtype']}{tuple(saved_t[k]['shape'])}, like {mine['dtype']}{tuple(mine['shape'])}")
        elif k in saved_t and mine is None:
            differ.append(f"{k}: a tensor in the checkpoint, {values[k]!r} in like")
        elif k in saved_v and mine is not None:
            differ.append(f"{k}: the value {saved_v[k]!r} in the checkpoint, a tensor in like")
    if differ:
        raise ValueError(
            f"{len(differ)} entries of {path!r} differ from `like` in shape, dtype or kind: {_list(differ, 6)}. "
            "Build `like` as the saved state was built (same model config, dtypes, optimizer and frozen leaves); "
            "a differing entry is never loaded, even with strict=False"
        )
    saved = set(saved_t) | set(saved_v)
    missing = [k for k in keys if k not in saved]
    # A checkpoint without buffers (written before they were saved, or of a model that has none):
    # the module keeps its buffers, and a non-strict load reports them (Note [checkpointed buffers]).
    old = not meta.get("buffers")
    strict_missing = [k for k in missing if not (old and k.startswith(BUFFERS) and k in bkeys)]
    unexpected = sorted(saved - set(keys))
    if n_state and not set(keys[:n_state]) & saved:  # (the model's buffers aside: they are named alike in any tree)
        raise ValueError(
            f"`like` and the checkpoint {path!r} have no entry in common: it holds [{_list(sorted(saved), 4)}], like "
            f"[{_list(keys[:n_state], 4)}]. Pass a tree built as the saved one was (the state itself; its parameters "
            "alone as {'params': state.params})"
        )
    # Saved optimizer state of a parameter for which `like` holds a wrapped torch optimizer that has
    # made no state yet (before its first step): dropping it would resume a different run,
    # silently, even with strict=False. (Another optimizer's state, state of a parameter gone from
    # `like`, or a `like` of parameters only are ordinary unexpected entries, which strict=False
    # leaves unread: fine-tuning with another optimizer, taking the weights out.)
    own = [k[len("params."):] for k in keys if k.startswith("params.")]
    stateful = {p for p in own if any(k.startswith("opt_state.") and f".{p}." in f"{k}." for k in keys)}
    later = _makes_state_later(like)
    lost = [k for k in unexpected if later and k.startswith("opt_state.")
            and any(f".{p}." in f"{k}." for p in own if p not in stateful)]
    if lost:
        raise ValueError(
            f"the checkpoint {path!r} holds optimizer state that `like` has no place for: [{_list(lost)}]. Build "
            "`like` with the optimizer the checkpoint was saved with; a wrapped torch optimizer "
            "(sf.optim.from_torch) creates its state at its first step, so take one step on `like` before "
            "loading (every entry is then overwritten)"
        )
    if strict and (strict_missing or unexpected):
        raise ValueError(
            f"the checkpoint {path!r} and `like` have different entries: missing from the checkpoint: "
            f"[{_list(strict_missing)}]; in the checkpoint but not in like: [{_list(unexpected)}]. Build `like` like the "
            "saved state (same model, optimizer, frozen leaves), or pass strict=False to load the common "
            "entries and get a LoadReport of the others"
        )
    common = {k: t for k, t in tensors.items() if k in saved_t}
    if common:
        try:
            with _one_process(), C.region("sf.load (torch.distributed.checkpoint)"):
                dcp.load(common, storage_reader=FileSystemReader(path), no_dist=not _dist())
        except CheckpointException as e:  # a BaseException: make it one that `except Exception` sees
            raise RuntimeError(f"reading the checkpoint {path!r} failed; `like` may be partly overwritten: {e}") from e
    out = [saved_v[k] if k in saved_v else x for k, x in zip(keys[:n_state], leaves[:n_state])]
    state = optree.tree_unflatten(spec, out)
    return state if strict else (state, LoadReport(missing, unexpected))


def load_extras(path: str | os.PathLike) -> dict:
    """The `extras` saved with a checkpoint (tensors on the CPU), or `{}` if it has none.

    Not a collective: any rank (or any process) may call it.

    Args:
        path: a checkpoint folder written by `sf.save`.

    Returns:
        The dict passed as `sf.save(..., extras=...)`.

    Example:
        >>> loader.load_state_dict(sf.load_extras(path)["loader"])
    """
    _settle()
    path = os.path.abspath(os.fspath(path))
    if _marker(path) is None:
        raise ValueError(f"{path!r} is not a complete checkpoint (no {MARKER} marker); see sf.latest")
    f = os.path.join(path, EXTRAS)
    return torch.load(f, weights_only=True) if os.path.exists(f) else {}
