"""Ranks that agree on the model: rank 0's values broadcast, or a checked agreement (Note [one model]).

Note [one model]
~~~~~~~~~~~~~~~~
`step.init`, `sf.shard` and `sf.import_state_dict` take values that every rank of the mesh is
supposed to hold alike: the full (non-DTensor) leaves of a parameter tree, which each rank built
or loaded itself, the local shards that several ranks hold (a replicated leaf under `no_shard`,
`hybrid_shard`'s replicas, the tensor-parallel peers of a leaf whole on tp), and the module's
buffers (`step.init`: its real ones; `import_state_dict`: those it read). A model
built without a seed, with a per-rank seed, or loaded on rank 0 only would otherwise train a
different model on each rank, with no word: nothing in a step compares the ranks' parameters.

So they agree first, as `sync` says:

* `"broadcast"` (the default; DDP's habit at construction): the values of rank 0 (for a shard
  held by several ranks: of the first of them, coordinate 0 along the mesh dims it is replicated
  on) are broadcast to the others. The tensors are packed as bytes into buckets of up to
  `BUCKET_BYTES` (a larger tensor goes alone), one broadcast each, so a model of N bytes costs
  about N / 64 MiB broadcasts, less than one all-gather of the model (a step does two). A full
  leaf is given to its consumer straight out of the received bucket, which is dropped once its
  leaves are consumed: at most one bucket more than the model is alive on a rank. Rank 0's own
  leaves are used as they are.
* `"check"`: each rank takes a bitwise fingerprint of each tensor (two wrapping int64 sums over
  its bytes, one weighted by position) and the fingerprints are gathered; where a rank differs
  from its reference, a `ValueError` naming the leaves and the ranks is raised on every rank
  alike, before anything is sharded. For ranks that hold one model by construction, to be told
  when they do not.
* `None`: nothing is compared or sent (each rank's own values are used).

Before either, the ranks agree on the structure (paths, shapes, dtypes): one all-reduce of a
hash, so that a rank with another tree is named rather than left to abort gloo with buffers of
other sizes. Values that are legitimately per rank are never touched: meta-device leaves (each
rank fills only its own shards from rank 0's recorded generator state, Note [meta init]), DTensor
leaves given to `sf.shard` or `step.init` (already laid out), and the shards of a leaf split
across ranks. All collectives go through `_collectives` (counted, watched).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from . import _collectives as C
from ._mesh import mesh_group

__all__ = ["SYNC_MODES", "BUCKET_BYTES", "Item", "check_sync", "agree", "agree_on_settings", "replicated_dims"]

SYNC_MODES = ("broadcast", "check", None)

BUCKET_BYTES = 64 << 20
"""The most bytes one broadcast of `sync="broadcast"` carries (a larger tensor goes alone)."""

_ALIGN = 16  # each tensor's bytes start at a multiple of this in a bucket (views of any dtype)
_CHUNK = 1 << 20  # elements fingerprinted at a time (the int64 temporaries stay small)
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHT = 0x5851F42D4C957F2D  # an odd multiplier for the positions (wrapping)


def check_sync(sync: Any, call: str) -> None:
    """Refuses a `sync=` value that is not one of `SYNC_MODES`."""
    if sync not in SYNC_MODES:
        raise ValueError(
            f"{call}: sync={sync!r} is not one of 'broadcast' (every rank takes rank 0's values, the default), "
            "'check' (refuse, naming the leaves and ranks, if the ranks' values differ) or None (each rank keeps its own)"
        )


@dataclass
class Item:
    """One tensor the ranks must hold alike.

    Attributes:
        path: its name in messages (a dotted leaf path, or "buffer <name>").
        value: this rank's tensor (a full leaf, or a local shard).
        emit: called once with the agreed value: `value` itself on the source rank and where
            nothing is sent, else a view of a received bucket, valid during the call only.
        dims: the mesh dims along which the ranks hold it alike (all of them for a full leaf).
        shape: the shape the ranks agree on first (a local shard's global shape: shards of one
            leaf may differ in size); None: `value`'s.
    """

    path: str
    value: torch.Tensor
    emit: Callable[[torch.Tensor], None]
    dims: tuple[int, ...]
    shape: tuple[int, ...] | None = None


def replicated_dims(x: DTensor) -> tuple[int, ...]:
    """The mesh dims along which the ranks hold the same local shard of DTensor `x`."""
    return tuple(d for d, p in enumerate(x.placements) if isinstance(p, Replicate))


_BUILD_ALIKE = (
    "Build the model from one seed on every rank (torch.manual_seed(0) before building it) and load pretrained "
    "weights on every rank"
)


def agree(items: list[Item], mesh: DeviceMesh, sync: str | None, call: str, fix: str = _BUILD_ALIKE) -> None:
    """Makes the ranks of `mesh` hold `items` alike, as `sync` says (Note [one model]), and
    calls each item's `emit` with its agreed value, in order within each group of items
    replicated on the same mesh dims. A collective on `mesh` unless `sync` is None or the mesh
    has one rank; every rank must pass items of the same paths, shapes and dtypes. `fix`: how to
    make the values agree, for the refusal of "check"."""
    check_sync(sync, call)
    if sync is None or mesh.size() == 1 or not items:
        for it in items:
            it.emit(it.value)
        return
    group = mesh_group(mesh)
    _agree_on_structure(items, mesh, group, call)
    if sync == "check":
        _check(items, mesh, group, call, fix)
        for it in items:
            it.emit(it.value)
        return
    by_dims: dict[tuple[int, ...], list[Item]] = {}
    for it in items:
        by_dims.setdefault(tuple(d for d in it.dims if mesh.size(d) > 1), []).append(it)
    for dims, group_items in by_dims.items():  # the same order on every rank (the same items)
        if not dims:
            for it in group_items:
                it.emit(it.value)
            continue
        sub = group if len(dims) == mesh.ndim else mesh_group(mesh, dims)
        _broadcast(group_items, sub, _source(mesh, dims), mesh.device_type, call)


def _ranks_differ(text: str, mesh: DeviceMesh, group: Any, call: str) -> bool:
    """Whether the ranks of `group` hold different `text`: one all-reduce of its hash (the max of
    the hash and of its negation: equal everywhere only when every rank's is the same)."""
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1  # fits an int64
    both = torch.tensor([h, -h], dtype=torch.int64, device=mesh.device_type)
    C.all_reduce_blocking(both, group, call, op="max")
    return both[0].item() != -both[1].item()


def agree_on_settings(settings: dict[str, str], mesh: DeviceMesh, call: str) -> None:
    """One all-reduce of a hash of `settings` (name -> its text); where the ranks differ, every
    rank raises a ValueError naming the settings and the ranks. A step's options set on some ranks
    only (clipping, accumulation, frozen leaves) would step the ranks' shards differently, and
    under `no_shard` let the replicas drift apart, without a word."""
    if mesh.size() == 1:
        return
    group = mesh_group(mesh)
    if not _ranks_differ("\n".join(f"{k}={v}" for k, v in sorted(settings.items())), mesh, group, call):
        return
    said = C.all_gather_object(settings, call, group=group)
    ranks = dist.get_process_group_ranks(group)
    lines = [f"{k}: rank {ranks[0]} has {said[0].get(k)}, rank {r} has {mine.get(k)}"
             for r, mine in zip(ranks[1:], said[1:]) for k in sorted(set(mine) | set(said[0])) if mine.get(k) != said[0].get(k)]
    raise ValueError(
        f"{call}: the ranks were given different settings: {'; '.join(lines[:6])}. Give every rank the same options "
        "(the same configuration and code)"
    )


def _source(mesh: DeviceMesh, dims: tuple[int, ...]) -> int:
    """The global rank whose values this rank takes: its own coordinates, 0 along `dims`."""
    at = list(mesh.get_coordinate())
    for d in dims:
        at[d] = 0
    return int(mesh.mesh[tuple(at)].item())


def _describe(it: Item) -> str:
    shape = tuple(it.value.shape) if it.shape is None else tuple(it.shape)
    return f"{it.path} {shape} {str(it.value.dtype).removeprefix('torch.')}"


def _agree_on_structure(items: list[Item], mesh: DeviceMesh, group: Any, call: str) -> None:
    """One all-reduce of a hash of the items' paths, shapes and dtypes; where the ranks differ,
    every rank raises a ValueError naming what differs from rank 0's."""
    if not _ranks_differ("\n".join(f"{_describe(it)} {it.dims}" for it in items), mesh, group, call):
        return
    said = C.all_gather_object([(_describe(it), it.dims) for it in items], call, group=group)
    ranks = dist.get_process_group_ranks(group)
    ref = said[0]
    lines = []
    for r, mine in zip(ranks[1:], said[1:]):
        if [d for d, _ in mine] != [d for d, _ in ref]:
            extra = [d for d, _ in mine if (d, _) not in ref][:3]
            lacks = [d for d, _ in ref if (d, _) not in mine][:3]
            lines.append(f"rank {r}: {len(mine)} tensors, has {extra} where rank {ranks[0]} has {lacks}")
        elif mine != ref:  # one tree, replicated over other mesh dims: another mesh or strategy
            diff = [(d, a, b) for (d, a), (_, b) in zip(mine, ref) if a != b][:3]
            lines.append(f"rank {r} holds {', '.join(f'{d} replicated over mesh dims {a}' for d, a, _ in diff)} where rank "
                         f"{ranks[0]} has {', '.join(f'mesh dims {b}' for _, _, b in diff)}")
    raise ValueError(
        f"{call}: the ranks hold different trees (paths, shapes or dtypes), or lay them out differently, where they "
        f"must hold one model: {'; '.join(lines)}. Build the same model on every rank (the same configuration and "
        "code), and the same mesh and strategy"
    )


def _fingerprint(t: torch.Tensor) -> list[int]:
    """Two wrapping int64 sums over `t`'s bytes, the second weighted by position: bitwise equal
    tensors give equal fingerprints (NaNs and signed zeros included), on any device."""
    flat = t.detach().contiguous().reshape(-1)
    size = flat.element_size()
    flat = flat.view(_INTS[size]) if size in _INTS else flat.view(torch.int64)
    s1 = torch.zeros((), dtype=torch.int64, device=flat.device)
    s2 = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        v = flat[start:start + _CHUNK].to(torch.int64)
        w = torch.arange(start + 1, start + 1 + v.numel(), dtype=torch.int64, device=flat.device).mul_(_WEIGHT)
        s1 += v.sum()
        s2 += (v * w).sum()  # not in place: `v` is the tensor itself when it is int64
    return [int(s1.item()), int(s2.item()), flat.numel()]


def _check(items: list[Item], mesh: DeviceMesh, group: Any, call: str, fix: str) -> None:
    """Gathers every rank's fingerprints; each item is compared with that of its reference rank
    (coordinate 0 along the dims it is replicated on); any difference is a ValueError on every rank."""
    mine = (mesh.get_coordinate(), [_fingerprint(it.value) for it in items])
    said = C.all_gather_object(mine, call, group=group)
    ranks = dist.get_process_group_ranks(group)
    at = {tuple(coord): (r, fps) for r, (coord, fps) in zip(ranks, said)}
    differ: dict[str, list[tuple[int, int]]] = {}
    for i, it in enumerate(items):
        dims = [d for d in it.dims if mesh.size(d) > 1]
        for coord, (r, fps) in at.items():
            ref = list(coord)
            for d in dims:
                ref[d] = 0
            ref_rank, ref_fps = at[tuple(ref)]
            if ref_rank != r and fps[i] != ref_fps[i]:
                differ.setdefault(it.path, []).append((r, ref_rank))
    if not differ:
        return
    named = []
    for path, pairs in list(differ.items())[:8]:
        by_ref: dict[int, list[int]] = {}
        for r, q in pairs:
            by_ref.setdefault(q, []).append(r)
        named.append(f"{path!r} ({'; '.join(_differ(rs, q) for q, rs in by_ref.items())})")
    more = f" and {len(differ) - 8} more" if len(differ) > 8 else ""
    raise ValueError(
        f"{call}: the ranks hold different values for {len(differ)} of {len(items)} tensors they must hold alike "
        f"(sync='check'): {', '.join(named)}{more}. {fix}, or pass sync='broadcast' to give every rank rank 0's values"
    )


def _differ(ranks: list[int], ref: int) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} differs from rank {ref}"
    return f"ranks {', '.join(map(str, ranks))} differ from rank {ref}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _buckets(items: list[Item]) -> list[list[tuple[Item, int, int]]]:
    """Items packed in order into buckets of up to BUCKET_BYTES: (item, byte offset, bytes)."""
    out: list[list[tuple[Item, int, int]]] = []
    used = 0
    for it in items:
        n = it.value.numel() * it.value.element_size()
        start = -(-used // _ALIGN) * _ALIGN
        if not out or start + n > BUCKET_BYTES:
            out.append([])
            start = 0
        out[-1].append((it, start, n))
        used = start + n
    return out


def _broadcast(items: list[Item], group: Any, src: int, device: str, call: str) -> None:
    """Broadcasts `items` from global rank `src` over `group`, bucket by bucket; each item's
    `emit` gets its agreed value as soon as its bucket has arrived."""
    me = dist.get_rank()
    for bucket in _buckets(items):
        total = bucket[-1][1] + bucket[-1][2]
        first = bucket[0][0].value
        if me == src and len(bucket) == 1 and first.device.type == device and first.is_contiguous():
            buf = _bytes(first)  # sent as it is
        else:
            buf = torch.empty(total, dtype=torch.uint8, device=device)
            if me == src:
                for it, off, n in bucket:
                    buf[off:off + n].copy_(_bytes(it.value))
        with C.watching(call):
            C.broadcast(buf, src, group)
        for it, off, n in bucket:
            if me == src:
                it.emit(it.value)
            else:
                it.emit(buf[off:off + n].view(it.value.dtype).view(it.value.shape))
        del buf
