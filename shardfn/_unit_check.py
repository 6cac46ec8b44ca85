"""The check that every rank ran the same units in a step (Note [units on every rank] in `_engine.py`)."""

from __future__ import annotations

from typing import Any

import torch

from . import _collectives as C
from ._param import OffSchedule

__all__ = ["UnitCheck"]


class UnitCheck:
    """One small all-gather per forward of which of the model's units ran on each rank, started
    when the forward ends and acted on at the engine's next collective (`settle`).

    Args:
        group: a process group over every rank of the mesh.
        names: the model's units' names.
        has_units: whether the engine has units besides the root (without, only leaving is checked).
        device: where the exchange's tensors live.
    """

    def __init__(self, group: Any, names: list[str], has_units: bool, device: torch.device):
        self.group = group
        self.world = torch.distributed.get_world_size(group)
        self.names = names
        self.has_units = has_units
        self.device = device
        self._pending: tuple | None = None  # (work, everyone, mine, leaving) until acted on

    def start(self, ran: set[int], leaving: bool = False) -> None:
        """Starts the exchange that stops every rank, before any gradient is reduced, if the ranks
        ran different units (`ran`: the model's units this rank ran), and takes every rank off the
        unit schedule if one is `leaving` it (a row of 2s). Leaving, it is waited for at once."""
        n = max(len(self.names), 1)
        mine = torch.zeros(n, dtype=torch.int32, device=self.device)
        if leaving:
            mine.fill_(2)
        elif ran:
            mine[list(ran)] = 1
        everyone = mine.repeat(self.world)  # (a fake process group, `sf.simulate`, writes nothing here)
        work = C.all_gather(everyone, mine, self.group, async_op=True)
        self._pending = (work, everyone, mine, leaving)
        if leaving:
            self.settle()

    def settle(self, timeout: float | None = None) -> None:
        """Waits for the exchange, if one is pending, and acts on it: raises if a rank left the
        schedule or the ranks ran different units."""
        if self._pending is None:
            return
        work, everyone, mine, leaving = self._pending
        if work is not None:
            C.wait(work, timeout)
        self._pending = None
        n = mine.numel()
        table = everyone.view(self.world, n)
        left = (table == 2).all(dim=1).nonzero().flatten().tolist()
        if leaving:
            return
        if left:
            e = OffSchedule(f"rank(s) {left} left the unit schedule on this step (a backward inside loss_fn)")
            e.agreed = True  # every rank saw it in this exchange
            raise e
        if not self.has_units:
            return
        differ = (table != table[0]).any(dim=0).nonzero().flatten().tolist()
        if differ:
            lines = "; ".join(f"{self.names[u]!r} ran on ranks {table[:, u].nonzero().flatten().tolist()} only" for u in differ[:4])
            raise NotImplementedError(
                f"the ranks ran different units in this step ({lines}). Every rank must run every unit in a "
                "step, as with FSDP: send zero tokens through an idle expert rather than skipping it, and run "
                "skipped blocks on a zero-size batch (Note [units on every rank]). Nothing was reduced or applied."
            )

    def abandon(self, timeout: float) -> None:
        """After a failed step: waits for the exchange in flight (what it says no longer matters)."""
        if self._pending is not None:
            work, self._pending = self._pending[0], None
            C.wait(work, timeout)
