"""The trees a gradient core computes from and hands out: its parameters and gradients as DTensors
over its flat buffers, taken in (`adopt`) and handed out (`publish`) in one place.

Note [the held tree]
~~~~~~~~~~~~~~~~~~~~
A core computes from one tree of DTensors whose local tensors are views of its flat buffers, and
hands out the gradients it reduced as DTensors over its gradient buffers. Both change hands: a
train step takes a state in (its own, or a copy, or an unpickled one) and returns new DTensors over
the same memory, the old ones donated (Note [donated state] in `_donate.py`); `sf.value_and_grad`
takes the user's tree in and keeps it as the core's, so the user's DTensors stay the live ones, and
donates the gradients it handed out before. `HeldTree` is the one place that does either: the
values of a tree passed in are copied into the buffers where they are not already there, and the
DTensors they replace are donated.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

from . import _donate

__all__ = ["HeldTree"]


class HeldTree:
    """The core's parameter DTensors (`params`, one per leaf, over `views`: this rank's shard of
    each leaf inside the flat buffers) and its gradient tree (`grads`, None at frozen leaves)."""

    def __init__(self, treespec: Any, params: list[DTensor], views: list[torch.Tensor], grads: list):
        self.treespec = treespec
        self.params = params
        self.views = views
        self.grads = optree.tree_unflatten(treespec, grads)

    def tree(self) -> Any:
        """The parameter tree the core computes from."""
        return optree.tree_unflatten(self.treespec, self.params)

    def holds(self, leaves: list) -> bool:
        """Whether `leaves` are the held DTensors themselves, over the buffers."""
        return len(leaves) == len(self.params) and all(
            a is b and _donate.same_memory(a._local_tensor, v) for a, b, v in zip(leaves, self.params, self.views)
        )

    def take(self, leaves: list[DTensor]) -> None:
        """Holds `leaves`, whose local tensors already are the buffers' views (nothing copied or donated)."""
        self.params = list(leaves)

    def adopt(self, leaves: list[DTensor], replaced: str | None, *, rebind: bool) -> None:
        """The core computes from the values of `leaves` from now on: each is copied into the buffers
        unless its memory already is theirs. `rebind=True` makes `leaves` themselves the held
        DTensors (their local tensors become views of the buffers; a held DTensor a leaf replaces is
        donated with `replaced`); `rebind=False` holds new DTensors over the buffers and donates every
        held one over them."""
        with torch.no_grad():
            for i, (x, v) in enumerate(zip(leaves, self.views)):
                if _donate.same_memory(x._local_tensor, v):
                    continue
                v.copy_(x._local_tensor)
                before = self.params[i]
                if rebind:
                    if replaced is not None and before is not x and _donate.same_memory(before._local_tensor, v):
                        _donate.donate(before, replaced)
                    _donate.adopt(x, v)
        if rebind:
            self.params = list(leaves)
            return
        if replaced is not None:
            for p, v in zip(self.params, self.views):
                if _donate.same_memory(p._local_tensor, v):
                    _donate.donate(p, replaced)
        self.params = [_donate.wrap(_donate.alias(v), p._spec) for p, v in zip(self.params, self.views)]

    def publish(self, donation: _donate.Donation, memo: dict, kept_params: list, kept_grads: list) -> Any:
        """New DTensors over the buffers for the parameters and gradients handed out; the ones handed
        out before are donated (`donation`). Returns the parameter tree (the gradients: `grads`)."""
        self.params = donation.many(self.params, memo, kept_params)
        self.publish_grads(donation, memo, kept_grads)
        return self.tree()

    def publish_grads(self, donation: _donate.Donation, memo: dict, kept: list) -> Any:
        """New DTensors over the gradient buffers, the ones handed out before donated; returns them."""
        leaves, spec = optree.tree_flatten(self.grads, none_is_leaf=True)
        self.grads = optree.tree_unflatten(spec, donation.many(leaves, memo, kept))
        return self.grads
