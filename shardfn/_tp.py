"""Tensor parallelism on top of FSDP: the forward on tensor-parallel shards, from the specs alone.

Note [tensor parallel forward]
------------------------------
On a mesh `(dp, tp)` (the first axis is FSDP's, the second tensor-parallel) a leaf's spec says how
it is split over `tp`: `P("tp", None)` splits the rows of a `[out, in]` weight (column-parallel:
each rank computes a slice of the outputs), `P(None, "tp")` its columns (row-parallel: each rank
computes a partial sum of the outputs); `P()` (or `P("dp")`) keeps it whole on every tp rank.
Every leaf is also FSDP-sharded over `dp`, within its tp shard: on dim 0, or on the dim its spec names
`dp` on (`P("tp", "dp")`: FSDP on dim 1 of a column-parallel weight; a dim split over both lists them
`("tp", "dp")`, FSDP within the tp shard; Note [leaves split on another dim] in `_flat.py`).

Layout. The flat engine (Note [flat unit layout] in `_flat.py`) knows nothing of `tp`: a leaf's
"full" value, for it, is this rank's tp shard, split over dim 0 across the `dp` group only,
gathered unit by unit over `dp` and reduce-scattered over `dp` (the mean over the dp ranks, Note
[the mean over ranks]; ranks that differ only in their tp coordinate get the same batch and compute
the same loss; the first step checks that they hold the same batch). The state's DTensors live on the whole 2-D mesh with the placements of both splits
(`P(None, "tp")` FSDP'd on dim 0 is `P("dp", "tp")`; `P("tp", None)` FSDP'd inside each tp shard is
`P(("tp", "dp"), None)`, rows split over tp first: Note [layouts of a spec] in `_spec.py`), so that
gather, save and describe see the true layout.

Forward. When a unit is gathered, the module computes on DTensors over the `tp` sub-mesh built on
the gathered shards (`DTensor.from_local`, no copy, no check): Shard(d) for tp-split leaves,
Replicate for the others, with autograd from the DTensor back to the engine's full parameter, so
gradients land where the engine reduces them. Plain tensors the model makes (inputs, masks,
rotary tables) count as replicated (`implicit_replication`). DTensor's sharding propagation then
computes each op on the shards by its rule for that op, whatever the model does between a column-
and a row-parallel layer (a norm over a sharded dim, a reshape into heads): where an op needs a
sharded operand whole, DTensor gathers it, so the result is exact, only slower (reported below).
An op DTensor has no rule for, or cannot apply to these shards, raises: it never computes wrong (a
split into heads that tp does not divide is a ValueError saying so; some loss variants on
vocabulary-sharded logits raise DTensor's own error).

Collectives from the specs. Left alone, DTensor chooses where to reduce partial sums, and often
chooses badly (gathers of weights in the backward). So the modules that hold a tp-split leaf
steer it at their boundaries, as a tensor-parallel plan does, but derived from the specs:

- forward: an output that is a partial sum (the row-parallel matmul's) is all-reduced to
  Replicate as the module returns: one all-reduce per column -> row pair;
- backward: on each input that needs a gradient, ONE tensor hook turns the gradient, once summed
  over every consumer of that input (q, k and v read the same normalized activations), from a
  partial sum into Replicate: one all-reduce per pair in the backward too.

A vocabulary-parallel embedding (`P("tp", None)` on `nn.Embedding`) gives a masked partial sum,
all-reduced the same way; a vocabulary-parallel head gives logits sharded on the vocabulary, and a
cross-entropy of them (`F.cross_entropy`, what Hugging Face's losses call) runs on the shards
without gathering them: ignored labels, any reduction, class weights, label smoothing, and the
log-probabilities read by other terms too (Note [cross-entropy on the shards]). Other ops on the
sharded logits that DTensor has no sharded rule for (`softmax`, `logsumexp`) make it gather them
whole, reported as a fallback (below). The pointwise losses whose backward DTensor computes with a
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
on a gathered copy so that the write never reaches the tensor, is refused (`_in_place`).

Mixed precision: `reduce_dtype` holds for the tp all-reduces too: a partial sum is cast to it before
its all-reduce and back after, in the forward and in the backward. (The embedding's masked sum adds
zeros to one value, exact in any dtype: it is reduced in the compute dtype.)

Fallbacks. An op DTensor cannot compute on the shards as they come makes it gather a sharded
operand whole (an all-gather): the first step of each train step watches for that, and warns once
per (op, module) naming both. The exact result does not change; the rule for that leaf, or the
model's code, should. (GPT-2's `c_attn` packs q|k|v along its outputs: split on them it would hand
each rank a slice of q, k and v that the split into heads then gathers; its ready rules keep
`c_attn` whole on tp and split `c_fc`/`c_proj` of the MLP.)

Remat recomputes a unit's forward as far as its backward needs: a row-parallel layer whose output
nothing saves (the last of a block) is not run again, nor its all-reduce; the others are, all-reduce
included.

Rules (`shardfn/rules.py`). Ready `[(regex, P)]` lists, read and edited as any rules: Llama's family
splits q/k/v and gate/up on their outputs (`P("tp", None)`: heads and key/value heads must divide by
tp), o and down on their inputs (`P(None, "tp")`), the embedding and the head on the vocabulary;
GPT-2's `Conv1D` weights are `[in, out]`, so its column-parallel `c_fc` is `P(None, "tp")` and its
row-parallel `mlp.c_proj` is `P("tp", None)`; the packed q|k|v projections (GPT-2's `c_attn`, the
project GPT's `qkv`) stay whole on tp. Every other leaf is whole on tp and FSDP-sharded over dp.
"""

from __future__ import annotations

import re
import warnings
import weakref
from collections import Counter
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.utils._python_dispatch import TorchDispatchMode

from . import _collectives as C
from ._layouts import asked, gather_sequence
from ._spec import P, _chunk

__all__ = ["TensorParallel", "split_specs", "dp_dim", "state_spec", "local_part", "FallbackWarning"]


class FallbackWarning(UserWarning):
    """An op gathered a tensor-parallel activation whole (exact, but slower): Note [tensor parallel forward]."""


def split_specs(path: str, shape: torch.Size, spec: P, dp: str, tp: str, dp_size: int) -> int | None:
    """The dim `spec` splits over `tp` (None: whole on tp), checking that `dp` shares a dim with `tp`
    only as FSDP within the tp shard does (`(tp, dp)`; either order when `dp` has one rank)."""
    tp_dim = None
    for d in range(len(spec)):
        axes = spec.axes_of(d)
        if dp in axes and axes not in ((dp,), (tp, dp)) and not (dp_size == 1 and axes == (dp, tp)):
            # (dp, tp) on one dim is dp-major: a tp rank's rows would be strided, not the block the
            # tensor-parallel forward computes on; laying it out as (tp, dp) instead would silently
            # give another layout than the spec says.
            raise NotImplementedError(
                f"leaf {path!r} (shape {tuple(shape)}) has spec {spec!r}: on a ({dp}, {tp}) mesh the train step "
                f"FSDP-shards over {dp!r} within the {tp!r} shard; on dim {d} list them as ({tp!r}, {dp!r})"
            )
        if tp in axes:
            tp_dim = d
    return tp_dim


def dp_dim(spec: P, dp: str) -> int:
    """The dim a leaf is FSDP'd on over `dp`: the one `spec` names `dp` on, else dim 0."""
    return next((d for d in range(len(spec)) if dp in spec.axes_of(d)), 0)


def state_spec(tp_dim: int | None, fsdp: bool, ndim: int, dp: str, tp: str, fsdp_dim: int = 0) -> P:
    """The spec of a leaf split on `tp_dim` over tp and FSDP'd over dp on `fsdp_dim` within its tp
    shard (Note [tensor parallel forward]): `P(("tp", "dp"), None)`, `P("dp", "tp")`, `P("tp", "dp")`, ..."""
    entries: list = [None] * ndim
    if tp_dim is not None:
        entries[tp_dim] = tp
    if fsdp:
        entries[fsdp_dim] = (tp, dp) if tp_dim == fsdp_dim else dp
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def local_part(full: torch.Tensor, tp_dim: int | None, rank: int, size: int) -> torch.Tensor:
    """This tp rank's part of `full` (DTensor's Shard split: chunks of ceil(n / size))."""
    if tp_dim is None or size == 1:
        return full
    lo, hi = _chunk(0, full.shape[tp_dim], size, rank)
    return full.narrow(tp_dim, lo, hi - lo)


def local_shape(shape: torch.Size, tp_dim: int | None, rank: int, size: int) -> torch.Size:
    """The shape of `local_part` of a tensor of `shape`."""
    if tp_dim is None or size == 1:
        return torch.Size(shape)
    lo, hi = _chunk(0, shape[tp_dim], size, rank)
    return torch.Size((*shape[:tp_dim], hi - lo, *shape[tp_dim + 1 :]))


_REGISTERED = False


def _register_strategies() -> None:
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


def _partial(x: Any) -> bool:
    return isinstance(x, DTensor) and any(p.is_partial() for p in x.placements)


class TensorParallel:
    """The tensor-parallel side of one train step: the DTensors its forward computes on, the hooks
    that place its collectives, and what it did (Note [tensor parallel forward]).

    Args:
        mesh: the (dp, tp) mesh; `tp` names the tensor-parallel axis.
        tp_dims: per leaf, the dim split over tp (None: whole).
        shapes: per leaf, its global shape.
        reduce_dtype: the dtype partial sums are all-reduced in (None: their own).
    """

    def __init__(self, mesh: DeviceMesh, tp: str, tp_dims: list[int | None], shapes: list[torch.Size], reduce_dtype: torch.dtype | None):
        _register_strategies()
        self.mesh = mesh[tp]
        self.size = self.mesh.size()
        self.rank = self.mesh.get_local_rank()
        self.tp_dims = list(tp_dims)
        self.placements = [(Shard(d),) if d is not None else (Replicate(),) for d in tp_dims]
        self.shapes = [torch.Size(s) for s in shapes]
        self.strides = [torch.empty(s, device="meta").stride() for s in self.shapes]
        self.reduce_dtype = reduce_dtype
        self.stats: Counter = Counter()  # "forward" / "backward": all-reduces the steering issued
        self.watch = True  # watch for fallback gathers (the first step)
        self._reported: set[tuple[str, str]] = set()
        self._handles: list[Any] = []
        self.running: list[str] = []  # the modules holding a split leaf whose forward is running, innermost last
        self.sequence_gathers: dict = {}  # sequence parallelism's gathers, one per input (`_layouts.gather_sequence`)
        self.layouts: Any = None  # the step's `activation_specs` (`_layouts.ActivationSpecs`), acting inside `context()`

    def leaf(self, i: int, local: torch.Tensor) -> DTensor:
        """Leaf `i` as a DTensor on the tp mesh over its gathered shard `local` (a view, with autograd
        back to `local`), whose `.to_local()` is refused for a split leaf, exact for a whole one (`_Leaf`)."""
        d = DTensor.from_local(local, self.mesh, self.placements[i], run_check=False, shape=self.shapes[i], stride=self.strides[i])
        if self.size > 1:
            d.__class__ = _Leaf
            d._sf_tp = weakref.ref(self)  # type: ignore[attr-defined]
        return d

    # -- steering (Note [tensor parallel forward]) ----------------------------------------------
    def install(self, module: torch.nn.Module, split_paths: set[str]) -> None:
        """Hooks the submodules of `module` that hold a tp-split parameter (dotted names in `split_paths`)."""
        owners = {p.rpartition(".")[0] for p in split_paths}
        ref = weakref.ref(self)
        for name, mod in module.named_modules():
            if name in owners:
                self._handles.append(mod.register_forward_pre_hook(_pre_hook(ref, name)))
                self._handles.append(mod.register_forward_hook(_post_hook(ref, name), always_call=True))
        weakref.finalize(self, _remove, list(self._handles))  # the module outlives its steps

    def remove(self) -> None:
        """Takes the hooks off the modules."""
        _remove(self._handles)
        self._handles = []

    def replicate(self, x: DTensor, direction: str) -> DTensor:
        """A partial sum as Replicate: one all-reduce over tp, in `reduce_dtype` if set."""
        self.stats[direction] += 1
        dtype = x.dtype
        # A masked sum (the vocabulary-parallel embedding's) adds zeros to one value: exact in any
        # dtype, and DTensor cannot cast it before reducing; plain partial sums go in reduce_dtype.
        plain = all(type(p) is Partial or not p.is_partial() for p in x.placements)
        if self.reduce_dtype is not None and self.reduce_dtype != dtype and plain:
            x = x.to(self.reduce_dtype)
        x = C.redistribute(x, x.device_mesh, [Replicate()] * x.device_mesh.ndim, "the tensor-parallel forward")
        return x.to(dtype) if x.dtype != dtype else x

    def scatter(self, g: DTensor, placements: tuple) -> DTensor:
        """A partial gradient reduce-scattered onto `placements` (a sequence split: Note [activation
        layouts] in `_layouts.py`), in `reduce_dtype` if set."""
        self.stats["backward"] += 1
        dtype = g.dtype
        if self.reduce_dtype is not None and self.reduce_dtype != dtype:
            g = g.to(self.reduce_dtype)
        g = C.redistribute(g, g.device_mesh, list(placements), "sequence parallelism's reduce-scatter")
        return g.to(dtype) if g.dtype != dtype else g

    @contextmanager
    def context(self, same_randomness: bool = True) -> Iterator[None]:
        """The context a forward and its backward run in: plain tensors count as replicated;
        cross-entropy on vocabulary-sharded logits stays sharded; the fallback watch (first step).
        `same_randomness=False` skips the generator broadcast: a run on the meta device draws
        nothing, and `sf.estimate_memory` runs on one rank without its peers."""
        if same_randomness:
            self.same_randomness()
        self.sequence_gathers.clear()
        with ExitStack() as stack:
            if self.layouts is not None:
                self.layouts.running += 1
                stack.callback(setattr, self.layouts, "running", self.layouts.running - 1)
            stack.callback(self.sequence_gathers.clear)
            stack.enter_context(implicit_replication())
            stack.enter_context(_loss_parallel())
            stack.enter_context(_dropout_whole(self))
            if self.watch:
                stack.enter_context(_GatherWatch(self))
            try:
                yield
            except NotImplementedError as e:
                found = re.search(r"Operator (\S+) does not have a sharding strategy", str(e))
                if found is None:
                    raise
                raise NotImplementedError(
                    f"tensor parallel: torch's DTensor has no rule for {found.group(1)} on tensors split over tp, which "
                    "the loss or the model reached (in the forward, or in the backward for an op ending in _backward). "
                    "Compute it on a whole tensor (x.full_tensor() of the DTensor it got) or keep the leaves that feed "
                    "it whole on tp (a rule mapping them to P() before the ready rules)"
                ) from e

    def same_randomness(self) -> None:
        """Gives every rank of this tp group the generator state of its tp rank 0 (Note [randomness
        on tp peers])."""
        if self.size == 1:
            return
        src = int(self.mesh.mesh.flatten()[0])
        group = self.mesh.get_group()
        device = self.mesh.device_type
        state = torch.get_rng_state()
        t = state.to(device) if device != "cpu" else state
        C.broadcast(t, src, group)
        torch.set_rng_state(t.cpu())
        if device == "cuda":
            dev = torch.cuda.get_rng_state().cuda()
            C.broadcast(dev, src, group)
            torch.cuda.set_rng_state(dev.cpu())

    def report(self, op: str, module: str) -> None:
        if (op, module) in self._reported:
            return
        self._reported.add((op, module))
        warnings.warn(
            f"tensor parallel: {op} in {module or 'loss_fn'} gathered a tp-sharded tensor whole (exact, but each rank "
            "computes on the whole tensor): change that leaf's rule, or the code (Note [tensor parallel forward] in "
            "shardfn/_tp.py)",
            FallbackWarning,
            stacklevel=2,
        )


def _remove(handles: list) -> None:
    for h in handles:
        h.remove()


def _pre_hook(ref: Any, name: str):
    def pre(mod: torch.nn.Module, args: tuple) -> tuple | None:
        tp = ref()
        if tp is None:
            return None
        tp.running.append(f"{name!r} ({type(mod).__name__})")
        # Sequence parallelism: an input split on its sequence is gathered whole first (Note
        # [activation layouts] in `_layouts.py`); the gradient hook below then sits on the gather.
        w = getattr(mod, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2:  # a linear layer (nn.Linear, GPT-2's Conv1D): features last
            gathered = tuple(gather_sequence(a, tp.sequence_gathers) for a in args)
        else:
            gathered = args
        changed = any(g is not a for g, a in zip(gathered, args))
        if torch.is_grad_enabled():
            for a, was in zip(gathered, args):
                if isinstance(a, DTensor) and a.requires_grad and not getattr(a, "_sf_tp_hooked", False):
                    # A gathered sequence's partial gradient goes straight back to the sequence split:
                    # one reduce-scatter (Megatron-SP), not an all-reduce and a slice.
                    a.register_hook(_grad_hook(ref) if a is was else _grad_hook(ref, tuple(was.placements)))
                    a._sf_tp_hooked = True  # type: ignore[attr-defined]
        return gathered if changed else None

    return pre


class _Leaf(DTensor):
    """A leaf as the tensor-parallel forward hands it to its module: a DTensor (its ops give plain
    DTensors) whose `.to_local()`, which code written for torch's own tensor parallelism calls, is
    served or refused here rather than failing inside DTensor. Whole on tp, the local tensor is the
    whole leaf: it is given, and its gradient (a DTensor: the ops around it computed on DTensors,
    the plain tensor counting as replicated) is made whole and handed back as the leaf's
    (`_WholeLocal`), where DTensor's own backward failed ("the local_tensor argument only accepts
    torch.Tensor but got DTensor"). Split on tp, a local shard beside DTensor activations cannot be
    computed exactly: refused, naming the module."""

    __slots__ = ()

    def to_local(self, *, grad_placements: Any = None) -> torch.Tensor:
        if all(p.is_replicate() for p in self.placements):
            return _WholeLocal.apply(self)
        tp = getattr(self, "_sf_tp", lambda: None)()
        where = f"module {tp.running[-1]}" if tp is not None and tp.running else "loss_fn (or a module holding no split leaf)"
        raise NotImplementedError(
            f"tensor parallel: {where} called .to_local() on its parameter of shape {tuple(self.shape)}, split over tp "
            f"({self.placements[0]}), as code written for torch's own tensor parallelism does. shardfn hands modules "
            "their parameters as DTensors over tp and computes on them as DTensors (Note [tensor parallel forward] in "
            "shardfn/_tp.py), so a local shard beside DTensor activations cannot be computed exactly. Compute on the "
            "DTensor itself (drop the .to_local() and any DTensor.from_local() of the result), or keep this leaf whole "
            "on tp (a rule mapping it to P() before the others)"
        )


class _WholeLocal(torch.autograd.Function):
    """The local tensor of a leaf whole on tp; its gradient, a DTensor or not, made whole (a partial
    sum all-reduced over tp) and handed back as a DTensor of the leaf's layout."""

    @staticmethod
    def forward(ctx, x: DTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = x._spec
        return x._local_tensor.view_as(x._local_tensor)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> DTensor:  # type: ignore[override]
        spec = ctx.spec
        if isinstance(g, DTensor):
            if any(not p.is_replicate() for p in g.placements):
                g = C.redistribute(g, g.device_mesh, [Replicate()] * g.device_mesh.ndim, "the tensor-parallel backward")
            g = g._local_tensor
        return DTensor(g.contiguous(), spec, requires_grad=False)


def _grad_hook(ref: Any, split: tuple | None = None):
    def hook(g: torch.Tensor) -> torch.Tensor | None:
        tp = ref()
        if tp is not None and _partial(g):
            if split is not None:
                return tp.scatter(g, split)
            return tp.replicate(g, "backward")
        return None

    return hook


def _post_hook(ref: Any, name: str):
    def post(mod: torch.nn.Module, args: tuple, out: Any) -> Any:
        tp = ref()
        if tp is not None and tp.running:
            tp.running.pop()
        if tp is not None and _partial(out):
            return tp.replicate(out, "forward")
        return None

    return post


@contextmanager
def _op_handlers(ops: dict) -> Iterator[None]:
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


def _by_default(op_call, args, kwargs):
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
        return handler(op_call, args, kwargs) if handler is not None else _by_default(op_call, args, kwargs)

    return run


# -- cross-entropy on vocabulary-sharded logits ---------------------------------------------------
@contextmanager
def _loss_parallel() -> Iterator[None]:
    """A cross-entropy on logits sharded on the class dim, computed on the shards (Note [cross-entropy
    on the shards]); DTensor's own rules wherever the class dim is not sharded."""
    from torch.distributed.tensor.parallel import loss as lp

    ops = {
        # op: (handler, the argument whose class dim decides, the argument holding that dim)
        torch.ops.aten._log_softmax.default: (lp._log_softmax_handler, 0, 1),
        torch.ops.aten._log_softmax_backward_data.default: (_log_softmax_backward, 1, 2),
        torch.ops.aten.nll_loss_forward.default: (lp._nll_loss_forward_handler, 0, None),
        torch.ops.aten.nll_loss2d_forward.default: (lp._nll_loss_forward_handler, 0, None),
        torch.ops.aten.nll_loss_backward.default: (_nll_loss_backward, 1, None),
        torch.ops.aten.nll_loss2d_backward.default: (_nll_loss_backward, 1, None),
    }

    def guarded(op, handler, arg, dim_arg):
        def run(op_call, args, kwargs):
            x = args[arg]
            dim = args[dim_arg] if dim_arg is not None else (1 if x.dim() > 1 else 0)
            dim = dim % max(x.dim(), 1)
            if isinstance(x, DTensor) and any(p.is_shard(dim) for p in x.placements):
                _refuse_empty_shards(x, dim)
                return handler(op_call, args, kwargs)
            return _by_default(op_call, args, kwargs)

        return run

    handlers = {op: guarded(op, handler, arg, dim_arg) for op, (handler, arg, dim_arg) in ops.items()}
    handlers[torch.ops.aten.masked_fill_.Scalar] = _zero_fill_partial
    handlers.update({op: _mean_loss_backward for op in _MEAN_LOSS_BACKWARDS})
    handlers.update({op: _scan_whole for op in _SCANS})
    handlers.update({op: _norm_replicated for op in _NORMS})
    handlers[torch.ops.aten.add_.Scalar] = _add_to_partial
    handlers[torch.ops.aten.add_.Tensor] = _add_to_partial
    handlers.update({op: _mean_loss_forward for op in _MEAN_LOSSES})
    handlers[torch.ops.aten.fill_.Scalar] = _fill
    handlers[torch.ops.aten.fill_.Tensor] = _fill
    handlers[torch.ops.aten.gather.default] = _gather_on_shards
    handlers.update({op: _pointwise_local for op in _POINTWISE_WITHOUT_RULES})
    handlers[torch.ops.aten.convolution.default] = _convolution
    handlers[torch.ops.aten.convolution_backward.default] = _convolution_backward
    handlers.update({op: _in_place(handlers.get(op)) for op in _IN_PLACE})
    with _op_handlers(handlers):
        yield


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
    return _by_default(op_call, args, kwargs)


# Vector norms: over a split dim DTensor leaves a partial norm (`_NormPartial`), which later ops treat
# as a partial SUM (torch 2.13): `x.norm(dim=d).sum()` sums the shards' norms, silently. Its result is
# made whole at once (one all-reduce of the reduced, small tensor).
_NORMS = (torch.ops.aten.linalg_vector_norm.default, torch.ops.aten.norm.Scalar, torch.ops.aten.norm.ScalarOpt_dim)


def _norm_replicated(op_call, args, kwargs):
    """A vector norm by DTensor's rule, its partial result (a norm over a split dim) made whole."""
    out = _by_default(op_call, args, kwargs)
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
        return _by_default(op_call, args, kwargs)
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
        return _by_default(op_call, args, kwargs)
    return _by_default(op_call, sum_args, sum_kwargs) / args[0].numel()


def _fill(op_call, args, kwargs):
    """`fill_` of a tp DTensor with a constant. Split or whole, each rank fills its own part (DTensor
    has no rule for `fill_.Tensor`, which `x[0] = v` reaches; a view that DTensor computed on a copy is
    refused before, by `_in_place`). A partial sum takes the value on its first part and zeros
    elsewhere (torch's `1 - x` of a partial `x`, in `cosine_embedding_loss`, is
    `empty_like(x).fill_(1).sub_(x)`, and DTensor fills every rank: the sum held tp times the value);
    a partial mean, max or min on every part. Anything else by DTensor's own rule."""
    x, value = args[0], _constant(args[1])
    if not isinstance(x, DTensor) or value is None:
        return _by_default(op_call, args, kwargs)
    if not any(p.is_partial() for p in x.placements):  # each rank fills its own part (no copy: `_in_place`)
        x._local_tensor.fill_(value)
        return x
    kinds = _partial_kinds(x)
    if kinds is None:
        return _by_default(op_call, args, kwargs)
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
        return _by_default(op_call, args, kwargs)
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
        return _by_default(op_call, args, kwargs)
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
        return _by_default(op_call, args, kwargs)
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
        return _by_default(op_call, args, kwargs)
    numel = args[1].numel()  # the whole input's (every operand has its shape)
    return _by_default(op_call, sum_args, sum_kwargs) / numel


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
    return _by_default(op_call, args, kwargs)


# -- dropout on tp-sharded activations ---------------------------------------------------------------
# Note [randomness on tp peers]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Ranks that differ only in their tp coordinate compute one forward: a replicated activation must
# get the same dropout mask on each, or the copies of the leaves that are whole on tp (norms, a
# whole head) are updated from different forwards and drift apart, silently. So each step starts
# by giving the tp group its tp rank 0's generator state (one small broadcast), and a dropout on a
# tp-sharded activation draws the mask of the WHOLE activation on every rank and keeps its own
# part: every rank draws as many numbers, so the generators stay in step (uneven shards would
# otherwise draw different counts), and the shards' masks are parts of one mask, as on one process,
# not copies of one pattern. Other random ops on sharded DTensors (`rand_like` of an activation)
# are the user's; dropout is what models call.

def _shard_dim(x: Any) -> int | None:
    """The dim a DTensor on a 1-D mesh is sharded on (None: not sharded, or not that kind)."""
    if not isinstance(x, DTensor) or x.device_mesh.ndim != 1 or not x.placements[0].is_shard():
        return None
    return x.placements[0].dim


@contextmanager
def _dropout_whole(tp: "TensorParallel") -> Iterator[None]:
    """Random fills and dropout on tp-sharded DTensors draw the whole tensor's numbers on every rank
    and keep their own part (Note [randomness on tp peers])."""
    aten = torch.ops.aten
    fills = [aten.bernoulli_.float, aten.uniform_.default, aten.normal_.default]  # CPU's dropout: bernoulli_

    # Every random op here runs on the local tensors, never through DTensor's own random path (its
    # generator tracker does not support CPU meshes, and would replace the generator state tp peers share).
    def fill(op_call, args, kwargs):
        x = args[0]
        if not isinstance(x, DTensor) or x.device_mesh.ndim != 1:
            return _by_default(op_call, args, kwargs)
        local = x._local_tensor
        dim = _shard_dim(x)
        if dim is None:  # whole on tp: every peer draws the same numbers from the same state
            op_call(local, *args[1:], **kwargs)
            if x.placements[0].is_partial() and x.device_mesh.get_local_rank() != 0:
                local.zero_()  # a partial sum holding the drawn values: tp rank 0's part, zeros elsewhere
            return x
        whole = torch.empty(x.shape, dtype=local.dtype, device=local.device)
        op_call(whole, *args[1:], **kwargs)
        local.copy_(local_part(whole, dim, x.device_mesh.get_local_rank(), x.device_mesh.size()))
        return x

    def dropout(op_call, args, kwargs):
        x, p = args[0], args[1]
        if not isinstance(x, DTensor) or x.device_mesh.ndim != 1:
            return _by_default(op_call, args, kwargs)
        train = args[2] if len(args) > 2 else kwargs.get("train")  # None: training, as ATen reads it
        local = x._local_tensor
        dim = _shard_dim(x)
        if dim is None or train is False or p == 0:
            out, mask = op_call(local, p, train)
        else:
            mask = torch.empty(x.shape, dtype=torch.bool, device=local.device).bernoulli_(1 - p)
            mask = local_part(mask, dim, x.device_mesh.get_local_rank(), x.device_mesh.size())
            out = local * mask * (1.0 / (1 - p) if p < 1 else 0.0)
        spec = dict(device_mesh=x.device_mesh, placements=x.placements, run_check=False, shape=x.shape, stride=x.stride())
        # The mask is a value every rank holds whole (not a partial sum), or split as `x` is.
        mask_spec = {**spec, "placements": (Replicate(),)} if x.placements[0].is_partial() else spec
        return DTensor.from_local(out, **spec), DTensor.from_local(mask, **mask_spec)

    with _op_handlers({**{op: fill for op in fills}, aten.native_dropout.default: dropout}):
        yield


# -- the fallback watch --------------------------------------------------------------------------
def _module_tracker() -> Any:
    """torch's `ModuleTracker`, which names the modules running, minus the gradient hooks it puts on
    what a recompute (remat) computes inside the backward: each hook and the recomputed graph
    reference each other, so every recomputed unit's activations would stay alive until the step
    ends. A fallback in a recompute is still named by the module the recompute runs."""
    from torch.utils.module_tracker import ModuleTracker

    class Tracker(ModuleTracker):
        def _fw_pre_hook(self, mod, input):  # noqa: A002 - torch's signature
            if torch._C._current_graph_task_id() == -1:
                return super()._fw_pre_hook(mod, input)
            self._get_append_fn(self._get_mod_name(mod), True)()
            return None

        def _fw_post_hook(self, mod, input, output):  # noqa: A002
            if torch._C._current_graph_task_id() == -1:
                return super()._fw_post_hook(mod, input, output)
            self._get_pop_fn(self._get_mod_name(mod), True)()
            return None

    return Tracker()


class _GatherWatch(TorchDispatchMode):
    """Sees the all-gathers DTensor issues to compute an op, and which op and module asked."""

    def __init__(self, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.op = None
        self.modules = _module_tracker()

    def __enter__(self):
        self.modules.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self.modules.__exit__(*exc)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            self.op = func
            return NotImplemented
        name = str(func)
        if "c10d_functional" in name and "all_gather" in name and not asked():  # DTensor's; the engine's go through c10d
            parents = [p for p in self.modules.parents if p != "Global"]
            self.tp.report(str(self.op), max(parents, key=len) if parents else "")
        return func(*args, **(kwargs or {}))


