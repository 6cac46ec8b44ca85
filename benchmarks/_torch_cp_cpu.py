"""torch's context parallelism on CPU meshes, for the torchtitan baseline in `context_parallel.py`.

torch's `context_parallel` (torchtitan's recipe) runs attention as a ring only for the CUDA kernels
(flash, memory-efficient, cuDNN): on a CPU mesh, `F.scaled_dot_product_attention` dispatches to
`aten._scaled_dot_product_flash_attention_for_cpu`, for which DTensor has no sharding strategy, and
the recipe stops. `enable()` maps that kernel and its backward to torch's own ring
(`_templated_ring_attention`, `_templated_ring_attention_backward`: the same rotation, load-balanced
causal skips and log-sum-exp merge the CUDA kernels get), with the CPU kernel as the per-block op.
Nothing else in the recipe changes. The benchmark checks the result against shardfn's cp step.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.experimental._context_parallel import _attention as _cp

aten = torch.ops.aten
_SEQ = 2  # (B, H, T, D): the sequence dim torch's ring assumes


def _block_forward(query, key, value, *, is_causal, dropout_p=0.0, scale=None, attn_mask=None):
    return aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )


def _block_backward(*, grad_out, query, key, value, out, logsumexp, is_causal, dropout_p=0.0, scale=None, attn_mask=None):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )


def _spec_like(spec: DTensorSpec, local: torch.Tensor) -> DTensorSpec:
    shape = list(local.shape)
    shape[_SEQ] *= spec.mesh.size()
    full = torch.empty(shape, dtype=local.dtype, device="meta")
    return DTensorSpec(spec.mesh, (Shard(_SEQ),), tensor_meta=TensorMeta(full.shape, full.stride(), local.dtype))


def _handler(op_call, args, kwargs):
    info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    specs = [a._spec for a in args if isinstance(a, DTensor)]
    if any(s.placements != (Shard(_SEQ),) for s in specs):
        raise NotImplementedError(f"the CPU ring takes q/k/v split on dim {_SEQ}; got {[s.placements for s in specs]}")
    group = specs[0].mesh.get_group()
    la, lk = list(info.local_args), dict(info.local_kwargs)
    if op_call is aten._scaled_dot_product_flash_attention_for_cpu.default:
        q, k, v, *rest = la
        dropout_p, is_causal = (list(rest) + [0.0, False])[:2]
        out = _cp._templated_ring_attention(
            group, _SEQ, _block_forward, query=q, key=k, value=v, is_causal=is_causal, dropout_p=dropout_p, **lk
        )
    else:
        g, q, k, v, o, lse, dropout_p, is_causal = la
        out = _cp._templated_ring_attention_backward(
            group, _SEQ, _block_backward, grad_out=g, grad_out_name="grad_out", query=q, key=k, value=v,
            out=o, logsumexp=lse, is_causal=is_causal, dropout_p=dropout_p, **lk,
        )
    return tuple(DTensor(t, _spec_like(specs[0], t), requires_grad=False) for t in out)


def enable() -> None:
    """Adds the CPU flash kernel and its backward to the ops torch's `context_parallel` rings."""
    _cp.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = _handler
    _cp.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _handler
