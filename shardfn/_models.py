"""Functionalized models, and which one a parameter tree belongs to.

`sf.functionalize` registers the `ModelInfo` of every module it turns into a function (weakly: a
model nobody uses is forgotten). Whatever needs the model behind a tree (the train step's units,
`sf.value_and_grad`, per-example gradients, state-dict names, export and import, meta init in
`sf.shard`) asks `model_of`, the one place that decides it: `apply=` when given, else the live model
whose parameter names are the tree's, preferring the one that returned these very tensors.

A `ModelInfo` also carries the runtimes active on its model (Note [unit runtime] in `_runtime.py`).
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ._tree import tree_flatten_with_paths

__all__ = ["ModelInfo", "register", "candidates", "model_of", "unit_of_module"]


@dataclass(frozen=True)
class GraphRun:
    """What the model's hooks do while a step's graph is traced or run (Note [the step as one graph]
    in `_step_graph.py`).

    Attributes:
        cast: the compute dtype the inputs of `apply` and of every unit are cast to (mixed
            precision), or None.
        remat: the units whose forward runs under `torch.utils.checkpoint` in the graph.
    """

    cast: Any = None
    remat: frozenset = frozenset()


@dataclass(eq=False)
class ModelInfo:
    """What every `apply` of one functionalized module shares: names, ties, units."""

    module: nn.Module
    param_paths: list[str]  # canonical dotted names, module order
    aliases: dict[str, list[str]]  # canonical path -> every name it is used under (itself first)
    unit_names: list[str]  # unit submodule paths, module order
    unit_of: dict[str, int]  # canonical path -> unit index, -1 for the root unit
    buffer_paths: list[str] = field(default_factory=list)
    returned: dict[str, weakref.ref] = field(default_factory=dict)  # path -> the leaf functionalize returned
    meta_init: Any = None  # a meta-device module: its recorded construction (`_meta_init.Capture`)
    runtimes: list = field(default_factory=list)  # active runtimes, innermost last (`_runtime.activate`)
    slots: dict = field(default_factory=dict)  # dotted name -> (its module's path, its key in `_parameters`/`_buffers`)
    # buffers `init="empty"` could not compute (Note [buffers under init="empty"]): name -> (weakref, version)
    unset_buffers: dict = field(default_factory=dict)
    compiling: Any = None  # the compiled units of the step running now (Note [compiled units] in `_compiled.py`)
    whole_step: "GraphRun | None" = None  # a step's graph is being traced or run (Note [the step as one graph] in `_step_graph.py`)

    @property
    def runtime(self) -> Any:
        """The innermost runtime active on this model, or None (Note [unit runtime])."""
        return self.runtimes[-1] if self.runtimes else None

    def returned_tree(self, paths: Sequence[str], leaves: Sequence[Any]) -> bool:
        """Whether these leaves are the very tensors `functionalize` returned for this model."""
        return all(p in self.returned and self.returned[p]() is x for p, x in zip(paths, leaves))


def unit_of_module(owner: str, unit_names: Sequence[str]) -> int:
    """The index in `unit_names` of the innermost unit whose submodule is `owner` or holds it; -1
    for none (the root)."""
    best, best_len = -1, -1
    for i, u in enumerate(unit_names):
        if (owner == u or owner.startswith(u + ".")) and len(u) > best_len:
            best, best_len = i, len(u)
    return best


class _Registry:
    """The live functionalized models of this process, held weakly."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []

    def add(self, info: ModelInfo) -> None:
        self.prune()
        self.refs.append(weakref.ref(info))

    def prune(self) -> None:
        self.refs[:] = [r for r in self.refs if r() is not None]

    def live(self) -> list[ModelInfo]:
        return [i for i in (r() for r in self.refs) if i is not None]


REGISTRY = _Registry()


def register(info: ModelInfo) -> None:
    """Makes `info` findable by its parameter names (weakly held)."""
    REGISTRY.add(info)


def candidates(paths: Sequence[str], leaves: Sequence[Any] = ()) -> list[ModelInfo]:
    """The live functionalized models whose parameter names are exactly `paths`; when several
    have them, the one that returned these very `leaves` if there is one."""
    want = set(paths)

    def live() -> list[ModelInfo]:
        return [i for i in REGISTRY.live() if set(i.param_paths) == want]

    found = live()
    if len(found) > 1 and leaves:
        found = [i for i in found if i.returned_tree(paths, leaves)] or found
    if len(found) > 1:  # a model nobody uses may still wait for the cycle collector
        del found
        gc.collect()
        found = live()
    return found


def model_of(
    tree: Any = None,
    apply: Any = None,
    what: str = "this tree",
    *,
    flat: tuple[Sequence[str], Sequence[Any]] | None = None,
    module: nn.Module | None = None,
    where: Callable[[ModelInfo], bool] | None = None,
    alike: bool = True,
    reason: str | None = None,
    hint: str = "say which one it belongs to with apply=apply",
) -> ModelInfo | None:
    """The functionalized model a parameter tree belongs to, or None for a tree of no model.

    Args:
        tree: the parameter tree (or pass `flat=(paths, leaves)`, already flattened).
        apply: the `sf.functionalize` function the user named: its model, once checked against the
            tree's names.
        what: how messages name the tree.
        module: the model must be this module's (meta init's `init=`).
        where: only models for which this holds are considered (a checkpoint's: those with buffers).
        alike: several models with the tree's names are accepted when their state dicts would be
            alike (state-dict names); False refuses several (the units a step runs differ).
        reason, hint: what a refusal of several models says, and how to say which.

    Returns:
        The model's `ModelInfo`, or None.
    """
    paths, leaves = flat if flat is not None else tree_flatten_with_paths(tree)[:2]
    if apply is not None:
        info = getattr(apply, "info", None)
        if not isinstance(info, ModelInfo):
            raise ValueError(f"apply= takes the function sf.functionalize returned, got {type(apply).__name__}")
        if set(info.param_paths) != set(paths):
            missing = sorted(set(info.param_paths) - set(paths))
            extra = sorted(set(paths) - set(info.param_paths))
            raise ValueError(
                f"{what} does not match apply=: missing {missing[:5]}, unexpected {extra[:5]}; pass the tree "
                "sf.functionalize returned with that apply (or one with its structure, e.g. state.params)"
            )
        return info
    found = candidates(paths, leaves)
    if len(found) > 1:  # a model left in a reference cycle stays registered until the collector runs
        del found
        gc.collect()
        found = candidates(paths, leaves)
    if where is not None:
        found = [i for i in found if where(i)]
    if module is not None:
        found = [i for i in found if i.module is module]
        return found[0] if found else None
    if len(found) > 1 and (not alike or not all(_same_state_dict(found[0], other) for other in found[1:])):
        kinds = ", ".join(type(i.module).__name__ for i in found)
        if reason is None:
            reason = (
                " and differ in their tied names or buffers" if alike
                else ": a teacher, an EMA copy, ..., and these are not the tensors one of them returned"
            )
        raise ValueError(f"{len(found)} functionalized models have exactly the parameter names of {what} ({kinds}){reason}; {hint}")
    return found[0] if found else None


def persistent_buffers(info: ModelInfo) -> dict[str, torch.Tensor]:
    """The model's buffers that its state dict holds, by name, in module order."""
    buffers = dict(info.module.named_buffers(remove_duplicate=False))
    return {n: buffers[n] for n in info.module.state_dict(keep_vars=True) if n in buffers}


def _same_state_dict(a: ModelInfo, b: ModelInfo) -> bool:
    """Whether the two models name and fill a state dict alike (then it does not matter which)."""
    if a.aliases != b.aliases:
        return False
    ba, bb = persistent_buffers(a), persistent_buffers(b)
    if list(ba) != list(bb):
        return False
    for n, x in ba.items():
        y = bb[n]
        if x.is_meta or y.is_meta or x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y.to(x.device)):
            return False
    return True
