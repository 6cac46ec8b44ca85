"""Recomputation of unit activations in backward (`remat`).

A unit chosen for remat runs its forward under `torch.utils.checkpoint` (non-reentrant): only its
inputs are saved, and its activations are recomputed when the backward reaches it. The unit is
gathered by pre-backward before the recompute starts (a hook on its outputs fires first), and stays
gathered through its backward, so one gather serves both the recompute and the backward.

The recompute runs after `apply`'s re-parametrization has ended, so the wrapper captures the
tensors the unit's module held when its forward ran and puts them back for the recompute.

Note [buffers under remat]: a forward may update its module's buffers in place (BatchNorm's running
statistics and batch count in training mode). Run again by the recompute, it would update them a
second time: statistics off by one extra momentum step, `num_batches_tracked` counting twice. So the
wrapper copies the unit's buffers as its forward starts, and keeps past the forward the copies of
those the forward changed (compared by value: a kernel's in-place update of BatchNorm's statistics
does not move a buffer's version counter); the recompute reads fresh copies of those (what the
forward read) and writes into them, and they are dropped: the module's buffers take exactly the one
update of the step, as without remat. Buffers the forward leaves as they were (masks, rotary tables)
hold no copy past the forward; the recompute reads them directly. The cost: a copy of the unit's
buffers during its forward, and of the changed ones until its recompute.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Sequence

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.checkpoint import checkpoint

from ._tree import compile_patterns

__all__ = ["select_units", "install"]


def select_units(remat: bool | str | Sequence[str], unit_names: list[str]) -> set[int]:
    """The unit indices `remat` chooses: all (True), none (False), or those matching regexes."""
    if remat is True:
        return set(range(len(unit_names)))
    if remat is False or remat is None:
        return set()
    rx = compile_patterns(remat, "remat", "unit names (or a bool)")
    chosen = {i for i, n in enumerate(unit_names) if any(r.fullmatch(n) for r in rx)}
    if not chosen:
        raise ValueError(f"remat={remat!r} matches no unit; the units are {unit_names[:6]}")
    return chosen


def install(info: Any, unit: int) -> None:
    """Wraps the forward of unit `unit` of `info`'s module once (idempotent)."""
    module = info.module.get_submodule(info.unit_names[unit])
    if getattr(module.forward, "_shardfn_remat", False):
        return
    original = module.forward
    ref = weakref.ref(info)  # the module keeps its forward; its model's info must not be kept by it
    name = info.unit_names[unit]

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        model = ref()
        graph = model.whole_step if model is not None else None
        if graph is not None and unit in graph.remat and torch.is_grad_enabled() and torch.compiler.is_compiling():
            return checkpoint(forward.inner, *args, use_reentrant=False, **kwargs)  # Note [remat in the graph] in `_step_graph.py`
        rt = model.runtime if model is not None else None  # Note [unit runtime] in `_runtime.py`
        # In the backward too: a recompute by the model's own checkpoint around the unit must save what
        # its forward saved (non-reentrant checkpointing checks it), remat's checkpoint included.
        if rt is None or not rt.remats(unit) or not torch.is_grad_enabled():
            return forward.inner(*args, **kwargs)
        cache = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)  # only if loaded
        if cache is not None and any(isinstance(x, cache) for x in (*args, *kwargs.values())):
            raise ValueError(
                f"remat of unit {name!r}, which is handed a key/value cache: the recompute would "
                "append to the cache a second time. Pass use_cache=False to the model when training with remat "
                "(as Hugging Face does under gradient checkpointing)"
            )
        params = dict(module.named_parameters(remove_duplicate=False))
        buffers = dict(module.named_buffers(remove_duplicate=False))
        # Note [buffers under remat]: the buffers as the forward reads them, one copy per tensor (a
        # buffer under two names stays one tensor, by its first name).
        first: dict[int, str] = {}
        for n, b in buffers.items():
            first.setdefault(id(b), n)
        saved = {n: buffers[n].clone() for n in first.values()}
        calls = [0]

        def run(*a: Any, **k: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:  # the forward: the module's own buffers, updated once
                with _reparametrize_module(module, {**params, **buffers}):
                    out = forward.inner(*a, **k)
                    # A buffer the forward reassigned (`self.ema = 0.9 * self.ema + ...`) is put back
                    # by the swap's exit: its new value goes into the module's own tensor.
                    now = dict(module.named_buffers(remove_duplicate=False))
                    moved = {n: t for n, t in now.items() if n in buffers and t is not buffers[n]}
                with torch.no_grad():
                    for n, t in moved.items():
                        if t.shape == buffers[n].shape and t.dtype == buffers[n].dtype:
                            buffers[n].copy_(t)
                        else:
                            # Another shape: the module takes the new tensor; the recompute reads
                            # the old one, which still holds what the forward read.
                            owner, _, leaf = n.rpartition(".")
                            module.get_submodule(owner)._buffers[leaf] = t
                # not written (a NaN counts as written: its copy stays): read as it is. On the meta
                # device (the memory estimate) no value tells: the copy is kept, as if written.
                for n in [n for n, t in saved.items() if not t.is_meta and torch.equal(t, buffers[n])]:
                    del saved[n]
                return out
            # A recompute: what the forward read, in fresh copies that take its writes.
            mine = {n: t.clone() for n, t in saved.items()}
            with _reparametrize_module(module, {**params, **{n: mine.get(first[id(b)], b) for n, b in buffers.items()}}):
                return forward.inner(*a, **k)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    forward._shardfn_remat = True  # type: ignore[attr-defined]
    forward.inner = original  # type: ignore[attr-defined]  # what it runs; a compiled unit's goes in here (Note [compiled units])
    module.forward = forward

