"""What torch.func's wrappers hide: one place that looks through them.

Inside a torch.func transform a tensor is seen wrapped, once per level (a grad-tracking wrapper,
a batched one); the DTensor, the storage and the autograd graph are those of the innermost tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils import _pytree as pytree

__all__ = ["unwrap", "batched", "under_grad_transform", "refuse_tracing"]


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


def refuse_tracing() -> None:
    """Raises under make_fx tracing (`torch.func.linearize`, `torch.fx`), whose trace would keep a
    collective's result as a constant."""
    if get_proxy_mode() is not None:
        raise NotImplementedError(
            "sf.gather cannot be traced by make_fx (torch.func.linearize, torch.fx tracing): the trace would keep "
            "the gathered values as constants. Use torch.func.jvp (linearize's function is a jvp), or gather "
            "outside the traced function"
        )
