"""The schedule's buffers on a rank: the FlatUnits' arenas, gathers, frees and reductions.

`UnitBuffers` is the engine's `Buffers` (Note [the schedule's moves] in `_schedule.py`): the
schedule decides what happens to each unit and when; this does it to the units' flat buffers, in
the arenas of the slot plan (Note [slot arenas] in `_flat.py`, Note [unit plan] in `_engine.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from ._flat import Arena, FlatUnit
from . import _schedule as schedule
from ._schedule import ROOT
from ._unit_check import UnitCheck

__all__ = ["UnitBuffers"]


class UnitBuffers:
    """The arenas and collectives of one engine's units.

    Args:
        units: the non-root units.
        root: the root unit.
        check: the cross-rank unit check, settled before every gather and reduction (None on one rank).
    """

    def __init__(self, units: list[FlatUnit], root: FlatUnit, check: UnitCheck | None):
        self.units = units
        self.root = root
        self.check = check
        self.arenas: list[Arena] = []  # every arena, for the step's end
        self.reduce_arenas: list[tuple[Arena, Arena]] = []  # (input, output) per reduction in flight
        self.slot_arenas: list[Arena] = []  # the arenas of the units that share slots

    def unit(self, u: int) -> FlatUnit:
        return self.root if u == ROOT else self.units[u]

    def bind(self, slot_of: dict[int, int], n_reductions: int) -> None:
        """Gives every unit its arenas: the shared slot `slot_of[u]`, or arenas of its own, and
        `n_reductions` pairs of reduction arenas."""
        units = {u: self.unit(u) for u in [*range(len(self.units)), ROOT]}
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
        complex_units = [("<root>" if u == ROOT else self.unit(u).name) for u, unit in units.items()
                         if unit.reduce_dtype.is_complex or unit.compute_dtype.is_complex]
        if complex_units:  # the gradient norm, the reductions and sf.optim take values as real
            raise NotImplementedError(
                f"units {complex_units[:3]} hold complex parameters, which train_step and value_and_grad do not support yet: hold "
                "each as real pairs in the module (a real parameter of shape (..., 2), viewed with "
                "torch.view_as_complex where it is used)"
            )
        if len(rdt) > 1:
            by = {str(d): [("<root>" if u == ROOT else self.unit(u).name) for u, unit in units.items() if unit.reduce_dtype == d][:3]
                  for d in rdt}
            raise NotImplementedError(
                f"units reduce their gradients in different dtypes ({by}); every unit of a model reduces in one dtype: "
                "give all the trained parameters one dtype (model.to(dtype)), or set it with "
                "mixed_precision=sf.MixedPrecision(reduce_dtype=...)"
            )
        rdt_one = rdt.pop()
        # Scratch for reduce-scatter inputs that are not built in a slot: allocated only when used.
        n_in = max(s["rs_in"] for s in sizes.values())
        n_out = max(s["rs_out"] for s in sizes.values())
        self.reduce_arenas = [(Arena(n_in, rdt_one, device, shared=True), Arena(n_out, rdt_one, device, shared=True)) for _ in range(n_reductions)]
        self.arenas = _unique([*(a for d in arenas.values() for a in d.values()), *(a for p in self.reduce_arenas for a in p)])
        self.slot_arenas = _unique([a for v in slot_of for a in self.units[v].arenas.values()])

    # -- Buffers (Note [the schedule's moves]) ------------------------------------------------------
    def before_collective(self) -> None:
        if self.check is not None:
            self.check.settle()

    def start_gather(self, u: int) -> Any:
        return self.unit(u).start_gather()

    def finish_gather(self, u: int, work: Any, timeout: float | None = None) -> None:
        self.unit(u).finish_gather(work, timeout=timeout)

    def free(self, u: int) -> None:
        self.unit(u).free()

    def gathers_in_place(self, u: int) -> bool:
        return self.unit(u).gathers_in_place

    def reduces_in_slot(self, u: int, live: set[int]) -> bool:
        unit = self.unit(u)
        owner = unit.arenas["full"].owner  # whose data the arena holds: it must not be gathered now
        held = owner is self.root or any(self.units[v] is owner for v in live)
        return unit.reduce_in_full and (owner is None or owner is unit or not held)

    def start_reduce(self, u: int, pair: int, in_slot: bool, accumulate: bool) -> Any:
        return self.unit(u).start_reduce(accumulate, *self.reduce_arenas[pair], in_full=in_slot)

    def finish_reduce(self, u: int, pending: Any, timeout: float | None = None) -> Any | None:
        return self.unit(u).finish_reduce(pending, timeout=timeout)

    def keep_grads(self, u: int) -> None:
        self.unit(u).stash_grads()

    def release_idle_slots(self, live: set[int]) -> None:
        held = {id(a) for v in live for name, a in self.units[v].arenas.items() if name != "gathered"}
        for a in self.slot_arenas:
            if id(a) not in held:
                a.release()

    def release_slot(self, u: int) -> None:
        for name in ("full", "stage"):
            self.units[u].arenas[name].release()

    def release_gathered(self, u: int) -> None:
        self.unit(u).arenas["gathered"].release()

    def release_all(self) -> None:
        for a in self.arenas:
            a.release()
        if self.root.offload:  # Note [offloaded shards on the host]
            torch.cuda.current_stream(self.root.device).synchronize()


# Note [offloaded shards on the host]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With `offload="cpu"` a unit's shard lives in pinned host memory and each gather starts with an
# asynchronous host-to-device copy of it (`FlatUnit.start_gather`); after the step the optimizer
# writes the same host memory, on the CPU. A copy still in flight then would send the device half
# updated values, without a word. The backward's blocking device-to-host copies of the reduced
# gradients order every earlier copy in practice, but the step does not rest on that: when the
# backward is over, the compute stream is synchronized once before the optimizer runs (the
# reductions were waited already, so it waits for what little is left).


def _unique(items: list) -> list:
    out, seen = [], set()
    for x in items:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out
