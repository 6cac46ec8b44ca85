"""Ordinary user code that must train exactly, or be refused before anything is computed wrong.

Each case is a small hand-made model with one pattern users write (part of a block frozen, a
regularizer reading `params`, a block returning a dataclass, a model applied twice, ...), trained
a few steps with `sf.train_step` and compared with single-process AdamW on the global batch, built
from the same unsharded weights. Cases run at world sizes 2 and 3 under `full_shard`,
`shard_grad_op` and `hybrid_shard`.
"""

from __future__ import annotations

import contextlib

import copy
import dataclasses
import re

import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardfn as sf
from shardfn._engine import StaleParameterError
from shardfn._core import model_info
from shardfn._tree import nest

LR, EPS, WD, STEPS, V, D = 1e-2, 1e-5, 0.01, 3, 32, 12


# -- models ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class BlockOut:
    h: torch.Tensor
    gate: float = 1.0


class Boxed:
    """A container torch's pytree knows (as Hugging Face registers its ModelOutput), optree does not."""

    def __init__(self, h):
        self.h = h


torch.utils._pytree.register_pytree_node(Boxed, lambda b: ([b.h], None), lambda xs, _: Boxed(xs[0]))


class Opaque:
    """A container nobody knows: its tensors are invisible to hooks."""

    def __init__(self, h):
        self.h = h


class Block(nn.Module):
    def __init__(self, d, out="tensor"):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.out = out
        self.seen_dtypes: list = []

    def forward(self, x, bias=None):
        if hasattr(self, "rel") and self.out == "bias":  # T5: the first block makes the position bias
            x = x + self.attn(self.norm(x))
            return x + self.mlp(x), self.rel[: x.shape[1]].mean(-1, keepdim=True) * self.rel[0]
        if bias is not None:
            self.seen_dtypes.append(bias.dtype)
            x = x + bias
        x = x + self.attn(self.norm(x))
        x = x + self.mlp(x)
        if self.out == "dataclass":
            return BlockOut(x)
        if self.out == "boxed":
            return Boxed(x)
        if self.out == "opaque":
            return Opaque(x)
        if self.out == "view":
            return x.view(x.shape)
        if self.out == "aux":  # a second output for an auxiliary loss (as MoE balance losses)
            return x, x.pow(2).mean()
        return x


class Net(nn.Module):
    """Embedding, blocks, a final norm and an untied head (the root: emb, ln_f, head)."""

    def __init__(self, L=3, out="tensor", bias_kwarg=False, shared_bias=False, inplace=False, hidden=False, t5=False, aux=False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(D, out) for _ in range(L))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)
        self.bias_kwarg, self.shared_bias, self.inplace, self.hidden = bias_kwarg, shared_bias, inplace, hidden
        self.depth = L  # blocks run (fewer: an early exit)
        self.t5, self.aux = t5, aux
        if shared_bias or t5:  # a bias made from the first block's parameter, used by every later block
            self.blocks[0].rel = nn.Parameter(torch.randn(8, D) * 0.1)
        if t5:  # as T5: the first block computes it and passes it on
            self.blocks[0].out = "bias"
        if aux:
            self.blocks[0].out = "aux"

    def forward(self, idx):
        h = self.emb(idx)
        bias = torch.full((D,), 0.25) if self.bias_kwarg else None
        for i, b in enumerate(list(self.blocks)[: self.depth]):
            if self.shared_bias and i == 0:
                bias = None
            out = b(h, bias=bias)
            if self.t5 and i == 0:
                out, bias = out
            if self.aux and i == 0:
                out, aux = out
            h = out if isinstance(out, torch.Tensor) else out.h
            if self.shared_bias and i == 0:
                bias = b.rel[: idx.shape[1]].unsqueeze(0).mean(-1, keepdim=True) * b.rel[0]
            if self.inplace:
                h += 0.5  # the caller updates the unit's (view) output in place
        h = self.ln_f(h)
        out = h if self.hidden else self.head(h)
        return (out, aux) if self.aux else out


class PosEmb(nn.Module):
    """A unit that returns a view of its own parameter."""

    def __init__(self):
        super().__init__()
        self.pe = nn.Parameter(torch.randn(8, D) * 0.1)

    def forward(self, T):
        return self.pe[:T]


class Sometimes(nn.Module):
    """Position embeddings from a unit that returns a slice of its parameter, and an extra head
    that only long sequences use: in later steps it gets no gradient anywhere."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = PosEmb()
        self.blocks = nn.ModuleList(Block(D) for _ in range(2))
        self.head = nn.Linear(D, V)
        self.extra = nn.Linear(D, V)

    def forward(self, idx):
        h = self.emb(idx) + self.pos(idx.shape[1])
        for b in self.blocks:
            h = b(h)
        out = self.head(h)
        return out + self.extra(h) if idx.shape[1] == 8 else out


class Interleaved(nn.Module):
    """Blocks and adapters interleaved in the forward, grouped in module order."""

    def __init__(self, L=3):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(L))
        self.adapters = nn.ModuleList(nn.Linear(D, D) for _ in range(L))
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        h = self.emb(idx)
        for b, a in zip(self.blocks, self.adapters):
            h = h + torch.tanh(b(h))
            h = h + 0.5 * a(h)
        return self.head(h)


class Tower(nn.Module):
    """Every parameter in a unit (no root), fed a one-hot input that needs no gradient: the first
    unit has no input to detect the end of its backward on."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(V, D), nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, V)])

    def forward(self, idx):
        h = F.one_hot(idx, V).float()
        for b in self.blocks[:-1]:
            h = torch.tanh(b(h))
        return self.blocks[-1](h)


class _AddsToItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h):
        h.add_(1.0)  # in place on the unit's input
        return self.lin(h)


class InPlaceInput(nn.Module):
    """A unit that modifies its input in place: refused with the fix (the end of a unit's backward
    is detected on its inputs)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(_AddsToItsInput() for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.ReLU()) for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        h = self.emb(idx).mean(1)
        for b in self.blocks:
            h = b(h)
        return self.head(h).unsqueeze(1).expand(-1, idx.shape[1], -1)


# -- the cases ------------------------------------------------------------------------------------
def ce(out, x):
    return F.cross_entropy(out.flatten(0, 1).float(), x.roll(-1, 1).flatten())


def batch(step, world, per_rank=2, T=8):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (world * per_rank, T), generator=g)


# Each case: how to build the model, which leaves are frozen, and the loss as a function of
# (f, params, x), where f(params, x) runs the model (apply on the sharded side, the module itself
# in the reference) and params is the parameter tree (the step's on the sharded side, the module's
# parameters in the reference).
CASES = {
    "frozen_part_of_unit": dict(build=lambda: Net(), frozen=r"blocks\.\d+\.(norm|attn)\..*"),
    "frozen_root": dict(build=lambda: Net(), frozen=r"emb\..*|ln_f\..*"),
    "requires_grad_false": dict(build=lambda: Net(), requires_grad_false=r"blocks\.\d+\.attn\..*|emb\..*"),
    "l2_and_head_outside_apply": dict(build=lambda: Net(hidden=True), loss="l2_head"),
    "dataclass_output": dict(build=lambda: Net(out="dataclass")),
    "pytree_output": dict(build=lambda: Net(out="boxed")),
    "view_output_updated_in_place": dict(build=lambda: Net(out="view", inplace=True)),
    "applied_twice": dict(build=lambda: Net(L=4), loss="twice"),
    "interleaved": dict(build=lambda: Interleaved(), units=r"(blocks|adapters)\.\d+"),
    "no_root_applied_twice": dict(build=lambda: Tower(), loss="twice"),
    "derived_tree_in_apply": dict(build=lambda: Net(), loss="derived"),
    "view_of_own_parameter_and_unused_head": dict(build=lambda: Sometimes(), units=r"pos|blocks\.\d+", T=lambda i: 8 if i == 0 else 6),
    "param_read_by_model_code": dict(build=lambda: Net(shared_bias=True)),
    "t5_like_bias_kwarg": dict(build=lambda: Net(t5=True)),
    "auxiliary_loss_on_a_block": dict(build=lambda: Net(aux=True), loss="aux"),
}


def _trained(model, name, case):
    frozen = case.get("frozen")
    return not (frozen and re.fullmatch(frozen, name)) and model.get_parameter(name).requires_grad


def _loss(case, f, params, x):
    kind = case.get("loss")
    if kind == "derived":  # weights scaled, and a delta on one unit leaf, then the model applied
        q = optree.tree_map(lambda t: t * 0.9, params)
        q["blocks"]["1"]["attn"]["weight"] = q["blocks"]["1"]["attn"]["weight"] + 0.01
        return ce(f(q, x), x)
    if kind == "aux":
        out, aux = f(params, x)
        return ce(out, x) + 0.1 * aux
    if kind == "twice":  # a two-view loss: the model applied to each half
        a, b = x.chunk(2)
        return ce(f(params, a), a) + 0.5 * ce(f(params, b), b)
    if kind == "l2_head":  # the head applied by hand, an L2 penalty over every leaf, a logged norm
        h = f(params, x)
        logits = h @ params["head"]["weight"].T + params["head"]["bias"]
        with torch.no_grad():
            _ = sum(p.norm() for p in optree.tree_leaves(params) if p.dim() == 2)
        l2 = sum((p.float() ** 2).sum() for p in optree.tree_leaves(params))
        return ce(logits, x) + 1e-3 * l2
    return ce(f(params, x), x)


def _build(case):
    torch.manual_seed(0)
    model = case["build"]()
    rgf = case.get("requires_grad_false")
    if rgf:
        for n, p in model.named_parameters():
            if re.fullmatch(rgf, n):
                p.requires_grad_(False)
    return model


def _reference(case, world, sgd: bool = False):
    model = _build(case)
    params = nest(model.named_parameters())
    trained = [p for n, p in model.named_parameters() if _trained(model, n, case)]
    opt = torch.optim.SGD(trained, lr=LR, momentum=0.9) if sgd else torch.optim.AdamW(trained, lr=LR, eps=EPS, weight_decay=WD)
    losses = []
    for i in range(STEPS):
        total = 0.0
        for x in batch(i, world, T=case.get("T", lambda i: 8)(i)).chunk(world):
            loss = _loss(case, lambda p, xx: torch.func.functional_call(model, dict(zip(sf.tree_paths(p), optree.tree_leaves(p))), (xx,)), params, x) / world
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {n: p.detach() for n, p in model.named_parameters()}, losses


def _mesh(strategy, world):
    if strategy != "hybrid_shard":
        return sf.mesh(dp=-1)
    return sf.mesh(replicate=1, shard=-1) if world == 2 else sf.mesh(replicate=world, shard=1)


def _step(case, strategy, world, **kw):
    model = _build(case)
    apply, params = sf.functionalize(model, units=case.get("units", r"blocks\.\d+"))
    step = sf.train_step(
        lambda p, x: _loss(case, apply, p, x), sf.optim.adamw(LR, eps=EPS, weight_decay=WD), _mesh(strategy, world),
        strategy=strategy, frozen=case.get("frozen"), apply=apply, **kw,
    )
    return model, apply, step, step.init(params)


def _rel(a, b):
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


def _by_path(tree) -> dict:
    """A tree's leaves by dotted path: each parameter once, under its first name."""
    return dict(zip(sf.tree_paths(tree), optree.tree_leaves(tree)))


def _param_err(state, ref: dict) -> float:
    """The worst relative error of the trained parameters against the reference's."""
    got = _by_path(sf.gather(state.params))
    return max(_rel(got[n], ref[n]) for n in ref)


def rank_cases(strategy: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, case in CASES.items():
        ref, ref_losses = _reference(case, world)
        _, apply, step, state = _step(case, strategy, world)
        loss_err = 0.0
        for i in range(STEPS):
            state, m = step(state, batch(i, world, T=case.get("T", lambda i: 8)(i)).chunk(world)[rank])
            loss_err = max(loss_err, abs(m["loss"].item() - ref_losses[i]) / abs(ref_losses[i]))
        got = _by_path(sf.gather(state.params))
        param_err = max(_rel(got[n], ref[n]) for n in ref)
        frozen_kept = all(torch.equal(got[n], ref[n]) for n in ref if not _trained(_build(case), n, case))
        out[name] = (loss_err, param_err, frozen_kept)
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "hybrid_shard"])
def test_user_patterns_are_exact(pools, strategy, world):
    for rank_result in pools(world).run(rank_cases, strategy):
        for name, (loss_err, param_err, frozen_kept) in rank_result.items():
            assert loss_err < 1e-5 and param_err < 1e-5, (name, loss_err, param_err)
            assert frozen_kept, name


class _Routed(nn.Module):
    """Top-1 routing of whole sequences to three experts kept in an nn.ModuleList: with two sequences
    a rank, each rank calls the experts its own sequences go to, and the ranks' sets differ."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, 3)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.used: list = []

    def forward(self, h):
        e = self.router(h.mean(1)).argmax(-1)
        self.used.append(sorted(set(e.tolist())))
        out = torch.zeros_like(h)
        for k in range(3):
            m = e == k
            if m.any():
                out[m] = self.experts[k](h[m])
        return h + torch.tanh(out)


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(ln=nn.LayerNorm(D), moe=_Routed())) for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = b["moe"](b["ln"](h))
        return self.head(h)


# units= naming containers (Note [containers are not units]): the experts' list alone (-> the root),
# the list inside a unit that is called (-> that unit), and blocks that are ModuleDicts (-> the root).
CONTAINER_UNITS = {
    "experts": r"blocks\.\d+\.moe\.experts",
    "experts_in_a_unit": [r"blocks\.\d+\.moe", r"blocks\.\d+\.moe\.experts"],
    "blocks_that_are_dicts": r"blocks\.\d+",
}


def rank_containers_as_units(strategy: str) -> dict:
    """Experts routed differently on each rank, with `units=` naming containers: exact, where the
    experts' list as a unit of its own aborted the job (each rank gathering the experts it read)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    case = dict(build=lambda: MoENet())
    # SGD: an expert no rank routes to in a step keeps its value and momentum, as in torch.optim; Adam's
    # bias correction would count the skipped step (one step count for all leaves, Note [leaves
    # without a gradient] in shardfn/_train.py)
    ref, ref_losses = _reference(case, world, sgd=True)
    out = {}
    for name, units in CONTAINER_UNITS.items():
        model = _build(case)
        with pytest.warns(UserWarning, match="no forward of their own") as seen:
            apply, params = sf.functionalize(model, units=units)
        step = sf.train_step(lambda p, x: ce(apply(p, x), x), sf.optim.sgd(LR, momentum=0.9), _mesh(strategy, world), strategy=strategy)
        state = step.init(params)
        losses = []
        for i in range(STEPS):
            state, m = step(state, batch(i, world).chunk(world)[rank])
            losses.append(m["loss"].item())
        used = [b["moe"].used for b in model.blocks]
        out[name] = dict(err=_param_err(state, ref), loss=max(abs(a - b) / b for a, b in zip(losses, ref_losses)),
                         used=used, warning=str(seen[0].message))
    return out


@pytest.mark.parametrize("world,strategy", [(2, "full_shard"), (3, "shard_grad_op"), (2, "hybrid_shard")])
def test_units_that_are_containers_train_exactly(pools, world, strategy):
    results = pools(world).run(rank_containers_as_units, strategy)
    for name in CONTAINER_UNITS:
        for r in results:
            assert r[name]["err"] < 1e-5 and r[name]["loss"] < 1e-5, (name, r[name])
        # the ranks called different experts in some step: a collective per read would not match
        used = [r[name]["used"] for r in results]
        assert any(len({repr(u[b][i]) for u in used}) > 1 for b in range(2) for i in range(STEPS)), (name, used)
    warning = results[0]["experts"]["warning"]
    assert "'blocks.0.moe.experts' -> the root" in warning and r"r'blocks\.0\.moe\.experts\.\d+'" in warning, warning
    assert "'blocks.0.moe.experts' -> 'blocks.0.moe'" in results[0]["experts_in_a_unit"]["warning"]


# -- refusals, failures and what follows them -----------------------------------------------------
def rank_refusals() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # A unit output whose tensors no pytree can see: refused in the first forward.
    case = dict(build=lambda: Net(out="opaque"))
    _, _, step, state = _step(case, "full_shard", world)
    try:
        step(state, batch(0, world).chunk(world)[rank])
        out["opaque"] = "NO ERROR"
    except ValueError as e:
        out["opaque"] = str(e)
    # A unit that modifies its input in place.
    _, _, step, state = _step(dict(build=lambda: InPlaceInput()), "full_shard", world)
    try:
        step(state, batch(0, world).chunk(world)[rank])
        out["inplace"] = "NO ERROR"
    except ValueError as e:
        out["inplace"] = str(e)
    # Two functionalized models with the same parameter names (a student and its teacher).
    torch.manual_seed(0)
    student, teacher = Net(), Net()
    s_apply, s_params = sf.functionalize(student, units=r"blocks\.\d+")
    t_apply, t_params = sf.functionalize(teacher, units=r"blocks\.\d+")
    loss_fn = lambda p, x: F.mse_loss(s_apply(p, x), t_apply(t_params, x).detach())  # noqa: E731
    try:  # a copy of the student's params: the names say nothing about which model
        sf.train_step(loss_fn, sf.optim.adamw(LR), sf.mesh(dp=-1)).init(optree.tree_map(torch.clone, s_params))
        out["ambiguous"] = "NO ERROR"
    except ValueError as e:
        out["ambiguous"] = str(e)
    # The very tensors functionalize returned tell the student from the teacher.
    out["found"] = model_info(None, sf.tree_paths(s_params), optree.tree_leaves(s_params)) is s_apply.info
    # The step's params handed to another model's apply.
    step = sf.train_step(lambda p, x: t_apply(p, x).sum(), sf.optim.adamw(LR), sf.mesh(dp=-1), apply=s_apply)
    state = step.init(s_params)
    try:
        step(state, batch(0, world).chunk(world)[rank])
        out["other_model"] = "NO ERROR"
    except ValueError as e:
        out["other_model"] = str(e)
    # With apply= the teacher is just a function of the batch: exact against the reference.
    torch.manual_seed(0)
    ref_s, ref_t = Net(), Net()
    opt = torch.optim.AdamW(ref_s.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    step = sf.train_step(loss_fn, sf.optim.adamw(LR, eps=EPS, weight_decay=WD), sf.mesh(dp=-1), apply=s_apply)
    state = step.init(s_params)
    for i in range(2):
        x = batch(i, world)
        state, _ = step(state, x.chunk(world)[rank])
        for xr in x.chunk(world):
            (F.mse_loss(ref_s(xr), ref_t(xr).detach()) / world).backward()
        opt.step()
        opt.zero_grad()
    got = _by_path(sf.gather(state.params))
    out["teacher_err"] = max(_rel(got[n], p.detach()) for n, p in ref_s.named_parameters())
    return out


def test_refusals_before_anything_is_computed(pools):
    for r in pools(2).run(rank_refusals):
        assert "Opaque" in r["opaque"] and "register" in r["opaque"], r["opaque"]
        assert "modifies one of its inputs in place" in r["inplace"], r["inplace"]
        assert "apply=" in r["ambiguous"], r["ambiguous"]
        assert r["found"], r
        assert "apply=" in r["other_model"], r["other_model"]
        assert r["teacher_err"] < 1e-5, r


class _Clamped(nn.Linear):
    """A weight clipped in place in the forward (WGAN's critic, written into the module)."""

    def forward(self, x):
        with torch.no_grad():
            self.weight.clamp_(-0.1, 0.1)
        return super().forward(x)


def rank_parameters_written(strategy: str) -> dict:
    """Note [parameters written in the forward]: a write into a parameter in the forward, in a
    unit or at the root, stops the step before anything is reduced; the state is as it was, and
    the same step without the write then trains."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    g = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, 10, (2 * world, 3), generator=g), torch.randn(2 * world, 3, 1, generator=g)
    ids, y = ids.chunk(world)[rank], y.chunk(world)[rank]
    for name, max_norm, clamped in (("embedding_max_norm", 1.0, False), ("clamped_in_a_unit", None, True), ("clean", None, False)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 4, max_norm=max_norm),
                              nn.Sequential((_Clamped if clamped else nn.Linear)(4, 8), nn.Tanh()), nn.Linear(8, 1))
        apply, params = sf.functionalize(model, units=r"1")  # the embedding at the root, block 1 a unit
        step = sf.train_step(lambda p, b: F.mse_loss(apply(p, b[0]), b[1]), sf.optim.sgd(0.5), sf.mesh(dp=-1),
                             strategy=strategy)
        state = step.init(params)
        before = [v.clone() for v in optree.tree_leaves(sf.gather(state.params))]
        try:
            state, _ = step(state, (ids, y))
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
            out[name + "_unchanged"] = all(map(torch.equal, before, optree.tree_leaves(sf.gather(state.params))))
    return out


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_parameters_written_in_the_forward_are_refused(pools, strategy):
    for r in pools(2).run(rank_parameters_written, strategy):
        assert r["embedding_max_norm"] is not None and r["embedding_max_norm"].startswith(
            "the root (what runs outside every unit) wrote one of its parameters ('0.weight'"), r
        assert "max_norm=None" in r["embedding_max_norm"], r
        assert r["clamped_in_a_unit"] is not None and r["clamped_in_a_unit"].startswith(
            "unit '1' wrote one of its parameters ('1.0.bias', '1.0.weight')"), r
        assert r["clean"] is None, r
        # Sharded, the write was on a gathered copy; whole on every rank (no_shard), on the state
        # itself, which the error says
        sharded = strategy == "full_shard"
        for case in ("embedding_max_norm", "clamped_in_a_unit"):
            assert r[case + "_unchanged"] == sharded and ("sf.copy" in r[case]) != sharded, (case, r)


def rank_failures(group_bytes: int | None) -> dict:
    """A step that raises (in loss_fn after the forward, or in the backward) on every rank leaves
    every rank able to run the next step, which is exact, with units alone or grouped; a planted
    stale read (units alone: unit 1 planted) is an error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    case = dict(build=lambda: Net())
    ref, ref_losses = _reference(case, world)
    model, apply, step, state = _step(case, "full_shard", world, group_bytes=group_bytes)
    good = step.loss_fn
    out = {}

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom in backward")

    def raise_after_forward(p, x):
        good(p, x)
        raise RuntimeError("boom in loss_fn")

    def raise_in_backward(p, x):
        return Boom.apply(good(p, x))

    for i in range(STEPS):
        x = batch(i, world).chunk(world)[rank]
        if i == 1:
            for bad in (raise_after_forward, raise_in_backward):
                step.loss_fn = bad
                try:
                    step(state, x)
                    out[bad.__name__] = "NO ERROR"
                except RuntimeError as e:
                    out[bad.__name__] = str(e)
            step.loss_fn = good
            if group_bytes == 0:
                # A missed pre-backward, planted: unit 1 is not gathered again before its backward.
                engine = step.engine
                original = engine._pre_backward
                engine._pre_backward = lambda u, *rest: None if u == 1 else original(u, *rest)
                try:
                    step(state, x)
                    out["stale"] = "NO ERROR"
                except StaleParameterError as e:
                    out["stale"] = str(e)
                engine._pre_backward = original
        state, m = step(state, x)
    out["err"] = _param_err(state, ref)
    return out


@pytest.mark.parametrize("group_bytes", [0, None])
def test_failed_steps_leave_every_rank_ready(pools, group_bytes):
    for r in pools(2).run(rank_failures, group_bytes, timeout=60):
        assert "boom in loss_fn" in r["raise_after_forward"], r
        assert "boom in backward" in r["raise_in_backward"], r
        if group_bytes == 0:
            assert "memory was freed or held another unit" in r["stale"], r
        assert r["err"] < 1e-5, r


def rank_plan() -> dict:
    """The plan after the first step: slots in forward order; a unit busy while another unit of
    its slot runs (the first block of a model applied twice, with no input to detect the end of
    each use on) keeps arenas of its own."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in ("interleaved", "no_root_applied_twice"):
        case = CASES[name]
        _, apply, step, state = _step(case, "full_shard", world, group_bytes=0)  # the plan of units alone
        state, _ = step(state, batch(0, world).chunk(world)[rank])
        e = step.engine
        out[name] = dict(order=[e.units[u].name for u in e.order], slot_of={e.units[u].name: k for u, k in e.slot_of.items()})
        e.stats.record_events = True
        e.stats.reset()
        step(state, batch(1, world).chunk(world)[rank])
        out[name]["events"] = [(w, e.units[u].name if u >= 0 else "", ph) for w, u, ph in e.stats.events]
        out[name]["max_live"] = e.stats.max_live_units
    return out


def test_plan_follows_the_forward(pools):
    r = pools(2).run(rank_plan)[0]
    il = r["interleaved"]
    assert il["order"] == ["blocks.0", "adapters.0", "blocks.1", "adapters.1", "blocks.2", "adapters.2"], il
    assert [il["slot_of"][n] for n in il["order"]] == [0, 1, 0, 1, 0, 1], il
    fwd = [(w, n) for w, n, ph in il["events"] if ph == "forward" and n]
    # Every unit's gather is prefetched before the previous unit is freed.
    for a, b in zip(il["order"], il["order"][1:]):
        assert fwd.index(("gather", b)) < fwd.index(("free", a)), (a, b, fwd)
    assert il["max_live"] <= 2
    sb = r["no_root_applied_twice"]
    assert "blocks.0" not in sb["slot_of"] and sorted(sb["slot_of"].values()) == [0, 0, 1], sb


def rank_mixed_precision() -> dict:
    """Keyword arguments of units are cast like positional ones; a bf16 model without root
    parameters trains, against a bf16 single-process reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    case = dict(build=lambda: Net(bias_kwarg=True))
    model, apply, step, state = _step(case, "full_shard", world, mixed_precision=sf.MixedPrecision(param_dtype=torch.bfloat16))
    step(state, batch(0, world).chunk(world)[rank])
    dtypes = sorted({str(d) for b in model.blocks for d in b.seen_dtypes})

    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Linear(D, D) for _ in range(3)]).to(torch.bfloat16)
    ref = copy.deepcopy(seq)
    apply, params = sf.functionalize(seq, units=r"\d+")
    loss = lambda p, b: F.mse_loss(apply(p, b[0]).float(), b[1])  # noqa: E731
    step = sf.train_step(loss, sf.optim.sgd(0.1, momentum=0.9), sf.mesh(dp=-1))
    state = step.init(params)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, fused=True)  # sf's bf16 rounding
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = torch.randn(4 * world, D, generator=g).to(torch.bfloat16), torch.randn(4 * world, D, generator=g)
        state, _ = step(state, (x.chunk(world)[rank], y.chunk(world)[rank]))
        for xr, yr in zip(x.chunk(world), y.chunk(world)):
            (F.mse_loss(ref(xr).float(), yr) / world).backward()
        opt.step()
        opt.zero_grad()
    got = _by_path(sf.gather(state.params))
    names = [n for n, _ in ref.named_parameters()]  # bf16 rounding: the whole model as one vector
    want = dict(ref.named_parameters())
    err = _rel(torch.cat([got[n].float().reshape(-1) for n in names]), torch.cat([want[n].detach().float().reshape(-1) for n in names]))
    return dict(dtypes=dtypes, bf16_err=err, dtype=str(got[names[0]].dtype))


def test_mixed_precision_kwargs_and_bf16_without_root(pools):
    for r in pools(2).run(rank_mixed_precision):
        assert r["dtypes"] == ["torch.bfloat16"], r
        # bf16 rounding: the gradient reduction adds in bf16 what the reference accumulates in bf16,
        # in another order (at one rank the two are bit-identical).
        assert r["bf16_err"] < 2e-2 and r["dtype"] == "torch.bfloat16", r


def rank_buffers() -> list:
    """BatchNorm running statistics end identical on every rank (rank 0's, as DDP)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = BNNet()
    apply, params = sf.functionalize(model, units=r"blocks\.\d+")
    step = sf.train_step(lambda p, x: ce(apply(p, x), x), sf.optim.adamw(LR), sf.mesh(dp=-1))
    state = step.init(params)
    for i in range(3):
        state, _ = step(state, batch(i, world, per_rank=4).chunk(world)[rank])
    bufs = torch.cat([b.float().reshape(-1) for b in model.buffers()])
    everyone = [torch.empty_like(bufs) for _ in range(world)]
    dist.all_gather(everyone, bufs)
    return [torch.equal(everyone[0], b) for b in everyone] + [bool((bufs != 0).any())]


def test_batchnorm_buffers_stay_identical(pools):
    for r in pools(3).run(rank_buffers):
        assert all(r), r


def rank_early_exit() -> dict:
    """Rank 1 skips the last block in step 1: every rank stops with an error naming it, before
    anything is reduced; the next step (all ranks run every block) is exact."""
    rank, world = dist.get_rank(), dist.get_world_size()
    case = dict(build=lambda: Net())
    ref, _ = _reference(case, world)
    model, apply, step, state = _step(case, "full_shard", world)
    out = {}
    for i in range(STEPS):
        x = batch(i, world).chunk(world)[rank]
        if i == 1:
            model.depth = 2 if rank == 1 else 3
            try:
                step(state, x)
                out["error"] = "NO ERROR"
            except NotImplementedError as e:
                out["error"] = str(e)
            model.depth = 3
        state, _ = step(state, x)
    out["err"] = _param_err(state, ref)
    return out


def test_units_skipped_on_some_ranks_stop_every_rank(pools):
    for r in pools(2).run(rank_early_exit, timeout=60):
        assert "'blocks.2' ran on ranks [0] only" in r["error"], r
        assert r["err"] < 1e-5, r


def rank_skipped_leaves() -> dict:
    """A head that gets a gradient on some steps only keeps its value and its momentum on the
    others, as torch.optim skips it, whatever shape the optimizer's state has (Note [leaves
    without a gradient])."""
    rank, world = dist.get_rank(), dist.get_world_size()
    case = dict(build=lambda: Sometimes(), units=r"pos|blocks\.\d+")
    opts = {  # the extra head is used on even steps (odd ones for from_torch_late)
        "sgd": lambda: sf.optim.sgd(0.1, momentum=0.9),
        # the head unused on the first step: with dampening 0, a buffer kept at zero takes the first
        # gradient whole, as torch's new buffer does (dampening > 0 differs: docs/API.md)
        "sgd_late": lambda: sf.optim.sgd(0.1, momentum=0.9, nesterov=True),
        "masked": lambda: sf.optim.chain(
            sf.optim.masked(sf.optim.trace(0.9), lambda p: optree.tree_map(lambda x: x.dim() > 1, p)),
            sf.optim.scale_by_learning_rate(0.1),
        ),
        "from_torch": lambda: sf.optim.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9),
        # the head unused on the first step: torch makes its state only when it first steps it
        "from_torch_late": lambda: sf.optim.from_torch(torch.optim.AdamW, lr=0.01, weight_decay=0.1),
    }
    out = {}
    for name, make in opts.items():
        T = (lambda i: 6 if i % 2 == 0 else 8) if name.endswith("_late") else (lambda i: 8 if i % 2 == 0 else 6)  # noqa: E731
        model = _build(case)
        apply, params = sf.functionalize(model, units=case["units"])
        step = sf.train_step(lambda p, x: ce(apply(p, x), x), make(), sf.mesh(dp=-1), apply=apply)
        state = step.init(params)
        ref = _build(case)
        if name == "masked":  # momentum on matrices only, plain SGD on vectors
            groups = [{"params": [p for p in ref.parameters() if p.dim() > 1], "momentum": 0.9},
                      {"params": [p for p in ref.parameters() if p.dim() <= 1], "momentum": 0.0}]
            opt = torch.optim.SGD(groups, lr=0.1)
        elif name == "from_torch_late":
            opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
        elif name == "sgd_late":
            opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        else:
            opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for i in range(4):
            x = batch(i, world, T=T(i))
            with _counting_reprs() as reprs:  # the check for per-leaf state formats nothing
                state, _ = step(state, x.chunk(world)[rank])
            out[f"{name}_reprs_{i}"] = reprs[0]
            for xr in x.chunk(world):
                (ce(ref(xr), xr) / world).backward()
            opt.step()
            opt.zero_grad()
        out[name] = _param_err(state, {n: p.detach() for n, p in ref.named_parameters()})
    return out


@contextlib.contextmanager
def _counting_reprs():
    """Counts the tensors formatted as text inside the block (each costs a copy and a format)."""
    count, before = [0], torch.Tensor.__repr__

    def counted(self, *args, **kwargs):
        count[0] += 1
        return before(self, *args, **kwargs)

    torch.Tensor.__repr__ = counted
    try:
        yield count
    finally:
        torch.Tensor.__repr__ = before


def test_leaves_without_a_gradient_are_skipped_like_torch(pools):
    for r in pools(2).run(rank_skipped_leaves):
        reprs = {k: v for k, v in r.items() if "_reprs_" in k}
        assert max(v for k, v in r.items() if k not in reprs) < 1e-5, r
        assert not any(reprs.values()), reprs


def test_a_sparse_embedding_is_refused_at_init():
    """`nn.Embedding(sparse=True)` makes a sparse gradient, which the flat gradient buffers do not
    take: refused at `step.init`, naming the module, not in the reduction; frozen, it trains."""
    for frozen in (None, r"0\.weight"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
        apply, params = sf.functionalize(model)
        step = sf.train_step(lambda p, x: apply(p, x).square().mean(), sf.optim.sgd(0.1), sf.mesh(dp=-1), frozen=frozen)
        if frozen is None:
            with pytest.raises(NotImplementedError, match=r"'0' is an Embedding with sparse=True.*sparse=False"):
                step.init(params)
        else:
            state, m = step(step.init(params), torch.tensor([[1, 2], [3, 4]]))
            assert torch.isfinite(m["loss"])


class _TwoDtypes(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float64):
        super().__init__()
        self.z = torch.nn.Parameter(torch.randn(4, dtype=dtype))
        self.blk = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.blk(x) + (self.z.real if self.z.is_complex() else self.z).float()


def rank_units_of_two_reduce_dtypes(dtype: torch.dtype) -> str:
    apply, params = sf.functionalize(_TwoDtypes(dtype), units=r"blk")
    step = sf.train_step(lambda p, b: apply(p, b).pow(2).mean(), sf.optim.sgd(0.1), sf.mesh(dp=-1))
    try:
        step(step.init(params), torch.randn(2, 4))
    except NotImplementedError as e:
        return str(e)
    return "not refused"


def test_units_reducing_in_two_dtypes_are_refused_naming_them(pools):
    msg = pools(1).run(rank_units_of_two_reduce_dtypes, torch.float64)[0]
    assert "'torch.float64': ['<root>']" in msg and "'torch.float32': ['blk']" in msg, msg
    assert "model.to(dtype)" in msg, msg
    # Complex parameters: refused as such (the mixed-dtype advice, reduce_dtype=float32, failed in
    # the reduction's cat; an all-complex model failed in the gradient norm)
    msg = pools(1).run(rank_units_of_two_reduce_dtypes, torch.complex64)[0]
    assert "units ['<root>'] hold complex parameters" in msg and "view_as_complex" in msg, msg
