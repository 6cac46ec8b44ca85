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


# gloo implements reduce-scatter as an all-reduce of a clone of the input, then a copy of this
# rank's chunk. When the input is scratch, shardfn runs that all-reduce in place instead: the same
# algorithm and bytes, without a full-size clone alive for the whole collective.
GLOO_REDUCE_SCATTER_IN_PLACE = True
_BACKENDS: dict = {}


def _backend(group) -> str:
    key = id(group)
    if key not in _BACKENDS:
        _BACKENDS[key] = str(dist.get_backend(group))
    return _BACKENDS[key]


class _ChunkOfAllReduce:
    """The work of a reduce-scatter run as an in-place all-reduce: `wait()` also copies the chunk."""

    def __init__(self, work, out: torch.Tensor, chunk: torch.Tensor):
        self.work, self.out, self.chunk = work, out, chunk

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            with torch.no_grad():
                self.out.copy_(self.chunk)
            self.work = None
        return True


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True, scratch: bool = False):
    """`out` (n) <- the sum over ranks of this rank's chunk of `inp` (W * n).

    With `scratch`, the caller gives up `inp` (it may be overwritten); on gloo the reduction then
    runs in place (see GLOO_REDUCE_SCATTER_IN_PLACE). Bytes are counted as a reduce-scatter either way.
    """
    world = dist.get_world_size(group)
    STATS.add("reduce_scatter", _ring_bytes(inp, world))
    if scratch and GLOO_REDUCE_SCATTER_IN_PLACE and _backend(group) == "gloo":
        work = dist.all_reduce(inp, op=dist.ReduceOp.SUM, group=group, async_op=True)
        pending = _ChunkOfAllReduce(work, out, inp.view(world, -1)[dist.get_rank(group)])
        if not async_op:
            pending.wait()
        return pending
    return dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce(t: torch.Tensor, group, async_op: bool = False):
    """`t` <- the sum of `t` over ranks, in place."""
    STATS.add("all_reduce", 2 * _ring_bytes(t, dist.get_world_size(group)))
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
