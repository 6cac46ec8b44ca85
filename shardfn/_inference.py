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
(`self.emb.attend(h)`), a block's weight after the block ran. Outside its unit's forward, a
parameter's module attribute is therefore not the placeholder (whose memory is given back) but a
`Param` (`_param.py`), as in a train step: metadata needs nothing, and any op on it receives the
leaf's full value, gathered on its own (one collective, so every rank makes the same reads, as for
any collective) and kept until the call returns. As the unit's forward starts, its attributes
become the gathered placeholders, so the module computes on plain tensors; as it ends, the
`Param`s come back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import _collectives as C
from ._flat import _alias, _storage_alloc, _storage_free
from ._param import Param
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
        # Note [reads outside a unit, in inference]: outside its unit's forward, a unit's leaf is a
        # Param that gathers it on its own when read; (unit, j) -> its source, and its value once read.
        self._sources: dict[tuple[int, int], Any] = {}
        self._read_values: dict[tuple[int, int], torch.Tensor] = {}
        self._swaps: dict[int, list[tuple[Any, str, torch.Tensor, Param]]] = {}
        for u, unit in self.units.items():
            for j, ((path, ph), src) in enumerate(zip(unit.placeholders.items(), unit.sources)):
                if u == -1:  # the root: gathered for the whole call
                    for name in info.aliases[path]:
                        self.flat[name] = ph
                    continue
                self._sources[(u, j)] = src
                outside = Param.make(ph, self._read, (u, j))
                for name in info.aliases[path]:
                    self.flat[name] = outside
                    owner, _, attr = name.rpartition(".")
                    self._swaps.setdefault(u, []).append((info.module.get_submodule(owner), attr, ph, outside))

    def __enter__(self):
        if -1 in self.units:
            self.units[-1].gather()
        return self.flat, self

    def __exit__(self, *exc: object) -> None:
        for unit in self.units.values():
            unit.free()
        self._read_values.clear()

    def _read(self, p: Param) -> torch.Tensor:
        """A unit's leaf read outside the unit's forward: its full value, gathered once per call."""
        value = self._read_values.get(p.where)
        if value is None:
            src = self._sources[p.where]
            with torch.no_grad():
                value = C.full_tensor(src, "apply on a sharded tree") if isinstance(src, DTensor) else src.detach()
            self._read_values[p.where] = value
        return value

    def _swap(self, u: int, inside: bool) -> None:
        """Unit `u`'s module attributes: its gathered placeholders (its forward runs) or its Params."""
        for mod, attr, ph, outside in self._swaps.get(u, ()):
            new, old = (ph, outside) if inside else (outside, ph)
            # Only where `apply` bound this call's own tensor (a module may have been swapped out).
            if mod._parameters.get(attr) is old:
                mod._parameters[attr] = new

    # runtime protocol (see shardfn/_runtime.py)
    def pre_forward(self, info, u: int, args: Any, kwargs: dict) -> None:
        if info is self.apply.info and u in self.units:
            self.units[u].gather()
            self._swap(u, True)
        return None

    def post_forward(self, info, u: int, output: Any) -> None:
        if info is self.apply.info and u in self.units:
            self._swap(u, False)
            self.units[u].free()
        return None
