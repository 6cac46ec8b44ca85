"""The model's own activation checkpointing under `sf.train_step`, against a single-process reference
(Note [the model's own checkpointing] in shardfn/_recompute.py).

Two placements of the checkpoint, each non-reentrant and reentrant:

- inside a unit's forward, its hooks outside: Hugging Face's `gradient_checkpointing_enable()` on
  Llama, GPT-2 and T5 (each decoder layer's `forward` is checkpointed). The recompute runs in the
  unit's backward and calls no hook; the unit's pre-backward has put its parameters back.
- around a unit's call, its hooks inside: PyTorch's own distributed-test Transformer
  (`torch.testing._internal.distributed._tensor.common_dtensor`, `checkpoint_activations=True`:
  `torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)`), and the same model with
  `use_reentrant=True`, whose forward runs under no_grad, so that no hook sees the unit's outputs
  and the unit is gathered by its hook in the recompute.

Each runs under every strategy, with the units grouped (the default, Note [unit groups]) and alone
in slot arenas (`group_bytes=0`, Note [slot arenas]), with shardfn's own remat on top, with the
checkpointed layers holding units (the layer's own parameters in the root), and with mixed
precision (against the same step without the model's checkpointing: the recompute computes what
the forward did, bit for bit; and loosely against a bf16 reference). A step with the model's
checkpointing issues the same all-gathers as without: the recompute reads the unit its backward
gathered, never a parameter gathered on its own. One rank call per world size runs every case.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import sys
import traceback
import types
import warnings
from pathlib import Path

import optree
import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

import shardfn as sf
from shardfn import _collectives as C

pytest.importorskip("transformers", reason="the Hugging Face cases build tiny transformers models")

STEPS = 2
PER_RANK = 2
SEQ = 8
VOCAB = 64
LR, EPS, WD = 1e-3, 1e-5, 0.01
TOL = 1e-5  # fp32: relative error per parameter and per step loss
# Mixed precision against the bf16 reference: the error in the update of all parameters as one
# vector, relative to that update (2 steps move the parameters by 0.4-1.7% of their norm, so an error
# relative to the parameters could not tell a wrong update from a right one). Measured 0.009-0.015;
# bf16 itself is 0.03-0.06 from the fp32 update.
BF16_TOL = 0.1


# -- models ---------------------------------------------------------------------------------------
def _torch_transformer():
    """`ModelArgs` and `Transformer` of PyTorch's distributed tests, from that file's own source.

    Importing `common_dtensor` imports torch's unittest harness (it needs `expecttest` and
    `hypothesis`, and calls `torch.backends.disable_global_flags()` for the whole process), so the
    model's classes are taken from the file as they are and run on their own imports.
    """
    spec = importlib.util.find_spec("torch.testing._internal.distributed._tensor.common_dtensor")
    tree = ast.parse(Path(spec.origin).read_text(), spec.origin)
    want = {"ModelArgs", "Attention", "FeedForward", "Experts", "ExpertLayer", "TransformerBlock", "Transformer"}

    def light(node) -> bool:
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        return not any(m.startswith(("torch.testing", "torch.distributed._local_tensor")) for m in mods)

    body = [n for n in tree.body if (isinstance(n, (ast.Import, ast.ImportFrom)) and light(n)) or (isinstance(n, ast.ClassDef) and n.name in want)]
    name = "_torch_common_dtensor_models"
    mod = sys.modules.get(name)
    if mod is None:  # a module of its own (dataclasses look their class's module up)
        mod = sys.modules[name] = types.ModuleType(name)
        exec(compile(ast.Module(body, []), spec.origin, "exec"), mod.__dict__)  # noqa: S102 - torch's own source
    return mod.ModelArgs, mod.Transformer


def _transformer(reentrant: bool, checkpointing: bool) -> torch.nn.Module:
    ModelArgs, Transformer = _torch_transformer()
    args = ModelArgs(n_layers=3, vocab_size=VOCAB, max_seq_len=SEQ, dim=16, n_heads=4, dropout_p=0.0,
                     checkpoint_activations=checkpointing)
    if not reentrant:
        return Transformer(args)

    class ReentrantTransformer(Transformer):
        """The same model, its layers under `checkpoint(layer, h, use_reentrant=True)`."""

        def forward(self, tokens):
            h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
            for layer in self.layers:
                h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=True) if self.checkpoint_activations else layer(h)
            return self.output(self.norm(h)).float()

    return ReentrantTransformer(args)


def _hf(name: str) -> torch.nn.Module:
    import transformers as tf

    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False, attn_implementation="eager"))
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=3, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, attn_implementation="eager"))
    if name == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, attn_implementation="eager"))
    raise ValueError(name)


# model id -> (builder (of whether the model checkpoints), units, Hugging Face model?)
MODELS = {
    "llama": (lambda ck: _hf("llama"), r"model\.layers\.\d+", True),
    "gpt2": (lambda ck: _hf("gpt2"), r"transformer\.h\.\d+", True),
    "t5": (lambda ck: _hf("t5"), r"(encoder|decoder)\.block\.\d+", True),
    "torch": (lambda ck: _transformer(False, ck), r"layers\.\d+", False),
    "torch_reentrant": (lambda ck: _transformer(True, ck), r"layers\.\d+", False),
}


def build(model: str, checkpointing: bool | str, seed: int = 0) -> torch.nn.Module:
    """A model, seeded; `checkpointing`: "reentrant" (Hugging Face's use_reentrant=True), True (the
    model's own way: Hugging Face's default, non-reentrant), or False."""
    make, _, hf = MODELS[model]
    torch.manual_seed(seed)
    m = make(bool(checkpointing)).float().train()
    if hf and checkpointing:
        with warnings.catch_warnings():  # transformers 5.x: the old name of activation_checkpointing_enable
            warnings.filterwarnings("ignore", message=r"`gradient_checkpointing_enable` is deprecated", category=FutureWarning)
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    return m


def global_batch(model: str, step: int, world: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    n = PER_RANK * world
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    if model == "t5":
        return dict(input_ids=ids, labels=torch.randint(0, VOCAB, (n, SEQ - 2), generator=g))
    if MODELS[model][2]:
        return dict(input_ids=ids, labels=ids.clone())
    return dict(tokens=ids, labels=torch.randint(0, VOCAB, (n, SEQ), generator=g))


def loss_of(model: str, out, batch) -> torch.Tensor:
    if MODELS[model][2]:
        return out.loss
    return F.cross_entropy(out.flatten(0, 1), batch["labels"].flatten())


def run_model(model: str, m: torch.nn.Module, batch: dict):
    return m(**batch) if MODELS[model][2] else m(batch["tokens"])


def reference(model: str, checkpointing, world: int, bf16: bool = False) -> dict:
    """The single-process run on the global batches (in a bf16 copy with fp32 master weights: `bf16`)."""
    m = build(model, checkpointing)
    init = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = torch.optim.AdamW(m.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    losses = []
    for i in range(STEPS):
        batch = global_batch(model, i, world)
        opt.zero_grad()
        if bf16:
            low = copy.deepcopy(m).to(torch.bfloat16)
            loss = loss_of(model, run_model(model, low, batch), batch).float()
            loss.backward()
            for p, q in zip(m.parameters(), low.parameters()):
                p.grad = q.grad.float()
        else:
            loss = loss_of(model, run_model(model, m, batch), batch)
            loss.backward()
        opt.step()
        losses.append(loss.item())
    return dict(losses=losses, params={n: p.detach().clone() for n, p in m.named_parameters()}, init=init)


def sharded(model: str, checkpointing, strategy: str, rank: int, world: int, units: str | None = None, **options) -> dict:
    m = build(model, checkpointing)
    apply, params = sf.functionalize(m, units=units or MODELS[model][1])
    del m

    def loss_fn(params, batch):
        return loss_of(model, apply(params, **batch) if MODELS[model][2] else apply(params, batch["tokens"]), batch)

    mesh = sf.mesh(replicate=1, shard=world) if strategy == "hybrid_shard" else sf.mesh(dp=-1)
    step = sf.train_step(loss_fn, sf.optim.adamw(LR, eps=EPS, weight_decay=WD), mesh, strategy=strategy, apply=apply, **options)
    state = step.init(params)
    del params
    losses = []
    C.STATS.reset()
    for i in range(STEPS):
        batch = {k: v.chunk(world)[rank].clone() for k, v in global_batch(model, i, world).items()}
        state, metrics = step(state, batch)
        losses.append(metrics["loss"].item())
    gathers = C.STATS.calls.get("all_gather_single", 0) + C.STATS.calls.get("all_gather", 0)
    full = sf.to_state_dict(sf.gather(state.params), apply)
    return dict(losses=losses, params={k: v.detach().clone() for k, v in full.items()}, gathers=gathers)


def _err(got: dict, want: dict, per_leaf: bool = True) -> float:
    """The largest relative error over the parameters and the step losses. `per_leaf=False`: of the
    update of all parameters as one vector, relative to the reference's update (bf16 against its
    reference: Adam turns rounding noise in a near-zero gradient into full-size steps on that leaf)."""
    errs = [abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"])]
    if not per_leaf:
        a, b, b0 = (torch.cat([x[n].double().reshape(-1) for n in want["params"]]) for x in (got["params"], want["params"], want["init"]))
        return max(errs + [((a - b).norm() / (b - b0).norm()).item()])
    for n, w in want["params"].items():
        errs.append((got["params"][n] - w).double().norm().item() / max(w.double().norm().item(), 1e-3))
    return max(errs)


# (model, checkpointing, strategy, options, world sizes); group_bytes=0: every unit alone, in slot arenas.
# At 3 ranks (uneven shards), a case of each kind.
CASES = [
    ("llama", True, "full_shard", {}, (2, 3)),
    ("llama", True, "full_shard", dict(group_bytes=0), (2, 3)),
    ("llama", True, "shard_grad_op", dict(group_bytes=0), (2,)),
    ("llama", True, "full_shard", dict(group_bytes=0, remat=True), (2,)),
    ("llama", "reentrant", "full_shard", dict(group_bytes=0), (2, 3)),
    ("llama", "reentrant", "full_shard", dict(remat=True), (2,)),
    # Units inside the checkpointed layers: the layer's own parameters (attention, norms) are the root's.
    ("llama", True, "full_shard", dict(units=r"model\.layers\.\d+\.mlp", group_bytes=0), (2, 3)),
    ("gpt2", True, "full_shard", dict(group_bytes=0), (2,)),
    ("gpt2", "reentrant", "hybrid_shard", {}, (2,)),
    ("gpt2", True, "no_shard", {}, (2,)),
    ("t5", True, "full_shard", dict(group_bytes=0), (2, 3)),
    ("torch", True, "full_shard", dict(group_bytes=0), (2, 3)),
    ("torch", True, "hybrid_shard", {}, (2,)),
    ("torch", True, "full_shard", dict(group_bytes=0, remat=True), (2, 3)),
    ("torch_reentrant", True, "full_shard", dict(group_bytes=0), (2, 3)),
    ("torch_reentrant", True, "full_shard", {}, (2,)),
    ("torch_reentrant", True, "no_shard", {}, (2,)),
    ("torch_reentrant", True, "hybrid_shard", dict(group_bytes=0), (2, 3)),
    ("torch_reentrant", True, "shard_grad_op", dict(remat=True), (2,)),
]
# Mixed precision: as CASES, each also run without the model's checkpointing.
MP_CASES = [
    ("llama", True, "full_shard", dict(group_bytes=0), (2, 3)),
    ("llama", "reentrant", "hybrid_shard", {}, (2,)),
    ("torch_reentrant", True, "full_shard", dict(group_bytes=0, remat=True), (2, 3)),
]


def _case_id(case) -> str:
    model, ck, strategy, opts, _ = case
    parts = [model, "reentrant" if ck == "reentrant" else "", strategy, *(f"{k}={v}" for k, v in opts.items())]
    return "-".join(p for p in parts if p)


def rank_checkpointing() -> dict:
    """Every case on this rank: its error against the reference, or the traceback it raised."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    refs: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as pytest makes them in this process
        for case in CASES:
            model, ck, strategy, opts, worlds = case
            if world not in worlds:
                continue
            try:
                key = (model, ck)
                if key not in refs:
                    refs[key] = reference(model, ck, world)
                got = sharded(model, ck, strategy, rank, world, **opts)
                out[_case_id(case)] = _err(got, refs[key])
            except Exception:  # noqa: BLE001 - reported by the test, per case
                out[_case_id(case)] = traceback.format_exc()
            dist.barrier()
        for case in MP_CASES:
            model, ck, strategy, opts, worlds = case
            if world not in worlds:
                continue
            mp = sf.MixedPrecision(torch.bfloat16, torch.float32)
            try:
                got = sharded(model, ck, strategy, rank, world, mixed_precision=mp, **opts)
                plain = sharded(model, False, strategy, rank, world, mixed_precision=mp, **opts)
                ref = reference(model, ck, world, bf16=True)
                out["mp-" + _case_id(case)] = dict(ref=_err(got, ref, per_leaf=False), plain=_err(got, plain), gathers=(got["gathers"], plain["gathers"]))
            except Exception:  # noqa: BLE001
                out["mp-" + _case_id(case)] = traceback.format_exc()
            dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(pools):
    cache: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            cache[world] = pools(world).run(rank_checkpointing, timeout=300)
        return cache[world]

    return get


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"w{w}")
def test_the_models_own_checkpointing_trains_like_one_process(results, world):
    failed = {}
    for rank, res in enumerate(results(world)):
        for case, r in res.items():
            if isinstance(r, str):
                failed[f"{case} rank {rank}"] = r
            elif isinstance(r, dict):
                if not (r["ref"] < BF16_TOL and r["plain"] < 1e-6):
                    failed[f"{case} rank {rank}"] = r
                if r["gathers"][0] != r["gathers"][1]:
                    failed[f"{case} rank {rank} all-gathers (with, without the model's checkpointing)"] = r["gathers"]
            elif not r < TOL:
                failed[f"{case} rank {rank}"] = f"relative error {r:.3g}"
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())


# -- the memory estimate ----------------------------------------------------------------------------
def rank_estimate() -> dict:
    """`sf.estimate_memory` of each model with and without its own checkpointing (units alone): the
    full gradients of units (the same either way), and whether the estimate left a gradient on the
    module's own (meta) parameters, where a reentrant recompute computing on them would put it."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for model, ck in (("llama", "reentrant"), ("llama", True), ("torch_reentrant", True)):
            for checkpointing in (ck, False):
                m = build(model, checkpointing)
                apply, params = sf.functionalize(m, units=MODELS[model][1])

                def loss_fn(params, batch, apply=apply, model=model):
                    return loss_of(model, apply(params, **batch) if MODELS[model][2] else apply(params, batch["tokens"]), batch)

                step = sf.train_step(loss_fn, sf.optim.adamw(LR), sf.mesh(dp=-1), apply=apply, group_bytes=0)
                est = sf.estimate_memory(step, params, batch=global_batch(model, 0, 1), world=2)
                leaked = [n for n, p in m.named_parameters() if p.grad is not None]
                out[model, str(ck), bool(checkpointing)] = (est.largest["unit_grads"], leaked)
                if model == "torch_reentrant" and checkpointing:
                    m = build("torch", True)  # the same model, its checkpoint around each layer non-reentrant
                    apply, params = sf.functionalize(m, units=MODELS["torch"][1])

                    def loss_fn(params, batch, apply=apply):
                        return loss_of("torch", apply(params, batch["tokens"]), batch)

                    step = sf.train_step(loss_fn, sf.optim.adamw(LR), sf.mesh(dp=-1), apply=apply, group_bytes=0)
                    again = sf.estimate_memory(step, params, batch=global_batch("torch", 0, 1), world=2)
                    out["peaks"] = (est.peak, again.peak)
    return out


def test_the_estimate_counts_the_models_own_checkpointing(pools):
    """The recompute's gradients land on the tree's leaves, as in the step (Note [the model's own
    checkpointing] in shardfn/_recompute.py), not on the module's own parameters; the estimate's
    peak against the measured one is in tests/test_estimate.py."""
    out = pools(1).run(rank_estimate)[0]
    for model, ck in (("llama", "reentrant"), ("llama", "True"), ("torch_reentrant", "True")):
        (with_ck, leaked), (without, _) = out[model, ck, True], out[model, ck, False]
        assert not leaked, (model, ck, "the estimate left gradients on the module's parameters", leaked[:4])
        assert with_ck == without > 0, (model, ck, "full gradients of units", with_ck, without)
    # A reentrant checkpoint around a unit's call: no hook sees the unit's forward, and the estimate
    # gathers the unit where the step does, in its recompute (without it: 12% lower, no unit gathered
    # in the backward). The non-reentrant checkpoint of the same model: within 1% of it.
    reentrant, non_reentrant = out["peaks"]
    assert abs(reentrant / non_reentrant - 1) < 0.03, out["peaks"]


# -- two trees in one step, a backward inside loss_fn --------------------------------------------
def rank_two_trees_and_penalties() -> dict:
    """One step of the torch Transformer (non-reentrant, then reentrant) applied to the step's tree
    and to a tree derived from it; and with a gradient penalty, which takes the step off the unit
    schedule (Note [steps off the unit schedule] in shardfn/_core.py)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    batch = {k: v.chunk(world)[rank].clone() for k, v in global_batch("torch", 0, world).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for model in ("torch", "torch_reentrant"):
            for what in ("two_trees", "penalty"):
                got = {}
                for checkpointing in (True, False) if what == "two_trees" else (True,):
                    m = build(model, checkpointing)
                    apply, params = sf.functionalize(m, units=MODELS[model][1])

                    def loss_fn(params, b, apply=apply, what=what):
                        loss = F.cross_entropy(apply(params, b["tokens"]).flatten(0, 1), b["labels"].flatten())
                        if what == "two_trees":  # every unit runs on its own parameters, then on half of them
                            half = optree.tree_map(lambda w: w * 0.5, params)
                            return loss + F.cross_entropy(apply(half, b["tokens"]).flatten(0, 1), b["labels"].flatten())
                        # A penalty on the final norm's gradient (no second derivative through attention)
                        (g,) = torch.autograd.grad(loss, params["norm"]["weight"], create_graph=True)
                        return loss + g.pow(2).sum()

                    step = sf.train_step(loss_fn, sf.optim.adamw(LR), sf.mesh(dp=-1), apply=apply, group_bytes=0)
                    state = step.init(params)
                    try:
                        state, metrics = step(state, batch)
                        full = sf.to_state_dict(sf.gather(state.params), apply)
                        got[checkpointing] = dict(losses=[metrics["loss"].item()], params=dict(full))
                    except Exception as e:  # noqa: BLE001 - what the test asserts on
                        got[checkpointing] = f"{type(e).__name__}: {e}"
                unchecked = got.get(False)
                out[model, what] = (got[True] if isinstance(got[True], str) else _err(got[True], unchecked), unchecked if isinstance(unchecked, str) else None)
    return out


def test_two_trees_and_a_backward_inside_loss_fn(pools):
    """A model applied to two trees in one step: each use's recompute reads its own tree, equal to
    the step without the model's checkpointing; a reentrant checkpoint around a unit's call cannot
    tell which use its recompute is for, and says so. A backward inside loss_fn (a penalty) takes
    the step off the unit schedule, where the model's own checkpointing is refused, naming the fix."""
    for r in pools(2).run(rank_two_trees_and_penalties):
        assert all(unchecked is None for _, unchecked in r.values()), r  # without the model's checkpointing: all run
        assert r["torch", "two_trees"][0] < 1e-6, r
        assert r["torch_reentrant", "two_trees"][0].startswith("NotImplementedError"), r
        assert "use_reentrant=False" in r["torch_reentrant", "two_trees"][0], r
        assert r["torch", "penalty"][0].startswith("NotImplementedError"), r
        assert "off the unit schedule" in r["torch", "penalty"][0] and "gradient_checkpointing_disable" in r["torch", "penalty"][0], r
        # torch's own refusal: a reentrant checkpoint and torch.autograd.grad (the same in one process)
        assert "use_reentrant=True, torch.utils.checkpoint is incompatible with .grad()" in r["torch_reentrant", "penalty"][0], r


def rank_reentrant_prefetch() -> list:
    """The engine's events in the second step's backward of the reentrant torch Transformer (three
    units alone in slot arenas, under full_shard)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = build("torch_reentrant", True)
    apply, params = sf.functionalize(m, units=MODELS["torch_reentrant"][1])

    def loss_fn(params, b):
        return F.cross_entropy(apply(params, b["tokens"]).flatten(0, 1), b["labels"].flatten())

    step = sf.train_step(loss_fn, sf.optim.adamw(LR), sf.mesh(dp=-1), apply=apply, group_bytes=0)
    state = step.init(params)
    engine = step.core.engine
    for i in range(2):
        engine.stats.record_events = i == 1
        state, _ = step(state, {k: v.chunk(world)[rank].clone() for k, v in global_batch("torch_reentrant", i, world).items()})
    return [(what, u) for what, u, phase in engine.stats.events if phase == "backward" and what in ("gather", "reduce")]


def test_a_reentrant_recompute_prefetches_the_unit_before(pools):
    """A reentrant checkpoint around a unit's call runs the unit's forward under no_grad: no hook
    sees its outputs, so the unit is gathered by its own hook in the recompute (Note [the model's
    own checkpointing]), which also starts gathering the unit before it, as a pre-backward would:
    that gather overlaps this unit's backward and starts before its reduction."""
    for events in pools(2).run(rank_reentrant_prefetch):
        # The last unit (2) stays gathered from its forward; 1 and 0 are gathered again, each before
        # the reduction of the unit after it; the root (-1) last.
        assert events == [("gather", 1), ("reduce", 2), ("gather", 0), ("reduce", 1), ("reduce", 0), ("reduce", -1)], events
