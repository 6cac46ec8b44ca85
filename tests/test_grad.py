"""`sf.value_and_grad` / `sf.grad`: the FSDP gradient as a transform. Its gradients equal the
unsharded ones on the global batch; a step written by hand with it and `sf.optim.adamw` equals
`train_step` step for step; trees are taken over without a per-step copy, and old trees and
gradients are donated."""

from __future__ import annotations

import optree
import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from shardfn import _collectives as C
from reference import OPT, backward_on_another_thread, global_batch, local_batch, loss_of, make_loss_fn, make_model, rel_err, units_of

KINDS = ["mlp", "gpt"]


def rank_gradients(kind: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(kind)
    ref_model = make_model(kind)
    apply, params = sf.functionalize(model, units=units_of(kind))
    mesh = sf.mesh(dp=-1)
    sharded = sf.shard(params, sf.specs(params, mesh), mesh)
    loss_fn = make_loss_fn(kind, apply)
    batch = global_batch(kind, 0, world)
    vg = sf.value_and_grad(lambda p, b: (loss_fn(p, b), b[0].shape[0]), has_aux=True)
    (loss, aux), grads = vg(sharded, local_batch(batch, rank, world))
    # The unsharded reference on the global batch.
    ref_loss = loss_of(kind, ref_model(batch[0]), batch[1])
    ref_loss.backward()
    want = {n: p.grad for n, p in ref_model.named_parameters()}
    got = sf.to_state_dict(sf.gather(grads))
    out = {"loss": rel_err(loss, ref_loss), "aux": aux, "grads": max(rel_err(got[n], want[n]) for n in want),
           "types": {type(g).__name__ for g in optree.tree_leaves(grads)}}
    # The same tree again: no copy in, the old gradients donated.
    first = [g.detach().clone() for g in optree.tree_leaves(sf.gather(grads))]
    leaves_before = [x._local_tensor.data_ptr() for x in optree.tree_leaves(sharded)]
    second = vg(sharded, local_batch(batch, rank, world))[1]
    out["same_memory"] = leaves_before == [x._local_tensor.data_ptr() for x in optree.tree_leaves(sharded)]
    try:
        sf.gather(grads)
        out["old_grads"] = "readable"
    except sf.DonatedError:
        out["old_grads"] = "donated"
    out["second"] = max(rel_err(a, b) for a, b in zip(optree.tree_leaves(sf.gather(second)), first))
    # sf.grad takes the tree into its own buffers; the first transform then takes it back.
    g2 = sf.grad(loss_fn)(sharded, local_batch(batch, rank, world))
    out["grad"] = max(rel_err(a, b) for a, b in zip(optree.tree_leaves(sf.gather(g2)), first))
    third = vg(sharded, local_batch(batch, rank, world))[1]
    out["third"] = max(rel_err(a, b) for a, b in zip(optree.tree_leaves(sf.gather(third)), first))
    # With remat, the backward (hooks, reductions, recomputes) on another thread, as on CUDA.
    with backward_on_another_thread():
        fourth = sf.grad(loss_fn, remat=True)(sharded, local_batch(batch, rank, world))
    out["threaded"] = max(rel_err(a, b) for a, b in zip(optree.tree_leaves(sf.gather(fourth)), first))
    return out


def rank_fp64_loss() -> dict:
    """An fp64 model: the loss `value_and_grad` and `train_step` report is the fp64 mean over ranks
    (it was accumulated in fp32: 2e-7 off while the parameters matched to 1e-16), and the gradient
    norm that clipping scales by is fp64 too (it was summed in fp32: 5e-8 off)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    ref = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4 * world, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = [p.requires_grad_() for p in ref]
    want = torch.func.functional_call(model, dict(zip(["0.weight", "0.bias", "2.weight", "2.bias"], ref)), x).pow(2).mean() + 1 / 3
    want_norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in torch.autograd.grad(want, ref)]))
    apply, params = sf.functionalize(model)
    mesh = sf.mesh(dp=-1)

    def loss_fn(p, xb):
        return apply(p, xb).pow(2).mean() + 1 / 3

    loss, _ = sf.value_and_grad(loss_fn)(sf.shard(params, sf.specs(params, mesh), mesh), x.chunk(world)[rank])
    step = sf.train_step(loss_fn, sf.optim.sgd(0.0), mesh, max_grad_norm=1e-3)
    _, m = step(step.init(params), x.chunk(world)[rank])
    return {"dtypes": (loss.dtype, m["loss"].dtype, m["grad_norm"].dtype),
            "errs": (abs(loss.item() - want.item()), abs(m["loss"].item() - want.item()), abs(m["grad_norm"].item() / want_norm.item() - 1))}


@pytest.mark.parametrize("world", [1, 2])
def test_an_fp64_loss_is_reported_in_fp64(pools, world):
    for out in pools(world).run(rank_fp64_loss):
        assert out["dtypes"] == (torch.float64,) * 3, out
        assert max(out["errs"]) < 1e-15, out


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_value_and_grad_equals_the_unsharded_gradient(pools, kind, world):
    for rank, out in enumerate(pools(world).run(rank_gradients, kind)):
        assert out["loss"] < 1e-6 and out["grads"] < 1e-5, (rank, out)
        assert out["types"] == {"DTensor"}, out
        assert out["aux"] == global_batch(kind, 0, world)[0].chunk(world)[rank].shape[0]
        assert out["grad"] < 1e-6 and out["second"] < 1e-6 and out["third"] < 1e-6, {k: out[k] for k in ("grad", "second", "third")}
        assert out["threaded"] < 1e-6, out["threaded"]
        assert out["same_memory"] and out["old_grads"] == "donated", {k: out[k] for k in ("same_memory", "old_grads")}


def rank_hand_written_step(kind: str, steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    # train_step.
    apply, params = sf.functionalize(make_model(kind), units=units_of(kind))
    mesh = sf.mesh(dp=-1)
    step = sf.train_step(make_loss_fn(kind, apply), sf.optim.adamw(**OPT), mesh)
    state = step.init(params)
    losses_step = []
    for i in range(steps):
        state, m = step(state, local_batch(global_batch(kind, i, world), rank, world))
        losses_step.append(float(m["loss"]))
    # The same, written by hand: value_and_grad plus the optimizer's in-place update.
    apply2, params2 = sf.functionalize(make_model(kind), units=units_of(kind))
    opt = sf.optim.adamw(**OPT)
    grad_fn = sf.value_and_grad(make_loss_fn(kind, apply2), apply=apply2)
    tree = sf.shard(params2, sf.specs(params2, mesh), mesh)
    opt_state = opt.init(tree)
    losses_hand, gathers = [], []
    for i in range(steps):
        C.STATS.reset()
        loss, grads = grad_fn(tree, local_batch(global_batch(kind, i, world), rank, world))
        opt_state = opt.step_(grads, opt_state, tree)
        losses_hand.append(float(loss))
        gathers.append(dict(C.STATS.calls))
    # And functionally: sf.apply_updates makes a new tree, copied in at the next call.
    apply3, params3 = sf.functionalize(make_model(kind), units=units_of(kind))
    grad_fn3 = sf.value_and_grad(make_loss_fn(kind, apply3), apply=apply3)
    tree3 = sf.shard(params3, sf.specs(params3, mesh), mesh)
    opt_state3 = opt.init(tree3)
    losses_fun = []
    for i in range(steps):
        loss, grads = grad_fn3(tree3, local_batch(global_batch(kind, i, world), rank, world))
        updates, opt_state3 = opt.update(grads, opt_state3, tree3)
        old, tree3 = tree3, sf.apply_updates(tree3, updates)
        losses_fun.append(float(loss))
    grad_fn3(tree3, local_batch(global_batch(kind, 0, world), rank, world))  # copies tree3 in: `old` is donated
    try:
        sf.gather(old)
        donated = False
    except sf.DonatedError:
        donated = True
    final = [sf.gather(x) for x in optree.tree_leaves(state.params)]
    hand = [sf.gather(x) for x in optree.tree_leaves(tree)]
    fun = [sf.gather(x) for x in optree.tree_leaves(tree3)]
    return {
        "losses": (losses_step, losses_hand, losses_fun),
        "params": max(rel_err(a, b) for a, b in zip(hand, final)),
        "params_fun": max(rel_err(a, b) for a, b in zip(fun, final)),
        "gathers": gathers[-1],
        "donated": donated,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_a_hand_written_step_equals_train_step(pools, world):
    for rank, out in enumerate(pools(world).run(rank_hand_written_step, "gpt", 3)):
        step_l, hand_l, fun_l = out["losses"]
        assert max(abs(a - b) for a, b in zip(step_l, hand_l)) < 1e-6, out["losses"]
        assert max(abs(a - b) for a, b in zip(step_l, fun_l)) < 1e-6, out["losses"]
        assert out["params"] < 1e-6 and out["params_fun"] < 1e-6 and out["donated"], out
        assert out["gathers"].get("all_gather", 0) > 0 and out["gathers"].get("reduce_scatter", 0) > 0, out


def rank_hand_step_with_a_frozen_leaf() -> dict:
    """A hand-written step on a model with a frozen leaf (requires_grad=False, as peft freezes):
    value_and_grad gives None there. A plain optimizer refuses the None, naming the leaf and the
    recipe; with that recipe (masked) the step, pure or in place, equals torch's AdamW."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
    model[0].bias.requires_grad_(False)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
    ref.load_state_dict(model.state_dict())
    ref[0].bias.requires_grad_(False)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    apply, params = sf.functionalize(model)
    mesh = sf.mesh(dp=-1)
    out = {}
    trees = {}
    for how in ("pure", "in_place"):
        tree = sf.shard(params, sf.specs(params, mesh), mesh)
        vg = sf.value_and_grad(lambda p, x: apply(p, x).pow(2).mean())
        opt = sf.optim.adamw(1e-2, weight_decay=0.1)
        _, grads = vg(tree, torch.zeros(world, 8, dtype=torch.float64))
        try:
            opt.update(grads, opt.init(tree), tree)
        except ValueError as e:
            out["plain"] = str(e)
        opt = sf.optim.masked(opt, optree.tree_map(lambda g: g is not None, grads, none_is_leaf=True))
        state = opt.init(tree)
        for s in range(3):
            x = torch.randn(2 * world, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
            _, grads = vg(tree, x.chunk(world)[rank])
            if how == "pure":
                updates, state = opt.update(grads, state, tree)
                tree = sf.apply_updates(tree, updates)
            else:
                state = opt.step_(grads, state, tree)
            if how == "pure":
                ref_opt.zero_grad()
                ref(x).pow(2).mean().backward()
                ref_opt.step()
        trees[how] = sf.to_state_dict(sf.gather(tree))
    want = ref.state_dict()
    out["errs"] = {how: max(rel_err(t[n], want[n]) for n in want) for how, t in trees.items()}
    out["frozen_kept"] = all(torch.equal(t["0.bias"], want["0.bias"]) for t in trees.values())
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_hand_written_step_with_a_frozen_leaf(pools, world):
    for out in pools(world).run(rank_hand_step_with_a_frozen_leaf):
        assert "None at ['0.bias']" in out["plain"] and "sf.optim.masked" in out["plain"], out["plain"]
        assert max(out["errs"].values()) < 1e-12 and out["frozen_kept"], out


def test_value_and_grad_refuses_full_tensors():
    fn = sf.value_and_grad(lambda p, b: p["w"].sum())
    with pytest.raises(ValueError, match="sharded tree"):
        fn({"w": torch.ones(3)}, None)
    with pytest.raises(ValueError, match="callable"):
        sf.value_and_grad("loss")


def rank_ownership() -> dict:
    """Trees shared between a train step and a transform, and local tensors a user holds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = sf.mesh(dp=-1)
    out = {}
    # A train step whose state's params a transform reads in between keeps training exactly.
    runs = []
    for peek in (False, True):
        apply, params = sf.functionalize(make_model("mlp"), units=units_of("mlp"))
        step = sf.train_step(make_loss_fn("mlp", apply), sf.optim.adamw(**OPT), mesh, apply=apply)
        state, losses = step.init(params), []
        for i in range(3):
            batch = local_batch(global_batch("mlp", i, world), rank, world)
            if peek and i == 1:
                sf.value_and_grad(make_loss_fn("mlp", apply), apply=apply)(state.params, batch)
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        runs.append((losses, [sf.gather(x) for x in optree.tree_leaves(state.params)]))
    out["peek_losses"] = runs[0][0] == runs[1][0]
    out["peek_params"] = all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    # In-place writes through local tensors (taken after the first call) are seen.
    apply, params = sf.functionalize(make_model("mlp"), units=units_of("mlp"))
    tree = sf.shard(params, sf.specs(params, mesh), mesh)
    loss_fn = make_loss_fn("mlp", apply)
    vg = sf.value_and_grad(loss_fn, apply=apply)
    batch = local_batch(global_batch("mlp", 0, world), rank, world)
    vg(tree, batch)
    held = [x.to_local() for x in optree.tree_leaves(tree)]
    with torch.no_grad():
        for t in held:
            t.mul_(0.5)  # through the held local tensors
    with torch.no_grad():  # grad mode is the transform's business
        loss, grads = vg(tree, batch)
    ref_model = make_model("mlp")
    with torch.no_grad():
        for p in ref_model.parameters():
            p.mul_(0.5)
    x, y = global_batch("mlp", 0, world)
    loss_of("mlp", ref_model(x), y).backward()
    ref = [p.grad for p in ref_model.parameters()]
    grads = sf.to_state_dict(sf.gather(grads))
    grads = [grads[n] for n, _ in ref_model.named_parameters()]
    out["held"] = max(rel_err(a, b) for a, b in zip(grads, ref))
    # Under no_shard a sharded tree is refused before anything changes.
    full = sf.gather(tree)
    tree2 = sf.shard(full, sf.specs(full, mesh), mesh)
    try:
        sf.value_and_grad(loss_fn, strategy="no_shard", apply=apply)(tree2, batch)
        out["no_shard"] = "ran"
    except ValueError as e:
        out["no_shard"] = str(e)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ownership_is_checked_by_memory(pools, world):
    for rank, out in enumerate(pools(world).run(rank_ownership)):
        assert out["peek_losses"] and out["peek_params"], (rank, out)
        assert out["held"] < 1e-5, (rank, out)
        assert "replicated tree" in out["no_shard"], out["no_shard"]
