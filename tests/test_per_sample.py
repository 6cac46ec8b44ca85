"""Per-example gradients of a sharded model: `sf.per_sample_grad_norms`, `sf.per_sample_grads` and
`sf.dp_value_and_grad`, against a loop of single-example backward passes on the unsharded model (and
a single-process DP-SGD with the same noise) at worlds 1, 2 and 3; tied weights, a leaf read outside
`apply`, frozen leaves and a peft LoRA model; the memory bound, measured; bad input refused."""

from __future__ import annotations

import functools
import math
import os
import warnings

import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardfn as sf
from reference import GPT_CFG, make_model, rel_err, units_of

# torch's own note that an op has no batching rule yet (scaled_dot_product_attention on CPU): vmap
# falls back to a loop over examples, which is slower and exact.
SLOW_BATCHING = r"There is a performance drop because we have not yet implemented the batching rule"
pytestmark = pytest.mark.filterwarnings(f"ignore:{SLOW_BATCHING}:UserWarning")


def _strict_warnings(fn):
    """`fn` run with warnings as errors, as pytest makes them in this process, and the ranks' own
    filters as they were after it (a later test on the same pool must not inherit them)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", message=SLOW_BATCHING, category=UserWarning)
            return fn(*args, **kwargs)

    return run


def _examples(kind: str, n: int):
    g = torch.Generator().manual_seed(7)
    if kind == "gpt":
        return (torch.randint(0, GPT_CFG.vocab, (n, GPT_CFG.block_size), generator=g),
                torch.randint(0, GPT_CFG.vocab, (n, GPT_CFG.block_size), generator=g))
    return torch.randn(n, 7, generator=g), torch.randn(n, 3, generator=g)


def _loss_one(kind: str, apply, outside: bool):
    def loss_one(p, example):
        x, y = example
        out = apply(p, x[None])
        loss = F.cross_entropy(out.flatten(0, 1), y[None].flatten()) if kind == "gpt" else F.mse_loss(out, y[None])
        if outside:  # a leaf read outside apply too (a regularizer): it must count in the norm
            loss = loss + 0.3 * p["2"]["weight"].pow(2).sum() * x.sum().tanh()
        return loss

    return loss_one


def loop_reference(loss_one, params, batch, trained: list[bool]) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Per-example gradients by a plain backward per example, on the unsharded tree."""
    leaves, spec = optree.tree_flatten(params)
    norms, grads = [], []
    for i in range(optree.tree_leaves(batch)[0].shape[0]):
        mine = [x.detach().clone().requires_grad_(t) for x, t in zip(leaves, trained)]
        loss = loss_one(optree.tree_unflatten(spec, mine), optree.tree_map(lambda t: t[i], batch))
        g = torch.autograd.grad(loss, [x for x, t in zip(mine, trained) if t])
        grads.append(list(g))
        norms.append(torch.stack([x.double().pow(2).sum() for x in g]).sum().sqrt())
    return torch.stack(norms).float(), grads


def dp_reference(grads: list[list[torch.Tensor]], norms: torch.Tensor, clip: float, sigma: float, seed: int) -> list[torch.Tensor]:
    """Single-process DP-SGD: clip each example, sum, add the seeded noise, divide by the batch size."""
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    summed = [sum(f * g[k] for f, g in zip(factors, grads)) for k in range(len(grads[0]))]
    gen = torch.Generator().manual_seed(seed)
    return [(s + sigma * clip * torch.randn(s.shape, generator=gen)) / len(grads) for s in summed]


@_strict_warnings
def rank_per_sample(kind: str, outside: bool, frozen: str | None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    apply, params = sf.functionalize(make_model(kind), units=units_of(kind))
    mesh = sf.mesh(dp=2, tp=2) if world == 4 else sf.mesh(dp=-1)
    sharded = sf.shard(params, sf.specs(params, mesh, rules=GPT_2D if world == 4 else None), mesh)
    loss_one = _loss_one(kind, apply, outside)
    per_rank = 3
    batch = _examples(kind, per_rank * world)
    mine = tuple(t.chunk(world)[rank] for t in batch)
    paths = sf.tree_paths(params)
    trained = [frozen is None or not __import__("re").fullmatch(frozen, p) for p in paths]
    ref_norms, ref_grads = loop_reference(loss_one, params, batch, trained)
    out: dict = {}
    norms_fn = sf.per_sample_grad_norms(loss_one, frozen=frozen)
    norms = norms_fn(sharded, mine)
    out["norms"] = rel_err(norms, ref_norms.chunk(world)[rank])
    out["norms_again"] = rel_err(norms_fn(sharded, mine), norms)
    psg = sf.per_sample_grads(loss_one, frozen=frozen)(sharded, mine)
    leaves = optree.tree_leaves(psg, none_is_leaf=True)
    out["frozen_none"] = all((g is None) == (not t) for g, t in zip(leaves, trained))
    got = [g for g in leaves if g is not None]
    out["psg_layout"] = {(type(g).__name__, tuple(g.shape)[0], tuple(g.to_local().shape)[0]) for g in got}
    out["psg"] = max(rel_err(sf.gather(g)[i], ref_grads[i][k]) for k, g in enumerate(got) for i in range(len(ref_grads)))
    # DP-SGD: a clip norm between the smallest and largest example norm, so some are clipped.
    clip = float(ref_norms.median())
    dp = sf.dp_value_and_grad(loss_one, clip, 0.8, frozen=frozen)
    (loss, dp_norms), grads = dp(sharded, mine, seed=123)
    want = dp_reference(ref_grads, ref_norms, clip, 0.8, 123)
    dp_leaves = [g for g in optree.tree_leaves(grads, none_is_leaf=True) if g is not None]
    out["dp"] = max(rel_err(sf.gather(g), w) for g, w in zip(dp_leaves, want))
    out["dp_types"] = {type(g).__name__ for g in dp_leaves}
    out["dp_layout"] = [g.placements for g in dp_leaves] == [x.placements for x, t in zip(optree.tree_leaves(sharded), trained) if t]
    with torch.no_grad():
        ref_loss = torch.stack([loss_one(params, (batch[0][i], batch[1][i])) for i in range(len(batch[0]))]).mean()
    out["dp_loss"] = rel_err(loss, ref_loss)
    out["dp_norms"] = rel_err(dp_norms, ref_norms.chunk(world)[rank])
    out["clipped"] = int((ref_norms > clip).sum()), len(ref_norms)
    # A second step with another seed: the noise differs, the clipped sum does not.
    grads2 = sf.copy(grads)
    (_, _), grads3 = dp(sharded, mine, seed=124)
    want3 = dp_reference(ref_grads, ref_norms, clip, 0.8, 124)
    out["dp_seed2"] = max(rel_err(sf.gather(g), w) for g, w in zip([g for g in optree.tree_leaves(grads3) if g is not None], want3))
    out["differs"] = any(not torch.equal(sf.gather(a), sf.gather(b)) for a, b in zip(optree.tree_leaves(grads2), optree.tree_leaves(grads3)))
    return out


# On (dp, tp): axes of one dim against mesh order, column- and row-parallel, two dims.
GPT_2D = [
    (r"wte\.weight", sf.P(("tp", "dp"), None)),
    (r".*qkv\.weight", sf.P("tp", None)),
    (r".*proj\.weight", sf.P(None, "tp")),
    (r".*fc\.weight", sf.P("dp", "tp")),
    (r".*fc\.bias", sf.P(("tp", "dp"))),
    (r".*ln.*", sf.P()),
]

CASES = {
    "mlp": ("mlp", False, None),
    "mlp_read_outside_apply": ("mlp", True, None),
    "gpt_tied": ("gpt", False, None),
    "gpt_frozen_block": ("gpt", False, r"blocks\.0\..*"),
}


# World 1 once (the tied GPT); every case at 2 and 3; the GPT at (dp=2, tp=2) in tensor-parallel layouts.
@pytest.mark.parametrize("case,world", [("gpt_tied", 1)] + [(c, w) for w in (2, 3) for c in CASES] + [("gpt_frozen_block", 4)])
def test_per_example_gradients_match_a_loop_of_single_example_backwards(pools, case, world):
    for rank, out in enumerate(pools(world).run(rank_per_sample, *CASES[case])):
        errs = {k: out[k] for k in ("norms", "norms_again", "psg", "dp", "dp_loss", "dp_norms", "dp_seed2")}
        assert max(errs.values()) < 1e-5, (rank, errs)
        assert out["frozen_none"] and out["dp_types"] == {"DTensor"} and out["dp_layout"], out
        assert out["psg_layout"] == {("DTensor", 3 * world, 3)}, out["psg_layout"]
        clipped, n = out["clipped"]
        assert 0 < clipped < n and out["differs"], out


@_strict_warnings
def rank_lora_dp() -> dict:
    """DP fine-tuning of a peft LoRA model (frozen base, tied nothing): norms and DP-SGD gradients
    of the LoRA weights only, against the loop on the unsharded model."""
    from test_real_models import build_model

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model("lora")
    apply, params = sf.functionalize(model, units=r"base_model\.model\.model\.layers\.\d+")
    mesh = sf.mesh(dp=-1)
    sharded = sf.shard(params, sf.specs(params, mesh), mesh)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (2 * world, 6), generator=g)

    def loss_one(p, ex):
        return apply(p, input_ids=ex[None], labels=ex[None]).loss

    paths = sf.tree_paths(params)
    trained = ["lora_" in p for p in paths]
    ref_norms, ref_grads = loop_reference(loss_one, params, ids, trained)
    mine = ids.chunk(world)[rank]
    norms = sf.per_sample_grad_norms(loss_one)(sharded, mine)
    clip = float(ref_norms.median())
    (_, _), grads = sf.dp_value_and_grad(loss_one, clip, 1.0)(sharded, mine, seed=5)
    want = dp_reference(ref_grads, ref_norms, clip, 1.0, 5)
    leaves = optree.tree_leaves(grads, none_is_leaf=True)
    got = [x for x in leaves if x is not None]
    return {"norms": rel_err(norms, ref_norms.chunk(world)[rank]), "dp": max(rel_err(sf.gather(a), b) for a, b in zip(got, want)),
            "trained_only": [x is not None for x in leaves] == trained}


def test_dp_sgd_on_a_peft_lora_model(pools):
    pytest.importorskip("peft")
    for out in pools(2).run(rank_lora_dp):
        assert out["norms"] < 1e-5 and out["dp"] < 1e-5 and out["trained_only"], out


L, WIDTH, B = 8, 512, 16  # 1 MiB per leaf in fp32; the per-example gradients of one leaf: 16 MiB


def _hwm_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def rank_peak(which: str) -> int:
    """Peak RSS growth (KiB) of one call, over the RSS before it."""
    import gc

    from torch import nn

    rank = dist.get_rank()
    torch.manual_seed(0)
    apply, params = sf.functionalize(nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(L)]), units=r"\d+")
    mesh = sf.mesh(dp=-1)
    sharded = sf.shard(params, sf.specs(params, mesh), mesh)
    del params
    g = torch.Generator().manual_seed(rank)
    batch = (torch.randn(B, WIDTH, generator=g), torch.randn(B, WIDTH, generator=g))

    def loss_one(p, ex):
        return F.mse_loss(apply(p, ex[0][None]), ex[1][None])

    dp = sf.dp_value_and_grad(loss_one, 1.0, 1.0)
    fn = {"norms": lambda: sf.per_sample_grad_norms(loss_one)(sharded, batch),
          "dp": lambda: dp(sharded, batch, seed=0),
          "grads": lambda: sf.per_sample_grads(loss_one)(sharded, batch)}[which]
    out = fn()
    del out
    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _hwm_kb()
    fn()
    return _hwm_kb() - base


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to measure peak RSS")
def test_per_example_norms_hold_one_units_gradients_at_a_time():
    """Measured: the norms pass grows the RSS by at most the full parameters, the per-example
    gradients of two units and 4 MiB; DP-SGD by that and the full gradient; where the per-example
    gradients of the whole model (what `per_sample_grads` returns) take eight units' worth."""
    from shardfn._pool import RankPool

    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        with RankPool(2, timeout=120, warm=True) as pool:
            peaks = {w: pool.run(rank_peak, w) for w in ("norms", "dp", "grads")}
    finally:
        if old is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old
    leaf = WIDTH * WIDTH * 4 >> 10
    bound = L * leaf + 2 * B * leaf + 4096
    assert max(peaks["norms"]) <= bound, (peaks, bound)
    assert max(peaks["dp"]) <= bound + L * leaf, (peaks, bound)
    assert min(peaks["grads"]) >= L * B * leaf, peaks


def rank_dropout() -> list[float]:
    """Dropout draws the same masks in the norms pass and the clipped-sum pass: with one example,
    no noise and a clip far below its norm, the DP gradient's norm is the clip, exactly."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 3)).train()
    apply, params = sf.functionalize(model, units=r"\d+")
    mesh = sf.mesh(dp=-1)
    sharded = sf.shard(params, sf.specs(params, mesh), mesh)
    x, y = _examples("mlp", 1)
    dp = sf.dp_value_and_grad(lambda p, e: F.mse_loss(apply(p, e[0][None]), e[1][None]), 1e-3, 0.0, randomness="different")
    ratios = []
    for step in range(4):
        _, grads = dp(sharded, (x, y), seed=step)
        ratios.append(math.sqrt(sum(float(g.full_tensor().double().pow(2).sum()) for g in optree.tree_leaves(grads))) / 1e-3)
    return ratios


def test_dp_sgd_with_dropout_clips_the_gradient_it_scales(pools):
    (ratios,) = pools(1).run(rank_dropout)
    assert max(abs(r - 1) for r in ratios) < 1e-5, ratios


def rank_refusals() -> list[str]:
    rank = dist.get_rank()
    apply, params = sf.functionalize(make_model("mlp"), units=units_of("mlp"))
    mesh = sf.mesh(dp=-1)
    sharded = sf.shard(params, sf.specs(params, mesh), mesh)
    x, y = _examples("mlp", 4)
    said = []
    for call in (
        lambda: sf.dp_value_and_grad(lambda p, e: F.mse_loss(apply(p, e[0][None]), e[1][None]), 1.0, 1.0)(sharded, (x, y), seed=rank),
        lambda: sf.per_sample_grad_norms(lambda p, e: (apply(p, e[0][None]) - e[1]).pow(2))(sharded, (x, y)),
        lambda: sf.per_sample_grads(lambda p, e: F.mse_loss(apply(p, e[0][None]), e[1][None]))(sharded, (x[: 1 + rank], y[: 1 + rank])),
        lambda: sf.per_sample_grads(lambda p, e: apply(p, e[0][None]))(sharded, (x, y)),
        # rank 1 passes no example (a last global batch smaller than the world): refused on every rank
        lambda: sf.per_sample_grad_norms(lambda p, e: F.mse_loss(apply(p, e[0][None]), e[1][None]))(sharded, (x[: 3 * (1 - rank)], y[: 3 * (1 - rank)])),
        lambda: sf.dp_value_and_grad(lambda p, e: F.mse_loss(apply(p, e[0][None]), e[1][None]), 1.0, 0.0)(sharded, (x[: 3 * (1 - rank)], y[: 3 * (1 - rank)]), seed=0),
    ):
        try:
            call()
            said.append("ran")
        except ValueError as e:
            said.append(str(e))
    return said


def test_bad_input_is_refused_with_the_fix(pools):
    for said in pools(2).run(rank_refusals):
        assert "different seeds" in said[0], said
        assert "one element" in said[1], said
        assert "same number on every rank" in said[2], said
        assert "one element" in said[3], said
        assert "rank(s) [1] of the mesh pass no example" in said[4] and "rank(s) [1]" in said[5], said
    loss = lambda p, e: p["w"].sum()  # noqa: E731
    for bad in (0.0, -1.0, math.inf, True, "1"):
        with pytest.raises(ValueError, match="l2_norm_clip"):
            sf.dp_value_and_grad(loss, bad, 1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        sf.dp_value_and_grad(loss, 1.0, -0.5)
    with pytest.raises(ValueError, match="callable"):
        sf.per_sample_grad_norms(3)
    dp = sf.dp_value_and_grad(loss, 1.0, 1.0)
    with pytest.raises(ValueError, match="seed"):
        dp({"w": torch.ones(2)}, torch.ones(3, 1), seed=-1)
    with pytest.raises(ValueError, match="sharded tree"):
        dp({"w": torch.ones(2)}, torch.ones(3, 1), seed=1)
    with pytest.raises(NotImplementedError, match="not differentiable"):
        torch.func.grad(lambda p: sf.per_sample_grad_norms(loss)(p, torch.ones(3, 1)).sum())({"w": torch.ones(2)})
    with pytest.raises(ValueError, match="leading dim"):
        sf.per_sample_grad_norms(loss)({"w": torch.ones(2)}, (torch.ones(3, 1), torch.ones(2, 1)))
