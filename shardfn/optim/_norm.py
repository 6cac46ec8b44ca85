"""The global L2 norm of a (possibly sharded) pytree, with one all-reduce."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import _collectives as C
from .._mesh import mesh_group
from ._local import flatten, locals_

__all__ = ["global_norm", "local_sumsq"]

def _replicas(x: DTensor) -> int:
    n = 1
    for dim, placement in enumerate(x.placements):
        if placement.is_partial():
            raise ValueError(
                f"global_norm needs reduced leaves, got a DTensor with placements {x.placements}; "
                "redistribute Partial leaves to Shard or Replicate first"
            )
        if placement.is_replicate():
            n *= x.device_mesh.size(dim)
    return n


def local_sumsq(tensors: list[torch.Tensor], weights: list[float] | None = None) -> torch.Tensor:
    """The sum of squares of `tensors` (each weighted, if given) on this rank: one foreach kernel,
    in fp32 (in fp64 when every tensor is fp64), on the first tensor's device. The one place a norm
    is computed (`global_norm` and the train step add these sums over ranks)."""
    device = tensors[0].device
    if all(t.dtype == torch.float64 for t in tensors):  # an fp64 model clips exactly
        sq = torch.stack([n if n.device == device else n.to(device) for n in torch._foreach_norm(tensors, 2)]).square_()
        if weights is not None and any(w != 1.0 for w in weights):
            sq = sq * torch.tensor(weights, dtype=torch.float64).to(device, non_blocking=True)
        return sq.sum()
    wide = [i for i, t in enumerate(tensors) if t.dtype == torch.float64]  # kept in fp64, summed in fp32
    norms = list(torch._foreach_norm([t for t in tensors if t.dtype != torch.float64], 2, dtype=torch.float32)) if len(wide) < len(tensors) else []
    for i, n in zip(wide, torch._foreach_norm([tensors[i] for i in wide], 2) if wide else ()):
        norms.insert(i, n.float())
    sq = torch.stack([n if n.device == device else n.to(device) for n in norms]).square_()
    if weights is not None and any(w != 1.0 for w in weights):
        sq = sq * torch.tensor(weights, dtype=torch.float32).to(device, non_blocking=True)
    return sq.sum()


def global_norm(tree: Any) -> torch.Tensor:
    """The L2 norm of all leaves of `tree` together, as a 0-d fp32 tensor (fp64 if every leaf is).

    On a sharded tree (DTensor leaves) it is the norm of the full tree: each leaf's local sum of squares
    is divided by its number of replicas (the product of the mesh sizes along its `Replicate` dims),
    and the sum goes through exactly one all-reduce over all ranks of the mesh (watched and counted, `_collectives`).
    Plain-tensor leaves of a sharded tree count as replicated on every rank of the mesh. A tree without
    DTensor leaves needs no communication.

    Args:
        tree: a pytree of tensors and/or DTensors (all DTensors on meshes spanning the same ranks).

    Returns:
        A 0-d float32 tensor (float64 when every leaf is) on the leaves' device, equal on every rank.

    Example:
        >>> global_norm({"w": torch.ones(2, 2), "b": torch.zeros(3)})
        tensor(2.)
    """
    leaves, _ = flatten(tree)
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    locs = locals_(leaves)
    meshes = {x.device_mesh for x in leaves if isinstance(x, DTensor)}
    if not meshes:
        return local_sumsq(locs).sqrt_()
    mesh = next(iter(meshes))
    ranks = set(mesh.mesh.flatten().tolist())
    for other in meshes:
        if set(other.mesh.flatten().tolist()) != ranks:
            raise ValueError(f"global_norm needs all DTensor leaves on meshes over the same ranks, got {meshes}")
    weights = [1.0 / (_replicas(x) if isinstance(x, DTensor) else len(ranks)) for x in leaves]
    total = local_sumsq(locs, weights)
    if len(ranks) > 1:
        C.all_reduce_blocking(total, mesh_group(mesh), "sf.optim.clip_by_global_norm (the global norm)")
    return total.sqrt_()
