"""Forward-mode AD (`torch.func.jvp`) over DTensor leaves.

Note [dual DTensors]:
`torch.func.jvp(f, (sharded,), (tangents,))` pairs each primal with its tangent (`make_dual`).
Forward AD checks there that the tangent has the primal's layout (`_has_same_storage_numel`) and,
where it has not, makes a zero tensor with the primal's layout to copy it into
(`_new_zeros_with_same_feature_meta`). DTensor has no rule for either op, so a jvp over a sharded
tree failed before `f` ran. The two rules here answer them for DTensors: the layouts agree when
the specs (mesh, placements, global shape) agree and the local shards do; the zeros are the
primal's spec over zeros shaped as its local shard, into which forward AD copies the tangent's
shard (a tangent whose shard is a strided view, say). A tangent laid out otherwise (a plain
tensor, whose rows could mean the full tensor or the shard; other placements; another dtype,
which the copy would cast) is a `ValueError` with the fix. Past `make_dual`, `sf.gather`'s jvp all-gathers the tangent shards and the rest of `f`
runs on plain tensors, so the jvp of `f(sf.gather(p))` (or of `apply(p, x)`) is exactly the
unsharded jvp of each rank's own function. (Reverse mode averages over ranks, as the gradient of
the gather is the reduce-scatter of the mean; forward mode has nothing to reduce. The two compose:
Note [the mean over ranks] in `_shard.py`.)

The rules go in DTensor's table of op handlers, which has no public entry point yet; if that
table moves, jvp over sharded trees raises DTensor's own error again and nothing else changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ._functorch import refuse_tracing

__all__ = ["install"]

aten = torch.ops.aten


def _same_storage_numel(op: Any, args: tuple, kwargs: dict) -> bool:
    a, b = args
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)) or a._spec != b._spec:
        return False
    return bool(aten._has_same_storage_numel(a._local_tensor, b._local_tensor))


def _zeros_like_primal(op: Any, args: tuple, kwargs: dict) -> Any:
    tangent, primal = args
    refuse_tracing()  # torch.func.linearize makes its tangents by expanding a scalar
    if not isinstance(primal, DTensor):  # a DTensor tangent for a plain primal: forward AD's own error
        raise ValueError(
            f"a DTensor tangent was given for a plain tensor of shape {tuple(primal.shape)}: give a plain "
            "tangent for a plain primal, and a DTensor laid out as the primal for a sharded one"
        )
    if not isinstance(tangent, DTensor):
        raise ValueError(
            f"a plain tensor of shape {tuple(tangent.shape)} was given as the tangent of a sharded leaf "
            f"({primal._spec}): shard the tangents as the params, `sf.shard(tangents, specs, mesh)`"
        )
    got = (tangent.device_mesh, tangent.placements, tuple(tangent.shape), tangent.dtype)
    want = (primal.device_mesh, primal.placements, tuple(primal.shape), primal.dtype)
    if got != want:
        raise ValueError(
            f"the tangent of a sharded leaf must be laid out as the leaf: the leaf is {want[1]} {want[2]} {want[3]}, "
            f"the tangent {got[1]} {got[2]} {got[3]}{' on another mesh' if got[0] != want[0] else ''}. Shard the "
            "tangents as the params, `sf.shard(tangents, specs, mesh)`, with the params' dtype"
        )
    local = aten._new_zeros_with_same_feature_meta(tangent._local_tensor, primal._local_tensor, **kwargs)
    return DTensor(local, primal._spec, requires_grad=False)


def install() -> None:
    """Adds the two rules of Note [dual DTensors] to DTensor's op handlers (idempotent)."""
    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    if isinstance(handlers, dict):
        handlers.setdefault(aten._has_same_storage_numel.default, _same_storage_numel)
        handlers.setdefault(aten._new_zeros_with_same_feature_meta.default, _zeros_like_primal)
