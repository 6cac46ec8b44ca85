"""`sf.train_step`: a sharded training step around a pure `loss_fn(params, batch)`.

A step is the gradient core (`_core.GradientCore`: layout, unit schedule, forward and backward,
reductions) followed by the clip, the optimizer's update and the donation of the state it was
given (Note [donated state] in `_donate.py`); `TrainStep._step` reads as those steps in order.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import _compiled, _donate, _estimate, _watch
from ._agree import agree_on_settings, check_sync
from ._context import ContextParallel
from ._core import STRATEGIES, GradientCore, MixedPrecision, model_info
from ._state import TrainState
from ._tree import tree_flatten_with_paths
from .optim import apply_updates
from .optim._base import in_place
from .optim._combine import PartlyUpdatedError

__all__ = ["TrainState", "MixedPrecision", "TrainStep", "train_step", "STRATEGIES"]


class TrainStep:
    """A sharded train step; see `train_step`. Call `init(params)` once, then `step(state, batch)`.

    Attributes:
        core: the gradient core (`_core.GradientCore`): layout, engine, gradients.
        opt: the optimizer.
        max_grad_norm: the clip's global norm, or None.
    """

    def __init__(self, loss_fn, opt, mesh, specs, strategy, mixed_precision, remat, accumulation_steps, max_grad_norm,
                 apply=None, frozen=None, offload=None, accumulation="sharded", group_bytes=None, check_memory=None,
                 keep_last_unit=True, compile=False, randomness="per_rank", batch_specs=None, activation_specs=None):
        # What every rank must have built alike, checked at init (`agree_on_settings`).
        self._settings = {k: _setting(v) for k, v in dict(
            strategy=strategy, mixed_precision=mixed_precision, remat=remat, accumulation_steps=accumulation_steps,
            max_grad_norm=max_grad_norm, frozen=frozen, offload=offload, accumulation=accumulation, group_bytes=group_bytes,
            keep_last_unit=keep_last_unit, compile=compile, randomness=randomness, batch_specs=batch_specs,
            activation_specs=activation_specs, mesh=(tuple(mesh.mesh_dim_names or ()), tuple(mesh.shape))).items()}
        if specs is not None:
            paths, spec_leaves, _ = tree_flatten_with_paths(specs)
            self._settings.update({f"specs[{p!r}]": repr(x) for p, x in zip(paths, spec_leaves)})
        compile = _compiled.compile_options(compile, "sf.train_step")  # Note [compiled units] in `_compiled.py`
        names = tuple(mesh.mesh_dim_names or ())
        if batch_specs is not None and "cp" not in names:
            raise ValueError(
                f"batch_specs= names batch dims split over a cp axis, and this mesh has none (axes {names}): build the mesh "
                "with one, e.g. sf.mesh(dp=2, cp=2), or leave batch_specs out"
            )
        if compile is not None and compile.get("step") and "cp" in names:
            raise NotImplementedError(
                'compile="step" (the whole step as one graph) does not run with context parallelism yet: the ring runs '
                "eager; use compile=True, whose units compile as the graphs around it"
            )
        if compile is not None and "cp" in names and "tp" in names:
            raise NotImplementedError(
                f"compile=True with tensor parallel (a mesh with tp and cp axes {names}) is not supported yet: leave "
                "compile=False on this mesh"
            )
        if compile is not None and "cp" in names:  # the ring runs eager: a unit compiles as the graphs around it
            compile = {**compile, "fullgraph": False}
        # Note [context parallelism] in `_context.py`: the step runs on dp * cp ranks as one data axis.
        self.context = ContextParallel(mesh, batch_specs) if "cp" in names else None
        mesh = self.context.flat if self.context is not None else mesh
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
        self.core = GradientCore(
            loss_fn, mesh, specs, strategy, mixed_precision, remat, accumulation_steps,
            apply=apply, frozen=frozen, offload=offload, accumulation=accumulation, group_bytes=group_bytes,
            keep_last_unit=keep_last_unit, randomness=randomness, compile=compile, activation_specs=activation_specs,
        )
        self.opt = opt
        self.max_grad_norm = max_grad_norm
        self.mesh = mesh
        self.check_memory = _estimate.check_setting(check_memory)  # Note [memory estimate] in `_estimate.py`
        self._memory_checked = False
        self._donated: tuple[list, list, list] = ([], [], [])  # Note [recycled wrappers]

    # What tests and tools read of a step: the core's.
    loss_fn = property(lambda self: self.core.loss_fn, lambda self, fn: setattr(self.core, "loss_fn", fn))
    engine = property(lambda self: self.core.engine)
    grads = property(lambda self: self.core.held.grads)
    paths = property(lambda self: self.core.paths)
    treespec = property(lambda self: self.core.treespec)
    _units = property(lambda self: self.core.units)
    _off_schedule = property(lambda self: self.core.off_schedule)

    def init(self, params: Any, init: str | None = None, *, sync: str | None = "broadcast") -> TrainState:
        """Shards `params` into this step's flat buffers and initializes the optimizer.

        Args:
            params: the full parameter tree, a DTensor tree, or a tree on the meta device (the
                module's initializers fill it).
            init: `"empty"` where values do not matter (memory estimates, simulation): meta leaves
                and the module's meta buffers stay uninitialized, whether the module was built
                under `sf.meta_device()` or plain `torch.device("meta")`; nothing is replayed.
            sync: how the ranks come to hold one model from full leaves each built or loaded itself
                (an unseeded build, a per-rank seed, weights loaded on rank 0 only), and the
                module's buffers: `"broadcast"` (default, as DDP at construction) gives every rank
                rank 0's values, in a few bucketed broadcasts; `"check"` raises a `ValueError` on
                every rank naming the leaves and ranks that differ; None keeps each rank's own,
                unchecked. Meta-device leaves and DTensor leaves are never sent (Note [one model]
                in `shardfn/_agree.py`).

        Returns:
            `TrainState(params=<DTensor tree>, opt_state=..., step=0)`; frozen leaves get no
            optimizer state.

        Raises:
            ValueError: `loss_fn`, or a block of the model, was compiled by the user (Note
                [compiled code in a step] in `shardfn/_compiled.py`).
        """
        self._refuse_compiled(params)
        check_sync(sync, "step.init")
        if sync is not None:
            agree_on_settings(self._settings, self.mesh, "step.init")
        if self.check_memory is not False:
            _estimate.check_memory(self, params, None, self.check_memory)
        params = self.core.build(params, init, sync)
        return TrainState(params=params, opt_state=self.opt.init(self.core.trainable(params)), step=0)

    def _refuse_compiled(self, params: Any) -> None:
        """Refuses a compiled `loss_fn` or a model holding compiled blocks, before anything is traced."""
        paths, leaves, _ = tree_flatten_with_paths(params)
        try:
            info = model_info(self.core.apply, paths, leaves)
        except ValueError:
            info = None  # which model: `core.build` refuses it with its own message
        _compiled.refuse_compiled(self.core.loss_fn, info.module if info is not None else None, "sf.train_step")

    # -- the step -------------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        with _watch.watched("the train step"):
            return self._step(state, batch)

    def _step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        if self.core.engine is None:
            raise ValueError("call step.init(params) before the first step")
        params = self._adopt(state.params)
        if not self._memory_checked:  # until a first step passes it: a refused batch tried again is checked again
            if _estimate.checks_first_step(self.check_memory, self.mesh.device_type):
                _estimate.check_memory(self, params, batch, self.check_memory)
            self._memory_checked = True
        if self.context is None:
            g = self.core.gradients(params, batch)
        else:
            # The first step's forward is watched for positions mixed outside attention, in eager
            # mode (Note [positions mixed outside attention] in `_positions.py`).
            # The watch is made as the block begins, and the cut marks the sequence dims for it.
            with self.context.attention(watch=self.core.compiled is None):
                local = self.context.cut(batch)
                info = self.core.engine.info
                self.context.check_windows(info.module if info is not None else None)
                g = self.core.gradients(params, local)
            self.context.check_attended()
            self.context.check_positions()
        self._clip(g.grad_norm)
        # Scalars of the optimizer state (its step count) are updated in place: the input state
        # keeps its own (Note [donated state]).
        opt_leaves, opt_spec = optree.tree_flatten(state.opt_state, none_is_leaf=True)
        opt_in = optree.tree_unflatten(opt_spec, [_scalar_copy(x) for x in opt_leaves])
        try:
            opt_state = self._optimize(params, g.grads, opt_in, g.skip)
        except PartlyUpdatedError as e:
            # Its moments are partly this step's: the state it was read from is invalidated, loudly.
            _donate.Donation(str(e)).many([x for x in opt_leaves if isinstance(x, DTensor) and not _donate.is_donated(x)], {})
            raise
        params, opt_state = self._donate(state, opt_state)
        metrics = {"loss": g.loss, "grad_norm": g.grad_norm, "aux": g.aux}
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

    def _clip(self, grad_norm: torch.Tensor) -> None:
        """Scales the gradients to `max_grad_norm` when their global norm exceeds it."""
        if self.max_grad_norm is not None:
            self.core.scale_grads(torch.clamp(self.max_grad_norm / (grad_norm + 1e-6), max=1.0))

    def _adopt(self, params: Any) -> Any:
        """Makes `params` this step's own flat-buffer DTensors (copying values in if they are not)."""
        held = self.core.held
        if held.holds(optree.tree_leaves(params)):
            return params
        paths, leaves, _ = tree_flatten_with_paths(params)
        if paths != self.core.paths:
            raise ValueError("state.params does not have the structure this step was initialized with")
        for i, leaf in enumerate(leaves):
            dst = held.params[i]
            if not isinstance(leaf, DTensor) or leaf.placements != dst.placements or leaf.shape != dst.shape:
                raise ValueError(
                    f"state.params leaf {paths[i]!r} is {type(leaf).__name__} "
                    f"{getattr(leaf, 'placements', '')} {tuple(leaf.shape)}; expected a DTensor "
                    f"{dst.placements} {tuple(dst.shape)} as step.init returns"
                )
            if _donate.is_donated(leaf):
                raise _donate.DonatedError(leaf._local_tensor._message)
        # The step's buffers take these values (a copy, an unpickled state, or its own state that
        # another transform took over): the state that held them before is donated.
        held.adopt(leaves, _replaced(), rebind=False)
        return held.tree()

    def _donate(self, state: TrainState, opt_state: Any) -> tuple[Any, Any]:
        """New DTensors over the step's memory for the returned state and `step.grads`; the input
        state's and the old gradients' DTensors are donated (Note [donated state])."""
        donation = _donate.Donation(_donated(state.step + 1))
        memo: dict[int, DTensor] = {}
        held = self.core.held
        leaves = optree.tree_leaves(state.params)
        if len(leaves) != len(held.params) or not all(map(operator.is_, leaves, held.params)):
            # a copy that was copied in is donated too
            donation.many([x for x in leaves if isinstance(x, DTensor) and not _donate.is_donated(x)], memo)
        kept = self._donated
        params = held.publish(donation, memo, kept[0], kept[1])
        opt_leaves, opt_spec = optree.tree_flatten(opt_state, none_is_leaf=True)
        opt_state = optree.tree_unflatten(opt_spec, donation.many(opt_leaves, memo, kept[2]))
        return params, opt_state

    def _optimize(self, params: Any, grads: Any, opt_state: Any, skip: list[int]) -> Any:
        """The optimizer's update, in place; trained leaves at positions `skip` keep their values
        and their optimizer state (Note [leaves without a gradient])."""
        trainable = self.core.trainable(params)
        idx = [self.core.trained_index[k] for k in skip]  # positions in the tree, frozen leaves counted
        kept = _keep(trainable, opt_state, idx) if skip else None
        step_ = in_place(self.opt, "step_")  # none for a user's (init, update), or one rebuilt with another update
        if step_ is not None:
            opt_state = step_(grads, opt_state, trainable)
        else:
            updates, opt_state = self.opt.update(grads, opt_state, trainable)
            new = optree.tree_leaves(apply_updates(trainable, updates))
            old = optree.tree_leaves(trainable)
            with torch.no_grad():
                torch._foreach_copy_([p._local_tensor for p in old], [x._local_tensor if isinstance(x, DTensor) else x for x in new])
        if kept is not None:
            _restore(trainable, opt_state, idx, kept)
        return opt_state


# Note [leaves without a gradient]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.optim skips a parameter whose `.grad` is None: a head used only on some steps, a pooler the
# loss never reaches, a unit that did not run keep their values and their optimizer state (no
# weight decay, no momentum). The reduction needs a gradient for every trained leaf of a unit, so
# a leaf that got none on this rank counts as zero there; which leaves got one on some rank rides
# on the step's metrics all-reduce, and the leaves that got none anywhere are put back, values and
# optimizer state, after the optimizer's update (only on steps where this rank saw such a leaf).
# The optimizer state put back is every part of it that holds something per parameter: any
# subtree whose structure starts with the parameter tree's (moments, momentum, a masked
# transform's inner state, a wrapped torch optimizer's per-parameter dicts).
# One difference remains with torch.optim: `sf.optim`'s step count is one for all leaves, as in
# optax, so a leaf's Adam bias correction later counts the steps it skipped, and so does SGD's
# first momentum step under dampening (torch's buffer takes the leaf's first gradient undamped;
# here the shared first step decides, and a later first gradient is damped).
def _per_leaf(trainable: Any, opt_state: Any) -> list[list[Any]]:
    """The trained parameters, and each part of `opt_state` that holds something per parameter
    (moments, momentum, a masked transform's state, a torch optimizer's state dicts), each as one
    entry per leaf of the parameter tree (frozen leaves are None)."""
    spec = optree.tree_structure(trainable, none_is_leaf=True)

    def per_leaf(x: Any) -> list | None:
        # Asked first: a failed flatten_up_to formats `x` into its error message, DTensors and all.
        if not spec.is_prefix(optree.tree_structure(x, none_is_leaf=True)):
            return None
        return spec.flatten_up_to(x)

    found = [optree.tree_leaves(trainable, none_is_leaf=True)]
    for sub in optree.tree_leaves(opt_state, is_leaf=lambda x: per_leaf(x) is not None, none_is_leaf=True):
        entries = per_leaf(sub)
        if entries is not None and sub is not trainable:
            found.append(entries)
    return found


def _tensors(entry: Any) -> list[torch.Tensor]:
    return [_local(t) for t in optree.tree_leaves(entry) if isinstance(t, torch.Tensor)]


def _local(x: Any) -> torch.Tensor:
    return x._local_tensor if isinstance(x, DTensor) else x


def _keep(trainable: Any, opt_state: Any, idx: list[int]) -> list[list[torch.Tensor]]:
    """Copies of what each part of the state holds for each leaf at `idx` (Note [leaves without a
    gradient]), one list per (part, leaf)."""
    return [[t.clone() for t in _tensors(e[i])] for e in _per_leaf(trainable, opt_state) for i in idx]


def _restore(trainable: Any, opt_state: Any, idx: list[int], kept: list[list[torch.Tensor]]) -> None:
    """Puts back what `_keep` copied. A part that held nothing for a leaf and was filled by this
    update (a torch optimizer makes a parameter's state at its first step) is emptied again, as
    torch leaves the state of a parameter it never stepped."""
    dst, src = [], []
    for (entry, i), old in zip(((e, i) for e in _per_leaf(trainable, opt_state) for i in idx), kept):
        new = _tensors(entry[i])
        if len(new) == len(old):
            dst += new
            src += old
        elif not old and isinstance(entry[i], dict):
            entry[i].clear()
        else:
            raise RuntimeError(
                f"the optimizer's state for a leaf without a gradient went from {len(old)} to {len(new)} tensors in one "
                "update, so it cannot be put back as torch.optim leaves such a parameter (Note [leaves without a gradient])"
            )
    if dst:
        with torch.no_grad():
            torch._foreach_copy_(dst, src)


def _scalar_copy(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.numel() == 1 else x


def _setting(x: Any) -> str:
    """A step option as text that every rank built alike writes alike (a function by its name, not
    its address)."""
    if callable(x) and not isinstance(x, type):
        return getattr(x, "__qualname__", type(x).__qualname__)
    if isinstance(x, (list, tuple)):
        return "(" + ", ".join(_setting(v) for v in x) + ")"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {_setting(v)}" for k, v in x.items()) + "}"
    return repr(x)


def _donated(step: int) -> str:
    return (
        f"this state was donated to the train step that made step {step}: its memory holds the state that "
        "step returned. Use the returned state, or keep one with sf.copy(state) before the step (Note "
        "[donated state] in shardfn/_donate.py)"
    )


def _replaced() -> str:
    return (
        "this state was replaced: another state was passed to the train step, whose values now fill its memory. "
        "Keep a state with sf.copy(state) before the step (Note [donated state] in shardfn/_donate.py)"
    )


def train_step(
    loss_fn: Callable[[Any, Any], Any],
    opt: Any,
    mesh: DeviceMesh,
    specs: Any = None,
    strategy: str = "full_shard",
    mixed_precision: MixedPrecision | None = None,
    remat: bool = False,
    accumulation_steps: int = 1,
    max_grad_norm: float | None = None,
    *,
    apply: Any = None,
    frozen: str | Sequence[str] | None = None,
    offload: str | None = None,
    accumulation: str = "sharded",
    group_bytes: int | None = None,
    check_memory: bool | int | None = None,
    keep_last_unit: bool = True,
    compile: bool | str | dict = False,
    randomness: str = "per_rank",
    batch_specs: Any = None,
    activation_specs: Any = None,
) -> TrainStep:
    """Builds a sharded train step around `loss_fn(params, batch)`.

    Parameters, gradients and optimizer state are sharded over `mesh`; each unit of the model (the
    `units` of the `sf.functionalize` that `loss_fn` calls) is gathered just before its forward and
    freed right after (but the last: `keep_last_unit`), gathered again for its backward, and its
    gradients are reduce-scattered as soon as they are complete (see Note [unit schedule] in
    `shardfn/_engine.py`).

    Args:
        loss_fn: `loss_fn(params, batch) -> loss` or `(loss, aux)`; `params` are full tensors in the
            compute dtype, `batch` this rank's local batch.
        opt: a `GradientTransformation` (see `sf.optim`).
        mesh: the device mesh (see `sf.mesh`).
        specs: a tree of `P` like `params` (default: `sf.specs(params, mesh)`).
        strategy: "full_shard", "shard_grad_op" (no re-gather in backward), "no_shard" (DDP), or
            "hybrid_shard" (on `sf.mesh(replicate=R, shard=S)`: shard within the shard axis,
            all-reduce gradients across the replicate axis; `sf.mesh(replicate=-1, shard=-1)`
            shards within each node and replicates across nodes).
        mixed_precision: dtypes for compute, reduction and buffers, or None.
        remat: recompute unit activations in backward: True for every unit, or a regex (or list)
            over unit names.
        accumulation_steps: micro-batches per step, split from `batch` along dim 0 (`metrics["aux"]` is then the last one's).
        max_grad_norm: clip gradients to this global norm, or None.
        apply: the `sf.functionalize` function whose units to use (default: found by the params' names).
        frozen: a regex (or list) over dotted parameter names: those leaves are not trained (no
            gradient, no reduction, no optimizer state).
        offload: "cpu" keeps sharded params, gradients and optimizer state in pinned CPU memory and
            steps the optimizer there (CUDA meshes; on a CPU mesh everything already is on the CPU,
            so it changes nothing).
        accumulation: "sharded" reduce-scatters every micro-batch into the sharded gradient (memory
            stays flat); "local" keeps full gradients across micro-batches and reduces once (less
            communication, more memory).
        group_bytes: consecutive small units whose full parameters fit in this many bytes together
            are gathered and reduced as one (Note [unit groups] in `shardfn/_engine.py`); None: 2 MiB;
            0: every unit alone.
        check_memory: refuse with `sf.MemoryCheckError` (a `MemoryError`), before allocating, a
            step whose estimated peak per rank (`sf.estimate_memory`) exceeds the memory available:
            None (default) checks the state at `init`, and on CUDA also the first step with its
            batch; True checks both on any device; an int is a budget in bytes instead of the
            device's free memory (both checks); False checks nothing.
        keep_last_unit: under `full_shard` and `hybrid_shard`, the last unit to run in the forward stays
            gathered from its forward to its backward, which comes first (one all-gather fewer per
            step, as torchtitan does for FSDP2's last block); False frees it like the others, its
            full size less while the loss (the largest activations, often the peak) is computed.
        compile: False (the default) runs the step eager. True compiles each unit's forward (and
            its backward) with `torch.compile(fullgraph=True)`, the gathers and reductions eager
            around it; a dict of `torch.compile` options is taken over that (Note [compiled units]
            in `shardfn/_compiled.py`). On a (dp, tp) mesh from the second step; not with
            `activation_specs` nor on a mesh with tp and cp axes yet (`NotImplementedError`); on a
            cp mesh the units compile around the ring attention. "step" (or a dict with
            `"step": True`) compiles the whole forward and backward as one graph, gathers and
            reduce-scatters inside, from the second step (Note [the step as one graph] in
            `shardfn/_step_graph.py`).
            A `loss_fn` or blocks compiled by the user are refused at `init` with a `ValueError`.
        randomness: "per_rank" (the default): each data-parallel rank draws its own random numbers
            in the step (dropout masks differ over the global batch; tensor-parallel peers draw the
            same), folded in from one draw of the generator, as JAX's `fold_in(key, axis_index)`;
            "same": every rank draws from its generator as it stands (ranks seeded alike draw
            alike). Note [randomness per rank] in `shardfn/_rng.py`.
        batch_specs: on a mesh with a `cp` axis (`sf.mesh(dp=2, cp=2)`), a `P` per batch leaf (or a
            prefix of the batch's tree) naming its sequence dims "cp", e.g. `sf.P(None, "cp")`: each
            rank passes the batch of its dp coordinate, the step cuts the sequence (a head and a
            tail chunk per cp rank) and runs `F.scaled_dot_product_attention` as exact ring
            attention over cp; parameters are sharded over dp and cp together. Pass global
            position ids in the batch (Note [context parallelism] in `shardfn/_context.py`).
        activation_specs: on a (dp, tp) mesh, `[(regex, P), ...]`: the output of each module whose
            dotted path matches (in full, the first rule winning) is laid out as its spec says
            over tp, as `sf.constrain` would inside the model; `sf.rules.LLAMA_SP` is sequence
            parallelism for Llama-like models (Note [activation layouts] in `shardfn/_layouts.py`).
            A rule matching no module is a `ValueError` at `init`.

    Returns:
        A `TrainStep`: `state = step.init(params)`, then `state, metrics = step(state, batch)`.

    Example:
        >>> step = sf.train_step(loss_fn, sf.optim.adamw(1e-3), sf.mesh(dp=-1))
        >>> state = step.init(params)
        >>> state, metrics = step(state, batch)
    """
    return TrainStep(
        loss_fn, opt, mesh, specs, strategy, mixed_precision, remat, accumulation_steps, max_grad_norm,
        apply=apply, frozen=frozen, offload=offload, accumulation=accumulation, group_bytes=group_bytes,
        check_memory=check_memory, keep_last_unit=keep_last_unit, compile=compile, randomness=randomness,
        batch_specs=batch_specs, activation_specs=activation_specs,
    )
