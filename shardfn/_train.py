"""`sf.train_step`: a sharded training step around a pure `loss_fn(params, batch)`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import optree
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import _collectives as C
from . import _runtime
from ._engine import Engine
from ._flat import FlatUnit, LeafSlot
from ._functional import find_apply
from ._spec import P, match_specs, placements_for, specs as make_specs
from ._tree import tree_flatten_with_paths

__all__ = ["TrainState", "MixedPrecision", "TrainStep", "train_step", "STRATEGIES"]

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")


class TrainState(NamedTuple):
    """What a train step carries from one step to the next.

    Attributes:
        params: the parameter tree, DTensor leaves holding this rank's shards (fp32 master weights).
        opt_state: the optimizer state, sharded like `params`.
        step: the number of steps taken.
    """

    params: Any
    opt_state: Any
    step: int = 0


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
            if v is not None and not (isinstance(v, torch.dtype) and v.is_floating_point):
                raise ValueError(f"MixedPrecision.{name} must be a floating-point torch.dtype or None, got {v!r}")


def _split_loss(out: Any) -> tuple[torch.Tensor, Any]:
    if isinstance(out, tuple) and len(out) == 2:
        loss, aux = out
    else:
        loss, aux = out, None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar tensor (or (loss, aux)), got {type(loss).__name__} {getattr(loss, 'shape', '')}")
    if not loss.requires_grad:
        raise ValueError("the loss does not depend on the params: loss_fn must compute it from its `params` argument")
    return loss, aux


def _split_batch(batch: Any, k: int) -> list[Any]:
    if k == 1:
        return [batch]
    leaves, spec = optree.tree_flatten(batch)
    parts = []
    for x in leaves:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] % k:
            raise ValueError(
                f"accumulation_steps={k} splits every batch tensor along dim 0 in {k} equal parts; "
                f"got a leaf of shape {getattr(x, 'shape', type(x).__name__)}"
            )
        parts.append(x.chunk(k))
    return [optree.tree_unflatten(spec, [p[i] for p in parts]) for i in range(k)]


class TrainStep:
    """A sharded train step; see `train_step`. Call `init(params)` once, then `step(state, batch)`."""

    def __init__(self, loss_fn, opt, mesh, specs, strategy, mixed_precision, remat, accumulation_steps, max_grad_norm, apply=None):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if strategy == "hybrid_shard":
            raise NotImplementedError("strategy='hybrid_shard' is not supported yet; use 'full_shard' on a 1-D mesh")
        if remat:
            raise NotImplementedError("remat=True is not supported yet")
        if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be a positive int, got {accumulation_steps!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise ValueError("mixed_precision must be an sf.MixedPrecision(...) or None")
        if not isinstance(mesh, DeviceMesh):
            raise ValueError(f"mesh must be a DeviceMesh (see sf.mesh), got {type(mesh).__name__}")
        if mesh.ndim != 1:
            raise NotImplementedError(f"train_step supports 1-D meshes for now; got axes {mesh.mesh_dim_names}")
        self.loss_fn = loss_fn
        self.opt = opt
        self.mesh = mesh
        self.specs = specs
        self.strategy = strategy
        self.mp = mixed_precision or MixedPrecision()
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.apply = apply
        self.group = mesh.get_group()
        self.world = mesh.size()
        self.rank = mesh.get_local_rank()
        self.engine: Engine | None = None

    # -- init -----------------------------------------------------------------------------------
    def init(self, params: Any) -> TrainState:
        """Shards `params` into this step's flat buffers and initializes the optimizer.

        Args:
            params: the full parameter tree (same values on every rank), or a DTensor tree.

        Returns:
            `TrainState(params=<DTensor tree>, opt_state=..., step=0)`.
        """
        spec_tree = self.specs if self.specs is not None else make_specs(params, self.mesh)
        paths, leaves, spec_list, treespec = match_specs(params, spec_tree, self.mesh)
        if self.strategy == "no_shard":
            spec_list = [P() for _ in leaves]
        for path, leaf, spec in zip(paths, leaves, spec_list):
            if any(spec.axes_of(d) for d in range(1, len(spec))):
                raise NotImplementedError(
                    f"leaf {path!r} (shape {tuple(leaf.shape)}) has spec {spec!r}: the train step shards dim 0 "
                    "only for now; use P('dp') or P()"
                )
        info = self.apply.info if self.apply is not None else find_apply(paths)
        unit_of = [info.unit_of[p] if info is not None else -1 for p in paths]
        n_units = len(info.unit_names) if info is not None else 0
        device = self.mesh.device_type
        W, r = self.world, self.rank
        members: dict[int, list[int]] = {u: [] for u in [*range(n_units), -1]}
        for i, u in enumerate(unit_of):
            members[u].append(i)

        units: dict[int, FlatUnit] = {}
        self._slot_of: list[tuple[int, int]] = [None] * len(leaves)  # type: ignore[list-item]
        for u, idx in members.items():
            dtypes = {leaves[i].dtype for i in idx}
            if len(dtypes) > 1:
                raise NotImplementedError(
                    f"unit {info.unit_names[u] if u >= 0 else '<root>'!r} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                    "give each unit one dtype"
                )
            dtype = dtypes.pop() if dtypes else torch.float32
            slots = []
            off = 0
            full_off = 0
            ordered = [i for i in idx if spec_list[i].axes_of(0)] + [i for i in idx if not spec_list[i].axes_of(0)]
            for i in ordered:
                leaf, sharded = leaves[i], bool(spec_list[i].axes_of(0))
                shape = leaf.shape
                if sharded:
                    rows = shape[0]
                    chunk = -(-rows // W)
                    row_numel = shape[1:].numel()
                    local_rows = max(0, min(rows - r * chunk, chunk))
                else:
                    chunk, row_numel = (shape[0], shape[1:].numel()) if leaf.dim() else (1, 1)
                    local_rows = chunk
                s = LeafSlot(i, paths[i], shape, sharded, chunk, row_numel, local_rows, off, full_off)
                off += s.seg_numel
                if sharded:
                    full_off += W * s.seg_numel
                slots.append(s)
            compute = self.mp.param_dtype or dtype
            reduce = self.mp.reduce_dtype or compute
            unit = FlatUnit(
                name=(info.unit_names[u] if u >= 0 else ""),
                slots=slots,
                dtype=dtype,
                compute_dtype=compute,
                reduce_dtype=reduce,
                group=self.group,
                world=W,
                rank=r,
                device=device,
                requires_grad=[True] * len(slots),
            )
            units[u] = unit
            for j, s in enumerate(slots):
                self._slot_of[s.index] = (u, j)

        # Fill the local shards and build the user-facing DTensors over them.
        dt_params, dt_grads, proxies = [], [], []
        with torch.no_grad():
            for i, (leaf, spec) in enumerate(zip(leaves, spec_list)):
                u, j = self._slot_of[i]
                unit, s = units[u], units[u].slots[j]
                src = leaf.full_tensor() if isinstance(leaf, DTensor) else leaf
                if src.is_meta:
                    raise ValueError(f"leaf {paths[i]!r} is on the meta device: materialize the parameters before init")
                src = src.detach().to(device)
                if s.sharded:
                    src = src[r * s.chunk : r * s.chunk + s.local_rows]
                unit.local_views[j].copy_(src)
                placements = placements_for(spec, self.mesh)
                dt_params.append(self._dtensor(unit.local_views[j], placements, s))
                dt_grads.append(self._dtensor(unit.grad_views[j], placements, s))
                proxies.append(unit.proxies[j])
        self.treespec = treespec
        self.paths = paths
        self._units = units
        self._dt_params = dt_params
        self._local_params = [unit.local for unit in units.values()]
        self.grads = optree.tree_unflatten(treespec, dt_grads)
        self.proxy_tree = optree.tree_unflatten(treespec, proxies)
        self.engine = Engine(
            info,
            [units[u] for u in range(n_units)],
            units[-1],
            reshard_after_forward=self.strategy == "full_shard",
        )
        params_tree = optree.tree_unflatten(treespec, dt_params)
        return TrainState(params=params_tree, opt_state=self.opt.init(params_tree), step=0)

    def _dtensor(self, local: torch.Tensor, placements, s: LeafSlot) -> DTensor:
        stride = torch.empty(s.shape, device="meta").stride()
        return DTensor.from_local(local, self.mesh, placements, run_check=False, shape=s.shape, stride=stride)

    def _adopt(self, params: Any) -> Any:
        """Makes `params` this step's own flat-buffer DTensors (copying values in if they are not)."""
        leaves = optree.tree_leaves(params)
        if len(leaves) == len(self._dt_params) and all(a is b for a, b in zip(leaves, self._dt_params)):
            return params
        paths, leaves, _ = tree_flatten_with_paths(params)
        if paths != self.paths:
            raise ValueError("state.params does not have the structure this step was initialized with")
        with torch.no_grad():
            for i, leaf in enumerate(leaves):
                dst = self._dt_params[i]
                if not isinstance(leaf, DTensor) or leaf.placements != dst.placements or leaf.shape != dst.shape:
                    raise ValueError(
                        f"state.params leaf {paths[i]!r} is {type(leaf).__name__} "
                        f"{getattr(leaf, 'placements', '')} {tuple(leaf.shape)}; expected a DTensor "
                        f"{dst.placements} {tuple(dst.shape)} as step.init returns"
                    )
                dst._local_tensor.copy_(leaf._local_tensor)
        return optree.tree_unflatten(self.treespec, self._dt_params)

    # -- the step -------------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        if self.engine is None:
            raise ValueError("call step.init(params) before the first step")
        params = self._adopt(state.params)
        k = self.accumulation_steps
        scale = 1.0 / (self.world * k)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.mesh.device_type)
        aux = None
        engine = self.engine
        try:
            with _runtime.activate(engine):
                for m, micro in enumerate(_split_batch(batch, k)):
                    engine.begin(accumulate=m > 0)
                    loss, aux = _split_loss(self.loss_fn(self.proxy_tree, micro))
                    loss_sum += loss.detach().float()
                    torch.autograd.backward(loss * scale)
                    engine.end()
        except BaseException:
            engine.abort()
            raise
        grads = [u.grad for u in self._units.values()]
        # One all-reduce for the loss and the squared gradient norm. Replicated segments are the
        # same on every rank after their all-reduce, so each rank counts 1/W of them.
        sq = torch.zeros((), dtype=torch.float32, device=loss_sum.device)
        for u in self._units.values():
            if u.S:
                sq += u.grad[: u.S].float().square().sum()
            if u.R:
                sq += u.grad[u.S :].float().square().sum() / self.world
        stats = torch.stack([loss_sum / k, sq])
        if self.world > 1:
            C.all_reduce(stats, self.group)
        loss_mean = stats[0] / self.world
        grad_norm = stats[1].sqrt()
        if self.max_grad_norm is not None:
            coef = torch.clamp(self.max_grad_norm / (grad_norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        opt_state = self._optimize(params, state.opt_state)
        metrics = {"loss": loss_mean, "grad_norm": grad_norm, "aux": aux}
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

    def _optimize(self, params: Any, opt_state: Any) -> Any:
        step_ = getattr(self.opt.update, "step_", None)
        if step_ is not None:
            return step_(self.grads, opt_state, params)
        from .optim import apply_updates

        updates, opt_state = self.opt.update(self.grads, opt_state, params)
        new = optree.tree_leaves(apply_updates(params, updates))
        with torch.no_grad():
            torch._foreach_copy_([p._local_tensor for p in self._dt_params], [x._local_tensor if isinstance(x, DTensor) else x for x in new])
        return opt_state


def train_step(
    loss_fn: Callable[[Any, Any], Any],
    opt: Any,
    mesh: DeviceMesh,
    specs: Any = None,
    strategy: str = "full_shard",
    mixed_precision: MixedPrecision | None = None,
    remat: bool = False,
    accumulation_steps: int = 1,
    max_grad_norm: float | None = None,
    *,
    apply: Any = None,
) -> TrainStep:
    """Builds a sharded train step around `loss_fn(params, batch)`.

    Parameters, gradients and optimizer state are sharded over `mesh`; each unit of the model (the
    `units` of the `sf.functionalize` that `loss_fn` calls) is gathered just before its forward and
    freed right after, gathered again for its backward, and its gradients are reduce-scattered as
    soon as they are complete (see Note [unit schedule] in `shardfn/_engine.py`).

    Args:
        loss_fn: `loss_fn(params, batch) -> loss` or `(loss, aux)`; `params` are full tensors in the
            compute dtype, `batch` this rank's local batch.
        opt: a `GradientTransformation` (see `sf.optim`).
        mesh: the device mesh (see `sf.mesh`).
        specs: a tree of `P` like `params` (default: `sf.specs(params, mesh)`).
        strategy: "full_shard", "shard_grad_op" (no re-gather in backward) or "no_shard" (DDP).
        mixed_precision: dtypes for compute and reduction, or None.
        remat: recompute each unit's activations in backward.
        accumulation_steps: micro-batches per step, split from `batch` along dim 0.
        max_grad_norm: clip gradients to this global norm, or None.
        apply: the `sf.functionalize` function whose units to use (default: found by the params' names).

    Returns:
        A `TrainStep`: `state = step.init(params)`, then `state, metrics = step(state, batch)`.

    Example:
        >>> step = sf.train_step(loss_fn, sf.optim.adamw(1e-3), sf.mesh(dp=-1))
        >>> state = step.init(params)
        >>> state, metrics = step(state, batch)
    """
    return TrainStep(loss_fn, opt, mesh, specs, strategy, mixed_precision, remat, accumulation_steps, max_grad_norm, apply)
