"""Big-model init: a module built under `sf.meta_device()`, its recorded construction replayed unit by unit.

Note [meta init]
----------------
`with sf.meta_device(): model = Model(cfg)` builds the module without memory while recording every
tensor operation its construction runs. `step.init(params)` and `sf.shard(..., init=model)` replay
the recording and give every parameter and buffer exactly the value an eager CPU build from the
same generator state would have, whatever the construction does (`reset_parameters`, `self.apply`,
`nn.init.*`, `.data.normal_()`, draws that are not parameters, casts, ties).

Recording. Inside the block tensors are fake CPU tensors (`FakeTensorMode`), not meta tensors,
because construction code branches on the device (some initializers return early on meta): the
block must run exactly the Python an eager build runs. A dispatch mode above it (`_Recorder`)
stores each ATen operation, tensors replaced by references to their storage (index, size, stride,
offset, dtype: views and ties alias as they did) and outside tensors (data: `torch.tensor([...])`,
numpy) by real copies of their values. At the end of the block the module's tensors become meta
tensors mapped to the recording's storages, their version counters noted.

What ATen alone would not record exactly:
- Initializers that branch on what they draw (`trunc_normal_` redraws rejected samples) are
  recorded as one operation each, patched where `torch.nn.init` looks them up, and replayed by
  calling them for real: the same generator state gives the same draws.
- A value read into Python (`.item()`, `.tolist()`, `if t.any()`: drop-path rates, a branch on a
  drawn value) is computed for real: the recording so far is planned and run for that storage
  alone, as the replay will, from the block's generator state, and the construction goes on with
  the value an eager build sees. Such a read ties the recording to the generator state: a rank
  that began the block in another state than rank 0's is refused at replay.
- A deep copy (`nn.Transformer`'s layer clones) is a recorded copy of each storage's bytes, one per
  storage as in eager (views of one storage stay views of one copy). The copied modules keep the
  recording (its deep copy is itself); the block's end walks the recorded modules' submodules,
  which a deep copy does not register.
Whatever cannot be replayed exactly is refused while recording, naming the construction code (the
innermost frame outside torch, and the module whose method runs it) and the operation: touching
the generator's state or passing `generator=`, other devices, `resize_`, sizes that depend on
values (`nonzero`). The recording keeps the first refusal's message: a construction that catches
it (torch's `ParametrizationList` catches `NotImplementedError` from `right_inverse` and goes on
without it) is refused at replay, with that message.

The generator after the block. An eager build advances the CPU generator; the block draws nothing
for real, so at its end every recorded random operation runs again on a scratch tensor of its
size (with what it reads computed, as a replay computes it), from the block's first state, and the
generator is set to where that leaves it: a second block (a GAN's other model) or a draw after the
block gets what it would get eagerly. This is exact whatever each kernel consumes, and costs the
eager build's drawing time and one operation's scratch memory at a time. A block that raises
leaves the generator where it began.

Replay (`materialize`) runs on every rank from the recorded generator state, after deciding what
to run. Going backwards from the wanted parameters and buffers, an operation runs if it writes a
storage whose value matters (and what it reads then matters); a write of a whole storage ends its
earlier history. A random operation whose result does not matter still draws, into a scratch
tensor of the same size, stride and dtype, so the generator advances as in the eager build; draws
after the last random operation that matters are skipped. Views and operations that neither
matter nor draw are skipped. Storages live from their first running operation to their last, and
a parameter's shard is kept when its value is final. An operation that draws nothing runs as early
as the storages it touches allow (after their last writes, and after the last reads of those it
writes): a cast, or a change to part of a weight made after every layer is built, runs right after
what it touches is ready, not where the construction ran it. Memory is this rank's shards plus
the operations in flight; time is every rank drawing the whole model's random numbers.

Refused, because the value cannot be known: a module built under plain `torch.device("meta")` (no
recording), meta values from before the block or from uninitialized `torch.empty` memory, and
changes after the block (a replaced parameter is not recorded; an in-place change shows in its
version counter; changes through `.data` cannot be seen, so the docs say to do everything in the
block). Where values do not matter (memory estimates, a simulated rank), `init="empty"` accepts
any meta tree, recorded or not: each rank allocates its uninitialized shards and the module's meta
buffers, nothing is replayed or communicated.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from . import _collectives as C

__all__ = ["meta_device", "materialize", "has_meta", "capture", "EMPTY", "check_init", "empty_shard", "empty_buffers"]

aten = torch.ops.aten
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

# Operations that write all of their first argument without reading it (Note [meta init]).
_OVERWRITE = {
    "fill_", "zero_", "normal_", "uniform_", "copy_", "random_", "bernoulli_", "exponential_",
    "geometric_", "cauchy_", "log_normal_",
}
_UNINITIALIZED = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                  aten.new_empty.default, aten.new_empty_strided.default}
_READS_VALUE = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.allclose.default}
_METADATA_ONLY = {aten.set_.source_Tensor, aten.set_.source_Storage, aten.set_.source_Storage_storage_offset}


def check_outside_block(what: str) -> None:
    """Refuses `what` inside an `sf.meta_device()` block (it would be recorded as construction)."""
    if _active() is not None:
        raise ValueError(f"{what} is called inside an sf.meta_device() block: call it after the block (build the "
                         "module inside it, then leave it)")


def has_meta(leaves: list[Any]) -> bool:
    return any(isinstance(x, torch.Tensor) and x.is_meta for x in leaves)


@dataclass(frozen=True)
class _Ref:
    """A recorded tensor: which storage, and the view of it."""

    s: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True)
class _Const:
    value: torch.Tensor


@dataclass
class _Op:
    func: Any
    args: Any  # pytree with _Ref / _Const in place of tensors
    kwargs: Any
    outs: list[_Ref | None]  # the flat outputs' references
    reads: set[int]
    writes: set[int]  # written storages, new outputs included
    full: set[int]  # written storages whose every byte this operation sets without reading them
    random: bool
    dtype: torch.dtype  # the default dtype when it ran


@dataclass(eq=False)
class _Record:
    """One `sf.meta_device()` block: its operations, storages and generator state."""

    rng: torch.Tensor
    ops: list[_Op] = field(default_factory=list)
    index: dict[int, int] = field(default_factory=dict)  # storage cdata -> storage index
    storages: list[Any] = field(default_factory=list)  # kept alive: their addresses stay unique
    created: set[int] = field(default_factory=set)  # storages an operation of the block created
    versions: dict[int, tuple[Any, int]] = field(default_factory=dict)  # id(param/buffer) -> (weakref, version at exit)
    alias: list[Any] = field(default_factory=list)  # the meta storages standing for fake ones after the block
    open: bool = True
    problem: str | None = None  # why this recording cannot be replayed
    values: dict[int, tuple[Any, int]] = field(default_factory=dict)  # storage -> (its value read, len(ops) then)
    random_reads: bool = False  # the construction read a value that depends on random draws
    refused: str | None = None  # a refusal raised while recording (the construction may have caught it)

    def __deepcopy__(self, memo: dict) -> "_Record":
        return self  # a module deep-copied in the block (nn.Transformer's clones) keeps its recording

    def ref(self, t: torch.Tensor) -> _Ref:
        st = t.untyped_storage()
        key = st._cdata
        s = self.index.get(key)
        if s is None:
            s = self.index[key] = len(self.storages)
            self.storages.append(st)
        return _Ref(s, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    def known(self, t: torch.Tensor) -> _Ref | None:
        s = self.index.get(t.untyped_storage()._cdata)
        if s is None or s not in self.created:
            return None
        return _Ref(s, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


_state = threading.local()


def _active() -> _Record | None:
    return getattr(_state, "record", None)


def _covers(r: _Ref, nbytes: int) -> bool:
    """Whether the view `r` is every byte of its storage, each once."""
    numel = 1
    for n in r.size:
        numel *= n
    if r.offset != 0 or numel * r.dtype.itemsize != nbytes:
        return False
    expected = 1
    for n, st in sorted(((n, st) for n, st in zip(r.size, r.stride) if n != 1), key=lambda x: x[1]):
        if st != expected:
            return False
        expected *= n
    return True


def _where() -> str:
    """The construction code running now: the innermost frame outside torch and shardfn, and the
    module whose method it is (for refusals)."""
    f = sys._getframe(1)
    while f is not None and (f.f_code.co_filename.startswith(_TORCH_DIR) or f.f_code.co_filename.startswith(_OWN_DIR)
                             or f.f_code.co_filename.startswith("<")):
        f = f.f_back
    if f is None:
        return ""
    at = f"{f.f_code.co_filename}:{f.f_lineno}"
    who = f.f_code.co_name
    while f is not None:  # the module whose method runs it (a comprehension's frame has no self)
        owner = f.f_locals.get("self")
        if isinstance(owner, nn.Module):
            who = f"{type(owner).__name__}.{f.f_code.co_name}"
            break
        f = f.f_back
    return f" in {who} ({at})"


def _refuse(what: str) -> NotImplementedError:
    """The refusal to raise; the recording keeps its message, so that a construction that catches
    it (torch's parametrizations catch NotImplementedError) is still refused at replay."""
    message = (f"sf.meta_device() cannot record this construction exactly{_where()}: {what}. Build the module "
               "eagerly, or move this out of the module's construction (Note [meta init] in shardfn/_meta_init.py)")
    rec = _active()
    if rec is not None and rec.refused is None:
        rec.refused = message
    return NotImplementedError(message)


class _Recorder(TorchDispatchMode):
    """Records every operation on meta tensors into a `_Record` (Note [meta init])."""

    def __init__(self, record: _Record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.record
        flat_in = pytree.tree_leaves((args, kwargs))
        meta_in = any(isinstance(x, FakeTensor) or (isinstance(x, torch.Tensor) and x.is_meta) for x in flat_in)
        if kwargs.get("generator") is not None:
            raise _refuse(f"{func} draws from an explicit generator= (only the default CPU generator is replayed)")
        random = torch.Tag.nondeterministic_seeded in func.tags
        if func in (aten.resize_.default, aten.resize_as_.default) and meta_in:
            raise _refuse(f"{func} changes a recorded storage's size")
        # Which arguments the schema says this operation writes (before running it: refs are
        # taken of the inputs as they are now).
        written: list[tuple[torch.Tensor, bool]] = []  # (tensor, overwritten whole without being read)
        name = func._schema.name.split("::")[-1]
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            for t in pytree.tree_leaves(v):
                if isinstance(t, torch.Tensor):
                    written.append((t, (i == 0 and name in _OVERWRITE) or a.name == "out"))
        written_ids = {id(t) for t, _ in written if _}
        if func in _READS_VALUE and meta_in:  # the construction branches on a value: computed for real
            def value(x: Any) -> Any:
                recorded = isinstance(x, torch.Tensor) and (isinstance(x, FakeTensor) or x.is_meta)
                return _evaluate(rec, x, func) if recorded else x

            real_args, real_kwargs = pytree.tree_map(value, (args, kwargs))
            with unset_fake_temporarily():
                return func(*real_args, **real_kwargs)
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise _refuse(f"{func} makes a tensor whose size depends on values") from e
        flat_out = pytree.tree_leaves(out)
        if func in _METADATA_ONLY or not any(isinstance(x, torch.Tensor) for x in flat_out) and not random:
            return out
        for x in flat_out:
            if isinstance(x, torch.Tensor) and (not isinstance(x, FakeTensor) or x.device.type != "cpu"):
                raise _refuse(f"{func} makes a tensor on {x.device} (only CPU tensors are recorded and replayed: "
                              "build on the default device)")
        reads: set[int] = set()

        def template(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if not isinstance(x, FakeTensor) and not x.is_meta:
                with unset_fake_temporarily():  # a real copy, not a fake one (the fake mode is below this one)
                    return _Const(x.detach().clone())
            r = rec.ref(x)
            if id(x) not in written_ids:
                reads.add(r.s)
            return r

        targs, tkwargs = pytree.tree_map(template, (args, kwargs))
        writes: set[int] = set()
        full: set[int] = set()
        for t, whole in written:
            if isinstance(t, FakeTensor) or t.is_meta:
                r = rec.ref(t)
                writes.add(r.s)
                if whole and _covers(r, rec.storages[r.s].nbytes()):
                    full.add(r.s)
        outs: list[_Ref | None] = []
        for x in flat_out:
            if not isinstance(x, torch.Tensor):
                outs.append(None)
                continue
            new = x.untyped_storage()._cdata not in rec.index
            r = rec.ref(x)
            if new:
                rec.created.add(r.s)
                writes.add(r.s)
                full.add(r.s)
            outs.append(r)
        if not writes and not random:
            return out  # a view (or a query): references already say where its values are
        rec.ops.append(_Op(func, targs, tkwargs, outs, reads, writes, full, random, torch.get_default_dtype()))
        return out


# Initializers recorded as one operation each and replayed by calling them for real (Note [meta
# init]): they branch on the values they draw, which fake tensors do not have. Each writes every
# element of its first argument without reading it; patched where torch.nn.init looks them up, so
# calls through any alias of the public function (transformers keeps its own) are seen.
_WHOLE = {"_no_grad_trunc_normal_": "nn.init.trunc_normal_"}


def _record_whole(rec: _Record, fn: Callable, name: str, tensor: torch.Tensor, args: tuple, kwargs: dict) -> None:
    """Appends `fn(tensor, *args, **kwargs)` to the recording as one random operation."""
    if kwargs.get("generator") is not None:
        raise _refuse(f"{name} draws from an explicit generator= (only the default CPU generator is replayed)")
    if any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves((args, kwargs))):
        raise _refuse(f"{name} is given a tensor argument besides the tensor it fills")
    r = rec.ref(tensor)
    full = {r.s} if _covers(r, rec.storages[r.s].nbytes()) else set()
    rec.ops.append(_Op(fn, (r, *args), dict(kwargs), [], set(), {r.s}, full, True, torch.get_default_dtype()))


def _whole_op(rec: _Record, fn: Callable, name: str) -> Callable:
    def run(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _active() is not rec or not isinstance(tensor, FakeTensor):
            return fn(tensor, *args, **kwargs)
        _record_whole(rec, fn, name, tensor, args, kwargs)
        return tensor

    return run


def _deepcopy_fake(rec: _Record, original: Callable) -> Callable:
    """`Tensor.__deepcopy__` inside the block: a recorded tensor's copy is a recorded copy of its
    storage's bytes (one per storage, as an eager deep copy shares one new storage between views)."""

    def deepcopy(self: torch.Tensor, memo: dict) -> torch.Tensor:
        if _active() is not rec or not isinstance(self, FakeTensor):
            return original(self, memo)
        if id(self) in memo:
            return memo[id(self)]
        st = self.untyped_storage()
        key = ("shardfn storage", st._cdata)
        if key not in memo:
            with torch.no_grad():
                memo[key] = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,)).clone().untyped_storage()
        new = torch.empty(0, dtype=self.dtype).set_(memo[key], self.storage_offset(), self.size(), self.stride())
        new.requires_grad_(self.requires_grad)
        for k, v in self.__dict__.items():  # the user's attributes (_is_param, ...), not the fake tensor's own
            if k not in new.__dict__:
                new.__dict__[k] = copy.deepcopy(v, memo)
        memo[id(self)] = new
        return new

    return deepcopy


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """Builds modules on the meta device, recording their construction so it can be replayed exactly.

    Inside the block, tensors are fake CPU tensors (no memory, nothing drawn) and every operation
    on them is recorded; after it, the module holds meta tensors. `step.init(params)` and `sf.shard(params, specs, mesh,
    init=model)` then replay the recording unit by unit and give the parameters and buffers
    exactly the values an eager build of the same code would give, on the CPU, with the CPU
    generator in the state it had when the block began, at any world size (rank 0's state is
    used on every rank). After the block the CPU generator is where the eager build would leave it
    (every recorded draw is made again into scratch tensors at the block's end). Do every change to
    the module (casts, custom init, ties) inside the block, and call `sf.functionalize` after it.
    Constructions that cannot be replayed exactly are refused with `NotImplementedError`
    (Note [meta init] in `shardfn/_meta_init.py`).

    Example:
        >>> torch.manual_seed(0)
        >>> with sf.meta_device():
        ...     model = Model(cfg)
        >>> apply, params = sf.functionalize(model, units=r"blocks\\.\\d+")
        >>> state = step.init(params)  # the values of torch.manual_seed(0); Model(cfg)
    """
    if _active() is not None:
        raise ValueError("sf.meta_device() blocks do not nest: build everything in one block")
    rec = _Record(rng=torch.random.get_rng_state())
    tagged: list[tuple[Any, str]] = []

    def tag(module: nn.Module, name: str, value: Any) -> None:
        module.__dict__["_shardfn_meta_record"] = rec
        tagged.append((weakref.ref(module), name))

    def rng_refused(*args: Any, **kwargs: Any) -> Any:
        raise _refuse("the construction reads or sets the random generator's state (manual_seed, get_rng_state, "
                      "set_rng_state, fork_rng): only draws are recorded")

    from torch.nn.modules import module as _m

    hooks = [
        _m.register_module_parameter_registration_hook(tag),
        _m.register_module_buffer_registration_hook(tag),
        _m.register_module_module_registration_hook(tag),
    ]
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # before patching: it imports torch._dynamo
    patched = [(mod, name, getattr(mod, name)) for mod in (torch, torch.random)
               for name in ("manual_seed", "seed", "get_rng_state", "set_rng_state")]
    for mod, name, _ in patched:
        setattr(mod, name, rng_refused)
    swap = torch.utils.swap_tensors

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        # `module.to(dtype)` swaps fake parameters; the fake mode's converter memo holds weak
        # references to them, which swap_tensors refuses. The memo only caches conversions.
        memo = fake.fake_tensor_converter.meta_converter.tensor_memo
        for k, v in list(memo.items()):
            if v is t1 or v is t2:
                del memo[k]
        swap(t1, t2)

    torch.utils.swap_tensors = swap_tensors
    patched.append((torch.utils, "swap_tensors", swap))
    numpy = torch.Tensor.numpy

    def to_numpy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _active() is rec and isinstance(self, FakeTensor):
            raise _refuse(".numpy() of a recorded tensor (the array would share its memory, which a recording "
                          "has not): read values with .tolist() or .item()")
        return numpy(self, *args, **kwargs)

    patched.append((torch.Tensor, "numpy", numpy))
    torch.Tensor.numpy = to_numpy
    patched.append((torch.Tensor, "__deepcopy__", torch.Tensor.__deepcopy__))
    torch.Tensor.__deepcopy__ = _deepcopy_fake(rec, torch.Tensor.__deepcopy__)
    for attr, public in _WHOLE.items():
        fn = getattr(torch.nn.init, attr)
        patched.append((torch.nn.init, attr, fn))
        setattr(torch.nn.init, attr, _whole_op(rec, fn, public))
    _state.record = rec
    moved = False  # the generator's state changed inside the block (outside the recording)
    try:
        with fake, _Recorder(rec):
            yield
    finally:
        _state.record = None
        rec.open = False
        rec.values.clear()  # values read while recording: the replay computes its own
        for mod, name, fn in patched:
            setattr(mod, name, fn)
        for h in hooks:
            h.remove()
        moved = not torch.equal(torch.random.get_rng_state(), rec.rng)
        if moved:
            rec.problem = "the CPU generator's state changed inside the block (a real draw or a seed outside torch's operations)"
        _to_meta(rec, [(m, name) for mref, name in tagged if (m := mref()) is not None])
    if not moved and rec.refused is None:  # (a caught refusal left the recording incomplete)
        torch.random.set_rng_state(_end_state(rec))  # (not when the block raised: an eager build stops there too)


def _end_state(rec: _Record) -> torch.Tensor:
    """The CPU generator's state after the recorded construction (Note [meta init]): every recorded
    draw made again, into a scratch tensor of its operation's size."""
    order, _ = _plan(rec, set(), draw_all=True)
    return _execute(rec, order, rec.rng, lambda s, storage: None)


def _to_meta(rec: _Record, tagged: list[tuple[nn.Module, str]]) -> None:
    """Replaces the block's fake tensors in its modules by meta tensors that alias as they did."""
    storages: dict[int, Any] = {}
    made: dict[int, torch.Tensor] = {}

    def meta(t: torch.Tensor) -> torch.Tensor:
        if id(t) in made:
            return made[id(t)]
        r = rec.ref(t)
        if r.s not in storages:
            storages[r.s] = torch.empty(rec.storages[r.s].nbytes(), dtype=torch.uint8, device="meta").untyped_storage()
            rec.index[storages[r.s]._cdata] = r.s
            rec.alias.append(storages[r.s])
        m = torch.empty(0, dtype=r.dtype, device="meta").set_(storages[r.s], r.offset, r.size, r.stride)
        if isinstance(t, nn.Parameter):
            m = nn.Parameter(m, requires_grad=t.requires_grad)
        made[id(t)] = m
        return m

    seen: set[int] = set()
    stack = [m for m, _ in tagged]  # and their submodules: a deep copy registers nothing
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        stack.extend(c for c in m._modules.values() if c is not None)
        for d in (m._parameters, m._buffers, m.__dict__):
            for k, v in list(d.items()):
                if isinstance(v, FakeTensor):
                    d[k] = meta(v)
        for k in list(m._parameters) + list(m._buffers):
            t = m._parameters.get(k) if k in m._parameters else m._buffers.get(k)
            if t is not None:
                rec.versions[id(t)] = (weakref.ref(t), t._version)


@dataclass(eq=False)
class Capture:
    """A functionalized meta module's recording and where its parameters are in it."""

    record: _Record | None  # None: built under plain torch.device("meta")
    refs: dict[str, _Ref]  # canonical parameter path -> its recorded tensor
    problem: str | None = None  # why it cannot be replayed, found at functionalize time


def capture(module: nn.Module, params: dict[str, torch.Tensor]) -> Capture | None:
    """What `materialize` needs of a module with meta parameters (called by `functionalize`
    while the module still holds them); None when no parameter is on the meta device."""
    if not any(p.is_meta for p in params.values()):
        return None
    records = {id(r): r for m in module.modules() if (r := m.__dict__.get("_shardfn_meta_record")) is not None}
    if not records:
        return Capture(None, {})
    if len(records) > 1:
        return Capture(None, {}, "parts of it were built in different sf.meta_device() blocks: build it in one")
    rec = next(iter(records.values()))
    if rec.refused is not None:
        return Capture(rec, {}, rec.refused)
    if rec.problem is not None:
        return Capture(rec, {}, rec.problem)
    if rec.open:
        return Capture(None, {}, "it is functionalized inside its sf.meta_device() block: leave the block first")
    refs: dict[str, _Ref] = {}
    for path, p in params.items():
        if not p.is_meta:
            continue
        r = rec.known(p)
        if r is None:
            return Capture(rec, {}, f"parameter {path!r} was not made inside the sf.meta_device() block (e.g. a "
                                    "cast, a new tensor or a deep copy of the module after it): do every change to "
                                    "the module inside the block; for a copy (an EMA), copy.deepcopy the module "
                                    "inside the block, or copy the initialized params")
        seen = rec.versions.get(id(p))
        if seen is not None and seen[0]() is p and seen[1] != p._version:
            return Capture(rec, {}, f"parameter {path!r} was changed after the sf.meta_device() block (an in-place "
                                    "operation outside the recording): do every change to the module inside the block")
        refs[path] = r
    return Capture(rec, refs)


EMPTY = "empty"  # `init=`: meta leaves become uninitialized shards (values do not matter)


def check_init(init: Any, where: str, module: bool = True) -> bool:
    """Whether `init` asks for uninitialized shards (`init="empty"`); refuses other strings, and
    anything else where `module` is False (step.init finds the module itself)."""
    if init is None or isinstance(init, str) and init == EMPTY:
        return init is not None
    if isinstance(init, str) or not module:
        other = " or the meta-device module" if module else " or nothing (the module is found from apply= or the params)"
        got = repr(init) if isinstance(init, str) else f"a {type(init).__name__}"
        raise ValueError(f"{where} takes init={EMPTY!r} (uninitialized shards, where values do not matter){other}; "
                         f"got {got}")
    return False


def empty_shard(leaf: torch.Tensor, mesh: Any, placements: Any) -> Any:
    """A DTensor over an uninitialized local shard of the meta tensor `leaf` (`init="empty"`):
    only this rank's shard is allocated."""
    d = distribute_tensor(leaf.detach(), mesh, placements, src_data_rank=None)  # meta: shapes only
    local = torch.empty_like(d.to_local(), device=mesh.device_type)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=d.shape, stride=d.stride())


# Note [buffers under init="empty"]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `init="empty"` skips the parameters' initializers: their values come later (a checkpoint, an
# import) or do not matter. A buffer is another thing: the ones a module does not save (a rotary
# table's `inv_freq`, a scale registered with `persistent=False`) come back from no checkpoint, so
# an uninitialized one would stay garbage through `sf.load` and train with it, silently. So a
# module built under `sf.meta_device()` gets its meta buffers computed, as an eager build would
# (the replay of the buffers' part of the recording: small, and the same on every rank). A module
# built on plain `torch.device("meta")` has no recording to compute them from: its floating-point
# buffers are filled with NaN and its others with zero, and the model remembers them
# (`ModelInfo.unset_buffers`): `sf.load` and `sf.import_state_dict`, which bring real values for
# the parameters, refuse such a model when one of those buffers is one no checkpoint holds (not in
# its `state_dict`) and nothing has written it since. (NaN alone is not loud enough: Hugging Face's
# Llama with a NaN `inv_freq` computes finite, wrong logits.)
def empty_buffers(module: nn.Module | None, device: Any, info: Any = None) -> None:
    """Makes `module`'s meta buffers real on `device` (`init="empty"`; Note [buffers under
    init="empty"]): computed when `info` (the functionalized model) recorded its construction,
    else NaN (floating point) or zero. A buffer shared by several modules stays one tensor."""
    if module is None:
        return
    if not any(b is not None and b.is_meta for b in module.buffers()):
        return
    cap = getattr(info, "meta_init", None) if info is not None else None
    if cap is not None and cap.record is not None and cap.problem is None and cap.record.refused is None:
        try:
            materialize(info, set(), lambda path, value: None, buffer_device=device)
            return
        except (ValueError, NotImplementedError):
            pass  # a buffer the recording cannot give exactly: NaN, as without a recording
    made: dict[int, torch.Tensor] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        for k, b in m._buffers.items():
            if b is not None and b.is_meta:
                if id(b) not in made:
                    made[id(b)] = torch.full_like(b, float("nan") if b.is_floating_point() or b.is_complex() else 0, device=device)
                m._buffers[k] = t = made[id(b)]
                if info is not None:
                    info.unset_buffers[f"{name}.{k}" if name else k] = (weakref.ref(t), t._version)


def refuse_unset_buffers(info: Any, where: str) -> None:
    """Refuses (before anything is read) a model with buffers `init="empty"` left unset that no
    checkpoint holds (Note [buffers under init="empty"])."""
    if info is None or not info.unset_buffers:
        return
    saved = set(info.module.state_dict(keep_vars=True))
    unset = []
    for name, (ref, version) in list(info.unset_buffers.items()):
        t = ref()
        if t is None or t._version != version:  # gone, or written since
            del info.unset_buffers[name]
        elif name not in saved:
            unset.append(name)
    if unset:
        raise ValueError(
            f"{where}: the model's buffers {unset[:5]} hold no values: init=\"empty\" could not compute them (the module "
            "was built on plain torch.device(\"meta\"), with no recording of its construction), and no checkpoint holds "
            "them (the module does not save them: persistent=False, as a rotary table's inv_freq). Build the module "
            "under `with sf.meta_device():` (init=\"empty\" then computes its buffers, still leaving the parameters "
            "uninitialized), or set these buffers yourself before loading (Note [buffers under init=\"empty\"] in "
            "shardfn/_meta_init.py)"
        )


def _rng_state(rec: _Record) -> torch.Tensor:
    state = rec.rng
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        state = C.broadcast_object(state, "meta-device init")
        if rec.random_reads and not torch.equal(state, rec.rng):
            raise ValueError(
                f"rank {dist.get_rank()} began its sf.meta_device() block with another CPU generator state than rank 0, "
                "and the construction read a drawn value (`.item()`, `if t.any()`): its recording may branch otherwise "
                "than rank 0's. Seed every rank alike (torch.manual_seed(seed) on each) before the block"
            )
    return state


def _plan(rec: _Record, targets: set[int], draw_all: bool = False) -> tuple[list[tuple[int, str]], list[int]]:
    """Which operations run, and how (Note [meta init]): [(op index, "run" | "rng")] in order,
    and the uninitialized (torch.empty) storages some target depends on. `draw_all`: every random
    operation draws (the generator's end state), whatever reads outside the block give."""
    needed = set(targets)
    kind: dict[int, str] = {}
    garbage: list[int] = []
    drawing = draw_all  # a later random operation runs: draws before it must happen
    for i in range(len(rec.ops) - 1, -1, -1):
        op = rec.ops[i]
        if op.writes & needed:
            kind[i] = "run"
            drawing = drawing or op.random
            if op.func in _UNINITIALIZED:
                garbage.extend(op.writes & needed)
            needed -= op.full
            needed |= op.reads
        elif op.random and drawing:  # (draws after the last random operation that runs are skipped)
            kind[i] = "rng"
            needed |= op.reads - op.writes
    foreign = needed - rec.created
    if foreign and not draw_all:
        raise ValueError(
            "the meta-device module's values depend on a meta tensor made outside its sf.meta_device() block "
            "(its values were never recorded): create every tensor the module uses inside the block"
        )
    # An operation that draws nothing runs as early as what it touches allows: after the last write
    # of each storage it reads or writes, and after the last read of each it writes. A cast at the
    # end of __init__, or a change to part of a weight after every layer is built, would otherwise
    # keep earlier storages alive until then. One that makes new storages from nothing (a constant)
    # runs right before its first user. Draws keep their order (the generator's).
    last_write: dict[int, tuple] = {}
    last_read: dict[int, tuple] = {}
    pending: dict[int, int] = {}  # storage -> the operation from nothing that makes it, not placed yet
    keyed: list[tuple[tuple, int, str]] = []
    for i in sorted(kind):
        op = rec.ops[i]
        run = kind[i] == "run"
        fresh = not (op.writes & (last_write.keys() | last_read.keys() | pending.keys()))
        if run and not op.random and not op.reads and fresh:
            for s in op.writes:
                pending[s] = i
            continue
        after = [last_write[s] for s in op.reads | op.writes if s in last_write]
        after += [last_read[s] for s in op.writes if s in last_read]
        key = max(after) + (i,) if run and not op.random and after else (i,)
        for c in sorted({pending[s] for s in op.reads | op.writes if s in pending}):
            made = key[:-1] + (c,) if len(key) > 1 else (c,)
            keyed.append((made, c, "run"))
            for s in rec.ops[c].writes:
                pending.pop(s, None)
                last_write[s] = made
        keyed.append((key, i, kind[i]))
        for s in (op.reads if run else op.reads - op.writes):
            last_read[s] = max(last_read.get(s, key), key)
        if run:
            for s in op.writes:
                last_write[s] = key
    keyed.extend(((c,), c, "run") for c in sorted(set(pending.values())))
    keyed.sort(key=lambda x: x[0])
    return [(i, k) for _, i, k in keyed], garbage


def _view(storage: Any, r: _Ref) -> torch.Tensor:
    return torch.empty(0, dtype=r.dtype).set_(storage, r.offset, r.size, r.stride)


def _extent(r: _Ref) -> int:
    if any(n == 0 for n in r.size):
        return 0
    return (r.offset + sum((n - 1) * st for n, st in zip(r.size, r.stride)) + 1) * r.dtype.itemsize


def _execute(rec: _Record, order: list[tuple[int, str]], rng: torch.Tensor,
             done: Callable[[int, Any], None]) -> torch.Tensor:
    """Runs the planned operations (`_plan`) from generator state `rng`, on real CPU storages;
    `done(s, storage)` when storage `s` is used for the last time, then drops it. Returns the
    generator's state after the last operation (the default generator is left as it was)."""
    last: dict[int, int] = {}
    for pos, (i, k) in enumerate(order):
        op = rec.ops[i]
        for s in op.reads | (op.writes if k == "run" else set()):
            last[s] = pos
    real: dict[int, Any] = {}
    gen = torch.default_generator  # not torch.random's functions: they are refused inside the block
    saved = gen.get_state()
    default = torch.get_default_dtype()
    try:
        with torch.no_grad():
            gen.set_state(rng)
            for pos, (i, k) in enumerate(order):
                op = rec.ops[i]
                torch.set_default_dtype(op.dtype)

                def arg(x: Any) -> Any:
                    if isinstance(x, _Const):
                        return x.value.clone()  # an operation may return it or write it
                    if isinstance(x, _Ref):
                        if k == "rng" and x.s in op.writes:
                            return _view(torch.UntypedStorage(_extent(x)), x)  # scratch: only the draws matter
                        if x.s not in real:
                            real[x.s] = torch.UntypedStorage(rec.storages[x.s].nbytes())
                        return _view(real[x.s], x)
                    return _to_cpu(x)

                args, kwargs = pytree.tree_map(arg, (op.args, op.kwargs))
                out = op.func(*args, **kwargs)
                if k == "run":
                    for r, t in zip(op.outs, pytree.tree_leaves(out)):
                        if r is None or r.s in real:
                            continue
                        if (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype) == (r.size, r.stride, r.offset, r.dtype) \
                                and t.untyped_storage().nbytes() == rec.storages[r.s].nbytes():
                            real[r.s] = t.untyped_storage()
                        else:  # laid out otherwise than the meta kernel said: copy into the recorded layout
                            real[r.s] = torch.UntypedStorage(rec.storages[r.s].nbytes())
                            _view(real[r.s], r).copy_(t)
                del out, args, kwargs
                for s in [s for s in op.reads | op.writes if last.get(s) == pos]:
                    done(s, real[s])
                    real.pop(s, None)
        return gen.get_state()
    finally:
        gen.set_state(saved)
        torch.set_default_dtype(default)


def _evaluate(rec: _Record, x: torch.Tensor, func: Any) -> torch.Tensor:
    """The real value of the recorded tensor `x` now, for an operation that reads it into Python
    (Note [meta init]): what the recording so far computes for its storage, kept until an
    operation writes the storage again."""
    r = rec.ref(x)
    cached = rec.values.get(r.s)
    if cached is None or any(r.s in op.writes for op in rec.ops[cached[1]:]):
        try:
            order, garbage = _plan(rec, {r.s})
        except ValueError as e:
            raise _refuse(f"{func} reads the value of a tensor made outside the block, never recorded") from e
        if garbage:
            raise _refuse(f"{func} reads uninitialized memory (torch.empty that no recorded operation set)")
        if any(k == "run" and rec.ops[i].random for i, k in order):
            rec.random_reads = True
        got: dict[int, Any] = {}

        def done(s: int, storage: Any) -> None:
            if s == r.s:
                got[s] = storage

        with unset_fake_temporarily():
            _execute(rec, order, rec.rng, done)
        cached = rec.values[r.s] = (got[r.s], len(rec.ops))
    with unset_fake_temporarily():
        return _view(cached[0], r)


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    return x


def materialize(info: Any, wanted: set[str], emit: Callable[[str, torch.Tensor], None], buffer_device: Any = "cpu") -> None:
    """Replays the construction of `info.module` (Note [meta init]), calling `emit(canonical path,
    full CPU value)` once per wanted parameter, then dropping the value. Meta buffers are made real
    on `buffer_device` and stay the module's.

    Raises:
        ValueError: the module was not built under `sf.meta_device()`, or changed after it.
        NotImplementedError: the recording cannot give a value exactly.
    """
    module = info.module
    cap: Capture | None = info.meta_init
    if cap is not None and cap.record is not None and cap.record.refused is not None:
        raise NotImplementedError(
            f"{cap.record.refused} (raised while the meta-device {type(module).__name__} was built, and caught by "
            "its construction code, so the recording is incomplete)"
        )
    if cap is None or cap.record is None or cap.problem is not None:
        why = cap.problem if cap is not None and cap.problem else (
            "it was built on the meta device without a recording of its construction (plain torch.device(\"meta\"))")
        raise ValueError(
            f"cannot give the meta-device {type(module).__name__} the values an eager build would have: {why}. "
            "Build it under `with sf.meta_device(): model = Model(...)` (the construction is recorded and replayed "
            "exactly; Note [meta init] in shardfn/_meta_init.py), or, where values do not matter (memory estimates, "
            "simulation), pass init=\"empty\" (step.init(params, init=\"empty\"), sf.shard(..., init=\"empty\")) "
            "for uninitialized shards"
        )
    rec = cap.record
    if _active() is not None:
        raise ValueError("initialize meta-device modules after the sf.meta_device() block, not inside it")
    missing = sorted(p for p in wanted if p not in cap.refs)
    if missing:
        raise ValueError(f"parameters {missing[:5]} are not recorded in the module's sf.meta_device() block")
    buffers: list[tuple[nn.Module, str, str, _Ref]] = []
    for mname, m in module.named_modules(remove_duplicate=False):
        for local, b in m._buffers.items():
            if b is None or not b.is_meta:
                continue
            r = rec.known(b)
            path = f"{mname}.{local}" if mname else local
            if r is None:
                raise ValueError(f"buffer {path!r} of the meta-device module was not made inside its sf.meta_device() "
                                 "block: do every change to the module inside the block")
            seen = rec.versions.get(id(b))
            if seen is not None and seen[0]() is b and seen[1] != b._version:
                raise ValueError(f"buffer {path!r} was changed after the sf.meta_device() block: do every change "
                                 "to the module inside the block")
            buffers.append((m, local, path, r))
    params = {p: cap.refs[p] for p in wanted}
    by_storage: dict[int, list[tuple[str, Any]]] = {}
    for path, r in params.items():
        by_storage.setdefault(r.s, []).append(("param", path, r))
    for m, local, path, r in buffers:
        by_storage.setdefault(r.s, []).append(("buffer", (m, local, path), r))
    order, garbage = _plan(rec, set(by_storage))
    if garbage:
        names = [x[1] if x[0] == "param" else x[1][2] for s in garbage for x in by_storage.get(s, [])]
        raise NotImplementedError(
            f"{names[:5] or 'a value the module uses'} would hold uninitialized memory (torch.empty that no "
            "recorded operation sets): an eager build gives garbage there, which cannot be reproduced. Initialize "
            "it in the construction (Note [meta init] in shardfn/_meta_init.py)"
        )
    made: dict[tuple, torch.Tensor] = {}

    def done(s: int, storage: Any) -> None:
        for what, who, r in by_storage.get(s, []):
            if what == "param":
                emit(who, _view(storage, r))
            else:
                key = (s, r)
                if key not in made:
                    made[key] = _view(storage, r).clone().to(buffer_device)
                m, local, _ = who
                m._buffers[local] = made[key]

    _execute(rec, order, _rng_state(rec), done)
