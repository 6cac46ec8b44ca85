"""shardfn.optim: parity with torch.optim, purity, the in-place step_ path, and sharded trees."""

from __future__ import annotations

import math

import optree
import pytest
import torch

import shardfn as sf
import shardfn.optim as O
from shardfn.optim import _alias
from shardfn.optim._norm import global_norm

SHAPES = {"a": (3, 4), "s": (), "m": (5, 7), "v": (2,), "sub": {"w": (7, 3), "b": (3,)}}
SCHED = O.warmup_cosine_decay_schedule(0.0, 0.05, 2, 8, end_value=0.005)
STEPS = 6


def make_tree(seed: int, shapes=SHAPES) -> dict:
    g = torch.Generator().manual_seed(seed)
    return optree.tree_map(lambda s: torch.randn(s, generator=g), shapes, is_leaf=lambda x: isinstance(x, tuple))


def grads_seq(params, n: int = STEPS, seed: int = 100) -> list:
    leaves, spec = optree.tree_flatten(params)
    g = torch.Generator().manual_seed(seed)
    return [spec.unflatten([torch.randn(x.shape, generator=g) for x in leaves]) for _ in range(n)]


def clone_tree(tree):
    return optree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def rel_err(a, b) -> float:
    """Max over leaves of ||a - b|| / ||b||, with ||b|| floored at an RMS of 1 (leaves that end near 0)."""
    errs = [
        ((x - y).norm() / max(y.norm().item(), math.sqrt(max(y.numel(), 1)))).item()
        for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b))
    ]
    return max(errs)


def run_torch(cls, kwargs, params, grads, lr=None, groups=None, clip=None):
    leaves, spec = optree.tree_flatten(params)
    ps = [torch.nn.Parameter(x.clone()) for x in leaves]
    opt = cls(groups(ps) if groups else ps, **kwargs)
    for t, g in enumerate(grads):
        for p, gl in zip(ps, optree.tree_leaves(g)):
            p.grad = gl.clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ps, clip)
        if lr is not None:
            for group in opt.param_groups:
                group["lr"] = lr(t)
        opt.step()
    return spec.unflatten([p.detach() for p in ps])


def run_ours(opt, params, grads, mode: str):
    """mode: 'update' (pure), 'step_' (in place), or 'mixed' (alternating)."""
    params = clone_tree(params)
    state = opt.init(params)
    for t, g in enumerate(grads):
        if mode == "step_" or (mode == "mixed" and t % 2):
            state = opt.step_(clone_tree(g), state, params)
        else:
            updates, state = opt.update(g, state, params)
            params = O.apply_updates(params, updates)
    return params


CASES = {
    "adamw": (lambda: O.adamw(1e-2), torch.optim.AdamW, dict(lr=1e-2), None),
    "adamw_wd_betas": (lambda: O.adamw(3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
                       torch.optim.AdamW, dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1), None),
    "adamw_sched": (lambda: O.adamw(SCHED, weight_decay=0.1), torch.optim.AdamW, dict(lr=0.0, weight_decay=0.1), SCHED),
    "adam": (lambda: O.adam(1e-2), torch.optim.Adam, dict(lr=1e-2), None),
    "adam_wd": (lambda: O.adam(1e-2, weight_decay=0.1), torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1), None),
    "adam_sched": (lambda: O.adam(SCHED, weight_decay=0.1), torch.optim.Adam, dict(lr=0.0, weight_decay=0.1), SCHED),
    "sgd": (lambda: O.sgd(0.1), torch.optim.SGD, dict(lr=0.1), None),
    "sgd_momentum": (lambda: O.sgd(0.1, momentum=0.9), torch.optim.SGD, dict(lr=0.1, momentum=0.9), None),
    "sgd_dampening": (lambda: O.sgd(0.1, momentum=0.9, dampening=0.3), torch.optim.SGD,
                      dict(lr=0.1, momentum=0.9, dampening=0.3), None),
    "sgd_nesterov": (lambda: O.sgd(0.1, momentum=0.8, nesterov=True), torch.optim.SGD,
                     dict(lr=0.1, momentum=0.8, nesterov=True), None),
    "sgd_wd": (lambda: O.sgd(0.1, momentum=0.9, dampening=0.1, weight_decay=0.05), torch.optim.SGD,
               dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.05), None),
    "sgd_wd_plain": (lambda: O.sgd(0.1, weight_decay=0.05), torch.optim.SGD, dict(lr=0.1, weight_decay=0.05), None),
    "sgd_sched": (lambda: O.sgd(SCHED, momentum=0.9, nesterov=True, weight_decay=0.05), torch.optim.SGD,
                  dict(lr=0.0, momentum=0.9, nesterov=True, weight_decay=0.05), SCHED),
}


UPDATE_TOL = 3e-5  # 6e-6 at most from rounding here; an lr off by 1e-4 of itself, or beta2 0.998 for 0.999: 1e-4, 4e-4


@pytest.mark.parametrize("mode", ["update", "step_", "mixed"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch(name, mode):
    make, cls, kwargs, sched = CASES[name]
    params = make_tree(0)
    grads = grads_seq(params)
    ref = run_torch(cls, kwargs, params, grads, lr=sched)
    out = run_ours(make(), params, grads, mode)
    assert rel_err(out, ref) < 1e-5
    # The accumulated update itself, relative to its own size (no floor: an update is small beside
    # the parameters, whose error the line above bounds), so a small formula error shows.
    moved = [(o - p, r - p) for o, r, p in zip(*map(optree.tree_leaves, (out, ref, params)))]
    assert min(d_ref.norm().item() for _, d_ref in moved) > 0, "a leaf the reference did not move checks nothing"
    assert max(((d - d_ref).norm() / d_ref.norm()).item() for d, d_ref in moved) < UPDATE_TOL
    assert all(x.dtype == torch.float32 for x in optree.tree_leaves(out))


@pytest.mark.parametrize("name", ["adamw_sched", "adam_wd", "sgd_wd", "sgd_nesterov"])
def test_update_is_pure(name):
    opt = CASES[name][0]()
    params = make_tree(0)
    grads = grads_seq(params, 3)
    state = opt.init(params)
    for g in grads:
        before = clone_tree((g, state, params))
        updates, new_state = opt.update(g, state, params)
        after = (g, state, params)
        assert optree.tree_structure(before) == optree.tree_structure(after)
        assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(before), optree.tree_leaves(after)))
        # the new state and the updates share no storage with the inputs
        ins = {x.untyped_storage().data_ptr() for x in optree.tree_leaves((state, params)) if x.numel()}
        outs = [x.untyped_storage().data_ptr() for x in optree.tree_leaves(new_state) if x.numel()]
        assert not ins.intersection(outs)
        params, state = O.apply_updates(params, updates), new_state


def test_state_layout():
    params = make_tree(0)
    state = O.adamw(1e-3).init(params)
    adam_state = state[0]
    assert isinstance(adam_state, O.ScaleByAdamState)
    assert adam_state.count.dtype == torch.int64 and adam_state.count.device.type == "cpu"
    assert optree.tree_structure(adam_state.mu) == optree.tree_structure(params)
    s = O.sgd(O.constant_schedule(0.1), momentum=0.9).init(params)
    assert isinstance(s[0], O.TraceState) and isinstance(s[1], O.ScaleByScheduleState)
    opt = O.sgd(0.1)
    assert all(callable(f) for f in (opt.init, opt.update, opt.update_, opt.step_))
    # A transformation of only (init, update), as optax builds them: no in-place forms; a chain
    # of it gets both, and a train step runs its update and apply_updates.
    user = O.GradientTransformation(opt.init, opt.update)
    assert user.update_ is None and user.step_ is None
    chained = O.chain(user)
    assert callable(chained.update_) and callable(chained.step_)


def test_chain_and_clip_match_torch():
    params = make_tree(1)
    grads = grads_seq(params)
    opt = O.chain(O.clip_by_global_norm(1.0), O.adamw(1e-2, weight_decay=0.1))
    ref = run_torch(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), params, grads, clip=1.0)
    for mode in ("update", "step_"):
        assert rel_err(run_ours(opt, params, grads, mode), ref) < 1e-5
    custom = O.chain(O.scale_by_adam(0.9, 0.999, 1e-8), O.scale(-1e-2))
    ref = run_torch(torch.optim.Adam, dict(lr=1e-2), params, grads)
    for mode in ("update", "step_"):
        assert rel_err(run_ours(custom, params, grads, mode), ref) < 1e-5


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_by_global_norm(max_norm):
    g = make_tree(2)
    leaves = optree.tree_leaves(g)
    norm = math.sqrt(sum(float((x.double() ** 2).sum()) for x in leaves))
    assert abs(global_norm(g).item() - norm) < 1e-5 * norm
    assert global_norm(g).dtype == torch.float32 and global_norm(g).ndim == 0
    clip = O.clip_by_global_norm(max_norm)
    out, _ = clip.update(g, clip.init(g))
    coef = min(1.0, max_norm / (norm + 1e-6))
    assert rel_err(out, optree.tree_map(lambda x: x * coef, g)) < 1e-6
    assert abs(global_norm(out).item() - min(norm, max_norm)) < 1e-4 * norm
    assert global_norm({}).item() == 0.0


def test_masked_weight_decay_matches_param_groups():
    params = make_tree(3)
    grads = grads_seq(params)
    mask = lambda p: optree.tree_map(lambda x: x.ndim > 1, p)  # noqa: E731 - no decay on vectors/scalars
    decay = [x.ndim > 1 for x in optree.tree_leaves(params)]

    def groups(ps):
        return [{"params": [p for p, d in zip(ps, decay) if d]},
                {"params": [p for p, d in zip(ps, decay) if not d], "weight_decay": 0.0}]

    ref = run_torch(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.5), params, grads, groups=groups)
    for mode in ("update", "step_", "mixed"):
        assert rel_err(run_ours(O.adamw(1e-2, weight_decay=0.5, mask=mask), params, grads, mode), ref) < 1e-5
    ref = run_torch(torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.5), params, grads, groups=groups)
    for mode in ("update", "step_"):
        out = run_ours(O.sgd(0.1, momentum=0.9, weight_decay=0.5, mask=mask(params)), params, grads, mode)
        assert rel_err(out, ref) < 1e-5
    # masked-out leaves get no state
    state = O.masked(O.trace(0.9), mask).init(params)
    assert len(optree.tree_leaves(state.inner_state.trace)) == sum(decay)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_step_keeps_its_plan_only_for_the_same_tensors(kind, monkeypatch):
    """Note [fused step plan]: a train step passes the same local tensors every step (gradients
    written in place), and one optimizer may drive two states in turn; both stay exact."""
    mask = {"a": True, "s": False, "m": True, "v": False, "sub": {"w": True, "b": False}}
    build = {
        "adamw": (lambda: O.adamw(1e-2, weight_decay=0.5, mask=mask), torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.5)),
        "sgd": (lambda: O.sgd(0.1, momentum=0.9, weight_decay=0.5, mask=mask), torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.5)),
    }[kind]
    decay = optree.tree_leaves(mask)

    def groups(ps):
        return [{"params": [p for p, d in zip(ps, decay) if d]},
                {"params": [p for p, d in zip(ps, decay) if not d], "weight_decay": 0.0}]

    opt = build[0]()
    runs = []
    for seed in (3, 4):
        params = make_tree(seed)
        seq = grads_seq(params, seed=seed + 100)
        grads = clone_tree(seq[0])  # the same tensors every step, refilled in place
        runs.append(dict(params=clone_tree(params), state=opt.init(params), grads=grads, seq=seq,
                         ref=run_torch(build[1], build[2], params, seq, groups=groups)))
    # Runs of one state (the plan is reused) and switches between the two (it is made again, and
    # the step counts are set again).
    order = [(0, 0), (0, 1), (0, 2), (1, 0), (0, 3), (1, 1), (1, 2), (1, 3), (0, 4), (1, 4), (0, 5), (1, 5)]
    plans = []
    fusable = _alias._fusable
    monkeypatch.setattr(_alias, "_fusable", lambda lists: plans.append(1) or fusable(lists))
    for r, t in order:
        run = runs[r]
        for g, new in zip(optree.tree_leaves(run["grads"]), optree.tree_leaves(run["seq"][t])):
            g.copy_(new)
        run["state"] = opt.step_(run["grads"], run["state"], run["params"])
    assert len(plans) == 8  # the first, then one for each switch; none within a run
    for run in runs:
        assert rel_err(run["params"], run["ref"]) < 1e-5


@pytest.mark.parametrize("mode", ["update", "step_"])
def test_from_torch(mode):
    params = make_tree(4)
    grads = grads_seq(params)
    ref = run_torch(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), params, grads)
    opt = O.from_torch(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    assert rel_err(run_ours(opt, params, grads, mode), ref) < 1e-6
    ref = run_torch(torch.optim.SGD, dict(lr=0.0, momentum=0.9, dampening=0.2), params, grads, lr=SCHED)
    opt = O.from_torch(torch.optim.SGD, lr=SCHED, momentum=0.9, dampening=0.2)
    assert rel_err(run_ours(opt, params, grads, mode), ref) < 1e-6


# Every elementwise optimizer of torch.optim, with hyper-parameters off their defaults (those read
# when the optimizer is built, not only per step: Adagrad's initial accumulator).
TORCH_OPTIMIZERS = {
    "Adagrad": (torch.optim.Adagrad, dict(lr=1e-2, initial_accumulator_value=0.1, lr_decay=0.01, weight_decay=0.1)),
    "Adadelta": (torch.optim.Adadelta, dict(lr=0.5, rho=0.8, weight_decay=0.1)),
    "Adam": (torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.9), amsgrad=True)),
    "Adamax": (torch.optim.Adamax, dict(lr=1e-2, weight_decay=0.1)),
    "ASGD": (torch.optim.ASGD, dict(lr=1e-2, t0=1.0, weight_decay=0.1)),
    "NAdam": (torch.optim.NAdam, dict(lr=1e-2, momentum_decay=1e-3, decoupled_weight_decay=True, weight_decay=0.1)),
    "RAdam": (torch.optim.RAdam, dict(lr=1e-2, weight_decay=0.1)),
    "RMSprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
    "Rprop": (torch.optim.Rprop, dict(lr=1e-2, etas=(0.4, 1.3))),
    "SGD": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)),
}


@pytest.mark.parametrize("mode", ["update", "step_"])
@pytest.mark.parametrize("name", list(TORCH_OPTIMIZERS))
def test_from_torch_equals_each_torch_optimizer(name, mode):
    cls, kwargs = TORCH_OPTIMIZERS[name]
    params = make_tree(5)
    grads = grads_seq(params)
    ref = run_torch(cls, kwargs, params, grads)
    assert rel_err(run_ours(O.from_torch(cls, **kwargs), params, grads, mode), ref) < 1e-6


def test_from_torch_steps_a_tree_with_no_leaf():
    """An empty tree, or a mask that selects no leaf: nothing to step (torch refuses an optimizer
    over no parameter), the leaves left out keep their values."""
    opt = O.from_torch(torch.optim.Adagrad, lr=1e-2, initial_accumulator_value=0.1)
    state = opt.init({})
    updates, state = opt.update({}, state, {})
    assert updates == {} and int(state.count) == 1
    assert int(opt.step_({}, state, {}).count) == 2
    params = {"a": torch.ones(2)}
    masked = O.masked(opt, {"a": False})
    updates, _ = masked.update({"a": torch.full((2,), 3.0)}, masked.init(params), params)
    assert torch.equal(updates["a"], torch.full((2,), 3.0))  # a masked-out leaf's update is its gradient, as optax


def test_from_torch_is_pure():
    opt = O.from_torch(torch.optim.Adam, lr=1e-2)
    params = make_tree(4)
    state = opt.init(params)
    for g in grads_seq(params, 2):
        before = clone_tree((g, state, params))
        updates, new_state = opt.update(g, state, params)
        after = optree.tree_leaves((g, state, params))
        assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(before), after))
        params, state = O.apply_updates(params, updates), new_state


def test_apply_updates_keeps_dtype_and_requires_grad():
    p = {"w": torch.ones(3, dtype=torch.bfloat16), "b": torch.zeros(2, requires_grad=True)}
    u = {"w": torch.full((3,), 0.5), "b": torch.ones(2)}
    out = O.apply_updates(p, u)
    assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"], torch.full((3,), 1.5, dtype=torch.bfloat16))
    assert out["b"].requires_grad and out["b"].is_leaf and torch.equal(p["b"], torch.zeros(2))


def test_schedules():
    assert O.constant_schedule(0.3)(100) == 0.3
    lin = O.linear_schedule(1.0, 0.0, 4)
    assert [lin(t) for t in (0, 1, 4, 9)] == [1.0, 0.75, 0.0, 0.0]
    cos = O.cosine_decay_schedule(2.0, 10, alpha=0.1)
    assert cos(0) == pytest.approx(2.0) and cos(5) == pytest.approx(2.0 * (0.45 + 0.1))
    assert cos(50) == pytest.approx(0.2)
    w = O.warmup_cosine_decay_schedule(0.0, 1.0, 10, 110, end_value=0.1)
    assert [w(0), w(5), w(10)] == pytest.approx([0.0, 0.5, 1.0])
    assert w(60) == pytest.approx(0.55) and w(110) == pytest.approx(0.1) and w(500) == pytest.approx(0.1)
    j = O.join_schedules([O.constant_schedule(1.0), O.linear_schedule(2.0, 0.0, 2)], [3])
    assert [j(t) for t in range(6)] == [1.0, 1.0, 1.0, 2.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "build",
    [
        lambda: O.adamw(-1e-3),
        lambda: O.adam(1e-3, betas=(1.0, 0.999)),
        lambda: O.adam(1e-3, betas=(0.9, -0.1)),
        lambda: O.adamw(1e-3, eps=-1.0),
        lambda: O.adamw(1e-3, weight_decay=-0.1),
        lambda: O.sgd(-0.1),
        lambda: O.sgd(0.1, momentum=-0.5),
        lambda: O.sgd(0.1, nesterov=True),
        lambda: O.trace(0.9, nesterov=True, dampening=0.1),
        lambda: O.scale_by_learning_rate(-1.0),
        lambda: O.sgd(0.1, momentum=0.9, dampening=0.5, nesterov=True),
        lambda: O.sgd(0.1, momentum=0.9, dampening=1.5),
        lambda: O.clip_by_global_norm(0.0),
        lambda: O.linear_schedule(1.0, 0.0, 0),
        lambda: O.warmup_cosine_decay_schedule(0.0, 1.0, 10, 5),
        lambda: O.from_torch(torch.optim.AdamW, lr=-1.0),
        lambda: O.from_torch(dict, lr=1.0),
        lambda: O.chain(O.scale(1.0), "not a transform"),
    ],
)
def test_bad_hyperparameters(build):
    with pytest.raises(ValueError):
        build()


def test_structure_mismatch():
    params = make_tree(0)
    opt = O.adamw(1e-3)
    state = opt.init(params)
    bad = dict(params, extra=torch.zeros(2))
    for fn in (lambda: opt.update(bad, state, bad), lambda: opt.step_(bad, state, bad),
               lambda: opt.update(params, state[:2], params), lambda: O.apply_updates(params, bad),
               lambda: O.sgd(0.1, momentum=0.9).update(params, state, params),
               lambda: O.add_decayed_weights(0.1).update(params, O.EmptyState())):
        with pytest.raises(ValueError):
            fn()


# ---- sharded trees: run on every rank of a RankPool --------------------------------------------

SHARDED_SHAPES = {"rows5": (5, 3), "rows7": (7,), "one": (1, 4), "rep": (3, 2), "scalar": ()}
SHARDED_PLACEMENT = {"rows5": "shard", "rows7": "shard", "one": "shard", "rep": "rep", "scalar": "rep"}
SHARDED_OPTS = {
    "adamw": lambda: O.adamw(SCHED, weight_decay=0.1),
    "adam": lambda: O.adam(1e-2, weight_decay=0.1),
    "sgd": lambda: O.sgd(0.1, momentum=0.9, dampening=0.1, weight_decay=0.05),
    "sgd_nesterov": lambda: O.sgd(0.1, momentum=0.9, nesterov=True),
    "clip_adamw": lambda: O.chain(O.clip_by_global_norm(0.5), O.adamw(1e-2)),
    "adamw_masked": lambda: O.adamw(1e-2, weight_decay=0.5, mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p)),
    "from_torch_adamw": lambda: O.from_torch(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
}


def _distribute(tree, mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {k: distribute_tensor(v, mesh, [Shard(0) if SHARDED_PLACEMENT[k] == "shard" else Replicate()])
            for k, v in tree.items()}


def _count_dtensor_ops(fn):
    """Runs fn and returns (result, number of dispatched ops that saw a DTensor argument)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(isinstance(x, DTensor) for x in optree.tree_leaves((args, kwargs or {}))):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        out = fn()
    return out, Count.n


def _rank_sharded_check(world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    full = make_tree(5, SHARDED_SHAPES)
    grads = grads_seq(full, 5, seed=7)
    res = {"err": {}, "dtensor_ops": 0, "placements_ok": True, "local_rows": None}
    sharded0 = _distribute(full, mesh)
    res["local_rows"] = {k: tuple(v.to_local().shape) for k, v in sharded0.items()}
    res["counter_works"] = _count_dtensor_ops(lambda: sharded0["rows5"] * 2)[1] > 0

    def same_layout(tree, like):
        return all(isinstance(x, DTensor) and x.placements == y.placements and x.shape == y.shape
                   and x.stride() == y.stride() and x.device_mesh == y.device_mesh
                   for x, y in zip(optree.tree_leaves(tree), optree.tree_leaves(like)))

    for name, make in SHARDED_OPTS.items():
        ref = run_ours(make(), full, grads, "update")
        for mode in ("update", "step_"):
            opt = make()
            params = _distribute(full, mesh)
            state = opt.init(params)
            for a in optree.tree_leaves(state):
                if a.dim() > 0 and not isinstance(a, DTensor):
                    res["placements_ok"] = False
            for g in grads:
                gs = _distribute(g, mesh)
                if mode == "update":
                    (updates, state), n = _count_dtensor_ops(lambda: opt.update(gs, state, params))
                    res["placements_ok"] &= same_layout(updates, params)
                    params = O.apply_updates(params, updates)
                    res["placements_ok"] &= same_layout(params, gs)
                else:
                    state, n = _count_dtensor_ops(lambda: opt.step_(gs, state, params))
                res["dtensor_ops"] += n
            mus = [s.mu for s in optree.tree_leaves(state, is_leaf=lambda x: isinstance(x, O.ScaleByAdamState))
                   if isinstance(s, O.ScaleByAdamState)]
            for mu in mus:
                res["placements_ok"] &= same_layout(mu, params)
            res["err"][(name, mode)] = rel_err({k: v.full_tensor() for k, v in params.items()}, ref)

    # global norm: equal to the full tree's, with exactly one all_reduce
    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    sg = _distribute(grads[0], mesh)
    dist.all_reduce = counting
    try:
        norm = global_norm(sg)
        res["norm_calls"] = len(calls)
        clip = O.clip_by_global_norm(0.5)
        clipped, _ = clip.update(sg, clip.init(sg))
        res["clip_calls"] = len(calls) - res["norm_calls"]
        global_norm(grads[0])
        res["plain_calls"] = len(calls) - res["norm_calls"] - res["clip_calls"]
    finally:
        dist.all_reduce = real
    res["norm_err"] = abs(norm.item() - global_norm(grads[0]).item()) / global_norm(grads[0]).item()
    ref_clip, _ = clip.update(grads[0], clip.init(grads[0]))
    res["clip_err"] = rel_err({k: v.full_tensor() for k, v in clipped.items()}, ref_clip)
    res["placements_ok"] &= same_layout(clipped, sg)
    # plain leaves in a sharded tree count as replicated on every rank
    mixed = global_norm({**sg, "plain": torch.full((3,), 2.0)})
    res["mixed_err"] = abs(mixed.item() - global_norm({**grads[0], "plain": torch.full((3,), 2.0)}).item())
    return res


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_trees(pools, world):
    results = pools(world).run(_rank_sharded_check, world)
    rows = [r["local_rows"]["one"][0] for r in results]
    assert 0 in rows, "some rank must hold an empty shard"
    assert [r["local_rows"]["rows5"][0] for r in results] != [5] * world
    for r in results:
        assert r["placements_ok"] and r["counter_works"]
        assert r["mixed_err"] < 1e-5
        assert r["dtensor_ops"] == 0, "optimizer math must run on local tensors, not through DTensor dispatch"
        assert max(r["err"].values()) < 1e-5, r["err"]
        assert r["norm_calls"] == 1 and r["clip_calls"] == 1 and r["plain_calls"] == 0
        assert r["norm_err"] < 1e-6 and r["clip_err"] < 1e-6


def test_sgd_options_are_keyword_only_and_checked():
    """optax's order is (lr, momentum, nesterov), torch's (lr, momentum, dampening, weight_decay,
    nesterov): a positional call would silently mean something else in one of them."""
    with pytest.raises(TypeError):
        O.sgd(0.1, 0.9)  # type: ignore[misc]
    for bad in (dict(momentum="0.9"), dict(nesterov=1), dict(dampening=True), dict(dampening=2.0), dict(weight_decay=None)):
        with pytest.raises(ValueError):
            O.sgd(0.1, **bad)


def test_clip_by_global_norm_on_float64():
    params = {"w": torch.randn(4, 3, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}
    grads = {k: 10 * torch.ones_like(v) for k, v in params.items()}
    opt = O.clip_by_global_norm(1.0)
    updates, _ = opt.update(grads, opt.init(params), params)
    norm = math.sqrt(sum(float((u.double() ** 2).sum()) for u in updates.values()))
    assert abs(norm - 1.0) < 1e-5 and all(u.dtype == torch.float64 for u in updates.values())


def rank_replaced_update() -> dict:
    """A transformation rebuilt with another `update` (`opt._replace(update=...)`): the train step
    runs that update, not the in-place step of the one it replaced."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    apply, params = sf.functionalize(model)
    frozen_lr = sf.optim.sgd(0.1)._replace(update=sf.optim.sgd(0.0).update)
    step = sf.train_step(lambda p, b: apply(p, b).pow(2).sum(), frozen_lr, sf.mesh(dp=-1))
    state = step.init(params)
    before = [x.full_tensor().clone() for x in optree.tree_leaves(state.params)]
    state, _ = step(state, torch.randn(5, 4))
    after = [x.full_tensor() for x in optree.tree_leaves(state.params)]
    return {"unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
            "own": sf.optim.sgd(0.1).step_ is not None}


def test_a_replaced_update_is_the_one_that_runs(pools):
    for out in pools(1).run(rank_replaced_update):
        assert out["unchanged"] and out["own"], out


def test_apply_if_finite_skips_non_finite_updates():
    """A NaN or an infinity anywhere skips the update (zeros; the inner state, Adam's count
    included, unchanged); after max_consecutive_errors skipped in a row the next one is applied,
    as in optax; finite updates are the inner transformation's exactly, in every mode."""
    full = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), "b": torch.zeros(3)}
    grads = grads_seq(full, 6, seed=3)
    bad = {2: float("nan"), 3: float("inf"), 4: float("nan")}  # three in a row: the third is applied at max 2
    for mode in ("update", "update_", "step_"):
        opt = O.apply_if_finite(O.adamw(1e-2, weight_decay=0.1), max_consecutive_errors=2)
        ref_opt = O.adamw(1e-2, weight_decay=0.1)
        params = {k: v.clone() for k, v in full.items()}
        ref = {k: v.clone() for k, v in full.items()}
        state, ref_state = opt.init(params), ref_opt.init(ref)
        seen = []
        for i, g in enumerate(grads):
            g = {k: v.clone() for k, v in g.items()}
            if i in bad:
                g["w"][1, 2] = bad[i]
            if mode == "step_":
                state = opt.step_(g, state, params)
            else:
                updates, state = (opt.update if mode == "update" else opt.update_)(g, state, params)
                params = O.apply_updates(params, updates)
            if i not in bad or i == 4:  # the third in a row is let through
                ref_upd, ref_state = ref_opt.update({k: v.clone() for k, v in g.items()}, ref_state, ref)
                ref = O.apply_updates(ref, ref_upd)
            seen.append((int(state.notfinite_count), bool(state.last_finite), int(state.total_notfinite)))
        assert seen == [(0, True, 0), (0, True, 0), (1, False, 1), (2, False, 2), (3, False, 3), (0, True, 3)], (mode, seen)
        assert int(state.inner_state[0].count) == int(ref_state[0].count) == 4, mode
        assert torch.isnan(params["w"][1, 2]) and torch.isnan(ref["w"][1, 2]), mode  # the NaN let through
        torch.testing.assert_close(params, ref, equal_nan=True, rtol=1e-6, atol=1e-7, msg=mode)
    # Finite updates only: the inner optimizer's exactly.
    opt = O.apply_if_finite(O.sgd(0.1, momentum=0.9), 3)
    assert rel_err(run_ours(opt, full, grads, "step_"), run_ours(O.sgd(0.1, momentum=0.9), full, grads, "step_")) == 0
    for bad_max in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_consecutive_errors must be a positive int"):
            O.apply_if_finite(O.sgd(0.1), bad_max)
    with pytest.raises(ValueError, match="GradientTransformation"):
        O.apply_if_finite(0.1, 3)


def _rank_apply_if_finite_in_the_step(strategy: str) -> dict:
    """A train step with apply_if_finite(adamw) on sharded state: at step 1 one gradient element
    is infinite, in one rank's shard only (the last row of the last bias); every rank skips that
    step, and the parameters are the reference's that skipped it too."""
    import torch.distributed as dist
    from reference import OPT, Reference, compare_params, global_batch, local_batch, loss_of, make_model

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model("mlp")
    ref = Reference(model, "mlp")
    apply, params = sf.functionalize(model, units=r"\d+")
    poison = {"on": False}

    def loss_fn(p, batch):
        x, y = batch
        loss = loss_of("mlp", apply(p, x), y)
        return loss + p["4"]["bias"][-1] * float("inf") if poison["on"] else loss

    opt = O.apply_if_finite(O.adamw(**OPT), max_consecutive_errors=3)
    step = sf.train_step(loss_fn, opt, sf.mesh(dp=-1), strategy=strategy)
    state = step.init(params)
    rows = state.params["4"]["bias"].shape[0]
    owner = rank == (rows - 1) // -(-rows // world) if strategy == "full_shard" else True  # holds the last row
    for i in range(4):
        batch = global_batch("mlp", i, world)
        poison["on"] = i == 1
        state, metrics = step(state, local_batch(batch, rank, world))
        if i != 1:
            ref.step(batch)
    return {"err": compare_params(state.params, apply, ref), "counts": (int(state.opt_state.notfinite_count),
            int(state.opt_state.total_notfinite)), "holds_the_row": owner}


@pytest.mark.parametrize("world", [2, 3])
def test_apply_if_finite_in_a_sharded_train_step(pools, world):
    for strategy in ("full_shard", "no_shard"):
        results = pools(world).run(_rank_apply_if_finite_in_the_step, strategy)
        for r in results:
            assert r["err"] < 1e-5 and r["counts"] == (0, 1), (strategy, r)
        if strategy == "full_shard":  # the infinite element lay in some ranks' shards only
            assert not all(r["holds_the_row"] for r in results), results


def _rank_whole_tensor_optimizers() -> dict:
    """Adafactor and Muon through from_torch: refused on leaves split over ranks, and on whole
    (replicated) leaves equal to torch's own step."""
    mesh = sf.mesh(dp=-1)
    g = torch.Generator().manual_seed(0)
    w, grad = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    out = {}
    for cls in (torch.optim.Adafactor, torch.optim.Muon):
        opt = O.from_torch(cls, lr=0.01)
        for layout, spec in (("split", sf.P("dp")), ("whole", sf.P())):
            params = sf.shard({"w": w.clone()}, {"w": spec}, mesh)
            grads = sf.shard({"w": grad.clone()}, {"w": spec}, mesh)
            try:
                updates, _ = opt.update(grads, opt.init(params), params)
            except NotImplementedError as e:
                out[cls.__name__, layout] = str(e)
                continue
            ref = w.clone().requires_grad_()
            torch_opt = cls([ref], lr=0.01)
            ref.grad = grad.clone()
            torch_opt.step()
            out[cls.__name__, layout] = rel_err(O.apply_updates(params, updates)["w"].full_tensor(), ref.detach())
    return out


def test_from_torch_refuses_optimizers_that_read_whole_tensors_on_shards(pools):
    """Adafactor's factored moments and relative step, Muon's orthogonalization: on a rank's
    shard they would compute as if it were the whole tensor (Adafactor: parameters 3e-3 off after
    3 steps, silently). Refused there; exact on whole leaves. LBFGS needs a closure: refused."""
    with pytest.raises(NotImplementedError, match="closure"):
        O.from_torch(torch.optim.LBFGS, lr=0.1)
    for r in pools(2).run(_rank_whole_tensor_optimizers):
        for name in ("Adafactor", "Muon"):
            assert isinstance(r[name, "split"], str) and "split over ranks" in r[name, "split"], r
            assert r[name, "whole"] < 1e-6, r


def test_adam_refuses_complex_leaves():
    """torch.optim.Adam takes a complex value's real and imaginary parts as two reals; a plain
    second moment squared the complex number (0.25 off after 3 steps): refused at init."""
    params = {"z": torch.randn(3, dtype=torch.complex64), "w": torch.randn(2)}
    for opt in (sf.optim.adam(1e-3), sf.optim.adamw(1e-3)):
        with pytest.raises(NotImplementedError, match="leaf 'z' is torch.complex64"):
            opt.init(params)
    sf.optim.sgd(0.1, momentum=0.9).init(params)  # elementwise: complex as torch's SGD
