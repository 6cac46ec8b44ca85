"""`sf.functionalize`: an nn.Module as a pure function over a nested-dict parameter tree.

The module keeps its code, hooks and buffers; its parameters move to the meta device and their
storage goes to the returned tree. Each call re-parametrizes the module with the tensors it is given
(`torch.nn.utils.stateless`), so the function reads no parameter from the module.

Units (sharding units) are submodules whose dotted names match the `units` regexes in full. A unit's
parameters are those of its submodules that no inner unit claims; a parameter tied across units
belongs to the root unit. Forward hooks on the unit modules report each unit's start and end to the
runtime active on the model (Note [unit runtime] in `_runtime.py`): a train step gathers and frees
units there, and `apply` on a sharded tree gathers there for inference. With no runtime active,
the hooks cost one lookup.
"""

from __future__ import annotations

import re
import warnings
import weakref
from typing import Any, Sequence

import optree
import torch
from torch import nn
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.autograd import forward_ad
from torch.nn.utils.stateless import _reparametrize_module

from . import _runtime, _watch
from ._inference import ShardedForward
from ._meta_init import capture, check_outside_block
from ._models import ModelInfo, model_of, persistent_buffers, register, unit_of_module
from ._param import Param
from ._schedule import cast_floating
from ._shard import _holds_dtensor, gather
from ._state import params_of
from ._tree import compile_patterns, nest, tree_flatten_with_paths

__all__ = ["functionalize", "Apply", "to_state_dict", "from_state_dict"]


def _owner(path: str) -> str:
    return path.rpartition(".")[0]


def _refuse_meta_leaves(leaves: list, args: tuple, kwargs: dict) -> None:
    """Meta-device parameters (a module built on meta, not initialized yet) with real inputs: torch
    computes some ops of the two (a CPU matmul with a meta operand) on uninitialized memory."""
    if not any(isinstance(x, torch.Tensor) and x.is_meta for x in leaves):
        return
    real = [x for x in optree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and not x.is_meta]
    if real:
        raise ValueError(
            f"apply got parameters on the meta device and inputs on {real[0].device}: the tree holds no values yet (a "
            "module built on the meta device). Initialize it first: step.init(params) or sf.shard(params, specs, "
            "mesh, init=model) for a module built under sf.meta_device()"
        )


def _slots(info: ModelInfo, flat: dict[str, torch.Tensor]) -> list[tuple[dict, str]] | None:
    """For each name of `flat`, in order, the dict (`_parameters` or `_buffers` of its module, found
    now: a submodule may have been replaced) and key that hold it; None if a name is neither. The
    split of each name is kept per model (`info.slots`)."""
    split = info.slots
    owners: dict[tuple, Any] = {(): info.module}
    out = []
    for name in flat:
        parts = split.get(name)
        if parts is None:
            owner, _, attr = name.rpartition(".")
            parts = split[name] = (tuple(owner.split(".")) if owner else (), attr)
        path, attr = parts
        mod = owners.get(path)
        if mod is None:
            mod = info.module
            for k in path:
                mod = mod._modules.get(k) if isinstance(mod, nn.Module) else None
            if not isinstance(mod, nn.Module):
                return None
            owners[path] = mod
        d = mod._parameters if attr in mod._parameters else mod._buffers if attr in mod._buffers else None
        if d is None:
            return None
        out.append((d, attr))
    return out


def _unit_hooks(info: ModelInfo, index: int):
    ref = weakref.ref(info)  # the module holds its hooks; the model's info must not be kept by them

    def pre(mod: nn.Module, args: Any, kwargs: dict) -> Any:
        model = ref()
        if model is not None and model.runtimes:
            return model.runtimes[-1].pre_forward(model, index, args, kwargs)
        if model is not None and model.whole_step is not None and model.whole_step.cast is not None:  # as the engine casts
            return cast_floating(args, model.whole_step.cast), cast_floating(kwargs, model.whole_step.cast)
        return None

    def post(mod: nn.Module, args: Any, output: Any) -> Any:
        model = ref()
        if model is not None and model.runtimes:
            return model.runtimes[-1].post_forward(model, index, output)
        return None

    return pre, post


def _needs_grad(leaves: list, args: tuple, kwargs: dict) -> bool:
    """Whether a derivative may flow through `apply` on a sharded tree (else it is inference).

    Forward mode needs no grad mode: a jvp (torch.func's, or a dual tensor of
    `torch.autograd.forward_ad`) counts under `torch.no_grad()` too.
    """
    tensors = [x for x in (*leaves, *optree.tree_leaves((args, kwargs))) if isinstance(x, torch.Tensor)]
    if any(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters()):
        return True
    if any(forward_ad.unpack_dual(x).tangent is not None for x in tensors):
        return True
    if not torch.is_grad_enabled():
        return False
    if torch._C._are_functorch_transforms_active():
        return True
    return any(x.requires_grad for x in tensors)


# `apply` under a user's torch.compile (torch.compile(apply), or a compiled function calling it):
# dynamo would trace the engine's gathers, frees and hooks and fail in AOTAutograd on its views of
# the flat buffers. It runs eager there instead (a graph break; under fullgraph=True dynamo's
# error carries this reason). Note [compiled code in a step] in `_compiled.py`.
_EAGER_APPLY = ("shardfn's apply runs eager inside torch.compile (its gathers and hooks are the step's); pass compile=True "
                "to sf.train_step or sf.value_and_grad to compile the model's units (Note [compiled units] in "
                "shardfn/_compiled.py)")


class Apply:
    """A module's method as a pure function of a parameter tree: `apply(params, *args, **kwargs)`.

    Attributes:
        buffers: the module's buffers as a nested dict (its own tensors).
        info: names, ties and units of the model (shared by every method).
    """

    def __init__(self, info: ModelInfo, method: str = "forward"):
        self.info = info
        self._method = method

    @property
    def buffers(self) -> dict:
        return nest((name, b) for name, b in self.info.module.named_buffers())

    @property
    def units(self) -> list[str]:
        """The unit submodule paths, in module order."""
        return list(self.info.unit_names)

    def method(self, name: str) -> "Apply":
        """The same kind of function for another method of the module, e.g. `apply.method("generate")`."""
        if not callable(getattr(self.info.module, name, None)):
            raise ValueError(f"{type(self.info.module).__name__} has no method {name!r}")
        return Apply(self.info, name)

    def flat_params(self, params: Any) -> dict[str, torch.Tensor]:
        """{every parameter name, tied aliases included: tensor} for a params tree."""
        paths, leaves, _ = tree_flatten_with_paths(params)
        if len(paths) != len(self.info.param_paths) or set(paths) != set(self.info.param_paths):
            missing = sorted(set(self.info.param_paths) - set(paths))
            extra = sorted(set(paths) - set(self.info.param_paths))
            raise ValueError(
                f"params do not match the model: missing {missing[:5]}, unexpected {extra[:5]}; "
                "pass the tree sf.functionalize returned (or one with the same structure)"
            )
        flat: dict[str, torch.Tensor] = {}
        for path, leaf in zip(paths, leaves):
            for name in self.info.aliases[path]:
                flat[name] = leaf
        return flat

    def __call__(self, params: Any, *args: Any, buffers: Any = None, **kwargs: Any) -> Any:
        if self.info.whole_step is not None and torch.compiler.is_compiling():  # Note [the step as one graph] in `_step_graph.py`
            return self._traced(params, args, buffers, kwargs)
        return self._eager(params, *args, buffers=buffers, **kwargs)

    def _traced(self, params: Any, args: tuple, buffers: Any, kwargs: dict) -> Any:
        """`apply` inside the step's graph: `params` is the nested dict of the full leaves the graph
        gathered; the module runs through `torch.func.functional_call`, which dynamo traces."""
        if self._method != "forward":
            raise NotImplementedError(f'compile="step" runs apply (the forward); apply.method({self._method!r}) runs eager only')
        flat: dict[str, torch.Tensor] = {}
        for path in self.info.param_paths:
            node = params
            for k in path.split("."):
                node = node[k]
            for name in self.info.aliases[path]:
                flat[name] = node
        if buffers is not None:
            bpaths, bleaves, _ = tree_flatten_with_paths(buffers)
            flat.update(zip(bpaths, bleaves))
        cast = self.info.whole_step.cast
        args, kwargs = cast_floating(args, cast), cast_floating(kwargs, cast)
        return torch.func.functional_call(self.info.module, flat, args, kwargs, tie_weights=False, strict=False)

    @torch.compiler.disable(reason=_EAGER_APPLY)
    def _eager(self, params: Any, *args: Any, buffers: Any = None, **kwargs: Any) -> Any:
        rt = self.info.runtime  # Note [unit runtime] in `_runtime.py`
        # A train step hands `loss_fn` its own parameter objects: it says which tensors the model
        # computes on (Note [parameters outside apply] in `_param.py`).
        flat = rt.flat_params(self, params) if rt is not None else None
        if flat is None:
            leaves = optree.tree_leaves(params)
            owner = next((x.owner() for x in leaves if isinstance(x, Param)), None)
            if owner is not None:  # a step's parameters, handed to a model the step does not run
                flat = owner.flat_params(self, params)
        if flat is None:
            if any(_holds_dtensor(x) for x in leaves):
                if _needs_grad(leaves, args, kwargs):
                    # A gradient will flow (to the inputs, to the tree, or inside a torch.func
                    # transform): the tree is gathered differentiably, its gradient the reduce-scatter.
                    return self(gather(params), *args, buffers=buffers, **kwargs)
                with _watch.watched("apply on a sharded tree"), ShardedForward(self, params) as (gathered, runtime):
                    with _runtime.activate(runtime, self.info):
                        return self._call_flat(gathered, args, buffers, kwargs)
            _refuse_meta_leaves(leaves, args, kwargs)
            flat = self.flat_params(params)
        if rt is not None:
            args, kwargs = rt.cast_inputs(self.info, args, kwargs)
        return self._call_flat(flat, args, buffers, kwargs)

    def _call_flat(self, flat: dict[str, torch.Tensor], args: tuple, buffers: Any, kwargs: dict) -> Any:
        if buffers is not None:
            bpaths, bleaves, _ = tree_flatten_with_paths(buffers)
            for path, b in zip(bpaths, bleaves):
                if not (b is None or isinstance(b, torch.Tensor)):
                    raise ValueError(f"buffers[{path!r}] is a {type(b).__name__}; pass tensors, as apply.buffers holds them")
            flat = {**flat, **dict(zip(bpaths, bleaves))}
        module = self.info.module
        # `torch.func.functional_call` does this for `forward` only; `apply.method(...)` needs any method.
        fn = module if self._method == "forward" else getattr(module, self._method)
        slots = _slots(self.info, flat)
        if slots is None:  # a name that is no parameter or buffer of the module: torch's general swap
            with _reparametrize_module(module, flat):
                return fn(*args, **kwargs)
        # Each name's entry in its module's `_parameters` or `_buffers` is set and restored directly
        # (what torch's `swap_tensor` does for such names); torch's per-name walk with its checks
        # costs more than the forward of a small block.
        old = [d[k] for d, k in slots]
        try:
            for (d, k), t in zip(slots, flat.values()):
                d[k] = t
            return fn(*args, **kwargs)
        finally:
            for (d, k), t in zip(slots, old):
                d[k] = t

    def __repr__(self) -> str:
        return (
            f"<sf.Apply {type(self.info.module).__name__}.{self._method}: "
            f"{len(self.info.param_paths)} params, {len(self.info.unit_names)} units>"
        )


def functionalize(module: nn.Module, units: str | Sequence[str] | None = None) -> tuple[Apply, dict]:
    """Turns `module` into a pure function over a nested-dict parameter tree.

    The parameters' storage moves into the returned tree and the module is left holding meta
    tensors, so sharding the tree really frees memory. A parameter tied to others appears once, at
    its first path, and stays tied everywhere it is used.

    Args:
        module: the model. Functionalize each module once.
        units: a regex (or list of regexes) matched in full against dotted submodule paths; each
            match is a sharding unit. Parameters outside every unit form the root unit.

    Returns:
        `(apply, params)`: `apply(params, *args, buffers=None, **kwargs)` runs `module.forward`.

    Example:
        >>> apply, params = sf.functionalize(model, units=r"blocks\\.\\d+")
        >>> logits = apply(params, tokens)
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"functionalize takes an nn.Module, got {type(module).__name__}")
    check_outside_block("sf.functionalize")
    if getattr(module, "_shardfn_functionalized", False):
        raise ValueError(
            f"this {type(module).__name__} was already functionalized (its parameters are on the meta "
            "device now); reuse the first (apply, params), or build a new module"
        )
    taken = [(n, p._shardfn_taken_by) for n, p in module.named_parameters() if hasattr(p, "_shardfn_taken_by")]
    if taken:
        names = [n for n, _ in taken]
        raise ValueError(
            f"parameters {names[:5]}{' and more' if len(names) > 5 else ''} of this {type(module).__name__} were handed to "
            f"the tree of an earlier sf.functionalize (of a {taken[0][1]}, which shares these modules with this one, or "
            "holds this one): the module now holds placeholders on the meta device in their place. Functionalize one "
            "module that holds every model sharing them (an nn.Module with both as children; tied weights stay tied), "
            "or reuse the earlier (apply, params)"
        )
    patterns = compile_patterns(units, "units", "dotted submodule names")
    unit_names = [n for n, _ in module.named_modules() if n and any(p.fullmatch(n) for p in patterns)]
    if patterns and not unit_names:
        names = [n for n, _ in module.named_modules() if n][:8]
        raise ValueError(f"units {units!r} match no submodule; submodule paths look like {names}")
    unit_names = _without_containers(module, unit_names, units)

    aliases: dict[str, list[str]] = {}
    first_path: dict[int, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        key = id(p)
        if key not in first_path:
            first_path[key] = name
            aliases[name] = [name]
            tensors[name] = p
        else:
            aliases[first_path[key]].append(name)
    unit_of = {}
    for path, names in aliases.items():
        owners = {unit_of_module(_owner(n), unit_names) for n in names}
        unit_of[path] = owners.pop() if len(owners) == 1 else -1
    info = ModelInfo(
        module=module,
        param_paths=list(aliases),
        aliases=aliases,
        unit_names=unit_names,
        unit_of=unit_of,
        buffer_paths=[n for n, _ in module.named_buffers()],
        meta_init=capture(module, tensors),
    )

    detached = {path: t.detach() for path, t in tensors.items()}
    info.returned = {path: weakref.ref(t) for path, t in detached.items()}
    params = nest(detached.items())
    meta: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in meta:
                meta[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                meta[id(p)]._shardfn_taken_by = type(module).__name__  # another functionalize refuses it
            mod._parameters[name] = meta[id(p)]
    module._shardfn_functionalized = True
    for i, name in enumerate(unit_names):
        pre, post = _unit_hooks(info, i)
        sub = module.get_submodule(name)
        sub.register_forward_pre_hook(pre, with_kwargs=True)
        sub.register_forward_hook(post)
    register(info)
    return Apply(info), params


# Note [containers are not units]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A unit is gathered when its module's forward starts and freed when it ends (Note [unit
# schedule] in `_engine.py`). A container (an `nn.ModuleList` or `nn.ModuleDict`, any module
# without a forward of its own) is never called: its parent calls its children, and may call
# different ones on different ranks (a mixture of experts routes each rank's tokens to its own
# experts). As a unit it would have no point in the forward where every rank gathers it, and each
# read of its leaves would be a collective of its own, issued on the ranks whose code made it: the
# ranks' collectives would differ and the job abort. FSDP2 refuses such a module. Here a container
# that `units=` matches is not made a unit: its leaves belong to the unit that holds it, or to the
# root, gathered with it and read in place, whichever children each rank calls. The numbers are
# those of the model; what is lost is the memory a unit of its own would have saved, which a
# warning says, with the fix: match the modules that are called (`r"experts\.\d+"`), or give the
# container a forward.
def _is_container(module: nn.Module) -> bool:
    """No forward of its own: not in its class (nn.Module's raises), nor set on it (torch.compile's
    wrapper sets one), nor a call of its own."""
    return type(module).forward is nn.Module.forward and "forward" not in vars(module) and type(module).__call__ is nn.Module.__call__


def _children_pattern(module: nn.Module, name: str) -> str:
    """A `units=` pattern for the children of container `name`: what to match instead of it."""
    keys = [k for k, _ in module.get_submodule(name).named_children()]
    tail = r"\d+" if keys and all(k.isdigit() for k in keys) else r"\w+"
    return re.escape(name) + r"\." + tail


def _without_containers(module: nn.Module, unit_names: list[str], units: Any) -> list[str]:
    """`unit_names` less the containers among them (Note [containers are not units]), with a warning."""
    containers = [n for n in unit_names if _is_container(module.get_submodule(n))]
    if not containers:
        return unit_names
    kept = [n for n in unit_names if n not in containers]
    holder = {n: (kept[i] if (i := unit_of_module(n, kept)) >= 0 else "the root") for n in containers}
    kinds = sorted({type(module.get_submodule(n)).__name__ for n in containers})
    shown = ", ".join(f"{n!r} -> {h if h == 'the root' else repr(h)}" for n, h in list(holder.items())[:4])
    warnings.warn(
        f"units {units!r} match {len(containers)} module(s) with no forward of their own ({'/'.join(kinds)}: {shown}"
        f"{' and more' if len(containers) > 4 else ''}), which are never called, so they cannot be units: their "
        "parameters join the unit that holds them, or the root, gathered with it and read in place by whichever "
        "children each rank calls (Note [containers are not units] in shardfn/_functional.py). To gather them on "
        f"their own, match the modules that are called (r'{_children_pattern(module, containers[0])}'), or give the "
        "container a forward",
        UserWarning,
        stacklevel=3,
    )
    return kept


def to_state_dict(tree: Any, apply: Apply | None = None) -> dict[str, torch.Tensor]:
    """A parameter tree as `module.state_dict()` of its model: loads with `load_state_dict(strict=True)`.

    The model is the functionalized one the tree belongs to (found by its parameter names, as
    `sf.train_step` finds it; `apply=` says which when several models have these names and differ).
    Its tied names (e.g. `lm_head.weight` tied to `wte.weight`) map to the same tensor, and its
    persistent buffers are added, in `state_dict()` order. A tree of no functionalized model gives
    its own leaves by dotted path.

    Args:
        tree: a parameter tree (plain or DTensor leaves, kept as they are), or a `TrainState`
            (its params).
        apply: the `sf.functionalize` function of the model, to say which model when several have
            these parameter names.

    Returns:
        An ordered dict of names to tensors (DTensor leaves stay DTensors; buffers are the
        module's own tensors; a gradient tree's None leaves, its frozen ones, stay None).

    Example:
        >>> model.load_state_dict(sf.to_state_dict(params))            # strict=True
        >>> torch.save(sf.to_state_dict(sf.gather(state.params)), "model.pt")
    """
    tree = params_of(tree)
    # None leaves count as leaves: a gradient tree holds None at its frozen leaves.
    paths, leaves, _ = tree_flatten_with_paths(tree, none_is_leaf=True)
    info = model_of(apply=apply, flat=(paths, leaves))
    out = dict(zip(paths, leaves))
    if info is None:
        return out
    by_name = {name: out[path] for path in info.param_paths for name in info.aliases[path]}
    buffers = persistent_buffers(info)
    full: dict[str, torch.Tensor] = {}
    for name in info.module.state_dict(keep_vars=True):  # state_dict's own order
        full[name] = by_name[name] if name in by_name else buffers[name]
    return full


def from_state_dict(apply: Apply, state_dict: dict[str, torch.Tensor]) -> dict:
    """Builds a parameter tree for `apply` from `module.state_dict()`-style names.

    Tied aliases are accepted (and must hold the same values as their first name); buffers found in
    `state_dict` are copied into the module's buffers. Values take the module's dtypes; a shape
    other than the module's, or tied names holding different values, is a `ValueError` before
    anything is written.

    Args:
        apply: the function `sf.functionalize` returned.
        state_dict: names to tensors, e.g. `torch.load("model.pt")` or `module.state_dict()` of a
            twin module.

    Returns:
        The parameter tree, as `sf.functionalize` would have returned it.

    Example:
        >>> params = sf.from_state_dict(apply, torch.load("model.pt"))
    """
    info = apply.info
    known = set(info.param_paths) | {n for names in info.aliases.values() for n in names} | set(info.buffer_paths)
    unexpected = sorted(set(state_dict) - known)
    missing = sorted(p for p in info.param_paths if p not in state_dict)
    if unexpected or missing:
        raise ValueError(
            f"state_dict does not match {type(info.module).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    # Checked before anything is written, as module.load_state_dict does: shapes (a buffer of
    # another shape would broadcast into the module's), and tied names holding different values.
    module = info.module
    like = {p: module.get_parameter(p) for p in info.param_paths}
    buffers = dict(module.named_buffers())
    wrong = [f"{n}: {tuple(state_dict[n].shape)} where the module has {tuple(t.shape)}"
             for n, t in [*like.items(), *buffers.items()] if n in state_dict and state_dict[n].shape != t.shape]
    for p in info.param_paths:
        for alias in info.aliases[p]:
            if alias != p and alias in state_dict and state_dict[alias].shape == like[p].shape and not torch.equal(state_dict[alias], state_dict[p]):
                wrong.append(f"{alias}: tied to {p}, holds other values")
    if wrong:
        raise ValueError(f"state_dict does not fit {type(module).__name__}: " + "; ".join(wrong[:5])
                         + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else ""))
    with torch.no_grad():
        for name, b in buffers.items():
            if name in state_dict:
                b.copy_(state_dict[name])
    # The module's dtypes, as load_state_dict's copy into its parameters gives them.
    return nest((p, state_dict[p] if state_dict[p].dtype == like[p].dtype else state_dict[p].to(like[p].dtype)) for p in info.param_paths)
