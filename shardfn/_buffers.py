"""Module buffers that the forward updates (BatchNorm's running statistics), kept equal on all ranks.

Note [buffers]
--------------
Each rank runs the forward on its own share of the batch, so a buffer the forward updates in place
(BatchNorm's `running_mean`, `running_var`, `num_batches_tracked`) would drift apart across ranks:
each rank's statistics are those of its own data. DDP avoids it by broadcasting rank 0's buffers
before every forward (`broadcast_buffers=True`, its default). A train step does the same, once
per step after the backward, for the buffers of every module one of whose buffers changed version
during the step (an in-place update bumps it; BatchNorm's kernel updates the running statistics
without a bump, but always adds to `num_batches_tracked`), in one broadcast per dtype from the
mesh's first rank: afterwards every rank holds rank 0's buffers, and a model whose forward updates
no buffer costs nothing. (The
statistics are those of rank 0's share of the batch, as with DDP; a single process on the global
batch sees all of it, so data-parallel BatchNorm never matches it exactly: use SyncBatchNorm-style
statistics in the model for that.)
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
        self.module = module
        self.mesh = mesh
        self.group = mesh_group(mesh) if mesh.size() > 1 else None
        self.src = int(mesh.mesh.flatten()[0])
        self._versions: list[list[int]] = []
        self._groups: list[list[torch.Tensor]] = []  # the buffers of each module that has some

    def mark(self) -> None:
        """Records the buffers' versions at the start of a step."""
        if self.module is None or self.group is None:
            return
        self._groups = [list(m._buffers.values()) for m in self.module.modules() if any(b is not None for b in m._buffers.values())]
        self._groups = [[b for b in g if b is not None] for g in self._groups]
        self._versions = [[b._version for b in g] for g in self._groups]

    def sync(self) -> None:
        """Broadcasts the buffers the step changed from the first rank to all."""
        if not self._groups:
            return
        changed = [b for g, vs in zip(self._groups, self._versions) if any(b._version != v for b, v in zip(g, vs)) for b in g]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in changed:
            by_dtype.setdefault(b.dtype, []).append(b)
        for bufs in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in bufs])
            C.broadcast(flat, self.src, self.group)
            with torch.no_grad():
                torch._foreach_copy_(bufs, [x.view_as(b) for x, b in zip(flat.split([b.numel() for b in bufs]), bufs)])
        self._groups = []
