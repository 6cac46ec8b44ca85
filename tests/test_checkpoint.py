"""`sf.save` / `sf.load` / `sf.latest`: sharded checkpoints, resharded on load, committed atomically.

A GPT with dims that neither 2 nor 3 divide is trained 3 steps at world size 2 and saved; fresh
ranks at world sizes 1 to 4 load it (parameters and AdamW state bit-identical) and train on, as an
uninterrupted 6-step run does. Saves that raise or die leave the previous checkpoint the one
`sf.latest` finds, loading exactly; the loading options, `keep=`, extras and asynchronous saves
are checked on a small MLP.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor, Partial

import shardfn as sf
from shardfn import _checkpoint
from shardfn.models import GPT
from shardfn._pool import RankError
from reference import GPT_CFG, OPT, global_batch, local_batch, make_loss_fn, make_model, units_of

STEPS = 3


def full(tree) -> dict:
    """Every leaf of a state as a full, private copy (DTensors gathered), by dotted path."""
    paths, leaves, _ = _checkpoint._flatten(tree)
    out = {}
    for p, x in zip(paths, leaves):
        if isinstance(x, torch.Tensor):
            x = (x.full_tensor() if hasattr(x, "full_tensor") else x).detach().clone()
        out[p] = x
    return out


def local(tree) -> dict:
    """Every leaf as this rank holds it (a private copy): no collective, for the checks of big trees."""
    paths, leaves, _ = _checkpoint._flatten(tree)
    out = {}
    for p, x in zip(paths, leaves):
        if isinstance(x, torch.Tensor):
            sharded = hasattr(x, "placements") and x.placements[0].is_shard()
            assert not sharded or (x.device_mesh.ndim == 1 and x.placements[0].dim == 0)
            x = ("shard" if sharded else "whole", (x.to_local() if hasattr(x, "to_local") else x).detach().clone())
        out[p] = x
    return out


def assemble(per_rank: list[dict]) -> dict:
    """The full leaves from every rank's `local` (Shard(0) pieces concatenated in rank order)."""
    out = {}
    for k, v in per_rank[0].items():
        if isinstance(v, tuple):
            out[k] = torch.cat([r[k][1] for r in per_rank]) if v[0] == "shard" else v[1]
        else:
            out[k] = v
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (k, (a[k] - b[k]).abs().max())
        else:
            assert a[k] == b[k], (k, a[k], b[k])


def build(kind: str = "gpt", **kw):
    apply, params = sf.functionalize(make_model(kind), units=units_of(kind))
    step = sf.train_step(make_loss_fn(kind, apply), sf.optim.adamw(**OPT), sf.mesh(dp=-1), **kw)
    return step, step.init(params)


def train(step, state, first: int, last: int, kind: str = "gpt"):
    """Steps `first..last-1` on the same global batches at any world size (each rank its share)."""
    r, w = dist.get_rank(), dist.get_world_size()
    losses = []
    for i in range(first, last):
        state, m = step(state, local_batch(global_batch(kind, i, 12, 1), r, w))
        losses.append(m["loss"].item())
    return state, losses


# -- resume at another world size -------------------------------------------------------------------
def rank_train_and_save(path: str) -> dict:
    step, state = build()
    straight, straight_losses = train(step, state, 0, 2 * STEPS)  # uninterrupted
    result = {"straight": local(straight), "straight_losses": straight_losses}
    step, state = build()
    state, _ = train(step, state, 0, STEPS)
    sf.save(state, path, extras={"data": {"position": STEPS * 12, "seed": torch.tensor([7, 8])}, "note": "gpt"})
    result["saved"] = local(state)
    return result


def rank_load_and_continue(path: str) -> dict:
    step, state = build()
    state = sf.load(path, like=state)
    loaded = local(state)
    state, losses = train(step, state, STEPS, 2 * STEPS)
    return {"loaded": loaded, "continued": local(state), "losses": losses, "extras": sf.load_extras(path)}


@pytest.fixture(scope="module")
def gpt_checkpoint(pools, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("resume") / "step_3")
    res = pools(2).run(rank_train_and_save, path)
    saved = {k: assemble([r[k] for r in res]) for k in ("straight", "saved")}
    return path, {**saved, "straight_losses": res[0]["straight_losses"]}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_resume_at_another_world_size(pools, gpt_checkpoint, world):
    path, saved = gpt_checkpoint
    assert sf.latest(os.path.dirname(path)) == path
    res = pools(world).run(rank_load_and_continue, path)
    got = {k: assemble([r[k] for r in res]) for k in ("loaded", "continued")}
    got["losses"], got["extras"] = res[0]["losses"], res[0]["extras"]
    # Parameters, both AdamW moments, its count and the step: bit-identical to what was saved
    # (moments that a fresh init holds as zeros).
    assert_same(got["loaded"], saved["saved"])
    assert got["loaded"]["step"] == STEPS
    moments = [k for k in saved["saved"] if k.startswith(("opt_state.0.mu.", "opt_state.0.nu."))]
    assert len(moments) == 2 * len([k for k in saved["saved"] if k.startswith("params.")])
    assert all(saved["saved"][k].abs().sum() > 0 for k in moments)
    assert got["extras"] == {"data": {"position": 36, "seed": got["extras"]["data"]["seed"]}, "note": "gpt"}
    assert torch.equal(got["extras"]["data"]["seed"], torch.tensor([7, 8]))
    # The next steps train from the loaded values, as the uninterrupted run did.
    straight, continued = saved["straight"], got["continued"]
    assert continued["step"] == 2 * STEPS
    if world == 2:  # the same reductions: exactly
        assert_same(continued, straight)
        assert got["losses"] == saved["straight_losses"][STEPS:]
    else:  # another world size sums gradients in another order: equal up to rounding
        for k, v in straight.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                torch.testing.assert_close(continued[k], v, rtol=1e-5, atol=1e-6, msg=str(k))
        assert got["losses"] == pytest.approx(saved["straight_losses"][STEPS:], rel=1e-6)


def rank_resume_from_empty(path: str, how: str) -> dict:
    """A big model resumed without initializing it: built on the meta device, `init="empty"`, then
    the checkpoint. The GPT's `emb_scale` is a buffer the checkpoint does not hold (persistent=False)."""
    torch.manual_seed(0)
    with sf.meta_device() if how == "recorded" else torch.device("meta"):
        model = GPT(GPT_CFG)
    apply, params = sf.functionalize(model, units=units_of("gpt"))
    step = sf.train_step(make_loss_fn("gpt", apply), sf.optim.adamw(**OPT), sf.mesh(dp=-1))
    state = step.init(params, init="empty")
    try:
        state = sf.load(path, like=state)
    except ValueError as e:
        return {"error": str(e), "scale": float(model.emb_scale)}
    state, losses = train(step, state, STEPS, 2 * STEPS)
    return {"losses": losses, "scale": float(model.emb_scale)}


def test_a_model_resumed_from_init_empty_has_its_buffers(pools, gpt_checkpoint):
    """Note [buffers under init="empty"] in `shardfn/_meta_init.py`: under `sf.meta_device()` the
    buffers are computed, and the run goes on as the uninterrupted one; on plain meta no value can
    be had for a buffer no checkpoint holds, and `sf.load` refuses, naming it (it trained on
    uninitialized memory)."""
    path, saved = gpt_checkpoint
    for r in pools(2).run(rank_resume_from_empty, path, "recorded"):
        assert r["scale"] == 1.0 and r["losses"] == saved["straight_losses"][STEPS:], r
    for r in pools(2).run(rank_resume_from_empty, path, "plain"):
        assert "buffers ['emb_scale'] hold no values" in r["error"] and "sf.meta_device()" in r["error"], r


def rank_weights_out_of_a_training_checkpoint(path: str) -> dict:
    """The parameters taken out of an AdamW run's checkpoint: into a tree of parameters alone, and
    into a state with another optimizer (fine-tuning with SGD), with strict=False; a bare parameter
    tree, which names no entry as the checkpoint does, is refused rather than loading nothing."""
    out = {}
    for name in ("params only", "sgd state", "bare"):
        apply, params = sf.functionalize(make_model("gpt"), units=units_of("gpt"))
        opt = sf.optim.sgd(0.1) if name == "sgd state" else sf.optim.adamw(**OPT)
        state = sf.train_step(make_loss_fn("gpt", apply), opt, sf.mesh(dp=-1)).init(params)
        like = {"params": state.params} if name == "params only" else state.params if name == "bare" else state
        try:
            got, report = sf.load(path, like=like, strict=False, apply=apply)
        except ValueError as e:
            out[name] = str(e)
            continue
        out[name] = local({"params": got["params"] if isinstance(got, dict) else got.params})
        out[name + " unexpected"] = sorted({k.split(".")[1] for k in report.unexpected_keys if k.startswith("opt_state.")})
    return out


def test_the_weights_load_out_of_a_training_checkpoint(pools, gpt_checkpoint):
    path, saved = gpt_checkpoint
    res = pools(2).run(rank_weights_out_of_a_training_checkpoint, path)
    params = {k: v for k, v in saved["saved"].items() if k.startswith("params.")}
    for name in ("params only", "sgd state"):
        assert_same(assemble([r[name] for r in res]), params)
    assert res[0]["params only unexpected"] == ["0"] and res[0]["sgd state unexpected"] == ["0"], res[0]
    assert "no entry in common" in res[0]["bare"] and "{'params': state.params}" in res[0]["bare"], res[0]["bare"]


# -- a plain DTensor tree, uneven and empty shards, another mesh ------------------------------------
def plain_tree(mesh, fill: float | None = None):
    g = torch.Generator().manual_seed(3)
    tree = {
        "w": torch.randn(5, 7, generator=g),  # 5 rows over 3 ranks: 2, 2, 1
        "tiny": torch.randn(2, 3, generator=g),  # 2 rows over 3 ranks: one rank holds none
        "norm": torch.randn(7, generator=g),  # replicated
    }
    if fill is not None:
        tree = {k: torch.full_like(v, fill) for k, v in tree.items()}
    axis = mesh.mesh_dim_names[-1]
    specs = {"w": sf.P(axis), "tiny": sf.P(axis), "norm": sf.P()}
    return {"params": sf.shard(tree, specs, mesh), "count": torch.tensor(4), "epoch": 2, "name": "run-1"}


def rank_save_tree(path: str) -> dict:
    tree = plain_tree(sf.mesh(dp=-1))
    sf.save(tree, path)
    return full(tree)


def rank_load_tree(path: str) -> dict:
    world = dist.get_world_size()
    mesh = sf.mesh(replicate=2, shard=-1) if world == 4 else sf.mesh(dp=-1)
    like = plain_tree(mesh, fill=0.0)
    like["epoch"], like["name"], like["count"] = 0, "", torch.tensor(0)
    locals_before = [x._local_tensor for x in like["params"].values()]
    out = sf.load(path, like=like)
    same_storage = all(a is x._local_tensor for a, x in zip(locals_before, out["params"].values()))
    return {"loaded": full(out), "in_place": same_storage and out["params"]["w"] is like["params"]["w"]}


def test_plain_tree_uneven_shards_and_another_mesh(pools, tmp_path):
    path = str(tmp_path / "tree")
    saved = pools(3).run(rank_save_tree, path)[0]
    for world in (2, 4):  # 4: a hybrid (replicate=2, shard=2) mesh
        got = pools(world).run(rank_load_tree, path)
        for g in got:
            assert g["in_place"]
            assert_same(g["loaded"], saved)


# -- saves that fail or die -------------------------------------------------------------------------
def rank_save_mlp(path: str, steps: int, keep: int | None = None) -> dict:
    step, state = build("mlp")
    state, _ = train(step, state, 0, steps, "mlp")
    sf.save(state, path, keep=keep)
    return full(state)


def rank_save_that_fails(path: str, how: str) -> str:
    """Trains further and saves to `path`, with one rank failing inside the save as `how` says."""
    step, state = build("mlp")
    state, _ = train(step, state, 0, 3, "mlp")
    rank = dist.get_rank()
    if how == "raise" and rank == 1:
        def write_data(self, plan, planner):
            raise OSError("No space left on device (simulated)")
        FileSystemWriter.write_data = write_data
    if how == "exit" and rank == 1:
        def write_data(self, plan, planner):  # killed half-way through writing its shards
            with open(os.path.join(self.path, "__1_0.distcp"), "wb") as f:
                f.write(b"partial")
            os._exit(3)
        FileSystemWriter.write_data = write_data
    if how == "exit_before_marker" and rank == 0:  # renamed to its final name, killed before the marker
        write_atomically = _checkpoint.write_atomically

        def killed(p, data):
            if p.endswith(_checkpoint.MARKER):
                os._exit(3)
            write_atomically(p, data)
        _checkpoint.write_atomically = killed
    try:
        sf.save(state, path)
    except Exception as e:  # noqa: BLE001 - every rank must raise, none may hang
        return f"{type(e).__name__}: {e}"
    return "saved"


def rank_load_mlp(path: str) -> dict:
    step, state = build("mlp")
    return full(sf.load(path, like=state))


def test_failed_and_killed_saves_leave_the_previous_checkpoint(pools, tmp_path):
    good = str(tmp_path / "a")
    saved = pools(2).run(rank_save_mlp, good, 1)[0]
    # A rank raises while writing its shards: every rank raises, nothing is committed.
    errors = pools(2).run(rank_save_that_fails, str(tmp_path / "b"), "raise")
    assert all("No space left" in e for e in errors), errors
    assert not os.path.exists(tmp_path / "b")
    # A rank dies while writing; then rank 0 dies between the rename and the marker.
    for name, how in (("c", "exit"), ("d", "exit_before_marker")):
        with pytest.raises(RankError, match="died"):
            pools(2).run(rank_save_that_fails, str(tmp_path / name), how)
        assert sf.latest(tmp_path) == good, os.listdir(tmp_path)
    assert not os.path.exists(tmp_path / "c")  # only a hidden temporary folder
    assert os.path.isdir(tmp_path / "d") and not os.path.exists(tmp_path / "d" / "COMPLETE")
    assert any(n.startswith(".c.tmp-") for n in os.listdir(tmp_path))
    assert_same(pools(2).run(rank_load_mlp, good)[0], saved)
    with pytest.raises(RankError, match="not a complete checkpoint"):
        pools(2).run(rank_load_mlp, str(tmp_path / "d"))
    # keep= clears both: the dead save's temporary folder and the folder it left unmarked.
    os.makedirs(tmp_path / "notes")  # not a checkpoint: left alone
    pools(2).run(rank_save_mlp, str(tmp_path / "e"), 1, 2)
    assert sorted(os.listdir(tmp_path)) == ["a", "e", "notes"], os.listdir(tmp_path)


# -- options and mistakes -----------------------------------------------------------------------------
def raises(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except (ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def rank_options(d: str) -> dict:
    rank = dist.get_rank()
    step, state = build("mlp")
    state, _ = train(step, state, 0, 2, "mlp")
    out: dict = {}
    sf.save(state, f"{d}/one")
    out["exists"] = raises(sf.save, state, f"{d}/one")
    out["per_rank_extras"] = raises(sf.save, state, f"{d}/two", extras={"rank": rank})
    out["per_rank_plain"] = raises(sf.save, {"w": torch.full((3,), float(rank))}, f"{d}/two")  # saved from rank 0 only
    out["bad_extras"] = raises(sf.save, state, f"{d}/two", extras={"f": lambda: 0})
    out["folder"] = raises(sf.load, d, like=state)
    pending = DTensor.from_local(torch.ones(3), sf.mesh(dp=-1), [Partial()])  # a sum not yet reduced
    out["partial_placement"] = raises(sf.save, {"g": pending}, f"{d}/two")

    # strict=False: a state with one leaf more (a new head) and without the last layer's bias.
    apply, params = sf.functionalize(make_model("mlp"), units=units_of("mlp"))
    params = dict(params)
    del params["4"]["bias"]
    params["head"] = {"weight": torch.full((4, 3), 0.5)}
    other = sf.train_step(make_loss_fn("mlp", apply), sf.optim.adamw(**OPT), sf.mesh(dp=-1))
    like = other.init(params)
    out["strict"] = raises(sf.load, f"{d}/one", like=like)
    loaded, report = sf.load(f"{d}/one", like=like, strict=False)
    out["report"] = report
    out["partial"], out["saved"] = full(loaded), full(state)

    # A tree whose shapes differ: refused even with strict=False, naming the leaves.
    torch.manual_seed(0)
    wide = torch.nn.Sequential(torch.nn.Linear(7, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2), torch.nn.Tanh(), torch.nn.Linear(2, 3))
    apply, params = sf.functionalize(wide, units=units_of("mlp"))
    like = sf.train_step(make_loss_fn("mlp", apply), sf.optim.adamw(**OPT), sf.mesh(dp=-1)).init(params)
    out["shapes"] = raises(sf.load, f"{d}/one", like=like, strict=False)

    # Frozen leaves have no optimizer state: nothing to save for them, and a state that trains them
    # does not load silently.
    fstep, fstate = build("mlp", frozen=r"0\..*")
    fstate, _ = train(fstep, fstate, 0, 2, "mlp")
    sf.save(fstate, f"{d}/frozen")
    out["frozen_saved"] = full(fstate)
    out["frozen_loaded"] = full(sf.load(f"{d}/frozen", like=build("mlp", frozen=r"0\..*")[1]))
    out["frozen_into_trained"] = raises(sf.load, f"{d}/frozen", like=build("mlp")[1])

    # keep=2 over three saves; a dead save's temporary folder is cleared.
    if rank == 0:
        os.makedirs(f"{d}/keep/.old.tmp-dead", exist_ok=True)
    dist.barrier()
    for i in range(3):
        state, _ = train(step, state, 2 + i, 3 + i, "mlp")
        sf.save(state, f"{d}/keep/s{i}", keep=2, extras={"i": i, "t": torch.arange(i + 1), "tag": f"s{i}", "x": [1.5, None]})
    out["kept"] = sorted(os.listdir(f"{d}/keep"))
    out["latest"] = sf.latest(f"{d}/keep")
    out["extras"] = sf.load_extras(out["latest"])

    # An asynchronous save: the state keeps training while it is written; sf.load waits for it.
    handle = sf.save(state, f"{d}/async", asynchronous=True)
    snap = full(state)
    state, _ = train(step, state, 10, 11, "mlp")
    out["async_loaded"] = full(sf.load(f"{d}/async", like=build("mlp")[1]))
    out["async_snap"] = snap
    out["async_path"] = handle.wait()
    # A failure in the background surfaces at wait(), and at the next save or load if nobody waited.
    write_data = FileSystemWriter.write_data
    if rank == 1:
        def failing(self, plan, planner):
            raise OSError("No space left on device (simulated)")
        FileSystemWriter.write_data = failing
    try:
        handle = sf.save(state, f"{d}/bad", asynchronous=True)
        try:
            handle.wait()
            out["async_failure"] = "no error"
        except RuntimeError as e:
            out["async_failure"] = f"{e} / {e.__cause__}"
        sf.save(state, f"{d}/bad2", asynchronous=True)
        try:
            sf.load(f"{d}/async", like=state)
            out["next_load"] = "no error"
        except RuntimeError as e:
            out["next_load"] = str(e)
    finally:
        FileSystemWriter.write_data = write_data
    out["latest_after_failures"] = sf.latest(d)
    return out


def test_options_and_mistakes(pools, tmp_path):
    d = str(tmp_path)
    res = pools(2).run(rank_options, d)
    for out in res:
        assert "ValueError" in out["exists"] and "never overwritten" in out["exists"], out["exists"]
        assert "ValueError" in out["per_rank_extras"] and "differ from rank 0" in out["per_rank_extras"], out["per_rank_extras"]
        assert "ValueError" in out["per_rank_plain"] and "plain (non-DTensor) tensors" in out["per_rank_plain"], out["per_rank_plain"]
        assert "ValueError" in out["bad_extras"] and "function" in out["bad_extras"], out["bad_extras"]
        assert "NotImplementedError" in out["partial_placement"] and "'g'" in out["partial_placement"], out["partial_placement"]
        assert "folder of checkpoints" in out["folder"] and "one" in out["folder"], out["folder"]
        assert "params.4.bias" in out["strict"] and "params.head.weight" in out["strict"] and "strict=False" in out["strict"]
        rep = out["report"]
        assert set(rep.missing_keys) == {"params.head.weight", "opt_state.0.mu.head.weight", "opt_state.0.nu.head.weight"}
        assert set(rep.unexpected_keys) == {"params.4.bias", "opt_state.0.mu.4.bias", "opt_state.0.nu.4.bias"}
        assert "params.0.weight" in out["shapes"] and "(6, 7)" in out["shapes"] and "(5, 7)" in out["shapes"], out["shapes"]
        assert "opt_state.0.mu.0.weight" not in out["frozen_saved"] and "params.0.weight" in out["frozen_saved"]
        assert_same(out["frozen_loaded"], out["frozen_saved"])
        assert "missing from the checkpoint: [opt_state.0.mu.0.bias" in out["frozen_into_trained"], out["frozen_into_trained"]
        assert out["kept"] == ["s1", "s2"], out["kept"]
        assert out["latest"] == os.path.join(d, "keep", "s2")
        ex = out["extras"]
        assert ex["i"] == 2 and ex["tag"] == "s2" and ex["x"] == [1.5, None] and torch.equal(ex["t"], torch.arange(3))
        assert out["async_path"] == os.path.join(d, "async")
        assert_same(out["async_loaded"], out["async_snap"])
        assert "bad' failed" in out["async_failure"] and "No space left" in out["async_failure"], out["async_failure"]
        assert "bad2' failed" in out["next_load"], out["next_load"]
        assert out["latest_after_failures"] == os.path.join(d, "async")
    partial, saved = res[0]["partial"], res[0]["saved"]
    for k, v in saved.items():  # the common entries are loaded; the new head keeps its values
        if not k.endswith("4.bias"):
            assert (torch.equal(partial[k], v) if isinstance(v, torch.Tensor) else partial[k] == v), k
    assert torch.equal(partial["params.head.weight"], torch.full((4, 3), 0.5))


def test_one_process_without_a_process_group(tmp_path):
    """A plain tensor tree in one process (no process group): the same files and rules."""
    assert not dist.is_initialized()
    tree = {"w": torch.randn(4, 3), "opt": (torch.zeros(4, 3), torch.tensor(2)), "step": 5, "lr": float("inf"), "tag": "run-1"}
    for i in range(3):
        tree["w"] = tree["w"] + 1
        sf.save(tree, tmp_path / f"s{i}", keep=1, extras={"i": i})
    assert sorted(os.listdir(tmp_path)) == ["s2"]
    assert sf.latest(tmp_path) == str(tmp_path / "s2") and sf.latest(tmp_path / "nothing") is None
    like = {"w": torch.zeros(4, 3), "opt": (torch.ones(4, 3), torch.tensor(0)), "step": 0, "lr": 0.0, "tag": "x"}
    w = like["w"]
    out = sf.load(tmp_path / "s2", like=like)
    assert out["w"] is w and torch.equal(w, tree["w"]) and torch.equal(out["opt"][0], torch.zeros(4, 3))
    assert (out["step"], out["lr"], out["tag"], int(out["opt"][1])) == (5, float("inf"), "run-1", 2)
    assert sf.load_extras(tmp_path / "s2") == {"i": 2}
    with pytest.raises(ValueError, match="kept for the temporary folders"):
        sf.save(tree, tmp_path / ".hidden")
    with pytest.raises(ValueError, match=r"differ from `like`.*'w'|w: checkpoint float32\(4, 3\), like float64\(4, 3\)"):
        sf.load(tmp_path / "s2", like={**like, "w": torch.zeros(4, 3, dtype=torch.float64)})
    with pytest.raises(ValueError, match="no checkpoint at"):
        sf.load(tmp_path / "s9", like=like)


def rank_async_and_return(path: str) -> str:
    mesh = sf.mesh(dp=-1)
    sf.save(sf.shard({"w": torch.arange(12.0).reshape(6, 2)}, {"w": sf.P("dp")}, mesh), path, asynchronous=True)
    return "returned"  # nobody waits: sf.launch's rank waits before returning


def test_async_save_not_waited_for_is_finished(tmp_path):
    """An asynchronous save nobody waited for completes at interpreter exit and when a launched
    function returns, instead of being lost with the process."""
    import subprocess
    import sys

    code = ("import torch, shardfn as sf, sys\n"
            "sf.save({'w': torch.arange(6.0)}, sys.argv[1], asynchronous=True)\n")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "single")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert sf.latest(str(tmp_path)) == str(tmp_path / "single")
    assert torch.equal(sf.load(str(tmp_path / "single"), like={"w": torch.zeros(6)})["w"], torch.arange(6.0))
    assert sf.launch(rank_async_and_return, str(tmp_path / "launched"), nprocs=2) == ["returned", "returned"]
    got = sf.load(str(tmp_path / "launched"), like={"w": torch.zeros(6, 2)})["w"]
    assert torch.equal(got, torch.arange(12.0).reshape(6, 2))


def rank_from_torch(path: str) -> dict:
    """A wrapped torch optimizer creates its state at its first step: a fresh `like` has no place
    for it, which is refused (never silently dropped); one step on `like` first makes it load."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = sf.mesh(dp=-1)

    def make():
        apply, params = sf.functionalize(make_model("mlp"), units=units_of("mlp"))
        step = sf.train_step(make_loss_fn("mlp", apply), sf.optim.from_torch(torch.optim.AdamW, lr=1e-2), mesh, apply=apply)
        return step, step.init(params)

    def batch(i):
        return local_batch(global_batch("mlp", i, world), rank, world)

    step, state = make()
    for i in range(2):
        state, _ = step(state, batch(i))
    sf.save(state, path)
    state, m = step(state, batch(2))
    want = float(m["loss"])
    step2, like = make()
    out = {}
    for strict in (True, False):
        try:
            sf.load(path, like=like, strict=strict)
            out[strict] = "loaded"
        except ValueError as e:
            out[strict] = str(e)
    like, _ = step2(like, batch(0))  # creates the torch optimizer's state; every entry is overwritten
    like = sf.load(path, like=like)
    _, m2 = step2(like, batch(2))
    out["resumed"] = (want, float(m2["loss"]))
    return out


def test_a_wrapped_torch_optimizer_resumes_or_refuses(pools, tmp_path):
    for out in pools(2).run(rank_from_torch, str(tmp_path / "ck")):
        for strict in (True, False):
            assert "take one step on `like` before loading" in out[strict], out[strict]
        want, got = out["resumed"]
        assert abs(want - got) <= 1e-6 * abs(want), out["resumed"]


# -- the model's buffers ----------------------------------------------------------------------------
def bn_build():
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    apply, params = sf.functionalize(model, units=r"[03]")

    def loss_fn(p, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(apply(p, x), y)

    step = sf.train_step(loss_fn, sf.optim.adamw(**OPT), sf.mesh(dp=-1), apply=apply)
    return model, step, step.init(params), apply


def bn_train(step, state, first: int, last: int):
    r, w = dist.get_rank(), dist.get_world_size()
    for i in range(first, last):
        g = torch.Generator().manual_seed(50 + i)
        batch = (torch.randn(8, 6, generator=g) * (1 + i), torch.randint(0, 3, (8,), generator=g))
        state, _ = step(state, local_batch(batch, r, w))
    return state


def rank_batchnorm_resume(d: str) -> dict:
    """A BatchNorm model trained 3 steps, saved, loaded into a fresh model and trained 3 more
    equals the uninterrupted 6 steps: parameters and running statistics."""
    model, step, state, _ = bn_build()
    state = bn_train(step, state, 0, 6)
    straight = {**full(state.params), **{k: v.clone() for k, v in model.named_buffers()}}
    del model, step, state
    model, step, state, apply = bn_build()
    state = bn_train(step, state, 0, 3)
    other = bn_build()  # a second model with these names and buffers: whose buffers to save?
    several = raises(sf.save, state, f"{d}/several")
    sf.save(state, f"{d}/bn", apply=apply)
    saved_mean = model[1].running_mean.clone()
    del model, step, state, apply, other
    model, step, state, _ = bn_build()  # a fresh model: its statistics start again
    fresh_mean = model[1].running_mean.clone()
    state = sf.load(f"{d}/bn", like=state)
    loaded_mean = model[1].running_mean.clone()
    state = bn_train(step, state, 3, 6)
    resumed = {**full(state.params), **{k: v.clone() for k, v in model.named_buffers()}}
    # A state of the user's own shape holds the model's buffers too.
    sf.save({"model": state.params, "opt": state.opt_state, "step": 6}, f"{d}/own_shape")
    own_shape = sorted(_checkpoint._read_meta(f"{d}/own_shape").get("buffers", []))
    # A checkpoint without buffers (a plain tree of the same names) loads; the module keeps its own.
    params_only = f"{d}/params_only"
    sf.save({"w": state.params["0"]["weight"]}, params_only)
    report = sf.load(params_only, like={"w": state.params["0"]["weight"]}, strict=False)[1]
    return {"straight": straight, "resumed": resumed, "saved_mean": saved_mean, "fresh_mean": fresh_mean,
            "loaded_mean": loaded_mean, "several": several, "entries": sorted(_checkpoint._read_meta(f"{d}/bn").get("buffers", [])), "report": report,
            "own_shape": own_shape}


def test_buffers_resume_exactly(pools, tmp_path):
    for out in pools(2).run(rank_batchnorm_resume, str(tmp_path)):
        assert out["entries"] == ["buffers.1.num_batches_tracked", "buffers.1.running_mean", "buffers.1.running_var"]
        assert out["own_shape"] == out["entries"], out["own_shape"]
        assert not torch.equal(out["fresh_mean"], out["saved_mean"])
        assert torch.equal(out["loaded_mean"], out["saved_mean"])
        assert_same(out["resumed"], out["straight"])
        assert out["resumed"]["1.num_batches_tracked"] == 6
        assert out["report"] == ([], [])
        assert "ValueError" in out["several"] and "apply=apply" in out["several"], out["several"]


# -- every layout, across meshes: (dp=2, tp=2) <-> (dp=4,), (dp=1, tp=2), one rank -------------------
LAYOUT_SHAPES = {"col": (5, 3), "row": (3, 7), "strided": (7, 3), "two": (5, 7), "norm": (7,)}


def layout_specs(mesh) -> dict:
    if "tp" in mesh.mesh_dim_names:
        return {"col": sf.P("tp", None), "row": sf.P(None, "tp"), "strided": sf.P(("tp", "dp"), None), "two": sf.P("dp", "tp"), "norm": sf.P()}
    return {"col": sf.P("dp"), "row": sf.P(None, "dp"), "strided": sf.P(("dp",), None), "two": sf.P(None, "dp"), "norm": sf.P()}


def layout_values(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g) for k, s in LAYOUT_SHAPES.items()}


def layout_state(mesh, fill: float | None = None) -> dict:
    """Parameters and AdamW-like moments of the same layouts, a step count and a plain value."""
    specs = layout_specs(mesh)

    def tree(seed):
        values = layout_values(seed)
        if fill is not None:
            values = {k: torch.full_like(v, fill) for k, v in values.items()}
        return sf.shard(values, specs, mesh)

    return {"params": tree(1), "opt": {"mu": tree(2), "nu": tree(3), "count": torch.tensor(0 if fill is not None else 5)}, "epoch": 0 if fill is not None else 2}


def layout_mesh(axes: str):
    return {"2x2": lambda: sf.mesh(dp=2, tp=2), "4": lambda: sf.mesh(dp=4), "1x2": lambda: sf.mesh(dp=1, tp=2), "1": lambda: sf.mesh(dp=1)}[axes]()


def rank_layouts_across_meshes(axes: str, load: list[str], save: str | None) -> list:
    """Loads each checkpoint of `load` at mesh `axes` (bit-equal full values, each rank holding its
    spec's rows), then saves the state at that mesh to `save`."""
    from shardfn._spec import local_slices

    mesh = layout_mesh(axes)
    out = []
    for path in load:
        like = layout_state(mesh, fill=0.0)
        got = sf.load(path, like=like)
        specs = layout_specs(mesh)
        rows_ok = all(
            torch.equal(x.to_local(), x.full_tensor()[local_slices(specs[k], mesh, x.shape)])
            for tree in (got["params"], got["opt"]["mu"], got["opt"]["nu"]) for k, x in tree.items()
        )
        out.append((full(got), rows_ok, [str(x.placements) for x in got["params"].values()]))
    if save is not None:
        sf.save(layout_state(mesh), save)
    return out


def test_every_layout_loads_exactly_across_meshes(pools, tmp_path):
    want = {f"{tree}.{k}": v for tree, seed in (("params", 1), ("opt.mu", 2), ("opt.nu", 3)) for k, v in layout_values(seed).items()}
    want.update({"opt.count": torch.tensor(5), "epoch": 2})
    at = {m: str(tmp_path / m) for m in ("2x2", "4", "1x2", "1")}

    def check(results: list, n: int) -> None:
        for per_rank in results:
            assert len(per_rank) == n
            for loaded, rows_ok, _ in per_rank:
                assert rows_ok
                assert_same(loaded, want)

    # Saved at (dp=2, tp=2) and at (dp=4,); each loaded at the other.
    pools(4).run(rank_layouts_across_meshes, "2x2", [], at["2x2"])
    check(pools(4).run(rank_layouts_across_meshes, "4", [at["2x2"]], at["4"]), 1)
    # (dp=2, tp=2) at (dp=1, tp=2) and at one rank, each saving its own for the way back.
    check(pools(2).run(rank_layouts_across_meshes, "1x2", [at["2x2"]], at["1x2"]), 1)
    check(pools(1).run(rank_layouts_across_meshes, "1", [at["2x2"]], at["1"]), 1)
    res = pools(4).run(rank_layouts_across_meshes, "2x2", [at["4"], at["1x2"], at["1"]], None)
    check(res, 3)
    assert "_StridedShard(dim=0, sf=2)" in res[0][0][2][2]  # P(("tp", "dp")) at (dp=2, tp=2)
