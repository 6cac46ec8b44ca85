"""The whole step as one graph: `compile="step"`.

Note [the step as one graph]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
`compile=True` compiles each unit's forward and leaves the schedule (gathers, frees, reductions)
to the engine's hooks, eager. `compile="step"` hands the compiler the whole forward and backward
instead, collectives included, as SimpleFSDP does (arXiv 2411.00284): the compiled function takes
each unit's flat buffer of this rank's shards (`FlatUnit.local`, Note [flat unit layout] in
`_flat.py`) and the batch, all-gathers each unit's sharded part with a functional collective whose
backward is the reduce-scatter (`all_gather_tensor_autograd`), cuts the gathered rows into the
full leaves, and runs `loss_fn` on the tree of them (`apply` calls `torch.func.functional_call`,
which dynamo traces, in place of the eager engine). Autograd through that graph gives each rank
the sum over ranks of the gradient of its shards: the reduce-scatter, bucketed and reordered
against compute by the compiler, not by hooks. What the backward keeps is the compiler's: it keeps
the gathered parameters (collectives are not recomputed), so under every strategy the step's
memory is `shard_grad_op`'s, not `full_shard`'s. Recomputing the gathers for the backward
(SimpleFSDP's selective checkpointing around the forward) was tried: in torch 2.13 it left
functional collectives unwaited in some processes (a second compiled model, dynamic shapes), a few
MB held per step for good, and it turned any Python side effect of `loss_fn` into a checkpoint
error; it is not used.
Leaves whole on every rank (`no_shard`, or a spec that replicates a leaf) are read in place from
the shard buffer, and their gradients are all-reduced after the backward, in one call per unit;
under `hybrid_shard` the graph gathers and reduce-scatters over the unit's shard group, and each
unit's gradient shard is then all-reduced over the replicas, in one call per unit, as the eager
step does.
The optimizer, clipping and the donation of the state run after the graph, eager, on the same
flat buffers as every other step.

Which leaves got a gradient (Note [leaves without a gradient] in `_train.py`: torch.optim skips a
leaf no loss reached) is read from the graph, not from the values: each full leaf passes a marker
(`_leaf`) that dynamo keeps in the graph, and the backend, before it hands the graph on, finds the
leaves from which no path of tensors that need a gradient reaches the loss, then removes the
markers. Each compiled graph keeps its own list, set as that graph runs.

The first step runs eager on the unit schedule (it checks the model as every first step does:
units run on every rank, parameters not written in the forward, buffers); the steps after it run
the graph. What is not built for it yet is refused where the step is built
(`NotImplementedError`): tensor parallelism, context parallelism and `activation_specs`,
offload, a
leaf split on another dim than 0, a `loss_fn` over no functionalized model, and the named
collectives inside `loss_fn` (refused when the graph is traced, with dynamo's reason).
Collectives inside the graph are functional ones that `shardfn._collectives.STATS` does not count.
"""

from __future__ import annotations

import logging
import operator
import time
import types
import weakref
from typing import Any, Callable

import optree
import torch

from . import _collectives as C
from . import _watch
from ._loss import add_loss, split_batch, split_loss
from ._models import GraphRun
from ._remat import select_units
from ._tree import nest

__all__ = ["WholeStep", "refuse_unsupported", "step_option"]

_log = logging.getLogger("shardfn")


@torch.compiler.allow_in_graph
def _leaf(x: torch.Tensor, index: int) -> torch.Tensor:
    """Marks the full value of tree leaf `index` in the graph (removed before the graph compiles)."""
    return x.view(x.shape)


def step_option(compile: dict | None) -> tuple[dict | None, bool]:
    """(the `torch.compile` options, whether the step is one graph) of a `compile_options` result."""
    if compile is None:
        return None, False
    return {k: v for k, v in compile.items() if k != "step"}, bool(compile.get("step"))


def refuse_unsupported(core: Any) -> None:
    """`compile="step"` with what it does not run yet: a `NotImplementedError` naming it."""
    layout = core.layout
    why = None
    if layout.tp_axis is not None:
        why = f"a mesh of axes {tuple(core.mesh.mesh_dim_names or ())} (tensor parallel, or axes beside the data axis)"
    elif core.layouts is not None:
        why = "activation_specs (sequence parallelism)"
    elif core.offload is not None:
        why = "offload"
    if why is not None:
        raise NotImplementedError(
            f'compile="step" (the whole step as one graph) does not run with {why} yet: use compile=True (each '
            "unit's forward and backward compiled, the schedule eager), or leave it out (Note [the step as one "
            "graph] in shardfn/_step_graph.py)"
        )


class WholeStep:
    """The forward and backward of a train step's `loss_fn` as one compiled graph (Note [the step
    as one graph]).

    Args:
        core: the `GradientCore` whose units, loss and layout it computes with (built).
        info: the functionalized model (`_models.ModelInfo`).
        options: `torch.compile` options (`backend`, `dynamic`; `fullgraph` is always on).
    """

    def __init__(self, core: Any, info: Any, options: dict):
        self.core, self.info = core, info
        bad = sorted(k for k in options if k not in ("fullgraph", "backend", "dynamic", "disable"))
        if bad or options.get("fullgraph") is False:
            raise NotImplementedError(
                f'compile="step" takes the torch.compile options backend and dynamic; {bad or ["fullgraph=False"]} are not '
                "supported with it yet (the whole step must be one graph)"
            )
        self.units = [u for u in core.units.values()]
        for unit in self.units:
            other = [s.path for s in unit.segments if s.sharded and s.dim != 0]
            if other:
                raise NotImplementedError(
                    f'compile="step" does not run leaves split on another dim than 0 yet ({other[:3]}): split them on '
                    "dim 0, or use compile=True"
                )
        self.n_leaves = len(core.paths)
        # What the model's hooks do in the graph (Note [remat in the graph]; Note [mixed precision in the graph])
        remat = frozenset(select_units(core.remat, info.unit_names)) if core.remat else frozenset()
        self.run = GraphRun(cast=core.mp.param_dtype, remat=remat)
        self.ready = False  # the first step runs eager (Note [the step as one graph])
        self.graphs = 0  # how many graphs were compiled
        self.compile_seconds: float | None = None
        self.last_unused: tuple[int, ...] = ()  # the leaves without a gradient in the graph that ran last
        # A code object of its own: dynamo keeps its graphs and guards on the code object it
        # compiled, and a step's would otherwise be shared by every step of the process (each new
        # step a recompile of the one frame, up to dynamo's limit) and keep every model alive.
        own = types.FunctionType(_run.__code__.replace(), _run.__globals__, _run.__name__)
        # Note [dynamic shapes in the graph]: dynamic=True marks the batch's dims, not the whole frame.
        self.dynamic_batch = options.get("dynamic") is True
        self._fn = torch.compile(own, backend=_Backend(self, options.get("backend", "inductor")), fullgraph=True,
                                 dynamic=None if self.dynamic_batch else options.get("dynamic"),
                                 disable=bool(options.get("disable", False)))

    # -- what the graph computes --------------------------------------------------------------
    def _full_leaves(self, locals_: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Every leaf's full value, gathered from the units' shard buffers, in tree order, in the
        unit's compute dtype (Note [mixed precision in the graph])."""
        full: list[torch.Tensor | None] = [None] * self.n_leaves
        for unit, local in zip(self.units, locals_):
            gathered = None
            if unit.S:
                gathered = C.traced_gather(local[: unit.S], unit.world, unit.group, unit.compute_dtype,
                                           unit.reduce_dtype).view(unit.world, unit.S)
            for s in unit.segments:
                if s.sharded:
                    rows = gathered[:, s.offset : s.offset + s.seg_numel].reshape(unit.world * s.chunk, *s.shape[1:])
                    value = rows[: s.shape[0]]
                else:
                    value = local[s.offset : s.offset + s.seg_numel].view(s.shape).to(unit.compute_dtype)
                if not s.trained:
                    value = value.detach()
                full[s.index] = _leaf(value, s.index)
        return full

    def step(self, locals_: list[torch.Tensor], batch: Any) -> tuple:
        """What the graph computes: `loss_fn` on the gathered tree, as (loss, aux)."""
        out = self.core.loss_fn(nest(zip(self.core.paths, self._full_leaves(locals_))), batch)
        # the loss first: the graph's first output, from which the backend follows the gradient
        return (out[0], out[1]) if isinstance(out, tuple) and len(out) == 2 else (out, None)

    # -- one step -------------------------------------------------------------------------------
    def gradients(self, batch: Any) -> tuple:
        """Forward and backward of every micro-batch through the graph; the gradients summed over
        the ranks into the units' gradient buffers (`had_grad` set from the graph). Returns this
        rank's loss, summed over micro-batches, and the last micro-batch's aux."""
        core, k = self.core, self.core.accumulation_steps
        scale = 1.0 / (k * core.layout.data_world)  # the reduce-scatter sums: the mean over ranks and micro-batches
        started = time.perf_counter() if self.compile_seconds is None else None
        locals_ = [u.local.detach().requires_grad_(u.n_trained > 0) for u in self.units]
        wants = [x for x in locals_ if x.requires_grad]
        sums: list[torch.Tensor | None] = [None] * len(wants)
        loss_sum = aux = None
        unused: set[int] = set(range(self.n_leaves))
        self.info.whole_step = self.run
        try:  # the step's outcome is recorded as an eager step's is (Note [out of step] in `_watch.py`)
            with torch.enable_grad():
                for micro in split_batch(batch, k):
                    loss, aux = split_loss(self._traced(locals_, micro))
                    loss_sum = add_loss(loss_sum, loss)
                    unused &= set(self.last_unused)
                    grads = torch.autograd.grad(loss * scale, wants, allow_unused=True) if wants else ()
                    sums = [g if s is None else s if g is None else s + g for s, g in zip(sums, grads)]
        except BaseException as e:
            _watch.report_step(e)
            raise
        finally:
            self.info.whole_step = None
        _watch.report_step(None)
        if started is not None:
            self.compile_seconds = time.perf_counter() - started
            _log.info('shardfn: compile="step" compiled the step in %.1f s (%d graph(s))', self.compile_seconds, self.graphs)
        self._put(locals_, iter(sums), unused)
        return loss_sum, aux

    def _traced(self, locals_: list[torch.Tensor], micro: Any) -> Any:
        """The compiled function on one micro-batch; what dynamo could not trace as one graph is a
        `NotImplementedError` that says so, with dynamo's reason, before anything is applied."""
        if self.dynamic_batch:
            _batch_dims_dynamic(micro)
        try:
            return self._fn(self, locals_, micro)
        except Exception as e:
            if not type(e).__module__.startswith("torch._dynamo"):
                raise
            said = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise NotImplementedError(
                'compile="step" could not trace loss_fn and the model as one graph, so this step computed nothing. What '
                "stops it: the named collectives (sf.psum, ...), logging or I/O in loss_fn or the model (Hugging Face's "
                "loss with labels= logs a warning: compute the loss from the logits), Python that reads tensor values "
                "(.item(), an if on a tensor), and Python values that change every step (a global step counter: a recompile "
                "per value until dynamo makes it an input or reaches its limit; pass it as a tensor in the batch). compile=True compiles each "
                f"unit and runs the rest eager. Dynamo said: {type(e).__name__}: {said}"
            ) from e

    def _put(self, locals_: list[torch.Tensor], sums: Any, unused: set[int]) -> None:
        """The graph's gradients into the units' gradient buffers; leaves whole on every rank summed
        over the ranks (one all-reduce per unit)."""
        with torch.no_grad():
            for unit, local in zip(self.units, locals_):
                g = next(sums) if local.requires_grad else None
                unit.alloc_grad()
                if g is None:
                    unit.grad.zero_()
                else:
                    unit.grad.copy_(g)
                    if unit.R_trained and unit.world > 1:
                        _all_reduce(unit.grad[unit.S : unit.S + unit.R], unit.reduce_dtype, unit.group)
                    if unit.replicate_group is not None:  # hybrid_shard: the sum over the replicas too
                        _all_reduce(unit.grad[unit.S_frozen : unit.S + unit.R_trained], unit.reduce_dtype, unit.replicate_group)
                for j, s in enumerate(unit.segments):
                    unit.had_grad[j] = s.trained and s.index not in unused


# Note [remat in the graph]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A unit `remat` chooses runs its forward under `torch.utils.checkpoint` (non-reentrant) in the graph
# too: remat's wrapper of the unit's forward (`_remat.py`) sees `GraphRun.remat` while dynamo traces
# and checkpoints the forward there, and the compiler recomputes the unit's activations in the
# backward instead of keeping them. The gathers stay outside the checkpointed regions, so no
# collective is recomputed (the gathered parameters are kept, as without remat). A unit's buffers
# are read as they are: a forward that writes its buffers (BatchNorm's statistics) is traced as
# dynamo allows it under a checkpoint, or refused with dynamo's reason.


# Note [mixed precision in the graph]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The graph computes what the eager engine computes under `MixedPrecision`: each unit's shard is
# cast to the compute dtype and gathered in it; the gradient of the gathered rows is cast to the
# reduce dtype, reduce-scattered in it and cast to the shard's dtype (`_collectives.traced_gather`).
# Leaves whole on every rank are cast to the compute dtype in place, and their gradients
# all-reduced in the reduce dtype after the backward (`WholeStep._put`). The inputs of `apply` and
# of every unit are cast as the engine's hooks cast them (`GraphRun.cast`, read by the
# unit hooks in `_functional.py`). Buffers are in `buffer_dtype` from the step's build on, as for
# every step. Accumulated micro-batches add up in the shard's dtype, after each one's reduction.


# Note [dynamic shapes in the graph]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `torch.compile(..., dynamic=True)` makes every int the traced frame reads symbolic, and the step's
# frame reads its layout from Python objects (each unit's shard length, segment offsets and
# shapes): the whole layout became symbols, guarded and simplified in every graph, and dynamo
# traced the frame twice. So `dynamic=True` means here what users mean by it: the batch's dims are
# dynamic (`torch._dynamo.maybe_mark_dynamic` on every dim of every tensor of the batch before each
# call; a dim the model ties to a constant is specialized, without an error), and the frame compiles
# with torch's default, automatic dynamic shapes, which leave the layout's ints static. Without
# `dynamic`, a new batch shape recompiles once with the dims that changed dynamic (torch's
# default); `dynamic=False` compiles a graph per shape.


def _batch_dims_dynamic(batch: Any) -> None:
    """Marks every dim of every tensor in `batch` dynamic (Note [dynamic shapes in the graph])."""
    import torch._dynamo

    for x in optree.tree_leaves(batch):
        if isinstance(x, torch.Tensor):
            for d in range(x.dim()):
                torch._dynamo.maybe_mark_dynamic(x, d)


def _all_reduce(t: torch.Tensor, dtype: torch.dtype, group: Any) -> None:
    """`t` summed over `group` in place, the sum taken in `dtype` (Note [mixed precision in the graph])."""
    if t.dtype == dtype:
        C.all_reduce(t, group)
    else:
        summed = t.to(dtype)
        C.all_reduce(summed, group)
        t.copy_(summed)


class _Backend:
    """The step's `torch.compile` backend: reads which leaves get a gradient off dynamo's graph,
    takes the markers out, and hands the graph to the compiler named (Note [the step as one graph]).
    It holds its step weakly: torch keeps every backend it was given for the life of the process."""

    def __init__(self, whole: "WholeStep", name: str):
        self.whole, self.name = weakref.ref(whole), name

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._dynamo import lookup_backend

        unused = _leaves_without_gradient(gm)
        whole = self.whole()
        if whole is not None:
            whole.graphs += 1
        compiled = lookup_backend(self.name)(gm, example_inputs)
        ref = self.whole

        def run(*args: Any) -> Any:
            w = ref()
            if w is not None:
                w.last_unused = unused
            return compiled(*args)

        return run


def _run(whole: Any, locals_: list[torch.Tensor], batch: Any) -> Any:
    """What each step's compiled function runs (a copy of its code per step: `WholeStep.__init__`)."""
    return whole.step(locals_, batch)


def _leaves_without_gradient(gm: torch.fx.GraphModule) -> tuple[int, ...]:
    """The tree leaves (indices) marked in `gm` from which no path of tensors that need a gradient
    reaches the loss (the graph's first output); the markers are removed from `gm` and the graphs
    it calls (a checkpointed region is a subgraph of its own)."""
    marks = {n.args[1] for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
             for n in m.graph.nodes if n.op == "call_function" and n.target is _leaf}
    reached, _ = _reached(gm, {0})
    for m in gm.modules():
        if isinstance(m, torch.fx.GraphModule):
            for n in [n for n in m.graph.nodes if n.op == "call_function" and n.target is _leaf]:
                n.replace_all_uses_with(n.args[0])
                m.graph.erase_node(n)
            m.recompile()
    return tuple(sorted(marks - reached))


def _carries_gradient(n: torch.fx.Node) -> bool:
    value = n.meta.get("example_value")
    values = value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


def _reached(gm: torch.fx.GraphModule, wanted: set[int] | None) -> tuple[set[int], set[int]]:
    """(the marked leaves, the positions of `gm`'s inputs) from which a path of tensors that need a
    gradient reaches `gm`'s outputs at positions `wanted` (None: all). A higher-order op that runs
    a subgraph (the checkpointed region) is followed into it."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    stack = [o for i, o in enumerate(outs) if isinstance(o, torch.fx.Node) and (wanted is None or i in wanted)]
    seen: set = set()
    marks: set[int] = set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target is _leaf:
            marks.add(n.args[1])
            stack.append(n.args[0])
            continue
        if not _carries_gradient(n):
            continue
        body = n.args[0] if n.op == "call_function" and n.args and isinstance(n.args[0], torch.fx.Node) else None
        sub = getattr(gm, body.target, None) if body is not None and body.op == "get_attr" else None
        if isinstance(sub, torch.fx.GraphModule):  # a subgraph: what of it reaches the outputs used here
            used = {u.args[1] for u in n.users if u.op == "call_function" and u.target is operator.getitem}
            sub_marks, sub_inputs = _reached(sub, used or None)
            marks |= sub_marks
            operands = n.args[1:]
            stack.extend(operands[i] for i in sub_inputs if i < len(operands) and isinstance(operands[i], torch.fx.Node))
            continue
        stack.extend(n.all_input_nodes)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return marks, {i for i, p in enumerate(placeholders) if p in seen}
