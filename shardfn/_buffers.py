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
        self._updating: set | None = None  # modules whose buffers a forward updated (None: not known yet)
        self._saved: list = []
        self._saved_versions: list = []

    def mark(self) -> None:
        """Records the buffers' versions at the start of a step."""
        if self.module is None or self.group is None:
            return
        self._groups = [g for g in (list(m.buffers(recurse=False)) for m in self.module.modules()) if g]
        self._versions = [[b._version for b in g] for g in self._groups]

    def save(self) -> None:
        """Before a step that may be given up and run again (Note [steps off the unit schedule] in
        `_core.py`): copies of the buffers a forward may update. Until a step has shown which
        modules' buffers the forward updates, every buffer is copied; afterwards only those."""
        self._saved, self._saved_versions = [], []
        if self.module is None:
            return
        groups = [(m, list(m.buffers(recurse=False))) for m in self.module.modules()]
        groups = [(m, g) for m, g in groups if g]
        self._saved_versions = [(m, g, [b._version for b in g]) for m, g in groups]
        for m, g in groups:
            if self._updating is None or m in self._updating:
                self._saved += [(b, b.clone()) for b in g]

    def learn(self) -> None:
        """After a step: which modules' buffers its forward updated (those are copied from now on)."""
        changed = {m for m, g, vs in self._saved_versions if any(b._version != v for b, v in zip(g, vs))}
        self._updating = changed | (self._updating or set())
        self._saved, self._saved_versions = [], []

    def restore(self) -> None:
        """The step is given up: the buffers get their values from before it back."""
        saved = {id(b) for b, _ in self._saved}
        for m, g, vs in self._saved_versions:
            if any(b._version != v and id(b) not in saved for b, v in zip(g, vs)):
                raise NotImplementedError(
                    f"a buffer of {type(m).__name__} changed in a step that is run again, and no copy of it was kept "
                    "(its module had not updated buffers in earlier steps)"
                )
        with torch.no_grad():
            for b, c in self._saved:
                b.copy_(c)

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
                for b, x in zip(bufs, flat.split([b.numel() for b in bufs])):
                    b.copy_(x.view_as(b))
        self._groups = []
