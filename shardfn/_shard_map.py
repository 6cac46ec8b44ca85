"""`sf.shard_map`: a function run once per rank on that rank's blocks (JAX's `shard_map`).

Note [shard_map boundaries]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
An input enters as this rank's block of its global value: a full tensor (the same on every rank)
is cut by its spec, a DTensor is redistributed to the spec's layout and its local shard taken.
Inside, the block varies over the axes its spec names (Note [varying axes] in `_manual.py`). An
output leaves as a DTensor laid out by its spec, whose blocks are what each rank returned. The
boundaries are autograd Functions: the cotangent of a full input is assembled from every rank's
block of it (an all-gather over the axes the spec names; over the other axes it is invariant,
which the types inside guarantee), that of a DTensor input is the DTensor of the blocks' cotangents
in the input's own layout, and that of an output is its DTensor cotangent's block. An output
whose value varies over an axis its spec does not name (so the spec would claim one value where
the ranks hold different ones) is refused with `check=True` (every rank computes the same types,
so all raise together); an output that is invariant over an axis its spec does name is copied
onto it (`pvary`), whose transpose sums the cotangent there.

Splits must be even, as JAX requires: a dim the product of its axes does not divide is refused.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from . import _collectives as C
from ._manual import Region, axis_group, current, region
from ._named import _pvary, lift
from ._spec import P, local_slices, placements_for, shard_slices

__all__ = ["shard_map"]


def _is_spec(x: Any) -> bool:
    return isinstance(x, P) or x is None


def _broadcast(specs: Any, tree: Any, what: str) -> list:
    """`specs` (a prefix of `tree`, with P leaves) broadcast to one spec per leaf of `tree`."""
    try:
        full = optree.tree_broadcast_prefix(specs, tree, is_leaf=_is_spec, none_is_leaf=True)
    except ValueError:
        shape = optree.tree_map(lambda x: f"<{type(x).__name__}{tuple(x.shape) if isinstance(x, torch.Tensor) else ''}>", tree,
                                none_is_leaf=True)
        raise ValueError(
            f"sf.shard_map: {what} {specs!r} is not a prefix of the {'arguments' if what == 'in_specs' else 'outputs'}' tree "
            f"{shape}: give a P for each leaf or subtree, in a tree of the same kind (a tuple for a tuple), or one P for all"
        ) from None
    return optree.tree_leaves(full, is_leaf=_is_spec, none_is_leaf=True)


def _check_spec(spec: Any, shape: tuple, mesh: DeviceMesh, where: str) -> P:
    names = tuple(mesh.mesh_dim_names)
    sizes = dict(zip(names, (int(s) for s in mesh.shape)))
    if not isinstance(spec, P):
        raise ValueError(f"sf.shard_map: {where} has spec {spec!r}: give a P for every tensor, e.g. sf.P() for a replicated one")
    unknown = [a for a in spec.axes if a not in names]
    if unknown or len(spec) > len(shape):
        why = f"names axes {unknown} not in the mesh" if unknown else f"has {len(spec)} entries for {len(shape)} dims"
        raise ValueError(f"sf.shard_map: {where} (shape {shape}) has spec {spec!r}, which {why}; the mesh axes are {sizes}")
    for d in range(len(spec)):
        n = math.prod(sizes[a] for a in spec.axes_of(d))
        if shape[d] % n:
            raise ValueError(
                f"sf.shard_map: {where} (shape {shape}) has spec {spec!r}: dim {d} of size {shape[d]} is not divided by "
                f"{n}, the size of axes {spec.axes_of(d)} on mesh {sizes}. shard_map splits evenly, as JAX does: pad the dim "
                "to a multiple, or split another dim"
            )
    return spec


def _block_shape(spec: P, shape: tuple, mesh: DeviceMesh) -> tuple:
    sizes = dict(zip(mesh.mesh_dim_names, (int(s) for s in mesh.shape)))
    return tuple(n // math.prod(sizes[a] for a in spec.axes_of(d)) for d, n in enumerate(shape))


class _EnterFull(torch.autograd.Function):
    """A full tensor (the same on every rank) -> this rank's block; backward assembles the full
    cotangent from every rank's block (Note [shard_map boundaries])."""

    @staticmethod
    def forward(x: torch.Tensor, spec: P, mesh: DeviceMesh) -> torch.Tensor:  # type: ignore[override]
        return x[local_slices(spec, mesh, x.shape)].clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, ctx.spec, ctx.mesh = inputs
        ctx.shape = tuple(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return _Assemble.apply(grad, ctx.spec, ctx.mesh, ctx.shape), None, None

    @staticmethod
    def jvp(ctx, tangent: torch.Tensor, *_: None) -> torch.Tensor:  # type: ignore[override]
        return _EnterFull.apply(tangent, ctx.spec, ctx.mesh)

    @staticmethod
    def vmap(info, in_dims, x, spec, mesh):  # type: ignore[override]
        if in_dims[0] is None:
            return _EnterFull.apply(x, spec, mesh), None
        return _EnterFull.apply(x.movedim(in_dims[0], 0), P(None, *spec), mesh), 0


class _Assemble(torch.autograd.Function):
    """Every rank's block -> the full tensor on every rank (the transpose of `_EnterFull`)."""

    @staticmethod
    def forward(block: torch.Tensor, spec: P, mesh: DeviceMesh, shape: tuple) -> torch.Tensor:  # type: ignore[override]
        axes = spec.axes
        if not axes:
            return block.clone()
        with torch._C._DisableFuncTorch():
            group = axis_group(mesh, axes)
            got = C.all_gather_blocking(block.detach(), group.group, "the gradient of sf.shard_map's input")
            full = block.new_empty(shape)
            names = tuple(mesh.mesh_dim_names)
            sizes = dict(zip(names, (int(s) for s in mesh.shape)))
            for j, r in enumerate(group.ranks):
                coord, rest = {}, j
                for a in reversed(axes):
                    coord[a], rest = rest % sizes[a], rest // sizes[a]
                full[shard_slices(spec, shape, sizes, coord)] = got[r]
        return full

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, ctx.spec, ctx.mesh, ctx.shape = inputs

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return _EnterFull.apply(grad, ctx.spec, ctx.mesh), None, None, None

    @staticmethod
    def jvp(ctx, tangent: torch.Tensor, *_: None) -> torch.Tensor:  # type: ignore[override]
        return _Assemble.apply(tangent, ctx.spec, ctx.mesh, ctx.shape)

    @staticmethod
    def vmap(info, in_dims, block, spec, mesh, shape):  # type: ignore[override]
        return _vmapped(_Assemble, in_dims, block, spec, mesh, shape)


def _vmapped(f: Any, in_dims: tuple, x: torch.Tensor, spec: P, mesh: DeviceMesh, shape: tuple) -> tuple:
    """`f` (a block <-> tensor move) under vmap: the batch as a dim of its own, first, unsplit."""
    if in_dims[0] is None:
        return f.apply(x, spec, mesh, shape), None
    b = x.movedim(in_dims[0], 0)
    return f.apply(b, P(None, *spec), mesh, (b.shape[0], *shape)), 0


def _grad_placements(placements: tuple) -> tuple:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


class _EnterDTensor(torch.autograd.Function):
    """A DTensor -> this rank's block under `spec`; backward: the DTensor of the blocks'
    cotangents, in the input's layout."""

    @staticmethod
    def forward(x: DTensor, spec: P, mesh: DeviceMesh) -> torch.Tensor:  # type: ignore[override]
        with torch._C._DisableFuncTorch():
            want = placements_for(spec, mesh, x.shape)
            moved = C.redistribute(x, mesh, want, "sf.shard_map") if tuple(x.placements) != tuple(want) else x
            return moved.to_local().clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, ctx.spec, ctx.mesh = inputs
        ctx.shape, ctx.stride, ctx.placements = x.shape, x.stride(), tuple(x.placements)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Any:  # type: ignore[override]
        with torch._C._DisableFuncTorch():
            want = placements_for(ctx.spec, ctx.mesh, ctx.shape)
            d = DTensor.from_local(grad.contiguous(), ctx.mesh, want, run_check=False, shape=ctx.shape, stride=ctx.stride)
            back = _grad_placements(ctx.placements)
            return (C.redistribute(d, ctx.mesh, back, "the gradient of sf.shard_map's input") if back != tuple(want) else d), None, None

    @staticmethod
    def jvp(ctx, tangent: DTensor, *_: None) -> torch.Tensor:  # type: ignore[override]
        return _EnterDTensor.apply(tangent, ctx.spec, ctx.mesh)


class _Leave(torch.autograd.Function):
    """This rank's block -> the output DTensor laid out by `spec`; backward: the block of the
    DTensor cotangent."""

    @staticmethod
    def forward(block: torch.Tensor, spec: P, mesh: DeviceMesh, shape: tuple) -> DTensor:  # type: ignore[override]
        with torch._C._DisableFuncTorch():
            placements = placements_for(spec, mesh, shape)
            stride = torch.empty(shape, device="meta").stride()
            return DTensor.from_local(block.detach().contiguous(), mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, ctx.spec, ctx.mesh, ctx.shape = inputs

    @staticmethod
    def backward(ctx, grad: Any) -> Any:  # type: ignore[override]
        return _Block.apply(grad, ctx.spec, ctx.mesh, ctx.shape), None, None, None

    @staticmethod
    def jvp(ctx, tangent: torch.Tensor, *_: None) -> DTensor:  # type: ignore[override]
        return _Leave.apply(tangent, ctx.spec, ctx.mesh, ctx.shape)

    @staticmethod
    def vmap(info, in_dims, block, spec, mesh, shape):  # type: ignore[override]
        return _vmapped(_Leave, in_dims, block, spec, mesh, shape)


class _Block(torch.autograd.Function):
    """A DTensor (or a full tensor, the same on every rank) -> this rank's block under `spec`
    (the transpose of `_Leave`; its own backward is `_Leave`)."""

    @staticmethod
    def forward(grad: Any, spec: P, mesh: DeviceMesh, shape: tuple) -> torch.Tensor:  # type: ignore[override]
        with torch._C._DisableFuncTorch():
            want = placements_for(spec, mesh, shape)
            if isinstance(grad, DTensor):
                if tuple(grad.placements) != tuple(want):
                    grad = C.redistribute(grad, mesh, want, "the gradient of sf.shard_map's output")
                return grad.to_local().contiguous()
            return grad[local_slices(spec, mesh, shape)].contiguous()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, ctx.spec, ctx.mesh, ctx.shape = inputs

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return _Leave.apply(grad, ctx.spec, ctx.mesh, ctx.shape), None, None, None

    @staticmethod
    def jvp(ctx, tangent: Any, *_: None) -> torch.Tensor:  # type: ignore[override]
        return _Block.apply(tangent, ctx.spec, ctx.mesh, ctx.shape)

    @staticmethod
    def vmap(info, in_dims, grad, spec, mesh, shape):  # type: ignore[override]
        return _vmapped(_Block, in_dims, grad, spec, mesh, shape)


def _enter(x: Any, spec: Any, mesh: DeviceMesh, path: str, reg: Region, outer: "Region | None") -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    spec = _check_spec(spec, tuple(x.shape), mesh, f"input {path}")
    from ._functorch import unwrap

    again = sorted(outer.of(x) & frozenset(spec.axes), key=str) if outer is not None else []
    if again:
        raise ValueError(
            f"sf.shard_map: input {path} already varies over {again}: it is a block of the enclosing {outer.what}, and "
            f"spec {spec!r} would cut it again. A shard_map inside per-shard code may split over other axes only; "
            "pass the enclosing block with sf.P() over these axes, or move the split to the outer shard_map"
        )
    inner = unwrap(x)
    if isinstance(inner, DTensor):
        if inner.device_mesh != mesh:
            raise ValueError(
                f"sf.shard_map: input {path} is a DTensor on another mesh ({inner.device_mesh}); shard_map's mesh is {mesh}. "
                "Redistribute it onto shard_map's mesh first, or pass its full value"
            )
        with reg.untracked():
            block = _EnterDTensor.apply(x, spec, mesh)
    else:
        with reg.untracked():  # a copy, also when nothing is cut: fn may write into its blocks
            block = _EnterFull.apply(x, spec, mesh)
    reg.types[block] = frozenset(spec.axes)
    return block


def _leave(block: Any, spec: Any, mesh: DeviceMesh, path: str, reg: Region, check: bool) -> Any:
    if not isinstance(block, torch.Tensor):
        raise ValueError(f"sf.shard_map: output {path} is a {type(block).__name__}: the function must return tensors (a pytree of them)")
    names = tuple(mesh.mesh_dim_names)
    sizes = dict(zip(names, (int(s) for s in mesh.shape)))
    if not isinstance(spec, P) or any(a not in names for a in spec.axes) or len(spec) > block.ndim:
        raise ValueError(f"sf.shard_map: output {path} (block shape {tuple(block.shape)}) has spec {spec!r}: give a P of at most "
                         f"{block.ndim} entries naming axes of the mesh {sizes}")
    varies = reg.of(block)
    if check:
        extra = [a for a in names if a in varies and a not in spec.axes]
        if extra:
            raise ValueError(
                f"sf.shard_map: output {path} has out spec {spec!r}, which says it is the same on every rank along "
                f"{extra}, but its value varies along {extra}: name the axes in its out spec (e.g. sf.P({extra[0]!r}) to "
                f"concatenate the blocks), or reduce it first (sf.pmean(x, {tuple(extra) if len(extra) > 1 else extra[0]!r}) "
                "or sf.psum; an all_gather's result is typed as varying, as in JAX, so its out spec names the axis); "
                "check=False takes every rank's block as it is"
            )
    missing = tuple(a for a in names if a in spec.axes and a not in varies)
    if missing:
        block = _pvary(block, reg, missing)
    shape = tuple(n * math.prod(sizes[a] for a in spec.axes_of(d)) for d, n in enumerate(block.shape))
    with reg.untracked():
        return _Leave.apply(block, spec, mesh, shape)


def shard_map(fn: Callable, *, mesh: DeviceMesh, in_specs: Any, out_specs: Any, check: bool = True) -> Callable:
    """`fn` run once per rank on that rank's blocks of its inputs, as `jax.shard_map`.

    Args:
        fn: the per-rank function. It receives this rank's blocks (plain tensors) and returns
            this rank's blocks of the outputs; inside it, the named collectives (`sf.psum`,
            `sf.all_gather`, `sf.ppermute`, ...) work over the mesh's axes.
        mesh: the mesh (`sf.mesh(...)`).
        in_specs: a `P` per argument (a prefix of the arguments' tree; one `P` for all is
            allowed). An input is a full tensor, the same on every rank, which its spec cuts, or
            a DTensor, redistributed to its spec. Non-tensor arguments pass through.
        out_specs: a `P` per output (a prefix of the outputs' tree). Each output comes back as a
            DTensor whose blocks are what the ranks returned.
        check: refuse (`ValueError`) an out spec that says an output is the same along an axis
            where its value varies (Note [varying axes] in `shardfn/_manual.py`). With
            `check=False` each rank's block is taken as it is. Derivatives stay exact either way.

    Returns:
        A function of the global inputs returning the global outputs. Its derivatives
        (autograd, `torch.func.grad`, `vjp`, `jvp`) are those of the global function.

    Example:
        >>> f = sf.shard_map(lambda x: sf.psum(x.sum(0), "dp"), mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P())
        >>> f(torch.ones(8, 3)).full_tensor()
        tensor([8., 8., 8.])
    """
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"sf.shard_map: mesh= takes a DeviceMesh (sf.mesh(dp=-1)), got {type(mesh).__name__}")

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        specs = _broadcast(in_specs, args, "in_specs")
        paths = optree.tree_paths(args, none_is_leaf=True)
        leaves, treedef = optree.tree_flatten(args, none_is_leaf=True)
        outer = current()  # an enclosing region: its blocks are not cut again
        with region(mesh, "sf.shard_map", lift) as reg:
            blocks = [_enter(x, s, mesh, _path(p), reg, outer) for x, s, p in zip(leaves, specs, paths)]
            out = fn(*optree.tree_unflatten(treedef, blocks))
            out_leaves, out_def = optree.tree_flatten(out)
            want = _broadcast(out_specs, out, "out_specs")
            out_paths = optree.tree_paths(out)
            done = [_leave(b, s, mesh, _path(p), reg, check) for b, s, p in zip(out_leaves, want, out_paths)]
        return optree.tree_unflatten(out_def, done)

    return run


def _path(p: tuple) -> str:
    return "".join(f"[{k!r}]" for k in p) or "(the whole tree)"
