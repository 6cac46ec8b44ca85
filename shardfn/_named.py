"""Collectives over named mesh axes, with JAX's names and meanings, and exact derivatives.

Each collective is an `_Op`: what it does to this rank's block, its transpose (the op its
backward runs) and the same op under a vmap (dims shifted past the batch dim). One autograd
Function, `_Collective`, runs any op: forward the op, backward its transpose, jvp the op itself on
the tangent (every op here is linear), vmap the shifted op. Which op a call is, and how its result
is typed, follows from the axes its input varies over (Note [varying axes] in `shardfn/_manual.py`;
the table in docs/API.md, "Per-shard code").

The communication goes through `shardfn/_collectives.py`, counted and watched like every other
collective shardfn issues (a stalled `ppermute` is named as a stalled gather is).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import optree
import torch
from torch.distributed.tensor import DTensor

from . import _collectives as C
from . import _debug
from ._manual import AxisGroup, Region, axis_group, axis_names

__all__ = ["pvary", "psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "ppermute", "all_to_all", "axis_index", "axis_size"]


@dataclass(frozen=True)
class _Op:
    group: AxisGroup
    what: str

    def run(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def alone(self, x: torch.Tensor) -> torch.Tensor:
        """The op over axes of one rank (Note [axes of size one]): no message, a new tensor."""
        return x.detach().clone()

    def transpose(self) -> "_Op":
        raise NotImplementedError

    def shifted(self) -> "_Op":
        """The op on a tensor with one more leading dim (a vmap's batch dim)."""
        return self

    def meta(self, x: torch.Tensor) -> torch.Tensor:
        """The result's shape on the meta device, where nothing is sent (`sf.estimate_memory`)."""
        return torch.empty_like(x)


@dataclass(frozen=True)
class _Sum(_Op):
    def run(self, x):
        return C.all_reduce_blocking(x.detach().contiguous().clone(), self.group.group, self.what)

    def transpose(self):
        return _Copy(self.group, self.what)


@dataclass(frozen=True)
class _Copy(_Op):
    """pvary: the identity on values; its transpose sums over the axes."""

    def run(self, x):
        return x.detach().clone()

    def transpose(self):
        return _Sum(self.group, self.what)


@dataclass(frozen=True)
class _Gather(_Op):
    dim: int
    tiled: bool

    def run(self, x):
        got = C.all_gather_blocking(x.detach(), self.group.group, self.what)
        blocks = [got[g] for g in self.group.ranks]
        return torch.cat(blocks, self.dim) if self.tiled else torch.stack(blocks, self.dim)

    def alone(self, x):
        return x.detach().clone() if self.tiled else x.detach().unsqueeze(self.dim).clone()

    def transpose(self):
        return _Scatter(self.group, self.what, self.dim, self.tiled)

    def meta(self, x):
        return torch.cat([x] * self.group.size, self.dim) if self.tiled else torch.stack([x] * self.group.size, self.dim)

    def shifted(self):
        return replace(self, dim=self.dim + 1)


@dataclass(frozen=True)
class _Scatter(_Op):
    dim: int
    tiled: bool

    def run(self, x):
        n = self.group.size
        x = x.detach()
        pieces = x.chunk(n, self.dim) if self.tiled else [p.squeeze(self.dim) for p in x.split(1, self.dim)]
        by_rank = [pieces[self.group.position_of(g)] for g in range(n)]
        return C.reduce_scatter_blocking(by_rank, self.group.group, self.what)

    def alone(self, x):
        return x.detach().clone() if self.tiled else x.detach().squeeze(self.dim).clone()

    def transpose(self):
        return _Gather(self.group, self.what, self.dim, self.tiled)

    def meta(self, x):
        return x.chunk(self.group.size, self.dim)[0].clone() if self.tiled else x.select(self.dim, 0).clone()

    def shifted(self):
        return replace(self, dim=self.dim + 1)


@dataclass(frozen=True)
class _Permute(_Op):
    perm: tuple[tuple[int, int], ...]

    def run(self, x):
        g, me = self.group, self.group.index
        send_to = [g.ranks[d] for s, d in self.perm if s == me]
        sources = [s for s, d in self.perm if d == me]
        return C.permute_blocking(x.detach(), send_to, g.ranks[sources[0]] if sources else None, g.group, self.what)

    def alone(self, x):
        return x.detach().clone() if (0, 0) in self.perm else torch.zeros_like(x)

    def transpose(self):
        return replace(self, perm=tuple((d, s) for s, d in self.perm))


@dataclass(frozen=True)
class _AllToAll(_Op):
    """The tiled all-to-all: `split_dim` cut in n, piece j to position j, the pieces received
    concatenated along `concat_dim` in source order."""

    split_dim: int
    concat_dim: int

    def run(self, x):
        g = self.group
        pieces = x.detach().chunk(g.size, self.split_dim)
        got = C.all_to_all_blocking([pieces[g.position_of(r)] for r in range(g.size)], g.group, self.what)
        return torch.cat([got[r] for r in g.ranks], self.concat_dim)

    def transpose(self):
        return replace(self, split_dim=self.concat_dim, concat_dim=self.split_dim)

    def meta(self, x):
        return torch.cat([x.chunk(self.group.size, self.split_dim)[0]] * self.group.size, self.concat_dim)

    def shifted(self):
        return replace(self, split_dim=self.split_dim + 1, concat_dim=self.concat_dim + 1)


def _check_same_shape(t: torch.Tensor, group: AxisGroup, what: str) -> None:
    """Debug mode: a named collective's operand has one shape and dtype on every rank of its axis
    (as in JAX; unequal sizes abort gloo, or wait or mix values on other backends). One more small
    collective per call, which is why it is checked in debug mode only."""
    mine = (tuple(t.shape), str(t.dtype))
    every = C.all_gather_object(mine, f"{what}'s shape check (debug mode)", group.group)
    if any(x != mine for x in every):
        ranks = range(len(every)) if group.group is None else torch.distributed.get_process_group_ranks(group.group)
        shown = ", ".join(f"rank {r}: {tuple(s)} {d}" for r, (s, d) in zip(ranks, every))
        raise ValueError(
            f"{what}: the ranks passed tensors of different shapes or dtypes ({shown}). As in JAX, a collective takes "
            "one shape on every rank along its axis: with batch shares of unequal size, pad the blocks to one size "
            "(with a mask) before gathering, or reduce sums and counts with sf.psum"
        )


class _Collective(torch.autograd.Function):
    """Runs an `_Op` (see the module's docstring). The communication runs under
    `torch._C._DisableFuncTorch()`, so it composes with torch.func's transforms."""

    @staticmethod
    def forward(x: torch.Tensor, op: _Op) -> torch.Tensor:  # type: ignore[override]
        run = op.run if op.group.size > 1 else op.alone
        if _debug.ON and op.group.size > 1 and x.device.type != "meta":
            _check_same_shape(x.to_local() if isinstance(x, DTensor) else x, op.group, op.what)
        if isinstance(x, DTensor):
            return _on_local(x, run if x.device.type != "meta" else op.meta, isinstance(op, (_Sum, _Copy, _Permute)), op.what)
        if x.device.type == "meta":
            return op.meta(x) if op.group.size > 1 else op.alone(x)
        with torch._C._DisableFuncTorch():
            return run(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.op = inputs[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return _Collective.apply(grad, ctx.op.transpose()), None

    @staticmethod
    def jvp(ctx, tangent: torch.Tensor, _op: None) -> torch.Tensor:  # type: ignore[override]
        return _Collective.apply(tangent, ctx.op)

    @staticmethod
    def vmap(info, in_dims, x, op):  # type: ignore[override]
        if in_dims[0] is None:
            return _Collective.apply(x, op), None
        return _Collective.apply(x.movedim(in_dims[0], 0), op.shifted()), 0


class _Extremum(torch.autograd.Function):
    """pmax / pmin: the gradient goes to the ranks that hold the extremum, shared among ties. A NaN
    on any rank makes the result NaN there, as `torch.amax` of the global value does, whichever
    rank holds it (a reduction that compared NaNs would give the other ranks' value or not,
    by rank order)."""

    @staticmethod
    def forward(x: torch.Tensor, group: AxisGroup, op: str, what: str) -> torch.Tensor:  # type: ignore[override]
        def run(t: torch.Tensor) -> torch.Tensor:
            t = t.detach().contiguous()
            if not t.is_floating_point():
                return C.all_reduce_blocking(t.clone(), group.group, what, op)
            # One reduction of the values (NaNs out of the comparison) and of NaN flags (+1 under a
            # max, -1 under a min: the flag of any rank wins either way).
            nan = torch.isnan(t)
            sign = 1.0 if op == "max" else -1.0
            both = torch.cat([t.masked_fill(nan, -sign * float("inf")).reshape(-1), (sign * nan.to(t.dtype)).reshape(-1)])
            both = C.all_reduce_blocking(both, group.group, what, op)
            n = t.numel()
            return both[:n].view(t.shape).masked_fill(both[n:].view(t.shape) != 0, float("nan"))

        if isinstance(x, DTensor):
            if any(p.is_partial() for p in x.placements):
                raise NotImplementedError(f"{what} of a partial sum over tensor-parallel ranks: call .full_tensor() on it first")
            return _on_local(x, run, True, what)
        with torch._C._DisableFuncTorch():
            return run(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, ctx.group, _, ctx.what = inputs
        # Which elements hold the extremum, not the output itself: a write into the result in place
        # (`m.mul_(2)`, as any collective's result allows) leaves the backward what it needs.
        hit = (x == output).to(x.dtype)
        ctx.save_for_backward(hit)
        ctx.save_for_forward(hit)

    @staticmethod
    def _share(ctx, hit: torch.Tensor) -> torch.Tensor:
        with torch._C._DisableFuncTorch():
            count = C.all_reduce_blocking(hit.detach().clone(), ctx.group.group, ctx.what)
        return hit / count

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Any:  # type: ignore[override]
        (hit,) = ctx.saved_tensors
        return grad * _Extremum._share(ctx, hit), None, None, None

    @staticmethod
    def jvp(ctx, tangent: torch.Tensor, *_: None) -> torch.Tensor:  # type: ignore[override]
        (hit,) = ctx.saved_tensors
        return _Collective.apply(tangent * _Extremum._share(ctx, hit), _Sum(ctx.group, ctx.what))

    @staticmethod
    def vmap(info, in_dims, x, group, op, what):  # type: ignore[override]
        """Elementwise over ranks: a batch dim is one more dim of the operand (every rank's the same)."""
        if in_dims[0] is None:
            return _Extremum.apply(x, group, op, what), None
        return _Extremum.apply(x.movedim(in_dims[0], 0), group, op, what), 0


def lift(reg: Region, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
    """`x` through `pvary` over `axes` (what a region's tracking inserts: Note [varying axes])."""
    return _pvary(x, reg, axes)


def _on_local(x: DTensor, run, elementwise: bool, what: str) -> DTensor:
    """A collective over data axes of a DTensor laid out over other axes (a train step's tensor-
    parallel values): the collective of its local tensors, in its layout. Ops that keep every
    element where it is take any layout; the others need the value whole (replicated)."""
    if not elementwise and not all(p.is_replicate() for p in x.placements):
        raise NotImplementedError(
            f"{what} of a tensor split over tensor-parallel ranks ({x.placements}): call .full_tensor() on it first"
        )
    with torch._C._DisableFuncTorch():
        out = run(x.to_local())
    shape, stride = (x.shape, x.stride()) if elementwise else (out.shape, out.stride())
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False, shape=shape, stride=stride)


def _pvary(x: torch.Tensor, reg: Region, axes: tuple[str, ...]) -> torch.Tensor:
    if not axes or not (x.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(x)):
        return x
    with reg.untracked():
        return _Collective.apply(x, _Copy(axis_group(reg.mesh, axes), "sf.pvary"))


def pvary(x: torch.Tensor, axis: "str | Sequence[str]") -> torch.Tensor:
    """`x`, typed as varying over `axis` too (JAX's `pvary`): the identity on values, whose
    transpose sums the cotangent over those axes (over axes `x` already varied over: nothing)."""
    reg, axes = axis_names(axis, "pvary")
    have = reg.of(x)
    out = _pvary(x, reg, tuple(a for a in axes if a not in have))
    reg.types[out] = have | frozenset(axes)
    return out


def _lift(reg: Region, x: torch.Tensor, axes: tuple[str, ...]) -> tuple[torch.Tensor, frozenset]:
    """`x` typed as varying over `axes` too (a collective's input varies over its axes)."""
    have = reg.of(x)
    missing = tuple(a for a in axes if a not in have)
    if missing:
        x = _pvary(x, reg, missing)
    return x, have | frozenset(axes)


def _tensor(x: Any, call: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"sf.{call} takes a tensor (or a pytree of tensors), got {type(x).__name__}")
    return x


def _dim(d: int, ndim: int, call: str, what: str) -> int:
    if not -ndim <= d < ndim:
        raise ValueError(f"sf.{call}: {what}={d} is out of range for a tensor of {ndim} dims")
    return d % ndim


# Note [axes of size one]
# ~~~~~~~~~~~~~~~~~~~~~~~
# Over axes of one rank (`tp` of `sf.mesh(dp=-1, tp=1)`) every collective is the identity on
# values (an untiled gather adds its dim of one, a scatter takes it away, a permutation that
# does not send index 0 to itself gives zeros), and so is its transpose: no message is sent, and
# no group is needed (such an `AxisGroup` has none; a collective over `group=None` would run over
# every rank). Each still returns a new tensor, as it does over more ranks: JAX's arrays are
# values, and a result that were its input would be written by the caller's in-place ops and
# retyped under it.
def _apply(reg: Region, x: torch.Tensor, axes: tuple[str, ...], op: _Op, typed: frozenset) -> torch.Tensor:
    reg.collectives += 1
    with reg.untracked():
        out = _Collective.apply(x, op)
    reg.types[out] = typed
    return out


def _tree(fn, x: Any) -> Any:
    return optree.tree_map(fn, x, none_is_leaf=False)


def psum(x: Any, axis: "str | Sequence[str]") -> Any:
    """The sum of `x` over the ranks along `axis` (JAX's `psum`); a pytree is summed leaf by leaf.

    The result is invariant over `axis`. A value already invariant over `axis` sums to
    `axis_size(axis) * x`. A Python number `n` gives `n * axis_size(axis)`.
    """
    reg, axes = axis_names(axis, "psum")
    group = axis_group(reg.mesh, axes)

    def one(v):
        if isinstance(v, (int, float)):
            return v * group.size
        if isinstance(v, torch.Tensor) and v.dtype == torch.bool:
            raise ValueError("sf.psum of a bool tensor: cast it first (x.int() to count, or x.any() / sf.pmax to combine)")
        v, have = _lift(reg, _tensor(v, "psum"), axes)
        return _apply(reg, v, axes, _Sum(group, "sf.psum"), have - frozenset(axes))

    return _tree(one, x)


def pmean(x: Any, axis: "str | Sequence[str]") -> Any:
    """The mean of `x` over the ranks along `axis` (JAX's `pmean`): `psum(x, axis) / axis_size(axis)`."""
    n = axis_size(axis)
    return _tree(lambda v: v / n, psum(x, axis))


def _extremum(x: Any, axis: Any, op: str) -> Any:
    call = "p" + op
    reg, axes = axis_names(axis, call)
    group = axis_group(reg.mesh, axes)

    def one(v):
        v, have = _lift(reg, _tensor(v, call), axes)
        if group.size == 1:  # Note [axes of size one]: the identity, and so is its transpose
            return _apply(reg, v, axes, _Copy(group, f"sf.{call}"), have - frozenset(axes))
        reg.collectives += 1
        with reg.untracked():
            out = _Extremum.apply(v, group, op, f"sf.{call}")
        reg.types[out] = have - frozenset(axes)
        return out

    return _tree(one, x)


def pmax(x: Any, axis: "str | Sequence[str]") -> Any:
    """The elementwise maximum over the ranks along `axis` (JAX's `pmax`); invariant over `axis`.
    Its gradient goes to the ranks holding the maximum, split evenly among ties."""
    return _extremum(x, axis, "max")


def pmin(x: Any, axis: "str | Sequence[str]") -> Any:
    """The elementwise minimum over the ranks along `axis` (JAX's `pmin`); invariant over `axis`.
    Its gradient goes to the ranks holding the minimum, split evenly among ties."""
    return _extremum(x, axis, "min")


def all_gather(x: torch.Tensor, axis: "str | Sequence[str]", dim: int = 0, tiled: bool = False) -> torch.Tensor:
    """Every rank's `x` along `axis`, in axis order (JAX's `all_gather`): stacked as a new dim
    `dim`, or with `tiled=True` concatenated along `dim`. Its transpose is `psum_scatter`; the
    result is typed as varying over `axis`, as in JAX."""
    reg, axes = axis_names(axis, "all_gather")
    x = _tensor(x, "all_gather")
    dim = _dim(dim, x.ndim if tiled else x.ndim + 1, "all_gather", "dim")
    group = axis_group(reg.mesh, axes)
    x, have = _lift(reg, x, axes)
    return _apply(reg, x, axes, _Gather(group, "sf.all_gather", dim, tiled), have)


def psum_scatter(x: torch.Tensor, axis: "str | Sequence[str]", dim: int = 0, tiled: bool = False) -> torch.Tensor:
    """The sum over the ranks along `axis`, of which each keeps its own piece along `dim` (JAX's
    `psum_scatter`): without `tiled`, `x.shape[dim]` must equal the axis size and `dim` goes away;
    with `tiled=True`, `dim` is cut in `axis_size` equal pieces. Its transpose is `all_gather`."""
    reg, axes = axis_names(axis, "psum_scatter")
    x = _tensor(x, "psum_scatter")
    if x.dtype == torch.bool:  # a sum of bools: gloo would OR them (as sf.psum, refused)
        raise ValueError("sf.psum_scatter of a bool tensor: cast it first (x.int() to count)")
    dim = _dim(dim, x.ndim, "psum_scatter", "dim")
    group = axis_group(reg.mesh, axes)
    n = x.shape[dim]
    if (tiled and n % group.size) or (not tiled and n != group.size):
        need = f"a multiple of {group.size}" if tiled else f"{group.size}"
        raise ValueError(
            f"sf.psum_scatter over {axes} (size {group.size}): dim {dim} of shape {tuple(x.shape)} has size {n}, it must be "
            f"{need}. Pad the dim, or pass tiled={not tiled} if that is what you meant"
        )
    x, have = _lift(reg, x, axes)
    return _apply(reg, x, axes, _Scatter(group, "sf.psum_scatter", dim, tiled), have)


def ppermute(x: torch.Tensor, axis: "str | Sequence[str]", perm: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Sends `x` from index `source` to index `destination` along `axis` for each pair of `perm`
    (JAX's `ppermute`); an index that receives nothing gets zeros. Each index is a source at most
    once and a destination at most once. Its transpose is the inverse permutation."""
    reg, axes = axis_names(axis, "ppermute")
    x = _tensor(x, "ppermute")
    group = axis_group(reg.mesh, axes)
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise ValueError(
            f"sf.ppermute over {axes}: perm must be a list of (source, destination) pairs of indices, got {perm!r}; e.g. "
            "the ring shift [(i, (i + 1) % n) for i in range(n)]"
        ) from None
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts) or any(not 0 <= i < group.size for i in srcs + dsts):
        raise ValueError(
            f"sf.ppermute over {axes} (size {group.size}): perm {list(perm)} must be (source, destination) pairs of indices "
            f"in [0, {group.size}), each index a source at most once and a destination at most once, e.g. a ring shift "
            f"[(i, (i + 1) % n) for i in range(n)]"
        )
    x, have = _lift(reg, x, axes)
    return _apply(reg, x, axes, _Permute(group, "sf.ppermute", pairs), have)


def all_to_all(x: torch.Tensor, axis: "str | Sequence[str]", split_dim: int, concat_dim: int, tiled: bool = False) -> torch.Tensor:
    """JAX's `all_to_all`: `x` is cut along `split_dim` into `axis_size` pieces, piece j sent to
    index j, and the pieces received are joined along `concat_dim` in source order. Without
    `tiled`, `x.shape[split_dim]` must equal the axis size, `split_dim` goes away and the sources
    form a new dim at `concat_dim`. Its transpose swaps `split_dim` and `concat_dim`."""
    reg, axes = axis_names(axis, "all_to_all")
    x = _tensor(x, "all_to_all")
    split_dim = _dim(split_dim, x.ndim, "all_to_all", "split_dim")
    concat_dim = _dim(concat_dim, x.ndim, "all_to_all", "concat_dim")
    group = axis_group(reg.mesh, axes)
    n = x.shape[split_dim]
    if (tiled and n % group.size) or (not tiled and n != group.size):
        need = f"a multiple of {group.size}" if tiled else f"{group.size}"
        raise ValueError(
            f"sf.all_to_all over {axes} (size {group.size}): split_dim {split_dim} of shape {tuple(x.shape)} has size {n}, it "
            f"must be {need}"
        )
    x, have = _lift(reg, x, axes)
    if not tiled:  # as JAX: the tiled exchange on a tensor with a new dim of one at concat_dim
        if split_dim < concat_dim:
            concat_dim += 1
        elif split_dim > concat_dim:
            split_dim += 1
        if split_dim != concat_dim:
            x = x.unsqueeze(concat_dim)
            reg.types[x] = have
    out = _apply(reg, x, axes, _AllToAll(group, "sf.all_to_all", split_dim, concat_dim), have)
    if not tiled and split_dim != concat_dim:
        out = out.squeeze(split_dim)
    reg.types[out] = have
    return out


def axis_index(axis: "str | Sequence[str]") -> torch.Tensor:
    """This rank's index along `axis` (for a tuple of axes the first is the major one), as a
    0-dim int64 tensor typed as varying over `axis`, usable in tensor arithmetic."""
    reg, axes = axis_names(axis, "axis_index")
    group = axis_group(reg.mesh, axes)
    device = torch.device(reg.mesh.device_type, torch.cuda.current_device()) if reg.mesh.device_type == "cuda" else reg.mesh.device_type
    with reg.untracked():
        out = torch.tensor(group.index, dtype=torch.int64, device=device)
    reg.types[out] = frozenset(axes)
    return out


def axis_size(axis: "str | Sequence[str]") -> int:
    """The number of ranks along `axis` (the product of the sizes of a tuple of axes)."""
    reg, axes = axis_names(axis, "axis_size")
    size = 1
    for a in axes:
        size *= reg.sizes[a]
    return size
