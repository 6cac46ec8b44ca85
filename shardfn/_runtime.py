"""Unit runtimes: who is told when a unit's forward starts and ends.

Note [unit runtime]
-------------------
A runtime is a `UnitRuntime`: `pre_forward(info, unit, args, kwargs)` and `post_forward(info, unit,
output)` (each may return replacement (args, kwargs) / output, or None), `info` (the model it
serves, or None), `cast_inputs(info, args, kwargs)`, applied to the inputs of every `apply` call,
`flat_params(apply, params)`, which may say which tensors `apply` computes on (None: `apply`
decides), and `remats(unit)`, whether remat's checkpoint wraps that unit's forward now.
`RuntimeDefaults` gives the last three their do-nothing form. Train steps (their engine), sharded
inference, the per-example norms and the memory estimate's probe activate theirs for the
duration of one call.

A runtime is held by the model it serves (`ModelInfo.runtimes`, innermost last), not by the thread
that activated it: on CUDA, autograd runs the backward on its own device threads, and what runs
there (unit hooks fired by a recompute, `apply` under the user's own checkpoint, remat) must find
the same runtime as the forward did. The hooks `functionalize` puts on unit modules and remat's
wrapper reach the model's info through a weak reference and ask it; with no runtime active they
cost one lookup. Hooks that only the step installs (on outputs, inputs and gradients) hold their
engine themselves.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Protocol

__all__ = ["RuntimeDefaults", "UnitRuntime", "activate"]


class UnitRuntime(Protocol):
    """What a model's unit hooks, `apply` and remat ask the runtime active on the model."""

    info: Any

    def pre_forward(self, info: Any, unit: int, args: tuple, kwargs: dict) -> tuple | None: ...

    def post_forward(self, info: Any, unit: int, output: Any) -> Any: ...

    def cast_inputs(self, info: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]: ...

    def flat_params(self, apply: Any, params: Any) -> dict | None: ...

    def remats(self, unit: int) -> bool: ...


class RuntimeDefaults:
    """The do-nothing parts of a `UnitRuntime`: inputs as they are, `apply` decides what it
    computes on, no remat."""

    info: Any = None

    def cast_inputs(self, info: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, kwargs

    def flat_params(self, apply: Any, params: Any) -> dict | None:
        return None

    def remats(self, unit: int) -> bool:
        return False


@contextmanager
def activate(runtime: UnitRuntime, info: Any = None) -> Iterator[None]:
    """Makes `runtime` the innermost runtime of its model (`info`, default `runtime.info`) while
    the block runs; a runtime without a model (a train step of a plain function) needs none."""
    info = info if info is not None else runtime.info
    if info is None:
        yield
        return
    info.runtimes.append(runtime)
    try:
        yield
    finally:
        for i in range(len(info.runtimes) - 1, -1, -1):  # its own entry, also if an inner one leaked
            if info.runtimes[i] is runtime:
                del info.runtimes[i]
                break
