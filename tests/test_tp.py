"""FSDP x tensor parallel on a (dp, tp) mesh: exact against the single-process reference, with the
collectives the specs imply (Note [tensor parallel forward] in shardfn/_tp.py)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

import shardfn as sf
from shardfn import _collectives as C

LR, EPS, WD = 1e-3, 1e-3, 0.01  # an eps that does not turn rounding noise in tiny gradients into steps
VOCAB, SEQ, PER_RANK = 64, 8, 2
TOL = 1e-5


def _model(name: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if name == "llama":
        cfg = tf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0, tie_word_embeddings=False,
            attn_implementation="eager",
        )
        return tf.LlamaForCausalLM(cfg).float().train()
    if name == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, attn_implementation="eager",
        )
        return tf.GPT2LMHeadModel(cfg).float().train()
    if name == "gpt":
        from shardfn.models import GPT, GPTConfig

        return GPT(GPTConfig(vocab=VOCAB, block_size=SEQ, n_layer=2, n_head=4, d=32))
    raise ValueError(name)


UNITS = {"llama": r"model\.layers\.\d+", "gpt2": r"transformer\.h\.\d+", "gpt": r"blocks\.\d+"}
RULES = {"llama": sf.rules.LLAMA, "gpt2": sf.rules.GPT2, "gpt": sf.rules.GPT}


def _batch(step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g)


def _loss(name: str, out, ids: torch.Tensor) -> torch.Tensor:
    if name == "gpt":
        return F.cross_entropy(out[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return out.loss


def _reference(name: str, steps: int, data_world: int) -> dict[str, torch.Tensor]:
    model = _model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    for s in range(steps):
        ids = _batch(s, PER_RANK * data_world)
        opt.zero_grad()
        out = model(ids) if name == "gpt" else model(input_ids=ids, labels=ids, use_cache=False)
        _loss(name, out, ids).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    a, b = a.detach().double(), b.detach().double()
    return (a - b).norm().item() / max(b.norm().item(), 1e-3)


def rank_train(name: str, axes: dict, strategy: str = "full_shard", remat: bool = False, accumulation_steps: int = 1,
               steps: int = 3) -> dict:
    """Trains `name` `steps` steps on a mesh of `axes` with the ready rules; returns the worst error
    against the reference and what the steps did."""
    mesh = sf.mesh(**axes)
    dp_axis, dp = next(iter(axes)), mesh.size(0)
    dp_rank = mesh.get_local_rank(dp_axis)
    apply, params = sf.functionalize(_model(name), units=UNITS[name])
    specs = sf.specs(params, mesh, rules=RULES[name] if "tp" in axes else [], default=sf.P(dp_axis))

    def loss_fn(p, ids):
        out = apply(p, ids) if name == "gpt" else apply(p, input_ids=ids, labels=ids, use_cache=False)
        return _loss(name, out, ids)

    opt = sf.optim.adamw(LR, eps=EPS, weight_decay=WD)
    step = sf.train_step(loss_fn, opt, mesh, specs=specs, strategy=strategy, remat=remat, accumulation_steps=accumulation_steps)
    state = step.init(params)
    counts = []
    for s in range(steps):
        ids = _batch(s, PER_RANK * dp).chunk(dp)[dp_rank]
        C.STATS.reset()
        tp = step.core.tp
        if tp is not None:
            tp.stats.clear()
        state, _ = step(state, ids)
        counts.append((dict(C.STATS.calls), dict(C.STATS.bytes_sent), dict(tp.stats) if tp is not None else {}))
    full = sf.to_state_dict(sf.gather(state.params), apply)
    ref = _reference(name, steps, dp)
    err = max((_rel(full[n], ref[n]), n) for n in ref)
    return dict(err=err, counts=counts)


def rank_value_and_grad(name: str, axes: dict) -> dict:
    """sf.value_and_grad on a 2-D tree (the layout a train step gives it): the loss and gradients of
    the global batch's mean."""
    mesh = sf.mesh(**axes)
    dp_axis, dp = next(iter(axes)), mesh.size(0)
    dp_rank = mesh.get_local_rank(dp_axis)
    model = _model(name)
    ref = copy.deepcopy(model)
    apply, params = sf.functionalize(model, units=UNITS[name])
    specs = sf.specs(params, mesh, rules=RULES[name] if "tp" in axes else [], default=sf.P(dp_axis))

    def loss_fn(p, ids):
        out = apply(p, ids) if name == "gpt" else apply(p, input_ids=ids, labels=ids, use_cache=False)
        return _loss(name, out, ids)

    tree = sf.train_step(loss_fn, sf.optim.sgd(0.0), mesh, specs=specs).init(params).params
    ids = _batch(0, PER_RANK * dp)
    loss, grads = sf.value_and_grad(loss_fn)(tree, ids.chunk(dp)[dp_rank])
    want = _loss(name, ref(ids) if name == "gpt" else ref(input_ids=ids, labels=ids, use_cache=False), ids)
    want.backward()
    full = sf.to_state_dict(sf.gather(grads), apply)
    err = max((_rel(full[n], p.grad), n) for n, p in ref.named_parameters())
    return dict(loss=abs(loss.item() - want.item()), err=err)
