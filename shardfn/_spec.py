"""Partition specs (`P`), spec trees from rules (`specs`), and their validation against a mesh."""

from __future__ import annotations

import re
from typing import Any, Sequence

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from ._tree import tree_flatten_with_paths

__all__ = ["P", "specs", "placements_for", "check_spec", "match_specs"]

_Entry = "str | tuple[str, ...] | None"


class P(tuple):
    """A partition spec, as in JAX: one entry per tensor dim naming the mesh axis it is split over.

    Each entry is a mesh axis name, a tuple of axis names (the dim is split over all of them, the
    first major), or `None` (not split). Trailing dims without an entry are not split; `P()` is
    fully replicated. `P` is immutable and hashable.

    Example:
        >>> P("dp", None)
        P('dp', None)
    """

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
                    f"P entry {i} is {e!r}: each entry must be a mesh axis name, a tuple of names, or None"
                )
            for a in axes:
                if a in seen:
                    raise ValueError(f"mesh axis {a!r} appears twice in P{tuple(entries)!r}: a mesh axis splits one dim")
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
    """Raises a ValueError naming the leaf path, shape, spec and mesh axes if `spec` cannot apply."""
    axes = _mesh_axes(mesh)
    shape = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None

    def fail(why: str, fix: str) -> None:
        raise ValueError(
            f"spec {spec!r} for leaf {path!r} (shape {shape}) on mesh axes {axes}: {why}. {fix}"
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


def placements_for(spec: P, mesh: DeviceMesh) -> tuple[Placement, ...]:
    """DTensor placements (one per mesh dim) for a checked spec."""
    axes = _mesh_axes(mesh)
    out: list[Placement] = [Replicate() for _ in axes]
    for d in range(len(spec)):
        for a in spec.axes_of(d):
            out[axes.index(a)] = Shard(d)
    return tuple(out)


def _fit_default(default: P, leaf: torch.Tensor) -> P:
    # The default spec is a default, not a request: a leaf of lower rank than it keeps the entries that fit.
    return default if len(default) <= leaf.dim() else P(*tuple(default)[: leaf.dim()])


def specs(
    params: Any,
    mesh: DeviceMesh,
    rules: Sequence[tuple[str, P]] | None = None,
    default: P = P("dp"),
) -> Any:
    """Builds a pytree of `P` with the structure of `params`, from ordered regex rules.

    Each rule is `(regex, P)`; the regex is matched in full against the leaf's dotted path and the
    first matching rule wins. Leaves no rule matches get `default`; where `default` has more entries
    than the leaf has dims (a scalar under `P("dp")`), the entries that do not fit are dropped.

    Args:
        params: the parameter tree.
        mesh: the mesh whose axis names the specs use.
        rules: ordered `(regex, P)` pairs.
        default: the spec of leaves no rule matches.

    Returns:
        A tree of `P`, one per leaf of `params`.

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
    for path, leaf in zip(paths, leaves):
        for rx, spec in compiled:
            if rx.fullmatch(path):
                break
        else:
            spec = _fit_default(default, leaf) if isinstance(leaf, torch.Tensor) else default
        check_spec(path, leaf, spec, mesh)
        out.append(spec)
    return optree.tree_unflatten(treespec, out)


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

