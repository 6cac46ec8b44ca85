"""The tensor-parallel layout of a leaf: which dim a spec splits over `tp`, the FSDP dim within
that split, and a tp rank's part (Note [tensor parallel forward] in `_tp.py`, for the forward).

Note [tensor parallel layout]
-----------------------------
The flat engine (Note [flat unit layout] in `_flat.py`) knows nothing of `tp`: a leaf's
"full" value, for it, is this rank's tp shard, split over dim 0 across the `dp` group only,
gathered unit by unit over `dp` and reduce-scattered over `dp` (the mean over the dp ranks, Note
[the mean over ranks]; ranks that differ only in their tp coordinate get the same batch and compute
the same loss; the first step checks that they hold the same batch). The state's DTensors live on the whole 2-D mesh with the placements of both splits
(`P(None, "tp")` FSDP'd on dim 0 is `P("dp", "tp")`; `P("tp", None)` FSDP'd inside each tp shard is
`P(("tp", "dp"), None)`, rows split over tp first: Note [layouts of a spec] in `_spec.py`), so that
gather, save and describe see the true layout.

Forward. When a unit is gathered, the module computes on DTensors over the `tp` sub-mesh built on
"""

from __future__ import annotations

import torch

from ._spec import P, _chunk

__all__ = ["split_specs", "dp_dim", "state_spec", "local_part", "local_shape"]


def split_specs(path: str, shape: torch.Size, spec: P, dp: str, tp: str, dp_size: int) -> int | None:
    """The dim `spec` splits over `tp` (None: whole on tp), checking that `dp` shares a dim with `tp`
    only as FSDP within the tp shard does (`(tp, dp)`; either order when `dp` has one rank)."""
    tp_dim = None
    for d in range(len(spec)):
        axes = spec.axes_of(d)
        if dp in axes and axes not in ((dp,), (tp, dp)) and not (dp_size == 1 and axes == (dp, tp)):
            # (dp, tp) on one dim is dp-major: a tp rank's rows would be strided, not the block the
            # tensor-parallel forward computes on; laying it out as (tp, dp) instead would silently
            # give another layout than the spec says.
            raise NotImplementedError(
                f"leaf {path!r} (shape {tuple(shape)}) has spec {spec!r}: on a ({dp}, {tp}) mesh the train step "
                f"FSDP-shards over {dp!r} within the {tp!r} shard; on dim {d} list them as ({tp!r}, {dp!r})"
            )
        if tp in axes:
            tp_dim = d
    return tp_dim


def dp_dim(spec: P, dp: str) -> int:
    """The dim a leaf is FSDP'd on over `dp`: the one `spec` names `dp` on, else dim 0."""
    return next((d for d in range(len(spec)) if dp in spec.axes_of(d)), 0)


def state_spec(tp_dim: int | None, fsdp: bool, ndim: int, dp: str, tp: str, fsdp_dim: int = 0) -> P:
    """The spec of a leaf split on `tp_dim` over tp and FSDP'd over dp on `fsdp_dim` within its tp
    shard (Note [tensor parallel forward]): `P(("tp", "dp"), None)`, `P("dp", "tp")`, `P("tp", "dp")`, ..."""
    entries: list = [None] * ndim
    if tp_dim is not None:
        entries[tp_dim] = tp
    if fsdp:
        entries[fsdp_dim] = (tp, dp) if tp_dim == fsdp_dim else dp
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def local_part(full: torch.Tensor, tp_dim: int | None, rank: int, size: int) -> torch.Tensor:
    """This tp rank's part of `full` (DTensor's Shard split: chunks of ceil(n / size))."""
    if tp_dim is None or size == 1:
        return full
    lo, hi = _chunk(0, full.shape[tp_dim], size, rank)
    return full.narrow(tp_dim, lo, hi - lo)


def local_shape(shape: torch.Size, tp_dim: int | None, rank: int, size: int) -> torch.Size:
    """The shape of `local_part` of a tensor of `shape`."""
    if tp_dim is None or size == 1:
        return torch.Size(shape)
    lo, hi = _chunk(0, shape[tp_dim], size, rank)
    return torch.Size((*shape[:tp_dim], hi - lo, *shape[tp_dim + 1 :]))
