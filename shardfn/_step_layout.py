"""How a train step lays a parameter tree out: the mesh's roles, each leaf's split, the unit groups
and their flat buffers, the engine's policy, the clip's norm plan.

`StepLayout` is decided once per step from its options and the tree's specs; `GradientCore`
builds from it, and `sf.estimate_memory` sizes the same layout without any buffer (Note [flat unit
layout] in `_flat.py`, Note [unit groups] in `_engine.py`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import _collectives as C
from . import _donate
from ._agree import Item, agree
from ._meta_init import check_init, empty_buffers, materialize
from ._engine import Policy, group_name, plan_groups
from ._flat import FlatUnit, LeafSpec, norm_parts
from ._spec import P, match_specs, placements_for, specs as make_specs
from ._tp_layout import dp_dim, local_part, local_shape, split_specs, state_spec

__all__ = ["StepLayout", "nested_units"]


def nested_units(names: list[str]) -> set[int]:
    """The units that hold, or are held by, another unit."""
    return {i for i, a in enumerate(names) for b in names if a != b and (a.startswith(b + ".") or b.startswith(a + "."))}


class StepLayout:
    """The layout of a step's tree over its mesh (options as in `sf.train_step`).

    Attributes:
        shard_axis, replicate_axis, tp_axis: the mesh's roles: FSDP over `shard_axis`, replicas
            over `replicate_axis` (hybrid_shard), tensor parallel over `tp_axis` (None without).
        group, replicate_group: their process groups; shard_world, world, rank: sizes, this rank.
        data_world, data_axes: the ranks (and axes) over which the batch is split.
        dims, tp_dims, fsdp, shapes: per leaf (after `leaf_specs`), the dim split over the shard
            axis, over tp, whether it is FSDP'd, and this rank's tp shard's shape.
    """

    def __init__(self, mesh: DeviceMesh, specs: Any, strategy: str, mp: Any, offload: str | None,
                 group_bytes: int, keep_last_unit: bool, accumulation_steps: int, accumulation: str):
        self.mesh, self.specs, self.strategy, self.mp, self.offload = mesh, specs, strategy, mp, offload
        self.group_bytes, self.keep_last_unit = group_bytes, keep_last_unit
        self.accumulation_steps, self.accumulation = accumulation_steps, accumulation
        names = tuple(mesh.mesh_dim_names or ())
        if strategy == "hybrid_shard":
            if mesh.ndim != 2:
                raise ValueError(
                    f"strategy='hybrid_shard' needs a 2-D mesh (replicate, shard), e.g. sf.mesh(replicate=-1, shard=-1) (shard within each node, replicate across nodes); got axes {names}"
                )
            self.shard_axis, self.replicate_axis = names[1], names[0]
        elif mesh.ndim == 2:  # (dp, tp): FSDP over the first axis, tensor parallel over the second
            if strategy not in ("full_shard", "shard_grad_op"):
                raise NotImplementedError(
                    f"strategy={strategy!r} on a 2-D mesh {names}: FSDP x tensor parallel runs under 'full_shard' or "
                    "'shard_grad_op'; hybrid_shard takes a (replicate, shard) mesh without tensor parallel"
                )
            if offload is not None:
                raise NotImplementedError(f"offload={offload!r} with tensor parallel (a 2-D mesh {names}) is not supported yet")
            if names[0] == "tp" or names[1] == "dp":
                # The roles go by position; these are the names `sf.rules` and `sf.specs` use for them.
                raise ValueError(
                    f"on a 2-D mesh the first axis is the data (FSDP) axis and the second tensor parallel, by position; "
                    f"this mesh's axes are {names}: build it with the data axis first, "
                    f"sf.mesh({names[1]}={mesh.size(1)}, {names[0]}={mesh.size(0)})"
                )
            self.shard_axis, self.replicate_axis = names[0], None
        else:
            if mesh.ndim != 1:
                raise ValueError(
                    f"strategy={strategy!r} shards over a 1-D mesh, or a (dp, tp) mesh for FSDP x tensor parallel; got axes "
                    f"{names}. For a (replicate, shard) mesh use strategy='hybrid_shard'"
                )
            self.shard_axis, self.replicate_axis = names[0], None
        self.group = mesh.get_group(self.shard_axis)
        self.replicate_group = mesh.get_group(self.replicate_axis) if self.replicate_axis else None
        self.shard_world = mesh.size(names.index(self.shard_axis))
        self.world = mesh.size()
        self.rank = mesh.get_local_rank(self.shard_axis)
        # Tensor parallel (Note [tensor parallel forward] in `_tp.py`): ranks that differ only in
        # their tp coordinate compute the same loss; the mean is over the dp ranks.
        self.tp_axis = names[1] if mesh.ndim == 2 and strategy != "hybrid_shard" else None
        self.tp_size = mesh.size(1) if self.tp_axis else 1
        self.tp_rank = mesh.get_local_rank(self.tp_axis) if self.tp_axis else 0
        self.data_world = self.world // self.tp_size
        self.data_axes = (self.replicate_axis, self.shard_axis) if self.replicate_axis else (self.shard_axis,)

    def leaf_specs(self, params: Any) -> tuple[list[str], list, list[P], Any]:
        """The tree's paths, leaves, one `P` per leaf (checked: one dim over the shard axis), structure;
        sets `_dims`, the dim each leaf is split on over the shard axis (None: replicated over it)."""
        spec_tree = self.specs if self.specs is not None else make_specs(params, self.mesh, default=P(self.shard_axis))
        paths, leaves, spec_list, treespec = match_specs(params, spec_tree, self.mesh)
        if self.tp_axis is not None:
            self._refuse_idle_tp_axis(spec_list)
            self.tp_dims = [split_specs(p, x.shape, s, self.shard_axis, self.tp_axis, self.shard_world) for p, x, s in zip(paths, leaves, spec_list)]
            # Every leaf is FSDP'd over dp, within its tp shard: on the dim its spec names dp on, else dim 0.
            self.dims = [dp_dim(s, self.shard_axis) if x.dim() > 0 else None for x, s in zip(leaves, spec_list)]
            self.fsdp = [d is not None for d in self.dims]
            self.shapes = [local_shape(x.shape, d, self.tp_rank, self.tp_size) for x, d in zip(leaves, self.tp_dims)]
            self._refuse_offload_off_dim0(paths, leaves, spec_list)
            return paths, leaves, spec_list, treespec
        if self.strategy == "no_shard":
            spec_list = [P() for _ in leaves]
        self.dims = []
        for path, leaf, spec in zip(paths, leaves, spec_list):
            split = [d for d in range(len(spec)) if spec.axes_of(d)]
            if len(split) > 1 or (split and spec.axes_of(split[0]) != (self.shard_axis,)):
                raise NotImplementedError(
                    f"leaf {path!r} (shape {tuple(leaf.shape)}) has spec {spec!r}: the train step shards one dim over "
                    f"{self.shard_axis!r} and nothing else on this mesh; use e.g. P({self.shard_axis!r}), "
                    f"P(None, {self.shard_axis!r}) or P()"
                )
            self.dims.append(split[0] if split else None)
        self._refuse_offload_off_dim0(paths, leaves, spec_list)
        return paths, leaves, spec_list, treespec

    def _refuse_idle_tp_axis(self, spec_list: list) -> None:
        """A 2-D mesh whose second (tensor-parallel) axis no spec names would have its ranks repeat
        each other's work, every leaf whole on them: most often the axes are in the other order
        (`sf.mesh(tp=2, dp=2)`, whose data axis is `tp`). Refused before anything is built."""
        if self.tp_size == 1 or any(self.tp_axis in s.axes for s in spec_list):
            return
        named = sorted({a for s in spec_list for a in s.axes})
        first, second = self.shard_axis, self.tp_axis
        raise ValueError(
            f"on a 2-D mesh the first axis is the data (FSDP) axis and the second tensor parallel: here {first!r} "
            f"and {second!r}, but no leaf's spec names {second!r} (the specs name {named or 'no axis'}), so its "
            f"{self.tp_size} ranks would each compute the whole model on the same batch. If {first!r} is meant to be "
            f"tensor parallel, put the data axis first: sf.mesh({second}={self.mesh.size(1)}, {first}={self.mesh.size(0)}); "
            f"else pass specs that split leaves over {second!r} (sf.specs(params, mesh, rules=...)), or use a 1-D mesh "
            "for FSDP alone"
        )

    def _refuse_offload_off_dim0(self, paths: list[str], leaves: list, spec_list: list) -> None:
        """CPU offload keeps leaves split on dim 0 only, for now."""
        if self.offload is None:
            return
        for path, leaf, spec, d in zip(paths, leaves, spec_list, self.dims):
            if d not in (None, 0):
                raise NotImplementedError(
                    f"leaf {path!r} (shape {tuple(leaf.shape)}) has spec {spec!r}: offload={self.offload!r} keeps leaves "
                    f"split on dim 0 only for now; split it on dim 0 (P({self.shard_axis!r})) or leave offload off"
                )

    def unit_layout(self, info: Any, paths: list[str], leaves: list, spec_list: list, trained: list[bool]):
        """What `flat_units` lays out, without any buffer: each unit group's leaf indices and
        `LeafSpec`s (the root is -1), its dtype, the groups (lists of the model's units) and the
        model's unit names. `sf.estimate_memory` sizes the step's buffers from it."""
        unit_of = [info.unit_of[p] if info is not None else -1 for p in paths]
        n_units = len(info.unit_names) if info is not None else 0
        members: dict[int, list[int]] = {u: [] for u in [*range(n_units), -1]}
        for i, u in enumerate(unit_of):
            members[u].append(i)

        if self.tp_axis is not None:  # a leaf, for the flat engine, is this rank's tp shard of it
            shape_of = self.shapes
        else:
            shape_of = [x.shape for x in leaves]
        specs_of = {
            u: [LeafSpec(i, paths[i], shape_of[i], self.dims[i] is not None, trained[i], self.dims[i] or 0) for i in idx]
            for u, idx in members.items()
        }
        model_dtypes = [leaf.dtype for leaf in leaves]
        model_dtype = max(set(model_dtypes), key=model_dtypes.count) if leaves else torch.float32
        dtype_of = {}
        for u, idx in members.items():
            dtypes = {leaves[i].dtype for i in idx}
            if len(dtypes) > 1:
                raise NotImplementedError(
                    f"unit {info.unit_names[u] if u >= 0 else '<root>'!r} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                    "give each unit one dtype"
                )
            dtype_of[u] = dtypes.pop() if dtypes else model_dtype  # a unit without leaves: the model's
        names = info.unit_names if info is not None else []
        nbytes = [sum(shape_of[i].numel() for i in members[u]) * (self.mp.param_dtype or dtype_of[u]).itemsize for u in range(n_units)]
        self.nested_units = nested_units(names)  # the engine's too (`GradientCore._make_engine`)
        groups = plan_groups(names, nbytes, [dtype_of[u] for u in range(n_units)], self.nested_units, self.group_bytes)
        members = {**{g: [i for m in ms for i in members[m]] for g, ms in enumerate(groups)}, -1: members[-1]}
        specs_of = {**{g: [x for m in ms for x in specs_of[m]] for g, ms in enumerate(groups)}, -1: specs_of[-1]}
        dtype_of = {**{g: dtype_of[ms[0]] for g, ms in enumerate(groups)}, -1: dtype_of[-1]}
        return members, specs_of, dtype_of, groups, names

    def flat_units(self, info: Any, paths: list[str], leaves: list, spec_list: list, trained: list[bool]):
        """A `FlatUnit` per unit group (the root is -1) holding its leaves' shards, and each leaf's
        (group, index); also each group's dtype, whether gathers go point to point, and the groups
        (Note [unit groups] in `_engine.py`: consecutive small units are gathered and reduced as one)."""
        members, specs_of, dtype_of, groups, names = self.unit_layout(info, paths, leaves, spec_list, trained)
        device = self.mesh.device_type
        direct_gather = self.shard_world > 1 and C.point_to_point(self.group, device)
        units: dict[int, FlatUnit] = {}
        for u, idx in members.items():
            compute = self.mp.param_dtype or dtype_of[u]
            units[u] = FlatUnit(
                name=(group_name([names[m] for m in groups[u]]) if u >= 0 else ""),
                leaves=specs_of[u],
                dtype=dtype_of[u],
                compute_dtype=compute,
                reduce_dtype=self.mp.reduce_dtype or compute,
                group=self.group,
                world=self.shard_world,
                rank=self.rank,
                device=device,
                replicate_group=self.replicate_group,
                offload=self.offload == "cpu",
                direct_gather=direct_gather,
            )
        where: list[tuple[int, int]] = [None] * len(leaves)  # type: ignore[list-item]
        for u, unit in units.items():
            for j, i in enumerate(unit.leaf_indices()):
                where[i] = (u, j)
        return units, where, dtype_of, direct_gather, groups

    def policy(self, units: dict, dtype_of: dict, direct_gather: bool) -> Policy:
        """The engine's policy for this strategy and these options."""
        master = dtype_of[-1]
        one_dtype = len(set(dtype_of.values())) == 1 and self.offload is None
        reduce_in_master = one_dtype and (self.mp.reduce_dtype or self.mp.param_dtype or master) == master
        in_place = direct_gather and any(u.gathers_in_place for k, u in units.items() if k >= 0)
        return Policy(
            reshard_after_forward=self.strategy in ("full_shard", "hybrid_shard"),
            keep_last=self.keep_last_unit,
            share_slots=self.strategy in ("full_shard", "hybrid_shard"),
            slots=3 if in_place else 2,
            all_reduce=self.strategy == "no_shard" and reduce_in_master and (self.accumulation_steps == 1 or self.accumulation == "local"),
            reduce_in_master=reduce_in_master and self.mp.param_dtype in (None, master),
            single_micro_batch=self.accumulation_steps == 1,
            cast_dtype=self.mp.param_dtype,
        )

    def norm_plan(self, units: dict) -> tuple[list, list, list | None]:
        """Gradient segments for the clip, this rank's part of each for the norm (see
        `FlatUnit.norm_parts`), and each part's weight (None: all 1)."""
        if self.tp_axis is not None:
            return self._tp_norm_plan(units)
        replicas = self.world // self.shard_world
        replica_rank = self.mesh.get_local_rank(self.replicate_axis) if self.replicate_axis else 0
        segs, parts = [], []
        for unit in units.values():
            s_, p_ = norm_parts(unit, replicas, replica_rank, self.world)
            segs += s_
            parts += p_
        return segs, parts, None

    def _tp_norm_plan(self, units: dict) -> tuple[list, list, list]:
        """As `_norm_plan` on a (dp, tp) mesh: a leaf's gradient shard is this rank's alone when the
        leaf is split over tp, and the same on every tp rank when it is not (each then adds the
        squares of its 1/tp part); a leaf not FSDP'd (a scalar) is the same on every rank."""
        segs, parts, weights = [], [], []
        for unit in units.values():
            s_, _ = norm_parts(unit, 1, 0, 1)
            segs += s_
            for j, seg in enumerate(unit.segments):
                if not seg.trained or unit.grad_views[j].numel() == 0:
                    continue
                copies = (self.tp_size if self.tp_dims[seg.index] is None else 1) * (1 if seg.sharded else self.shard_world)
                parts.append(unit.grad_views[j].reshape(-1))
                weights.append(1.0 / copies)
        return segs, parts, weights

    def tp_local(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """Leaf `i`'s part on this tp rank (the whole leaf without tensor parallel)."""
        return local_part(full, self.tp_dims[i], self.tp_rank, self.tp_size) if self.tp_axis is not None else full

    def fill(self, info: Any, paths: list[str], leaves: list, spec_list: list, units: dict, where: list,
              init: str | None = None, sync: str | None = None):
        """Fills the local shards (meta leaves by the module's initializers, full leaves with the
        values the ranks agree on); returns the DTensors over them, those over the gradient
        shards, and the shards themselves."""
        device = self.mesh.device_type
        # Meta leaves: the module's recorded construction, replayed (Note [meta init] in `_meta_init.py`).
        meta = {i for i, leaf in enumerate(leaves) if leaf.is_meta}
        empty = check_init(init, "step.init", module=False)
        # Buffers the replay makes real are every rank's alike already (Note [meta init]): not sent.
        replayed = {n for n, b in info.module.named_buffers() if b.is_meta} if info is not None else set()
        if empty:  # values do not matter: the shards stay uninitialized
            empty_buffers(info.module if info is not None else None, device, info)
        elif meta:
            if info is None:
                raise ValueError(
                    f"leaf {paths[min(meta)]!r} is on the meta device and belongs to no functionalized module whose "
                    "initializers could set it: pass the tree sf.functionalize returned (or apply=), or real tensors"
                )
            at = {paths[i]: i for i in meta}

            def emit(path: str, full: torch.Tensor) -> None:
                u, j = where[at[path]]
                units[u].fill(j, self.tp_local(at[path], full))

            materialize(info, set(at), emit, buffer_device=device)
        self._fill_full(info, paths, leaves, units, where, meta, sync, buffers=not empty, skip=replayed)
        dt_params, dt_grads, flat_views = [], [], []
        for i, (leaf, spec) in enumerate(zip(leaves, spec_list)):
            u, j = where[i]
            if i not in meta and isinstance(leaf, DTensor):
                units[u].fill(j, self.tp_local(i, C.full_tensor(leaf, "the train step's init")))
            local, grad, shape = units[u].shard(j)
            if self.tp_axis is not None:
                own = state_spec(self.tp_dims[i], self.fsdp[i], leaf.dim(), self.shard_axis, self.tp_axis, self.dims[i] or 0)
                placements, shape = placements_for(own, self.mesh, leaf.shape), leaf.shape
            else:
                placements = placements_for(spec, self.mesh, leaf.shape)
            flat_views.append(local)  # the step's own; users get aliases (Note [donated state])
            dt_params.append(self.dtensor(_donate.alias(local), placements, shape))
            dt_grads.append(self.dtensor(grad, placements, shape) if grad is not None else None)
        return dt_params, dt_grads, flat_views

    def _fill_full(self, info: Any, paths: list[str], leaves: list, units: dict, where: list, meta: set[int],
                   sync: str | None, buffers: bool, skip: set[str]) -> None:
        """Fills the full (non-DTensor, non-meta) leaves with the values the ranks agree on, and
        makes the module's real buffers agree too, but those named in `skip` (Note [one
        model] in `_agree.py`): each leaf is copied in as its bucket arrives."""
        whole = tuple(range(self.mesh.ndim))

        def filler(i: int) -> Callable[[torch.Tensor], None]:
            u, j = where[i]
            return lambda full: units[u].fill(j, self.tp_local(i, full))

        def copier(buf: torch.Tensor) -> Callable[[torch.Tensor], None]:
            def copy(value: torch.Tensor) -> None:
                if value is not buf:
                    with torch.no_grad():
                        buf.copy_(value)
            return copy

        items = [Item(paths[i], x, filler(i), whole) for i, x in enumerate(leaves) if i not in meta and not isinstance(x, DTensor)]
        if buffers and sync is not None and info is not None:
            items += [Item(f"buffer {name}", b, copier(b), whole) for name, b in info.module.named_buffers()
                      if not b.is_meta and name not in skip]
        agree(items, self.mesh, sync, "step.init")

    def dtensor(self, local: torch.Tensor, placements, shape: torch.Size) -> DTensor:
        stride = torch.empty(shape, device="meta").stride()
        spec = DTensor.from_local(local, self.mesh, placements, run_check=False, shape=shape, stride=stride)._spec
        return _donate.wrap(local, spec)
