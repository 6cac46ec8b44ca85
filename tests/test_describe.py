"""`sf.describe`: the layout of a tree or a train state on each rank, as text and as HTML."""

from __future__ import annotations

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
    return {k: (str(d), d._repr_html_(), [(r.path, r.shape, r.spec, r.local_shape, r.nbytes, r.padding) for r in d.rows], d.totals)
            for k, d in out.items()}


def test_describe_a_tree_and_a_state(pools):
    res = pools(3).run(rank_describe)
    text, page, rows, totals = res[2]["tree"]
    # 5 rows over 3 ranks: chunks of 2, rank 2 holds 1 row and 1 row of padding.
    assert ("0.weight", (5, 7), "P('dp')", (1, 7), 28, 28) in rows, rows
    assert ("2.weight", (2, 5), "P('dp')", (0, 5), 0, 20) in rows, rows  # 2 rows: rank 2 holds none
    assert totals == {"params": sum(r[4] for r in rows)}
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
