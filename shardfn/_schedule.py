"""The unit schedule's decisions, written once: the engine acts on them, the estimate replays them.

Note [one schedule]
~~~~~~~~~~~~~~~~~~~
What happens to each unit and when is decided here, as pure functions of the policy, the forward
order and the units' sizes: which unit stays gathered from its forward to its backward, how the
units share slot arenas and how large each arena is, when a prefetch waits and which gathered
units make room for one that nobody prefetched, which unit is the last of its slot in the
backward (its slot is given back after it), how many gradient reductions may be in flight, and
the dtype the model's inputs are cast to. `Engine` (`_engine.py`) executes these decisions on real
buffers, and `sf.estimate_memory` (`_estimate.py`) replays them on byte counts; neither derives
them itself, so a change here moves both (tests/test_estimate.py changes one and sees both move).
What stays each one's own is how it acts: the engine on its arenas, hooks and collectives, the
estimate on the meta run's timeline.

Note [the schedule's moves]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The moves themselves (gather, wait, free, prefetch and its deferral, the groups kept between
their members' forwards, reductions in flight and the slots they drain, the slot given back after
its last unit, the end of the step) are one state machine, `Schedule`, driven by the step's
events: `begin`, `forward_starts` / `forward_ends` of a unit, `forward_over`, `backward_starts`,
`recompute_starts`, `use_over` (a use's backward is done), `grad_ready` (a parameter's gradient is
accumulated) and `end`. It acts through `Buffers`, the only thing that differs between the two
that run it: the engine's `UnitBuffers` (`_unit_buffers.py`) gathers, frees and reduces FlatUnits;
the estimate's `_Sim` adds and removes the same buffers' bytes. The estimate marks the same events
on its meta run (the unit hooks, the inputs' post-backward, the gradient hooks) and replays them
through the same `Schedule`, so whatever the engine does next to a unit, the estimate does too.
Each unit's state in a step is `Schedule.state(u)`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Mapping, Protocol, Sequence

import torch
from torch.utils import _pytree as pytree

__all__ = ["ArenaPlan", "Buffers", "BusyLog", "Phase", "ROOT", "ReductionStarted", "Schedule", "ScheduleStats", "UnitState",
           "arena_plan", "cast_floating", "evictions", "forward_order", "keeps_for_backward", "last_of_slot", "plan_slots",
           "prefetch_waits", "reductions_in_flight", "slot_holder"]

ROOT = -1
"""The root unit's index: what runs outside every unit (embeddings, head), gathered for the whole step."""

ARENAS = ("full", "gathered", "stage")
"""A unit's buffers (Note [slot arenas] in `_engine.py`): its full parameters, the all-gather's
output, and the staging copy of its shards."""


def forward_order(seen: Sequence[int], n_units: int) -> list[int]:
    """The forward order the schedule follows after the first forward: the units in the order
    they first ran, then those that did not run, in the module's order."""
    return [*seen, *(u for u in range(n_units) if u not in seen)]


def keeps_for_backward(policy: Any, order_known: bool, u: int | None, last_ran: int | None) -> bool:
    """Whether unit `u` stays gathered from its forward to its backward: the last unit to run in
    the first step's forward, whose backward comes first, once that order is known (Note [unit
    schedule] in `_engine.py`)."""
    return bool(policy.keep_last) and order_known and u is not None and u == last_ran


def slot_holder(u: int, live: Iterable[int], slot_of: Mapping[int, int]) -> int | None:
    """The gathered unit other than `u` that holds `u`'s slot arenas, if any: it is freed before
    `u` is gathered (or, for a prefetch of `u`, the prefetch waits)."""
    slot = slot_of.get(u)
    if slot is None:
        return None
    for v in sorted(live):
        if v != u and slot_of.get(v) == slot:
            return v
    return None


def prefetch_waits(policy: Any, n_live: int, slot_held: bool) -> bool:
    """Whether a prefetch must wait: under `reshard_after_forward`, while `policy.max_live` units
    are gathered, or another gathered unit holds the prefetched unit's slot. (The engine starts it
    once a unit is freed; the estimate, which replays no clock between marks, leaves it out.)"""
    return bool(policy.reshard_after_forward) and (n_live >= policy.max_live or slot_held)


def evictions(policy: Any, live: Iterable[int], idle: Iterable[int]) -> list[int]:
    """The gathered units to free before a unit that nobody prefetched starts, under
    `reshard_after_forward`: idle ones (`idle`: gathered, not running), lowest first, until fewer
    than `policy.max_live` are gathered; prefetches nobody uses yet are dropped rather than the
    bound exceeded."""
    if not policy.reshard_after_forward:
        return []
    n = len(set(live))
    out = []
    for w in sorted(idle):
        if n < policy.max_live:
            break
        out.append(w)
        n -= 1
    return out


def reductions_in_flight(policy: Any, n_units: int, slot_of: Mapping[int, int]) -> int:
    """How many gradient reductions may overlap the backward without any extra buffer.

    All-reduced gradients (`no_shard` in the master dtype) are reduced in place in their flat
    buffers: every unit's may run while the backward goes on, as DDP's buckets. Reduce-scatters
    whose input lives in its own unit's slot, neighbours in different slots: two (the engine
    finishes a slot's reduction before refilling it); not with three slots (gathers in place), where
    the third already holds one reduction's input while the previous unit is gathered. Else one.
    """
    if policy.all_reduce:
        return n_units + 1
    if slot_of and policy.reduce_in_master and policy.single_micro_batch and policy.slots == 2:
        return 2
    return 1


def plan_slots(order: Sequence[int], nested: Iterable[int], compute: Mapping[int, torch.dtype], policy: Any,
               busy: Mapping[int, Sequence[tuple[int, int]]] | None = None) -> dict[int, int]:
    """The slot plan (Note [unit plan] in `_engine.py`): the units that share slot arenas, in
    forward order, `policy.slots` apart, and each one's slot.

    Args:
        order: the units in forward order.
        nested: units that run inside other units (they keep arenas of their own).
        compute: each unit's compute dtype (a slot holds one dtype: the first unit's).
        policy: the engine's `Policy`.
        busy: each unit's busy spans (clock intervals) in the step that was watched; units whose
            spans overlap another's of the same slot keep arenas of their own. None: no overlap
            known (the estimate, which has no clock of the engine's).
    """
    if not (policy.share_slots and order):
        return {}
    nested = set(nested)
    candidates = [u for u in order if u not in nested and compute[u] == compute[order[0]]]
    busy = busy or {}
    private: set[int] = set()

    def overlap(a: int, b: int) -> bool:
        return any(s1 < e2 and s2 < e1 for s1, e1 in busy.get(a, ()) for s2, e2 in busy.get(b, ()))

    while True:
        shared = [u for u in candidates if u not in private]
        slot_of = {u: i % policy.slots for i, u in enumerate(shared)}
        clash = [(a, b) for i, a in enumerate(shared) for b in shared[i + 1 :] if slot_of[a] == slot_of[b] and overlap(a, b)]
        if not clash:
            break
        span = {u: sum(e - s for s, e in busy.get(u, ())) for u in candidates}
        private |= {max(pair, key=lambda v: span[v]) for pair in clash}
    return slot_of if len(shared) >= 2 else {}


def last_of_slot(order: Sequence[int], slot_of: Mapping[int, int]) -> set[int]:
    """The units that are the last of their slot to run in the backward (the first in forward
    order): after each one's reduction its slot is given back until the next forward."""
    first: dict[int, int] = {}
    for u in order:
        if u in slot_of:
            first.setdefault(slot_of[u], u)
    return set(first.values())


@dataclass(frozen=True)
class ArenaPlan:
    """Which arena holds each buffer of each unit, and how large each arena is.

    Attributes:
        key_of: unit -> buffer name (`ARENAS`) -> the arena's key; units that share a slot share
            its keys, and the slot units share one all-gather output, `("gathered", "shared")`.
        numel: arena key -> its size in elements (the largest of the units it serves).
        dtype: arena key -> its dtype.
        shared: the keys of arenas that several units use in turn.
    """

    key_of: dict[int, dict[str, Hashable]]
    numel: dict[Hashable, int]
    dtype: dict[Hashable, torch.dtype]
    shared: frozenset

    def nbytes(self, key: Hashable) -> int:
        """The arena's size in bytes."""
        return self.numel[key] * self.dtype[key].itemsize


def arena_plan(sizes: Mapping[int, Mapping[str, int]], compute: Mapping[int, torch.dtype],
               slot_of: Mapping[int, int]) -> ArenaPlan:
    """The arenas of a slot plan (Note [slot arenas] in `_engine.py`).

    Args:
        sizes: each unit's buffer sizes in elements (`FlatUnit.sizes()`), the root's included.
        compute: each unit's compute dtype.
        slot_of: the slot plan (`plan_slots`); units outside it get arenas of their own.
    """
    key_of: dict[int, dict[str, Hashable]] = {}
    numel: dict[Hashable, int] = {}
    dtype: dict[Hashable, torch.dtype] = {}
    shared: set = set()
    if slot_of:  # one all-gather output for all of them: one unit gather in flight at a time
        g = ("gathered", "shared")
        numel[g] = max(sizes[v]["gathered"] for v in slot_of)
        dtype[g] = compute[next(iter(slot_of))]
        shared.add(g)
    for u in sizes:
        if u in slot_of:
            k = slot_of[u]
            members = [v for v in slot_of if slot_of[v] == k]
            keys = {name: (name, "slot", k) for name in ("full", "stage")}
            for name, key in keys.items():
                numel[key] = max(sizes[v][name] for v in members)
                dtype.setdefault(key, compute[u])
                shared.add(key)
            key_of[u] = {**keys, "gathered": ("gathered", "shared")}
        else:
            key_of[u] = {name: (name, u) for name in ARENAS}
            for name in ARENAS:
                numel[(name, u)] = sizes[u][name]
                dtype[(name, u)] = compute[u]
    return ArenaPlan(key_of, numel, dtype, frozenset(shared))


def cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    """Mixed precision: the floating-point tensors of `tree` (a unit's or the model's inputs) in
    the compute dtype; None leaves the tree as it is."""
    if dtype is None:
        return tree
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


# -- the moves (Note [the schedule's moves]) ---------------------------------------------------------


class Phase(str, enum.Enum):
    """Where a step is; equal to its name in lower case ("forward")."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class UnitState(str, enum.Enum):
    """What a unit is in the step now (`Schedule.state`)."""

    SHARDED = "sharded"  # only its shards exist
    GATHERING = "gathering"  # its all-gather is in flight
    GATHERED = "gathered"  # its full parameters are valid
    REDUCING = "reducing"  # its reduction is in flight
    REDUCED = "reduced"  # its gradient shard is final for this backward


class ReductionStarted(Exception):
    """Raised by `Buffers.start_reduce` that failed after some of its collectives started; `pending`
    holds those (what `finish_reduce` waits for), and `__cause__` is the failure. The schedule keeps
    them in flight, so that `abort` waits for them before their memory is given back (Note [freed
    memory] 9 in `_debug.py`), and raises the failure itself."""

    def __init__(self, pending: Any):
        super().__init__("a reduction failed after some of its collectives started")
        self.pending = pending


def previous_ran(order: Sequence[int], i: int | None, ran: set[int]) -> int | None:
    """The unit of `order` before position `i` (None: no position) that is in `ran`, or None."""
    while i is not None and i > 0:
        i -= 1
        if order[i] in ran:
            return order[i]
    return None


@dataclass
class ScheduleStats:
    """What the schedule did in the last step; for tests and benchmarks."""

    events: list[tuple[str, int, str]] = field(default_factory=list)  # (what, unit, phase); ROOT is -1
    max_live_units: int = 0  # most non-root units gathered (or gathering) at once
    record_events: bool = False

    def reset(self) -> None:
        self.events.clear()
        self.max_live_units = 0


class BusyLog:
    """When each unit was busy in a step (running its forward, or a use of it in its backward), on
    a clock of the step's events: the first step's log makes the slot plan (Note [unit plan])."""

    def __init__(self, on: bool):
        self.on = on
        self.clock = 0
        self.since: dict[int, int] = {}
        self.spans: dict[int, list[tuple[int, int]]] = {}  # unit -> its busy spans

    def start(self, u: int) -> None:
        if self.on:
            self.clock += 1
            self.since.setdefault(u, self.clock)

    def end(self, u: int) -> None:
        if self.on:
            self.clock += 1
            since = self.since.pop(u, None)
            if since is not None:
                self.spans.setdefault(u, []).append((since, self.clock))


class Buffers(Protocol):
    """What the schedule acts on: the engine's buffers (`UnitBuffers`) or the estimate's byte counts.

    A `work` or `pending` is whatever the implementation returns from a start and is handed back
    to its finish; `timeout` (seconds, None: no bound) bounds a wait after a failed step."""

    def before_collective(self) -> None:
        """A gather or reduction is about to be issued (the engine settles its cross-rank unit check)."""

    def start_gather(self, u: int) -> Any:
        """Allocates unit `u`'s full parameters and starts their all-gather."""

    def finish_gather(self, u: int, work: Any, timeout: float | None = None) -> None:
        """Waits for `u`'s all-gather; its full parameters are valid from here."""

    def free(self, u: int) -> None:
        """Drops `u`'s full parameters (shared slot arenas keep their storage)."""

    def gathers_in_place(self, u: int) -> bool:
        """Whether `u`'s all-gather writes its full arena as soon as it starts."""

    def reduces_in_slot(self, u: int, live: set[int]) -> bool:
        """Whether `u`'s reduce-scatter input may be built in its own full arena now (no other unit
        whose data it holds is gathered: `live`, and the root, gathered for the whole step)."""

    def start_reduce(self, u: int, pair: int, in_slot: bool, accumulate: bool) -> Any:
        """Starts reducing `u`'s full gradients into its shard, with reduction arenas `pair`. If it
        fails after a collective started, it raises `ReductionStarted` with what started."""

    def finish_reduce(self, u: int, pending: Any, timeout: float | None = None) -> Any | None:
        """Waits for a reduction; returns a new pending one if another phase started (hybrid)."""

    def keep_grads(self, u: int) -> None:
        """A micro-batch that is not reduced: `u`'s full gradients are kept for the next."""

    def release_idle_slots(self, live: set[int]) -> None:
        """Gives back the slot arenas that none of the `live` units holds."""

    def release_slot(self, u: int) -> None:
        """Gives back the slot arenas of `u` (the last unit of its slot in this backward)."""

    def release_gathered(self, u: int) -> None:
        """Gives back the all-gather output `u` used (the step's last unit gather is done)."""

    def release_all(self) -> None:
        """The step is over: gives back every arena."""


class Schedule:
    """The unit schedule of one model's units as a state machine (Note [the schedule's moves],
    Note [unit schedule] in `_engine.py`).

    Args:
        policy: the strategy's choices (`_engine.Policy`).
        names: the units' names, for errors.
        trained: for each unit (ROOT included), how many of its leaves are trained.
        grouped: the units that hold several of the model's units (Note [unit groups]).
        buffers: what the moves act on.
        catch_up: issue the forward's gathers a rank skipped (Note [units on every rank]); only
            with several ranks.
        stats: where the events are recorded.
    """

    def __init__(self, policy: Any, names: Sequence[str], trained: Mapping[int, int], grouped: Iterable[int], buffers: Buffers,
                 catch_up: bool = False, stats: ScheduleStats | None = None):
        self.policy = policy
        self.names = list(names)
        self.n = len(self.names)
        self.trained = dict(trained)
        self.grouped = set(grouped)
        self.buffers = buffers
        self.catches_up = catch_up
        self.stats = stats if stats is not None else ScheduleStats()
        self.order: list[int] = list(range(self.n))  # forward order (a guess until the first forward)
        self.order_known = False
        self.last_ran: int | None = None  # the last unit of the first forward (`kept_for_backward`)
        self.planned = False  # the slot plan is made (the busy log is no longer kept)
        self.needs_plan = False  # a step found the plan wrong: the next one plans again
        self.set_plan({})
        self.reset()

    # -- the plan ---------------------------------------------------------------------------------
    def set_plan(self, slot_of: Mapping[int, int]) -> None:
        """The units that share slot arenas, and each one's slot (`plan_slots`)."""
        self.slot_of = dict(slot_of)
        self.max_reductions = reductions_in_flight(self.policy, self.n, self.slot_of)
        self.done_after = last_of_slot(self.order, self.slot_of)

    def forget_plan(self) -> None:
        """The next step runs with an arena per unit, learns the order again and plans again."""
        self.order_known = False
        self.planned = False
        self.set_plan({})

    def reset(self) -> None:
        """A new step's state: nothing gathered, nothing reduced."""
        self.works: dict[int, Any] = {}  # unit -> its all-gather in flight
        self.live: set[int] = set()  # non-root units allocated (gathered or gathering)
        self.running: set[int] = set()  # units inside their forward
        self.active: dict[int, int] = {}  # unit -> uses whose backward has begun and not ended
        self.deferred: list[int] = []  # prefetches waiting for room
        self.pending = [0] * self.n  # per unit: gradients and uses to come before its reduction
        self.reduced: set[int] = set()
        self.in_flight: list[tuple[int, Any, int, bool]] = []  # (unit, pending, arena pair, input in its slot)
        self.ran: set[int] = set()  # units whose forward ran in this step
        self.seen: list[int] = []  # ... in the order they first ran
        self.fwd_gathered: set[int] = set()  # units gathered in this forward
        self.fwd_ptr = 0  # units before this position in forward order were gathered or caught up
        self.pos = {u: i for i, u in enumerate(self.order)}
        self.accumulate = False
        self.reduce_now = True
        self.busy_log = BusyLog(on=not self.planned)
        self.phase = Phase.IDLE

    # -- what the state says ---------------------------------------------------------------------
    def state(self, u: int) -> UnitState:
        """Unit `u`'s state now."""
        if any(w == u for w, _, _, _ in self.in_flight):
            return UnitState.REDUCING
        if u in self.reduced:
            return UnitState.REDUCED
        if u in self.works:
            return UnitState.GATHERING
        if u in self.live or (u == ROOT and self.phase != Phase.IDLE):
            return UnitState.GATHERED
        return UnitState.SHARDED

    def busy(self, u: int) -> bool:  # running its forward, or a use of it in its backward
        return u in self.running or self.active.get(u, 0) > 0

    def kept_for_backward(self, u: int | None) -> bool:
        return keeps_for_backward(self.policy, self.order_known, u, self.last_ran)

    def holder(self, u: int) -> int | None:  # the live unit other than `u` holding `u`'s slot
        return slot_holder(u, self.live, self.slot_of)

    def same_full(self, u: int, w: int) -> bool:
        """Whether units `u` and `w` have their full parameters in one arena."""
        return u == w or (u in self.slot_of and w in self.slot_of and self.slot_of[u] == self.slot_of[w])

    def next_of(self, u: int) -> int | None:
        i = self.pos.get(u, len(self.order))
        return self.order[i + 1] if i + 1 < len(self.order) else None

    def prev_of(self, u: int) -> int | None:
        """The unit before `u` in forward order that ran in this step (the backward's next)."""
        return previous_ran(self.order, self.pos.get(u), self.ran)

    def note(self, what: str, u: int) -> None:
        self.stats.record_events and self.stats.events.append((what, u, self.phase))

    # -- gather / free ------------------------------------------------------------------------
    def start(self, u: int) -> None:
        """Starts gathering `u`, making room first (Note [unit plan], Note [one schedule])."""
        b = self.buffers
        b.before_collective()
        if u in self.works or (u != ROOT and u in self.live):
            return
        v = self.holder(u)
        if v is not None:  # see Note [unit plan]
            if self.busy(v):
                self.needs_plan = True
                raise RuntimeError(
                    f"unit {self.names[u]!r} is needed while unit {self.names[v]!r}, which shares its "
                    "buffers under this step's plan, is still in use: the units ran differently than in the "
                    "first step (Note [unit plan]). Nothing was computed wrong; the next step plans again. "
                    "If this repeats, the order of units changes from step to step: use strategy='shard_grad_op'."
                )
            self.free(v, prefetch=False)
        if u != ROOT:
            # A unit runs that nobody prefetched: drop prefetches nobody uses yet rather than
            # exceed the bound.
            for w in evictions(self.policy, self.live, [w for w in self.live if not self.busy(w)]):
                self.free(w, prefetch=False)
        if u in self.slot_of:  # one shared all-gather output: one unit gather in flight
            for w in [w for w in self.works if w in self.slot_of]:
                self._drain(w)
                self._finish_gather(w)
        if u != ROOT:
            self.live.add(u)
            self.stats.max_live_units = max(self.stats.max_live_units, len(self.live))
            if self.phase == Phase.FORWARD:
                self.fwd_gathered.add(u)
        if b.gathers_in_place(u):  # its gather writes the slot at once (Note [slot arenas])
            self._drain(u)
        self.note("gather", u)
        self.works[u] = b.start_gather(u)
        # Deferred prefetches run once `u` holds its slot: started while `u` made room, one of
        # them could take that slot (or be `u` itself, gathered twice).
        self._run_deferred()

    def ensure(self, u: int) -> None:  # `u`'s full parameters are valid when this returns
        if u != ROOT and u not in self.live and u not in self.works:
            self.start(u)
        if u in self.works:
            self._drain(u)
            self._finish_gather(u)

    def _finish_gather(self, u: int, timeout: float | None = None) -> None:  # Note [freed memory] 8 in _debug.py
        self.buffers.finish_gather(u, self.works[u], timeout)
        del self.works[u]  # only once complete: a gather whose wait raised stays for `abort`

    def _drain(self, u: int) -> None:
        """Finishes reductions whose input lives in the arena that `u` is about to fill."""
        while any(in_slot and self.same_full(w, u) for w, _, _, in_slot in self.in_flight):
            self.finish_oldest()

    def free(self, u: int, prefetch: bool = True) -> None:
        """Frees `u`'s full parameters; then, if `prefetch`, starts the prefetches that waited for room."""
        if u in self.works:  # a prefetch nobody used: finish it before dropping the buffers
            self._drain(u)
            self._finish_gather(u)
        if u == ROOT or u in self.live:
            self.note("free", u)
            self.buffers.free(u)
            self.live.discard(u)
        if prefetch:
            self._run_deferred()

    def _run_deferred(self) -> None:
        deferred, self.deferred = self.deferred, []
        for w in deferred:
            self.prefetch(w)

    def prefetch(self, u: int | None) -> None:
        """Starts gathering `u` ahead of its use, or defers it until a unit is freed."""
        if u is None or u in self.live or u in self.reduced:
            return
        if prefetch_waits(self.policy, len(self.live), self.holder(u) is not None):
            if u not in self.deferred:
                self.deferred.append(u)
            return
        self.start(u)

    def _free_kept(self, but: int | None = None) -> None:
        """Frees the groups kept gathered after their members' forwards, once another group's
        forward starts (`but`) or the forward is over: a group is gathered once per forward in
        whatever order its members run (Note [unit groups])."""
        if self.policy.reshard_after_forward and self.grouped:
            for u in [u for u in self.live if u in self.grouped and u != but and u in self.ran and not self.busy(u)]:
                if but is None and self.kept_for_backward(u):
                    continue
                self.free(u)
            if but is None:
                self._release_idle_slots()

    def _release_idle_slots(self) -> None:
        """After the last unit's forward (nothing else is gathered until the first unit's backward,
        while the loss takes its largest activations): gives back the slots no gathered unit holds."""
        if not (self.slot_of and self.order_known) or any(w in self.slot_of for w in self.works):
            return
        self.buffers.release_idle_slots(self.live)

    def _release_spent_slot(self, u: int) -> None:
        """In the backward, once the last unit of a slot is freed and its reduction (whose input may
        live in the slot) is done: gives the slot back, so that the growing gradient shards do not
        stack on it."""
        if self.phase != Phase.BACKWARD or u not in self.done_after or u in self.live:
            return
        if any(self.same_full(w, u) for w, _, _, _ in self.in_flight):
            return
        if any(v in self.live for v in self.slot_of if self.slot_of[v] == self.slot_of[u]):
            return
        self.note("release_slot", u)
        self.buffers.release_slot(u)

    # -- the step's events --------------------------------------------------------------------------
    def begin(self, accumulate: bool, reduce_now: bool) -> None:
        """A forward/backward starts: the root is gathered, the first unit prefetched."""
        self.reset()
        self.phase = Phase.FORWARD
        self.accumulate, self.reduce_now = accumulate, reduce_now
        self.pending = [self.trained.get(u, 0) for u in range(self.n)]
        self.start(ROOT)
        if self.n:
            self.prefetch(self.order[0])
        self.ensure(ROOT)

    def forward_starts(self, u: int) -> None:
        """`u`'s forward begins (in the forward): it is gathered when this returns."""
        self._free_kept(but=u)
        if u not in self.ran:
            self.ran.add(u)
            self.seen.append(u)
            if self.order_known and self.catches_up:
                self.catch_up(self.pos[u])
        self.ensure(u)
        self.running.add(u)
        self.busy_log.start(u)
        self.prefetch(self.next_of(u))

    def inputs_hooked(self, u: int) -> None:  # this use's inputs need a gradient: wait for its `use_over` too
        self.pending[u] += 1

    def forward_ends(self, u: int) -> None:
        """`u`'s forward returned."""
        self.running.discard(u)
        self.busy_log.end(u)
        if self.policy.reshard_after_forward and u not in self.grouped:
            if not self.kept_for_backward(u):
                self.free(u)
            if u == self.last_ran:
                self._release_idle_slots()

    def forward_over(self) -> bool:
        """`loss_fn` returned: the order is known from here; `backward()` comes next. False if the
        forward was over already."""
        if self.phase != Phase.FORWARD:
            return False
        if not self.order_known and self.seen:
            self.order = forward_order(self.seen, self.n)
            self.last_ran = self.seen[-1]
            self.pos = {u: i for i, u in enumerate(self.order)}
            self.done_after = last_of_slot(self.order, self.slot_of)
            self.order_known = True
        self._free_kept()
        self.deferred = []  # prefetches issued during the forward for units that never ran are dropped
        if self.catches_up:
            self.catch_up(len(self.order))
        return True

    def backward(self) -> None:
        self.phase = Phase.BACKWARD

    def catch_up(self, upto: int) -> None:
        """Gathers (and frees) the units before position `upto` in forward order that this rank did
        not gather in this forward (Note [units on every rank] in `_engine.py`)."""
        if not self.order_known:
            return
        for v in self.order[self.fwd_ptr : upto]:
            if v not in self.fwd_gathered:
                self.start(v)
                self.free(v)
        self.fwd_ptr = max(self.fwd_ptr, upto)

    def backward_starts(self, u: int) -> None:
        """A use of `u` begins its backward: it is gathered when this returns."""
        self.buffers.before_collective()
        if u in self.reduced:
            raise RuntimeError(f"unit {self.names[u]!r} got a gradient after its reduction; please report this with the model")
        if self.active.get(u, 0) == 0:
            self.busy_log.start(u)
        self.active[u] = self.active.get(u, 0) + 1
        self.ensure(u)
        prev = self.prev_of(u)
        self.prefetch(prev)
        if prev is None and self.slot_of and not any(w in self.slot_of for w in self.works):
            self.buffers.release_gathered(u)  # the last unit gather of the step is done
        # A reduction in flight whose input fills a slot that nothing needs afterwards: finish it
        # now, so that the slot is given back before this unit's backward allocates its gradients.
        while any(w in self.done_after for w, _, _, _ in self.in_flight):
            self.finish_oldest()

    def recompute_starts(self, u: int) -> None:
        """`u` runs again in the backward (a checkpoint's recompute; without `backward_starts` first
        under a reentrant one, which then prefetches too)."""
        self.ensure(u)
        if self.active.get(u, 0) == 0:
            self.prefetch(self.prev_of(u))

    def use_over(self, u: int) -> None:
        """A use of `u` is over in the backward (its inputs have their gradients)."""
        if self.active.get(u, 0) > 0:
            self.active[u] -= 1
            if self.active[u] == 0:
                self.busy_log.end(u)
        self.pending[u] -= 1
        if self.pending[u] == 0:
            self.reduce(u)
        elif self.policy.reshard_after_forward and not self.busy(u) and u in self.live and u not in self.grouped:
            self.free(u)  # another use comes later: gathered again then

    def grad_ready(self, u: int) -> None:
        """A trained parameter of `u` has its gradient for this backward."""
        if self.phase == Phase.IDLE:
            return
        if u in self.reduced and self.reduce_now:
            raise RuntimeError(f"unit {self.names[u]!r} got a gradient after its reduction; please report this with the model")
        self.pending[u] -= 1
        if self.pending[u] == 0:
            self.reduce(u)

    def reduce(self, u: int) -> None:
        """`u`'s gradients are complete: its reduction starts (at most `max_reductions` in flight)."""
        b = self.buffers
        b.before_collective()
        if u in self.reduced:
            return
        self.reduced.add(u)
        if self.active.pop(u, 0):
            self.busy_log.end(u)
        if self.trained.get(u, 0) and not self.reduce_now:
            b.keep_grads(u)
        if self.trained.get(u, 0) and self.reduce_now:
            self.note("reduce", u)
            while len(self.in_flight) >= self.max_reductions:  # their inputs are memory too: the oldest ends first
                self.finish_oldest()
            pair = min(set(range(self.max_reductions)) - {p for _, _, p, _ in self.in_flight})
            in_slot = b.reduces_in_slot(u, self.live)
            if in_slot:
                self._drain(u)
            try:
                self.in_flight.append((u, b.start_reduce(u, pair, in_slot, self.accumulate), pair, in_slot))
            except ReductionStarted as e:  # what started stays in flight until `abort` waits for it
                self.in_flight.append((u, e.pending, pair, in_slot))
                raise e.__cause__ from None
        if u != ROOT:
            self.free(u)
            self._release_spent_slot(u)

    def finish_oldest(self, timeout: float | None = None) -> None:
        """Waits for the oldest reduction in flight."""
        u, pending, pair, in_slot = self.in_flight[0]
        again = self.buffers.finish_reduce(u, pending, timeout)
        self.in_flight.pop(0)
        if again is not None:  # hybrid: the replicate-axis all-reduce is now in flight
            self.in_flight.append((u, again, pair, in_slot))
        else:
            self._release_spent_slot(u)

    def end(self) -> dict[int, list[tuple[int, int]]] | None:
        """The backward is over: reduces what did not finish (the root, units without gradients),
        waits, frees everything. Returns the busy spans if this step makes the slot plan, else None."""
        self.forward_over() and self.backward()
        self.buffers.before_collective()
        for u in list(self.live):  # nothing reads a full parameter now
            self.free(u)
        for u in reversed(self.order):
            if u not in self.reduced:
                self.reduce(u)
        self.reduce(ROOT)
        while self.in_flight:
            self.finish_oldest()
        self.free(ROOT)
        for u in list(self.live):
            self.free(u)
        self.buffers.release_all()
        busy = self.busy_log.spans if not self.planned and self.reduce_now else None
        self.reset()
        return busy

    def abort(self, timeout: float) -> None:
        """After a failed step: waits (at most `timeout` s each) for what is in flight; one that does
        not complete raises (TimeoutError, RuntimeError) and stays in place."""
        for u in list(self.works):
            self._finish_gather(u, timeout)
        while self.in_flight:
            self.finish_oldest(timeout)
