"""The train-step runtime: when each unit is gathered, freed and reduced.

Note [unit schedule]
--------------------
This follows the FSDP paper (Zhao et al., 2023), for units u_0 .. u_n in forward order and a root:

  step start     gather the root (it holds what runs outside every unit: embeddings, head), and start
                 gathering the first unit.
  pre-forward    wait for u_i's gather (start it if nobody did); start gathering u_{i+1} (prefetch).
  post-forward   `full_shard`: free u_i. Hook u_i's outputs so that the first gradient reaching them
                 runs pre-backward.
  pre-backward   wait for / start u_i's gather; start gathering u_{i-1} (prefetch, reverse order).
  grads ready    a post-accumulate-grad hook on each full parameter counts u_i's gradients; when the
                 last one lands, the previous unit's reduction is waited for, u_i's reduce-scatter
                 starts (async) and u_i is freed. Reductions overlap the backward of the next
                 units: two in flight under `full_shard` when their inputs live in the units' own
                 slots, every unit's under `no_shard` (in-place all-reduces, as DDP's buckets),
                 else one.
  backward end   units whose parameters got no gradient are reduced as zeros; all pending
                 reductions are waited for; everything still gathered is freed.

Under `full_shard` the units' buffers are two slot arenas, three when gathers land in place (Note
[slot arenas] in `_flat.py`); they are given back when the last unit's forward ends (the loss and its
gradient, the step's largest activations, come next), each again in the backward once the last of
its units is reduced, and all when the step ends.

Memory bound: at most two units besides the root are gathered (or being gathered) at any time under
`full_shard`: a prefetch that would make three waits until a unit is freed. `shard_grad_op` keeps
units from their forward to the end of their backward (no second gather); `no_shard` has no gathers.

Forward order is taken from the first step (the pre-forward calls as they happen); until then module
order is the guess. optree's leaf order is never used for it (dict keys sort: "10" < "2").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from ._flat import Arena, FlatUnit

__all__ = ["Engine", "EngineStats"]

ROOT = -1


@dataclass
class EngineStats:
    """What the runtime did in the last step; for tests and benchmarks."""

    events: list[tuple[str, int, str]] = field(default_factory=list)  # (what, unit, phase); ROOT is -1
    max_live_units: int = 0  # most non-root units gathered (or gathering) at once
    record_events: bool = False

    def reset(self) -> None:
        self.events.clear()
        self.max_live_units = 0


class Engine:
    """Runs one model's units through a train step (see Note [unit schedule]).

    Args:
        info: the functionalized model whose unit hooks report to this engine (None: root only).
        units: the non-root units, indexed as `info.unit_names`.
        root: the root unit.
        reshard_after_forward: free units after their forward (`full_shard`).
        max_live: the most non-root units gathered at once under `reshard_after_forward`.
        cast_dtype: floating-point inputs of the model and of each unit are cast to this dtype
            (mixed precision), or None.
        slot_of: unit -> slot, for units that share slot arenas (Note [slot arenas]), or None.
        reduce_arenas: `max_reductions` (rs_in, rs_out) arena pairs that reductions take in turn.
        arenas: every arena, released when a step ends.
    """

    def __init__(
        self,
        info,
        units: list[FlatUnit],
        root: FlatUnit,
        reshard_after_forward: bool,
        max_live: int = 2,
        cast_dtype: torch.dtype | None = None,
        slot_of: dict[int, int] | None = None,
        reduce_arenas: list[tuple[Arena, Arena]] | None = None,
        arenas: list[Arena] = (),
        max_reductions: int = 1,
    ):
        self.info = info
        self.units = units
        self.root = root
        self.reshard_after_forward = reshard_after_forward
        self.max_live = max_live
        self.cast_dtype = cast_dtype
        self.slot_of = slot_of or {}
        self.reduce_arenas = reduce_arenas
        self.max_reductions = max_reductions
        self.arenas = list(arenas)
        self._in_use: set[int] = set()  # running forward, or between pre-backward and reduction
        self._slot_arenas = list({id(a): a for v in self.slot_of for a in units[v].arenas.values()}.values())
        self.remat_units: set[int] = set()  # read by the remat wrappers (shardfn/_remat.py)
        self._reduce_now = True
        n = len(units)
        self.order: list[int] = list(range(n))  # forward order (guess until the first step)
        self._order_known = False
        self._seen: list[int] = []
        self._next = self._neighbours(+1)
        self._prev = self._neighbours(-1)
        self._slot_done_after = self._last_of_slot()
        self.stats = EngineStats()
        self._works: dict[int, Any] = {}  # unit -> pending all-gather work
        self._live: set[int] = set()  # non-root units allocated (gathered or gathering)
        self._deferred: list[int] = []
        self._remaining = [0] * n
        self._root_remaining = 0
        self._reduced: set[int] = set()
        self._in_flight: list[tuple[int, Any, int]] = []  # (unit index, pending, arena pair)
        self._accumulate = False
        self.phase = "idle"
        for u, unit in enumerate(units):
            self._hook_grads(unit, u)
        self._hook_grads(root, ROOT)

    # -- bookkeeping --------------------------------------------------------------------------
    def _neighbours(self, d: int) -> dict[int, int]:
        o = self.order
        return {o[i]: o[i + d] for i in range(len(o)) if 0 <= i + d < len(o)}

    def _last_of_slot(self) -> set[int]:
        """The units that are the last of their slot to run in the backward (first in forward order)."""
        first: dict[int, int] = {}
        for u in self.order:
            if u in self.slot_of:
                first.setdefault(self.slot_of[u], u)
        return set(first.values())

    def _unit(self, u: int) -> FlatUnit:
        return self.root if u == ROOT else self.units[u]

    def _event(self, what: str, u: int) -> None:
        if self.stats.record_events:
            self.stats.events.append((what, u, self.phase))

    def _hook_grads(self, unit: FlatUnit, u: int) -> None:
        def hook(_: torch.Tensor) -> None:
            self._grad_ready(u)

        for p in unit.proxies:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(hook)

    # -- gather / free ------------------------------------------------------------------------
    def _slot_holder(self, u: int) -> int | None:
        """The live unit other than `u` that holds `u`'s slot arena, if any."""
        slot = self.slot_of.get(u)
        if slot is None:
            return None
        for v in self._live:
            if v != u and self.slot_of.get(v) == slot:
                return v
        return None

    def _start(self, u: int) -> None:
        unit = self._unit(u)
        if u in self._works or (u != ROOT and u in self._live):
            return
        v = self._slot_holder(u)
        if v is not None:  # see Note [slot arenas]
            if v not in self._in_use:
                self._free(v)  # a prefetch that came too early (execution order != module order)
            elif self.phase == "backward":
                self._reduce(v)  # its remaining gradients never come (unused parameters)
            else:
                raise RuntimeError(
                    f"unit {self.units[u].name!r} runs while unit {self.units[v].name!r}, which shares its "
                    "buffers, is still running; give units that run inside one another distinct slots "
                    "(nest them as submodules) or use strategy='shard_grad_op'"
                )
        if u != ROOT and self.reshard_after_forward:
            # A unit runs that nobody prefetched (execution order != the order guessed): drop
            # prefetches nobody uses yet rather than exceed the bound.
            for w in [w for w in self._live if w not in self._in_use]:
                if len(self._live) < self.max_live:
                    break
                self._free(w)
        if u != ROOT and self.slot_of:  # one shared all-gather output: one unit gather in flight
            for w in [w for w in self._works if w != ROOT]:
                self._drain_slot(w)
                self._unit(w).finish_gather(self._works.pop(w))
        if u != ROOT:
            self._live.add(u)
            self.stats.max_live_units = max(self.stats.max_live_units, len(self._live))
        if unit.gathers_in_place:  # its gather writes the slot at once (Note [slot arenas])
            self._drain_slot(u)
        self._event("gather", u)
        self._works[u] = unit.start_gather()

    def _ensure(self, u: int) -> None:
        if u != ROOT and u not in self._live and u not in self._works:
            self._start(u)
        if u in self._works:
            self._drain_slot(u)
            self._unit(u).finish_gather(self._works.pop(u))

    def _drain_slot(self, u: int) -> None:
        """Finishes reductions whose input lives in the arena that `u`'s gather is about to fill."""
        full = self._unit(u).arenas["full"]
        while any(self._unit(w).reduce_in_full and self._unit(w).arenas["full"] is full for w, _, _ in self._in_flight):
            self._finish_oldest()

    def _free(self, u: int) -> None:
        if u in self._works:  # a prefetch nobody used: finish it before dropping the buffers
            self._drain_slot(u)
            self._unit(u).finish_gather(self._works.pop(u))
        if u == ROOT or u in self._live:
            self._event("free", u)
            self._unit(u).free()
            self._live.discard(u)
        deferred, self._deferred = self._deferred, []
        for w in deferred:
            self._prefetch(w)

    def _prefetch(self, u: int | None) -> None:
        if u is None or u in self._live or u in self._reduced:
            return
        if self.reshard_after_forward and (len(self._live) >= self.max_live or self._slot_holder(u) is not None):
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
        self.phase = "forward"
        self._accumulate = accumulate
        self._reduce_now = reduce
        self._seen = []
        self._remaining = [u.num_trained for u in self.units]
        self._root_remaining = self.root.num_trained
        self._reduced = set()
        self._start(ROOT)
        if self.units:
            self._prefetch(self.order[0])
        self._ensure(ROOT)

    def cast_inputs(self, info, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Mixed precision: floating-point inputs of the model's forward in the compute dtype."""
        if self.cast_dtype is None or info is not self.info:
            return args, kwargs
        return self._cast(args), self._cast(kwargs)

    def _cast(self, tree: Any) -> Any:
        dt = self.cast_dtype
        return optree.tree_map(lambda t: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)

    def pre_forward(self, info, u: int, args: tuple) -> tuple | None:
        if info is not self.info or self.phase == "idle":
            return None
        if self.phase == "forward" and u not in self._seen:
            self._seen.append(u)
        self._ensure(u)
        if self.phase == "forward":
            self._in_use.add(u)
        if self.phase == "forward":
            self._prefetch(self._next.get(u))
        return self._cast(args) if self.cast_dtype is not None else None

    def post_forward(self, info, u: int, output: Any) -> None:
        if info is not self.info or self.phase != "forward":
            return None
        tensors = [t for t in optree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda _g, u=u: self._pre_backward(u), mode="any")
        self._in_use.discard(u)
        if self.reshard_after_forward:
            self._free(u)
            if self.slot_of and self._order_known and u not in self._next and not self._live:
                # The last unit's forward is done: until the first unit backward, the slots hold
                # only freed parameters, while the loss and its gradient take their largest
                # activations. Give the memory back; the backward allocates the slots again.
                for a in self._slot_arenas:
                    a.release()
        return None

    def _pre_backward(self, u: int) -> None:
        if self.phase == "forward":
            self._end_forward()
        if u in self._reduced:
            return
        self._ensure(u)
        self._in_use.add(u)
        prev = self._prev.get(u)
        self._prefetch(prev)
        if prev is None and self.slot_of and not any(w != ROOT for w in self._works):
            self.units[u].arenas["gathered"].release()  # the last unit gather of the step is done
        # A reduction in flight whose input fills a slot that nothing needs afterwards: finish it
        # now, so that the slot is given back before this unit's backward allocates its gradients.
        # Near the end of the backward, where the sharded gradients pile up, this is the step's peak.
        while any(w in self._slot_done_after for w, _, _ in self._in_flight):
            self._finish_oldest()

    def _end_forward(self) -> None:
        self.phase = "backward"
        if not self._order_known and self._seen:
            rest = [u for u in range(len(self.units)) if u not in self._seen]
            self.order = self._seen + rest
            self._next, self._prev = self._neighbours(+1), self._neighbours(-1)
            self._slot_done_after = self._last_of_slot()
            self._order_known = True
        # Prefetches issued during the forward for units that never ran are dropped.
        self._deferred = []

    def _grad_ready(self, u: int) -> None:
        if self.phase == "idle":
            return
        if u == ROOT:
            self._root_remaining -= 1
            if self._root_remaining == 0:
                self._reduce(ROOT)
            return
        if u in self._reduced and self._reduce_now:
            raise RuntimeError(
                f"unit {self.units[u].name!r} got a gradient after its reduction: its buffers were needed by "
                "another unit first. Units must finish their backward before the unit two places "
                "earlier in module order begins its own."
            )
        self._remaining[u] -= 1
        if self._remaining[u] == 0:
            self._reduce(u)

    def _reduce(self, u: int) -> None:
        unit = self._unit(u)
        if u in self._reduced:
            return
        self._reduced.add(u)
        self._in_use.discard(u)
        if unit.num_trained and self._reduce_now:
            self._event("reduce", u)
            # At most `max_reductions` in flight (their full-size inputs are memory too): wait for
            # the oldest before this one takes a free arena pair.
            while len(self._in_flight) >= self.max_reductions:
                self._finish_oldest()
            busy = {pair for _, _, pair in self._in_flight}
            pair = min(set(range(self.max_reductions)) - busy)
            pending = unit.start_reduce(self._accumulate, *self.reduce_arenas[pair])
            self._in_flight.append((u, pending, pair))
        if u != ROOT:
            self._free(u)
            self._release_spent_slot(u)

    def _finish_oldest(self) -> None:
        u, pending, pair = self._in_flight.pop(0)
        again = self._unit(u).finish_reduce(pending)
        if again is not None:  # hybrid: the replicate-axis all-reduce is now in flight
            self._in_flight.append((u, again, pair))
        else:
            self._release_spent_slot(u)

    def _release_spent_slot(self, u: int) -> None:
        """In the backward, once the last unit of a slot is freed and its reduction (whose input may
        live in the slot) is done, nothing needs the slot until the next forward: give it back, so
        that the sharded gradients, which grow as the backward goes on, do not stack on it."""
        if self.phase != "backward" or u not in self._slot_done_after or u in self._live:
            return
        full = self.units[u].arenas["full"]
        if any(self._unit(w).arenas["full"] is full for w, _, _ in self._in_flight):
            return
        self._event("release_slot", u)
        for name in ("full", "stage"):
            self.units[u].arenas[name].release()

    def end(self) -> None:
        """Ends one forward/backward: reduces what got no gradient, waits, frees everything."""
        if self.phase == "forward":
            self._end_forward()
        for u in [*range(len(self.units)), ROOT]:
            if u not in self._reduced:
                self._reduce(u)
        while self._in_flight:
            self._finish_oldest()
        self._free(ROOT)
        for u in list(self._live):
            self._free(u)
        self._deferred = []
        self._in_use.clear()
        for a in self.arenas:
            a.release()
        self.phase = "idle"

    def abort(self) -> None:
        """Leaves the engine clean after an exception in the user's code: no gather survives."""
        for u, w in list(self._works.items()):
            self._unit(u).finish_gather(w)
        self._works.clear()
        while self._in_flight:
            self._finish_oldest()
        for unit in [*self.units, self.root]:
            unit.take_grads()
            unit.free()
        for a in self.arenas:
            a.release()
        self._live.clear()
        self._in_use.clear()
        self._deferred = []
        self.phase = "idle"
