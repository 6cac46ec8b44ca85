"""torch.func through shards: `grad` and `vjp` of a function of `sf.gather(sharded)` or of
`apply(sharded, x)` are sharded trees equal to the gradient of the mean over ranks (each rank's
function sees its own batch; with the same batch on every rank, the unsharded gradient); gradients
to the inputs are exact; what is not supported yet refuses with the way around it."""

from __future__ import annotations

import contextlib

import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import shardfn as sf
from reference import global_batch, local_batch, make_model, rel_err, units_of


def _x(rank: int) -> torch.Tensor:
    return torch.randn(3, 7, generator=torch.Generator().manual_seed(rank))


def _mean(per_rank: list) -> list:
    """The mean over ranks, leaf by leaf, of each rank's tree (or list of leaves)."""
    return [sum(t) / len(per_rank) for t in zip(*[optree.tree_leaves(x) for x in per_rank])]


def rank_transforms() -> dict:
    from torch.func import grad, grad_and_value, vjp, vmap

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model("mlp")
    apply, params = sf.functionalize(model, units=units_of("mlp"))
    mesh = sf.mesh(dp=-1)
    sharded = sf.shard(params, sf.specs(params, mesh), mesh)

    def loss(p, x):
        return apply(p, x).pow(2).sum()

    # The unsharded reference: the mean of every rank's gradient (Note [the mean over ranks]).
    ref = _mean([grad(loss)(params, _x(r)) for r in range(world)])
    out = {}
    g = grad(lambda p: loss(sf.gather(p), _x(rank)))(sharded)
    out["grad"] = [(type(a).__name__, a.placements, rel_err(sf.gather(a), b)) for a, b in zip(optree.tree_leaves(g), ref)]
    g2, value = grad_and_value(lambda p: loss(sf.gather(p), _x(rank)))(sharded)
    out["grad_and_value"] = max(rel_err(sf.gather(a), b) for a, b in zip(optree.tree_leaves(g2), ref))
    out["value"] = rel_err(value, loss(params, _x(rank)))
    _, fn = vjp(lambda p: apply(sf.gather(p), _x(rank)), sharded)
    cot = torch.ones(3, 3)
    (gv,) = fn(cot)
    ref_vjp = _mean([vjp(lambda p: apply(p, _x(r)), params)[1](cot)[0] for r in range(world)])
    out["vjp"] = max(rel_err(sf.gather(a), b) for a, b in zip(optree.tree_leaves(gv), ref_vjp))
    # Through `apply` on the sharded tree: gradients to the tree and to the inputs.
    ga = grad(lambda p: loss(p, _x(rank)))(sharded)
    out["apply_grad"] = max(rel_err(sf.gather(a), b) for a, b in zip(optree.tree_leaves(ga), ref))
    gx = grad(lambda x: apply(sharded, x).pow(2).sum())(_x(rank))
    out["input_grad"] = rel_err(gx, grad(lambda x: apply(params, x).pow(2).sum())(_x(rank)))
    x = _x(rank).requires_grad_()
    (gx2,) = torch.autograd.grad(apply(sharded, x).pow(2).sum(), x)
    out["input_autograd"] = rel_err(gx2, gx)
    # Transforms over the inputs of a sharded model: the tree is a constant to them.
    from torch.func import hessian, jacfwd, jacrev, jvp

    for name, fn in {
        "jacrev_x": lambda p: jacrev(lambda x: apply(p, x))(_x(rank)),
        "jacfwd_x": lambda p: jacfwd(lambda x: apply(p, x))(_x(rank)),
        "jvp_x": lambda p: jvp(lambda x: apply(p, x), (_x(rank),), (torch.ones(3, 7),))[1],
        "hessian_x": lambda p: hessian(lambda x: apply(p, x).pow(2).sum())(_x(rank)),
        "vmap_grad_x": lambda p: vmap(grad(lambda x: apply(p, x[None]).sum()))(_x(rank)),
    }.items():
        out[name] = rel_err(fn(sharded), fn(params))
    # jacrev with respect to the sharded tree: one reduce-scatter for the batch of cotangents; the
    # Jacobian is sharded like the tree, on the dims after the output's.
    jac = jacrev(lambda p: apply(p, _x(rank)))(sharded)
    ref_jac = _mean([jacrev(lambda p: apply(p, _x(r)))(params) for r in range(world)])
    out["jacrev"] = max(rel_err(sf.gather(a), b) for a, b in zip(optree.tree_leaves(jac), ref_jac))
    out["jacrev_types"] = {type(a).__name__ for a in optree.tree_leaves(jac)}
    try:  # its derivative would be taken outside the recorded graph: refused, never zeros
        jacrev(jacrev(lambda p: loss(p, _x(rank))))(sharded)
        out["jacrev_jacrev"] = "ran"
    except NotImplementedError as e:
        out["jacrev_jacrev"] = str(e)
    # A Hessian-vector product, reverse over reverse: the gradient of sf.gather's gradient.
    v = optree.tree_map(lambda t: torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel())), params)
    v_sharded = sf.shard(v, sf.specs(v, mesh), mesh)
    (hv,) = vjp(grad(lambda p: loss(p, _x(rank))), sharded)[1](v_sharded)
    ref_hv = _mean([vjp(grad(lambda p: loss(p, _x(r))), params)[1](v)[0] for r in range(world)])
    out["hvp"] = max(rel_err(sf.gather(a), b) for a, b in zip(optree.tree_leaves(hv), ref_hv))
    # The same data on every rank: every gradient equals the unsharded one (not W times it).
    x0 = _x(0)

    def lo(p):
        return loss(p, x0)

    def worst(got, want):
        return max(rel_err(sf.gather(a), b) for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want)))

    out["equal_data"] = {
        "grad_gather": worst(grad(lambda p: lo(sf.gather(p)))(sharded), grad(lo)(params)),
        "grad_apply": worst(grad(lo)(sharded), grad(lo)(params)),
        "vjp": worst(vjp(lambda p: apply(p, x0), sharded)[1](cot)[0], vjp(lambda p: apply(p, x0), params)[1](cot)[0]),
        "jacrev": worst(jacrev(lambda p: apply(p, x0))(sharded), jacrev(lambda p: apply(p, x0))(params)),
        "hvp": worst(vjp(grad(lo), sharded)[1](v_sharded)[0], vjp(grad(lo), params)[1](v)[0]),
        "jvp_grad": worst(jvp(grad(lo), (sharded,), (v_sharded,))[1], jvp(grad(lo), (params,), (v,))[1]),
        "grad_jvp": worst(grad(lambda t: jvp(lo, (sharded,), (t,))[1])(v_sharded), grad(lambda t: jvp(lo, (params,), (t,))[1])(v)),
    }
    # A leaf read directly (a DTensor) and added to the loss of the gathered tree: refused in the
    # forward with the way around it, under torch.func and plain autograd; afterwards (and outside
    # any gradient) a DTensor still meets plain scalars.
    leaf = sf.tree_paths(params)[0].split(".")

    def direct(p):
        return loss(p, x0) + p[leaf[0]][leaf[1]].pow(2).sum()

    mixed = {}
    for name, fn in {"func": lambda: grad(direct)(sharded),
                     "autograd": lambda: direct(optree.tree_map(lambda t: t.detach().requires_grad_(), sharded)).backward()}.items():
        try:
            fn()
            mixed[name] = "ran"
        except ValueError as e:
            mixed[name] = str(e)
    first = optree.tree_leaves(sharded)[0]
    mixed["after"] = rel_err(sf.gather(first * torch.tensor(2.0)), 2 * sf.gather(first))
    out["mixed"] = mixed
    with torch.no_grad():
        out["inference"] = rel_err(apply(sharded, _x(rank)), apply(params, _x(rank)))
    try:
        vmap(grad(lambda p, x: loss(sf.gather(p), x[None])), in_dims=(None, 0))(sharded, _x(rank))
        out["vmap"] = "ran"
    except NotImplementedError as e:
        out["vmap"] = str(e)
    # One convention: sf.value_and_grad (the unit schedule) gives what torch.func gives, each rank
    # passing its own batch. Last: it takes the tree into its own buffers.
    _, vg = sf.value_and_grad(loss, apply=apply)(sharded, _x(rank))
    out["value_and_grad"] = max(rel_err(sf.gather(a), sf.gather(b)) for a, b in zip(optree.tree_leaves(vg), optree.tree_leaves(ga)))
    return out


def rank_other_layouts() -> float:
    from torch.func import grad

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = sf.mesh(dp=-1)
    full = {"a": torch.randn(5, 7, generator=torch.Generator().manual_seed(0)), "s": torch.tensor(1.5),
            "b": torch.randn(3, 5, generator=torch.Generator().manual_seed(1))}
    tree = sf.shard(full, {"a": sf.P(None, "dp"), "s": sf.P(), "b": sf.P()}, mesh)

    def f(p, x):
        return (p["s"] * torch.tanh(x @ p["a"].T) @ p["b"].T).pow(2).sum()

    g = grad(lambda p: f(sf.gather(p), _x(rank)))(tree)
    ref = _mean([grad(f)(full, _x(r)) for r in range(world)])
    errs = [rel_err(sf.gather(a), b) for a, b in zip(optree.tree_leaves(g), ref)]
    # A 2-D mesh: the mean is over every rank of the mesh, whichever axes a leaf is split over.
    mesh2 = sf.mesh(replicate=1, shard=-1)
    tree2 = sf.shard(full, {"a": sf.P("shard"), "s": sf.P(), "b": sf.P(None, ("replicate", "shard"))}, mesh2)
    g2 = grad(lambda p: f(sf.gather(p), _x(0)))(tree2)
    errs += [rel_err(sf.gather(a), b) for a, b in zip(optree.tree_leaves(g2), optree.tree_leaves(grad(f)(full, _x(0))))]
    return max(errs)


@pytest.mark.parametrize("world", [2, 3])
def test_grad_through_gather_of_replicated_and_other_dim_leaves(pools, world):
    errs = pools(world).run(rank_other_layouts)
    assert max(errs) < 1e-5, errs


@pytest.mark.parametrize("world", [1, 2, 3])
def test_grad_and_vjp_through_gather_are_sharded_and_exact(pools, world):
    for rank, out in enumerate(pools(world).run(rank_transforms)):
        for kind, placements, err in out["grad"]:
            assert kind == "DTensor" and err < 1e-5, (rank, out["grad"])
        assert out["grad_and_value"] < 1e-5 and out["value"] < 1e-6 and out["vjp"] < 1e-5, (rank, out)
        assert "gather outside the vmap" in out["vmap"], out["vmap"]
        keys = ("apply_grad", "input_grad", "input_autograd", "inference", "hvp", "jacrev", "jacrev_x", "jacfwd_x", "jvp_x", "hessian_x",
                "vmap_grad_x")
        assert out["jacrev_types"] == {"DTensor"}, out["jacrev_types"]
        assert "derivative of jacrev" in out["jacrev_jacrev"], out["jacrev_jacrev"]
        assert max(out[k] for k in keys) < 1e-5, (rank, out)
        assert max(out["equal_data"].values()) < 1e-6 and out["value_and_grad"] < 1e-5, (rank, out)
        for k in ("func", "autograd"):
            assert "sf.gather(tree)" in out["mixed"][k] and "apply(tree, x)" in out["mixed"][k], out["mixed"]
        assert out["mixed"]["after"] == 0, out["mixed"]


class _Routed(torch.nn.Module):
    """An encoder and an expert that only examples with x[:, 0] > 0 reach (routing by the data)."""

    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(6, 6)
        self.expert = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        sel = x[:, 0] > 0
        return h + torch.zeros_like(h).index_put((sel,), self.expert(h[sel])) if sel.any() else h


def _routed_x(rank: int, n: int = 4) -> torch.Tensor:
    """Rank 0's examples all reach the expert, the others' none."""
    x = torch.randn(n, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    x[:, 0] = x[:, 0].abs() if rank == 0 else -x[:, 0].abs()
    return x


def rank_leaf_unused_on_some_ranks() -> dict:
    """A leaf that only some ranks' functions use (Note [one node for the tree] in shardfn/_shard.py):
    each rank reduced the leaves its own function reached, so the next leaf's reduce-scatter met the
    other ranks' reduce-scatter of the skipped one: wrong gradients on one rank, a stall on the other.
    Now exact through sf.gather and apply, for grad, vjp and a Hessian-vector product; and a jacrev
    whose ranks have different numbers of outputs is a ValueError on every rank (gloo aborted)."""
    from torch.func import grad, jacrev, jvp, vjp

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    apply, params = sf.functionalize(_Routed().double())
    mesh = sf.mesh(dp=-1)
    sharded = sf.shard(params, sf.specs(params, mesh), mesh)

    def f(p, x):
        return (apply(p, x) ** 2).sum()

    ref = _mean([grad(f)(params, _routed_x(r)) for r in range(world)])
    v = optree.tree_map(lambda t: torch.ones_like(t) / t.numel(), params)
    ref_hvp = _mean([jvp(lambda p: grad(f)(p, _routed_x(r)), (params,), (v,))[1] for r in range(world)])
    errs = {}
    x = _routed_x(rank)
    got = {
        "grad_gather": grad(lambda p: f(sf.gather(p), x))(sharded),
        "grad_apply": grad(lambda p: f(p, x))(sharded),
        "vjp_gather": vjp(lambda p: f(sf.gather(p), x), sharded)[1](torch.tensor(1.0, dtype=torch.float64))[0],
    }
    for k, g in got.items():
        errs[k] = max(rel_err(sf.gather(a), b) for a, b in zip(optree.tree_leaves(g), ref))
    vs = sf.shard(v, sf.specs(v, mesh), mesh)
    hvp = vjp(lambda p: grad(lambda q: f(sf.gather(q), x))(p), sharded)[1](vs)[0]
    errs["hvp"] = max(rel_err(sf.gather(a), b) for a, b in zip(optree.tree_leaves(hvp), ref_hvp))
    try:
        jacrev(lambda p: apply(p, _routed_x(rank, 3 + rank)))(sharded)
        errs["jacrev_sizes"] = "no error"
    except ValueError as e:
        errs["jacrev_sizes"] = str(e)
    # Per-example gradients by vmap over unequal per-rank batches: refused as a vmap over examples
    # (every rank agrees before reducing), not as a jacrev of other sizes.
    try:
        enc = lambda p, xi: torch.tanh(sf.gather(p)["enc"]["weight"] @ xi).sum()  # noqa: E731
        torch.func.vmap(lambda xi: grad(enc)(sharded, xi))(_routed_x(rank, 3 + rank))
        errs["vmap_examples"] = "no error"
    except NotImplementedError as e:
        errs["vmap_examples"] = str(e)
    return errs


@pytest.mark.parametrize("world", [2, 3])
def test_a_leaf_unused_on_some_ranks(pools, world):
    for rank, out in enumerate(pools(world).run(rank_leaf_unused_on_some_ranks)):
        sizes, examples = out.pop("jacrev_sizes"), out.pop("vmap_examples")
        assert "same number of outputs on every rank" in sizes, (rank, sizes)
        assert "sf.gather under vmap" in examples, (rank, examples)
        assert max(out.values()) < 1e-12, (rank, out)


def rank_forward_mode() -> dict:
    """jvp with respect to a sharded tree (Note [dual DTensors]): the tangents are sharded as the
    tree; each rank's output tangent is that of its own function, equal to the unsharded jvp."""
    from torch.autograd import forward_ad
    from torch.func import grad, hessian, jacfwd, jvp, linearize

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = sf.mesh(dp=-1)
    g = torch.Generator().manual_seed(0)
    full = {"a": torch.randn(5, 7, generator=g), "s": torch.tensor(1.5), "b": torch.randn(3, 5, generator=g),
            "c": torch.randn(4, 5, generator=g)}
    specs = {"a": sf.P("dp"), "s": sf.P(), "b": sf.P(None, "dp"), "c": sf.P("dp")}
    tree = sf.shard(full, specs, mesh)
    v = optree.tree_map(lambda t: torch.randn(t.shape, generator=g), full)
    v_sharded = sf.shard(v, specs, mesh)

    def f(p, x):
        h = torch.tanh(x @ p["a"].T) * p["s"]
        return h @ p["b"].T + (h @ p["c"].T).sum(-1, keepdim=True)

    x, dx = _x(rank), torch.randn(3, 7, generator=g)
    out = {}
    o, t = jvp(lambda p: f(sf.gather(p), x), (tree,), (v_sharded,))
    ref_o, ref_t = jvp(lambda p: f(p, x), (full,), (v,))
    out["jvp"] = max(rel_err(o, ref_o), rel_err(t, ref_t))
    _, t2 = jvp(lambda p, x: f(sf.gather(p), x), (tree, x), (v_sharded, dx))
    out["jvp_both"] = rel_err(t2, jvp(f, (full, x), (v, dx))[1])
    # Through `apply` on a sharded model; forward mode needs no grad mode, and works with
    # torch.autograd.forward_ad's dual tensors as well.
    apply, params = sf.functionalize(make_model("mlp"), units=units_of("mlp"))
    sharded = sf.shard(params, sf.specs(params, mesh), mesh)
    w = optree.tree_map(lambda t: torch.randn(t.shape, generator=g), params)
    w_sharded = sf.shard(w, sf.specs(w, mesh), mesh)
    ref_apply = jvp(lambda p: apply(p, x), (params,), (w,))[1]
    out["jvp_apply"] = rel_err(jvp(lambda p: apply(p, x), (sharded,), (w_sharded,))[1], ref_apply)
    with torch.no_grad():
        out["jvp_apply_no_grad"] = rel_err(jvp(lambda p: apply(p, x), (sharded,), (w_sharded,))[1], ref_apply)
    with forward_ad.dual_level():
        duals = optree.tree_map(forward_ad.make_dual, sharded, w_sharded)
        out["forward_ad_apply"] = rel_err(forward_ad.unpack_dual(apply(duals, x)).tangent, ref_apply)
    # Transforms around the jvp that differentiate its tangent: the tangent's gather is recorded.
    transposed = grad(lambda t: jvp(lambda p: f(sf.gather(p), x), (tree,), (t,))[1].sum())(v_sharded)
    ref_transposed = _mean([grad(lambda t: jvp(lambda p: f(p, _x(r)), (full,), (t,))[1].sum())(v) for r in range(world)])
    out["grad_of_jvp"] = max(rel_err(sf.gather(a), b) for a, b in zip(optree.tree_leaves(transposed), ref_transposed))
    nested = jvp(lambda p: jvp(lambda q: f(sf.gather(q), x).pow(2).sum(), (p,), (p,))[1], (tree,), (v_sharded,))[1]
    out["jvp_of_jvp"] = rel_err(nested, jvp(lambda p: jvp(lambda q: f(q, x).pow(2).sum(), (p,), (p,))[1], (full,), (v,))[1])
    # Forward over reverse: a Hessian-vector product whose result is sharded, the mean over ranks.
    def loss(p, x):
        return f(p, x).pow(2).sum()

    _, hv = jvp(grad(lambda p: loss(sf.gather(p), x)), (tree,), (v_sharded,))
    ref_hv = _mean([jvp(grad(lambda p: loss(p, _x(r))), (full,), (v,))[1] for r in range(world)])
    out["fwd_over_rev"] = max(rel_err(sf.gather(a), b) for a, b in zip(optree.tree_leaves(hv), ref_hv))
    out["fwd_over_rev_types"] = {type(a).__name__ for a in optree.tree_leaves(hv)}

    # Third order: the gradient of the squared norm of that (global) Hessian-vector product.
    def hvp_norm(p, hvp):
        return sum(t.pow(2).sum() for t in optree.tree_leaves(hvp(p)))

    g3 = grad(hvp_norm)(tree, lambda p: jvp(grad(lambda q: loss(sf.gather(q), x)), (p,), (v_sharded,))[1])

    def ref_hvp(p):
        return _mean([jvp(grad(lambda q: loss(q, _x(r))), (p,), (v,))[1] for r in range(world)])

    out["third_order"] = max(rel_err(sf.gather(a), b) for a, b in zip(optree.tree_leaves(g3), optree.tree_leaves(grad(hvp_norm)(full, ref_hvp))))
    relaid = sf.shard(v, optree.tree_map(lambda _: sf.P(), specs), mesh)
    doubles = sf.shard(optree.tree_map(lambda t: t.double(), v), specs, mesh)
    for name, fn in {
        "jacfwd": lambda: jacfwd(lambda p: f(sf.gather(p), x))(tree),
        "hessian": lambda: hessian(lambda p: loss(sf.gather(p), x))(tree),
        "plain_tangent": lambda: jvp(lambda p: f(sf.gather(p), x), (tree,), (v,)),
        "relaid_tangent": lambda: jvp(lambda p: f(sf.gather(p), x), (tree,), (relaid,)),
        "float64_tangent": lambda: jvp(lambda p: f(sf.gather(p), x), (tree,), (doubles,)),
        "linearize": lambda: linearize(lambda p: f(sf.gather(p), x), tree)[1](v_sharded),
        "jvp_of_sf_grad": lambda: jvp(lambda p: sf.grad(lambda q, b: apply(q, b).sum())(p, x), (sharded,), (w_sharded,)),
    }.items():
        try:
            fn()
            out[name] = "ran"
        except (NotImplementedError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_jvp_with_respect_to_a_sharded_tree(pools, world):
    for rank, out in enumerate(pools(world).run(rank_forward_mode)):
        exact = ("jvp", "jvp_both", "jvp_apply", "jvp_apply_no_grad", "forward_ad_apply", "grad_of_jvp", "jvp_of_jvp",
                 "fwd_over_rev", "third_order")
        assert max(out[k] for k in exact) < 1e-5, (rank, out)
        assert out["fwd_over_rev_types"] == {"DTensor"}, out
        assert out["jacfwd"].startswith("NotImplementedError: jacfwd, hessian") and "jacrev" in out["jacfwd"], out["jacfwd"]
        assert out["hessian"].startswith("NotImplementedError: jacfwd, hessian"), out["hessian"]
        for k in ("plain_tangent", "relaid_tangent", "float64_tangent"):
            assert out[k].startswith("ValueError") and "sf.shard(tangents" in out[k], (k, out[k])
        assert out["linearize"].startswith("NotImplementedError: sf.gather cannot be traced"), out["linearize"]
        assert out["jvp_of_sf_grad"].startswith("NotImplementedError: sf.value_and_grad (and sf.grad) cannot run inside"), out


def rank_jvp_inside_loss(strategy: str) -> float:
    """A loss_fn with a directional-derivative penalty (jvp over its inputs) trains exactly."""
    from torch.func import grad, jvp

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = sf.mesh(dp=-1)
    apply, params = sf.functionalize(make_model("mlp"), units=units_of("mlp"))

    def loss(p, batch):
        x, y = batch
        d = jvp(lambda z: apply(p, z), (x,), (torch.ones_like(x),))[1]
        return (apply(p, x) - y).pow(2).mean() + 0.1 * d.pow(2).mean()

    step = sf.train_step(loss, sf.optim.sgd(0.1), mesh=mesh, strategy=strategy)
    state = step.init(params)
    ref = params
    for i in range(2):
        batch = global_batch("mlp", i, world)
        state, _ = step(state, local_batch(batch, rank, world))
        ref = optree.tree_map(lambda a, b: a - 0.1 * b, ref, grad(loss)(ref, batch))
    return max(rel_err(a, b) for a, b in zip(optree.tree_leaves(sf.gather(state.params)), optree.tree_leaves(ref)))


@pytest.mark.parametrize("world,strategy", [(2, "full_shard"), (3, "full_shard"), (2, "no_shard")])
def test_jvp_inside_loss(pools, world, strategy):
    errs = pools(world).run(rank_jvp_inside_loss, strategy)
    assert max(errs) < 1e-5, errs


def rank_vmap_inside_loss(strategy: str) -> dict:
    """A loss_fn that vmaps over its examples (per-example losses, here clamped) trains exactly as
    the same loss_fn on the unsharded model."""
    from torch.func import vmap

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = sf.mesh(dp=-1)
    apply, params = sf.functionalize(make_model("mlp"), units=units_of("mlp"))

    def make_loss(app):
        def loss_fn(p, batch):
            x, y = batch
            per = vmap(lambda xi, yi: (app(p, xi[None]) - yi[None]).pow(2).mean())(x, y)
            return per.clamp(max=2.0).mean()

        return loss_fn

    step = sf.train_step(make_loss(apply), sf.optim.sgd(0.1, momentum=0.9), mesh, strategy=strategy, apply=apply)
    state = step.init(params)
    # The reference: the plain module on one process, torch.func.functional_call under the same
    # vmap, torch's SGD.
    ref = make_model("mlp")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_loss_fn = make_loss(lambda p, x: torch.func.functional_call(ref, p, (x,)))
    losses = []
    for i in range(3):
        batch = global_batch("mlp", i, world)
        state, m = step(state, local_batch(batch, rank, world))
        ref_opt.zero_grad()
        ref_loss = ref_loss_fn(dict(ref.named_parameters()), batch)
        ref_loss.backward()
        ref_opt.step()
        losses.append(rel_err(m["loss"], ref_loss.detach()))
    got = sf.to_state_dict(sf.gather(state.params), apply)
    return {"loss": max(losses), "params": max(rel_err(got[k], v) for k, v in ref.state_dict().items())}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard"])
def test_vmap_inside_loss_fn_under_every_strategy(pools, strategy, world):
    for rank, out in enumerate(pools(world).run(rank_vmap_inside_loss, strategy)):
        assert out["loss"] < 1e-5 and out["params"] < 1e-5, (rank, out)


class _Logged(TorchDispatchMode):
    """A user's dispatch mode around the step (a logger, as a flop counter is): it sees every op."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def rank_ensemble(strategy: str, under: str = "plain") -> dict:
    """An ensemble (torch.func.stack_module_state) trained by a loss_fn that vmaps over the members
    trains exactly as the unsharded ensemble: vmap over the step's parameters themselves (which
    would batch their raw memory, past shardfn) moves the step off the unit schedule before any op
    computes; over the leaves read first, it stays on it. `under`: "mode", the steps run under a
    user's TorchDispatchMode; "debug", in shardfn's debug mode (whose read check is such a mode):
    the same decisions and results (Note [params below the dispatcher])."""
    import copy

    from shardfn import _debug

    from torch import nn
    from torch.func import functional_call, stack_module_state, vmap

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)) for _ in range(4)]
    stacked, _ = stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")
    params = {k: v.detach().clone() for k, v in stacked.items()}

    def make_loss(read_first: bool):
        def loss_fn(p, batch):
            x, y = batch
            if read_first:
                p = optree.tree_map(lambda t: t.view(t.shape), p)
            out = vmap(lambda q: functional_call(base, q, (x,)))(p)  # [members, examples, 3]
            return F.mse_loss(out, y.expand(len(members), *y.shape))

        return loss_fn

    mesh = sf.mesh(dp=-1)
    out = {}
    for read_first in (False, True):
        step = sf.train_step(make_loss(read_first), sf.optim.sgd(0.1, momentum=0.9), mesh, strategy=strategy)
        state = step.init(params)
        ref = {k: v.clone().requires_grad_() for k, v in params.items()}
        opt = torch.optim.SGD(ref.values(), lr=0.1, momentum=0.9)
        losses = []
        for i in range(3):
            batch = global_batch("mlp", i, world)
            logged = _Logged()
            _debug.enable(under == "debug")
            try:
                with logged if under == "mode" else contextlib.nullcontext():
                    state, m = step(state, local_batch(batch, rank, world))
            finally:
                _debug.enable(_debug.ENV)
            assert under != "mode" or logged.ops > 0
            opt.zero_grad()
            ref_loss = make_loss(False)(ref, batch)
            ref_loss.backward()
            opt.step()
            losses.append(rel_err(m["loss"], ref_loss))
        got = sf.gather(state.params)
        out[read_first] = (max(losses), max(rel_err(got[k], ref[k]) for k in ref), step._off_schedule)
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_an_ensemble_vmapped_inside_loss_fn(pools, strategy, world):
    for rank, out in enumerate(pools(world).run(rank_ensemble, strategy)):
        assert out[False][2] and not out[True][2], out  # off the schedule only when vmap meets the Params
        assert max(max(out[k][:2]) for k in out) < 1e-5, (rank, out)


@pytest.mark.parametrize("under", ["mode", "debug"])
def test_an_ensemble_vmapped_under_a_dispatch_mode(pools, under):
    """A dispatch mode calls the op of a Param that vmap batched below autograd: Param's
    `__torch_function__` runs first and must refuse as its `__torch_dispatch__` does, not hand the
    op the full value with the gradient lost (the parameters ended 8e-3 from one process)."""
    for rank, out in enumerate(pools(2).run(rank_ensemble, "full_shard", under)):
        assert out[False][2] and not out[True][2], out  # off the schedule only when vmap meets the Params
        assert max(max(out[k][:2]) for k in out) < 1e-5, (rank, out)


class _Lora(torch.nn.Module):
    """A frozen linear map plus a trained low-rank one, as peft's LoRA layers: the unit's trained
    gradients land before its backward is done with the frozen weight."""

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(8, 8).requires_grad_(False)
        self.a = torch.nn.Linear(8, 2, bias=False)
        self.b = torch.nn.Linear(2, 8, bias=False)

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))


class _LoraBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(_Lora(), torch.nn.Tanh(), torch.nn.Linear(8, 8)) for _ in range(3)])

    def forward(self, x):
        for blk in self.blocks:
            x = x + blk(x)
        return x


def rank_vmap_partly_frozen() -> dict:
    """vmap over the examples inside loss_fn, on units whose trained leaves finish before their
    frozen ones are done (LoRA): every strategy's gradient equals the unsharded one."""
    from torch.func import vmap

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _LoraBlocks()
    apply, params = sf.functionalize(model, units=r"blocks\.\d+")
    x = torch.randn(3 * world, 8, generator=torch.Generator().manual_seed(1))

    def loss_fn(p, b):
        return vmap(lambda xi: apply(p, xi[None]).pow(2).mean())(b).mean()

    trained = {k: p.requires_grad for k, p in model.named_parameters()}
    assert sorted(trained) == sorted(sf.tree_paths(params)) and not all(trained.values())
    leaves, spec = optree.tree_flatten(params)
    mine = [t.detach().clone().requires_grad_(trained[k]) for k, t in zip(sf.tree_paths(params), leaves)]
    ref_loss = loss_fn(optree.tree_unflatten(spec, mine), x)
    paths = sf.tree_paths(params)  # the leaves' order
    ref = dict(zip([k for k in paths if trained[k]], torch.autograd.grad(ref_loss, [t for t in mine if t.requires_grad])))
    out = {}
    mesh = sf.mesh(dp=-1)
    for strategy in ("full_shard", "shard_grad_op", "no_shard"):
        spec_default = sf.P() if strategy == "no_shard" else sf.P("dp")
        sharded = sf.shard(params, sf.specs(params, mesh, default=spec_default), mesh)
        loss, grads = sf.value_and_grad(loss_fn, strategy=strategy, apply=apply)(sharded, x.chunk(world)[rank])
        got = dict(zip(sf.tree_paths(params), optree.tree_leaves(grads, none_is_leaf=True)))
        out[strategy] = max([rel_err(loss, ref_loss)] + [rel_err(sf.gather(got[k]), g) for k, g in ref.items()])
        out[strategy + "_frozen_none"] = all(got[k] is None for k in trained if not trained[k])
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_vmap_inside_loss_fn_on_partly_frozen_units(pools, world):
    for rank, out in enumerate(pools(world).run(rank_vmap_partly_frozen)):
        assert all(v is True for k, v in out.items() if k.endswith("_frozen_none")), out
        assert max(v for k, v in out.items() if not k.endswith("_frozen_none")) < 1e-5, (rank, out)


def rank_penalty(strategy: str, style: str, accumulation_steps: int) -> dict:
    """A gradient penalty inside loss_fn (on the input gradient or on the parameters' gradient, by
    torch.autograd.grad with create_graph or by torch.func.grad): the step leaves the unit schedule
    and trains exactly as the unsharded model (the mean over ranks and micro-batches of loss_fn)."""
    from torch.func import grad, vmap

    rank, world = dist.get_rank(), dist.get_world_size()
    apply, params = sf.functionalize(make_model("mlp"), units=units_of("mlp"))

    def make_loss(app):
        def loss_fn(p, batch):
            x, y = batch
            if style == "param_func":  # a penalty on the parameters' gradient
                g = grad(lambda q: F.mse_loss(app(q, x), y))(p)
                return F.mse_loss(app(p, x), y) + 0.1 * sum(t.pow(2).sum() for t in optree.tree_leaves(g))
            if style == "param_autograd":
                base = F.mse_loss(app(p, x), y)
                g = torch.autograd.grad(base, optree.tree_leaves(p), create_graph=True)
                return base + 0.1 * sum(t.pow(2).sum() for t in g)
            if style == "autograd":
                x = x.detach().requires_grad_()
                out = app(p, x)
                (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            else:
                out = app(p, x)
                gx = vmap(grad(lambda xi: app(p, xi[None]).sum()))(x)
            return F.mse_loss(out, y) + gx.pow(2).mean()

        return loss_fn

    mesh = sf.mesh(replicate=1, shard=-1) if strategy == "hybrid_shard" else sf.mesh(dp=-1)
    step = sf.train_step(make_loss(apply), sf.optim.sgd(0.1, momentum=0.9), mesh, strategy=strategy,
                         accumulation_steps=accumulation_steps, apply=apply)
    state = step.init(params)
    ref = optree.tree_map(lambda t: t.detach().clone().requires_grad_(), params)
    ref_leaves = optree.tree_leaves(ref)
    opt = torch.optim.SGD(ref_leaves, lr=0.1, momentum=0.9)
    losses = []
    for i in range(3):
        batch = global_batch("mlp", i, world, per_rank=2 * accumulation_steps)
        state, m = step(state, local_batch(batch, rank, world))
        opt.zero_grad()
        ref_loss = torch.stack([make_loss(apply)(ref, b) for b in zip(*(t.chunk(world * accumulation_steps) for t in batch))]).mean()
        ref_loss.backward()
        opt.step()
        losses.append(rel_err(m["loss"], ref_loss))
    got = optree.tree_leaves(sf.gather(state.params))
    return {"loss": max(losses), "params": max(rel_err(a, b) for a, b in zip(got, ref_leaves)), "off": step._off_schedule}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy,style,k", [("full_shard", "autograd", 1), ("full_shard", "func", 2), ("shard_grad_op", "func", 1),
                                              ("no_shard", "autograd", 1), ("hybrid_shard", "func", 1),
                                              ("full_shard", "param_func", 1), ("full_shard", "param_autograd", 2)])
def test_a_gradient_penalty_inside_loss_fn(pools, strategy, style, k, world):
    for rank, out in enumerate(pools(world).run(rank_penalty, strategy, style, k)):
        assert out["off"] and out["loss"] < 1e-5 and out["params"] < 1e-5, (rank, out)


def test_a_gradient_penalty_with_mixed_precision_is_refused(pools):
    out = pools(2).run(rank_penalty_mixed_precision)
    assert all("mixed_precision" in o for o in out), out


def rank_penalty_mixed_precision() -> str:
    from torch.func import grad, vmap

    apply, params = sf.functionalize(make_model("mlp"), units=units_of("mlp"))

    def loss_fn(p, batch):
        x, y = batch
        return F.mse_loss(apply(p, x), y) + vmap(grad(lambda xi: apply(p, xi[None]).sum()))(x).pow(2).mean()

    step = sf.train_step(loss_fn, sf.optim.sgd(0.1), sf.mesh(dp=-1), mixed_precision=sf.MixedPrecision(param_dtype=torch.bfloat16))
    try:
        step(step.init(params), local_batch(global_batch("mlp", 0, 2), dist.get_rank(), 2))
        return "ran"
    except NotImplementedError as e:
        return str(e)


def rank_penalty_batchnorm() -> dict:
    """Lazy regularization on a model with BatchNorm: plain, penalty (the step that leaves the
    schedule runs loss_fn twice), plain. Parameters equal the unsharded model's; the running
    statistics are rank 0's, updated once per step, as a train step always keeps them."""
    import copy

    from torch import nn

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(7, 7), nn.BatchNorm1d(7), nn.Tanh()) for _ in range(2)], nn.Linear(7, 3))
    ref = copy.deepcopy(model)
    stats = copy.deepcopy(model)  # rank 0's forwards only: the statistics a train step keeps
    apply, params = sf.functionalize(model, units=r"\d+")

    def make_loss(app, penalty):
        def loss_fn(p, batch):
            x, y = batch
            x = x.detach().requires_grad_()
            out = app(p, x)
            loss = F.mse_loss(out, y)
            if penalty:
                (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
                loss = loss + gx.pow(2).mean()
            return loss

        return loss_fn

    step = sf.train_step(lambda p, b: make_loss(apply, b[2])(p, b[:2]), sf.optim.sgd(0.1, momentum=0.9), sf.mesh(dp=-1), apply=apply)
    state = step.init(params)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    functional = lambda m: lambda p, x: torch.func.functional_call(m, p, (x,))  # noqa: E731
    for i, penalty in enumerate([False, True, False]):
        batch = global_batch("mlp", i, world, per_rank=4)
        x, y = local_batch(batch, rank, world)
        state, _ = step(state, (x, y, penalty))
        opt.zero_grad()
        loss_ref = make_loss(functional(ref), penalty)
        p_ref = dict(ref.named_parameters())
        before = {k: v.detach().clone() for k, v in p_ref.items()}
        torch.stack([loss_ref(p_ref, c) for c in zip(batch[0].chunk(world), batch[1].chunk(world))]).mean().backward()
        opt.step()
        with torch.no_grad():  # rank 0's forward, with the parameters it ran with
            torch.func.functional_call(stats, before, (batch[0].chunk(world)[0],))
    got = sf.to_state_dict(sf.gather(state.params))
    want_buffers = dict(stats.named_buffers())
    return {"params": max(rel_err(got[k], v) for k, v in ref.named_parameters()),
            "buffers": max(rel_err(b.float(), want_buffers[k].float()) for k, b in model.named_buffers()),
            "off": step._off_schedule}


def test_lazy_regularization_with_batchnorm(pools):
    for out in pools(2).run(rank_penalty_batchnorm):
        assert out["off"] and out["params"] < 1e-5 and out["buffers"] < 1e-6, out


def rank_penalty_on_some_ranks() -> dict:
    """A penalty taken on some ranks only (it depends on the rank's data): every rank leaves the
    unit schedule on that step, and training equals the unsharded model's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    apply, params = sf.functionalize(make_model("mlp"), units=units_of("mlp"))

    def make_loss(app):
        def loss_fn(p, batch):
            x, y, take = batch
            x = x.detach().requires_grad_()
            out = app(p, x)
            loss = F.mse_loss(out, y)
            if bool(take):
                (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
                loss = loss + gx.pow(2).mean()
            return loss

        return loss_fn

    step = sf.train_step(make_loss(apply), sf.optim.sgd(0.1, momentum=0.9), sf.mesh(dp=-1), apply=apply)
    state = step.init(params)
    ref = optree.tree_map(lambda t: t.detach().clone().requires_grad_(), params)
    opt = torch.optim.SGD(optree.tree_leaves(ref), lr=0.1, momentum=0.9)
    offs = []
    for i, taker in enumerate([None, 0, None]):  # step 1: only rank 0 takes the penalty
        batch = global_batch("mlp", i, world)
        x, y = local_batch(batch, rank, world)
        state, _ = step(state, (x, y, torch.tensor(rank == taker)))
        offs.append(step._off_schedule)
        opt.zero_grad()
        chunks = zip(batch[0].chunk(world), batch[1].chunk(world), [torch.tensor(r == taker) for r in range(world)])
        torch.stack([make_loss(apply)(ref, c) for c in chunks]).mean().backward()
        opt.step()
    got = optree.tree_leaves(sf.gather(state.params))
    return {"offs": offs, "params": max(rel_err(a, b) for a, b in zip(got, optree.tree_leaves(ref)))}


@pytest.mark.parametrize("world", [2, 3])
def test_a_penalty_on_some_ranks_moves_every_rank(pools, world):
    for out in pools(world).run(rank_penalty_on_some_ranks):
        assert out["offs"] == [False, True, True] and out["params"] < 1e-5, out
