"""The collectives shardfn issues, in one place: all-gather, reduce-scatter, all-reduce.

Each call goes through `torch.distributed` by attribute lookup at call time (so tests can count
them by patching `torch.distributed`), and adds to `STATS`, the bytes each rank sends, which the
benchmarks read. On CUDA (NCCL) an async collective runs on the process group's stream and
`Work.wait()` makes the current stream wait for it, without a host sync; on gloo it runs on gloo's
own threads and `wait()` blocks. On gloo with CPU tensors the all-gather and the reduce-scatter run
as point-to-point exchanges: see Note [gloo collectives].
"""

from __future__ import annotations

import contextlib
import math
import pickle
import threading
import datetime
from concurrent.futures import Future, ThreadPoolExecutor
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from . import _debug, _watch

__all__ = ["STATS", "all_gather", "all_gather_pieces", "reduce_scatter", "all_reduce", "broadcast", "gloo_collectives", "point_to_point",
           "full_tensor", "full_tensors"]


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


@torch.library.custom_op("shardfn::count", mutates_args=())
def _count_op(x: torch.Tensor, op: str, nbytes: int) -> None:
    STATS.add(op, nbytes)


@_count_op.register_fake
def _(x: torch.Tensor, op: str, nbytes: int) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.shardfn.count.default)  # kept in the graph though it returns nothing


def local_of(x: torch.Tensor) -> torch.Tensor:
    """`x`'s local tensor if it is a DTensor, else `x` (the tensor argument of a counting op)."""
    return x._local_tensor if isinstance(x, DTensor) else x


def count(op: str, nbytes: int, x: torch.Tensor) -> None:
    """`STATS.add(op, nbytes)` for a collective of `x`. Traced into a compiled unit it is an op of the
    graph that counts on every run: dynamo would bake a Python counter's value into the graph's
    guards (a recompile per step). The op takes `x` (its local tensor) so that a graph records it
    wherever it is traced: an op without a tensor argument runs at trace time only."""
    if torch.compiler.is_compiling():
        torch.ops.shardfn.count(local_of(x), op, nbytes)
    else:
        STATS.add(op, nbytes)


def _ring_bytes(t: torch.Tensor, world: int) -> int:
    # What a ring algorithm sends per rank: (W - 1) / W of the full buffer.
    return t.numel() * t.element_size() * (world - 1) // world


# Note [gloo collectives]
# ~~~~~~~~~~~~~~~~~~~~~~~
# gloo's all-gather (`all_gather_single`) receives into a temporary as large as the whole output
# and then copies it out; its reduce-scatter (`reduce_scatter_single`) all-reduces a clone of the
# whole input and copies this rank's chunk. Both allocate a full-size buffer per call, alive for
# the whole collective, and the all-reduce sends twice the bytes a reduce-scatter needs. For the
# flat unit buffers (Note [flat unit layout]) that is a second unit's worth of memory at the
# moment of the step's peak, and page faults and copies that compete with compute for the cores.
#
# The same exchanges as point-to-point messages need none of it. All-gather: each rank sends its
# contiguous shard to every peer (`isend`) and receives each peer's shard straight into that
# peer's chunk of the output (`irecv`); its own chunk is a local copy. Reduce-scatter: each rank
# sends chunk p of its input to rank p and receives every peer's chunk of *its* index; the first
# arrives in the output itself, the others (W > 2) in shard-sized scratch, and `wait()` adds them
# and the rank's own chunk. Each rank sends (W - 1) shards either way, exactly a ring's bytes.
# `benchmarks/collectives.py` times both against gloo's own (figures in `benchmarks/README.md`).
#
# The messages are posted from one background thread, in call order. Posted from the training
# thread, each `isend` writes into the socket there, as far as the socket takes, and each `irecv`
# waits for the connection's lock while gloo's own thread copies another message: host time taken
# from the step's compute. The training thread now only takes the tags, copies its own chunk and
# hands the rest over, and posting overlaps its compute.
#
# Each call takes fresh tags from a counter per process group, which every rank advances in the
# same order, so that calls in flight at once never take each other's messages. As for any
# collective, all ranks must issue the calls in the same order; if they do not and the sizes
# differ, gloo stops the process ("Received data size doesn't match expected size"), where its own
# all-gather returns garbage without a word.
#
# Limits: CPU tensors only (gloo's point-to-point is host memory); the reduce-scatter's scratch is
# W - 2 shards, so for W > 3 a reduce-scatter whose caller gives up the input (`scratch=True`)
# runs as an in-place all-reduce instead, gloo's own algorithm without its clone. NCCL keeps its
# native collectives, which write into the output directly.
GLOO_COLLECTIVES = "p2p"
"""How flat-buffer collectives run on gloo with CPU tensors: "p2p" (Note [gloo collectives]),
"in_place" (native all-gather; a scratch reduce-scatter as an in-place all-reduce) or "native"
(torch.distributed's own collectives, the path NCCL takes)."""

_MODES = ("p2p", "in_place", "native")
_TAG_BASE, _TAG_SPAN = 1 << 24, 1 << 29  # clear of small user tags; wraps well inside 32 bits
_EPOCH = 1 << 22  # tags skipped after a failed step (`new_epoch`)
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> _info


@contextlib.contextmanager
def gloo_collectives(mode: str) -> Iterator[None]:
    """Runs the block with `GLOO_COLLECTIVES = mode` (tests and benchmarks compare the modes)."""
    global GLOO_COLLECTIVES
    if mode not in _MODES:
        raise ValueError(f"gloo collectives mode must be one of {_MODES}, got {mode!r}")
    old, GLOO_COLLECTIVES = GLOO_COLLECTIVES, mode
    try:
        yield
    finally:
        GLOO_COLLECTIVES = old


def _info(group) -> list:
    """[backend, rank, world, next tag] of a process group (None: the default group)."""
    key = dist.group.WORLD if group is None else group
    info = _GROUPS.get(key)
    if info is None:
        info = _GROUPS[key] = [str(dist.get_backend(group)), dist.get_rank(group), dist.get_world_size(group), 0]
    return info


def point_to_point(group, device) -> bool:
    """Whether all-gathers and reduce-scatters over `group` of tensors on `device` run point to
    point now (Note [gloo collectives])."""
    return GLOO_COLLECTIVES == "p2p" and torch.device(device).type == "cpu" and _info(group)[0] == "gloo"


def _p2p(group, t: torch.Tensor) -> list | None:
    """The group's info if a collective of `t` runs point to point, else None."""
    return _info(group) if point_to_point(group, t.device) else None


def new_epoch() -> None:
    """Moves every group's point-to-point tags far ahead, after a failed step on this rank: ranks
    that failed at the same point move together and stay matched, while a message of a rank that
    went on (or failed elsewhere) can no longer be taken for one of this rank's next collectives."""
    for info in _GROUPS.values():
        info[3] = (info[3] + _EPOCH) % _TAG_SPAN


def _next_tag(info: list) -> int:
    tag = _TAG_BASE + info[3]
    info[3] = (info[3] + 1) % _TAG_SPAN
    return tag


class _Exchange:
    """The pending messages of one point-to-point collective; `wait()` also runs its epilogue.

    `works`: the started works, or the poster thread's future of them.
    """

    def __init__(self, works: list | Future, epilogue=None):
        self.works, self.epilogue = works, epilogue

    def completed(self) -> bool:
        """Whether every message has landed (without waiting; the epilogue may not have run)."""
        works = self.works  # once: `wait` may set it to None meanwhile
        if works is None:
            return True
        if isinstance(works, Future):
            if not works.done() or works.exception() is not None:
                return works.done()
            works = works.result()
        return all(w.is_completed() for w in works)

    def wait(self, timeout: float | None = None) -> bool:
        if self.works is not None:
            works = self.works.result(timeout) if isinstance(self.works, Future) else self.works
            for w in works:
                wait(w, timeout)  # marks the wait itself (_watch.waiting)
            self.works = None
            if self.epilogue is not None:
                with torch.no_grad():
                    self.epilogue()
                self.epilogue = None
        return True


def wait(work, timeout: float | None = None) -> None:
    """Waits for a pending collective, for at most `timeout` seconds (None: the group's own
    timeout); raises `TimeoutError` when it is not done by then."""
    if isinstance(work, _Exchange):
        work.wait(timeout)
    elif timeout is None:
        with _watch.waiting():
            work.wait()
    else:
        try:
            work.wait(datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            raise TimeoutError(f"a collective was not done within {timeout:.0f} s: {e}") from e
    _debug.waited(work)  # a no-op unless debug mode remembered collectives


POST_FROM_THREAD = True
"""Post point-to-point messages from one background thread (see Note [gloo collectives])."""
_POSTER: list[ThreadPoolExecutor] = []


# Note [point-to-point on NCCL]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# gloo takes each `isend` and `irecv` on its own: a message waits in the connection until its
# peer posts the other end, whatever else either rank posted meanwhile. NCCL does not. Each send
# or receive posted alone is a kernel on the group's stream that blocks the GPU until its peer's
# matching kernel runs, so two ranks that swap (cp = 2, a 2-rank `sf.ppermute`) each queue a
# receive that waits for a send queued behind the peer's own receive: the GPUs wait on each other
# for good. A ring of three or more also stalls on the host, each rank making the two-rank
# communicator with its predecessor while that one makes its own. NCCL wants the sends and
# receives of one exchange inside one group (`ncclGroupStart/End`), which
# `dist.batch_isend_irecv` issues. So on any backend but gloo an exchange is posted as one batch,
# from the calling thread (a CUDA tensor's messages then wait for the kernels the caller's stream
# queued before them, as a collective does); on gloo, from the poster thread as above.
def _posts_as_batch(group) -> bool:
    """Whether an exchange over `group` is posted as one batch (Note [point-to-point on NCCL])."""
    return _info(group)[0] != "gloo"


def _exchange(group, sends: list, recvs: list, epilogue=None) -> _Exchange:
    """Posts `recvs` [(tensor, src, tag)], then `sends` [(tensor, dst, tag)] (group ranks; empty
    tensors skipped, the same on every rank), from the poster thread on gloo and as one batch
    elsewhere (Note [point-to-point on NCCL]); returns the pending exchange."""

    def post() -> list:
        if _debug.ON:
            _debug.check_posted([t for t, _, _ in recvs + sends], "point-to-point message")
        works = [dist.irecv(t, group=group, group_src=src, tag=tag) for t, src, tag in recvs if t.numel()]
        works += [dist.isend(t, group=group, group_dst=dst, tag=tag) for t, dst, tag in sends if t.numel()]
        return works

    if _posts_as_batch(group):
        if _debug.ON:
            _debug.check_posted([t for t, _, _ in recvs + sends], "point-to-point message")
        ops = [dist.P2POp(dist.irecv, t, group=group, tag=tag, group_peer=src) for t, src, tag in recvs if t.numel()]
        ops += [dist.P2POp(dist.isend, t, group=group, tag=tag, group_peer=dst) for t, dst, tag in sends if t.numel()]
        pending = _Exchange(dist.batch_isend_irecv(ops) if ops else [], epilogue)
    elif not POST_FROM_THREAD:
        pending = _Exchange(post(), epilogue)
    else:
        if not _POSTER:
            _POSTER.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardfn-p2p"))
        pending = _Exchange(_POSTER[0].submit(post), epilogue)
    if _debug.ON:  # the list is built only in debug mode: this is on every gather's and reduction's path
        _debug.in_flight(pending.completed, [t for t, _, _ in recvs + sends], "point-to-point exchange", pending)
    return pending


def _remembered(work, tensors: list[torch.Tensor], what: str):
    """`work`, remembered in debug mode with the memory it reads and writes until it is complete."""
    if work is not None and _debug.ON:
        _debug.in_flight(work.is_completed, tensors, what, work)
    return work


def _done(pending, async_op: bool):
    if not async_op:
        wait(pending)
        return None
    return pending


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True):
    """`out` (W * n) <- every rank's `inp` (n), rank-major. `inp` must stay untouched until done."""
    if _p2p(group, out) is None:
        STATS.add("all_gather", _ring_bytes(out, dist.get_world_size(group)))
        return _remembered(dist.all_gather_single(out, inp, group=group, async_op=async_op), [out, inp], "all-gather")
    return _done(all_gather_pieces([(out, inp)], group), async_op)


def all_gather_pieces(pieces: list[tuple[torch.Tensor, torch.Tensor]], group):
    """For each `(out, inp)`: `out` (W * n) <- every rank's `inp` (n), as ONE collective (async).

    Point to point, the pieces' messages go out together and share the returned work; each `out`
    may be anywhere, so a unit's large leaves are received straight into their full parameters
    (FlatUnit's `direct_gather`). Otherwise each piece is an all-gather of its own.
    """
    world = dist.get_world_size(group)
    STATS.add("all_gather", sum(_ring_bytes(out, world) for out, _ in pieces))
    info = _p2p(group, pieces[0][0]) if pieces else None
    if info is None:
        return _Exchange([_remembered(dist.all_gather_single(out, inp, group=group, async_op=True), [out, inp], "all-gather")
                          for out, inp in pieces])
    _, rank, world, _ = info
    tags = [_next_tag(info) for _ in pieces]
    peers = [((rank + k) % world, (rank - k) % world) for k in range(1, world)]  # staggered
    sends = [(inp, dst, tag) for dst, _ in peers for (_, inp), tag in zip(pieces, tags)]
    recvs = [(out.view(world, -1)[src], src, tag) for _, src in peers for (out, _), tag in zip(pieces, tags)]
    pending = _exchange(group, sends, recvs)
    with torch.no_grad():
        for out, inp in pieces:
            own = out.view(world, -1)[rank]
            if own.data_ptr() != inp.data_ptr():
                own.copy_(inp)
    return pending


# gloo implements reduce-scatter as an all-reduce of a clone of the input, then a copy of this
# rank's chunk; in "in_place" mode (or "p2p" with W > 3) a caller's scratch input is all-reduced
# in place instead: the same algorithm and bytes, without the clone.
def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True, scratch: bool = False):
    """`out` (n) <- the sum over ranks of this rank's chunk of `inp` (W * n).

    With `scratch`, the caller gives up `inp` (it may be overwritten). Bytes are counted as a
    reduce-scatter whatever runs underneath (Note [gloo collectives]).
    """
    world = dist.get_world_size(group)
    STATS.add("reduce_scatter", _ring_bytes(inp, world))
    info = _p2p(group, inp)
    if info is not None and (world <= 3 or not scratch):
        return _done(_reduce_scatter_p2p(out, inp, group, info), async_op)
    if scratch and GLOO_COLLECTIVES != "native" and inp.device.type == "cpu" and _info(group)[0] == "gloo":
        rank = _info(group)[1]
        work = _remembered(dist.all_reduce(inp, op=dist.ReduceOp.SUM, group=group, async_op=True), [inp], "reduce-scatter")
        return _done(_Exchange([work], lambda: out.copy_(inp.view(world, -1)[rank])), async_op)
    return _remembered(dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op), [out, inp],
                       "reduce-scatter")


def _reduce_scatter_p2p(out: torch.Tensor, inp: torch.Tensor, group, info: list) -> _Exchange:
    _, rank, world, _ = info
    tag, chunks = _next_tag(info), inp.view(world, -1)
    if not out.numel():
        return _Exchange([])
    bufs = [out] + [torch.empty_like(out) for _ in range(world - 2)]
    peers = [((rank + k) % world, (rank - k) % world) for k in range(1, world)]
    sends = [(chunks[dst], dst, tag) for dst, _ in peers]
    recvs = [(b, src, tag) for b, (_, src) in zip(bufs, peers)]
    own = chunks[rank]

    def epilogue():
        if world == 1:  # no peer wrote into `out`
            out.copy_(own)
            return
        out.add_(own)
        for b in bufs[1:]:
            out.add_(b)

    return _exchange(group, sends, recvs, epilogue)


def all_reduce(t: torch.Tensor, group, async_op: bool = False):
    """`t` <- the sum of `t` over ranks, in place."""
    STATS.add("all_reduce", 2 * _ring_bytes(t, dist.get_world_size(group)))
    if async_op:
        return _remembered(dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True), [t], "all-reduce")
    with _watch.waiting():
        return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


def broadcast(t: torch.Tensor, src: int, group) -> None:
    """`t` <- `t` of global rank `src`, in place (point to point on gloo with CPU tensors: Note
    [a broadcast's buffer])."""
    STATS.add("broadcast", t.numel() * t.element_size())
    info = _p2p(group, t)
    if info is None or not t.is_contiguous():
        with _watch.waiting():
            dist.broadcast(t, src=src, group=group)
        return
    root = src if group is None else dist.get_group_rank(group, src)
    tag = _next_tag(info)
    me, world = info[1], info[2]
    sends = [(t, peer, tag) for peer in range(world) if peer != me] if me == root else []
    recvs = [(t, root, tag)] if me != root else []
    if sends or recvs:
        with _watch.waiting():
            wait(_exchange(group, sends, recvs))


# Note [a broadcast's buffer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# gloo runs its own collectives on a worker thread, which drops its reference to the tensors
# after it has marked the collective done: `dist.broadcast` may return while that thread still
# holds the buffer, and a rank whose worker is descheduled keeps it alive into what follows. The
# broadcasts that make the ranks agree on the model at `step.init` (Note [one model] in
# `_agree.py`) receive into a buffer as large as the model; kept so, it stood on top of the first
# step's peak on one run in about forty (a measured peak 1.66 MB above the estimate, in a test
# that compares them). On gloo with CPU tensors a broadcast is therefore sent point to point, like
# the flat-buffer collectives (Note [gloo collectives]): the root sends to every peer (W - 1 times
# the bytes, as gloo's own broadcast does), and the messages' works, held by this thread alone,
# are gone when `broadcast` returns.


# Note [every collective here]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Besides the flat-buffer collectives above (the train step's, whose caller holds the watch), the
# collectives shardfn issues anywhere else go through the functions below: the global norm's and
# per-sample all-reduces, the objects that checkpoints, exports, meta init and `sf.launch` agree
# on, DTensor's own gathers (`full_tensor`, `redistribute`) and a region around
# `torch.distributed.checkpoint`'s save and load, whose collectives DCP issues itself. Each adds to
# `STATS` and runs under the watch (`_watch.watched(what)`, and `waiting()` while it blocks), so a
# peer that failed, died, returned or stalled is named for any of them as for a stalled gather.
# `what` names the shardfn call for the error; inside an outer watched call the outer name wins.
# A test fails if another module issues a `torch.distributed` collective directly (only process
# group set-up stays outside). Collectives a user issues through `torch.distributed` are not
# watched.

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@contextlib.contextmanager
def watching(what: str, group: Any = None) -> Iterator[None]:
    """Runs a block that waits on collectives under the watch, as shardfn call `what` (for
    collectives of this module issued where no watched call encloses them, as in a backward).
    `group`: the process group the block waits on, when it is one (a stall is looked for among its
    ranks); None: any rank may be the one waited on."""
    # The heartbeat describes the main thread; a save in the background only has its errors named.
    if threading.current_thread() is not threading.main_thread():
        with _watch.watched(what, mark=False):
            yield
        return
    with _watch.watched(what), _watch.waiting(group):
        yield


def _world(group) -> int:
    return dist.get_world_size(group)


def all_reduce_blocking(t: torch.Tensor, group, what: str, op: str = "sum") -> torch.Tensor:
    """`t` <- the `op` ("sum", "max" or "min") of `t` over the ranks of `group`, in place; blocks, under
    the watch as shardfn call `what`. Returns `t`."""
    STATS.add("all_reduce", 2 * _ring_bytes(t, _world(group)))
    with watching(what, group):
        dist.all_reduce(t, op=_OPS[op], group=group)
    return t


class _Count:
    n = 0

    def write(self, b) -> None:
        self.n += len(b)


def _pickled(obj) -> int:
    """The size of `obj` pickled, counted as it is written (nothing is kept)."""
    sink = _Count()
    pickle.Pickler(sink, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return sink.n


def all_gather_object(obj, what: str, group=None) -> list:
    """Every rank's `obj` (picklable), rank by rank, on every rank of `group` (None: all ranks).
    Counted as the pickled object sent to each peer."""
    world = _world(group)
    if world == 1:
        return [obj]
    STATS.add("all_gather_object", _pickled(obj) * (world - 1))
    if _simulated(group):  # Note [simulated rank] in `_simulate.py`: every rank as this one
        return [obj] * world
    out: list = [None] * world
    with watching(what, group):
        dist.all_gather_object(out, obj, group=group)
    return out


def _simulated(group) -> bool:
    """Whether `group` is `sf.simulate`'s fake process group, whose collectives move nothing (an
    object exchanged there would come back as uninitialized bytes)."""
    return dist.get_backend(group) == "fake"


def broadcast_object(obj, what: str, src: int = 0, group=None):
    """Global rank `src`'s `obj` (picklable), on every rank of `group` (None: all ranks); other
    ranks' `obj` is ignored. Counted on `src`, as the pickled object sent to each peer."""
    world = _world(group)
    if world == 1:
        return obj
    if dist.get_rank() == src:
        STATS.add("broadcast_object", _pickled(obj) * (world - 1))
    if _simulated(group):  # Note [simulated rank] in `_simulate.py`: this rank's object stands for src's
        return obj
    box = [obj]
    with watching(what, group):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(what: str, group=None) -> None:
    """Waits until every rank of `group` (None: all ranks) reached it."""
    STATS.add("barrier", 0)
    with watching(what, group):
        dist.barrier(group=group)


def _shards(placements, mesh) -> int:
    """Into how many pieces `placements` cut a tensor over `mesh`."""
    n = 1
    for dim, p in enumerate(placements):
        if p.is_shard() or isinstance(p, _StridedShard):  # is_shard() is False for it
            n *= mesh.size(dim)
    return n


def full_tensor(x, what: str) -> torch.Tensor:
    """The full value of DTensor `x` on every rank of its mesh (DTensor's own gathers). Counted as
    one all-gather of its shards: (S - 1) / S of the full tensor's bytes for S shards. A leaf of a
    mesh of several dims that `full_tensors` packs, outside autograd, goes that way (one gather per
    splitting mesh dim, where DTensor gathers over each mesh dim, those of one rank too)."""
    if x.device_mesh.ndim > 1 and _packable(x) and not (torch.is_grad_enabled() and x.requires_grad):
        return full_tensors([x], what)[0]
    shards = _shards(x.placements, x.device_mesh)
    STATS.add("all_gather", x.numel() * x.element_size() * (shards - 1) // shards)
    with watching(what):
        return x.full_tensor()


GATHER_BUCKET_BYTES = 64 << 20
"""The most full-tensor bytes `full_tensors` gathers in one collective."""


def _packable(x) -> bool:
    """Whether DTensor `x` is split only by plain `Shard`s, each tensor dim over one mesh dim of
    several ranks at most (a mesh dim of one rank splits nothing: `(Shard(0), Shard(0))` on a (dp=1,
    tp) mesh is one split), one of them at least: then its full value is one gather per splitting
    mesh dim."""
    dims = [p.dim for i, p in enumerate(x.placements) if type(p) is Shard and x.device_mesh.size(i) > 1]
    return bool(dims) and len(dims) == len(set(dims)) and all(type(p) in (Shard, Replicate) for p in x.placements)


def full_tensors(xs: list, what: str) -> list[torch.Tensor]:
    """The full values of DTensors `xs` on every rank, as `full_tensor` gives them one by one, in
    few collectives. Leaves split by plain `Shard`s (each tensor dim over one mesh dim at most) are
    gathered one mesh dim at a time, from the last to the first, packed: at each mesh dim, every
    leaf it splits goes into one all-gather over that dim's group per dtype (each rank's piece
    padded to the largest), of up to `GATHER_BUCKET_BYTES` received (padding counted). A lone leaf
    split over a 1-D mesh, a leaf split only over mesh dims of one rank, and any other layout
    (`_StridedShard`, partial sums) go through `full_tensor`. Every rank must pass the same leaves in the same order.

    Example: on a (dp, tp) mesh, leaves `(Shard(0), Replicate())`, `(Replicate(), Shard(1))` and
    `(Shard(0), Shard(1))` take one all-gather over tp (the last two), then one over dp (the first
    and the last)."""
    out: list = [None] * len(xs)
    pieces: dict[int, torch.Tensor] = {}  # leaf -> its value gathered over the mesh dims done so far
    for i, x in enumerate(xs):
        if _packable(x):
            pieces[i] = x._local_tensor
        else:
            out[i] = full_tensor(x, what)
    lone = [i for i in pieces if xs[i].device_mesh.ndim == 1]
    if len(pieces) == 1 and lone:
        out[lone[0]] = full_tensor(xs[lone[0]], what)
        return out
    for back in range(max((xs[i].device_mesh.ndim for i in pieces), default=0)):
        # (mesh, mesh dim, dtype, device) -> [[bytes received, (leaf, tensor dim), ...], ...]
        buckets: dict[tuple, list[list]] = {}
        for i, local in pieces.items():
            x = xs[i]
            m = x.device_mesh.ndim - 1 - back
            if m < 0 or type(x.placements[m]) is not Shard or x.device_mesh.size(m) == 1:
                continue
            d, world = x.placements[m].dim, x.device_mesh.size(m)
            nbytes = world * math.prod(_padded(local.shape, d, x.shape[d], world)) * local.element_size()
            chain = buckets.setdefault((x.device_mesh, m, local.dtype, local.device), [[0]])
            if len(chain[-1]) > 1 and chain[-1][0] + nbytes > GATHER_BUCKET_BYTES:
                chain.append([0])
            chain[-1][0] += nbytes
            chain[-1].append((i, d))
        for (mesh, m, _, _), chain in buckets.items():
            for _, *items in chain:
                gathered = _gather_packed([(pieces[i], d, xs[i].shape[d]) for i, d in items], mesh.get_group(m), mesh.size(m), what)
                for (i, _), full in zip(items, gathered):
                    pieces[i] = full
    for i, full in pieces.items():
        out[i] = full
    return out


def _padded(local_shape, dim: int, n: int, world: int) -> list[int]:
    """The shape of each rank's piece of a tensor whose dim `dim` (n long) is split over `world`
    ranks as `torch.chunk` splits it, padded to the largest piece."""
    padded = list(local_shape)
    padded[dim] = -(-n // world)
    return padded


def _gather_packed(items: list, group, world: int, what: str) -> list[torch.Tensor]:
    """One all-gather over `group` of pieces `items` [(local, dim, n)]: each a tensor whose dim
    `dim`, n long, is split over the group's `world` ranks as `torch.chunk` splits it (rank r holds
    rows [r c, min((r + 1) c, n)), c = ceil(n / W)); returns each whole along `dim`."""
    layout, total = [], 0
    for local, d, n in items:
        padded = _padded(local.shape, d, n, world)
        layout.append((d, n, padded, total))
        total += math.prod(padded)
    inp = torch.empty(total, dtype=items[0][0].dtype, device=items[0][0].device)
    with torch.no_grad():
        for (local, _, _), (d, _, padded, at) in zip(items, layout):
            inp[at:at + math.prod(padded)].view(padded).narrow(d, 0, local.shape[d]).copy_(local)
        gathered = torch.empty(world * total, dtype=inp.dtype, device=inp.device)
        with watching(what, group):
            all_gather(gathered, inp, group, async_op=False)
        rows = gathered.view(world, total)
        fulls = []
        for d, n, padded, at in layout:
            c = padded[d]
            pieces = [rows[r, at:at + math.prod(padded)].view(padded).narrow(d, 0, max(0, min(c, n - r * c))) for r in range(world)]
            fulls.append(torch.cat(pieces, dim=d))
    return fulls


def redistribute(x, mesh, placements, what: str):
    """DTensor `x` laid out as `placements` over `mesh` (DTensor's own collectives). Counted as
    what each rank sends for the usual moves: an all-gather of the shards the new layout drops,
    an all-to-all between two layouts of as many shards, nothing for a finer sharding (a slice)."""
    before, after = _shards(x.placements, x.device_mesh), _shards(placements, mesh)
    local = x.numel() * x.element_size() // before
    summed = [i for i, p in enumerate(x.placements) if p.is_partial() and not placements[i].is_partial()]
    if summed:  # partial sums reduced: a reduce-scatter where the new layout splits, else an all-reduce
        n, scatter = 1, True
        for i in summed:  # loops, not generator expressions: traced in a compiled unit
            n *= mesh.size(i)
            scatter = scatter and placements[i].is_shard()
        count("reduce_scatter" if scatter else "all_reduce", (1 if scatter else 2) * local * (n - 1) // n, x)
    else:
        if before > after:
            nbytes = local * (before // after - 1)
        elif before == after and tuple(x.placements) != tuple(placements):
            nbytes = local * (before - 1) // before
        else:
            nbytes = 0
        count("redistribute", nbytes, x)
    if torch.compiler.is_compiling():
        # In a compiled unit (Note [compiled units] in `_compiled.py`) DTensor's collectives are
        # traced into its graph, and waited for there: no host wait to watch.
        return x.redistribute(mesh, placements)
    with watching(what):
        return x.redistribute(mesh, placements)


def all_gather_blocking(t: torch.Tensor, group, what: str) -> list[torch.Tensor]:
    """Every rank's `t` (same shape on every rank), in group-rank order; blocks, under the watch."""
    world = _world(group)
    t = t.contiguous()
    if world == 1:
        return [t]
    STATS.add("all_gather", t.numel() * t.element_size() * (world - 1))
    out = [torch.empty_like(t) for _ in range(world)]
    with watching(what, group):
        dist.all_gather(out, t, group=group)
    return out


def reduce_scatter_blocking(chunks: list[torch.Tensor], group, what: str) -> torch.Tensor:
    """The sum over ranks of chunk g (equal shapes), on group rank g; blocks, under the watch."""
    world = _world(group)
    if world == 1:
        return chunks[0].contiguous().clone()
    inp = torch.cat([c.reshape(-1) for c in chunks])
    out = torch.empty_like(chunks[0], memory_format=torch.contiguous_format)
    with watching(what, group):
        wait(reduce_scatter(out.view(-1), inp, group, async_op=True, scratch=True))
    return out


def all_to_all_blocking(chunks: list[torch.Tensor], group, what: str) -> list[torch.Tensor]:
    """Chunk g (equal shapes) to group rank g; returns what each group rank sent this one, in
    group-rank order. Counted as the bytes sent to the peers; blocks, under the watch."""
    world = _world(group)
    if world == 1:
        return [chunks[0].contiguous().clone()]
    inp = torch.cat([c.reshape(-1) for c in chunks])
    out = torch.empty_like(inp)
    STATS.add("all_to_all", inp.numel() * inp.element_size() * (world - 1) // world)
    with watching(what, group):
        dist.all_to_all_single(out, inp, group=group)
    return list(out.view(world, *chunks[0].shape).unbind(0))


def permute_blocking(t: torch.Tensor, send_to: list[int], recv_from: int | None, group, what: str) -> torch.Tensor:
    """Sends `t` to each group rank in `send_to` and returns what group rank `recv_from` sent
    (zeros when None); every rank's `t` has one shape. Point to point, one tag per call, which
    every rank of the group takes in the same order; blocks, under the watch."""
    t = t.contiguous()
    out = torch.zeros_like(t)
    info = _info(group)
    tag = _next_tag(info)
    rank = info[1]
    sends = [(t, dst, tag) for dst in send_to if dst != rank]
    recvs = [(out, recv_from, tag)] if recv_from is not None and recv_from != rank else []
    if recv_from == rank:
        out.copy_(t)
    STATS.add("ppermute", t.numel() * t.element_size() * len(sends))
    if sends or recvs:
        with watching(what, group):
            wait(_exchange(group, sends, recvs))
    return out


@contextlib.contextmanager
def region(what: str) -> Iterator[None]:
    """A block whose collectives a library issues itself (`torch.distributed.checkpoint`'s save
    and load): run under the watch as shardfn call `what`. Counted as one call, of unknown bytes."""
    STATS.add("torch.distributed.checkpoint", 0)
    with watching(what):
        yield


__all__ += ["watching", "all_reduce_blocking", "all_gather_blocking", "reduce_scatter_blocking", "all_to_all_blocking", "permute_blocking", "all_gather_object", "broadcast_object", "barrier", "full_tensor", "redistribute", "region"]


# Note [collectives in a traced graph]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The step as one graph (Note [the step as one graph] in `_step_graph.py`) gathers each unit inside
# the graph with torch's functional collectives, which dynamo traces and the compiler buckets and
# orders against compute; their waits are the graph's. They are neither counted in `STATS` nor
# watched: the graph's collectives are the compiler's to schedule, and a stall in one is named by
# the process group's timeout. The gather's backward is the reduce-scatter. Under mixed precision
# the shard is cast to the compute dtype before the gather, and the gradient to the reduce dtype
# before the reduce-scatter, then to the shard's dtype: autograd hands a tensor's gradient over in
# that tensor's own dtype, so a reduce dtype other than the compute dtype needs a function of its
# own (`_TracedGatherCast`).


def traced_gather(shard: torch.Tensor, world: int, group: Any, compute: torch.dtype, reduce: torch.dtype) -> torch.Tensor:
    """The 1-D `shard` of every rank of `group` (`world` ranks), concatenated, in `compute`, for a
    traced graph (Note [collectives in a traced graph]); the backward reduce-scatters the gradient
    in `reduce` and returns it in the shard's dtype."""
    if shard.dtype == compute == reduce:
        return funcol.all_gather_tensor_autograd(shard, 0, group) if world > 1 else shard
    if compute == reduce and world > 1:
        return funcol.all_gather_tensor_autograd(shard.to(compute), 0, group)
    return _TracedGatherCast.apply(shard, compute, reduce, group if world > 1 else None)


class _TracedGatherCast(torch.autograd.Function):
    """All-gather of a shard cast to `compute`; the backward reduce-scatters the gradient in
    `reduce` and returns it in the shard's dtype (Note [collectives in a traced graph])."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, compute: torch.dtype, reduce: torch.dtype, group: Any) -> torch.Tensor:
        ctx.dtype, ctx.reduce, ctx.group = shard.dtype, reduce, group
        x = shard.to(compute)
        return funcol.all_gather_tensor(x, 0, group) if group is not None else x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        g = grad.to(ctx.reduce)
        if ctx.group is not None:
            g = funcol.reduce_scatter_tensor(g, "sum", 0, ctx.group)
        return g.to(ctx.dtype), None, None, None


__all__ += ["traced_gather"]
