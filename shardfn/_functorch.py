"""What torch.func's wrappers hide: one place that looks through them.

Inside a torch.func transform a tensor is seen wrapped, once per level (a grad-tracking wrapper,
a batched one); the DTensor, the storage and the autograd graph are those of the innermost tensor.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch.utils import _pytree as pytree

__all__ = ["unwrap", "batched", "under_grad_transform", "at_levels"]


def unwrap(x: Any) -> Any:
    """`x` without torch.func's wrappers (stops at a DTensor, which is never a wrapper)."""
    while isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x


def _levels(x: Any):
    while isinstance(x, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(x):
        yield x
        x = torch._C._functorch.get_unwrapped(x)


def batched(x: Any) -> bool:
    """Whether `x` is batched by a vmap at any level."""
    return any(torch._C._functorch.is_batchedtensor(w) for w in _levels(x))


def under_grad_transform(tree: Any) -> bool:
    """Whether a tensor of `tree` is tracked by a torch.func gradient transform (vmap alone is not)."""
    return any(not torch._C._functorch.is_batchedtensor(w) for x in pytree.tree_leaves(tree) for w in _levels(x))


def at_levels(fn: Callable[[Any], torch.Tensor], x: torch.Tensor, what: str) -> torch.Tensor:
    """`fn` of the tensor inside `x`'s gradient wrappers, wrapped again at the same levels.

    For the body of an autograd.Function's `jvp`, which receives tangents wrapped at the levels of
    the transforms around it: `fn` (a collective) runs with every transform off, on the innermost
    tensor, and its result is handed back at those levels. A tangent batched by vmap (`jacfwd`, a
    vmap over tangents) raises `NotImplementedError` naming `what`.
    """
    levels = []
    while isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and torch._C._functorch.is_functorch_wrapped_tensor(x):
        if torch._C._functorch.is_batchedtensor(x):
            raise NotImplementedError(what)
        levels.append(torch._C._functorch.maybe_get_level(x))
        x = torch._C._functorch.get_unwrapped(x)
    with temporarily_clear_interpreter_stack(), torch._C._DisableFuncTorch():
        out = fn(x)
    for level in reversed(levels):
        out = torch._C._functorch._wrap_for_grad(out, level)
    return out
