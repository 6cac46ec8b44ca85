"""Partition specs (`P`), spec trees from rules (`specs`), and their validation against a mesh."""

from __future__ import annotations

import difflib
import functools
import itertools
import math
import re
from typing import Any, Sequence

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ._tree import tree_flatten_with_paths

__all__ = ["P", "specs", "placements_for", "check_spec", "match_specs", "shard_slices", "local_slices", "mesh_coordinate", "spec_of"]

_Entry = "str | tuple[str, ...] | None"


class P(tuple):
    """A partition spec, as in JAX: one entry per tensor dim naming the mesh axis it is split over.

    Each entry is a mesh axis name, a tuple of axis names (the dim is split over all of them,
    nested, the first the major one, in any order: Note [layouts of a spec]), or `None` (not
    split). Trailing dims without an entry are not split; `P()` is fully replicated. Sizes the axes
    do not divide are split as `torch.chunk` does. `P` is immutable and hashable; a mesh axis named
    twice is a `ValueError`.

    Example:
        >>> P("dp", None)
        P('dp', None)
    """

    __slots__ = ()

    def __new__(cls, *entries: Any) -> "P":
        norm = []
        seen: set[str] = set()
        for i, e in enumerate(entries):
            if isinstance(e, list):
                e = tuple(e)
            if e is None or isinstance(e, str):
                axes = () if e is None else (e,)
            elif isinstance(e, tuple) and e and all(isinstance(a, str) for a in e):
                axes = e
                e = e[0] if len(e) == 1 else e
            else:
                raise ValueError(
                    f"P entry {i} is {e!r}: each entry must be a mesh axis name, a tuple of names, or None, "
                    "e.g. P('dp', None) or P(('dp', 'tp'))"
                )
            for a in axes:
                if a in seen:
                    raise ValueError(
                        f"mesh axis {a!r} appears twice in P{tuple(entries)!r}: a mesh axis splits at most one dim. Name it "
                        "once; to split one dim over several axes give them as one tuple entry, e.g. P(('dp', 'tp'), None)"
                    )
                seen.add(a)
            norm.append(e)
        return super().__new__(cls, norm)

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"

    def __reduce__(self):
        return (P, tuple(self))

    @property
    def axes(self) -> tuple[str, ...]:
        """All mesh axis names this spec uses."""
        out: list[str] = []
        for e in self:
            if isinstance(e, str):
                out.append(e)
            elif isinstance(e, tuple):
                out.extend(e)
        return tuple(out)

    def axes_of(self, dim: int) -> tuple[str, ...]:
        """The mesh axes that tensor dim `dim` is split over (empty if none)."""
        if dim >= len(self) or self[dim] is None:
            return ()
        e = self[dim]
        return (e,) if isinstance(e, str) else tuple(e)


def _mesh_axes(mesh: DeviceMesh) -> tuple[str, ...]:
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("the mesh has no axis names: build it with sf.mesh(dp=-1) or init_device_mesh(..., mesh_dim_names=...)")
    return tuple(names)


def check_spec(path: str, leaf: Any, spec: Any, mesh: DeviceMesh) -> None:
    """Raises a ValueError naming the leaf path, shape, spec and mesh axes, with the fix, if `spec`
    cannot apply; NotImplementedError where DTensor cannot lay this shape out as the spec says."""
    axes = _mesh_axes(mesh)
    shape = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None

    def fail(why: str, fix: str) -> None:
        raise ValueError(
            f"spec {spec!r} for leaf {path!r} (shape {shape}) on mesh axes {axes} of sizes {tuple(mesh.shape)}: {why}. {fix}"
        )

    if not isinstance(spec, P):
        fail(f"expected a P, got {type(spec).__name__}", "Use sf.P(...) for every leaf.")
    if not isinstance(leaf, torch.Tensor):
        fail(f"the leaf is a {type(leaf).__name__}, not a tensor", "Only tensors can be sharded.")
    if not (leaf.is_floating_point() or leaf.is_complex()):
        fail(f"the leaf has dtype {leaf.dtype}", "Parameters must be floating point; keep integer state in buffers.")
    for a in spec.axes:
        if a not in axes:
            fail(f"unknown mesh axis {a!r}", f"Use one of {axes}.")
    if len(spec) > leaf.dim():
        what = "a scalar cannot be split" if leaf.dim() == 0 else f"the spec has {len(spec)} entries for a {leaf.dim()}-d tensor"
        fail(what, "Give at most one entry per tensor dim (P() replicates).")
    try:
        placements_for(spec, mesh, shape)
    except NotImplementedError as e:
        raise NotImplementedError(f"leaf {path!r} (shape {shape}): {e}") from None


# Note [layouts of a spec]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A spec entry names the mesh axes one tensor dim is split over, the first the major one, as in
# JAX. The split is nested: `P(("a", "b"))` cuts the dim into `size(a)` chunks as `torch.chunk`
# does (trailing chunks may be shorter, or empty), then each chunk into `size(b)` chunks. The
# rank at coordinate (a=i, b=j) holds chunk j of chunk i: one contiguous slice per dim
# (`shard_slices`). With even sizes this is JAX's layout exactly; with uneven ones it is what
# DTensor's `Shard` does on each mesh dim, and what FSDP2 over a tensor-parallel shard holds.
#
# DTensor applies placements in mesh order, left to right, so axes listed in mesh order are one
# `Shard(d)` per mesh dim. Axes listed against mesh order (`P(("tp", "dp"))` on a mesh (dp, tp):
# tensor parallel first, then FSDP within each tensor-parallel shard) need torch's
# `_StridedShard(d, split_factor=k)` on the earlier mesh dim, k being the product of the sizes of
# the axes the spec lists before it but the mesh after it: that dim then takes its part of each
# of those k pieces. For sizes that the product of the axes divides the two agree; for uneven ones
# they agree on most shapes but not all (9 rows, P(("tp", "dp")) at dp=4, tp=2: DTensor gives
# rank (dp=3, tp=0) row 8, the nested split gives it nothing). `placements_for` therefore checks
# every coordinate of the leaf's shape against `shard_slices` and refuses, with
# NotImplementedError, a shape where DTensor cannot say the spec's layout.


def _chunk(start: int, stop: int, n: int, k: int) -> tuple[int, int]:
    """Chunk k of [start, stop) cut in n as `torch.chunk` does (chunks of ceil(len / n); the last
    ones shorter or empty)."""
    size = -(-(stop - start) // n) if stop > start else 0
    lo = min(stop, start + k * size)
    return lo, min(stop, lo + size)


def shard_slices(spec: P, shape: Sequence[int], axis_sizes: dict[str, int], coordinate: dict[str, int]) -> tuple[slice, ...]:
    """The part of a tensor of `shape` that the rank at `coordinate` holds under `spec`.

    One slice per tensor dim (Note [layouts of a spec] in `shardfn/_spec.py`): each dim is cut over
    its axes in the spec's order, the first the major one, as `torch.chunk` cuts (a rank may hold
    fewer elements than others, or none).

    Args:
        spec: the leaf's partition spec.
        shape: the leaf's global shape.
        axis_sizes: mesh axis name -> its size (`dict(zip(mesh.mesh_dim_names, mesh.shape))`).
        coordinate: mesh axis name -> the rank's index along it (`mesh_coordinate(mesh)`).

    Returns:
        A tuple of `slice`s, one per dim of `shape`: `full[shard_slices(...)]` is the rank's shard.

    Example:
        >>> shard_slices(P(("tp", "dp")), (5, 3), {"dp": 2, "tp": 2}, {"dp": 1, "tp": 0})
        (slice(2, 3, None), slice(0, 3, None))
    """
    out = []
    for d, n in enumerate(shape):
        lo, hi = 0, int(n)
        for a in spec.axes_of(d):
            lo, hi = _chunk(lo, hi, axis_sizes[a], coordinate[a])
        out.append(slice(lo, hi))
    return tuple(out)


def mesh_coordinate(mesh: DeviceMesh) -> dict[str, int]:
    """This rank's index along each named axis of `mesh`."""
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not in the mesh: build the mesh over every rank that runs this")
    return dict(zip(_mesh_axes(mesh), coord))


def local_slices(spec: P, mesh: DeviceMesh, shape: Sequence[int]) -> tuple[slice, ...]:
    """`shard_slices` for this rank of `mesh`: which slice of the full tensor it holds under `spec`."""
    return shard_slices(spec, shape, dict(zip(_mesh_axes(mesh), mesh.shape)), mesh_coordinate(mesh))


def _axis_sizes(mesh: DeviceMesh) -> tuple[tuple[str, int], ...]:
    return tuple(zip(_mesh_axes(mesh), (int(s) for s in mesh.shape)))


def _placements(spec: P, sizes: tuple[tuple[str, int], ...]) -> tuple[Placement, ...]:
    axes = [a for a, _ in sizes]
    size = dict(sizes)
    out: list[Placement] = [Replicate() for _ in axes]
    for d in range(len(spec)):
        order = spec.axes_of(d)
        for i, a in enumerate(order):
            m = axes.index(a)
            k = math.prod(size[b] for b in order[:i] if axes.index(b) > m)
            out[m] = _StridedShard(d, split_factor=k) if k > 1 and size[a] > 1 else Shard(d)
    return tuple(out)


def _segments_chunk(segs: list[tuple[int, int]], n: int, k: int) -> list[tuple[int, int]]:
    """Chunk k of the positions `segs` lists, cut in n as torch.chunk does."""
    total = sum(b - a for a, b in segs)
    lo, hi = _chunk(0, total, n, k)
    out, pos = [], 0
    for a, b in segs:
        s, e = max(a, a + lo - pos), min(b, a + hi - pos)
        if s < e:
            out.append((s, e))
        pos += b - a
    return out


def _dtensor_segments(placements: tuple[Placement, ...], sizes: tuple[int, ...], coord: tuple[int, ...], dim: int, n: int) -> list[tuple[int, int]]:
    """What DTensor gives the rank at `coord` of tensor dim `dim` (length n) under `placements`,
    applied in mesh order as `distribute_tensor` does, as runs of global indices."""
    segs = [(0, n)] if n else []
    for p, size, c in zip(placements, sizes, coord):
        if isinstance(p, _StridedShard) and p.dim == dim:
            pieces = [_segments_chunk(segs, p.split_factor, j) for j in range(p.split_factor)]
            segs = [s for piece in pieces for s in _segments_chunk(piece, size, c)]
        elif isinstance(p, Shard) and p.dim == dim:
            segs = _segments_chunk(segs, size, c)
    merged: list[tuple[int, int]] = []
    for a, b in segs:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


@functools.lru_cache(maxsize=4096)
def _expressible(spec: P, sizes: tuple[tuple[str, int], ...], placements: tuple[Placement, ...], shape: tuple[int, ...]) -> int | None:
    """The first dim whose nested split DTensor's `placements` do not reproduce, or None."""
    names = [a for a, _ in sizes]
    size = dict(sizes)
    for d, n in enumerate(shape):
        if not any(isinstance(p, _StridedShard) and p.dim == d for p in placements):
            continue
        axes = spec.axes_of(d)
        for local in itertools.product(*(range(size[a]) for a in axes)):
            coord = dict(zip(axes, local))
            want = shard_slices(P(spec[d] if d < len(spec) else None), (n,), size, coord)[0]
            full = tuple(coord.get(a, 0) for a in names)
            got = _dtensor_segments(placements, tuple(size[a] for a in names), full, d, n)
            if got != ([(want.start, want.stop)] if want.stop > want.start else []):
                return d
    return None


def placements_for(spec: P, mesh: DeviceMesh, shape: Sequence[int] | None = None) -> tuple[Placement, ...]:
    """DTensor placements (one per mesh dim) that lay a tensor out as a checked `spec` says.

    Axes listed in mesh order give `Shard(dim)` on each of their mesh dims; axes listed against
    mesh order (`P(("tp", "dp"))` on a mesh (dp, tp)) give torch's `_StridedShard` on the earlier
    mesh dims (Note [layouts of a spec] in `shardfn/_spec.py`), which FSDP2 with tensor
    parallelism produces too.

    Args:
        spec: a spec `check_spec` accepted.
        mesh: the mesh.
        shape: the leaf's global shape. Needed when the spec lists axes against mesh order: every
            rank's shard is then checked against the spec's nested split (`shard_slices`).

    Returns:
        A tuple of placements, one per mesh dim.

    Raises:
        NotImplementedError: DTensor cannot lay a tensor of `shape` out as `spec` says (a few
            uneven sizes with axes against mesh order).

    Example:
        >>> placements_for(P(("tp", "dp"), None), mesh, (5, 3))  # mesh (dp=2, tp=2)
        (_StridedShard(dim=0, sf=2), Shard(dim=0))
    """
    sizes = _axis_sizes(mesh)
    out = _placements(spec, sizes)
    if any(isinstance(p, _StridedShard) for p in out):
        if shape is None:
            raise TypeError(f"placements_for({spec!r}, mesh) lists axes against mesh order {tuple(a for a, _ in sizes)}: pass the leaf's shape=")
        bad = _expressible(spec, sizes, out, tuple(int(n) for n in shape))
        if bad is not None:
            raise NotImplementedError(
                f"spec {spec!r} on mesh {dict(sizes)}: DTensor cannot lay dim {bad} of shape {tuple(shape)} out as the "
                f"spec's nested split (its axes are listed against the mesh's order, and {shape[bad]} is not divided "
                f"evenly). List the axes of that dim in mesh order, or use a size their product divides"
            )
    return out


def axis_names(mesh: DeviceMesh) -> tuple[str, ...]:
    """The mesh's axis names; `dim0`, `dim1`, ... for a mesh built without names."""
    return tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))


def spec_of(placements: Sequence[Placement], mesh: DeviceMesh, ndim: int) -> P:
    """The spec whose `placements_for` are `placements` (the inverse; trailing `None`s dropped).

    Example:
        >>> spec_of((_StridedShard(0, split_factor=2), Shard(0)), mesh, 2)  # mesh (dp=2, tp=2)
        P(('tp', 'dp'))
    """
    names = axis_names(mesh)
    dims: list[list[str]] = [[] for _ in range(ndim)]
    for axis, p in zip(names, placements):
        if isinstance(p, (Shard, _StridedShard)):
            dims[p.dim].append(axis)
    sizes = tuple(zip(names, (int(n) for n in mesh.shape)))
    entries: list[Any] = []
    for d, axes in enumerate(dims):
        found = None
        for order in itertools.permutations(axes):  # mesh order first: the usual case costs one try
            probe = _placements(P(*([None] * d), order or None), sizes)
            if all(probe[names.index(a)] == placements[names.index(a)] for a in order):
                found = order
                break
        if found is None:
            raise NotImplementedError(f"placements {tuple(placements)} on mesh axes {names} say no partition spec")
        entries.append(None if not found else found[0] if len(found) == 1 else tuple(found))
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _fit_default(default: P, leaf: torch.Tensor) -> P:
    # The default spec is a default, not a request: a leaf of lower rank than it keeps the entries that fit.
    return default if len(default) <= leaf.dim() else P(*tuple(default)[: leaf.dim()])


READY_RULES: set[tuple[str, P]] = set()
"""The rules of `sf.rules`' ready lists (registered there): they cover model variants (biases,
untied heads), so one that decides no leaf is not an error, unless none of them does."""


def specs(
    params: Any,
    mesh: DeviceMesh,
    rules: Sequence[tuple[str, P]] | None = None,
    default: P = P("dp"),
    *,
    allow_unmatched: bool = False,
) -> Any:
    """Builds a pytree of `P` with the structure of `params`, from ordered regex rules.

    Each rule is `(regex, P)`; the regex is matched in full against the leaf's dotted path and the
    first matching rule wins. Leaves no rule matches get `default`; where `default` has more entries
    than the leaf has dims (a scalar under `P("dp")`), the entries that do not fit are dropped.

    A rule that decides no leaf's spec (its regex matches no path, or only paths an earlier rule
    decides) is most often a typo or a missing `.*` prefix, which would leave the intended leaf at
    `default` (whole on tp, its memory and speed lost): every such rule is reported in one
    `ValueError`, unless `allow_unmatched=True`. The rules of `sf.rules`' ready lists are exempt
    (a Llama without biases leaves the bias rule idle), unless none of those given decides a leaf.

    Args:
        params: the parameter tree.
        mesh: the mesh whose axis names the specs use.
        rules: ordered `(regex, P)` pairs.
        default: the spec of leaves no rule matches.
        allow_unmatched: accept rules that decide no leaf (rules shared by several models).

    Returns:
        A tree of `P`, one per leaf of `params`.

    Raises:
        ValueError: a malformed rule, a spec that cannot apply to its leaf, or (unless
            `allow_unmatched`) rules that decide no leaf, named with a few leaf paths and the fix.

    Example:
        >>> specs = sf.specs(params, mesh, rules=[(r".*norm.*", sf.P())], default=sf.P("dp"))
    """
    compiled = []
    for i, rule in enumerate(rules or ()):
        if not (isinstance(rule, tuple) and len(rule) == 2):
            raise ValueError(f"rule {i} is {rule!r}: rules are (regex, P) pairs")
        pattern, spec = rule
        if not isinstance(spec, P):
            raise ValueError(f"rule {i} ({pattern!r}) maps to {spec!r}: use sf.P(...)")
        try:
            compiled.append((re.compile(pattern), spec))
        except re.error as e:
            raise ValueError(f"rule {i}: bad regex {pattern!r}: {e}") from None
    if not isinstance(default, P):
        raise ValueError(f"default must be a P, got {default!r}")
    paths, leaves, treespec = tree_flatten_with_paths(params)
    out = []
    decided = [0] * len(compiled)
    for path, leaf in zip(paths, leaves):
        for k, (rx, spec) in enumerate(compiled):
            if rx.fullmatch(path):
                decided[k] += 1
                break
        else:
            spec = _fit_default(default, leaf) if isinstance(leaf, torch.Tensor) else default
        check_spec(path, leaf, spec, mesh)
        out.append(spec)
    if not allow_unmatched:
        _refuse_idle_rules(list(rules or ()), compiled, decided, paths)
    return optree.tree_unflatten(treespec, out)


def _refuse_idle_rules(rules: list, compiled: list, decided: list[int], paths: list[str]) -> None:
    """Every rule that decided no leaf, in one ValueError (ready rules exempt while one of them
    decides a leaf): whether its regex matches no path at all, or only paths an earlier rule takes,
    with the paths nearest to it."""
    ready = [k for k, r in enumerate(rules) if _is_ready(r)]
    ready_used = any(decided[k] for k in ready)
    idle = [k for k in range(len(rules)) if not decided[k] and not (k in ready and ready_used)]
    if not idle:
        return
    lines = []
    for k in idle:
        pattern, spec = rules[k]
        taken = [p for p in paths if compiled[k][0].fullmatch(p)]
        if taken:
            lines.append(f"rule {k} ({pattern!r}, {spec!r}) matches only leaves an earlier rule decides, e.g. {taken[0]!r}")
        elif part := [p for p in paths if compiled[k][0].search(p)][:3]:
            lines.append(f"rule {k} ({pattern!r}, {spec!r}) matches no leaf, only part of {', '.join(map(repr, part))} (a '.*' prefix?)")
        else:
            near = difflib.get_close_matches(pattern.replace("\\", ""), paths, n=3, cutoff=0.0)
            lines.append(f"rule {k} ({pattern!r}, {spec!r}) matches no leaf (nearest paths: {', '.join(map(repr, near))})")
    every_ready = " (no rule of the ready list given matches this tree: is it another model's list?)" if ready and not ready_used else ""
    raise ValueError(
        f"sf.specs: {len(idle)} of {len(rules)} rules decide no leaf's spec, so the leaves they were meant for get the "
        f"default{every_ready}: {'; '.join(lines)}. A rule's regex must match a whole dotted path, e.g. "
        r"r'.*\.fc\.weight' for 'blocks.0.fc.weight' (a missing '.*' prefix is the usual cause); "
        "fix or reorder the rules, or pass allow_unmatched=True for rules meant for other models too"
    )


def _is_ready(rule: Any) -> bool:
    try:
        return tuple(rule) in READY_RULES
    except TypeError:  # an unhashable rule
        return False


def match_specs(params: Any, spec_tree: Any, mesh: DeviceMesh) -> tuple[list[str], list[Any], list[P], Any]:
    """Flattens `params` and a spec tree that must have the same structure, checking every pair.

    Returns (paths, leaves, specs, treespec of params).
    """
    paths, leaves, treespec = tree_flatten_with_paths(params)
    spaths, sleaves, _ = tree_flatten_with_paths(spec_tree, is_leaf=lambda x: isinstance(x, P))
    if spaths != paths:
        missing = sorted(set(paths) - set(spaths))
        extra = sorted(set(spaths) - set(paths))
        raise ValueError(
            "the spec tree does not match the params: "
            + (f"no spec for {missing[:5]}{'...' if len(missing) > 5 else ''}; " if missing else "")
            + (f"specs for unknown leaves {extra[:5]}{'...' if len(extra) > 5 else ''}; " if extra else "")
            + ("same leaves in another structure; " if not missing and not extra else "")
            + "build it with sf.specs(params, mesh, rules=...)."
        )
    for path, leaf, spec in zip(paths, leaves, sleaves):
        check_spec(path, leaf, spec, mesh)
    return paths, leaves, sleaves, treespec

