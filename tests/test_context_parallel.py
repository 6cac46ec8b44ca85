"""Context parallelism: the sequence split over `cp`, attention as an exact ring, against one process.

Each rank passes the batch of its dp coordinate; the step cuts the sequence (a head and a tail chunk
per cp rank) and the parameters after a few AdamW steps must equal a single process trained on the
global batch.
"""

from __future__ import annotations

import warnings

import numpy as np
import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardfn as sf
from shardfn import _collectives as C
from shardfn.models import GPT, GPTConfig
from reference import OPT, rel_err

T = 24  # a multiple of 2 * cp for cp = 2, 3, 4
CFG = GPTConfig(vocab=37, block_size=T, n_layer=2, n_head=4, d=32)


def _gpt_batch(step: int, dp: int, dp_rank: int | None = None):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, CFG.vocab, (2 * dp, T), generator=g)
    y = torch.randint(0, CFG.vocab, (2 * dp, T), generator=g)
    pos = torch.arange(T).expand(2 * dp, T)
    if dp_rank is None:
        return ids, y, pos
    rows = slice(2 * dp_rank, 2 * dp_rank + 2)
    return ids[rows], y[rows], pos[rows]


def _llama(kind: str = "llama"):
    import transformers as tf

    torch.manual_seed(0)
    small = dict(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=T, attention_dropout=0.0, attn_implementation="sdpa")
    if kind.startswith("mistral"):  # a sliding window of `mistral<N>` positions
        return tf.MistralForCausalLM(tf.MistralConfig(**small, sliding_window=int(kind[len("mistral"):])))
    if kind == "qwen2_moe":  # builds a sliding-window mask it does not use, by indexing the attention mask
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                        shared_expert_intermediate_size=16))
    return tf.LlamaForCausalLM(tf.LlamaConfig(**small))


def _shifted(ids: torch.Tensor) -> torch.Tensor:
    """Next-token labels aligned with the tokens (the last position has none): shifted before the cut."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)


def rank_context_parallel(dims: dict, kind: str, options: dict) -> dict:
    options = dict(options)
    mesh = sf.mesh(**dims)
    dp = dims.get("dp", 1)
    coord = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    dp_rank = coord.get("dp", 0)
    if kind == "gpt":
        torch.manual_seed(0)
        model = GPT(CFG)
        units = r"blocks\.\d+"
    else:
        model = _llama(kind)
        units = r"model\.layers\.\d+"
    ref = GPT(CFG) if kind == "gpt" else _llama(kind)
    ref.load_state_dict(model.state_dict())
    apply, params = sf.functionalize(model, units=units)

    if kind == "gpt":
        def loss_fn(p, b):
            ids, y, pos = b
            return F.cross_entropy(apply(p, ids, pos).flatten(0, 1), y.flatten())
    else:
        def loss_fn(p, b):  # the global token mean: each rank's sum over the ranks' counts
            ids, labels, pos = b
            # global positions; a mask of ones, or Hugging Face would take the jump between the
            # head and tail chunks' positions for packed sequences and mask across it
            logits = apply(p, input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=False).logits
            nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
            return sf.psum(nll, "dp") / sf.psum((labels != -100).sum(), "dp")

    tp = options.pop("tp_rules", None)
    if tp is not None:  # tensor parallel too: the leaves split over tp by the model's ready rules
        options["specs"] = sf.specs(params, mesh, rules=getattr(sf.rules, tp), default=sf.P("dp"))
    step = sf.train_step(loss_fn, sf.optim.adamw(**OPT), mesh, batch_specs=sf.P(None, "cp"), **options)
    state = step.init(params)
    ropt = torch.optim.AdamW(ref.parameters(), **OPT)
    k = options.get("accumulation_steps", 1)
    losses, calls = [], []
    for s in range(3):
        ids, y, pos = _gpt_batch(s, dp, dp_rank)
        if kind != "gpt":
            y = _shifted(ids)
        C.STATS.reset()
        state, metrics = step(state, (ids, y, pos))
        calls.append(C.STATS.calls.get("ppermute", 0))
        gids, gy, gpos = _gpt_batch(s, dp)
        ropt.zero_grad()
        if kind == "gpt":
            # accumulation: the mean of the micro-batches' means, as the step takes it
            rl = sum(F.cross_entropy(ref(i, q).flatten(0, 1), t.flatten()) for i, t, q in zip(gids.chunk(dp * k), gy.chunk(dp * k), gpos.chunk(dp * k))) / (dp * k)
        else:
            gy = _shifted(gids)
            rl = F.cross_entropy(ref(input_ids=gids, position_ids=gpos, use_cache=False).logits.flatten(0, 1), gy.flatten(), ignore_index=-100)
        rl.backward()
        ropt.step()
        losses.append(abs(metrics["loss"].item() - rl.item()) / rl.item())
    full = sf.to_state_dict(sf.gather(state.params), apply)
    err = max(rel_err(full[n], v) for n, v in ref.state_dict().items() if n in full)
    leaves = [x for x in torch.utils._pytree.tree_leaves(state.params) if isinstance(x, torch.distributed.tensor.DTensor)]
    names = leaves[0].device_mesh.mesh_dim_names
    tp_split = sum(1 for x in leaves if "tp" in names and x.placements[names.index("tp")].is_shard())
    return dict(err=err, loss=max(losses), calls=calls, tp_split=tp_split)


CASES = [
    (2, dict(cp=2), "gpt", {}),
    (3, dict(cp=3), "gpt", {}),
    (4, dict(dp=2, cp=2), "gpt", {}),
    (4, dict(dp=1, cp=4), "gpt", dict(remat=True)),
    (4, dict(dp=2, cp=2), "gpt", dict(accumulation_steps=2, strategy="shard_grad_op")),
    (4, dict(dp=2, cp=2), "llama", {}),
    (4, dict(dp=1, cp=4), "llama", dict(accumulation_steps=2)),
    (2, dict(cp=2), "llama", dict(remat=True, strategy="no_shard")),
    (2, dict(cp=2), "qwen2_moe", {}),  # tokens routed to experts; a mask built and never used
    (2, dict(cp=2), f"mistral{T}", {}),  # a sliding window as long as the sequence bounds nothing
    # with tensor parallelism: (dp x cp, tp), the ring on each tp rank's heads (whole on tp for the GPT)
    (4, dict(dp=1, tp=2, cp=2), "gpt", dict(tp_rules="GPT")),
    (4, dict(dp=1, tp=2, cp=2), "llama", dict(tp_rules="LLAMA", remat=True)),
]


@pytest.mark.parametrize("world,dims,kind,options", CASES, ids=[f"{w}-{'x'.join(f'{k}{v}' for k, v in d.items())}-{m}-{'-'.join(o) or 'plain'}" for w, d, m, o in CASES])
def test_context_parallel_matches_one_process_on_the_global_batch(pools, world, dims, kind, options):
    for r in pools(world).run(rank_context_parallel, dims, kind, options):
        assert r["err"] < 1e-5 and r["loss"] < 1e-5, r
        assert (r["tp_split"] > 0) == ("tp" in dims), r  # with tp, the ready rules' leaves split over it
        cp = dims["cp"]
        # per attention layer: cp - 1 K/V exchanges forward (again under remat), cp - 1 of K/V with
        # their gradients backward and one handing the gradients home
        forwards = 2 if options.get("remat") else 1
        per_micro = CFG.n_layer * (forwards * (cp - 1) + cp)
        assert r["calls"] == [per_micro * options.get("accumulation_steps", 1)] * 3, r["calls"]


def rank_refusals() -> dict:
    out = {}
    mesh = sf.mesh(cp=-1)
    apply, params = sf.functionalize(GPT(CFG), units=r"blocks\.\d+")

    def loss_fn(p, b):
        return F.cross_entropy(apply(p, b[0]).flatten(0, 1), b[1].flatten())

    try:  # a sequence split on cp by hand: the step would not know; refused
        sf.train_step(loss_fn, sf.optim.sgd(0.1), mesh)
        out["no_specs"] = "not refused"
    except ValueError as e:
        out["no_specs"] = str(e)
    try:
        sf.train_step(loss_fn, sf.optim.sgd(0.1), sf.mesh(dp=-1), batch_specs=sf.P(None, "cp"))
        out["no_axis"] = "not refused"
    except ValueError as e:
        out["no_axis"] = str(e)
    step = sf.train_step(loss_fn, sf.optim.sgd(0.1), mesh, batch_specs=sf.P(None, "cp"))
    state = step.init(params)
    try:
        step(state, (torch.zeros(2, 10, dtype=torch.long), torch.zeros(2, 10, dtype=torch.long)))
        out["uneven"] = "not refused"
    except ValueError as e:
        out["uneven"] = str(e)
    masked = sf.train_step(lambda p, b: F.scaled_dot_product_attention(b, b, b, attn_mask=torch.ones(8, 8, dtype=torch.bool)).sum() + 0 * sum(v.sum() for v in p.values()),
                           sf.optim.sgd(0.1), mesh, batch_specs=sf.P(None, None, "cp"))
    small = {"w": torch.ones(2)}
    mstate = masked.init(small)
    try:
        masked(mstate, torch.ones(1, 2, 8, 4))
        out["mask"] = "not refused"
    except NotImplementedError as e:
        out["mask"] = str(e)

    def per_token(p, b):  # no attention at all: exact, but the step cannot know the model needs none
        return (b * p["w"]).square().sum()

    def warned(run) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            run()
        return [str(w.message) for w in seen if issubclass(w.category, sf.ContextParallelWarning)]

    plain = sf.train_step(per_token, sf.optim.sgd(0.1), mesh, batch_specs=sf.P(None, "cp"))
    hstate = [plain.init({"w": torch.ones(4)})]

    def two_steps():
        for _ in range(2):
            hstate[0], _ = plain(hstate[0], torch.ones(2, 8, 4))

    out["no_attention"] = warned(two_steps)  # once, at the first step
    pos_step = sf.train_step(lambda p, b: F.cross_entropy(apply(p, b[0], pos=b[2]).flatten(0, 1), b[1].flatten()),
                             sf.optim.sgd(0.1), mesh, batch_specs=sf.P(None, "cp"))
    pstate = pos_step.init(params)
    out["sdpa"] = warned(lambda: pos_step(pstate, _gpt_batch(0, 1)))
    return out


def test_context_parallel_refusals(pools):
    for r in pools(2).run(rank_refusals):
        assert "batch_specs=" in r["no_specs"], r["no_specs"]
        assert "has none" in r["no_axis"], r["no_axis"]
        assert "multiple of 2 * cp" in r["uneven"], r["uneven"]
        assert "attn_mask" in r["mask"], r["mask"]
        assert len(r["no_attention"]) == 1 and "no torch.nn.functional.scaled_dot_product_attention" in r["no_attention"][0], r

        assert r["sdpa"] == [], r["sdpa"]


def _pooled_classifier(p, b):  # a sequence classifier that mean-pools its tokens
    h = torch.tanh(b[0] @ p["w"])
    return F.cross_entropy(h.mean(1) @ p["head"], b[2])


def _pooled_then_psum(p, b):  # the same pooling, its sums combined across the ranks first: exact
    h = torch.tanh(b[0] @ p["w"])
    pooled = sf.psum(h.sum(1), "dp") / sf.psum(torch.tensor(float(h.shape[1])), "dp")
    return F.cross_entropy(pooled @ p["head"], b[2])


def _last_token(p, b):  # a classifier that reads the last token
    return F.cross_entropy(torch.tanh(b[0] @ p["w"])[:, -1] @ p["head"], b[2])


def _shift_inside(p, b):  # next-token labels shifted inside the loss, after the cut
    logits = torch.tanh(b[0] @ p["w"]) @ p["head"]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), b[1][:, 1:].flatten())


def _by_hand(p, b):  # attention written out, not through F.scaled_dot_product_attention
    x = b[0] @ p["w"]
    return (torch.softmax(x @ x.transpose(-1, -2), -1) @ x).square().mean()


def _sdpa(p, b):  # per-token work around F.scaled_dot_product_attention: nothing else mixes positions
    x = (b[0] @ p["w"])[:, None]
    y = F.scaled_dot_product_attention(x, x, x, is_causal=True)[:, 0]
    return F.cross_entropy(y.flatten(0, 1) @ p["head"], b[1].flatten())


def _both_ways(p, b):  # causal attention read forwards and backwards (flipped), per-token loss
    x = (b[0] @ p["w"])[:, None]
    back = x.flip(2)
    y = F.scaled_dot_product_attention(x, x, x, is_causal=True) + F.scaled_dot_product_attention(back, back, back, is_causal=True).flip(2)
    return F.cross_entropy(y[:, 0].flatten(0, 1) @ p["head"], b[1].flatten())


def _heads_as_sequence(p, b):  # q laid out (batch, sequence, heads, head_dim): attention over each token's heads
    x = (b[0] @ p["w"]).unflatten(-1, (2, 3))
    y = F.scaled_dot_product_attention(x, x, x).flatten(2)
    return F.cross_entropy(y.flatten(0, 1) @ p["head"], b[1].flatten())


def _memory(p, b):  # the sequence's queries over a memory every rank holds whole, no causal mask: exact
    x = (b[0] @ p["w"])[:, None]
    mem = p["w"][None, None].expand(x.shape[0], 1, 4, 6)
    y = F.scaled_dot_product_attention(x, mem, mem)[:, 0]
    return F.cross_entropy(y.flatten(0, 1) @ p["head"], b[1].flatten())


def _positions_made(how):  # rotary-like angles from positions counted from this rank's length
    def loss_fn(p, b):
        t = b[0].shape[1]
        pos = {"linspace": lambda: torch.linspace(0, t - 1, t), "cumsum": lambda: torch.ones(t).cumsum(0) - 1,
               "numpy": lambda: torch.from_numpy(np.arange(t)).float()}[how]()
        h = (b[0] @ p["w"]) * torch.cos(pos[:, None] * 0.3)
        return F.cross_entropy(h.flatten(0, 1) @ p["head"], b[1].flatten())
    return loss_fn


def _table_on_its_last_dim(p, b):  # a table of positions stored (features, positions), cut to a rank's length (4)
    h = torch.tanh(b[0] @ p["w"])
    h = torch.cat([h[..., :4] + p["w"][:, :4].T, h[..., 4:]], -1)  # position i's row added to token i
    return F.cross_entropy(h.flatten(0, 1) @ p["head"], b[1].flatten())


_NOT_THE_SEQUENCE = ["scaled_dot_product_attention got a query", "is not the sequence the step cut"]
POSITION_CASES = {  # loss_fn, the words its refusal must hold (None: it trains)
    # Note [what the ring attends over]
    "heads_as_sequence": (_heads_as_sequence, _NOT_THE_SEQUENCE + ["the sequence is its dim -3"]),
    "memory": (_memory, None),
    # Note [positions counted from this rank's length]
    "linspace_positions": (_positions_made("linspace"), ["aten.linspace.default computed on 4 positions", "pass the global position ids"]),
    "cumsum_positions": (_positions_made("cumsum"), ["aten.cumsum.default computed on 4 positions"]),
    "numpy_positions": (_positions_made("numpy"), ["computed on 4 positions", "NumPy's arange"]),
    "table_on_its_last_dim": (_table_on_its_last_dim, ["aten.slice.Tensor cut dim 1 of a (4, 6) tensor that is not the sequence"]),
    "pooled": (_pooled_classifier, ["aten.mean.dim pooled dim 1", "aten._log_softmax", "h.mean(1)", "sf.psum"]),
    "pooled_then_psum": (_pooled_then_psum, None),
    "last_token": (_last_token, ["aten.select.int cut dim 1", "[:, -1]", "a pick of one position"]),
    "shift_inside": (_shift_inside, ["aten.slice.Tensor cut dim 1", "logits[:, :-1]", "shift the labels before the cut"]),
    "by_hand": (_by_hand, ["aten._softmax.default ran over dim 2", "torch.softmax(x @ x.transpose(-1, -2), -1)",
                           "scaled_dot_product_attention"]),
    "sdpa": (_sdpa, None),
    "both_ways": (_both_ways, None),
}


def rank_positions_mixed_outside_attention(case: str, dims: dict | None = None) -> dict:
    """One loss_fn of `POSITION_CASES` on cp=2: its first step refused before anything is applied,
    or, where nothing but attention mixes positions, two steps trained as one process would."""
    fn, _ = POSITION_CASES[case]
    mesh = sf.mesh(**(dims or dict(cp=-1)))
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 6) * 0.5, "head": torch.randn(6, 3) * 0.5}
    g = torch.Generator().manual_seed(1)
    # tokens' features, a label per token and one per sequence (not cut)
    batch = (torch.randn(2, 8, 4, generator=g), torch.randint(0, 3, (2, 8), generator=g), torch.randint(0, 3, (2,), generator=g))
    step = sf.train_step(fn, sf.optim.sgd(0.1), mesh, batch_specs=(sf.P(None, "cp"), sf.P(None, "cp"), sf.P()))
    state = step.init(params)
    before = {k: v.clone() for k, v in sf.gather(state.params).items()}
    out: dict = {}
    try:
        state, m = step(state, batch)
        state, m = step(state, batch)
    except ValueError as e:
        out["refused"] = str(e)
        out["unchanged"] = all(torch.equal(before[k], v) for k, v in sf.gather(state.params).items())
        return out
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    original = F.scaled_dot_product_attention  # the reference: the whole sequence, in this process
    whole = _pooled_classifier if fn is _pooled_then_psum else fn  # psum's sums: the whole sequence's
    for _ in range(2):
        loss = whole(ref, batch)
        grads = torch.autograd.grad(loss, list(ref.values()))
        with torch.no_grad():
            for v, gr in zip(ref.values(), grads):
                v -= 0.1 * gr
    assert F.scaled_dot_product_attention is original  # the step put it back
    full = sf.gather(state.params)
    out["err"] = max(rel_err(full[k], ref[k].detach()) for k in ref)
    return out


@pytest.mark.parametrize("case", list(POSITION_CASES))
def test_positions_mixed_outside_attention_are_refused(pools, case):
    """Note [positions mixed outside attention]: a pooling fed on into the model, a pick of the last
    token, labels shifted after the cut and attention by hand each compute on this rank's chunks
    alone; the first step refuses them, naming the op and the line, with the state untouched. The
    same pooling combined across the ranks by `sf.psum`, and per-token work around the ring, train
    exactly."""
    _, words = POSITION_CASES[case]
    for r in pools(2).run(rank_positions_mixed_outside_attention, case):
        if words is None:
            assert "refused" not in r and r["err"] < 1e-5, r
        else:
            assert "refused" in r and r["unchanged"], r
            for w in words:
                assert w in r["refused"], (w, r["refused"])


def test_a_pooling_summed_over_dp_beside_cp_is_refused(pools):
    """At (dp=2, cp=2) the step's data axis spans all four ranks: `sf.psum(x, "dp")` of a pooled
    value would add two different sequences' pools, so it is refused too."""
    for r in pools(4).run(rank_positions_mixed_outside_attention, "pooled_then_psum", dict(dp=2, cp=2)):
        assert "refused" in r and r["unchanged"], r
        assert "combined across the ranks" in r["refused"] and "at dp = 2" in r["refused"], r["refused"]


def rank_hugging_face_labels() -> dict:
    """Hugging Face's causal-LM loss shifts `labels` itself, after the cut: refused, naming
    `shift_labels=`. A padding mask with zeros: the model spreads it over (batch, heads, queries,
    keys) by index, which the watch lets pass (every key where it was, as for Qwen2-MoE's unused
    sliding-window mask), and attention refuses the mask it is given, before anything is applied."""
    mesh = sf.mesh(cp=-1)
    model = _llama()
    apply, params = sf.functionalize(model, units=r"model\.layers\.\d+")

    def loss_fn(p, b):
        ids, pos = b
        return apply(p, input_ids=ids, labels=ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=False).loss

    def padded(p, b):
        ids, pos = b
        mask = torch.ones_like(ids)
        mask[0, :2] = 0  # left padding, cut with the sequence
        logits = apply(p, input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())

    out = {}
    ids, _, pos = _gpt_batch(0, 1)
    for name, fn, error in [("refused", loss_fn, ValueError), ("padded", padded, NotImplementedError)]:
        step = sf.train_step(fn, sf.optim.sgd(0.1), mesh, batch_specs=sf.P(None, "cp"))
        state = step.init(optree.tree_map(torch.clone, params))
        before = [v.clone() for v in optree.tree_leaves(sf.gather(state.params))]
        out[name] = None
        try:
            step(state, (ids, pos))
        except error as e:
            out[name] = str(e)
            out[name + "_unchanged"] = all(map(torch.equal, before, optree.tree_leaves(sf.gather(state.params))))
    return out


def rank_attention_windows() -> dict:
    """Note [attention windows under cp]: a sliding window between a rank's length and the
    sequence's is left out of the mask by Hugging Face on every rank; the step refuses it before
    anything is computed, whether the model says so in its config (Mistral) or in its layers
    (Qwen2's sliding layers)."""
    import transformers as tf

    out = {}
    ids, _, pos = _gpt_batch(0, 1)
    small = dict(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=T, attn_implementation="sdpa")
    models = {
        "mistral": tf.MistralForCausalLM(tf.MistralConfig(**small, sliding_window=T - 4)),
        "qwen2": tf.Qwen2ForCausalLM(tf.Qwen2Config(**small, use_sliding_window=True, sliding_window=T - 4, max_window_layers=1)),
    }
    for name, model in models.items():
        apply, params = sf.functionalize(model, units=r"model\.layers\.\d+")

        def loss_fn(p, b):
            logits = apply(p, input_ids=b[0], position_ids=b[1], attention_mask=torch.ones_like(b[0]), use_cache=False).logits
            return F.cross_entropy(logits.flatten(0, 1), _shifted(b[0]).flatten(), ignore_index=-100)

        step = sf.train_step(loss_fn, sf.optim.sgd(0.1), sf.mesh(cp=-1), batch_specs=sf.P(None, "cp"))
        state = step.init(params)
        before = [v.clone() for v in optree.tree_leaves(sf.gather(state.params))]
        try:
            step(state, (ids, pos))
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
        out[name + "_unchanged"] = all(map(torch.equal, before, optree.tree_leaves(sf.gather(state.params))))
    return out


def test_attention_windows_shorter_than_the_sequence_are_refused(pools):
    for r in pools(2).run(rank_attention_windows):
        assert r["mistral"] is not None and f"MistralConfig.sliding_window bounds attention to a window of {T - 4}" in r["mistral"], r
        assert r["qwen2"] is not None and "sliding_window bounds attention" in r["qwen2"] and "self_attn" in r["qwen2"], r
        assert r["mistral_unchanged"] and r["qwen2_unchanged"], r


def test_hugging_face_labels_shifted_inside_the_model_and_padding_masks_are_refused(pools):
    for r in pools(2).run(rank_hugging_face_labels):
        assert r["refused"] is not None and "shift_labels=" in r["refused"] and "loss_utils.py" in r["refused"], r
        assert r["padded"] is not None and "attn_mask" in r["padded"], r
        assert r["refused_unchanged"] and r["padded_unchanged"], r


def rank_estimate() -> dict:
    """sf.estimate_memory of a context-parallel step against its measured peak, and against the same
    sequence without cp (each rank holding the whole sequence)."""
    from shardfn._peak import step_peak

    out = {}
    cfg = GPTConfig(vocab=64, block_size=256, n_layer=2, n_head=2, d=32)
    for name, dims, specs in (("cp", dict(cp=-1), sf.P(None, "cp")), ("dp", dict(dp=-1), None)):
        mesh = sf.mesh(**dims)
        torch.manual_seed(0)
        apply, params = sf.functionalize(GPT(cfg), units=r"blocks\.\d+")

        def loss_fn(p, b):
            return F.cross_entropy(apply(p, b[0], b[2]).flatten(0, 1), b[1].flatten())

        step = sf.train_step(loss_fn, sf.optim.adamw(1e-3), mesh, batch_specs=specs)
        ids = torch.randint(0, cfg.vocab, (2, 256), generator=torch.Generator().manual_seed(0))
        batch = (ids, ids, torch.arange(256).expand(2, 256))
        est = sf.estimate_memory(step, params, batch=batch)
        state = step.init(params)
        measured = sorted(step_peak(step, state.params, batch).peak for _ in range(3))[1]
        out[name] = (est.peak, measured)
    return out


def test_estimate_of_a_context_parallel_step(pools):
    for r in pools(2).run(rank_estimate):
        est, measured = r["cp"]
        assert 0.9 <= est / measured <= 1.1, r
        assert r["cp"][0] < r["dp"][0], r  # each rank holds half the sequence's activations


def rank_both_rings(causal: bool) -> float:
    """The fused-kernel ring (CPU) and the plain-ops ring (other devices) against attention on the
    whole sequence, values and gradients; on contiguous inputs and on views whose last dim is not
    contiguous (a batch norm's transposed output: the fused kernel reads its last dim as
    contiguous)."""
    from shardfn._context import ContextParallel

    mesh = sf.mesh(cp=-1)
    cp = ContextParallel(mesh, sf.P(None, None, "cp"))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, T, 8, generator=g) for _ in range(3))
    w = torch.randn(2, 4, T, 8, generator=g)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=causal)
    (want * w).sum().backward()
    errs = []
    for ring in (lambda *a: cp.attend(*a, is_causal=causal), lambda *a: cp._ring_math(*a, causal, 8 ** -0.5)):
        for layout in ("contiguous", "transposed"):  # q, k, v as views whose last dim is not contiguous too
            local = [cp.cut(x).clone().requires_grad_() for x in (q, k, v)]
            if layout == "transposed":
                local = [x.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_() for x in local]
                assert local[0].stride(-1) != 1
            out = ring(*local)
            (out * cp.cut(w)).sum().backward()
            errs.append(rel_err(out, cp.cut(want)))
            errs += [rel_err(a.grad, cp.cut(b.grad)) for a, b in zip(local, full)]
    return max(errs)


@pytest.mark.parametrize("causal", [True, False])
def test_both_rings_match_whole_sequence_attention(pools, causal):
    assert max(pools(3).run(rank_both_rings, causal)) < 1e-5


def rank_attention_shapes() -> dict:
    """What `F.scaled_dot_product_attention` takes beyond (batch, heads, positions, head size),
    through the ring (whose fused CPU kernel takes only that): 3 and 5 dims, keys broadcast over
    the heads, values of another head size than the queries' (latent attention), both ways."""
    from shardfn._context import ContextParallel

    mesh = sf.mesh(cp=-1)
    g = torch.Generator().manual_seed(4)
    shapes = {  # name -> q, k, v shapes (the positions second to last)
        "3 dims": ((6, T, 8), (6, T, 8), (6, T, 8)),
        "5 dims": ((2, 2, 3, T, 8), (2, 2, 3, T, 8), (2, 2, 3, T, 8)),
        "keys broadcast": ((2, 4, T, 8), (2, 1, T, 8), (2, 1, T, 8)),
        "values wider": ((2, 4, T, 8), (2, 4, T, 8), (2, 4, T, 12)),
        "values narrower": ((2, 4, T, 12), (2, 4, T, 12), (2, 4, T, 8)),
    }
    out = {}
    for name, dims in shapes.items():
        q, k, v = (torch.randn(*d, generator=g) for d in dims)
        cp = ContextParallel(mesh, sf.P(*([None] * (q.dim() - 2)), "cp"))
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        want = F.scaled_dot_product_attention(*full, is_causal=True)
        w = torch.randn(want.shape, generator=g)
        (want * w).sum().backward()
        local = [cp.cut(x).clone().requires_grad_() for x in (q, k, v)]
        got = cp.attend(*local, is_causal=True)
        (got * cp.cut(w)).sum().backward()
        out[name] = max([rel_err(got, cp.cut(want))] + [rel_err(a.grad, cp.cut(b.grad)) for a, b in zip(local, full)])
    return out


def test_attention_of_every_shape_sdpa_takes_runs_as_the_ring(pools):
    for r in pools(2).run(rank_attention_shapes):
        assert max(r.values()) < 1e-5, r


# -- a rank of a context- or sequence-parallel job, simulated (Note [simulated rank]) ----------------

SIM_T = 512


def _simulated_step(dims: dict, sp: bool) -> tuple[int, int]:
    """Inside `sf.simulate`: rank 1's estimate and measured peak (init and two steps) of the GPT
    built under `sf.meta_device()`, on `dims`; `sp`: with `sf.rules.GPT_SP`."""
    from shardfn._peak import step_peak

    cfg = GPTConfig(vocab=64, block_size=SIM_T, n_layer=2, n_head=2, d=64)
    with sf.meta_device():
        model = GPT(cfg)
    apply, params = sf.functionalize(model, units=r"blocks\.\d+")
    mesh = sf.mesh(**dims)

    def loss_fn(p, b):
        ids, pos = b
        return F.cross_entropy(apply(p, ids, pos).flatten(0, 1), ids.flatten())

    kw: dict = dict(batch_specs=sf.P(None, "cp")) if "cp" in dims else {}
    if "tp" in dims:
        rules = sf.rules.GPT_SP if sp else sf.rules.GPT
        kw.update(specs=sf.specs(params, mesh, rules=rules, default=sf.P("dp")), activation_specs=rules if sp else None)
    step = sf.train_step(loss_fn, sf.optim.adamw(1e-3), mesh, **kw)
    batch = (torch.zeros(4, SIM_T, dtype=torch.long), torch.arange(SIM_T).expand(4, SIM_T))
    est = sf.estimate_memory(step, params, batch=batch)
    return est.peak, step_peak(step, params, batch).peak


def simulated_steps() -> list:
    """In a fresh process: rank 1 of 4-rank jobs, data-parallel, context-parallel (with and
    without tp) and sequence-parallel."""
    cases = [(dict(dp=4), False), (dict(dp=1, cp=4), False), (dict(dp=1, tp=2, cp=2), False),
             (dict(dp=2, tp=2), False), (dict(dp=2, tp=2), True)]
    return [(dims, sp, *sf.simulate(_simulated_step, dims, sp, world=4, rank=1)) for dims, sp in cases]


def test_simulated_context_and_sequence_parallel_ranks_match_the_estimate():
    """`sf.simulate` runs a rank of a cp and an sp job (a meta-device model, collectives that move
    nothing): the estimate within 10% of the peak measured there; the sequence cut over cp=4 holds
    less than data parallelism over 4 (its activations are 1/4 the tokens), sequence parallelism
    less than plain tp."""
    import os
    import pickle
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = "import pickle, sys, test_context_parallel as t; sys.stdout.buffer.write(pickle.dumps(t.simulated_steps()))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    runs = pickle.loads(done.stdout)
    for dims, sp, est, measured in runs:
        assert 0.9 <= est / measured <= 1.1, (dims, sp, est, measured)
    peak = {(tuple(d.items()), sp): m for d, sp, _, m in runs}
    assert peak[((("dp", 1), ("cp", 4)), False)] < peak[((("dp", 4),), False)], peak
    assert peak[((("dp", 2), ("tp", 2)), True)] < peak[((("dp", 2), ("tp", 2)), False)], peak


# -- the other entry points on a cp mesh: checkpoints reshard, describe, export -----------------------
def _cp_build(dims: dict, cp: bool):
    torch.manual_seed(0)
    apply, params = sf.functionalize(GPT(CFG), units=r"blocks\.\d+")

    def loss_fn(p, b):
        ids, y, pos = b
        return F.cross_entropy(apply(p, ids, pos).flatten(0, 1), y.flatten())

    step = sf.train_step(loss_fn, sf.optim.adamw(**OPT), sf.mesh(**dims), batch_specs=sf.P(None, "cp") if cp else None)
    return apply, step, step.init(params)


def _full(state) -> dict:
    """Every tensor leaf of a state (params, both AdamW moments, the step), gathered, by path."""
    from shardfn import _checkpoint

    paths, leaves, _ = _checkpoint._flatten(state)
    return {p: (x.full_tensor() if isinstance(x, torch.distributed.tensor.DTensor) else x).detach().clone()
            for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)}


def rank_cp_save(folder: str) -> dict:
    """Two steps at (dp=2, cp=2), then a checkpoint, an export and a description of the state."""
    apply, step, state = _cp_build(dict(dp=2, cp=2), cp=True)
    dp_rank = dict(zip(step.mesh.mesh_dim_names, step.mesh.get_coordinate()))["dp"]
    for s in range(2):
        state, _ = step(state, _gpt_batch(s, 2, dp_rank))
    sf.save(state, f"{folder}/ckpt")
    sf.export(state, f"{folder}/model.safetensors", apply=apply)
    return dict(full=_full(state), described=str(sf.describe(state)))


def rank_cp_load(folder: str) -> dict:
    """The (dp=2, cp=2) checkpoint loaded on a dp-only mesh of this world size, then one more step."""
    _, step, state = _cp_build(dict(dp=-1), cp=False)
    state = sf.load(f"{folder}/ckpt", like=state)
    loaded = _full(state)
    w, r = dist.get_world_size(), dist.get_rank()
    ids, y, pos = _gpt_batch(2, 2)
    rows = slice(r * 4 // w, (r + 1) * 4 // w)
    state, m = step(state, (ids[rows], y[rows], pos[rows]))
    return dict(loaded=loaded, loss=m["loss"].item())


@pytest.mark.parametrize("world", [1, 4])
def test_a_context_parallel_state_reshards_exports_and_describes(pools, tmp_path, world):
    """A state trained at (dp=2, cp=2) is saved, loaded at dp=4 and on one rank (every leaf, AdamW
    moments and step included, bit-identical) and trained on, exported to safetensors as the
    gathered parameters, and described over the ranks it is sharded on."""
    from safetensors.torch import load_file

    folder = str(tmp_path)
    saved = pools(4).run(rank_cp_save, folder)
    full = saved[0]["full"]
    assert full.keys() and all(torch.equal(full[k], r["full"][k]) for r in saved[1:] for k in full)
    got = pools(world).run(rank_cp_load, folder)
    for r in got:
        assert r["loaded"].keys() == full.keys(), sorted(set(r["loaded"]) ^ set(full))
        for k, v in full.items():
            assert v.dtype == r["loaded"][k].dtype and torch.equal(v, r["loaded"][k]), k
    exported = load_file(f"{folder}/model.safetensors")
    params = {k[len("params."):]: v for k, v in full.items() if k.startswith("params.")}
    # The step after loading computes from the saved values: its loss is one process's on them.
    model = GPT(CFG)
    missing, unexpected = model.load_state_dict(params, strict=False)
    assert not unexpected and set(missing) == {"pos", "head.weight"}, (missing, unexpected)  # a buffer; the tied head
    ids, y, pos = _gpt_batch(2, 2)
    with torch.no_grad():
        want = F.cross_entropy(model(ids, pos).flatten(0, 1), y.flatten()).item()
    for r in got:
        assert abs(r["loss"] - want) < 1e-5 * abs(want), (r["loss"], want)
    assert len(exported) >= len(params) > 0
    for k, v in params.items():
        assert torch.equal(exported[k], v), k
    # described as it lives: sharded over the dp x cp ranks as one data axis (docs/API.md)
    text = saved[0]["described"]
    assert text.startswith("mesh dp=4, rank 0"), text
    assert "blocks.0.fc.weight         (128, 32)     P('dp')  (32, 32)" in text, text


def _watched_forward(model, kwargs: dict) -> str | None:
    """`model(**kwargs)` under the first step's watch, in this process, with attention standing in
    for the ring as the step runs it (unwatched, its output keeping the queries' sequence dims);
    the batch leaves' dim 1 marked as the sequence. What the watch found, or None."""
    from shardfn._positions import PositionWatch

    watch = PositionWatch()
    original = F.scaled_dot_product_attention

    def ring(q, k, v, *args, **kw):
        with watch.paused():
            out = original(q, k, v, *args, **kw)
        watch.attended(q, out)
        return out

    F.scaled_dot_product_attention = ring
    try:
        with watch:
            for v in kwargs.values():
                if isinstance(v, torch.Tensor):
                    watch.mark(v, (1,))
            model(**kwargs)
    finally:
        F.scaled_dot_product_attention = original
    return watch.found


def test_the_watch_passes_per_token_models_and_finds_what_mixes_positions():
    """Note [positions mixed outside attention] on Hugging Face models as they are: the decoders
    (Llama, Qwen2, Mistral, GPT-2, Mixtral's and Qwen2-MoE's routing) and BERT's masked LM run per position around
    attention; a classifier's pick of the last or [CLS] token, Llama's loss shifting `labels=`
    itself, Llama without an attention mask (it compares neighbouring position ids to find packed
    sequences) and dynamic RoPE scaling (its length the largest position id of this rank's chunks)
    are found, each at its line."""
    import transformers as tf

    torch.manual_seed(0)
    small = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
    gpt2 = dict(vocab_size=50, n_positions=64, n_embd=32, n_layer=2, n_head=4, attn_implementation="sdpa", pad_token_id=0)
    bert = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                attn_implementation="sdpa", pad_token_id=0)
    ids = torch.randint(1, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8).expand(2, 8)
    mask = torch.ones_like(ids)
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(**small))
    clean = {
        "llama": (llama, dict(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False)),
        "llama shift_labels=": (llama, dict(input_ids=ids, position_ids=pos, attention_mask=mask, labels=ids, shift_labels=ids,
                                            use_cache=False)),
        "qwen2": (tf.Qwen2ForCausalLM(tf.Qwen2Config(**small)), dict(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False)),
        "mistral": (tf.MistralForCausalLM(tf.MistralConfig(**small)), dict(input_ids=ids, position_ids=pos, attention_mask=mask,
                                                                            use_cache=False)),
        "gpt2": (tf.GPT2LMHeadModel(tf.GPT2Config(**gpt2)), dict(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False)),
        "bert mlm": (tf.BertForMaskedLM(tf.BertConfig(**bert)), dict(input_ids=ids, position_ids=pos, attention_mask=mask, labels=ids)),
        # tokens routed to experts across the flattened batch: rows move, positions do not mix
        "mixtral": (tf.MixtralForCausalLM(tf.MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2)),
                    dict(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False)),
        # a sliding-window mask built by indexing the attention mask by key position, never used
        "qwen2-moe": (tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                                shared_expert_intermediate_size=16)),
                      dict(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False)),
    }
    clean["llama, its cache on"] = (llama, dict(input_ids=ids, position_ids=pos, attention_mask=mask))
    for name, (model, kwargs) in clean.items():
        assert _watched_forward(model, kwargs) is None, (name, _watched_forward(model, kwargs))
    counted = ["counted", "positions then met the sequence's values", "pass the global position ids"]
    found = {
        # no position ids passed: the model counts them from this rank's length (Note [positions
        # counted from this rank's length])
        "llama without position ids": (llama, dict(input_ids=ids, attention_mask=mask), counted + ["aten.arange", "modeling_llama.py"]),
        "gpt2 without position ids": (tf.GPT2LMHeadModel(tf.GPT2Config(**gpt2)), dict(input_ids=ids, attention_mask=mask),
                                      counted + ["modeling_gpt2.py"]),
        "bert without position ids": (tf.BertForMaskedLM(tf.BertConfig(**bert)), dict(input_ids=ids, attention_mask=mask),
                                      counted + ["aten.slice.Tensor cut dim 1 of a (1, 512) tensor that is not the sequence"]),
        "llama labels=": (llama, dict(input_ids=ids, position_ids=pos, attention_mask=mask, labels=ids, use_cache=False),
                          ["aten.constant_pad_nd", "loss_utils.py", "nn.functional.pad(labels"]),
        "llama without a mask": (llama, dict(input_ids=ids, position_ids=pos, use_cache=False),
                                 ["aten.slice.Tensor", "find_packed_sequence_indices"]),
        "gpt2 classifier": (tf.GPT2ForSequenceClassification(tf.GPT2Config(**gpt2)),
                            dict(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False),
                            ["aten.argmax.default ran over dim 1", "modeling_gpt2.py"]),
        "llama, dynamic RoPE": (tf.LlamaForCausalLM(tf.LlamaConfig(**{**small, "max_position_embeddings": 4},
                                                                   rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
                                dict(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False),
                                ["aten.max.default took dim 1", "torch.max(position_ids)", "read into Python"]),
        "bert classifier": (tf.BertForSequenceClassification(tf.BertConfig(**bert)), dict(input_ids=ids, position_ids=pos,
                                                                                          attention_mask=mask),
                            ["aten.select.int cut dim 1", "first_token_tensor"]),
    }
    for name, (model, kwargs, words) in found.items():
        got = _watched_forward(model, kwargs)
        assert got is not None and all(w in got for w in words), (name, got)


_LIN = torch.nn.Linear(4, 4)
_TABLE = torch.randn(16, 4)  # a table of positions (sinusoids, learned), longer than a rank's chunks
_CONV3, _CONV1, _CONV_SEQ = torch.nn.Conv1d(4, 4, 3, padding=1), torch.nn.Conv1d(4, 4, 1), torch.nn.Conv1d(8, 8, 1)
SINGLE_OPS = {  # a function of x (batch, sequence, features), the start of what the watch says (None: nothing)
    "per token": (lambda x: torch.relu(_LIN(x)).sum(), None),
    "resampled over the sequence": (lambda x: F.interpolate(x.transpose(1, 2), scale_factor=0.5, mode="linear").sum(),
                                    "aten.upsample_linear1d.default ran over dim 2"),
    "scattered along the sequence": (lambda x: torch.zeros(2, 1, 4).scatter_reduce(1, torch.zeros(2, 8, 4, dtype=torch.long), x,
                                                                                    "amax", include_self=False).sum(),
                                     "aten.scatter_reduce.two wrote by index along dim 1"),
    "added by index over features": (lambda x: torch.zeros(2, 8, 2).index_add(2, torch.tensor([0, 1, 0, 1]), x).square().sum(), None),
    "layer norm": (lambda x: F.layer_norm(_LIN(x), (4,)).mean(), None),
    "max over features": (lambda x: x.amax(-1).sum(), None),
    "the whole max": (lambda x: x.amax() * x.sum(), None),
    "a mean pooled, then linear": (lambda x: _LIN(x.mean(1)).sum(), None),
    "per-sequence means": (lambda x: (x.sum(-1).sum(1) / 8).mean(), None),
    "a kernel of one": (lambda x: torch.tanh(_CONV1(x.transpose(1, 2))).sum(), None),
    "roll of features": (lambda x: x.roll(1, 2).sum(), None),
    "flip of features": (lambda x: x.flip(2).sum(), None),
    "cat of features": (lambda x: torch.cat([torch.zeros(2, 8, 4), x], 2).sum(), None),
    "shift": (lambda x: x[:, 1:].sum(), "aten.slice.Tensor cut dim 1"),
    "last token": (lambda x: x[:, -1].sum(), "aten.select.int cut dim 1"),
    "attention by hand": (lambda x: (torch.softmax(x @ x.transpose(-1, -2), -1) @ x).sum(), "aten._softmax.default ran over dim 2"),
    "pooled into tanh": (lambda x: torch.tanh(_LIN(x.mean(1))).sum(), "aten.mean.dim pooled dim 1"),
    "cumsum": (lambda x: x.cumsum(1).sum(), "aten.cumsum.default ran over dim 1"),
    "max over positions": (lambda x: x.amax(1).sum(), "aten.amax.default ran over dim 1"),
    "attention op": (lambda x: F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None]).sum(), "aten._scaled_dot_product"),
    "convolution": (lambda x: _CONV3(x.transpose(1, 2)).sum(), "aten.convolution.default convolved dim 2"),
    "sequence as channels": (lambda x: torch.tanh(_CONV_SEQ(x)).sum(), "aten.convolution.default summed over dim 1"),
    "roll": (lambda x: x.roll(1, 1).sum(), "aten.roll.default moved positions along dim 1"),
    "flip, paired across the sequence": (lambda x: torch.tanh(x * x.flip(1)).sum(), None),  # the cut, flipped, is the flip's
    "flip of tokens flattened": (lambda x: x.reshape(-1, 4).flip(0).cumsum(1).sum(), "aten.flip.default moved positions along dim 0"),
    "window": (lambda x: x.unfold(1, 2, 1).sum(), "aten.unfold.default moved positions along dim 1"),
    "difference": (lambda x: x.diff(dim=1).sum(), "aten.slice.Tensor cut dim 1"),
    "a prompt": (lambda x: torch.cat([torch.zeros(2, 3, 4), x], 1).sum(), "aten.cat joined a tensor that is not the sequence"),
    "sequences end to end": (lambda x: torch.tanh(torch.cat([x, x.flip(1)], 1)).sum(), "aten.cat joined 2 sequences end to end"),
    # tokens flattened across the batch: rows routed, split or picked, not positions mixed
    "tokens routed by index": (lambda x: _routed(x.reshape(-1, 4)), None),
    "tokens sorted by expert": (lambda x: x.reshape(-1, 4)[_LIN(x.reshape(-1, 4)).argmax(-1).argsort()].square().sum(), None),
    "a chunked loss": (lambda x: sum(c.square().sum() for c in x.reshape(-1, 4).split(3)), None),
    "tokens kept by a mask": (lambda x: x.reshape(-1, 4)[x.reshape(-1, 4)[:, 0] > 0].square().sum(), None),
    "a batch as long as the chunks": (lambda x: _LIN(torch.cat([x, x], 0)).reshape(4, 8, 4)[:2].square().sum(), None),
    # every position indexed where it is (a padding mask spread over (batch, heads, queries, keys))
    "a mask spread by index": (lambda x: torch.tanh(x[torch.arange(2)[:, None, None], torch.arange(8)[None, None, :]]).sum(), None),
    "positions picked by index": (lambda x: torch.tanh(x[:, torch.tensor([0, 2, 4, 6])]).sum(), "aten.index.Tensor indexed dim 1"),
    "each token's label picked": (lambda x: torch.tanh(x[torch.arange(2)[:, None], torch.arange(8)[None, :],
                                                           (x[..., 0] > 0).long()]).sum(), None),
    "a pad": (lambda x: F.pad(x, (0, 0, 1, -1)).square().sum(), "aten.constant_pad_nd.default padded dim 1"),
    "an FFT": (lambda x: torch.fft.fft(x, dim=1).abs().sum(), "aten._fft"),
    "a max-pool": (lambda x: F.adaptive_max_pool1d(x.transpose(1, 2), 1).sum(), "aten.adaptive_max_pool"),
    "rotary angles from an arange": (lambda x: (x * torch.cos(torch.arange(x.shape[1]).float()[None, :, None])).sum(),
                                     "aten.arange.default counted 8 positions"),
    "a table of positions cut": (lambda x: (x + _TABLE[: x.shape[1]]).sum(),
                                 "aten.slice.Tensor cut dim 0 of a (16, 4) tensor that is not the sequence"),
    "a table of one row repeated, cut": (lambda x: (x + _TABLE[:1].expand(16, 4)[: x.shape[1]]).sum(), None),
    "an arange of features": (lambda x: (x * torch.arange(4).float()).sum(), None),
    "a mask from positions counted": (lambda x: (x.sum(-1) * (torch.arange(8)[:, None] >= torch.arange(8)).sum(1)).sum(),
                                      "aten.arange.default counted 8 positions"),
    "a group norm": (lambda x: F.group_norm(x.transpose(1, 2), 2).square().sum(), "aten.native_group_norm.default ran over dim 2"),
    "a batch norm in training": (lambda x: F.batch_norm(x.transpose(1, 2), None, None, training=True).square().sum(),
                                 "aten.native_batch_norm.default took batch statistics over dim 2"),
    "a batch norm of flattened tokens": (lambda x: F.batch_norm(x.reshape(-1, 4), None, None, training=True).square().sum(),
                                         "aten.native_batch_norm.default took batch statistics over dim 0"),
    "a batch norm in eval": (lambda x: F.batch_norm(x.transpose(1, 2), torch.zeros(4), torch.ones(4)).square().sum(), None),
    "an instance norm": (lambda x: F.instance_norm(x.transpose(1, 2)).square().sum(), "aten.native_batch_norm.default took"),
    "the sequence as a batch norm's channels": (lambda x: F.batch_norm(x, None, None, training=True).square().sum(), None),
    "pooled into a loss op": (lambda x: F.mse_loss(x.mean(1), torch.ones(2, 4)), "aten.mean.dim pooled dim 1"),
    "pooled into a layer norm": (lambda x: F.layer_norm(x.mean(1), (4,)).sum(), "aten.mean.dim pooled dim 1"),
    "pooled times the sequence": (lambda x: (x * x.mean(1, keepdim=True)).sum(), "aten.mean.dim pooled dim 1"),
    "pooled into a log-sigmoid": (lambda x: -F.logsigmoid(x.sum(1)).mean(), "aten.sum.dim_IntList pooled dim 1"),
    "a mask checked whole": (lambda x: x.sum() if bool((x > -100).all()) else x.mean(), None),
    "a largest position read": (lambda x: x.sum() * (2.0 if int(x.amax() + 1) > 100 else 1.0), "aten.amax.default took dim 1"),
}


def _routed(tokens: torch.Tensor) -> torch.Tensor:
    """Top-1 routing of flattened tokens to two experts, by index, and back (per token)."""
    choice = _LIN(tokens).argmax(-1) % 2
    out = torch.zeros_like(tokens)
    for e in range(2):
        rows = (choice == e).nonzero().flatten()
        out = out.index_add(0, rows, torch.tanh(tokens[rows] * (e + 1)))
    return out.square().sum()


@pytest.mark.parametrize("case", list(SINGLE_OPS))
def test_the_watch_on_single_ops(case):
    """The rules of Note [positions mixed outside attention], op by op, on a (2, 8, 4) tensor whose
    dim 1 is the sequence (the sequence as a conv's channels: an (2, 8, 4) input read as (N, C, L))."""
    from shardfn._positions import PositionWatch

    fn, want = SINGLE_OPS[case]
    watch = PositionWatch()
    x = torch.randn(2, 8, 4, requires_grad=True)
    with watch:
        watch.mark(x, (1,))
        fn(x).backward()  # the backward's sums over positions are not the forward's
    if want is None:
        assert watch.found is None, watch.found
    else:
        assert watch.found is not None and watch.found.startswith(want), watch.found


def test_a_watch_stopped_by_an_op_it_cannot_follow_says_so(monkeypatch):
    """An op of a form the rules did not foresee stops the watch rather than break the step; the
    step then warns, naming the op, since what the forward did after it was not checked."""
    from shardfn import _context
    from shardfn._positions import PositionWatch

    def unforeseen(self, func, *args):
        raise IndexError("a form the rules did not foresee")

    monkeypatch.setattr(PositionWatch, "_follow", unforeseen)
    watch = PositionWatch()
    x = torch.randn(2, 8, 4)
    with watch:
        watch.mark(x, (1,))
        y = (x * 2).sum()
    assert watch.found is None and watch.stopped is not None and "aten.mul" in watch.stopped, watch.stopped
    assert y.item() == pytest.approx(2 * x.sum().item())  # the step's numbers are untouched
    owner = _context.ContextParallel.__new__(_context.ContextParallel)
    owner.watch, owner.positions_checked = watch, False
    with pytest.warns(_context.ContextParallelWarning, match="stopped at aten.mul"):
        owner.check_positions()
    assert owner.positions_checked
