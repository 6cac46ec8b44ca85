"""Named optimizers (`sgd`, `adam`, `adamw`) as chains, whose ``step_`` runs torch's fused kernels."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch.optim.adam import adam as adam_functional
from torch.optim.sgd import sgd as sgd_functional

from ._base import GradientTransformation, InPlace, OptState, Params, generic_step
from ._combine import Mask, chain, masked, resolve_mask
from ._local import flatten, flatten_as, locals_
from ._transforms import (
    ScalarOrSchedule,
    _check_beta,
    _check_lr,
    _check_nonneg,
    add_decayed_weights,
    lr_at,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)

__all__ = ["sgd", "adam", "adamw"]

_FUSED_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps")


def _fusable(lists: tuple[list[torch.Tensor], ...]) -> bool:
    """Whether torch's fused kernels take these local lists (same float dtype and device per leaf)."""
    first = lists[0]
    for i, p in enumerate(first):
        if not p.dtype.is_floating_point or p.device.type not in _FUSED_DEVICE_TYPES:
            return False
        for other in lists[1:]:
            if other[i].dtype != p.dtype or other[i].device != p.device:
                return False
    return True


def _groups(weight_decay: float, mask: Optional[Mask], params: Params, leaves: list[torch.Tensor]):
    """Yields (weight_decay, device, positions in `leaves`) for each mask group and device/dtype."""
    if weight_decay == 0 or mask is None:
        parts = [(weight_decay, range(len(leaves)))]
    else:
        flags = resolve_mask(mask, params)
        parts = [(wd, [i for i, f in enumerate(flags) if f == keep]) for wd, keep in ((weight_decay, True), (0.0, False))]
    for wd, positions in parts:
        by_kind: dict[tuple, list[int]] = {}
        for i in positions:
            by_kind.setdefault((leaves[i].device, leaves[i].dtype), []).append(i)
        for (device, _), idx in by_kind.items():
            yield wd, device, idx


# Note [fused step plan]
# ~~~~~~~~~~~~~~~~~~~~~~
# What a fused step decides from its leaves alone (whether torch's fused kernel takes them, their
# groups by weight decay, device and dtype) is kept for the next step, which reuses it when it is
# given the very same local tensors (a train step's state keeps them from step to step; the plan
# holds them weakly) and the mask is not a function of the params. A step over other tensors plans
# again. For a model of a few hundred small leaves, planning costs about as much as the kernel.
class _FusedPlan:
    """The groups of a fused step's leaves, kept while the leaves stay the same tensors."""

    def __init__(self, weight_decay: float, mask: Optional[Mask]):
        self.weight_decay, self.mask = weight_decay, mask
        self._refs: list[list[weakref.ref]] | None = None
        self._groups: list | None = None

    def __call__(self, lists: tuple[list[torch.Tensor], ...], params: Params) -> list | None:
        """[(weight_decay, device, per-list sublists)] for torch's fused kernel, or None if it does
        not take these leaves."""
        refs = self._refs
        same = refs is not None and not callable(self.mask) and all(
            len(r) == len(l) and all(a() is b for a, b in zip(r, l)) for r, l in zip(refs, lists)
        )
        if not same:
            self._groups = list(_groups(self.weight_decay, self.mask, params, lists[0])) if _fusable(lists) else None
            self._refs = [[weakref.ref(x) for x in l] for l in lists]
        if self._groups is None:
            return None
        return [(wd, device, tuple([l[i] for i in idx] for l in lists)) for wd, device, idx in self._groups]


def _chain_state(state: OptState, n: int) -> tuple:
    if not isinstance(state, tuple) or len(state) != n:
        raise ValueError(f"expected the optimizer's state, a tuple of {n} states, got {type(state).__name__}")
    return state


def _with_wd(weight_decay: float, mask: Optional[Mask]) -> list[GradientTransformation]:
    if weight_decay == 0:
        return []
    wd = add_decayed_weights(weight_decay)
    return [wd if mask is None else masked(wd, mask)]


def _check_adam(lr: ScalarOrSchedule, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    _check_lr(lr)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (b1, b2), got {betas!r}")
    _check_beta("betas[0]", betas[0])
    _check_beta("betas[1]", betas[1])
    _check_nonneg("eps", eps)
    _check_nonneg("weight_decay", weight_decay)


def _adam_family(
    lr: ScalarOrSchedule,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    mask: Optional[Mask],
    decoupled: bool,
) -> GradientTransformation:
    _check_adam(lr, betas, eps, weight_decay)
    b1, b2 = float(betas[0]), float(betas[1])
    wd = _with_wd(weight_decay, mask)
    adam_t = scale_by_adam(b1, b2, eps)
    parts = [adam_t, *wd] if decoupled else [*wd, adam_t]
    parts.append(scale_by_learning_rate(lr))
    i_adam = parts.index(adam_t)
    opt = chain(*parts)
    fallback = generic_step(opt.update_)
    plan = _FusedPlan(weight_decay, mask)
    # torch's per-leaf step tensors, kept between steps: its fused kernel leaves them at t, so they
    # are set to t - 1 (two kernels) only when the last step of these leaves was not t - 1.
    step_counts: dict[tuple, list] = {}  # (weight decay, device, number of leaves) -> [step tensors, their value]

    @torch.no_grad()
    def step_(grads: Any, state: OptState, params: Params) -> OptState:
        state = _chain_state(state, len(parts))
        st = state[i_adam]
        g_leaves, spec = flatten(grads)
        lists = (
            locals_(flatten_as(spec, params, "params")),
            locals_(g_leaves),
            locals_(flatten_as(spec, st.mu, "adam state mu")),
            locals_(flatten_as(spec, st.nu, "adam state nu")),
        )
        groups = plan(lists, params)
        if groups is None:
            return fallback(grads, state, params)
        t = float(int(st.count) + 1)
        lr_t = lr_at(lr, state[-1])
        for wd_g, device, (p, g, m, v) in groups:
            # torch.optim's functional Adam with fused=True (its fused kernel), which counts the
            # steps itself, one tensor per leaf.
            entry = step_counts.get((wd_g, device, len(p)))
            if entry is None:
                entry = step_counts[(wd_g, device, len(p))] = [[torch.zeros((), dtype=torch.float32, device=device) for _ in p], None]
            steps = entry[0]
            if entry[1] != t - 1:
                torch._foreach_zero_(steps)
                torch._foreach_add_(steps, t - 1)
            entry[1] = None  # unknown if the kernel fails part way
            adam_functional(p, g, m, v, [], steps, fused=True, decoupled_weight_decay=decoupled, amsgrad=False,
                                  beta1=b1, beta2=b2, lr=lr_t, weight_decay=wd_g, eps=eps, maximize=False)
            entry[1] = t
        st.count.add_(1)
        if callable(lr):
            state[-1].count.add_(1)
        return state

    return opt._replace(step_=InPlace(step_, opt.update))


def adam(
    lr: ScalarOrSchedule,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    mask: Optional[Mask] = None,
) -> GradientTransformation:
    """Adam, matching ``torch.optim.Adam`` (coupled L2 weight decay: ``g + weight_decay * p``).

    Built as ``chain(add_decayed_weights(weight_decay), scale_by_adam(*betas, eps),
    scale_by_learning_rate(lr))``; ``step_`` runs ``torch.optim``'s functional Adam with ``fused=True`` on the local leaves.

    Args:
        lr: learning rate >= 0, or a schedule ``step -> float``.
        betas: decays of the first and second moments, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: L2 coefficient, >= 0.
        mask: which leaves get weight decay (a pytree of bools like the params, or ``params -> mask``);
            None decays all.

    Returns:
        A GradientTransformation.

    Example:
        >>> opt = adam(1e-3, weight_decay=1e-4)
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
    """
    return _adam_family(lr, betas, eps, weight_decay, mask, decoupled=False)


def adamw(
    lr: ScalarOrSchedule,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    mask: Optional[Mask] = None,
) -> GradientTransformation:
    """AdamW, matching ``torch.optim.AdamW`` (decoupled decay: ``p -= lr * weight_decay * p``).

    The default ``weight_decay=0.01`` is torch's; optax's ``adamw`` defaults to 1e-4.

    Built as ``chain(scale_by_adam(*betas, eps), add_decayed_weights(weight_decay),
    scale_by_learning_rate(lr))``; ``step_`` runs ``torch.optim``'s functional AdamW with ``fused=True`` on the local leaves.

    Args:
        lr: learning rate >= 0, or a schedule ``step -> float``.
        betas: decays of the first and second moments, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: decoupled decay coefficient, >= 0.
        mask: which leaves get weight decay (a pytree of bools like the params, or ``params -> mask``);
            None decays all.

    Returns:
        A GradientTransformation.

    Example:
        >>> opt = adamw(1e-3, weight_decay=0.01)
        >>> state = opt.init(params)
        >>> state = opt.step_(grads, state, params)    # in place, fused
    """
    return _adam_family(lr, betas, eps, weight_decay, mask, decoupled=True)


def sgd(
    lr: ScalarOrSchedule,
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    mask: Optional[Mask] = None,
) -> GradientTransformation:
    """SGD with optional momentum, matching ``torch.optim.SGD`` (first momentum buffer = gradient).

    Everything after the learning rate is keyword-only: positional orders differ between optax
    (``momentum, nesterov``) and torch (``momentum, dampening, weight_decay, nesterov``).

    Built as ``chain(add_decayed_weights(weight_decay), trace(momentum, nesterov, dampening),
    scale_by_learning_rate(lr))`` (parts with a zero coefficient left out); ``step_`` runs
    ``torch.optim``'s functional SGD with ``fused=True`` on the local leaves.

    Args:
        lr: learning rate >= 0, or a schedule ``step -> float``.
        momentum: momentum factor, >= 0.
        dampening: dampening of new gradients in the momentum buffer, in [0, 1].
        nesterov: Nesterov momentum (needs momentum > 0 and dampening == 0).
        weight_decay: L2 coefficient, >= 0.
        mask: which leaves get weight decay (a pytree of bools like the params, or ``params -> mask``).

    Returns:
        A GradientTransformation.

    Example:
        >>> opt = sgd(0.1, momentum=0.9, nesterov=True)
    """
    _check_lr(lr)
    for name, value in (("momentum", momentum), ("dampening", dampening), ("weight_decay", weight_decay)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"sgd: {name} must be a number, got {value!r}")
    if not isinstance(nesterov, bool):
        raise ValueError(f"sgd: nesterov must be True or False, got {nesterov!r}")
    _check_nonneg("momentum", momentum)
    _check_nonneg("weight_decay", weight_decay)
    if not 0 <= dampening <= 1:
        raise ValueError(f"sgd: dampening must be in [0, 1], got {dampening!r}")
    parts = _with_wd(weight_decay, mask)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum needs momentum > 0 and dampening == 0")
    trace_t = trace(momentum, nesterov, dampening) if momentum > 0 else None  # dampening alone is a no-op
    if trace_t is not None:
        parts.append(trace_t)
    parts.append(scale_by_learning_rate(lr))
    opt = chain(*parts)
    fallback = generic_step(opt.update_)
    plan = _FusedPlan(weight_decay, mask)
    i_trace = parts.index(trace_t) if trace_t is not None else None

    @torch.no_grad()
    def step_(grads: Any, state: OptState, params: Params) -> OptState:
        state = _chain_state(state, len(parts))
        g_leaves, spec = flatten(grads)
        lists = (locals_(flatten_as(spec, params, "params")), locals_(g_leaves))
        first = False
        if i_trace is not None:
            ts = state[i_trace]
            lists = (*lists, locals_(flatten_as(spec, ts.trace, "sgd momentum state")))
            first = int(ts.count) == 0
        groups = plan(lists, params)
        if groups is None:
            return fallback(grads, state, params)
        lr_t = lr_at(lr, state[-1])
        for wd_g, _, grouped in groups:
            p, g = grouped[0], grouped[1]
            bufs = grouped[2] if i_trace is not None else []
            # torch.optim's functional SGD with fused=True. It tells the first step (the buffer
            # takes the gradient whole, undamped) by buffers that are None, and then makes new
            # ones: this state holds its buffers from `init`, so they get the new values.
            given = [None] * len(p) if first or not bufs else bufs
            sgd_functional(p, g, given, fused=True, weight_decay=wd_g, momentum=float(momentum), lr=lr_t,
                           dampening=float(dampening), nesterov=nesterov, maximize=False)
            if first:
                for b, new in zip(bufs, given):
                    b.copy_(new)
        if i_trace is not None:
            state[i_trace].count.add_(1)
        if callable(lr):
            state[-1].count.add_(1)
        return state

    return opt._replace(step_=InPlace(step_, opt.update))
