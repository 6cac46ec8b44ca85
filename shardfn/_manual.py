"""Manual regions: code that runs once per rank on that rank's blocks, over named mesh axes.

A region is opened by `sf.shard_map` (and by the train step around `loss_fn`): it binds a mesh,
so that the named collectives (`shardfn/_named.py`) find their axes by name, and it tracks, for
every tensor computed inside, the set of mesh axes its value varies over (Note [varying axes]).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakTensorKeyDictionary

from . import _mesh

__all__ = ["Region", "AxisGroup", "current", "region", "step_region", "vma", "axis_group", "axis_names"]


# Note [varying axes]
# ~~~~~~~~~~~~~~~~~~~
# Inside per-shard code a value is either the same on every rank along a mesh axis (invariant) or
# not (varying), and the derivative of a collective depends on which: `psum` of a varying value
# sums different values and its transpose hands every rank the (invariant) cotangent as it is,
# while a value that is invariant along an axis and is then used together with one that varies
# there has been, implicitly, copied onto every rank of the axis (`pvary`), whose transpose sums
# the cotangents over the axis. This is JAX's `check_vma` discipline; with it, every derivative
# is that of the global function, and no collective needs a "sum or not" guess in its backward.
#
# Eager PyTorch has no types to carry it, so a region tracks it beside the values: a torch
# function mode sees every call made inside the region and gives each tensor it returns the union
# of its tensor arguments' axes (a weak map from tensor to a frozenset of axis names). Where the
# arguments of one call differ, those that need a gradient and vary over fewer axes are first
# passed through `pvary` to the union (so the sum over the axis happens in the backward, once,
# exactly where the value was copied); arguments that need no gradient are left as they are (the
# copy is the identity on values). An in-place call that makes its target vary over more axes
# than before, on a target that needs a gradient, first routes the target through `pvary` too.
#
# Where each value starts: the blocks of `shard_map`'s inputs vary over the axes their spec names;
# a tensor the region has not seen (a closed-over weight, a module's parameter) is invariant over
# every axis; `axis_index` varies over its axes; a random draw (`torch.randn`, dropout, ...)
# varies over every axis of the region, which is always safe (a value typed varying that happens
# to be equal is only refused where an out spec claims it invariant). torch.func's wrappers are
# looked through, so a `vmap` or `grad` inside the region keeps the types of what it wraps; and
# what a transform hands out on exit (the tensor under its wrapper, or a view of it, which the
# region never sees made) is typed as its wrapper was: a value computed by `vmap`, `jvp` or
# `grad` from this rank's block varies with it. A value that leaves torch and comes back (through
# `.tolist()`, NumPy, a Python number) is a tensor the region has not seen: it counts as invariant.
#
# A derivative taken inside the region (`torch.func.grad`, `vjp`, `torch.autograd.grad`, a
# `backward`) is not a computation on its arguments: nothing of them is lifted there (lifting an
# input would hand autograd a new tensor the outputs do not depend on: a zero gradient, silently).
# The lifts already made where the input met varying values are in the graph, so the gradient with
# respect to an invariant input is the sum over the axes of the ranks' gradients, and it is typed as
# its input (a cotangent has its primal's type), as JAX's `grad` inside `shard_map` gives.

_RANDOM_NAMES = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli", "normal",
    "multinomial", "poisson", "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
    "feature_alpha_dropout", "uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_",
    "cauchy_", "log_normal_", "rrelu", "native_dropout",
})


def _is_random(func: Any, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    if name == "scaled_dot_product_attention":
        return bool(kwargs.get("dropout_p", 0.0))
    return name in _RANDOM_NAMES


def _mutated(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor an in-place call writes into, if any."""
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        return out
    name = getattr(func, "__name__", "")
    if args and isinstance(args[0], torch.Tensor) and (name == "__setitem__" or (name.endswith("_") and not name.startswith("__"))
                                                        or name in ("__iadd__", "__isub__", "__imul__", "__itruediv__")):
        return args[0]
    return None


@dataclass(frozen=True)
class AxisGroup:
    """The ranks along some axes of a mesh, as a collective over those axes sees them.

    `index` is this rank's position along the axes, the first named the major one (JAX's
    `axis_index` of a tuple of axes); `ranks[j]` is the group rank at position j.
    """

    axes: tuple[str, ...]
    group: Any
    size: int
    index: int
    ranks: tuple[int, ...]  # position along the axes -> group rank

    def position_of(self, group_rank: int) -> int:
        return self.ranks.index(group_rank)


_GROUPS = _mesh.ByMesh()  # mesh -> {axes: AxisGroup}, by identity (Note [mesh groups] in `_mesh.py`)


def axis_group(mesh: DeviceMesh, axes: tuple[str, ...]) -> AxisGroup:
    """The `AxisGroup` of `axes` of `mesh` (a collective the first time, on every rank)."""
    known = _GROUPS.setdefault(mesh, {})
    if axes in known:
        return known[axes]
    names = tuple(mesh.mesh_dim_names or ())
    sizes = dict(zip(names, (int(s) for s in mesh.shape)))
    coords = dict(zip(names, mesh.get_coordinate() or ()))
    size = math.prod(sizes[a] for a in axes)
    index = _position(axes, sizes, coords)
    if size == 1:
        made = known[axes] = AxisGroup(axes, None, 1, 0, (0,))
        return made
    group = _mesh.mesh_group(mesh, axes)
    grid = mesh.mesh
    positions: list[int] = []
    for g in range(dist.get_world_size(group)):
        global_rank = dist.get_global_rank(group, g)
        where = (grid == global_rank).nonzero()[0].tolist()
        positions.append(_position(axes, sizes, dict(zip(names, where))))
    ranks = tuple(positions.index(j) for j in range(size))
    made = known[axes] = AxisGroup(axes, group, size, index, ranks)
    return made


def _position(axes: tuple[str, ...], sizes: dict, coords: dict) -> int:
    index = 0
    for a in axes:
        index = index * sizes[a] + int(coords[a])
    return index


def _memory(t: torch.Tensor) -> "torch.UntypedStorage | None":
    """The storage `t` views (None where there is none to name: meta, wrappers, no data).

    Note [memory written in place]: a write is remembered by the storage it went to, held weakly,
    never by its address: torch keeps one Python object per storage for as long as the storage
    lives, so the entry goes when the memory is given back, and a tensor allocated later at the
    same address (an invariant value, typed varying by a write it never saw) is not confused with
    it."""
    try:
        t = torch._C._functorch.get_unwrapped(t) if torch._C._functorch.is_functorch_wrapped_tensor(t) else t
        if t.device.type == "meta" or isinstance(t, torch.distributed.tensor.DTensor):
            return None
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    return storage if storage.data_ptr() else None


class Region:
    """One manual region: its mesh, its axes, and the axes each tensor computed in it varies over."""

    def __init__(self, mesh: DeviceMesh, what: str, lift: Callable, axes: "tuple[str, ...] | None" = None,
                 unseen: frozenset = frozenset()):
        names = mesh.mesh_dim_names
        if not names:
            raise ValueError("the mesh has no axis names: build it with sf.mesh(dp=-1) or init_device_mesh(..., mesh_dim_names=...)")
        self.mesh, self.what, self.lift = mesh, what, lift
        self.sizes = dict(zip(tuple(names), (int(s) for s in mesh.shape)))
        self.names: tuple[str, ...] = tuple(names) if axes is None else tuple(axes)  # the axes values are typed over
        self.unseen = unseen  # the type of a tensor the region has not seen
        self.types: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.collectives = 0  # named collectives called in the region
        self.paused = False
        self._mode: "_Tracking | None" = None
        # memory written in place -> the axes written into it (Note [memory written in place])
        self._writes: "weakref.WeakKeyDictionary[torch.UntypedStorage, frozenset]" = weakref.WeakKeyDictionary()

    def track(self) -> None:
        """Starts typing the calls made in the region from here on (Note [varying axes])."""
        if self._mode is None:
            self._mode = _Tracking(self)
            self._mode.__enter__()

    def close(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def spread(self, x: torch.Tensor) -> int:
        """Over how many ranks `x` takes different values: the product of its varying axes' sizes."""
        return math.prod(self.sizes[a] for a in self.of(x))

    @contextlib.contextmanager
    def untracked(self) -> Iterator[None]:
        """A block whose calls are not typed (a named collective's own work)."""
        old, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = old

    def axes(self, axis: "str | tuple[str, ...] | list[str]", call: str) -> tuple[str, ...]:
        """`axis` (a name or names) checked against the region's mesh, as a tuple."""
        axes = (axis,) if isinstance(axis, str) else tuple(axis) if isinstance(axis, (tuple, list)) else None
        bad = [a for a in axes if a not in self.names] if axes and all(isinstance(a, str) for a in axes) else [axis]
        if bad or not axes or len(set(axes)) != len(axes):
            every = self.names[0] if len(self.names) == 1 else self.names
            raise ValueError(
                f"{call}: axis {axis!r} is not a name, or a tuple of distinct names, of the axes {self.names} that the "
                f"enclosing {self.what} runs over. Name those axes, e.g. {call}(x, {every!r})"
                + (" for all of them" if len(self.names) > 1 else "")
                + ("; collectives over other mesh axes run inside sf.shard_map" if len(self.names) < len(self.sizes) else "")
            )
        return axes

    def of(self, x: Any) -> frozenset:
        """The axes `x` varies over (a tensor the region has not seen: `unseen`), with those of
        what was written into its memory in place (through any view of it)."""
        if not isinstance(x, torch.Tensor):
            return frozenset()
        t = x
        while True:
            found = self.types.get(t)
            if found is not None:
                break
            if not torch._C._functorch.is_functorch_wrapped_tensor(t):
                base = t._base
                found = self.types.get(base, self.unseen) if base is not None else self.unseen
                break
            t = torch._C._functorch.get_unwrapped(t)
        if self._writes:
            key = _memory(t)
            if key is not None and key in self._writes:
                return found | self._writes[key]
        return found

    def written(self, target: torch.Tensor, axes: frozenset) -> None:
        """An in-place write of a value varying over `axes` into `target`: every view of its
        memory varies over them from now on (the buffer a `narrow(...).copy_(x)` wrote into)."""
        key = _memory(target)
        if key is not None and axes:
            self._writes[key] = self._writes.get(key, frozenset()) | axes

    def mark(self, x: Any, axes: frozenset) -> None:
        for t in pytree.tree_leaves(x):
            if isinstance(t, torch.Tensor):
                self.types[t] = axes
                while torch._C._functorch.is_functorch_wrapped_tensor(t):  # what the transform hands out on exit
                    t = torch._C._functorch.get_unwrapped(t)
                    self.types[t] = axes


_DIFFERENTIATE = (torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward)


def _differentiated(region: Region, func: Any, args: tuple, kwargs: dict) -> Any:
    """A derivative taken in the region: run as it is, each gradient typed as its input (Note
    [varying axes])."""
    out = func(*args, **kwargs)
    if func is torch.autograd.grad:
        inputs = kwargs["inputs"] if "inputs" in kwargs else args[1] if len(args) > 1 else ()
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        for g, x in zip(out, inputs):
            if isinstance(g, torch.Tensor):
                region.mark(g, region.of(x))
    return out


# Note [a lift inside a custom Function]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A `torch.autograd.Function` runs its forward with gradients off, and `Function.apply` itself
# passes no torch function mode, so the region sees only the calls inside the forward. Where one
# of them uses a tensor that needs a gradient together with values that vary over more axes (a
# closed-over weight times this rank's block), the `pvary` that would sum its gradient over the
# ranks cannot be put in the graph there: the Function's backward would hand the weight this
# rank's gradient alone, different on every rank. `torch.utils.checkpoint(use_reentrant=True)` is
# such a Function. So that call is refused, naming the fix: type the tensor as varying before it
# enters the Function (`sf.pvary(w, axes)`), or checkpoint with `use_reentrant=False`. Under
# `torch.no_grad()` outside a Function no gradient flows, and nothing is refused.
def _refuse_inside_a_function(region: Region, func: Any, t: torch.Tensor, have: frozenset, union: frozenset) -> None:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "apply" and frame.f_code.co_filename.endswith(_FUNCTION_FILES):
            missing = tuple(sorted(union - have))
            raise NotImplementedError(
                f"{region.what}: inside a torch.autograd.Function's forward, {getattr(func, '__name__', func)} uses a "
                f"tensor of shape {tuple(t.shape)} that needs a gradient and varies over {sorted(have) or 'no axis'} "
                f"together with values that vary over {sorted(union)}: its gradient would be this rank's alone, not "
                f"the sum over {list(missing)} (Note [a lift inside a custom Function] in shardfn/_manual.py). Pass it "
                f"through sf.pvary(x, {missing[0] if len(missing) == 1 else missing!r}) before the Function, or, for "
                "torch.utils.checkpoint, use use_reentrant=False"
            )
        frame = frame.f_back


_FUNCTION_FILES = (os.path.join("torch", "autograd", "function.py"), os.path.join("torch", "_functorch", "autograd_function.py"))


class _Tracking(TorchFunctionMode):
    """Gives every tensor a call in the region returns the axes it varies over (Note [varying axes])."""

    def __init__(self, region: Region):
        super().__init__()
        self.region = region

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        region = self.region
        if region.paused or getattr(func, "__name__", "") == "__set__":  # a collective's own work; `x.data = y`
            return func(*args, **kwargs)
        if func in _DIFFERENTIATE:
            return _differentiated(region, func, args, kwargs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        found = [region.of(t) if isinstance(t, torch.Tensor) else None for t in flat]
        union = frozenset().union(*(f for f in found if f is not None))
        if _is_random(func, kwargs):
            union = frozenset(region.names)
        if any(f is not None and f != union for f in found):
            target = _mutated(func, args, kwargs)
            lifted = []
            for t, f in zip(flat, found):
                if f is not None and f != union and t.requires_grad and not torch.is_grad_enabled():
                    _refuse_inside_a_function(region, func, t, f, union)
                if f is not None and f != union and t.requires_grad and torch.is_grad_enabled():
                    if t is target:
                        t.copy_(region.lift(region, t.clone(), tuple(a for a in region.names if a in union - f)))
                    else:
                        t = region.lift(region, t, tuple(a for a in region.names if a in union - f))
                lifted.append(t)
            args, kwargs = pytree.tree_unflatten(lifted, spec)
        out = func(*args, **kwargs)
        region.mark(out, union)
        target = _mutated(func, args, kwargs)
        if target is not None:
            region.types[target] = union
            region.written(target, union)
        return out


_LOCAL = threading.local()


def current() -> Region | None:
    """The innermost manual region open on this thread, if any."""
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def region(mesh: DeviceMesh, what: str, lift: Callable) -> Iterator[Region]:
    """Opens a manual region over every axis of `mesh` for the block, typing every call in it
    (Note [varying axes]); `lift(region, x, axes)` is `pvary`."""
    with _opened(Region(mesh, what, lift)) as reg:
        reg.track()
        yield reg


@contextlib.contextmanager
def step_region(mesh: DeviceMesh, data_axes: tuple[str, ...], lift: Callable) -> Iterator[Region]:
    """The region around a train step's `loss_fn` (Note [named collectives in a step])."""
    with _opened(Region(mesh, "train step's loss_fn", lift, axes=data_axes, unseen=frozenset(data_axes))) as reg:
        yield reg


@contextlib.contextmanager
def _opened(reg: Region) -> Iterator[Region]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append(reg)
    try:
        yield reg
    finally:
        reg.close()
        stack.pop()


def vma(x: torch.Tensor) -> frozenset:
    """The mesh axes `x` varies over in the current region (empty outside one)."""
    reg = current()
    return reg.of(x) if reg is not None else frozenset()


def axis_names(axis: "str | tuple[str, ...]", call: str) -> tuple[Region, tuple[str, ...]]:
    """The current region and `axis` as a checked tuple of its axis names."""
    reg = current()
    if reg is None:
        raise ValueError(
            f"sf.{call} was called outside per-shard code: call it inside a function run by sf.shard_map, or inside the "
            "loss_fn of sf.train_step / sf.value_and_grad"
        )
    axes = reg.axes(axis, f"sf.{call}")
    reg.track()
    return reg, axes
