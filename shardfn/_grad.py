"""`sf.value_and_grad` / `sf.grad`: the FSDP gradient of a sharded tree, as a transform.

Note [gradient transform]
~~~~~~~~~~~~~~~~~~~~~~~~~
`value_and_grad(loss_fn)(params, batch)` runs the gradient core of a train step
(`GradientCore.gradients` in `_core.py`): units gathered just in time, freed, gathered again for the backward,
their gradients reduce-scattered as soon as they are complete, the next gather prefetched. Each
rank passes its own batch and gets the loss and the gradients of the mean over ranks, as a train
step does. A train step is this plus the optimizer update, so a step written by hand with
`sf.optim` runs the same code.

The engine computes on per-unit flat buffers (Note [flat unit layout] in `shardfn/_flat.py`). On
the first call, the transform copies the tree's shards into its buffers and then points the
tree's own local tensors at them (`set_`): the tree is unchanged to the user (same DTensors, same
local tensor objects, same values), and later calls with it copy nothing. Views taken with
`to_local()` before the first call still look at the tree's old memory: take them after it. Ownership is checked by
memory, not by object: a tree whose memory another transform (or a train step) took over since is
copied back in. An in-place optimizer step (`opt.step_(grads, state,
params)`) keeps it so. A different tree (one that `sf.apply_updates` returned) is copied in and
takes the buffers over, and the tree that held them before is donated: reading it raises
`sf.DonatedError` (Note [donated state] in `shardfn/_donate.py`). The gradients returned are
DTensors over the transform's gradient buffers, donated at the next call: `sf.copy` keeps them.
"""

from __future__ import annotations

from typing import Any, Callable

import optree
from torch.distributed.tensor import DTensor

from . import _compiled, _donate, _watch
from ._describe import _spec_of
from ._functorch import unwrap
from ._core import GradientCore, MixedPrecision, model_info
from ._tree import tree_flatten_with_paths

__all__ = ["value_and_grad", "grad", "ValueAndGrad"]


class ValueAndGrad:
    """`sf.value_and_grad(loss_fn, ...)`: call it as `fn(params, batch)`; see `value_and_grad`."""

    def __init__(self, loss_fn: Callable, has_aux: bool, options: dict):
        if not callable(loss_fn):
            raise ValueError(f"sf.value_and_grad(loss_fn): loss_fn must be callable, got {type(loss_fn).__name__}")
        self.loss_fn, self.has_aux, self.options = loss_fn, bool(has_aux), options
        self._core: GradientCore | None = None
        self._layout: dict[str, DTensor] = {}
        self._donated: list = []  # the gradients the last call donated (Note [recycled wrappers])

    def _loss(self, params: Any, batch: Any) -> Any:
        out = self.loss_fn(params, batch)
        if self.has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ValueError("has_aux=True: loss_fn must return (loss, aux)")
            return out
        if isinstance(out, tuple):
            raise ValueError("loss_fn returned a tuple: pass has_aux=True to return (loss, aux)")
        return out

    def __call__(self, params: Any, batch: Any) -> tuple[Any, Any]:
        with _watch.watched("sf.value_and_grad"):
            core = self._take(params)
            g = core.gradients(core.tree(), batch)
            message = (
                "these gradients were donated to the next sf.value_and_grad call, whose gradients fill their memory; "
                "keep them with sf.copy(grads)"
            )
            grads = core.held.publish_grads(_donate.Donation(message), {}, self._donated)
            return ((g.loss, g.aux) if self.has_aux else g.loss), grads

    def _take(self, params: Any) -> GradientCore:
        """The core whose buffers `params` now lives in (built on the first call)."""
        paths, leaves, treespec = tree_flatten_with_paths(params)
        wrapped = [p for p, x in zip(paths, leaves) if isinstance(unwrap(x), DTensor) and not isinstance(x, DTensor)]
        if wrapped:
            raise NotImplementedError(
                f"sf.value_and_grad (and sf.grad) cannot run inside a torch.func transform over its params (leaf "
                f"{wrapped[0]!r} is traced by one): its gradient is computed by the unit schedule, outside any "
                "recorded graph. Inside torch.func transforms use torch.func.grad of a function of "
                "sf.gather(params) or apply(params, x), whose gradients are sharded trees too"
            )
        bad = [(p, type(x).__name__) for p, x in zip(paths, leaves) if not isinstance(x, DTensor)]
        if bad:
            raise ValueError(
                f"sf.value_and_grad takes a sharded tree (DTensor leaves, e.g. from sf.shard); leaf {bad[0][0]!r} is a "
                f"{bad[0][1]}. Shard the tree with sf.shard(params, sf.specs(params, mesh), mesh), or use torch.func.grad "
                "for full tensors"
            )
        for p, x in zip(paths, leaves):
            if _donate.is_donated(x):
                raise _donate.DonatedError(x._local_tensor._message)
        core = self._core
        if core is None or core.paths != paths or core.treespec != treespec:
            core = self._core = self._build(params, paths, leaves)
        held = core.held
        if all(_donate.same_memory(x._local_tensor, v) for x, v in zip(leaves, held.views)):
            held.take(leaves)  # already the core's memory
            return core
        for p, x in zip(paths, leaves):
            own = self._layout[p]
            if _same_layout(x, own) and x.placements != own.placements:
                x._spec = own._spec
            if x.placements != own.placements or x.shape != own.shape:
                raise ValueError(
                    f"leaf {p!r} is a DTensor {x.placements} {tuple(x.shape)}; this transform's tree has "
                    f"{own.placements} {tuple(own.shape)} there. Use one sf.value_and_grad per tree layout"
                )
        message = (
            "this tree was donated: another tree was passed to sf.value_and_grad, and its values now fill this "
            "tree's memory. Keep a tree with sf.copy(params)"
        )
        held.adopt(leaves, message, rebind=True)  # a new tree, or one that another transform took over
        return core

    def _build(self, params: Any, paths: list[str], leaves: list[DTensor]) -> GradientCore:
        mesh = leaves[0].device_mesh
        for p, x in zip(paths, leaves):
            if x.device_mesh != mesh:
                raise ValueError(f"leaf {p!r} is on another mesh than {paths[0]!r}: one mesh per tree")
        o = self.options
        info = model_info(o["apply"], paths, leaves)  # Note [compiled code in a step] in `_compiled.py`
        _compiled.refuse_compiled(self.loss_fn, info.module if info is not None else None, "sf.value_and_grad")
        specs = optree.tree_unflatten(optree.tree_structure(params), [_spec_of(x) for x in leaves])
        core = GradientCore(
            self._loss, mesh, specs, o["strategy"], o["mixed_precision"], o["remat"], o["accumulation_steps"],
            apply=o["apply"], frozen=o["frozen"], accumulation=o["accumulation"], group_bytes=o["group_bytes"],
            keep_last_unit=o["keep_last_unit"], randomness=o["randomness"], compile=o["compile"],
            activation_specs=o["activation_specs"],
        )
        core.build(params)  # copies the shards into the core's flat buffers
        for p, x, own in zip(paths, leaves, core.held.params):
            if _same_layout(x, own):
                x._spec = own._spec  # at most a mesh dim of one rank said otherwise: the same local data
                continue
            if o["strategy"] == "no_shard":
                fix = ("under 'no_shard' every leaf is whole on every rank, so pass a replicated tree "
                       "(sf.shard(params, sf.specs(params, mesh, default=sf.P()), mesh))")
            elif core.layout.tp_axis is not None:
                dp, tp = core.layout.shard_axis, core.layout.tp_axis
                fix = (f"on a ({dp}, {tp}) mesh sf.value_and_grad shards every leaf over {dp!r} (FSDP) within its "
                       f"{tp!r} shard, and computes on the tree in that layout: give it one, sf.shard(params, specs, mesh) "
                       f"with each spec naming {dp!r} too (here {_spec_of(own)!r}; P(({tp!r}, {dp!r}), None) for "
                       f"P({tp!r}, None), P({dp!r}, {tp!r}) for P(None, {tp!r}), P({dp!r}) for a leaf whole on {tp!r}), "
                       "or the tree a train step lays out: sf.train_step(loss_fn, opt, mesh, specs=specs).init(params).params")
            else:
                fix = f"shard the tree as it computes on it: spec {_spec_of(own)!r} for this leaf"
            raise ValueError(
                f"strategy={o['strategy']!r} lays leaf {p!r} (shape {tuple(x.shape)}) out as {own.placements} "
                f"(spec {_spec_of(own)!r}), but the tree has it as {x.placements} (spec {_spec_of(x)!r}): {fix}"
            )
        self._layout = {p: own for p, own in zip(paths, core.held.params)}  # the core's own DTensors
        core.held.adopt(leaves, None, rebind=True)  # the tree passed in computes from the core's buffers
        return core


def _same_layout(x: DTensor, own: DTensor) -> bool:
    """Whether `x` holds the same local data as `own` would: the same mesh and shape, and placements
    that differ at most on mesh dims of one rank (`Replicate()` and `Shard(d)` there are one layout)."""
    if x.device_mesh != own.device_mesh or x.shape != own.shape:
        return False
    mesh = x.device_mesh
    return all(a == b or mesh.size(i) == 1 for i, (a, b) in enumerate(zip(x.placements, own.placements)))


def value_and_grad(
    loss_fn: Callable[[Any, Any], Any],
    has_aux: bool = False,
    *,
    strategy: str = "full_shard",
    mixed_precision: MixedPrecision | None = None,
    remat: Any = False,
    accumulation_steps: int = 1,
    accumulation: str = "sharded",
    apply: Any = None,
    frozen: Any = None,
    group_bytes: int | None = None,
    keep_last_unit: bool = True,
    compile: bool | str | dict = False,
    randomness: str = "per_rank",
    activation_specs: Any = None,
) -> ValueAndGrad:
    """The loss and its gradient with respect to a sharded tree, on the FSDP unit schedule.

    Each rank passes its own batch; the loss is the mean over ranks and the gradients are those of
    that mean (the global batch's when the ranks hold equal shares of it; with unequal shares, the
    mean of the ranks' mean losses), as in `train_step`, which is this plus the optimizer update
    (Note [gradient transform] in `shardfn/_grad.py`).

    Args:
        loss_fn: `loss_fn(params, batch) -> loss`, or `(loss, aux)` with `has_aux=True`; `params`
            hold full values wherever they are used, as in `train_step`.
        has_aux: whether `loss_fn` returns `(loss, aux)`.
        strategy, mixed_precision, remat, accumulation_steps, accumulation, apply, frozen,
            group_bytes, keep_last_unit, randomness: as in `train_step`.
        compile: as in `train_step`: False (the default) runs eager; True or a dict of
            `torch.compile` options compiles each unit's forward and backward; "step" the whole
            forward and backward as one graph, from the second call. A compiled
            `loss_fn` or model is refused at the first call with a `ValueError`.
        activation_specs: as in `train_step`: `[(regex, P), ...]` laying out the outputs of the
            matched modules over the mesh's tp axis (sequence parallelism: `sf.rules.LLAMA_SP`,
            `GPT_SP`, `GPT2_SP`; Note [activation layouts] in `shardfn/_layouts.py`).

    Returns:
        `fn(params, batch) -> (loss, grads)` (or `((loss, aux), grads)`), where `params` is a tree of
        DTensors (e.g. from `sf.shard`) and `grads` a tree of DTensors like it (None for frozen
        leaves). The tree passed is taken into the transform's buffers on the first call.

    Example:
        >>> grad_fn = sf.value_and_grad(loss_fn)
        >>> opt_state = opt.init(params)
        >>> for batch in data:
        ...     loss, grads = grad_fn(params, batch)
        ...     opt_state = opt.step_(grads, opt_state, params)   # in place
    """
    options = dict(compile=_compiled.compile_options(compile, "sf.value_and_grad"), strategy=strategy, mixed_precision=mixed_precision, remat=remat, accumulation_steps=accumulation_steps,
                   accumulation=accumulation, apply=apply, frozen=frozen, group_bytes=group_bytes,
                   keep_last_unit=keep_last_unit, randomness=randomness, activation_specs=activation_specs)
    return ValueAndGrad(loss_fn, has_aux, options)


def grad(loss_fn: Callable[[Any, Any], Any], has_aux: bool = False, **options: Any) -> Callable[[Any, Any], Any]:
    """The gradient of `loss_fn` with respect to a sharded tree: `value_and_grad` without the value.

    Args:
        loss_fn, has_aux, **options: as in `value_and_grad`.

    Returns:
        `fn(params, batch) -> grads`, or `(grads, aux)` with `has_aux=True` (as `jax.grad`).

    Example:
        >>> grads = sf.grad(loss_fn)(sharded_params, batch)
    """
    vg = value_and_grad(loss_fn, has_aux, **options)

    def fn(params: Any, batch: Any) -> Any:
        value, grads = vg(params, batch)
        return (grads, value[1]) if has_aux else grads

    fn.value_and_grad = vg  # type: ignore[attr-defined]
    return fn
