"""`apply_if_finite`: skip an update that holds a NaN or an infinity, as optax does, over shards too."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.distributed.tensor import DTensor

from .. import _collectives as C
from .._mesh import mesh_group
from ._base import GradientTransformation, OptState, Params, Updates, donating, generic_step, in_place, transformation
from ._local import flatten, locals_, new_count, zeros_like

__all__ = ["apply_if_finite", "ApplyIfFiniteState"]


class ApplyIfFiniteState(NamedTuple):
    """State of `apply_if_finite` (optax's fields).

    Attributes:
        notfinite_count: non-finite updates in a row, up to now (0 after a finite one).
        last_finite: whether the last update was finite (a 0-d bool tensor).
        total_notfinite: non-finite updates seen in all.
        inner_state: the inner transformation's state (unchanged by a skipped update).
    """

    notfinite_count: torch.Tensor
    last_finite: torch.Tensor
    total_notfinite: torch.Tensor
    inner_state: OptState


def all_finite(tree: Any) -> bool:
    """Whether every element of every leaf of `tree` is finite, agreed by every rank: on a sharded
    tree, each rank's count of non-finite elements in its shards goes through one all-reduce over
    the ranks of the leaves' mesh (watched and counted), so that all ranks skip or apply alike.
    A host read of one number (a device sync on GPUs)."""
    leaves, _ = flatten(tree)
    if not leaves:
        return True
    device = locals_(leaves)[0].device
    locs = [x for x in locals_(leaves) if x.numel()]
    bad = torch.stack([(~torch.isfinite(x)).any().to(device) for x in locs]).sum().float() if locs else torch.zeros((), device=device)
    meshes = [x.device_mesh for x in leaves if isinstance(x, DTensor)]
    if meshes and meshes[0].size() > 1:
        C.all_reduce_blocking(bad.reshape(1), mesh_group(meshes[0]), "sf.optim.apply_if_finite (the finiteness check)")
    return bool(bad.item() == 0)


def apply_if_finite(inner: GradientTransformation, max_consecutive_errors: int) -> GradientTransformation:
    """Applies `inner` only where the incoming updates are all finite, as optax's `apply_if_finite`.

    An update holding a NaN or an infinity anywhere (on any rank's shard: every rank agrees, one
    all-reduce) is skipped: the updates returned are zeros (in a train step: the parameters are
    left as they were) and the inner state stays as it was (no moment, momentum or step count
    moves). After `max_consecutive_errors` skipped updates in a row, the next non-finite one is
    applied (as optax does), so a run that keeps diverging shows it in its parameters. The counts
    are in the state.

    Each update reads one number back from the device (the agreed finiteness), a sync on GPUs.

    Args:
        inner: the transformation to guard (e.g. `sf.optim.adamw(1e-3)`).
        max_consecutive_errors: how many non-finite updates in a row are skipped, > 0.

    Returns:
        A GradientTransformation with state `ApplyIfFiniteState`; its `step_` runs the inner one's
        (fused kernels included) when the update is applied.

    Example:
        >>> opt = sf.optim.apply_if_finite(sf.optim.adamw(1e-3), max_consecutive_errors=5)
        >>> step = sf.train_step(loss_fn, opt, mesh)
        >>> state, metrics = step(state, batch)      # a NaN loss leaves the parameters as they were
        >>> int(state.opt_state.total_notfinite)     # steps skipped so far
    """
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise ValueError(f"apply_if_finite takes a GradientTransformation, got {inner!r}")
    if isinstance(max_consecutive_errors, bool) or not isinstance(max_consecutive_errors, int) or max_consecutive_errors < 1:
        raise ValueError(f"max_consecutive_errors must be a positive int (non-finite updates skipped in a row), got {max_consecutive_errors!r}")

    def init(params: Params) -> ApplyIfFiniteState:
        return ApplyIfFiniteState(new_count(), torch.ones((), dtype=torch.bool), new_count(), inner.init(params))

    def decide(updates: Updates, state: Any) -> tuple[bool, bool]:
        """(finite, apply) for these updates."""
        if not isinstance(state, ApplyIfFiniteState):
            raise ValueError(f"apply_if_finite expects an ApplyIfFiniteState, got {type(state).__name__}")
        finite = all_finite(updates)
        return finite, finite or int(state.notfinite_count) + 1 > max_consecutive_errors

    def counted(state: ApplyIfFiniteState, finite: bool, inner_state: OptState, inplace: bool) -> ApplyIfFiniteState:
        if inplace:  # the state's scalars in place, as the other transformations' counts
            if finite:
                state.notfinite_count.zero_()
            else:
                state.notfinite_count.add_(1)
                state.total_notfinite.add_(1)
            state.last_finite.fill_(finite)
            return state._replace(inner_state=inner_state)
        return ApplyIfFiniteState(
            torch.zeros_like(state.notfinite_count) if finite else state.notfinite_count + 1,
            torch.tensor(finite),
            state.total_notfinite + (0 if finite else 1),
            inner_state,
        )

    def make(inplace: bool) -> Callable:
        fn = donating(inner) if inplace else inner.update

        def update(updates: Updates, state: ApplyIfFiniteState, params: Optional[Params] = None):
            finite, apply = decide(updates, state)
            if apply:
                updates, inner_state = fn(updates, state.inner_state, params)
            else:
                updates, inner_state = zeros_like(updates), state.inner_state
            return updates, counted(state, finite, inner_state, inplace)

        return update

    inner_step = in_place(inner, "step_") or generic_step(donating(inner))

    @torch.no_grad()
    def step_(grads: Updates, state: ApplyIfFiniteState, params: Params) -> ApplyIfFiniteState:
        finite, apply = decide(grads, state)
        inner_state = inner_step(grads, state.inner_state, params) if apply else state.inner_state
        return counted(state, finite, inner_state, True)

    return transformation(init, make(False), make(True), step_)
