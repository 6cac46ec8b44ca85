"""Context parallelism: the sequence split over a `cp` mesh axis, attention as a ring.

Note [context parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~~
On a mesh with a `cp` axis (`sf.mesh(dp=2, cp=2)`), `train_step(..., batch_specs=P(None, "cp"))`
says which dims of the batch are the sequence. Each rank passes the batch of its data-parallel
coordinate (the same on its cp peers), and the step cuts every dim its spec names "cp" into
2 * cp chunks, of which cp rank r keeps chunk r and chunk 2 * cp - 1 - r (head and tail, as
torchtitan's load balancer does): under a causal mask the early chunks attend to little and the
late ones to much, and head plus tail gives every rank the same work.

Everything but attention is per token, so it runs on the local chunks as it is; the parameters
are the same on every rank, so the step shards them, reduces their gradients and averages the
loss over dp and cp together, as one data-parallel axis of dp * cp ranks (each rank's loss is the
mean over as many tokens). `F.scaled_dot_product_attention` is swapped, while the step runs (in
`torch.nn.functional` itself: a process-wide change for the step's duration), for ring attention
over cp: each rank keeps its queries and passes its keys and values (one tensor)
around the ring, cp - 1 exchanges, combining the blocks with an online softmax (float32
statistics) and masking by global position. The exchanges are `ppermute`s (`_named.py`), whose
transpose is the inverse ring, so the backward is autograd's and exact; under remat the
recomputation runs the ring again.

What the model must be told: positions. A model that derives positions from the length of what
it is given (`arange(T)`) would see local lengths; pass the global position ids in the batch
(split with it: the project's GPT takes `pos=`, Hugging Face models `position_ids=`) and labels
aligned with the tokens (shift them before the cut: a model that shifts labels itself shifts within
each chunk). Attention with an explicit mask, or with dropout, is refused, as is context
parallelism with tensor parallelism (not yet).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import optree
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ._manual import axis_group
from ._named import _Collective, _Permute
from ._spec import P

__all__ = ["ContextParallel"]


class ContextParallel:
    """A step's context parallelism: the mesh it is over, the batch cut, the ring attention."""

    def __init__(self, mesh: DeviceMesh, batch_specs: Any):
        names = tuple(mesh.mesh_dim_names or ())
        if names not in (("dp", "cp"), ("cp",)):
            raise NotImplementedError(
                f"context parallelism runs on sf.mesh(dp=..., cp=...) or sf.mesh(cp=...); this mesh has axes {names}. "
                "With tensor parallelism (a tp axis) it is not supported yet"
            )
        if batch_specs is None:
            raise ValueError(
                "the mesh has a cp axis: say which batch dims are the sequence with batch_specs=, e.g. "
                "sf.train_step(..., batch_specs=sf.P(None, 'cp')) for (batch, sequence) leaves; each rank passes the batch "
                "of its dp coordinate and the step cuts it (a sequence cut by hand would attend within each rank's part only)"
            )
        if mesh.size() != torch.distributed.get_world_size():
            raise NotImplementedError("context parallelism on a mesh over part of the job's ranks is not supported yet")
        self.mesh, self.batch_specs = mesh, batch_specs
        self.size = int(mesh.size(names.index("cp")))
        self.group = axis_group(mesh, ("cp",))
        self.flat = init_device_mesh(mesh.device_type, (mesh.size(),), mesh_dim_names=("dp",))

    # -- the batch ------------------------------------------------------------------------------
    def cut(self, batch: Any) -> Any:
        """This rank's head and tail chunks of every batch dim whose spec names "cp"."""
        try:
            specs = optree.tree_broadcast_prefix(self.batch_specs, batch, is_leaf=lambda x: isinstance(x, P), none_is_leaf=True)
        except ValueError as e:
            raise ValueError(f"batch_specs must be a P for every leaf of the batch, or a prefix of its tree with P leaves: {e}") from None
        paths = optree.tree_paths(batch, none_is_leaf=True)
        leaves, treedef = optree.tree_flatten(batch, none_is_leaf=True)
        flat_specs = optree.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P), none_is_leaf=True)
        return optree.tree_unflatten(treedef, [self._cut_one(x, s, p) for x, s, p in zip(leaves, flat_specs, paths)])

    def _cut_one(self, x: Any, spec: Any, path: tuple) -> Any:
        where = "batch leaf " + ("".join(f"[{k!r}]" for k in path) or "(the batch)")
        if not isinstance(x, torch.Tensor):
            return x
        if not isinstance(spec, P) or any(a != "cp" for a in spec.axes) or len(spec) > x.ndim:
            raise ValueError(
                f"batch_specs: {where} (shape {tuple(x.shape)}) has spec {spec!r}: name only 'cp', on the sequence dims "
                "(each rank already passes the batch of its dp coordinate), e.g. sf.P(None, 'cp')"
            )
        n, r = self.size, self.group.index
        for d in range(len(spec)):
            if spec.axes_of(d):
                if x.shape[d] % (2 * n):
                    raise ValueError(
                        f"batch_specs: {where} has {x.shape[d]} positions on dim {d}, not a multiple of 2 * cp = {2 * n} "
                        "(each cp rank holds a head and a tail chunk): pad the sequence to a multiple"
                    )
                chunks = x.chunk(2 * n, d)
                x = torch.cat([chunks[r], chunks[2 * n - 1 - r]], d)
        return x

    def positions(self, t_local: int, rank: int) -> torch.Tensor:
        """The global positions of cp rank `rank`'s `t_local` tokens (its head, then its tail)."""
        c, n = t_local // 2, self.size
        return torch.cat([rank * c + torch.arange(c), (2 * n - 1 - rank) * c + torch.arange(c)])

    # -- attention ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def attention(self) -> Iterator[None]:
        """`F.scaled_dot_product_attention` as ring attention over cp for the block.

        Swapped in `torch.nn.functional` itself, for the step (its forward, and its backward, where
        remat recomputes the forward: a torch function mode is not active there), then put back.
        """
        original = F.scaled_dot_product_attention

        def ring(*args: Any, **kwargs: Any) -> torch.Tensor:
            return self.attend(*args, **kwargs)

        F.scaled_dot_product_attention = ring
        try:
            yield
        finally:
            F.scaled_dot_product_attention = original

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        """Exact attention of this rank's queries over the whole sequence (Note [context parallelism])."""
        if attn_mask is not None or dropout_p:
            raise NotImplementedError(
                "context parallelism: scaled_dot_product_attention with an explicit attn_mask or dropout_p > 0 is not "
                "supported yet (its mask would be of the local chunks); use is_causal=True without a mask, and attention "
                "dropout 0"
            )
        if isinstance(q, torch.distributed.tensor.DTensor):
            raise NotImplementedError("context parallelism with tensor parallelism (DTensor q/k/v) is not supported yet")
        t = q.shape[-2]
        if k.shape[-2] != t or t % 2:
            raise NotImplementedError(
                f"context parallelism: attention of {t} queries to {k.shape[-2]} keys per rank; self-attention over the "
                "sequence the step cut (an even number of positions per rank) is what runs as a ring"
            )
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            rep = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
        n, me = self.size, self.group.index
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        dtype = q.dtype
        qf = q.float()
        qpos = self.positions(t, me).to(q.device)
        m = torch.full((*q.shape[:-1], 1), -math.inf, device=q.device)
        num = torch.zeros(*q.shape[:-1], v.shape[-1], device=q.device)
        den = torch.zeros_like(m)
        kv = torch.cat([k, v], -1)
        ring = tuple((i, (i + 1) % n) for i in range(n))
        dk = k.shape[-1]
        for s in range(n):
            kk, vv = kv[..., :dk].float(), kv[..., dk:].float()
            scores = (qf @ kk.transpose(-2, -1)) * scale
            if is_causal:
                kpos = self.positions(t, (me - s) % n).to(q.device)
                scores = scores.masked_fill(kpos[None, :] > qpos[:, None], -math.inf)
            new_m = torch.maximum(m, scores.amax(-1, keepdim=True))
            safe = torch.where(torch.isinf(new_m), torch.zeros_like(new_m), new_m)
            p = torch.exp(scores - safe)
            corr = torch.exp(torch.where(torch.isinf(m), torch.full_like(m, -math.inf), m - safe))
            num = num * corr + p @ vv
            den = den * corr + p.sum(-1, keepdim=True)
            m = new_m
            if s < n - 1:
                kv = _Collective.apply(kv, _Permute(self.group, "context-parallel attention", ring))
        return (num / den).to(dtype)
