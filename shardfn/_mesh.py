"""`sf.mesh`: a named DeviceMesh over the ranks, starting the process group when needed."""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import sys
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import _collectives as C
from . import _watch

__all__ = ["mesh", "ensure_process_group", "mesh_group"]


def ensure_process_group() -> None:
    """Starts the default process group if none is running.

    Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR set) it joins the job: NCCL when CUDA is available,
    else gloo. With no distributed environment at all it starts a one-rank group in memory (NCCL
    for CUDA tensors and gloo for CPU ones when CUDA is available, else gloo), so that a script or
    notebook runs unchanged on one process.

    The group's timeout is `SHARDFN_TIMEOUT` seconds (default 600): a rank that waits that long on
    a collective stops with an error naming the rank that stalled (Note [fail fast] in
    `shardfn/_watch.py`).
    """
    if dist.is_initialized():
        return
    backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = _watch.collective_timeout()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
        _watch.PG_TIMEOUT_S = timeout.total_seconds()
        _watch.start()
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    atexit.register(_destroy_at_exit, dist.group.WORLD)


def _destroy_at_exit(group: Any) -> None:
    """Note [orderly exit]: the process group started here is destroyed when the interpreter exits
    normally, while Python is still whole.

    Left to the interpreter's teardown, gloo's worker threads may still hold finished work whose
    tensors refer to Python objects; destroying those after Python is gone ends the process with
    SIGABRT ("terminate called without an active exception") now and then, after every result was
    in (pytorch/pytorch#190489). A rank that failed skips this: one of its collectives may still
    wait on a peer, and the destroy would wait with it; its process ends as it did before.
    """
    if _watch.FAILED_HERE[0] or getattr(sys, "last_value", None) is not None:
        return
    if dist.is_initialized() and dist.group.WORLD is group:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def mesh(**axes: int) -> DeviceMesh:
    """Builds a named device mesh over all ranks.

    Axis sizes are given by name, in mesh order (major first); one size may be -1, meaning "the rest".
    The mesh is on CUDA (NCCL) when GPUs are present, else on CPU (gloo).

    Args:
        **axes: axis name -> size, e.g. `dp=-1`, or `replicate=2, shard=-1` for hybrid sharding.

    Returns:
        A `torch.distributed.device_mesh.DeviceMesh` with those axis names.

    Example:
        >>> mesh = sf.mesh(dp=-1)
        >>> mesh = sf.mesh(replicate=2, shard=-1)
    """
    if not axes:
        raise ValueError("sf.mesh needs at least one axis, e.g. sf.mesh(dp=-1)")
    ensure_process_group()
    world = dist.get_world_size()
    sizes = list(axes.values())
    for name, s in axes.items():
        if not isinstance(s, int) or (s < 1 and s != -1):
            raise ValueError(f"mesh axis {name!r} has size {s!r}: sizes are positive ints, or -1 for the rest")
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {axes}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if world % known:
            raise ValueError(f"mesh {axes}: {world} ranks are not divisible by {known}")
        sizes[sizes.index(-1)] = world // known
    if math.prod(sizes) != world:
        raise ValueError(f"mesh {axes} has {math.prod(sizes)} ranks but the job has {world}; use -1 for one axis")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, tuple(sizes), mesh_dim_names=tuple(axes))


# Note [mesh groups]
# ~~~~~~~~~~~~~~~~~~
# Every process group shardfn takes from a mesh comes from `mesh_group`. One axis is the mesh's
# own group; all axes of a mesh over every rank are the default group. Any other set of axes (all
# axes of a mesh over some of the ranks, as a slice of a larger mesh is) spans a group the mesh
# does not hold: it is made with `dist.new_group`, which every rank of the job must call for every
# such group, in the same order, so each rank first learns every rank's group (one object
# all-gather) and then all of them are made, in the order of their lowest rank. That happens once
# per mesh and axes, on the first call, which (as for any collective) every rank makes at the
# same point; the group is then kept with the mesh (a weak map keyed by the mesh), so it lives as
# long as the mesh does. (DeviceMesh's private `_flatten` would make the same groups, registered
# in the root mesh under a name.)
_AXES_GROUPS: "weakref.WeakKeyDictionary[DeviceMesh, dict]" = weakref.WeakKeyDictionary()


def mesh_group(mesh: DeviceMesh, axes: "tuple[str | int, ...] | str | int | None" = None):
    """The process group spanning `axes` of `mesh` (names or dims; all axes when None).

    A collective when it makes a group (Note [mesh groups]): every rank calls it at the same point.
    """
    if isinstance(axes, (str, int)):
        axes = (axes,)
    names = tuple(mesh.mesh_dim_names or ())
    dims = tuple(range(mesh.ndim)) if axes is None else tuple(a if isinstance(a, int) else names.index(a) for a in axes)
    if len(dims) == 1:
        return mesh.get_group(names[dims[0]] if names else dims[0])
    if mesh.size() == dist.get_world_size() and set(dims) == set(range(mesh.ndim)):
        return dist.group.WORLD
    groups = _AXES_GROUPS.setdefault(mesh, {})
    key = tuple(sorted(dims))
    if key not in groups:
        groups[key] = _new_group(mesh, key)
    return groups[key]


def _new_group(mesh: DeviceMesh, dims: tuple[int, ...]):
    """A new process group over `dims` of `mesh` holding this rank (Note [mesh groups])."""
    rest = [d for d in range(mesh.ndim) if d not in dims]
    coords = mesh.get_coordinate() or []
    mine = mesh.mesh
    for d in reversed(rest):  # this rank's slice along the other axes
        mine = mine.select(d, coords[d])
    ranks = sorted(int(r) for r in mine.flatten())
    every = C.all_gather_object(ranks, "making a process group over mesh axes")
    distinct = sorted({tuple(r) for r in every})
    made = None
    for group_ranks in distinct:
        group = dist.new_group(list(group_ranks))
        if list(group_ranks) == ranks:
            made = group
    return made
