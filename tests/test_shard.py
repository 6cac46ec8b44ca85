"""shard / gather on real ranks, and apply on a sharded tree (inference unit by unit)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

import shardfn as sf
from reference import GPT_CFG, make_model, rel_err


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
    if world == 3:  # b has 2 rows: rank 2 holds an empty shard
        assert [r["b_local"] for r in pools(world).run(rank_shard_gather)] == [(1,), (1,), (0,)]


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
