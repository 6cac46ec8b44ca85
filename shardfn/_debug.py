"""Debug mode: freed memory poisoned, reads of freed units caught, reuse invariants checked.

`SHARDFN_DEBUG=1` in the environment (read once, when shardfn is imported; `0` or unset: off)
turns the debug mode on for the process; `enable(True)` / `enable(False)` switches it at run time
(tests switch it inside pool ranks; `_process.reset()` puts back the environment's value). In
debug mode:

- every place that gives memory back or hands it to other data while a collective or autograd
  might still hold it (the places of Note [freed memory] below) first fills that memory with NaN
  (floating-point dtypes) or the byte 0xA5 (other dtypes), where nothing can read it any more, so
  that a read the invariants forbid computes NaN rather than plausible values;
- an op that reads the full parameters of a unit while they are freed (its memory given back,
  holding another unit, or not gathered yet), in the forward or the backward of a train step, raises
  `UseAfterFreeError` naming the unit, before it computes (a `TorchDispatchMode` over the step that
  looks at every tensor an op reads: Note [stale parameters] in `_flat.py` gives every such tensor a
  version of `STALE` or more; autograd's own check covers only what it saved);
- a slot arena taken over while its previous unit is still gathered, a gather that lands in an
  arena whose reduce-scatter input is still in flight, and a recycled DTensor wrapper that is
  reachable from anything else raise `RuntimeError` at once;
- memory given back or poisoned while an asynchronous collective still reads or writes it, and a
  point-to-point message posted (by the poster thread, after its caller returned) into a buffer
  already given back, raise `RuntimeError` at once, naming the collective (every async collective
  of `_collectives` is remembered with its memory until it is complete);
- a named collective (`sf.psum`, `sf.all_gather`, ...) whose operand has another shape or dtype on
  some rank of its axis raises `ValueError` on every rank, naming each rank's (one small collective
  more per call, `_named._check_same_shape`); without debug mode gloo aborts the rank on unequal
  sizes.

None of it changes a result: a train step gives bitwise the same parameters with debug mode on as
off (`tests/test_debug.py`). It costs a fill per free, a Python call per op in the step and a heap
walk for a few recycled wrappers per step: a debugging aid, not a mode to train in.

Note [freed memory]
-------------------
The places shardfn gives memory back, or lets other data take it, while a collective or autograd
may still hold a tensor over it, and the invariant that makes each sound (each has a Note where the
code is; in debug mode each poisons and checks as listed):

1. `_flat._storage_free` (`untyped_storage().resize_(0)`, the FSDP paper's free) of an arena
   (`Arena.release`), of a gradient shard (`FlatUnit.release_grad`) and of `apply`'s per-unit
   buffers (`_inference._Unit.free`): nothing reads the storage until it is allocated again; the
   tensors over it stay, and reading one would read freed memory (a crash on CPU). Poisoned before
   the resize. Note [slot arenas].
2. A shared slot arena taken by the next unit (`FlatUnit.free` of a unit whose arena is shared, then
   `Arena.claim`): the freed unit's readers are STALE, and the arena is claimed only once its
   previous owner is freed. Poisoned at the free (its region of the arena), unless the unit's own
   reduce-scatter input is there and in flight; checked at the claim. Note [slot arenas].
3. A reduce-scatter input built in the unit's own slot (`FlatUnit.start_reduce` with `in_full`): the
   unit's full parameters are dead from then on (its readers are marked STALE there), and nothing
   fills the arena until the reduction is finished (`Engine._drain_slot`). Poisoned when the
   reduction finishes, with the scratch input of `rs_in` (`reduce_arenas`, reused by the next
   reduction). Note [slot arenas].
4. Point-to-point receives straight into full parameters (`direct_gather`, Note [gloo collectives]
   in `_collectives.py`): a message may land as soon as the gather starts, so the gather starts only
   once the arena's previous unit is freed and no reduction reads it. Checked when the gather starts
   (and before the copy of a gather that does not land in place). Note [slot arenas].
5. Huge-page advice (`_memory.huge_pages`, `madvise(MADV_HUGEPAGE)`): given only on the 2 MB-aligned
   inside of a storage just allocated, before it is written; the advice keeps the contents and
   never reaches past the storage. Nothing to poison; checked in debug mode that the range lies in
   the storage. Note [huge pages].
6. Recycled DTensor wrappers (`_donate.Donation.many`): a donated wrapper becomes a new state's only
   when nothing else can reach it (its reference count, weak references, C++ owners). In debug mode
   the garbage collector is asked for the referrers of the first recycled wrappers of each donation,
   which must be the list that keeps them. Nothing to poison: a donated wrapper holds no memory, and
   its placeholder raises on every read. Note [recycled wrappers].
7. `set_` over another tensor's storage (`_flat._alias`, `_donate.alias`, `_donate.adopt`): makes a
   second tensor over memory that stays allocated; `adopt` points a DTensor at a flat buffer, and the
   memory it held is given back by torch only when no other tensor holds it (a user's view keeps
   its values). Never poisoned: memory a user may still read is not shardfn's to poison.

8. A failed step (`Engine.abort`): every collective of the step still remembered by the schedule
   (a gather or reduction whose wait raised stays among its works until it completes) is waited for
   again, at most `ABORT_WAIT_S` each, before any unit is freed; one that does not complete keeps its
   buffers allocated for good and the engine refuses later steps, since a peer still alive may yet
   write into them. Checked by the in-flight record of every free above.
9. A reduction that failed half-way (`FlatUnit.start_reduce` whose replicated leaves' all-reduce
   failed to start after its reduce-scatter did): the schedule keeps what started in flight
   (`ReductionStarted` in `_schedule.py`), so 8 waits for it before its input and output are freed.
10. The step after a broken one (8's refusal): the refusal comes first, before the step gives the
   gradient shards back (`release_grad`, which a reduce-scatter left in flight may still write) or
   retries off the schedule (`Engine.refuse_if_broken`, read by `GradientCore.gradients`).

Not covered: a read after the step of a tensor kept from inside it (outside the step nothing
watches the ops; storage freed by `resize_(0)` crashes the process on CPU), and compiled units
(`compile=`), whose graphs run without the per-op check.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ENV", "ON", "UseAfterFreeError", "enable", "enabled", "poison", "reads_checked", "track", "check_alone",
           "in_flight", "waited", "forget_in_flight", "check_not_in_flight", "check_posted"]


def _from_env() -> bool:
    value = os.environ.get("SHARDFN_DEBUG", "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"SHARDFN_DEBUG={value!r} is not understood: set SHARDFN_DEBUG=1 for shardfn's debug mode, 0 or unset for none")


ENV = _from_env()
"""The debug mode the environment asked for when shardfn was imported (`SHARDFN_DEBUG`)."""
ON = ENV
"""Whether the debug mode is on now (read at every free; switch it with `enable`)."""

_set_versions = torch._C._autograd._unsafe_set_version_counter
_STALE = 1 << 30  # `_flat.STALE`: the version of every reader of a freed unit (Note [stale parameters])
_PATTERN = 0xA5
_UNITS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # every FlatUnit, for naming the unit of a stale tensor


class UseAfterFreeError(RuntimeError):
    """Debug mode: an op read the full parameters of a unit while they were freed."""


def enable(on: bool = True) -> None:
    """Turns the debug mode on or off for this process (see the module's docstring)."""
    global ON
    if not isinstance(on, bool):
        raise ValueError(f"enable() takes True or False, got {on!r}")
    ON = on


def enabled() -> bool:
    """Whether the debug mode is on."""
    return ON


def track(unit: Any) -> None:
    """Remembers a `FlatUnit` (weakly), so that a read of its freed parameters can name it."""
    _UNITS.add(unit)


# -- poison -----------------------------------------------------------------------------------
def poison(t: torch.Tensor) -> None:
    """Fills the memory `t` views with NaN (floating-point dtypes) or the byte 0xA5, through an
    alias of its own, so that no version counter of `t` or its views moves."""
    if not t.numel() or t.untyped_storage().nbytes() == 0:
        return
    check_not_in_flight(t, "poisoning freed memory", whole_storage=False)
    alias = torch.empty(0, dtype=t.dtype, device=t.device)
    with torch.no_grad():
        alias.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        if t.is_floating_point() or t.is_complex():
            alias.fill_(math.nan)
        elif t.is_contiguous():
            n = t.numel() * t.element_size()
            torch.empty(0, dtype=torch.uint8, device=t.device).set_(
                t.untyped_storage(), t.storage_offset() * t.element_size(), (n,), (1,)
            ).fill_(_PATTERN)
        else:
            alias.fill_(True if t.dtype == torch.bool else _PATTERN)


def poison_storage(t: torch.Tensor) -> None:
    """Fills the whole storage under `t` (it is about to be given back)."""
    st = t.untyped_storage()
    if st.nbytes():
        check_not_in_flight(t, "a storage given back")
        # On the storage itself, byte by byte: no tensor is made over it, which under a torch.func
        # transform (a vmap or grad in loss_fn) would be a functorch wrapper without a storage.
        with torch.no_grad():
            st.fill_(_PATTERN)


# -- collectives in flight --------------------------------------------------------------------
# Every asynchronous collective of `_collectives` is remembered here in debug mode, with the bytes
# it reads or writes (each tensor's own, not its whole storage: a unit's slot holds its reduction's
# input and, past it, frozen leaves that are poisoned while the reduction runs), until it is
# complete or waited for: memory given back, reallocated or poisoned meanwhile would be written by
# a message after the free (heap corruption on CPU, another tensor's values on GPU), so that
# raises at once, naming the collective (Note [freed memory]). The list is the process's
# (`_process.reset` empties it); a lock keeps the poster thread's reads whole.
_IN_FLIGHT: list[tuple[Callable[[], bool], list[tuple[int, int]], str, Any]] = []
_IN_FLIGHT_LOCK = threading.Lock()


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes `t` itself covers (from its first element to past its last)."""
    if not t.numel():
        return (0, 0)
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size())


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return (st.data_ptr(), st.data_ptr() + st.nbytes())


def in_flight(done: Callable[[], bool], tensors: list[torch.Tensor], what: str, work: Any) -> None:
    """Debug mode: the bytes of `tensors` belong to the pending collective `work` (`what`) until
    `done()` or until it is waited for (`waited`; gloo's reduce-scatter never says it is complete)."""
    if not ON:
        return
    spans = [_span(t) for t in tensors if t.numel() and t.untyped_storage().nbytes()]
    if spans:
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.append((done, spans, what, work))


def waited(work: Any) -> None:
    """`work` is complete: its memory is the caller's again."""
    if _IN_FLIGHT:
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT[:] = [rec for rec in _IN_FLIGHT if rec[3] is not work]


def forget_in_flight() -> list[str]:
    """Forgets every collective remembered (`_process.reset`: one test's abandoned collectives are
    not the next one's); returns what those not complete were, for a report: a message may still
    land in their memory."""
    with _IN_FLIGHT_LOCK:
        live = [rec[2] for rec in _IN_FLIGHT if not rec[0]()]
        _IN_FLIGHT.clear()
    return live


def check_not_in_flight(t: torch.Tensor, doing: str, whole_storage: bool = True) -> None:
    """Debug mode: raises if a collective in flight reads or writes the memory about to be given
    back, reallocated or poisoned (`doing`): `t`'s whole storage, or with `whole_storage=False`
    the bytes `t` covers. Forgets the collectives that are complete."""
    if not _IN_FLIGHT:
        return
    lo, hi = _storage_span(t) if whole_storage else _span(t)
    with _IN_FLIGHT_LOCK:
        live = [rec for rec in _IN_FLIGHT if not rec[0]()]
        _IN_FLIGHT[:] = live
    for _, spans, what, _ in live:
        if any(a < hi and lo < b for a, b in spans):
            raise RuntimeError(
                f"{doing}, while a {what} still in flight reads or writes it: a message would land in memory that "
                "is no longer the collective's (Note [freed memory] in shardfn/_debug.py); please report this"
            )


def check_posted(tensors: list[torch.Tensor], what: str) -> None:
    """Debug mode: a message is posted only into memory that is still allocated (the poster thread
    posts after the caller returned: the caller must not have given its buffers back meanwhile)."""
    if ON and any(t.numel() and t.untyped_storage().nbytes() == 0 for t in tensors):
        raise RuntimeError(
            f"a {what} was posted into a buffer already given back (Note [freed memory] in shardfn/_debug.py); "
            "please report this"
        )


# -- reads of freed units ---------------------------------------------------------------------
_aten = torch.ops.aten
# Ops that read only the metadata of a tensor argument (its shape, dtype, device), never its data.
_METADATA_ONLY = {
    _aten.new_empty.default, _aten.new_empty_strided.default, _aten.new_zeros.default, _aten.new_ones.default,
    _aten.new_full.default, _aten.empty_like.default, _aten.zeros_like.default, _aten.ones_like.default,
    _aten.full_like.default, _aten.rand_like.default, _aten.randn_like.default, _aten.detach.default,
    _aten.alias.default, _aten.lift_fresh.default, _aten.sym_size.int, _aten.sym_stride.int, _aten.sym_numel.default,
    _aten.sym_storage_offset.default, _aten.is_same_size.default,
}


def _unit_of(x: torch.Tensor) -> Any:
    """The freed unit whose readers share `x`'s version counter (found by setting each candidate's
    counter for a moment and watching `x`'s), or None."""
    for unit in list(_UNITS):
        if unit.valid:
            continue
        for r in unit._readers:
            before = r._version
            _set_versions((r,), (before + 1,))
            hit = x._version == before + 1
            _set_versions((r,), (before,))
            if hit:
                return unit
    return None


def _check(func: Any, x: torch.Tensor) -> None:
    if isinstance(x, DTensor):
        x = x._local_tensor
    if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.is_inference():
        return  # tensors of other kinds (fake, functional) carry no unit's version
    if x._version < _STALE:
        return
    unit = _unit_of(x)
    name = "an unknown unit" if unit is None else f"unit {unit.name!r}" if unit.name else "the root unit"
    raise UseAfterFreeError(
        f"{func} read the full parameters of {name} while that unit was freed (its memory given back, "
        "holding another unit, or not gathered yet): a tensor kept from the unit's forward (an attribute set "
        "in forward, a closure, a cache) was used after the unit returned. Read parameters only inside "
        "their unit's forward, or through the params handed to loss_fn (Note [freed memory] in "
        "shardfn/_debug.py)"
    )


class _ReadCheck(TorchDispatchMode):
    """Raises before any op reads a tensor over a freed unit's parameters."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _METADATA_ONLY and not func.is_view:
            for x in pytree.tree_leaves((args, kwargs)):
                if isinstance(x, torch.Tensor):
                    _check(func, x)
        return func(*args, **kwargs)


@contextlib.contextmanager
def reads_checked(skip: bool = False) -> Iterator[None]:
    """A train step's forward and backward, watched for reads of freed units in debug mode (a
    no-op otherwise, or with `skip`: compiled units)."""
    if not ON or skip:
        yield
        return
    with _ReadCheck():
        yield


# -- recycled wrappers ------------------------------------------------------------------------
CHECKED_PER_DONATION = 2
"""How many recycled wrappers of one donation debug mode checks with the garbage collector."""


def check_alone(kept: list, i: int) -> None:
    """Debug mode: `kept[i]`, about to be recycled, must be referred to by `kept` alone
    (Note [recycled wrappers] in `_donate.py`)."""
    others = [r for r in gc.get_referrers(kept[i]) if r is not kept]
    if others:
        kinds = sorted({type(r).__name__ for r in others})
        raise RuntimeError(
            f"a donated DTensor about to be recycled into a new state is still referred to by {kinds}: the check "
            "that nothing can reach it is wrong (Note [recycled wrappers] in shardfn/_donate.py); please report this"
        )


def check_advice(storage: torch.UntypedStorage, lo: int, hi: int) -> None:
    """Debug mode: huge-page advice [lo, hi) lies inside `storage` (Note [huge pages])."""
    ptr, n = storage.data_ptr(), storage.nbytes()
    if not (ptr <= lo <= hi <= ptr + n):
        raise RuntimeError(f"huge-page advice [{lo:#x}, {hi:#x}) reaches past its storage [{ptr:#x}, {ptr + n:#x}); please report this")
