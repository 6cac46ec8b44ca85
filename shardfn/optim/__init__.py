"""Functional optimizers, optax-style, for plain and sharded (DTensor) pytrees.

An optimizer is a `GradientTransformation(init, update)` of pure functions; its state is a pytree of
NamedTuples of tensors. Every one built here also has its in-place forms as fields: ``update_`` (may
overwrite its inputs) and ``step_(grads, state, params) -> state``, the whole step in place (fused
torch kernels for `sgd`, `adam` and `adamw`).
"""

from ._alias import adam, adamw, sgd
from ._base import EmptyState, GradientTransformation, apply_updates
from ._combine import MaskedState, PartlyUpdatedError, chain, masked
from ._finite import ApplyIfFiniteState, apply_if_finite
from ._schedules import (
    Schedule,
    constant_schedule,
    cosine_decay_schedule,
    join_schedules,
    linear_schedule,
    warmup_cosine_decay_schedule,
)
from ._torch import TorchOptimizerState, from_torch
from ._transforms import (
    ScaleByAdamState,
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    clip_by_global_norm,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)

__all__ = [
    "GradientTransformation",
    "EmptyState",
    "ScaleByAdamState",
    "TraceState",
    "ScaleByScheduleState",
    "MaskedState",
    "ApplyIfFiniteState",
    "TorchOptimizerState",
    "Schedule",
    "apply_updates",
    "chain",
    "masked",
    "PartlyUpdatedError",
    "apply_if_finite",
    "scale",
    "scale_by_adam",
    "trace",
    "add_decayed_weights",
    "scale_by_learning_rate",
    "clip_by_global_norm",
    "sgd",
    "adam",
    "adamw",
    "from_torch",
    "constant_schedule",
    "linear_schedule",
    "cosine_decay_schedule",
    "warmup_cosine_decay_schedule",
    "join_schedules",
]
