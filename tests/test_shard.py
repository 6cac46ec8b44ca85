"""shard / gather on real ranks, and apply on a sharded tree (inference unit by unit)."""

from __future__ import annotations

import contextlib
import copy
import re
import warnings

import optree
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

import shardfn as sf
from shardfn import _collectives as C
from reference import GPT_CFG, make_model, rel_err
from shardfn.models import GPT


def rank_shard_gather() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    params = {"w": torch.randn(5, 7), "b": torch.randn(2), "n": torch.randn(7), "s": torch.randn(())}
    mesh = sf.mesh(dp=-1)
    specs = sf.specs(params, mesh, rules=[(r"n", sf.P())])
    sharded = sf.shard(params, specs, mesh)
    chunk = -(-5 // world)
    out = {
        "types": all(isinstance(x, DTensor) for x in sharded.values()),
        "w_local": tuple(sharded["w"].to_local().shape),
        "w_want": (max(0, min(5 - rank * chunk, chunk)), 7),
        "b_local": tuple(sharded["b"].to_local().shape),
        "placements": (sharded["w"].placements, sharded["n"].placements, sharded["s"].placements),
    }
    full = sf.gather(sharded)
    out["gather_exact"] = all(torch.equal(full[k], params[k]) for k in params)
    out["plain"] = all(type(v) is torch.Tensor for v in full.values())

    # Outside autograd, a tree's leaves are gathered together: one all-gather per mesh and dtype for
    # the leaves split on one dim (even, uneven, empty shards; dims 0, 1, 2), one per other leaf.
    many = {"a": torch.randn(7, 5), "b": torch.randn(2, 3), "c": torch.randn(3, 11), "d": torch.randn(4, 2, 9),
            "e": torch.randn(0, 4), "f": torch.randn(1), "g": torch.randn(13).double(), "h": torch.randn(5).double(),
            "i": torch.randn(6).bfloat16(), "r": torch.randn(3), "s": [torch.randn(5, 2), None]}
    specs = {"a": sf.P("dp"), "b": sf.P("dp"), "c": sf.P(None, "dp"), "d": sf.P(None, None, "dp"), "e": sf.P("dp"),
             "f": sf.P("dp"), "g": sf.P("dp"), "h": sf.P("dp"), "i": sf.P("dp"), "r": sf.P(), "s": [sf.P("dp"), None]}
    sharded_many = sf.shard(many, specs, mesh)
    C.STATS.reset()
    full = sf.gather(sharded_many)
    out["together_calls"] = C.STATS.calls.get("all_gather")
    flat, want = optree.tree_leaves(full), optree.tree_leaves(many)
    out["together_exact"] = len(flat) == len(want) and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(flat, want))
    out["together_as_one_by_one"] = all(torch.equal(a, b.full_tensor()) for a, b in zip(flat, optree.tree_leaves(sharded_many)))
    cap, C.GATHER_BUCKET_BYTES = C.GATHER_BUCKET_BYTES, 1  # every leaf over the cap: one collective each
    try:
        C.STATS.reset()
        split = optree.tree_leaves(sf.gather(sharded_many))
        out["split_calls"] = C.STATS.calls.get("all_gather")
        out["split_exact"] = all(torch.equal(a, b) for a, b in zip(split, want))
    finally:
        C.GATHER_BUCKET_BYTES = cap
    # Ranks that differ in grad mode issue the same collectives (and get the same values).
    leaves = {k: v.detach().requires_grad_() for k, v in sharded.items()}
    with torch.no_grad() if rank == 0 else contextlib.nullcontext():
        mixed = sf.gather(leaves)
    out["mixed_modes"] = all(torch.equal(mixed[k], params[k]) for k in params)

    # The gradient of gather is the reduce-scatter of the mean over ranks: rank r weights the loss
    # by (r + 1), and the gradient is that of the mean of the ranks' losses.
    leaves = {k: v.detach().requires_grad_() for k, v in sharded.items()}
    g = sf.gather(leaves)
    loss = (rank + 1) * sum((g[k] * params[k]).sum() for k in g)
    loss.backward()
    factor = (world + 1) / 2
    errs = []
    for k in params:
        grad = leaves[k].grad
        assert isinstance(grad, DTensor) and grad.placements == leaves[k].placements
        errs.append(rel_err(grad.full_tensor(), factor * params[k]))
    out["grad_err"] = max(errs)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_shard_and_gather(pools, world):
    for r in pools(world).run(rank_shard_gather):
        assert r["types"] and r["plain"] and r["gather_exact"], r
        assert r["w_local"] == r["w_want"], r
        assert r["placements"] == ((Shard(0),), (Replicate(),), (Replicate(),)), r
        assert r["grad_err"] < 1e-6, r
        # float32 packed (a-f, s) + float64 packed (g, h) + bfloat16 alone (i) + replicated alone (r)
        assert r["together_exact"] and r["together_as_one_by_one"] and r["together_calls"] == 4, r
        assert r["split_exact"] and r["split_calls"] == 11 and r["mixed_modes"], r
    if world == 3:  # b has 2 rows: rank 2 holds an empty shard
        assert [r["b_local"] for r in pools(world).run(rank_shard_gather)] == [(1,), (1,), (0,)]


def rank_gather_2d() -> dict:
    """`sf.gather` on a (dp=2, tp=2) mesh: one packed all-gather per mesh dim and dtype, exact."""
    from torch.distributed.tensor import distribute_tensor

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = sf.mesh(dp=2, tp=world // 2)
    torch.manual_seed(0)
    full = {"a": torch.randn(7, 5), "b": torch.randn(3, 11), "c": torch.randn(5, 9), "d": torch.randn(4, 2, 9).double(),
            "e": torch.randn(1, 3), "r": torch.randn(3), "x": torch.randn(6, 6)}
    placements = {"a": (Shard(0), Replicate()), "b": (Replicate(), Shard(1)), "c": (Shard(0), Shard(1)),
                  "d": (Shard(2), Shard(0)), "e": (Shard(1), Shard(0)), "r": (Replicate(), Replicate()),
                  "x": (Shard(0), Shard(0))}  # x: a dim split twice, gathered by DTensor itself
    tree = {k: distribute_tensor(v, mesh, placements[k]) for k, v in full.items()}
    C.STATS.reset()
    got = sf.gather(tree)
    out = {"calls": C.STATS.calls.get("all_gather"), "exact": all(torch.equal(got[k], full[k]) for k in full),
           "as_one_by_one": all(torch.equal(got[k], tree[k].full_tensor()) for k in full)}
    # The gradient is that of the mean over ranks (rank r weights its loss by r + 1).
    leaves = {k: v.detach().requires_grad_() for k, v in tree.items()}
    g = sf.gather(leaves)
    ((rank + 1) * sum((g[k] * full[k]).sum() for k in g)).backward()
    out["grad_err"] = max(rel_err(leaves[k].grad.full_tensor(), (world + 1) / 2 * full[k]) for k in full)
    # Split only over a mesh dim of one rank: nothing to gather, and the leaf's own local tensor is
    # neither handed out nor marked by autograd.
    one = distribute_tensor(full["a"], sf.mesh(dp=1, tp=world), (Shard(0), Replicate())).requires_grad_()
    whole = sf.gather({"a": one, "b": tree["b"]})["a"]
    out["one_rank_dim"] = (torch.equal(whole, full["a"]), whole is not one._local_tensor, one._local_tensor.grad_fn is None)
    return out


def test_gather_on_a_2d_mesh_packs_each_mesh_dim(pools):
    for r in pools(4).run(rank_gather_2d):
        # over tp: float32 (b, c, e) + float64 (d); over dp: float32 (a, c, e) + float64 (d); x and r alone
        assert r["exact"] and r["as_one_by_one"] and r["calls"] == 6, r
        assert r["grad_err"] < 1e-6, r
        assert all(r["one_rank_dim"]), r["one_rank_dim"]


def rank_sharded_apply() -> dict:
    model = make_model("gpt")
    twin = make_model("gpt")
    apply, params = sf.functionalize(model, units=r"blocks\.\d+")
    mesh = sf.mesh(dp=-1)
    sharded = sf.shard(params, sf.specs(params, mesh), mesh)
    del params
    x = torch.randint(0, GPT_CFG.vocab, (2, 8), generator=torch.Generator().manual_seed(3))
    calls = []
    orig = DTensor.full_tensor

    def counted(self, *a, **k):
        calls.append(self.shape)
        return orig(self, *a, **k)

    live = []

    def spy(mod, args):
        # While block 1 runs, block 0's full parameters are gone.
        rt = apply.info.runtime
        live.append(sum(u.buf.untyped_storage().nbytes() > 0 for k, u in rt.units.items() if k >= 0))

    h = model.blocks[1].register_forward_pre_hook(spy)
    DTensor.full_tensor = counted
    try:
        with torch.no_grad():
            out = apply(sharded, x)
    finally:
        DTensor.full_tensor = orig
        h.remove()
    return dict(err=rel_err(out, twin(x)), gathers=len(calls), leaves=len(sf.tree_paths(sharded)), live=live)


def test_apply_on_sharded_tree_gathers_unit_by_unit(pools):
    for r in pools(2).run(rank_sharded_apply):
        assert r["err"] < 1e-6, r
        assert r["gathers"] == r["leaves"], r  # every leaf gathered once
        assert r["live"] == [1], r  # only the running block is held in full


class _TiedByHand(torch.nn.Module):
    """A model that reads units' parameters outside their forward: a head tied by hand to an
    embedding that is a unit, another method of that unit, and a block's weight after it ran."""

    class Emb(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(13, 6))

        def forward(self, ids):
            return torch.nn.functional.embedding(ids, self.weight)

        def attend(self, h):
            return h @ self.weight.T

    def __init__(self):
        super().__init__()
        self.emb = self.Emb()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(6, 6) for _ in range(2)])

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        h = h + h @ self.blocks[0].weight  # block 0's weight, after its forward
        return torch.nn.functional.linear(h, self.emb.weight) + self.emb.attend(h)


def rank_sharded_apply_reads_outside_units() -> dict:
    torch.manual_seed(0)
    model = _TiedByHand()
    apply, params = sf.functionalize(model, units=[r"emb", r"blocks\.\d+"])
    mesh = sf.mesh(dp=-1)
    sharded = sf.shard(params, sf.specs(params, mesh), mesh)
    ids = torch.randint(0, 13, (2, 5), generator=torch.Generator().manual_seed(1))
    out = {}
    try:
        with torch.no_grad():
            apply(sharded, ids)
        out["error"] = "NO ERROR"
    except ValueError as e:
        out["error"] = str(e)
    with torch.no_grad():  # gathered whole, it runs
        out["gathered"] = rel_err(apply(sf.gather(sharded), ids), _twin_of_tied(ids))
    # nn.TransformerEncoder in eval takes its fast path (nested tensors: zeros at padded positions)
    # after checking its first layer's weights, read outside that layer's unit: sharded, the same.
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    twin = copy.deepcopy(enc)
    apply, params = sf.functionalize(enc, units=r"layers\.\d+")
    sharded = sf.shard(params, sf.specs(params, mesh), mesh)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
    with torch.no_grad():
        out["encoder"] = rel_err(apply(sharded, x, src_key_padding_mask=pad), twin(x, src_key_padding_mask=pad))
    return out


def _twin_of_tied(ids):
    torch.manual_seed(0)
    return _TiedByHand()(ids)


def test_apply_on_a_sharded_tree_reading_units_outside_their_forward(pools):
    """Note [reads outside a unit, in inference] in `shardfn/_inference.py`: a read of a unit's
    parameter outside its forward is a `ValueError` saying what to do (it was torch's "setStorage
    ... of size 0"); code that branches on tensor subclasses takes the module's own path."""
    for r in pools(3).run(rank_sharded_apply_reads_outside_units):
        assert "read a unit's parameter outside that unit's forward" in r["error"], r["error"]
        assert "apply(sf.gather(tree), ...)" in r["error"], r["error"]
        assert r["gathered"] < 1e-6 and r["encoder"] < 1e-6, r


# Layouts the spec language can say, on the GPT's leaves (dims 53, 35, 105, 140, 8: uneven at 2,
# 3 and 4 shards). On (dp, tp): axes against mesh order (("tp", "dp")), over two dims, and mixed.
LAYOUTS = {
    1: [
        (r"wte\.weight", sf.P(None, "dp")),
        (r".*qkv\.weight", sf.P(("dp",), None)),
        (r".*ln1.*", sf.P()),
        (r".*proj\.weight", sf.P(None, "dp")),
    ],
    2: [
        (r"wte\.weight", sf.P(("tp", "dp"), None)),
        (r"wpe\.weight", sf.P(None, ("tp", "dp"))),
        (r".*qkv\.weight", sf.P("tp", None)),
        (r".*qkv\.bias", sf.P(("tp", "dp"))),
        (r".*proj\.weight", sf.P(None, "tp")),
        (r".*fc\.weight", sf.P("dp", "tp")),
        (r".*fc\.bias", sf.P(("dp", "tp"))),
        (r".*out\.weight", sf.P("tp", "dp")),
        (r".*ln1.*", sf.P()),
        (r".*ln2\.weight", sf.P("tp")),
    ],
}


def layout_mesh():
    return sf.mesh(dp=2, tp=2) if dist.get_world_size() == 4 else sf.mesh(dp=-1)


def rank_layouts() -> dict:
    from torch.func import grad, jacrev, jvp, vjp, vmap

    from shardfn._spec import local_slices

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = layout_mesh()
    model, twin = make_model("gpt"), make_model("gpt")
    apply, params = sf.functionalize(model, units=r"blocks\.\d+")
    specs = sf.specs(params, mesh, rules=LAYOUTS[mesh.ndim])
    sharded = sf.shard(params, specs, mesh)
    paths = sf.tree_paths(params)
    flat = dict(zip(paths, optree.tree_leaves(params)))
    spec_of = dict(zip(paths, optree.tree_leaves(specs, is_leaf=lambda x: isinstance(x, sf.P))))
    dts = dict(zip(paths, optree.tree_leaves(sharded)))
    out: dict = {"specs": {p: repr(s) for p, s in spec_of.items()}, "local": {}, "bad": []}

    def check(what: str, got, want, exact: bool = True) -> None:
        if not (got.shape == want.shape and (torch.equal(got, want) if exact else rel_err(got, want) < 1e-6)):
            out["bad"].append(what)

    for p, d in dts.items():
        box = local_slices(spec_of[p], mesh, d.shape)
        out["local"][p] = [(b.start, b.stop) for b in box]
        check(f"shard {p}", d.to_local(), flat[p][box])
        (chunk,) = d.__create_chunk_list__()  # where torch.distributed.checkpoint puts the shard
        if list(chunk.offsets) != [b.start for b in box] or list(chunk.sizes) != [b.stop - b.start for b in box]:
            out["bad"].append(f"chunk {p}")
        check(f"full_tensor {p}", d.full_tensor(), flat[p])
    full = sf.gather(sharded)
    for p, x in zip(paths, optree.tree_leaves(full)):
        check(f"gather {p}", x, flat[p])

    # The gradient of gather: the mean over ranks, laid out as the leaf.
    leaves = optree.tree_map(lambda x: x.detach().requires_grad_(), sharded)
    g = sf.gather(leaves)
    loss = (rank + 1) * sum((a * b).sum() for a, b in zip(optree.tree_leaves(g), optree.tree_leaves(params)))
    loss.backward()
    factor = (world + 1) / 2
    for p, x in zip(paths, optree.tree_leaves(leaves)):
        if x.grad.placements != dts[p].placements:
            out["bad"].append(f"grad placements {p}")
        check(f"grad {p}", x.grad.to_local(), (factor * flat[p])[local_slices(spec_of[p], mesh, x.shape)], exact=False)
    # torch.func.grad (same data on every rank: the unsharded gradient), vjp (same cotangent on
    # every rank: the cotangent itself), jvp, jacrev, vmap.
    gs = grad(lambda t: sum((a * b).sum() for a, b in zip(optree.tree_leaves(sf.gather(t)), optree.tree_leaves(params))))(sharded)
    for p, x in zip(paths, optree.tree_leaves(gs)):
        if x.placements != dts[p].placements:
            out["bad"].append(f"func.grad placements {p}")
        check(f"func.grad {p}", x.full_tensor(), flat[p], exact=False)
    _, pull = vjp(sf.gather, sharded)
    (cot,) = pull(params)
    for p, x in zip(paths, optree.tree_leaves(cot)):
        check(f"vjp {p}", x.full_tensor(), flat[p], exact=False)
    tangents = sf.shard(optree.tree_map(lambda x: x * 0 + 1, params), specs, mesh)
    with warnings.catch_warnings():  # forward AD's first use in a process loads torch's jvp decompositions,
        warnings.simplefilter("ignore", DeprecationWarning)  # which call the deprecated torch.jit.script
        _, dot = jvp(lambda t: sum((x * x).sum() for x in optree.tree_leaves(sf.gather(t))), (sharded,), (tangents,))
    out["jvp"] = rel_err(dot, 2 * sum(x.sum() for x in flat.values()))
    scale = torch.arange(1.0, 106.0)
    jac = jacrev(lambda t: (sf.gather(t)["blocks"]["0"]["attn"]["qkv"]["bias"] * scale)[:4])(sharded)
    j = jac["blocks"]["0"]["attn"]["qkv"]["bias"]
    check("jacrev", j.full_tensor(), torch.eye(4, 105) * scale)
    xs = torch.randn(3, 35)
    w = flat["blocks.0.fc.weight"]
    check("vmap", vmap(lambda x: sf.gather(sharded)["blocks"]["0"]["fc"]["weight"] @ x)(xs), vmap(lambda x: w @ x)(xs))

    # apply on the sharded tree, unit by unit, against the unsharded model.
    x = torch.randint(0, GPT_CFG.vocab, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out["apply"] = rel_err(apply(sharded, x), twin(x))

    # A sharded tree resharded to P("dp") and back (sf.shard of DTensors: DTensor's redistribute).
    plain = sf.shard(sharded, sf.specs(params, mesh), mesh)
    back = sf.shard(plain, specs, mesh)
    for p, x, y in zip(paths, optree.tree_leaves(plain), optree.tree_leaves(back)):
        check(f"reshard {p}", x.to_local(), flat[p][local_slices(sf.P("dp"), mesh, x.shape)])
        check(f"reshard back {p}", y.to_local(), dts[p].to_local())
    if mesh.ndim == 2:  # another mesh: refused, naming the leaf and the way through full values
        other = sf.mesh(dp=-1)
        try:
            sf.shard(sharded, sf.specs(params, other), other)
            out["bad"].append("reshard to another mesh")
        except ValueError as e:
            if not re.search(r"leaf '[\w.]+' is sharded over another mesh", str(e)) or "sf.gather(tree)" not in str(e):
                out["bad"].append(f"reshard to another mesh: {e}")

    # Meta-device init straight into every layout.
    torch.manual_seed(0)
    with sf.meta_device():
        lazy = GPT(GPT_CFG)
    _, meta_params = sf.functionalize(lazy, units=r"blocks\.\d+")
    built = sf.shard(meta_params, specs, mesh, init=lazy)
    for p, x in zip(paths, optree.tree_leaves(built)):
        if x.placements != dts[p].placements:
            out["bad"].append(f"meta placements {p}")
        check(f"meta {p}", x.to_local(), dts[p].to_local())
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_layout_shard_gather_transforms_apply(pools, world):
    res = pools(world).run(rank_layouts)
    for r in res:
        assert r["bad"] == [], r["bad"]
        assert r["jvp"] < 1e-6 and r["apply"] < 1e-6, r
    if world == 4:  # the spec's nested split, first axis major: ranks are (dp, tp) = (r // 2, r % 2)
        specs = res[0]["specs"]
        assert specs["wte.weight"] == "P(('tp', 'dp'), None)" and specs["blocks.0.fc.weight"] == "P('dp', 'tp')"
        # 53 rows: tp halves of 27 and 26 rows, each cut in two by dp.
        assert [r["local"]["wte.weight"][0] for r in res] == [(0, 14), (27, 40), (14, 27), (40, 53)]
        assert [r["local"]["blocks.0.fc.bias"][0] for r in res] == [(0, 35), (35, 70), (70, 105), (105, 140)]
        assert [r["local"]["blocks.0.out.weight"] for r in res] == [[(0, 18), (0, 70)], [(18, 35), (0, 70)], [(0, 18), (70, 140)], [(18, 35), (70, 140)]]


def test_shard_inside_a_torch_func_transform_is_refused():
    """`sf.shard` makes new leaves: inside `torch.func.grad` it raised torch's internal
    "requires_grad_() inside a functorch transform"; now shardfn says what to do instead."""
    mesh = sf.mesh(dp=-1)
    w = torch.randn(4, 3)

    def f(w):
        return sf.gather(sf.shard({"w": w}, {"w": sf.P("dp")}, mesh))["w"].sum()

    with pytest.raises(NotImplementedError, match="sf.shard inside a torch.func transform"):
        torch.func.grad(f)(w)
