"""The model's own activation checkpointing inside a train step: what a recompute computes on.

Note [the model's own checkpointing]
------------------------------------
A model may checkpoint its activations itself: Hugging Face's `gradient_checkpointing_enable()`
(which checkpoints each decoder layer's `forward`, inside the module's `__call__`, so that module
hooks stay outside the checkpoint), or code that calls `torch.utils.checkpoint.checkpoint(block, h)`
(the hooks of `block` then run inside the checkpoint, in the forward and again in the recompute),
non-reentrant (saved-tensor hooks: the recompute runs when the backward first unpacks a tensor
the region saved) or reentrant (an autograd Function under no_grad in the forward, whose backward
reruns the forward with grad on and backpropagates through it). Either way the recompute runs in
the backward, long after `apply` returned, and reads the module's attributes as they are then:
outside `apply` the module holds meta tensors (`sf.functionalize`, `_functional.py`), and a
unit's full parameters exist only while it is gathered.

So a unit's forward records, per use, what its modules' parameter attributes hold while it runs
(its full parameters, the root's for leaves tied across units, or tensors `loss_fn` derived from
the parameters and handed to `apply`), and the same tensors are put back before its recompute:

- by the unit's pre-backward (the first gradient reaching its outputs), for the view of that use.
  It fires before anything of the unit's backward runs, so before a non-reentrant recompute and
  before a reentrant checkpoint's backward, wherever the checkpoint sits (inside the unit's
  forward, or around the unit's call); the pre-backward gathers the unit, and it stays gathered
  until that use's backward is over (Note [unit schedule] in `_engine.py`), so the recompute reads
  it gathered, in its slot (Note [slot arenas] in `_flat.py`), with autograd's stale-parameter
  check as for any read (Note [stale parameters]).
- by the unit's own forward hook, run by the recompute, when no pre-backward came before it: a
  reentrant checkpoint around the unit's call ran the unit's forward under no_grad, so no hook saw
  its outputs. The hook gathers the unit (as it gathers any unit run in the backward), which stays
  gathered until its gradients are complete and reduced, and starts gathering the unit before it,
  as a pre-backward would (prefetch); the view is the one its forward recorded.
  A unit that ran on several different views in the step (a model applied to two trees) cannot
  say which one this recompute is for: refused. (A non-reentrant checkpoint around the call runs
  the hook too, after the pre-backward: the view stays that use's.)
- shardfn's own remat (`remat=`) inside such a checkpoint runs in the recompute as in the forward
  (`_remat.py`): a non-reentrant checkpoint checks that the recompute saves what the forward saved.
- the root's attributes (embeddings, a final norm: a recompute of a region outside every unit)
  are put back as the forward ends, from the one `apply` call of the step, and only if there was
  one; the root is gathered for the whole step.

Everything put back is restored (to the module's meta tensors) when the step ends or fails, where
it still holds what was put there (a user's checkpoint of the whole `apply` reruns `apply` in the
backward, which sets and restores the attributes itself). In a
group of units (Note [unit groups]) each member keeps its own views; the group is gathered while
any member's backward runs. The module's buffers are not touched: a recompute reads them as they
are at that time, as a single process does. The cost when nothing recomputes: one tuple of a
unit's parameter attributes per forward, and putting them back per backward (about 0.2 ms a step
for 32 units of 12 parameters). `sf.estimate_memory`'s meta run does the same (`_estimate._Probe`),
so that a reentrant recompute's gradients reach the leaves it counts, and starts the backward of a
unit whose forward no hook saw in its recompute, where the engine gathers it. It does not count
the random-number state a checkpoint keeps per call (5 KB on the CPU).

Not supported: a recompute in a step off the unit schedule (a backward inside `loss_fn`, Note
[steps off the unit schedule] in `_core.py`), whose `apply` ran on the gathered tree with no
runtime to record it: the step refuses it with the fix; a recompute after `apply` called outside
any step (`apply(params, x).backward()`), which reads the module's meta tensors and fails in torch
("expected device meta"); non-reentrant checkpointing under a torch.func gradient transform, which
torch itself refuses ("don't yet support saved tensor hooks").
"""

from __future__ import annotations

from typing import Any

import torch

from ._models import unit_of_module

__all__ = ["UnitViews"]

ROOT = -1
View = tuple  # what a unit's parameter attributes held in one forward, in `UnitViews` slot order


class UnitViews:
    """Per unit of one model (its own numbering, ROOT for the root), the parameter attributes its
    recompute reads, and what each forward put in them (Note [the model's own checkpointing])."""

    def __init__(self, info: Any):
        self._slots: dict[int, list[tuple[dict, str]]] = {}
        self._names: dict[int, list[str]] = {}
        module = info.module
        for path in info.param_paths:
            for name in info.aliases[path]:
                owner, _, attr = name.rpartition(".")
                m = unit_of_module(owner, info.unit_names)
                self._slots.setdefault(m, []).append((module.get_submodule(owner)._parameters, attr))
                self._names.setdefault(m, []).append(name)
        self._root_names = self._names.get(ROOT, [])
        self.reset()

    def reset(self) -> None:
        """Forgets the step's views (after `restore`, or before a step)."""
        self._saved: dict[tuple[int, str], tuple[dict, str, Any, Any]] = {}  # slot -> (.., what it held, what we put)
        self._views: dict[int, list[View]] = {}  # unit -> the distinct views its forwards recorded
        self._by_hook: set[int] = set()  # units whose view a pre-backward put back

    def record(self, m: int) -> View | None:
        """What unit `m`'s parameter attributes hold now, inside its forward."""
        slots = self._slots.get(m)
        if not slots:
            return None
        view = tuple(d.get(k) for d, k in slots)
        self._remember(m, view)
        return view

    def record_root(self, flat: dict[str, torch.Tensor] | None) -> None:
        """What `apply` puts in the root's attributes (`flat`: name -> tensor; None: not known, a
        tree of the caller's own)."""
        if self._root_names:
            self._remember(ROOT, (object(),) if flat is None else tuple(flat.get(n) for n in self._root_names))

    def _remember(self, m: int, view: View) -> None:
        seen = self._views.setdefault(m, [])
        if not any(_same(view, v) for v in seen):
            seen.append(view)

    def put_back(self, m: int, view: View | None, by_hook: bool = True) -> None:
        """Puts `view` (recorded for unit `m`) back in its attributes, for a recompute."""
        if view is None:
            return
        saved = self._saved
        for (d, k), t in zip(self._slots[m], view):
            now = d.get(k)
            had = saved.get((id(d), k))
            # What it held before: unless it holds what we put, what is there now (an `apply` that ran
            # in between, the user's checkpoint of `apply` recomputing it, restored its own).
            saved[(id(d), k)] = (d, k, had[2] if had is not None and now is had[3] else now, t)
            d[k] = t
        if by_hook:
            self._by_hook.add(m)

    def for_recompute(self, m: int, name: str) -> None:
        """A hook of unit `m` runs in the backward: unless a pre-backward put its view back, the
        one view its forwards recorded (refused if they recorded several)."""
        if m in self._by_hook:
            return
        views = self._views.get(m, [])
        if len(views) > 1:
            raise NotImplementedError(
                f"unit {name!r} is recomputed in the backward by a reentrant checkpoint around its call "
                f"(torch.utils.checkpoint(..., use_reentrant=True)), and it ran on {len(views)} different "
                "parameter trees in this step's forward: shardfn cannot tell which one this recompute is for. "
                "Use use_reentrant=False, or apply the model to one tree per step"
            )
        if views:
            self.put_back(m, views[0], by_hook=False)

    def put_back_root(self) -> None:
        """The forward is over: the root's attributes hold what the step's `apply` computed on, if
        it was called on one tree (several: they keep the module's own, and a recompute outside
        every unit is refused by the step)."""
        views = self._views.get(ROOT, [])
        if len(views) == 1:
            self.put_back(ROOT, views[0], by_hook=False)

    def restore(self) -> None:
        """The step is over (or failed): every attribute holds what it held before it."""
        for d, k, before, ours in self._saved.values():
            if d.get(k) is ours:  # else whoever put it there restored it already
                d[k] = before
        self.reset()


def _same(a: View, b: View) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
