"""Mends for torch 2.13's DTensor on tensor-parallel shards: the ops it computes wrong (silently) or
refuses, each computed exactly by a custom handler, listed once in `MENDS` (delete an entry when a
torch upgrade gets it right), and installed for a tensor-parallel forward and backward by `mended()`
(`TensorParallel.context` in `_tp.py`). Also the sharding strategies DTensor lacks for CPU's fused
attention (`register_strategies`, through torch's public `register_sharding`).

Note [DTensor mends]
--------------------
A vocabulary-parallel head gives logits sharded on the vocabulary, and a
cross-entropy of them (`F.cross_entropy`, what Hugging Face's losses call) runs on the shards
without gathering them: ignored labels, any reduction, class weights, label smoothing, and the
log-probabilities read by other terms too (Note [cross-entropy on the shards]). Other ops on the
sharded logits that DTensor has no sharded rule for (`softmax`, `logsumexp`) make it gather them
whole, reported as a fallback (Note [tensor parallel forward] in `_tp.py`). The pointwise losses whose backward DTensor computes with a
shard's element count under `reduction="mean"` (`mse_loss`, `smooth_l1_loss`, `huber_loss`,
`soft_margin_loss`, `binary_cross_entropy`: gradients tp times too large) take the `"sum"` backward
divided by the whole count (`_mean_loss_backward`). An op DTensor has no rule for at all is refused
with its name and the fix (`TensorParallel.context`). A scan along a split dim (`cumsum`, which
DTensor computes shard by shard) runs on the dim gathered whole (`_scan_whole`). A vector norm over
a split dim is made whole at once (`_norm_replicated`: DTensor's partial norm is summed as a partial
sum by the ops after it, `x.norm(dim=d).sum()`), and torch's `rms_norm` over a split dim adds its eps
to the partial mean on each rank (`_add_to_partial`: DTensor refuses that in-place add). Other torch 2.13
DTensor errors mended here: pointwise losses with `reduction="mean"` over an uneven split (DTensor
averages the shards' means; `_mean_loss_forward` divides the sum by the whole count), `fill_` of a
partial sum (`1 - x` inside `cosine_embedding_loss`: every rank held the 1; `_fill`, which also fills
a row `x[0] = v` DTensor has no rule for), an in-place constant added to a partial sum, a
`gather` along a split dim (`logp.gather(-1, labels)`, whose masked partial failed in the reductions
after it; `_gather_on_shards`), the activations' backwards DTensor has no rule for (`logsigmoid`,
`leaky_relu`, `elu`, `mish`, `softplus`, `hardswish`, ...: `_pointwise_local`), and convolutions with
a weight split on its channels (Note [convolutions on tp shards]). An in-place write through a view
that crosses a split (`x[..., :k] *= s`, `x[..., i] = v` on the split dim), which DTensor computes
on a gathered copy so that the write never reaches the tensor, is refused (`_in_place`). A
cross-entropy over rows split unevenly over tp (a sequence the tp size does not divide, flattened
with the batch), whose mean DTensor refuses, runs on the rows gathered whole
(`_rows_split_unevenly`); a `torch.cat` of a legacy empty tensor (a key/value cache's start) drops
it, as torch does (`_cat_without_legacy_empties`).

Mixed precision: `reduce_dtype` holds for the tp all-reduces too: a partial sum is cast to it before
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from . import _collectives as C
from ._spec import _chunk

__all__ = ["MENDS", "Mend", "mended", "op_handlers", "by_default", "register_strategies"]


_REGISTERED = False


def register_strategies() -> None:
    """Sharding strategies DTensor lacks, for ops models call: CPU's fused attention (heads or
    batch split, or all replicated), through torch's public `register_sharding`."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten
    ops = [getattr(aten, n).default for n in ("_scaled_dot_product_flash_attention_for_cpu",) if hasattr(aten, n)]
    bwd = [getattr(aten, n).default for n in ("_scaled_dot_product_flash_attention_for_cpu_backward",) if hasattr(aten, n)]
    if not ops or not bwd:
        return

    def mask_for(attn_mask: Any, d: int | None) -> list:
        # The mask's placement when q/k/v split on dim d (None: all whole). It broadcasts against
        # (batch, heads, q, k) from the right: a dim it lacks, or holds once, stays whole.
        if attn_mask is None:
            return []
        i = None if d is None else d - (4 - len(attn_mask.shape))
        return [Shard(i) if i is not None and i >= 0 and attn_mask.shape[i] > 1 else Replicate()]

    @register_sharding(ops[0])
    def _sdpa(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        R = Replicate()
        out = [([R, R], [R, R, R, None, None, *mask_for(attn_mask, None)])]
        if not dropout_p:  # dropout drawn per shard: Note [randomness on tp peers]
            out += [([Shard(d), Shard(d)], [Shard(d), Shard(d), Shard(d), None, None, *mask_for(attn_mask, d)]) for d in (0, 1)]
        return out

    @register_sharding(bwd[0])
    def _sdpa_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
        R = Replicate()
        strategies = [([R, R, R], [R, R, R, R, R, R, None, None, *mask_for(attn_mask, None)])]
        if not dropout_p:
            strategies += [([Shard(d)] * 3, [Shard(d)] * 6 + [None, None, *mask_for(attn_mask, d)]) for d in (0, 1)]
        return strategies


@contextmanager
def op_handlers(ops: dict) -> Iterator[None]:
    """DTensor's custom handlers for `ops` (op -> handler) inside the block, the previous ones after."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    saved = {op: handlers.get(op) for op in ops}
    handlers.update(ops)
    try:
        yield
    finally:
        for op, h in saved.items():
            if h is None:
                handlers.pop(op, None)
            else:
                handlers[op] = h


def by_default(op_call, args, kwargs):
    """`op_call` by DTensor's own rule, from inside its custom handler (put back after)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op_call, None)
    try:
        return op_call(*args, **kwargs)
    finally:
        if handler is not None:
            handlers[op_call] = handler


# In-place ops a model or a loss may apply to a view (`x[..., :k].mul_(s)`, `x[..., i] = v`). A view
# across a tp split (a slice of the split dim) is, in torch 2.13's DTensor, computed on a gathered
# copy: a write through it never reaches the tensor, silently. Such writes are refused (`_in_place`).
_IN_PLACE = tuple(
    getattr(getattr(torch.ops.aten, op), overload)
    for op, overloads in {
        "add_": ("Tensor", "Scalar"), "sub_": ("Tensor", "Scalar"), "mul_": ("Tensor", "Scalar"), "div_": ("Tensor", "Scalar"),
        "fill_": ("Scalar", "Tensor"), "zero_": ("default",), "copy_": ("default",), "masked_fill_": ("Scalar", "Tensor"),
        "clamp_": ("default",), "clamp_min_": ("default",), "clamp_max_": ("default",), "neg_": ("default",),
        "exp_": ("default",), "pow_": ("Scalar",), "addcmul_": ("default",), "addcdiv_": ("default",),
        "index_fill_": ("int_Scalar",), "scatter_": ("value", "src"), "index_put_": ("default",),
    }.items()
    for overload in overloads
)


def _through_a_copy(x: Any) -> bool:
    """Whether DTensor `x` is a view whose local tensor is not part of its base's (a gathered copy)."""
    base = getattr(x, "_base", None)
    return (isinstance(x, DTensor) and isinstance(base, DTensor)
            and x._local_tensor.untyped_storage().data_ptr() != base._local_tensor.untyped_storage().data_ptr())


def _in_place(handler=None):
    """The handler of an in-place op: refuses a write through a view that DTensor computed on a copy
    (see `_IN_PLACE`), then runs `handler` (DTensor's own rule if None)."""
    def run(op_call, args, kwargs):
        if args and _through_a_copy(args[0]):
            raise NotImplementedError(
                f"tensor parallel: {op_call} writes in place through a view of a tp-split tensor that crosses its split "
                f"(a view of shape {tuple(args[0].shape)} of a tensor of shape {tuple(args[0]._base.shape)} placed "
                f"{tuple(args[0]._base.placements)}): torch's DTensor computes such a view on a gathered copy, so the "
                "write would never reach the tensor. Write it out of place (torch.where, masked_fill, index_fill, a "
                "product with a mask) or on x.full_tensor()"
            )
        return handler(op_call, args, kwargs) if handler is not None else by_default(op_call, args, kwargs)

    return run


# -- cross-entropy on vocabulary-sharded logits ---------------------------------------------------
def _on_class_shards(handler: Callable, arg: int, dim_arg: int | None) -> Callable:
    """`handler` where args[arg] is split on its class dim (args[dim_arg], or 1 / 0 for nll_loss's);
    DTensor's own rule wherever the class dim is whole (Note [cross-entropy on the shards])."""
    def run(op_call, args, kwargs):
        x = args[arg]
        dim = args[dim_arg] if dim_arg is not None else (1 if x.dim() > 1 else 0)
        dim = dim % max(x.dim(), 1)
        if isinstance(x, DTensor) and any(p.is_shard(dim) for p in x.placements):
            _refuse_empty_shards(x, dim)
            return handler(op_call, args, kwargs)
        if isinstance(x, DTensor) and _rows_split_unevenly(x, dim):
            args = tuple(_whole(a) for a in args)
        return by_default(op_call, args, kwargs)

    return run


def _rows_split_unevenly(x: DTensor, class_dim: int) -> bool:
    """Whether `x` is split over tp on a dim other than `class_dim` in pieces of unequal size (a
    sequence the tp size does not divide, flattened with the batch: DTensor's `_StridedShard`), where
    DTensor refuses a loss's mean ("cannot be evenly sharded")."""
    for mesh_dim, p in enumerate(x.placements):
        if p.is_partial() or p.is_replicate():
            continue
        d = getattr(p, "dim", None)
        if d is None or d % max(x.dim(), 1) == class_dim:
            continue
        if not p.is_shard() or x.shape[d] % x.device_mesh.size(mesh_dim):
            return True
    return False


def _whole(a: Any) -> Any:
    """A DTensor gathered whole on its mesh (replicated), anything else as it is."""
    if isinstance(a, DTensor) and not all(p.is_replicate() for p in a.placements):
        return C.redistribute(a, a.device_mesh, [Replicate()] * a.device_mesh.ndim, "tensor parallel")
    return a


# The pointwise losses whose backward DTensor computes with `reduction="mean"` from a shard's own
# element count (the gradient of a sharded input comes out tp times too large, silently): op -> the
# position of its `reduction` argument.
_MEAN_LOSS_BACKWARDS = {
    torch.ops.aten.mse_loss_backward.default: 3,
    torch.ops.aten.smooth_l1_loss_backward.default: 3,
    torch.ops.aten.huber_loss_backward.default: 3,
    torch.ops.aten.soft_margin_loss_backward.default: 3,
    torch.ops.aten.binary_cross_entropy_backward.default: 4,
}


# Scans along a dim (a running sum, product, max): DTensor computes each shard's alone when the dim is
# split (torch 2.13), silently; they run on the dim gathered whole instead (reported as a fallback).
_SCANS = (torch.ops.aten.cumsum.default, torch.ops.aten.cumprod.default, torch.ops.aten.logcumsumexp.default,
          torch.ops.aten.cummax.default, torch.ops.aten.cummin.default)


def _scan_whole(op_call, args, kwargs):
    """A scan along a split dim, on the dim gathered whole (exact); by DTensor's rule otherwise."""
    x, dim = args[0], args[1]
    if isinstance(x, DTensor) and x.dim() > 0:
        d = dim % x.dim()
        if any(p.is_shard(d) for p in x.placements):
            whole = [Replicate() if p.is_shard(d) else p for p in x.placements]
            args = (C.redistribute(x, x.device_mesh, whole, "tensor parallel"), *args[1:])
    return by_default(op_call, args, kwargs)


# Vector norms: over a split dim DTensor leaves a partial norm (`_NormPartial`), which later ops treat
# as a partial SUM (torch 2.13): `x.norm(dim=d).sum()` sums the shards' norms, silently. Its result is
# made whole at once (one all-reduce of the reduced, small tensor).
_NORMS = (torch.ops.aten.linalg_vector_norm.default, torch.ops.aten.norm.Scalar, torch.ops.aten.norm.ScalarOpt_dim)


def _norm_replicated(op_call, args, kwargs):
    """A vector norm by DTensor's rule, its partial result (a norm over a split dim) made whole."""
    out = by_default(op_call, args, kwargs)
    if isinstance(out, DTensor) and any(p.is_partial() for p in out.placements):
        whole = [Replicate() if p.is_partial() else p for p in out.placements]
        out = C.redistribute(out, out.device_mesh, whole, "tensor parallel")
    return out


def _first_of_partial(x: DTensor, kinds: set) -> bool:
    """Whether this rank holds the one part of a partial sum that takes a constant (its coordinate is 0
    on every mesh dim the sum is over); True for a partial mean, max or min (every part takes it)."""
    if kinds != {"sum"}:
        return True
    coordinate = x.device_mesh.get_coordinate()
    return all(coordinate[i] == 0 for i, p in enumerate(x.placements) if p.is_partial())


def _partial_kinds(x: Any) -> set | None:
    """The reduce ops of `x`'s partial placements when a constant can be written into it part by part
    (plain partial sums alone, or means, maxima and minima alone); None otherwise."""
    if not isinstance(x, DTensor):
        return None
    partial = [p for p in x.placements if p.is_partial()]
    kinds = {getattr(p, "reduce_op", None) for p in partial}
    if partial and all(type(p) is Partial for p in partial) and (kinds == {"sum"} or kinds <= {"avg", "max", "min"}):
        return kinds
    return None


def _constant(value: Any) -> Any:
    """A scalar operand as a number or plain 0-dim tensor; None if it is anything else."""
    if isinstance(value, DTensor):
        return value._local_tensor if value.dim() == 0 and all(p.is_replicate() for p in value.placements) else None
    if isinstance(value, torch.Tensor):
        return value if value.dim() == 0 else None
    return value


def _add_to_partial(op_call, args, kwargs):
    """`x.add_(c)` of a partial sum, mean, max or min and a constant `c` (an RMSNorm's `mean(x**2) +
    eps` over a split dim, as torch's `rms_norm` writes it; `x.sum(-1).add_(1)`): DTensor refuses an
    in-place op on a partial. The mean, max or min of `x_r + c` is that of `x_r` plus c: every part
    takes c; a sum takes it once, on its first part. Anything else by DTensor's own rule."""
    x = args[0]
    other = _constant(args[1]) if len(args) > 1 else None
    alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
    kinds = _partial_kinds(x)
    if kinds is None or other is None:
        return by_default(op_call, args, kwargs)
    if _first_of_partial(x, kinds):
        x._local_tensor.add_(other, alpha=alpha)
    return x


# The pointwise losses whose forward DTensor computes with `reduction="mean"` as the mean of the
# shards' means: wrong where a split is uneven (5 classes over 2 ranks): op -> position of `reduction`.
_MEAN_LOSSES = {
    torch.ops.aten.mse_loss.default: 2,
    torch.ops.aten.smooth_l1_loss.default: 2,
    torch.ops.aten.huber_loss.default: 2,
    torch.ops.aten.soft_margin_loss.default: 2,
    torch.ops.aten.binary_cross_entropy.default: 3,
    torch.ops.aten.binary_cross_entropy_with_logits.default: 4,
}


def _split(x: Any) -> bool:
    return isinstance(x, DTensor) and not all(p.is_replicate() for p in x.placements)


def _with_sum(args: tuple, kwargs: dict, at: int) -> tuple[int, tuple, dict]:
    """(reduction, args, kwargs) with `reduction` (at position `at`, or a keyword) set to sum (2)."""
    reduction = args[at] if len(args) > at else kwargs.get("reduction", 1)
    if len(args) > at:
        return reduction, (*args[:at], 2, *args[at + 1:]), kwargs
    return reduction, args, {**kwargs, "reduction": 2}


def _mean_loss_forward(op_call, args, kwargs):
    """A pointwise loss with `reduction="mean"` of split operands: the `"sum"` one over the whole
    input's element count (DTensor averages the shards' means, wrong for uneven shards)."""
    at = _MEAN_LOSSES[op_call]
    reduction, sum_args, sum_kwargs = _with_sum(args, kwargs, at)
    operands = (*args[:at], *(v for k, v in kwargs.items() if k in ("weight", "pos_weight")))
    if reduction != 1 or not any(_split(a) for a in operands):
        return by_default(op_call, args, kwargs)
    return by_default(op_call, sum_args, sum_kwargs) / args[0].numel()


def _fill(op_call, args, kwargs):
    """`fill_` of a tp DTensor with a constant. Split or whole, each rank fills its own part (DTensor
    has no rule for `fill_.Tensor`, which `x[0] = v` reaches; a view that DTensor computed on a copy is
    refused before, by `_in_place`). A partial sum takes the value on its first part and zeros
    elsewhere (torch's `1 - x` of a partial `x`, in `cosine_embedding_loss`, is
    `empty_like(x).fill_(1).sub_(x)`, and DTensor fills every rank: the sum held tp times the value);
    a partial mean, max or min on every part. Anything else by DTensor's own rule."""
    x, value = args[0], _constant(args[1])
    if not isinstance(x, DTensor) or value is None:
        return by_default(op_call, args, kwargs)
    if not any(p.is_partial() for p in x.placements):  # each rank fills its own part (no copy: `_in_place`)
        x._local_tensor.fill_(value)
        return x
    kinds = _partial_kinds(x)
    if kinds is None:
        return by_default(op_call, args, kwargs)
    x._local_tensor.fill_(value if _first_of_partial(x, kinds) else 0)
    return x


def _gather_on_shards(op_call, args, kwargs):
    """`x.gather(d, index)` along a dim `d` split over tp: each rank picks the indices that fall in its
    part and zeros elsewhere, a partial sum (DTensor's masked partial for it fails in the reductions
    after it). Anything else by DTensor's own rule."""
    x, dim, index = args[0], args[1], args[2]
    d = dim % max(x.dim(), 1) if isinstance(x, DTensor) else dim
    whole_index = not isinstance(index, DTensor) or all(p.is_replicate() for p in index.placements)
    if not (isinstance(x, DTensor) and x.device_mesh.ndim == 1 and x.placements[0].is_shard(d) and whole_index and not kwargs.get("sparse_grad", False)):
        return by_default(op_call, args, kwargs)
    mesh = x.device_mesh
    local = x._local_tensor
    idx = index._local_tensor if isinstance(index, DTensor) else index
    lo, hi = _chunk(0, x.shape[d], mesh.size(), mesh.get_local_rank())
    rel = idx - lo
    outside = (rel < 0) | (rel >= hi - lo)
    if hi > lo:
        picked = local.gather(d, rel.masked_fill(outside, 0)).masked_fill(outside, 0)
    else:  # this rank holds none of the dim
        picked = torch.zeros(idx.shape, dtype=local.dtype, device=local.device)
    return _wrap(picked, mesh, [Partial()], picked.shape)


# Elementwise ops (activations' backwards, mostly) that torch 2.13's DTensor has no rule for: every
# tensor operand has the output's shape, so they run on each rank's part of a common layout.
_POINTWISE_WITHOUT_RULES = tuple(
    getattr(torch.ops.aten, name).default
    for name in ("log_sigmoid_forward", "log_sigmoid_backward", "softplus_backward", "hardswish_backward", "elu_backward",
                 "leaky_relu_backward", "mish_backward", "hardsigmoid_backward", "hardtanh_backward",
                 "softshrink_backward", "hardshrink_backward")
)


def _global_stride(shape) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def _wrap(local: torch.Tensor, mesh: DeviceMesh, placements, shape) -> DTensor:
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=_global_stride(shape))


def _as(x: Any, mesh: DeviceMesh, placements) -> torch.Tensor:
    """This rank's part of `x` (a DTensor, or a plain tensor counted as replicated) laid out as `placements`."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    if tuple(x.placements) != tuple(placements):
        x = C.redistribute(x, mesh, placements, "tensor parallel")
    return x._local_tensor


def _pointwise_local(op_call, args, kwargs):
    """An elementwise op DTensor has no rule for: its operands in the layout of the first one that is
    not a partial sum (Replicate if none), computed on this rank's part."""
    dts = [a for a in args if isinstance(a, DTensor)]
    mesh, shape = dts[0].device_mesh, dts[0].shape
    whole = (Replicate(),) * mesh.ndim
    # A split layout if an operand has one (a whole operand takes its part without communication).
    layouts = [tuple(a.placements) for a in dts if a.shape == shape and not any(p.is_partial() for p in a.placements)]
    target = next((pl for pl in layouts if any(p.is_shard() for p in pl)), whole)
    local = [_as(a, mesh, target if a.shape == shape else whole) if isinstance(a, torch.Tensor) and (isinstance(a, DTensor) or a.dim()) else a
             for a in args]
    out = op_call(*local, **kwargs)
    mine = next((t.shape for a, t in zip(args, local) if isinstance(a, DTensor) and a.shape == shape), None)

    def wrap(t):
        if not isinstance(t, torch.Tensor):
            return t
        return _wrap(t, mesh, target, shape) if t.shape == mine else _wrap(t, mesh, whole, t.shape)

    return tuple(wrap(t) for t in out) if isinstance(out, (tuple, list)) else wrap(out)


# Note [convolutions on tp shards]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch 2.13's DTensor convolution handler serves one layout, an input split along its width with a
# whole weight (spatial parallelism, with halo exchanges over the default group); for a weight split
# on its channels it runs the local convolution on the shards it is given and labels the result with
# the layout its sharding rule chose, which the shards are not (a "Replicate" output holding half
# the channels). So shardfn computes convolutions with a tp-split operand itself: a weight split on
# its output channels (`P("tp", None, None, None)`, column-parallel) on a whole input gives the
# output split on its channels; a weight split on its input channels with the input split so (the
# next, row-parallel, convolution) gives a partial sum, the bias added on the first tp rank; any
# other layout (groups, transposed, an input split on its width, a split leaving a tp rank no channel)
# runs on the operands gathered whole (exact, reported as a fallback). An input split along its batch
# with a whole weight is DTensor's (a local convolution). The backward follows the same cases.


def _conv_layout(x: Any, w: Any, b: Any, transposed: bool, groups: int) -> str:
    """"column", "row", "whole" or "dtensor" (DTensor's own rule): how `_convolution` computes a
    convolution of these operands. The same on every tp rank: it reads placements and global shapes."""
    def pl(t):
        return t.placements[0] if isinstance(t, DTensor) else Replicate()

    if not _split(w) and not _split(b) and not pl(x).is_shard(1) and not pl(x).is_partial():
        if pl(x).is_shard(0):  # split along the batch with a whole weight: DTensor computes it locally
            return "dtensor"
    w_mesh = w.device_mesh if isinstance(w, DTensor) else None
    one_dim = all(t.device_mesh.ndim == 1 for t in (x, w, b) if isinstance(t, DTensor))
    if one_dim and not transposed and groups == 1 and w_mesh is not None:
        # A split that leaves a tp rank no channel: every rank computes it whole instead.
        n = w_mesh.size()
        holds_all = lambda channels: _chunk(0, channels, n, n - 1)[1] > _chunk(0, channels, n, n - 1)[0]  # noqa: E731
        if pl(w).is_shard(0) and pl(x).is_replicate() and (b is None or pl(b).is_shard(0) or pl(b).is_replicate()) and holds_all(w.shape[0]):
            return "column"
        if pl(w).is_shard(1) and pl(x).is_shard(1) and (b is None or pl(b).is_replicate()) and holds_all(w.shape[1]):
            return "row"
    return "whole"


def _conv_plan(operands: tuple, split: tuple, layout_of: tuple, kwargs: dict) -> tuple[DeviceMesh, str] | None:
    """(mesh, layout) for a convolution or its backward over `operands`, when one of `split` is
    split over tp and the layout (`_conv_layout(*layout_of)`) is not DTensor's own; None otherwise."""
    if kwargs or not any(_split(t) for t in split):
        return None
    layout = _conv_layout(*layout_of)
    if layout == "dtensor":
        return None
    return next(t for t in operands if isinstance(t, DTensor)).device_mesh, layout


def _convolution(op_call, args, kwargs):
    """A convolution with a tp-split operand (Note [convolutions on tp shards]); DTensor's otherwise."""
    x, w, b, transposed, groups = args[0], args[1], args[2], args[6], args[8]
    plan = _conv_plan((x, w, b), (x, w, b), (x, w, b, transposed, groups), kwargs)
    if plan is None:
        return by_default(op_call, args, kwargs)
    mesh, layout = plan
    whole = [Replicate()] * mesh.ndim
    rest = args[3:]
    if layout == "column":  # a whole bias: this rank's channels of it (a slice)
        out = op_call(_as(x, mesh, whole), w._local_tensor, None if b is None else _as(b, mesh, [Shard(0)]), *rest)
        shape = list(out.shape)
        shape[1] = w.shape[0]
        return _wrap(out, mesh, [Shard(1)], shape)
    if layout == "row":
        out = op_call(x._local_tensor, w._local_tensor, None, *rest)
        if b is not None and mesh.get_local_rank() == 0:
            out = out + _as(b, mesh, whole).view(1, -1, *([1] * (out.dim() - 2)))
        return _wrap(out, mesh, [Partial()], out.shape)
    out = op_call(*(None if t is None else _as(t, mesh, whole) for t in (x, w, b)), *rest)
    return _wrap(out, mesh, whole, out.shape)


def _convolution_backward(op_call, args, kwargs):
    """The backward of `_convolution`, case by case (Note [convolutions on tp shards])."""
    go, x, w = args[0], args[1], args[2]
    bias_sizes, transposed, groups = args[3], args[7], args[9]
    # The layout from the input and weight alone: a bias the forward took whole with a column-split
    # weight gets its gradient split on the channels here, then made whole by autograd (exact).
    plan = _conv_plan((go, x, w), (x, w), (x, w, None, transposed, groups), kwargs)
    if plan is None:
        return by_default(op_call, args, kwargs)
    mesh, layout = plan
    whole = [Replicate()] * mesh.ndim
    rest = list(args[3:])
    if layout == "column":
        rest[0] = None if bias_sizes is None else [w._local_tensor.shape[0]]
        gi, gw, gb = op_call(_as(go, mesh, [Shard(1)]), _as(x, mesh, whole), w._local_tensor, *rest)
        return (None if gi is None else _wrap(gi, mesh, [Partial()], x.shape),
                None if gw is None else _wrap(gw, mesh, [Shard(0)], w.shape),
                None if gb is None else _wrap(gb, mesh, [Shard(0)], [w.shape[0]]))
    if layout == "row":
        gi, gw, gb = op_call(_as(go, mesh, whole), x._local_tensor, w._local_tensor, *rest)
        return (None if gi is None else _wrap(gi, mesh, [Shard(1)], x.shape),
                None if gw is None else _wrap(gw, mesh, [Shard(1)], w.shape),
                None if gb is None else _wrap(gb, mesh, whole, gb.shape))
    gi, gw, gb = op_call(*(_as(t, mesh, whole) for t in (go, x, w)), *rest)
    return tuple(None if g is None else _wrap(g, mesh, whole, g.shape) for g in (gi, gw, gb))


def _mean_loss_backward(op_call, args, kwargs):
    """The backward of a pointwise loss with `reduction="mean"` on a sharded input: the `"sum"`
    backward (which DTensor computes right) divided by the whole input's element count."""
    at = _MEAN_LOSS_BACKWARDS[op_call]
    reduction, sum_args, sum_kwargs = _with_sum(args, kwargs, at)
    # 1: mean; any operand split (the input, the target, a weight) makes DTensor count a shard
    if reduction != 1 or not any(_split(a) for a in (*args[1:at], kwargs.get("weight"))):
        return by_default(op_call, args, kwargs)
    numel = args[1].numel()  # the whole input's (every operand has its shape)
    return by_default(op_call, sum_args, sum_kwargs) / numel


# Note [cross-entropy on the shards]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `F.cross_entropy` is `log_softmax` then `nll_loss`. On logits sharded over the vocabulary, the
# forwards are torch's `loss_parallel` handlers: the log-softmax's max and sum of exponentials are
# all-reduced, the loss reads each label's log-probability on the rank that holds it. The backwards
# are shardfn's own, each the gradient of its op alone, so that the log-probabilities may have other
# consumers too (label smoothing sums them over the vocabulary; a distillation loss weighs them by
# soft targets; a user adds a term): torch's pair instead computes the whole cross-entropy gradient
# in `nll_loss`'s backward and passes the gradient through `log_softmax`'s, which is wrong as soon
# as anything else reads the log-probabilities. Here:
#   nll_loss:    d/d logp[i, c] = -weight[c] * scale_i where c is label i (and i is not ignored), on the
#                rank whose shard holds c; zero elsewhere. No communication.
#   log_softmax: d/d x = g - exp(logp) * sum_c g, the sum over the vocabulary all-reduced over tp.
# Class weights with ignored labels work as on one process (the weight is read at label 0 in place of
# an ignored one, then zeroed). Label smoothing masks a partial sum to zero at ignored labels, in
# place: `_zero_fill_partial` does it on each rank's part.
def _local_of(x: Any) -> Any:
    """The value of a replicated DTensor (or a plain tensor / number) on this rank."""
    if isinstance(x, DTensor):
        if not all(p.is_replicate() for p in x.placements):
            raise NotImplementedError(
                f"a cross-entropy on logits split over the vocabulary got a {x.placements} operand (labels, weights or "
                "a gradient) where a replicated one is supported: keep the head whole on tp for this loss (a rule "
                "mapping its weight to P() before the ready rules)"
            )
        return x._local_tensor
    return x


def _class_shard(x: DTensor, dim: int) -> tuple[int, Any, int]:
    """The mesh dim that splits `x`'s dim `dim`, its group, and where this rank's part starts."""
    m = next(i for i, p in enumerate(x.placements) if p.is_shard(dim))
    others = [p for i, p in enumerate(x.placements) if i != m]
    if not all(p.is_replicate() for p in others):
        raise NotImplementedError(
            f"a cross-entropy on logits laid out as {x.placements}: only the vocabulary may be split (over tp); keep "
            "the head whole on tp for this loss (a rule mapping its weight to P() before the ready rules)"
        )
    mesh = x.device_mesh
    return m, mesh.get_group(m), _chunk(0, x.shape[dim], mesh.size(m), mesh.get_local_rank(m))[0]


def _refuse_empty_shards(x: DTensor, dim: int) -> None:
    """A class dim split so that a rank holds no class (9 classes over tp=4: 3, 3, 3, 0) is refused
    on every rank alike, before anything is computed: torch's forward handlers cannot run there."""
    for m, p in enumerate(x.placements):
        if p.is_shard(dim):
            n, w = x.shape[dim], x.device_mesh.size(m)
            lo, hi = _chunk(0, n, w, w - 1)  # the last rank's classes
            if lo == hi:
                raise NotImplementedError(
                    f"a cross-entropy on logits whose {n} classes are split over {w} tp ranks as torch.chunk splits "
                    f"them ({-(-n // w)} per rank) leaves the last rank none, which the loss on the shards cannot take "
                    "yet: keep the head whole on tp (a rule mapping its weight to P() before the ready rules), or use "
                    "a tp size that leaves every rank some classes"
                )


def _nll_loss_backward(op_call, args, kwargs):
    """The gradient of `nll_loss` with respect to log-probabilities sharded on the class dim."""
    grad_output, logp, target, weight, reduction, ignore_index, total_weight = args
    cd = 1 if logp.dim() > 1 else 0
    _, _, start = _class_shard(logp, cd)
    local = logp._local_tensor
    if isinstance(grad_output, DTensor) and not all(p.is_replicate() for p in grad_output.placements):
        grad_output = C.redistribute(grad_output, grad_output.device_mesh, [Replicate()] * grad_output.device_mesh.ndim,
                                     "the tensor-parallel loss")  # e.g. per-token losses weighted by a partial sum
    t, g = _local_of(target), _local_of(grad_output)
    kept = t != ignore_index
    scale = g / _local_of(total_weight) if reduction == 1 else g  # 1: mean
    scale = scale.expand(t.shape) if scale.dim() == 0 else scale
    if weight is not None:
        scale = scale * _local_of(weight)[torch.where(kept, t, 0)]
    here = kept & (t >= start) & (t < start + local.shape[cd])
    grad = torch.zeros_like(local)
    grad.scatter_(cd, torch.where(here, t - start, 0).unsqueeze(cd), torch.where(here, -scale, 0).to(grad.dtype).unsqueeze(cd))
    return DTensor.from_local(grad, logp.device_mesh, logp.placements, run_check=False, shape=logp.shape, stride=logp.stride())


def _log_softmax_backward(op_call, args, kwargs):
    """The gradient of `log_softmax` over a class dim sharded over tp: g - exp(logp) * sum(g), the sum
    over the whole class dim (one all-reduce over tp)."""
    grad, logp, dim, input_dtype = args
    dim = dim % logp.dim()
    _, group, _ = _class_shard(logp, dim)
    if not isinstance(grad, DTensor):
        grad = DTensor.from_local(grad, logp.device_mesh, [Replicate()] * logp.device_mesh.ndim, run_check=False)
    if tuple(grad.placements) != tuple(logp.placements):  # e.g. replicated: this rank's part, no communication
        grad = C.redistribute(grad, logp.device_mesh, logp.placements, "the tensor-parallel loss")
    g, out = grad._local_tensor, logp._local_tensor
    total = g.sum(dim, keepdim=True, dtype=torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else None)
    if total.device.type != "meta":  # a meta run (sf.estimate_memory) has no values to sum
        C.all_reduce_blocking(total, group, "the tensor-parallel loss")
    res = torch.exp(out)  # one logits-sized buffer, filled in place: g - exp(logp) * sum(g)
    res.mul_(total.to(res.dtype)).neg_().add_(g)
    res = res.to(input_dtype)
    return DTensor.from_local(res, logp.device_mesh, logp.placements, run_check=False, shape=logp.shape, stride=logp.stride())


def _zero_fill_partial(op_call, args, kwargs):
    """`masked_fill_(mask, 0)` of a partial sum: zero on every rank is a sum of zero, so each rank
    fills its own part (a cross-entropy with label smoothing masks its sum over the sharded
    vocabulary so); anything else by DTensor's own rule."""
    x, mask, value = args[0], args[1], args[2]
    plain = not isinstance(mask, DTensor) or all(p.is_replicate() for p in mask.placements)
    partial_sum = all(p.is_replicate() or (p.is_partial() and getattr(p, "reduce_op", None) == "sum") for p in x.placements)
    if value == 0 and plain and partial_sum and any(p.is_partial() for p in x.placements) and not kwargs:
        local = mask._local_tensor if isinstance(mask, DTensor) else mask
        x._local_tensor.masked_fill_(local, 0)
        return x
    return by_default(op_call, args, kwargs)


def _cat_without_legacy_empties(op_call, args, kwargs):
    """`torch.cat` skips a 1-D tensor of no elements beside tensors of more dims (the legacy empty
    `torch.tensor([])`), as Hugging Face's key/value cache begins: DTensor instead makes it a
    replicated operand and reshards it to the others' layout, which fails (`IndexError: Dimension
    out of range`). Such operands are dropped, which is what `torch.cat` does with them; the rest by
    DTensor's own rule."""
    tensors = list(args[0])
    kept = [t for t in tensors if not (t.dim() == 1 and t.shape[0] == 0)]
    if len(kept) < len(tensors) and kept and any(t.dim() > 1 for t in kept):
        if len(kept) == 1:  # cat returns a new tensor, never its input
            return by_default(torch.ops.aten.clone.default, (kept[0],), {})
        args = (kept, *args[1:])
    return by_default(op_call, args, kwargs)


# -- the list ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mend:
    """Custom DTensor handlers for `ops`: what torch 2.13's DTensor gets wrong or refuses (`fixes`),
    and the handler that computes it exactly instead."""

    ops: tuple
    handler: Callable
    fixes: str


def _cross_entropy() -> tuple[Mend, ...]:
    from torch.distributed.tensor.parallel import loss as lp

    aten = torch.ops.aten
    why = "loss_parallel() replaces these ops for every input (and fails on whole ones); its backward pair is wrong when other terms read the log-probabilities"
    return (
        Mend((aten._log_softmax.default,), _on_class_shards(lp._log_softmax_handler, 0, 1), why),
        Mend((aten._log_softmax_backward_data.default,), _on_class_shards(_log_softmax_backward, 1, 2), why),
        Mend((aten.nll_loss_forward.default, aten.nll_loss2d_forward.default), _on_class_shards(lp._nll_loss_forward_handler, 0, None), why),
        Mend((aten.nll_loss_backward.default, aten.nll_loss2d_backward.default), _on_class_shards(_nll_loss_backward, 1, None), why),
    )


def _mends() -> tuple[Mend, ...]:
    aten = torch.ops.aten
    return (
        *_cross_entropy(),
        Mend((aten.masked_fill_.Scalar,), _zero_fill_partial, "refuses masked_fill_ of a partial sum (label smoothing on sharded logits)"),
        Mend(tuple(_MEAN_LOSS_BACKWARDS), _mean_loss_backward, "mean-reduced pointwise losses' backward divides by a shard's count: gradients tp times too large, silently"),
        Mend(tuple(_MEAN_LOSSES), _mean_loss_forward, "mean-reduced pointwise losses average the shards' means: wrong on an uneven split, silently"),
        Mend(_SCANS, _scan_whole, "scans along a split dim run shard by shard, silently"),
        Mend(_NORMS, _norm_replicated, "a norm over a split dim is a partial norm that later ops sum as a partial sum, silently"),
        Mend((aten.add_.Scalar, aten.add_.Tensor), _add_to_partial, "refuses an in-place constant added to a partial (rms_norm's eps over a split dim)"),
        Mend((aten.fill_.Scalar, aten.fill_.Tensor), _fill, "fills every part of a partial sum (the sum holds tp times the value, silently); no rule for fill_.Tensor"),
        Mend((aten.gather.default,), _gather_on_shards, "a gather along a split dim gives a masked partial the reductions after it fail on"),
        Mend(_POINTWISE_WITHOUT_RULES, _pointwise_local, "no rule for these activations' backwards"),
        Mend((aten.convolution.default,), _convolution, "a convolution with a channel-split weight is labelled with a layout its shards are not, silently"),
        Mend((aten.convolution_backward.default,), _convolution_backward, "the backward of the same"),
        Mend((aten.cat.default,), _cat_without_legacy_empties, "reshards a legacy empty operand (torch.tensor([]), a key/value cache's start) and fails"),
    )


MENDS: tuple[Mend, ...] = _mends()
"""Every mend, in one list: on a torch whose DTensor gets an entry right, delete the entry (the tests
in tests/test_tp.py that name its ops say whether it still holds)."""


@contextmanager
def mended() -> Iterator[None]:
    """The block runs with every mend in `MENDS`, and with in-place writes through a view DTensor
    computed on a copy refused (`_in_place`, around each in-place op's handler); the handlers that
    were there before, after."""
    handlers = {op: m.handler for m in MENDS for op in m.ops}
    handlers.update({op: _in_place(handlers.get(op)) for op in _IN_PLACE})
    with op_handlers(handlers):
        yield
