"""Donated state: a train step takes its input state's memory, and the old state says so loudly.

Note [donated state]
~~~~~~~~~~~~~~~~~~~~
`step(state, batch)` updates the parameters, gradients and optimizer state in place, in the step's
flat buffers, as JAX's donated buffers. The returned state wraps that memory in new DTensor
objects; the DTensors of the state passed in (and of `step.grads` before the step) are donated:
their local tensor becomes a placeholder on which every operation raises `DonatedError`, so an old
state can never show values that changed under the user's feet. Scalars of the optimizer state
(the step count) are copied before the update, so an old state keeps its own. To keep a state (a
rollback on NaN, an EMA, a comparison), copy it first: `kept = sf.copy(state)`; a copy passed back
to the step is copied into the step's buffers (and the state it replaces is donated).

Pickling: the step's DTensors are views into flat buffers, and torch cannot pickle a DTensor whose
local tensor starts inside its storage (the wrapper then looks like it owns data); the DTensors
made here pickle their local values instead, so a `TrainState`, its parameters and `step.grads`
pickle and `torch.save` as plain DTensors of the same mesh and placements.
"""

from __future__ import annotations

import weakref
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

__all__ = ["DonatedError", "adopt", "alias", "copy", "donate", "same_memory", "wrap"]


class DonatedError(RuntimeError):
    """A tensor of a state that was donated to a train step was read."""


class _Donated(torch.Tensor):
    """The local tensor of a donated DTensor: the same metadata, no data; every operation raises."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, message: str):
        r = torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device)
        r._message = message
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        flat = optree.tree_leaves((args, kwargs or {}))
        message = next((a._message for a in flat if isinstance(a, _Donated)), "this tensor was donated")
        raise DonatedError(message)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"<donated tensor: {self._message}>"

    def __reduce_ex__(self, protocol):  # type: ignore[override]
        raise DonatedError(self._message)


class _Reduce:
    """Pickles a DTensor made by `wrap` as `DTensor(local values, spec)`; held by the DTensor itself
    through a weak reference, so it makes no reference cycle."""

    __slots__ = ("ref",)

    def __init__(self, dt: DTensor):
        self.ref = weakref.ref(dt)

    def __call__(self, protocol: int):
        dt = self.ref()
        local = dt._local_tensor
        if isinstance(local, _Donated):
            raise DonatedError(local._message)
        return (_rebuild, (local.detach().clone(), dt._spec, dt.requires_grad))


def _rebuild(local: torch.Tensor, spec: Any, requires_grad: bool) -> DTensor:
    return wrap(local, spec, requires_grad)


def wrap(local: torch.Tensor, spec: Any, requires_grad: bool = False) -> DTensor:
    """A DTensor over `local` with `spec` (no checks, no communication) that pickles."""
    dt = DTensor(local, spec, requires_grad=requires_grad)
    dt.__reduce_ex__ = _Reduce(dt)
    return dt


def alias(view: torch.Tensor) -> torch.Tensor:
    """A tensor object of its own over `view`'s memory, to hand out: whatever a user does to it
    (even `set_`), the owner's own view keeps pointing at its buffer."""
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(
        view.untyped_storage(), view.storage_offset(), view.shape, view.stride()
    )


def same_memory(t: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether `t` holds exactly `view`'s memory."""
    return (
        t.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
        and t.storage_offset() == view.storage_offset()
        and t.shape == view.shape
        and t.stride() == view.stride()
    )


def adopt(dt: DTensor, view: torch.Tensor) -> None:
    """Points `dt`'s local tensor (the same object: local tensors a user took with `to_local()`
    follow) at `view`'s memory, a shard in a flat buffer; `dt` then pickles its values."""
    local = dt._local_tensor
    with torch.no_grad():
        local.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
    dt.__reduce_ex__ = _Reduce(dt)


def donate(dt: DTensor, message: str) -> DTensor:
    """A new DTensor over `dt`'s local tensor; `dt` itself is donated (reads raise `message`)."""
    new = wrap(dt._local_tensor, dt._spec, dt.requires_grad)
    dt._local_tensor = _Donated(dt._local_tensor, message)
    return new


def is_donated(x: Any) -> bool:
    return isinstance(x, DTensor) and isinstance(x._local_tensor, _Donated)


def copy(tree: Any) -> Any:
    """A copy of a state or tree that no train step owns: each DTensor's shards and each tensor cloned.

    A train step donates the state it is given (Note [donated state] in `shardfn/_donate.py`): to
    keep one (a rollback, an EMA, a comparison), copy it before the step. A copy can be passed to
    the step later; its values are copied into the step's buffers.

    Args:
        tree: a `TrainState`, a tree of DTensors (`state.params`, `step.grads`), or any tree.

    Returns:
        The same structure with every tensor copied (DTensors stay DTensors of the same mesh and
        placements); other leaves (ints, None) as they are.

    Example:
        >>> kept = sf.copy(state)
        >>> state, metrics = step(state, batch)
        >>> if not torch.isfinite(metrics["loss"]):
        ...     state = kept
    """

    def one(x: Any) -> Any:
        if isinstance(x, DTensor):
            if isinstance(x._local_tensor, _Donated):
                raise DonatedError(x._local_tensor._message)
            return wrap(x._local_tensor.detach().clone(), x._spec, x.requires_grad)
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        return x

    return optree.tree_map(one, tree, none_is_leaf=True)
