"""Training options, alone and combined, under every strategy: parity with a single-process reference.

The reference (tests/reference.py) trains the unsharded model on the global batch with
`torch.optim.AdamW`, freezing, masking, clipping and emulating bf16 as asked.
"""

from __future__ import annotations

import copy
import re

import optree
import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from shardfn import _collectives as C
from shardfn import _flat
from reference import OPT, Reference, compare_params, global_batch, local_batch, make_loss_fn, make_model, units_of

FROZEN = {"gpt": r"wpe\..*|blocks\.0\..*", "mlp": r"0\..*"}
NO_DECAY = r".*bias|.*ln.*"
STEPS = 3

OPTIONS = {
    "plain": {},
    "bf16": {"mp": True},
    "remat": {"remat": True},
    "accumulate": {"accum": 4},
    "accumulate_local": {"accum": 2, "accumulation": "local"},
    "clip": {"clip": 0.05},
    "frozen": {"frozen": True},
    "masked": {"no_decay": True},
    "offload": {"offload": True},
    "all": {"mp": True, "remat": True, "accum": 2, "clip": 0.05, "frozen": True, "no_decay": True},  # offload aside
    # Point to point, large leaves are received straight into their full parameters (the test
    # models' leaves all count as small by default): some of them, or all, with every option on.
    "in_place": {"small_segment": 40},
    "all_in_place": {"mp": True, "remat": True, "accum": 2, "clip": 0.05, "frozen": True, "no_decay": True, "small_segment": 0},
}


def _decay_mask(params):
    paths, leaves, spec = sf._tree.tree_flatten_with_paths(params)
    return optree.tree_unflatten(spec, [not re.fullmatch(NO_DECAY, p) for p in paths])


def rank_case(strategy: str, opts: dict, kinds=("gpt", "mlp")) -> dict:
    old = _flat.SMALL_SEGMENT
    _flat.SMALL_SEGMENT = opts.get("small_segment", old)
    try:
        return _case(strategy, opts, kinds)
    finally:
        _flat.SMALL_SEGMENT = old


def _case(strategy: str, opts: dict, kinds) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = sf.mesh(replicate=2, shard=-1) if strategy == "hybrid_shard" else sf.mesh(dp=-1)
    out = {}
    for kind in kinds:
        model = make_model(kind)
        ref = Reference(
            model, kind, max_grad_norm=opts.get("clip"), frozen=FROZEN[kind] if opts.get("frozen") else None,
            no_decay=NO_DECAY if opts.get("no_decay") else None, bf16=opts.get("mp", False),
        )
        apply, params = sf.functionalize(model, units=units_of(kind))
        opt = sf.optim.adamw(**OPT, mask=_decay_mask) if opts.get("no_decay") else sf.optim.adamw(**OPT)
        step = sf.train_step(
            make_loss_fn(kind, apply), opt, mesh, strategy=strategy,
            mixed_precision=sf.MixedPrecision(torch.bfloat16, torch.float32, buffer_dtype=torch.bfloat16) if opts.get("mp") else None,
            remat=opts.get("remat", False), accumulation_steps=opts.get("accum", 1), max_grad_norm=opts.get("clip"),
            frozen=FROZEN[kind] if opts.get("frozen") else None, offload="cpu" if opts.get("offload") else None,
            accumulation=opts.get("accumulation", "sharded"),
        )
        state = step.init(params)
        errs = [0.0, 0.0, 0.0]
        for i in range(STEPS):
            batch = global_batch(kind, i, world, per_rank=4)
            state, m = step(state, local_batch(batch, rank, world))
            ref_loss, ref_norm = ref.step(batch)
            errs[0] = max(errs[0], abs(m["loss"].item() - ref_loss) / abs(ref_loss))
            errs[1] = max(errs[1], abs(m["grad_norm"].item() - ref_norm) / ref_norm)
            errs[2] = max(errs[2], compare_params(state.params, apply, ref, per_leaf=not opts.get("mp")))
        n_state = len(optree.tree_leaves(state.opt_state))
        n_trained = sum(1 for p in sf.tree_paths(state.params) if not (opts.get("frozen") and re.fullmatch(FROZEN[kind], p)))
        out[kind] = (errs, n_state, n_trained)
    return out


def _world(strategy):
    return 4 if strategy == "hybrid_shard" else 2


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"])
def test_option_matrix(pools, strategy, option):
    opts = OPTIONS[option]
    if opts.get("offload") and not torch.cuda.is_available():
        pytest.skip("offload='cpu' moves nothing on a CPU mesh; benchmarks/device_check.py checks it on CUDA")
    tol = 1e-2 if opts.get("mp") else 1e-5  # bf16 compute: bf16 tolerances, whole-model error
    for rank_result in pools(_world(strategy)).run(rank_case, strategy, opts):
        for kind, (errs, n_state, n_trained) in rank_result.items():
            assert max(errs) < tol, (kind, errs)
            # AdamW state: mu and nu per trained leaf, plus counts: frozen leaves get none.
            assert 2 * n_trained <= n_state <= 2 * n_trained + 4, (kind, n_state, n_trained)


def rank_dtypes_on_the_wire(gloo: str) -> dict:
    """The dtypes each collective sends: native gloo collectives, or the point-to-point messages."""
    with C.gloo_collectives(gloo):
        return _dtypes_on_the_wire()


def _dtypes_on_the_wire() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model("gpt")
    apply, params = sf.functionalize(model, units=units_of("gpt"))
    step = sf.train_step(
        make_loss_fn("gpt", apply), sf.optim.adamw(**OPT), sf.mesh(dp=-1),
        mixed_precision=sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    state = step.init(params)
    seen: dict[str, set] = {"all_gather_single": set(), "reduce_scatter_single": set(), "isend": set(), "irecv": set()}
    orig = {n: getattr(dist, n) for n in seen}

    def spy(name):
        def f(*a, **k):
            seen[name].add(tuple(str(t.dtype) for t in a if isinstance(t, torch.Tensor)))
            return orig[name](*a, **k)

        return f

    for n in seen:
        setattr(dist, n, spy(n))
    try:
        state, _ = step(state, local_batch(global_batch("gpt", 0, world), rank, world))
    finally:
        for n, f in orig.items():
            setattr(dist, n, f)
    master = {str(x._local_tensor.dtype) for x in optree.tree_leaves(state.params)}
    moments = {str(x._local_tensor.dtype) for x in optree.tree_leaves(state.opt_state) if hasattr(x, "_local_tensor")}
    return {k: sorted(v) for k, v in seen.items()} | {"master": sorted(master), "moments": sorted(moments)}


def test_bf16_gathers_and_fp32_reduces(pools):
    for r in pools(2).run(rank_dtypes_on_the_wire, "native"):
        # (and the int32 check that every rank ran the same units, Note [units on every rank])
        assert r["all_gather_single"] == [("torch.bfloat16", "torch.bfloat16"), ("torch.int32", "torch.int32")], r
        assert r["reduce_scatter_single"] == [("torch.float32", "torch.float32")], r
        assert r["isend"] == r["irecv"] == [], r
        assert r["master"] == ["torch.float32"] and r["moments"] == ["torch.float32"], r
    for r in pools(2).run(rank_dtypes_on_the_wire, "p2p"):
        # Gathers send bf16 shards, reductions fp32 chunks, the units check int32, nothing else.
        assert r["isend"] == r["irecv"] == [("torch.bfloat16",), ("torch.float32",), ("torch.int32",)], r
        assert r["all_gather_single"] == r["reduce_scatter_single"] == [], r


def rank_count(strategy: str, opts: dict) -> dict:
    """Collectives of one step with options on (after a first step), as native collectives."""
    with C.gloo_collectives("native"):
        return _count(strategy, opts)


def _count(strategy: str, opts: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model("gpt")
    apply, params = sf.functionalize(model, units=units_of("gpt"))
    step = sf.train_step(
        make_loss_fn("gpt", apply), sf.optim.adamw(**OPT), sf.mesh(dp=-1), strategy=strategy,
        remat=opts.get("remat", False), max_grad_norm=opts.get("clip"), frozen=opts.get("frozen"),
        accumulation_steps=opts.get("accum", 1), accumulation=opts.get("accumulation", "sharded"),
        group_bytes=opts.get("group_bytes", 0),
    )
    state = step.init(params)
    batch = local_batch(global_batch("gpt", 0, world, per_rank=4), rank, world)
    state, _ = step(state, batch)
    counts: dict[str, int] = {}
    orig = {n: getattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single", "all_reduce")}

    def spy(name):
        def f(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return orig[name](*a, **k)

        return f

    for n in orig:
        setattr(dist, n, spy(n))
    try:
        step(state, batch)
    finally:
        for n, f in orig.items():
            setattr(dist, n, f)
    return counts


def test_collectives_with_options(pools):
    pool = pools(2)
    U = 3
    # remat: the unit is gathered once for both the recompute and the backward, the last unit not
    # again at all: it stays gathered from its forward (Note [unit schedule]).
    # (one all-gather per step is the units check, Note [units on every rank])
    assert pool.run(rank_count, "full_shard", {"remat": True})[0] == {"all_gather_single": 2 * U + 1, "reduce_scatter_single": U + 1, "all_reduce": 1}
    # The three blocks as one group (Note [unit groups]): remat still per block, the group gathered
    # once (the last unit, kept for the backward).
    c = pool.run(rank_count, "full_shard", {"remat": True, "group_bytes": None})[0]
    assert c == {"all_gather_single": 2 + 1, "reduce_scatter_single": 1 + 1, "all_reduce": 1}, c
    # clipping: the norm costs no collective beyond the one metrics all-reduce.
    assert pool.run(rank_count, "full_shard", {"clip": 0.1})[0]["all_reduce"] == 1
    # frozen: a fully frozen unit (blocks.0) is gathered but never reduced.
    c = pool.run(rank_count, "full_shard", {"frozen": r"blocks\.0\..*"})[0]
    assert c["reduce_scatter_single"] == U, c
    # accumulation: sharded reduces every micro-batch, local once.
    assert pool.run(rank_count, "full_shard", {"accum": 2})[0]["reduce_scatter_single"] == 2 * (U + 1)
    assert pool.run(rank_count, "full_shard", {"accum": 2, "accumulation": "local"})[0]["reduce_scatter_single"] == U + 1


def rank_hybrid_groups() -> dict:
    model = make_model("mlp")
    apply, params = sf.functionalize(model, units=units_of("mlp"))
    mesh = sf.mesh(replicate=2, shard=-1)
    step = sf.train_step(make_loss_fn("mlp", apply), sf.optim.adamw(**OPT), mesh, strategy="hybrid_shard")
    state = step.init(params)
    leaf = state.params["0"]["weight"]
    return dict(placements=[str(p) for p in leaf.placements], local=tuple(leaf._local_tensor.shape), shape=tuple(leaf.shape))


def test_hybrid_shards_within_the_shard_axis(pools):
    res = pools(4).run(rank_hybrid_groups)
    assert all(r["placements"] == ["R", "S(0)"] for r in res), res
    assert [r["local"] for r in res] == [(3, 7), (2, 7), (3, 7), (2, 7)], res  # 5 rows over 2 shards


def rank_remat_recomputes(remat) -> int:
    """How many times an inner layer of each unit runs in one step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model("gpt")
    calls = []
    for b in model.blocks:
        b.fc.register_forward_hook(lambda *_: calls.append(1))
    apply, params = sf.functionalize(model, units=units_of("gpt"))
    step = sf.train_step(make_loss_fn("gpt", apply), sf.optim.adamw(**OPT), sf.mesh(dp=-1), remat=remat)
    state = step.init(params)
    step(state, local_batch(global_batch("gpt", 0, world), rank, world))
    return len(calls)


def test_remat_recomputes_the_chosen_units(pools):
    pool = pools(2)
    assert pool.run(rank_remat_recomputes, False) == [3, 3]
    assert pool.run(rank_remat_recomputes, True) == [6, 6]  # forward + recompute, per unit
    assert pool.run(rank_remat_recomputes, r"blocks\.[01]") == [5, 5]


def rank_remat_batchnorm(remat) -> dict:
    """Two SGD steps of a model with BatchNorm inside its units, the same batch on every rank, against
    the same steps in one process: the buffers take one update a step, remat or not (Note [buffers
    under remat] in shardfn/_remat.py)."""
    torch.manual_seed(0)
    block = lambda: torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6), torch.nn.Tanh())  # noqa: E731
    model = torch.nn.Sequential(block(), block(), torch.nn.Linear(6, 2))
    ref = copy.deepcopy(model)
    apply, params = sf.functionalize(model, units=r"[01]")
    loss = lambda out, y: torch.nn.functional.mse_loss(out, y)  # noqa: E731
    step = sf.train_step(lambda p, b: loss(apply(p, b[0]), b[1]), sf.optim.sgd(0.1), sf.mesh(dp=-1), remat=remat)
    state = step.init(params)
    opt = torch.optim.SGD(ref.parameters(), 0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
        state, _ = step(state, (x, y))
        opt.zero_grad()
        loss(ref(x), y).backward()
        opt.step()
    got = sf.to_state_dict(sf.gather(state.params), apply)
    return {n: (got[n].double() - t.double()).abs().max().item() for n, t in ref.state_dict().items()}


@pytest.mark.parametrize("remat", [False, True])
def test_remat_updates_batchnorm_statistics_once(pools, remat):
    for errs in pools(2).run(rank_remat_batchnorm, remat):
        assert errs["0.1.num_batches_tracked"] == 0 and errs["1.1.num_batches_tracked"] == 0, errs
        assert max(errs.values()) < 1e-6, errs


class _EmaBlock(torch.nn.Module):
    """A block whose forward updates buffers in one of the ways users write: in place under no_grad,
    through `.data` (no version counter moves), by reassignment (a new tensor), or inside a kernel
    (`F.batch_norm` on buffers of a module that is no BatchNorm class, no counter)."""

    def __init__(self, how: str):
        super().__init__()
        self.fc = torch.nn.Linear(5, 5)
        self.how = how
        self.register_buffer("ema", torch.zeros(5, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("var", torch.ones(5, dtype=torch.float64))

    def forward(self, x):
        m = x.detach().mean(0)
        if self.how == "in_place":
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * m)
                self.count += 1
        elif self.how == "data":
            self.ema.data.mul_(0.9).add_(0.1 * m)
            self.count.data += 1
        elif self.how == "reassign":
            self.ema = 0.9 * self.ema + 0.1 * m
            self.count = self.count + 1
        elif self.how == "kernel":
            x = torch.nn.functional.batch_norm(x, self.ema, self.var, training=True, momentum=0.1)
        return x + torch.tanh(self.fc(x - self.ema))


def rank_buffer_updates(how: str, remat: bool, fail_at: int) -> dict:
    """Three SGD steps against one process that runs each rank's share in turn from the same buffers
    and keeps rank 0's (what the sync gives, as DDP's broadcast): parameters and buffers exact, on
    every rank (Note [buffers] in shardfn/_buffers.py). With `fail_at`, that step's loss_fn raises
    after the forward on every rank: the buffers are as before it, and the run goes on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(_EmaBlock(how), _EmaBlock(how), torch.nn.Linear(5, 2)).double()

    model, ref = make(), make()
    apply, params = sf.functionalize(model, units=r"[01]")
    attempt = [0]

    def loss_fn(p, b):
        out = torch.nn.functional.mse_loss(apply(p, b[0]), b[1])
        attempt[0] += 1
        if attempt[0] == fail_at:
            raise FloatingPointError("planted")
        return out

    step = sf.train_step(loss_fn, sf.optim.sgd(0.1), sf.mesh(dp=-1), remat=remat)
    state = step.init(params)
    opt = torch.optim.SGD(ref.parameters(), 0.1)
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(4 * world, 5, generator=g, dtype=torch.float64), torch.randn(4 * world, 2, generator=g, dtype=torch.float64)
        if s + 1 == fail_at:
            before = {n: b.clone() for n, b in model.named_buffers()}
            try:
                step(state, (x.chunk(world)[rank], y.chunk(world)[rank]))
            except FloatingPointError:
                pass
            kept = max((b - before[n]).abs().max().item() for n, b in model.named_buffers())
        state, _ = step(state, (x.chunk(world)[rank], y.chunk(world)[rank]))
        opt.zero_grad()
        start = {n: b.clone() for n, b in ref.named_buffers()}
        for r in reversed(range(world)):  # rank 0 last: its buffers stay
            for n, b in ref.named_buffers():
                b.copy_(start[n])
            (torch.nn.functional.mse_loss(ref(x.chunk(world)[r]), y.chunk(world)[r]) / world).backward()
        opt.step()
    got = {**sf.to_state_dict(sf.gather(state.params), apply), **dict(model.named_buffers())}
    errs = {n: (got[n].double() - t.double()).abs().max().item() for n, t in ref.state_dict().items()}
    return {"errs": errs, "failed_step_moved": kept if fail_at else 0.0}


@pytest.mark.parametrize("how", ["in_place", "data", "reassign", "kernel"])
@pytest.mark.parametrize("remat", [False, True])
def test_buffers_a_forward_updates_are_synced(pools, how, remat):
    for world in (2, 3):
        for out in pools(world).run(rank_buffer_updates, how, remat, 0 if remat else 2):
            assert max(out["errs"].values()) < 1e-12, (world, out)
            assert out["failed_step_moved"] == 0.0, (world, out)


def rank_local_accumulation_precision() -> dict:
    """bf16 compute, fp32 reduce, 16 micro-batches: "local" accumulation adds the micro-batches'
    gradients in fp32, as "sharded" does (and FSDP2): both equal the gradients of each micro-batch's
    bf16 backward added in fp32. Autograd alone added them in bf16 (3e-3 off)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    k, per = 16, 32
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    low = copy.deepcopy(model).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(per * world, 6, generator=g), torch.randn(per * world, 3, generator=g)
    want = {n: torch.zeros(p.shape) for n, p in low.named_parameters()}
    for r in range(world):
        for xm, ym in zip(x.chunk(world)[r].chunk(k), y.chunk(world)[r].chunk(k)):
            low.zero_grad()
            (torch.nn.functional.mse_loss(low(xm.to(torch.bfloat16)).float(), ym) / (world * k)).backward()
            for n, p in low.named_parameters():
                want[n] += p.grad.float()
    errs = {}
    for mode in ("sharded", "local"):
        apply, params = sf.functionalize(copy.deepcopy(model), units=r"[02]")
        step = sf.train_step(lambda p, b: torch.nn.functional.mse_loss(apply(p, b[0]).float(), b[1]), sf.optim.sgd(0.1), sf.mesh(dp=-1),
                             mixed_precision=sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                             accumulation_steps=k, accumulation=mode)
        step(step.init(params), (x.chunk(world)[rank], y.chunk(world)[rank]))
        got = sf.to_state_dict(sf.gather(step.grads), apply)
        errs[mode] = max((got[n] - want[n]).abs().max().item() / want[n].abs().max().item() for n in want)
    return errs


def test_local_accumulation_adds_in_the_reduce_dtype(pools):
    for errs in pools(2).run(rank_local_accumulation_precision):
        assert max(errs.values()) < 1e-6, errs


class _Cache(torch.nn.Module):
    """A mask grown to the longest sequence seen (reassigned: another shape on each rank), and an EMA
    updated through `.data` only when the batch routes to it (a change on one rank)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("mask", torch.ones(1, 1), persistent=False)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        t = x.shape[0]
        if self.mask.shape[0] < t:
            self.mask = torch.tril(torch.ones(t, t))
        if x[0, 0] > 0:
            self.ema.data.add_(1.0)
        return self.fc(self.mask[:t, :t] @ x)


def rank_buffers_that_differ_between_ranks(remat: bool) -> dict:
    """Rank r's batches have 2 + 2r rows; the EMA is reached by rank 0 at step 0 and by rank 1 at
    step 1. Every rank ends with rank 0's buffers (its mask's shape too), with remat as well:
    broadcast sizes that differed aborted the ranks, a reassignment to another shape under remat
    raised a KeyError, and a change first seen on another rank than the one that learned it drifted."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Cache(), torch.nn.Linear(4, 1))
    apply, params = sf.functionalize(model, units=r"0")
    step = sf.train_step(lambda p, x: apply(p, x).pow(2).mean(), sf.optim.sgd(0.1), sf.mesh(dp=-1), remat=remat)
    state = step.init(params)
    for s in range(2):
        x = torch.randn(2 + 2 * rank, 4, generator=torch.Generator().manual_seed(s))
        x[0, 0] = 1.0 if s == rank else -1.0
        state, _ = step(state, x)
    return {"mask": tuple(model[0].mask.shape), "ema": model[0].ema.tolist()}


@pytest.mark.parametrize("remat", [False, True])
def test_buffers_that_differ_between_ranks_take_rank_0s(pools, remat):
    got = pools(3).run(rank_buffers_that_differ_between_ranks, remat)
    assert all(g == got[0] for g in got), got
    assert got[0]["mask"] == (2, 2) and got[0]["ema"] == [1.0] * 4, got[0]
