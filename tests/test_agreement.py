"""Ranks that build different initial weights hold one model (Note [one model] in shardfn/_agree.py).

An unseeded (here: per-rank seeded) build and pretrained weights loaded on rank 0 only, given to
`step.init`, `sf.shard` and `sf.import_state_dict`: by default every rank takes rank 0's values
(then trains as the single-process reference from them); `sync="check"` refuses on every rank,
naming leaves and ranks; meta-device init sends nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from shardfn import _agree
from shardfn import _collectives as C
from reference import OPT, Reference, compare_params, global_batch, local_batch, make_loss_fn, make_model, units_of
from shardfn.models import GPT
from reference import GPT_CFG


def _build(how: str, rank: int) -> torch.nn.Module:
    """`how` a rank builds the model: "seeded" (seed 0 everywhere), "per_rank" (seed 100 + rank,
    as an unseeded build), "rank0_load" (per-rank seeds, then rank 0 loads seed 0's weights)."""
    if how == "seeded":
        return make_model("gpt", 0)
    model = make_model("gpt", 100 + rank)
    if how == "rank0_load" and rank == 0:
        model.load_state_dict(make_model("gpt", 0).state_dict())
    return model


def _expected(how: str) -> torch.nn.Module:
    """The model every rank must end up holding: rank 0's."""
    return make_model("gpt", 100 if how == "per_rank" else 0)


def _exact(tree, apply, want: torch.nn.Module) -> list[str]:
    """The names whose gathered values differ from `want`'s (exactly)."""
    full = sf.to_state_dict(sf.gather(tree), apply)
    ref = want.state_dict()
    return [n for n in ref if not torch.equal(full[n], ref[n])]


def _differ(ranks: list[int], ref: int) -> str:
    """How a refusal names the ranks that differ from their reference."""
    return f"rank {ranks[0]} differs from rank {ref}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} differ from rank {ref}"


def _refusal(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _mesh(strategy: str, world: int):
    if strategy == "hybrid_shard":
        return sf.mesh(replicate=2, shard=world // 2)
    if strategy == "tp":
        return sf.mesh(dp=2, tp=world // 2)
    return sf.mesh(dp=-1)


def _step(strategy: str, apply, mesh, params):
    kw = {} if strategy == "tp" else {"strategy": strategy}
    specs = sf.specs(params, mesh, rules=sf.rules.GPT, default=sf.P("dp")) if strategy == "tp" else None
    return sf.train_step(make_loss_fn("gpt", apply), sf.optim.adamw(**OPT), mesh, specs=specs, **kw)


def rank_train_step_agrees(strategies: list[str]) -> dict:
    """step.init under each strategy: rank 0's values on every rank (exact), then two steps as the
    reference from them; "check" refuses a per-rank build and passes a seeded one; None sends nothing."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    for strategy in strategies:
        mesh = _mesh(strategy, world)
        data_world = mesh.size(0) if strategy == "tp" else world
        data_rank = mesh.get_local_rank(0) if strategy == "tp" else rank
        for how in ("per_rank", "rank0_load"):
            model = _build(how, rank)
            apply, params = sf.functionalize(model, units=units_of("gpt"))
            step = _step(strategy, apply, mesh, params)
            C.STATS.reset()
            state = step.init(params)
            out[strategy, how, "broadcasts"] = C.STATS.calls.get("broadcast", 0)
            out[strategy, how, "differ"] = _exact(state.params, apply, _expected(how))
            if how == "rank0_load":  # trains as one process from the pretrained weights
                ref = Reference(_expected(how), "gpt")
                for i in range(2):
                    batch = global_batch("gpt", i, data_world)
                    ref.step(batch)
                    state, _ = step(state, local_batch(batch, data_rank, data_world))
                out[strategy, how, "train_err"] = compare_params(state.params, apply, ref)
        model = _build("per_rank", rank)
        apply, params = sf.functionalize(model, units=units_of("gpt"))
        out[strategy, "check"] = _refusal(lambda: _step(strategy, apply, mesh, params).init(params, sync="check"))
        model = _build("seeded", rank)
        apply, params = sf.functionalize(model, units=units_of("gpt"))
        C.STATS.reset()
        state = _step(strategy, apply, mesh, params).init(params, sync="check")
        out[strategy, "check_passes"] = _exact(state.params, apply, _expected("seeded"))
        out[strategy, "check_sends"] = C.STATS.calls.get("broadcast", 0)
        C.STATS.reset()
        _step(strategy, apply, mesh, params).init(params, sync=None)
        out[strategy, "none_calls"] = dict(C.STATS.calls)
    return out


def _check_train_step(results: list[dict], strategies: list[str], world: int) -> None:
    for rank, r in enumerate(results):
        for strategy in strategies:
            for how in ("per_rank", "rank0_load"):
                assert r[strategy, how, "differ"] == [], (rank, strategy, how, r[strategy, how, "differ"])
                assert r[strategy, how, "broadcasts"] >= 1, (strategy, how, r)  # the model is small: a bucket per group
            assert r[strategy, "rank0_load", "train_err"] < 1e-5, (strategy, r)
            msg = r[strategy, "check"]
            assert msg is not None and "sync='check'" in msg and "blocks.0." in msg, (strategy, msg)
            assert _differ(list(range(1, world)), 0) in msg, (strategy, msg)
            assert "sync='broadcast'" in msg, msg  # the fix
            assert r[strategy, "check_passes"] == [] and r[strategy, "check_sends"] == 0, (strategy, r)
            assert "broadcast" not in r[strategy, "none_calls"] and "all_gather_object" not in r[strategy, "none_calls"], r
        assert all(x == results[0][k] for k, x in r.items() if k[-1] == "check"), "the refusal is the same on every rank"


@pytest.mark.parametrize("world", [2, 3])
def test_train_step_init_gives_every_rank_rank0s_model(pools, world):
    strategies = ["full_shard", "no_shard"]
    _check_train_step(pools(world).run(rank_train_step_agrees, strategies), strategies, world)


def test_train_step_init_agrees_under_hybrid_and_tensor_parallel(pools):
    strategies = ["hybrid_shard", "tp"]
    results = pools(4).run(rank_train_step_agrees, strategies)
    _check_train_step(results, strategies, 4)


def rank_shard_agrees() -> dict:
    """sf.shard: rank 0's values by default, bucketed; "check" refuses; a tree of other shapes on
    one rank is refused on every rank; meta init broadcasts nothing and stays exact."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = sf.mesh(dp=-1)
    out: dict = {}
    for how in ("per_rank", "rank0_load"):
        model = _build(how, rank)
        apply, params = sf.functionalize(model)
        for default in (sf.P("dp"), sf.P()):
            specs = sf.specs(params, mesh, default=default)
            C.STATS.reset()
            sharded = sf.shard(params, specs, mesh)
            out[how, str(default), "calls"] = C.STATS.calls.get("broadcast", 0)
            out[how, str(default), "differ"] = _exact(sharded, apply, _expected(how))
        out[how, "check"] = _refusal(lambda: sf.shard(params, sf.specs(params, mesh), mesh, sync="check"))
    # Buckets: one broadcast per bucket of at most BUCKET_BYTES, a larger leaf alone; exact.
    model = _build("per_rank", rank)
    apply, params = sf.functionalize(model)
    big = sum(x.numel() * x.element_size() > 1024 for x in params_leaves(params))  # at least one bucket each
    cap, _agree.BUCKET_BYTES = _agree.BUCKET_BYTES, 2048
    try:
        C.STATS.reset()
        sharded = sf.shard(params, sf.specs(params, mesh), mesh)
        out["small_buckets"] = (C.STATS.calls.get("broadcast", 0), big, len(params_leaves(params)))
        out["small_buckets_differ"] = _exact(sharded, apply, _expected("per_rank"))
    finally:
        _agree.BUCKET_BYTES = cap
    # Other shapes on one rank: a ValueError on every rank, before anything is sent.
    odd = {"w": torch.zeros(4 + (rank == 1), 3), "b": torch.zeros(2)}
    out["structure"] = _refusal(lambda: sf.shard(odd, sf.specs(odd, mesh), mesh))
    out["bad_sync"] = _refusal(lambda: sf.shard(odd, sf.specs(odd, mesh), mesh, sync="rank0"))
    # Values no float compares equal (NaN) agree bitwise; dtypes of every width travel.
    torch.manual_seed(rank)
    mixed = {"nan": torch.full((3,), float("nan")), "h": torch.randn(7).half(), "b": torch.randn(4).bfloat16(),
             "c": torch.randn(3, dtype=torch.complex128), "s": torch.tensor(2.0 + rank)}
    got = sf.gather(sf.shard(mixed, sf.specs(mixed, mesh), mesh))
    out["mixed"] = got["h"].tolist() + got["b"].tolist() + got["c"].real.tolist() + [got["s"].item()]
    alike = {"nan": mixed["nan"], "zeros": torch.tensor([-0.0, 0.0]), "d": torch.arange(3.0).double()}
    out["mixed_check"] = _refusal(lambda: sf.shard(alike, sf.specs(alike, mesh), mesh, sync="check"))
    # Meta-device init: each rank fills its own shards from rank 0's recorded generator state; nothing is broadcast.
    torch.manual_seed(0)
    with sf.meta_device():
        meta_model = GPT(GPT_CFG)
    apply, params = sf.functionalize(meta_model)
    C.STATS.reset()
    sharded = sf.shard(params, sf.specs(params, mesh), mesh, init=meta_model)
    out["meta_calls"] = C.STATS.calls.get("broadcast", 0)
    out["meta_differ"] = _exact(sharded, apply, make_model("gpt", 0))
    torch.manual_seed(0)
    with sf.meta_device():
        meta_model = GPT(GPT_CFG)
    apply, params = sf.functionalize(meta_model, units=units_of("gpt"))
    C.STATS.reset()
    state = _step("full_shard", apply, mesh, params).init(params)
    out["meta_init_calls"] = {k: v for k, v in C.STATS.calls.items() if k in ("broadcast", "all_reduce")}
    out["meta_init_differ"] = _exact(state.params, apply, make_model("gpt", 0))
    return out


def params_leaves(params) -> list[torch.Tensor]:
    import optree

    return optree.tree_leaves(params)


def _rank0_mixed() -> list:
    """`rank_shard_agrees`'s `mixed` values as rank 0 draws them (its seed is its rank)."""
    torch.manual_seed(0)
    h, b, c = torch.randn(7).half(), torch.randn(4).bfloat16(), torch.randn(3, dtype=torch.complex128)
    return h.tolist() + b.tolist() + c.real.tolist() + [2.0]


@pytest.mark.parametrize("world", [2, 3])
def test_shard_gives_every_rank_rank0s_values(pools, world):
    results = pools(world).run(rank_shard_agrees)
    for r in results:
        for how in ("per_rank", "rank0_load"):
            for default in ("P('dp')", "P()"):
                assert r[how, default, "differ"] == [], (how, default, r)
                assert r[how, default, "calls"] == 1, (how, default, r)  # one bucket for the whole small model
            assert _differ(list(range(1, world)), 0) in r[how, "check"] and "sync='check'" in r[how, "check"], r[how, "check"]
        calls, big, leaves = r["small_buckets"]
        assert big // 2 <= calls <= leaves and calls > 1 and r["small_buckets_differ"] == [], r
        assert "different trees" in r["structure"] and "rank 1" in r["structure"] and "w (5, 3)" in r["structure"], r["structure"]
        assert "sync='rank0'" in r["bad_sync"] and "'check'" in r["bad_sync"], r["bad_sync"]
        assert r["mixed"] == _rank0_mixed(), "rank 0's values of every dtype"
        # NaNs and signed zeros agree bitwise: nothing differs
        assert r["mixed_check"] is None, r["mixed_check"]
        assert r["meta_calls"] == 0 and r["meta_differ"] == [], r
        # step.init: neither leaves nor replayed buffers sent; one small all-reduce of its options
        assert r["meta_init_calls"] == {"all_reduce": 1} and r["meta_init_differ"] == [], r
    assert len({tuple(r["mixed"]) for r in results}) == 1


def rank_import_agrees(layout: str) -> dict:
    """sf.import_state_dict from sources that differ by rank (a dict built per rank): the ranks
    that hold the same rows (no_shard's replicas, tp peers) take the first one's; "check" refuses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _build("seeded", rank)
    apply, params = sf.functionalize(model, units=units_of("gpt"))
    strategy = "tp" if layout == "tp" else layout
    mesh = _mesh(strategy, world)
    step = _step(strategy, apply, mesh, params)
    state = step.init(params)
    source = make_model("gpt", 100 + rank).state_dict()
    out: dict = {}
    out["check"] = _refusal(lambda: sf.import_state_dict(source, like=state, sync="check"))
    sf.import_state_dict(source, like=state)
    full = sf.to_state_dict(sf.gather(state.params), apply)
    # every leaf read whole (replicated) takes rank 0's file; a tp-split or dp-sharded one holds each rank's rows
    out["values"] = {n: v.sum().item() for n, v in full.items()}
    if layout == "no_shard":
        out["differ"] = _exact(state.params, apply, make_model("gpt", 100))
    return out


def test_import_state_dict_agrees_on_replicated_rows(pools):
    for world in (2, 3):
        results = pools(world).run(rank_import_agrees, "no_shard")
        for r in results:
            assert r["differ"] == [], r["differ"]
            assert r["check"] is not None and _differ(list(range(1, world)), 0) in r["check"] and "the same source" in r["check"], r["check"]
    results = pools(4).run(rank_import_agrees, "tp")
    for r in results:
        assert r["values"] == results[0]["values"], "every rank gathers one model"
        assert "rank 1 differs from rank 0; rank 3 differs from rank 2" in r["check"], r["check"]


def rank_other_layout_on_one_rank() -> dict:
    """Rank 0 steps under hybrid_shard on (replicate=1, shard=W), the others under full_shard on
    (dp=W): step.init names the settings that differ; and one leaf's spec whole on rank 1 only, in
    step.init and in sf.shard."""
    torch.manual_seed(0)
    apply, params = sf.functionalize(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)), units=r"\d")
    if dist.get_rank() == 0:
        step = sf.train_step(lambda p, b: apply(p, b).sum(), sf.optim.sgd(0.1), sf.mesh(replicate=1, shard=-1), strategy="hybrid_shard")
    else:
        step = sf.train_step(lambda p, b: apply(p, b).sum(), sf.optim.sgd(0.1), sf.mesh(dp=-1))
    out = {}
    try:
        step.init(params)
        out["step"] = "not refused"
    except ValueError as e:
        out["step"] = str(e)
    mesh = sf.mesh(dp=-1)
    specs = sf.specs(params, mesh, default=sf.P("dp"))
    if dist.get_rank() == 1:
        specs["0"]["weight"] = sf.P()  # whole on every rank, where rank 0 shards it
    step = sf.train_step(lambda p, b: apply(p, b).sum(), sf.optim.sgd(0.1), mesh, specs=specs)
    try:
        step.init(params)
        out["step specs"] = "not refused"
    except ValueError as e:
        out["step specs"] = str(e)
    try:
        sf.shard(params, specs, mesh)
        out["shard"] = "not refused"
    except ValueError as e:
        out["shard"] = str(e)
    return out


def test_ranks_that_lay_the_model_out_differently_are_told_how(pools):
    for r in pools(2).run(rank_other_layout_on_one_rank):
        assert "different settings" in r["step"] and "strategy: rank 0 has 'hybrid_shard', rank 1 has 'full_shard'" in r["step"], r
        for call in ("step specs", "shard"):
            assert "different settings: specs['0.weight']: rank 0 has P('dp'), rank 1 has P()" in r[call], r


def rank_an_option_on_one_rank() -> dict:
    """A step option set on rank 1 only (clipping, frozen leaves): refused at step.init, naming it;
    the same options pass."""
    torch.manual_seed(0)
    apply, params = sf.functionalize(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)), units=r"\d")
    one = dist.get_rank() == 1
    out = {}
    for name, kw in (("clip", dict(max_grad_norm=0.1 if one else None)), ("frozen", dict(frozen=r"0\..*" if one else None)),
                     ("same", dict(max_grad_norm=1.0, frozen=r"1\..*"))):
        step = sf.train_step(lambda p, b: apply(p, b).sum(), sf.optim.sgd(0.1), sf.mesh(dp=-1), strategy="no_shard", **kw)
        try:
            step.init(params)
            out[name] = "not refused"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_a_step_option_set_on_some_ranks_only_is_refused(pools):
    for r in pools(2).run(rank_an_option_on_one_rank):
        assert "different settings: max_grad_norm: rank 0 has None, rank 1 has 0.1" in r["clip"], r
        assert "frozen: rank 0 has None, rank 1 has '0\\\\..*'" in r["frozen"], r
        assert r["same"] == "not refused", r
