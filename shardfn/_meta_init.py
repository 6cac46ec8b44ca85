"""Big-model init: the parameters of a module built on the meta device, made real unit by unit.

Note [meta init]
----------------
`with torch.device("meta"): model = Model(cfg)` builds the module without memory and without
drawing a random number. `step.init(params)` and `sf.shard(params, specs, mesh, init=model)` then
give every parameter the value an eager build (`torch.manual_seed(s); Model(cfg)` on the CPU, in
one process) would have given it, holding only this rank's shards plus one module's parameters.

The values of an eager build come from the initializers it ran, in the order it ran them, on the
global CPU random generator. What can be replayed is what the module exposes:

1. Construction: every submodule that owns parameters or buffers and has `reset_parameters()`
   (every torch layer calls it at the end of its `__init__`) is initialized by it, children
   before parents (`__init__` builds children first), siblings in registration order, which is
   construction order for ordinary code (`self.a = A(); self.b = B()`).
2. Hugging Face models (`transformers.PreTrainedModel`, each nested one included) then run their
   `post_init()` as at the end of their own `__init__`: `_init_weights` over their submodules,
   children first, skipping modules an inner model already initialized (`initialize_weights`'
   `smart_apply`).

Every rank replays this whole sequence from the same generator state (the CPU generator's state
when `functionalize` saw the meta module, taken from rank 0), one module at a time: the module's
own parameters get fresh full CPU tensors, its initializer runs, and a parameter's value is kept
(its shard copied out, the full tensor dropped) at the last step that initializes it. Earlier
steps run on scratch tensors: only their draws from the generator matter, which depend on sizes
and not on values. A name tied to an earlier one (`lm_head.weight` to the embedding) gets scratch
tensors too: eager code ties after construction, so the head's own initializers drew numbers for
a tensor that was then replaced. Memory: this rank's shards plus one module's full parameters;
time: every rank draws the whole model's random numbers.

So the values equal an eager build's exactly, at any world size, for modules that follow these
conventions. What cannot be replayed is refused rather than guessed: a parameter or buffer that
no step initializes (a module without `reset_parameters`, e.g. an `nn.Parameter(torch.randn(..))`
or a buffer computed in `__init__`; a model that re-initializes itself with its own
`self.apply(fn)`), and a final step that leaves some values unset (they would need an earlier
step's values). Numbers drawn in an `__init__` outside `reset_parameters` (Hugging Face GPT-2's
`Conv1D`) are drawn eagerly but cannot be replayed: values then differ from an eager build.
Buffers are materialized on the mesh's device and stay the module's (replicated, as eager).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from . import _watch

__all__ = ["materialize", "has_meta", "record_rng"]


def has_meta(leaves: list[Any]) -> bool:
    return any(isinstance(x, torch.Tensor) and x.is_meta for x in leaves)


def record_rng(module: nn.Module) -> torch.Tensor | None:
    """The CPU generator's state, when `module` has meta parameters (their init replays from it)."""
    if any(p.is_meta for p in module.parameters()):
        return torch.random.get_rng_state()
    return None


def _pretrained_class() -> type | None:
    tf = sys.modules.get("transformers")
    return getattr(tf, "PreTrainedModel", None) if tf is not None else None


def _owns(m: nn.Module) -> bool:
    return any(p is not None for p in m._parameters.values()) or any(b is not None for b in m._buffers.values())


def _steps(root: nn.Module) -> list[tuple[nn.Module, Callable[[nn.Module], None]]]:
    """(module, initializer) in the order an eager build runs them (Note [meta init])."""
    hf = _pretrained_class()
    steps: list[tuple[nn.Module, Callable]] = []
    seen: set[int] = set()
    hf_done: set[int] = set()

    def reset(m: nn.Module) -> None:
        m.reset_parameters()

    def post_init(model: nn.Module) -> None:  # smart_apply(model._initialize_weights), children first
        def visit(m: nn.Module, owner: nn.Module) -> None:
            for child in m.children():
                visit(child, child if isinstance(child, hf) else owner)
            if id(m) not in hf_done:
                hf_done.add(id(m))
                steps.append((m, owner._init_weights))

        visit(model, model)

    def build(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            build(child)
        if _owns(m) and callable(getattr(m, "reset_parameters", None)):
            steps.append((m, reset))
        if hf is not None and isinstance(m, hf):
            post_init(m)

    build(root)
    return steps


def _rng_state(info: Any) -> torch.Tensor:
    state = info.init_rng if info.init_rng is not None else torch.random.get_rng_state()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [state]
        with _watch.watched("meta-device init"), _watch.waiting():
            dist.broadcast_object_list(box, src=0)
        state = box[0]
    return state


def materialize(info: Any, wanted: set[str], emit: Callable[[str, torch.Tensor], None], buffer_device: Any = "cpu") -> None:
    """Initializes every meta parameter of `info.module` as an eager build would (Note [meta
    init]), calling `emit(canonical path, full CPU value)` once per parameter, then dropping it.
    Meta buffers are made real on `buffer_device` and stay the module's.

    Raises:
        NotImplementedError: a parameter or buffer that no replayable initializer sets.
    """
    module = info.module
    canonical = {name: path for path, names in info.aliases.items() for name in names}
    names_of: dict[int, str] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        names_of.setdefault(id(m), name)
    steps = _steps(module)

    def pname(m: nn.Module, local: str) -> str:
        prefix = names_of[id(m)]
        return f"{prefix}.{local}" if prefix else local

    last: dict[str, int] = {}
    for k, (m, _) in enumerate(steps):
        for local, p in m._parameters.items():
            if p is not None and pname(m, local) in canonical and canonical[pname(m, local)] == pname(m, local):
                last[pname(m, local)] = k
    touched: dict[str, int] = {}
    buffers_set: dict[int, tuple[str, torch.Tensor, int]] = {}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.random.set_rng_state(_rng_state(info))
        for k, (m, init) in enumerate(steps):
            saved = dict(m._parameters)
            fresh: dict[str, torch.Tensor] = {}
            for local, p in saved.items():
                if p is None:
                    continue
                t = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"), requires_grad=False)
                name = pname(m, local)
                if last.get(name) == k and name in wanted and touched.get(name, 0) and t.is_floating_point():
                    t.fill_(float("nan"))  # an earlier step's values are gone: this one must set all
                fresh[local] = t
                m._parameters[local] = t
            for local, b in list(m._buffers.items()):
                if b is not None and b.is_meta:
                    real = torch.empty(b.shape, dtype=b.dtype, device=buffer_device)
                    m._buffers[local] = real
                    buffers_set[id(real)] = (pname(m, local), real, real._version)
            versions = {local: t._version for local, t in fresh.items()}
            try:
                init(m)
            finally:
                m._parameters.update(saved)
            for local, t in fresh.items():
                name = pname(m, local)
                if name not in wanted or canonical.get(name) != name:
                    continue
                wrote = t._version != versions[local]
                touched[name] = touched.get(name, 0) + wrote
                if last[name] != k:
                    continue
                if not wrote:
                    raise NotImplementedError(_unset(name, m, "its last initializer leaves it as it is"))
                if t.is_floating_point() and torch.isnan(t).any() and touched[name] > 1:
                    raise NotImplementedError(_unset(name, m, "its last initializer sets only part of it"))
                emit(name, t.detach())
            del fresh
    never = sorted(p for p in wanted if p not in last)
    if never:
        owner = module.get_submodule(never[0].rpartition(".")[0]) if "." in never[0] else module
        raise NotImplementedError(_unset(never[0], owner, "no initializer of the module sets it") + f" ({len(never)} such parameters: {never[:5]})")
    unset_buffers = [n for n, b in module.named_buffers(remove_duplicate=False) if b.is_meta]
    unset_buffers += [n for n, b, v in buffers_set.values() if b._version == v]
    if unset_buffers:
        raise NotImplementedError(
            f"the buffers {sorted(set(unset_buffers))[:5]} of the meta-device module are set by no initializer "
            "(a buffer computed in __init__ is lost on the meta device): build the module eagerly, or give the "
            "module that owns them a reset_parameters() that sets them (Note [meta init] in shardfn/_meta_init.py)"
        )


def _unset(name: str, m: nn.Module, why: str) -> str:
    return (
        f"parameter {name!r} ({type(m).__name__}) of the meta-device module cannot be initialized as an eager build "
        f"would: {why}. Meta-device init replays each submodule's reset_parameters() and Hugging Face's "
        "_init_weights (Note [meta init] in shardfn/_meta_init.py): give that module a reset_parameters() that sets "
        "all of its own parameters, or build the module eagerly"
    )
