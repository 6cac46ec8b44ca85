"""Compiled steps: the `compile=` option, and what a user compiled before.

Note [compiled units]
~~~~~~~~~~~~~~~~~~~~~
`compile=True` (or a dict of `torch.compile` options) compiles the forward of each unit of the
model: `torch.compile(unit.forward, fullgraph=True)`, and through AOTAutograd its backward. The
unit's module hooks stay eager, outside the compiled region: they are where the engine gathers,
frees, prefetches and reduces (the whole schedule), and they run in
`Module.__call__`, around `forward`. So the compiled graph sees what the module's own code
computes and nothing of shardfn: the unit's gathered parameters (views of the unit's gathered
buffer, read, never written) come in as graph inputs with the activations, and the gradients
come out of the compiled backward into the same hooks as eager ones. Identical units (the
blocks of a stack) run the same code object, so they share one compiled graph (dynamo's cache is
per code object, its guards on the module's structure, not its identity). A model without
units compiles its root module's forward (everything then runs as one unit).

A unit's forward is wrapped once, innermost (under remat's checkpoint, Note [remat] in
`_remat.py`): the wrapper runs the compiled forward while a step that asked for it runs
(`ModelInfo.compiling`, set for the step's forward and backward) and the module's own forward
otherwise, so `apply` outside a step, and other steps of the same model, run eager.

The units run eager where dynamo cannot follow: a step off the unit schedule (a backward inside
`loss_fn`: the retry on the gathered tree), a `torch.func` transform called eagerly in `loss_fn`,
and a unit holding another unit (only the innermost compile). Units that read a constant of their
own are a graph each; dynamo's recompile limit is raised for the step's units.

On a mesh with a cp axis, ring attention (Note [context parallelism] in `_context.py`) is a
function dynamo does not trace (`torch.compiler.disable`): a unit compiles as the graphs around
it, `fullgraph` False there.

On a (dp, tp) mesh (Note [tensor parallel forward] in `_tp.py`) the units compile too, with the
tensor-parallel steering inside their graphs:
- the first step runs eager: it watches for fallback gathers with a `TorchDispatchMode`
  (`_tp._GatherWatch`), and dynamo runs a frame eager under a dispatch mode and remembers the skip
  for that code object (no unit would compile in any later step);
- later steps hand the units plain DTensors (not `_tp._Leaf`, whose exact type AOTAutograd's
  compiled forward refuses); a model whose code took the local tensor of a leaf in the first step
  (`.to_local()`, served exactly only on `_Leaf`s) keeps its units eager, with a `FallbackWarning`;
- the steering's forward redistributes are traced (DTensor's functional collectives in the graph,
  waited for there, outside the stall watch). Its backward hooks are not: dynamo would trace a hook
  at the forward, on a gradient layout it guesses (whole), where the backward computes a partial
  sum. Inside a compiled backward DTensor keeps the partial sums and reduces them where its ops
  need them, in the gradient's dtype (not `reduce_dtype`: warned of at tp > 2, where the sum of
  three or more rounds differently), and a unit's inputs pass an eager identity
  (`TensorParallel.steer_inputs`) whose backward makes a partial gradient whole as the hooks do,
  so what leaves a unit is what the eager step hands on. Measured against the eager step: the same
  collectives on the project's GPT and GPT-2, 6 all-reduces and 6 all-gathers more per step on
  Llama (2 layers), 4 all-reduces more with remat and accumulation (tests/test_compile.py);
- what the steering counts (`_collectives.STATS`, `TensorParallel.stats`) is counted by an op of
  the graph on every run (`shardfn::count`, `shardfn::count_steering`, kept by
  `torch.fx.node.has_side_effect`): a Python counter read in traced code is a guard on its value
  (a recompile per step). The reductions DTensor issues in a compiled backward are not counted;
  torch's profiler sees them;
- the steering's per-module names (for eager errors) are not kept, and its post-forward hooks are
  not `always_call`: dynamo guards on each such hook's id and a stack's blocks would be a graph each.
- shapes are static there (`on_tensor_parallel`): dynamo's automatic dynamic shapes, which it
  turns on at a frame's second input shape, fail in DTensor's sharding propagation on symbolic
  sizes, so a new sequence length is a new graph; `dynamic=True` is refused;
- known to fail, both in torch 2.13's tracing of a `DeviceMesh` as an opaque graph input (DTensor's
  `__tensor_flatten__` gives its mesh beside its local tensor; make_fx's `opaque_tracker` maps each
  mesh object to one graph input): a tp unit compiled in a process where an eager tp step
  (`compile=False`) ran before, with or without dropout, on the same mesh or a new one. Its joint
  graph binds the mesh of the output's tangent (`tangents_2`) over the parameters' (`primals_3`),
  and hands it on as a forward output, so the partitioner stops ("Node tangents_2 was invalid, but
  is output"); compiled alone, or after a compiled step, the same unit's joint graph returns
  `primals_3` there and passes. Clearing DTensor's sharding-propagation caches, its random-number
  tracker or the garbage between the two steps changes nothing. And once, after a long sequence of
  other compiled and failed steps in one process, Inductor's "device_mesh._get_submesh is not an
  OpOverload", from the same machinery's submesh reconstruction (`_device_mesh_reconstruct_fn`).
Sequence parallelism (`activation_specs`) and a mesh with tp and cp axes are refused with
`NotImplementedError` where the step is built.

A step whose units' forwards never run (the parent calls a unit's children, not the unit)
compiles nothing: the first such step warns. (A container, which has no forward, is not a unit:
Note [containers are not units] in `_functional.py`.) The whole step as one graph, collectives
inside, is `compile="step"` (Note [the step as one graph] in `_step_graph.py`).

Note [compiled code in a step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
What users already write is refused, before anything is traced: a block compiled before
`sf.functionalize` (`block.compile()`, or `torch.compile(block)` put back into its parent) and a
compiled `loss_fn` (`torch.compile(loss_fn)`). Traced, they reach the engine's views of its flat
buffers (Note [flat unit layout] in `_flat.py`) and its hooks, which AOTAutograd fails on with an
internal `AssertionError`; `step.init`, and the first call of an `sf.value_and_grad` function,
refuse them with a `ValueError` that names what was compiled and `compile=True`, which compiles
the same code where it can be. `apply` itself under a user's `torch.compile` (`torch.compile(apply)`
called from a plain `loss_fn`, or a compiled helper that calls it) cannot be seen at init: it is
`torch.compiler.disable`d, so dynamo breaks the graph there and it runs eager, exactly.

torch 2.13 has no public way to ask whether a module or a function was compiled; what
`torch.compile` leaves on them is read instead (docs/private-torch-apis.md): the wrapper module's
`_orig_mod`, `Module.compile()`'s `_compiled_call_impl`, and the compiled function's
`_torchdynamo_orig_callable`. Nothing of `torch._dynamo` is imported.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import re
import time
import warnings
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from ._tp import FallbackWarning

__all__ = ["CompiledUnits", "compile_options", "compiled_function", "compiled_modules", "refuse_compiled"]

_NON_LEAF_GRAD = r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed"
_TORCH_COMPILE_KEYS = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")


def on_tensor_parallel(options: dict, names: tuple, tp_size: int, mp: Any) -> dict:
    """`compile=` options for a (dp, tp) mesh (axes `names`, `tp_size` ranks on tp, mixed precision
    `mp`): static shapes. A new input shape is a new graph there: DTensor's sharding propagation fails
    on symbolic sizes, which dynamo's automatic dynamic shapes would bring in at a frame's second
    shape; `dynamic=True` is refused. A `reduce_dtype` wider than the compute dtype is warned of at
    tp > 2 (two operands round alike in either dtype)."""
    wider = mp is not None and mp.reduce_dtype is not None and mp.reduce_dtype != (mp.param_dtype or mp.reduce_dtype)
    if wider and tp_size > 2:
        warnings.warn(
            f"compile=True on a tensor-parallel mesh {names}: inside the compiled units DTensor's backward sums "
            f"the tensor-parallel partial gradients in the compute dtype ({mp.param_dtype}), not in reduce_dtype "
            f"({mp.reduce_dtype}); the FSDP reductions keep reduce_dtype (Note [compiled units] in "
            "shardfn/_compiled.py). compile=False sums them in reduce_dtype",
            UserWarning,
            stacklevel=5,
        )
    if options.get("dynamic"):
        raise NotImplementedError(
            f"compile={{'dynamic': True}} on a tensor-parallel mesh {names} is not supported yet (DTensor's sharding "
            "propagation fails on symbolic sizes): leave dynamic out (each new input shape compiles a graph of its own; "
            "pad batches to a few lengths), or compile=False"
        )
    return {**options, "dynamic": False}


def _refuse_cuda_graphs(compile: dict, where: str) -> None:
    """CUDA graphs replay the memory addresses they were recorded with, and a unit's gathered
    parameters are freed and gathered again into other memory every step (Note [compiled units]):
    not supported. `mode="max-autotune"` turns them on only where CUDA is."""
    mode, options = compile.get("mode"), compile.get("options") or {}
    graphs = (mode == "reduce-overhead" or options.get("triton.cudagraphs")
              or (mode == "max-autotune" and torch.cuda.is_available() and options.get("triton.cudagraphs", True)))
    if graphs:
        raise NotImplementedError(
            f"{where}(..., compile={compile!r}): CUDA graphs are not supported yet: they replay the addresses they "
            "recorded, and each unit's gathered parameters are freed and gathered again every step; use "
            "compile={'mode': 'max-autotune-no-cudagraphs'} or compile=True"
        )


def compile_options(compile: Any, where: str) -> dict | None:
    """The `torch.compile` options of a `compile=` setting: None for False (eager).

    Args:
        compile: the `compile=` argument: False, True, "step", or a dict of `torch.compile` options
            (`fullgraph`, `dynamic`, `backend`, `mode`, `options`, `disable`, and `step`); True is
            `{"fullgraph": True}`, "step" `{"fullgraph": True, "step": True}` (the whole step as
            one graph, Note [the step as one graph] in `_step_graph.py`), and a dict is taken over
            the first.
        where: what the option was given to, for messages (`"sf.train_step"`).

    Raises:
        ValueError: for anything else than False, True or such a dict.
        NotImplementedError: for options that turn on CUDA graphs (`mode="reduce-overhead"`).
    """
    if compile is False:
        return None
    if compile is True:
        return {"fullgraph": True}
    if compile == "step":  # Note [the step as one graph] in `_step_graph.py`
        return {"fullgraph": True, "step": True}
    if isinstance(compile, dict):
        bad = sorted(k for k in compile if k not in (*_TORCH_COMPILE_KEYS, "step"))
        if bad:
            raise ValueError(
                f"{where}(..., compile={compile!r}): {bad} are not torch.compile options; use some of "
                f"{list(_TORCH_COMPILE_KEYS)}, e.g. compile={{'mode': 'max-autotune-no-cudagraphs'}}"
            )
        _refuse_cuda_graphs(compile, where)
        return {"fullgraph": True, **compile}
    raise ValueError(
        f"{where}(..., compile={compile!r}): compile must be False (the default), True (each unit compiled), \"step\" "
        "(the whole step as one graph), or a dict of torch.compile options (with \"step\": True for the whole step)"
    )


class CompiledUnits:
    """The compiled forwards of one step's units (Note [compiled units]).

    Args:
        info: the functionalized model (`_models.ModelInfo`).
        options: `torch.compile` options (from `compile_options`).
    """

    def __init__(self, info: Any, options: dict):
        self.info, self.options = info, options
        self._compiled: dict[int, Any] = {}  # id(module) -> its compiled forward
        self.first_call_s: list[float] = []  # wall time of each unit's first compiled call (its compile)
        self._logged = False
        names = info.unit_names or [""]
        # A unit holding another runs that one's hooks (its gathers) inside: only the innermost compile.
        inner = [n for n in names if not any(m != n and (n == "" or m.startswith(n + ".")) for m in names)]
        self.modules = [(name, info.module.get_submodule(name)) for name in inner]
        # Units differing in a constant their code reads (a layer index) are one graph each, under one
        # code object: dynamo's recompile limit (8) must not stop a deep model at its ninth unit.
        self.recompile_limit = max(8, 2 * len(self.modules) + 8)
        self.paused = False
        # Tensor parallel: a compiled unit's inputs, for their gradients to leave it whole
        # (`TensorParallel.steer_inputs`); None without.
        self.steer: Any = None
        self.warned_local_reads = False  # a tp model's units run eager (`for_step`), said once
        self.calls = 0  # unit forwards that ran in this step's `active()` (compiled or not)
        self.warned_no_call = False
        self.unit = ""  # the unit whose compiled forward runs (named by the backend's check)
        self._backend = _CheckedBackend(options, self)  # one for all units: they share graphs
        for name, module in self.modules:
            _install(info, name, module)

    def for_step(self, tp: Any) -> Any:
        """The context a step's units run compiled in (`active`), given the step's `TensorParallel`
        (None without). On a tensor-parallel mesh the first step runs eager (it watches for fallback
        gathers with a dispatch mode, which dynamo would remember as a skip), and so do all steps of
        a model whose code took the local tensor of a leaf (`.to_local()`, served exactly only on
        eager leaves: warned of once); later steps hand the units plain DTensors and steer the
        gradients of their inputs (`TensorParallel.steer_inputs`)."""
        if tp is not None:
            if tp.watch:
                return contextlib.nullcontext()
            if tp.local_reads:
                if not self.warned_local_reads:
                    self.warned_local_reads = True
                    warnings.warn(
                        f"compile=True: {', '.join(tp.local_reads)} took the local tensor of a tensor-parallel leaf "
                        "(.to_local()), which shardfn serves exactly only in eager steps: this model's units run eager "
                        "on this mesh. Compute on the DTensor itself to compile them (Note [compiled units] in "
                        "shardfn/_compiled.py)",
                        FallbackWarning,
                        stacklevel=5,
                    )
                return contextlib.nullcontext()
            tp.plain_leaves = True
            self.steer = tp.steer_inputs
        return self.active()

    def runs_compiled(self) -> bool:
        """Whether the units run compiled now: not off the unit schedule (the step retried on the
        gathered tree, Note [steps off the unit schedule] in `_core.py`), and not under a torch.func
        transform called eagerly (a vmap or grad over the model's inputs), which dynamo does not trace."""
        import torch

        return not self.paused and not torch._C._are_functorch_transforms_active()

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """The units run eager in the block."""
        before, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = before

    def forward_of(self, name: str, module: nn.Module, original: Any) -> Any:
        """The compiled forward of `module` (compiled on first use)."""
        fn = self._compiled.get(id(module))
        if fn is None:
            import torch

            kept = {k: v for k, v in self.options.items() if k not in ("backend", "mode", "options")}
            fn = self._compiled[id(module)] = _first_call_named(torch.compile(original, backend=self._backend, **kept), name, self)
        return fn

    def log_compile_time(self) -> None:
        """Logs, once, how long the units' first compiled calls took (their compile), on the
        `shardfn` logger at INFO."""
        if self._logged or not self.first_call_s:
            return
        self._logged = True
        logging.getLogger("shardfn").info(
            "compile=True: the first compiled calls of %d units took %.1f s in all (compiling their forwards and "
            "backwards; identical units share one graph); later steps at the same shapes reuse them",
            len(self.first_call_s), sum(self.first_call_s),
        )

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The units run compiled in this block (the step's forward and backward)."""
        before = self.info.compiling
        self.info.compiling = self
        try:
            # Once per step, not per unit call: dynamo reads `.grad` of each graph input as it
            # wraps it, and the unit's parameters are views of its gathered buffer, not leaves
            # (torch warns of that read); and the recompile limit raised for the step's units.
            self.calls = 0
            with warnings.catch_warnings(), _dynamo_config().patch(recompile_limit=self.recompile_limit):
                warnings.filterwarnings("ignore", message=_NON_LEAF_GRAD, category=UserWarning)
                yield
        finally:
            self.info.compiling = before
        if self.calls == 0 and not self.warned_no_call:
            self.warned_no_call = True
            warnings.warn(
                f"compile=True compiled nothing in this step: no unit's forward ran (units {[n for n, _ in self.modules][:4]}). "
                "A unit whose parent calls its children, not the unit itself, runs no forward of its own to compile: name "
                "the modules that are called as units, or leave compile=False",
                UserWarning,
                stacklevel=4,
            )
        self.log_compile_time()


# Note [a buffer written, then read, in a compiled unit]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A unit whose forward writes one of its inputs in place and then reads it (a buffer counted up
# and used: `self.n += 1; y = x / self.n`) compiles to a backward that takes the written value
# for the one the forward read: torch 2.13's AOTAutograd gets its gradients wrong, without a word,
# with shardfn or without (`torch.compile(block.forward)` on a plain model alone does the same;
# measured: a weight's gradient norm 0.21 against eager's 0.49). BatchNorm's statistics, written
# and not read again in the graph, are not affected. So every graph dynamo makes of a unit passes a
# check before its backend compiles it: an in-place write into a graph input that is read after
# the write is refused (`NotImplementedError`, naming the unit and the input, and the fixes: write
# out of place, or compile=False). The check wraps the backend torch.compile would build from the
# same options (`torch._TorchCompileInductorWrapper`, `torch._TorchCompileWrapper`), one object for
# all the step's units, so that identical units still share one compiled graph.
_IN_PLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.ipow,
                       operator.imod, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift}


def _writes_input(node: Any) -> Any:
    """The graph input `node` writes in place (a dynamo FX node), or None."""
    target = node.target
    in_place = (node.op == "call_function" and (target in _IN_PLACE_OPERATORS or
                                                (getattr(target, "__name__", "").endswith("_") and not getattr(target, "__name__", "").startswith("_"))))
    in_place = in_place or (node.op == "call_method" and isinstance(target, str) and target.endswith("_") and not target.startswith("_"))
    if not in_place or not node.args:
        return None
    first = node.args[0]
    while getattr(first, "op", None) in ("call_function", "call_method") and _is_view(first) and first.args:
        first = first.args[0]  # a write through a view (`self.n[0] += 1`) writes its base
    return first if getattr(first, "op", None) == "placeholder" else None


_VIEW_METHODS = {"view", "view_as", "reshape", "narrow", "select", "unsqueeze", "squeeze", "flatten", "transpose", "t",
                 "permute", "expand", "__getitem__", "diagonal", "unflatten"}


def _is_view(node: Any) -> bool:
    """Whether a dynamo FX node takes a view of its first argument."""
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    return node.target is operator.getitem or getattr(node.target, "__name__", "") in _VIEW_METHODS


def _input_name(target: str) -> str:
    """A dynamo graph input's name as the module's code has it (`L_self_buffers_n_` -> `n`)."""
    inner = target[2:-1] if target.startswith("L_") and target.endswith("_") else target
    parts = re.split(r"_(?:buffers|parameters|modules)_", inner)
    return ".".join(parts[1:]) if len(parts) > 1 else inner


def _refuse_reads_after_writes(gm: Any, unit: str) -> None:
    """Note [a buffer written, then read, in a compiled unit]."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    for node in nodes:
        written = _writes_input(node)
        if written is None:
            continue
        later = [u for u in list(written.users) + list(node.users) if u.op != "output" and order[u] > order[node]]
        if later:
            raise _ReadAfterWrite(
                f"compile=True: unit {unit or '<root>'!r} writes its input {_input_name(str(written.target))!r} in place ({node.target}) and "
                f"then reads it ({later[0].target}): torch's AOTAutograd computes the gradient of what it reads from the "
                "written value, wrongly, without a word (Note [a buffer written, then read, in a compiled unit] in "
                "shardfn/_compiled.py). Write it out of place (n = n + 1 and assign the buffer after its last read), or "
                "compile=False"
            )


class _ReadAfterWrite(NotImplementedError):
    """The check's refusal, raised inside dynamo's backend call (which wraps it)."""


class _CheckedBackend:
    """The backend torch.compile would build from `options`, with the check of Note [a buffer
    written, then read, in a compiled unit] before it compiles each graph."""

    def __init__(self, options: dict, owner: "CompiledUnits"):
        backend, mode, more, dynamic = (options.get("backend", "inductor"), options.get("mode"), options.get("options"),
                                        options.get("dynamic"))
        if backend == "inductor":
            self.inner = torch._TorchCompileInductorWrapper(mode, more, dynamic)
        else:
            self.inner = torch._TorchCompileWrapper(backend, mode, more, dynamic)
        self.compiler_name = getattr(self.inner, "compiler_name", "inductor")
        self.owner = owner

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        _refuse_reads_after_writes(gm, self.owner.unit)
        return self.inner(gm, example_inputs)

    def __getattr__(self, name: str) -> Any:  # reset(), get_compiler_config(), ...: the inner backend's
        return getattr(self.inner, name)


def _first_call_named(fn: Any, name: str, owner: CompiledUnits) -> Any:
    """`fn`, whose first call (where it compiles) is timed, and whose errors name the unit."""
    first = [True]

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter() if first[0] else 0.0
        owner.unit = name  # for the backend's check (Note [a buffer written, then read, in a compiled unit])
        try:
            out = fn(*args, **kwargs)  # under `active()`: its warning filter and recompile limit
        except Exception as e:
            inner = getattr(e, "inner_exception", None)  # dynamo wraps what a backend raised
            if isinstance(inner, _ReadAfterWrite):
                raise NotImplementedError(str(inner)) from None
            if "is a view and is being modified inplace" in str(e):
                raise ValueError(
                    f"unit {name or '<root>'!r} modifies one of its inputs in place (e.g. x.add_(...) or an inplace "
                    "activation on its input): shardfn detects the end of a unit's backward on its inputs, as FSDP2 "
                    "does, so a unit must not modify them; use the out-of-place op (x = x + ...)"
                ) from e
            breaks = type(e).__name__ in ("Unsupported", "UserError") and owner.options.get("fullgraph", True)
            e.add_note(
                f"shardfn: in unit {name or '<root>'!r}, compiled by the step's compile= option as "
                f"torch.compile(forward, {', '.join(f'{k}={v!r}' for k, v in owner.options.items())}) "
                "(Note [compiled units] in shardfn/_compiled.py)"
                + (". fullgraph=True refuses graph breaks: compile={'fullgraph': False} allows them" if breaks else "")
                + "; compile=False runs eager"
            )
            raise
        if first[0]:
            first[0] = False
            owner.first_call_s.append(time.perf_counter() - t0)
        return out

    return call


def _dynamo_config() -> Any:
    """torch._dynamo's config module (its recompile limit: docs/private-torch-apis.md)."""
    import torch._dynamo

    return torch._dynamo.config


def _install(info: Any, name: str, module: nn.Module) -> None:
    """Wraps `module`'s forward once, innermost (under remat's wrapper, if any): it runs the
    compiled forward of the step that is compiling the model, if one is, else the original."""
    outer = module.__dict__.get("forward")
    holder = outer if getattr(outer, "_shardfn_remat", False) else None
    current = holder.inner if holder is not None else (outer or module.forward)
    if getattr(current, "_shardfn_compiled", False):
        return
    ref = weakref.ref(info)

    @functools.wraps(current)
    def forward(*args: Any, **kwargs: Any) -> Any:
        model = ref()
        units = model.compiling if model is not None else None
        if units is not None:
            units.calls += 1
        if units is None or not units.runs_compiled():
            return current(*args, **kwargs)
        if units.steer is not None:
            args, kwargs = units.steer(args, kwargs)
        return units.forward_of(name, module, current)(*args, **kwargs)

    forward._shardfn_compiled = True  # type: ignore[attr-defined]
    if holder is not None:
        holder.inner = forward
    else:
        module.forward = forward


def compiled_function(fn: Any) -> bool:
    """Whether `fn` is what `torch.compile` returns for a function (or a partial of one), or a
    compiled module (see `compiled_modules`)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, nn.Module):
        return bool(compiled_modules(fn))
    return getattr(fn, "_torchdynamo_orig_callable", None) is not None


def _compiled_module(module: nn.Module) -> str | None:
    """How `module` was compiled (`"a torch.compile(...) wrapper"`, `"compiled by .compile()"`), or None."""
    if isinstance(getattr(module, "_orig_mod", None), nn.Module):
        return "a torch.compile(...) wrapper"
    if getattr(module, "_compiled_call_impl", None) is not None:
        return "compiled by .compile()"
    return None


def compiled_modules(module: nn.Module) -> list[tuple[str, str]]:
    """The compiled modules in `module` (itself included), outermost only: `(dotted path, how)`,
    the path `""` for `module` itself."""
    found: list[tuple[str, str]] = []
    for name, sub in module.named_modules(remove_duplicate=False):
        if any(p == "" or name.startswith(p + ".") for p, _ in found):
            continue  # inside a compiled module: the outer one is named
        how = _compiled_module(sub)
        if how is not None:
            found.append((name, how))
    return found


def refuse_compiled(loss_fn: Any, module: nn.Module | None, where: str) -> None:
    """Refuses a compiled `loss_fn`, or a model (`module`, the functionalized model; None for a
    plain pure function) that holds compiled modules, before anything is traced.

    Args:
        loss_fn: the user's loss function.
        module: the functionalized module whose units the step runs, or None.
        where: what they were given to, for messages (`"sf.train_step"`).

    Raises:
        ValueError: naming the compiled loss function or module paths, and the fix.
    """
    if compiled_function(loss_fn):
        name = getattr(loss_fn, "__name__", None) or type(loss_fn).__name__
        raise ValueError(
            f"{where}: loss_fn {name!r} is compiled (torch.compile(loss_fn)); shardfn cannot run a compiled loss_fn, "
            "whose trace would reach the step's own buffers and hooks. Pass the uncompiled function, and "
            f"{where}(..., compile=True) to compile the model's units (Note [compiled units] in shardfn/_compiled.py)"
        )
    if module is None:
        return
    found = compiled_modules(module)
    if not found:
        return
    shown = ", ".join(f"{(repr(p) if p else 'the model itself')} ({how})" for p, how in found[:4])
    more = f" and {len(found) - 4} more" if len(found) > 4 else ""
    raise ValueError(
        f"{where}: the model holds compiled modules: {shown}{more}. shardfn cannot run modules compiled before "
        "sf.functionalize, whose traces would reach the step's own buffers. Pass the uncompiled module to "
        "sf.functionalize (build the model without module.compile(); for torch.compile(block) put back into its "
        "parent, keep the block itself, which the compiled one holds as ._orig_mod), and "
        f"{where}(..., compile=True) compiles the model's units where they can be (Note [compiled units] in "
        "shardfn/_compiled.py)"
    )
