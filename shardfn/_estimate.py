"""`sf.estimate_memory`: the per-rank memory of a train step, before any buffer exists.

Note [memory estimate]
----------------------
The estimate replays one step of the engine's plan on paper, in the order the engine runs it.

- The layout is the step's own: `StepLayout.unit_layout` (`_step_layout.py`) groups the model's units and assigns
  leaves exactly as `step.init` would, `buffer_sizes` sizes each group's buffers
  (Note [flat unit layout] in `_flat.py`) and `StepLayout.policy` decides the strategy's
  choices (slot arenas, how many reductions overlap), for any world size, without allocating any
  of them: param and gradient shards, the slot arenas shared by units in forward order (Note
  [slot arenas], Note [unit plan]) and the reduction arenas are the sizes the engine would make.
- What the model computes comes from running it: `loss_fn` runs once on the meta device, on
  unsharded parameters of the compute dtype and a meta copy of one micro-batch, forward and
  backward, under a dispatch mode that counts every tensor allocated and freed (autograd's saved
  tensors, gradients of activations, temporaries inside the backward) and marks each unit's
  forward, the start of its backward and each parameter's gradient. A unit chosen for `remat`
  runs under the same checkpoint as in the step, so its recompute is counted where it happens.
- The two are merged on the meta run's clock: the meta run marks the events the engine's hooks
  see (each unit's forward and its end, inputs that need a gradient and the end of that use's
  backward, the start of each use's backward, a recompute, each parameter's gradient), and the
  estimate replays them through the engine's own `Schedule` (Note [the schedule's moves] in
  `_schedule.py`), acting on byte counts instead of buffers (`_Sim`, a `Buffers`): every gather,
  free, deferred prefetch, slot release and reduction in flight happens where the engine does it,
  with the arenas of the same slot plan (`arena_plan`), and each parameter's full gradient is held
  from its arrival until its unit is reduced (the root's until the end of the backward). The peak
  is the largest sum of the state (param shards, gradient shards, optimizer state, module buffers),
  the buffers live at that moment and the meta run's live bytes; where it happens is reported as
  the phase and the unit running.
- The optimizer's state is what its `init` makes for meta shards of the trained leaves; the
  temporaries of its update are measured on a small real copy (each leaf scaled down) and scaled
  back up.
- Tensor parallel (a (dp, tp) mesh, Note [tensor parallel forward] in `_tp.py`): for the plan a
  leaf is this rank's tp shard, so parameter, gradient and optimizer shards are the tp shards split
  over dp. The meta run computes on meta DTensors over the step's own tp mesh, with the step's
  steering hooks and context, each unit's views made as the unit starts, as the engine makes them
  (autograd runs the ready node made last first: views made before the forward would hold every
  gradient to the end of the backward), so DTensor runs every op on the local meta shards: the counter lets
  DTensor dispatch and counts the local tensors it computes, so activations count at their local
  size and the collectives' outputs (the tp all-reduces, the vocabulary-parallel cross-entropy's)
  as any tensor. The fake tensors DTensor's sharding propagation computes global shapes on hold no
  memory and are not counted. What it cannot count yet it refuses (`NotEstimated`, a
  `NotImplementedError` naming it) rather than give a wrong figure: fused attention over DTensors
  off the CPU, where the meta shards beneath would take the math path.

Two steps are replayed, as the engine runs them: the first, with an arena per unit and the order
unknown until its first forward ends, which plans the slots from its units' busy spans at the end of
its first reducing micro-batch (Note [unit plan]; a unit busy alongside others, as T5's first
block, keeps an arena of its own there too), and a planned step; the peak is the larger. Assumed:
every micro-batch runs as the one the meta run ran, and a step whose units run off the schedule
(Note [steps off the unit schedule]) is estimated as if on it. The model's own checks on its data cannot run on meta
tensors: a truth test reads true, a number read from a tensor is refused.

What it cannot see: memory outside the tensors of this process. A collective library's own
buffers (NCCL's channels and scratch, set by `NCCL_BUFFSIZE` and the number of channels; gloo's
internal copies in an all-reduce), the allocator's caching and fragmentation, the CUDA context,
and kernels' private workspaces. Leave room for them: `MemoryEstimate.fits`, `max_batch` and
`min_world` keep `RESERVE` of the budget free; the check before a step (`check_memory`) refuses
only what exceeds the budget itself.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import optree
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from . import _collectives as C
from ._engine import _PostBackward, _PostBackwardEager
from ._flat import _split_dim, _together, buffer_sizes, place
from ._functorch import unwrap
from ._manual import step_region
from ._named import lift
from ._recompute import UnitViews
from . import _schedule as schedule
from ._schedule import ROOT, Phase

__all__ = ["MemoryEstimate", "estimate_memory", "RESERVE", "device_budget", "MemoryCheckError"]

RESERVE = 0.10
"""The share of a memory budget the estimate leaves free for what it cannot see (Note [memory estimate])."""

CATEGORIES = (
    ("params", "parameter shards"),
    ("grads", "gradient shards"),
    ("optimizer", "optimizer state"),
    ("buffers", "module buffers"),
    ("units", "gathered units (arenas)"),
    ("comm", "communication buffers"),
    ("unit_grads", "full gradients of units"),
    ("activations", "activations and temporaries"),
    ("update", "optimizer update temporaries"),
)


class NotEstimated(NotImplementedError):
    """What `sf.estimate_memory` cannot count exactly yet: it refuses rather than give a wrong figure."""


class MemoryCheckError(MemoryError):
    """A train step's estimated peak exceeds the memory available to it (`check_memory`)."""


def _fmt(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class MemoryEstimate:
    """The estimated per-rank memory of a train step (bytes); see `sf.estimate_memory`.

    Attributes:
        peak: the largest total at any moment of the step.
        at_peak: the total at the peak, by category (see `CATEGORIES`): it sums to `peak`.
        largest: each category's largest value in the step.
        phase, unit: where the peak happens: "forward", "backward" or "optimizer", and the unit
            running then ("" for the root or none).
        first_step: whether the peak is in the first step, which runs before the engine plans its
            slot arenas (Note [unit plan]) and learns which unit is the last (`keep_last_unit`).
        world, rank: the shard world size and rank it is for.
        host: with `offload="cpu"` on CUDA, the host memory the shards, gradients and optimizer
            state take, which `peak` (device memory) leaves out; else 0. Each unit's shard and
            gradient buffer is pinned, counted as torch's pinned allocator takes it (rounded up to
            a power of two).
        batch_size: the per-rank batch (dim 0 of the batch's leaves), or None without a batch.
    """

    peak: int
    at_peak: dict
    largest: dict
    phase: str
    unit: str
    world: int
    rank: int
    batch_size: int | None = None
    first_step: bool = False
    host: int = 0
    _redo: Callable | None = field(default=None, repr=False)

    def __getitem__(self, key: str) -> int:
        if key == "peak":
            return self.peak
        if key in self.at_peak:
            return self.at_peak[key]
        raise KeyError(f"{key!r}: the keys are 'peak' and {list(self.at_peak)}")

    def keys(self) -> list[str]:
        return ["peak", *self.at_peak]

    def fits(self, budget: int | None = None) -> bool:
        """Whether the peak fits in `budget` bytes (default: the device's free memory, `device_budget`)
        with `RESERVE` of it left free."""
        budget = device_budget() if budget is None else budget
        return self.peak <= budget * (1 - RESERVE)

    def max_batch(self, budget: int | None = None, limit: int = 1 << 20) -> int:
        """The largest per-rank batch (dim 0 of every batch leaf, as given to the step) whose peak
        fits `budget` bytes (default: the device's free memory) with `RESERVE` left; 0 if none does.
        Batches are tried as multiples of the accumulation steps."""
        if self._redo is None or self.batch_size is None:
            raise ValueError("max_batch needs an estimate made with a batch: sf.estimate_memory(step, params, batch=...)")
        budget = device_budget() if budget is None else budget
        k = self._redo(None, None, "k")
        fits = lambda b: self._redo(b, None, None).fits(budget)  # noqa: E731
        lo, hi = 0, k
        while hi <= limit and fits(hi):
            lo, hi = hi, hi * 2
        hi = min(hi, limit + k)
        while hi - lo > k:  # lo fits (or is 0), hi does not
            mid = (lo + hi) // 2 // k * k
            if mid <= lo:
                break
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def min_world(self, budget: int | None = None, worlds: tuple[int, ...] = tuple(2**i for i in range(11))) -> int | None:
        """The smallest shard world size among `worlds` (default 1, 2, 4, ... 1024) at which this
        step, with this per-rank batch, fits `budget` bytes per rank (default: the device's free
        memory) with `RESERVE` left; None if none does. Rank 0's share is estimated (the largest:
        uneven splits give the first ranks the extra rows)."""
        if self._redo is None:
            raise ValueError("this estimate cannot be redone")
        budget = device_budget() if budget is None else budget
        for w in sorted(worlds):
            if self._redo(None, w, None).fits(budget):
                return w
        return None

    def table(self) -> list[tuple[str, int, int]]:
        """Rows (what, bytes at the peak, largest bytes in the step), the total last."""
        rows = [(label, self.at_peak.get(key, 0), self.largest.get(key, 0)) for key, label in CATEGORIES]
        return rows + [("peak", self.peak, self.peak)]

    def __str__(self) -> str:
        where = f"{self.phase}" + (f", unit {self.unit!r}" if self.unit else "") + (" of the first step" if self.first_step else "")
        head = f"estimated memory per rank (shard world {self.world}, rank {self.rank}): peak {_fmt(self.peak)} in the {where}"
        w = max(len(r[0]) for r in self.table())
        lines = [head, f"{'':{w}}  {'at peak':>12}  {'largest':>12}"]
        for label, at, big in self.table():
            lines.append(f"{label:{w}}  {_fmt(at):>12}  {_fmt(big):>12}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        import html

        where = f"{self.phase}" + (f", unit {html.escape(self.unit)}" if self.unit else "") + (" of the first step" if self.first_step else "")
        rows = "".join(
            f"<tr><td>{html.escape(label)}</td><td style='text-align:right'>{_fmt(at)}</td>"
            f"<td style='text-align:right'>{_fmt(big)}</td></tr>"
            for label, at, big in self.table()
        )
        return (
            f"<p>estimated memory per rank (shard world {self.world}, rank {self.rank}): peak "
            f"<b>{_fmt(self.peak)}</b> in the {where}</p><table><tr><th></th><th>at peak</th><th>largest</th></tr>{rows}</table>"
        )


def device_budget(device: str | torch.device | None = None) -> int:
    """The memory a step can still take on `device` (default: CUDA if available, else the CPU):
    CUDA's free memory (`torch.cuda.mem_get_info`), or the host's `MemAvailable`."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# -- counting tensors on the meta device ----------------------------------------------------------


def _wrappers() -> tuple[type, ...]:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    return (DTensor, AsyncCollectiveTensor)


_WRAPPERS = _wrappers()


# Ops whose output shape depends on their input's values: on the meta device torch cannot run them.
_DATA_SHAPED = frozenset(
    getattr(torch.ops.aten, name).default if hasattr(getattr(torch.ops.aten, name), "default") else getattr(torch.ops.aten, name)
    for name in ("nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "argwhere")
    if hasattr(torch.ops.aten, name)
)


def _data_shaped(func: Any) -> NotImplementedError:
    return NotImplementedError(
        f"loss_fn computes a tensor whose shape depends on values ({func}: boolean-mask indexing x[mask], "
        "nonzero, masked_select, unique): sf.estimate_memory runs the model on the meta device, where tensors "
        "hold no values. Compute such indices outside loss_fn (bind them in), or estimate without a batch"
    )


class _Counter(TorchDispatchMode):
    """Counts the bytes of every storage an op creates, until it is freed; a timeline of marks."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.cur = 0
        self.peak = 0
        self.excluded: set[int] = set()  # storages that existed before
        self.untracked: set[int] = set()  # storages counted elsewhere (gradients of parameters)
        self.events: list[tuple] = []  # (kind, arg, bytes live after)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, _WRAPPERS) for t in types):
            # A DTensor (tensor parallel) holds no storage of its own: it runs the op on its local
            # tensors, which come back through this mode and are counted at their local size, with
            # the collectives' buffers.
            return NotImplemented
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            # A model's check on its data (Hugging Face's "are these packed sequences?" reads
            # `bool(...)`): no data here, so a truth test reads true and a number is refused.
            if args[0].dtype == torch.bool:
                return True
            raise NotImplementedError(
                "loss_fn reads a number from a tensor (.item(), int(t), a shape computed from data): "
                "sf.estimate_memory runs the model on the meta device, where tensors hold no values. "
                "Compute such numbers outside loss_fn (bind them in), or estimate without a batch"
            )
        if func in _DATA_SHAPED and any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args[:1]):
            raise _data_shaped(func)
        try:
            out = func(*args, **(kwargs or {}))
        except NotImplementedError as e:  # an op whose meta kernel calls nonzero itself (x[mask] is aten.index)
            if "nonzero" in str(e) and any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in pytree.tree_leaves(args)):
                raise _data_shaped(func) from e
            raise
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out

    def track(self, t: torch.Tensor) -> None:
        if isinstance(t, FakeTensor):  # DTensor's sharding propagation computes shapes on fake tensors: no memory
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live or key in self.excluded or key in self.untracked:
            return
        n = st.nbytes()
        self.live[key] = n
        self.cur += n
        if self.cur > self.peak:
            self.peak = self.cur
        self.events.append(("mem", None, self.cur))
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        n = self.live.pop(key, None)
        if n is None:
            self.untracked.discard(key)
            return
        self.cur -= n
        self.events.append(("mem", None, self.cur))

    def untrack(self, t: torch.Tensor) -> int:
        """Stops counting `t`'s storage (a parameter's gradient, counted by the schedule instead)."""
        key = t.untyped_storage()._cdata
        n = self.live.pop(key, None)
        if n is None:
            return 0
        self.untracked.add(key)
        self.cur -= n
        return n

    def known(self, tensors) -> None:
        """Storages that exist already (parameters, the batch, buffers): views of them are not new."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.excluded.add(t.untyped_storage()._cdata)

    def mark(self, kind: str, arg: Any = None) -> None:
        self.events.append((kind, arg, self.cur))


class _Probe:
    """A unit runtime (Note [unit runtime]) for the meta run: marks each unit's forward and the
    start of its backward, casts inputs as the engine does, asks for remat as the engine does, and
    puts back what a recompute of the model's own checkpointing reads, as the engine does (Note
    [the model's own checkpointing] in `_recompute.py`: a reentrant recompute computes the unit's
    gradients on those tensors)."""

    def __init__(self, info, counter: _Counter, cast_dtype, remat_units: set[int]):
        self.info = info
        self.counter = counter
        self.cast_dtype = cast_dtype
        self.remat_units = remat_units
        self.phase = Phase.FORWARD
        self.views = UnitViews(info) if info is not None else None
        self._running: list = []  # per running unit use: the view its forward recorded

    def _cast(self, tree):
        return schedule.cast_floating(tree, self.cast_dtype)

    tree: Any = None  # the parameter tree handed to loss_fn

    def flat_params(self, apply, params):
        """`apply` computes on the tree as handed to it (with tensor parallel: its meta DTensors, which
        `apply` would gather whole without a runtime that owns them)."""
        flat = apply.flat_params(params) if params is self.tree and apply.info is self.info else None
        if self.views is not None and apply.info is self.info:
            self.views.record_root(flat)
        return flat

    def cast_inputs(self, info, args, kwargs):
        if self.cast_dtype is None or info is not self.info:
            return args, kwargs
        return self._cast(args), self._cast(kwargs)

    def pre_forward(self, info, u, args, kwargs):
        if info is not self.info:
            return None
        if self.phase != Phase.FORWARD:  # a recompute by the model's own checkpoint around the unit
            self.counter.mark("recompute", u)
            self.views.for_recompute(u, info.unit_names[u])
            return (self._cast(args), self._cast(kwargs)) if self.cast_dtype is not None else None
        self.counter.mark("fwd", u)
        self._fresh_views(u)
        self._running.append(self.views.record(u))
        if self.cast_dtype is not None:
            args, kwargs = self._cast(args), self._cast(kwargs)
        if torch.is_grad_enabled():  # the end of this use's backward, as `Engine.pre_forward` hooks it
            flat, spec = pytree.tree_flatten((args, kwargs))
            idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and unwrap(x).requires_grad]
            if idx:
                fn = _PostBackward if torch._C._are_functorch_transforms_active() else _PostBackwardEager
                for i, o in zip(idx, fn.apply(self, u, *(flat[i] for i in idx))):
                    flat[i] = o
                args, kwargs = pytree.tree_unflatten(flat, spec)
                self.counter.mark("hooked", u)
        return args, kwargs

    def use_over(self, u) -> None:
        self.counter.mark("bwd_end", u)

    def remats(self, unit: int) -> bool:
        return unit in self.remat_units

    swaps: dict = {}  # tensor parallel: unit -> [(module, attribute, leaf)]
    view: Any = None  # leaf -> a new DTensor over its meta shard

    def _fresh_views(self, u) -> None:
        """Tensor parallel: the unit computes on DTensor views made as it starts, as the engine makes
        them (Note [tensor parallel forward]). Autograd runs ready nodes newest first, so views made
        before the forward would hold every gradient until the end of the backward."""
        for mod, attr, i in self.swaps.pop(u, ()):
            if mod._parameters.get(attr) is self.tree_leaves[i]:
                mod._parameters[attr] = self.view(i)

    def post_forward(self, info, u, output):
        if info is not self.info or self.phase != Phase.FORWARD:
            return None
        self.counter.mark("fwd_end", u)
        view = self._running.pop() if self._running else None
        if torch.is_grad_enabled():
            tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                counter, views = self.counter, self.views

                def begin(_g, u=u, v=view):
                    views.put_back(u, v)
                    counter.mark("bwd", u)

                torch.autograd.graph.register_multi_grad_hook(tensors, begin, mode="any")
        return None


class _AttentionAsOn:
    """On the meta device, `scaled_dot_product_attention` takes the math path, which keeps the
    attention matrix; the device the step runs on takes a fused kernel that keeps far less. While
    active, `F.scaled_dot_product_attention` on meta tensors runs the kernel that device would
    choose (its meta version), so that the count is that device's; it is put back on exit."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self._orig = None

    def __enter__(self):
        F = torch.nn.functional
        self._orig = orig = F.scaled_dot_product_attention

        def sdpa(*args, **kwargs):
            if args and isinstance(args[0], _WRAPPERS[0]) and self.device_type != "cpu":
                # On tp shards DTensor picks the kernel from the device it reports, and the meta
                # shards beneath would take the math path: checked on the CPU only.
                raise NotEstimated(
                    f"sf.estimate_memory of scaled_dot_product_attention on tensor-parallel shards on {self.device_type!r}: "
                    "the activations of torch's fused attention over DTensors are estimated on the CPU only for now. "
                    "Measure a step instead (torch.cuda.max_memory_allocated), or estimate without a batch (the state alone)"
                )
            if args and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta":
                try:
                    out = self._fused(*args, **kwargs)
                except Exception:  # noqa: BLE001 - no fused kernel for this call: the math path, as counted
                    out = None
                if out is not None:
                    return out
            return orig(*args, **kwargs)

        F.scaled_dot_product_attention = sdpa
        return self

    def __exit__(self, *exc):
        torch.nn.functional.scaled_dot_product_attention = self._orig
        return False

    def _choice(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> int:
        dev = torch.device(self.device_type)
        small = [torch.zeros((1, *t.shape[1:]), dtype=t.dtype, device=dev).requires_grad_(t.requires_grad) for t in (q, k, v)]
        mask = None if attn_mask is None else torch.zeros((1, *attn_mask.shape[1:]), dtype=attn_mask.dtype, device=dev)
        if mask is not None and attn_mask.shape[0] != q.shape[0]:
            mask = torch.zeros(attn_mask.shape, dtype=attn_mask.dtype, device=dev)
        choice = torch._fused_sdp_choice(*small, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        del small, mask
        return choice

    def _fused(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if (self.device_type == "cuda" and not torch.cuda.is_available()) or self.device_type not in ("cpu", "cuda"):
            return None
        with _disable_current_modes():  # a real probe of the device's choice, not counted
            choice = self._choice(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if self.device_type == "cpu":
            if choice != 1:
                return None
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            return None  # the CUDA kernels take repeated heads: the math path's count is close enough
        if choice == 1 and attn_mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        if choice == 2:
            return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale)[0]
        return None


def _meta_like(x: Any, dtype=None) -> Any:
    if isinstance(x, torch.Tensor):  # a DTensor's shape is its global one
        return torch.empty(x.shape, dtype=dtype or x.dtype, device="meta")
    return x


def _swap_buffers(module: torch.nn.Module, dtype) -> list:
    """Puts meta copies of the module's buffers in place (mixed precision's dtype on floating ones);
    returns what to put back."""
    saved = []
    for mod in module.modules():
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            saved.append((mod, name, b))
            dt = dtype if (dtype is not None and b.is_floating_point()) else b.dtype
            mod._buffers[name] = torch.empty(b.shape, dtype=dt, device="meta")
    return saved


def _attributes(module: torch.nn.Module) -> list[tuple[torch.nn.Module, dict]]:
    """Each module's attributes as they are (a shallow copy of its `__dict__`), to put back after a
    run on the meta device: a forward that caches what it computes (`self.table = ...`, a position
    table made on the input's device) would otherwise leave meta tensors in the model."""
    return [(mod, dict(mod.__dict__)) for mod in module.modules()]


def _put_back(saved: list[tuple[torch.nn.Module, dict]]) -> None:
    """The modules' attributes as `_attributes` found them: changed ones back, new ones gone."""
    for mod, before in saved:
        now = mod.__dict__
        for k in [k for k in now if k not in before]:
            del now[k]
        for k, v in before.items():
            if now.get(k, _MISSING) is not v:
                now[k] = v


_MISSING = object()


def _run_meta(core, info, paths, treespec, leaves, trained, unit_dtype, micro, attention=None) -> _Counter:
    """Runs `loss_fn` forward and backward on meta tensors; returns the counter (its timeline).
    With tensor parallel, on meta DTensors over the step's tp mesh, steered as the step steers them.
    `attention`: context parallelism's ring (a context manager factory), which the model's attention
    calls run as, over the device's own kernel (`_AttentionAsOn`)."""
    counter = _Counter()
    cast = core.mp.param_dtype
    metas = []
    for i, leaf in enumerate(leaves):
        t = torch.empty(core.layout.shapes[i] if core.layout.tp_axis is not None else leaf.shape, dtype=unit_dtype[i], device="meta")
        if trained[i]:
            t.requires_grad_(True)

            def hook(p, i=i):
                n = counter.untrack(p.grad)
                counter.mark("grad", (i, n))
                p.grad = None

            t.register_post_accumulate_grad_hook(hook)
        metas.append(t)
    tp, own_tp = _tensor_parallel(core, info, paths, leaves)
    tree = optree.tree_unflatten(treespec, [tp.leaf(i, t) for i, t in enumerate(metas)] if tp is not None else metas)
    remat = set()
    if core.remat and info is not None:
        from ._remat import install, select_units

        remat = select_units(core.remat, info.unit_names)
        for u in remat:
            install(info, u)
    probe = _Probe(info, counter, cast, remat)
    probe.tree = tree
    if tp is not None and info is not None:
        probe.tree_leaves = optree.tree_leaves(tree)
        probe.view = lambda i: tp.leaf(i, metas[i])
        probe.swaps = {}
        for i, path in enumerate(paths):
            if info.unit_of[path] >= 0:
                for name in info.aliases[path]:
                    owner, _, attr = name.rpartition(".")
                    probe.swaps.setdefault(info.unit_of[path], []).append((info.module.get_submodule(owner), attr, i))
    saved = _swap_buffers(info.module, core.mp.buffer_dtype) if info is not None else []
    attributes = _attributes(info.module) if info is not None else []
    from . import _runtime

    counter.known(metas)
    counter.known(optree.tree_leaves(micro))
    if info is not None:
        counter.known(info.module.buffers())
        counter.known(info.module.parameters())
    stats = (tp.stats.copy(), tp.watch) if tp is not None else None
    try:
        with contextlib.ExitStack() as stack:
            if tp is not None:
                tp.watch = False  # the step's first step reports what gathers
                stack.enter_context(tp.context(same_randomness=False))  # no collective: one rank may estimate alone
            stack.enter_context(_AttentionAsOn(core.mesh.device_type))
            if attention is not None:  # inside: the ring is what the model calls (its blocks on the fused kernel)
                stack.enter_context(attention())
            stack.enter_context(counter)
            stack.enter_context(_runtime.activate(probe, info))
            stack.enter_context(torch.enable_grad())
            # the named collectives loss_fn may call (sf.psum of a global token count) run on meta
            # tensors in the step's region, as in the step (Note [named collectives in a step])
            stack.enter_context(step_region(core.mesh, core.layout.data_axes, lift))
            out = core.loss_fn(tree, micro)
            loss = out[0] if isinstance(out, tuple) and len(out) == 2 else out
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"loss_fn must return a scalar tensor (or (loss, aux)), got {type(loss).__name__}")
            del out
            probe.phase = Phase.BACKWARD
            if probe.views is not None:
                probe.views.put_back_root()
            counter.mark("end_forward")
            torch.autograd.backward(loss.reshape(()))
            del loss
            counter.mark("end")
    finally:
        if probe.views is not None:
            probe.views.restore()
        for mod, name, b in saved:
            mod._buffers[name] = b
        _put_back(attributes)
        if tp is not None:
            if own_tp:
                tp.remove()
            else:  # the step's own: its counts and watch are the step's
                tp.stats.clear()
                tp.stats.update(stats[0])
                tp.watch = stats[1]
    return counter


def _tensor_parallel(core, info, paths, leaves):
    """The tensor-parallel side the meta run computes with (None without tensor parallel): the
    step's own once it is built (its hooks are on the module), else one made and hooked as
    `step.init` would (taken off after the run); and whether it is the estimate's own."""
    if core.tp is not None or core.layout.tp_axis is None:
        return core.tp, False
    tp = core.make_tp(info, paths, leaves)
    if core.layouts is not None and info is not None:  # the step's activation layouts (Note [activation layouts])
        core.layouts.install(info.module, core.mesh, core.layout.data_axes)
        tp.layouts = core.layouts
    return tp, True


# -- the plan of one step ---------------------------------------------------------------------------


@dataclass
class _Group:
    name: str
    members: list  # the model's unit indices
    leaves: list  # leaf indices
    sizes: dict  # buffer_sizes (elements)
    S: int
    R: int
    S_trained: int
    n_trained: int
    master: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype
    staged: bool
    gathers_in_place: bool
    trained_leaves: list
    largest_trained: int = 0  # the largest trained sharded segment (elements per rank)
    padded_trained: int = 0  # the trained sharded segments whose rows do not split evenly (elements per rank)


def _pinned_bytes(n: int) -> int:
    """The bytes torch's pinned host allocator takes for `n` (the next power of two, by default)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _itemsize(dt: torch.dtype) -> int:
    return dt.itemsize


class _Sim:
    """The engine's buffers through a train step, in bytes: the `Buffers` on which the estimate runs
    the engine's own `Schedule` at the meta run's marks (Note [the schedule's moves] in `_schedule.py`,
    Note [memory estimate])."""

    def __init__(self, groups: dict, policy, world: int, p2p: bool, persistent: dict, leaf_group: list, offload: bool,
                 transient_grads: set):
        self.g = groups
        self.world = world
        self.p2p = p2p
        self.persistent = persistent  # category -> bytes, constant through the step
        self.leaf_group = leaf_group
        self.offload = offload
        self.transient_grads = transient_grads  # units whose gradient shard is allocated by their reduction
        self.alloc: dict = {}  # buffer key -> (category, bytes)
        self.owner: dict = {}  # arena key -> the unit whose data it holds (`Arena.owner`)
        self.kept: dict = {}  # leaf -> bytes of full gradients kept from earlier micro-batches (local accumulation)
        self.full_grads: dict = {}  # leaf -> bytes
        self.act = 0
        self.peak = -1
        self.at_peak: dict = {}
        self.where = ("forward", "", True)  # phase, unit, in the first step
        self.largest: dict = {}
        self.current = ""
        self.first_step = True
        units = sorted(u for u in groups if u != ROOT)
        self.units = units
        self.schedule = schedule.Schedule(policy, [groups[u].name for u in units], {u: len(g.trained_leaves) for u, g in groups.items()},
                                          {u for u in units if len(groups[u].members) > 1}, self)
        self.plan_arenas({})

    def plan_arenas(self, slot_of: dict) -> None:
        """The schedule's slot plan, and the arenas `UnitBuffers.bind` makes for a slot plan, from the one plan (`arena_plan`)."""
        s, gs = self.schedule, self.g
        s.set_plan(slot_of)
        self.slot_of = s.slot_of
        every = [*self.units, ROOT]
        self.plan = schedule.arena_plan({u: gs[u].sizes for u in every}, {u: gs[u].compute for u in every}, slot_of)
        self.arena: dict = {key: self.plan.nbytes(key) for key in self.plan.numel}
        rdt = gs[ROOT].reduce
        self.rs_in = max(g.sizes["rs_in"] for g in gs.values()) * _itemsize(rdt)
        self.rs_out = max(g.sizes["rs_out"] for g in gs.values()) * _itemsize(rdt)

    def new_step(self, first: bool) -> None:
        """A new step: the gradient shards are given back until their reductions (`release_grad`)."""
        self.first_step = first
        self.alloc = {k: v for k, v in self.alloc.items() if k[0] != "gradshard"}
        self.kept.clear()

    # -- arenas ----------------------------------------------------------------------------------
    def _key(self, u: int, name: str):
        return self.plan.key_of[u][name]

    def _alloc(self, key) -> None:
        if key not in self.alloc:
            self.alloc[key] = ("units", self.arena.get(key, 0))

    def _set(self, key, category: str, n: int) -> None:
        if key not in self.alloc:
            self.alloc[key] = (category, n)

    def _release(self, key) -> None:
        self.alloc.pop(key, None)
        self.owner.pop(key, None)

    # -- totals ------------------------------------------------------------------------------------
    def total(self, extra: dict | None = None) -> dict:
        cats = dict(self.persistent)
        for cat, n in self.alloc.values():
            cats[cat] = cats.get(cat, 0) + n
        cats["unit_grads"] = cats.get("unit_grads", 0) + sum(self.full_grads.values()) + sum(self.kept.values())
        cats["activations"] = cats.get("activations", 0) + self.act
        for k, v in (extra or {}).items():
            cats[k] = cats.get(k, 0) + v
        return cats

    def see(self, extra: dict | None = None) -> None:
        cats = self.total(extra)
        tot = sum(cats.values())
        for k, v in cats.items():
            self.largest[k] = max(self.largest.get(k, 0), v)
        if tot > self.peak:
            self.peak, self.at_peak, self.where = tot, cats, (self.schedule.phase.value, self.current, self.first_step)

    # -- Buffers: what the engine's moves do to the bytes ----------------------------------------
    def before_collective(self) -> None:
        pass

    def start_gather(self, u: int) -> None:
        gr = self.g[u]
        full = self._key(u, "full")
        self._alloc(full)
        self.owner[full] = u
        if gr.staged:
            self._alloc(self._key(u, "stage"))
        if self.world > 1 and gr.S:
            self._alloc(self._key(u, "gathered"))
        self.see()

    def finish_gather(self, u: int, work: Any, timeout: float | None = None) -> None:
        """A private gathered arena (and a stage without replicated leaves) is spent."""
        if u not in self.slot_of:
            self._release(self._key(u, "gathered"))
            if self.g[u].staged and not self.g[u].R:
                self._release(self._key(u, "stage"))

    def free(self, u: int) -> None:
        if u not in self.slot_of:
            for name in ("full", "gathered", "stage"):
                self._release(self._key(u, name))

    def gathers_in_place(self, u: int) -> bool:
        return self.g[u].gathers_in_place

    def reduces_in_slot(self, u: int, live: set[int]) -> bool:
        gr = self.g[u]
        if not ((u in self.slot_of or u == ROOT) and gr.reduce == gr.compute and self.world > 1):
            return False
        owner = self.owner.get(self._key(u, "full"))
        return owner is None or owner == u or not (owner == ROOT or owner in live)

    def start_reduce(self, u: int, pair: int, in_slot: bool, accumulate: bool) -> None:
        gr = self.g[u]
        direct = gr.reduce == gr.master and not self.offload and not accumulate
        if direct:
            self._grad_alloc(u)
        else:
            self._set(("rs_out", pair), "comm", self.rs_out)
        spike = {"comm": 0}
        if gr.S_trained and gr.compute != (gr.reduce if (self.world > 1 or not direct) else gr.master):
            # `_chunk_cat` into a buffer of another dtype copies the gradients in their own dtype first,
            # one leaf at a time (measured), the largest one's padded gradient at most
            spike["comm"] += self.world * gr.largest_trained * _itemsize(gr.compute)
        if self.world > 1:
            # ... and it pads every gradient whose rows do not split evenly, all at once (measured)
            spike["comm"] += self.world * gr.padded_trained * _itemsize(gr.compute)
        if self.world > 1 and gr.S_trained:
            if in_slot:
                full = self._key(u, "full")
                self._alloc(full)
                self.owner[full] = u
            else:
                self._set(("rs_in", pair), "comm", self.rs_in)
            if self.p2p and self.world == 3:  # shard-sized scratch until the reduction is waited for
                self._set(("scratch", u), "comm", gr.S_trained * _itemsize(gr.reduce if not direct else gr.master))
        self.see(spike)
        for i in gr.trained_leaves:  # the full gradients are spent
            self.full_grads.pop(i, None)
            self.kept.pop(i, None)

    def finish_reduce(self, u: int, pending: Any, timeout: float | None = None) -> None:
        self._grad_alloc(u)
        self.see()
        self._release(("scratch", u))

    def _grad_alloc(self, u: int) -> None:
        gr = self.g[u]
        if ("gradshard", u) not in self.alloc and u in self.transient_grads:
            self.alloc[("gradshard", u)] = ("grads", (gr.S + gr.R) * _itemsize(gr.master))

    def keep_grads(self, u: int) -> None:
        """Local accumulation: the full gradients wait for the last micro-batch, in reduce_dtype
        where it is wider (`FlatUnit.stash_grads`)."""
        gr = self.g[u]
        wider = _itemsize(gr.reduce) > _itemsize(gr.compute)
        for i in gr.trained_leaves:
            n = self.full_grads.pop(i, None)
            if n is not None:
                self.kept[i] = n * _itemsize(gr.reduce) // _itemsize(gr.compute) if wider else n

    def release_idle_slots(self, live: set[int]) -> None:
        held = {self._key(v, name) for v in live for name in ("full", "stage")}
        for key in list(self.alloc):
            if (key == ("gathered", "shared") or (len(key) == 3 and key[1] == "slot")) and key not in held:
                self._release(key)

    def release_slot(self, u: int) -> None:
        for name in ("full", "stage"):
            self._release(self._key(u, name))

    def release_gathered(self, u: int) -> None:
        self._release(self._key(u, "gathered"))

    def release_all(self) -> None:
        for key in list(self.alloc):
            if key[0] != "gradshard":
                self._release(key)

    # -- the meta run's timeline -------------------------------------------------------------------
    def run(self, events: list, member_group: dict, names: list[str], accumulate: bool, reduce_now: bool) -> dict | None:
        """Replays one micro-batch of the meta run's timeline through the schedule; returns what
        `Schedule.end` returns (the busy spans when this step makes the slot plan)."""
        s = self.schedule
        self.current = ""
        s.begin(accumulate, reduce_now)
        busy = None
        for kind, arg, live in events:
            self.act = live
            if kind == "fwd":
                self.current = names[arg]
                s.forward_starts(member_group[arg])
            elif kind == "hooked":
                s.inputs_hooked(member_group[arg])
            elif kind == "fwd_end":
                s.forward_ends(member_group[arg])
            elif kind == "end_forward":
                s.forward_over() and s.backward()
                self.current = ""
            elif kind == "bwd":
                self.current = names[arg]
                s.backward_starts(member_group[arg])
            elif kind == "recompute":
                s.recompute_starts(member_group[arg])
            elif kind == "bwd_end":
                s.use_over(member_group[arg])
            elif kind == "grad":
                i, n = arg
                if i in self.kept:
                    self.see({"unit_grads": n})  # added into the gradient kept from the last micro-batch
                else:
                    self.full_grads[i] = n
                u = self.leaf_group[i]
                if u != ROOT and s.phase != Phase.IDLE:
                    self.see()
                    s.grad_ready(u)
            elif kind == "end":
                busy = s.end()
            self.see()
        return busy


def estimate_memory(step: Any, params: Any, batch: Any = None, *, world: int | None = None, rank: int = 0,
                    update_probe_bytes: int = 1 << 22) -> MemoryEstimate:
    """The per-rank memory a train step takes, estimated from the plan its engine runs, without
    allocating any full tensor (Note [memory estimate] in `shardfn/_estimate.py`).

    Args:
        step: an `sf.train_step(...)` (initialized or not).
        params: the parameter tree as `step.init` takes it: full tensors, DTensors, or tensors on
            the meta device (only shapes and dtypes are read).
        batch: this rank's batch as the step receives it (its tensors may be on the meta device:
            only shapes and dtypes are read); None leaves activations out.
        world: the shard world size to estimate for (default: the step's mesh's shard axis).
        rank: the rank to estimate for (ranks differ only by uneven splits; 0 holds the most).
        update_probe_bytes: the size of the scaled-down real copy on which the optimizer's
            update temporaries are measured.

    Returns:
        A `MemoryEstimate`: `est.peak` (also `est["peak"]`), the bytes at the peak by category,
        where the peak is (phase and unit), printable as a table (HTML in a notebook), and what
        fits (`fits`, `max_batch`, `min_world`).
    """
    if not (hasattr(step, "core") and hasattr(step, "opt")):
        raise ValueError(f"sf.estimate_memory takes a train step (sf.train_step(...)), got {type(step).__name__}")
    core = step.core
    if core.whole_step:
        raise NotImplementedError(
            'sf.estimate_memory replays the unit schedule, and a compile="step" step runs as one graph whose memory the '
            "compiler decides (Note [the step as one graph] in shardfn/_step_graph.py): estimate the same step with "
            "compile=True or False (the eager schedule's memory), or measure the compiled step's peak"
        )
    W = core.layout.shard_world if world is None else int(world)
    if W < 1:
        raise ValueError(f"world must be a positive shard world size, got {world!r}")
    if not 0 <= rank < W:
        raise ValueError(f"rank must be in [0, {W}), got {rank!r}")

    def redo(batch_size, new_world, what):
        if what == "k":
            return core.accumulation_steps
        b = batch if batch_size is None else _resize_batch(batch, batch_size)
        return estimate_memory(step, params, b, world=new_world or W, rank=0 if new_world else rank, update_probe_bytes=update_probe_bytes)

    est = _estimate(step, params, batch, W, rank, update_probe_bytes)
    est._redo = redo
    return est


def _resize_batch(batch: Any, n: int) -> Any:
    def one(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return torch.empty((n, *x.shape[1:]), dtype=x.dtype, device="meta")
        return x

    return optree.tree_map(one, batch)


def _batch_size(batch: Any) -> int | None:
    for x in optree.tree_leaves(batch):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return x.shape[0]
    return None


def _estimate(step, params, batch, W: int, rank: int, probe_bytes: int) -> MemoryEstimate:
    from ._core import model_info, trained_leaves
    from ._loss import split_batch
    from ._step_layout import nested_units

    core = step.core
    paths, leaves, spec_list, treespec = core.layout.leaf_specs(params)
    info = model_info(core.apply, paths, leaves)
    trained = trained_leaves(info, paths, core.frozen)
    members, specs_of, dtype_of, groups, names = core.layout.unit_layout(info, paths, leaves, spec_list, trained)
    device = core.mesh.device_type
    p2p = W > 1 and (C.point_to_point(core.layout.group, device) if core.layout.shard_world > 1 else (C.GLOO_COLLECTIVES == "p2p" and device == "cpu"
                                                                                        and torch.distributed.get_backend(core.layout.group) == "gloo"))
    offload = core.offload == "cpu" and device != "cpu"
    gs: dict = {}
    leaf_group = [None] * len(leaves)
    for u, idx in members.items():
        sp = specs_of[u]
        segs = place(sp, W, rank)
        sh = [s for s in segs if s.sharded]
        S = sum(s.seg_numel for s in sh)
        R = sum(s.seg_numel for s in segs if not s.sharded)
        small = [s for s in sh if _together(s, W)]  # gathered through `gathered`, as FlatUnit decides
        compute = core.mp.param_dtype or dtype_of[u]
        gr = _Group(
            name=("+".join(names[m] for m in groups[u]) if u >= 0 else ""),
            members=list(groups[u]) if u >= 0 else [],
            leaves=list(idx),
            sizes=buffer_sizes(sp, W, rank, p2p),
            S=S, R=R,
            S_trained=sum(s.seg_numel for s in sh if s.trained),
            n_trained=sum(s.seg_numel for s in segs if s.trained),
            master=dtype_of[u], compute=compute, reduce=core.mp.reduce_dtype or compute,
            staged=compute != dtype_of[u] or offload,
            gathers_in_place=p2p and W > 1 and len(small) < len(sh),  # as FlatUnit decides
            trained_leaves=[x.index for x in sp if x.trained],
            largest_trained=max([s.seg_numel for s in sh if s.trained], default=0),
            padded_trained=sum(s.seg_numel for s in sh if s.trained and s.shape[_split_dim(s, W)] % W),
        )
        gs[u] = gr
        for i in idx:
            leaf_group[i] = u
    policy = core.layout.policy(gs, dtype_of, p2p)
    unit_dtype = [gs[leaf_group[i]].compute for i in range(len(leaves))]
    k = core.accumulation_steps
    if batch is not None:
        meta_batch = optree.tree_map(lambda x: _meta_like(x) if isinstance(x, torch.Tensor) else x, batch)
        context = step.context  # Note [context parallelism]: this rank's chunks, attention as the ring
        if context is not None:
            meta_batch = context.cut(meta_batch)
        mb = split_batch(meta_batch, k)[0]
        counter = _run_meta(core, info, paths, treespec, leaves, trained, unit_dtype, mb,
                            attention=context.attention if context is not None else None)
        events = counter.events
    else:
        events = [("end_forward", None, 0)]
        for i in range(len(leaves)):
            if trained[i]:
                shape = core.layout.shapes[i] if core.layout.tp_axis is not None else leaves[i].shape  # this rank's tp shard
                events.append(("grad", (i, math.prod(shape) * _itemsize(unit_dtype[i])), 0))
        events.append(("end", None, 0))
    member_group = {m: g for g, ms in enumerate(groups) for m in ms}
    n = len(gs) - 1
    inner = nested_units(names)
    nested = {g for g, ms in enumerate(groups) for m in ms if m in inner}

    # The state: shards, optimizer, buffers.
    persistent = {"params": sum((g.S + g.R) * _itemsize(g.master) for g in gs.values())}
    transient = {u for u, g in gs.items() if not offload and g.S > 0}
    persistent["grads"] = sum((g.S + g.R) * _itemsize(g.master) for u, g in gs.items() if u not in transient)
    persistent["buffers"] = _buffer_bytes(info, core.mp.buffer_dtype)
    local_shapes = {}
    for u, g in gs.items():
        for s in place(specs_of[u], W, rank):
            local_shapes[s.index] = (s.local_shape, g.master)
    opt_bytes, update_bytes = _optimizer_bytes(step.opt, treespec, [local_shapes[i] if trained[i] else None for i in range(len(leaves))], probe_bytes)
    persistent["optimizer"] = opt_bytes
    host = 0
    if offload:  # shards, gradients and optimizer live in host memory; the update runs there
        # Each unit's shard and gradient buffer is pinned, and torch's pinned-memory allocator
        # rounds every allocation up to a power of two (by default: `pinned_max_round_threshold`).
        pinned = sum(2 * _pinned_bytes((g.S + g.R) * _itemsize(g.master)) for g in gs.values())
        host = pinned + opt_bytes + update_bytes
        persistent["params"] = persistent["grads"] = persistent["optimizer"] = 0
        update_bytes = 0

    local = core.accumulation == "local"
    n_micro = min(k, 2)  # later micro-batches repeat the second
    # Two steps, as the engine runs them: the first with an arena per unit and the order unknown
    # until its first forward; it plans the slots from its busy spans at the end of its first
    # backward that reduces (Note [unit plan]); then a planned step.
    sim = _Sim(gs, policy, W, p2p, persistent, leaf_group, offload, transient)
    for first in (True, False):
        sim.new_step(first)
        for m in range(n_micro):
            last = m == n_micro - 1
            busy = sim.run(events, member_group, names, accumulate=m > 0 and not local, reduce_now=last or not local)
            if busy is not None:  # `Engine._plan`
                sim.schedule.planned = True
                if policy.share_slots and n:
                    order = sim.schedule.order
                    sim.plan_arenas(schedule.plan_slots(order, nested, {u: gs[u].compute for u in order}, policy, busy))
    largest = dict(sim.largest)
    # The optimizer: every gradient shard, the state and the update's temporaries.
    opt_cats = dict(persistent)
    opt_cats["grads"] = 0 if offload else sum((g.S + g.R) * _itemsize(g.master) for g in gs.values())
    opt_cats["update"] = update_bytes
    peak, at_peak, (phase, unit, first) = sim.peak, sim.at_peak, sim.where
    where = (phase, unit)
    if sum(opt_cats.values()) > peak:
        peak, at_peak, where, first = sum(opt_cats.values()), opt_cats, ("optimizer", ""), False
    for kk, v in opt_cats.items():
        largest[kk] = max(largest.get(kk, 0), v)
    full = {key: at_peak.get(key, 0) for key, _ in CATEGORIES}
    return MemoryEstimate(peak=int(peak), at_peak=full, largest={key: int(largest.get(key, 0)) for key, _ in CATEGORIES},
                          phase=where[0], unit=where[1], world=W, rank=rank, batch_size=_batch_size(batch) if batch is not None else None,
                          first_step=first, host=int(host))


def _buffer_bytes(info, dtype) -> int:
    if info is None:
        return 0
    seen, n = set(), 0
    for b in info.module.buffers():
        key = id(b)
        if key in seen:
            continue
        seen.add(key)
        dt = dtype if (dtype is not None and b.is_floating_point()) else b.dtype
        n += b.numel() * _itemsize(dt)
    return n


def _tree_bytes(tree: Any) -> int:
    """The bytes of the distinct storages of the tensors in `tree` (plain, or a DTensor's local)."""
    seen: dict[int, int] = {}
    for x in optree.tree_leaves(tree, none_is_leaf=True):
        if isinstance(x, DTensor):
            x = x._local_tensor
        if isinstance(x, torch.Tensor) and x.device.type != "meta":
            st = x.untyped_storage()
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _optimizer_bytes(opt, treespec, shapes: list, probe_bytes: int) -> tuple[int, int]:
    """The optimizer state's bytes for these shards (`opt.init` on meta tensors), and its update's
    temporaries, measured on a real copy scaled down to about `probe_bytes` and scaled back."""
    metas = [torch.empty(s[0], dtype=s[1], device="meta") if s is not None else None for s in shapes]
    tree = optree.tree_unflatten(treespec, metas)
    counter = _Counter()
    with counter:
        state = opt.init(tree)
    state_bytes = counter.cur
    del state
    total = sum(math.prod(s[0]) * _itemsize(s[1]) for s in shapes if s is not None)
    if not total or probe_bytes <= 0:
        return state_bytes, 0
    f = min(1.0, probe_bytes / total)
    small = [torch.zeros(max(1, math.ceil(math.prod(s[0]) * f)), dtype=s[1]) if s is not None else None for s in shapes]
    grads = [torch.ones_like(x) if x is not None else None for x in small]
    ptree = optree.tree_unflatten(treespec, small)
    gtree = optree.tree_unflatten(treespec, grads)
    from .optim import apply_updates
    from .optim._base import in_place

    st = opt.init(ptree)
    step_ = in_place(opt, "step_")
    counter = _Counter()
    made = 0  # state the update made and left alive (torch's optimizers make theirs at the first step)
    # What exists before the update is not its memory (an in-place op returns its input; torch's
    # optimizers detach the gradients they are given).
    counter.known(x._local_tensor if isinstance(x, DTensor) else x for x in optree.tree_leaves((small, grads, st), none_is_leaf=True))
    try:
        with counter, torch.no_grad():
            if step_ is not None:
                before = _tree_bytes(st)
                st = step_(gtree, st, ptree)
                made = max(0, _tree_bytes(st) - before)  # state made at the first step, held by what it returned
            else:
                updates, st2 = opt.update(gtree, st, ptree)
                new = apply_updates(ptree, updates)
                del updates, st2, new
    except Exception:  # noqa: BLE001 - an optimizer that needs more than plain tensors: count one update's worth
        return state_bytes, 2 * total
    # What the update made and left alive is state (counted as such), the rest of its peak temporaries.
    return state_bytes + int(made / f), int((counter.peak - made) / f)


# -- the check before a step allocates (`train_step(check_memory=...)`) ---------------------------


def check_memory(step: Any, params: Any, batch: Any, setting: Any) -> None:
    """Refuses, with `MemoryCheckError` and the estimate's table, a step whose estimated peak
    exceeds the memory available: `setting` is the step's `check_memory` (True: the device's free
    memory; an int: that many bytes). `batch` None checks the state alone (at `step.init`)."""
    if setting is False:
        return
    if setting is True or setting is None:  # the device's free memory, and what its allocator caches unused
        budget = device_budget(step.mesh.device_type)
        if step.mesh.device_type == "cuda":
            budget += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    else:  # a budget the user gave: as given
        budget = int(setting)
    try:
        est = _estimate(step, params, batch, step.core.layout.shard_world, step.core.layout.rank, 0)
    except NotEstimated as e:  # what the estimate cannot count yet: by default, no check, and a word why
        if setting is None:
            warnings.warn(f"train_step skipped its memory check (check_memory=None): {e}", stacklevel=3)
            return
        raise
    except Exception:  # noqa: BLE001 - a model the estimate cannot run (e.g. it reads data): by default, no check
        if setting is None:
            return
        raise
    if est.peak > budget:
        what = "its state alone (parameter and gradient shards, optimizer state)" if batch is None else "the step with this batch"
        raise MemoryCheckError(
            f"this train step would not fit: {what} is estimated at {_fmt(est.peak)} per rank, and "
            f"{_fmt(budget)} {'is available' if setting in (True, None) else 'is the budget (check_memory=)'} on rank "
            f"{step.core.layout.rank} of the shard axis.\n{est}\n"
            "Shard over more ranks, use remat=True, mixed precision or a smaller batch (sf.estimate_memory(step, params, "
            "batch).max_batch() says which fits); sf.train_step(..., check_memory=False) skips this check"
        )


def check_setting(value: Any) -> Any:
    """Validates `train_step(check_memory=...)`."""
    if value is None or isinstance(value, bool) or (isinstance(value, int) and value > 0):
        return value
    raise ValueError(f"check_memory must be True, False, None (the default) or a budget in bytes > 0, got {value!r}")


def checks_first_step(setting: Any, device_type: str) -> bool:
    """Whether `check_memory=setting` checks the first step with its batch (see `train_step`)."""
    return setting not in (None, False) or (setting is None and device_type == "cuda")
