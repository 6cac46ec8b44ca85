"""The active unit runtime: who is told when a unit's forward starts and ends.

A runtime is an object with `pre_forward(info, unit, args, kwargs)` and `post_forward(info, unit,
output)` (each may return replacement (args, kwargs) / output, or None), and optionally
`cast_inputs(info, args, kwargs)`, applied to the inputs of every `apply` call, and
`flat_params(apply, params)`, which may say which tensors `apply` computes on. The forward hooks
that `functionalize` puts on unit modules call the innermost active one. Train steps and sharded
inference activate theirs for the duration of one call.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["current", "activate"]

_state = threading.local()


def current() -> Any:
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@contextmanager
def activate(runtime: Any) -> Iterator[None]:
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(runtime)
    try:
        yield
    finally:
        stack.pop()
