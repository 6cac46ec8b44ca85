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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Mapping, Sequence

import torch
from torch.utils import _pytree as pytree

__all__ = ["ArenaPlan", "arena_plan", "cast_floating", "evictions", "forward_order", "keeps_for_backward", "last_of_slot",
           "plan_slots", "prefetch_waits", "reductions_in_flight", "slot_holder"]

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
