"""Module buffers that the forward updates (BatchNorm's running statistics), kept equal on all ranks.

Note [buffers]
--------------
Each rank runs the forward on its own share of the batch, so a buffer the forward updates (BatchNorm's
`running_mean`, an EMA codebook) would drift apart across ranks: each rank's statistics are those of
its own data. DDP avoids it by broadcasting rank 0's buffers before every forward
(`broadcast_buffers=True`, its default). A train step does the same once per step, after the
backward, for the buffers of every module that changed one of them on some rank, in one broadcast
per dtype from the mesh's first rank: afterwards every rank holds rank 0's buffers, and a model
whose forward updates no buffer costs nothing. (The statistics are those of rank 0's share of the
batch, as with DDP; a single process on the global batch sees all of it, so data-parallel BatchNorm
never matches it exactly: use SyncBatchNorm-style statistics in the model for that.)

A forward changes a buffer in one of three ways, and each is seen: in place through autograd's
view of it (its version counter moves), by reassignment (`self.ema = 0.9 * self.ema + ...`: the
module holds another tensor), or where no counter moves (`self.ema.data.mul_(...)`, a kernel that
writes its running statistics itself, as `F.batch_norm` does). The last is seen by value: until a
step has shown which modules update buffers, a step keeps a copy of every buffer and compares;
afterwards only the buffers of the modules that did (those are compared every step). So a module
that starts updating a buffer out of autograd's sight after the first step is not synced; one
updated in place or reassigned always is. Which modules changed travels with the step's one
all-reduce of its loss and norm, so every rank broadcasts the same buffers (a change on one rank
only, a routed expert's statistics, is synced as well, and the module is compared by value on
every rank from then on), with no collective of its own. A reassigned buffer may have another
shape on each rank (a mask grown to the longest sequence seen): then rank 0's shapes are sent
first, in one small broadcast, and every rank takes them, as DDP's broadcast would. Buffers a
module registers after the step's first use (lazily, in a forward) are not watched.

The copies serve a step that fails too: the buffers that have copies get their values (and
tensors) from before it back, so an exception in `loss_fn` leaves the buffers of the modules known
to update them as they were, as it leaves the parameters.

Reading the flags back is a host sync once per step on a GPU, for models with buffers only.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from . import _collectives as C
from ._mesh import mesh_group

__all__ = ["ModuleBuffers"]


class ModuleBuffers:
    """The buffers of `module` (None: none), synced from the mesh's first rank (Note [buffers])."""

    def __init__(self, module: torch.nn.Module | None, mesh: DeviceMesh):
        self.group = mesh_group(mesh) if mesh.size() > 1 else None
        self.src = int(mesh.mesh.flatten()[0])
        # The modules that hold buffers, in one order on every rank (the flags of `changed` follow it).
        self.owners = [m for m in module.modules() if m._buffers] if module is not None else []
        self._updating: set | None = None  # modules whose buffers a forward changed (None: no step yet)
        self._before: list[list[tuple]] = []  # per owner: (name, tensor, version, copy or None)

    def start(self) -> None:
        """A step starts: each buffer's tensor and version, and copies of those a forward may
        change (every buffer until a step has shown which modules change theirs)."""
        self._before = []
        for m in self.owners:
            keep = self._updating is None or m in self._updating
            self._before.append([(n, b, b._version, b.detach().clone() if keep else None) for n, b in m._buffers.items() if b is not None])

    def changed(self) -> list[bool]:
        """Per owner, whether this rank's step changed one of its buffers (reassigned, in place, or
        by value where a copy was kept); then per owner, whether it reassigned one (the new tensor's
        shape may differ between ranks: a cache grown to the longest sequence seen)."""
        moved, swapped = [], []
        for m, entries in zip(self.owners, self._before):
            new = any(m._buffers.get(n) is not b for n, b, _, _ in entries)
            # Counters first: a value comparison is a host sync on a GPU.
            moved.append(new or any(b._version != v for _, b, v, _ in entries)
                         or any(c is not None and not torch.equal(c, b) for _, b, _, c in entries))
            swapped.append(new)
        return moved + swapped

    def restore(self, strict: bool = True) -> None:
        """The step is given up: the buffers get their tensors and values from before it back.
        `strict`: a buffer changed in place with no copy kept raises (a step about to be run again
        must not see it changed); otherwise (the step failed) it stays as it is."""
        lost = [m for m, entries in zip(self.owners, self._before) for _, b, v, c in entries if c is None and b._version != v]
        if lost and strict:  # checked before anything is put back
            raise NotImplementedError(
                f"a buffer of {type(lost[0]).__name__} changed in a step that is run again, and no copy of it was kept "
                "(its module had not updated buffers in earlier steps)"
            )
        with torch.no_grad():
            for m, entries in zip(self.owners, self._before):
                for n, b, _, c in entries:
                    if m._buffers.get(n) is not b:
                        m._buffers[n] = b
                    if c is not None:
                        b.copy_(c)

    def sync(self, changed: list[bool], swapped: list[bool]) -> None:
        """Broadcasts from the first rank the buffers of the owners flagged in `changed`, and
        remembers them as updating (Note [buffers]). The flags are the union over ranks of
        `changed()`'s, the same on every rank; where an owner reassigned a buffer on some rank
        (`swapped`), rank 0's shapes and dtypes go first and the others take them."""
        self._updating = {m for m, f in zip(self.owners, changed) if f} | (self._updating or set())
        if self.group is None or not any(changed):
            return
        slots = [(m, n) for m, f, entries in zip(self.owners, changed, self._before) if f for n, *_ in entries if m._buffers.get(n) is not None]
        if any(swapped):
            layout = C.broadcast_object([(tuple(m._buffers[n].shape), m._buffers[n].dtype) for m, n in slots], "the train step (module buffers)",
                                        src=self.src, group=self.group)
            for (m, n), (shape, dtype) in zip(slots, layout):
                t = m._buffers[n]
                if tuple(t.shape) != shape or t.dtype != dtype:
                    m._buffers[n] = torch.empty(shape, dtype=dtype, device=t.device)
        bufs, seen = [], set()
        for m, n in slots:
            b = m._buffers[n]
            if id(b) not in seen:
                seen.add(id(b))
                bufs.append(b)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in bufs:
            by_dtype.setdefault(b.dtype, []).append(b)
        for same in by_dtype.values():
            flat = torch.cat([b.detach().reshape(-1) for b in same])
            C.broadcast(flat, self.src, self.group)
            with torch.no_grad():
                for b, x in zip(same, flat.split([b.numel() for b in same])):
                    b.copy_(x.view_as(b))
