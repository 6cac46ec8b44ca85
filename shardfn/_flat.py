"""Per-unit flat buffers: the sharded storage of one unit, and its gather, free and reduce-scatter.

Note [flat unit layout]
-----------------------
Each unit keeps this rank's shards of all its parameters in ONE flat buffer, `local`:

    local = [ frozen sharded | trained sharded | trained replicated | frozen replicated ]
              <------------- S ------------->   <-------------- R -------------->

A sharded leaf i of shape (n_i, *rest) is split over dim 0 in chunks of c_i = ceil(n_i / W) rows, as
DTensor's `Shard(0)` splits it: rank r holds rows [r*c_i, min(n_i, (r+1)*c_i)), which may be fewer
than c_i or none at all. Its segment is always c_i rows long; rows past the end are padding, held at
zero. A replicated leaf's segment is the whole leaf. The user-visible DTensor of a leaf views the real
rows of its segment, so the optimizer, writing through the DTensors, writes the flat buffer.

All-gather: `local[:S]` is the all-gather input as it is (no copy-in), unless mixed precision casts
it or CPU offload moves it to the GPU (then it is first copied into `stage`). The output, `gathered`,
is rank-major: (W, S). Full parameters are leaf-major, so one batched copy (`_foreach_copy_` over views
built at init) moves each leaf's (W, c_i * rest) block into `full`, where the full parameters live.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _collectives as C

__all__ = ["LeafSlot", "FlatUnit"]


@dataclass(frozen=True)
class LeafSlot:
    """Where one parameter lives in its unit's flat buffers."""

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

    @property
    def seg_numel(self) -> int:
        return self.chunk * self.row_numel

    @property
    def local_shape(self) -> torch.Size:
        return torch.Size((self.local_rows, *self.shape[1:])) if self.sharded else self.shape


@dataclass(frozen=True)
class LeafSpec:
    """What a unit needs to know of one leaf to place it."""

    index: int
    path: str
    shape: torch.Size
    sharded: bool
    trained: bool


def _storage_free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _storage_alloc(t: torch.Tensor, nbytes: int) -> None:
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over the same storage as `t`, with a version counter of its own."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def place(leaves: list[LeafSpec], world: int, rank: int) -> list[LeafSlot]:
    """Lays leaves out in the order of Note [flat unit layout] and computes their offsets."""
    order = (
        [x for x in leaves if x.sharded and not x.trained]
        + [x for x in leaves if x.sharded and x.trained]
        + [x for x in leaves if not x.sharded and x.trained]
        + [x for x in leaves if not x.sharded and not x.trained]
    )
    slots, off, full_off = [], 0, 0
    for x in order:
        if x.sharded:
            rows, row_numel = x.shape[0], x.shape[1:].numel()
            chunk = -(-rows // world)
            local_rows = max(0, min(rows - rank * chunk, chunk))
        else:
            chunk, row_numel = 1, x.shape.numel()
            local_rows = 1
        s = LeafSlot(x.index, x.path, x.shape, x.sharded, x.trained, chunk, row_numel, local_rows, off, full_off)
        off += s.seg_numel
        if x.sharded:
            full_off += world * s.seg_numel
        slots.append(s)
    return slots


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
    """

    def __init__(self, name, leaves, dtype, compute_dtype, reduce_dtype, group, world, rank, device, replicate_group=None, offload=False):
        self.name = name
        self.slots: list[LeafSlot] = place(leaves, world, rank)
        self.dtype, self.compute_dtype, self.reduce_dtype = dtype, compute_dtype, reduce_dtype
        self.group, self.world, self.rank = group, world, rank
        self.replicate_group = replicate_group
        slots = self.slots
        sh = [s for s in slots if s.sharded]
        self.S = sum(s.seg_numel for s in sh)
        self.R = sum(s.seg_numel for s in slots if not s.sharded)
        self.S_frozen = sum(s.seg_numel for s in sh if not s.trained)
        self.R_trained = sum(s.seg_numel for s in slots if not s.sharded and s.trained)
        self.S_trained = self.S - self.S_frozen
        self.full_numel = world * self.S
        offload = offload and torch.device(device).type != "cpu"
        store = dict(device="cpu", pin_memory=True) if offload else dict(device=device)
        kw = dict(device=device)
        self.local = torch.zeros(self.S + self.R, dtype=dtype, **store)
        self.grad = torch.zeros(self.S + self.R, dtype=dtype, **store)
        self.staged = compute_dtype != dtype or offload  # all-gather input needs a copy-in
        self.offload = offload

        def local_view(buf: torch.Tensor, s: LeafSlot) -> torch.Tensor:
            return buf[s.offset : s.offset + s.local_rows * s.row_numel].view(s.local_shape)

        self.local_views = [local_view(self.local, s) for s in slots]
        self.grad_views = [local_view(self.grad, s) for s in slots]

        # Storage-resizable buffers, empty between uses.
        self.full = torch.empty(self.full_numel, dtype=compute_dtype, **kw)
        self.gathered = torch.empty(world * self.S if world > 1 else 0, dtype=compute_dtype, **kw)
        self.stage = torch.empty(self.S + self.R if self.staged else 0, dtype=compute_dtype, **kw)
        n_trained = self.S_trained + self.R_trained
        self.rs_in = torch.empty(world * self.S_trained if world > 1 else 0, dtype=reduce_dtype, **kw)
        self.direct = reduce_dtype == dtype and not offload  # reduce straight into `grad`
        self.rs_out = torch.empty(n_trained if not self.direct else 0, dtype=reduce_dtype, **kw)
        self._bytes = {id(t): t.untyped_storage().nbytes() for t in (self.full, self.gathered, self.stage, self.rs_in, self.rs_out)}
        for t in (self.full, self.gathered, self.stage, self.rs_in, self.rs_out):
            _storage_free(t)
        full_w, gathered_w, self._stage_w = _alias(self.full), _alias(self.gathered), _alias(self.stage)

        rep_src = self.stage if self.staged else self.local
        self.proxies: list[torch.Tensor] = []
        for s in slots:
            if s.sharded:
                v = self.full[s.full_offset : s.full_offset + s.shape.numel()].view(s.shape)
            else:
                v = rep_src[s.offset : s.offset + s.seg_numel].view(s.shape)
            p = v.detach()
            p.requires_grad_(s.trained)
            self.proxies.append(p)
        # Copy-out plan: gathered (W, S) -> full, one (W, c_i * rest) block per sharded leaf.
        if world > 1:
            src = gathered_w.view(world, self.S)
        else:
            src = (self._stage_w if self.staged else self.local)[: self.S].view(1, self.S)
        self._copy_dst = [full_w[s.full_offset : s.full_offset + world * s.seg_numel].view(world, s.seg_numel) for s in sh]
        self._copy_src = [src[:, s.offset : s.offset + s.seg_numel] for s in sh]
        self._sh_trained = [i for i, s in enumerate(slots) if s.sharded and s.trained]
        self._rep_trained = [i for i, s in enumerate(slots) if not s.sharded and s.trained]
        self.num_trained = len(self._sh_trained) + len(self._rep_trained)

    def _alloc(self, t: torch.Tensor) -> None:
        _storage_alloc(t, self._bytes[id(t)])

    # -- gather -------------------------------------------------------------------------------
    @property
    def is_allocated(self) -> bool:
        return any(t.untyped_storage().nbytes() > 0 for t in (self.full, self.gathered, self.stage))

    def start_gather(self):
        """Allocates the full buffer and starts the all-gather; returns the pending work (or None)."""
        self._alloc(self.full)
        if self.staged:
            self._alloc(self.stage)
            with torch.no_grad():
                self._stage_w.copy_(self.local, non_blocking=True)
        if self.world == 1 or self.S == 0:
            return None
        self._alloc(self.gathered)
        src = self.stage[: self.S] if self.staged else self.local[: self.S]
        return C.all_gather(self.gathered, src, self.group, async_op=True)

    def finish_gather(self, work) -> None:
        """Waits for the all-gather and copies the rank-major result into the full parameters."""
        if work is not None:
            work.wait()
        if self._copy_dst:
            with torch.no_grad():
                torch._foreach_copy_(self._copy_dst, self._copy_src)
        if self.world > 1:
            _storage_free(self.gathered)
        if self.staged and not self.R:
            _storage_free(self.stage)  # replicated leaves compute from `stage`; else it is spent

    def free(self) -> None:
        """Drops the full parameters' storage (the tensors stay, empty, for the next gather)."""
        _storage_free(self.full)
        _storage_free(self.gathered)
        if self.staged:
            _storage_free(self.stage)

    # -- gradients ----------------------------------------------------------------------------
    def take_grads(self) -> None:
        """Drops the full gradients (after a reduction, or when a micro-batch keeps them)."""
        for p in self.proxies:
            p.grad = None

    def start_reduce(self, accumulate: bool):
        """Starts reducing the trained full gradients into this rank's `grad` shard.

        Leaves without a gradient count as zero. With `accumulate`, the result is added to `grad`.
        Returns the pending state for `finish_reduce`.
        """
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.proxies]
        self.take_grads()
        direct = self.direct and not accumulate
        if direct:
            out = self.grad[self.S_frozen : self.S + self.R_trained]
        elif not self.direct:
            self._alloc(self.rs_out)
            out = self.rs_out
        else:  # accumulating in the master dtype without offload: a temporary
            out = torch.empty(self.S_trained + self.R_trained, dtype=self.reduce_dtype, device=self.full.device)
        works = []
        with torch.no_grad():
            if self.S_trained:
                sh = [grads[i] for i in self._sh_trained]
                if self.world == 1:
                    torch._chunk_cat(sh, dim=0, num_chunks=1, out=out[: self.S_trained].view(1, -1))
                else:
                    self._alloc(self.rs_in)
                    torch._chunk_cat(sh, dim=0, num_chunks=self.world, out=self.rs_in.view(self.world, -1))
                    works.append(C.reduce_scatter(out[: self.S_trained], self.rs_in, self.group, async_op=True))
            if self.R_trained:
                rep = out[self.S_trained :]
                torch._foreach_copy_(
                    [rep[s.offset - self.S : s.offset - self.S + s.seg_numel].view(s.shape) for s in (self.slots[i] for i in self._rep_trained)],
                    [grads[i] for i in self._rep_trained],
                )
                if self.world > 1:
                    works.append(C.all_reduce(rep, self.group, async_op=True))
        return [works, out, direct, accumulate, self.replicate_group]

    def finish_reduce(self, pending) -> list | None:
        """Waits for a reduction. Returns a new pending state if a hybrid all-reduce was started."""
        works, out, direct, accumulate, replicate = pending
        for w in works:
            w.wait()
        if self.world > 1:
            _storage_free(self.rs_in)
        if replicate is not None:
            return [[C.all_reduce(out, replicate, async_op=True)], out, direct, accumulate, None]
        if not direct:
            with torch.no_grad():
                dst = self.grad[self.S_frozen : self.S + self.R_trained]
                if accumulate:
                    dst.add_(out.to(dst.device, non_blocking=False))
                else:
                    dst.copy_(out)
            if out is self.rs_out:
                _storage_free(self.rs_out)
        return None
