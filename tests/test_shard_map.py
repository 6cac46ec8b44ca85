"""sf.shard_map and the named collectives: values and derivatives against the global function.

Each case is a per-rank function, its specs, and the global function it computes written directly
on the full tensors in one process (the meaning of JAX's collective of the same name). The sharded
value, its autograd gradient, `torch.func.grad` and `torch.func.jvp` are compared with the global
function's. Cases run over one axis of a 1-D mesh at 2, 3 and 4 ranks, and on a (dp=2, tp=2) mesh
over a tuple of axes in either order and over one axis with the other as an outer batch.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from shardfn import _collectives as C
from reference import rel_err


def _blocks(x: torch.Tensor, n: int) -> torch.Tensor:
    """(n, *block) from a global tensor split in n along dim 0."""
    return x.reshape(n, x.shape[0] // n, *x.shape[1:])


# name -> (per-rank fn(axis, n), output "split" along the axis or the "same" on its ranks, global reference(x, n),
# rows per rank ("n": the axis size), cols (None: twice the axis size))
def _cases() -> dict[str, tuple[Callable, str, Callable, int, int]]:
    def ring(n):
        return [(i, (i + 1) % n) for i in range(n)]

    return {
        "psum": (lambda a, n: lambda x: sf.psum(x, a), "same", lambda x, n: _blocks(x, n).sum(0), 2, 3),
        "pmean": (lambda a, n: lambda x: sf.pmean(x * x, a), "same", lambda x, n: _blocks(x * x, n).mean(0), 2, 3),
        "pmax": (lambda a, n: lambda x: sf.pmax(x, a), "same", lambda x, n: _blocks(x, n).amax(0), 2, 3),
        "pmin": (lambda a, n: lambda x: sf.pmin(x.sin(), a), "same", lambda x, n: _blocks(x.sin(), n).amin(0), 2, 3),
        "psum_tree": (lambda a, n: lambda x: sum(sf.psum({"u": x, "v": [2 * x]}, a)["v"]), "same",
                      lambda x, n: 2 * _blocks(x, n).sum(0), 2, 3),
        "psum_of_invariant": (lambda a, n: lambda x: sf.psum(sf.psum(x, a), a), "same", lambda x, n: n * _blocks(x, n).sum(0), 2, 3),
        "all_gather_tiled": (lambda a, n: lambda x: sf.all_gather(x, a, tiled=True) * 1.5, "split",
                             lambda x, n: 1.5 * x.repeat(n, 1), 2, 3),
        "all_gather_stacked_dim1": (lambda a, n: lambda x: sf.all_gather(x.cos(), a, dim=1).flatten(1), "split",
                                    lambda x, n: _blocks(x.cos(), n).transpose(0, 1).flatten(1).repeat(n, 1), 2, 3),
        "all_gather_contrastive": (lambda a, n: lambda x: (x @ sf.all_gather(x, a, tiled=True).T).logsumexp(1, keepdim=True), "split",
                                   lambda x, n: (x @ x.T).logsumexp(1, keepdim=True), 2, 3),
        "psum_scatter_tiled": (lambda a, n: lambda x: sf.psum_scatter(x * x, a, dim=1, tiled=True), "split",
                               lambda x, n: torch.cat(list((_blocks(x * x, n).sum(0)).chunk(n, 1)), 0), 2, 2 * 4 * 3),
        "psum_scatter_stacked": (lambda a, n: lambda x: sf.psum_scatter(x, a), "split",
                                 lambda x, n: _blocks(x, n).sum(0).flatten(), "n", 3),
        "ppermute_ring": (lambda a, n: lambda x: sf.ppermute(x * 2, a, ring(n)), "split", lambda x, n: torch.roll(2 * x, x.shape[0] // n, 0), 2, 3),
        "ppermute_partial": (lambda a, n: lambda x: sf.ppermute(x, a, [(0, n - 1)]), "split",
                             lambda x, n: torch.cat([torch.zeros_like(b) if j != n - 1 else _blocks(x, n)[0] for j, b in enumerate(_blocks(x, n))]), 2, 3),
        "all_to_all_tiled": (lambda a, n: lambda x: sf.all_to_all(x, a, 1, 0, tiled=True), "split",
                             lambda x, n: torch.cat(list(x.chunk(n, 1)), 0), 2, None),
        "all_to_all_untiled": (lambda a, n: lambda x: sf.all_to_all(x.reshape(x.shape[0], n, -1), a, 1, 0).flatten(1), "split",
                               lambda x, n: torch.cat([_blocks(x, n)[:, :, j * (x.shape[1] // n):(j + 1) * (x.shape[1] // n)].flatten(1)
                                                       for j in range(n)], 0), 2, None),
        "axis_index": (lambda a, n: lambda x: x * (sf.axis_index(a) + 1), "split",
                       lambda x, n: x * torch.arange(1, n + 1).repeat_interleave(x.shape[0] // n)[:, None], 2, 3),
        "axis_size": (lambda a, n: lambda x: x * sf.axis_size(a), "split", lambda x, n: x * n, 2, 3),
    }


def _input(name: str, rows: "int | str", cols: int | None, n: int, outer: int) -> torch.Tensor:
    """The global input: `rows` per rank ("n": the axis size), `cols` (None: twice the axis size)."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    per = n if rows == "n" else rows
    return torch.randn(per * n * outer, cols if cols is not None else 2 * n, generator=g)


def _check_cases(mesh, axis, in_entry, out_split, out_same, n: int, outer: int = 1) -> dict:
    """Every case over `axis` (of size n) of `mesh`, the input split as `in_entry` on dim 0, the
    output `out_split` / `out_same`; `outer` > 1: an outer axis cuts dim 0 first, the reference
    runs per outer block."""
    res = {}
    for name, (make, kind, ref, rows, cols) in _cases().items():
        x = _input(name, rows, cols, n, outer)
        out_spec = sf.P(out_split) if kind == "split" else (sf.P(out_same) if out_same else sf.P())
        f = sf.shard_map(make(axis, n), mesh=mesh, in_specs=sf.P(in_entry), out_specs=out_spec)

        def glob(x, ref=ref):
            return torch.cat([ref(c, n) for c in x.chunk(outer)]) if outer > 1 else ref(x, n)

        def sharded(x, f=f):
            return sf.gather(f(x))

        xg = x.clone().requires_grad_()
        y = sharded(xg)
        want = glob(x)
        w = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
        (gx,) = torch.autograd.grad((y * w).sum(), xg)
        xr = x.clone().requires_grad_()
        (rx,) = torch.autograd.grad((glob(xr) * w).sum(), xr)
        fg = torch.func.grad(lambda x: (sharded(x) * w).sum())(x)
        t = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
        _, jv = torch.func.jvp(sharded, (x,), (t,))
        _, rjv = torch.func.jvp(glob, (x,), (t,))
        res[name] = max(rel_err(y, want), rel_err(gx, rx), rel_err(fg, rx), rel_err(jv, rjv))
        if kind == "split" and name != "axis_size":  # the value varies: a spec claiming it the same is refused
            try:
                sf.shard_map(make(axis, n), mesh=mesh, in_specs=sf.P(in_entry), out_specs=sf.P(out_same) if out_same else sf.P())(x)
                res[name + ":check"] = "not refused"
            except ValueError as e:
                res[name + ":check"] = "refused" if "varies along" in str(e) else str(e)
    return res


def rank_collectives_1d() -> dict:
    mesh = sf.mesh(dp=-1)
    return _check_cases(mesh, "dp", "dp", "dp", None, dist.get_world_size())


def rank_collectives_2d() -> dict:
    mesh = sf.mesh(dp=2, tp=2)
    out = {}
    for tag, (axis, entry) in {"dp,tp": (("dp", "tp"), ("dp", "tp")), "tp,dp": (("tp", "dp"), ("tp", "dp"))}.items():
        out.update({f"{tag}:{k}": v for k, v in _check_cases(mesh, axis, entry, entry, None, 4).items()})
    # over tp only, dp an outer batch: the same cases per dp block
    out.update({f"tp:{k}": v for k, v in _check_cases(mesh, "tp", ("dp", "tp"), ("dp", "tp"), "dp", 2, outer=2).items()})
    return out


def rank_collectives_over_an_axis_of_one() -> dict:
    """Note [axes of size one]: on (dp=W, tp=1), every collective over tp is the identity, and so
    is its transpose; the input typed as varying over tp (in_specs over (dp, tp)) or not (over dp
    alone: the collective's pvary, whose transpose once summed over every rank)."""
    mesh = sf.mesh(dp=-1, tp=1)
    w = dist.get_world_size()
    out = {f"tp:{k}": v for k, v in _check_cases(mesh, "tp", ("dp", "tp"), ("dp", "tp"), "dp", 1, outer=w).items()}
    out.update({f"tp, lifted:{k}": v for k, v in _check_cases(mesh, "tp", "dp", ("dp", "tp"), "dp", 1, outer=w).items()})
    # a closed-over weight, summed over tp of one: its gradient is the global one
    x = torch.arange(1.0, 2 * w + 1).reshape(2 * w, 1)
    wt = torch.tensor([2.0], requires_grad=True)
    f = sf.shard_map(lambda b: sf.psum((wt * b).sum(), "tp"), mesh=mesh, in_specs=sf.P("tp"), out_specs=sf.P())
    sf.gather(f(x)).backward()
    out["closed-over weight"] = rel_err(wt.grad, x.sum().reshape(1))

    def written(b):  # each collective's result is a new tensor: writing it leaves its input alone
        y = sf.psum(b, "tp")
        y.mul_(10)
        return b + y

    got = sf.gather(sf.shard_map(written, mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P("dp"))(torch.ones(2 * w, 1)))
    out["result written in place"] = rel_err(got, torch.full((2 * w, 1), 11.0))
    return out


def _assert_all(results: list[dict]) -> None:
    for r in results:
        for k, v in r.items():
            if k.endswith(":check"):
                assert v == "refused", (k, v)
            else:
                assert v < 1e-5, (k, v)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_and_derivatives_match_the_global_function(pools, world):
    _assert_all(pools(world).run(rank_collectives_1d))


def test_collectives_on_a_2d_mesh_over_tuples_and_one_axis(pools):
    _assert_all(pools(4).run(rank_collectives_2d))


def test_collectives_over_an_axis_of_one_rank(pools):
    _assert_all(pools(3).run(rank_collectives_over_an_axis_of_one))


# ----------------------------------------------------------------------------------------------
# Examples people copy, each against its single-process reference.


def _tp_mlp(x, w1, w2, axis):
    """Column-split w1, row-split w2, one psum: a tensor-parallel MLP written by hand."""
    return sf.psum(torch.nn.functional.gelu(x @ w1) @ w2, axis)


def _ring_attention(q, k, v, axis):
    """Causal attention over a sequence split along `axis`: K/V blocks passed around the ring
    (ppermute), an online softmax, the causal mask by global position."""
    n, me = sf.axis_size(axis), sf.axis_index(axis)
    t = q.shape[-2]
    scale = q.shape[-1] ** -0.5
    qpos = me * t + torch.arange(t)
    m = torch.full(q.shape[:-1] + (1,), float("-inf"))
    num, den = torch.zeros_like(q), torch.zeros_like(m)
    for s in range(n):
        src = (me - s) % n
        kpos = src * t + torch.arange(t)
        scores = (q @ k.transpose(-2, -1)) * scale
        scores = scores.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
        new_m = torch.maximum(m, scores.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(new_m), torch.zeros_like(new_m), new_m)
        p = torch.exp(scores - safe)
        corr = torch.exp(torch.where(torch.isinf(m), torch.full_like(m, float("-inf")), m - safe))
        num = num * corr + p @ v
        den = den * corr + p.sum(-1, keepdim=True)
        m = new_m
        if s < n - 1:
            ring = [(i, (i + 1) % n) for i in range(n)]
            k, v = sf.ppermute(k, axis, ring), sf.ppermute(v, axis, ring)
    return num / den


def _moe(x, router, experts, axis):
    """Top-1 mixture of experts, one expert per rank: all_to_all dispatch and combine."""
    n = sf.axis_size(axis)
    probs = torch.softmax(x @ router, -1)
    choice = probs.argmax(-1)
    gate = probs.gather(-1, choice[:, None])
    onehot = torch.nn.functional.one_hot(choice, n)
    slot = (onehot.cumsum(0) - 1).gather(-1, choice[:, None])[:, 0]
    cap = x.shape[0]  # no token dropped
    send = x.new_zeros(n, cap, x.shape[1]).index_put((choice, slot), x)
    recv = sf.all_to_all(send, axis, 0, 0, tiled=True)            # (n sources, cap, d) for my expert
    out = recv @ experts[0]
    back = sf.all_to_all(out, axis, 0, 0, tiled=True)             # (n experts, cap, d) for my tokens
    return gate * back[choice, slot]


def rank_examples() -> dict:
    W = dist.get_world_size()
    mesh = sf.mesh(dp=-1)
    g = torch.Generator().manual_seed(11)
    res = {}

    def compare(name, f, ref, args, out_w=None):
        leaves = [a.clone().requires_grad_() for a in args]
        y = sf.gather(f(*leaves))
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)) if out_w is None else out_w
        grads = torch.autograd.grad((y * w).sum(), leaves)
        rl = [a.clone().requires_grad_() for a in args]
        want = ref(*rl)
        rgrads = torch.autograd.grad((want * w).sum(), rl)
        fgrads = torch.func.grad(lambda *a: (sf.gather(f(*a)) * w).sum(), argnums=tuple(range(len(args))))(*args)
        res[name] = max([rel_err(y, want)] + [rel_err(a, b) for a, b in zip(grads, rgrads)] + [rel_err(a, b) for a, b in zip(fgrads, rgrads)])

    # tensor-parallel MLP over the ranks: x whole, w1 split by columns, w2 by rows
    x, w1, w2 = torch.randn(4, 6, generator=g), torch.randn(6, 4 * W, generator=g), torch.randn(4 * W, 6, generator=g)
    tp = sf.shard_map(lambda x, a, b: _tp_mlp(x, a, b, "dp"), mesh=mesh, in_specs=(sf.P(), sf.P(None, "dp"), sf.P("dp", None)), out_specs=sf.P())
    compare("tp_mlp", tp, lambda x, a, b: torch.nn.functional.gelu(x @ a) @ b, (x, w1, w2))
    # the same with the weights as DTensors: laid out as the specs (no move) and otherwise (moved)
    d1 = sf.shard(w1, sf.P(None, "dp"), mesh).detach().requires_grad_()
    d2 = sf.shard(w2, sf.P(None, "dp"), mesh).detach().requires_grad_()  # split the other way: redistributed
    y = sf.gather(tp(x, d1, d2))
    ((y * y).sum()).backward()
    r1, r2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    want = torch.nn.functional.gelu(x @ r1) @ r2
    (want * want).sum().backward()
    res["tp_mlp_dtensor"] = max(rel_err(y, want), rel_err(d1.grad.full_tensor(), r1.grad), rel_err(d2.grad.full_tensor(), r2.grad))
    res["tp_mlp_dtensor_grad_layout"] = (tuple(d1.grad.placements), tuple(d2.grad.placements)) == (tuple(d1.placements), tuple(d2.placements))

    # ring attention, the sequence split over the ranks
    q, k, v = (torch.randn(2, 3, 4 * W, 8, generator=g) for _ in range(3))
    ring = sf.shard_map(lambda q, k, v: _ring_attention(q, k, v, "dp"), mesh=mesh, in_specs=sf.P(None, None, "dp"), out_specs=sf.P(None, None, "dp"))
    compare("ring_attention", ring, lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v))

    # top-1 MoE, tokens and experts split over the ranks
    x, router, experts = torch.randn(5 * W, 6, generator=g), torch.randn(6, W, generator=g), torch.randn(W, 6, 6, generator=g)
    moe = sf.shard_map(lambda x, r, e: _moe(x, r, e, "dp"), mesh=mesh, in_specs=(sf.P("dp"), sf.P(), sf.P("dp")), out_specs=sf.P("dp"))

    def moe_ref(x, r, e):
        probs = torch.softmax(x @ r, -1)
        c = probs.argmax(-1)
        return probs.gather(-1, c[:, None]) * torch.einsum("nd,nde->ne", x, e[c])

    compare("moe", moe, moe_ref, (x, router, experts))
    C.STATS.reset()
    moe(x, router, experts)
    res["moe_calls"] = C.STATS.calls.get("all_to_all")
    C.STATS.reset()
    ring(q, k, v)
    res["ring_calls"] = C.STATS.calls.get("ppermute", 0)
    return res


@pytest.mark.parametrize("world", [2, 3])
def test_examples_match_their_single_process_references(pools, world):
    for r in pools(world).run(rank_examples):
        for k in ("tp_mlp", "tp_mlp_dtensor", "ring_attention", "moe"):
            assert r[k] < 1e-5, (k, r[k])
        assert r["tp_mlp_dtensor_grad_layout"]
        assert r["moe_calls"] == 2  # dispatch and combine
        assert r["ring_calls"] == 2 * (world - 1)  # K and V, world - 1 steps


# ----------------------------------------------------------------------------------------------
# Named collectives inside a train step's loss_fn: the batch is this rank's block along "dp".


class _TwoTower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.img = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5))
        self.txt = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5))

    def forward(self, x, y):
        return torch.nn.functional.normalize(self.img(x), dim=-1), torch.nn.functional.normalize(self.txt(y), dim=-1)


def _clip_loss(zi, zt, zi_all, zt_all, labels):
    """Symmetric InfoNCE of this rank's rows against every row of the global batch."""
    f = torch.nn.functional
    return 0.5 * (f.cross_entropy(zi @ zt_all.T / 0.1, labels) + f.cross_entropy(zt @ zi_all.T / 0.1, labels))


def _masked_batch(step: int, n: int):
    g = torch.Generator().manual_seed(50 + step)
    x, y = torch.randn(n, 6, generator=g), torch.randn(n, 5, generator=g)
    mask = (torch.rand(n, generator=g) < 0.6).float()
    mask[0] = 1.0
    return x, y, mask


def rank_collectives_in_a_step(strategy: str) -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    hybrid = strategy == "hybrid_shard"
    mesh = sf.mesh(replicate=2, shard=-1) if hybrid else sf.mesh(dp=-1)
    DP = ("replicate", "shard") if hybrid else "dp"  # the step's data axes
    res = {}
    opt = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)

    # CLIP-style contrastive loss over the global batch: all_gather of the embeddings over "dp"
    torch.manual_seed(0)
    model = _TwoTower()
    ref = _TwoTower()
    ref.load_state_dict(model.state_dict())
    apply, params = sf.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        zi, zt = apply(p, x, y)
        zi_all, zt_all = sf.all_gather(zi, DP, tiled=True), sf.all_gather(zt, DP, tiled=True)
        labels = sf.axis_index(DP) * x.shape[0] + torch.arange(x.shape[0])
        return _clip_loss(zi, zt, zi_all, zt_all, labels)

    step = sf.train_step(loss_fn, sf.optim.adamw(**opt), mesh, strategy=strategy)
    state = step.init(params)
    ropt = torch.optim.AdamW(ref.parameters(), **opt)
    losses = []
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(3 * W, 6, generator=g), torch.randn(3 * W, 4, generator=g)
        state, metrics = step(state, (x.chunk(W)[rank], y.chunk(W)[rank]))
        ropt.zero_grad()
        zi, zt = ref(x, y)
        rloss = _clip_loss(zi, zt, zi, zt, torch.arange(3 * W))
        rloss.backward()
        ropt.step()
        losses.append(abs(metrics["loss"].item() - rloss.item()) / rloss.item())
    full = sf.to_state_dict(sf.gather(state.params), apply)
    res["clip_params"] = max(rel_err(full[k], v) for k, v in ref.state_dict().items())
    res["clip_loss"] = max(losses)

    # A loss that is this rank's share of the global mean: psum(local_sum) / psum(count), the
    # counts differing by rank; taken as the global loss, as it is.
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5))
    rnet = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5))
    rnet.load_state_dict(net.state_dict())
    apply, params = sf.functionalize(net)

    def masked(p, batch):
        x, y, mask = batch
        err = ((apply(p, x) - y) ** 2).mean(-1)
        return sf.psum((err * mask).sum(), DP) / sf.psum(mask.sum(), DP)

    step = sf.train_step(masked, sf.optim.sgd(0.1, momentum=0.9), mesh, strategy=strategy)  # sees the gradient's scale
    state = step.init(params)
    ropt = torch.optim.SGD(rnet.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for s in range(3):
        x, y, mask = _masked_batch(s, 4 * W)
        cut = [t.chunk(W)[rank] for t in (x, y, mask)]
        state, metrics = step(state, tuple(cut))
        ropt.zero_grad()
        rloss = (((rnet(x) - y) ** 2).mean(-1) * mask).sum() / mask.sum()
        rloss.backward()
        ropt.step()
        losses.append(abs(metrics["loss"].item() - rloss.item()) / rloss.item())
    full = sf.to_state_dict(sf.gather(state.params), apply)
    res["masked_params"] = max(rel_err(full[k], v) for k, v in rnet.state_dict().items())
    res["masked_loss"] = max(losses)

    # value_and_grad: the same loss, the single-process gradient
    torch.manual_seed(1)
    net2 = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5))
    rnet.load_state_dict(net2.state_dict())
    apply, params = sf.functionalize(net2)
    sharded = sf.shard(params, sf.specs(params, mesh, default=sf.P("shard") if hybrid else sf.P("dp")), mesh)

    def masked2(p, batch):
        x, y, mask = batch
        err = ((apply(p, x) - y) ** 2).mean(-1)
        return sf.psum((err * mask).sum(), DP) / sf.psum(mask.sum(), DP)

    x, y, mask = _masked_batch(9, 4 * W)
    loss, grads = sf.value_and_grad(masked2, apply=apply, strategy="hybrid_shard" if hybrid else "full_shard")(sharded, tuple(t.chunk(W)[rank] for t in (x, y, mask)))
    rnet.zero_grad()
    rloss = (((rnet(x) - y) ** 2).mean(-1) * mask).sum() / mask.sum()
    rloss.backward()
    gfull = sf.to_state_dict(sf.gather(grads), apply)
    res["vg_grads"] = max(rel_err(gfull[k], p.grad) for k, p in rnet.named_parameters())
    res["vg_loss"] = abs(loss.item() - rloss.item()) / rloss.item()
    return res


@pytest.mark.parametrize("world,strategy", [(2, "full_shard"), (3, "full_shard"), (3, "no_shard"), (2, "shard_grad_op"), (4, "hybrid_shard")])
def test_collectives_in_a_train_step_loss(pools, world, strategy):
    for r in pools(world).run(rank_collectives_in_a_step, strategy):
        for k, v in r.items():
            assert v < 2e-5, (k, v)



def rank_losses_with_tensor_parallel() -> dict:
    """The psum-normalized loss on a (dp=2, tp=2) mesh, tensor-parallel leaves and all: its loss is
    a DTensor over "tp", taken as the global loss as it is (gradients of the full scale, clipped on
    the global norm)."""
    rank = dist.get_rank()
    mesh = sf.mesh(dp=2, tp=2)
    dp = mesh.get_coordinate()[0]
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5))
    rnet = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5))
    rnet.load_state_dict(net.state_dict())
    apply, params = sf.functionalize(net)
    rules = [(r"0\.weight", sf.P("tp", None)), (r"0\.bias", sf.P("tp")), (r"2\.weight", sf.P(None, "tp"))]
    specs = sf.specs(params, mesh, rules=rules, default=sf.P("dp"))

    def masked(p, batch):
        x, y, mask = batch
        err = ((apply(p, x) - y) ** 2).mean(-1)
        return sf.psum((err * mask).sum(), "dp") / sf.psum(mask.sum(), "dp")

    step = sf.train_step(masked, sf.optim.sgd(0.1, momentum=0.9), mesh, specs=specs, max_grad_norm=0.05)
    state = step.init(params)
    ropt = torch.optim.SGD(rnet.parameters(), lr=0.1, momentum=0.9)
    losses, norms = [], []
    for s in range(3):
        x, y, mask = _masked_batch(s, 8)
        state, metrics = step(state, tuple(t.chunk(2)[dp] for t in (x, y, mask)))
        ropt.zero_grad()
        rloss = (((rnet(x) - y) ** 2).mean(-1) * mask).sum() / mask.sum()
        rloss.backward()
        norms.append(abs(metrics["grad_norm"].item() - torch.nn.utils.clip_grad_norm_(rnet.parameters(), 0.05).item()))
        ropt.step()
        losses.append(abs(metrics["loss"].item() - rloss.item()) / rloss.item())
    full = sf.to_state_dict(sf.gather(state.params), apply)
    return dict(params=max(rel_err(full[k], v) for k, v in rnet.state_dict().items()), loss=max(losses),
                norm=max(norms), rank=rank)


def test_a_psum_normalized_loss_under_tensor_parallel_matches_one_process(pools):
    for r in pools(4).run(rank_losses_with_tensor_parallel):
        for k in ("params", "loss", "norm"):
            assert r[k] < 2e-5, (k, r)

# ----------------------------------------------------------------------------------------------
# Randomness per rank: data-parallel ranks draw their own numbers, tp peers the same.


class _Drop(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.nn.functional.dropout(self.fc(x), 0.5, True))


def rank_randomness(dims: dict, randomness: str) -> dict:
    mesh = sf.mesh(**dims)
    torch.manual_seed(0)  # every rank seeded alike, as scripts do
    apply, params = sf.functionalize(_Drop())
    masks = []

    def loss_fn(p, x):
        h = apply(p, x)
        masks.append(torch.nn.functional.dropout(torch.ones(16), 0.5, True))  # what this rank drew
        return h.pow(2).mean()

    specs = sf.specs(params, mesh, rules=[(r"fc\.weight", sf.P("tp", None)), (r"fc\.bias", sf.P("tp")), (r"out\.weight", sf.P(None, "tp"))] if "tp" in dims else [])
    step = sf.train_step(loss_fn, sf.optim.sgd(0.1), mesh, specs=specs, randomness=randomness)
    state = step.init(params)
    x = torch.ones(4, 6)
    for _ in range(2):
        state, _ = step(state, x)
    coord = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    inside = None
    if "tp" not in dims:  # per-shard code: fold_rng picks the axis the draws differ along
        def fn(x):
            with sf.fold_rng("dp"):
                return torch.nn.functional.dropout(x, 0.5, True)

        inside = sf.shard_map(fn, mesh=mesh, in_specs=sf.P(), out_specs=sf.P("dp"))(torch.ones(1, 32)).to_local()
    return dict(coord=coord, masks=[m.tolist() for m in masks], after=torch.rand(4).tolist(), inside=None if inside is None else inside.tolist())


def test_data_parallel_ranks_draw_their_own_numbers(pools):
    a, b = pools(2).run(rank_randomness, dict(dp=-1), "per_rank")
    assert a["masks"] != b["masks"]  # dropout differs over the global batch
    assert a["masks"][0] != a["masks"][1]  # and from step to step
    assert a["after"] == b["after"]  # the generators stay in step outside the step
    assert a["inside"] != b["inside"]
    a, b = pools(2).run(rank_randomness, dict(dp=-1), "same")
    assert a["masks"] == b["masks"]  # the generators as they stand: seeded alike, drawn alike


def test_tp_peers_draw_alike_and_dp_ranks_differ(pools):
    got = pools(4).run(rank_randomness, dict(dp=2, tp=2), "per_rank")
    by = {(r["coord"]["dp"], r["coord"]["tp"]): r["masks"] for r in got}
    assert by[(0, 0)] == by[(0, 1)] and by[(1, 0)] == by[(1, 1)]
    assert by[(0, 0)] != by[(1, 0)]


def rank_refusals_and_vmap() -> dict:
    W = dist.get_world_size()
    mesh = sf.mesh(dp=-1)
    res = {}
    try:  # uneven: refused as JAX does, naming the input, its shape, the spec and the mesh
        sf.shard_map(lambda x: x, mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P("dp"))({"w": torch.ones(2 * W + 1, 3)})
        res["uneven"] = "not refused"
    except ValueError as e:
        res["uneven"] = str(e)
    try:
        sf.psum(torch.ones(2), "dp")
        res["outside"] = "not refused"
    except ValueError as e:
        res["outside"] = str(e)
    try:
        sf.shard_map(lambda x: sf.psum(x, "tp"), mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P())(torch.ones(W, 2))
        res["axis"] = "not refused"
    except ValueError as e:
        res["axis"] = str(e)
    try:
        sf.shard_map(lambda x: sf.ppermute(x, "dp", [(0, 1), (1, 1)]), mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P("dp"))(torch.ones(W, 2))
        res["perm"] = "not refused"
    except ValueError as e:
        res["perm"] = str(e)
    bad = {
        "perm_kind": lambda x: sf.ppermute(x, "dp", "ring"),
        "bool": lambda x: sf.psum(x > 0, "dp"),
        "axis_kind": lambda x: sf.psum(x, 0),
    }
    for name, body in bad.items():
        try:
            sf.shard_map(body, mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P("dp"), check=False)(torch.ones(W, 2))
            res[name] = "not refused"
        except ValueError as e:
            res[name] = str(e)

    def into_a_buffer(x):  # a block written through a view of an invariant buffer: the buffer varies
        buf = torch.zeros(2 * x.shape[0], x.shape[1])
        buf.narrow(0, 0, x.shape[0]).copy_(x)
        return buf

    try:
        sf.shard_map(into_a_buffer, mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P())(torch.ones(W, 2))
        res["view_write"] = "not refused"
    except ValueError as e:
        res["view_write"] = str(e)
    res["view_write_ok"] = tuple(sf.gather(sf.shard_map(into_a_buffer, mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P("dp"))(
        torch.arange(2.0 * W).reshape(W, 2))).shape)

    def cut_again(x):
        return sf.shard_map(lambda y: y, mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P("dp"))(x)

    try:
        sf.shard_map(cut_again, mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P("dp"))(torch.ones(W * W, 2))
        res["nested"] = "not refused"
    except ValueError as e:
        res["nested"] = str(e)
    # vmap around the shard_map (the batch a dim of its own in every block), and jacrev (a vmap
    # over the cotangents), against the global function
    g3 = sf.shard_map(lambda b: sf.psum(b.sin(), "dp") * b, mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P("dp"))
    xs = torch.randn(3, W * 2, 4, generator=torch.Generator().manual_seed(8))

    def glob(r):  # the global function: every row block times the sum over blocks of sin
        return r.reshape(W, 2, 4).sin().sum(0).repeat(W, 1) * r

    ys = torch.func.vmap(g3)(xs)
    res["vmap_outside"] = (tuple(ys.placements), rel_err(ys.full_tensor(), torch.stack([glob(r) for r in xs])))
    jac = torch.func.jacrev(lambda r: sf.gather(g3(r)).sum(0))(xs[0])
    res["jacrev"] = rel_err(jac, torch.func.jacrev(lambda r: glob(r).sum(0))(xs[0]))
    mine = torch.zeros(3)
    sf.shard_map(lambda b: b.add_(1), mesh=mesh, in_specs=sf.P(), out_specs=sf.P())(mine)
    res["caller_kept"] = mine.tolist()
    # vmap inside the per-rank function: collectives of batched values (per-example psum)
    x = torch.randn(W * 2, 5, 3, generator=torch.Generator().manual_seed(4))

    def fn(x):
        return torch.func.vmap(lambda r: sf.psum(r.sin(), "dp"), in_dims=1, out_dims=1)(x)

    f = sf.shard_map(fn, mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P())
    xg = x.clone().requires_grad_()
    y = sf.gather(f(xg))
    (g,) = torch.autograd.grad(y.pow(2).sum(), xg)
    xr = x.clone().requires_grad_()
    want = xr.sin().reshape(W, 2, 5, 3).sum(0)
    (rg,) = torch.autograd.grad(want.pow(2).sum(), xr)
    res["vmap"] = max(rel_err(y, want), rel_err(g, rg))
    # a Hessian-vector product through psum and all_gather (a gradient of a gradient)
    h = sf.shard_map(lambda x: sf.psum((sf.all_gather(x, "dp", tiled=True) * x.repeat(W, 1)).sum(), "dp"), mesh=mesh,
                     in_specs=sf.P("dp"), out_specs=sf.P())
    x2 = torch.randn(W, 3, generator=torch.Generator().manual_seed(6))
    v = torch.randn(W, 3, generator=torch.Generator().manual_seed(7))

    def hvp(fun, x):
        return torch.func.jvp(torch.func.grad(fun), (x,), (v,))[1]

    res["hvp"] = rel_err(hvp(lambda x: sf.gather(h(x)), x2), hvp(lambda x: _gathered_pairs(x, W), x2))
    return res


def _gathered_pairs(x: torch.Tensor, W: int) -> torch.Tensor:
    """The global value of sum_r psum(all_gather(x) * tile(x_r)): every rank's block against the whole."""
    blocks = x.reshape(W, -1, x.shape[-1])
    return sum((x * blocks[r].repeat(W, 1)).sum() for r in range(W))


@pytest.mark.parametrize("world", [2, 3])
def test_refusals_vmap_and_second_derivatives(pools, world):
    for r in pools(world).run(rank_refusals_and_vmap):
        assert "dim 0 of size" in r["uneven"] and "['w']" in r["uneven"] and "pad the dim" in r["uneven"], r["uneven"]
        assert "outside per-shard code" in r["outside"], r["outside"]
        assert "'tp'" in r["axis"] and "('dp',)" in r["axis"], r["axis"]
        assert "destination at most once" in r["perm"], r["perm"]
        assert "(source, destination) pairs" in r["perm_kind"], r["perm_kind"]
        assert "bool tensor" in r["bool"], r["bool"]
        assert "axis 0 is not a name" in r["axis_kind"], r["axis_kind"]
        assert "varies along ['dp']" in r["view_write"], r["view_write"]
        assert r["view_write_ok"] == (2 * world, 2), r["view_write_ok"]
        assert "already varies over ['dp']" in r["nested"], r["nested"]
        assert r["caller_kept"] == [0.0, 0.0, 0.0], r["caller_kept"]  # the block was a copy
        assert r["vmap_outside"][0] == (torch.distributed.tensor.Shard(1),) and r["vmap_outside"][1] < 1e-6, r["vmap_outside"]
        assert r["jacrev"] < 1e-6, r["jacrev"]
        assert r["vmap"] < 1e-5, r["vmap"]
        assert r["hvp"] < 1e-5, r["hvp"]


def rank_derivatives_inside() -> dict:
    """Derivatives taken inside the per-rank function with respect to a replicated weight: JAX's
    data-parallel recipe (`grad` of the local loss, then `pmean`)."""
    mesh, n = sf.mesh(dp=-1), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    X, W, Y = torch.randn(4 * n, 5, generator=g), torch.randn(5, 3, generator=g), torch.randn(4 * n, 3, generator=g)

    def local_loss(w, x, y):
        return ((x @ w - y) ** 2).mean()

    def by_func(w, x, y):
        return torch.func.grad(local_loss)(w, x, y)

    def by_autograd(w, x, y):
        with torch.enable_grad():
            w = w.detach().requires_grad_()
            (gw,) = torch.autograd.grad(local_loss(w, x, y), w)
        return gw

    def by_backward(w, x, y):
        with torch.enable_grad():
            w = w.detach().requires_grad_()
            local_loss(w, x, y).backward()
        return w.grad

    def run(fn, reduce, out):
        mapped = sf.shard_map(lambda w, x, y: reduce(fn(w, x, y)), mesh=mesh, in_specs=(sf.P(), sf.P("dp"), sf.P("dp")), out_specs=out)
        return sf.gather(mapped(W, X, Y))

    return {
        "func_pmean": run(by_func, lambda t: sf.pmean(t, "dp"), sf.P()),
        "grad_of_pmean": run(lambda w, x, y: torch.func.grad(lambda w: sf.pmean(local_loss(w, x, y), "dp"))(w), lambda t: t, sf.P()),
        "func_psum": run(by_func, lambda t: sf.psum(t, "dp"), sf.P()),
        "func_stacked": run(by_func, lambda t: t[None], sf.P("dp")),
        "autograd_pmean": run(by_autograd, lambda t: sf.pmean(t, "dp"), sf.P()),
        "backward_pmean": run(by_backward, lambda t: sf.pmean(t, "dp"), sf.P()),
        "own_block": sf.gather(sf.shard_map(lambda x: torch.func.grad(lambda x: (x**2).sum())(x), mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P("dp"))(X)),
        "inputs": (X, W, Y),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_a_derivative_inside_the_function_sums_over_the_axes_its_input_is_copied_on(pools, world):
    """As JAX's `grad` inside `shard_map`: the gradient with respect to a replicated weight is the sum
    over the ranks of their local gradients (the transpose of the weight's implicit copy onto the
    axis), the same on every rank. Before: `torch.func.grad` gave zeros, silently, and
    `torch.autograd.grad` raised, since the region lifted the weight in the call itself."""
    for r in pools(world).run(rank_derivatives_inside):
        X, W, Y = r["inputs"]
        local = [torch.func.grad(lambda w: ((x @ w - y) ** 2).mean())(W) for x, y in zip(X.chunk(world), Y.chunk(world))]
        total = sum(local)
        assert total.norm() > 0.1
        for key in ("func_pmean", "autograd_pmean", "backward_pmean"):
            assert rel_err(r[key], total) < 1e-6, (key, r[key], total)
        assert rel_err(r["func_psum"], world * total) < 1e-6, r["func_psum"]
        assert rel_err(r["grad_of_pmean"], total / world) < 1e-6, r["grad_of_pmean"]  # the global mean's (docs/API.md)
        assert rel_err(r["func_stacked"], torch.stack([total] * world)) < 1e-6, r["func_stacked"]
        assert rel_err(r["own_block"], 2 * X) < 1e-6, r["own_block"]


class _Mul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return (g * b).sum(0), g * a


def rank_custom_functions() -> dict:
    """Note [a lift inside a custom Function]: a closed-over weight that meets this rank's block
    inside a `torch.autograd.Function` (or reentrant checkpointing) is refused, naming the fixes;
    each fix gives the global gradient."""
    from torch.utils.checkpoint import checkpoint

    mesh, n = sf.mesh(dp=-1), dist.get_world_size()
    x = torch.arange(1.0, 2 * n + 1).reshape(2 * n, 1).requires_grad_()  # (reentrant checkpointing warns without)
    out: dict = {}

    def grad_of(body) -> "torch.Tensor | str":
        w = torch.tensor([2.0], requires_grad=True)
        f = sf.shard_map(lambda xb: sf.psum(body(w, xb).sum(), "dp"), mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P())
        try:
            sf.gather(f(x)).backward()
        except NotImplementedError as e:
            return str(e)
        return w.grad

    out["function"] = grad_of(lambda w, xb: _Mul.apply(w, xb))
    out["reentrant"] = grad_of(lambda w, xb: checkpoint(lambda a: (w * a).sin(), xb, use_reentrant=True))
    out["function, pvary first"] = grad_of(lambda w, xb: _Mul.apply(sf.pvary(w, "dp"), xb))
    out["not reentrant"] = grad_of(lambda w, xb: checkpoint(lambda a: (w * a).sin(), xb, use_reentrant=False))
    out["x"] = x.detach()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_weight_inside_a_custom_function_is_refused_or_lifted_by_hand(pools, world):
    for r in pools(world).run(rank_custom_functions):
        x = r["x"]
        for key in ("function", "reentrant"):
            assert isinstance(r[key], str) and "sf.pvary(x, 'dp')" in r[key] and "use_reentrant=False" in r[key], (key, r[key])
        assert rel_err(r["function, pvary first"], x.sum().reshape(1)) < 1e-6, r["function, pvary first"]
        assert rel_err(r["not reentrant"], (x * (2 * x).cos()).sum().reshape(1)) < 1e-6, r["not reentrant"]


def rank_transforms_inside() -> dict:
    """torch.func's transforms inside the per-rank function: what they hand out is typed as what
    they computed (it varies over dp with the block), so a psum of it needs no pvary and its
    gradient is the global function's, and an out spec claiming it invariant is refused."""
    mesh, n = sf.mesh(dp=-1), dist.get_world_size()
    x = torch.linspace(0.1, 1.0, 2 * n, dtype=torch.float64)
    bodies = {  # per-rank value of the block -> (global value's reference gradient)
        "vmap": (lambda b: torch.func.vmap(torch.sin)(b), lambda x: x.cos()),
        "grad": (lambda b: torch.func.grad(lambda b: b.sin().sum())(b) ** 2, lambda x: -2 * x.sin() * x.cos()),
        "jvp": (lambda b: torch.func.jvp(torch.sin, (b,), (torch.ones_like(b),))[1], lambda x: -x.sin()),
        "jacrev diagonal": (lambda b: torch.func.jacrev(torch.sin)(b).diagonal(), lambda x: -x.sin()),
    }
    out = {}
    for name, (body, want) in bodies.items():
        xg = x.clone().requires_grad_()
        f = sf.shard_map(lambda b: sf.psum(body(b).sum(), "dp"), mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P())
        (g,) = torch.autograd.grad(sf.gather(f(xg)), xg)
        out[name] = rel_err(g, want(x))
        try:
            sf.shard_map(body, mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P())(x)
            out[name + ":check"] = "not refused"
        except ValueError as e:
            out[name + ":check"] = "refused" if "varies along" in str(e) else str(e)
    # a replicated weight used inside a vmap over the block's rows: its gradient, summed over dp
    g = torch.Generator().manual_seed(2)
    X, W = torch.randn(2 * n, 3, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)
    w = W.clone().requires_grad_()
    f = sf.shard_map(lambda b: sf.psum(torch.func.vmap(lambda r: (r * w).tanh().sum())(b).sum(), "dp"),
                     mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P())
    sf.gather(f(X)).backward()
    wr = W.clone().requires_grad_()
    (X * wr).tanh().sum().backward()
    out["weight inside a vmap"] = rel_err(w.grad, wr.grad)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_transforms_inside_the_function_keep_the_types_of_what_they_compute(pools, world):
    _assert_all(pools(world).run(rank_transforms_inside))


def rank_memory_written_then_freed() -> dict:
    """A buffer written in place with this rank's block (varying over dp) and freed; a weight's
    multiple (invariant) allocated later at the same address. JAX: d psum(((2w) * x).sum()) / dw =
    2 * (the sum of the blocks) on every rank. Typing writes by address made the multiple varying:
    no pvary where it met the block, so each rank got its own share of the gradient, silently
    (Note [memory written in place] in shardfn/_manual.py)."""
    from shardfn._manual import vma

    mesh = sf.mesh(dp=-1)
    world = dist.get_world_size()
    X = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    info = {}

    def fn(x, w):
        written = set()
        for i in range(1000):  # until an allocation lands where a written buffer was
            buf = torch.empty(4, 6, dtype=x.dtype)
            buf.copy_(x)
            written.add(buf.data_ptr())
            del buf
            h = w * 2.0
            if h.data_ptr() in written:
                break
        info.update(reused=h.data_ptr() in written, typed=sorted(vma(h)))
        return sf.psum((h * x).sum(), "dp")

    w = torch.randn(4, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64).requires_grad_()
    y = sf.shard_map(fn, mesh=mesh, in_specs=(sf.P("dp"), sf.P()), out_specs=sf.P())(X, w).full_tensor()
    (gw,) = torch.autograd.grad(y, w)
    return dict(info, err=rel_err(gw, 2 * X.view(world, 4, 6).sum(0)))


def test_memory_written_in_place_then_freed_types_nothing_after_it(pools):
    for r in pools(2).run(rank_memory_written_then_freed):
        assert r["reused"], r  # the address came back: the case this checks happened
        assert r["typed"] == [] and r["err"] < 1e-12, r


def rank_extrema() -> dict:
    """pmax / pmin under vmap (a per-example stable softmax over a vocabulary split on tp, inside
    the function; and a vmap around the shard_map), a write into a pmax result in place before its
    backward, and a NaN on either rank (NaN wherever one is, as torch.amax of the global value)."""
    mesh = sf.mesh(dp=2, tp=2)
    X = torch.randn(8, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = {}

    def softmax_rows(x):
        def one(r):
            m = sf.pmax(r.amax(), "tp")
            e = (r - m).exp()
            return e / sf.psum(e.sum(), "tp")
        return torch.func.vmap(one)(x)

    y = sf.shard_map(softmax_rows, mesh=mesh, in_specs=sf.P(None, "tp"), out_specs=sf.P(None, "tp"))(X).full_tensor()
    out["inside"] = rel_err(y, torch.softmax(X, -1))
    both = torch.stack([X, -2 * X])
    y = torch.func.vmap(sf.shard_map(lambda x: sf.pmin(x, "dp"), mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P()))(both)
    out["around"] = rel_err(y.full_tensor(), both.view(2, 2, 4, 6).amin(1))
    x = X.clone().requires_grad_()

    def doubled(b):
        m = sf.pmax(b, "dp")
        m.mul_(2.0)
        return m

    y = sf.shard_map(doubled, mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P())(x).full_tensor()
    (g,) = torch.autograd.grad(y.sum(), x)
    xx = X.clone().requires_grad_()
    (want,) = torch.autograd.grad((2 * xx.view(2, 4, 6).amax(0)).sum(), xx)
    out["in_place"] = rel_err(g, want)
    nan = torch.zeros(8, 1, dtype=torch.float64)
    nan[0, 0] = nan[5, 0] = float("nan")  # on dp rank 0 at row 0, on dp rank 1 at row 1
    for op, f in (("max", sf.pmax), ("min", sf.pmin)):
        got = sf.shard_map(lambda b, f=f: f(b, "dp"), mesh=mesh, in_specs=sf.P("dp"), out_specs=sf.P())(nan).full_tensor()
        out[f"nan_{op}"] = got.isnan().ravel().tolist()
    return out


def test_extrema_under_vmap_in_place_and_with_nan(pools):
    for r in pools(4).run(rank_extrema):
        assert r["inside"] < 1e-12 and r["around"] < 1e-12 and r["in_place"] < 1e-12, r
        assert r["nan_max"] == r["nan_min"] == [True, True, False, False], r
