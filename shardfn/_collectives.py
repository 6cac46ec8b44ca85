"""The collectives shardfn issues, in one place: all-gather, reduce-scatter, all-reduce.

Each call goes through `torch.distributed` by attribute lookup at call time (so tests can count
them by patching `torch.distributed`), and adds to `STATS`, the bytes each rank sends, which the
benchmarks read. On CUDA (NCCL) an async collective runs on the process group's stream and
`Work.wait()` makes the current stream wait for it, without a host sync; on gloo it runs on gloo's
own threads and `wait()` blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["STATS", "all_gather", "reduce_scatter", "all_reduce"]


@dataclass
class CommStats:
    """Counts and bytes sent per rank, by collective, since the last `reset()`."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes_sent: dict[str, int] = field(default_factory=dict)

    def add(self, op: str, nbytes: int) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        self.bytes_sent[op] = self.bytes_sent.get(op, 0) + nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes_sent.clear()


STATS = CommStats()


def _ring_bytes(t: torch.Tensor, world: int) -> int:
    # What a ring algorithm sends per rank: (W - 1) / W of the full buffer.
    return t.numel() * t.element_size() * (world - 1) // world


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True):
    """`out` (W * n) <- every rank's `inp` (n), rank-major."""
    STATS.add("all_gather", _ring_bytes(out, dist.get_world_size(group)))
    return dist.all_gather_single(out, inp, group=group, async_op=async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True):
    """`out` (n) <- the sum over ranks of this rank's chunk of `inp` (W * n)."""
    STATS.add("reduce_scatter", _ring_bytes(inp, dist.get_world_size(group)))
    return dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce(t: torch.Tensor, group, async_op: bool = False):
    """`t` <- the sum of `t` over ranks, in place."""
    STATS.add("all_reduce", 2 * _ring_bytes(t, dist.get_world_size(group)))
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
