"""`sf.shard` and `sf.gather`: between full parameter trees and DTensor trees."""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch.autograd import forward_ad
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from . import _collectives as C
from . import _donate, _forward_ad, _watch
from ._mesh import mesh_group
from ._functorch import batched, install_mixing_check, note_gathered, refuse_tracing, unwrap
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch._C._functorch import TransformType
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard
from ._agree import Item, agree, agree_on_settings, check_sync
from ._meta_init import check_init, empty_buffers, empty_shard, materialize
from ._models import ModelInfo, model_of
from ._spec import local_slices, match_specs, placements_for, spec_of

__all__ = ["shard", "gather"]

_forward_ad.install()  # Note [dual DTensors]
install_mixing_check()  # Note [a sharded leaf read inside a transform]


def shard(params: Any, specs: Any, mesh: DeviceMesh, init: Any = None, *, sync: str | None = "broadcast") -> Any:
    """Shards a full parameter tree over `mesh`: a tree of DTensors holding only local shards.

    The ranks must hold one model: by default every rank takes rank 0's values of the full leaves
    (`sync`, Note [one model] in `shardfn/_agree.py`); each then keeps its own shards. Every layout a spec can say is honored: a dim over several axes is split
    nested, the first axis the major one (Note [layouts of a spec] in `shardfn/_spec.py`); dims
    that the axes' sizes do not divide are split as `torch.chunk` does, and a rank may hold an
    empty shard. A tree of DTensors is redistributed to the specs' layouts.

    Args:
        params: the full parameter tree.
        specs: a tree of `P` with the structure of `params` (see `sf.specs`).
        mesh: the device mesh.
        init: the module `params` came from (or its `sf.functionalize` function), when it was built
            under `with sf.meta_device():`: its recorded construction is replayed, one tensor at a
            time, giving exactly the values an eager build would have (Note [meta init] in
            `shardfn/_meta_init.py`); every rank then holds only its shards plus what is being
            initialized. This takes the recorded generator state from rank 0 (a collective).
            `init="empty"`: where values do not matter (memory estimates, simulation), the meta
            leaves become uninitialized local shards, whether the module was built under
            `sf.meta_device()` or plain `torch.device("meta")` (the module's meta buffers become
            uninitialized tensors on the mesh's device); nothing is replayed or communicated.
        sync: how the ranks come to hold the same full (non-DTensor, non-meta) leaves, which each
            built or loaded itself (an unseeded build, a per-rank seed, weights loaded on rank 0
            only): `"broadcast"` (default) sends rank 0's values to the others, packed in a few
            buckets (about one broadcast per 64 MiB); `"check"` compares bitwise fingerprints and
            raises a `ValueError` on every rank naming the leaves and ranks that differ; None uses
            each rank's own values, unchecked. Meta-device leaves (each rank fills its own shards)
            and DTensor leaves (already laid out) are never sent.

    Returns:
        A tree of `torch.distributed.tensor.DTensor`, the structure of `params`: new leaves (each
        `requires_grad` as its source), not a function of `params` for autograd. A gradient flows to
        the sharded leaves; to differentiate through a layout, gather (`sf.gather`, `apply`).

    Example:
        >>> sharded = sf.shard(params, sf.specs(params, mesh), mesh)
        >>> with sf.meta_device():
        ...     model = Model(cfg)
        >>> apply, params = sf.functionalize(model, units=r"blocks\\.\\d+")
        >>> sharded = sf.shard(params, sf.specs(params, mesh), mesh, init=model)
    """
    if torch._C._are_functorch_transforms_active():
        raise NotImplementedError(
            "sf.shard inside a torch.func transform: it makes new leaves, which no transform differentiates "
            "through. Shard outside the transform and differentiate with respect to the sharded tree (through "
            "sf.gather or apply)"
        )
    check_sync(sync, "sf.shard")
    paths, leaves, spec_list, treespec = match_specs(params, specs, mesh)
    if sync is not None:  # one layout on every rank: a spec set otherwise on one rank is refused by name
        agree_on_settings({f"specs[{p!r}]": repr(s) for p, s in zip(paths, spec_list)}, mesh, "sf.shard")
    out: list[Any] = [None] * len(leaves)
    meta = {i for i, leaf in enumerate(leaves) if leaf.is_meta}
    if meta and check_init(init, "sf.shard"):  # values do not matter: uninitialized shards (Note [meta init])
        for i in meta:
            out[i] = empty_shard(leaves[i], mesh, placements_for(spec_list[i], mesh, leaves[i].shape))
        owner = model_of(flat=(paths, leaves), where=lambda m: m.returned_tree(paths, leaves))
        empty_buffers(owner.module if owner is not None else None, mesh.device_type, owner)
    elif meta:
        at = {paths[i]: i for i in meta}
        info = _init_model(init, paths, leaves, paths[min(meta)])

        def emit(path: str, full: torch.Tensor) -> None:
            i = at[path]
            placements = placements_for(spec_list[i], mesh, full.shape)
            d = distribute_tensor(full.to(mesh.device_type), mesh, placements, src_data_rank=None)
            local = d.to_local().clone()  # not a view: the full value is dropped
            out[i] = DTensor.from_local(local, mesh, placements, run_check=False, shape=d.shape, stride=d.stride())

        materialize(info, set(at), emit, buffer_device=mesh.device_type)
    elif init is not None:
        raise ValueError("init= is for parameters on the meta device; these params hold values: drop init=")

    def emitter(i: int) -> Any:
        def emit(full: torch.Tensor) -> None:
            placements = placements_for(spec_list[i], mesh, full.shape)
            d = distribute_tensor(full.detach().to(mesh.device_type), mesh, placements, src_data_rank=None)
            if full is not leaves[i]:  # a view of a received bucket: the shard gets memory of its own
                d = DTensor.from_local(d.to_local().clone(), mesh, placements, run_check=False, shape=d.shape, stride=d.stride())
            out[i] = d
        return emit

    whole = tuple(range(mesh.ndim))
    items = [Item(paths[i], leaf, emitter(i), whole) for i, leaf in enumerate(leaves) if i not in meta and not isinstance(leaf, DTensor)]
    with _watch.watched("sf.shard"), _watch.waiting():
        agree(items, mesh, sync, "sf.shard")  # Note [one model] in `_agree.py`
        for i, (leaf, spec) in enumerate(zip(leaves, spec_list)):
            if i in meta or not isinstance(leaf, DTensor):
                continue
            if leaf.device_mesh != mesh:
                raise ValueError(
                    f"leaf {paths[i]!r} is sharded over another mesh ({leaf.device_mesh}) than the one given "
                    f"({mesh}): move a tree to a new mesh through its full values, `full = sf.gather(tree)` then "
                    "`sf.shard(full, specs, mesh)`, or `sf.save` then `sf.load` onto the new mesh"
                )
            out[i] = C.redistribute(leaf, mesh, placements_for(spec, mesh, leaf.shape), "sf.shard")
    return optree.tree_unflatten(treespec, out)


def _init_model(init: Any, paths: list[str], leaves: list[Any], first: str) -> Any:
    """The functionalized model whose initializers set the meta leaves."""
    if init is None:
        raise ValueError(
            f"leaf {first!r} is on the meta device: pass the module it was built with, "
            "sf.shard(params, specs, mesh, init=model), to initialize it with the module's own initializers "
            "(or init=\"empty\" for uninitialized shards where values do not matter)"
        )
    if isinstance(getattr(init, "info", None), ModelInfo):  # the module's sf.functionalize function
        return init.info
    if not isinstance(init, torch.nn.Module):
        raise ValueError(f"init= takes the meta-device module (or its sf.functionalize function), got {type(init).__name__}")
    found = model_of(flat=(paths, leaves), module=init)
    if found is None:
        raise ValueError(
            f"init= is a {type(init).__name__} whose functionalized parameters are not these: pass the module "
            "sf.functionalize(module) turned into these params, with the whole tree it returned (not a subtree)"
        )
    return found


def _reduce_to_placements(grad: torch.Tensor, mesh: DeviceMesh, placements, shape) -> torch.Tensor:
    """Averages `grad` (a full tensor on each rank) over every rank of the mesh and keeps this
    rank's part (Note [the mean over ranks])."""
    grad = grad.contiguous()
    if mesh.ndim == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0 and grad.dim() > 0:
        group, W = mesh_group(mesh, 0), mesh.size()
        r = mesh.get_local_rank()
        rows = grad.shape[0]
        chunk = -(-rows // W)
        seg = chunk * grad.shape[1:].numel()
        inp = torch.empty(W, seg, dtype=grad.dtype, device=grad.device)
        torch._chunk_cat([grad], dim=0, num_chunks=W, out=inp)
        out = torch.empty(chunk, *grad.shape[1:], dtype=grad.dtype, device=grad.device)
        with C.watching("the gradient of sf.gather"):
            C.reduce_scatter(out.view(-1), inp.view(-1), group, async_op=False)
        if W > 1:
            out.div_(W)
        return out[: max(0, min(rows - r * chunk, chunk))]
    total = grad.clone()
    for d, p in enumerate(placements):
        if not isinstance(p, Replicate) or mesh.size(d) > 1:
            C.all_reduce_blocking(total, mesh_group(mesh, d), "the gradient of sf.gather")
    if mesh.size() > 1:
        total.div_(mesh.size())
    # This rank's part, as the placements lay it out (Note [layouts of a spec] in `_spec.py`), by
    # hand: distribute_tensor cannot run inside torch.func transforms.
    box = local_slices(spec_of(placements, mesh, total.dim()), mesh, total.shape)
    return total[box].contiguous()


_JACFWD_REFUSED = (
    "jacfwd, hessian or a vmap over tangents with respect to a sharded tree is not supported yet: use "
    "torch.func.jacrev (its Jacobian is sharded like the tree), a Hessian-vector product "
    "(torch.func.vjp(torch.func.grad(f), params)), or gather outside the transform, `full = sf.gather(params)`"
)

_TANGENT_LAYOUT = (
    "the tangent of a sharded leaf must be a DTensor laid out as the leaf ({spec}); got a {kind} of shape {shape}: "
    "shard the tangents as the params, `sf.shard(tangents, sf.specs(tangents, mesh), mesh)`"
)

_VMAP_REFUSED = (
    "the gradient of sf.gather under vmap is not supported: across ranks it would average example i of every "
    "rank. For per-example gradients of a sharded model use sf.per_sample_grads, sf.per_sample_grad_norms "
    "or sf.dp_value_and_grad; or gather outside the vmap, `full = sf.gather(params)`, and vmap over the full tree"
)


# Note [the mean over ranks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every rank runs its own function of the gathered tree and seeds its own backward with 1. The
# gradient shardfn returns, here as in the train step and `value_and_grad`, is that of the mean of
# those functions over the W ranks of the leaf's mesh: the gather's backward averages the ranks'
# full gradients (a reduce-scatter, or an all-reduce for a replicated leaf, divided by W). So the
# same data on every rank gives the unsharded gradient exactly, and each rank's equal share of a
# global batch gives the global batch's (with unequal shares, the mean of the ranks' means:
# `sf.dp_value_and_grad` divides by the global count).
#
# For gradients of gradients to stay exact, the averaging reduce-scatter's own backward is the
# plain gather, without a 1/W. Seen as linear maps with the inner product of the mean over ranks
# on per-rank tensors (<x, y> = mean_r x_r . y_r, which is what a seed of 1 on every rank stands
# for) and the plain one on sharded tensors, the gather G and the averaging reduce-scatter R are
# each other's adjoints: <G s, x> = mean_r s . x_r = s . R x. What each rank computes on its own
# needs nothing more: the 1/W of that inner product appears on both sides. A Hessian-vector product
# `vjp(grad(f))(v)` then runs G on `v` (every rank gets `v`), each rank's Hessian, and R: the
# mean of the ranks' Hessians times `v`, exactly. `jvp` is each rank's own function (the tangent
# gathered, nothing averaged) and composes the same way (`jvp(grad(f))`, a gradient of a jvp).


# Note [one node for the tree]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A gather's backward is a collective, so every rank must run it for the same leaves in the same
# order, whatever its own function used. A rank whose data routes around a leaf (an expert no
# example of its batch reaches, a task head it has no example for) computes no gradient for that
# leaf; with one autograd node per leaf, that node never ran there, and the next leaf's
# reduce-scatter paired with the other ranks' reduce-scatter of the skipped one: wrong gradients on
# one rank, a stall on another. So the tree is gathered by one node, and reduced by one: autograd
# runs a node's backward once, with zeros for the outputs nothing used (materialized gradients, a
# Function's default, which both rely on: their backwards never see None), as
# soon as any output got a gradient, and the node reduces every leaf, in leaf order. The reduction
# is one node as well, so a gradient of a gradient (a Hessian-vector product) gathers every leaf
# again on every rank. A rank whose function used no leaf of the tree at all runs neither, and the
# others wait for it until the collective timeout names it. The cost: every leaf's full gradient
# is alive at once before the reduction starts (a node per leaf could reduce and free each as it
# came), the same as for `sf.gather` outside transforms; the train step, which reduces unit by
# unit, does not go through here.


def _meta(x: Any, under_vmap: bool) -> tuple | None:
    """What the reduction of a gathered leaf needs: its mesh, placements, shape and spec (None for
    a plain tensor, whose gradient passes through)."""
    return (x.device_mesh, x.placements, x.shape, x._spec, under_vmap) if isinstance(x, DTensor) else None


def _reduce_one(grad: torch.Tensor, meta: tuple) -> DTensor:
    mesh, placements, shape, spec, _ = meta
    with torch._C._DisableFuncTorch():
        local = _reduce_to_placements(grad, mesh, placements, shape)
    # The plain constructor: `DTensor.from_local` is an autograd.Function, refused inside torch.func.
    return _donate.wrap(local, spec)


_JACREV_OF_JACREV = (
    "a derivative of jacrev with respect to a sharded tree (jacrev(jacrev(f)), a gradient of a Jacobian) "
    "is not supported yet: gather outside the transforms (`full = sf.gather(params)`), or use a "
    "Hessian-vector product, torch.func.vjp(torch.func.grad(f), params)"
)


def _batch_refusal(grads: list, metas: tuple) -> str | None:
    """Why this rank cannot reduce a batch of cotangents, if it cannot: a vmap over examples (the
    forward ran under vmap), a leaf on part of a mesh, or a transform that would differentiate the
    Jacobian (the batch is reduced outside any recorded graph: it would see zeros)."""
    if any(m[4] or len(m[1]) != m[0].ndim for m in metas):
        return _VMAP_REFUSED
    if any(g.requires_grad for g in grads) or any(i.key() in (TransformType.Grad, TransformType.Jvp) for i in retrieve_all_functorch_interpreters()):
        return _JACREV_OF_JACREV
    return None


def _agree_on_batch(n: int, refusal: str | None, metas: tuple) -> None:
    """Before any cotangent batch is reduced, the ranks of every mesh the leaves live on exchange
    their batch size and refusal (one small exchange per mesh): a refusal on any rank, or different
    sizes (jacrev averages J_r over the ranks, which needs as many outputs on each; gloo would abort
    on the wrong-sized messages), is raised on every rank."""
    meshes = list({id(m[0]): m[0] for m in metas}.values())
    for mesh in meshes:
        with torch._C._DisableFuncTorch():
            said = C.all_gather_object((n, refusal), "jacrev through sf.gather", group=mesh_group(mesh))
        refusals = [r for _, r in said if r is not None]
        if refusals:
            raise NotImplementedError(refusals[0])
        sizes = [k for k, _ in said]
        if len(set(sizes)) > 1:
            raise ValueError(
                f"jacrev with respect to a sharded tree gives mean_r J_r, the mean over ranks of each rank's Jacobian, "
                f"which needs the same number of outputs on every rank; the ranks have {sizes}. Give every rank outputs "
                "of one shape (e.g. pad the last batch), or gather outside the transform (`full = sf.gather(params)`) "
                "for each rank's own Jacobian"
            )


def _reduce_batched(grad: torch.Tensor, meta: tuple) -> DTensor:
    """A batch of cotangents (jacrev), batch dim first, reduced as one: batch dim last so every
    Shard dim keeps its index, then first again on the shard."""
    mesh, placements, shape, _, _ = meta
    n = grad.shape[0]
    with torch._C._DisableFuncTorch():
        local = _reduce_to_placements(grad.movedim(0, -1), mesh, placements, (*shape, n)).movedim(-1, 0).contiguous()
    out_placements = tuple(_shifted(p) for p in placements)
    full_shape = torch.Size((n, *shape))
    out_spec = DTensorSpec(mesh, out_placements, TensorMeta(full_shape, torch.empty(0).new_empty(full_shape, device="meta").stride(), local.dtype))
    return _donate.wrap(local, out_spec)


class _Gather(torch.autograd.Function):
    """DTensors -> full tensors, one autograd node for the whole tree (Note [one node for the
    tree]); backward averages the full gradients of all ranks into the shards (Note [the mean over
    ranks]).

    The collectives run under `torch._C._DisableFuncTorch()`, so the function composes with
    torch.func transforms (without it, a transform refuses the collective's in-place copy into a
    captured tensor). The backward is itself a Function (`_ReduceScatter`, whose backward is this
    gather), so a gradient of a gradient (`vjp(grad(f))`, a Hessian-vector product) is recorded
    and exact. Its jvp gathers the tangents' shards (Note [dual DTensors] in `_forward_ad.py`).
    """

    @staticmethod
    def forward(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        with torch._C._DisableFuncTorch():
            return tuple(_own(C.full_tensor(x, "sf.gather"), x) if isinstance(x, DTensor) else x.clone() for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        # Whether the forward itself ran under vmap: a vmap over examples, whose batched gradient
        # the reduction refuses (_VMAP_REFUSED); a vmap over the cotangents alone (jacrev) is
        # served, one reduce-scatter per leaf for the whole batch.
        under_vmap = any(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters())
        ctx.metas = tuple(_meta(unwrap(x), under_vmap) for x in inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        at = [i for i, m in enumerate(ctx.metas) if m is not None]
        out = list(grads)
        if at:
            reduced = _ReduceScatter.apply(tuple(ctx.metas[i] for i in at), *[grads[i] for i in at])
            for i, r in zip(at, reduced):
                out[i] = r
        return tuple(out)

    @staticmethod
    def vmap(info, in_dims, *xs):  # type: ignore[override]
        if any(d is not None for d in in_dims):
            raise NotImplementedError("sf.gather of a tree batched by vmap is not supported: vmap over the gathered tree")
        return _Gather.apply(*xs), (None,) * len(xs)

    @staticmethod
    def jvp(ctx, *tangents: torch.Tensor | None) -> tuple:  # type: ignore[override]
        for t, meta in zip(tangents, ctx.metas):
            if t is None or meta is None:
                continue
            if batched(t):
                raise NotImplementedError(_JACFWD_REFUSED)
            _, placements, shape, spec, _ = meta
            u = unwrap(t)
            if not isinstance(u, DTensor) or (u.device_mesh, u.placements, u.shape) != (meta[0], placements, shape):
                raise ValueError(_TANGENT_LAYOUT.format(kind=type(u).__name__, shape=tuple(u.shape), spec=spec))
        # The tangents' gather is this Function again, so a transform around the jvp that
        # differentiates the tangents (grad of a jvp, jvp of a jvp) records it too.
        present = [t for t in tangents if t is not None]
        fulls = iter(_Gather.apply(*present) if present else ())
        return tuple(None if t is None else next(fulls) for t in tangents)


class _ReduceScatter(torch.autograd.Function):
    """Full tensors (one set per rank) -> the DTensors of their mean, laid out as `metas` say; the
    gradient of `_Gather`, and its backward is `_Gather` (its adjoint: Note [the mean over ranks]).
    One node for the tree, as `_Gather` (Note [one node for the tree])."""

    @staticmethod
    def forward(metas: tuple, *grads: torch.Tensor) -> tuple[DTensor, ...]:  # type: ignore[override]
        return tuple(_reduce_one(g, m) for g, m in zip(grads, metas))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.metas = inputs[0]

    @staticmethod
    def backward(ctx, *grads: DTensor) -> Any:  # type: ignore[override]
        return (None, *_Gather.apply(*grads))

    @staticmethod
    def vmap(info, in_dims, metas, *grads):  # type: ignore[override]
        dims = in_dims[1:]
        if all(d is None for d in dims):
            return _ReduceScatter.apply(metas, *grads), (None,) * len(grads)
        # The batch of cotangents (jacrev). A leaf no output reached has an unbatched (zero)
        # cotangent on this rank and perhaps a batched one on another: every leaf goes as a batch,
        # so that the ranks issue the same collectives of the same sizes.
        n = info.batch_size
        batches = [g.movedim(d, 0) if d is not None else g.unsqueeze(0).expand(n, *g.shape) for g, d in zip(grads, dims)]
        _agree_on_batch(n, _batch_refusal(batches, metas), metas)
        return tuple(_reduce_batched(g, m) for g, m in zip(batches, metas)), (0,) * len(grads)

    @staticmethod
    def jvp(ctx, _metas: None, *tangents: torch.Tensor | None) -> tuple:  # type: ignore[override]
        if any(t is not None and batched(t) for t in tangents):
            raise NotImplementedError(_JACFWD_REFUSED)
        at = [i for i, t in enumerate(tangents) if t is not None]
        reduced = iter(_ReduceScatter.apply(tuple(ctx.metas[i] for i in at), *[tangents[i] for i in at]) if at else ())
        return tuple(None if t is None else next(reduced) for t in tangents)


def _shifted(p: Any) -> Any:
    """Placement `p` of a tensor that gained a leading dim."""
    if isinstance(p, _StridedShard):
        return _StridedShard(p.dim + 1, split_factor=p.split_factor)
    return Shard(p.dim + 1) if isinstance(p, Shard) else p


def _holds_dtensor(x: Any) -> bool:
    return isinstance(unwrap(x), DTensor)


def gather(sharded: Any) -> Any:
    """Gathers a DTensor tree into full tensors on every rank; differentiable.

    The gradient of `gather` is the reduce-scatter of the mean: each shard receives the mean, over
    the ranks of the mesh, of the gradients of its rows (for replicated leaves, the all-reduced
    gradient divided by the number of ranks). A gradient through `gather` is so the gradient of
    the mean over ranks of each rank's function, as `sf.value_and_grad` and `train_step` give: the
    same data on every rank gives the unsharded gradient (Note [the mean over ranks] in
    `shardfn/_shard.py`).

    Args:
        sharded: a tree with DTensor leaves (plain tensors pass through).

    Returns:
        The same tree with full, plain tensors.

    Example:
        >>> full = sf.gather(state.params)
    """
    refuse_tracing()
    leaves, treedef = optree.tree_flatten(sharded)
    note_gathered(leaves)
    with _watch.watched("sf.gather"):
        if _transformed(leaves):
            at = [i for i, x in enumerate(leaves) if _holds_dtensor(x)]
            for i, full in zip(at, _Gather.apply(*[leaves[i] for i in at]) if at else ()):
                leaves[i] = full
            return optree.tree_unflatten(treedef, leaves)
        at = [i for i, x in enumerate(leaves) if isinstance(x, DTensor)]
        for i, full in zip(at, _GatherMany.apply(*[leaves[i] for i in at]) if at else ()):
            leaves[i] = full
        return optree.tree_unflatten(treedef, leaves)


def _own(full: torch.Tensor, x: DTensor) -> torch.Tensor:
    """`full` in memory of its own: a leaf whole on this rank (replicated, a mesh of one rank) comes
    back from the gather as its local tensor, which the next train step overwrites in place."""
    local = x._local_tensor
    if local.numel() and full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        return full.clone()
    return full


def _transformed(leaves: list) -> bool:
    """Whether a torch.func transform or a forward-AD tangent sees the gather: the tree then goes
    through `_Gather`, which has their rules. Either is the same on every rank for the same code, so
    every rank issues the same collectives."""
    if torch._C._are_functorch_transforms_active():
        return True
    return any(isinstance(x, torch.Tensor) and forward_ad.unpack_dual(x).tangent is not None for x in leaves)


class _GatherMany(torch.autograd.Function):
    """DTensors -> full tensors in few collectives (`_collectives.full_tensors`: leaves split by plain
    `Shard`s packed into one all-gather per mesh dim and dtype); the backward reduces each
    gradient as `_Gather`'s does. Used outside torch.func transforms and forward AD, whatever the
    leaves' `requires_grad` and the grad mode, so that every rank issues the same collectives."""

    @staticmethod
    def forward(ctx, *xs: DTensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.metas = [(x.device_mesh, x.placements, x.shape, x._spec, False) for x in xs]
        return tuple(_own(full, x) for full, x in zip(C.full_tensors(list(xs), "sf.gather"), xs))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        return _ReduceScatter.apply(tuple(ctx.metas), *grads)
