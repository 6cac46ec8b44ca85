"""Real clients: tiny Hugging Face `transformers` models and a `peft` LoRA model, trained with
`sf.train_step` on spawned gloo ranks, against a single-process reference.

What these models bring that the project's own test models do not:

- Llama (`LlamaForCausalLM`): the rotary cos/sin reach each decoder layer as a keyword argument
  (`position_embeddings=`), computed once outside every unit.
- T5 (`T5ForConditionalGeneration`): encoder and decoder blocks are units; the relative position bias
  that block 0 computes (with its own parameters) flows into every later block; the encoder output
  feeds every decoder block's cross-attention; blocks return tuples; the shared embedding is tied to
  both stacks' `embed_tokens` and the LM head.
- BERT (`BertForMaskedLM`): the MLM decoder is tied to the word embeddings (and its bias to
  `cls.predictions.bias`).
- ViT (`ViTForImageClassification`): float (image) inputs, a classifier over the CLS token.
- LoRA (`peft.get_peft_model` on a tiny Llama): the base weights have `requires_grad=False`; only the
  LoRA weights train, the base must stay bit-identical. Case "lora" says nothing more to the step;
  case "lora_frozen_regex" also names the base in `sf.train_step(frozen=...)`, which separates
  "requires_grad is ignored" from "a unit whose trained leaves sit among frozen ones" (the frozen
  base weights are still needed by the unit's backward after its last LoRA gradient has landed).
- "llama_stack": the whole `LlamaModel` as one unit, whose output is a `ModelOutput` (a dict-like
  class that transformers registers with torch's pytree, not with optree).

Units are each model's blocks, matched over dotted submodule paths (peft's paths get a
"base_model.model." prefix). The reference is `copy.deepcopy` of the same seeded model (taken before
`sf.functionalize`, which moves the module's parameters to the meta device), trained with
`torch.optim.AdamW` on the global batch (every rank's local batch, concatenated); the sharded side
uses `sf.optim.adamw` with the same hyperparameters. Each rank's local batch has the same size and no
ignored (-100) labels, so the mean of the per-rank mean losses (the models' own `.loss`) is the
global mean loss. Compared: every parameter after 3 steps (relative error < 1e-4; leaves with
`requires_grad=False` bit-identical to their initial values) and every step's loss.

One rank-function call per (world, case) trains every strategy: a strategy that raises is recorded
and the next one runs; when a rank dies (a segfault) the strategies it finished are read back from
files, the one it was running gets the error, and the rest run again on a fresh pool. The tests,
parametrized by case, strategy and world, read those results, so a failure names all three.
Warnings are errors in the ranks too, as pytest makes them in this process (pyproject).

Hybrid sharding at 2 and 3 ranks: both degenerate 2-D meshes are checked, `replicate=1, shard=W`
("hybrid_shard-r1": shard over every rank, nothing to replicate) and `replicate=W, shard=1`
("hybrid_shard-rW": every rank holds the whole model, gradients all-reduced over the replicas); at
2 and 3 ranks these are the only 2-D shapes.
"""

from __future__ import annotations

import copy
import faulthandler
import importlib.util
import pickle
import re
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from shardfn._pool import RankError

pytest.importorskip("transformers", reason="the real-model suite trains tiny transformers models")

STEPS = 3
PER_RANK = 2  # examples per rank per step
SEQ = 8
VOCAB = 64
LR, EPS, WD = 1e-3, 1e-5, 0.01
TOL = 1e-4  # relative error, per parameter and per step loss

LORA_UNITS = r"base_model\.model\.model\.layers\.\d+"


@dataclass(frozen=True)
class Case:
    """A model (`build_model` name), its units, and what is passed to `sf.train_step(frozen=...)`."""

    model: str
    units: str
    frozen: str | None = None
    peft: bool = False


CASES = {
    "llama": Case("llama", r"model\.layers\.\d+"),
    "t5": Case("t5", r"(encoder|decoder)\.block\.\d+"),
    "bert": Case("bert", r"bert\.encoder\.layer\.\d+"),
    "vit": Case("vit", r"vit\.(encoder\.layer|layers)\.\d+"),  # `vit.layers.N` since transformers 5.x
    "lora": Case("lora", LORA_UNITS, peft=True),  # trainable = requires_grad, nothing else said
    # The same LoRA model with the frozen base also named to the step (`frozen=`): what a user can
    # write today; it separates "requires_grad is ignored" from what happens to partly frozen units.
    "lora_frozen_regex": Case("lora", LORA_UNITS, frozen=r"(?!.*\.lora_[AB]\.).*", peft=True),
    # The whole LlamaModel as one unit: its output is a ModelOutput (BaseModelOutputWithPast), a
    # dict-like class registered with torch's pytree, not optree's.
    "llama_stack": Case("llama", r"model"),
}
# strategy id -> (strategy, mesh axes as a function of the world size)
STRATEGIES = {
    "full_shard": ("full_shard", lambda w: dict(dp=-1)),
    "shard_grad_op": ("shard_grad_op", lambda w: dict(dp=-1)),
    "hybrid_shard-r1": ("hybrid_shard", lambda w: dict(replicate=1, shard=w)),
    "hybrid_shard-rW": ("hybrid_shard", lambda w: dict(replicate=w, shard=1)),
}
WORLDS = [2, 3]


# -- models and batches -------------------------------------------------------------------------------
def _llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0, tie_word_embeddings=False,
        attn_implementation="eager", **kw,
    )


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny float32 model with dropout 0, its parameters drawn from `seed`, in train mode."""
    import transformers as tf

    torch.manual_seed(seed)
    if name == "llama":
        model = tf.LlamaForCausalLM(_llama_config())
    elif name == "t5":
        cfg = tf.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, attn_implementation="eager",
        )
        model = tf.T5ForConditionalGeneration(cfg)
    elif name == "bert":
        cfg = tf.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            attn_implementation="eager",
        )
        model = tf.BertForMaskedLM(cfg)
    elif name == "vit":
        cfg = tf.ViTConfig(
            image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=5,
            attn_implementation="eager",
        )
        model = tf.ViTForImageClassification(cfg)
    elif name == "lora":
        import peft

        base = tf.LlamaForCausalLM(_llama_config())
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], bias="none")
        with warnings.catch_warnings():
            # peft 0.21 reads `model.is_gradient_checkpointing`, which transformers 5.x deprecates.
            warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning, module=r"transformers\.modeling_utils")
            model = peft.get_peft_model(base, lora)
    else:
        raise ValueError(name)
    return model.float().train()


def global_batch(name: str, step: int, world: int) -> dict[str, torch.Tensor]:
    """Every rank's examples for `step`, concatenated (rank-major); no label is ignored (-100)."""
    g = torch.Generator().manual_seed(1000 + step)
    n = PER_RANK * world
    if name in ("llama", "lora"):
        ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        return dict(input_ids=ids, labels=ids.clone())  # the model shifts the labels itself
    if name == "t5":
        return dict(
            input_ids=torch.randint(0, VOCAB, (n, SEQ), generator=g),
            labels=torch.randint(0, VOCAB, (n, SEQ - 2), generator=g),
        )
    if name == "bert":
        return dict(
            input_ids=torch.randint(0, VOCAB, (n, SEQ), generator=g),
            labels=torch.randint(0, VOCAB, (n, SEQ), generator=g),
        )
    if name == "vit":
        return dict(pixel_values=torch.randn(n, 3, 8, 8, generator=g), labels=torch.randint(0, 5, (n,), generator=g))
    raise ValueError(name)


def local_batch(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    return {k: v.chunk(world)[rank].clone() for k, v in batch.items()}


# Below this norm a leaf is compared in absolute terms (|a - b| / NORM_FLOOR). Such a leaf is one whose
# value is rounding noise: BERT's key biases start at zero and get an analytically zero gradient (the
# softmax cancels a per-query constant), so both runs leave them at ~1e-10, in whatever direction the
# reduction order rounds. Every other leaf here has a norm far above the floor, and a leaf that really
# trains moves by ~1e-3 per element per step, a thousand times the absolute tolerance (TOL * floor).
NORM_FLOOR = 1e-3


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||b||, NORM_FLOOR)."""
    a, b = a.detach().double(), b.detach().double()
    return (a - b).norm().item() / max(b.norm().item(), NORM_FLOOR)


# -- the reference ------------------------------------------------------------------------------------
def reference_run(model: torch.nn.Module, name: str, world: int) -> dict:
    """Trains `model` (a copy) on the global batches: per-step losses and final parameters."""
    model = copy.deepcopy(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR, eps=EPS, weight_decay=WD)
    losses, norms = [], []
    for i in range(STEPS):
        opt.zero_grad()
        loss = model(**global_batch(name, i, world)).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(trained, float("inf")).item())
        opt.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=True)}
    return dict(losses=losses, grad_norms=norms, params=params)


# -- the sharded run ----------------------------------------------------------------------------------
def sharded_run(case: Case, strategy_id: str, rank: int, world: int) -> dict:
    strategy, axes = STRATEGIES[strategy_id]
    name = case.model
    model = build_model(name)
    apply, params = sf.functionalize(model, units=case.units)
    del model  # `apply` holds the module; the tree holds the parameters

    def loss_fn(params, batch):
        return apply(params, **batch).loss

    mesh = sf.mesh(**axes(world))
    opt = sf.optim.adamw(LR, eps=EPS, weight_decay=WD)
    # `apply=` said explicitly: a strategy that raised may leave its model alive, and a step that
    # has to guess between two models with the same parameter names refuses to.
    step = sf.train_step(loss_fn, opt, mesh, strategy=strategy, frozen=case.frozen, apply=apply)
    state = step.init(params)
    del params
    losses, norms = [], []
    for i in range(STEPS):
        state, metrics = step(state, local_batch(global_batch(name, i, world), rank, world))
        losses.append(metrics["loss"].item())
        norms.append(metrics["grad_norm"].item())
    full = sf.to_state_dict(sf.gather(state.params), apply)
    names = set(apply.info.param_paths)  # the parameters, each once (no tied names, no buffers)
    return dict(losses=losses, grad_norms=norms, params={k: v.detach().clone() for k, v in full.items() if k in names})


def compare(ref: dict, got: dict, initial: dict[str, torch.Tensor], frozen: set[str]) -> dict:
    """What the test asserts on, in plain Python values (results cross a pipe)."""
    out: dict = dict(ref_losses=ref["losses"], losses=got["losses"], ref_grad_norms=ref["grad_norms"],
                     grad_norms=got["grad_norms"])
    out["missing"] = sorted(set(ref["params"]) - set(got["params"]))
    out["unexpected"] = sorted(set(got["params"]) - set(ref["params"]))
    out["loss_errs"] = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    errs, frozen_changed = {}, []
    for n, want in ref["params"].items():
        if n not in got["params"]:
            continue
        have = got["params"][n]
        if tuple(have.shape) != tuple(want.shape):
            errs[n] = float("inf")
            continue
        errs[n] = rel_err(have, want)
        if n in frozen and not torch.equal(have, initial[n]):
            frozen_changed.append((n, rel_err(have, initial[n])))
    out["param_errs"] = errs
    out["frozen_changed"] = frozen_changed
    out["n_frozen"] = len(frozen)
    # How far the reference moved each leaf: an error of this size means "did not train like it".
    out["ref_moved"] = {n: rel_err(ref["params"][n], initial[n]) for n in ref["params"]}
    return out


def _result_file(outdir: str, case_id: str, world: int, strategy_id: str, rank: int) -> Path:
    return Path(outdir) / f"{case_id}-w{world}-{strategy_id}-r{rank}.pkl"


def rank_train(case_id: str, strategy_ids: list[str], outdir: str) -> dict:
    """Every strategy on one case: the reference once, then each strategy from the same seed.

    A strategy that raises is recorded (the others still run); each strategy's result is also written
    to `outdir`, so that when a rank dies (a segfault) the strategies finished before it are kept.
    """
    faulthandler.enable()  # a crash in native code (a segfault) prints where, to the captured stderr
    case = CASES[case_id]
    rank, world = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as pytest does in the parent (pyproject: filterwarnings=error)
        model = build_model(case.model)
        initial = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=True)}
        frozen = {n for n, p in model.named_parameters(remove_duplicate=True) if not p.requires_grad}
        ref = reference_run(model, case.model, world)
        del model
        out = {}
        for sid in strategy_ids:
            try:
                got = sharded_run(case, sid, rank, world)
                out[sid] = compare(ref, got, initial, frozen)
            except Exception:  # noqa: BLE001 - recorded per strategy; the test reports it
                out[sid] = dict(error=traceback.format_exc())
            _result_file(outdir, case_id, world, sid, rank).write_bytes(pickle.dumps(out[sid]))
            # Every rank finishes a strategy before the next starts (a rank that raised early does not
            # run ahead into the next strategy's collectives).
            dist.barrier()
    return out


# -- the tests ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(pools, tmp_path_factory):
    """`results(case, world)` -> {strategy: [rank results] or the pool's error}, one call per (case, world).

    When a rank dies or overruns, the strategies it had finished are read back, the one it was running
    gets the error, and the rest run again on a fresh pool.
    """
    cache: dict[tuple[str, int], dict] = {}
    outdir = str(tmp_path_factory.mktemp("real_models"))

    def get(case_id: str, world: int) -> dict:
        key = (case_id, world)
        if key in cache:
            return cache[key]
        got: dict = {}
        todo = list(STRATEGIES)
        while todo:
            try:
                res = pools(world).run(rank_train, case_id, todo, outdir, timeout=180)
            except RankError as e:
                while todo and all(_result_file(outdir, case_id, world, todo[0], r).exists() for r in range(world)):
                    sid = todo.pop(0)
                    got[sid] = [pickle.loads(_result_file(outdir, case_id, world, sid, r).read_bytes()) for r in range(world)]
                if todo:
                    got[todo.pop(0)] = f"{type(e).__name__}: {e}"
                continue
            for sid in todo:
                got[sid] = [r[sid] for r in res]
            todo = []
        cache[key] = got
        return got

    return get


def _summary(r: dict) -> str:
    worst = sorted(r["param_errs"].items(), key=lambda kv: -kv[1])[:6]
    lines = [
        f"losses     {[f'{x:.6f}' for x in r['losses']]}",
        f"ref losses {[f'{x:.6f}' for x in r['ref_losses']]}",
        f"grad norms {[f'{x:.6f}' for x in r['grad_norms']]} (reference {[f'{x:.6f}' for x in r['ref_grad_norms']]})",
        "worst parameters (relative error; how far the reference moved the leaf):",
        *[f"  {n}: {e:.3g}  ({r['ref_moved'][n]:.3g})" for n, e in worst],
    ]
    if r["frozen_changed"]:
        lines.append(f"{len(r['frozen_changed'])} of {r['n_frozen']} frozen (requires_grad=False) leaves changed, e.g. "
                     f"{r['frozen_changed'][:3]}")
    return "\n".join(lines)


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("case", list(CASES))
def test_trains_like_single_process(results, case, strategy, world):
    if CASES[case].peft:
        pytest.importorskip("peft", reason="the LoRA cases need peft")
    res = results(case, world)[strategy]
    where = f"{case}/{strategy}/w{world}"
    assert not isinstance(res, str), (
        f"{where}: the ranks died or hung (a rank that dies without a Python exception crashed in native "
        f"code, e.g. a segfault: its faulthandler trace is in the captured stderr):\n{res}")
    for rank, r in enumerate(res):
        where = f"{case}/{strategy}/w{world} rank {rank}"
        assert "error" not in r, f"{where} raised:\n{r.get('error')}"
        assert not r["missing"] and not r["unexpected"], (where, r["missing"][:5], r["unexpected"][:5])
        assert not r["frozen_changed"], f"{where}: frozen leaves changed\n{_summary(r)}"
        worst_loss = max(r["loss_errs"])
        assert worst_loss < TOL, f"{where}: per-step loss relative error {worst_loss:.3g}\n{_summary(r)}"
        worst = max(r["param_errs"].values())
        assert worst < TOL, f"{where}: parameter relative error {worst:.3g}\n{_summary(r)}"


def test_models_are_what_the_suite_claims():
    """The properties each case is chosen for hold in the installed transformers/peft (one process)."""

    def units(case_id, model):
        return [n for n, _ in model.named_modules() if n and re.fullmatch(CASES[case_id].units, n)]

    llama = build_model("llama")
    assert units("llama", llama) == ["model.layers.0", "model.layers.1"]
    assert units("llama_stack", llama) == ["model"]
    t5 = build_model("t5")
    assert units("t5", t5) == ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]
    assert t5.shared.weight is t5.encoder.embed_tokens.weight is t5.decoder.embed_tokens.weight
    bert = build_model("bert")
    assert units("bert", bert) == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    assert bert.cls.predictions.decoder.weight is bert.bert.embeddings.word_embeddings.weight
    assert len(units("vit", build_model("vit"))) == 2
    names = [case.model for case in CASES.values() if not case.peft]
    if importlib.util.find_spec("peft") is not None:
        lora = build_model("lora")
        assert units("lora", lora) == ["base_model.model.model.layers.0", "base_model.model.model.layers.1"]
        trained = [n for n, p in lora.named_parameters() if p.requires_grad]
        assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained), trained
        frozen = [n for n, p in lora.named_parameters() if not p.requires_grad]
        assert frozen == [n for n, _ in lora.named_parameters() if re.fullmatch(CASES["lora_frozen_regex"].frozen, n)]
        names.append("lora")
    for name in dict.fromkeys(names):
        model, again = build_model(name), build_model(name)
        for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
            assert torch.equal(p, q), (name, n)  # seeded: every rank builds the same model
        assert model(**global_batch(name, 0, 1)).loss.isfinite()
