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
each chunk). Attention with an explicit mask, or with dropout, is refused.

Only `F.scaled_dot_product_attention` sees across the ranks' chunks: attention written out by hand
(`softmax(q @ k.T)`), a pooling over the sequence or a shift of the labels inside the model would
compute on the local chunks alone. The first step follows the sequence through its forward and
refuses such ops before anything is applied (Note [positions mixed outside attention] in
`_positions.py`). A first step whose forward called no `scaled_dot_product_attention` at all warns
once, with `ContextParallelWarning`.

Attention within a window (a sliding window, or chunked attention) is refused where the window
is shorter than the sequence (Note [attention windows under cp]).

With tensor parallelism (`sf.mesh(dp=..., tp=..., cp=...)`) the step runs on a (dp x cp, tp) mesh:
parameters split over tp as their specs say and sharded over dp and cp together, the forward on
DTensors over tp (Note [tensor parallel forward] in `_tp.py`). Attention's q, k and v are then
DTensors over tp, split on their heads (Llama's rules) or whole (the GPTs' packed q|k|v); heads
attend independently, so the ring runs on each tp rank's own heads and the output keeps their
layout.
"""

from __future__ import annotations

import contextlib
import weakref
import math
import warnings
from typing import Any, Iterator

import optree
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import _collectives as C
from ._manual import axis_group
from ._mesh import device_mesh
from ._named import _Collective, _Permute
from ._positions import PositionWatch, check_attention
from ._spec import P

__all__ = ["ContextParallel", "ContextParallelWarning"]


# Note [attention windows under cp]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The ring attends each query to every key before it in the whole sequence. A model whose
# attention is bounded by a window (Mistral's sliding window, Qwen2's and Gemma's sliding layers,
# Llama 4's chunked attention) says so through a mask, which the ring refuses; but Hugging Face
# builds that mask from the lengths the model is given, and leaves it out when they fit in the
# window (`is_causal` alone is then the same thing on one process). Under cp a rank sees 2 of the
# 2 * cp chunks, so a window between a rank's length and the sequence's is left out on every rank,
# and the step would train full causal attention, measured 3.5818 against one process's 3.5821
# on a Mistral of window 12 at 16 positions, cp = 2. The window is read where Hugging Face keeps it
# (`attention_windows`) and checked against the sequences of every batch before the step computes:
# a window at least as long as the sequence bounds nothing, and passes.
def attention_windows(module: Any) -> list[tuple[str, int]]:
    """The attention windows a model declares, as (where, positions), in Hugging Face's
    conventions: an attention layer's `sliding_window` (None on full-attention layers: Qwen2,
    Gemma), and a config's `sliding_window` or `attention_chunk_size` where its layers use them
    (`layer_types` naming sliding or chunked attention; without `layer_types`, unless
    `use_sliding_window` is False: Mistral, Mixtral, Phi-3)."""
    found: list[tuple[str, int]] = []  # the layers' own first: they name where the window is
    declared: list[tuple[str, int]] = []
    seen_configs: set[int] = set()
    for name, m in module.named_modules():
        w = m.__dict__.get("sliding_window")
        if isinstance(w, int) and not isinstance(w, bool) and w > 0:
            found.append((f"module {name or type(m).__name__!r}'s sliding_window", w))
        cfg = m.__dict__.get("config")
        if cfg is None or id(cfg) in seen_configs:
            continue
        seen_configs.add(id(cfg))
        types = [str(t) for t in (getattr(cfg, "layer_types", None) or [])]
        for key, kind in (("sliding_window", "sliding"), ("attention_chunk_size", "chunked")):
            w = getattr(cfg, key, None)
            if not isinstance(w, int) or isinstance(w, bool) or w <= 0:
                continue
            used = any(kind in t for t in types) if types else (key == "sliding_window" and getattr(cfg, "use_sliding_window", True) is not False)
            if used:
                declared.append((f"{type(cfg).__name__}.{key}", w))
    return found + declared


class ContextParallelWarning(UserWarning):
    """A context-parallel step ran no `F.scaled_dot_product_attention`: anything else that mixes
    positions saw only this rank's chunks of the sequence (Note [context parallelism])."""


class ContextParallel:
    """A step's context parallelism: the mesh it is over, the batch cut, the ring attention."""

    def __init__(self, mesh: DeviceMesh, batch_specs: Any):
        names = tuple(mesh.mesh_dim_names or ())
        if not (set(names) <= {"dp", "tp", "cp"} and "cp" in names and len(set(names)) == len(names)):
            raise NotImplementedError(
                f"context parallelism runs on sf.mesh(dp=..., cp=...), sf.mesh(cp=...) or with tensor parallelism "
                f"sf.mesh(dp=..., tp=..., cp=...); this mesh has axes {names}"
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
        # One function for the step's life, outside compiled regions: a compiled unit breaks its
        # graph there and runs the ring eager (Note [compiled units] in `_compiled.py`); being one
        # object, it leaves dynamo's guard on `F.scaled_dot_product_attention` true from step to step.
        self._ring = torch.compiler.disable(self.attend)
        self.size = int(mesh.size(names.index("cp")))
        self.attended = 0  # calls of the ring; a first step without one warns (`check_attended`)
        self._checked = False
        self.watch: PositionWatch | None = None  # the first step's (Note [positions mixed outside attention])
        self.positions_checked = False
        self.lengths: list[int] = []  # the cp dims' global lengths in the batch last cut
        self._windows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> attention_windows
        self.group = axis_group(mesh, ("cp",))
        if "tp" in names:  # the step's mesh: (dp x cp, tp), dp and cp as one data axis
            t = mesh.mesh.permute(*(names.index(a) for a in ("dp", "cp", "tp") if a in names))
            self.flat = device_mesh(mesh.device_type, t.reshape(-1, mesh.size(names.index("tp"))), ("dp", "tp"))
        else:
            self.flat = device_mesh(mesh.device_type, torch.arange(mesh.size()), ("dp",))

    # -- attention windows ------------------------------------------------------------------------
    def check_windows(self, module: Any) -> None:
        """Refuses, before anything is computed, a model whose attention is bounded by a window
        shorter than the longest sequence of the batch just cut (Note [attention windows under cp])."""
        if module is None or not self.lengths:
            return
        found = self._windows.get(module)
        if found is None:
            found = self._windows[module] = attention_windows(module)
        longest = max(self.lengths)
        short = [(where, w) for where, w in found if w < longest]
        if short:
            where, w = short[0]
            raise ValueError(
                f"context parallelism: {where} bounds attention to a window of {w} positions, and the batch's sequences "
                f"are {longest} long. The ring attends over the whole sequence (it takes no window), and a model that "
                f"builds the window's mask from the lengths it sees (Hugging Face leaves the mask out when a rank's "
                f"{longest // self.size} positions fit in the window) would train full attention without a word; nothing "
                f"was computed. Train on sequences of at most {w} positions, or without a cp axis (Note [attention "
                "windows under cp] in shardfn/_context.py)"
            )

    # -- the batch ------------------------------------------------------------------------------
    def cut(self, batch: Any) -> Any:
        """This rank's head and tail chunks of every batch dim whose spec names "cp" (marked as the
        sequence for the step's `watch`, if it has one)."""
        try:
            specs = optree.tree_broadcast_prefix(self.batch_specs, batch, is_leaf=lambda x: isinstance(x, P), none_is_leaf=True)
        except ValueError as e:
            raise ValueError(f"batch_specs must be a P for every leaf of the batch, or a prefix of its tree with P leaves: {e}") from None
        paths = optree.tree_paths(batch, none_is_leaf=True)
        leaves, treedef = optree.tree_flatten(batch, none_is_leaf=True)
        self.lengths = []
        flat_specs = optree.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P), none_is_leaf=True)
        return optree.tree_unflatten(treedef, [self._cut_one(x, s, p) for x, s, p in zip(leaves, flat_specs, paths)])

    def _cut_one(self, x: Any, spec: Any, path: tuple) -> Any:
        where = "batch leaf " + ("".join(f"[{k!r}]" for k in path) or "(the batch)")
        if not isinstance(x, torch.Tensor):
            return x
        if not isinstance(spec, P) or any(a != "cp" for a in spec.axes):
            raise ValueError(
                f"batch_specs: {where} (shape {tuple(x.shape)}) has spec {spec!r}: name only 'cp', on the sequence dims "
                "(each rank already passes the batch of its dp coordinate), e.g. sf.P(None, 'cp')"
            )
        if len(spec) > x.ndim:
            raise ValueError(
                f"batch_specs: {where} (shape {tuple(x.shape)}) has spec {spec!r}, which names {len(spec)} dims where it has "
                f"{x.ndim}: give each batch leaf its own spec, sf.P() for a leaf with no sequence dim, e.g. "
                "batch_specs=(sf.P(None, 'cp'), sf.P()) for (tokens, labels per sequence)"
            )
        n, r = self.size, self.group.index
        for d in range(len(spec)):
            if spec.axes_of(d):
                if x.shape[d] % (2 * n):
                    raise ValueError(
                        f"batch_specs: {where} has {x.shape[d]} positions on dim {d}, not a multiple of 2 * cp = {2 * n} "
                        "(each cp rank holds a head and a tail chunk): pad the sequence to a multiple"
                    )
                self.lengths.append(int(x.shape[d]))
                chunks = x.chunk(2 * n, d)
                x = torch.cat([chunks[r], chunks[2 * n - 1 - r]], d)
        if self.watch is not None:
            self.watch.mark(x, tuple(d for d in range(len(spec)) if spec.axes_of(d)))
        return x

    def positions(self, t_local: int, rank: int) -> torch.Tensor:
        """The global positions of cp rank `rank`'s `t_local` tokens (its head, then its tail)."""
        c, n = t_local // 2, self.size
        return torch.cat([rank * c + torch.arange(c), (2 * n - 1 - rank) * c + torch.arange(c)])

    # -- attention ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def attention(self, watch: bool = False) -> Iterator[None]:
        """`F.scaled_dot_product_attention` as ring attention over cp for the block; with `watch`,
        and until a step has passed it, the block's forward is checked for ops that mix positions
        outside attention (Note [positions mixed outside attention] in `_positions.py`).

        Swapped in `torch.nn.functional` itself, for the step (its forward, and its backward, where
        remat recomputes the forward: a torch function mode is not active there), then put back.
        """
        original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self._ring
        dp = int(self.mesh.size(self.mesh.mesh_dim_names.index("dp"))) if "dp" in self.mesh.mesh_dim_names else 1
        self.watch = PositionWatch(dp) if watch and not self.positions_checked else None
        try:
            with self.watch if self.watch is not None else contextlib.nullcontext():
                yield
        finally:
            F.scaled_dot_product_attention = original

    def check_positions(self) -> None:
        """After a watched step: refuses it if an op other than attention mixed positions."""
        watch, self.watch = self.watch, None
        if watch is None:
            return
        if watch.found is not None:
            raise ValueError(
                f"context parallelism: {watch.found}. Each cp rank holds 2 of the 2 * cp chunks of every sequence, and "
                "only torch.nn.functional.scaled_dot_product_attention sees across them, so this step would compute "
                "something else than one process on the whole sequence; nothing was applied (Note [positions mixed "
                "outside attention] in shardfn/_positions.py)"
            )
        if watch.stopped is not None:
            warnings.warn(
                f"context parallelism: the check for ops that mix positions outside attention stopped at {watch.stopped}, "
                "a form of that op it does not follow; what the forward did after it was not checked (Note [positions "
                "mixed outside attention] in shardfn/_positions.py)", ContextParallelWarning, stacklevel=3)
        self.positions_checked = True

    def check_attended(self) -> None:
        """After the first step: warns if its forward called no `scaled_dot_product_attention`."""
        if self._checked:
            return
        self._checked = True
        if not self.attended:
            warnings.warn(
                "context parallelism: this step's forward called no torch.nn.functional.scaled_dot_product_attention, "
                "the one op that sees across the cp ranks' chunks of the sequence. Anything else that mixes positions "
                "(attention written out by hand, pooling over the sequence, a shift of the labels in the model) computed on "
                "this rank's chunks alone: call F.scaled_dot_product_attention for attention, or train this model without "
                "a cp axis (Note [context parallelism] in shardfn/_context.py)",
                ContextParallelWarning,
                stacklevel=4,
            )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        """Exact attention of this rank's queries over the whole sequence (Note [context parallelism])."""
        watch = self.watch
        if watch is None:
            return self._attend(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if not isinstance(q, DTensor):  # Note [what the ring attends over] in `_positions.py`
            check_attention(watch, q, k, v, bool(is_causal))
        with watch.paused():  # the ring mixes positions across the ranks, as it should
            out = self._attend(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        watch.attended(q, out)
        return out

    def _attend(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> torch.Tensor:
        self.attended += 1
        if attn_mask is not None or dropout_p:
            raise NotImplementedError(
                "context parallelism: scaled_dot_product_attention with an explicit attn_mask or dropout_p > 0 is not "
                "supported yet (its mask would be of the local chunks); use is_causal=True without a mask, and attention "
                "dropout 0"
            )
        if isinstance(q, DTensor):
            return self._attend_on_tp(q, k, v, is_causal, scale, enable_gqa)
        t = q.shape[-2]
        if k.shape[-2] != t or t % 2:
            raise NotImplementedError(
                f"context parallelism: attention of {t} queries to {k.shape[-2]} keys per rank; self-attention over the "
                "sequence the step cut (an even number of positions per rank) is what runs as a ring"
            )
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            rep = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if q.device.type in ("cpu", "meta"):
            return _on_the_fused_kernel(q, k, v, lambda q, k, v: _RingFlash.apply(q, k, v, bool(is_causal), float(scale), self))
        return self._ring_math(q, k, v, is_causal, scale)

    def _attend_on_tp(self, q: DTensor, k: DTensor, v: DTensor, is_causal: bool, scale: float | None, enable_gqa: bool) -> DTensor:
        """With tensor parallelism: q, k and v are DTensors over tp, whole there or split on their
        heads (or batch); every head attends on its own, so the ring runs on the local heads."""
        pl = tuple(q.placements)
        same = all(isinstance(x, DTensor) and tuple(x.placements) == pl for x in (k, v))
        if not same or any(p.is_partial() or (p.is_shard() and p.dim % q.dim() >= q.dim() - 2) for p in pl):
            raise NotImplementedError(
                f"context parallelism with tensor parallelism: attention of q, k, v laid out as {pl}, "
                f"{getattr(k, 'placements', None)}, {getattr(v, 'placements', None)} over tp; split them on their heads (as "
                "sf.rules.LLAMA does) or keep them whole on tp, the same for all three"
            )
        out = self._attend(q.to_local(), k.to_local(), v.to_local(), None, 0.0, is_causal, scale, enable_gqa)
        shape = (*q.shape[:-1], v.shape[-1])
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(out, q.device_mesh, pl, run_check=False, shape=torch.Size(shape), stride=stride)

    def chunk_pairs(self, src: int, causal: bool) -> list[tuple[int, int, bool]]:
        """(query chunk, key chunk, diagonal) for this rank's queries against `src`'s keys, the
        pairs a causal mask leaves out skipped: (0 or 1: head or tail, the same for keys)."""
        n, me = self.size, self.group.index
        qids, kids = (me, 2 * n - 1 - me), (src, 2 * n - 1 - src)
        out = []
        for i, qa in enumerate(qids):
            for j, ka in enumerate(kids):
                if not causal or ka < qa:
                    out.append((i, j, False))
                elif ka == qa:
                    out.append((i, j, True))
        return out

    def send_on(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """`t` to the next cp rank, the previous one's in return (the meta device: nothing sent)."""
        if t.device.type == "meta":
            return torch.empty_like(t)
        n = self.size
        g = self.group
        return C.permute_blocking(t, [g.ranks[(g.index + 1) % n]], g.ranks[(g.index - 1) % n], g.group, what)

    def _ring_math(self, q, k, v, is_causal, scale):
        """The ring with plain tensor ops (devices without the fused CPU kernel): exact, and its
        backward autograd's, saving every ring step's scores."""
        n, me, t = self.size, self.group.index, q.shape[-2]
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


def _on_the_fused_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring) -> torch.Tensor:
    """`ring(q, k, v)` on the shapes torch's fused CPU kernel takes, the result in the caller's.

    `F.scaled_dot_product_attention` takes any leading dims, keys broadcast over the queries'
    leading dims, and values of another head size than the queries' (latent attention's); the
    kernel takes (batch, heads, positions, head size) alike for all three. So the leading dims
    are flattened into the heads, and the smaller head size padded with zeros: padded columns of
    the queries and keys add nothing to the scores (the scale is the caller's, fixed before), and
    those of the values give output columns that are cut off again."""
    lead = q.shape[:-2]
    k = k.expand(*lead, *k.shape[-2:])
    v = v.expand(*lead, *v.shape[-2:])
    dk, dv = q.shape[-1], v.shape[-1]
    e = max(dk, dv)
    if dk < e:
        q, k = F.pad(q, (0, e - dk)), F.pad(k, (0, e - dk))
    if dv < e:
        v = F.pad(v, (0, e - dv))
    if q.dim() != 4:
        q, k, v = (x.reshape(1, -1, *x.shape[-2:]) for x in (q, k, v))
    out = ring(q, k, v)
    if dv < e:
        out = out[..., :dv]
    return out.reshape(*lead, *out.shape[-2:])


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _RingFlash(torch.autograd.Function):
    """Ring attention over cp on torch's fused CPU attention kernel, per pair of chunks, merged by
    their log-sum-exps; saves q, k, v, the output and its log-sum-exp only. The backward passes
    each key/value block around the ring again with its gradient accumulating beside it, and a
    last exchange hands every block's gradient back to its owner."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, cp: ContextParallel):  # type: ignore[override]
        n, me = cp.size, cp.group.index
        c = q.shape[-2] // 2
        qs = (q[..., :c, :], q[..., c:, :])
        outs = [None, None]
        lses = [None, None]
        kv = torch.cat([k, v], -1).contiguous()
        dk = k.shape[-1]
        for s in range(n):
            kk, vv = kv[..., :dk], kv[..., dk:]
            ks, vs = (kk[..., :c, :], kk[..., c:, :]), (vv[..., :c, :], vv[..., c:, :])
            for i, j, diag in cp.chunk_pairs((me - s) % n, causal):
                o, lse = _FLASH(qs[i].contiguous(), ks[j].contiguous(), vs[j].contiguous(), 0.0, diag, scale=scale)
                if outs[i] is None:
                    outs[i], lses[i] = o.float(), lse
                else:
                    new = torch.logaddexp(lses[i], lse)
                    outs[i] = outs[i] * torch.exp(lses[i] - new)[..., None] + o.float() * torch.exp(lse - new)[..., None]
                    lses[i] = new
            if s < n - 1:
                kv = cp.send_on(kv, "context-parallel attention")
        out = torch.cat(outs, -2).to(q.dtype)
        lse = torch.cat(lses, -1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.cp = causal, scale, cp
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        cp, causal, scale = ctx.cp, ctx.causal, ctx.scale
        n, me = cp.size, cp.group.index
        c = q.shape[-2] // 2
        dout = dout.contiguous()
        halves = lambda t, dim=-2: (t.narrow(dim, 0, c), t.narrow(dim, c, c))  # noqa: E731
        qs, outs, douts, lses = halves(q), halves(out), halves(dout), halves(lse, -1)
        dq = [torch.zeros_like(x, dtype=torch.float32) for x in qs]
        dk_, dv_ = k.shape[-1], v.shape[-1]
        kv = torch.cat([k, v], -1).contiguous()
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        for s in range(n):
            kk, vv = kv[..., :dk_], kv[..., dk_:]
            for i, j, diag in cp.chunk_pairs((me - s) % n, causal):
                kj = kk.narrow(-2, j * c, c).contiguous()
                vj = vv.narrow(-2, j * c, c).contiguous()
                gq, gk, gv = _FLASH_BACKWARD(douts[i].contiguous(), qs[i].contiguous(), kj, vj, outs[i].contiguous(),
                                             lses[i].contiguous(), 0.0, diag, scale=scale)
                dq[i] += gq.float()
                dkv[..., j * c:(j + 1) * c, :dk_] += gk.float()
                dkv[..., j * c:(j + 1) * c, dk_:] += gv.float()
            if s < n - 1:  # the block and its gradient so far go on together
                both = cp.send_on(torch.cat([kv.float(), dkv], -1), "the gradient of context-parallel attention")
                kv, dkv = both[..., : kv.shape[-1]].to(k.dtype), both[..., kv.shape[-1]:]
        if n > 1:  # each block's gradient is one rank short of home
            dkv = cp.send_on(dkv, "the gradient of context-parallel attention")
        return torch.cat(dq, -2).to(q.dtype), dkv[..., :dk_].to(k.dtype), dkv[..., dk_:].to(v.dtype), None, None, None
