"""`apply` on a sharded tree: a forward that gathers unit by unit (inference on a sharded model).

The root unit is gathered for the whole call; each other unit is gathered when its forward starts
and freed when it ends, so a rank never holds more than the root and one unit in full. The full
tensors a unit's modules compute on are placeholders whose storage exists only while their unit
runs (Note [freed memory] 1 in `_debug.py`; in debug mode they are poisoned before each free).
No gradient flows back to the DTensors (use `sf.gather` or a train step for that).

Note [reads outside a unit, in inference]
-----------------------------------------
A model may read a unit's parameter outside that unit's forward: a head tied by hand to an
embedding that is a unit (`F.linear(h, self.emb.weight)`), another method of the unit
(`self.emb.attend(h)`), a block's weight after the block ran. Here that memory is given back, and
torch refuses the read ("data is not allocated yet", "out of bounds for storage of size 0"): the
call raises a `ValueError` that says so and what to do (`apply(sf.gather(tree), ...)`, or make the
reader part of the unit). The attributes stay plain tensors outside their unit, rather than
`Param`s that gather on a read as in a train step: code that branches on tensor subclasses
(`nn.TransformerEncoder`'s fast path tests `has_torch_function` on its first layer's weights)
must take the path it takes on the module itself, whose outputs differ at padded positions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import _collectives as C
from ._flat import _alias, _storage_alloc, _storage_free
from ._runtime import RuntimeDefaults
from ._tree import tree_flatten_with_paths


class _Unit:
    def __init__(self, leaves: list[tuple[str, DTensor]]):
        self.sources = [d for _, d in leaves]
        numel = sum(d.numel() for _, d in leaves)
        first = leaves[0][1]
        self.buf = torch.empty(numel, dtype=first.dtype, device=first._local_tensor.device)
        self.nbytes = self.buf.untyped_storage().nbytes()
        self.placeholders, off = {}, 0
        for path, d in leaves:
            self.placeholders[path] = self.buf[off : off + d.numel()].view(d.shape)
            off += d.numel()
        _storage_free(self.buf)

    def gather(self) -> None:
        _storage_alloc(self.buf, self.nbytes)
        writer = _alias(self.buf)
        with torch.no_grad():
            off = 0
            for d in self.sources:
                full = C.full_tensor(d, "apply on a sharded tree") if isinstance(d, DTensor) else d
                writer[off : off + d.numel()].copy_(full.reshape(-1))
                off += d.numel()

    def free(self) -> None:
        _storage_free(self.buf)


# What torch says when an op reads a tensor whose storage was given back (`resize_(0)`).
_FREED_READS = ("data is not allocated yet", "out of bounds for storage of size 0")


class ShardedForward(RuntimeDefaults):
    """Context: placeholders for every parameter name, and the runtime that fills them per unit."""

    def __init__(self, apply, params: Any):
        self.apply = apply
        self.info = info = apply.info
        paths, leaves, _ = tree_flatten_with_paths(params)
        if set(paths) != set(info.param_paths):
            apply.flat_params(params)  # raises the error naming the mismatch
        groups: dict[int, list[tuple[str, Any]]] = {}
        for path, leaf in zip(paths, leaves):
            groups.setdefault(info.unit_of[path], []).append((path, leaf))
        self.units = {u: _Unit(g) for u, g in groups.items()}
        self.flat: dict[str, torch.Tensor] = {}
        for unit in self.units.values():
            for path, ph in unit.placeholders.items():
                for name in info.aliases[path]:
                    self.flat[name] = ph

    def __enter__(self):
        if -1 in self.units:
            self.units[-1].gather()
        return self.flat, self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        for unit in self.units.values():
            unit.free()
        if isinstance(exc, RuntimeError) and any(m in str(exc) for m in _FREED_READS):
            raise ValueError(
                "apply on a sharded tree: the model read a unit's parameter outside that unit's forward (a head tied "
                "by hand to an embedding unit, another method of a unit, a block's weight after it ran), whose memory "
                "is given back as the unit's forward ends (Note [reads outside a unit, in inference] in "
                "shardfn/_inference.py). Call apply(sf.gather(tree), ...) (the whole model on every rank), or choose "
                "units that hold what reads them (a tied embedding and head in one unit, or in the root)"
            ) from exc

    # runtime protocol (see shardfn/_runtime.py)
    def pre_forward(self, info, u: int, args: Any, kwargs: dict) -> None:
        if info is self.apply.info and u in self.units:
            self.units[u].gather()
        return None

    def post_forward(self, info, u: int, output: Any) -> None:
        if info is self.apply.info and u in self.units:
            self.units[u].free()
        return None
