"""Per-example gradients of a sharded model: their norms, DP-SGD, and the gradients themselves.

Note [per-example gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
`loss_fn(params, example)` is the loss of one example (no batch dim, as in torch.func's per-sample
recipe); the transforms vmap it over dim 0 of every leaf of this rank's batch. A rank computes the
per-example gradients of its own examples, from full values of the parameters, so an example's
gradient norm is its norm over all shards without any further communication.

The per-example gradients of a leaf exist only inside that leaf's backward. Each trained leaf
reaches `loss_fn` through `_Probe`, a gather whose gradient goes to a scalar probe instead of the
leaf: its backward receives the leaf's gradients of the whole local batch at once (under
`vmap(grad(...))`, one row per example) and returns their squared norms as the probe's gradient.
A rank so holds the per-example gradients of about one leaf at a time (the leaves of one unit at
most, when autograd finishes them together), never those of the whole model. A tied leaf reaches
the model once, so its gradient sums every use before the probe sees it.

DP-SGD needs an example's whole norm before its gradient can be clipped, and the norm is known
only when every leaf's backward has run: two passes. The first computes the norms (above); the
second is one ordinary backward of `sum_i c_i * loss_i / B` through `sf.gather` (whose gradient is
the reduce-scatter of the mean over ranks, so each rank's sum is weighted by the world size), with
`c_i = min(1, C / (norm_i + 1e-6))` as Opacus clips: the clipped sum without any per-example
gradient. Noise `sigma * C * N(0, I)` is drawn leaf by leaf, in the tree's leaf order, at
each leaf's full shape, from `torch.Generator().manual_seed(seed)` on the CPU; each rank keeps its
shard of it, so every rank agrees, and a single process with the same seed draws the same noise.
The result is `(sum_i clip(g_i) + noise) / B` for the global batch of `B` examples.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable

import optree
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from . import _collectives as C
from . import _runtime, _watch
from ._models import unit_of_module
from ._functorch import under_grad_transform
from ._mesh import mesh_group
from ._shard import gather
from ._core import _rng_state, _set_rng_state, model_info, trained_leaves
from ._tree import compile_patterns, tree_flatten_with_paths

__all__ = ["per_sample_grad_norms", "per_sample_grads", "dp_value_and_grad", "DPValueAndGrad"]

_CLIP_EPS = 1e-6


class _Acc:
    """One trained leaf's per-example gradients while the backward runs, until they are reduced
    to squared norms (Note [per-example gradients])."""

    __slots__ = ("pending", "total", "hold", "reduced", "direct", "dtype")

    def __init__(self, hold: bool, dtype: torch.dtype):
        self.dtype = dtype  # the norms' dtype
        self.pending = 0  # relays whose backward has not run
        self.total: Any = None  # the sum of what arrived, batched over the examples
        self.hold = hold  # reduce only at the probe (the leaf is also read outside its units)
        self.reduced = False
        self.direct = False  # a gradient reached the probe after the relays had reduced

    def add(self, grad: torch.Tensor) -> None:
        grad = grad.detach()
        self.total = grad if self.total is None else self.total + grad

    def take(self) -> torch.Tensor:
        # Detached (above): torch.func.grad records the backward (create_graph), and a squared norm
        # would save its input, the per-example gradients, until the transform returns.
        sq = self.total.to(self.dtype).pow(2).sum()
        self.total, self.reduced = None, True
        return sq


def _keep_acc(ctx, inputs: tuple, output: Any) -> None:
    """`setup_context` of `_Probe` and `_Relay` (inputs: probe, leaf, acc): no gradient arriving
    stays None, so a leaf that no unit used needs no zeros."""
    ctx.acc = inputs[2]
    ctx.set_materialize_grads(False)


class _Probe(torch.autograd.Function):
    """A leaf gathered to its full value; its gradient goes to a scalar probe, as the squared norm
    of the leaf's whole gradient (per example, under vmap)."""

    @staticmethod
    def forward(probe: torch.Tensor, x: Any, acc: _Acc) -> torch.Tensor:  # type: ignore[override]
        with torch._C._DisableFuncTorch():
            return C.full_tensor(x, "a per-sample gradient") if isinstance(x, DTensor) else x.detach().clone()

    setup_context = staticmethod(_keep_acc)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None) -> Any:  # type: ignore[override]
        acc = ctx.acc
        if grad is not None:
            if acc.reduced:  # read outside its units too: the pass runs again, holding this leaf
                acc.direct = True
                return None, None, None
            acc.add(grad)
        if acc.total is None:
            return None, None, None
        return acc.take(), None, None

    @staticmethod
    def vmap(info, in_dims, probe, x, acc):  # type: ignore[override]
        if any(d is not None for d in in_dims):
            raise NotImplementedError("per-example gradients of a tree batched by vmap are not supported")
        return _Probe.apply(probe, x, acc), None


class _Relay(torch.autograd.Function):
    """Identity on a leaf for one forward of a unit that uses it. Made when the unit starts, its
    backward runs as soon as the unit's is done (autograd runs later-made nodes first), so the
    leaf's per-example gradients are reduced then rather than at the end of the whole backward."""

    generate_vmap_rule = True

    @staticmethod
    def forward(probe: torch.Tensor, full: torch.Tensor, acc: _Acc) -> torch.Tensor:  # type: ignore[override]
        return full

    setup_context = staticmethod(_keep_acc)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None) -> Any:  # type: ignore[override]
        acc = ctx.acc
        acc.pending -= 1
        if grad is not None:
            acc.add(grad)
        if acc.pending == 0 and not acc.hold and acc.total is not None:
            return acc.take(), None, None
        return None, None, None


class _Relays(_runtime.RuntimeDefaults):
    """The unit runtime of the norms pass: while a unit runs, the module computes on relays of its
    leaves; elsewhere (outside every unit's forward, in `loss_fn` itself) on the gathered leaves."""

    def __init__(self, info: Any, paths: list[str], stand: list, probes: dict, accs: dict):
        self.info, self.stand, self.probes, self.accs = info, stand, probes, accs
        self.swaps: dict[int, list[tuple[torch.nn.Module, str, int]]] = {}
        index = {p: k for k, p in enumerate(paths)}
        module = info.module
        for path in info.param_paths:
            k = index[path]
            if k not in accs:
                continue
            for name in info.aliases[path]:
                owner, _, attr = name.rpartition(".")
                u = unit_of_module(owner, info.unit_names)
                if u >= 0:
                    self.swaps.setdefault(u, []).append((module.get_submodule(owner), attr, k))

    def pre_forward(self, info: Any, u: int, args: Any, kwargs: dict) -> None:
        if info is self.info:
            for mod, attr, k in self.swaps.get(u, ()):
                if mod._parameters.get(attr) is self.stand[k]:
                    self.accs[k].pending += 1
                    mod._parameters[attr] = _Relay.apply(self.probes[k], self.stand[k], self.accs[k])
        return None

    def post_forward(self, info: Any, u: int, output: Any) -> None:
        if info is self.info:
            for mod, attr, k in self.swaps.get(u, ()):
                if mod._parameters.get(attr) is not self.stand[k]:
                    mod._parameters[attr] = self.stand[k]
        return None


def _check_loss_fn(loss_fn: Any, who: str) -> None:
    if not callable(loss_fn):
        raise ValueError(f"{who}(loss_fn): loss_fn must be callable, got {type(loss_fn).__name__}")


def _one_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            "loss_fn(params, example) must return the loss of one example, a tensor with one element; got "
            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}"
        )
    return loss.reshape(())


def _batch_size(batch: Any, who: str) -> int:
    leaves = [x for x in optree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    sizes = {x.shape[0] if x.dim() else None for x in leaves}
    if not leaves or None in sizes or len(sizes) != 1:
        shapes = [tuple(x.shape) for x in leaves][:4]
        raise ValueError(
            f"{who}: every tensor of the batch needs the same leading dim, the examples (loss_fn sees one example "
            f"at a time, without it); got shapes {shapes}"
        )
    return sizes.pop()


class _Model:
    """What the per-example passes need of a tree: its leaves, which are trained, its mesh."""

    def __init__(self, params: Any, apply: Any, frozen: list, who: str):
        self.paths, self.leaves, self.treespec = tree_flatten_with_paths(params)
        if not self.paths:
            raise ValueError(f"{who}: params is an empty tree")
        if under_grad_transform(self.leaves):
            raise NotImplementedError(
                f"{who} inside a torch.func gradient transform over params: its result is not differentiable (the "
                "per-example gradients are reduced as they are computed), so the outer gradient would be zero"
            )
        self.info = model_info(apply, self.paths, self.leaves)
        self.trained = trained_leaves(self.info, self.paths, frozen)
        if not any(self.trained):
            raise ValueError(f"{who}: every leaf is frozen, so there is no gradient to take")
        meshes = {x.device_mesh for x in self.leaves if isinstance(x, DTensor)}
        if len(meshes) > 1:
            raise ValueError(f"{who}: the tree's DTensors are on {len(meshes)} meshes; use one mesh per tree")
        self.mesh = meshes.pop() if meshes else None
        world = dist.get_world_size() if dist.is_initialized() else 1
        if self.mesh is None and world > 1:
            raise ValueError(
                f"{who}: params hold no DTensor, but {world} ranks run: shard the tree (sf.shard) so that the "
                "transform knows the mesh, or call it on one rank"
            )

    def group(self):
        return None if self.mesh is None else mesh_group(self.mesh)

    def world(self) -> int:
        return 1 if self.mesh is None else self.mesh.size()


def _refuse_empty(model: _Model, n: int, who: str) -> None:
    """A `ValueError` on every rank, before any other collective, if a rank has no example: a vmap
    over none fails inside torch's backward on that rank alone, while the others would wait for it."""
    world = model.world()
    empty = torch.zeros(world, dtype=torch.int32, device=model.mesh.device_type if model.mesh is not None else "cpu")
    if n == 0:
        empty[dist.get_rank(model.group()) if world > 1 else 0] = 1
    if world > 1:
        C.all_reduce_blocking(empty, model.group(), who)
    ranks = empty.nonzero().flatten().tolist()
    if ranks:
        raise ValueError(
            f"{who}: rank(s) {ranks} of the mesh pass no example; every rank needs at least one (drop or re-split a "
            "last global batch smaller than the world; the train step takes empty shares, the per-example transforms do not)"
        )


def _per_example(
    model: _Model, loss_fn: Callable, batch: Any, randomness: str, hold: set, rng: tuple | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, squared gradient norms) of this rank's examples, one unit's per-example gradients at
    a time (Note [per-example gradients]). `hold`: the leaves seen read outside their units, whose
    gradients are reduced only at the end; grown (and the pass run again) when one is found."""
    from torch.func import grad, vmap

    trained = [k for k, t in enumerate(model.trained) if t]
    # Norms in float32, or float64 for a float64 model.
    dtype = torch.promote_types(max((model.leaves[k].dtype for k in trained), key=lambda d: d.itemsize), torch.float32)
    if rng is None:
        rng = _rng_state(model.mesh.device_type if model.mesh is not None else "cpu")
    for attempt in range(2):
        if attempt:
            _set_rng_state(rng)  # the pass again, with the same random draws
        accs = {k: _Acc(k in hold or model.info is None, dtype) for k in trained}

        def one(probes: list, example: Any) -> tuple[torch.Tensor, torch.Tensor]:
            probe_of = dict(zip(trained, probes))
            stand = [_Probe.apply(probe_of[k], x, accs[k]) if k in accs else gather(x).detach() for k, x in enumerate(model.leaves)]
            tree = optree.tree_unflatten(model.treespec, stand)
            if model.info is None:
                loss = _one_loss(loss_fn(tree, example))
            else:
                with _runtime.activate(_Relays(model.info, model.paths, stand, probe_of, accs)):
                    loss = _one_loss(loss_fn(tree, example))
            return loss, loss.detach()

        probes = [torch.zeros((), dtype=dtype) for _ in trained]
        sq, losses = vmap(grad(one, has_aux=True), in_dims=(None, 0), randomness=randomness)(probes, batch)
        found = {k for k, a in accs.items() if a.direct}
        if not found:
            return losses, torch.stack(sq).sum(0)
        hold |= found
    raise AssertionError("unreachable: a second pass holds every leaf read outside its units")


def per_sample_grad_norms(
    loss_fn: Callable[[Any, Any], torch.Tensor], *, apply: Any = None, frozen: Any = None, randomness: str = "error"
) -> Callable[[Any, Any], torch.Tensor]:
    """The gradient norm of each example of this rank's batch, over all shards of the model.

    A rank never holds the per-example gradients of the whole model: those of one leaf at a time
    (Note [per-example gradients] in `shardfn/_per_sample.py`). It holds the parameters in full
    while it runs (as `sf.gather` would).

    Args:
        loss_fn: `loss_fn(params, example) -> loss` of one example; it is vmapped over dim 0 of
            every leaf of the batch (torch.func's recipe: a model that wants a batch dim gets
            `x[None]`).
        apply: the `sf.functionalize` function `loss_fn` calls, when several models share the
            parameter names (as in `value_and_grad`).
        frozen: regexes over dotted names of leaves that are not trained (as in `train_step`);
            `requires_grad=False` on a module's parameter freezes it too. Frozen leaves have no
            gradient and count in no norm.
        randomness: torch.func.vmap's `randomness` ("error", "different", "same") for dropout
            and other random ops inside `loss_fn`. A model whose forward branches on tensor values
            (`.item()`, as Hugging Face BERT's attention-mask code) cannot be vmapped; torch.func
            says so.

    Returns:
        `fn(params, batch) -> norms`: a float32 tensor with one norm per example of this rank's
        batch. `params` is a sharded tree (or a full one on a single process).

    Example:
        >>> def loss_fn(params, example):
        ...     x, y = example
        ...     return F.cross_entropy(apply(params, x[None]), y[None])
        >>> norms = sf.per_sample_grad_norms(loss_fn)(sharded, (x, y))   # shape [len(x)]
    """
    _check_loss_fn(loss_fn, "sf.per_sample_grad_norms")
    frozen_rx = compile_patterns(frozen, "frozen", "dotted parameter names")
    hold: set = set()  # leaves read outside their units, learnt on the first call

    def fn(params: Any, batch: Any) -> torch.Tensor:
        with _watch.watched("sf.per_sample_grad_norms"):
            n = _batch_size(batch, "sf.per_sample_grad_norms")
            model = _Model(params, apply, frozen_rx, "sf.per_sample_grad_norms")
            _refuse_empty(model, n, "sf.per_sample_grad_norms")
            _, sq = _per_example(model, loss_fn, batch, randomness, hold)
            return sq.sqrt()

    return fn


def per_sample_grads(
    loss_fn: Callable[[Any, Any], torch.Tensor], *, apply: Any = None, frozen: Any = None, randomness: str = "error"
) -> Callable[[Any, Any], Any]:
    """The gradient of each example of the global batch, sharded along the examples as the batch is.

    Each rank passes its own examples (the same number on every rank) and holds their gradients in
    full: leaf `p` of shape `S` becomes a DTensor of shape `[B, *S]`, `B` the global batch, split
    over every mesh axis along dim 0 (rank-major, as the ranks' batches concatenate). That is the
    output itself: `B / world` times the model per rank. For norms and DP-SGD, which need none of
    it at once, use `per_sample_grad_norms` and `dp_value_and_grad`.

    Args:
        loss_fn, apply, frozen, randomness: as in `per_sample_grad_norms`.

    Returns:
        `fn(params, batch) -> grads`, a tree like `params` (None at frozen leaves). On a single
        process with a full tree, plain tensors `[B, *S]`, as `vmap(grad(loss_fn))` gives.

    Example:
        >>> g = sf.per_sample_grads(loss_fn)(sharded, batch)
        >>> g["fc"]["weight"].to_local()[i]     # example i of this rank, whole
    """
    _check_loss_fn(loss_fn, "sf.per_sample_grads")
    frozen_rx = compile_patterns(frozen, "frozen", "dotted parameter names")

    def fn(params: Any, batch: Any) -> Any:
        from torch.func import grad, vmap

        with _watch.watched("sf.per_sample_grads"):
            n = _batch_size(batch, "sf.per_sample_grads")
            model = _Model(params, apply, frozen_rx, "sf.per_sample_grads")
            world = model.world()
            if world > 1:
                sizes = torch.tensor([n, -n], dtype=torch.int64, device=model.mesh.device_type)
                C.all_reduce_blocking(sizes, model.group(), "sf.per_sample_grads", op="max")
                if int(sizes[0]) != -int(sizes[1]):
                    raise ValueError(
                        f"sf.per_sample_grads: the ranks pass batches of {-int(sizes[1])} to {int(sizes[0])} examples; the "
                        "gradients are sharded along the examples, which needs the same number on every rank"
                    )
            if n == 0:  # the same number on every rank (checked): none anywhere
                raise ValueError("sf.per_sample_grads: the ranks pass no example; every rank needs at least one")
            with torch.no_grad():
                full = [gather(x) for x in model.leaves]
            trained = [x for x, t in zip(full, model.trained) if t]

            def one(trained_leaves: list, example: Any) -> torch.Tensor:
                it = iter(trained_leaves)
                tree = optree.tree_unflatten(model.treespec, [next(it) if t else x for x, t in zip(full, model.trained)])
                return _one_loss(loss_fn(tree, example))

            grads = vmap(grad(one), in_dims=(None, 0), randomness=randomness)(trained, batch)
            it = iter(grads)
            out = []
            for x, t in zip(model.leaves, model.trained):
                g = next(it) if t else None
                if g is not None and model.mesh is not None:
                    mesh = model.mesh
                    g = DTensor.from_local(
                        g, mesh, [Shard(0)] * mesh.ndim, run_check=False, shape=(n * world, *g.shape[1:]),
                        stride=torch.empty(0, *g.shape[1:]).stride() if g.dim() > 1 else (1,),
                    )
                out.append(g)
            return optree.tree_unflatten(model.treespec, out)

    return fn


class DPValueAndGrad:
    """`sf.dp_value_and_grad(...)`: call it as `fn(params, batch, seed=...)`; see `dp_value_and_grad`."""

    def __init__(self, loss_fn: Callable, l2_norm_clip: float, noise_multiplier: float, apply: Any, frozen: Any, randomness: str):
        _check_loss_fn(loss_fn, "sf.dp_value_and_grad")
        for name, v, low in (("l2_norm_clip", l2_norm_clip, "positive"), ("noise_multiplier", noise_multiplier, "non-negative")):
            ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or (v <= 0 if low == "positive" else v < 0):
                raise ValueError(f"sf.dp_value_and_grad: {name} must be a finite {low} number, got {v!r}")
        self.loss_fn, self.clip, self.sigma = loss_fn, float(l2_norm_clip), float(noise_multiplier)
        self.apply, self.frozen, self.randomness = apply, compile_patterns(frozen, "frozen", "dotted parameter names"), randomness
        self._hold: set = set()  # leaves read outside their units, learnt on the first call

    def _clipped_sum(self, model: _Model, batch: Any, weights: torch.Tensor) -> list:
        """The second pass: the gradient of sum_i w_i * loss_i over the global batch, through
        `sf.gather`, whose backward reduce-scatters the mean over ranks of each leaf's full gradient
        into its shard: each rank's weighted sum is scaled by the world size, so that their mean
        is the sum over all ranks."""
        from torch.func import grad, vmap

        index = [k for k, t in enumerate(model.trained) if t]
        world = model.world()

        def weighted(trained: list) -> torch.Tensor:
            it = iter(trained)
            full = [gather(next(it)) if t else gather(x).detach() for x, t in zip(model.leaves, model.trained)]
            tree = optree.tree_unflatten(model.treespec, full)
            losses = vmap(lambda p, e: _one_loss(self.loss_fn(p, e)), in_dims=(None, 0), randomness=self.randomness)(tree, batch)
            return (losses * weights.to(losses.dtype)).sum() * world

        return grad(weighted)([model.leaves[k] for k in index])

    def __call__(self, params: Any, batch: Any, seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], Any]:
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or not 0 <= int(seed) < 2**63:
            raise ValueError(f"sf.dp_value_and_grad: seed must be a non-negative int (the same on every rank), got {seed!r}")
        seed = int(seed)
        with _watch.watched("sf.dp_value_and_grad"):
            n = _batch_size(batch, "sf.dp_value_and_grad")
            model = _Model(params, self.apply, self.frozen, "sf.dp_value_and_grad")
            if model.mesh is None:
                raise ValueError(
                    "sf.dp_value_and_grad takes a sharded tree (DTensor leaves, e.g. from sf.shard), as sf.value_and_grad does"
                )
            _refuse_empty(model, n, "sf.dp_value_and_grad")
            # Dropout and other random ops must draw the same in both passes (the clip factor of
            # an example is that of the gradient it scales): each pass starts from the same RNG state.
            rng = _rng_state(model.mesh.device_type)
            losses, sq = _per_example(model, self.loss_fn, batch, self.randomness, self._hold, rng)
            norms = sq.sqrt()
            device = model.mesh.device_type
            # One all-reduce for the global batch size and loss; one for the seed's agreement.
            totals = torch.stack([torch.tensor(float(n)), losses.detach().double().sum().cpu()]).to(device, torch.float64)
            seeds = torch.tensor([seed, -seed], dtype=torch.int64, device=device)
            if model.world() > 1:
                C.all_reduce_blocking(totals, model.group(), "sf.dp_value_and_grad")
                C.all_reduce_blocking(seeds, model.group(), "sf.dp_value_and_grad", op="max")
                if int(seeds[0]) != -int(seeds[1]):
                    raise ValueError(
                        "sf.dp_value_and_grad: the ranks pass different seeds; the noise must be the same draw on every "
                        "rank, so pass the same seed everywhere (e.g. one derived from the step number)"
                    )
            total = float(totals[0])
            weights = ((self.clip / (norms + _CLIP_EPS)).clamp(max=1.0) / total).to(losses.device)
            _set_rng_state(rng)
            trained = iter(self._clipped_sum(model, batch, weights))
            grads = [next(trained) if t else None for t in model.trained]
            self._add_noise(grads, seed, total)
            return ((totals[1] / total).to(losses.dtype), norms), optree.tree_unflatten(model.treespec, grads)

    def _add_noise(self, grads: list, seed: int, total: float) -> None:
        if self.sigma == 0:
            return
        gen = torch.Generator().manual_seed(seed)
        scale = self.sigma * self.clip / total
        with torch.no_grad():
            for g in grads:
                if g is None:
                    continue
                noise = torch.randn(tuple(g.shape), generator=gen, dtype=torch.float32)
                local = distribute_tensor(noise, g.device_mesh, g.placements, src_data_rank=None).to_local()
                g.to_local().add_(local.to(g.device, g.dtype), alpha=scale)


def dp_value_and_grad(
    loss_fn: Callable[[Any, Any], torch.Tensor],
    l2_norm_clip: float,
    noise_multiplier: float,
    *,
    apply: Any = None,
    frozen: Any = None,
    randomness: str = "error",
) -> DPValueAndGrad:
    """DP-SGD's gradient of a sharded model: per-example clipping, summed, with Gaussian noise.

    For the global batch of `B` examples (each rank passes its own), the gradient is
    `(sum_i g_i * min(1, l2_norm_clip / (|g_i| + 1e-6)) + noise_multiplier * l2_norm_clip * N(0, I)) / B`,
    `|g_i|` the norm of example i's gradient over the whole model (Opacus's clipping). Two passes
    (Note [per-example gradients] in `shardfn/_per_sample.py`): the norms, one unit's per-example
    gradients at a time; then the gradient of the clip-weighted loss, reduce-scattered into shards.
    The noise comes from `torch.Generator().manual_seed(seed)` on the CPU: one `torch.randn(shape)`
    in float32 per trained leaf, at its full shape, in the tree's leaf order (`sf.tree_paths`, keys
    sorted, so not `model.parameters()` order; frozen leaves draw nothing), cast to the leaf's
    dtype; every rank must pass the same seed (checked) and keeps its shard. Random ops in
    `loss_fn` (dropout, with `randomness="different"`) draw the same in both passes. A tied weight
    is one leaf: its per-example gradient sums every use, as a single process computes it. Ranks
    may pass different numbers of examples; `B` is their total.

    Memory per rank: the parameters in full and their full gradients (as `sf.gather` and
    `torch.func.grad` would hold them), plus the per-example gradients of about one unit.

    Args:
        loss_fn: `loss_fn(params, example) -> loss` of one example, as in `per_sample_grad_norms`.
        l2_norm_clip: the clipping norm `C`.
        noise_multiplier: `sigma`; the noise's standard deviation is `sigma * C` (0: no noise).
        apply, frozen, randomness: as in `per_sample_grad_norms`.

    Returns:
        `fn(params, batch, seed) -> ((loss, norms), grads)`: `loss` the mean loss over the global
        batch, `norms` the unclipped gradient norms of this rank's examples, `grads` a sharded tree
        like `params` (None at frozen leaves), ready for `sf.optim`.

    Example:
        >>> dp = sf.dp_value_and_grad(loss_fn, l2_norm_clip=1.0, noise_multiplier=1.1)
        >>> (loss, norms), grads = dp(params, batch, seed=step)
        >>> updates, opt_state = opt.update(grads, opt_state, params)
        >>> params = sf.apply_updates(params, updates)
    """
    return DPValueAndGrad(loss_fn, l2_norm_clip, noise_multiplier, apply, frozen, randomness)
