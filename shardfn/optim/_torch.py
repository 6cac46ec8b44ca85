"""`from_torch`: any ``torch.optim.Optimizer`` class as a pure GradientTransformation."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from ._base import GradientTransformation, OptState, Params, Updates, transformation
from ._local import bump, clone, flatten, flatten_as, local, locals_, new_count, unflatten, wrap

__all__ = ["from_torch", "TorchOptimizerState"]


class TorchOptimizerState(NamedTuple):
    """State of `from_torch`: steps taken, and per leaf the torch optimizer's state dict.

    `per_leaf` has the structure of the params with a dict in place of each leaf; the dicts are
    empty until the first update (torch optimizers create their state lazily). Tensors shaped like the
    leaf's local tensor are stored as DTensors like the leaf.
    """

    count: torch.Tensor
    per_leaf: Any


# Optimizers whose step reads more of a tensor than each element (Adafactor's row and column
# moments and its relative step from the parameter's norm, Muon's orthogonalized matrix,
# SparseAdam's sparse rows): run on a rank's shard, each computes on part of the tensor as if it
# were the whole, without a word. Refused on leaves split over ranks; exact on whole ones.
_MIXING = tuple(getattr(torch.optim, n) for n in ("Adafactor", "Muon", "SparseAdam") if hasattr(torch.optim, n))
_NEEDS_A_CLOSURE = tuple(getattr(torch.optim, n) for n in ("LBFGS",) if hasattr(torch.optim, n))


def _refuse_on_shards(optimizer_class: type, leaves: list, local: list, spec: Any) -> None:
    split = [i for i, (x, l) in enumerate(zip(leaves, local)) if l.numel() != x.numel()]
    if split:
        raise NotImplementedError(
            f"from_torch({optimizer_class.__name__}) on leaves split over ranks ({len(split)} of {len(leaves)}): its step "
            "reads whole tensors (factored moments, norms, orthogonalization), and each rank would step its shard as "
            "if it were the whole tensor. Use an elementwise optimizer (sf.optim.adamw, from_torch(torch.optim.AdamW, "
            "...)), or keep these leaves whole (strategy='no_shard')"
        )


def from_torch(optimizer_class: type, **kwargs: Any) -> GradientTransformation:
    """Wraps a ``torch.optim.Optimizer`` class functionally.

    Each update builds the optimizer over the local tensors of the params
    (``optimizer_class(params, **kwargs)``: one param group), loads the per-leaf state, takes one
    ``step()`` and reads the state back. ``update``
    works on copies, so it never mutates its inputs; ``step_`` steps the params in place.
    `lr` may be a schedule ``step -> float``.

    On sharded trees each rank runs the optimizer on its local shards: exact for elementwise
    optimizers (SGD, Adam, AdamW, RMSprop, Adagrad, ...). Ones that read whole tensors
    (Adafactor, Muon, SparseAdam) are refused on leaves split over ranks (`NotImplementedError`),
    and LBFGS, whose step needs a closure, always.

    Args:
        optimizer_class: e.g. ``torch.optim.AdamW``.
        **kwargs: the optimizer's hyper-parameters.

    Returns:
        A GradientTransformation with state `TorchOptimizerState` (its update needs `params`).

    Example:
        >>> opt = from_torch(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
        >>> updates, state = opt.update(grads, opt.init(params), params)
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise ValueError(f"from_torch needs a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    if issubclass(optimizer_class, _NEEDS_A_CLOSURE):
        raise NotImplementedError(
            f"from_torch({optimizer_class.__name__}): it re-evaluates the loss through a closure within its step, and a "
            "shardfn step hands the optimizer one gradient; use a first-order optimizer (sf.optim.adamw, "
            "from_torch(torch.optim.SGD, ...))"
        )
    mixing = next((c for c in _MIXING if issubclass(optimizer_class, c)), None)
    lr = kwargs.get("lr")
    # Validate the hyper-parameters now, with the optimizer's own checks.
    probe = {**kwargs, "lr": 0.0} if callable(lr) else kwargs
    try:
        optimizer_class([torch.zeros(1, 1, requires_grad=True)], **probe)  # 2-D: Muon takes matrices only
    except (TypeError, ValueError) as e:
        raise ValueError(f"{optimizer_class.__name__}{kwargs}: {e}") from None

    def init(params: Params) -> TorchOptimizerState:
        leaves, spec = flatten(params)
        return TorchOptimizerState(count=new_count(), per_leaf=spec.unflatten([{} for _ in leaves]))

    def run(grads: Updates, state: TorchOptimizerState, params: Params, inplace: bool):
        if params is None:
            raise ValueError("from_torch needs `params`: call update(updates, state, params)")
        if not isinstance(state, TorchOptimizerState):
            raise ValueError(f"from_torch expects a TorchOptimizerState, got {type(state).__name__}")
        g_leaves, spec = flatten(grads)
        p_leaves = flatten_as(spec, params, "params")
        try:
            dicts = spec.flatten_up_to(state.per_leaf)
        except (ValueError, TypeError) as e:
            raise ValueError(f"from_torch state does not match the structure of the updates: {e}") from None
        p_loc = locals_(p_leaves)
        if mixing is not None:
            _refuse_on_shards(optimizer_class, p_leaves, p_loc, spec)
        ps = p_loc if inplace else clone(p_loc)
        grads_loc = locals_(g_leaves)
        gs = grads_loc if inplace else clone(grads_loc)
        group = dict(kwargs)
        if callable(lr):
            group["lr"] = float(lr(int(state.count)))
        # The hyper-parameters go to the constructor, not only into the param group: an optimizer
        # may read them as it is built (Adagrad fills its accumulators with
        # `initial_accumulator_value` there; a group's copy of it is never read).
        # No leaf (an empty tree, a mask that selects none): nothing to step, and torch refuses an
        # optimizer over no parameter.
        if not ps:
            return ps, p_loc, p_leaves, spec, TorchOptimizerState(count=bump(state.count, inplace), per_leaf=spec.unflatten([]))
        opt = optimizer_class(ps, **group)
        saved = [p.grad for p in ps]
        for p, g, d in zip(ps, gs, dicts):
            p.grad = g
            if d:
                opt.state[p] = {
                    k: (local(v) if inplace else local(v).clone()) if isinstance(v, torch.Tensor) else v
                    for k, v in d.items()
                }
        opt.step()
        new_dicts = []
        for p, like, old in zip(ps, p_leaves, saved):
            p.grad = old
            new_dicts.append(
                {
                    k: wrap(v, like) if isinstance(v, torch.Tensor) and v.shape == p.shape else v
                    for k, v in opt.state.get(p, {}).items()
                }
            )
        new_state = TorchOptimizerState(count=bump(state.count, inplace), per_leaf=spec.unflatten(new_dicts))
        return ps, p_loc, p_leaves, spec, new_state

    def update(updates: Updates, state: TorchOptimizerState, params: Optional[Params] = None):
        ps, p_loc, p_leaves, spec, new_state = run(updates, state, params, inplace=False)
        out = torch._foreach_sub(ps, p_loc) if ps else []
        return unflatten(spec, out, p_leaves), new_state

    @torch.no_grad()
    def step_(grads: Updates, state: OptState, params: Params) -> OptState:
        return run(grads, state, params, inplace=True)[-1]

    return transformation(init, update, step_=step_)
