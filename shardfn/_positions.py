"""Context parallelism's first-step check: nothing but attention mixes the positions of the sequence.

Note [positions mixed outside attention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under context parallelism every rank holds two chunks of each sequence, and only
`F.scaled_dot_product_attention`, swapped for the ring, sees across ranks (Note [context
parallelism] in `_context.py`). Any other op that combines positions computes on this rank's
chunks alone, and the result differs from one process's without a word: a shift of the labels
inside the model (Hugging Face's causal-LM loss pads and slices `labels`), a pick of one position
(the last token, a [CLS] token), attention written out by hand (a softmax over the keys), a max,
a cumulative op or a pooling over the sequence fed on into the model.

So the first step follows the sequence through its forward. A `TorchDispatchMode` marks the batch
leaves' dims that `batch_specs` names "cp", and carries the marks through the ops that keep
positions apart: pointwise ops (by broadcasting), views and reshapes (by grouping the dims whose
sizes multiply alike), transposes, slices of other dims, matrix products over other dims, an
embedding or index lookup by a marked tensor, and the reductions and norms over other dims. The
ring carries the queries' marks to its output. What it then refuses, naming the op and the line
of the model that called it:

- a slice, select, narrow, split or pad of a marked dim that does not keep it whole (a shift, a
  crop, a pick of one position), an index or gather along it, a scatter or index write along it,
  a roll, window (`unfold`), FFT, pooling op, resampling (`F.interpolate`), group norm, batch norm
  in training (its statistics) or convolution (a kernel longer than one) over it, and a `cat` that joins something that is not the sequence to it (a prompt),
  or joins sequences end to end;
- a softmax, log-softmax, log-sum-exp, max, min, sort, norm, product or cumulative op over a marked
  dim, unless it reduces everything to one number; and such a number (a max of the position ids)
  read into Python, where it steers the model by this rank's positions alone (Hugging Face's
  dynamic RoPE scaling);
- an attention op that reaches the dispatcher itself (not through `F.scaled_dot_product_attention`);
- a sum, mean or matrix product over a marked dim that keeps other dims (a pooling) whose result
  then goes through anything but linear ops (add, multiply by what is not the sequence, matrix
  products with weights, views, sums), an op the rules do not know included, before it crosses the
  ranks in a collective (`sf.psum` over "dp" in `loss_fn`); at dp > 1 that collective is refused
  too, since under cp the data axis spans dp x cp and the sum would add other sequences.

A flip of the sequence is exact: cp rank r holds chunks r and 2 * cp - 1 - r, head then tail, and
flipped they are the flipped sequence's chunks r and 2 * cp - 1 - r, in that order; positions
then pair across the sequence (`x + x.flip(1)`) as in one process. A flip of tokens merged with
other dims is refused.

An index that leaves every position where it was (`arange` over the whole marked dim, spread over
other dims: Hugging Face's `padding_mask[batch_idx, kv_idx]`) keeps the marks where the positions
land; a mask built that way and handed to attention is refused by the ring (Note [context
parallelism]), and one never used (Qwen2-MoE's sliding-window mask) costs nothing.

A marked dim that holds the sequence merged with the batch (tokens flattened to rows: its length
is not a chunk's) is cut, indexed, gathered and sorted freely: those ops move whole tokens (a
chunked loss, the tokens a mask keeps, a mixture of experts routing tokens to experts and back)
and mix no positions. Where such a dim is unflattened again, the innermost dim as long as a chunk
is the sequence (batch-major layout).

Note [what the ring attends over]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The ring (Note [context parallelism] in `_context.py`) passes keys and values around the cp
ranks as the chunks of the sequence, and masks causal pairs by chunk: what it attends over, dim
-2 of q, k and v, must be the sequence the step cut, whole on this rank's chunks. The first step
checks it from the marks: attention over the heads of each token (q laid out (batch, sequence,
heads, head_dim), a transpose forgotten), or over blocks of the sequence made by a reshape (the
sequence's marks on another dim) is refused, where the ring computed something else than one
process without a word. A tensor without marks is not refused: the check loses the trail at an
op it does not follow, so no marks is no evidence; attention among values the sequence never
reached (a Perceiver's latents, as long as a rank's share) therefore still runs as the ring,
which is wrong under a causal mask; such attention must not go through
`F.scaled_dot_product_attention` in a cp step. Queries over the sequence attending, without a causal mask, to keys and
values no rank cut (a memory every rank holds whole: an encoder's output) pass: each rank's
copy is the same, and attention over the copies the ring brings is attention over one.

Note [positions counted from this rank's length]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A model that is not given its tokens' positions counts them from the length it sees: Hugging
Face's decoders take `arange(length)` (`cache_position`) for `position_ids`, BERT cuts its buffer
of positions to the length, a hand-written model slices a table of sinusoids. Under cp that length
is a rank's two chunks, so every rank trains positions 0..T/cp - 1 for tokens elsewhere in the
sequence, without an error (measured: Llama's loss 1.4e-5 off at the first step, GPT-2's 1.1e-3,
parameters 5% and 75% off after two steps). So an `arange` as long as a rank's share of a
sequence dim, a slice of a tensor that is not the sequence down to that length (unless its
values are alike along that dim: BERT's token-type zeros), and any run 0, 1, 2, ... as long as
that share however it was made (a `linspace`, a cumulative sum of ones, `torch.tensor(range(t))`,
NumPy's `arange`), met as an op's input or output, are marked as positions counted so.
The marks follow views, casts, lookups and masks built from them, and where such positions meet
the sequence's values in a floating-point result (rotary angles multiplied in, a position
embedding added) the step is refused, naming where they were counted. Masks built by comparing
them pass (Hugging Face builds them from `cache_position` even when given the positions, and an
explicit mask reaching attention is refused by the ring). The global positions in the batch,
cut with it, carry the sequence's marks, not these.

What reduces to one number is the loss, whose meaning the step defines (the mean over the ranks
of each rank's loss, as under data parallelism). Ops the rules do not know lose the marks, so the
check can miss a mixing op past them, never refuse one it cannot see. It runs on the first step
only (until one passes), in eager mode (not inside `compile=True`'s compiled units), and not in
the backward, where a gradient's sum over positions is the point.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from typing import Any, Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["PositionWatch", "check_attention"]

_aten = torch.ops.aten

# Reductions whose value over several positions is linear in them: a pooling, not yet an error.
_LINEAR_REDUCTIONS = {"sum", "mean"}
# Reductions and scans that mix positions non-linearly: an error over a marked dim.
_MIXING = {"amax", "amin", "max", "min", "logsumexp", "_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax",
           "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "prod", "var", "std", "var_mean", "std_mean",
           "linalg_vector_norm", "norm", "argmax", "argmin", "sort", "topk", "median", "mode", "kthvalue", "any", "all"}
_SCALAR_OK = {"amax", "amin", "max", "min", "any", "all", "argmax", "argmin", "linalg_vector_norm", "norm", "prod"}
# Ops linear in each input (a pooled value may go through them).
_LINEAR = {"add", "sub", "rsub", "mul", "div", "neg", "clone", "_to_copy", "copy", "copy_", "where", "masked_fill", "detach",
           "alias", "lift_fresh", "contiguous", "zeros_like", "ones_like", "empty_like", "full_like"}
_VIEWS = {"view", "_unsafe_view", "reshape", "_reshape_alias", "unsqueeze", "squeeze", "view_as", "flatten", "unflatten"}
_SAME = {"clone", "_to_copy", "detach", "alias", "lift_fresh", "contiguous", "native_dropout", "dropout", "repeat_interleave"}
_POOLING_OPS = {"adaptive_max_pool2d", "adaptive_max_pool1d", "_adaptive_avg_pool2d", "adaptive_avg_pool1d", "max_pool2d_with_indices",
                "max_pool1d", "avg_pool2d", "avg_pool1d", "native_group_norm", "max_pool3d_with_indices", "avg_pool3d",
                "_adaptive_avg_pool3d", "adaptive_max_pool3d",
                # resampling (F.interpolate): each output position reads its neighbours
                "upsample_linear1d", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_bilinear2d",
                "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_bicubic2d", "_upsample_bilinear2d_aa",
                "_upsample_bicubic2d_aa", "upsample_trilinear3d", "upsample_nearest3d", "_upsample_nearest_exact3d",
                }  # outputs with the input's dims where they were
# Writes by index along a dim (self, dim, index, src or value): along the sequence, positions move.
_SCATTERS = {"scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy", "index_fill", "index_reduce"}
# Batch norms: in training, statistics over every dim but the channels (dim 1); otherwise pointwise.
_BATCH_NORMS = {"native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
                "_native_batch_norm_legit_no_training", "_batch_norm_with_update", "_batch_norm_with_update_functional",
                "_batch_norm_no_update", "cudnn_batch_norm", "miopen_batch_norm"}
_CUTS = {"slice", "select", "narrow", "split", "split_with_sizes", "unbind", "chunk", "unsafe_split", "tensor_split"}
_ATTENTION = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention", "scaled_dot_product_attention",
              "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable"}
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "_dtensor"}

_SHIFT_HINT = ("A shift along the sequence (labels shifted inside the model, neighbouring positions compared) or a pick of "
               "one position (the last token, a [CLS] token) reads this rank's chunks as if they were the whole sequence: "
               "shift the labels before the cut, in the batch (Hugging Face's causal-LM models: pass them shifted as "
               "shift_labels=, beside labels=, and compute the global token mean in loss_fn as sf.psum of the sums over "
               "sf.psum of the counts, since the -100 labels land on some ranks only; and an attention_mask of ones, "
               "without which they compare neighbouring position_ids to find packed sequences), or train this model "
               "without a cp axis")
_ROUTING = {"sort", "argsort", "topk", "kthvalue", "argmax", "argmin", "median", "mode"}  # order statistics: routing tokens

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_OWN_MODELS = (_OWN_DIR + "models.py", _OWN_DIR + "_models.py", _OWN_DIR + "demo.py")


def _alike_along(a: torch.Tensor, d: int) -> bool:
    """Whether every slice of `a` along dim `d` holds the same values (a buffer of token-type
    zeros, expanded: cut to a rank's length, it is still right)."""
    if a.device.type == "meta" or a.numel() == 0:
        return a.numel() == 0
    return bool(torch.equal(a, a.narrow(d, 0, 1).expand_as(a)))


def _batch_norm_trains(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a batch-norm op of `_BATCH_NORMS` computes the batch's statistics (training mode)."""
    if name in ("_batch_norm_with_update", "_batch_norm_with_update_functional"):
        return True
    if name in ("_native_batch_norm_legit_no_training", "_batch_norm_no_update"):
        return False
    if "training" in kwargs:
        return bool(kwargs["training"])
    return next((x for x in args if isinstance(x, bool)), True)


def _caller() -> str:
    """The innermost frame outside torch and shardfn (its models aside): the model's line."""
    for frame in reversed(traceback.extract_stack()):
        f = frame.filename
        if f.startswith(_TORCH_DIR) or (f.startswith(_OWN_DIR) and f not in _OWN_MODELS):
            continue
        return f"{f}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return "(no frame outside torch)"


def _norm(d: int, n: int) -> int:
    return d % n if n else 0


def _dims_arg(func, args, kwargs, ndim: int) -> list[int] | None:
    """The dims a reduction or scan runs over (None: every dim)."""
    schema = func._schema
    names = [a.name for a in schema.arguments]
    if "dim" not in names:
        return None
    i = names.index("dim")
    d = args[i] if i < len(args) else kwargs.get("dim", schema.arguments[i].default_value)
    if d is None or (isinstance(d, (list, tuple)) and len(d) == 0 and func._overloadpacket.__name__ not in ("amax", "amin")):
        return None
    if isinstance(d, (list, tuple)):
        if not d:
            return None  # amax/amin: [] is every dim
        return [_norm(x, ndim) for x in d]
    return [_norm(int(d), ndim)]


def _keepdim(func, args, kwargs) -> bool:
    names = [a.name for a in func._schema.arguments]
    if "keepdim" not in names:
        return func._overloadpacket.__name__ in ("_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax", "cumsum",
                                                 "cumprod", "cummax", "cummin", "logcumsumexp", "sort")
    i = names.index("keepdim")
    return bool(args[i] if i < len(args) else kwargs.get("keepdim", False))


def _after_reduction(dims: frozenset, reduced: list[int], keepdim: bool) -> frozenset:
    if keepdim:
        return frozenset(d for d in dims if d not in reduced)
    return frozenset(d - sum(1 for r in reduced if r < d) for d in dims if d not in reduced)


def _view_dims(src: tuple, dst: tuple, dims: frozenset, lengths: set) -> frozenset:
    """The dims of `dst` that `src`'s marked dims become under a view (sizes grouped by product);
    where a group of dims that holds the sequence splits (the batch and sequence merged by a
    linear layer, unmerged after it), the dims as long as a sequence (`lengths`) are marked."""
    src, dst = [s for s in src], [s for s in dst]
    if 0 in src or 0 in dst:
        return frozenset()
    out: set[int] = set()
    i = j = 0
    while i < len(src) and j < len(dst):
        a0, b0 = i, j
        pa, pb = src[i], dst[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(src):
                pa *= src[i]
                i += 1
            elif pb < pa and j < len(dst):
                pb *= dst[j]
                j += 1
            else:
                return frozenset()
        group = [b for b in range(b0, j) if dst[b] != 1] or list(range(b0, j))
        if any(a in dims and src[a] != 1 for a in range(a0, i)):
            if len(group) > 1:
                # batch-major (batch, sequence): the innermost dim as long as a sequence
                group = [b for b in group if dst[b] in lengths][-1:] or group
            out.update(group)
    return frozenset(out)


def _index_in_place(src: torch.Tensor, idx: list, sdims: frozenset) -> frozenset | None:
    """The marked dims of `src[idx]` (`aten.index.Tensor`) where every index of a marked dim is
    `arange` over that whole dim along one dim of the indices' broadcast shape, and no index of
    another marked dim varies along that one: each position then lands where it was, spread over
    the other dims (`padding_mask[batch_idx, kv_idx]`, Hugging Face's masks), or picks within its own
    row (`logp[b_idx, t_idx, labels]`, each token's label). None where positions are picked."""
    adv = [k for k, i in enumerate(idx) if i is not None]
    if any(idx[k].dtype in (torch.bool, torch.uint8) for k in adv):
        return None
    shape = torch.broadcast_shapes(*(idx[k].shape for k in adv))
    nb = len(shape)

    def varies(i: torch.Tensor, j: int) -> bool:  # index `i`, aligned right in the broadcast shape, along dim j
        k = j - (nb - i.ndim)
        return k >= 0 and i.shape[k] != 1

    # Indices next to each other put their broadcast dims where they were; apart, in front.
    lead = adv[0] if adv == list(range(adv[0], adv[-1] + 1)) else 0
    rest = [d for d in range(src.ndim) if d not in adv]  # the dims taken whole, in order after them
    out: set[int] = set()
    for d in sdims:
        if d not in adv:
            out.add(d if d < lead else nb + rest.index(d))
            continue
        i, n = idx[d], int(src.shape[d])
        along = [j for j in range(nb) if varies(i, j)]
        if n < 2 or len(along) != 1 or i.numel() != n or not torch.equal(i.reshape(-1), torch.arange(n, device=i.device)):
            return None
        if any(k != d and k in sdims and varies(idx[k], along[0]) for k in adv):
            return None  # another sequence dim indexed along the same dim: a diagonal, positions picked
        out.add(lead + along[0])
    return frozenset(out)


def check_attention(watch: "PositionWatch", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> None:
    """The ring attends over dim -2 of q, k and v as the sequence the step cut: what the marks show
    is something else there (each token's heads, blocks of the sequence) is refused on `watch`,
    since the ring would pass it around the ranks as chunks of a sequence (Note [what the ring
    attends over])."""
    if watch.found is not None:
        return None
    if not is_causal and not any(x in watch.dims for x in (k, v)):
        check = (("query", q),)  # keys and values no rank cut: a memory every rank holds whole
    else:
        check = (("query", q), ("key", k), ("value", v))
    for name, x in check:
        dims = watch.dims.get(x, frozenset())
        seq = x.ndim - 2
        # Refused where the marks say so; a tensor whose trail the check lost (an op it does
        # not follow) carries none, and runs as the ring, as before the check.
        if not dims or (seq in dims and (x.ndim - 1) not in dims and int(x.shape[seq]) in watch.lengths):
            continue
        where = (f"the sequence is its dim {sorted(dims)[0] - x.ndim}" if (x.ndim - 1) not in dims and seq not in dims else
                 "its features hold the sequence" if (x.ndim - 1) in dims else
                 f"it holds {x.shape[seq]} positions, not this rank's {sorted(watch.lengths)}: part of the sequence")
        return watch._refuse(
            f"scaled_dot_product_attention got a {name} of shape {tuple(x.shape)} whose dim -2, which attention runs "
            f"over, is not the sequence the step cut ({where})",
            "Under cp, F.scaled_dot_product_attention runs as the ring over the cut sequence, which must be dim -2 of "
            "q, k and v, whole on this rank's chunks: (batch, heads, sequence, head_dim). Attention over other dims "
            "(heads, blocks of the sequence) would be passed around the ranks as if it were the sequence: "
            "transpose q, k and v to put the sequence at dim -2, write attention over other dims by hand, or train "
            "without a cp axis")
    return None


def _progression(t: torch.Tensor, lengths: set) -> bool:
    """Whether `t` is a run of positions as long as this rank's share: one dim of such a length
    (the others of one), its values an arithmetic progression (`linspace(0, t - 1, t)`,
    `ones(t).cumsum(0) - 1`, `torch.tensor(range(t))`, NumPy's `arange`)."""
    if type(t) is not torch.Tensor:  # values read only from plain tensors (a wrapper subclass may hold no memory)
        return False
    n = t.numel()
    if n < 3 or n not in lengths or max(t.shape) != n or t.is_complex() or t.dtype == torch.bool or t.device.type == "meta":
        return False
    end = t.storage_offset() + sum((k - 1) * st for k, st in zip(t.shape, t.stride())) + 1
    if t.untyped_storage().nbytes() < end * t.element_size():  # a view of memory given back (a freed unit's)
        return False
    x = t.detach().reshape(-1).to(torch.float64)
    step = x[1:] - x[:-1]
    return bool(step[0] != 0) and torch.allclose(step, step[:1].expand_as(step), rtol=1e-4, atol=1e-6 * float(step[0].abs()))


def _count_positions(watch: "PositionWatch", func, args, kwargs, out: torch.Tensor) -> None:
    """Marks a tensor of positions counted from this rank's length as if it were the whole
    sequence's (Note [positions counted from this rank's length]): an `arange` as long as a
    chunk pair, or a slice of a tensor that is not the sequence down to that length, along a
    dim whose values are not all alike; or a run of positions as long as this rank's share,
    however made (`_progression`), among an op's inputs or as its output."""
    name = func._overloadpacket.__name__
    if name == "arange" and out.ndim == 1 and int(out.shape[0]) in watch.lengths and out.shape[0] > 1:
        step = args[2] if len(args) > 2 else kwargs.get("step", 1)
        if step == 1:
            watch.counted[out] = f"{func} counted {out.shape[0]} positions, this rank's length, at {_caller()}"
            return
    elif name == "slice" and args and isinstance(args[0], torch.Tensor):
        a = args[0]
        d = _norm(int(args[1] if len(args) > 1 else kwargs.get("dim", 0)), a.ndim)
        n = int(out.shape[d])
        # Any dim: a table may hold its positions on its last dim (a sinusoid table stored
        # (features, positions)), so a weight's features cut to a width equal to this rank's length
        # are refused too (loud, where letting a table through would be silent).
        if n in watch.lengths and n > 1 and a.shape[d] > n and not _alike_along(a, d):
            watch.counted[out] = (f"{func} cut dim {d} of a {tuple(a.shape)} tensor that is not the sequence (a table "
                                  f"of positions) to {n}, this rank's length, at {_caller()}")
            return
    runs = [x for x in (*[a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)], out)
            if x.ndim <= 2 and _progression(x, watch.lengths)]
    if runs:
        what = (f"{func} computed on {runs[0].numel()} positions 0, 1, 2, ... (as many as this rank's length: a linspace, "
                f"a cumulative sum, a tensor built of range(t) or NumPy's arange), at {_caller()}")
        for x in runs:
            watch.counted[x] = what
        watch.counted[out] = what


def _meet_counted(watch: "PositionWatch", func, name: str, args, ins: list, outs: list, counted: str) -> bool:
    """Positions counted from this rank's length (`counted`): refused where their values meet
    the sequence's values in a floating-point result (a position embedding added, rotary
    angles multiplied in); carried on to the outputs otherwise (views, casts, embeddings of
    them, masks built by comparing them). True where the op was refused."""
    if name == "index" and args and args[0] in watch.dims:
        return False  # indices into the sequence's own dims: `_index_in_place` decides
    if name == "embedding" and args[0] in watch.dims:
        return False
    marked = [x for x in ins if x in watch.dims and x not in watch.counted]
    if marked and any(o.is_floating_point() or o.is_complex() for o in outs):
        watch._refuse(f"{counted}; those positions then met the sequence's values in {func}",
                      "Positions counted from a rank's length (an arange of it, a table of positions cut to it) are "
                      "not the positions of its tokens: pass the global position ids in the batch, cut with it "
                      "(Hugging Face: position_ids=, with an attention_mask of ones; the project's GPT: "
                      "apply(p, ids, pos)), and build what depends on positions from them")
        return True
    for o in outs:
        watch.counted[o] = counted
    return False


class PositionWatch(TorchDispatchMode):
    """Follows the sequence dims of a context-parallel step's forward (Note [positions mixed outside
    attention]); `found` is the first op that mixed positions, as a message, or None."""

    def __init__(self, data_parallel: int = 1) -> None:
        super().__init__()
        self.data_parallel = data_parallel  # the dp size beside cp: a psum over "dp" adds other sequences too
        self.dims = WeakIdKeyDictionary()  # tensor -> frozenset of its sequence dims
        self.pooled = WeakIdKeyDictionary()  # tensor -> where a pooling over the sequence made it
        self.local = WeakIdKeyDictionary()  # one number -> where a max (min, norm) over this rank's positions made it
        self.counted = WeakIdKeyDictionary()  # tensor -> where positions counted from this rank's length made it
        self.found: str | None = None
        self.lengths: set[int] = set()  # the sequence's lengths on this rank
        self._paused = 0
        self.stopped: str | None = None  # the op whose form stopped the watch (the step warns of it)

    # -- what the step tells it ---------------------------------------------------------------
    def mark(self, t: torch.Tensor, dims: tuple[int, ...]) -> None:
        """`t`'s `dims` are the sequence (a batch leaf the step cut)."""
        if dims:
            self.dims[t] = frozenset(_norm(d, t.ndim) for d in dims)
            self.lengths.update(int(t.shape[d]) for d in dims)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The ring's own ops, which mix positions across ranks as they should, go unwatched."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def attended(self, q: torch.Tensor, out: torch.Tensor) -> None:
        """The ring's output keeps the queries' sequence dims."""
        if q in self.dims and out.ndim == q.ndim:
            self.dims[out] = self.dims[q]

    # -- the dispatcher -----------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._paused or self.found is not None or torch._C._current_graph_task_id() != -1:
            return out
        ins = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        try:
            if any(x in self.dims or x in self.pooled or x in self.local or x in self.counted for x in ins):
                self._follow(func, args, kwargs, ins, out)
            elif isinstance(out, torch.Tensor):
                _count_positions(self, func, args, kwargs, out)
        except Exception as e:  # noqa: BLE001 - an op of a form the rules did not foresee: stop watching, never break the step
            self.stopped = f"{func} ({type(e).__name__}: {e}), at {_caller()}"
            self._paused += 1
        return out

    def _merged(self, a: torch.Tensor, d: int) -> bool:
        """Whether marked dim `d` of `a` holds the sequence merged with other dims (tokens flattened
        across the batch: a token's row moves, its position does not mix with others)."""
        return int(a.shape[d]) not in self.lengths

    def _refuse(self, what: str, hint: str) -> None:
        self.found = f"{what}, at {_caller()}. {hint}"

    def _follow(self, func, args, kwargs, ins: list, out: Any) -> None:
        name = func._overloadpacket.__name__
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        counted = next((self.counted[x] for x in ins if x in self.counted), None)
        if counted is not None and _meet_counted(self, func, name, args, ins, outs, counted):
            return
        if func.namespace in _COLLECTIVE_NAMESPACES:  # across ranks: no longer this rank's alone
            pooled_in = next((self.pooled[x] for x in ins if x in self.pooled), None)
            if pooled_in is not None and self.data_parallel > 1:
                return self._refuse(f"{pooled_in}, and the pooled value was combined across the ranks by {func}",
                                    f"Under cp the step's data axis 'dp' spans the dp x cp ranks; at dp = {self.data_parallel} "
                                    "it also adds the pooled values of other sequences, held by the other dp ranks. A "
                                    "pooling over the sequence trains under cp at dp = 1 only (sf.psum(x, 'dp') in loss_fn), "
                                    "or without a cp axis")
            for t in ins + outs:
                self.dims.pop(t, None)
                self.pooled.pop(t, None)
            return
        local = next((self.local[x] for x in ins if x in self.local), None)
        if local is not None:
            if name == "_local_scalar_dense":  # read into Python: steers the model by this rank's positions alone
                return self._refuse(f"{local}, and its value was read into Python ({func})",
                                    "A value that steers the model (a length found as the largest position id, as Hugging "
                                    "Face's dynamic RoPE scaling does) differs from rank to rank under cp: pass a fixed "
                                    "length, or train this model without a cp axis")
            if all(o.numel() <= 1 for o in outs):
                for o in outs:
                    self.local[o] = local
        a = args[0] if args and isinstance(args[0], torch.Tensor) else None
        dims = self.dims.get(a, frozenset()) if a is not None else frozenset()
        pooled = next((self.pooled[x] for x in ins if x in self.pooled), None)
        if name in _ATTENTION:
            if any(x in self.dims for x in ins):
                self._refuse(f"{func} attended over this rank's chunks of the sequence alone",
                             "Call torch.nn.functional.scaled_dot_product_attention, which the step runs as a ring over cp")
            return
        if name in _CUTS and a is not None:
            self._cut(func, name, args, kwargs, a, dims, outs, pooled)
            return
        if name in _SAME and a is not None:
            self._set(outs[0], dims, pooled)
            return
        if name == "constant_pad_nd" and a is not None:
            pads = list(args[1])
            moved = [a.ndim - 1 - i // 2 for i in range(len(pads)) if pads[i] and a.ndim - 1 - i // 2 in dims]
            if moved and not self._merged(a, moved[0]):
                return self._refuse(f"{func} padded dim {moved[0]} of a {tuple(a.shape)} tensor, a sequence dim, by {pads}",
                                    _SHIFT_HINT)
            self._set(outs[0], dims, pooled)
            return
        if name in _VIEWS and a is not None:
            for o in outs:
                self._set(o, _view_dims(tuple(a.shape), tuple(o.shape), dims, self.lengths), pooled)
            return
        if name in ("transpose", "t", "permute", "expand", "expand_as") and a is not None:
            self._set(outs[0], self._moved(name, args, a, dims, outs[0]), pooled)
            return
        if torch.Tag.pointwise in func.tags or name in _LINEAR:
            if pooled is not None and name not in _LINEAR and any(o.numel() > 1 for o in outs):
                return self._refuse_pooled(func, pooled)
            if pooled is not None and name in ("mul", "div") and (sum(1 for x in ins if x in self.pooled) > 1 or any(
                    x in self.dims and x not in self.pooled for x in ins)):
                return self._refuse_pooled(func, pooled)  # a product of two values of the sequence
            for o in outs:
                marked: set[int] = set()
                for x in ins:
                    for d in self.dims.get(x, ()):
                        marked.add(d + o.ndim - x.ndim)
                self._set(o, frozenset(d for d in marked if 0 <= d < o.ndim), pooled)
            return
        if name in _LINEAR_REDUCTIONS or name in _MIXING:
            self._reduce(func, name, args, kwargs, a, dims, outs, pooled)
            return
        if name in ("mm", "addmm", "bmm", "baddbmm", "matmul", "mv", "dot", "vdot"):
            self._matmul(func, name, args, outs, pooled)
            return
        if name in ("embedding", "index", "index_select", "gather"):
            self._lookup(func, name, args, kwargs, outs)
            return
        if name in _SCATTERS and a is not None:
            d = _norm(int(args[1]), a.ndim)
            marked = frozenset().union(*(self.dims.get(x, frozenset()) for x in ins if x.ndim == a.ndim))
            if any(d in self.dims.get(x, ()) and not self._merged(x, d) for x in ins if x.ndim == a.ndim):
                return self._refuse(f"{func} wrote by index along dim {d} of a {tuple(a.shape)} tensor, a sequence dim",
                                    "A scatter or index write along the positions moves values between them, on this "
                                    "rank's chunks alone: train this model without a cp axis")
            self._set(outs[0], marked if d not in marked else dims, pooled)
            return
        if name in ("native_layer_norm", "_fused_rms_norm", "rms_norm") and a is not None:
            n = len(args[1])
            if any(d >= a.ndim - n for d in dims):
                self._refuse(f"{func} normalized over the sequence dim of a {tuple(a.shape)} tensor",
                             "A norm over positions sees this rank's chunks alone")
                return
            if pooled is not None:
                return self._refuse_pooled(func, pooled)
            self._set(outs[0], dims, pooled)
            return
        if name in _BATCH_NORMS and a is not None:
            over = sorted(d for d in dims if d != 1)
            if over and _batch_norm_trains(name, args, kwargs):
                return self._refuse(f"{func} took batch statistics over dim {over[0]} of a {tuple(a.shape)} tensor, a "
                                    "sequence dim",
                                    "A batch norm in training normalizes by the mean and variance over the positions, and "
                                    "sees this rank's chunks alone (its running statistics would differ by rank too): use a "
                                    "layer norm or RMS norm over the features, or train this model without a cp axis")
            if pooled is not None:
                return self._refuse_pooled(func, pooled)
            self._set(outs[0], dims, pooled)
            return
        if name in ("cat", "stack"):
            self._concat(name, args, kwargs, outs, pooled)
            return
        if name in ("convolution", "_convolution", "convolution_overrideable") and a is not None:
            k = args[1]
            spatial = [d for d in dims if d >= 2 and k.shape[d] > 1]
            if spatial:
                return self._refuse(f"{func} convolved dim {spatial[0]} of a {tuple(a.shape)} tensor, a sequence dim, with a "
                                    f"kernel of {k.shape[spatial[0]]}",
                                    "A convolution over positions reads its neighbours across the chunks' edges: train this "
                                    "model without a cp axis")
            if 1 in dims:  # the sequence as the input's channels: summed over by the kernel
                pooled = pooled or f"{func} summed over dim 1 of a {tuple(a.shape)} tensor, a sequence dim, as channels, at {_caller()}"
            self._set(outs[0], frozenset(d for d in dims if d != 1), pooled)
            return
        if name in ("roll", "flip", "unfold", "diff") and a is not None:
            if name == "roll":  # no dims: the flattened tensor rolls
                over = [_norm(int(x), a.ndim) for x in (args[2] if len(args) > 2 else kwargs.get("dims", []))] or None
            elif name == "flip":
                over = [_norm(int(x), a.ndim) for x in (args[1] if len(args) > 1 else kwargs["dims"])]
            elif name == "unfold":
                over = [_norm(int(args[1]), a.ndim)]
            else:
                over = _dims_arg(func, args, kwargs, a.ndim)
            hit = [d for d in (range(a.ndim) if over is None else over) if d in dims]
            if name == "flip" and hit and not any(self._merged(a, d) for d in hit):
                hit = []  # the head and tail cut, flipped, is the flipped sequence's head and tail (Note above)
            if hit:
                return self._refuse(f"{func} moved positions along dim {hit[0]} of a {tuple(a.shape)} tensor, a sequence dim",
                                    "A roll, flip, window or difference along the sequence reads this rank's chunks as if they "
                                    "were the whole sequence: train this model without a cp axis")
            self._set(outs[0], dims, pooled)
            return
        if name == "nll_loss_forward" and a is not None:
            if outs[0].numel() > 1:  # reduction="none": per position
                target = args[1]
                self._set(outs[0], frozenset(d for d in dims | self.dims.get(target, frozenset()) if d == 0), None)
            return
        if pooled is not None:  # an op the rules do not know, on a pooled value: not known to be linear
            return self._refuse_pooled(func, pooled)
        if name in _POOLING_OPS and a is not None:
            hit = [d for d in dims if d >= 2]
            if hit:
                return self._refuse(f"{func} ran over dim {hit[0]} of a {tuple(a.shape)} tensor, a sequence dim",
                                    "A pooling, transform or norm over the positions (a max-pool, an FFT, a group norm) sees "
                                    "this rank's chunks alone: train this model without a cp axis")
        if name in ("_fft_r2c", "_fft_c2c", "_fft_c2r") and a is not None:
            hit = [_norm(int(x), a.ndim) for x in args[1] if _norm(int(x), a.ndim) in dims]
            if hit:
                return self._refuse(f"{func} transformed dim {hit[0]} of a {tuple(a.shape)} tensor, a sequence dim",
                                    "An FFT over the positions sees this rank's chunks alone: train this model without a cp axis")
        # Any other op: its outputs lose the marks (the check cannot tell what it does with positions).

    @staticmethod
    def _moved(name, args, a, dims, o) -> frozenset:
        if name in ("expand", "expand_as"):  # broadcast: dims counted from the right
            return frozenset(d + o.ndim - a.ndim for d in dims)
        if name == "permute":
            perm = [_norm(int(x), a.ndim) for x in args[1]]
            return frozenset(i for i, src in enumerate(perm) if src in dims)
        if name == "t":
            d0, d1 = 0, 1
        else:
            d0, d1 = _norm(int(args[1]), a.ndim), _norm(int(args[2]), a.ndim)
        swap = {d0: d1, d1: d0}
        return frozenset(swap.get(d, d) for d in dims)

    def _set(self, t: torch.Tensor, dims: frozenset, pooled: str | None) -> None:
        if dims:
            self.dims[t] = dims
        else:
            self.dims.pop(t, None)
        if pooled is not None and t.numel() > 1:
            self.pooled[t] = pooled
        else:
            self.pooled.pop(t, None)

    def _refuse_pooled(self, func, pooled: str) -> None:
        self.found = (f"{pooled}, and the pooled value then went through {func}, which is not linear in it. A pooling over "
                      "the sequence sees this rank's chunks alone: combine the pooled sums across the ranks in loss_fn "
                      "before anything else uses them (at dp = 1, sf.psum(x, 'dp'): under cp the step's data axis spans "
                      "the dp x cp ranks, so at dp > 1 it would add other sequences too), or train without a cp axis")

    def _cut(self, func, name, args, kwargs, a, dims, outs, pooled) -> None:
        if name in ("split", "split_with_sizes", "unbind", "chunk", "unsafe_split", "tensor_split"):
            d = _norm(int(args[2] if len(args) > 2 else kwargs.get("dim", 0)), a.ndim) if name != "unbind" else _norm(
                int(args[1] if len(args) > 1 else kwargs.get("dim", 0)), a.ndim)
        else:
            d = _norm(int(args[1] if len(args) > 1 else kwargs.get("dim", 0)), a.ndim)
        if d in dims and self._merged(a, d):  # tokens flattened across the batch: a cut of rows, not of a sequence
            for o in outs:
                self._set(o, frozenset() if name in ("select", "unbind") else dims, pooled)
            return
        if d in dims and (name in ("select", "unbind") or any(o.shape[d] != a.shape[d] for o in outs)):
            self._refuse(f"{func} cut dim {d} of a {tuple(a.shape)} tensor, a sequence dim, to part of this rank's chunks",
                         _SHIFT_HINT)
            return
        for o in outs:
            self._set(o, dims if name != "select" else _after_reduction(dims, [d], False), pooled)

    def _reduce(self, func, name, args, kwargs, a, dims, outs, pooled) -> None:
        if a is None:
            return
        over = _dims_arg(func, args, kwargs, a.ndim)
        reduced = list(range(a.ndim)) if over is None else over
        whole = all(o.numel() <= 1 for o in outs) or len(reduced) == a.ndim and not _keepdim(func, args, kwargs) or name in (
            "any", "all") and over is None
        hit = [d for d in reduced if d in dims]
        if hit and name in _ROUTING and all(self._merged(a, d) for d in hit):  # tokens ranked across the batch (MoE routing)
            for o in outs:
                self._set(o, frozenset(), None)
            return
        if pooled is not None and name in _MIXING:
            return self._refuse_pooled(func, pooled)
        if not hit:
            keep = _keepdim(func, args, kwargs)
            for o in outs:
                self._set(o, dims if o.ndim == a.ndim else _after_reduction(dims, reduced, keep), pooled)
            return
        if name in _MIXING and not (whole and name in _SCALAR_OK):
            self._refuse(f"{func} ran over dim {hit[0]} of a {tuple(a.shape)} tensor, a sequence dim",
                         "Attention written out by hand (a softmax over the keys; torch.nn.MultiheadAttention with its default "
                         "need_weights=True), or a max, a sort, a norm or a cumulative op over the positions, sees this rank's "
                         "chunks alone: call torch.nn.functional.scaled_dot_product_attention for attention (MultiheadAttention: "
                         "need_weights=False), or train this model without a cp axis")
            return
        if whole:  # the loss, or a count: its meaning is the step's mean over ranks
            for o in outs:
                self._set(o, frozenset(), None)
                if name in _SCALAR_OK and name not in ("any", "all"):  # a max, min or norm of this rank's positions alone
                    self.local[o] = f"{func} took dim {hit[0]} of a {tuple(a.shape)} tensor, a sequence dim, to one number at {_caller()}"
            return
        keep = _keepdim(func, args, kwargs)
        where = f"{func} pooled dim {hit[0]} of a {tuple(a.shape)} tensor, a sequence dim, over this rank's chunks at {_caller()}"
        for o in outs:
            self._set(o, _after_reduction(dims, reduced, keep), where)

    def _matmul(self, func, name, args, outs, pooled) -> None:
        ts = [x for x in args if isinstance(x, torch.Tensor)]
        if name in ("addmm", "baddbmm"):
            ts = ts[1:]
        if len(ts) < 2 or not outs:
            return
        a, b = ts[0], ts[1]
        da, db = self.dims.get(a, frozenset()), self.dims.get(b, frozenset())
        if (a in self.pooled or b in self.pooled) and (sum(1 for x in (a, b) if x in self.pooled) > 1 or any(
                x in self.dims and x not in self.pooled for x in (a, b))):
            return self._refuse_pooled(func, pooled)  # a product of two values of the sequence
        o = outs[0]
        contracted = (a.ndim - 1 in da) or (b.ndim >= 2 and b.ndim - 2 in db) or (b.ndim == 1 and 0 in db)
        marked = {d + o.ndim - a.ndim for d in da if d < a.ndim - 1}
        if b.ndim >= 2:
            marked |= {d + o.ndim - b.ndim for d in db if d != b.ndim - 2}
        marked = {d for d in marked if 0 <= d < o.ndim}
        if contracted and o.numel() > 1:
            shape = tuple(a.shape) if a.ndim - 1 in da else tuple(b.shape)
            pooled = pooled or f"{func} summed over the sequence dim of a {shape} tensor (this rank's chunks) at {_caller()}"
        self._set(o, frozenset(marked), pooled if o.numel() > 1 else None)

    def _lookup(self, func, name, args, kwargs, outs) -> None:
        src = args[0]
        sdims = self.dims.get(src, frozenset())
        if name == "embedding":  # (weight, indices): the indices' dims lead
            self._set(outs[0], self.dims.get(args[1], frozenset()), None)
            return
        if name == "index":
            idx = [i for i in args[1]]
            kept = _index_in_place(src, idx, sdims) if sdims else None
            if kept is not None:  # every position where it was: a mask expanded (Hugging Face's padding mask)
                self._set(outs[0], kept, self.pooled.get(src))
                return
            if sdims and any(i is not None and not self._merged(src, k) for k, i in enumerate(idx) if k in sdims):
                return self._refuse(f"{func} indexed dim {min(sdims)} of a {tuple(src.shape)} tensor, a sequence dim",
                                    "A pick of positions by index (the last token of each sequence) reads this rank's chunks "
                                    "alone, in the model and in loss_fn alike: train this model without a cp axis")
            if not sdims and len(idx) == 1 and idx[0] is not None:  # a table looked up by a marked index (positions)
                self._set(outs[0], self.dims.get(idx[0], frozenset()), None)
            return
        d = _norm(int(args[1]), src.ndim)
        if d in sdims and self._merged(src, d):  # rows of flattened tokens picked (MoE dispatch)
            self._set(outs[0], frozenset(), None)
            return
        if d in sdims:
            return self._refuse(f"{func} gathered along dim {d} of a {tuple(src.shape)} tensor, a sequence dim",
                                "A gather of positions reads this rank's chunks alone: train this model without a cp axis")
        self._set(outs[0], sdims, self.pooled.get(src))

    @staticmethod
    def _op(name: str) -> str:
        return f"aten.{name}"

    def _concat(self, name, args, kwargs, outs, pooled) -> None:
        ts = [t for t in args[0] if isinstance(t, torch.Tensor)]
        if not ts:
            return
        d = int(args[1] if len(args) > 1 else kwargs.get("dim", 0))
        if name == "cat":
            d = _norm(d, ts[0].ndim)
            along = [t for t in ts if d in self.dims.get(t, ())]
            if along and len(along) < len(ts):
                return self._refuse(f"{self._op(name)} joined a tensor that is not the sequence to dim {d} of a "
                                    f"{tuple(along[0].shape)} tensor, a sequence dim",
                                    "Tokens put before or after this rank's chunks (a prompt, a shift written with a cat) "
                                    "land in every rank's part of the sequence: add them to the batch before the cut, or "
                                    "train this model without a cp axis")
            joined = [t for t in along if t.shape[d] and not self._merged(t, d)]
            if len(joined) > 1:
                return self._refuse(f"{self._op(name)} joined {len(joined)} sequences end to end along dim {d} of a "
                                    f"{tuple(joined[0].shape)} tensor, a sequence dim",
                                    "Each rank holds a head and a tail chunk of every sequence, and of the joined one "
                                    "it would hold others: train this model without a cp axis")
        marked: set[int] = set()
        for t in ts:
            for x in self.dims.get(t, ()):
                if name == "stack":
                    x = x + 1 if x >= _norm(d, t.ndim + 1) else x
                marked.add(x)
        self._set(outs[0], frozenset(marked), pooled)
