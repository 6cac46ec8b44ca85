"""`sf.train_step`: a sharded training step around a pure `loss_fn(params, batch)`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import _collectives as C
from . import _runtime
from ._engine import Engine
from ._flat import Arena, FlatUnit, LeafSlot, LeafSpec, buffer_sizes, has_large_leaves
from ._functional import find_apply
from ._remat import install as install_remat
from ._remat import select_units
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

    def __init__(self, loss_fn, opt, mesh, specs, strategy, mixed_precision, remat, accumulation_steps, max_grad_norm,
                 apply=None, frozen=None, offload=None, accumulation="sharded"):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be a positive int, got {accumulation_steps!r}")
        if accumulation not in ("sharded", "local"):
            raise ValueError(f"accumulation must be 'sharded' (reduce every micro-batch) or 'local' (reduce once), got {accumulation!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise ValueError("mixed_precision must be an sf.MixedPrecision(...) or None")
        if offload not in (None, "cpu"):
            raise ValueError(f"offload must be None or 'cpu', got {offload!r}")
        if not isinstance(mesh, DeviceMesh):
            raise ValueError(f"mesh must be a DeviceMesh (see sf.mesh), got {type(mesh).__name__}")
        names = tuple(mesh.mesh_dim_names or ())
        if strategy == "hybrid_shard":
            if mesh.ndim != 2:
                raise ValueError(
                    f"strategy='hybrid_shard' needs a 2-D mesh (replicate, shard), e.g. sf.mesh(replicate=2, shard=-1); got axes {names}"
                )
            self.shard_axis, self.replicate_axis = names[1], names[0]
        else:
            if mesh.ndim != 1:
                raise ValueError(
                    f"strategy={strategy!r} shards over a 1-D mesh; got axes {names}. For a 2-D mesh use strategy='hybrid_shard'"
                )
            self.shard_axis, self.replicate_axis = names[0], None
        self.loss_fn = loss_fn
        self.opt = opt
        self.mesh = mesh
        self.specs = specs
        self.strategy = strategy
        self.mp = mixed_precision or MixedPrecision()
        self.remat = remat
        self.accumulation_steps = accumulation_steps
        self.accumulation = accumulation
        self.max_grad_norm = max_grad_norm
        self.apply = apply
        self.frozen = _compile(frozen, "frozen")
        self.offload = offload
        self.group = mesh.get_group(self.shard_axis)
        self.replicate_group = mesh.get_group(self.replicate_axis) if self.replicate_axis else None
        self.shard_world = mesh.size(names.index(self.shard_axis))
        self.world = mesh.size()
        self.rank = mesh.get_local_rank(self.shard_axis)
        self.engine: Engine | None = None
        self.max_reductions = 1  # gradient reductions in flight at once (each may hold a full-size input)

    # -- init -----------------------------------------------------------------------------------
    def init(self, params: Any) -> TrainState:
        """Shards `params` into this step's flat buffers and initializes the optimizer.

        Args:
            params: the full parameter tree (same values on every rank), or a DTensor tree.

        Returns:
            `TrainState(params=<DTensor tree>, opt_state=..., step=0)`; frozen leaves get no
            optimizer state.
        """
        spec_tree = self.specs if self.specs is not None else make_specs(params, self.mesh, default=P(self.shard_axis))
        paths, leaves, spec_list, treespec = match_specs(params, spec_tree, self.mesh)
        if self.strategy == "no_shard":
            spec_list = [P() for _ in leaves]
        for path, leaf, spec in zip(paths, leaves, spec_list):
            bad_dim = any(spec.axes_of(d) for d in range(1, len(spec)))
            if bad_dim or spec.axes_of(0) not in ((), (self.shard_axis,)):
                raise NotImplementedError(
                    f"leaf {path!r} (shape {tuple(leaf.shape)}) has spec {spec!r}: the train step shards dim 0 over "
                    f"{self.shard_axis!r} only for now; use P({self.shard_axis!r}) or P()"
                )
        info = self.apply.info if self.apply is not None else find_apply(paths)
        unit_of = [info.unit_of[p] if info is not None else -1 for p in paths]
        n_units = len(info.unit_names) if info is not None else 0
        trained = [not any(rx.fullmatch(p) for rx in self.frozen) for p in paths]
        device = self.mesh.device_type
        members: dict[int, list[int]] = {u: [] for u in [*range(n_units), -1]}
        for i, u in enumerate(unit_of):
            members[u].append(i)

        specs_of = {u: [LeafSpec(i, paths[i], leaves[i].shape, bool(spec_list[i].axes_of(0)), trained[i]) for i in idx] for u, idx in members.items()}
        dtype_of = {}
        for u, idx in members.items():
            dtypes = {leaves[i].dtype for i in idx}
            if len(dtypes) > 1:
                raise NotImplementedError(
                    f"unit {info.unit_names[u] if u >= 0 else '<root>'!r} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                    "give each unit one dtype"
                )
            dtype_of[u] = dtypes.pop() if dtypes else torch.float32
        arenas, unit_slot, reduce_arenas = self._arenas(info, specs_of, dtype_of, device)

        units: dict[int, FlatUnit] = {}
        slot_of: list[tuple[int, int]] = [None] * len(leaves)  # type: ignore[list-item]
        for u, idx in members.items():
            compute = self.mp.param_dtype or dtype_of[u]
            units[u] = FlatUnit(
                name=(info.unit_names[u] if u >= 0 else ""),
                leaves=specs_of[u],
                dtype=dtype_of[u],
                compute_dtype=compute,
                reduce_dtype=self.mp.reduce_dtype or compute,
                group=self.group,
                world=self.shard_world,
                rank=self.rank,
                device=device,
                arenas=arenas[u],
                replicate_group=self.replicate_group,
                offload=self.offload == "cpu",
                reduce_in_full=u == -1 or u in unit_slot,
                direct_gather=self._direct_gather,
            )
            for j, s in enumerate(units[u].slots):
                slot_of[s.index] = (u, j)

        # Fill the local shards and build the user-facing DTensors over them.
        dt_params, dt_grads, proxies = [], [], []
        with torch.no_grad():
            for i, (leaf, spec) in enumerate(zip(leaves, spec_list)):
                u, j = slot_of[i]
                unit, s = units[u], units[u].slots[j]
                src = leaf.full_tensor() if isinstance(leaf, DTensor) else leaf
                if src.is_meta:
                    raise ValueError(f"leaf {paths[i]!r} is on the meta device: materialize the parameters before init")
                src = src.detach()
                if s.sharded:
                    src = src[self.rank * s.chunk : self.rank * s.chunk + s.local_rows]
                unit.local_views[j].copy_(src)
                placements = placements_for(spec, self.mesh)
                dt_params.append(self._dtensor(unit.local_views[j], placements, s))
                dt_grads.append(self._dtensor(unit.grad_views[j], placements, s) if s.trained else None)
                proxies.append(unit.proxies[j])
        if info is not None and self.mp.buffer_dtype is not None:
            _cast_buffers(info.module, self.mp.buffer_dtype)
        # Gradient segments for the clip, and this rank's part of each for the norm: a gradient held
        # by several ranks (a sharded segment by every replica of a hybrid mesh, a replicated one by
        # every rank) is identical on all of them once reduced, so each sums the squares of its own
        # 1/copies of it and the metrics all-reduce adds the parts.
        replicas = self.world // self.shard_world
        replica_rank = self.mesh.get_local_rank(self.replicate_axis) if self.replicate_axis else 0
        global_rank = replica_rank * self.shard_world + self.rank if self.replicate_axis else self.rank
        segs, parts = [], []
        for u in units.values():
            for seg, copies, i in (
                (u.grad[u.S_frozen : u.S], replicas, replica_rank),
                (u.grad[u.S : u.S + u.R_trained], self.world, global_rank),
            ):
                if seg.numel():
                    c = -(-seg.numel() // copies)
                    segs.append(seg)
                    parts.append(seg[i * c : (i + 1) * c])
        self._norm_segments = segs
        self._norm_parts = [p for p in parts if p.numel()]
        self.treespec = treespec
        self.paths = paths
        self._units = units
        self._dt_params = dt_params
        self._trained = trained
        self.grads = optree.tree_unflatten(treespec, dt_grads)
        self.proxy_tree = optree.tree_unflatten(treespec, proxies)
        self.engine = Engine(
            info,
            [units[u] for u in range(n_units)],
            units[-1],
            reshard_after_forward=self.strategy in ("full_shard", "hybrid_shard"),
            cast_dtype=self.mp.param_dtype,
            slot_of=unit_slot,
            reduce_arenas=reduce_arenas,
            max_reductions=self.max_reductions,
            arenas=_unique([*(a for d in arenas.values() for a in d.values()), *(a for p in reduce_arenas for a in p)]),
        )
        if self.remat:
            if info is None:
                raise ValueError("remat needs units: functionalize the model with units=... (or pass apply=)")
            self.engine.remat_units = select_units(self.remat, info.unit_names)
            for u in self.engine.remat_units:
                install_remat(info, u)
        params_tree = optree.tree_unflatten(treespec, dt_params)
        return TrainState(params=params_tree, opt_state=self.opt.init(self._trainable(params_tree)), step=0)

    def _arenas(self, info, specs_of: dict, dtype_of: dict, device) -> tuple[dict, dict, list]:
        """Arenas per unit (shared by slot under full_shard, see Note [slot arenas]) and for reductions."""
        W, r = self.shard_world, self.rank
        self._direct_gather = W > 1 and C.point_to_point(self.group, device)
        sizes = {u: buffer_sizes(specs_of[u], W, r, self._direct_gather) for u in specs_of}
        compute = {u: self.mp.param_dtype or dtype_of[u] for u in specs_of}
        reduce = {u: self.mp.reduce_dtype or compute[u] for u in specs_of}
        names = info.unit_names if info is not None else []
        nested = any(b.startswith(a + ".") for a in names for b in names)
        share = (
            self.strategy in ("full_shard", "hybrid_shard")
            and bool(names)
            and not nested
            and len({compute[u] for u in range(len(names))}) <= 1
        )
        # Gathers that land in place write a slot as soon as they start, while the slot of the unit
        # two places later may still hold its reduction's input: a third slot (Note [slot arenas]).
        self._slots_in_place = self._direct_gather and any(has_large_leaves(specs_of[u], W) for u in range(len(names)))
        n_slots = 3 if self._slots_in_place else 2
        unit_slot = {u: u % n_slots for u in range(len(names))} if share else {}
        self.max_reductions = self._reductions_in_flight(share, dtype_of, len(names))
        arenas: dict[int, dict[str, Arena]] = {}
        slots: dict[int, dict[str, Arena]] = {}
        if share:  # one all-gather output for all units: the engine has one unit gather in flight
            gathered = Arena(max(sizes[v]["gathered"] for v in unit_slot), compute[0], device, shared=True)
        for u in specs_of:
            if u in unit_slot:
                k = unit_slot[u]
                if k not in slots:
                    members = [v for v in unit_slot if unit_slot[v] == k]
                    slots[k] = {
                        name: Arena(max(sizes[v][name] for v in members), compute[u], device, shared=True)
                        for name in ("full", "stage")
                    }
                    slots[k]["gathered"] = gathered
                arenas[u] = slots[k]
            else:
                arenas[u] = {name: Arena(sizes[u][name], compute[u], device, shared=False) for name in ("full", "gathered", "stage")}
        rdt = {reduce[u] for u in specs_of}
        if len(rdt) > 1:
            raise NotImplementedError(f"units reduce in different dtypes {sorted(map(str, rdt))}; give every unit one dtype")
        rdt_one = rdt.pop()
        in_full = {u for u in specs_of if (u == -1 or u in unit_slot) and reduce[u] == compute[u]}
        n_in = max([sizes[u]["rs_in"] for u in specs_of if u not in in_full], default=0)
        n_out = max(sizes[u]["rs_out"] for u in specs_of)
        reduce_arenas = [(Arena(n_in, rdt_one, device, shared=True), Arena(n_out, rdt_one, device, shared=True)) for _ in range(self.max_reductions)]
        return arenas, unit_slot, reduce_arenas

    def _reductions_in_flight(self, share: bool, dtype_of: dict, n_units: int) -> int:
        """How many gradient reductions may overlap the backward without any extra buffer."""
        master = dtype_of[-1]
        one_dtype = len(set(dtype_of.values())) == 1 and self.offload is None
        reduce_in_master = one_dtype and (self.mp.reduce_dtype or self.mp.param_dtype or master) == master
        if self.strategy == "no_shard" and reduce_in_master and (self.accumulation_steps == 1 or self.accumulation == "local"):
            # Replicated gradients are all-reduced in place in their flat buffers, which need no
            # scratch: every unit's all-reduce may run while the backward goes on, as DDP's buckets.
            return n_units + 1
        if share and reduce_in_master and self.mp.param_dtype in (None, master) and self.accumulation_steps == 1 and not self._slots_in_place:
            # Each reduction's input lives in its own unit's slot and neighbours use different
            # slots: two can be in flight (the engine finishes a slot's reduction before refilling it).
            # Not when gathers land in place: their third slot already holds one reduction's input
            # while the previous unit is gathered, and a second would hold a fourth unit.
            return 2
        return 1

    def _trainable(self, tree: Any) -> Any:
        """`tree` with frozen leaves replaced by None: what the optimizer sees."""
        if all(self._trained):
            return tree
        leaves = optree.tree_leaves(tree)
        return optree.tree_unflatten(self.treespec, [x if t else None for x, t in zip(leaves, self._trained)])

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
        for u in self._units.values():  # the last step's gradient shards are spent
            u.release_grad()
        k = self.accumulation_steps
        local = self.accumulation == "local"
        scale = 1.0 / (self.world * k)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.mesh.device_type)
        aux = None
        engine = self.engine
        try:
            with _runtime.activate(engine):
                for m, micro in enumerate(_split_batch(batch, k)):
                    last = m == k - 1
                    engine.begin(accumulate=m > 0 and not local, reduce=last or not local)
                    loss, aux = _split_loss(self.loss_fn(self.proxy_tree, micro))
                    loss_sum += loss.detach().float()
                    torch.autograd.backward(loss * scale)
                    engine.end()
        except BaseException:
            engine.abort()
            raise
        # One all-reduce for the loss and the squared gradient norm (one foreach kernel over the
        # trained gradient segments, on their own device: the CPU under offload).
        norms = torch.stack(torch._foreach_norm(self._norm_parts, 2)).to(loss_sum.device) if self._norm_parts else loss_sum.new_zeros(1)
        sq = norms.float().square().sum()
        stats = torch.stack([loss_sum / k, sq])
        if self.world > 1:
            C.all_reduce(stats, None if self.replicate_group is not None else self.group)
        loss_mean = stats[0] / self.world
        grad_norm = stats[1].sqrt()
        if self.max_grad_norm is not None:
            coef = torch.clamp(self.max_grad_norm / (grad_norm + 1e-6), max=1.0)
            if self._norm_segments:  # the trained segments: frozen ones hold no gradient
                torch._foreach_mul_(self._norm_segments, coef.to(self._norm_segments[0].device))
        opt_state = self._optimize(params, state.opt_state)
        metrics = {"loss": loss_mean, "grad_norm": grad_norm, "aux": aux}
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

    def _optimize(self, params: Any, opt_state: Any) -> Any:
        trainable = self._trainable(params)
        step_ = getattr(self.opt.update, "step_", None)
        if step_ is not None:
            return step_(self.grads, opt_state, trainable)
        from .optim import apply_updates

        updates, opt_state = self.opt.update(self.grads, opt_state, trainable)
        new = optree.tree_leaves(apply_updates(trainable, updates))
        old = optree.tree_leaves(trainable)
        with torch.no_grad():
            torch._foreach_copy_([p._local_tensor for p in old], [x._local_tensor if isinstance(x, DTensor) else x for x in new])
        return opt_state


def _unique(items: list) -> list:
    out, seen = [], set()
    for x in items:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


def _compile(patterns: Any, what: str) -> list:
    if patterns is None:
        return []
    pats = [patterns] if isinstance(patterns, str) else list(patterns)
    try:
        return [re.compile(p) for p in pats]
    except (re.error, TypeError) as e:
        raise ValueError(f"{what} must be a regex or a list of regexes over dotted parameter names: {e}") from None


def _cast_buffers(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Mixed precision: floating-point buffers of the module, in `dtype` for good."""
    for mod in module.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_floating_point():
                mod._buffers[name] = b.to(dtype)


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
    frozen: str | Sequence[str] | None = None,
    offload: str | None = None,
    accumulation: str = "sharded",
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
        strategy: "full_shard", "shard_grad_op" (no re-gather in backward), "no_shard" (DDP), or
            "hybrid_shard" (on `sf.mesh(replicate=R, shard=S)`: shard within the shard axis,
            all-reduce gradients across the replicate axis).
        mixed_precision: dtypes for compute, reduction and buffers, or None.
        remat: recompute unit activations in backward: True for every unit, or a regex (or list)
            over unit names.
        accumulation_steps: micro-batches per step, split from `batch` along dim 0.
        max_grad_norm: clip gradients to this global norm, or None.
        apply: the `sf.functionalize` function whose units to use (default: found by the params' names).
        frozen: a regex (or list) over dotted parameter names: those leaves are not trained (no
            gradient, no reduction, no optimizer state).
        offload: "cpu" keeps sharded params, gradients and optimizer state in pinned CPU memory and
            steps the optimizer there (CUDA meshes; on a CPU mesh everything already is on the CPU,
            so it changes nothing).
        accumulation: "sharded" reduce-scatters every micro-batch into the sharded gradient (memory
            stays flat); "local" keeps full gradients across micro-batches and reduces once (less
            communication, more memory).

    Returns:
        A `TrainStep`: `state = step.init(params)`, then `state, metrics = step(state, batch)`.

    Example:
        >>> step = sf.train_step(loss_fn, sf.optim.adamw(1e-3), sf.mesh(dp=-1))
        >>> state = step.init(params)
        >>> state, metrics = step(state, batch)
    """
    return TrainStep(
        loss_fn, opt, mesh, specs, strategy, mixed_precision, remat, accumulation_steps, max_grad_norm,
        apply=apply, frozen=frozen, offload=offload, accumulation=accumulation,
    )
