"""The train step: parity with a single-process reference, collectives per step, memory behaviour."""

from __future__ import annotations

import contextlib
import copy
import re

import optree
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

import shardfn as sf
from shardfn import _collectives as C
from shardfn import _flat
from shardfn._tree import tree_flatten_with_paths
from reference import OPT, Reference, backward_on_another_thread, compare_params, global_batch, local_batch, loss_of, make_loss_fn, make_model, rel_err, units_of

STRATEGIES = ["full_shard", "shard_grad_op", "no_shard"]
STEPS = 4


def _setup(kind, strategy, **kw):
    model = make_model(kind)
    ref = Reference(model, kind, max_grad_norm=kw.get("max_grad_norm"))
    apply, params = sf.functionalize(model, units=units_of(kind))
    mesh = sf.mesh(dp=-1)
    step = sf.train_step(make_loss_fn(kind, apply), sf.optim.adamw(**OPT), mesh, strategy=strategy, **kw)
    return ref, apply, step, step.init(params), mesh


@contextlib.contextmanager
def _small_segment(n: int | None):
    """Sets which sharded leaves count as small (gathered together, the others straight into their
    full parameters; see Note [flat unit layout]). The test models' leaves are all small by default."""
    old = _flat.SMALL_SEGMENT
    _flat.SMALL_SEGMENT = old if n is None else n
    try:
        yield
    finally:
        _flat.SMALL_SEGMENT = old


def rank_parity(strategy: str, gloo: str = "p2p", small_segment: int | None = None, **kw) -> dict:
    """Several steps of the sharded step and of the reference; the worst relative errors seen."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with C.gloo_collectives(gloo), _small_segment(small_segment):
        return _parity(strategy, rank, world, **kw)


def _parity(strategy, rank, world, **kw) -> dict:
    out = {}
    # The GPT's blocks are grouped (Note [unit groups]); the MLP's units each run alone.
    for kind, group_bytes in (("gpt", None), ("mlp", 0)):
        ref, apply, step, state, _ = _setup(kind, strategy, group_bytes=group_bytes, **kw)
        assert len(step.engine.units) == (1 if kind == "gpt" else 5)
        loss_err = norm_err = param_err = 0.0
        for i in range(STEPS):
            batch = global_batch(kind, i, world, per_rank=4)
            state, m = step(state, local_batch(batch, rank, world))
            ref_loss, ref_norm = ref.step(batch)
            loss_err = max(loss_err, abs(m["loss"].item() - ref_loss) / abs(ref_loss))
            norm_err = max(norm_err, abs(m["grad_norm"].item() - ref_norm) / ref_norm)
            param_err = max(param_err, compare_params(state.params, apply, ref))
        assert state.step == STEPS
        leaves = sf.tree_paths(state.params)
        assert all(isinstance(x, torch.distributed.tensor.DTensor) for x in torch.utils._pytree.tree_leaves(state.params))
        out[kind] = (loss_err, norm_err, param_err, len(leaves))
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity_with_single_process_reference(pools, world, strategy):
    for rank_result in pools(world).run(rank_parity, strategy):
        for kind, (loss_err, norm_err, param_err, n) in rank_result.items():
            assert loss_err < 1e-5, (kind, loss_err)
            assert norm_err < 1e-5, (kind, norm_err)
            assert param_err < 1e-5, (kind, param_err)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("gloo", ["native", "in_place"])
def test_parity_with_other_gloo_collectives(pools, world, gloo):
    """The native collectives (the path NCCL takes) and the in-place all-reduce, instead of the
    default point-to-point exchanges (Note [gloo collectives])."""
    for rank_result in pools(world).run(rank_parity, "full_shard", gloo=gloo):
        for kind, (loss_err, norm_err, param_err, _) in rank_result.items():
            assert max(loss_err, norm_err, param_err) < 1e-5, (kind, loss_err, norm_err, param_err)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("small_segment", [0, 40])
def test_parity_with_leaves_gathered_into_place(pools, world, small_segment):
    """Point to point, large leaves are received straight into their full parameters: all of them
    (0), or the GPT's weights and biases while its layer norms go together (40)."""
    for strategy in ("full_shard", "shard_grad_op"):
        for rank_result in pools(world).run(rank_parity, strategy, small_segment=small_segment):
            for kind, (loss_err, norm_err, param_err, _) in rank_result.items():
                assert max(loss_err, norm_err, param_err) < 1e-5, (strategy, kind, loss_err, norm_err, param_err)


def rank_hybrid_other_dim() -> dict:
    """hybrid_shard on (replicate=2, shard=2) with 2-D leaves split on dim 1 over `shard`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = _dim1_run("gpt", "hybrid_shard", 3, rank, world, axes=dict(replicate=2, shard=2), max_grad_norm=0.5)
    out.pop("full")
    return out


def test_parity_at_four_ranks(pools):
    """W > 3: each reduce-scatter (whose input is scratch) runs as an in-place all-reduce instead of
    point to point (Note [gloo collectives]); gathers stay point to point, in place or not. And
    hybrid sharding of leaves split on dim 1 (Note [leaves split on another dim])."""
    for small_segment in (None, 0):
        for rank_result in pools(4).run(rank_parity, "full_shard", small_segment=small_segment):
            for kind, (loss_err, norm_err, param_err, _) in rank_result.items():
                assert max(loss_err, norm_err, param_err) < 1e-5, (small_segment, kind, loss_err, norm_err, param_err)
    for r in pools(4).run(rank_hybrid_other_dim):
        assert r["loss"] < 1e-5 and r["params"] < 1e-5, r
        assert r["layout"] and all(p == Shard(1) and local == want for _, p, local, want, _ in r["layout"]), r["layout"]


@pytest.mark.parametrize("world", [2, 3])
def test_parity_with_clipping_and_accumulation(pools, world):
    for rank_result in pools(world).run(rank_parity, "full_shard", max_grad_norm=0.5, accumulation_steps=2):
        for kind, (loss_err, norm_err, param_err, _) in rank_result.items():
            assert max(loss_err, norm_err, param_err) < 1e-5, (kind, loss_err, norm_err, param_err)


def rank_count_collectives(strategy: str, gloo: str = "native", small_segment: int | None = None, group_bytes: int | None = 0,
                            keep_last_unit: bool = True) -> dict:
    """Counts the process-group calls of one step, by collective and by phase (forward/backward).

    Point-to-point messages are posted from the calling thread here, so that each call is seen in
    the phase that issued it (from the poster thread it would be a moment later).
    """
    old, C.POST_FROM_THREAD = C.POST_FROM_THREAD, False
    try:
        with C.gloo_collectives(gloo), _small_segment(small_segment):
            return _count_collectives(strategy, group_bytes, keep_last_unit)
    finally:
        C.POST_FROM_THREAD = old


def _count_collectives(strategy: str, group_bytes: int | None = 0, keep_last_unit: bool = True) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, apply, step, state, mesh = _setup("gpt", strategy, group_bytes=group_bytes, keep_last_unit=keep_last_unit)
    batch = local_batch(global_batch("gpt", 0, world), rank, world)
    state, _ = step(state, batch)  # first step learns the unit order

    counts: dict[tuple[str, str], int] = {}
    live_seen: list[int] = []
    originals = {n: getattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_gather", "isend", "irecv", "send", "recv")}

    def wrap(name):
        def counted(*args, **kwargs):
            key = (name, step.engine.phase)
            counts[key] = counts.get(key, 0) + 1
            # Bytes of unsharded (full) parameter storage held right now, the root's aside.
            storages = {id(u.full.untyped_storage()): u.full.untyped_storage().nbytes() for u in step.engine.units}
            live_seen.append(sum(storages.values()))
            return originals[name](*args, **kwargs)

        return counted

    for n in originals:
        setattr(dist, n, wrap(n))
    try:
        step.engine.stats.reset()
        state, _ = step(state, batch)
    finally:
        for n, f in originals.items():
            setattr(dist, n, f)
    storage_left = [(a.base.shape, a.nbytes) for a in step.engine.arenas if a.allocated]
    storage_left += [(u.name, t.untyped_storage().nbytes()) for u in [*step.engine.units, step.engine.root] for t in (u.full, u.gathered, u.stage) if t.untyped_storage().nbytes()]
    grads_left = [u.name for u in [*step.engine.units, step.engine.root] for p in u.proxies if p.grad is not None]
    return dict(
        counts=counts,
        units=len(step.engine.units),
        max_live=step.engine.stats.max_live_units,
        live_seen=max(live_seen) if live_seen else 0,
        unit_bytes=max(u.full.numel() * u.full.element_size() for u in step.engine.units),
        storage_left=storage_left,
        grads_left=grads_left,
        pieces={u.name: len(u._gather_pieces) for u in [*step.engine.units, step.engine.root]},
        last=step.engine.units[step.engine.order[-1]].name if step.engine.units else None,
    )


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_per_step(pools, world):
    for strategy in STRATEGIES:
        for r in pools(world).run(rank_count_collectives, strategy):
            c, U = r["counts"], r["units"]
            assert U == 3
            ag_f, ag_b = c.get(("all_gather_single", "forward"), 0), c.get(("all_gather_single", "backward"), 0)
            rs = c.get(("reduce_scatter_single", "forward"), 0) + c.get(("reduce_scatter_single", "backward"), 0)
            ar = sum(v for (n, _), v in c.items() if n == "all_reduce")
            others = {k: v for k, v in c.items() if k[0] not in ("all_gather_single", "reduce_scatter_single", "all_reduce")}
            assert not others, others  # no per-leaf or fallback collectives
            # The forward's last all-gather is the check that every rank ran the same units (Note
            # [units on every rank]): one small int32 all-gather per step. The last unit stays
            # gathered for its backward (Note [unit schedule]): one gather fewer in the backward.
            if strategy == "full_shard":
                assert (ag_f, ag_b, rs, ar) == (U + 2, U - 1, U + 1, 1), (strategy, c)
            elif strategy == "shard_grad_op":
                assert (ag_f, ag_b, rs, ar) == (U + 2, 0, U + 1, 1), (strategy, c)
            else:  # one all-reduce per unit (+ root) for gradients, one for the metrics
                assert (ag_f, ag_b, rs, ar) == (1, 0, 0, U + 2), (strategy, c)
        # Grouped (Note [unit groups]): the three blocks are gathered and reduced as one unit.
        for r in pools(world).run(rank_count_collectives, strategy, group_bytes=None):
            c = r["counts"]
            assert r["units"] == 1, r
            ag = c.get(("all_gather_single", "forward"), 0), c.get(("all_gather_single", "backward"), 0)
            rs = sum(v for (n, _), v in c.items() if n == "reduce_scatter_single")
            ar = sum(v for (n, _), v in c.items() if n == "all_reduce")
            expect = {"full_shard": ((3, 0), 2, 1), "shard_grad_op": ((3, 0), 2, 1), "no_shard": ((1, 0), 0, 3)}[strategy]
            assert (ag, rs, ar) == expect, (strategy, c)
    # "in_place": each unit's reduce-scatter as gloo runs it, an all-reduce, but in place.
    c = pools(world).run(rank_count_collectives, "full_shard", "in_place")[0]["counts"]
    assert c == {("all_gather_single", "forward"): U + 2, ("all_gather_single", "backward"): U - 1,
                 ("all_reduce", "backward"): U + 1, ("all_reduce", "idle"): 1}, c
    # The default on gloo: every all-gather and reduce-scatter is W - 1 sends and W - 1 receives.
    c = pools(world).run(rank_count_collectives, "full_shard", "p2p")[0]["counts"]
    W = world
    assert c == {("isend", "forward"): (W - 1) * (U + 2), ("irecv", "forward"): (W - 1) * (U + 2),
                 ("isend", "backward"): (W - 1) * (2 * U), ("irecv", "backward"): (W - 1) * (2 * U),
                 ("all_reduce", "idle"): 1}, c
    # Leaves received in place: one message per piece (the small leaves together, each large
    # leaf alone) per peer, for every gather; reduce-scatters stay one message per peer.
    r = pools(world).run(rank_count_collectives, "full_shard", "p2p", 40)[0]
    c, pieces = r["counts"], r["pieces"]
    per_fwd = sum(pieces.values())
    per_bwd = per_fwd - pieces[""] - pieces[r["last"]] + U + 1  # the blocks but the last again, and the reductions
    assert pieces[""] >= 2 and all(n >= 5 for k, n in pieces.items() if k), pieces
    assert c == {("isend", "forward"): (W - 1) * (per_fwd + 1), ("irecv", "forward"): (W - 1) * (per_fwd + 1),
                 ("isend", "backward"): (W - 1) * per_bwd, ("irecv", "backward"): (W - 1) * per_bwd,
                 ("all_reduce", "idle"): 1}, (c, pieces)
    # keep_last_unit=False: every unit gathered again for its backward.
    for r in pools(world).run(rank_count_collectives, "full_shard", keep_last_unit=False):
        c = r["counts"]
        assert (c.get(("all_gather_single", "forward")), c.get(("all_gather_single", "backward"))) == (U + 2, U), c


@pytest.mark.parametrize("world", [2, 3])
def test_memory_at_most_two_units_and_nothing_left(pools, world):
    for r in pools(world).run(rank_count_collectives, "full_shard"):
        # The engine's own counter, and the storage observed at every collective call.
        assert r["max_live"] == 2, r
        assert 0 < r["live_seen"] <= 2 * r["unit_bytes"], r
        assert r["storage_left"] == [], r
        assert r["grads_left"] == [], r
    for r in pools(world).run(rank_count_collectives, "shard_grad_op"):
        assert r["storage_left"] == [] and r["grads_left"] == [], r
        assert r["max_live"] == r["units"], r  # kept from forward to backward, by design
    # Groups of two blocks and one (a cap between two and three blocks): at most two groups.
    r0 = pools(world).run(rank_count_collectives, "full_shard")[0]
    cap = 2 * r0["unit_bytes"] + 1
    for r in pools(world).run(rank_count_collectives, "full_shard", group_bytes=cap):
        assert r["units"] == 2, r
        assert r["max_live"] == 2 and 0 < r["live_seen"] <= 2 * r["unit_bytes"], r
        assert r["storage_left"] == [] and r["grads_left"] == [], r


def rank_local_shards() -> list:
    """Each DTensor's local shard is a view into its unit's flat buffer, with DTensor's chunking."""
    rank, world = dist.get_rank(), dist.get_world_size()
    _, _, step, state, _ = _setup("gpt", "full_shard")
    out = []
    flats = {id(u.local.untyped_storage()) for u in [*step.engine.units, step.engine.root]}
    for path, leaf in zip(sf.tree_paths(state.params), torch.utils._pytree.tree_leaves(state.params)):
        local = leaf._local_tensor
        rows = leaf.shape[0]
        chunk = -(-rows // world)
        want = max(0, min(rows - rank * chunk, chunk))
        out.append((path, tuple(local.shape), want, id(local.untyped_storage()) in flats))
    return out


def test_local_shards_live_in_flat_buffers(pools):
    for shards in pools(3).run(rank_local_shards):
        for path, shape, want_rows, in_flat in shards:
            assert shape[0] == want_rows if shape else True, (path, shape, want_rows)
            assert in_flat, path


def rank_bad_step() -> str:
    """A loss_fn that raises leaves the step usable and the state intact."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, apply, step, state, _ = _setup("gpt", "full_shard")
    before = {k: v.full_tensor().clone() for k, v in sf.to_state_dict(state.params).items() if k in apply.info.param_paths}
    good = step.loss_fn

    def bad(params, batch):
        good(params, batch)
        raise RuntimeError("user error")

    step.loss_fn = bad
    batch = local_batch(global_batch("gpt", 0, world), rank, world)
    try:
        step(state, batch)
    except RuntimeError as e:
        assert "user error" in str(e)
    else:
        raise AssertionError("no error")
    after = {k: v.full_tensor() for k, v in sf.to_state_dict(state.params).items() if k in apply.info.param_paths}
    assert all(torch.equal(before[k], after[k]) for k in before)
    step.loss_fn = good
    state, m = step(state, batch)
    ref_loss, _ = ref.step(global_batch("gpt", 0, world))
    return abs(m["loss"].item() - ref_loss)


def test_failed_step_loses_nothing(pools):
    assert all(err < 1e-5 for err in pools(2).run(rank_bad_step))


def rank_optimizer_raises() -> dict:
    """An optimizer that raises in its step (a learning-rate table one step too short): alone
    (adamw's schedule is read before it writes anything), the state is as it was and training goes
    on exactly; in a chain whose first part wrote its moments in place before the second raised,
    the state's optimizer state is invalidated loudly (its parameters as they were), and a copy
    taken before the step trains on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    lrs = [1e-3, 1e-3]  # steps 0 and 1; step 2 raises IndexError
    table = lambda c: lrs[int(c)]  # noqa: E731
    for name, opt in (("adamw", sf.optim.adamw(table)),
                      ("chain", sf.optim.chain(sf.optim.scale_by_adam(), sf.optim.scale_by_learning_rate(table)))):
        apply, params = sf.functionalize(make_model("gpt"), units=units_of("gpt"))
        step = sf.train_step(make_loss_fn("gpt", apply), opt, sf.mesh(dp=-1))
        state = step.init(params)
        batch = lambda i: local_batch(global_batch("gpt", i, world), rank, world)  # noqa: E731
        for i in range(2):
            state, _ = step(state, batch(i))
        kept = sf.copy(state)
        try:
            step(state, batch(2))
            out[name] = "not raised"
            continue
        except Exception as e:  # noqa: BLE001 - which one is the point
            out[name] = type(e).__name__
        out[name + " params as they were"] = all(map(torch.equal, optree.tree_leaves(sf.gather(state.params)),
                                                     optree.tree_leaves(sf.gather(kept.params))))
        try:
            out[name + " opt state as it was"] = all(
                torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(optree.tree_leaves(state.opt_state),
                                                                              optree.tree_leaves(kept.opt_state))
                if isinstance(a, DTensor))
        except sf.DonatedError as e:
            out[name + " opt state as it was"] = str(e)
        lrs.append(1e-3)  # the table fixed: the kept copy trains on
        state, m = step(kept, batch(2))
        out[name + " trains on"] = bool(torch.isfinite(m["loss"]))
        lrs.pop()
    return out


def test_an_optimizer_that_raises_leaves_the_state_or_invalidates_it(pools):
    for r in pools(2).run(rank_optimizer_raises):
        assert r["adamw"] == "IndexError" and r["adamw params as they were"] and r["adamw opt state as it was"] is True, r
        assert r["chain"] == "PartlyUpdatedError" and r["chain params as they were"], r
        assert "part 1 (of parts 0..1) raised (IndexError" in r["chain opt state as it was"], r
        assert r["adamw trains on"] and r["chain trains on"], r


def rank_errors() -> list[str]:
    model = make_model("mlp")
    apply, params = sf.functionalize(model, units=units_of("mlp"))
    mesh = sf.mesh(dp=-1)
    msgs = []
    loss_fn = make_loss_fn("mlp", apply)
    bad_specs = sf.specs(params, mesh)
    del bad_specs["0"]["bias"]
    for call in (
        lambda: sf.train_step(loss_fn, sf.optim.adamw(1e-3), mesh, specs=bad_specs).init(params),
        lambda: sf.train_step(loss_fn, sf.optim.adamw(1e-3), mesh, strategy="zero3"),
        lambda: sf.train_step(loss_fn, sf.optim.adamw(1e-3), mesh, accumulation_steps=0),
        lambda: sf.train_step(loss_fn, sf.optim.adamw(1e-3), mesh, max_grad_norm=-1.0),
        lambda: sf.train_step(loss_fn, sf.optim.adamw(1e-3), mesh)(None, None),
        lambda: sf.train_step(loss_fn, sf.optim.adamw(1e-3), mesh, group_bytes=-1),
        lambda: sf.train_step(loss_fn, sf.optim.adamw(1e-3), mesh, keep_last_unit="yes"),
        lambda: sf.train_step(loss_fn, sf.optim.adamw(1e-3), mesh, accumulation_steps=True),
    ):
        try:
            call()
        except ValueError as e:
            msgs.append(str(e))
        else:
            msgs.append("NO ERROR")
    return msgs


def test_user_errors_are_value_errors(pools):
    msgs = pools(2).run(rank_errors)[0]
    assert "0.bias" in msgs[0] and "spec tree" in msgs[0], msgs[0]
    assert "strategy" in msgs[1]
    assert "accumulation_steps" in msgs[2]
    assert "max_grad_norm" in msgs[3]
    assert "init" in msgs[4]
    assert "group_bytes" in msgs[5] and "0: no unit groups" in msgs[5], msgs[5]
    assert "keep_last_unit must be True or False" in msgs[6], msgs[6]
    assert "accumulation_steps must be a positive int, got True" in msgs[7], msgs[7]


def rank_schedule(strategy: str, small_segment: int | None = None, keep_last_unit: bool = True) -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    with _small_segment(small_segment):
        _, _, step, state, _ = _setup("gpt", strategy, group_bytes=0, keep_last_unit=keep_last_unit)
        batch = local_batch(global_batch("gpt", 0, world), rank, world)
        state, _ = step(state, batch)
        step.engine.stats.record_events = True
        step.engine.stats.reset()
        step(state, batch)
        return step.engine.stats.events


def test_spent_slots_given_back_before_the_next_gradients(pools):
    """Gathers in place: three slots, one per block here, so each block is the last of its slot.
    Its reduction is finished, and its slot given back, as the next block's backward begins (after
    that block's prefetch, before its gradients are reduced; Note [slot arenas])."""
    ev = pools(2).run(rank_schedule, "full_shard", 0)[0]
    bwd = [(w, u) for w, u, ph in ev if ph == "backward"]
    assert [u for w, u in bwd if w == "release_slot"] == [2, 1, 0], bwd
    assert bwd.index(("release_slot", 2)) < bwd.index(("reduce", 1)), bwd
    assert bwd.index(("release_slot", 1)) < bwd.index(("reduce", 0)), bwd
    assert not [e for e in ev if e[0] == "release_slot" and e[2] != "backward"], ev
    # Two slots (the default for these small leaves): units 0 and 1 are the last of theirs.
    ev = pools(2).run(rank_schedule, "full_shard")[0]
    assert [u for w, u, ph in ev if w == "release_slot"] == [1, 0], ev


def test_schedule_prefetches_in_forward_and_reverse_order(pools):
    ev = pools(2).run(rank_schedule, "full_shard")[0]
    R = -1
    fwd = [(w, u) for w, u, ph in ev if ph == "forward"]
    bwd = [(w, u) for w, u, ph in ev if ph == "backward"]
    assert [u for w, u in fwd if w == "gather"] == [R, 0, 1, 2]
    # The last unit stays gathered from its forward to its backward, the first.
    assert [u for w, u in fwd if w == "free"] == [0, 1]
    assert [u for w, u in bwd if w == "gather"] == [1, 0]
    assert [u for w, u in bwd if w == "reduce"] == [2, 1, 0, R]
    # Prefetch: the next unit's gather starts before the current one is done with.
    assert fwd.index(("gather", 1)) < fwd.index(("free", 0))
    assert fwd.index(("gather", 2)) < fwd.index(("free", 1))
    assert bwd.index(("gather", 1)) < bwd.index(("reduce", 2))
    assert bwd.index(("gather", 0)) < bwd.index(("reduce", 1))
    ev = pools(2).run(rank_schedule, "full_shard", None, False)[0]
    assert [u for w, u, ph in ev if w == "free" and ph == "forward"] == [0, 1, 2]
    assert [u for w, u, ph in ev if w == "gather" and ph == "backward"] == [2, 1, 0]
    # shard_grad_op: no gather in backward; units freed right after their reduction, the root last.
    ev = pools(2).run(rank_schedule, "shard_grad_op")[0]
    assert [u for w, u, ph in ev if w == "gather" and ph == "backward"] == []
    assert [u for w, u, ph in ev if w == "free" and ph == "backward"] == [2, 1, 0, R]


class _LastWithoutGradient(torch.nn.Module):
    """"no_grad": the last block runs under no_grad, so the unit kept for its backward gets none;
    "unused": the last block never runs (the last to run is blocks.2)."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        for b in self.blocks[:-1]:
            x = torch.nn.functional.gelu(b(x))
        if self.mode == "unused":
            return x
        with torch.no_grad():
            y = self.blocks[-1](x)
        return x + y


def rank_last_without_gradient(keep_last_unit: bool, mode: str = "no_grad") -> list:
    torch.manual_seed(0)
    model = _LastWithoutGradient(mode)
    ref = Reference(model, "mlp")  # the single-process reference, on the same batches
    apply, params = sf.functionalize(model, units=r"blocks\.\d+")
    step = sf.train_step(lambda p, b: torch.nn.functional.mse_loss(apply(p, b[0]), b[1]), sf.optim.adamw(**OPT),
                         sf.mesh(dp=-1), group_bytes=0, keep_last_unit=keep_last_unit)
    state = step.init(params)
    err = 0.0
    for i in range(2):
        g = torch.Generator().manual_seed(i)
        batch = (torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g))  # the same on every rank
        step.engine.stats.record_events = True
        step.engine.stats.reset()
        state, _ = step(state, batch)
        ref.step(batch)
        err = max(err, compare_params(state.params, apply, ref))
    return [[u for w, u, ph in step.engine.stats.events if w == "gather" and ph == "backward"], err]


def test_a_kept_unit_without_gradient_costs_no_extra_gather(pools):
    """The kept unit's slot is wanted back in the backward: freeing it runs the deferred prefetch of
    the unit that wanted it, which must not be gathered a second time; the values are the reference's."""
    (kept, e1), (freed, e2) = (pools(2).run(rank_last_without_gradient, keep)[0] for keep in (True, False))
    assert kept == freed == [2, 1, 0], (kept, freed)
    assert e1 < 1e-6 and e2 < 1e-6, (e1, e2)


def test_the_kept_unit_is_the_last_that_ran(pools):
    """A last block that never runs is not the one kept: blocks.2 is, and is not gathered again."""
    (kept, e1), (freed, e2) = (pools(3).run(rank_last_without_gradient, keep, "unused")[0] for keep in (True, False))
    assert freed == [2, 1, 0] and kept == [1, 0], (kept, freed)
    assert e1 < 1e-6 and e2 < 1e-6, (e1, e2)


class _Reversed(torch.nn.Module):
    """Blocks run in the reverse of module order, and block 1 twice: slot parity does not hold."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(4))

    def forward(self, x):
        for i in (3, 1, 2, 1, 0):
            x = torch.tanh(self.blocks[i](x))
        return x


def rank_unusual_order() -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _Reversed()
    ref = Reference(model, "mlp")
    apply, params = sf.functionalize(model, units=r"blocks\.\d+")
    step = sf.train_step(lambda p, b: torch.nn.functional.mse_loss(apply(p, b[0]), b[1]), sf.optim.adamw(**OPT), sf.mesh(dp=-1))
    state = step.init(params)
    err = 0.0
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        batch = (torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 6, generator=g))
        state, m = step(state, local_batch(batch, rank, world))
        ref.step(batch)
        err = max(err, compare_params(state.params, apply, ref))
    assert step.engine.stats.max_live_units <= 2
    return err


def test_units_out_of_module_order_and_reused(pools):
    """Execution order other than module order, and a unit run twice, stay exact (Note [slot arenas])."""
    assert max(pools(2).run(rank_unusual_order)) < 1e-5


def rank_pure_function() -> float:
    """A hand-written pure function (no functionalize): the whole tree is the root unit."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    params = {"w": torch.randn(7, 5), "b": torch.zeros(5)}
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    x, y = torch.randn(4 * world, 7), torch.randn(4 * world, 5)

    def loss_fn(p, batch):
        xb, yb = batch
        return ((xb @ p["w"] + p["b"] - yb) ** 2).mean()

    state = _sgd_beside_reference(loss_fn, params, ref, (x, y), lr=0.1)
    full = sf.gather(state.params)
    return max(((full[k] - ref[k].detach()).norm() / ref[k].detach().norm()).item() for k in full)


def _sgd_beside_reference(loss_fn, params: dict, ref: dict, batch: tuple, lr: float, specs=None, steps: int = 3):
    """`steps` train steps of SGD with momentum on this rank's share of `batch`, and as many steps of
    torch.optim.SGD on the whole batch for the plain tensors `ref` (updated in place); the state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    step = sf.train_step(loss_fn, sf.optim.sgd(lr, momentum=0.9), sf.mesh(dp=-1), specs=specs)
    state = step.init(params)
    opt = torch.optim.SGD(ref.values(), lr=lr, momentum=0.9)
    for _ in range(steps):
        state, _ = step(state, tuple(t.chunk(world)[rank] for t in batch))
        opt.zero_grad()
        loss_fn(ref, batch).backward()
        opt.step()
    return state


def test_train_step_on_a_plain_pure_function(pools):
    assert max(pools(3).run(rank_pure_function)) < 1e-6


def rank_backward_on_another_thread(kind: str, remat, user_checkpoint: bool = False, mp: bool = False) -> dict:
    """Three steps with the backward on another thread than the forward, against the same steps on
    one thread (bitwise) and, in fp32, against the reference; the threads a child module of the first
    unit ran on (the forward, and a recompute)."""
    import threading

    rank, world = dist.get_rank(), dist.get_world_size()
    threads = []
    runs = []
    for threaded in (False, True):
        model = make_model(kind)
        ref = Reference(model, kind)
        apply, params = sf.functionalize(model, units=units_of(kind))
        unit = model.get_submodule(apply.units[0])
        child = next((m for n, m in unit.named_modules() if n), unit)  # the MLP's units are Linears
        child.register_forward_hook(lambda *_: threads.append(threading.current_thread().name) if threaded else None)

        def loss_fn(params, batch, apply=apply):
            x, y = batch
            # The model under the user's own activation checkpoint: its recompute runs apply, and
            # every unit's hooks, in the backward.
            out = torch.utils.checkpoint.checkpoint(apply, params, x, use_reentrant=False) if user_checkpoint else apply(params, x)
            return loss_of(kind, out, y)

        mixed = sf.MixedPrecision(param_dtype=torch.bfloat16) if mp else None
        # A recompute of the whole model in the backward runs units out of the plan's order: their
        # slots are not shared under shard_grad_op.
        strategy = "shard_grad_op" if user_checkpoint else "full_shard"
        step = sf.train_step(loss_fn, sf.optim.adamw(**OPT), sf.mesh(dp=-1), strategy=strategy, remat=remat, mixed_precision=mixed)
        state = step.init(params)
        err = 0.0
        with backward_on_another_thread() if threaded else contextlib.nullcontext():
            for i in range(3):
                batch = global_batch(kind, i, world, per_rank=2)
                state, m = step(state, local_batch(batch, rank, world))
                ref_loss, _ = ref.step(batch)
                err = max(err, abs(m["loss"].item() - ref_loss) / abs(ref_loss), compare_params(state.params, apply, ref))
        runs.append((sf.to_state_dict(sf.gather(state.params), apply), err))
    (one, _), (two, err) = runs
    same = all(torch.equal(one[n], two[n]) for n in one)
    return dict(err=err, same=same, threads=sorted(set(threads)))


def test_backward_on_another_thread_than_the_forward(pools):
    """On CUDA autograd runs the backward on its own threads: unit hooks, reductions, remat's
    recompute and a recompute of `apply` (the user's own checkpoint) must reach the step's engine
    there, not through anything the forward's thread holds. The same steps on one thread are
    equal bitwise; in fp32 they equal the reference."""
    pool = pools(2)
    cases = [("gpt", True, False, False), ("gpt", True, False, True), ("mlp", False, True, False), ("mlp", False, True, True)]
    for kind, remat, user_checkpoint, mp in cases:
        for r in pool.run(rank_backward_on_another_thread, kind, remat, user_checkpoint, mp):
            assert r["same"], (kind, remat, user_checkpoint, mp, r)
            assert mp or r["err"] < 1e-5, (kind, remat, user_checkpoint, mp, r)
            assert r["threads"] == ["MainThread", "autograd-device-thread"], (kind, remat, user_checkpoint, mp, r)


class _TwoPairs(torch.nn.Module):
    """Four small blocks in two groups; `swap` runs the first pair in the other order."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(4)])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x, swap: bool):
        b = self.blocks
        x = b[1](torch.tanh(b[0](x))) if not swap else b[0](torch.tanh(b[1](x)))
        return self.head(b[3](torch.tanh(b[2](x)))).sum()


def rank_group_members_in_any_order() -> dict:
    """Rank 1 runs the members of a unit group in another order than rank 0: the group is gathered
    once per forward either way, and training equals the single-process reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _TwoPairs()
    ref = copy.deepcopy(model)
    apply, params = sf.functionalize(model, units=r"blocks\.\d+")
    x = torch.randn(5, 8)
    step = sf.train_step(lambda p, b: apply(p, b, rank == 1), sf.optim.sgd(0.1), sf.mesh(dp=-1), group_bytes=600)
    state = step.init(params)
    for _ in range(3):
        state, _ = step(state, x)
        grads = []
        for r in range(world):
            ref.zero_grad()
            ref(x, r == 1).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        with torch.no_grad():
            for p, *g in zip(ref.parameters(), *grads):
                p -= 0.1 * sum(g) / world
    got = sf.to_state_dict(state.params)
    err = max((got[k].full_tensor() - v).abs().max().item() for k, v in ref.named_parameters())
    return {"groups": step.engine.groups, "err": err}


def test_group_members_in_another_order_on_another_rank(pools):
    for out in pools(2).run(rank_group_members_in_any_order):
        assert out["groups"] == [[0, 1], [2, 3]], out
        assert out["err"] < 1e-6, out


def _dim1_specs(params, mesh):
    """`P(None, ax)` (DTensor's `Shard(1)`) on every 2-D leaf, `P(ax)` on the others; `ax` the
    mesh's last axis (the shard axis)."""
    ax = mesh.mesh_dim_names[-1]
    paths, leaves, _ = tree_flatten_with_paths(params)
    rules = [(re.escape(p), sf.P(None, ax)) for p, x in zip(paths, leaves) if x.dim() == 2]
    return sf.specs(params, mesh, rules=rules, default=sf.P(ax))


def _dim1_run(kind: str, strategy: str, steps: int, rank: int, world: int, save: str | None = None, bf16: bool = False,
              frozen: str | None = None, axes: dict | None = None, **kw) -> dict:
    """`steps` AdamW steps with 2-D leaves split on dim 1, against the reference; the worst errors,
    and the layout the state's leaves have."""
    model = make_model(kind)
    ref = Reference(model, kind, max_grad_norm=kw.get("max_grad_norm"), frozen=frozen, bf16=bf16)
    apply, params = sf.functionalize(model, units=units_of(kind))
    mesh = sf.mesh(**(axes or dict(dp=-1)))
    mixed = sf.MixedPrecision(torch.bfloat16, torch.float32) if bf16 else None
    step = sf.train_step(make_loss_fn(kind, apply), sf.optim.adamw(**OPT), mesh, strategy=strategy, specs=_dim1_specs(params, mesh),
                         mixed_precision=mixed, frozen=frozen, **kw)
    state = step.init(params)
    loss_err = param_err = 0.0
    for i in range(steps):
        batch = global_batch(kind, i, 12, per_rank=1)  # the same global batch at any world size
        state, m = step(state, local_batch(batch, rank, world))
        ref_loss, _ = ref.step(batch)
        loss_err = max(loss_err, abs(m["loss"].item() - ref_loss) / abs(ref_loss))
        param_err = max(param_err, compare_params(state.params, apply, ref, per_leaf=not bf16))
        if save is not None and i == steps - 2:
            sf.save(state, save)
    layout = []
    mu = state.opt_state[0].mu if isinstance(state.opt_state, tuple) else None
    for tree in (state.params, mu):
        if tree is None:
            continue
        for path, x in zip(*tree_flatten_with_paths(tree)[:2]):
            if x.dim() == 2:
                n, w, r = x.shape[1], mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
                c = -(-n // w)
                layout.append((path, tuple(x.placements)[-1], tuple(x._local_tensor.shape), (x.shape[0], max(0, min(n - r * c, c))),
                               x._local_tensor.is_contiguous()))
    return dict(loss=loss_err, params=param_err, layout=layout, full=sf.to_state_dict(sf.gather(state.params), apply))


def rank_other_dim(save: str | None = None, load: str | None = None) -> dict:
    """2-D leaves split on dim 1 (`Shard(1)`): train steps under every option against the
    reference, value_and_grad, the state's layout, a checkpoint saved here or loaded at another
    world size (then one more step, against the reference's third)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    with _small_segment(0):  # the dim-0 leaves received in place, the dim-1 ones through `gathered`
        out["remat_frozen"] = _dim1_run("gpt", "full_shard", 3, rank, world, remat=True, frozen=r"blocks\.0\..*", group_bytes=0)
    out["accum_clip"] = _dim1_run("gpt", "shard_grad_op", 3, rank, world, accumulation_steps=2, max_grad_norm=0.5)
    out["mlp"] = _dim1_run("mlp", "full_shard", 3, rank, world, group_bytes=0, save=save)
    out["bf16"] = _dim1_run("gpt", "full_shard", 3, rank, world, bf16=True)
    # The same in bf16 with every leaf on dim 0: the layout changes at most the rounding of the sums.
    model = make_model("gpt")
    apply, params = sf.functionalize(model, units=units_of("gpt"))
    step = sf.train_step(make_loss_fn("gpt", apply), sf.optim.adamw(**OPT), sf.mesh(dp=-1),
                         mixed_precision=sf.MixedPrecision(torch.bfloat16, torch.float32))
    state = step.init(params)
    for i in range(3):
        state, _ = step(state, local_batch(global_batch("gpt", i, 12, per_rank=1), rank, world))
    dim0 = sf.to_state_dict(sf.gather(state.params), apply)
    out["bf16_vs_dim0"] = max(rel_err(out["bf16"]["full"][n], dim0[n]) for n in dim0)
    for r in out.values():
        if isinstance(r, dict):
            r.pop("full")
    # value_and_grad on a tree sf.shard laid out so.
    model, ref_model = make_model("gpt"), make_model("gpt")
    apply, params = sf.functionalize(model, units=units_of("gpt"))
    mesh = sf.mesh(dp=-1)
    sharded = sf.shard(params, _dim1_specs(params, mesh), mesh)
    batch = global_batch("gpt", 0, 12, per_rank=1)
    # A leaf split on dim 1 also read outside apply (Note [parameters outside apply]).
    loss_fn = make_loss_fn("gpt", apply)
    penalized = lambda p, b: loss_fn(p, b) + 0.1 * (p["blocks"]["0"]["fc"]["weight"] ** 2).sum()  # noqa: E731
    loss, grads = sf.value_and_grad(penalized, apply=apply)(sharded, local_batch(batch, rank, world))
    ref_loss = loss_of("gpt", ref_model(batch[0]), batch[1]) + 0.1 * (ref_model.blocks[0].fc.weight ** 2).sum()
    ref_loss.backward()
    got = sf.to_state_dict(sf.gather(grads))
    out["value_and_grad"] = (rel_err(loss, ref_loss), max(rel_err(got[n], p.grad) for n, p in ref_model.named_parameters()),
                             sorted({str(g.placements) for g in torch.utils._pytree.tree_leaves(grads) if g.dim() == 2}))
    # 3-D leaves split on their middle and last dims (whole dims before and after the split one).
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 7, 5), "u": torch.randn(5, 3, 8), "b": torch.randn(8)}
    specs = {"w": sf.P(None, "dp"), "u": sf.P(None, None, "dp"), "b": sf.P("dp")}
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    x, y = torch.randn(6 * world, 4, 7), torch.randn(6 * world, 3, 8)

    def loss_fn(p, batch):
        xb, yb = batch
        return ((torch.einsum("nij,ijk,kal->nal", xb, p["w"], p["u"]) + p["b"] - yb) ** 2).mean()

    state = _sgd_beside_reference(loss_fn, params, ref, (x, y), lr=0.01, specs=specs)
    full = sf.gather(state.params)
    c7, c8 = -(-7 // world), -(-8 // world)
    want = {"w": ((Shard(1),), (4, max(0, min(c7, 7 - rank * c7)), 5)), "u": ((Shard(2),), (5, 3, max(0, min(c8, 8 - rank * c8))))}
    got = {k: (tuple(state.params[k].placements), tuple(state.params[k]._local_tensor.shape)) for k in want}
    out["3d"] = (max(rel_err(full[k], ref[k]) for k in full), got, want)
    # What is not supported yet is refused before anything is computed, naming the leaf and the spec.
    refused = []
    for axes, options, specs in ((dict(dp=-1), dict(offload="cpu"), _dim1_specs),
                                 (dict(replicate=1, shard=-1), dict(strategy="hybrid_shard"), lambda p, m: sf.specs(p, m, default=sf.P("replicate", "shard")))):
        apply, params = sf.functionalize(make_model("mlp"), units=units_of("mlp"))
        mesh = sf.mesh(**axes)
        try:
            sf.train_step(make_loss_fn("mlp", apply), sf.optim.sgd(0.1), mesh, specs=specs(params, mesh), **options).init(params)
        except NotImplementedError as e:
            refused.append(str(e))
    out["refused"] = refused
    if load is not None:  # the checkpoint of "mlp" after two steps, then its third step here
        model = make_model("mlp")
        ref = Reference(model, "mlp")
        apply, params = sf.functionalize(model, units=units_of("mlp"))
        mesh = sf.mesh(dp=-1)
        step = sf.train_step(make_loss_fn("mlp", apply), sf.optim.adamw(**OPT), mesh, specs=_dim1_specs(params, mesh), group_bytes=0)
        state = sf.load(load, like=step.init(params))
        out["loaded"] = sf.to_state_dict(sf.gather(state.params), apply)
        for i in range(3):
            batch = global_batch("mlp", i, 12, per_rank=1)
            ref.step(batch)
            if i == 1:
                out["loaded_ref_err"] = compare_params(state.params, apply, ref)
        state, _ = step(state, local_batch(global_batch("mlp", 2, 12, per_rank=1), rank, world))
        out["resumed"] = compare_params(state.params, apply, ref)
        out["loaded_layout"] = sorted({str(x.placements) for x in torch.utils._pytree.tree_leaves(state.params) if x.dim() == 2})
    return out


def test_leaves_split_on_another_dim_train_as_the_reference(pools, tmp_path):
    """`P(None, "dp")` on every 2-D leaf: FSDP over dim 1, uneven at 3 ranks, exact under both
    sharding strategies with remat, frozen leaves, accumulation, clipping; bf16 as close to the
    reference as dim 0's layout; value_and_grad; a checkpoint resumes at another world size."""
    path = str(tmp_path / "dim1")
    for world, save, load in ((3, path, None), (2, None, path)):
        for r in pools(world).run(rank_other_dim, save, load):
            for case in ("remat_frozen", "accum_clip", "mlp"):
                assert r[case]["loss"] < 1e-5 and r[case]["params"] < 1e-5, (world, case, r[case])
            assert r["bf16"]["params"] < 1e-2 and r["bf16_vs_dim0"] < 1e-6, (world, r["bf16"], r["bf16_vs_dim0"])
            for case in ("remat_frozen", "accum_clip", "mlp", "bf16"):
                layout = r[case]["layout"]
                assert layout, case
                for path_, placements, local, want, contiguous in layout:
                    assert placements == Shard(1) and local == want and contiguous, (world, case, path_, placements, local, want)
            loss_err, grad_err, placements = r["value_and_grad"]
            assert loss_err < 1e-5 and grad_err < 1e-5 and placements == ["(Shard(dim=1),)"], r["value_and_grad"]
            err, got, want = r["3d"]
            assert err < 1e-5 and got == want, r["3d"]
            assert len(r["refused"]) == 2 and "offload" in r["refused"][0] and "0.weight" in r["refused"][0], r["refused"]
            assert "spec P('replicate'" in r["refused"][1] and "nothing else on this mesh" in r["refused"][1], r["refused"]
            if load is not None:
                assert r["loaded_ref_err"] < 1e-5 and r["resumed"] < 1e-5, (r["loaded_ref_err"], r["resumed"])
                assert r["loaded_layout"] == ["(Shard(dim=1),)"], r["loaded_layout"]


def rank_empty_share() -> dict:
    """The last rank gets no example (a last global batch smaller than the world): metrics["loss"]
    is the global batch's loss, not NaN; the update is the mean over every rank's gradient (the
    empty share's counts zero), i.e. the reference's on the loss scaled by the share of ranks with
    examples. Under full_shard (the GPT) and no_shard (the MLP), and with accumulation."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind, strategy, accumulation_steps in (("gpt", "full_shard", 1), ("mlp", "no_shard", 2)):
        model = make_model(kind)
        ref = Reference(model, kind)
        apply, params = sf.functionalize(model, units=units_of(kind))
        step = sf.train_step(make_loss_fn(kind, apply), sf.optim.adamw(**OPT), sf.mesh(dp=-1), strategy=strategy,
                             accumulation_steps=accumulation_steps)
        state = step.init(params)
        losses, ref_losses = [], []
        for i in range(2):
            x, y = global_batch(kind, i, world, per_rank=2)
            n = 2 * (world - 1)  # shares of 2, and none on the last rank
            mine = slice(min(2 * rank, n), min(2 * rank + 2, n))
            with torch.no_grad():
                ref_losses.append(loss_of(kind, ref.model(x[:n]), y[:n]).item())
            scale = (world - 1) / world
            ref.opt.zero_grad()
            (loss_of(kind, ref.model(x[:n]), y[:n]) * scale).backward()
            ref.opt.step()
            state, metrics = step(state, (x[mine], y[mine]))
            losses.append(metrics["loss"].item())
        out[kind] = (losses, ref_losses, compare_params(state.params, apply, ref))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_with_an_empty_share_reports_the_global_loss(pools, world):
    for r in pools(world).run(rank_empty_share):
        for kind in ("gpt", "mlp"):
            losses, ref_losses, err = r[kind]
            assert all(abs(a - b) < 1e-5 * abs(b) for a, b in zip(losses, ref_losses)), (kind, losses, ref_losses)
            assert err < 1e-5, (kind, err)


def test_mixed_precision_refuses_dtypes_it_cannot_compute_in():
    """float8 dtypes (no arithmetic kernels: the backward's additions fail in torch) and
    non-floating dtypes are refused at construction, saying what is supported."""
    for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        for bad in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.bool, "bf16"):
            with pytest.raises(ValueError, match=rf"MixedPrecision.{name} must be None or one of torch.bfloat16") as e:
                sf.MixedPrecision(**{name: bad})
            assert ("float8" in str(e.value)) == (isinstance(bad, torch.dtype) and bad.is_floating_point), str(e.value)
        for good in (torch.bfloat16, torch.float16, torch.float32, torch.float64, None):
            sf.MixedPrecision(**{name: good})


def test_accumulation_refuses_a_batch_it_would_cut_wrongly():
    """`accumulation_steps=k` cuts every batch leaf along dim 0 into k micro-batches: a leaf that
    is no example per row (class weights beside the examples) would be cut too, each micro-batch
    taking a part of it; refused, naming the leaves, as are leaves it cannot cut in k, before
    anything is computed."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    apply, params = sf.functionalize(torch.nn.Sequential(torch.nn.Linear(4, 3)), units=None)

    def loss_fn(p, b):
        return F.cross_entropy(apply(p, b["x"]), b["y"], weight=b.get("w"))

    step = sf.train_step(loss_fn, sf.optim.sgd(0.1), sf.mesh(dp=-1), accumulation_steps=3)
    state = step.init(params)
    before = {k: v.clone() for k, v in sf.to_state_dict(sf.gather(state.params)).items()}
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    for bad, says in [
        (dict(x=x, y=y, w=torch.tensor([1.0, 2.0, 3.0])), r"the leaves' first dims differ \(\['w'\]: \(3,\), \['x'\]: \(6, 4\), \['y'\]: \(6,\)\)"),
        (dict(x=x[:4], y=y[:4]), r"got a tensor of shape \(4, 4\)"),
        (dict(x=x, y=y, n=3), "got a int leaf"),
    ]:
        with pytest.raises(ValueError, match=says):
            step(state, bad)
    after = sf.to_state_dict(sf.gather(state.params))
    assert all(torch.equal(before[k], after[k]) for k in before)
    state, m = step(state, dict(x=x, y=y))  # examples on dim 0 of every leaf: trains
    assert torch.isfinite(m["loss"])


def test_a_leaf_set_to_require_grad_where_the_module_freezes_it_is_refused():
    """Freezing is read from the module's parameters and `frozen=`; the tree's leaves come detached.
    A leaf the user set to `requires_grad=True` where its module parameter is frozen (a second
    stage that unfreezes a backbone through the tree) trained nothing for it: refused, naming it."""
    model = make_model("mlp")
    model[0].requires_grad_(False)
    apply, params = sf.functionalize(model, units=units_of("mlp"))
    step = sf.train_step(make_loss_fn("mlp", apply), sf.optim.sgd(0.1), sf.mesh(dp=-1))
    assert not any(x.requires_grad for x in optree.tree_leaves(params))
    params["0"]["weight"].requires_grad_(True)
    with pytest.raises(ValueError, match=r"leaves \['0.weight'\] of the tree require grad, but they are frozen"):
        step.init(params)
    model[0].weight.requires_grad_(True)  # through the module: trained
    state = step.init(params)
    trained = dict(zip(step.core.paths, step.core.trained))
    assert trained["0.weight"] and not trained["0.bias"] and all(v for k, v in trained.items() if not k.startswith("0.")), trained
