"""Small gradient transformations, each one foreach kernel sequence over the local leaves."""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Union

import torch

from .._tree import tree_flatten_with_paths
from ._base import EmptyState, GradientTransformation, OptState, Params, Updates, transformation
from ._local import bump, clone, flatten, flatten_as, foreach, locals_, new_count, unflatten, zeros_like
from ._norm import global_norm

__all__ = [
    "ScaleByAdamState",
    "TraceState",
    "ScaleByScheduleState",
    "scale",
    "scale_by_adam",
    "trace",
    "add_decayed_weights",
    "scale_by_learning_rate",
    "clip_by_global_norm",
]

Schedule = Callable[[int], float]
ScalarOrSchedule = Union[float, Schedule]


class ScaleByAdamState(NamedTuple):
    """State of `scale_by_adam`: steps taken, first and second moments (shaped like the params)."""

    count: torch.Tensor
    mu: Params
    nu: Params


class TraceState(NamedTuple):
    """State of `trace`: steps taken and the momentum buffer (shaped like the params)."""

    count: torch.Tensor
    trace: Params


class ScaleByScheduleState(NamedTuple):
    """State of a scheduled scale: steps taken."""

    count: torch.Tensor


def _check_nonneg(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_beta(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


def _check_lr(lr: ScalarOrSchedule) -> None:
    if not callable(lr):
        _check_nonneg("learning rate", lr)


def _count(state: OptState, what: str) -> int:
    count = getattr(state, "count", None)
    if not isinstance(count, torch.Tensor):
        raise ValueError(f"{what}: expected a state with a `count` tensor, got {type(state).__name__}")
    return int(count)


def scale(factor: float) -> GradientTransformation:
    """Multiplies updates by a constant.

    Args:
        factor: the multiplier.

    Returns:
        A stateless GradientTransformation.

    Example:
        >>> opt = chain(scale_by_adam(), scale(-1e-3))
    """

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def make(inplace: bool):
        def update(updates: Updates, state: OptState, params: Optional[Params] = None):
            leaves, spec = flatten(updates)
            return unflatten(spec, foreach("mul", inplace, locals_(leaves), factor), leaves), state

        return update

    return transformation(init, make(False), make(True))


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Rescales updates by Adam's bias-corrected moment estimates: ``m̂ / (sqrt(v̂) + eps)``.

    Args:
        b1: decay of the first moment, in [0, 1).
        b2: decay of the second moment, in [0, 1).
        eps: added to the denominator, >= 0.

    Returns:
        A GradientTransformation with state `ScaleByAdamState`.

    Example:
        >>> opt = chain(scale_by_adam(0.9, 0.999), scale_by_learning_rate(1e-3))
    """
    _check_beta("b1", b1)
    _check_beta("b2", b2)
    _check_nonneg("eps", eps)

    def init(params: Params) -> ScaleByAdamState:
        _refuse_complex(params, "scale_by_adam (adam, adamw)")
        return ScaleByAdamState(count=new_count(), mu=zeros_like(params), nu=zeros_like(params))

    def make(inplace: bool):
        def update(updates: Updates, state: ScaleByAdamState, params: Optional[Params] = None):
            leaves, spec = flatten(updates)
            t = _count(state, "scale_by_adam") + 1
            mu_leaves = flatten_as(spec, state.mu, "scale_by_adam state mu")
            nu_leaves = flatten_as(spec, state.nu, "scale_by_adam state nu")
            u = locals_(leaves)
            mu = foreach("lerp", inplace, locals_(mu_leaves), u, 1.0 - b1)
            nu = foreach("mul", inplace, locals_(nu_leaves), b2)
            out = u
            if u:
                torch._foreach_addcmul_(nu, u, u, value=1.0 - b2)
                denom = torch._foreach_sqrt(nu)
                torch._foreach_div_(denom, math.sqrt(1.0 - b2**t))
                torch._foreach_add_(denom, eps)
                out = torch._foreach_div(mu, denom)
                torch._foreach_div_(out, 1.0 - b1**t)
            new_state = ScaleByAdamState(
                count=bump(state.count, inplace),
                mu=unflatten(spec, mu, mu_leaves),
                nu=unflatten(spec, nu, nu_leaves),
            )
            return unflatten(spec, out, leaves), new_state

        return update

    return transformation(init, make(False), make(True))


def _refuse_complex(params: Params, what: str) -> None:
    """Adam's second moment of a complex value: torch.optim takes the real and imaginary parts as
    two reals (`view_as_real`), a plain `u * u` would square the complex number: refused."""
    paths, leaves, _ = tree_flatten_with_paths(params, none_is_leaf=True)
    for name, x in zip(paths, leaves):
        if isinstance(x, torch.Tensor) and x.is_complex():
            raise NotImplementedError(
                f"{what}: leaf {name!r} is {x.dtype}, and complex leaves are not supported yet (torch.optim.Adam treats "
                "the real and imaginary parts as two reals). Use sf.optim.from_torch(torch.optim.AdamW, ...), or hold "
                "the parameter as real pairs (torch.view_as_real) in the module"
            )


def trace(momentum: float, nesterov: bool = False, dampening: float = 0.0) -> GradientTransformation:
    """Momentum, with torch.optim.SGD's rule.

    ``buf = g`` on the first step, then ``buf = momentum * buf + (1 - dampening) * g``; the output is
    ``g + momentum * buf`` with `nesterov`, else ``buf``.

    Args:
        momentum: the decay of the buffer, >= 0.
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        dampening: damping of new gradients, in [0, 1].

    Returns:
        A GradientTransformation with state `TraceState`.

    Example:
        >>> opt = chain(trace(0.9), scale_by_learning_rate(0.1))   # torch.optim.SGD(lr=0.1, momentum=0.9)
    """
    _check_nonneg("momentum", momentum)
    if not (isinstance(dampening, (int, float)) and 0.0 <= dampening <= 1.0):
        raise ValueError(f"dampening must be in [0, 1], got {dampening!r}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum needs momentum > 0 and dampening == 0")

    def init(params: Params) -> TraceState:
        return TraceState(count=new_count(), trace=zeros_like(params))

    def make(inplace: bool):
        def update(updates: Updates, state: TraceState, params: Optional[Params] = None):
            leaves, spec = flatten(updates)
            first = _count(state, "trace") == 0
            buf_leaves = flatten_as(spec, state.trace, "trace state")
            u, buf = locals_(leaves), locals_(buf_leaves)
            if first:
                if inplace:
                    if u:
                        torch._foreach_copy_(buf, u)
                else:
                    buf = clone(u)
            else:
                buf = foreach("mul", inplace, buf, momentum)
                if u:
                    torch._foreach_add_(buf, u, alpha=1.0 - dampening)
            if nesterov:
                out = foreach("add", inplace, u, buf, alpha=momentum)
            elif first:
                out = u
            elif inplace:
                if u:
                    torch._foreach_copy_(u, buf)
                out = u
            else:
                out = clone(buf)  # the returned updates never alias the state
            new_state = TraceState(count=bump(state.count, inplace), trace=unflatten(spec, buf, buf_leaves))
            return unflatten(spec, out, leaves), new_state

        return update

    return transformation(init, make(False), make(True))


def add_decayed_weights(weight_decay: float = 0.0) -> GradientTransformation:
    """Adds ``weight_decay * params`` to the updates.

    Before `scale_by_adam` this is Adam's coupled L2 penalty; after it, AdamW's decoupled decay.
    Use `masked` to decay only some leaves.

    Args:
        weight_decay: the coefficient, >= 0.

    Returns:
        A stateless GradientTransformation (its update needs `params`).

    Example:
        >>> opt = chain(scale_by_adam(), add_decayed_weights(0.01), scale_by_learning_rate(1e-3))
    """
    _check_nonneg("weight_decay", weight_decay)

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def make(inplace: bool):
        def update(updates: Updates, state: OptState, params: Optional[Params] = None):
            if params is None:
                raise ValueError("add_decayed_weights needs `params`: call update(updates, state, params)")
            leaves, spec = flatten(updates)
            p = locals_(flatten_as(spec, params, "params"))
            return unflatten(spec, foreach("add", inplace, locals_(leaves), p, alpha=weight_decay), leaves), state

        return update

    return transformation(init, make(False), make(True))


def lr_at(lr: ScalarOrSchedule, state: OptState) -> float:
    """The learning rate for the next step: `lr`, or ``lr(count)`` for a schedule."""
    return float(lr(_count(state, "scale_by_learning_rate"))) if callable(lr) else float(lr)


def scale_by_learning_rate(lr: ScalarOrSchedule) -> GradientTransformation:
    """Multiplies updates by ``-lr`` (a descent step).

    Args:
        lr: a float >= 0, or a schedule ``step -> float`` evaluated at the number of steps taken before
            (0 on the first step).

    Returns:
        A GradientTransformation; its state is `EmptyState` for a float, `ScaleByScheduleState` for a
        schedule.

    Example:
        >>> opt = chain(trace(0.9), scale_by_learning_rate(cosine_decay_schedule(0.1, 1000)))
    """
    _check_lr(lr)
    if not callable(lr):
        return scale(-float(lr))

    def init(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=new_count())

    def make(inplace: bool):
        def update(updates: Updates, state: ScaleByScheduleState, params: Optional[Params] = None):
            factor = -lr_at(lr, state)
            leaves, spec = flatten(updates)
            out = unflatten(spec, foreach("mul", inplace, locals_(leaves), factor), leaves)
            return out, ScaleByScheduleState(count=bump(state.count, inplace))

        return update

    return transformation(init, make(False), make(True))


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scales updates by ``min(1, max_norm / (norm + 1e-6))``, like ``torch.nn.utils.clip_grad_norm_``.

    That is torch's formula; optax's ``clip_by_global_norm`` scales by ``max_norm / norm`` only when
    the norm exceeds ``max_norm``, without the 1e-6.

    The norm is that of the whole tree; on a sharded tree it covers every shard (one all-reduce).

    Args:
        max_norm: the largest norm let through, > 0.

    Returns:
        A stateless GradientTransformation.

    Example:
        >>> opt = chain(clip_by_global_norm(1.0), adamw(1e-3))
    """
    _check_nonneg("max_norm", max_norm)
    if max_norm == 0:
        raise ValueError("max_norm must be > 0")

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def make(inplace: bool):
        def update(updates: Updates, state: OptState, params: Optional[Params] = None):
            leaves, spec = flatten(updates)
            if not leaves:
                return updates, state
            coef = torch.clamp(max_norm / (global_norm(updates) + 1e-6), max=1.0)
            u = locals_(leaves)
            devices = {x.device for x in u}
            if len(devices) == 1:
                out = foreach("mul", inplace, u, coef.to(u[0].device))
            else:
                out = [x.mul_(coef.to(x.device)) if inplace else x * coef.to(x.device) for x in u]
            return unflatten(spec, out, leaves), state

        return update

    return transformation(init, make(False), make(True))
