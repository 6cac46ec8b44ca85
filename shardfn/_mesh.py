"""`sf.mesh`: a named DeviceMesh over the ranks, starting the process group when needed."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import math
import os
import socket
import sys
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import _collectives as C
from . import _watch

__all__ = ["mesh", "ensure_process_group", "mesh_group", "job_env", "ByMesh", "job_timeout", "with_job_timeout"]

# What `init_process_group`'s env:// rendezvous reads; torchrun sets all four on every rank.
RENDEZVOUS_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def job_env() -> "tuple[int, int, int | None] | None":
    """The job this process's environment describes: `(rank, world size, ranks per node or None)`,
    or None when it describes none (neither RANK nor WORLD_SIZE is set: MASTER_ADDR and MASTER_PORT
    alone, which some shells and cluster templates export, say where a job would meet, not that
    this process is one rank of one; a single process then runs on its own one-rank group).

    Raises:
        ValueError: some of those variables are set and others not, or one does not parse (a
            script run with `python` where `torchrun` was meant, or a hand-made environment): a
            process group started from it would wait for ranks that never come, or each process
            would train alone. Raised before any process group starts.
    """
    env = os.environ
    have = [k for k in RENDEZVOUS_ENV if k in env]
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    missing = [k for k in RENDEZVOUS_ENV if k not in env]
    if missing:
        raise ValueError(
            f"the environment describes part of a distributed job: {', '.join(f'{k}={env[k]!r}' for k in have)} "
            f"{'is' if len(have) == 1 else 'are'} set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
            "not. Start the script with torchrun (which sets all of "
            f"{', '.join(RENDEZVOUS_ENV)} on every rank), set the missing ones, or unset {', '.join(have)} to run "
            "as one process"
        )

    def integer(name: str, low: int, high: int | None = None) -> int:
        try:
            v = int(env[name])
        except ValueError:
            v = None
        if v is None or v < low or (high is not None and v > high):
            bound = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
            raise ValueError(f"{name}={env[name]!r} in the environment: it must be {bound}. Start the script with "
                             "torchrun, which sets it")
        return v

    world = integer("WORLD_SIZE", 1)
    rank = integer("RANK", 0, world - 1)
    integer("MASTER_PORT", 1, 65535)
    local = integer("LOCAL_WORLD_SIZE", 1, world) if "LOCAL_WORLD_SIZE" in env else None
    if local is not None and "LOCAL_RANK" in env:
        integer("LOCAL_RANK", 0, local - 1)
    return rank, world, local


def ensure_process_group() -> None:
    """Starts the default process group if none is running.

    Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, on one node or several) it
    joins the job: NCCL when CUDA is available, else gloo; some of those set and others not is a
    `ValueError` (`job_env`), raised before anything starts. With no distributed environment at all it starts a one-rank group in memory (NCCL
    for CUDA tensors and gloo for CPU ones when CUDA is available, else gloo), so that a script or
    notebook runs unchanged on one process.

    The group's timeout is `SHARDFN_TIMEOUT` seconds (default 600): a rank that waits that long on
    a collective stops with an error naming the rank that stalled (Note [fail fast] in
    `shardfn/_watch.py`). Start-up is not bound by it (Note [start-up]).
    """
    if dist.is_initialized():
        return
    job = job_env()
    backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = _watch.collective_timeout()
    if job is not None:
        store, rank, world = _meet(job, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        _watch.PG_TIMEOUT_S = timeout.total_seconds()
        _watch.start()
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    atexit.register(_destroy_at_exit, dist.group.WORLD)


# Note [start-up]
# ~~~~~~~~~~~~~~~
# A short collective timeout is how a job learns of a stalled rank quickly, but the ranks of one job
# do not start together: interpreters importing torch on a busy machine, nodes whose containers
# start minutes apart. Given to `init_process_group` alone, the collective timeout would also bound
# how long the first rank waits for the last to arrive, and a job with `SHARDFN_TIMEOUT=30` would
# fail at start-up whenever its ranks started more than 30 s apart. So the ranks first meet on the
# job's store with a start-up bound of their own (`SHARDFN_STARTUP_TIMEOUT`; unset, 600 s or the
# collective timeout if longer); the process group starts once every rank is there, with the
# collective timeout. A rank that never arrives is named in a `RankError` when the bound runs out.


def _meet(job: "tuple[int, int, int | None]", timeout: datetime.timedelta) -> "tuple[Any, int, int]":
    """Joins the job's store (env://, as `init_process_group` would) and waits there, up to the
    start-up bound, until every rank has arrived. Returns `(store, rank, world size)`, the store's
    timeout set to the collective `timeout`.

    Raises:
        RankError: a rank did not arrive within the start-up bound (named when the store tells)."""
    startup = _watch.startup_timeout()
    rank, world = job[0], job[1]
    # torchrun's store outlives a restart of its workers: each attempt meets under its own keys.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    keys = [f"shardfn/arrived/{attempt}/{r}" for r in range(world)]
    store = None
    try:
        store, rank, world = next(dist.rendezvous("env://", rank, world, timeout=startup))
        store.set(keys[rank], "1")
        store.wait(keys, startup)
    except (RuntimeError, TimeoutError) as e:  # DistStoreError, DistNetworkError
        missing = []
        if store is not None:
            with contextlib.suppress(Exception):
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
        who = (f"rank {missing[0]} did not" if len(missing) == 1 else f"ranks {missing} did not" if missing
               else "not every rank did")
        raise _watch.RankError(
            f"start-up: {who} reach sf.mesh within {startup.total_seconds():.0f} s of rank {rank} "
            f"(MASTER_ADDR={os.environ.get('MASTER_ADDR')}, MASTER_PORT={os.environ.get('MASTER_PORT')}, "
            f"world size {world}). Check that every rank was started with the same job settings and can reach "
            f"MASTER_ADDR; ranks that start further apart need a longer SHARDFN_STARTUP_TIMEOUT ({type(e).__name__}: {e})",
            missing[0] if len(missing) == 1 else None, "stalled",
        ) from e
    store.set_timeout(timeout)
    return store, rank, world


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

    Axis sizes are given by name, in mesh order (major first). One size may be -1, meaning "the
    rest". Two sizes may be -1 for a mesh laid out by node (Note [node layout]): the second -1 axis
    and the axes after it span the ranks of one node, the axes before it span the nodes; so
    `sf.mesh(replicate=-1, shard=-1)` shards within each node and replicates across nodes, the
    layout for `strategy="hybrid_shard"` on several nodes. The mesh is on CUDA (NCCL) when GPUs are
    present, else on CPU (gloo).

    The same sizes and names give the same mesh object, with the same process groups, for as long
    as the default process group lives (Note [one mesh per layout]): treat it as shared and do not
    change it (its groups' timeouts are set to the job's on every call; names given to flattened
    axes, `mesh["a", "b"]._flatten("ab")`, stay registered on it). After a collective failed or
    timed out, its groups are as broken as the default one: recover with
    `torch.distributed.destroy_process_group()` on every rank, which forgets every mesh made here.

    Args:
        **axes: axis name -> size, e.g. `dp=-1`, or `replicate=-1, shard=-1` for hybrid sharding.

    Returns:
        A `torch.distributed.device_mesh.DeviceMesh` with those axis names.

    Raises:
        ValueError: sizes that do not fit the job's world size (or its ranks per node), or a partial
            torchrun environment; raised before the process group starts when it is not running yet.

    Example:
        >>> mesh = sf.mesh(dp=-1)
        >>> mesh = sf.mesh(replicate=-1, shard=-1)   # shard within each node, replicate across nodes
        >>> mesh = sf.mesh(replicate=2, shard=-1)
    """
    if not axes:
        raise ValueError("sf.mesh needs at least one axis, e.g. sf.mesh(dp=-1)")
    call = "sf.mesh(" + ", ".join(f"{n}={s!r}" for n, s in axes.items()) + ")"
    for name, s in axes.items():
        if isinstance(s, bool) or not isinstance(s, int) or (s < 1 and s != -1):
            raise ValueError(f"{call}: axis {name!r} has size {s!r}: sizes are positive ints, or -1 for the rest")
    sizes = list(axes.values())
    rest = [i for i, s in enumerate(sizes) if s == -1]
    if len(rest) > 2:
        raise ValueError(f"{call}: at most two axes may be -1 (one: the rest of the ranks; two: the nodes, then the "
                         "ranks of a node)")
    # Everything that can be checked before the process group starts is (a job that does not fit
    # the mesh fails at once, not after the rendezvous).
    if dist.is_initialized():
        world, local = dist.get_world_size(), None
    else:
        job = job_env()
        world, local = (1, 1) if job is None else (job[1], job[2])
    if len(rest) == 2:
        _check_node_sizes(call, list(axes), sizes, rest, world, local)
        ensure_process_group()
        nodes = _nodes(call)
        sizes = _node_sizes(call, list(axes), sizes, rest, nodes)
        layout = torch.tensor([r for node in nodes for r in node]).reshape(sizes)
    else:
        known = math.prod(s for s in sizes if s != -1)
        if rest:
            if world % known:
                raise ValueError(
                    f"{call}: the axes of fixed size take {known} ranks, which do not divide the job's {world}: "
                    f"start the job with a multiple of {known} ranks, or change the fixed sizes"
                )
            sizes[rest[0]] = world // known
        elif known != world:
            raise ValueError(
                f"{call} has {known} ranks but the job has {world}: give sizes whose product is {world}, "
                "or -1 for one axis (the rest of the ranks)"
            )
        ensure_process_group()
        layout = None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return device_mesh(device, torch.arange(math.prod(sizes)).reshape(sizes) if layout is None else layout, tuple(axes))


# Note [one mesh per layout]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# A DeviceMesh of two or more axes makes new process groups (`dist.new_group`) for its axes, and
# torch keeps every process group until the default one is destroyed: a mesh that is garbage
# collected leaves its groups behind. Each gloo group holds a connection to every peer and an
# event-loop thread that wakes while idle; a process that builds the same mesh again and again (a
# notebook cell run again, a loop over configurations, a test suite on one pool of ranks) slows
# down with every one: 120 leftover groups cost each idle rank of four 18% of a core, 360 made an
# all-reduce 5x slower. So the meshes shardfn builds (`sf.mesh`, the context-parallel step's
# data mesh) are made once per layout and axis names, while the default group lives, and handed
# out again: `sf.mesh(dp=2, tp=2)` twice is the same mesh, with the same groups. That is safe
# where a map by equality of live meshes is not (Note [mesh groups]): the map holds its meshes,
# so what a call returns depends only on the calls before it, which every rank makes in the same
# order (a mesh is made collectively); the default group's end (`destroy_process_group`, also
# collective) forgets them all.
_MESHES: dict[tuple, tuple[Any, DeviceMesh]] = {}


def device_mesh(device: str, layout: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
    """The mesh of `layout` (ranks, one dim per axis) named `names`, made on the first call while
    the default process group lives and the same object after (Note [one mesh per layout]); its
    axes' groups take the job's timeout (Note [one collective timeout])."""
    world = dist.group.WORLD
    key = (device, tuple(layout.shape), tuple(int(r) for r in layout.flatten()), tuple(names))
    for k in [k for k, (w, _) in _MESHES.items() if w is not world]:
        del _MESHES[k]  # made under a default group that has ended: their groups are gone with it
    hit = _MESHES.get(key)
    if hit is not None:
        return with_job_timeout(hit[1])  # the timeout as the job sets it now
    if torch.equal(layout.flatten(), torch.arange(layout.numel())):
        made = init_device_mesh(device, tuple(layout.shape), mesh_dim_names=tuple(names))
    else:
        made = DeviceMesh(device, layout, mesh_dim_names=tuple(names))
    _MESHES[key] = (world, made)
    return with_job_timeout(made)


# Note [one collective timeout]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A process group made by `dist.new_group`, as every group of a DeviceMesh but the default one is,
# times out after torch's default (30 minutes for gloo, 10 for NCCL), whatever the default group's
# timeout. The watch learns of a stalled rank from a collective that times out (Note [fail fast] in
# `_watch.py`), so on a mesh of two axes a stall in a tp or dp collective would be named after
# torch's default rather than `SHARDFN_TIMEOUT`. Every group shardfn makes therefore takes the job's
# timeout, the default group's: the groups of the meshes it builds (`with_job_timeout`) and those it
# makes itself (`timeout=`). A mesh the user builds keeps what the user gave it.
def job_timeout() -> "datetime.timedelta | None":
    """The default process group's collective timeout (None: no group, or one that does not say)."""
    if _watch.PG_TIMEOUT_S is not None:
        return datetime.timedelta(seconds=_watch.PG_TIMEOUT_S)
    if not dist.is_initialized():
        return None
    device = torch.device("cuda" if torch.cuda.is_available() and dist.get_backend() != "gloo" else "cpu")
    try:
        timeout = dist.group.WORLD._get_backend(device).options._timeout
    except (RuntimeError, AttributeError):  # a backend without options (the fake one of `sf.simulate`)
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None


def with_job_timeout(mesh: DeviceMesh) -> DeviceMesh:
    """`mesh`, each of its axes' process groups given the job's timeout (Note [one collective timeout])."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    timeout = job_timeout()
    if timeout is None:
        return mesh
    for name in mesh.mesh_dim_names or range(mesh.ndim):
        group = mesh.get_group(name)
        if group is not dist.group.WORLD and dist.get_world_size(group) > 1:
            _set_pg_timeout(timeout, group)
    return mesh


# Note [node layout]
# ~~~~~~~~~~~~~~~~~~
# On several nodes, collectives within a node run over its fast links (NVLink, shared memory) and
# collectives across nodes over the network, which is slower. Hybrid sharding puts the
# frequent, large traffic (every unit's all-gather and reduce-scatter) on the shard axis and only
# one gradient all-reduce per step on the replicate axis, so the shard axis should be the ranks of
# one node and the replicate axis should span the nodes. FSDP's HYBRID_SHARD makes these groups
# by default (shard groups of a node's device count); FSDP2 and torchtitan take an
# `init_device_mesh(..., ("dp_replicate", "dp_shard"))` whose sizes the user sets. Here
# `sf.mesh(replicate=-1, shard=-1)` asks for the node layout without the sizes: the second -1
# axis, with the axes after it, spans one node's ranks; the axes before it span the nodes.
#
# Which ranks share a node is asked, not assumed: each rank says which node it is on (torchrun's
# GROUP_RANK, the node's rank in the rendezvous; the host name where it is not set, as under
# mpirun) in one object all-gather when the mesh is built. Nodes are ordered by their lowest rank
# and each node's ranks in order; torchrun numbers ranks node by node, so this is the plain
# `init_device_mesh` layout there, and any other numbering still gets one node per shard group.
# Every node must hold the same number of ranks (torchrun's --nproc-per-node); LOCAL_WORLD_SIZE
# lets sizes that cannot fit be refused before the process group starts, the gathered layout
# refuses what remains (nodes of different sizes) the same way on every rank.


def _check_node_sizes(call: str, names: list[str], sizes: list[int], rest: list[int], world: int, local: int | None) -> None:
    """What can be checked of a node-laid-out mesh before the process group starts."""
    if local is None:
        return
    inner = math.prod(sizes[rest[1] + 1:])
    outer = math.prod(s for s in sizes[:rest[1]] if s != -1)
    fix = "give the sizes explicitly (one of them may be -1)"
    if world % local:
        raise ValueError(f"{call}: axis {names[rest[1]]!r} spans the ranks of one node ({local}, LOCAL_WORLD_SIZE), but "
                         f"the job's {world} ranks (WORLD_SIZE) are not a whole number of nodes: start every node with "
                         "the same --nproc-per-node, or give the sizes explicitly")
    if local % inner:
        raise ValueError(f"{call}: the axes after {names[rest[1]]!r} take {inner} ranks, which do not divide the {local} "
                         f"ranks of a node (LOCAL_WORLD_SIZE): make them divide it, or {fix}")
    if (world // local) % outer:
        raise ValueError(f"{call}: the axes of fixed size before {names[rest[1]]!r} take {outer} nodes, which do not "
                         f"divide the job's {world // local} nodes ({world} ranks, {local} per node): start a multiple "
                         f"of {outer} nodes, or {fix}")


def _nodes(call: str) -> list[list[int]]:
    """The ranks of each node, nodes in order of their lowest rank (Note [node layout])."""
    node = os.environ.get("GROUP_RANK")
    key = ("node", node) if node is not None else ("host", socket.gethostname())
    keys = C.all_gather_object(key, f"{call} (finding the ranks of each node)")
    groups: dict = {}
    for r, k in enumerate(keys):
        groups.setdefault(k, []).append(r)
    return sorted(groups.values())


def _node_sizes(call: str, names: list[str], sizes: list[int], rest: list[int], nodes: list[list[int]]) -> list[int]:
    """The sizes of a node-laid-out mesh, from the ranks of each node (the same on every rank)."""
    counts = sorted({len(n) for n in nodes})
    if len(counts) > 1:
        raise ValueError(f"{call}: the nodes hold different numbers of ranks ({', '.join(str(len(n)) for n in nodes)}); a "
                         "mesh laid out by node needs the same number on each: start every node with the same "
                         "--nproc-per-node, or give the sizes explicitly")
    local, n = counts[0], len(nodes)
    _check_node_sizes(call, names, sizes, rest, local * n, local)
    sizes = list(sizes)
    sizes[rest[1]] = local // math.prod(sizes[rest[1] + 1:])
    sizes[rest[0]] = 1
    sizes[rest[0]] = n // math.prod(sizes[:rest[1]])
    return sizes


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
#
# The map is by identity, never by equality: a DeviceMesh equals any other over the same ranks and
# names (its `__eq__` and `__hash__` compare layouts), though each holds process groups of its
# own. A map by equality hands a new mesh the groups of an older equal one for as long as that
# one lives, and how long it lives is the garbage collector's affair, rank by rank: two ranks of
# one axis then run its collectives on different process groups, and wait on each other forever
# (or, making a group, one rank joins a collective the other never calls).
class ByMesh:
    """A map from live meshes, by identity, to what shardfn keeps for each (an entry goes with its
    mesh). Note [mesh groups]."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[weakref.ref, Any]] = {}

    def setdefault(self, mesh: DeviceMesh, value: Any) -> Any:
        """`mesh`'s value, first set to `value` if it has none."""
        item = self._items.get(id(mesh))
        if item is not None and item[0]() is mesh:
            return item[1]
        key, items = id(mesh), self._items

        def gone(ref: weakref.ref) -> None:
            if items.get(key, (None,))[0] is ref:
                del items[key]

        items[key] = (weakref.ref(mesh, gone), value)
        return value

    def __len__(self) -> int:
        return sum(1 for ref, _ in list(self._items.values()) if ref() is not None)


_AXES_GROUPS = ByMesh()


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
        group = dist.new_group(list(group_ranks), timeout=job_timeout())  # Note [one collective timeout]
        if list(group_ranks) == ranks:
            made = group
    return made
