"""What torch.func's wrappers hide: one place that looks through them.

Inside a torch.func transform a tensor is seen wrapped, once per level (a grad-tracking wrapper,
a batched one); the DTensor, the storage and the autograd graph are those of the innermost tensor.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils import _pytree as pytree

__all__ = ["unwrap", "batched", "under_grad_transform", "refuse_tracing", "note_gathered", "install_mixing_check"]


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


# Note [a sharded leaf read inside a transform]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Inside `torch.func.grad` over a sharded tree, a leaf read directly (`p["w"].pow(2).sum()`, not
# through `sf.gather`) computes as a DTensor. Added to a loss computed on gathered (plain) tensors,
# the sum is a DTensor, and the backward fails deep inside autograd when the DTensor gradient
# reaches the plain part (`nll_loss_backward got mixed torch.Tensor and DTensor`). DTensor lets a
# plain tensor of one element meet a DTensor (as a replicated scalar), and asks its dispatcher
# whether it may: that question is where the mistake is seen, in the forward, before any gradient
# is computed. It is refused when the plain scalar is part of what is differentiated: it requires
# grad (plain autograd), or a torch.func transform that gathered a sharded tree is still running
# (inside DTensor's dispatch torch.func's own levels are hidden, so `sf.gather` records the
# transforms it ran under, by a weak reference to one of its wrapped leaves, alive until the
# transform returns). Backward passes are left alone (their scalars are autograd's own). If the
# dispatcher stops asking, the error is DTensor's own again, and nothing else changes.

_transforms: list = []  # weak references to a wrapped leaf of each transform sf.gather ran under

_MIXED = (
    "a sharded (DTensor) leaf was computed with directly and then combined with plain tensors ({op}), "
    "inside a gradient over the sharded tree: its gradient cannot flow back to the plain tensors. Read "
    "the tree through `sf.gather(tree)` (e.g. `full = sf.gather(p); full['w'].pow(2).sum()`) or "
    "`apply(tree, x)`, never a DTensor leaf of it directly"
)


def note_gathered(leaves: list) -> None:
    """Records that `sf.gather` ran under the torch.func transform tracking `leaves`, if any."""
    for x in leaves:
        if isinstance(x, torch.Tensor) and torch._C._functorch.is_gradtrackingtensor(x):
            _transforms[:] = [r for r in _transforms if _live(r)]
            if not any(r() is x for r in _transforms):
                _transforms.append(weakref.ref(x))
            return


def _live(ref: Any) -> bool:
    x = ref()
    return x is not None and not torch._C._functorch.is_dead_tensor_wrapper(x)


def _differentiated(t: torch.Tensor) -> bool:
    if torch._C._current_graph_task_id() != -1:  # a backward pass
        return False
    return t.requires_grad or any(_live(r) for r in _transforms)


def install_mixing_check() -> None:
    """Makes DTensor's dispatcher refuse a plain scalar that is differentiated meeting a DTensor
    (Note [a sharded leaf read inside a transform]); idempotent."""
    from torch.distributed.tensor import DTensor

    dispatcher = getattr(DTensor, "_op_dispatcher", None)
    original = getattr(dispatcher, "_try_replicate_spec_for_scalar_tensor", None)
    if original is None or getattr(original, "_shardfn", False):
        return

    def check(op_call: Any, tensor_arg: torch.Tensor, compute_mesh: Any) -> Any:
        if tensor_arg.numel() == 1 and _differentiated(tensor_arg):
            raise ValueError(_MIXED.format(op=op_call))
        return original(op_call, tensor_arg, compute_mesh)

    check._shardfn = True  # type: ignore[attr-defined]
    dispatcher._try_replicate_spec_for_scalar_tensor = check
