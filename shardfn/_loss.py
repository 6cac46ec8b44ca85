"""What `loss_fn` returns and how a batch splits into micro-batches: read by every way a step
computes its gradients (the unit schedule, the gathered tree, the step as one graph)."""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

from . import _collectives as C

__all__ = ["add_loss", "loss_of", "split_batch", "split_loss"]


def loss_of(out: Any) -> Any:
    """The loss of what `loss_fn` returned, as it returned it (a DTensor under tensor parallel)."""
    return out[0] if isinstance(out, tuple) and len(out) == 2 else out


def split_loss(out: Any) -> tuple[torch.Tensor, Any]:
    if isinstance(out, tuple) and len(out) == 2:
        loss, aux = out
    else:
        loss, aux = out, None
    if isinstance(loss, DTensor):  # tensor parallel: the loss every tp rank computed
        loss = C.full_tensor(loss, "the loss")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar tensor (or (loss, aux)), got {type(loss).__name__} {getattr(loss, 'shape', '')}")
    loss = loss.reshape(())
    if not loss.requires_grad:
        raise ValueError("the loss does not depend on the params: loss_fn must compute it from its `params` argument")
    return loss, aux


def split_batch(batch: Any, k: int) -> list[Any]:
    if k == 1:
        return [batch]
    leaves, spec = optree.tree_flatten(batch)
    parts = []
    for x in leaves:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] % k:
            got = f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__} leaf"
            raise ValueError(
                f"accumulation_steps={k} splits every batch leaf along dim 0 in {k} equal parts; got {got}. "
                f"Pass a batch of tensors whose first dim is a multiple of {k} (bind constants into loss_fn instead)"
            )
        parts.append(x.chunk(k))
    firsts = sorted({int(x.shape[0]) for x in leaves})
    if len(firsts) > 1:  # a leaf that is no example per row (class weights, a shared matrix) would be cut too
        paths = optree.tree_paths(batch)
        shown = ", ".join(f"{''.join(f'[{p!r}]' for p in path) or '(the batch)'}: {tuple(x.shape)}" for path, x in zip(paths, leaves))
        raise ValueError(
            f"accumulation_steps={k} splits every batch leaf along dim 0 into {k} micro-batches, and the leaves' first "
            f"dims differ ({shown}), so some leaf is not one example per row: it would be cut too. Give every batch leaf "
            "the examples on dim 0, and bind what is shared by all of them (class weights, a mask, a table) into "
            "loss_fn instead"
        )
    return [optree.tree_unflatten(spec, [p[i] for p in parts]) for i in range(k)]


def add_loss(total: torch.Tensor | None, loss: torch.Tensor) -> torch.Tensor:
    """`total` + `loss` (detached), in the loss's dtype or float32 if that is narrower: an fp64
    loss is reported in fp64, a bf16 one in fp32 (`metrics["grad_norm"]` is in the gradients'
    dtype, fp32 at least)."""
    x = loss.detach()
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x.clone() if total is None else total + x
