"""Activation layouts (Note [activation layouts] in `shardfn/_layouts.py`): `sf.constrain` and a
step's `activation_specs`, sequence parallelism from `sf.rules.LLAMA_SP`, against one process and
against the same step without them; the collectives counted; refusals."""

from __future__ import annotations

import copy
import warnings

import optree
import pytest
import torch
import shardfn as sf
from shardfn import _collectives as C
from reference import rel_err
from shardfn._peak import step_peak
from shardfn._tp import FallbackWarning

pytest.importorskip("transformers", reason="the sequence-parallel cases train a tiny Hugging Face Llama")

VOCAB, STEPS, LR = 64, 3, 0.5


def _llama():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    return tf.LlamaForCausalLM(cfg).float().train()


def _ids(step: int, T: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(step))


def _train_against_one_process(step, params, ref, ref_loss, T: int, dp: int) -> tuple:
    """`STEPS` steps of `step` on this dp rank's share of each global batch, and of SGD with momentum
    on `ref` over the whole batch in this process; the collectives counted from the first step.
    Returns the state, each step's relative loss difference, and every gather DTensor fell back to
    (reported on the first step, Note [tensor parallel forward])."""
    state = step.init(params)
    ropt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    C.STATS.reset()
    losses, fallbacks = [], []
    for i in range(STEPS):
        ids = _ids(i, T)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FallbackWarning)
            state, metrics = step(state, ids.chunk(2)[dp])
        fallbacks += [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
        ropt.zero_grad()
        rloss = ref_loss(ids)
        rloss.backward()
        ropt.step()
        losses.append(abs(metrics["loss"].item() - rloss.item()) / rloss.item())
    return state, losses, fallbacks


def rank_sequence_parallel(sp: bool, T: int, measure: bool) -> dict:
    """3 SGD steps of the Llama on (dp=2, tp=2), with `LLAMA_SP` or without; the reference trains
    the same model on the global batch in this process."""
    mesh = sf.mesh(dp=2, tp=2)
    dp = mesh.get_coordinate()[0]
    model = _llama()
    ref = copy.deepcopy(model)
    seen: list = []
    model.model.layers[0].register_forward_hook(lambda m, a, out: seen.append((tuple(out.to_local().shape), tuple(out.placements))))
    apply, params = sf.functionalize(model, units=r"model\.layers\.\d+")
    specs = sf.specs(params, mesh, rules=sf.rules.LLAMA_SP if sp else sf.rules.LLAMA, default=sf.P("dp"))

    def loss_fn(p, ids):
        return apply(p, input_ids=ids, labels=ids, use_cache=False).loss

    # SGD with momentum: the gradients' own scale (AdamW would blow fp32 rounding of near-zero
    # gradients up to a step of lr, in tp and without it alike).
    step = sf.train_step(loss_fn, sf.optim.sgd(LR, momentum=0.9), mesh, specs=specs,
                         activation_specs=sf.rules.LLAMA_SP if sp else None)
    state, losses, _ = _train_against_one_process(step, params, ref, lambda ids: ref(input_ids=ids, labels=ids, use_cache=False).loss, T, dp)
    calls, sent = dict(C.STATS.calls), dict(C.STATS.bytes_sent)
    full = sf.to_state_dict(sf.gather(state.params), apply)
    err = max(rel_err(full[k], v) for k, v in ref.state_dict().items())
    ids = _ids(0, T).chunk(2)[dp]
    est = sf.estimate_memory(step, params, batch=ids).peak if measure else None
    measured = sorted(step_peak(step, _llama_params(apply), ids).peak for _ in range(3))[1] if measure else None
    return dict(params=err, loss=max(losses), calls=calls, sent=sent, layer_out=seen[0], estimate=est, measured=measured)


def _llama_params(apply):
    """A fresh copy of the Llama's parameters, as a tree of `apply`'s model."""
    return sf.from_state_dict(apply, _llama().state_dict())


def _gpt():
    from shardfn.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=VOCAB, block_size=32, n_layer=2, n_head=4, d=32))


def _gpt2():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, attn_implementation="sdpa")
    return tf.GPT2LMHeadModel(cfg).float().train()


_GPTS = {"gpt": (_gpt, r"blocks\.\d+", sf.rules.GPT, sf.rules.GPT_SP),
         "gpt2": (_gpt2, r"transformer\.h\.\d+", sf.rules.GPT2, sf.rules.GPT2_SP)}


def rank_gpt_sequence_parallel(name: str, sp: bool, T: int) -> dict:
    """3 SGD steps of the project's GPT or GPT-2 on (dp=2, tp=2), with its `_SP` rules or without,
    against the same model trained on the global batch in this process."""
    make, units, rules, rules_sp = _GPTS[name]
    mesh = sf.mesh(dp=2, tp=2)
    dp = mesh.get_coordinate()[0]
    model = make()
    ref = copy.deepcopy(model)
    seen: list = []
    block = model.blocks[0] if name == "gpt" else model.transformer.h[0]
    block.register_forward_hook(lambda m, a, out: seen.append(tuple((out[0] if isinstance(out, tuple) else out).placements)))
    apply, params = sf.functionalize(model, units=units)
    specs = sf.specs(params, mesh, rules=rules_sp if sp else rules, default=sf.P("dp"))

    def loss(m, p, ids):
        if name == "gpt":
            logits = m(ids) if p is None else apply(p, ids)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
        return (m(input_ids=ids, labels=ids) if p is None else apply(p, input_ids=ids, labels=ids)).loss

    step = sf.train_step(lambda p, ids: loss(None, p, ids), sf.optim.sgd(LR, momentum=0.9), mesh, specs=specs,
                         activation_specs=rules_sp if sp else None)
    state, losses, fallbacks = _train_against_one_process(step, params, ref, lambda ids: loss(ref, None, ids), T, dp)
    full = sf.to_state_dict(sf.gather(state.params), apply)
    err = max(rel_err(full[k], v) for k, v in ref.state_dict().items() if k in full)
    return dict(params=err, loss=max(losses), calls=dict(C.STATS.calls), block_out=seen[0], fallbacks=fallbacks)


@pytest.mark.parametrize("name,T", [("gpt", 32), ("gpt", 31), ("gpt2", 32)])
def test_sequence_parallelism_of_the_gpts_is_exact(pools, name, T):
    """`sf.rules.GPT_SP` and `GPT2_SP` (attention whole on tp, the MLP split): equal to one process
    at an even and an uneven sequence; the blocks' outputs split on the sequence; per step and
    layer, the MLP's all-reduce each way replaced by a reduce-scatter, and the sequence gathered
    before the attention and before the MLP, forward and backward."""
    plain = pools(4).run(rank_gpt_sequence_parallel, name, False, T)
    sp = pools(4).run(rank_gpt_sequence_parallel, name, True, T)
    for a, b in zip(plain, sp):
        for r in (a, b):
            assert r["params"] < 1e-5 and r["loss"] < 1e-5, r
            assert not r["fallbacks"], r  # every move asked for: no gather DTensor falls back to
        assert b["block_out"] == (torch.distributed.tensor.Shard(1),), b
        assert a["block_out"] == (torch.distributed.tensor.Replicate(),), a
        pa, ps = a["calls"], b["calls"]
        # Per step: the embedding's and each layer's row-parallel partial sums, reduce-scattered instead
        # of all-reduced, and their gradients' all-reduces likewise: 2 * (1 + layers) per step.
        assert ps.get("reduce_scatter", 0) - pa.get("reduce_scatter", 0) == 6 * STEPS, (pa, ps)
        assert pa["all_reduce"] - ps["all_reduce"] == 6 * STEPS, (pa, ps)


@pytest.mark.parametrize("T", [32, 31])  # the memory measured at 32 (at a few tokens SP's own buffers weigh more)
def test_sequence_parallelism_is_exact_and_moves_as_megatron(pools, T):
    """LLAMA_SP: equal to one process (and to tp without it); the decoder layers' outputs split on
    the sequence (T/tp rows per rank, uneven for T=31); per step, the five partial sums of the
    forward (embedding, o_proj and down_proj of two layers) reduce-scattered instead of
    all-reduced, five all-gathers before the column-parallel layers (q/k/v read one), and in the
    backward five all-gathers (of those reduce-scatters' gradients) and five reduce-scatters of
    the gathered inputs' gradients instead of five all-reduces; the estimate smaller."""
    measure = T == 32
    plain = pools(4).run(rank_sequence_parallel, False, T, measure)
    sp = pools(4).run(rank_sequence_parallel, True, T, measure)
    for a, b in zip(plain, sp):
        for r in (a, b):
            assert r["params"] < 1e-5 and r["loss"] < 1e-5, r
        assert b["layer_out"][1] == (torch.distributed.tensor.Shard(1),) and b["layer_out"][0][1] in (T // 2, (T + 1) // 2), b
        assert a["layer_out"][0][1] == T, a
        pa, ps = a["calls"], b["calls"]
        assert ps.get("reduce_scatter", 0) - pa.get("reduce_scatter", 0) == 10 * STEPS, (pa, ps)
        assert pa["all_reduce"] - ps["all_reduce"] == 10 * STEPS, (pa, ps)
        assert ps.get("redistribute", 0) == 10 * STEPS, ps  # the gathers: five forward, five backward
        if measure:
            assert b["estimate"] < a["estimate"] and b["measured"] < a["measured"], (a, b)
            assert 0.9 <= a["estimate"] / a["measured"] <= 1.1, a
            # Sequence parallelism's estimate has come out 0.87-0.97 of the measured peak at this tiny
            # size (a few hundred KB, where one gathered copy weighs): a wider bound, named as such.
            assert 0.85 <= b["estimate"] / b["measured"] <= 1.1, b


def rank_value_and_grad_sequence_parallel(sp: bool) -> dict:
    """`sf.value_and_grad` of the Llama on (dp=2, tp=2), with `activation_specs=LLAMA_SP` or
    without, on the tree a train step lays out; the reference differentiates the global batch."""
    mesh = sf.mesh(dp=2, tp=2)
    dp = mesh.get_coordinate()[0]
    model = _llama()
    ref = copy.deepcopy(model)
    seen: list = []
    model.model.layers[0].register_forward_hook(lambda m, a, out: seen.append(tuple(out.placements)))
    apply, params = sf.functionalize(model, units=r"model\.layers\.\d+")
    rules = sf.rules.LLAMA_SP if sp else sf.rules.LLAMA
    specs = sf.specs(params, mesh, rules=rules, default=sf.P("dp"))
    tree = sf.train_step(lambda p, ids: p, sf.optim.sgd(LR), mesh, specs=specs).init(params).params
    grad_fn = sf.value_and_grad(lambda p, ids: apply(p, input_ids=ids, labels=ids, use_cache=False).loss,
                                activation_specs=rules if sp else None)
    ids = _ids(0, 32)
    C.STATS.reset()
    loss, grads = grad_fn(tree, ids.chunk(2)[dp])
    calls = dict(C.STATS.calls)
    want = ref(input_ids=ids, labels=ids, use_cache=False).loss
    want.backward()
    full = sf.to_state_dict(sf.gather(grads), apply)
    err = max(rel_err(full[n], p.grad) for n, p in ref.named_parameters())
    return dict(grads=err, loss=abs(loss.item() - want.item()) / want.item(), calls=calls, layer_out=seen[0])


def test_value_and_grad_takes_activation_specs(pools):
    """`sf.value_and_grad(..., activation_specs=sf.rules.LLAMA_SP)`: the gradients equal one
    process's on the global batch, the decoder layers' outputs split on the sequence, and the
    partial sums reduce-scattered (ten per call) where plain tp all-reduces them."""
    plain = pools(4).run(rank_value_and_grad_sequence_parallel, False)
    sp = pools(4).run(rank_value_and_grad_sequence_parallel, True)
    for a, b in zip(plain, sp):
        for r in (a, b):
            assert r["grads"] < 1e-5 and r["loss"] < 1e-5, r
        assert b["layer_out"] == (torch.distributed.tensor.Shard(1),), b
        assert a["layer_out"] == (torch.distributed.tensor.Replicate(),), a
        pa, ps = a["calls"], b["calls"]
        assert ps.get("reduce_scatter", 0) - pa.get("reduce_scatter", 0) == 10, (pa, ps)
        assert pa["all_reduce"] - ps["all_reduce"] == 10, (pa, ps)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(6, 16)
        self.down = torch.nn.Linear(16, 6)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def rank_constrain() -> dict:
    """`sf.constrain` inside `loss_fn` of a tp step: the activation's layout is the asked one, the
    result equals the step without it; refusals."""
    mesh = sf.mesh(dp=2, tp=2)
    dp = mesh.get_coordinate()[0]
    out: dict = {}
    results = []
    for constrained in (False, True):
        torch.manual_seed(0)
        net = _Net()
        apply, params = sf.functionalize(net)
        specs = sf.specs(params, mesh, rules=[(r"up\.weight", sf.P("tp", None)), (r"up\.bias", sf.P("tp")),
                                              (r"down\.weight", sf.P(None, "tp"))], default=sf.P("dp"))
        layouts: list = []

        def loss_fn(p, x):
            h = apply(p, x)
            if constrained:
                h = sf.constrain(h, sf.P("dp", "tp"))  # rows this rank's block over dp, the sequence over tp
                layouts.append(tuple(h.placements))
            return h.pow(2).mean()

        step = sf.train_step(loss_fn, sf.optim.sgd(0.1), mesh, specs=specs)
        state = step.init(params)
        for i in range(2):
            x = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(i))
            state, _ = step(state, x.chunk(2)[dp])
        results.append(sf.to_state_dict(sf.gather(state.params), apply))
        if constrained:
            out["layout"] = layouts[0]
    out["same"] = max(rel_err(results[1][k], v) for k, v in results[0].items())
    torch.manual_seed(0)  # and both equal one process training the same net on the global batch
    ref = _Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(2):
        opt.zero_grad()
        ref(torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
        opt.step()
    out["reference"] = max(rel_err(r[k], v.detach()) for r in results for k, v in ref.state_dict().items())

    def refused(fn, kind=ValueError):
        try:
            fn()
        except kind as e:
            return str(e)
        return "not refused"

    x = torch.ones(2, 3)
    out["outside"] = refused(lambda: sf.constrain(x, sf.P()))
    flat = sf.mesh(dp=-1)
    out["shard_map"] = refused(lambda: sf.shard_map(lambda b: sf.constrain(b, sf.P()), mesh=flat, in_specs=sf.P("dp"),
                                                    out_specs=sf.P("dp"))(torch.ones(4, 2)))
    seen: dict = {}

    def probe(p, b):
        seen["identity"] = sf.constrain(b, sf.P("dp")) is b
        seen["axis"] = refused(lambda: sf.constrain(b, sf.P(None, "sp")))
        seen["data_dim1"] = refused(lambda: sf.constrain(b, sf.P(None, "dp")), NotImplementedError)
        return (b @ p["w"]).pow(2).mean()

    probe_step = sf.train_step(probe, sf.optim.sgd(0.1), flat)
    probe_step(probe_step.init({"w": torch.ones(3, 2)}), torch.ones(2, 3))
    out.update(seen)
    apply, params = sf.functionalize(_Net())
    out["no_tp"] = refused(lambda: sf.train_step(lambda p, b: apply(p, b).sum(), sf.optim.sgd(0.1), flat,
                                                 activation_specs=[(r"up", sf.P(None, "tp"))]).init(params))
    apply, params = sf.functionalize(_Net())
    specs = sf.specs(params, mesh, rules=[(r"up\.weight", sf.P("tp", None))], default=sf.P("dp"))
    out["unmatched"] = refused(lambda: sf.train_step(lambda p, b: apply(p, b).sum(), sf.optim.sgd(0.1), mesh, specs=specs,
                                                     activation_specs=[(r"mlp\.up", sf.P(None, "tp"))]).init(params))
    out["not_pairs"] = refused(lambda: sf.train_step(lambda p, b: apply(p, b).sum(), sf.optim.sgd(0.1), mesh,
                                                     activation_specs=sf.P(None, "tp")))
    return out


class _SeqNet(torch.nn.Module):
    """Tokens embedded, their sequence constrained over tp, a tp MLP, a head: a loss over the
    flattened tokens."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = torch.nn.Embedding(29, 12), torch.nn.Linear(12, 48)
        self.proj, self.head = torch.nn.Linear(48, 12), torch.nn.Linear(12, 29)
        self.constrained = True  # False: the single-process reference

    def forward(self, ids):
        x = self.emb(ids)
        if self.constrained:
            x = sf.constrain(x, sf.P(None, "tp"))
        return self.head(x + self.proj(torch.nn.functional.gelu(self.fc(x))))


def rank_uneven_sequence_constrained(T: int) -> float:
    """A sequence of T tokens constrained over tp=2 (uneven where T is odd), then a cross-entropy
    over the flattened tokens: two steps against one process."""
    mesh = sf.mesh(dp=1, tp=2)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 29, (4, T), generator=g), torch.randint(0, 29, (4, T), generator=g)) for _ in range(2)]
    torch.manual_seed(0)
    net = _SeqNet()
    ref = copy.deepcopy(net)
    ref.constrained = False
    apply, params = sf.functionalize(net)
    specs = sf.specs(params, mesh, rules=[(r"fc\.weight", sf.P("tp", None)), (r"fc\.bias", sf.P("tp")),
                                          (r"proj\.weight", sf.P(None, "tp"))], default=sf.P("dp"))
    loss = lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
    step = sf.train_step(lambda p, b: loss(apply(p, b[0]), b[1]), sf.optim.sgd(0.1), mesh, specs=specs)
    state = step.init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # the head gathers the sequence whole
        for b in batches:
            state, _ = step(state, b)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for ids, y in batches:
        opt.zero_grad()
        loss(ref(ids), y).backward()
        opt.step()
    got = sf.to_state_dict(sf.gather(state.params), apply)
    return max(rel_err(got[k], v.detach()) for k, v in ref.state_dict().items())


def test_a_sequence_the_tp_size_does_not_divide_constrained_over_tp_is_exact(pools):
    """A loss over tokens flattened from a sequence split unevenly over tp: DTensor refuses the
    mean of a loss over rows split unevenly ("cannot be evenly sharded"); it runs on the rows
    gathered whole (`_rows_split_unevenly` in `shardfn/_dtensor_mends.py`), exact."""
    for T in (7, 8):
        for err in pools(2).run(rank_uneven_sequence_constrained, T):
            assert err < 1e-5, (T, err)


def test_constrain_lays_out_the_activation_and_changes_no_value(pools):
    for r in pools(4).run(rank_constrain):
        assert r["layout"] == (torch.distributed.tensor.Shard(1),), r["layout"]
        assert r["same"] < 1e-6 and r["reference"] < 1e-5 and r["identity"] is True, r
        assert "sf.shard" in r["outside"], r["outside"]
        assert "inside sf.shard_map" in r["shard_map"], r["shard_map"]
        assert r["axis"].startswith("sf.constrain: spec") and "'sp'" in r["axis"], r["axis"]
        assert "sf.shard_map" in r["data_dim1"], r["data_dim1"]
        assert "tensor-parallel axis" in r["no_tp"], r["no_tp"]
        assert "['mlp\\\\.up'] match no module" in r["unmatched"], r["unmatched"]
        assert "list of (regex, sf.P) pairs" in r["not_pairs"], r["not_pairs"]


def rank_peft_llama_tensor_parallel() -> dict:
    """3 SGD steps of a tiny Llama with peft's LoRA on every projection, on (dp=2, tp=2) with
    `sf.rules.LLAMA`; the reference trains the same model on the global batch in this process."""
    import peft

    mesh = sf.mesh(dp=2, tp=2)
    dp = mesh.get_coordinate()[0]
    model = _llama()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    torch.manual_seed(1)
    model = peft.get_peft_model(model, cfg)
    ref = copy.deepcopy(model)
    apply, params = sf.functionalize(model, units=r".*\.layers\.\d+")
    specs = sf.specs(params, mesh, rules=sf.rules.LLAMA, default=sf.P("dp"))
    on_tp = {path for path, spec in zip(sf.tree_paths(params), optree.tree_leaves(specs, is_leaf=lambda x: isinstance(x, sf.P)))
             if "tp" in spec.axes}

    def loss_fn(p, ids):
        return apply(p, input_ids=ids, labels=ids, use_cache=False).loss

    step = sf.train_step(loss_fn, sf.optim.sgd(LR, momentum=0.9), mesh, specs=specs)
    state, losses, fallbacks = _train_against_one_process(
        step, params, ref, lambda ids: ref(input_ids=ids, labels=ids, use_cache=False).loss, 16, dp)
    full = sf.to_state_dict(sf.gather(state.params), apply)
    err = max(rel_err(full[k], v) for k, v in ref.state_dict().items())
    return dict(params=err, loss=max(losses), on_tp=sorted(on_tp), fallbacks=fallbacks)


def test_the_llama_rules_split_peft_lora_layers_on_tp_exactly(pools):
    """`sf.rules.LLAMA` on a peft model: every projection's base weight is split as the plain
    layer's, the adapter on the same side (column-parallel: B on its outputs; row-parallel: A on
    its inputs), the head too; 3 steps equal one process, and no layer falls back to a gather."""
    pytest.importorskip("peft")
    out = pools(4).run(rank_peft_llama_tensor_parallel)[0]
    on_tp = out["on_tp"]
    for layer in range(2):
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                     "mlp.down_proj"):
            base = f"base_model.model.model.layers.{layer}.{proj}"
            assert f"{base}.base_layer.weight" in on_tp, (base, on_tp)
            side = "lora_A" if proj.endswith(("o_proj", "down_proj")) else "lora_B"
            other = "lora_B" if side == "lora_A" else "lora_A"
            assert f"{base}.{side}.default.weight" in on_tp and f"{base}.{other}.default.weight" not in on_tp, (base, on_tp)
    assert "base_model.model.lm_head.weight" in on_tp and "base_model.model.model.embed_tokens.weight" in on_tp, on_tp
    assert out["params"] < 1e-5 and out["loss"] < 1e-5, out
    assert out["fallbacks"] == [], out["fallbacks"]  # every LoRA layer runs on its shards (before: a gather per layer)
