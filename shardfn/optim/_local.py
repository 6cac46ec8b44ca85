"""Local views of (possibly sharded) pytrees: the one place that unwraps and rewraps DTensors.

Optimizer math is elementwise, so it runs on each leaf's local tensor (``DTensor._local_tensor``), never
through DTensor dispatch. Results are wrapped back with the spec (mesh, placements, global shape and
stride) of the leaf they belong to.
"""

from __future__ import annotations

from typing import Any, Sequence

import optree
import torch
from torch.distributed.tensor import DTensor

__all__: list[str] = []

Tree = Any


def flatten(tree: Tree) -> tuple[list[Any], optree.PyTreeSpec]:
    """Leaves and structure of `tree` (``None`` is an empty subtree, as in JAX)."""
    return optree.tree_flatten(tree)


def flatten_as(spec: optree.PyTreeSpec, tree: Tree, what: str) -> list[Any]:
    """Leaves of `tree`, which must have structure `spec`; a ValueError naming `what` otherwise."""
    leaves, other = optree.tree_flatten(tree)
    if other != spec:
        frozen = _none_where_tensors(spec, tree)
        if frozen:
            raise ValueError(
                f"the updates are None at {frozen[:5]}{' ...' if len(frozen) > 5 else ''}, where {what} holds tensors: "
                "sf.value_and_grad gives None for frozen leaves. Optimize the trained leaves only: "
                "opt = sf.optim.masked(opt, mask) with mask = optree.tree_map(lambda g: g is not None, grads, "
                "none_is_leaf=True), then opt.init(params) as before; sf.apply_updates leaves a parameter whose "
                "update is None as it is"
            )
        raise ValueError(
            f"{what} does not match the structure of the updates:\n  expected {spec}\n  got      {other}"
        )
    return leaves


def pair_leaves(params: Tree, updates: Tree, what: str) -> tuple[list[Any], list[Any], Any]:
    """The leaves of `params` and of `updates` in pairs, and a function that puts new parameter
    leaves in place of the paired ones. A None update (a frozen leaf's, as optax takes them) pairs
    with nothing: its parameter stays. Otherwise the structures must match (ValueError naming `what`)."""
    p_leaves, spec = flatten(params)
    u_leaves, u_spec = optree.tree_flatten(updates)
    if u_spec == spec:  # the usual case: one walk of each tree
        return p_leaves, u_leaves, spec.unflatten
    full = optree.tree_structure(params, none_is_leaf=True)
    if optree.tree_structure(updates, none_is_leaf=True) != full:
        flatten_as(spec, updates, what)  # raises, naming the difference
    p_all = optree.tree_leaves(params, none_is_leaf=True)
    u_all = optree.tree_leaves(updates, none_is_leaf=True)
    keep = [p is not None and u is not None for p, u in zip(p_all, u_all)]

    def put(new: list[Any]) -> Tree:
        it = iter(new)
        return full.unflatten([next(it) if k else p for p, k in zip(p_all, keep)])

    return [p for p, k in zip(p_all, keep) if k], [u for u, k in zip(u_all, keep) if k], put


def _none_where_tensors(spec: optree.PyTreeSpec, tree: Tree) -> list[str]:
    """The dotted paths where the updates (structure `spec`, None an empty subtree) hold None and
    `tree` a leaf, if that is the only difference; else []."""
    updates = spec.unflatten([0] * spec.num_leaves)
    paths, leaves, u_spec = optree.tree_flatten_with_path(updates, none_is_leaf=True)
    if u_spec != optree.tree_structure(tree, none_is_leaf=True):
        return []
    return [".".join(map(str, p)) for p, x, t in zip(paths, leaves, optree.tree_leaves(tree, none_is_leaf=True)) if x is None and t is not None]


def local(x: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor, or `x` itself."""
    return x._local_tensor if isinstance(x, DTensor) else x


def locals_(leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [x._local_tensor if isinstance(x, DTensor) else x for x in leaves]


def wrap(out: torch.Tensor, like: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
    """`out` (a local tensor) as a leaf like `like`: a DTensor with `like`'s spec, or `out` itself."""
    if not isinstance(like, DTensor):
        return out.requires_grad_(requires_grad) if requires_grad else out
    if out.dtype == like.dtype:
        return DTensor(out, like._spec, requires_grad=requires_grad)
    wrapped = DTensor.from_local(
        out, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )
    return wrapped.requires_grad_(requires_grad) if requires_grad else wrapped


def unflatten(spec: optree.PyTreeSpec, outs: Sequence[torch.Tensor], likes: Sequence[torch.Tensor]) -> Tree:
    """Rebuilds a tree from local results, reusing a leaf of `likes` wherever its local tensor is the result."""
    leaves = [
        like if (like._local_tensor if isinstance(like, DTensor) else like) is out else wrap(out, like)
        for out, like in zip(outs, likes)
    ]
    return optree.tree_unflatten(spec, leaves)


def clone(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of local tensors (one foreach copy, no per-leaf arithmetic)."""
    out = [torch.empty_like(x) for x in xs]
    if out:
        torch._foreach_copy_(out, list(xs))
    return out


def zeros_like(tree: Tree) -> Tree:
    """Zeros shaped like every leaf of `tree` (DTensor leaves give DTensor zeros, same spec)."""
    leaves, spec = flatten(tree)
    outs = [torch.zeros_like(x) for x in locals_(leaves)]
    return unflatten(spec, outs, leaves)


def foreach(name: str, inplace: bool, xs: list[torch.Tensor], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """``torch._foreach_<name>_`` on `xs` (returning `xs`) when `inplace`, else the out-of-place op."""
    if not xs:
        return xs
    if inplace:
        getattr(torch, f"_foreach_{name}_")(xs, *args, **kwargs)
        return xs
    return list(getattr(torch, f"_foreach_{name}")(xs, *args, **kwargs))


def new_count() -> torch.Tensor:
    """A step counter: a 0-d int64 CPU tensor (reading it is no device sync)."""
    return torch.zeros((), dtype=torch.int64)


def bump(count: torch.Tensor, inplace: bool) -> torch.Tensor:
    return count.add_(1) if inplace else count + 1
