"""Combinators: `chain` and `masked`."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import optree

from ._base import GradientTransformation, OptState, Params, Updates, donating, transformation
from ._local import flatten

__all__ = ["chain", "masked", "MaskedState", "PartlyUpdatedError"]

Mask = Union[Any, Callable[[Params], Any]]


class PartlyUpdatedError(RuntimeError):
    """A chain's in-place update (`update_`, `step_`) whose part `part` raised after the parts
    before it had written their state in place: that state is partly this step's, and the caller's
    optimizer state can no longer be trusted (a train step invalidates it)."""

    def __init__(self, part: int, parts: int, cause: BaseException):
        self.part = part
        super().__init__(
            f"sf.optim.chain: part {part} (of parts 0..{parts - 1}) raised ({type(cause).__name__}: {cause}) after "
            f"{'part 0' if part == 1 else f'parts 0..{part - 1}'} had written its state in place (moments, momentum): "
            "the optimizer state given to this "
            "update is partly updated and cannot be trusted. Restore it from a copy taken before (sf.copy) or a "
            "checkpoint, or use the out-of-place update, which leaves its input as it was"
        )


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies transformations one after the other; the state is the tuple of their states.

    Args:
        *transforms: GradientTransformations, applied left to right.

    Returns:
        A GradientTransformation whose ``update_`` runs every part's ``update_`` (or ``update``) in
        turn, and whose ``step_`` runs that and adds the updates to the params in place.

    Example:
        >>> opt = chain(clip_by_global_norm(1.0), scale_by_adam(), scale_by_learning_rate(1e-3))
    """
    for t in transforms:
        if not (callable(getattr(t, "init", None)) and callable(getattr(t, "update", None))):
            raise ValueError(f"chain takes GradientTransformations, got {t!r}")

    def init(params: Params) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def make(inplace: bool):
        fns = [donating(t) if inplace else t.update for t in transforms]

        def update(updates: Updates, state: OptState, params: Optional[Params] = None):
            if not isinstance(state, tuple) or len(state) != len(fns):
                raise ValueError(
                    f"chain of {len(fns)} transformations expects a tuple of {len(fns)} states, "
                    f"got {type(state).__name__} of length {len(state) if isinstance(state, tuple) else '-'}"
                )
            new_state = []
            for i, (fn, s) in enumerate(zip(fns, state)):
                try:
                    updates, s = fn(updates, s, params)
                except Exception as e:
                    if inplace and i > 0:
                        raise PartlyUpdatedError(i, len(fns), e) from e
                    raise
                new_state.append(s)
            return updates, tuple(new_state)

        return update

    return transformation(init, make(False), make(True))


class MaskedState(NamedTuple):
    """State of `masked`: the inner state, built on the selected leaves only."""

    inner_state: OptState


def resolve_mask(mask: Mask, tree: Any) -> list[bool]:
    """The mask as one bool per leaf of `tree` (`mask` is a pytree like `tree`, or ``tree -> pytree``)."""
    m = mask(tree) if callable(mask) else mask
    _, spec = flatten(tree)
    try:
        flags = spec.flatten_up_to(m)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the mask must have the structure of the params ({spec}): {e}") from None
    for f in flags:
        if not isinstance(f, bool):
            raise ValueError(f"mask leaves must be bools, got {f!r}")
    return flags


def _select(tree: Any, flags: list[bool]) -> Any:
    leaves, spec = flatten(tree)
    return optree.tree_unflatten(spec, [x if f else None for x, f in zip(leaves, flags)])


def masked(inner: GradientTransformation, mask: Mask) -> GradientTransformation:
    """Applies `inner` to the leaves where `mask` is True; the others pass through unchanged.

    Masked-out leaves get no state (they are ``None``, an empty subtree, in the inner state).
    Their updates pass through as they came, as in optax: used as the whole optimizer
    (``masked(adamw(...), mask)`` alone), a masked-out leaf's update is its raw gradient, and
    ``apply_updates`` adds it (a step up the gradient, at rate 1). To train some leaves only, keep
    the others out of training (``sf.train_step(..., frozen=...)``), or chain ``masked`` between
    transforms that scale every leaf, as in the example.

    Args:
        inner: the transformation to apply.
        mask: a pytree of bools with the structure of the params, or a function ``params -> mask``
            (called on the params, or on the updates when no params are given; optax's ``masked``
            calls it on the updates in ``update``).

    Returns:
        A GradientTransformation with state `MaskedState`.

    Example:
        >>> no_bias = lambda p: optree.tree_map(lambda x: x.ndim > 1, p)
        >>> opt = chain(scale_by_adam(), masked(add_decayed_weights(0.1), no_bias), scale_by_learning_rate(1e-3))
    """

    def init(params: Params) -> MaskedState:
        return MaskedState(inner.init(_select(params, resolve_mask(mask, params))))

    def make(inplace: bool):
        fn = donating(inner) if inplace else inner.update

        def update(updates: Updates, state: MaskedState, params: Optional[Params] = None):
            if not isinstance(state, MaskedState):
                raise ValueError(f"masked expects a MaskedState, got {type(state).__name__}")
            flags = resolve_mask(mask, params if params is not None else updates)
            leaves, spec = flatten(updates)
            if len(flags) != len(leaves):
                # None updates (a frozen leaf's, from sf.value_and_grad) where the mask is False.
                leaves, spec = optree.tree_flatten(updates, none_is_leaf=True)
                if len(flags) != len(leaves):
                    raise ValueError("the mask does not match the structure of the updates")
                missing = [i for i, (x, f) in enumerate(zip(leaves, flags)) if x is None and f]
                if missing:
                    raise ValueError(
                        f"the updates are None at leaves {missing[:5]} (in leaf order) where the mask is True: mask "
                        "out the leaves that get no gradient (frozen ones), e.g. mask = optree.tree_map(lambda g: "
                        "g is not None, grads, none_is_leaf=True)"
                    )
            sub_params = None if params is None else _select(params, flags)
            sub, inner_state = fn(optree.tree_unflatten(spec, [x if f else None for x, f in zip(leaves, flags)]), state.inner_state, sub_params)
            it = iter(flatten(sub)[0])
            out = [next(it) if f else x for x, f in zip(leaves, flags)]
            return optree.tree_unflatten(spec, out), MaskedState(inner_state)

        return update

    return transformation(init, make(False), make(True))
