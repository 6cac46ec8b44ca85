"""Activation layouts: `sf.constrain` and a step's `activation_specs` (sequence parallelism).

Note [activation layouts]
~~~~~~~~~~~~~~~~~~~~~~~~~
Inside a step on a (dp, tp) mesh the model computes on DTensors over `tp` (Note [tensor parallel
forward] in `_tp.py`): every activation has a layout over tp, and a layout can be asked for.
`sf.constrain(x, spec)` (JAX's `with_sharding_constraint`) lays `x` out as `spec` says over the tp
axis from there on: a `DTensor.redistribute`, exact, whose gradient is the opposite move. A
partial sum constrained to a split is reduce-scattered (half an all-reduce's bytes), a whole value
split is sliced (nothing sent), a split made whole is all-gathered. `spec` may name the step's data
axes on dim 0 only: the batch that `loss_fn` sees is already this rank's block there (a no-op); an
activation is not re-split over a data axis (that is per-shard code: `sf.shard_map`). On a mesh
without tp the constraint can only say that: anything else is refused.

`train_step(..., activation_specs=[(regex, P), ...])` is the same by module path, for models one
does not edit: the output of each module whose dotted path matches (in full; the first rule wins)
is constrained as its spec says, before the module's own steering (a row-parallel layer's partial
sum goes straight to its split, never through an all-reduce). Every rule must match a module.

Sequence parallelism (Megatron-SP) is this with one more move, in the steering of linear layers
(a 2-D weight, features last) that hold tp-split leaves: an input split over tp on a dim other than
its last (the sequence) is all-gathered before the layer runs (once per input, however many modules read it: q, k and v),
so a column-parallel layer computes on the whole sequence and never gathers its weight.
`sf.rules.LLAMA_SP` constrains the embedding's and the row-parallel layers' outputs to the
sequence: norms, dropout and residual adds then run on sequence shards, each pair of layers
reduce-scatters once and all-gathers once each way instead of one all-reduce, and the activations
between blocks are 1/tp the size. `sf.rules.GPT_SP` / `GPT2_SP` do it for models whose attention
is whole on tp (its packed q|k|v stays whole): the attention's input is constrained whole (an
all-gather of the normalized sequence) and its output back to the sequence (a slice; its gradient
all-gathered for the attention's backward), so no gather is left for DTensor to fall back to.
"""

from __future__ import annotations

import re
import weakref
from typing import Any, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import _collectives as C
from ._manual import Region, current
from ._spec import READY_RULES, P, placements_for

__all__ = ["ActivationSpecs", "asked", "constrain", "gather_sequence"]

_ASKING = [0]  # relayouts asked for, running now (forward or backward): `asked()`


def asked() -> bool:
    """Whether a relayout asked for (`sf.constrain`, `activation_specs`, sequence parallelism's
    gather) is moving data now, forward or backward: its gathers are no fallback of DTensor's
    (`_tp._GatherWatch`)."""
    return _ASKING[0] > 0


class _Relayout(torch.autograd.Function):
    """`x.redistribute(mesh, placements)`, forward and backward marked as asked for."""

    @staticmethod
    def forward(ctx, x: DTensor, mesh: DeviceMesh, placements: tuple, what: str) -> DTensor:  # type: ignore[override]
        ctx.mesh, ctx.what = mesh, what
        ctx.grad_placements = tuple(Replicate() if p.is_partial() else p for p in x.placements)
        _ASKING[0] += 1
        try:
            return C.redistribute(x.detach(), mesh, list(placements), what)
        finally:
            _ASKING[0] -= 1

    @staticmethod
    def backward(ctx, g: DTensor) -> tuple:  # type: ignore[override]
        if tuple(g.placements) == ctx.grad_placements:  # already there (a gathered sequence's reduce-scattered gradient)
            return g, None, None, None
        _ASKING[0] += 1
        try:
            return C.redistribute(g, ctx.mesh, list(ctx.grad_placements), ctx.what), None, None, None
        finally:
            _ASKING[0] -= 1


def _relayout(x: DTensor, mesh: DeviceMesh, placements: Sequence, what: str) -> DTensor:
    return _Relayout.apply(x, mesh, tuple(placements), what)


def _is_step(reg: Region | None) -> bool:
    return reg is not None and reg.what == "train step's loss_fn"


def _tp_axis(mesh: DeviceMesh, data_axes: Sequence[str]) -> str | None:
    names = tuple(mesh.mesh_dim_names or ())
    rest = [n for n in names if n not in data_axes]
    return rest[0] if rest else None


def _check(spec: Any, ndim: int, axes: Sequence[str], tp: str | None, what: str) -> list[int]:
    """The dims `spec` splits over tp (at most one); data axes only on dim 0."""
    if not isinstance(spec, P):
        raise ValueError(f"{what}: the spec must be an sf.P, got {spec!r}; e.g. sf.P(None, {tp or 'tp'!r}) for the sequence dim")
    if len(spec) > ndim:
        raise ValueError(f"{what}: spec {spec!r} has {len(spec)} entries for a tensor of {ndim} dims; give at most one per dim")
    known = (*axes, *([tp] if tp else []))
    split: list[int] = []
    for d, entry in enumerate(spec):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for n in names:
            if n not in known:
                raise ValueError(
                    f"{what}: spec {spec!r} names {n!r}, which is not an axis of the step's mesh {known}; name "
                    f"{'the tensor-parallel axis ' + repr(tp) if tp else 'no axis but the data axes, on dim 0'}"
                )
            if n == tp:
                split.append(d)
            elif d != 0:
                raise NotImplementedError(
                    f"{what}: spec {spec!r} splits dim {d} over the data axis {n!r}: inside a step an activation is this "
                    "rank's block of the batch (dim 0), and re-splitting it over a data axis (an all-to-all) is per-shard "
                    "code: write it with sf.shard_map or the named collectives (sf.all_to_all)"
                )
    if len(split) > 1:
        raise ValueError(f"{what}: spec {spec!r} splits dims {split} over {tp!r}; one dim per axis")
    return split


def constrain(x: torch.Tensor, spec: P) -> torch.Tensor:
    """`x` laid out as `spec` says from here on (JAX's `with_sharding_constraint`; Note
    [activation layouts] in `shardfn/_layouts.py`).

    Inside `loss_fn` of a train step (or a model's forward under one) on a (dp, tp) mesh, `spec`
    names the tensor-parallel axis on the dim to split (`sf.P(None, "tp")`: the sequence of a
    `[batch, seq, d]` activation), or nothing (`sf.P()`: whole on every tp rank); the data axes
    may appear on dim 0 only (the batch is this rank's block there already). The move is exact and
    differentiable (a reduce-scatter, slice or all-gather over tp). Outside a step a DTensor is
    redistributed over its own mesh, as `sf.shard` lays out a tree.

    Args:
        x: a tensor (a DTensor over tp inside a tensor-parallel step; a plain tensor there counts as
            whole on tp).
        spec: an `sf.P`, at most one entry per dim of `x`.

    Returns:
        `x` in that layout: a DTensor over tp in a tensor-parallel step where it is split or was a
        DTensor, else `x` itself.

    Raises:
        ValueError: an axis that is not the step's, two dims over one axis, a plain tensor outside
            a step, or a call inside `sf.shard_map` (whose values are per-shard blocks).
        NotImplementedError: a split of a dim other than the batch over a data axis.
    """
    reg = current()
    if reg is not None and not _is_step(reg):
        raise ValueError(
            f"sf.constrain inside {reg.what}: there every value is this rank's block, with no layout to ask for; "
            "move the data with the named collectives (sf.all_gather, sf.psum_scatter, sf.all_to_all)"
        )
    if reg is None:
        if not isinstance(x, DTensor):
            raise ValueError(
                "sf.constrain outside a step, on a plain tensor: lay it out over a mesh with sf.shard(x, mesh=mesh, "
                "specs=spec), or call sf.constrain inside loss_fn or a model's forward under a train step"
            )
        mesh = x.device_mesh
        own = set(mesh.mesh_dim_names or ())
        # A recompute in the step's backward runs outside its loss_fn: the data axes of dim 0 say nothing here.
        if len(spec) and spec[0] is not None and not set((spec[0],) if isinstance(spec[0], str) else spec[0]) & own:
            spec = P(None, *tuple(spec)[1:])
        if tuple(x.placements) == tuple(placements_for(spec, mesh)):
            return x
        return _relayout(x, mesh, placements_for(spec, mesh), "sf.constrain")
    tp = _tp_axis(reg.mesh, reg.names)
    split = _check(spec, x.dim(), reg.names, tp, "sf.constrain")
    if tp is None or (not split and not isinstance(x, DTensor)):
        return x  # the data axes on dim 0 say what is so already
    if isinstance(x, DTensor):
        mesh = x.device_mesh
    else:  # a plain tensor counts as whole on tp (`implicit_replication`)
        mesh = reg.mesh[tp]
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    want = [Shard(split[0])] if split else [Replicate()]
    if tuple(x.placements) == tuple(want):
        return x
    return _relayout(x, mesh, want, "sf.constrain")


def gather_sequence(x: Any, cache: dict) -> Any:
    """Sequence parallelism's all-gather before a module holding tp-split leaves: a DTensor split
    over tp on a dim other than its last comes back whole (once per tensor: `cache`, id ->
    (weak refs to the input and its gather)); anything else as it is (Note [activation layouts])."""
    if not isinstance(x, DTensor) or x.device_mesh.ndim != 1:
        return x
    p = x.placements[0]
    if not (p.is_shard() and p.dim % x.dim() != x.dim() - 1):
        return x
    hit = cache.get(id(x))
    if hit is not None and hit[0]() is x:
        done = hit[1]()
        if done is not None:
            return done
    out = _relayout(x, x.device_mesh, [Replicate()], "sequence parallelism's all-gather")
    cache[id(x)] = (weakref.ref(x), weakref.ref(out))
    return out


class ActivationSpecs:
    """A step's `activation_specs`: checked against the model, and the hooks that lay out each
    matched module's output (Note [activation layouts]).

    Args:
        rules: `[(regex, P), ...]`, matched in full against module paths, the first match winning.
    """

    def __init__(self, rules: Sequence[tuple[str, P]]):
        if isinstance(rules, (str, P)) or not all(isinstance(r, tuple) and len(r) == 2 for r in rules):
            raise ValueError(
                f"activation_specs must be a list of (regex, sf.P) pairs, got {rules!r}; e.g. "
                "activation_specs=sf.rules.LLAMA_SP or [(r'.*\\.mlp\\.down_proj', sf.P(None, 'tp'))]"
            )
        self.rules = []
        for pattern, spec in rules:
            if not isinstance(spec, P):
                raise ValueError(f"activation_specs: rule {pattern!r} maps to {spec!r}, which is not an sf.P")
            try:
                self.rules.append((re.compile(pattern), pattern, spec))
            except re.error as e:
                raise ValueError(f"activation_specs: {pattern!r} is not a regular expression: {e}") from None
        self._handles: list = []
        self._on: set[int] = set()  # ids of the modules hooked
        self.running = 0  # inside a tensor-parallel context of the step (`_tp.TensorParallel.context`)

    def install(self, module: torch.nn.Module, mesh: DeviceMesh, data_axes: Sequence[str]) -> None:
        """Hooks every module whose path a rule matches, once (refusing rules that match none, and
        specs that do not fit the mesh). The hooks act while `running`: the step's forward, its
        backward's recomputes, and its memory estimate's meta run; elsewhere they do nothing."""
        if id(module) in self._on:
            return
        tp = _tp_axis(mesh, data_axes)
        used: set[str] = set()
        for name, mod in module.named_modules():
            for rx, pattern, spec in self.rules:
                if rx.fullmatch(name):
                    used.add(pattern)
                    _check(spec, 64, data_axes, tp, f"activation_specs rule {pattern!r}")
                    self._handles.append(mod.register_forward_hook(_layout_hook(name, spec, weakref.ref(self)), prepend=True))
                    break
        # A ready list (`sf.rules.LLAMA_SP`) holds the parameters' rules too: those are `sf.specs`' to check.
        unused = [p for _, p, spec in self.rules if p not in used and (p, spec) not in READY_RULES]
        if unused:
            self.remove()
            raise ValueError(
                f"activation_specs: {unused} match no module of the model (patterns match dotted module paths in full, "
                f"e.g. 'model.layers.0.mlp.down_proj'); fix the pattern (a '.*' prefix?) or drop the rule"
            )
        self._on.add(id(module))
        weakref.finalize(self, _remove, list(self._handles))

    def remove(self) -> None:
        """Takes the hooks off the modules."""
        _remove(self._handles)
        self._handles = []


def _remove(handles: list) -> None:
    for h in handles:
        h.remove()


def _layout_hook(name: str, spec: P, ref: Any):
    def hook(mod: torch.nn.Module, args: tuple, out: Any) -> Any:
        owner = ref()
        if owner is None or not owner.running:
            return None  # outside the step (apply on its own, another step): as the module computes
        if isinstance(out, torch.Tensor):
            return constrain(out, spec)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (constrain(out[0], spec), *out[1:])
        raise ValueError(
            f"activation_specs: module {name!r} returned {type(out).__name__}, not a tensor (or a tuple whose first "
            "item is one): match the module whose output is the activation, or call sf.constrain in the model"
        )

    return hook
