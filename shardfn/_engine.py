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
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from . import _collectives as C
from ._flat import FlatUnit
from ._functorch import under_grad_transform, unwrap
from ._param import OffSchedule
from ._param_view import ParamView
from . import _schedule as schedule
from ._schedule import ROOT, Phase, Schedule, ScheduleStats as EngineStats
from ._unit_buffers import UnitBuffers
from ._unit_check import UnitCheck

__all__ = ["Engine", "EngineStats", "Phase", "Policy", "ROOT", "StaleParameterError", "GROUP_BYTES", "plan_groups", "group_name"]

GROUP_BYTES = 2 << 20
"""The default cap on a unit group's full parameters, in bytes (Note [unit groups]); 0: no groups."""
ABORT_WAIT_S = 10.0
"""How long a failed step waits for each collective still in flight (see `Engine.abort`)."""
_PRIMITIVE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


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


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward marks the end of that use of the unit
    (`sink.use_over(u)`: the engine's, or the estimate's probe).

    Written for torch.func too (setup_context, a generated vmap rule): a `loss_fn` may vmap over
    its inputs (an ensemble, per-example losses); the backward then runs once, on batched grads.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(sink: Any, u: int, *tensors: torch.Tensor):  # type: ignore[override]
        return tensors

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.sink, ctx.u = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.sink.use_over(ctx.u)
        return (None, None, *grads)


class _PostBackwardEager(torch.autograd.Function):
    """`_PostBackward` where no torch.func transform is active, in the classic form: its `apply`
    does not bind its arguments through `inspect.signature`, a cost per unit and step."""

    @staticmethod
    def forward(ctx, sink: Any, u: int, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.sink, ctx.u = sink, u
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

    The parts, each owning its state: the schedule's moves (`Schedule`, `_schedule.py`), the units'
    buffers they act on (`UnitBuffers`), the tree `loss_fn` sees (`ParamView`), the cross-rank
    check of which units ran (`UnitCheck`); the engine itself holds the hooks that turn the model's
    forward and autograd's backward into the schedule's events.

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
        self.groups = [list(g) for g in (groups if groups is not None else [[u] for u in range(len(units))])]
        self._group_of = {m: g for g, ms in enumerate(self.groups) for m in ms}
        names = info.unit_names if info is not None else []
        n_members = len(self._group_of)
        self._member_names = list(names) if len(names) == n_members else [str(m) for m in range(n_members)]
        self._nested = {self._group_of[m] for m in nested}
        self.units = units
        self.root = root
        self.policy = policy
        self.cast_dtype = policy.cast_dtype
        self.remat_units: set[int] = set()  # read by the remat wrappers (shardfn/_remat.py)
        self.stats = EngineStats()
        self.broken: str | None = None
        self.check = UnitCheck(group, self._member_names, bool(units), root.local.device) if group is not None else None
        self.buffers = UnitBuffers(units, root, self.check)
        trained = {u: self.buffers.unit(u).num_trained for u in [*range(len(units)), ROOT]}
        grouped = {g for g, ms in enumerate(self.groups) if len(ms) > 1}
        self.schedule = Schedule(policy, [u.name for u in units], trained, grouped, self.buffers, catch_up=group is not None,
                                 stats=self.stats)
        self.view = ParamView(info, self.buffers, self.groups, self._member_names, self.schedule)
        self._reset()
        self._bind({})

    # -- what the parts hold, read by tests and benchmarks ----------------------------------------
    phase = property(lambda self: self.schedule.phase)
    order = property(lambda self: self.schedule.order)
    slot_of = property(lambda self: self.schedule.slot_of)
    planned = property(lambda self: self.schedule.planned)
    arenas = property(lambda self: self.buffers.arenas)
    user_tree = property(lambda self: self.view.user_tree)

    @property
    def tp(self) -> Any:
        """The tensor-parallel forward (`_tp.TensorParallel`), set by the core; None without."""
        return self.view.tp

    @tp.setter
    def tp(self, tp: Any) -> None:
        self.view.tp = tp

    def _reset(self) -> None:
        self._ran_members: set[int] = set()  # the model's units (hook numbering) that ran
        self._wrapped: list[tuple[bool, Any, int | None]] = []  # per running unit use: were its inputs hooked; its view; its writes
        self._root_writes: int | None = None  # the root's count of in-place writes when the forward began
        self.view.reset()

    # -- the plan (Note [unit plan]) ------------------------------------------------------------
    def _bind(self, slot_of: dict[int, int]) -> None:
        """Gives every unit its arenas: the shared slot `slot_of[u]`, or arenas of its own."""
        self.schedule.set_plan(slot_of)
        self.buffers.bind(slot_of, self.schedule.max_reductions)
        for u in [*range(len(self.units)), ROOT]:
            self._hook_grads(self.buffers.unit(u), u)  # bind makes new full parameters
        self.view.make_trees()

    def _plan(self, busy: dict[int, list[tuple[int, int]]]) -> None:
        """After the first step: slot arenas in forward order, busy units kept apart."""
        self.schedule.planned = True
        if not (self.policy.share_slots and self.units):
            return
        compute = {u: self.units[u].compute_dtype for u in self.order}
        self._bind(schedule.plan_slots(self.order, self._nested, compute, self.policy, busy))

    def replan(self) -> None:
        """Forgets the plan: the next step runs with an arena per unit and plans again."""
        self.schedule.forget_plan()
        self._bind({})

    # -- what loss_fn sees (`_param_view.py`) ----------------------------------------------------------
    def set_tree(self, treespec: Any, paths: list[str], where: list[tuple[int, int]]) -> None:
        """The parameter tree's structure, its leaves' paths, and (unit, index) of each leaf."""
        self.view.set_tree(treespec, paths, where)

    def flat_params(self, apply, params: Any) -> dict[str, torch.Tensor] | None:
        """What `apply(params, ...)` computes on, when `params` holds this step's parameters."""
        return self.view.flat_params(apply, params)

    def read(self, u: int, j: int) -> torch.Tensor:
        """The full value of leaf `j` of unit `u`, for a read outside `apply`."""
        return self.view.read(u, j)

    def cast_inputs(self, info, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Mixed precision: floating-point inputs of the model's forward in the compute dtype."""
        if self.cast_dtype is None or info is not self.info:
            return args, kwargs
        return self._cast(args), self._cast(kwargs)

    def _cast(self, tree: Any) -> Any:
        return schedule.cast_floating(tree, self.cast_dtype)

    def remats(self, unit: int) -> bool:
        """Whether remat checkpoints the model's unit `unit` now (inside a step)."""
        return unit in self.remat_units and self.schedule.phase != Phase.IDLE

    def _hook_grads(self, unit: FlatUnit, u: int) -> None:
        if u == ROOT:
            return  # the root is reduced after the backward

        ref = weakref.ref(self)  # the full parameters outlive the step object otherwise

        def hook(_: torch.Tensor) -> None:
            engine = ref()
            if engine is not None:
                engine.schedule.grad_ready(u)

        for p in unit.proxies:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(hook)

    # -- the step -----------------------------------------------------------------------------
    def refuse_if_broken(self) -> None:
        """Raises the error `abort` left (a collective it could not finish), before anything of a
        step touches a buffer: a message may still land in the gradient shards and the arenas it
        kept (Note [freed memory] 10 in `_debug.py`)."""
        if self.broken:
            raise RuntimeError(self.broken)

    def begin(self, accumulate: bool, reduce: bool = True) -> None:
        """Starts one forward/backward: gathers the root and prefetches the first unit.

        Args:
            accumulate: add this backward's reduced gradients to the sharded ones already there.
            reduce: reduce at all; False keeps the full gradients for a later backward (local
                accumulation of micro-batches).
        """
        self.refuse_if_broken()
        if self.schedule.needs_plan:
            self.schedule.needs_plan = False
            self.replan()
        self._reset()
        self.schedule.begin(accumulate, reduce)
        self._root_writes = self.root.writes()
        self.view.tp_trees()

    def pre_forward(self, info, u: int, args: tuple, kwargs: dict) -> tuple | None:
        s = self.schedule
        if info is not self.info or s.phase == Phase.IDLE:
            return None
        m, u = u, self._group_of[u]
        transforms = torch._C._are_functorch_transforms_active()
        if s.phase == Phase.FORWARD and transforms and under_grad_transform((args, kwargs)):
            raise OffSchedule(
                f"unit {self._member_names[m]!r} ran inside a torch.func gradient transform (grad, vjp, jacrev, ...) in "
                "loss_fn (a gradient penalty)"
            )
        views = self.view.views
        if s.phase == Phase.BACKWARD:  # a recompute, by the model's own checkpoint around the unit's call
            s.recompute_starts(u)
            if views is not None:  # Note [the model's own checkpointing] in `_recompute.py`
                views.for_recompute(m, self._member_names[m])
            return (self._cast(args), self._cast(kwargs)) if self.cast_dtype is not None else None
        self._ran_members.add(m)
        s.forward_starts(u)
        self.view.swap_in(u, True, m)
        view = views.record(m) if views is not None else None
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
                s.inputs_hooked(u)
                wrapped = True
        self._wrapped.append((wrapped, view, self.units[u].writes()))
        return args, kwargs

    def post_forward(self, info, u: int, output: Any) -> None:
        if info is not self.info or self.schedule.phase != Phase.FORWARD:
            return None
        m, u = u, self._group_of[u]
        self.view.swap_in(u, False, m)
        wrapped, view, writes = self._wrapped.pop() if self._wrapped else (False, None, None)
        if writes is not None and self.units[u].writes() != writes:
            self._refuse_written(self.units[u], self._member_names[m])
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
        self.schedule.forward_ends(u)
        return output

    # Note [parameters written in the forward]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A forward computes on a unit's gathered copy of its parameters, given back when it returns:
    # a write into them (`nn.Embedding(max_norm=...)` renormalizing the rows it looks up, a
    # `clamp_` under `torch.no_grad()`) would be lost under every sharded strategy, and under
    # `no_shard` kept by the rank that made it alone, so the replicas drift apart; in both the step
    # would train something else than one process without a word. Every such write moves the
    # version counter of the unit's full parameters (their readers, `FlatUnit.writes`), which the
    # engine reads as a unit's forward begins and ends (the root's: as the forward begins and
    # `loss_fn` returns), and a count that moved stops the step before any gradient is reduced.
    # A write through `.data` bypasses autograd's counter and is not seen.
    @staticmethod
    def _refuse_written(unit: FlatUnit, member: str | None) -> None:
        names = [seg.path for seg in unit.segments]
        if member is not None:  # a group's member: its own leaves, where it has them
            names = [n for n in names if n.startswith(member + ".")] or names
        where = f"unit {member!r}" if member is not None else "the root (what runs outside every unit)"
        shown = ", ".join(repr(n) for n in names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        landed = (" A leaf whole on every rank is computed on in place, so this rank's copy of it in the state "
                  "holds the write and may now differ from the other ranks': go back to a copy of the state "
                  "(sf.copy) or a checkpoint." if unit.writes_reach_the_state() else "")
        raise ValueError(
            f"{where} wrote one of its parameters ({shown}) in place in its forward: nn.Embedding(max_norm=...) "
            "renormalizes the rows it looks up, a clamp_ or copy_ under torch.no_grad() writes a weight. The forward "
            "computes on gathered copies, so the write would be lost (under no_shard, kept by this rank alone); "
            f"nothing was reduced or applied.{landed} Change parameters in the update (an sf.optim transform) or on "
            "the state after the step, and use nn.Embedding(max_norm=None) (Note [parameters written in the forward] "
            "in shardfn/_engine.py)"
        )

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
        if not self.schedule.forward_over():
            return
        if self._root_writes is not None and self.root.writes() != self._root_writes:
            self._refuse_written(self.root, None)
        if self.view.views is not None:
            self.view.views.put_back_root()  # a recompute outside every unit reads the root's attributes
        if self.check is not None:
            self.check.start(self._ran_members)
        self.schedule.backward()

    def leave_schedule(self) -> None:
        """This rank's `loss_fn` went beyond the unit schedule in the forward (Note [steps off the
        unit schedule] in `_core.py`): issue the rest of the forward's gathers, as the other ranks
        do, and say so in the exchange that ends every forward, so that every rank leaves with it."""
        if self.check is None or self.schedule.phase != Phase.FORWARD:
            return
        self.schedule.catch_up(len(self.order))
        self.check.start(set(), leaving=True)

    def _pre_backward(self, u: int, m: int | None = None, view: Any = None) -> None:
        """A use of `u` begins its backward (its member `m`'s forward recorded `view`)."""
        if self.schedule.phase != Phase.BACKWARD:
            raise OffSchedule("a backward ran inside loss_fn (torch.autograd.grad or a torch.func transform over the model)")
        if view is not None:  # what a recompute of this use reads (Note [the model's own checkpointing])
            self.view.views.put_back(m, view)
        self.schedule.backward_starts(u)

    def use_over(self, u: int) -> None:
        """A use of `u` is over in the backward (`_PostBackward` on its inputs)."""
        if self.schedule.phase != Phase.BACKWARD:
            raise OffSchedule("a backward ran inside loss_fn (torch.autograd.grad or a torch.func transform over the model)")
        self.schedule.use_over(u)

    def end(self) -> None:
        """Ends one forward/backward: reduces what did not finish, waits, frees everything."""
        self.end_forward()
        busy = self.schedule.end()
        if self.view.views is not None:
            self.view.views.restore()
        self._reset()
        if busy is not None:
            self._plan(busy)

    def abort(self) -> None:
        """Leaves the engine clean after an exception: no gather or reduction survives.

        Collectives in flight are waited for, at most `ABORT_WAIT_S` seconds each: when every rank
        raised at the same point they are all complete. When one is not (the other ranks went on,
        or stopped elsewhere), its buffers are kept as they are, since a message may still land in
        them, and the engine refuses every later step with an error that says to restart.
        """
        if self.view.views is not None:
            self.view.views.restore()  # the module's attributes as they were before the step
        try:
            if self.check is not None:
                self.check.abandon(ABORT_WAIT_S)
            self.schedule.abort(ABORT_WAIT_S)
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
        self.buffers.release_all()
        C.new_epoch()
        self.schedule.reset()
        self._reset()
