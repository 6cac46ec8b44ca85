"""`sf.describe`: the layout of a tree or a train state on each rank, as text and as HTML."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardfn as sf
from reference import OPT, make_loss_fn, make_model, units_of


def rank_describe() -> dict:
    world = dist.get_world_size()
    model = make_model("mlp")  # 7x5, 5, 5x2, 2, 2x3, 3 parameters
    apply, params = sf.functionalize(model, units=units_of("mlp"))
    mesh = sf.mesh(dp=-1)
    tree = sf.shard(params, sf.specs(params, mesh), mesh)
    step = sf.train_step(make_loss_fn("mlp", apply), sf.optim.adamw(**OPT), mesh)
    state = step.init(params)
    hybrid = sf.mesh(replicate=2, shard=-1) if world == 4 else None
    out = {"tree": sf.describe(tree), "state": sf.describe(state)}
    if hybrid is not None:
        out["hybrid"] = sf.describe(sf.shard(params, sf.specs(params, hybrid, default=sf.P("shard")), hybrid))
        # 5 x 3 float32 leaves over two axes of one dim, in both orders, and over two dims.
        two = sf.mesh(a=2, b=2)
        leaves = {"ab": torch.ones(5, 3), "ba": torch.ones(5, 3), "dims": torch.ones(5, 3)}
        rules = [("ab", sf.P(("a", "b"))), ("ba", sf.P(("b", "a"))), ("dims", sf.P("a", "b"))]
        out["two"] = sf.describe(sf.shard(leaves, sf.specs(leaves, two, rules=rules), two))
    return {k: (str(d), d._repr_html_(), [(r.path, r.shape, r.spec, r.local_shape, r.nbytes, r.padding) for r in d.rows], d.totals)
            for k, d in out.items()}


def test_describe_a_tree_and_a_state(pools):
    res = pools(3).run(rank_describe)
    text, page, rows, totals = res[2]["tree"]
    # 5 rows over 3 ranks: chunks of 2, rank 2 holds 1 row and 1 row of padding.
    assert ("0.weight", (5, 7), "P('dp')", (1, 7), 28, 28) in rows, rows
    assert ("2.weight", (2, 5), "P('dp')", (0, 5), 0, 20) in rows, rows  # 2 rows: rank 2 holds none
    assert totals == {"params": sum(r[4] + r[5] for r in rows)}  # padding included: the same on every rank
    assert "mesh dp=3, rank 2" in text and "0.weight" in text and "P('dp')" in text
    assert "<table>" in page and "<td>0.weight</td>" in page
    text0, _, rows0, totals0 = res[0]["state"]
    assert ("0.weight", (5, 7), "P('dp')", (2, 7), 56, 0) in rows0, rows0
    # AdamW keeps two moments per parameter (and a step count).
    assert 2 * totals0["params"] <= totals0["optimizer state"] <= 2 * totals0["params"] + 64, totals0
    assert "total optimizer state on this rank" in text0


def test_describe_a_hybrid_mesh(pools):
    res = pools(4).run(rank_describe)
    text, _, rows, _ = res[3]["hybrid"]
    assert "mesh replicate=2 x shard=2, rank 3" in text, text
    assert ("0.weight", (5, 7), "P('shard')", (2, 7), 56, 28) in rows, rows  # 5 rows over 2 shards
    # Ranks are (a, b) = (r // 2, r % 2). P(("a", "b")): rows [0, 2), [2, 3), [3, 4), [4, 5), each
    # padded to 2 rows; P(("b", "a")): [0, 2), [3, 4), [2, 3), [4, 5); P("a", "b"): rows [0, 3) or
    # [3, 5) by a, columns [0, 2) or [2, 3) by b, padded to 3 x 2.
    per_rank = [{r[0]: r[3:] for r in res[k]["two"][2]} for k in range(4)]
    assert [p["ab"] for p in per_rank] == [((2, 3), 24, 0), ((1, 3), 12, 12), ((1, 3), 12, 12), ((1, 3), 12, 12)], per_rank
    assert [p["ba"] for p in per_rank] == [((2, 3), 24, 0), ((1, 3), 12, 12), ((1, 3), 12, 12), ((1, 3), 12, 12)], per_rank
    assert [p["dims"] for p in per_rank] == [((3, 2), 24, 0), ((3, 1), 12, 12), ((2, 2), 16, 8), ((2, 1), 8, 16)], per_rank
    assert [res[k]["two"][2][1][2] for k in range(4)] == ["P(('b', 'a'))"] * 4
    assert {res[k]["two"][3]["params"] for k in range(4)} == {72}  # 3 leaves x 24 B padded, on every rank
    assert "params on this rank, padding included: 72 B" in res[0]["two"][0]
