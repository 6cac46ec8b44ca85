"""Donated state: a train step takes its input state's memory, and the old state says so loudly.

Note [donated state]
~~~~~~~~~~~~~~~~~~~~
`step(state, batch)` updates the parameters, gradients and optimizer state in place, in the step's
flat buffers, as JAX's donated buffers. The returned state wraps that memory in new DTensor
objects; the DTensors of the state passed in (and of `step.grads` before the step) are donated:
their local tensor becomes a placeholder on which every operation raises `DonatedError`, so an old
state can never show values that changed under the user's feet. What a user took out of a DTensor
before the step (`to_local()`, `detach()`, an index) is a view of the step's memory, as a
parameter's `.data` is in torch: it shows the values of each later step; `sf.copy` keeps values.
Scalars of the optimizer state (the step count) are copied before the update, so an old state
keeps its own. To keep a state (a rollback on NaN, an EMA, a comparison), copy it first: `kept =
sf.copy(state)` (or `copy.deepcopy`); a copy passed back to the step is copied into the step's
buffers (and the state it replaces is donated).

Pickling: the step's DTensors are views into flat buffers, and torch cannot pickle or deep-copy a
DTensor whose local tensor starts inside its storage (the wrapper then looks like it owns data);
the DTensors made here pickle their local values instead, and `copy.deepcopy` clones them as
`sf.copy` does, so a `TrainState`, its parameters and `step.grads` pickle, `torch.save` and
deep-copy as plain DTensors of the same mesh and placements.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

from . import _debug

__all__ = ["DonatedError", "Donation", "adopt", "alias", "copy", "donate", "same_memory", "wrap"]


class DonatedError(RuntimeError):
    """A tensor of a state that was donated to a train step was read."""


class _Donated(torch.Tensor):
    """The local tensor of a donated DTensor: the same metadata, no data; every operation raises."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, message: str):
        r = torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device)
        r._message = message
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        flat = optree.tree_leaves((args, kwargs or {}))
        message = next((a._message for a in flat if isinstance(a, _Donated)), "this tensor was donated")
        raise DonatedError(message)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"<donated tensor: {self._message}>"

    def __reduce_ex__(self, protocol):  # type: ignore[override]
        raise DonatedError(self._message)


class _Reduce:
    """Pickles a DTensor made here as `DTensor(local values, spec)`. It holds the local tensor, not
    the DTensor (no reference cycle), so one object serves every DTensor that wraps that local tensor
    in turn: the one a donation makes takes it over, and the donated one gets `Donation`'s refusal."""

    __slots__ = ("local", "spec", "requires_grad")

    def __init__(self, local: torch.Tensor, spec: Any, requires_grad: bool):
        self.local, self.spec, self.requires_grad = local, spec, requires_grad

    def __call__(self, protocol: int):
        return (_rebuild, (self.local.detach().clone(), self.spec, self.requires_grad))

    def deepcopy(self, memo: dict) -> DTensor:
        """`copy.deepcopy` of the DTensor: its values cloned, as `sf.copy` does (torch's own
        `__deepcopy__` fails on a DTensor whose local tensor starts inside its storage)."""
        return wrap(self.local.detach().clone(), self.spec, self.requires_grad)


def _attrs(local: torch.Tensor, spec: Any, requires_grad: bool) -> dict:
    """The attribute dict of a DTensor made here: how it pickles and deep-copies."""
    r = _Reduce(local, spec, requires_grad)
    return {"__reduce_ex__": r, "__deepcopy__": r.deepcopy}


class _Refuse:
    """The `__reduce_ex__` and `__deepcopy__` of a donated DTensor: pickling or copying it raises."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message

    def __call__(self, *args: Any, **kwargs: Any):
        raise DonatedError(self.message)


def _rebuild(local: torch.Tensor, spec: Any, requires_grad: bool) -> DTensor:
    _refuse_another_job(spec)
    return wrap(local, spec, requires_grad)


def _refuse_another_job(spec: Any) -> None:
    """A DTensor pickled (`torch.save` of a state) in a job of another layout: its mesh names ranks
    this job does not have, or leaves this rank out, and its shard is another rank's share. Such a
    file holds one rank's shards; `sf.save` / `sf.load` reshard (the check: before anything is used)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    mesh = spec.mesh
    ranks = mesh.mesh.flatten().tolist()
    world, rank = dist.get_world_size(), dist.get_rank()
    coordinate = mesh.get_coordinate()
    if max(ranks) >= world or coordinate is None:
        raise ValueError(
            f"this file holds a DTensor of shape {tuple(spec.shape)} over a mesh of ranks {ranks}, pickled in a job of "
            f"another layout than this one (world size {world}, rank {rank}): a state saved with torch.save holds one "
            "rank's shards and loads only into a job laid out as the one that saved it. Save with sf.save(state, path) "
            "and load with sf.load(path, like=state) to resume at another world size or mesh"
        )


# Note [cheap donation]
# ~~~~~~~~~~~~~~~~~~~~~
# A train step donates every DTensor of the state it is given and wraps the same memory in new ones
# (a few per leaf: parameters, gradients, optimizer moments), so what one donation allocates is paid
# per leaf and per step, and whatever outlives the step feeds the garbage collector's passes.
# So a donation allocates one object per leaf, the DTensor: it comes from `DTensor.__new__` alone
# (`DTensor.__init__` does nothing but pass through torch._dynamo's disable wrapper); it takes over
# the donated DTensor's attribute dict, which holds its pickling object (`_Reduce`, which holds the
# local tensor, not the DTensor); the donated DTensors of one donation share one attribute dict
# (their pickling refusal) and one placeholder per shape, stride and dtype (`Donation`). So any
# attribute a user set on a DTensor of the state moves to the new one, and an attribute set on a
# donated DTensor (which raises on every read of its values) is seen on all of that donation's.
def _new(local: torch.Tensor, spec: Any, requires_grad: bool) -> DTensor:
    return DTensor.__new__(DTensor, local, spec, requires_grad=requires_grad)


def wrap(local: torch.Tensor, spec: Any, requires_grad: bool = False) -> DTensor:
    """A DTensor over `local` with `spec` (no checks, no communication) that pickles."""
    dt = _new(local, spec, requires_grad)
    dt.__dict__.update(_attrs(local, spec, requires_grad))
    return dt


def alias(view: torch.Tensor) -> torch.Tensor:
    """A tensor object of its own over `view`'s memory, to hand out: whatever a user does to it
    (even `set_`), the owner's own view keeps pointing at its buffer."""
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(
        view.untyped_storage(), view.storage_offset(), view.shape, view.stride()
    )


def same_memory(t: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether `t` holds exactly `view`'s memory (a donated tensor holds none)."""
    if isinstance(t, _Donated) or isinstance(view, _Donated):
        return False
    return (
        t.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
        and t.storage_offset() == view.storage_offset()
        and t.shape == view.shape
        and t.stride() == view.stride()
    )


def adopt(dt: DTensor, view: torch.Tensor) -> None:
    """Points `dt`'s local tensor (the same object: local tensors a user took with `to_local()`
    follow) at `view`'s memory, a shard in a flat buffer; `dt` then pickles its values.

    The memory it held is given back by torch once no other tensor holds it; a user's view of it
    keeps its values, so it is never poisoned (Note [freed memory] 7 in `_debug.py`)."""
    local = dt._local_tensor
    with torch.no_grad():
        local.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
    dt.__dict__.update(_attrs(local, dt._spec, dt.requires_grad))


# Note [recycled wrappers]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A loop `state, metrics = step(state, batch)` drops each state once the next one is returned, so
# the DTensors a step donated are, one step later, reachable from nothing but the step that keeps
# them. A DTensor nothing else can reach cannot be observed again: making it the new DTensor of a
# later state is indistinguishable from allocating one, and it spares the garbage collector the few
# thousand short-lived wrappers of every step (on DEEP, about half its passes' time). It is taken
# only when nothing else holds it: its reference count is that of an object one list holds (a
# state the user keeps adds to it, and so, since torch 2.10, does a C++ owner such as an autograd
# graph that saved it), no weak reference points at it, its TensorImpl has no other owner
# (`Tensor._use_count`: the C++ check on any torch), and it wraps the same spec (shape, strides,
# dtype, mesh, placements). Only wrappers outside autograd are taken (`requires_grad` off, so a
# leaf with no `grad_fn`) with no `.grad`, no hooks left on them and no view base (an optimizer
# whose update returned views): that state lives on the tensor object, not in the attribute dict
# that moves. Anything else gets a new DTensor, and what it held stays donated. As with any new
# object, an `id()` seen before may come back: a cache keyed by ids of objects it does not hold was
# never sound, and now it goes wrong every other step. In debug mode the garbage collector
# confirms, for the first few wrappers of each donation, that the list is their only referrer
# (Note [freed memory] 6 in `_debug.py`).
def _reference_count_alone() -> int:
    kept = [object()]
    return sys.getrefcount(kept[0])  # the same expression as `_unreachable`'s: one list holds it


_ALONE = _reference_count_alone()
_use_count = getattr(torch.Tensor, "_use_count", None)


def _unreachable(kept: list, i: int) -> bool:
    """Whether `kept[i]`, a donated DTensor, is held by `kept` alone (Note [recycled wrappers])."""
    return (
        _use_count is not None
        and type(kept[i]) is DTensor
        and sys.getrefcount(kept[i]) == _ALONE
        and not weakref.getweakrefcount(kept[i])
        and _use_count(kept[i]) == 1
    )


class Donation:
    """One donation (a train step's, a transform call's): `donation(dt)` returns a new DTensor over
    `dt`'s local tensor and donates `dt` (reads raise `message`). The DTensors one donation donates
    share its placeholders and pickling refusal (Note [cheap donation])."""

    __slots__ = ("message", "_refuse", "_placeholders", "_donated_attrs")

    def __init__(self, message: str):
        self.message = message
        self._refuse = _Refuse(message)
        self._placeholders: dict[tuple, _Donated] = {}
        # Shared by every donated DTensor. Its methods that would reach a collective or hand out the
        # local tensor (full_tensor, redistribute, to_local) raise here, before anything is sent:
        # through a collective the placeholder reached C++ on some runs (a segfault), and only the
        # ranks that read it would have issued one.
        self._donated_attrs = {name: self._refuse for name in ("__reduce_ex__", "__deepcopy__", "full_tensor", "redistribute", "to_local")}

    def placeholder(self, like: torch.Tensor) -> "_Donated":
        key = (like.shape, like.stride(), like.dtype, like.device)
        d = self._placeholders.get(key)
        if d is None:
            d = self._placeholders[key] = _Donated(like, self.message)
        return d

    def __call__(self, dt: DTensor, spare: DTensor | None = None) -> DTensor:
        """A new DTensor over `dt`'s memory (`spare` itself when the caller found it unreachable and
        alike, Note [recycled wrappers]); `dt` is donated."""
        local, spec, requires_grad = dt._local_tensor, dt._spec, dt.requires_grad
        if (
            spare is not None
            and not requires_grad
            and spare._spec is spec
            and not spare.requires_grad  # a leaf, so no grad_fn; hooks need requires_grad to be set, and may stay after
            and spare.grad is None
            and spare._backward_hooks is None
            and spare._post_accumulate_grad_hooks is None
            and spare._base is None  # not a view of an earlier step's tensor (an update that returned views)
        ):
            new = spare
            new._local_tensor = local
        else:
            new = _new(local, spec, requires_grad)
        attrs = dt.__dict__
        r = attrs.get("__reduce_ex__")
        if type(r) is not _Reduce or r.local is not local or r.spec is not spec or r.requires_grad != requires_grad:
            attrs = {**attrs, **_attrs(local, spec, requires_grad)}
        new.__dict__ = attrs  # the donated DTensor's attributes (its pickling object) pass to the new one
        dt._local_tensor = self.placeholder(local)
        dt.__dict__ = self._donated_attrs
        return new

    def many(self, leaves: list, memo: dict[int, DTensor], kept: list | None = None) -> list:
        """`leaves` with each DTensor donated (`self(dt)`) and the others as they are; `memo` (id of
        a donated DTensor -> its new one) makes a DTensor seen twice, here or in an earlier call
        with the same memo, donated once. One loop for the few thousand leaves of a train step's state.

        `kept`: the caller's list of what its previous donation at this place donated; a DTensor
        there that nothing else can reach becomes the new one at its position, and the list then
        holds what this donation donated (Note [recycled wrappers])."""
        out = []
        append, get = out.append, memo.get
        spares = kept if kept is not None and len(kept) == len(leaves) else None
        checks = _debug.CHECKED_PER_DONATION if _debug.ON else 0
        for i, x in enumerate(leaves):
            if isinstance(x, DTensor):
                new = get(id(x))
                if new is None:
                    alone = spares is not None and _unreachable(spares, i)
                    if alone and checks:  # before a local name holds it (a frame would refer to it)
                        checks -= 1
                        _debug.check_alone(spares, i)
                    spare = spares[i] if alone else None
                    new = memo[id(x)] = self(x, spare)
                append(new)
            else:
                append(x)
        if kept is not None:
            kept[:] = [x if type(x) is DTensor else None for x in leaves]
        return out


def donate(dt: DTensor, message: str) -> DTensor:
    """A new DTensor over `dt`'s local tensor; `dt` itself is donated (reads raise `message`).
    Donating many at once: one `Donation(message)` called on each shares its placeholders."""
    return Donation(message)(dt)


def is_donated(x: Any) -> bool:
    return isinstance(x, DTensor) and isinstance(x._local_tensor, _Donated)


def copy(tree: Any) -> Any:
    """A copy of a state or tree that no train step owns: each DTensor's shards and each tensor cloned.

    A train step donates the state it is given (Note [donated state] in `shardfn/_donate.py`): to
    keep one (a rollback, an EMA, a comparison), copy it before the step. A copy can be passed to
    the step later; its values are copied into the step's buffers.

    Args:
        tree: a `TrainState`, a tree of DTensors (`state.params`, `step.grads`), or any tree.

    Returns:
        The same structure with every tensor copied (DTensors stay DTensors of the same mesh and
        placements); other leaves (ints, None) as they are.

    Example:
        >>> kept = sf.copy(state)
        >>> state, metrics = step(state, batch)
        >>> if not torch.isfinite(metrics["loss"]):
        ...     state = kept
    """

    def one(x: Any) -> Any:
        if isinstance(x, DTensor):
            if isinstance(x._local_tensor, _Donated):
                raise DonatedError(x._local_tensor._message)
            return wrap(x._local_tensor.detach().clone(), x._spec, x.requires_grad)
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        return x

    return optree.tree_map(one, tree, none_is_leaf=True)
