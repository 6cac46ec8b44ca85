"""Per-unit flat buffers: the sharded storage of one unit, and its gather, free and reduce-scatter.

Note [flat unit layout]
-----------------------
Each unit keeps this rank's shards of all its parameters in ONE flat buffer, `local`:

    local = [ frozen sharded | trained sharded | trained replicated | frozen replicated ]
              <------------- S ------------->   <-------------- R -------------->

and within the sharded part, large segments on the outside and small ones (under SMALL_SEGMENT
elements) in the middle, so that all small segments are contiguous:

    [ frozen large | frozen small | trained small | trained large ]

A sharded leaf i of shape (n_i, *rest) is split over dim 0 in chunks of c_i = ceil(n_i / W) rows, as
DTensor's `Shard(0)` splits it: rank r holds rows [r*c_i, min(n_i, (r+1)*c_i)), which may be fewer
than c_i or none at all. Its segment is always c_i rows long; rows past the end are padding, held at
zero. A replicated leaf's segment is the whole leaf. The user-visible DTensor of a leaf views the real
rows of its segment, so the optimizer, writing through the DTensors, writes the flat buffer.

All-gather: `local[:S]` is the all-gather input as it is (no copy-in), unless mixed precision casts
it or CPU offload moves it to the GPU (then it is first copied into `stage`). The output, `gathered`,
is rank-major: (W, S). Full parameters are leaf-major, so one batched copy (`_foreach_copy_` over views
built at init) moves each leaf's (W, c_i * rest) block into `full`, where the full parameters live.
When the collectives run point to point (gloo, Note [gloo collectives] in `_collectives.py`), a
message may land anywhere, and a large leaf's (W, c_i * rest) block is exactly the all-gather of its
segment: each large leaf is received straight into `full` (`direct_gather`), with no copy and no
unit-sized `gathered`; only the small segments travel together, as one message per peer, through a
small `gathered` and the copy. (Over NCCL, one collective for the whole unit beats many small ones.)

Free: `full`, `gathered` and `stage` keep their tensor objects for the whole run; only their storage
is resized to 0 and back (the FSDP paper's mechanism). The full parameters handed to `loss_fn` are
leaf tensors that view `full`; autograd saves them in forward and reads them in backward, after the
unit was freed and gathered again into the same storage. Writes go through a second tensor aliasing
that storage, with its own version counter, so refilling is not seen as an in-place change.

Reduce: the trained full gradients are chunked and padded with `torch._chunk_cat` into a (W, S_t)
buffer in the reduce dtype (rank-major again), and reduce-scattered straight into this rank's flat
gradient buffer `grad` (or into `rs_out` first, when a cast, an accumulation or offload is needed).
Trained replicated leaves are all-reduced in their segment. Because the trained segments touch, a
hybrid mesh's replicate-axis all-reduce covers both in ONE call. Frozen leaves are never reduced.

Note [leaves split on another dim]
----------------------------------
A spec may split a leaf over the shard axis on another dim k than 0 (`P(None, "dp")`, DTensor's
`Shard(k)`). Its segment is c = ceil(n_k / W) slices along k long, and this rank's shard, all the
dims but k whole and width_r = min(n_k, (r+1)*c) - r*c along k, lies CONTIGUOUS in its natural
shape at the start of the segment (the rest is padding, at zero), so the DTensor's local tensor and
the optimizer see an ordinary tensor, and the rank-major layout of `gathered` and of the reduce input
is the one above. What differs is the copies: rank r's block is not a run of rows of the full leaf
but a slab `full[..., r*c : r*c + width_r, ...]`. So such a leaf is always gathered with the small
leaves, through `gathered` (never received in place), and copied into `full` by one copy per rank's
chunk (a second `_foreach_copy_`, so that the dim-0 leaves' list keeps its contiguous fast path);
its reduce input is laid out by `_chunk_cat` over a stand-in, one row of zeros as long as its
segment (which zeros its segment on every rank), then one copy per rank's chunk of its gradient
overwrites the real part. Clipping's norm, accumulation, casts and the replicate all-reduce work on
whole segments, padding included, and see nothing of the dim. On one rank every split is the whole
leaf: the layout is dim 0's.

Note [slot arenas]
------------------
Allocating and freeing a unit-sized buffer for every gather costs page faults (on CPU with glibc's
mmap threshold, every large free returns pages to the OS and every allocation faults them back in,
which cost more than the copies themselves). Under `full_shard` at most two non-root units are
gathered at once, the running one and the prefetched one, which in a sequential model are always
neighbours in forward order. So the units in forward order u_0, u_2, u_4, ... share one "slot"
arena for their full parameters, u_1, u_3, u_5, ... another (the engine plans which units share,
from the first step's schedule: Note [unit plan] in `_engine.py`): a unit's full parameters are
fixed views into its slot, and gathering u_{i+2} overwrites u_i, which by then is freed. A slot is
allocated when its first unit is gathered and given back in the backward once the last unit that
uses it is freed and reduced (so the sharded gradients, which grow as the backward goes on, do not
stack on it), so memory is that of two units, as the bound says, and nothing survives the step. A unit needed while the other unit of its slot is
still in use is an error, never a silent overwrite (Note [stale parameters]). All units that share
slots share one all-gather output arena (one unit gather is in flight at a time). A unit's
reduce-scatter input is built in its own slot, whose parameters are dead once its backward is
over; the engine finishes that reduction before the slot is refilled. Nested units, units the
plan keeps apart, the first step, and strategies that keep units gathered (`shard_grad_op`,
`no_shard`) give each unit arenas of its own.

Gathers that land in place (`direct_gather`) write the slot as soon as they start, not when they
finish: in the backward, the prefetch of u_{i-1} would have to wait for the reduction of u_{i+1},
whose input fills the same slot, before u_i's backward could even start. They get three slots
(u_0, u_3, u_6, ... share one) instead: the running unit, the prefetched one and the reduction in
flight each have their own, which is as much memory as two slots plus a unit-sized `gathered`.
In the backward, a slot is given back as soon as the last of its units is reduced, so that the
sharded gradients, which grow as the backward goes on, do not stack on idle slots; the engine
finishes such a reduction as the next unit's backward begins rather than let it overlap that
unit's gradients (less memory at the step's peak for a short wait; `benchmarks/README.md`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import _collectives as C
from . import _debug
from ._memory import huge_pages
from ._schedule import ReductionStarted

__all__ = ["Segment", "LeafSpec", "FlatUnit", "buffer_sizes", "norm_parts", "place"]


@dataclass(frozen=True)
class Segment:
    """Where one parameter lives in its unit's flat buffers (its segment of `local`)."""

    index: int  # leaf index in the params tree's leaf order
    path: str
    shape: torch.Size  # global shape
    sharded: bool  # Shard(0) over the unit's group; else replicated
    trained: bool
    chunk: int  # rows per rank (sharded) / rows (replicated)
    row_numel: int
    local_rows: int  # rows this rank really holds
    offset: int  # start of its segment in `local`
    full_offset: int  # start in `full` (sharded leaves)
    dim: int = 0  # the dim it is split on (sharded leaves; Note [leaves split on another dim])

    @property
    def seg_numel(self) -> int:
        return self.chunk * self.row_numel

    @property
    def local_shape(self) -> torch.Size:
        if not self.sharded:
            return self.shape
        return torch.Size((*self.shape[: self.dim], self.local_rows, *self.shape[self.dim + 1 :]))

    def rank_chunks(self, world: int) -> list[tuple[int, int, int]]:
        """(rank, first index, width) along `dim` of every rank's non-empty chunk."""
        n = self.shape[self.dim]
        return [(r, r * self.chunk, min(n, (r + 1) * self.chunk) - r * self.chunk) for r in range(world) if r * self.chunk < n]

    def as_3d(self, t: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """`t` (the leaf, or a chunk `width` wide along `dim`) viewed as (before, dim, after)."""
        before = self.shape[: self.dim].numel()
        return t.view(before, self.shape[self.dim] if width is None else width, self.row_numel // max(before, 1))


@dataclass(frozen=True)
class LeafSpec:
    """What a unit needs to know of one leaf to place it."""

    index: int
    path: str
    shape: torch.Size
    sharded: bool
    trained: bool
    dim: int = 0  # the dim a sharded leaf is split on


def _storage_free(t: torch.Tensor) -> None:
    # Note [freed memory] 1 in `_debug.py`: nothing reads this storage until it is allocated again
    # (the tensors over it stay, and must not be read); in debug mode it is poisoned first.
    if _debug.ON:
        _debug.poison_storage(t)
    t.untyped_storage().resize_(0)


def _storage_alloc(t: torch.Tensor, nbytes: int) -> None:
    if t.untyped_storage().nbytes() != nbytes:
        if _debug.ON and t.untyped_storage().nbytes():
            _debug.check_not_in_flight(t, "a storage reallocated")  # its memory moves: Note [freed memory] 1
        t.untyped_storage().resize_(nbytes)
        if t.device.type == "cpu":
            huge_pages(t.untyped_storage())


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over the same storage as `t`, with a version counter of its own."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


class Arena:
    """Storage for buffers that are never in use at the same time, e.g. the full parameters of
    units that share a slot (see Note [slot arenas]).

    Its storage is allocated on first use and kept until `release()`; buffers are views of it.
    `owner` is the unit whose data it holds now: a unit that fills it takes it over, and the unit
    it held before is marked stale (Note [stale parameters]).
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: Any, shared: bool):
        self.base = torch.empty(numel, dtype=dtype, device=device)
        self.writer = _alias(self.base)
        self.nbytes = self.base.untyped_storage().nbytes()
        self.shared = shared
        self.owner: FlatUnit | None = None
        self.reduce_input: FlatUnit | None = None  # whose reduce-scatter input is here, in flight
        _storage_free(self.base)

    def alloc(self) -> None:
        _storage_alloc(self.base, self.nbytes)

    def release(self) -> None:
        if self.owner is not None:
            self.owner.mark_stale()
            self.owner = None
        self.reduce_input = None  # given back only once no collective reads it
        _storage_free(self.base)

    def claim(self, unit: "FlatUnit") -> None:
        """`unit` is about to write its data here: whoever held it is stale from now on.

        The engine frees the previous owner first (Note [freed memory] 2 in `_debug.py`): in debug
        mode a claim over a unit still gathered raises."""
        if self.owner is not unit:
            if self.owner is not None:
                if _debug.ON and self.owner.valid:
                    raise RuntimeError(
                        f"unit {unit.name!r} takes the arena of unit {self.owner.name!r} while that unit is still "
                        "gathered (Note [slot arenas]); please report this with the model"
                    )
                self.owner.mark_stale()
            self.owner = unit

    def check_unread(self, unit: "FlatUnit") -> None:
        """Debug mode: `unit` is about to write here, and no reduction reads it (Note [freed
        memory] 4 in `_debug.py`)."""
        if self.reduce_input is not None:
            raise RuntimeError(
                f"unit {unit.name!r} writes the arena that holds unit {self.reduce_input.name!r}'s reduce-scatter "
                "input while that reduction is in flight (Note [slot arenas]); please report this with the model"
            )

    @property
    def allocated(self) -> bool:
        return self.base.untyped_storage().nbytes() > 0


# Note [stale parameters]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A unit's full parameters (the tensors handed to its forward, which autograd saves for the
# backward) are fixed views into storage that other units reuse (Note [slot arenas]) or that is
# given back between uses. Autograd reads them again in the backward, and must only do so while
# they hold this unit's values: after the unit was gathered again, never while the memory is freed
# or holds another unit. That is an invariant of the engine's schedule, and it is checked on every
# run by autograd itself: each unit's full parameters share a version counter of their own (their
# reader tensors are aliases made with `set_`, not views of the arena's tensor, so units that share
# an arena do not share a counter). A gathered unit's counter reads VALID, the version autograd
# records when the forward saves the tensors; whenever the unit's memory is freed or taken by
# another unit, its counter is set to STALE, and back to VALID when it is gathered again. A saved
# parameter read while stale fails autograd's own check ("modified by an inplace operation"), which
# the train step turns into an error naming the unit, before any gradient is reduced or applied.
# The check costs one counter write per gather and per free; the gathers themselves write through
# `writer` aliases (their own counters), so a refill is not an in-place change to autograd.
VALID, STALE = 0, 1 << 30  # version counters are 32-bit
_set_versions = torch._C._autograd._unsafe_set_version_counter


# Sharded segments below this many elements (4 MiB in fp32) are "small": when the other leaves are
# received straight into `full` (see Note [flat unit layout]), the small ones travel together. Each
# message costs about as much host time as copying a few MB, so only large leaves go alone.
SMALL_SEGMENT = 1 << 20


def _split_dim(x: LeafSpec, world: int) -> int:
    """The dim the layout splits `x` on: on one rank every split is the whole leaf, as dim 0's."""
    return x.dim if world > 1 else 0


def _segment_numel(x: LeafSpec, world: int) -> int:
    d = _split_dim(x, world)
    n = x.shape[d]
    return -(-n // world) * (x.shape.numel() // n if n else x.shape[:d].numel() * x.shape[d + 1 :].numel())


def _together(x: LeafSpec | Segment, world: int) -> bool:
    """Whether sharded `x` is gathered with the small leaves, through `gathered` (a leaf split on
    another dim than 0 always is: its block is not the full leaf, Note [leaves split on another dim])."""
    return _segment_numel(x, world) < SMALL_SEGMENT or _split_dim(x, world) != 0


def buffer_sizes(leaves: list[LeafSpec], world: int, rank: int, direct: bool = False) -> dict[str, int]:
    """Element counts of a unit's transient buffers, to size the arenas it will use.

    `direct`: the unit gathers its large leaves straight into `full` (FlatUnit's `direct_gather`).
    """
    segs = place(leaves, world, rank)
    S = sum(s.seg_numel for s in segs if s.sharded)
    S_small = sum(s.seg_numel for s in segs if s.sharded and _together(s, world))
    R = sum(s.seg_numel for s in segs if not s.sharded)
    trained = sum(s.seg_numel for s in segs if s.trained)
    S_trained = sum(s.seg_numel for s in segs if s.sharded and s.trained)
    gathered = 0 if world == 1 else world * (S_small if direct else S)
    return {"full": world * S, "gathered": gathered, "stage": S + R, "rs_in": world * S_trained if world > 1 else 0, "rs_out": trained}


def place(leaves: list[LeafSpec], world: int, rank: int) -> list[Segment]:
    """Lays leaves out in the order of Note [flat unit layout] and computes their offsets."""

    def small(x: LeafSpec) -> bool:
        return _together(x, world)

    sharded = [x for x in leaves if x.sharded]
    order = (
        [x for x in sharded if not x.trained and not small(x)]
        + [x for x in sharded if not x.trained and small(x)]
        + [x for x in sharded if x.trained and small(x)]
        + [x for x in sharded if x.trained and not small(x)]
        + [x for x in leaves if not x.sharded and x.trained]
        + [x for x in leaves if not x.sharded and not x.trained]
    )
    segs, off, full_off = [], 0, 0
    for x in order:
        d = _split_dim(x, world) if x.sharded else 0
        if x.sharded:
            rows = x.shape[d]
            row_numel = x.shape[:d].numel() * x.shape[d + 1 :].numel()
            chunk = -(-rows // world)
            local_rows = max(0, min(rows - rank * chunk, chunk))
        else:
            chunk, row_numel = 1, x.shape.numel()
            local_rows = 1
        s = Segment(x.index, x.path, x.shape, x.sharded, x.trained, chunk, row_numel, local_rows, off, full_off, d)
        off += s.seg_numel
        if x.sharded:
            full_off += world * s.seg_numel
        segs.append(s)
    return segs


class FlatUnit:
    """One sharding unit's flat buffers and the collectives over them.

    Args:
        name: the unit's module path ("" for the root unit).
        leaves: its leaves (placed by `place`, see Note [flat unit layout]).
        dtype: the master (parameter) dtype of every leaf.
        compute_dtype: the dtype the unit is gathered in and computes in.
        reduce_dtype: the dtype gradients are reduced in.
        group / world / rank: the process group that shards (the shard axis).
        replicate_group: for hybrid sharding, the group gradients are all-reduced over after the
            reduce-scatter (None otherwise).
        device: where the unit computes.
        offload: keep `local` and `grad` (and so the optimizer) in pinned CPU memory.
        direct_gather: receive each large sharded leaf straight into `full` (the collectives run
            point to point, Note [gloo collectives]); only the small leaves go through `gathered`.

    The transient buffers (`full`, `gathered`, `stage`) live in arenas that the engine gives with
    `bind` (Note [slot arenas]); binding again (a new plan) makes new full parameters.
    """

    def __init__(self, name, leaves, dtype, compute_dtype, reduce_dtype, group, world, rank, device, replicate_group=None, offload=False, direct_gather=False):
        self.name = name
        self.leaves = list(leaves)
        self.segments: list[Segment] = place(leaves, world, rank)
        self.dtype, self.compute_dtype, self.reduce_dtype = dtype, compute_dtype, reduce_dtype
        self.group, self.world, self.rank = group, world, rank
        self.replicate_group = replicate_group
        self.device = device
        segs = self.segments
        sh = [s for s in segs if s.sharded]
        self.S = sum(s.seg_numel for s in sh)
        self.R = sum(s.seg_numel for s in segs if not s.sharded)
        self.S_frozen = sum(s.seg_numel for s in sh if not s.trained)
        self.R_trained = sum(s.seg_numel for s in segs if not s.sharded and s.trained)
        self.S_trained = self.S - self.S_frozen
        self.full_numel = world * self.S
        offload = offload and torch.device(device).type != "cpu"
        store = dict(device="cpu", pin_memory=True) if offload else dict(device=device)
        self.local = torch.zeros(self.S + self.R, dtype=dtype, **store)
        self.grad = torch.zeros(self.S + self.R, dtype=dtype, **store)
        self.staged = compute_dtype != dtype or offload  # all-gather input needs a copy-in
        self.offload = offload

        def local_view(buf: torch.Tensor, s: Segment) -> torch.Tensor:
            return buf[s.offset : s.offset + s.local_rows * s.row_numel].view(s.local_shape)

        self.local_views = [local_view(self.local, s) for s in segs]
        self.grad_views = [local_view(self.grad, s) for s in segs]
        self._grad_bytes = self.grad.untyped_storage().nbytes()
        # Gradient shards are dropped between steps when parameters are sharded (as FSDP's
        # zero_grad(set_to_none=True)); replicated (DDP-like) and offloaded ones stay.
        self._grad_transient = not offload and self.S > 0
        small = [s for s in sh if _together(s, world)]
        self.direct_gather = direct_gather and world > 1
        # Its gather writes `full` as soon as it starts (not only when it finishes).
        self.gathers_in_place = self.direct_gather and len(small) < len(sh)
        # The small sharded leaves are contiguous (Note [flat unit layout]): [small_lo, small_hi).
        self._small_lo = small[0].offset if small else 0
        self._small_hi = self._small_lo + sum(s.seg_numel for s in small)
        self._small = small
        self.direct = reduce_dtype == dtype and not offload  # reduce straight into `grad`
        self.n_trained = self.S_trained + self.R_trained
        self._sh_trained = [i for i, s in enumerate(segs) if s.sharded and s.trained]
        self._sh_trained_k = [i for i in self._sh_trained if segs[i].dim != 0]  # Note [leaves split on another dim]
        self._rep_trained = [i for i, s in enumerate(segs) if not s.sharded and s.trained]
        self.num_trained = len(self._sh_trained) + len(self._rep_trained)
        self.arenas: dict[str, Arena] = {}
        self.had_grad = [False] * len(segs)  # per leaf: a gradient reached it in this step
        self._stash: dict[int, torch.Tensor] = {}  # leaf -> its full gradient so far, local accumulation (`stash_grads`)
        self.proxies: list[torch.Tensor] = []
        self._counters: tuple[torch.Tensor, ...] = ()
        self._readers: tuple[torch.Tensor, ...] = ()
        self.valid = False
        self._rs_inp: torch.Tensor | None = None  # the reduce-scatter input in flight (debug mode's poison)
        _debug.track(self)

    def sizes(self) -> dict[str, int]:
        """Element counts of this unit's transient buffers (see `buffer_sizes`)."""
        return buffer_sizes(self.leaves, self.world, self.rank, self.direct_gather)

    def bind(self, arenas: dict[str, Arena], reduce_in_full: bool) -> None:
        """Puts this unit's transient buffers in `arenas` and makes its full parameters there.

        Args:
            arenas: the "full", "gathered" and "stage" arenas it computes in (see Note [slot
                arenas]), each at least `sizes()` long, in `compute_dtype`.
            reduce_in_full: build the reduce-scatter input in the unit's own "full" arena (its full
                parameters are dead once its backward is over): no arena of its own for it. The
                engine keeps the arena alive until the reduction finishes (Note [slot arenas]).
        """
        world, segs = self.world, self.segments
        sh = [s for s in segs if s.sharded]
        self.arenas = arenas
        for a in arenas.values():  # views are built over allocated storage, which is then released
            a.alloc()
        n_gather_src = self._small_hi - self._small_lo if self.direct_gather else self.S
        n_gathered, n_stage = (world * n_gather_src if world > 1 else 0), (self.S + self.R if self.staged else 0)
        # Readers: what the full parameters view. Each is an alias with a version counter of its
        # own (Note [stale parameters]); the arenas' own tensors are for the writers.
        full_r = _alias(arenas["full"].base)[: self.full_numel]
        stage_r = _alias(arenas["stage"].base)[:n_stage]
        self.full = full_r
        self.gathered = arenas["gathered"].base[:n_gathered]
        self.stage = stage_r
        full_w = arenas["full"].writer[: self.full_numel]
        gathered_w = arenas["gathered"].writer[:n_gathered]
        self._stage_w = arenas["stage"].writer[:n_stage]
        self.reduce_in_full = reduce_in_full and self.reduce_dtype == self.compute_dtype and world > 1
        self._rs_in_full = arenas["full"].writer[: world * self.S_trained] if self.reduce_in_full else None

        rep_src = stage_r if self.staged else _alias(self.local)
        self.proxies = []
        for s in segs:
            if s.sharded:
                v = full_r[s.full_offset : s.full_offset + s.shape.numel()].view(s.shape)
            else:
                v = rep_src[s.offset : s.offset + s.seg_numel].view(s.shape)
            p = v.detach()  # shares the reader's version counter
            p.requires_grad_(s.trained)
            self.proxies.append(p)
        self._readers = (full_r, stage_r) if self.staged and self.R else (full_r,)
        # Every proxy is a view of one of these: their counters move with a write into a parameter.
        self._counters = (full_r, rep_src) if rep_src is not full_r else (full_r,)
        # Gather plan: what the all-gather receives where (`_gather_pieces`), and the copy-out of
        # `gathered` (W, S) into full, one (W, c_i * rest) block per sharded leaf. With
        # `direct_gather` the large leaves arrive in `full` as they are and only the small ones,
        # gathered as one (W, small_hi - small_lo) block, are copied.
        src_flat = self._stage_w if self.staged else self.local
        self._gather_pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        if world == 1:
            src, lo, copied = src_flat[: self.S].view(1, self.S), 0, sh
        elif self.direct_gather:
            src, lo, copied = gathered_w.view(world, -1), self._small_lo, self._small
            if self._small:
                self._gather_pieces.append((self.gathered, src_flat[self._small_lo : self._small_hi]))
            for s in sh:
                if not _together(s, world):
                    self._gather_pieces.append(
                        (full_w[s.full_offset : s.full_offset + world * s.seg_numel], src_flat[s.offset : s.offset + s.seg_numel])
                    )
        else:
            src, lo, copied = gathered_w.view(world, self.S), 0, sh
            if self.S:
                self._gather_pieces.append((self.gathered, src_flat[: self.S]))
        self._copy_dst = [full_w[s.full_offset : s.full_offset + world * s.seg_numel].view(world, s.seg_numel) for s in copied if s.dim == 0]
        self._copy_src = [src[:, s.offset - lo : s.offset - lo + s.seg_numel] for s in copied if s.dim == 0]
        # Leaves split on another dim: one copy per rank's chunk (Note [leaves split on another dim]).
        self._copy_dst_k, self._copy_src_k = [], []
        for s in copied:
            if s.dim != 0:
                full_leaf = s.as_3d(full_w[s.full_offset : s.full_offset + s.shape.numel()])
                for r, first, width in s.rank_chunks(world):
                    self._copy_dst_k.append(full_leaf[:, first : first + width])
                    self._copy_src_k.append(s.as_3d(src[r, s.offset - lo : s.offset - lo + width * s.row_numel], width))
        for a in arenas.values():
            a.owner = None
            a.release()
        self.valid = True  # fresh aliases read version 0: mark them stale for real
        self.mark_stale()

    # -- the leaves, for the train step -------------------------------------------------------
    def leaf_indices(self) -> list[int]:
        """Each of this unit's leaves' index in the parameter tree, in this unit's order."""
        return [s.index for s in self.segments]

    def fill(self, j: int, full: torch.Tensor) -> None:
        """Copies this rank's rows of leaf `j`'s full value into the flat buffer."""
        s = self.segments[j]
        src = full.detach()
        if s.sharded:
            src = src.narrow(s.dim, min(self.rank * s.chunk, s.shape[s.dim]), s.local_rows)
        with torch.no_grad():
            self.local_views[j].copy_(src)

    def gather_leaf(self, j: int) -> torch.Tensor:
        """Leaf `j`'s full value in the compute dtype, in fresh memory: one all-gather of its
        segment alone (outside reads, Note [parameters outside apply] in `_param.py`)."""
        s = self.segments[j]
        alone = not s.sharded or self.world == 1  # the segment is the whole leaf: a copy of it
        seg = self.local[s.offset : s.offset + s.seg_numel].to(self.device, self.compute_dtype, copy=alone)
        if alone:
            return seg[: s.shape.numel()].view(s.shape)
        out = torch.empty(self.world * s.seg_numel, dtype=self.compute_dtype, device=seg.device)
        C.all_gather(out, seg.contiguous(), self.group, async_op=False)
        if s.dim == 0:
            return out[: s.shape.numel()].view(s.shape)
        full = torch.empty(s.shape, dtype=self.compute_dtype, device=seg.device)
        blocks = out.view(self.world, s.seg_numel)
        for r, first, width in s.rank_chunks(self.world):
            s.as_3d(full)[:, first : first + width].copy_(s.as_3d(blocks[r, : width * s.row_numel], width))
        return full

    def shard(self, j: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Size]:
        """Leaf `j`'s local shard, its gradient shard (None when frozen), and its global shape."""
        s = self.segments[j]
        return self.local_views[j], (self.grad_views[j] if s.trained else None), s.shape

    # -- validity (Note [stale parameters]) ---------------------------------------------------
    def writes(self) -> int:
        """A count that moves when anything writes this unit's full parameters in place through
        autograd's view of them (Note [parameters written in the forward] in `_engine.py`)."""
        return sum(t._version for t in self._counters)

    def writes_reach_the_state(self) -> bool:
        """Whether a write into a replicated leaf lands in the state itself (`local`, not a copy)."""
        return bool(self.R) and not self.staged

    def mark_valid(self) -> None:
        if not self.valid:
            _set_versions(self._readers, (VALID,) * len(self._readers))
            self.valid = True

    def mark_stale(self) -> None:
        if self.valid:
            _set_versions(self._readers, (STALE,) * len(self._readers))
            self.valid = False

    # -- gather -------------------------------------------------------------------------------
    def start_gather(self):
        """Allocates the full buffer and starts the all-gather; returns the pending work (or None)."""
        self.arenas["full"].claim(self)
        self.arenas["full"].alloc()
        if self.staged:
            if self.R:
                self.arenas["stage"].claim(self)
            self.arenas["stage"].alloc()
            with torch.no_grad():
                self._stage_w.copy_(self.local, non_blocking=True)
        if self.world == 1 or self.S == 0:
            return None
        if _debug.ON and self.gathers_in_place:  # messages land in `full` from now on: Note [freed memory] 4
            self.arenas["full"].check_unread(self)
        self.arenas["gathered"].alloc()
        return C.all_gather_pieces(self._gather_pieces, self.group)

    def finish_gather(self, work, timeout: float | None = None) -> None:
        """Waits for the all-gather and copies the rank-major result into the full parameters."""
        if work is not None:
            C.wait(work, timeout)
        if self._copy_dst or self._copy_dst_k:
            if _debug.ON:
                self.arenas["full"].check_unread(self)
            with torch.no_grad():
                for dst, src in ((self._copy_dst, self._copy_src), (self._copy_dst_k, self._copy_src_k)):
                    if dst:
                        torch._foreach_copy_(dst, src)
        self.mark_valid()
        if not self.arenas["gathered"].shared:
            self.arenas["gathered"].release()
            if self.staged and not self.R:
                self.arenas["stage"].release()  # replicated leaves compute from `stage`; else it is spent

    def free(self) -> None:
        """Drops the full parameters (their storage, unless an arena shared with other units keeps
        it for the next of them until the step ends)."""
        self.mark_stale()
        for name in ("full", "gathered", "stage"):
            if not self.arenas[name].shared:
                self.arenas[name].release()
        if _debug.ON:
            _poison_shared(self)

    # -- gradients ----------------------------------------------------------------------------
    def take_grads(self) -> None:
        """Drops the full gradients (after a reduction, or when a micro-batch keeps them)."""
        for p in self.proxies:
            p.grad = None
        self._stash.clear()

    def stash_grads(self) -> None:
        """Local accumulation, a micro-batch that is not reduced: where the gradients are narrower
        than `reduce_dtype` (bf16 compute, fp32 reduce), they move into accumulators in
        `reduce_dtype`, so that the micro-batches add up in it, as FSDP2 accumulates; autograd
        would add them in bf16."""
        if torch.finfo(self.reduce_dtype).bits <= torch.finfo(self.compute_dtype).bits:
            return
        for i, p in enumerate(self.proxies):
            if p.grad is not None:
                if i in self._stash:
                    self._stash[i].add_(p.grad)  # promotes: no temporary in reduce_dtype
                else:
                    self._stash[i] = p.grad.to(self.reduce_dtype)
                p.grad = None

    def alloc_grad(self) -> None:
        """Gives the gradient shard storage again (its trained segments are then overwritten)."""
        _storage_alloc(self.grad, self._grad_bytes)

    def release_grad(self) -> None:
        """A new step: drops the gradient shard's storage until the next reduction (as
        `zero_grad(set_to_none=True)`), and forgets which leaves got a gradient."""
        self.had_grad = [False] * len(self.segments)
        if self._grad_transient:
            _storage_free(self.grad)

    def start_reduce(self, accumulate: bool, rs_in: Arena, rs_out: Arena, in_full: bool = True):
        """Starts reducing the trained full gradients into this rank's `grad` shard.

        Leaves without a gradient count as zero. With `accumulate`, the result is added to `grad`.
        `rs_in` / `rs_out` are the arenas (reduce dtype) this reduction may use until it finishes;
        `in_full=False` keeps the input out of the unit's own arena even where it could go there
        (another unit holds it now). Returns the pending state for `finish_reduce`.
        """
        trained = {i: self.proxies[i] for i in (*self._sh_trained, *self._rep_trained)}
        if self._stash:  # local accumulation: the last micro-batch adds up in the stash too
            self.stash_grads()
        for i, p in trained.items():
            self.had_grad[i] |= p.grad is not None or i in self._stash
        zeros_dtype = self.reduce_dtype if self._stash else None
        grads = {i: self._stash[i] if i in self._stash else p.grad if p.grad is not None else torch.zeros(p.shape, dtype=zeros_dtype or p.dtype, device=p.device)
                 for i, p in trained.items()}
        del trained
        self.take_grads()
        direct = self.direct and not accumulate
        if direct:
            self.alloc_grad()
            out = self.grad[self.S_frozen : self.S + self.R_trained]
        else:
            rs_out.alloc()
            out = rs_out.base[: self.n_trained]
        works, inp = [], None
        with torch.no_grad():
            rep = out[self.S_trained :]
            if self.R_trained:
                torch._foreach_copy_(
                    [rep[s.offset - self.S : s.offset - self.S + s.seg_numel].view(s.shape) for s in (self.segments[i] for i in self._rep_trained)],
                    [grads[i] for i in self._rep_trained],
                )
            if self.S_trained:
                sh = [grads[i] for i in self._sh_trained]
                if self.world == 1:
                    _chunk_cat(sh, 1, out[: self.S_trained].view(1, -1))
                else:
                    if self.reduce_in_full and in_full:
                        # Note [freed memory] 3 in `_debug.py`: the full parameters are dead from here
                        # on, and nothing fills the arena until the reduction is finished.
                        self.arenas["full"].claim(self)
                        self.arenas["full"].alloc()
                        self.mark_stale()
                        self.arenas["full"].reduce_input = self
                        inp = self._rs_in_full
                    else:
                        rs_in.alloc()
                        inp = rs_in.base[: self.world * self.S_trained]
                    if self._sh_trained_k:
                        _chunks_k(self, grads, sh, inp.view(self.world, -1))
                    else:
                        _chunk_cat(sh, self.world, inp.view(self.world, -1))
                del sh
            del grads  # the full gradients are spent: free them before the collectives allocate
            self._rs_inp = inp
            pending = [works, out, direct, accumulate, self.replicate_group]
            try:
                if inp is not None:
                    works.append(C.reduce_scatter(out[: self.S_trained], inp, self.group, async_op=True, scratch=True))
                if self.R_trained and self.world > 1:
                    works.append(C.all_reduce(rep, self.group, async_op=True))
            except Exception as e:
                if works:  # the reduce-scatter writes `out` and reads `inp` until it completes
                    raise ReductionStarted(pending) from e
                raise
        return pending

    def finish_reduce(self, pending, timeout: float | None = None) -> list | None:
        """Waits for a reduction. Returns a new pending state if a hybrid all-reduce was started."""
        works, out, direct, accumulate, replicate = pending
        for w in works:
            C.wait(w, timeout)
        if self._rs_inp is not None:  # spent: the arena it lives in may be filled again
            if self.arenas["full"].reduce_input is self:
                self.arenas["full"].reduce_input = None
            if _debug.ON:
                _debug.poison(self._rs_inp)
            self._rs_inp = None
        if replicate is not None:
            return [[C.all_reduce(out, replicate, async_op=True)], out, direct, accumulate, None]
        if not direct:
            with torch.no_grad():
                self.alloc_grad()
                dst = self.grad[self.S_frozen : self.S + self.R_trained]
                if accumulate:
                    dst.add_(out.to(dst.device, non_blocking=False))
                else:
                    dst.copy_(out)
            if _debug.ON:
                _debug.poison(out)  # `rs_out`, spent: the next reduction takes it
        return None


def norm_parts(unit: FlatUnit, replicas: int, replica_rank: int, total_world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The trained segments of `unit`'s gradient shard (what clipping scales), and the part of each
    whose squares this rank adds to the global norm.

    A gradient several ranks hold (a sharded segment on every replica of a hybrid mesh, a
    replicated one on every rank) is identical on all of them once reduced, so each sums the
    squares of its own 1/copies of it, and the all-reduce of the sums adds the parts.
    """
    segs, parts = [], []
    global_rank = replica_rank * unit.world + unit.rank
    for seg, copies, i in (
        (unit.grad[unit.S_frozen : unit.S], replicas, replica_rank),
        (unit.grad[unit.S : unit.S + unit.R_trained], total_world, global_rank),
    ):
        if seg.numel():
            c = -(-seg.numel() // copies)
            segs.append(seg)
            if seg[i * c : (i + 1) * c].numel():
                parts.append(seg[i * c : (i + 1) * c])
    return segs, parts


def _chunks_k(unit: FlatUnit, grads: dict, sh: list, inp: torch.Tensor) -> None:
    """The rank-major reduce-scatter input (W, S_t) of a unit with leaves split on another dim
    than 0: `_chunk_cat` lays out the dim-0 leaves and zeros the others' segments, then one copy
    per rank's chunk fills those (Note [leaves split on another dim])."""
    W, base = unit.world, unit.S_frozen
    segs = unit.segments
    # A stand-in of one row of seg_numel zeros takes a leaf's place: chunked in W it is one row
    # for rank 0 and padding (zeros) for the others. Contiguous, in the gradients' dtype, so
    # `_chunk_cat` keeps its fast path.
    zeros = torch.zeros(max(segs[i].seg_numel for i in unit._sh_trained_k), dtype=sh[0].dtype, device=inp.device)
    stand_in = {i: zeros[: segs[i].seg_numel].view(1, segs[i].seg_numel) for i in unit._sh_trained_k}
    _chunk_cat([stand_in.get(i, g) for i, g in zip(unit._sh_trained, sh)], W, inp)
    dst, src = [], []
    for i in unit._sh_trained_k:
        s, g = segs[i], grads[i].contiguous()
        for r, first, width in s.rank_chunks(W):
            dst.append(s.as_3d(inp[r, s.offset - base : s.offset - base + width * s.row_numel], width))
            src.append(s.as_3d(g)[:, first : first + width])
    if dst:
        torch._foreach_copy_(dst, src)


def _poison_shared(unit: FlatUnit) -> None:
    """Debug mode: this freed unit's regions of the shared arenas it still owns (the next unit
    of its slot writes them; Note [freed memory] 2 in `_debug.py`). Not the shared `gathered`,
    where another unit's gather may be in flight, nor its reduce-scatter input, in flight too."""
    full, stage = unit.arenas["full"], unit.arenas["stage"]
    if full.shared and full.owner is unit and full.allocated:
        _debug.poison(unit.full[unit._rs_inp.numel() if full.reduce_input is unit else 0 :])
    if stage.shared and stage.owner is unit and stage.allocated:
        _debug.poison(unit.stage)


def _chunk_cat(tensors: list[torch.Tensor], chunks: int, out: torch.Tensor) -> None:
    """`torch._chunk_cat(tensors, dim=0, num_chunks=chunks, out=out)` without the empty tensors (a
    leaf of which this rank holds nothing, as a tensor-parallel split can leave a rank: no row of the
    layout), which `_chunk_cat` refuses."""
    tensors = [t for t in tensors if t.numel()]
    if tensors:
        torch._chunk_cat(tensors, dim=0, num_chunks=chunks, out=out)
