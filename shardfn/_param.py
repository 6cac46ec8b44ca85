"""The parameters `loss_fn` sees in a train step, and what reading one outside `apply` does.

Note [parameters outside apply]
-------------------------------
Inside a unit's forward the model reads its full parameters, which exist only while the unit is
gathered (Note [unit schedule]). `loss_fn` may also read any leaf of `params` itself: an L2
penalty, a head applied by hand, a logged norm. Such a read can come at any time, when the unit is
not gathered or its memory holds another unit, and autograd may read the tensor again at any
later point of the backward. So the leaves handed to `loss_fn` are not the full parameters: they
are `Param`s, tensors of the right shape, dtype and device whose every use goes through
`__torch_function__`.

- `apply` (of the model the step trains) swaps each `Param` for the unit's full parameter before
  the module runs, so the model itself computes on plain tensors at no extra cost.
- Any other use of a `Param` is an outside read: the op receives the leaf's full value, gathered
  on its own (one all-gather of the leaf's segment; a collective, so every rank must make the same
  reads, as for any collective) into memory that belongs to autograd, so it stays valid for the
  whole backward, whatever the units do. Its gradient flows into the unit's gradient, and the unit
  is reduced only once every use, inside and outside `apply`, has contributed. The value is
  gathered once per leaf and step (again only if a gradient is needed where the first read had
  none). Root leaves are gathered for the whole step and are read in place.
- Metadata (shape, dtype, device, requires_grad, ...) needs no gather.
- A `Param` kept past its step is dead: reading it is an error, never stale values.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

__all__ = ["Param", "Detour", "OffSchedule"]


class OffSchedule(NotImplementedError):
    """`loss_fn` used the model in a way the unit schedule cannot serve: a backward of its own
    (a gradient penalty), or torch.func.vmap over the parameters (an ensemble). Raised before
    anything is computed; the train step then computes the step on the whole gathered tree
    (Note [steps off the unit schedule] in `shardfn/_core.py`)."""

    agreed = False  # raised from the exchange in which every rank learnt that one leaves

_METADATA = {
    torch.Tensor.shape.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.requires_grad.__get__,
    torch.Tensor.is_leaf.__get__,
    torch.Tensor.layout.__get__,
    torch.Tensor.grad.__get__,
    torch.Tensor.grad_fn.__get__,
    torch.Tensor.is_cuda.__get__,
    torch.Tensor.is_meta.__get__,
    torch.Tensor.is_sparse.__get__,
    torch.Tensor.is_quantized.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.Tensor.element_size,
    torch.Tensor.stride,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
    torch.Tensor.get_device,
    torch.Tensor.is_contiguous,
    torch.Tensor.__len__,
    torch.Tensor.__hash__,
}


# Note [params below the dispatcher]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An op that reaches a `Param` below autograd (torch.func.vmap batches its inputs in C++, past
# `__torch_function__`) would compute on the unit's slot, with no gradient: `__torch_dispatch__`
# refuses it, and the step leaves the unit schedule. Under a TorchDispatchMode the mode sees that op
# first, and when the mode calls it, Python's op call runs `Param.__torch_function__` before the
# dispatcher reaches `Param.__torch_dispatch__`. Resolving the Param there would compute the right
# values with the gradient lost (a silently wrong step, only under the mode): so
# `__torch_function__` refuses too when it is called from inside the dispatcher, which is when
# the dispatcher's Python snapshot key is already excluded (it is not for any call made by user
# code, under a mode or not).
_SNAPSHOT = torch._C.DispatchKey.PythonTLSSnapshot


def _below_dispatch() -> bool:
    """Whether this call comes from inside the dispatcher (a dispatch mode calling an op; such a
    call is always of an aten `OpOverload`, which the caller checks first)."""
    return torch._C._dispatch_tls_is_dispatch_key_excluded(_SNAPSHOT)


def _past_shardfn(func: Any) -> OffSchedule:
    return OffSchedule(
        f"{func} reached a parameter shardfn handed out (a train step's, or a sharded apply's) directly, past shardfn "
        "(torch.func.vmap over the parameters, "
        "as an ensemble built with stack_module_state does)"
    )


class Param(torch.Tensor):
    """A leaf of the parameter tree `loss_fn` receives in a train step (Note [parameters outside apply]).

    `reader` (a weak reference to the engine's `read`) resolves it to a tensor holding its full
    value; `where` is its (unit, index) in the engine.
    """

    reader: weakref.WeakMethod
    where: tuple[int, int]

    @staticmethod
    def make(proxy: torch.Tensor, reader: Any, where: tuple[int, int]) -> "Param":
        p = torch.Tensor._make_subclass(Param, proxy.detach(), proxy.requires_grad)
        p.reader, p.where = weakref.WeakMethod(reader), where
        return p

    def owner(self) -> Any:
        """The engine whose step handed this parameter to `loss_fn` (None once it is deleted)."""
        read = self.reader()
        return None if read is None else read.__self__

    def resolve(self) -> torch.Tensor:
        read = self.reader()
        if read is None:
            raise RuntimeError("a parameter shardfn handed out was used after its train step was deleted, or after the "
                               "apply on a sharded tree that handed it to the model returned")
        return read(self)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.autograd.grad, torch.autograd.backward):
            # A gradient with respect to the parameters inside loss_fn (a gradient-norm penalty):
            # their uses went to the units' full parameters, so none would be found.
            raise OffSchedule("torch.autograd.grad with respect to a train step's parameters, inside loss_fn")
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if isinstance(func, torch._ops.OpOverload) and _below_dispatch():
            # A TorchDispatchMode (shardfn's debug mode, a user's flop counter or logger) calls the op
            # of a Param that reached the dispatcher past `__torch_function__` (Note [params below
            # the dispatcher]): the same refusal as `__torch_dispatch__`, never the full value.
            raise _past_shardfn(func)
        args, kwargs = tree_map_only(Param, Param.resolve, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Below autograd: an op reached the Param itself, not its full value, by a path that
        # skips `__torch_function__` (torch.func.vmap batches its inputs in C++). Its memory is
        # the unit's slot, which need not hold this leaf, and no gradient would flow: refuse.
        raise _past_shardfn(func)

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: D105 - a repr must not gather
        return f"sf.Param(shape={tuple(self.shape)}, dtype={self.dtype}, unit={self.where[0]})"

    def __reduce_ex__(self, proto):
        raise TypeError("a parameter shardfn handed out is valid only inside the call it was handed to (loss_fn in a "
                        "train step, the model's forward in apply on a sharded tree); return values computed from it")


class Detour(torch.autograd.Function):
    """A leaf's full value, gathered on its own, whose gradient flows into the unit's full
    parameter `proxy` (whose memory it never reads: it may hold another unit now)."""

    @staticmethod
    def forward(proxy: torch.Tensor, gather: Any) -> torch.Tensor:  # type: ignore[override]
        return gather()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None

    @staticmethod
    def vmap(info, in_dims, proxy, gather):  # type: ignore[override]
        # Under a vmap over the examples inside loss_fn the parameter is not batched; its
        # gradient, batched in the backward, is summed over the examples by torch.func.
        if in_dims[0] is not None:
            raise NotImplementedError("a train step's parameter batched by vmap is not supported")
        return Detour.apply(proxy, gather), None
