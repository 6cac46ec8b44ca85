"""The state contract: a train step donates its input state (reads raise, never show changed values),
`sf.copy` keeps one, and states, parameter trees and gradients pickle and `torch.save`."""

from __future__ import annotations

import copy
import io
import pickle

import optree
import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from reference import OPT, global_batch, local_batch, make_loss_fn, make_model, units_of


def _batch(i: int):
    return local_batch(global_batch("mlp", i, dist.get_world_size()), dist.get_rank(), dist.get_world_size())


def _full(tree) -> list[torch.Tensor]:
    return [x.detach().clone() for x in optree.tree_leaves(sf.gather(tree))]


def _raises_donated(fn) -> bool:
    try:
        fn()
    except sf.DonatedError:
        return True
    return False


def rank_donation() -> dict:
    model = make_model("mlp")
    apply, params = sf.functionalize(model, units=units_of("mlp"))
    mesh = sf.mesh(dp=-1)
    step = sf.train_step(make_loss_fn("mlp", apply), sf.optim.adamw(**OPT), mesh)
    s0 = step.init(params)
    s1, _ = step(s0, _batch(0))
    kept = sf.copy(s1)
    g1 = step.grads
    kept_grads = sf.copy(g1)
    s2, _ = step(s1, _batch(1))
    old_w = s1.params["0"]["weight"]
    out = {
        # Every read of a donated state fails, on every path a user takes.
        "local": _raises_donated(lambda: old_w.to_local() + 1),
        "gather": _raises_donated(lambda: sf.gather(s1.params)),
        "moments": _raises_donated(lambda: sf.gather(s1.opt_state)),
        "grads": _raises_donated(lambda: sf.gather(g1)),
        "again": _raises_donated(lambda: step(s1, _batch(1))),
        "pickle": _raises_donated(lambda: pickle.dumps(s1)),
        "printed": "donated" in repr(old_w),
        # Scalars keep their own values; the copy kept everything.
        "count": (int(kept.opt_state[0].count), int(s1.opt_state[0].count), int(s2.opt_state[0].count)),
        "kept_equal": all(torch.equal(a, b) for a, b in zip(_full(kept.params), _full(s2.params))) is False,
        "kept_grads_differ": any(not torch.equal(a, b) for a, b in zip(_full(kept_grads), _full(step.grads))),
    }
    # A rollback: the copy, stepped again on the same batch, gives exactly the state s2 was.
    s2_full = _full(s2.params)
    s2_opt = _full(s2.opt_state)
    r2, _ = step(sf.copy(kept), _batch(1))
    out["rollback"] = all(torch.equal(a, b) for a, b in zip(_full(r2.params), s2_full))
    out["rollback_opt"] = all(torch.equal(a, b) for a, b in zip(_full(r2.opt_state), s2_opt))
    out["replaced"] = _raises_donated(lambda: s2.params["0"]["weight"].to_local().sum())  # its memory now holds r2
    # Training goes on from the returned state.
    r3, m = step(r2, _batch(2))
    out["finite"] = bool(torch.isfinite(m["loss"]))
    # Each donated DTensor refuses pickling on its own; after several donations the returned state and
    # gradients pickle their current values (Note [cheap donation]).
    dts = [x for x in optree.tree_leaves((s1, g1, s2.params)) if isinstance(x, torch.Tensor) and hasattr(x, "to_local")]
    out["pickle_each"] = len(dts) > 0 and all(_raises_donated(lambda x=x: pickle.dumps(x)) for x in dts)
    now = optree.tree_leaves((r3, step.grads))
    back = optree.tree_leaves(pickle.loads(pickle.dumps((r3, step.grads))))
    out["pickle_current"] = len(now) == len(back) and all(
        torch.equal(_local(a), _local(b)) for a, b in zip(now, back) if isinstance(a, torch.Tensor)
    )
    # Two consumers of one model take a state in turn (two train steps, then value_and_grad): each
    # copies the values in and donates the state that held them, and the one that went first takes
    # the state back the same way, equal to one step run on the same batches.
    other = sf.train_step(make_loss_fn("mlp", apply), sf.optim.adamw(**OPT), mesh)
    other.init(sf.copy(r3.params))
    ref = sf.copy(r3)
    t1, _ = other(r3, _batch(3))
    t2, _ = step(t1, _batch(4))
    t2_full = _full(t2.params)
    t3, _ = other(t2, _batch(5))
    vg = sf.value_and_grad(make_loss_fn("mlp", apply))
    loss3, _ = vg(t3.params, _batch(6))
    t4, _ = step(t3, _batch(7))
    t4_full = _full(t4.params)
    loss4, _ = vg(t4.params, _batch(8))
    u1, _ = step(ref, _batch(3))
    u2, _ = step(u1, _batch(4))
    u2_full = _full(u2.params)
    u3, _ = step(u2, _batch(5))
    u4, _ = step(u3, _batch(7))
    out["two_consumers"] = (
        all(torch.equal(a, b) for a, b in zip(t2_full, u2_full))
        and all(torch.equal(a, b) for a, b in zip(t4_full, _full(u4.params)))
        and bool(torch.isfinite(loss3)) and bool(torch.isfinite(loss4))
    )
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_step_donates_its_input_state(pools, world):
    for rank, out in enumerate(pools(world).run(rank_donation)):
        for key in ("local", "gather", "moments", "grads", "again", "pickle", "printed", "kept_grads_differ", "rollback",
                    "rollback_opt", "replaced", "finite", "pickle_each", "pickle_current", "two_consumers"):
            assert out[key], (rank, key, out)
        assert out["count"] == (1, 1, 2), out
        assert out["kept_equal"], out  # the kept copy holds step 1, not step 2


def rank_recycled() -> dict:
    """Note [recycled wrappers]: a state the loop dropped lends its DTensors to a later one; a state
    kept in a variable, behind a weak reference or in an autograd graph stays donated."""
    import gc
    import weakref

    from torch.distributed.tensor import DTensor

    model = make_model("mlp")
    apply, params = sf.functionalize(model, units=units_of("mlp"))
    mesh = sf.mesh(dp=-1)
    step = sf.train_step(make_loss_fn("mlp", apply), sf.optim.adamw(**OPT), mesh)
    ref = sf.train_step(make_loss_fn("mlp", apply), sf.optim.adamw(**OPT), mesh)
    state, twin = step.init(params), ref.init(sf.copy(params))

    def ids(s) -> list[int]:
        return [id(x) for x in optree.tree_leaves((s.params, s.opt_state)) if isinstance(x, DTensor)]

    def donated(x) -> bool:
        return _raises_donated(lambda: x.to_local() + 1)

    seen = []
    for i in range(4):
        state, _ = step(state, _batch(i))
        twin, _ = ref(sf.copy(twin), _batch(i))  # a copy each step: nothing to recycle
        seen.append(ids(state))
    out = {"recycled": seen[3] == seen[1] and seen[2] == seen[0] and set(seen[0]).isdisjoint(seen[1])}
    w = state.params["4"]["weight"]
    probe = weakref.ref(state.params["2"]["weight"])
    saved = DTensor.from_local(torch.ones_like(w.to_local()), mesh, w.placements, shape=w.shape, stride=w.stride()).requires_grad_()
    graph = (saved * state.params["4"]["weight"]).sum()  # holds that leaf for its backward
    hooked = state.params["0"]["bias"].requires_grad_()
    calls = [0]
    hooked.register_hook(lambda g: calls.__setitem__(0, calls[0] + 1))  # holds no reference to the tensor
    del w, hooked
    state, _ = step(state, _batch(4))  # the state before is reachable only through the probe and the graph
    twin, _ = ref(sf.copy(twin), _batch(4))
    held = state
    out["held"] = out["weakref"] = out["hooks"] = True
    for i in range(5, 9):
        state, _ = step(state, _batch(i))
        twin, _ = ref(sf.copy(twin), _batch(i))
        gc.collect()
        # checked after every step: a DTensor taken over shows up in the next state or the one after
        now = {id(x) for x in optree.tree_leaves((state, step.grads))}
        out["held"] &= all(donated(x) and id(x) not in now for x in optree.tree_leaves(held.params))
        out["weakref"] &= probe() is None or (donated(probe()) and id(probe()) not in now)  # released, never revived
        bias = state.params["0"]["bias"]  # requires grad from step 4 on; the hooked wrapper must not come back
        torch.autograd.grad((bias * 2).sum(), bias)
        out["hooks"] &= bias.requires_grad and calls[0] == 0
        del bias
    out["graph"] = _raises_donated(graph.backward)
    # An optimizer whose update returns views: a view's base (an earlier step's tensor) is not
    # handed on with a reused wrapper.
    from typing import NamedTuple

    class Mom(NamedTuple):
        mu: object

    def init(p):
        return Mom(optree.tree_map(torch.zeros_like, p))

    def update(g, s, p=None):
        mu = optree.tree_map(lambda m, x: (m * 0.9 + x).view(m.shape), s.mu, g)
        return optree.tree_map(lambda m: -0.01 * m, mu), Mom(mu)

    viewing = sf.train_step(make_loss_fn("mlp", apply), sf.optim.GradientTransformation(init, update), mesh)
    v = viewing.init(sf.copy(state.params))
    out["no_view_base"] = True
    for i in range(4):
        v, _ = viewing(v, _batch(i))
        out["no_view_base"] &= all(x._base is None for x in optree.tree_leaves(v.opt_state.mu))
    out["exact"] = all(torch.equal(a, b) for a, b in zip(_full((state.params, state.opt_state)), _full((twin.params, twin.opt_state))))
    return out


@pytest.mark.parametrize("world", [2])
def test_dropped_states_lend_their_wrappers_and_kept_ones_never(pools, world):
    for rank, out in enumerate(pools(world).run(rank_recycled)):
        assert all(out.values()), (rank, out)


def rank_pickle() -> dict:
    model = make_model("mlp")
    apply, params = sf.functionalize(model, units=units_of("mlp"))
    mesh = sf.mesh(dp=-1)
    step = sf.train_step(make_loss_fn("mlp", apply), sf.optim.adamw(**OPT), mesh)
    state, _ = step(step.init(params), _batch(0))
    tree = sf.shard(sf.gather(state.params), sf.specs(state.params, mesh), mesh)
    out = {}
    for name, obj in (("state", state), ("params", state.params), ("grads", step.grads), ("tree", tree)):
        for how in ("pickle", "torch.save"):
            if how == "pickle":
                back = pickle.loads(pickle.dumps(obj))
            else:
                buf = io.BytesIO()
                torch.save(obj, buf)
                buf.seek(0)
                back = torch.load(buf, weights_only=False)
            a, b = optree.tree_leaves(obj), optree.tree_leaves(back)
            same = len(a) == len(b) and all(
                type(x) is type(y)
                and (not isinstance(x, torch.Tensor) or (x.shape == y.shape and torch.equal(_local(x), _local(y))))
                and getattr(x, "placements", None) == getattr(y, "placements", None)
                for x, y in zip(a, b)
            )
            # A state read back trains on: it is copied into the step's buffers.
            out[f"{name} {how}"] = same
    # copy.deepcopy copies values as sf.copy does; a donated state refuses it.
    for name, obj in (("state", state), ("params", state.params), ("grads", step.grads), ("tree", tree)):
        back = copy.deepcopy(obj)
        a, b = optree.tree_leaves(obj), optree.tree_leaves(back)
        out[f"{name} deepcopy"] = len(a) == len(b) and all(
            type(x) is type(y)
            and (not isinstance(x, torch.Tensor) or (
                torch.equal(_local(x), _local(y)) and (_local(x).numel() == 0 or _local(x).data_ptr() != _local(y).data_ptr())))
            and getattr(x, "placements", None) == getattr(y, "placements", None)
            for x, y in zip(a, b)
        )
    kept = copy.deepcopy(state)
    back = pickle.loads(pickle.dumps(state))
    state2, m = step(back, _batch(1))
    out["trains"] = bool(torch.isfinite(m["loss"]))
    out["deepcopy donated"] = _raises_donated(lambda: copy.deepcopy(state))  # `back` took the buffers: donated
    full2 = _full((state2.params, state2.opt_state))
    s3, _ = step(kept, _batch(1))  # the deep copy of the same state trains on to the same values
    out["deepcopy trains"] = all(torch.equal(x, y) for x, y in zip(_full((s3.params, s3.opt_state)), full2))
    return out


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if hasattr(x, "to_local") else x


@pytest.mark.parametrize("world", [1, 3])
def test_states_trees_and_gradients_pickle(pools, world):
    for rank, out in enumerate(pools(world).run(rank_pickle)):
        assert all(out.values()), (rank, out)


def rank_pickle_to(path: str) -> None:
    model = make_model("mlp")
    apply, params = sf.functionalize(model, units=units_of("mlp"))
    step = sf.train_step(make_loss_fn("mlp", apply), sf.optim.adamw(**OPT), sf.mesh(dp=-1))
    torch.save(step.init(params), f"{path}/state{dist.get_rank()}.pt")


def rank_unpickle_from(path: str) -> str:
    try:
        torch.load(f"{path}/state{dist.get_rank()}.pt", weights_only=False)
    except ValueError as e:
        return str(e)
    return "NO ERROR"


def test_a_state_pickled_in_another_job_layout_is_refused_as_it_loads(pools, tmp_path):
    """A state `torch.save`d per rank at world 3 and loaded at world 2 built DTensors over a mesh of
    three ranks, which failed later inside torch (a size mismatch in a gather or the step's copy in)."""
    pools(3).run(rank_pickle_to, str(tmp_path))
    for msg in pools(2).run(rank_unpickle_from, str(tmp_path)):
        assert "over a mesh of ranks [0, 1, 2]" in msg and "world size 2" in msg and "sf.load(path, like=state)" in msg, msg


def rank_gathered_snapshot(strategy: str) -> dict:
    """`sf.gather` of a state's parameters and of the step's gradients, kept while training goes on:
    leaves whole on this rank (one rank, `no_shard`, a `P()` leaf) come back from the gather in memory
    of their own, which the next step does not overwrite."""
    model = make_model("mlp")
    apply, params = sf.functionalize(model, units=units_of("mlp"))
    mesh = sf.mesh(dp=-1)
    specs = sf.specs(params, mesh, rules=[(r"2\..*", sf.P())])  # one layer whole on every rank
    step = sf.train_step(make_loss_fn("mlp", apply), sf.optim.sgd(0.1), mesh, strategy=strategy, specs=specs)
    state, _ = step(step.init(params), _batch(0))
    snaps = {"params": sf.gather(state.params), "grads": sf.gather(step.grads)}
    kept = {k: [x.clone() for x in optree.tree_leaves(v)] for k, v in snaps.items()}
    state, _ = step(state, _batch(1))
    moved = {k: [n for n, (a, b) in enumerate(zip(optree.tree_leaves(snaps[k]), kept[k])) if not torch.equal(a, b)] for k in snaps}
    return {"moved": moved, "leaves": len(kept["params"]), "trained": not torch.equal(kept["params"][0], optree.tree_leaves(sf.gather(state.params))[0])}


@pytest.mark.parametrize("world,strategy", [(1, "full_shard"), (2, "no_shard"), (2, "full_shard")])
def test_a_gathered_tree_is_not_changed_by_later_steps(pools, world, strategy):
    for rank, out in enumerate(pools(world).run(rank_gathered_snapshot, strategy)):
        assert out["leaves"] > 0 and out["trained"], out
        assert out["moved"] == {"params": [], "grads": []}, (rank, out)
