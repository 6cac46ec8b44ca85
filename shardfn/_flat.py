"""Per-unit flat buffers: the sharded storage of one unit, and its gather, free and reduce-scatter.

Note [flat unit layout]
-----------------------
Each unit keeps this rank's shards of all its parameters in ONE flat buffer, `local`:

    local = [ sharded segment: leaf 0 rows r*c0 .. (r+1)*c0, leaf 1 rows r*c1 .., ... | replicated leaves ]

Leaf i of shape (n_i, *rest) is split over dim 0 in chunks of c_i = ceil(n_i / W) rows, as DTensor's
`Shard(0)` splits it: rank r holds rows [r*c_i, min(n_i, (r+1)*c_i)), which may be fewer than c_i or
none at all. Its segment in `local` is always c_i rows long; the rows past the end are padding, held
at zero. The user-visible DTensor of the leaf views the real rows of its segment, so the optimizer,
writing through the DTensors, writes the flat buffer.

All-gather: `local`'s sharded segment is the all-gather input as it is (no copy-in, unless mixed
precision casts it). The output, `gathered`, is rank-major: (W, S) with S the segment length. Full
parameters are leaf-major, so one batched copy (`_foreach_copy_` over views built at init) moves each
leaf's (W, c_i * rest) block into `full`, where the unit's full parameters live, each a view.

Free: `full` and `gathered` keep their tensor objects for the whole run and only their storage is
resized to 0 and back (the FSDP paper's mechanism). The full parameters handed to `loss_fn` are leaf
tensors that view `full`; autograd saves them in forward and reads them in backward, after the unit was
freed and gathered again into the same storage. Writes go through a second tensor aliasing that
storage, with its own version counter, so refilling is not seen as an in-place change by autograd.

Reduce-scatter: the full gradients are chunked and padded with `torch._chunk_cat` into a (W, S)
buffer in the reduce dtype (rank-major again), and reduce-scattered straight into this rank's flat
gradient buffer, `grad`, whose per-leaf views are the gradient DTensors' local tensors. Replicated
leaves are all-reduced instead, in their own segment.
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
    chunk: int  # rows per rank (sharded) / rows (replicated)
    row_numel: int
    local_rows: int  # rows this rank really holds
    offset: int  # start in the local flat buffer (its segment)
    full_offset: int  # start in the full buffer (sharded leaves)

    @property
    def seg_numel(self) -> int:
        return self.chunk * self.row_numel

    @property
    def local_shape(self) -> torch.Size:
        return torch.Size((self.local_rows, *self.shape[1:])) if self.sharded else self.shape


def _storage_free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _storage_alloc(t: torch.Tensor, nbytes: int) -> None:
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over the same storage as contiguous `t`, with a version counter of its own."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


class FlatUnit:
    """One sharding unit's flat buffers and the collectives over them.

    Args:
        name: the unit's module path ("" for the root unit).
        slots: its leaves' places (see Note [flat unit layout]).
        dtype: the master (parameter) dtype of every leaf.
        compute_dtype: the dtype the unit is gathered in and computes in.
        reduce_dtype: the dtype gradients are reduced in.
        group / world / rank: the process group that shards and reduces.
        device: where the buffers live.
        requires_grad: per slot, whether the leaf is trained.
    """

    def __init__(self, name, slots, dtype, compute_dtype, reduce_dtype, group, world, rank, device, requires_grad):
        self.name = name
        self.slots: list[LeafSlot] = slots
        self.dtype, self.compute_dtype, self.reduce_dtype = dtype, compute_dtype, reduce_dtype
        self.group, self.world, self.rank = group, world, rank
        sh = [s for s in slots if s.sharded]
        rep = [s for s in slots if not s.sharded]
        self.sharded_slots, self.replicated_slots = sh, rep
        self.S = sum(s.seg_numel for s in sh)  # sharded segment length
        self.R = sum(s.seg_numel for s in rep)  # replicated segment length
        self.full_numel = sum(s.seg_numel * world for s in sh)
        kw = dict(device=device)
        self.local = torch.zeros(self.S + self.R, dtype=dtype, **kw)
        self.grad = torch.zeros(self.S + self.R, dtype=dtype, **kw)
        self.cast = compute_dtype != dtype

        def local_view(buf: torch.Tensor, s: LeafSlot) -> torch.Tensor:
            return buf[s.offset : s.offset + s.local_rows * s.row_numel if s.sharded else s.offset + s.seg_numel].view(s.local_shape)

        self.local_views = [local_view(self.local, s) for s in slots]
        self.grad_views = [local_view(self.grad, s) for s in slots]

        # Full buffers: `full` for sharded leaves, `rep_full` for replicated ones under a cast.
        # Without a cast, replicated leaves compute straight from `local` and are never freed.
        self.full = torch.empty(self.full_numel, dtype=compute_dtype, **kw)
        self.gathered = torch.empty(self.world * self.S if world > 1 else 0, dtype=compute_dtype, **kw)
        self.cast_in = torch.empty(self.S + self.R if self.cast else 0, dtype=compute_dtype, **kw)
        self.full_bytes = self.full.untyped_storage().nbytes()
        self.gathered_bytes = self.gathered.untyped_storage().nbytes()
        self.cast_bytes = self.cast_in.untyped_storage().nbytes()
        full_w, gathered_w = _alias(self.full), _alias(self.gathered)
        rep_src = self.cast_in if self.cast else self.local

        self.proxies: list[torch.Tensor] = [None] * len(slots)  # type: ignore[list-item]
        for i, s in enumerate(slots):
            if s.sharded:
                v = self.full[s.full_offset : s.full_offset + s.shape.numel()].view(s.shape)
            else:
                v = rep_src[s.offset : s.offset + s.seg_numel].view(s.shape)
            p = v.detach()
            p.requires_grad_(requires_grad[i])
            self.proxies[i] = p
        # Copy-out plan: gathered (W, S) -> full, one (W, c_i * rest) block per sharded leaf.
        src = gathered_w.view(world, self.S) if world > 1 else (self.cast_in if self.cast else self.local)[: self.S].view(1, self.S)
        self._copy_dst = [full_w[s.full_offset : s.full_offset + world * s.seg_numel].view(world, s.seg_numel) for s in sh]
        self._copy_src = [src[:, s.offset : s.offset + s.seg_numel] for s in sh]
        self._trained = [i for i, s in enumerate(slots) if requires_grad[i]]
        self._sh_idx = [i for i, s in enumerate(slots) if s.sharded]
        self._rep_idx = [i for i, s in enumerate(slots) if not s.sharded]
        self.rs_in = torch.empty(world * self.S, dtype=reduce_dtype, **kw)
        self.rs_bytes = self.rs_in.untyped_storage().nbytes()
        self.rs_out = torch.empty(self.S + self.R if reduce_dtype != dtype else 0, dtype=reduce_dtype, **kw)
        for t in (self.full, self.gathered, self.cast_in, self.rs_in, self.rs_out):
            _storage_free(t)
        self.rs_out_bytes = (self.S + self.R) * torch.empty(0, dtype=reduce_dtype).element_size() if reduce_dtype != dtype else 0
        self.num_trained = len(self._trained)

    # -- gather -------------------------------------------------------------------------------
    @property
    def is_allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0 or (self.cast and self.cast_in.untyped_storage().nbytes() > 0)

    def start_gather(self):
        """Allocates the full buffer and starts the all-gather; returns the pending work (or None)."""
        _storage_alloc(self.full, self.full_bytes)
        if self.cast:
            _storage_alloc(self.cast_in, self.cast_bytes)
            with torch.no_grad():
                _alias(self.cast_in).copy_(self.local)
        if self.world == 1 or self.S == 0:
            return None
        _storage_alloc(self.gathered, self.gathered_bytes)
        src = self.cast_in[: self.S] if self.cast else self.local[: self.S]
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

    def free(self) -> None:
        """Drops the full parameters' storage (the tensors stay, empty, for the next gather)."""
        _storage_free(self.full)
        if self.cast:
            _storage_free(self.cast_in)

    # -- gradients ----------------------------------------------------------------------------
    def start_reduce(self, accumulate: bool):
        """Reduces the full gradients of the proxies into this rank's `grad` shard; returns works.

        Leaves without a gradient count as zero. With `accumulate`, the result is added to `grad`.
        """
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.proxies]
        for p in self.proxies:
            p.grad = None
        works = []
        direct = not accumulate and self.reduce_dtype == self.dtype
        out = self.grad if direct else self.rs_out if self.reduce_dtype != self.dtype else torch.empty_like(self.grad)
        if self.reduce_dtype != self.dtype:
            _storage_alloc(self.rs_out, self.rs_out_bytes)
        with torch.no_grad():
            if self.S:
                sh = [grads[i] for i in self._sh_idx]
                if self.world == 1:
                    torch._chunk_cat(sh, dim=0, num_chunks=1, out=out[: self.S].view(1, self.S))
                else:
                    _storage_alloc(self.rs_in, self.rs_bytes)
                    torch._chunk_cat(sh, dim=0, num_chunks=self.world, out=self.rs_in.view(self.world, self.S))
                    works.append(C.reduce_scatter(out[: self.S], self.rs_in, self.group, async_op=True))
            if self.R:
                rep = out[self.S :]
                torch._foreach_copy_([rep[s.offset - self.S : s.offset - self.S + s.seg_numel].view(s.shape) for s in self.replicated_slots], [grads[i] for i in self._rep_idx])
                if self.world > 1:
                    works.append(C.all_reduce(rep, self.group, async_op=True))
        return (works, out, direct, accumulate)

    def finish_reduce(self, pending) -> None:
        works, out, direct, accumulate = pending
        for w in works:
            w.wait()
        if self.world > 1:
            _storage_free(self.rs_in)
        if not direct:
            with torch.no_grad():
                if accumulate:
                    self.grad.add_(out)
                else:
                    self.grad.copy_(out)
        if self.reduce_dtype != self.dtype:
            _storage_free(self.rs_out)
