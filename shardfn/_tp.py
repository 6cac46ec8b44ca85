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

Layout: Note [tensor parallel layout] in `_tp_layout.py` (the state's DTensors carry both splits).

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

Ops that torch 2.13's DTensor computes wrong or refuses on these shards (cross-entropy on sharded
logits, scans, norms, pointwise losses, fills, gathers, convolutions, in-place writes through
views) are mended by custom handlers: `_dtensor_mends.py`, one list to delete on upgrade.

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
from ._dtensor_mends import by_default, mended, op_handlers, register_strategies
from ._layouts import asked, gather_sequence
from ._tp_layout import local_part

__all__ = ["TensorParallel", "FallbackWarning"]


class FallbackWarning(UserWarning):
    """An op gathered a tensor-parallel activation whole (exact, but slower): Note [tensor parallel forward]."""


def _partial(x: Any) -> bool:
    return isinstance(x, DTensor) and any(p.is_partial() for p in x.placements)


_LIVE: "weakref.WeakValueDictionary[int, TensorParallel]" = weakref.WeakValueDictionary()


@torch.library.custom_op("shardfn::count_steering", mutates_args=())
def _count_steering_op(x: torch.Tensor, tp_id: int, direction: str) -> None:
    tp = _LIVE.get(tp_id)
    if tp is not None:
        tp.stats[direction] += 1


@_count_steering_op.register_fake
def _(x: torch.Tensor, tp_id: int, direction: str) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.shardfn.count_steering.default)


def _count_steering(tp: "TensorParallel", direction: str, x: torch.Tensor) -> None:
    """Counts a collective of the steering (of `x`) in `tp.stats`; traced into a compiled unit, an op
    of its graph that counts on every run, given `tp` by its id (as `C.count`; Note [compiled units]
    in `_compiled.py`)."""
    if torch.compiler.is_compiling():
        torch.ops.shardfn.count_steering(C.local_of(x), id(tp), direction)
    else:
        tp.stats[direction] += 1


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
        register_strategies()
        self.mesh = mesh[tp]
        self.size = self.mesh.size()
        self.rank = self.mesh.get_local_rank()
        self.tp_dims = list(tp_dims)
        self.placements = [(Shard(d),) if d is not None else (Replicate(),) for d in tp_dims]
        self.shapes = [torch.Size(s) for s in shapes]
        self.strides = [torch.empty(s, device="meta").stride() for s in self.shapes]
        self.reduce_dtype = reduce_dtype
        self.stats: Counter = Counter()  # "forward" / "backward": all-reduces the steering issued
        _LIVE[id(self)] = self
        self.watch = True  # watch for fallback gathers (the first step)
        # Compiled steps (Note [compiled units] in `_compiled.py`): the leaves are plain DTensors, and
        # the modules whose code took the local tensor of a leaf (`_Leaf.to_local`) in an eager step.
        self.plain_leaves = False
        self.local_reads: list[str] = []
        self._reported: set[tuple[str, str]] = set()
        self._handles: list[Any] = []
        self.running: list[str] = []  # the modules holding a split leaf whose forward is running, innermost last
        self.sequence_gathers: dict = {}  # sequence parallelism's gathers, one per input (`_layouts.gather_sequence`)
        self.layouts: Any = None  # the step's `activation_specs` (`_layouts.ActivationSpecs`), acting inside `context()`

    def leaf(self, i: int, local: torch.Tensor) -> DTensor:
        """Leaf `i` as a DTensor on the tp mesh over its gathered shard `local` (a view, with autograd
        back to `local`), whose `.to_local()` is refused for a split leaf, exact for a whole one (`_Leaf`)."""
        d = DTensor.from_local(local, self.mesh, self.placements[i], run_check=False, shape=self.shapes[i], stride=self.strides[i])
        if self.size > 1 and not self.plain_leaves:
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
                # Not always_call: dynamo guards on each such hook's id, a graph per block when compiled.
                # A forward that raises leaves its name in `running` until the step's context ends.
                self._handles.append(mod.register_forward_hook(_post_hook(ref, name)))
        weakref.finalize(self, _remove, list(self._handles))  # the module outlives its steps

    def remove(self) -> None:
        """Takes the hooks off the modules."""
        _remove(self._handles)
        self._handles = []

    def replicate(self, x: DTensor, direction: str) -> DTensor:
        """A partial sum as Replicate: one all-reduce over tp, in `reduce_dtype` if set."""
        _count_steering(self, direction, x)
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
        _count_steering(self, "backward", g)
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
            stack.callback(self.running.clear)
            stack.enter_context(implicit_replication())
            stack.enter_context(mended())
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

    def steer_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A compiled unit's inputs (eager, before its graph runs): each DTensor that needs a gradient
        passes through an identity whose backward makes a partial gradient whole over tp, as the
        eager step's hooks do inside the unit (Note [compiled units] in `_compiled.py`)."""
        ref = weakref.ref(self)

        def steer(x: Any) -> Any:
            return _SteerGrad.apply(x, ref) if isinstance(x, DTensor) and x.requires_grad and torch.is_grad_enabled() else x

        return tuple(steer(a) for a in args), {k: steer(v) for k, v in kwargs.items()}

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
        if not torch.compiler.is_compiling():  # for eager errors; traced, each name would be a graph
            tp.running.append(f"{name!r} ({type(mod).__name__})")
        # Sequence parallelism: an input split on its sequence is gathered whole first (Note
        # [activation layouts] in `_layouts.py`); the gradient hook below then sits on the gather.
        w = getattr(mod, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2:  # a linear layer (nn.Linear, GPT-2's Conv1D): features last
            gathered = tuple(gather_sequence(a, tp.sequence_gathers) for a in args)
        else:
            gathered = args
        changed = any(g is not a for g, a in zip(gathered, args))
        # Compiled (Note [compiled units] in `_compiled.py`): no hook. One traced here would decide on
        # a gradient layout that dynamo guesses at the forward; the partial sums stay DTensors in the
        # unit's backward, and what leaves the unit is made whole where it leaves (`steer_inputs`).
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
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
        tp = getattr(self, "_sf_tp", lambda: None)()
        where = f"module {tp.running[-1]}" if tp is not None and tp.running else "loss_fn (or a module holding no split leaf)"
        if all(p.is_replicate() for p in self.placements):
            if tp is not None and where not in tp.local_reads:
                tp.local_reads.append(where)
            return _WholeLocal.apply(self)
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


class _SteerGrad(torch.autograd.Function):
    """The identity, whose backward (eager) does what `_grad_hook` does: a partial gradient made
    whole over tp."""

    @staticmethod
    def forward(ctx, x: DTensor, ref: Any) -> DTensor:  # type: ignore[override]
        ctx.ref = ref
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: DTensor) -> tuple:  # type: ignore[override]
        steered = _grad_hook(ctx.ref)(g)
        return (g if steered is None else steered), None


def _post_hook(ref: Any, name: str):
    def post(mod: torch.nn.Module, args: tuple, out: Any) -> Any:
        tp = ref()
        if tp is not None and tp.running and not torch.compiler.is_compiling():
            tp.running.pop()
        if tp is not None and _partial(out):
            return tp.replicate(out, "forward")
        return None

    return post


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
            return by_default(op_call, args, kwargs)
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
            return by_default(op_call, args, kwargs)
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

    with op_handlers({**{op: fill for op in fills}, aten.native_dropout.default: dropout}):
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


