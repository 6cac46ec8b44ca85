"""The GradientTransformation type with its in-place fields (``update_``, ``step_``), and ``apply_updates``."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Protocol

import torch

from ._local import locals_, pair_leaves, wrap

__all__ = ["GradientTransformation", "EmptyState", "apply_updates"]

Params = Any
Updates = Any
OptState = Any


class TransformInitFn(Protocol):
    def __call__(self, params: Params) -> OptState: ...


class TransformUpdateFn(Protocol):
    def __call__(
        self, updates: Updates, state: OptState, params: Optional[Params] = None
    ) -> tuple[Updates, OptState]: ...


class GradientTransformation(NamedTuple):
    """A pair of pure functions, as in optax, and two optional in-place forms of ``update``.

    ``init(params) -> state`` builds the state (a pytree of NamedTuples of tensors);
    ``update(updates, state, params=None) -> (updates, new_state)`` transforms gradients into updates
    without mutating any input.

    The in-place forms are what a train step runs; a transformation built with only ``init`` and
    ``update`` (None for both) is run through ``update`` and ``apply_updates``:

    - ``update_(updates, state, params=None) -> (updates, new_state)``: ``update`` that may overwrite
      its ``updates`` and the state's tensors (``chain`` composes its parts' ``update_``).
    - ``step_(grads, state, params) -> state``: the whole optimizer step in place: it updates the
      local tensors of ``params``, may overwrite ``grads``, updates the state's tensors and returns
      the state (the same tensors). Every optimizer of this package has one (``sgd``, ``adam`` and
      ``adamw`` run torch's fused kernels there).

    Example:
        >>> opt = chain(scale_by_adam(), scale(-1e-3))
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
        >>> state = opt.step_(grads, state, params)   # or in place
    """

    init: TransformInitFn
    update: TransformUpdateFn
    update_: Optional[TransformUpdateFn] = None
    step_: Optional[Callable[[Updates, OptState, Params], OptState]] = None


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


class InPlace:
    """An in-place form (``update_`` or ``step_``) of one ``update``: it is used in place of
    `t.update` only while it is `t`'s own (`in_place`), so a transformation rebuilt with another
    ``update`` (``opt._replace(update=...)``) never runs the old one's in-place step."""

    __slots__ = ("fn", "of")

    def __init__(self, fn: Callable, of: Callable):
        self.fn, self.of = fn, of

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def in_place(t: Any, name: str) -> Optional[Callable]:
    """`t`'s in-place form `name` ("update_" or "step_") if it was made for `t.update`, else None."""
    f = getattr(t, name, None)
    return f if isinstance(f, InPlace) and f.of is getattr(t, "update", None) else None


def donating(t: GradientTransformation) -> Callable:
    """The update of `t` that may overwrite its updates and state: ``update_``, or ``update``."""
    return in_place(t, "update_") or t.update


def add_updates_(params: Params, updates: Updates) -> None:
    """``params += updates`` leafwise, in place on the local tensors (one foreach call)."""
    p_leaves, u_leaves, _ = pair_leaves(params, updates, "updates")  # a None update (a frozen leaf): unchanged
    if p_leaves:
        torch._foreach_add_(locals_(p_leaves), locals_(u_leaves))


def generic_step(update_: Callable) -> Callable:
    """``step_`` made of a donating update followed by an in-place add of the updates to the params."""

    @torch.no_grad()
    def step_(grads: Updates, state: OptState, params: Params) -> OptState:
        updates, state = update_(grads, state, params)
        add_updates_(params, updates)
        return state

    return step_


def transformation(
    init: Callable, update: Callable, update_: Optional[Callable] = None, step_: Optional[Callable] = None
) -> GradientTransformation:
    """A GradientTransformation with both in-place forms: `update_` (default: `update`) and
    `step_` (default: `update_` followed by an in-place add of the updates to the params).

    `update` and `update_` are run under ``torch.no_grad()``.
    """
    pure = torch.no_grad()(update)
    donate = torch.no_grad()(update_) if update_ is not None else pure
    step_ = step_ if step_ is not None else generic_step(donate)
    return GradientTransformation(init, pure, InPlace(donate, pure), InPlace(step_, pure))


@torch.no_grad()
def apply_updates(params: Params, updates: Updates) -> Params:
    """Returns ``params + updates`` leafwise, without mutating either.

    Each new leaf keeps the dtype (and, for DTensors, the mesh, placements, shape and stride) of its
    parameter, and its ``requires_grad`` flag.

    Args:
        params: a pytree of tensors or DTensors.
        updates: a pytree of the same structure, e.g. from ``opt.update``; a ``None`` update
            (a frozen leaf's) leaves its parameter as it is.

    Returns:
        The updated parameters, a new pytree.

    Example:
        >>> updates, state = opt.update(grads, state, params)
        >>> params = apply_updates(params, updates)
    """
    p_leaves, u_leaves, put = pair_leaves(params, updates, "updates (in apply_updates)")
    if not p_leaves:
        return params
    p_loc = locals_(p_leaves)
    outs = torch._foreach_add(p_loc, locals_(u_leaves))
    outs = [o if o.dtype == p.dtype else o.to(p.dtype) for o, p in zip(outs, p_loc)]
    return put([wrap(o, p, p.requires_grad) for o, p in zip(outs, p_leaves)])
