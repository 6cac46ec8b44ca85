"""What `loss_fn` and the model compute on in a train step: the parameter tree handed to
`loss_fn`, the module attributes each unit's forward swaps in, and reads outside `apply` (Note
[parameters outside apply] in `_param.py`)."""

from __future__ import annotations

from typing import Any

import optree
import torch

from ._models import unit_of_module
from ._param import Detour, Param
from ._recompute import UnitViews
from ._schedule import ROOT, Phase, Schedule
from ._unit_buffers import UnitBuffers

__all__ = ["ParamView"]


class ParamView:
    """The engine's parameters as the model and `loss_fn` see them.

    Args:
        info: the functionalized model (None: a plain function, root only).
        buffers: the engine's units.
        groups: for each engine unit, the model's units it holds (Note [unit groups] in `_engine.py`).
        member_names: the model's units' names.
        schedule: the step's schedule (where the step is now).
    """

    def __init__(self, info: Any, buffers: UnitBuffers, groups: list[list[int]], member_names: list[str], schedule: Schedule):
        self.info = info
        self.buffers = buffers
        self.groups = groups
        self.grouped = {g for g, ms in enumerate(groups) if len(ms) > 1}
        self.member_names = member_names
        self._schedule = schedule
        self.tp: Any = None  # the tensor-parallel forward (`_tp.TensorParallel`), set by the core
        self._where: list[tuple[int, int]] = []
        self.views: UnitViews | None = None
        self.reset()

    def reset(self) -> None:
        """A new step: no reads made, no tensor-parallel views."""
        self._reads: dict[tuple[int, int], torch.Tensor] = {}
        self._tp_views: dict[int, list[torch.Tensor]] = {}

    def set_tree(self, treespec: Any, paths: list[str], where: list[tuple[int, int]]) -> None:
        """The parameter tree's structure, its leaves' paths, and (unit, index) of each leaf."""
        self._treespec, self._paths, self._where = treespec, list(paths), list(where)
        self.make_trees()

    def make_trees(self) -> None:
        """(Re)builds the trees over the units' current proxies (after every bind)."""
        if not self._where:
            return
        self._leaf_of = {w: i for i, w in enumerate(self._where)}
        unit = self.buffers.unit
        proxies = [unit(u).proxies[j] for u, j in self._where]
        params = [Param.make(self._stand_in(p, w), self._read_param, w) for p, w in zip(proxies, self._where)]
        self.user_tree = optree.tree_unflatten(self._treespec, params)
        # What the module computes on: root leaves in place (gathered for the whole step), unit
        # leaves as Params until their unit's forward swaps its full parameters in.
        self._in_apply = optree.tree_unflatten(self._treespec, [p if u == ROOT else q for p, q, (u, _) in zip(proxies, params, self._where)])
        self._params_of: dict[int, dict[int, Param]] = {}
        for q, (u, j) in zip(params, self._where):
            self._params_of.setdefault(u, {})[j] = q
        self._flat = None  # {every parameter name: tensor}, built on the first `apply`
        # What each unit's recompute computes on (Note [the model's own checkpointing] in `_recompute.py`).
        self.views = UnitViews(self.info) if self.info is not None else None
        # (unit, the model's unit whose module holds the attribute, or None) -> (submodule, attribute, leaf)
        self._swaps: dict[tuple[int, int | None], list[tuple[Any, str, int]]] = {}
        if self.info is not None:
            module = self.info.module
            for path, (u, j) in zip(self._paths, self._where):
                if u == ROOT:
                    continue
                for name in self.info.aliases[path]:
                    owner, _, attr = name.rpartition(".")
                    self._swaps.setdefault((u, self._member_of_module(u, owner)), []).append((module.get_submodule(owner), attr, j))

    def _member_of_module(self, u: int, owner: str) -> int | None:
        """Which of group `u`'s units holds submodule `owner` (None: none of them, or one unit alone)."""
        if u not in self.grouped:
            return None
        members = self.groups[u]
        i = unit_of_module(owner, [self.member_names[m] for m in members])
        return members[i] if i >= 0 else None

    def swap_in(self, u: int, full: bool, m: int | None = None) -> None:
        """Unit `u`'s module attributes (of its member `m` only, in a group): its full parameters
        (its forward runs), or its Params (Note [parameters outside apply] in `_param.py`)."""
        swaps = self._swaps.get((u, None), [])
        if m is not None and u in self.grouped:
            swaps = swaps + self._swaps.get((u, m), [])
        if not swaps:
            return  # the root, or a unit without parameters
        proxies, params = self.full_of(u), self._params_of[u]
        new, old = (proxies, params) if full else (params, proxies)
        for mod, attr, j in swaps:
            # Only where `apply` was given this step's own parameter: a tensor the user derived
            # from it (scaled, noised, a delta added) is what the module must compute on.
            if mod._parameters.get(attr) is old[j]:
                mod._parameters[attr] = new[j]

    def full_of(self, u: int) -> list[torch.Tensor]:
        """What unit `u`'s modules compute on: its full parameters, or with tensor parallel DTensors
        over them on the tp mesh (made once per step; Note [tensor parallel forward] in `_tp.py`)."""
        proxies = self.buffers.unit(u).proxies
        if self.tp is None:
            return proxies
        out = self._tp_views.get(u)
        if out is None:
            out = self._tp_views[u] = [self.tp.leaf(self._leaf_of[(u, j)], p) for j, p in enumerate(proxies)]
        return out

    def _stand_in(self, proxy: torch.Tensor, where: tuple[int, int]) -> torch.Tensor:
        """What a `Param` looks like: its full parameter, or with tensor parallel a tensor of the
        leaf's global shape (no memory: an expanded scalar), as `loss_fn` expects."""
        if self.tp is None:
            return proxy
        shape = self.tp.shapes[self._leaf_of[where]]
        return proxy.new_zeros(()).expand(shape).requires_grad_(proxy.requires_grad) if shape != proxy.shape else proxy

    def tp_trees(self) -> None:
        """Tensor parallel: the root's leaves as DTensors over its gathered shards, for this step."""
        if self.tp is None:
            return
        root = self.full_of(ROOT)
        leaves = optree.tree_leaves(self._in_apply)
        self._in_apply = optree.tree_unflatten(
            self._treespec, [root[j] if u == ROOT else x for x, (u, j) in zip(leaves, self._where)]
        )
        self._flat = None

    def _read_param(self, p: Param) -> torch.Tensor:
        return self.read(*p.where)

    def _owns(self, x: Any) -> bool:
        return isinstance(x, Param) and x.reader() == self._read_param

    def flat_params(self, apply: Any, params: Any) -> dict[str, torch.Tensor] | None:
        """What `apply(params, ...)` computes on, when `params` holds this step's parameters."""
        if params is self.user_tree:
            mapped = self._in_apply
        else:
            leaves, spec = optree.tree_flatten(params)
            if not any(self._owns(x) for x in leaves):
                if self.views is not None:
                    self.views.record_root(None)  # `apply` on a tree of its own: the root's view is unknown
                return None
            mapped = optree.tree_unflatten(
                spec, [self.full_of(ROOT)[x.where[1]] if self._owns(x) and x.where[0] == ROOT else x for x in leaves]
            )
        if apply.info is not self.info:
            theirs = type(apply.info.module).__name__
            ours = type(self.info.module).__name__ if self.info is not None else "a plain function"
            raise ValueError(
                f"loss_fn applied a model ({theirs}) to the train step's parameters, but the step was built for "
                f"{ours}: pass the apply that loss_fn calls, sf.train_step(..., apply=apply). If the step's "
                "tree holds the parameters of several models (a student and a teacher), train one model's tree "
                "and shard the other's on its own (sf.shard), reading it inside loss_fn"
            )
        if mapped is self._in_apply:
            if self._flat is None:
                self._flat = apply.flat_params(mapped)
            flat = self._flat
        else:
            flat = apply.flat_params(mapped)
        if self.views is not None:
            self.views.record_root(flat)
        return flat

    def read(self, u: int, j: int) -> torch.Tensor:
        """The full value of leaf `j` of unit `u`, for a read outside `apply` (Note [parameters
        outside apply] in `_param.py`)."""
        if self._schedule.phase == Phase.IDLE:
            raise RuntimeError(
                "a parameter handed to loss_fn was used after its step (or outside a step): it is valid "
                "only inside loss_fn; return values computed from it instead"
            )
        unit = self.buffers.unit(u)
        proxy = unit.proxies[j]
        if u == ROOT:
            return self.full_of(ROOT)[j]  # gathered for the whole step
        out = self._reads.get((u, j))
        # A copy made under no_grad carries no gradient: never hand it to a use that needs one.
        if out is None or (torch.is_grad_enabled() and proxy.requires_grad and not out.requires_grad):
            out = Detour.apply(proxy, lambda: unit.gather_leaf(j))
            if self.tp is not None:
                out = self.tp.leaf(self._leaf_of[(u, j)], out)
            self._reads[(u, j)] = out
        return out
