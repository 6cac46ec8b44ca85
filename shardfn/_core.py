"""The gradient core: the FSDP gradient of `loss_fn` with respect to one sharded parameter tree.

`GradientCore` owns what a gradient needs and nothing an optimizer does: the layout (specs become
per-unit flat buffers, Note [flat unit layout] in `_flat.py`), the engine that runs the units
(Note [unit schedule] in `_engine.py`), the forward and backward on the unit schedule or on the
gathered tree (Note [steps off the unit schedule]), accumulation over micro-batches, and the
reductions (the loss, the global norm, which leaves got a gradient). `sf.train_step` is this core
plus clipping, the optimizer and donation; `sf.value_and_grad` is this core alone.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import optree
import torch
import torch.utils.checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import _collectives as C
from . import _debug, _runtime, _watch
from ._compiled import CompiledUnits, on_tensor_parallel
from ._layouts import ActivationSpecs
from ._buffers import ModuleBuffers
from ._engine import GROUP_BYTES, Engine, StaleParameterError
from ._flat import STALE
from ._manual import step_region
from ._mesh import mesh_group
from ._models import model_of
from ._named import lift
from ._tree import compile_patterns
from ._param import OffSchedule
from ._remat import install as install_remat
from ._rng import RANDOMNESS, folded
from ._remat import select_units
from ._shard import gather
from ._loss import add_loss, loss_of, split_batch, split_loss
from ._step_layout import StepLayout
from ._step_graph import WholeStep, refuse_unsupported, step_option
from ._held import HeldTree
from ._tp import TensorParallel
from .optim._norm import local_sumsq

__all__ = ["GradientCore", "Gradients", "MixedPrecision", "STRATEGIES", "model_info", "trained_leaves"]

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for the compute, the gradient reduction and the buffers; the master weights keep theirs.

    Attributes:
        param_dtype: the dtype units are gathered and computed in (None: the parameters' own).
        reduce_dtype: the dtype gradients are reduce-scattered in (None: `param_dtype`).
        buffer_dtype: the dtype floating-point buffers are cast to for the step (None: their own).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            v = getattr(self, name)
            if v is not None and v not in _MP_DTYPES:
                why = (" (a float8 dtype: torch has no arithmetic kernels for it, e.g. the additions of a "
                       "backward, so it is a storage format for scaled matmuls, not a compute dtype)"
                       if isinstance(v, torch.dtype) and v.is_floating_point else "")
                raise ValueError(
                    f"MixedPrecision.{name} must be None or one of torch.bfloat16, torch.float16, torch.float32, "
                    f"torch.float64; got {v!r}{why}"
                )


_MP_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _rng_state(device_type: str) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state() if device_type == "cuda" else None


def _set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


def _empty_share(batch: Any) -> bool:
    """Whether this rank's share of the batch has no example: every tensor of it (but scalars) has
    an empty first dim, and there is one at least."""
    dims = [x.shape[0] for x in optree.tree_leaves(batch) if isinstance(x, torch.Tensor) and x.dim() > 0]
    return bool(dims) and not any(dims)


class Gradients(NamedTuple):
    """What `GradientCore.gradients` returns: the gradients and what was measured with them."""

    grads: Any  # the sharded gradients (a tree like the params, None at frozen leaves), over the core's buffers
    loss: torch.Tensor  # the loss averaged over ranks (and micro-batches)
    grad_norm: torch.Tensor  # the global norm of the gradients
    skip: list[int]  # trained leaves (positions among them) that got no gradient on any rank
    aux: Any  # what loss_fn returned beside the loss, on this rank (its last micro-batch)


class GradientCore:
    """The FSDP gradient of `loss_fn` with respect to one sharded tree: `build(params)` once, then
    `gradients(tree, batch)` per step. Options as in `sf.train_step`.

    Attributes (after `build`):
        paths, treespec: the tree's dotted leaf names and structure.
        held: the DTensors the core computes from and the gradients it hands out, over its flat
            buffers, taken in and handed out there (`HeldTree`, Note [the held tree]).
        trained, trained_index: which leaves are trained; their positions in the tree.
        engine: the unit schedule's runtime.
        off_schedule: whether the steps run on the gathered tree (Note [steps off the unit schedule]).
    """

    def __init__(self, loss_fn: Callable[[Any, Any], Any], mesh: DeviceMesh, specs: Any = None, strategy: str = "full_shard",
                 mixed_precision: "MixedPrecision | None" = None, remat: Any = False, accumulation_steps: int = 1,
                 apply: Any = None, frozen: Any = None, offload: str | None = None, accumulation: str = "sharded",
                 group_bytes: int | None = None, keep_last_unit: bool = True, randomness: str = "per_rank",
                 compile: dict | None = None, activation_specs: Any = None):
        if randomness not in RANDOMNESS:
            raise ValueError(
                f"randomness must be one of {RANDOMNESS}, got {randomness!r}: 'per_rank' (each data-parallel rank draws its "
                "own numbers, Note [randomness per rank]) or 'same' (every rank's generator as it stands)"
            )
        self.randomness = randomness
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be a positive int, got {accumulation_steps!r}")
        if accumulation not in ("sharded", "local"):
            raise ValueError(f"accumulation must be 'sharded' (reduce every micro-batch) or 'local' (reduce once), got {accumulation!r}")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise ValueError("mixed_precision must be an sf.MixedPrecision(...) or None")
        if offload not in (None, "cpu"):
            raise ValueError(f"offload must be None or 'cpu', got {offload!r}")
        if group_bytes is not None and not (isinstance(group_bytes, int) and not isinstance(group_bytes, bool) and group_bytes >= 0):
            raise ValueError(f"group_bytes must be a byte count >= 0 (0: no unit groups) or None, got {group_bytes!r}")
        if not isinstance(keep_last_unit, bool):
            raise ValueError(f"keep_last_unit must be True or False, got {keep_last_unit!r}")
        if not isinstance(mesh, DeviceMesh):
            raise ValueError(f"mesh must be a DeviceMesh (see sf.mesh), got {type(mesh).__name__}")
        self.loss_fn = loss_fn
        self.mesh = mesh
        self.specs = specs
        self.strategy = strategy
        self.mp = mixed_precision or MixedPrecision()
        self.remat = remat
        self.accumulation_steps = accumulation_steps
        self.accumulation = accumulation
        self.apply = apply
        self.frozen = compile_patterns(frozen, "frozen", "dotted parameter names")
        self.offload = offload
        self.group_bytes = GROUP_BYTES if group_bytes is None else group_bytes
        self.keep_last_unit = keep_last_unit
        self.off_schedule = False  # Note [steps off the unit schedule]
        # torch.compile options (Note [compiled units]); whether the step is one graph (Note [the step as one graph])
        self.compile, self.whole_step = step_option(compile)
        self.compiled: CompiledUnits | None = None
        self.step_graph: WholeStep | None = None
        # Note [activation layouts] in `_layouts.py`: checked here, hooked at build.
        self.layouts = ActivationSpecs(activation_specs) if activation_specs is not None else None
        if compile is not None and activation_specs is not None:
            raise NotImplementedError(
                "compile=True with activation_specs (sequence parallelism) is not supported yet: leave compile=False, "
                "or drop activation_specs to compile the units"
            )
        self.layout = StepLayout(mesh, specs, strategy, self.mp, offload, self.group_bytes, keep_last_unit,
                                 accumulation_steps, accumulation)
        if self.whole_step:
            refuse_unsupported(self)
        elif compile is not None and self.layout.tp_axis is not None:
            self.compile = on_tensor_parallel(self.compile, tuple(mesh.mesh_dim_names or ()), self.layout.tp_size, self.mp)
        self.engine: Engine | None = None
        self.tp: TensorParallel | None = None
        self._tp_batch_checked = False

    def build(self, params: Any, init: str | None = None, sync: str | None = None) -> Any:
        """Lays `params` out in this core's flat unit buffers: its specs become flat units, the
        engine that runs them, and DTensors over this rank's shards.

        Args:
            params: the full parameter tree, a DTensor tree, or a tree on the meta device (the
                module's initializers fill it).
            init: `"empty"` leaves meta leaves uninitialized (values do not matter; Note [meta init]).
            sync: how the ranks agree on the full leaves and the module's buffers first (Note [one
                model] in `_agree.py`): "broadcast", "check" or None (each rank's own).

        Returns:
            The parameter tree of DTensors over the core's buffers (see `tree`).
        """
        paths, leaves, spec_list, treespec = self.layout.leaf_specs(params)
        info = model_info(self.apply, paths, leaves)
        trained = trained_leaves(info, paths, self.frozen, leaves)
        _refuse_sparse_gradients(info, paths, trained)
        units, where, dtype_of, direct_gather, groups = self.layout.flat_units(info, paths, leaves, spec_list, trained)
        self.engine = self._make_engine(info, units, dtype_of, direct_gather, groups)
        dt_params, dt_grads, flat_views = self.layout.fill(info, paths, leaves, spec_list, units, where, init, sync)
        self._prepare_buffers(info)
        self._norm_segments, self._norm_parts, self._norm_weights = self.layout.norm_plan(units)
        self.treespec = treespec
        self.paths = paths
        self.units = units
        self.held = HeldTree(treespec, dt_params, flat_views, dt_grads)
        self.trained = trained
        self._trained_where = [w for w, t in zip(where, trained) if t]  # the optimizer's leaves, in order
        self.trained_index = [i for i, t in enumerate(trained) if t]  # their positions in the tree
        self._install_tp(info, paths, leaves)
        self._install_layouts(info)
        self.engine.set_tree(treespec, paths, where)
        self._install_compiled(info)  # before remat: a compiled forward runs under remat's checkpoint
        self._install_remat(info)
        return self.tree()

    def _make_engine(self, info: Any, units: dict, dtype_of: dict, direct_gather: bool, groups: list[list[int]]) -> Engine:
        """The engine that runs these unit groups on the strategy's policy."""
        n_units = len(units) - 1
        nested = self.layout.nested_units
        return Engine(
            info, [units[u] for u in range(n_units)], units[-1], self.layout.policy(units, dtype_of, direct_gather), nested,
            group=mesh_group(self.mesh) if self.layout.world > 1 else None, groups=groups,
        )

    def _check_tp_batch(self, batch: Any) -> None:
        """On the first step: ranks that differ only in their tp coordinate hold the same batch, as
        tensor parallel needs (each computes its shards of the same examples). A checksum of the
        batch, compared over tp in one small all-reduce. A step refused here checks again."""
        sums = torch.zeros(2, dtype=torch.float64)
        for i, x in enumerate(optree.tree_leaves(batch)):
            if isinstance(x, torch.Tensor) and x.numel() and not isinstance(x, DTensor):
                v = x.detach().reshape(-1).to("cpu", torch.float64)
                sums[0] += (i + 1) * v.sum() + v.numel()
                sums[1] += (v * torch.arange(1, v.numel() + 1, dtype=torch.float64)).sum()
        both = torch.cat([sums, -sums]).to(self.mesh.device_type)
        C.all_reduce_blocking(both, self.mesh.get_group(self.layout.tp_axis), "the train step's batch check", op="max")
        if not torch.equal(both[:2], -both[2:]):
            raise ValueError(
                f"ranks that differ only in their {self.layout.tp_axis!r} coordinate got different batches: tensor parallel "
                f"computes each example on all of them. Give every rank the batch of its {self.layout.shard_axis!r} "
                f"coordinate, e.g. global_batch.chunk(mesh.size(0))[mesh.get_local_rank({self.layout.shard_axis!r})]"
            )
        self._tp_batch_checked = True

    def _install_tp(self, info: Any, paths: list[str], leaves: list) -> None:
        """The tensor-parallel forward (Note [tensor parallel forward] in `_tp.py`): the engine
        computes on DTensors over the tp mesh, and the modules holding a split leaf steer their
        collectives."""
        self.tp = self.make_tp(info, paths, leaves)
        if self.tp is not None:
            self.engine.tp = self.tp

    def make_tp(self, info: Any, paths: list[str], leaves: list) -> TensorParallel | None:
        """A tensor-parallel side for these leaves, its hooks on `info`'s module (None without a tp
        axis). The step makes its own once; `sf.estimate_memory` makes one for a step not built yet."""
        if self.layout.tp_axis is None:
            return None
        tp = TensorParallel(self.mesh, self.layout.tp_axis, self.layout.tp_dims, [x.shape for x in leaves], self.mp.reduce_dtype)
        if info is not None:
            tp.install(info.module, {n for p, d in zip(paths, self.layout.tp_dims) if d is not None for n in info.aliases[p]})
        return tp

    def _prepare_buffers(self, info: Any) -> None:
        """Mixed precision's buffer dtype; the buffers a forward updates, kept equal on every rank."""
        if info is not None and self.mp.buffer_dtype is not None:
            _cast_buffers(info.module, self.mp.buffer_dtype)
        if info is not None and self.mp.param_dtype is not None:
            for name, mod in info.module.named_modules():
                stats = getattr(mod, "running_mean", None)
                if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm) and stats is not None and stats.dtype != self.mp.param_dtype:
                    raise NotImplementedError(
                        f"{name!r} is a {type(mod).__name__} whose running statistics are {stats.dtype} while its unit "
                        f"computes in {self.mp.param_dtype}, which BatchNorm refuses. Pass "
                        f"MixedPrecision(..., buffer_dtype={self.mp.param_dtype}) to keep the statistics in that dtype; "
                        "BatchNorm in float32 inside a low-precision unit is not supported yet"
                    )
        self._buffers = ModuleBuffers(info.module if info is not None else None, self.mesh)

    def _install_layouts(self, info: Any) -> None:
        """The hooks of `activation_specs` on the model's modules (Note [activation layouts])."""
        if self.layouts is None:
            return
        if self.tp is None:
            raise ValueError(
                f"activation_specs lay activations out over a tensor-parallel axis, and this step's mesh has none (axes "
                f"{tuple(self.mesh.mesh_dim_names or ())}): build a (dp, tp) mesh, e.g. sf.mesh(dp=2, tp=2), or leave "
                "activation_specs out"
            )
        if info is None:
            raise ValueError("activation_specs name modules: functionalize the model (sf.functionalize), or pass apply=")
        self.layouts.install(info.module, self.mesh, self.layout.data_axes)
        self.tp.layouts = self.layouts

    def _install_compiled(self, info: Any) -> None:
        """The compiled forwards of the units, if `compile=` asked for them (Note [compiled units])."""
        if self.compile is None:
            return
        if info is None:
            raise NotImplementedError(
                "compile=True (and \"step\") compiles the units of a model from sf.functionalize; this tree belongs to no "
                "functionalized model (a loss_fn over plain tensors, or the model's parameters with other leaves beside "
                "them): functionalize the model and pass its apply (sf.train_step(..., apply=apply)), or leave compile=False"
            )
        if self.whole_step:
            self.step_graph = WholeStep(self, info, self.compile)
        else:
            self.compiled = CompiledUnits(info, self.compile)

    def _install_remat(self, info: Any) -> None:
        """Wraps the forward of each unit `remat` chooses (`_remat.py`)."""
        if self.remat:
            if info is None:
                raise ValueError("remat needs units: functionalize the model with units=... (or pass apply=)")
            self.engine.remat_units = select_units(self.remat, info.unit_names)
            for u in self.engine.remat_units:
                install_remat(info, u)

    def tree(self) -> Any:
        """The parameter tree of the DTensors the core computes from (`held.params`)."""
        return self.held.tree()

    def trainable(self, tree: Any) -> Any:
        """`tree` with frozen leaves replaced by None: what an optimizer sees."""
        if all(self.trained):
            return tree
        leaves = optree.tree_leaves(tree)
        return optree.tree_unflatten(self.treespec, [x if t else None for x, t in zip(leaves, self.trained)])

    def scale_grads(self, coef: torch.Tensor) -> None:
        """Multiplies the sharded gradients in place by `coef` (clipping)."""
        if self._norm_segments:  # the trained segments: frozen ones hold no gradient
            torch._foreach_mul_(self._norm_segments, coef.to(self._norm_segments[0].device))

    def gradients(self, params: Any, batch: Any) -> Gradients:
        """Forward and backward on the unit schedule (or on the gathered tree, Note [steps off the
        unit schedule]), gradients reduced into the core's gradient buffers (`held.grads`).

        Args:
            params: the core's own tree (`tree()`).
            batch: this rank's batch; split in `accumulation_steps` micro-batches.

        Returns:
            `Gradients`: the gradients, the loss averaged over ranks, the global gradient norm, the trained leaves
            (positions among them) that got no gradient on any rank, and this rank's aux.
        """
        if self.engine is not None:
            self.engine.refuse_if_broken()  # before the gradient shards are given back
        if self.tp is not None and not self._tp_batch_checked:
            self._check_tp_batch(batch)
        for u in self.units.values():  # the last step's gradient shards are spent
            u.release_grad()
        k = self.accumulation_steps
        self._buffers.start()
        try:
            with self._draws(), self._compiled_units():
                if self.off_schedule:
                    loss_sum, aux = self._gradients_gathered(batch)
                else:
                    loss_sum, aux = self._gradients_scheduled_or_gathered(batch)
        except BaseException:
            self._buffers.restore(strict=False)  # Note [buffers]: a failed step leaves them as they were
            raise
        changed = self._buffers.changed()
        # One all-reduce for the loss, the squared gradient norm, and which leaves got a gradient
        # on some rank (Note [leaves without a gradient]).
        weights = self._norm_weights
        sq = local_sumsq(self._norm_parts, weights).to(loss_sum.device) if self._norm_parts else loss_sum.new_zeros(())
        had = [self.units[u].had_grad[j] for u, j in self._trained_where]
        # And which modules changed a buffer on some rank (Note [buffers]): their buffers are synced.
        # A rank with an empty share (the last, smaller global batch) has a NaN loss (a mean over no
        # example): its loss is left out, and the loss is the mean over the ranks that had examples.
        empty = _empty_share(batch)
        mine = loss_sum.new_zeros(()) if empty else loss_sum / k
        stats = torch.cat([torch.stack([mine, sq, sq.new_tensor(0.0 if empty else 1.0)]), torch.tensor(had + changed, dtype=torch.float32).to(sq.device)])
        if self.layout.world > 1:
            C.all_reduce(stats, None if self.layout.replicate_group is not None or self.layout.tp_axis is not None else self.layout.group)
        loss_mean = (stats[0] / stats[2]).to(loss_sum.dtype)  # NaN only where no rank had an example
        grad_norm = stats[1].sqrt().to(sq.dtype)
        # Read back (a host sync on GPUs) only where this rank saw a leaf without a gradient, or the
        # model has buffers (Note [buffers]).
        n_had, n_buf = len(had), len(changed) // 2
        flags = stats[3:].tolist() if changed or not all(had) else []
        skip = [i for i, n in enumerate(flags[:n_had]) if n == 0] if not all(had) else []
        if changed:
            self._buffers.sync([x > 0 for x in flags[n_had : n_had + n_buf]], [x > 0 for x in flags[n_had + n_buf :]])
        aux = optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, aux, none_is_leaf=True)
        if self.step_graph is not None and not self.off_schedule:
            self.step_graph.ready = True  # the first step ran eager (Note [the step as one graph])
        return Gradients(self.held.grads, loss_mean, grad_norm, skip, aux)

    def _draws(self):
        """What the step's random draws come from (Note [randomness per rank] in `_rng.py`)."""
        if self.randomness == "same" or self.layout.data_world == 1:
            return contextlib.nullcontext()
        index = self.mesh.get_local_rank(self.layout.replicate_axis) * self.layout.shard_world if self.layout.replicate_axis else 0
        return folded(index + self.mesh.get_local_rank(self.layout.shard_axis), self.mesh.device_type)

    def _gradients_scheduled_or_gathered(self, batch: Any) -> tuple[torch.Tensor, Any]:
        """The step on the unit schedule; if the model leaves it (Note [steps off the unit
        schedule]), the same step again, with the same random draws and buffers, on the gathered tree."""
        if self.step_graph is not None and self.step_graph.ready:
            return self.step_graph.gradients(batch)
        rng = _rng_state(self.mesh.device_type)
        try:
            return self._gradients_on_schedule(batch)
        except OffSchedule as e:
            if self.layout.tp_axis is not None:
                raise NotImplementedError(
                    f"{e}: with tensor parallel (a 2-D mesh) train_step cannot compute this step yet (Note [steps "
                    "off the unit schedule] in shardfn/_core.py)"
                ) from e
            if self.mp.param_dtype is not None or self.offload is not None:
                raise NotImplementedError(
                    f"{e}: with mixed_precision or offload, train_step cannot compute this step yet (Note [steps off "
                    "the unit schedule] in shardfn/_core.py)"
                ) from e
            self.engine.refuse_if_broken()  # its abort could not finish a collective: nothing is given back
            self.off_schedule = True
            for u in self.units.values():
                u.release_grad()
            _set_rng_state(rng)
            self._buffers.restore()
            return self._gradients_gathered(batch)

    def _compiled_units(self) -> Any:
        """The context the step's units run compiled in, if `compile=` asked for it."""
        return self.compiled.for_step(self.tp) if self.compiled is not None else contextlib.nullcontext()

    def _gradients_on_schedule(self, batch: Any) -> tuple[torch.Tensor, Any]:
        """Forward and backward on the unit schedule; returns this rank's loss (summed over
        micro-batches) and aux."""
        k = self.accumulation_steps
        local = self.accumulation == "local"
        scale = 1.0 / (self.layout.data_world * k)
        loss_sum = None
        aux = None
        engine = self.engine
        tp = self.tp.context() if self.tp is not None else contextlib.nullcontext()
        try:
            with _runtime.activate(engine), torch.enable_grad(), tp, _debug.reads_checked(skip=self.compiled is not None):
                for m, micro in enumerate(split_batch(batch, k)):
                    last = m == k - 1
                    engine.begin(accumulate=m > 0 and not local, reduce=last or not local)
                    with step_region(self.mesh, self.layout.data_axes, lift) as reg:
                        out = self.loss_fn(engine.user_tree, micro)
                        spread = reg.spread(loss_of(out))  # Note [named collectives in a step]
                        loss, aux = split_loss(out)
                    loss_sum = add_loss(loss_sum, loss)
                    engine.end_forward()
                    torch.autograd.backward(loss * (scale * self.layout.data_world / spread))
                    engine.end()
            if self.tp is not None:
                self.tp.watch = False  # the first step showed what gathers
        except BaseException as e:
            if not isinstance(e, OffSchedule):
                _watch.report_step(e)  # before the abort, which may wait on peers that wait on this rank
            if isinstance(e, OffSchedule) and not e.agreed:
                engine.leave_schedule()  # the other ranks leave with this one
            engine.abort()
            clear = _explain(e)
            if clear is not None:
                raise clear from e
            raise
        _watch.report_step(None)
        return loss_sum, aux

    def _gradients_gathered(self, batch: Any) -> tuple[torch.Tensor, Any]:
        """Forward and backward on the whole gathered tree, with plain autograd: the gradient of
        `sf.gather` is the reduce-scatter of the mean over ranks (Note [steps off the unit schedule])."""
        k = self.accumulation_steps
        scale = 1.0 / k  # the gather's backward averages over the ranks
        loss_sum = None
        aux = None
        paused = self.compiled.pause() if self.compiled is not None else contextlib.nullcontext()
        with torch.enable_grad(), paused:  # eager: a backward inside loss_fn (Note [compiled units])
            leaves = [x.detach().requires_grad_(t) for x, t in zip(self.held.params, self.trained)]
            full = optree.tree_unflatten(self.treespec, [gather(x) for x in leaves])
            trained = [x for x, t in zip(leaves, self.trained) if t]
            sums: list = [None] * len(trained)
            try:
                for micro in split_batch(batch, k):
                    with step_region(self.mesh, self.layout.data_axes, lift) as reg:
                        out = self.loss_fn(full, micro)
                        spread = reg.spread(loss_of(out))
                        loss, aux = split_loss(out)
                    loss_sum = add_loss(loss_sum, loss)
                    grads = torch.autograd.grad(loss * (scale * self.layout.data_world / spread), trained, allow_unused=True, retain_graph=k > 1)
                    sums = [g if s is None else s if g is None else s + g for s, g in zip(sums, grads)]
            except RuntimeError as e:
                clear = _explain(e, off_schedule=True)
                if clear is not None:
                    raise clear from e
                raise
        del full
        for unit in self.units.values():
            unit.alloc_grad()
            unit.grad.zero_()
        with torch.no_grad():
            for (u, j), g in zip(self._trained_where, sums):
                if g is not None:
                    self.units[u].grad_views[j].copy_(g.to_local())
                    self.units[u].had_grad[j] = True
        return loss_sum, aux


# Note [named collectives in a step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `loss_fn` runs in a manual region over the step's data axes (Note [varying axes] in
# `_manual.py`), so the named collectives may be called in it: its batch is this rank's block
# along the data axes. Every value the region has not seen, the batch and the parameters among
# them, is typed as varying over the data axes: for the parameters, the step's own gradient
# reduction plays the part of the `pvary` at the boundary (the sum over ranks of their
# cotangents). The region starts typing calls at its first named collective (before it, every
# value is derived from the batch and the parameters, or is a constant, so the type it is given
# holds), and a `loss_fn` without one runs untouched.
# The loss the step differentiates is the mean over ranks of `loss_fn`'s value along the axes it
# varies over: a loss that varies over every data axis keeps the documented mean over ranks; one
# already reduced (`sf.psum(local_sum, "dp") / sf.psum(count, "dp")`, invariant over "dp") is the
# global loss, taken as it is. The backward is seeded with the ranks' share of that mean, and
# `metrics["loss"]`, the mean over ranks of the values, is then the global loss either way.

# Note [steps off the unit schedule]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Two things a `loss_fn` may do are beyond the unit schedule: run a backward of its own through
# the model (a gradient penalty: `torch.autograd.grad(..., create_graph=True)`, or a torch.func
# gradient transform over the inputs or the parameters), and vmap over the parameters themselves
# (an ensemble built with `torch.func.stack_module_state`). The first needs every unit's
# parameters again at moments the schedule does not know (the backward inside the forward, then
# the backward of that backward); the second batches the parameters in C++, past their reads.
# The engine and the `Param`s raise `OffSchedule` at once, before any op computes with a wrong
# value (a backward inside loss_fn is seen when it starts, after the forward), and the step
# starts over from the same random state and buffers (copies of those that forwards update,
# BatchNorm's statistics, are kept for that; loss_fn runs twice on that step), computing on the whole tree,
# gathered with `sf.gather` under plain autograd, whose gradient is the reduce-scatter. The step
# stays there from then on: exact under every strategy, with the parameters and gradients in full
# for the forward and backward, as `no_shard` holds them. Not yet with mixed precision or offload.
# The ranks leave together: a rank that leaves issues the rest of the forward's gathers (once the
# order of units is known, from the second step) and says so in the small exchange that ends every
# forward (Note [units on every rank]), where the others learn it and leave too. So a penalty that
# some ranks take and others do not (it depends on the data) still moves every rank off the
# schedule on the same step. On the first step, whose order of units is not known yet, a rank that
# leaves before its forward has run every unit cannot line its collectives up: take such a
# penalty on every rank, or from the second step on.

def _explain(e: BaseException, off_schedule: bool = False) -> BaseException | None:
    """A clear error for what a failed step's exception means, when shardfn knows (else None);
    `off_schedule`: the step ran on the gathered tree (Note [steps off the unit schedule])."""
    msg = str(e)
    if isinstance(e, RuntimeError) and f"is at version {STALE}" in msg:
        return StaleParameterError(
            "the backward read a unit's parameters while their memory was freed or held another unit, so "
            "nothing was reduced or applied (Note [stale parameters] in shardfn/_flat.py). The unit's "
            "pre-backward was missed: return its outputs as tensors or containers of them, and do not "
            "hand them to code that detaches and re-attaches them. Autograd said: " + msg
        )
    if isinstance(e, RuntimeError) and re.search(r"_PostBackward(Eager)? is a view and is being modified inplace", msg):
        return ValueError(
            "a unit modifies one of its inputs in place (e.g. x.add_(...) or an inplace activation on its "
            "input): shardfn detects the end of a unit's backward on its inputs, as FSDP2 does, so a unit "
            "must not modify them; use the out-of-place op (x = x + ...)"
        )
    if isinstance(e, RuntimeError) and "device meta" in msg and "expected device" in msg:
        if off_schedule:
            return NotImplementedError(
                "a recompute ran in the backward on the module's own (meta) parameters: the model checkpoints "
                "activations itself (gradient_checkpointing_enable(), torch.utils.checkpoint), and this step runs "
                "off the unit schedule (a backward inside loss_fn, Note [steps off the unit schedule] in "
                "shardfn/_core.py), where its recompute is not supported yet. Turn the model's own checkpointing "
                "off for such a loss_fn (e.g. model.gradient_checkpointing_disable())"
            )
        return NotImplementedError(
            "a recompute ran in the backward on the module's own (meta) parameters (Note [the model's own "
            "checkpointing] in shardfn/_recompute.py): the model checkpoints a region outside every unit while "
            "loss_fn applied it to several parameter trees (make the checkpointed modules units, units=...), or "
            "remat= covers a unit whose forward calls another unit (use remat= on units that call no other unit; "
            "Hugging Face decoders also need use_cache=False under remat)"
        )
    if isinstance(e, RuntimeError) and ("unflatten unevenly sharded" in msg or "flatten unevenly sharded" in msg):
        said = "; ".join(line.strip() for line in msg.splitlines() if line.strip())
        return ValueError(
            f"tensor parallel: a view of a tp-sharded activation splits a dim that tp does not divide evenly (DTensor "
            f"said: {said}). This is most often attention heads or key/value heads that are not a multiple of the tp "
            "size, which cannot be laid out on the shards: give that projection's rule a size tp divides "
            "(heads % tp == 0), or keep its leaves whole on tp (drop their rules)"
        )
    if isinstance(e, torch.utils.checkpoint.CheckpointError):
        # torch's check that the recompute saved what the forward saved: a unit's forward that runs
        # other units (their gathers differ between the two), or a forward that is not the same
        # computation twice (a cached parametrization, a value read from outside that changed).
        return NotImplementedError(
            "remat recomputed a unit's forward and it did not save what the forward saved (torch.utils.checkpoint's "
            "check). Either the unit's forward runs other units (nested units, or a unit calling another), which "
            "remat does not support yet, or the forward is not the same computation when run again (a "
            "torch.nn.utils.parametrize.cached() block, state changed between the two runs): leave that unit out "
            f"of remat= ({msg.splitlines()[0]})"
        )
    return None


def trained_leaves(info: Any, paths: list[str], frozen: list, leaves: list | None = None) -> list[bool]:
    """Which leaves are trained: not named by a `frozen=` pattern, and not `requires_grad=False` on
    the module's parameter (as peft freezes). `info` is the model's (None for a plain function).

    The tree's own leaves carry no freezing (`sf.functionalize` hands them out detached): a leaf of
    `leaves` set to `requires_grad=True` where the module or `frozen=` freezes it is refused, as
    the user meant to train it and it would stay frozen."""
    needs_grad = dict(info.module.named_parameters(remove_duplicate=True)) if info is not None else {}
    names = {p: info.aliases[p] if info is not None else [p] for p in paths}  # a tied leaf: every name
    for rx in frozen:
        if not any(rx.fullmatch(n) for p in paths for n in names[p]):
            raise ValueError(
                f"frozen={rx.pattern!r} matches no parameter (patterns match dotted names in full); "
                f"the names look like {[n for p in paths[:6] for n in names[p]][:6]}"
            )
    trained = [
        not any(rx.fullmatch(n) for rx in frozen for n in names[p]) and (p not in needs_grad or needs_grad[p].requires_grad)
        for p in paths
    ]
    if leaves is not None:
        asked = [p for p, t, x in zip(paths, trained, leaves) if not t and isinstance(x, torch.Tensor) and x.requires_grad]
        if asked:
            raise ValueError(
                f"leaves {asked[:5]} of the tree require grad, but they are frozen: shardfn reads which leaves train from "
                "the module's parameters (requires_grad as they were set on the module: the tree sf.functionalize "
                "returns is detached, and a leaf's own flag is not read) and from frozen=. To train them, set it on the "
                "module (model.get_parameter(name).requires_grad_(True), or model.requires_grad_(True)) before "
                "step.init; to freeze others, frozen= or requires_grad_(False) on the module's parameters"
            )
    return trained


def _cast_buffers(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Mixed precision: floating-point buffers of the module, in `dtype` for good."""
    for mod in module.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_floating_point():
                mod._buffers[name] = b.to(dtype)


def _refuse_sparse_gradients(info: Any, paths: list[str], trained: list[bool]) -> None:
    """An embedding with `sparse=True` whose weight is trained: its gradient is a sparse tensor,
    which the flat gradient buffers and their reduce-scatter do not take."""
    if info is None:
        return
    weights = {n for p, t in zip(paths, trained) if t for n in info.aliases.get(p, [p])}
    for name, mod in info.module.named_modules():
        if isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and mod.sparse:
            weight = f"{name}.weight" if name else "weight"
            if weight in weights:
                raise NotImplementedError(
                    f"{name!r} is an {type(mod).__name__} with sparse=True, whose weight's gradient is a sparse tensor; "
                    "sharded gradients are dense flat buffers, reduced as such. Build it with sparse=False (the "
                    "gradient of the rows a batch does not use is zero either way)"
                )


def model_info(apply: Any, paths: list[str], leaves: list) -> Any:
    """The functionalized model whose units a transform runs (`model_of`, refusing to guess between
    several models with these names); None for a plain pure function."""
    return model_of(
        flat=(paths, leaves), apply=apply, what="these params", alike=False,
        hint="say which one loss_fn trains: sf.train_step(..., apply=apply) or sf.value_and_grad(..., apply=apply)",
    )
