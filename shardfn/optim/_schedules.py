"""Learning-rate schedules: functions ``step -> float``, step = number of steps taken before (0-based)."""

from __future__ import annotations

import bisect
import math
from typing import Callable, Sequence

__all__ = [
    "Schedule",
    "constant_schedule",
    "linear_schedule",
    "cosine_decay_schedule",
    "warmup_cosine_decay_schedule",
    "join_schedules",
]

Schedule = Callable[[int], float]


def _check_steps(name: str, steps: int, allow_zero: bool = False) -> None:
    if not isinstance(steps, int) or steps < 0 or (steps == 0 and not allow_zero):
        raise ValueError(f"{name} must be an int {'>=' if allow_zero else '>'} 0, got {steps!r}")


def constant_schedule(value: float) -> Schedule:
    """A schedule that is always `value`.

    Args:
        value: the value.

    Returns:
        ``step -> value``.

    Example:
        >>> constant_schedule(0.1)(7)
        0.1
    """
    value = float(value)
    return lambda step: value


def linear_schedule(init_value: float, end_value: float, transition_steps: int) -> Schedule:
    """Goes linearly from `init_value` (step 0) to `end_value` (step `transition_steps`), then stays.

    Args:
        init_value: the value at step 0.
        end_value: the value from step `transition_steps` on.
        transition_steps: the length of the ramp, > 0.

    Returns:
        ``step -> float``.

    Example:
        >>> linear_schedule(0.0, 1.0, 4)(1)
        0.25
    """
    _check_steps("transition_steps", transition_steps)

    def schedule(step: int) -> float:
        frac = min(max(step, 0), transition_steps) / transition_steps
        return init_value + (end_value - init_value) * frac

    return schedule


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Cosine decay from `init_value` to ``alpha * init_value`` over `decay_steps`, then constant.

    Args:
        init_value: the value at step 0.
        decay_steps: the length of the decay, > 0.
        alpha: the final value as a fraction of `init_value`.

    Returns:
        ``step -> float``.

    Example:
        >>> cosine_decay_schedule(1.0, 10)(5)
        0.5
    """
    _check_steps("decay_steps", decay_steps)

    def schedule(step: int) -> float:
        t = min(max(step, 0), decay_steps) / decay_steps
        return init_value * ((1.0 - alpha) * 0.5 * (1.0 + math.cos(math.pi * t)) + alpha)

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Runs ``schedules[i]`` from ``boundaries[i-1]`` on, each restarted at step 0 (as in optax).

    Args:
        schedules: n schedules.
        boundaries: n - 1 increasing steps where the next schedule takes over.

    Returns:
        ``step -> float``.

    Example:
        >>> s = join_schedules([constant_schedule(1.0), constant_schedule(2.0)], [10])
        >>> s(9), s(10)
        (1.0, 2.0)
    """
    schedules, boundaries = list(schedules), list(boundaries)
    if len(schedules) != len(boundaries) + 1 or not schedules:
        raise ValueError(f"need one boundary fewer than schedules, got {len(schedules)} and {len(boundaries)}")
    if boundaries != sorted(boundaries):
        raise ValueError(f"boundaries must be increasing, got {boundaries}")

    def schedule(step: int) -> float:
        i = bisect.bisect_right(boundaries, step)
        return schedules[i](step - boundaries[i - 1] if i > 0 else step)

    return schedule


def warmup_cosine_decay_schedule(
    init_value: float, peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0
) -> Schedule:
    """Linear warm-up from `init_value` to `peak_value`, then cosine decay to `end_value` (as in optax).

    Args:
        init_value: the value at step 0.
        peak_value: the value at step `warmup_steps`.
        warmup_steps: the length of the warm-up, >= 0.
        decay_steps: the total length, warm-up included (> `warmup_steps`).
        end_value: the value from step `decay_steps` on.

    Returns:
        ``step -> float``.

    Example:
        >>> s = warmup_cosine_decay_schedule(0.0, 1.0, 10, 110)
        >>> s(5), s(10), s(110)
        (0.5, 1.0, 0.0)
    """
    _check_steps("warmup_steps", warmup_steps, allow_zero=True)
    if not isinstance(decay_steps, int) or decay_steps <= warmup_steps:
        raise ValueError(f"decay_steps must be an int > warmup_steps ({warmup_steps}), got {decay_steps!r}")
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    cosine = cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha)
    if warmup_steps == 0:
        return cosine
    return join_schedules([linear_schedule(init_value, peak_value, warmup_steps), cosine], [warmup_steps])
