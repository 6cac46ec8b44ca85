"""The train-step runtime: when each unit is gathered, freed and reduced, and where its buffers live.

Note [unit schedule]
--------------------
This follows the FSDP paper (Zhao et al., 2023), for units u_0 .. u_n in forward order and a root:

  step start     gather the root (it holds what runs outside every unit: embeddings, head), and start
                 gathering the first unit.
  pre-forward    wait for u_i's gather (start it if nobody did); start gathering u_{i+1} (prefetch).
                 The unit's floating-point inputs (args and kwargs) are cast to the compute dtype;
                 those that need a gradient go through `_PostBackward`, whose backward runs once
                 autograd has computed their gradients, i.e. once this use of the unit is over in
                 the backward (FSDP2 detects it the same way, on the inputs).
  post-forward   `full_shard`: free u_i, except the last unit to run in the first forward (once
                 the order is known, after that forward): its backward is the first, so it stays
                 gathered, one gather fewer per step (torchtitan sets FSDP2's
                 `reshard_after_forward=False` on its last block for the same reason). Hook u_i's
                 output tensors (found through torch's pytree, dataclasses and the bases of views)
                 so that the first gradient reaching them runs pre-backward.
  pre-backward   wait for / start u_i's gather; start gathering u_{i-1} (prefetch, reverse order).
  post-backward  a use of u_i is over: `full_shard` frees it if no other use is running.
  reduce         once every use of u_i is over AND every trained parameter of u_i has its gradient
                 (a post-accumulate-grad hook on each; autograd accumulates a leaf's gradient once,
                 after all of its uses, in `apply` or outside it), u_i's reduce-scatter starts
                 (async). Frozen parameters stay valid for as long as the unit's backward runs.
                 Reductions overlap the backward of the next units: two in flight under
                 `full_shard` when their inputs live in the units' own slots, every unit's under
                 `no_shard` (in-place all-reduces, as DDP's buckets), else one.
  backward end   units that did not finish (unused parameters, a unit that did not run) are reduced
                 with zeros for what got no gradient, then the root; all reductions are waited for;
                 everything still gathered is freed.

A unit may run several times in one step (a siamese loss, a model applied twice): each use has its
own pre- and post-backward, the unit may be freed and gathered again between uses, and it is
reduced once, when the last use is over. A unit with no input that needs a gradient (the first
block of a model fed raw features) has no post-backward; it is over when its gradients are.

Memory bound: at most two units besides the root are gathered (or being gathered) at any time under
`full_shard`: a prefetch that would make three waits until a unit is freed. (A unit here may be a
group of the model's small units: Note [unit groups].) `shard_grad_op` keeps
units from their forward to the end of their backward (no second gather); `no_shard` has no gathers.

Note [unit plan]
----------------
Under `full_shard` the units' full parameters live in a few shared slot arenas (Note [slot arenas]
in `_flat.py`): two, or three when gathers land in place. Which units may share a slot depends on
what runs when, which only the model knows. So the first step runs with an arena per unit (each
allocated when its unit is gathered and given back when it is freed), and records, for every
unit, when it was busy: running its forward, or between a pre-backward and the end of that use in
the backward. At the end of the first step the plan gives slots in forward order (u_0, u_2, ... in
one, u_1, u_3, ... in the other), so an interleaved model (`blocks.i`, `adapters.i`) or blocks run
out of module order still alternate; a unit that was busy at the same time as another unit of its
slot (T5's first block, whose position bias every later block uses, is busy through the whole
backward) keeps an arena of its own. Forward order is the order of the first step's pre-forwards;
optree's leaf order is never used for it (dict keys sort: "10" < "2").

If a later step runs units differently, so that a unit is needed while the other unit of its slot
is busy, the step stops with an error before anything wrong is computed, and the next step
plans again from scratch. Whatever the schedule, a unit's parameters are never read while its
memory holds another unit: autograd checks it (Note [stale parameters] in `_flat.py`).

The units this plan speaks of are the engine's: groups of the model's small units, decided before
the first step from their names and sizes (Note [unit groups]); the slots are planned over groups
from the first step's schedule in the same way.

Note [units on every rank]
--------------------------
Every collective must be issued by every rank, in the same order. A model whose execution depends
on the data (a mixture of experts that skips an expert no token was routed to, an early exit)
breaks that: with equal-sized units a shard could land in the wrong unit without any error. So:

- In the forward, gathers follow the plan's order: a rank that skips units still gathers (and
  frees) each of them at the point where the others gather it, so the forward's collectives match
  on every rank whatever each one runs.
- When the forward ends (before any gradient is reduced), the ranks exchange which units they ran,
  in one small all-gather. It starts there and is waited for at the engine's next collective or
  reduction (the first unit's backward), so that it overlaps the loss's and the root's backward. If
  the ranks differ, every rank stops with an error naming the units and ranks, and nothing is
  reduced or applied; the next step can run.

So a unit must run on every rank or on none, as FSDP requires. (A unit that no rank runs is
gathered, reduced with zero gradients, and costs only its collectives.) A unit run a different
number of times on different ranks, after being freed in between, issues gathers that the others
do not, and is not detected before it blocks.
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

import optree

from . import _collectives as C
from ._flat import Arena, FlatUnit
from ._functorch import under_grad_transform, unwrap
from ._models import unit_of_module
from ._param import Detour, OffSchedule, Param
from ._recompute import UnitViews
from . import _schedule as schedule

__all__ = ["Engine", "EngineStats", "Phase", "Policy", "StaleParameterError", "GROUP_BYTES", "plan_groups", "group_name"]

ROOT = -1
GROUP_BYTES = 2 << 20
"""The default cap on a unit group's full parameters, in bytes (Note [unit groups]); 0: no groups."""
ABORT_WAIT_S = 10.0
"""How long a failed step waits for each collective still in flight (see `Engine.abort`)."""
_PRIMITIVE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


class Phase(str, enum.Enum):
    """Where an engine is in its step; equal to its name in lower case ("forward")."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


# Note [unit groups]
# ~~~~~~~~~~~~~~~~~~
# A small unit pays a fixed cost per collective (a message per peer, a wait) and per hook, which
# DDP's gradient buckets pay once per bucket. So consecutive small units are grouped: the units the
# user named keep their hooks, their remat and the check that every rank ran them (Note [units on
# every rank], at the level of the units named), while the engine gathers, frees and reduces a
# group as one unit (one flat buffer, one all-gather, one reduce-scatter), which runs once per
# member in a step: it stays gathered from its first member's forward until another group's
# forward starts (or the forward ends), so it is gathered once per forward in whatever order its
# members run; in the backward it stays gathered from its last member's backward to its first's,
# then is reduced once.
#
# The plan comes from the units' names and sizes, when the flat buffers are laid out (before any
# step, since the state's DTensors view them): units are grouped in the order of their names, when
# they are siblings (`blocks.3`, `blocks.4`), none is nested in another unit, their parameters share
# a dtype, and their full parameters fit in the cap together (`GROUP_BYTES` by default, the
# `group_bytes` option of `train_step`; 0 turns grouping off). A unit over the cap stays alone.
# Members that run out of order (on one rank or differently on each) are still exact. A group
# whose members are interleaved with another group's is gathered again at each switch, which all
# ranks must do alike, as they must run the units themselves alike.
#
# Memory bound: under `full_shard` at most two groups besides the root are gathered at once, so
# the bound of Note [unit schedule] reads "two units" as "two groups": at most twice the cap, or two
# units where one is larger than the cap.


def plan_groups(names: list[str], nbytes: list[int], dtypes: list, nested: set[int], cap: int) -> list[list[int]]:
    """Consecutive sibling units, by name order, whose full parameters fit in `cap` bytes together
    (Note [unit groups]); returns the groups, each a list of unit indices, covering every unit."""
    groups: list[list[int]] = []
    size = 0
    for u, name in enumerate(names):
        last = groups[-1][-1] if groups else None
        fits = (
            last is not None and cap > 0 and u not in nested and last not in nested
            and names[last].rpartition(".")[0] == name.rpartition(".")[0]
            and dtypes[last] == dtypes[u] and size + nbytes[u] <= cap
        )
        if fits:
            groups[-1].append(u)
            size += nbytes[u]
        else:
            groups.append([u])
            size = nbytes[u]
    return groups


def group_name(names: list[str]) -> str:
    """A group's name: its single unit's, or its units' joined with "+"."""
    return "+".join(names)


class StaleParameterError(RuntimeError):
    """Autograd read a unit's parameters while their memory was freed or held another unit."""


@dataclass(frozen=True)
class Policy:
    """How a train step's engine runs its units: the strategy's choices, resolved.

    Attributes:
        reshard_after_forward: free units after their forward (`full_shard`, `hybrid_shard`).
        keep_last: under `reshard_after_forward`, keep the last unit to run in the forward gathered
            from its forward to its backward (Note [unit schedule]).
        share_slots: units may share slot arenas (Note [slot arenas]).
        slots: how many slot arenas units share (3 when gathers land in place).
        all_reduce: gradients are all-reduced in place (`no_shard` in the master dtype): every
            unit's reduction may be in flight at once.
        reduce_in_master: gradients are reduced in the master dtype, computed in it too.
        single_micro_batch: one reduction per step and unit (no sharded accumulation).
        cast_dtype: the compute dtype inputs are cast to (mixed precision), or None.
        max_live: the most non-root units gathered at once under `reshard_after_forward`.
    """

    reshard_after_forward: bool
    share_slots: bool
    keep_last: bool = True
    slots: int = 2
    all_reduce: bool = False
    reduce_in_master: bool = True
    single_micro_batch: bool = True
    cast_dtype: torch.dtype | None = None
    max_live: int = 2


@dataclass
class EngineStats:
    """What the runtime did in the last step; for tests and benchmarks."""

    events: list[tuple[str, int, str]] = field(default_factory=list)  # (what, unit, phase); ROOT is -1
    max_live_units: int = 0  # most non-root units gathered (or gathering) at once
    record_events: bool = False

    def reset(self) -> None:
        self.events.clear()
        self.max_live_units = 0


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward marks the end of that use of the unit.

    Written for torch.func too (setup_context, a generated vmap rule): a `loss_fn` may vmap over
    its inputs (an ensemble, per-example losses); the backward then runs once, on batched grads.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(engine: "Engine", u: int, *tensors: torch.Tensor):  # type: ignore[override]
        return tensors

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.engine, ctx.u = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.engine._post_backward(ctx.u)
        return (None, None, *grads)


class _PostBackwardEager(torch.autograd.Function):
    """`_PostBackward` where no torch.func transform is active, in the classic form: its `apply`
    does not bind its arguments through `inspect.signature`, a cost per unit and step."""

    @staticmethod
    def forward(ctx, engine: "Engine", u: int, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.engine, ctx.u = engine, u
        return tensors

    backward = staticmethod(_PostBackward.backward)


def _output_tensors(output: Any) -> tuple[list[torch.Tensor], list[str]]:
    """The tensors in a unit's output, and the type names of leaves that may hide more.

    Containers are those torch's pytree knows (tuples, lists, dicts, namedtuples, Hugging Face
    `ModelOutput`s) and dataclasses.
    """
    if isinstance(output, torch.Tensor):
        return [output], []
    tensors: list[torch.Tensor] = []
    opaque: list[str] = []
    todo = [(output, 0)]  # a stack, not a recursive closure: that would be a reference cycle
    while todo:  # holding the outputs until the cycle collector runs
        obj, depth = todo.pop()
        for leaf in pytree.tree_leaves(obj):
            if isinstance(leaf, torch.Tensor):
                tensors.append(leaf)
            elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type) and depth < 8:
                todo.extend((getattr(leaf, f.name), depth + 1) for f in dataclasses.fields(leaf))
            elif not isinstance(leaf, _PRIMITIVE):
                opaque.append(type(leaf).__name__)
    return tensors, opaque


def _hook_targets(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors to hook for pre-backward: those needing a gradient, and the bases of views (an
    in-place update of a view after the unit returns reroutes its gradient through the base)."""
    out: dict[int, torch.Tensor] = {}
    for t in tensors:
        t = unwrap(t)  # under vmap, autograd's graph holds the batched tensor's physical one
        if t.requires_grad:
            out[id(t)] = t
            base = t._base
            if base is not None and base.requires_grad and base.grad_fn is not None:
                out[id(base)] = base
    return list(out.values())


class Engine:
    """Runs one model's units through a train step (see Note [unit schedule] and Note [unit plan]).

    Args:
        info: the functionalized model whose unit hooks report to this engine (None: root only).
        units: the non-root units, indexed as `info.unit_names`.
        root: the root unit.
        policy: the strategy's choices (see `Policy`).
        nested: units that run inside other units (they never share slot arenas).
        group: a process group over every rank of the mesh, on which ranks check that they ran the
            same units (Note [units on every rank]); None on one rank.
        groups: for each of `units`, the units of `info` it holds (Note [unit groups]); None: one each.
            `nested` is over `info`'s units too.
    """

    def __init__(self, info, units: list[FlatUnit], root: FlatUnit, policy: Policy, nested: set[int] = frozenset(), group=None,
                 groups: list[list[int]] | None = None):
        self.info = info
        self._set_groups(groups if groups is not None else [[u] for u in range(len(units))])
        nested = {self._group_of[m] for m in nested}
        self.group = group
        self._world = torch.distributed.get_world_size(group) if group is not None else 1
        self.units = units
        self.root = root
        self.policy = policy
        self.reshard_after_forward = policy.reshard_after_forward
        self.max_live = policy.max_live
        self.cast_dtype = policy.cast_dtype
        self._nested = set(nested)
        self.remat_units: set[int] = set()  # read by the remat wrappers (shardfn/_remat.py)
        self.tp: Any = None  # the tensor-parallel forward (`_tp.TensorParallel`), set by the core
        n = len(units)
        self.order: list[int] = list(range(n))  # forward order (guess until the first step)
        self._order_known = False
        self._last_ran: int | None = None  # the last unit of the first forward (`_kept_for_backward`)
        self.planned = False
        self.stats = EngineStats()
        self._where: list[tuple[int, int]] = []
        self._needs_plan = False
        self.broken: str | None = None
        self._reset_step_state()
        self._bind({})

    # -- unit groups (Note [unit groups]) ---------------------------------------------------------
    def _set_groups(self, groups: list[list[int]]) -> None:
        """Maps the model's units (as its hooks number them) to the engine's units."""
        self.groups = [list(g) for g in groups]
        self._group_of = {m: g for g, ms in enumerate(self.groups) for m in ms}
        self._n_members = len(self._group_of)
        self._grouped = {g for g, ms in enumerate(self.groups) if len(ms) > 1}
        names = self.info.unit_names if self.info is not None else []
        self._member_names = list(names) if len(names) == self._n_members else [str(m) for m in range(self._n_members)]

    def _member(self, m: int) -> int:
        """The engine's unit that holds the model's unit `m`."""
        return self._group_of[m]

    def _free_kept(self, but: int | None = None) -> None:
        """Frees the groups kept gathered after their members' forwards, once another group's
        forward starts (`but`) or the forward is over: a group is gathered once per forward in
        whatever order its members run (Note [unit groups])."""
        if self.reshard_after_forward and self._grouped:
            for u in [u for u in self._live if u in self._grouped and u != but and u in self._ran and not self._busy(u)]:
                if but is None and self._kept_for_backward(u):
                    continue
                self._free(u)
            if but is None:
                self._release_idle_slots()

    def _kept_for_backward(self, u: int) -> bool:
        """The last unit to run in the first step's forward stays gathered after its forward: its
        backward comes first, and would gather it again at once (Note [unit schedule])."""
        return schedule.keeps_for_backward(self.policy, self._order_known, u, self._last_ran)

    def _release_idle_slots(self) -> None:
        """After the last unit's forward, nothing else is gathered until the first unit's backward,
        while the loss and its gradient take their largest activations: give back the slots that
        no gathered unit holds (the backward allocates them again)."""
        if not (self.slot_of and self._order_known) or any(w in self.slot_of for w in self._works):
            return
        held = {id(a) for v in self._live for name, a in self.units[v].arenas.items() if name != "gathered"}
        for a in self._slot_arenas:
            if id(a) not in held:
                a.release()

    # -- the plan (Note [unit plan]) ------------------------------------------------------------
    def _bind(self, slot_of: dict[int, int]) -> None:
        """Gives every unit its arenas: the shared slot `slot_of[u]`, or arenas of its own."""
        units = {u: self._unit(u) for u in [*range(len(self.units)), ROOT]}
        sizes = {u: unit.sizes() for u, unit in units.items()}
        compute = {u: unit.compute_dtype for u, unit in units.items()}
        device = self.root.device
        plan = schedule.arena_plan(sizes, compute, slot_of)  # Note [one schedule] in `_schedule.py`
        made = {key: Arena(plan.numel[key], plan.dtype[key], device, shared=key in plan.shared) for key in plan.numel}
        arenas = {u: {name: made[key] for name, key in plan.key_of[u].items()} for u in units}
        for u, unit in units.items():
            # A unit's reduce-scatter input goes in its own slot (its parameters are dead by then);
            # the root's goes in its own arena, as it is reduced after the backward.
            unit.bind(arenas[u], reduce_in_full=u == ROOT or u in slot_of)
        rdt = {unit.reduce_dtype for unit in units.values()}
        if len(rdt) > 1:
            raise NotImplementedError(f"units reduce in different dtypes {sorted(map(str, rdt))}; give every unit one dtype")
        rdt_one = rdt.pop()
        self.slot_of = dict(slot_of)
        self.max_reductions = schedule.reductions_in_flight(self.policy, len(self.units), self.slot_of)
        # Scratch for reduce-scatter inputs that are not built in a slot: allocated only when used.
        n_in = max(s["rs_in"] for s in sizes.values())
        n_out = max(s["rs_out"] for s in sizes.values())
        self.reduce_arenas = [(Arena(n_in, rdt_one, device, shared=True), Arena(n_out, rdt_one, device, shared=True)) for _ in range(self.max_reductions)]
        self.arenas = _unique([*(a for d in arenas.values() for a in d.values()), *(a for p in self.reduce_arenas for a in p)])
        self._slot_arenas = _unique([a for v in slot_of for a in self.units[v].arenas.values()])
        self._slot_done_after = schedule.last_of_slot(self.order, self.slot_of)
        for u, unit in units.items():
            self._hook_grads(unit, u)
        if self._where:
            self._make_trees()

    def _plan(self, busy: dict[int, list[tuple[int, int]]]) -> None:
        """After the first step: slot arenas in forward order, busy units kept apart."""
        self.planned = True
        if not (self.policy.share_slots and self.units):
            return
        compute = {u: self._unit(u).compute_dtype for u in self.order}
        self._bind(schedule.plan_slots(self.order, self._nested, compute, self.policy, busy))

    def replan(self) -> None:
        """Forgets the plan: the next step runs with an arena per unit and plans again."""
        self._order_known = False
        self.planned = False
        self._bind({})

    # -- what loss_fn sees (Note [parameters outside apply] in `_param.py`) ------------------------
    def set_tree(self, treespec: Any, paths: list[str], where: list[tuple[int, int]]) -> None:
        """The parameter tree's structure, its leaves' paths, and (unit, index) of each leaf."""
        self._treespec, self._paths, self._where = treespec, list(paths), list(where)
        self._make_trees()

    def _make_trees(self) -> None:
        self._leaf_of = {w: i for i, w in enumerate(self._where)}
        proxies = [self._unit(u).proxies[j] for u, j in self._where]
        params = [Param.make(self._stand_in(p, w), self._read_param, w) for p, w in zip(proxies, self._where)]
        self.user_tree = optree.tree_unflatten(self._treespec, params)
        # What the module computes on: root leaves in place (gathered for the whole step), unit
        # leaves as Params until their unit's forward swaps its full parameters in.
        self._in_apply = optree.tree_unflatten(self._treespec, [p if u == ROOT else q for p, q, (u, _) in zip(proxies, params, self._where)])
        self._params_of: dict[int, list[Param]] = {}
        for q, (u, j) in zip(params, self._where):
            self._params_of.setdefault(u, {})[j] = q
        self._flat = None  # {every parameter name: tensor}, built on the first `apply`
        # What each unit's recompute computes on (Note [the model's own checkpointing] in `_recompute.py`).
        self._views = UnitViews(self.info) if self.info is not None else None
        # (unit, the model's unit whose module holds the attribute, or None) -> (submodule, attribute, leaf)
        self._swaps: dict[tuple[int, int | None], list[tuple[Any, str, int]]] = {}
        if self.info is not None:
            module = self.info.module
            for path, (u, j) in zip(self._paths, self._where):
                if u == ROOT:
                    continue
                for name in self.info.aliases[path]:
                    owner, _, attr = name.rpartition(".")
                    self._swaps.setdefault((u, self._member_of_module(u, owner)), []).append((module.get_submodule(owner), attr, j))

    def _member_of_module(self, u: int, owner: str) -> int | None:
        """Which of group `u`'s units holds submodule `owner` (None: none of them, or one unit alone)."""
        if u not in self._grouped:
            return None
        members = self.groups[u]
        i = unit_of_module(owner, [self._member_names[m] for m in members])
        return members[i] if i >= 0 else None

    def _swap_in(self, u: int, full: bool, m: int | None = None) -> None:
        """Unit `u`'s module attributes (of its member `m` only, in a group): its full parameters
        (its forward runs), or its Params (Note [parameters outside apply] in `_param.py`)."""
        swaps = self._swaps.get((u, None), [])
        if m is not None and u in self._grouped:
            swaps = swaps + self._swaps.get((u, m), [])
        if not swaps:
            return  # the root, or a unit without parameters
        proxies, params = self._full_of(u), self._params_of[u]
        new, old = (proxies, params) if full else (params, proxies)
        for mod, attr, j in swaps:
            # Only where `apply` was given this step's own parameter: a tensor the user derived
            # from it (scaled, noised, a delta added) is what the module must compute on.
            if mod._parameters.get(attr) is old[j]:
                mod._parameters[attr] = new[j]

    def _full_of(self, u: int) -> list[torch.Tensor]:
        """What unit `u`'s modules compute on: its full parameters, or with tensor parallel DTensors
        over them on the tp mesh (made once per step; Note [tensor parallel forward] in `_tp.py`)."""
        proxies = self._unit(u).proxies
        if self.tp is None:
            return proxies
        out = self._tp_views.get(u)
        if out is None:
            out = self._tp_views[u] = [self.tp.leaf(self._leaf_of[(u, j)], p) for j, p in enumerate(proxies)]
        return out

    def _stand_in(self, proxy: torch.Tensor, where: tuple[int, int]) -> torch.Tensor:
        """What a `Param` looks like: its full parameter, or with tensor parallel a tensor of the
        leaf's global shape (no memory: an expanded scalar), as `loss_fn` expects."""
        if self.tp is None:
            return proxy
        shape = self.tp.shapes[self._leaf_of[where]]
        return proxy.new_zeros(()).expand(shape).requires_grad_(proxy.requires_grad) if shape != proxy.shape else proxy

    def _tp_trees(self) -> None:
        """Tensor parallel: the root's leaves as DTensors over its gathered shards, for this step."""
        if self.tp is None:
            return
        root = self._full_of(ROOT)
        leaves = optree.tree_leaves(self._in_apply)
        self._in_apply = optree.tree_unflatten(
            self._treespec, [root[j] if u == ROOT else x for x, (u, j) in zip(leaves, self._where)]
        )
        self._flat = None

    def _read_param(self, p: Param) -> torch.Tensor:
        return self.read(*p.where)

    def _owns(self, x: Any) -> bool:
        return isinstance(x, Param) and x.reader() == self._read_param

    def flat_params(self, apply, params: Any) -> dict[str, torch.Tensor] | None:
        """What `apply(params, ...)` computes on, when `params` holds this step's parameters."""
        if params is self.user_tree:
            mapped = self._in_apply
        else:
            leaves, spec = optree.tree_flatten(params)
            if not any(self._owns(x) for x in leaves):
                if self._views is not None:
                    self._views.record_root(None)  # `apply` on a tree of its own: the root's view is unknown
                return None
            mapped = optree.tree_unflatten(
                spec, [self._full_of(ROOT)[x.where[1]] if self._owns(x) and x.where[0] == ROOT else x for x in leaves]
            )
        if apply.info is not self.info:
            theirs = type(apply.info.module).__name__
            ours = type(self.info.module).__name__ if self.info is not None else "a plain function"
            raise ValueError(
                f"loss_fn applied a model ({theirs}) to the train step's parameters, but the step was built for "
                f"{ours}: pass the apply that loss_fn calls, sf.train_step(..., apply=apply). If the step's "
                "tree holds the parameters of several models (a student and a teacher), train one model's tree "
                "and shard the other's on its own (sf.shard), reading it inside loss_fn"
            )
        if mapped is self._in_apply:
            if self._flat is None:
                self._flat = apply.flat_params(mapped)
            flat = self._flat
        else:
            flat = apply.flat_params(mapped)
        if self._views is not None:
            self._views.record_root(flat)
        return flat

    # -- bookkeeping --------------------------------------------------------------------------
    def _reset_step_state(self) -> None:
        self._works: dict[int, Any] = {}  # unit -> pending all-gather work
        self._live: set[int] = set()  # non-root units allocated (gathered or gathering)
        self._running: set[int] = set()  # units inside their forward
        self._active: dict[int, int] = {}  # unit -> uses whose backward has begun and not ended
        self._deferred: list[int] = []
        self._pending: list[int] = [0] * len(self.units)
        self._reduced: set[int] = set()
        self._in_flight: list[tuple[int, Any, int, bool]] = []  # (unit, pending, arena pair, input in slot)
        self._reads: dict[tuple[int, int], torch.Tensor] = {}
        self._seen: list[int] = []
        self._ran: set[int] = set()  # units whose forward ran in this step
        self._ran_members: set[int] = set()  # the model's units (hook numbering) that ran
        self._check: tuple | None = None  # the exchange of which units ran, until acted on
        self._fwd_gathered: set[int] = set()  # units gathered in this forward
        self._fwd_ptr = 0  # units before this position in forward order were gathered or caught up
        self._pos: dict[int, int] = {u: i for i, u in enumerate(self.order)}
        self._wrapped: list[tuple[bool, Any]] = []  # per running unit use: were its inputs hooked; its view
        self._accumulate = False
        self._reduce_now = True
        self._clock = 0
        self._busy_since: dict[int, int] = {}
        self._busy_log: dict[int, list[tuple[int, int]]] = {}
        self._tp_views: dict[int, list[torch.Tensor]] = {}
        self.phase = Phase.IDLE

    def _unit(self, u: int) -> FlatUnit:
        return self.root if u == ROOT else self.units[u]

    def _event(self, what: str, u: int) -> None:
        if self.stats.record_events:
            self.stats.events.append((what, u, self.phase))

    def _hook_grads(self, unit: FlatUnit, u: int) -> None:
        if u == ROOT:
            return  # the root is reduced after the backward

        ref = weakref.ref(self)  # the full parameters outlive the step object otherwise

        def hook(_: torch.Tensor) -> None:
            engine = ref()
            if engine is not None:
                engine._grad_ready(u)

        for p in unit.proxies:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(hook)

    def _busy(self, u: int) -> bool:
        return u in self._running or self._active.get(u, 0) > 0

    def _busy_start(self, u: int) -> None:
        if self.planned:
            return  # the log feeds only the first step's plan
        self._clock += 1
        self._busy_since.setdefault(u, self._clock)

    def _busy_end(self, u: int) -> None:
        if self.planned:
            return
        self._clock += 1
        since = self._busy_since.pop(u, None)
        if since is not None:
            self._busy_log.setdefault(u, []).append((since, self._clock))

    def _next_of(self, u: int) -> int | None:
        i = self._pos.get(u)
        return self.order[i + 1] if i is not None and i + 1 < len(self.order) else None

    def _prev_of(self, u: int) -> int | None:
        """The unit before `u` in forward order that ran in this step (the backward's next)."""
        i = self._pos.get(u)
        while i is not None and i > 0:
            i -= 1
            v = self.order[i]
            if v in self._ran:
                return v
        return None

    # -- gather / free ------------------------------------------------------------------------
    def _slot_holder(self, u: int) -> int | None:
        """The live unit other than `u` that holds `u`'s slot arena, if any."""
        return schedule.slot_holder(u, self._live, self.slot_of)

    def _start(self, u: int) -> None:
        self._settle_check()
        unit = self._unit(u)
        if u in self._works or (u != ROOT and u in self._live):
            return
        v = self._slot_holder(u)
        if v is not None:  # see Note [unit plan]
            if self._busy(v):
                self._needs_plan = True
                raise RuntimeError(
                    f"unit {self.units[u].name!r} is needed while unit {self.units[v].name!r}, which shares its "
                    "buffers under this step's plan, is still in use: the units ran differently than in the "
                    "first step (Note [unit plan]). Nothing was computed wrong; the next step plans again. "
                    "If this repeats, the order of units changes from step to step: use strategy='shard_grad_op'."
                )
            self._free(v, prefetch=False)
        if u != ROOT:
            # A unit runs that nobody prefetched: drop prefetches nobody uses yet rather than
            # exceed the bound (Note [one schedule]).
            for w in schedule.evictions(self.policy, self._live, [w for w in self._live if not self._busy(w)]):
                self._free(w, prefetch=False)
        if u in self.slot_of:  # one shared all-gather output: one unit gather in flight
            for w in [w for w in self._works if w in self.slot_of]:
                self._drain_slot(w)
                self._unit(w).finish_gather(self._works.pop(w))
        if u != ROOT:
            self._live.add(u)
            self.stats.max_live_units = max(self.stats.max_live_units, len(self._live))
            if self.phase == Phase.FORWARD:
                self._fwd_gathered.add(u)
        if unit.gathers_in_place:  # its gather writes the slot at once (Note [slot arenas])
            self._drain_slot(u)
        self._event("gather", u)
        self._works[u] = unit.start_gather()
        # Deferred prefetches run once `u` holds its slot: started while `u` made room, one of
        # them could take that slot (or be `u` itself, gathered twice).
        self._run_deferred()

    def _ensure(self, u: int) -> None:
        if u != ROOT and u not in self._live and u not in self._works:
            self._start(u)
        if u in self._works:
            self._drain_slot(u)
            self._unit(u).finish_gather(self._works.pop(u))

    def _drain_slot(self, u: int) -> None:
        """Finishes reductions whose input lives in the arena that `u` is about to fill."""
        full = self._unit(u).arenas["full"]
        while any(in_slot and self._unit(w).arenas["full"] is full for w, _, _, in_slot in self._in_flight):
            self._finish_oldest()

    def _free(self, u: int, prefetch: bool = True) -> None:
        """Frees `u`'s full parameters; then, if `prefetch`, starts the prefetches that waited for room."""
        if u in self._works:  # a prefetch nobody used: finish it before dropping the buffers
            self._drain_slot(u)
            self._unit(u).finish_gather(self._works.pop(u))
        if u == ROOT or u in self._live:
            self._event("free", u)
            self._unit(u).free()
            self._live.discard(u)
        if prefetch:
            self._run_deferred()

    def _run_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for w in deferred:
            self._prefetch(w)

    def _prefetch(self, u: int | None) -> None:
        if u is None or u in self._live or u in self._reduced:
            return
        if schedule.prefetch_waits(self.policy, len(self._live), self._slot_holder(u) is not None):
            if u not in self._deferred:
                self._deferred.append(u)
            return
        self._start(u)

    # -- the step -----------------------------------------------------------------------------
    def begin(self, accumulate: bool, reduce: bool = True) -> None:
        """Starts one forward/backward: gathers the root and prefetches the first unit.

        Args:
            accumulate: add this backward's reduced gradients to the sharded ones already there.
            reduce: reduce at all; False keeps the full gradients for a later backward (local
                accumulation of micro-batches).
        """
        if self.broken:
            raise RuntimeError(self.broken)
        if self._needs_plan:
            self._needs_plan = False
            self.replan()
        self._reset_step_state()
        self.phase = Phase.FORWARD
        self._accumulate = accumulate
        self._reduce_now = reduce
        self._pending = [u.num_trained for u in self.units]
        self._start(ROOT)
        if self.units:
            self._prefetch(self.order[0])
        self._ensure(ROOT)
        self._tp_trees()

    def cast_inputs(self, info, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Mixed precision: floating-point inputs of the model's forward in the compute dtype."""
        if self.cast_dtype is None or info is not self.info:
            return args, kwargs
        return self._cast(args), self._cast(kwargs)

    def _cast(self, tree: Any) -> Any:
        return schedule.cast_floating(tree, self.cast_dtype)

    def read(self, u: int, j: int) -> torch.Tensor:
        """The full value of leaf `j` of unit `u`, for a read outside `apply` (Note [parameters
        outside apply] in `_param.py`)."""
        if self.phase == Phase.IDLE:
            raise RuntimeError(
                "a parameter handed to loss_fn was used after its step (or outside a step): it is valid "
                "only inside loss_fn; return values computed from it instead"
            )
        unit = self._unit(u)
        proxy = unit.proxies[j]
        if u == ROOT:
            return self._full_of(ROOT)[j]  # gathered for the whole step
        out = self._reads.get((u, j))
        # A copy made under no_grad carries no gradient: never hand it to a use that needs one.
        if out is None or (torch.is_grad_enabled() and proxy.requires_grad and not out.requires_grad):
            out = Detour.apply(proxy, lambda: unit.gather_leaf(j))
            if self.tp is not None:
                out = self.tp.leaf(self._leaf_of[(u, j)], out)
            self._reads[(u, j)] = out
        return out

    def pre_forward(self, info, u: int, args: tuple, kwargs: dict) -> tuple | None:
        if info is not self.info or self.phase == Phase.IDLE:
            return None
        m, u = u, self._member(u)
        transforms = torch._C._are_functorch_transforms_active()
        if self.phase == Phase.FORWARD and transforms and under_grad_transform((args, kwargs)):
            raise OffSchedule(
                f"unit {self._member_names[m]!r} ran inside a torch.func gradient transform (grad, vjp, jacrev, ...) in "
                "loss_fn (a gradient penalty)"
            )
        if self.phase == Phase.BACKWARD:  # a recompute, by the model's own checkpoint around the unit's call
            self._ensure(u)
            if self._active.get(u, 0) == 0:  # no pre-backward came first (a reentrant checkpoint): it prefetches
                self._prefetch(self._prev_of(u))
            if self._views is not None:  # Note [the model's own checkpointing] in `_recompute.py`
                self._views.for_recompute(m, self._member_names[m])
            return (self._cast(args), self._cast(kwargs)) if self.cast_dtype is not None else None
        self._ran_members.add(m)
        self._free_kept(but=u)
        if u not in self._ran:
            self._ran.add(u)
            self._seen.append(u)
            if self._order_known and self.group is not None:
                self._catch_up(self._pos[u])
        self._ensure(u)
        self._running.add(u)
        self._swap_in(u, True, m)
        view = self._views.record(m) if self._views is not None else None
        self._busy_start(u)
        self._prefetch(self._next_of(u))
        if self.cast_dtype is not None:
            args, kwargs = self._cast(args), self._cast(kwargs)
        wrapped = False
        if torch.is_grad_enabled():
            # Positional tensors and plain values only (a block called on its hidden states): no tree walk.
            plain = not kwargs and all(isinstance(x, (torch.Tensor, *_PRIMITIVE)) for x in args)
            flat, spec = (list(args), None) if plain else pytree.tree_flatten((args, kwargs))
            # Under vmap the batched wrapper does not require grad; the physical tensor does.
            idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and unwrap(x).requires_grad]
            if idx:
                fn = _PostBackward if transforms else _PostBackwardEager
                outs = fn.apply(self, u, *(flat[i] for i in idx))
                for i, o in zip(idx, outs):
                    flat[i] = o
                args, kwargs = (tuple(flat), kwargs) if plain else pytree.tree_unflatten(flat, spec)
                self._pending[u] += 1
                wrapped = True
        self._wrapped.append((wrapped, view))
        return args, kwargs

    def post_forward(self, info, u: int, output: Any) -> None:
        if info is not self.info or self.phase != Phase.FORWARD:
            return None
        m, u = u, self._member(u)
        self._running.discard(u)
        if u not in self._running or u in self._grouped:
            self._swap_in(u, False, m)
        self._busy_end(u)
        wrapped, view = self._wrapped.pop() if self._wrapped else (False, None)
        tensors, opaque = _output_tensors(output)
        output, tensors = self._own_memory(u, output, tensors)
        if torch.is_grad_enabled():
            targets = _hook_targets(tensors)
            if len(targets) == 1:  # its gradient is computed once per backward: a plain hook is the same
                targets[0].register_hook(lambda _g, u=u, m=m, v=view: self._pre_backward(u, m, v))
            elif targets:
                torch.autograd.graph.register_multi_grad_hook(targets, lambda _g, u=u, m=m, v=view: self._pre_backward(u, m, v), mode="any")
            elif opaque and (wrapped or self.units[u].num_trained):
                raise ValueError(
                    f"unit {self.units[u].name!r} returned {type(output).__name__} holding {sorted(set(opaque))}, where "
                    "shardfn finds no tensor that needs a gradient, so it cannot tell when the unit's backward "
                    "begins. Return tensors, or tuples, lists, dicts, dataclasses of them, or register the type "
                    "with torch.utils._pytree.register_pytree_node"
                )
        if self.reshard_after_forward and u not in self._grouped:
            if not self._kept_for_backward(u):
                self._free(u)
            if u == self._last_ran:
                self._release_idle_slots()
        return output

    def _own_memory(self, u: int, output: Any, tensors: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
        """`output` (and its `tensors`) with any tensor that views the unit's full parameters
        (`return self.pe[:T]`) copied: the unit is freed as its forward returns, and its memory
        given to another."""
        unit = self.units[u]
        mine = {a.base.untyped_storage().data_ptr() for a in (unit.arenas["full"], unit.arenas["stage"]) if a.allocated}
        mine.discard(0)

        def views(t: torch.Tensor) -> bool:
            t = unwrap(t)
            if isinstance(t, DTensor):  # tensor parallel: its local shard
                t = t._local_tensor
            return t.untyped_storage().data_ptr() in mine

        if not mine or not any(views(t) for t in tensors):
            return output, tensors
        output = pytree.tree_map_only(torch.Tensor, lambda t: t.clone() if views(t) else t, output)
        tensors = _output_tensors(output)[0]
        if any(views(t) for t in tensors):
            raise ValueError(
                f"unit {unit.name!r} returned a view of its own parameter inside a {type(output).__name__}, whose "
                "tensors shardfn cannot replace; its memory is freed as the unit returns: return a copy (.clone())"
            )
        return output, tensors

    def end_forward(self) -> None:
        """`loss_fn` has returned: the backward comes next."""
        if self.phase != Phase.FORWARD:
            return
        if not self._order_known and self._seen:
            self.order = schedule.forward_order(self._seen, len(self.units))
            self._last_ran = self._seen[-1]
            self._pos = {u: i for i, u in enumerate(self.order)}
            self._slot_done_after = schedule.last_of_slot(self.order, self.slot_of)
            self._order_known = True
        self._free_kept()
        if self._views is not None:
            self._views.put_back_root()  # a recompute outside every unit reads the root's attributes
        # Prefetches issued during the forward for units that never ran are dropped.
        self._deferred = []
        if self.group is not None:
            self._catch_up(len(self.order))
            self._check_same_units()
        self.phase = Phase.BACKWARD

    def leave_schedule(self) -> None:
        """This rank's `loss_fn` went beyond the unit schedule in the forward (Note [steps off the
        unit schedule] in `_core.py`): issue the rest of the forward's gathers, as the other ranks
        do, and say so in the exchange that ends every forward, so that every rank leaves with it."""
        if self.group is None or self.phase != Phase.FORWARD:
            return
        self._catch_up(len(self.order))
        self._check_same_units(leaving=True)

    def _catch_up(self, upto: int) -> None:
        """Gathers (and frees) the units before position `upto` in forward order that this rank
        did not gather in this forward, so that every rank gathers the same units in the same order
        (Note [units on every rank])."""
        if not self._order_known:
            return
        for v in self.order[self._fwd_ptr : upto]:
            if v not in self._fwd_gathered:
                self._start(v)
                self._free(v)
        self._fwd_ptr = max(self._fwd_ptr, upto)

    def _check_same_units(self, leaving: bool = False) -> None:
        """Starts the exchange that stops every rank, before any gradient is reduced, if the ranks
        ran different units, and takes every rank off the unit schedule if one is `leaving` it (a
        row of 2s). Leaving, it is waited for at once; else it overlaps the backward until the
        engine's next collective or reduction (`_settle_check`)."""
        n = max(self._n_members, 1)
        mine = torch.zeros(n, dtype=torch.int32, device=self.root.local.device)
        if leaving:
            mine.fill_(2)
        elif self._ran_members:
            mine[list(self._ran_members)] = 1
        everyone = torch.empty(self._world * n, dtype=torch.int32, device=mine.device)
        work = C.all_gather(everyone, mine, self.group, async_op=True)
        self._check = (work, everyone, mine, leaving)
        if leaving:
            self._settle_check()

    def _settle_check(self, timeout: float | None = None) -> None:
        """Waits for the exchange of which units ran, if one is pending, and acts on it."""
        if self._check is None:
            return
        work, everyone, mine, leaving = self._check
        if work is not None:
            C.wait(work, timeout)
        self._check = None
        n = mine.numel()
        table = everyone.view(self._world, n)
        left = (table == 2).all(dim=1).nonzero().flatten().tolist()
        if leaving:
            return
        if left:
            e = OffSchedule(f"rank(s) {left} left the unit schedule on this step (a backward inside loss_fn)")
            e.agreed = True  # every rank saw it in this exchange
            raise e
        if not self.units:
            return
        differ = (table != table[0]).any(dim=0).nonzero().flatten().tolist()
        if differ:
            lines = "; ".join(
                f"{self._member_names[u]!r} ran on ranks {table[:, u].nonzero().flatten().tolist()} only" for u in differ[:4]
            )
            raise NotImplementedError(
                f"the ranks ran different units in this step ({lines}). Every rank must run every unit in a "
                "step, as with FSDP: send zero tokens through an idle expert rather than skipping it, and run "
                "skipped blocks on a zero-size batch (Note [units on every rank]). Nothing was reduced or applied."
            )

    def _pre_backward(self, u: int, m: int | None = None, view: Any = None) -> None:
        """A use of `u` begins its backward (its member `m`'s forward recorded `view`)."""
        if self.phase != Phase.BACKWARD:
            raise OffSchedule(
                "a backward ran inside loss_fn (torch.autograd.grad or a torch.func transform over the model)"
            )
        if view is not None:  # what a recompute of this use reads (Note [the model's own checkpointing])
            self._views.put_back(m, view)
        self._settle_check()
        if u in self._reduced:
            raise RuntimeError(
                f"unit {self.units[u].name!r} got a gradient after its reduction; please report this with the model"
            )
        if self._active.get(u, 0) == 0:
            self._busy_start(u)
        self._active[u] = self._active.get(u, 0) + 1
        self._ensure(u)
        prev = self._prev_of(u)
        self._prefetch(prev)
        if prev is None and self.slot_of and not any(w in self.slot_of for w in self._works):
            self.units[u].arenas["gathered"].release()  # the last unit gather of the step is done
        # A reduction in flight whose input fills a slot that nothing needs afterwards: finish it
        # now, so that the slot is given back before this unit's backward allocates its gradients.
        # Near the end of the backward, where the sharded gradients pile up, this is the step's peak.
        while any(w in self._slot_done_after for w, _, _, _ in self._in_flight):
            self._finish_oldest()

    def _post_backward(self, u: int) -> None:
        if self.phase != Phase.BACKWARD:
            raise OffSchedule(
                "a backward ran inside loss_fn (torch.autograd.grad or a torch.func transform over the model)"
            )
        if self._active.get(u, 0) > 0:
            self._active[u] -= 1
            if self._active[u] == 0:
                self._busy_end(u)
        self._pending[u] -= 1
        if self._pending[u] == 0:
            self._reduce(u)
        elif self.reshard_after_forward and not self._busy(u) and u in self._live and u not in self._grouped:
            self._free(u)  # another use comes later: gathered again then

    def _grad_ready(self, u: int) -> None:
        if self.phase == Phase.IDLE:
            return
        if u in self._reduced and self._reduce_now:
            raise RuntimeError(
                f"unit {self.units[u].name!r} got a gradient after its reduction; please report this with the model"
            )
        self._pending[u] -= 1
        if self._pending[u] == 0:
            self._reduce(u)

    def _reduce(self, u: int) -> None:
        self._settle_check()
        unit = self._unit(u)
        if u in self._reduced:
            return
        self._reduced.add(u)
        if self._active.pop(u, 0):
            self._busy_end(u)
        if unit.num_trained and not self._reduce_now:
            unit.stash_grads()
        if unit.num_trained and self._reduce_now:
            self._event("reduce", u)
            # At most `max_reductions` in flight (their full-size inputs are memory too): wait for
            # the oldest before this one takes a free arena pair.
            while len(self._in_flight) >= self.max_reductions:
                self._finish_oldest()
            busy = {pair for _, _, pair, _ in self._in_flight}
            pair = min(set(range(self.max_reductions)) - busy)
            owner = unit.arenas["full"].owner
            in_slot = unit.reduce_in_full and (owner is None or owner is unit or not self._holds(owner))
            if in_slot:
                self._drain_slot(u)
            pending = unit.start_reduce(self._accumulate, *self.reduce_arenas[pair], in_full=in_slot)
            self._in_flight.append((u, pending, pair, in_slot and unit.reduce_in_full))
        if u != ROOT:
            self._free(u)
            self._release_spent_slot(u)

    def _holds(self, unit: FlatUnit) -> bool:
        """Whether `unit` is gathered (or gathering) now."""
        if unit is self.root:
            return self.phase != Phase.IDLE
        return any(self.units[v] is unit for v in self._live)

    def _finish_oldest(self) -> None:
        u, pending, pair, in_slot = self._in_flight.pop(0)
        again = self._unit(u).finish_reduce(pending)
        if again is not None:  # hybrid: the replicate-axis all-reduce is now in flight
            self._in_flight.append((u, again, pair, in_slot))
        else:
            self._release_spent_slot(u)

    def _release_spent_slot(self, u: int) -> None:
        """In the backward, once the last unit of a slot is freed and its reduction (whose input may
        live in the slot) is done, nothing needs the slot until the next forward: give it back, so
        that the sharded gradients, which grow as the backward goes on, do not stack on it."""
        if self.phase != Phase.BACKWARD or u not in self._slot_done_after or u in self._live:
            return
        full = self.units[u].arenas["full"]
        if any(self._unit(w).arenas["full"] is full for w, _, _, _ in self._in_flight):
            return
        if any(v in self._live for v in self.slot_of if self.slot_of[v] == self.slot_of[u]):
            return
        self._event("release_slot", u)
        for name in ("full", "stage"):
            self.units[u].arenas[name].release()

    def end(self) -> None:
        """Ends one forward/backward: reduces what did not finish, waits, frees everything."""
        self.end_forward()
        self._settle_check()
        for u in list(self._live):  # the backward is over: nothing reads a full parameter now
            self._free(u)
        for u in reversed(self.order):
            if u not in self._reduced:
                self._reduce(u)
        self._reduce(ROOT)
        while self._in_flight:
            self._finish_oldest()
        self._free(ROOT)
        for u in list(self._live):
            self._free(u)
        for a in self.arenas:
            a.release()
        planning = not self.planned and self._reduce_now
        busy = self._busy_log
        if self._views is not None:
            self._views.restore()
        self._reset_step_state()
        if planning:
            self._plan(busy)

    def abort(self) -> None:
        """Leaves the engine clean after an exception: no gather or reduction survives.

        Collectives in flight are waited for, at most `ABORT_WAIT_S` seconds each: when every rank
        raised at the same point they are all complete. When one is not (the other ranks went on,
        or stopped elsewhere), its buffers are kept as they are, since a message may still land in
        them, and the engine refuses every later step with an error that says to restart.
        """
        if self._views is not None:
            self._views.restore()  # the module's attributes as they were before the step
        try:
            if self._check is not None:  # what it says no longer matters: the step failed
                work, self._check = self._check[0], None
                C.wait(work, ABORT_WAIT_S)
            for u, w in list(self._works.items()):
                self._unit(u).finish_gather(w, timeout=ABORT_WAIT_S)
                del self._works[u]
            while self._in_flight:
                u, pending, pair, in_slot = self._in_flight[0]
                again = self._unit(u).finish_reduce(pending, timeout=ABORT_WAIT_S)
                self._in_flight.pop(0)
                if again is not None:
                    self._in_flight.append((u, again, pair, in_slot))
        except (TimeoutError, RuntimeError) as e:
            self.broken = (
                f"an earlier step failed while a collective was in flight on this rank, and it did not complete "
                f"within {ABORT_WAIT_S:.0f} s ({e}): the ranks are out of step. Restart the processes (the "
                "state before the failed step is intact; save it from a healthy rank or a checkpoint)"
            )
            return
        for unit in [*self.units, self.root]:
            unit.take_grads()
            unit.free()
        for a in self.arenas:
            a.release()
        C.new_epoch()
        self._reset_step_state()


def _unique(items: list) -> list:
    out, seen = [], set()
    for x in items:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out
