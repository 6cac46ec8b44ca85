"""`sf.export` / `sf.import_state_dict`: a Hugging Face model to a sharded state and back.

A tiny Llama with tied embeddings is saved by Hugging Face (`save_pretrained` omits the tied
`lm_head.weight`), imported into a train state at world sizes 2 and 3 (dims that 3 does not
divide) and exported again: every tensor equals the original state dict, the file loads into the
original module with `strict=True` and into `from_pretrained` with the same outputs, and no rank
ever held more than one unit's full parameters (every gathered leaf is counted while it lives).
"""

from __future__ import annotations

import os
import shutil
import weakref

import optree
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import shardfn as sf
from shardfn import _export

UNITS = r"model\.layers\.\d+"
# Column- and row-parallel layouts over tp, FSDP within the tp shards (("tp", "dp")), and two dims.
LLAMA_2D = [
    (r".*embed_tokens\.weight", sf.P(("tp", "dp"), None)),
    (r".*q_proj\.weight", sf.P(("tp", "dp"), None)),
    (r".*k_proj\.weight", sf.P("tp", None)),
    (r".*v_proj\.weight", sf.P("tp", "dp")),
    (r".*o_proj\.weight", sf.P(None, "tp")),
    (r".*gate_proj\.weight", sf.P(("tp", "dp"), None)),
    (r".*up_proj\.weight", sf.P("dp", "tp")),
    (r".*down_proj\.weight", sf.P(None, ("tp", "dp"))),
    (r".*norm\.weight", sf.P()),
]


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=53, hidden_size=40, intermediate_size=52, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=16)


def llama(seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config()).eval()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    model = llama(0)
    model.save_pretrained(d)
    return str(d), {k: v.clone() for k, v in model.state_dict().items()}


def rank_round_trip(src: str, out: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = llama(1)  # other values: the import must overwrite every one
    apply, params = sf.functionalize(model, units=UNITS)
    if world == 4:  # a tree sharded over a (dp, tp) mesh, in tensor-parallel layouts
        mesh = sf.mesh(dp=2, tp=2)
        state = sf.shard(params, sf.specs(params, mesh, rules=LLAMA_2D), mesh)
    else:
        step = sf.train_step(lambda p, b: apply(p, input_ids=b).logits.sum(), sf.optim.sgd(0.1), sf.mesh(dp=-1))
        state = step.init(params)
    del params
    same = sf.import_state_dict(src, like=state)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sf.to_state_dict(state).items()}
    if world == 4:  # each rank read the rows its spec gives it
        from shardfn._spec import local_slices

        specs = sf.specs(state, mesh, rules=LLAMA_2D)
        for p, x, spec in zip(sf.tree_paths(state), optree.tree_leaves(state), optree.tree_leaves(specs, is_leaf=lambda s: isinstance(s, sf.P))):
            assert torch.equal(x.to_local(), full[p][local_slices(spec, mesh, x.shape)]), p

    # Count every full leaf the export gathers while it is alive on this rank.
    live, peak = [0], [0]
    real = _export._gather_leaf

    def counted(x):
        t = real(x)
        if t is not x:
            n = t.numel() * t.element_size()
            live[0] += n
            peak[0] = max(peak[0], live[0])
            weakref.finalize(t, lambda: live.__setitem__(0, live[0] - n))
        return t

    _export._gather_leaf = counted
    try:
        sf.export(state, out)
    finally:
        _export._gather_leaf = real
    info = apply.info
    unit_bytes = {}
    for p in info.param_paths:
        x = full[p]
        unit_bytes[info.unit_of[p]] = unit_bytes.get(info.unit_of[p], 0) + x.numel() * x.element_size()
    return dict(same=same is state, full={k: v.clone() for k, v in full.items()}, peak=peak[0], left=live[0],
                max_unit=max(unit_bytes.values()), model_bytes=sum(unit_bytes.values()), rank=rank, world=world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_hf_round_trip(pools, hf_dir, tmp_path, world):
    from transformers import LlamaForCausalLM

    src, sd = hf_dir
    assert "lm_head.weight" not in load_file(os.path.join(src, "model.safetensors"))  # tied: omitted by HF
    out = str(tmp_path / "export" / "model.safetensors")
    results = pools(world).run(rank_round_trip, src, out)
    for r in results:
        assert r["same"]
        assert list(r["full"]) == list(sd) and all(torch.equal(r["full"][k], sd[k]) for k in sd)
        assert r["left"] == 0 and 0 < r["peak"] <= r["max_unit"] < r["model_bytes"] / 2, r
    back = load_file(out)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    assert not any(n.startswith(".") for n in os.listdir(tmp_path / "export"))  # no temporary file left
    x = torch.randint(0, 53, (2, 7))
    want = llama(0)(input_ids=x).logits
    twin = llama(2)
    twin.load_state_dict(back, strict=True)
    assert torch.equal(twin(input_ids=x).logits, want)
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "export")
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert torch.equal(hf(input_ids=x).logits, want)


def test_import_checks_names_and_shapes(tmp_path):
    model = llama(0)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    apply, params = sf.functionalize(model, units=UNITS)
    with pytest.raises(ValueError, match=r"missing from the source: \['model.norm.weight'\]"):
        sf.import_state_dict({k: v for k, v in sd.items() if k != "model.norm.weight"}, like=params)
    with pytest.raises(ValueError, match=r"in the source but not in the model: \['extra'\]"):
        sf.import_state_dict({**sd, "extra": torch.zeros(1)}, like=params)
    with pytest.raises(ValueError, match=r"model.norm.weight: source \(3,\), like \(40,\)"):
        sf.import_state_dict({**sd, "model.norm.weight": torch.zeros(3)}, like=params, strict=False)
    zeros = {k: torch.zeros_like(v) for k, v in sd.items() if k != "model.norm.weight"}
    tree, report = sf.import_state_dict({**zeros, "extra": torch.zeros(1)}, like=params, strict=False)
    assert report.missing_keys == ["model.norm.weight"] and report.unexpected_keys == ["extra"]
    assert tree is params and params["model"]["embed_tokens"]["weight"].abs().sum() == 0
    assert torch.equal(params["model"]["norm"]["weight"], sd["model.norm.weight"])  # kept
    sf.export(params, tmp_path / "m.safetensors", metadata={"note": "x"})  # one process, no process group
    assert set(load_file(tmp_path / "m.safetensors")) == set(sd)
    with pytest.raises(ValueError, match="str keys and str values"):
        sf.export(params, tmp_path / "n.safetensors", metadata={"n": 1})
    with pytest.raises(ValueError, match="metadata\\['format'\\] is 'pt'"):  # Hugging Face reads it
        sf.export(params, tmp_path / "n.safetensors", metadata={"format": "np"})


def test_import_refuses_what_it_cannot_place():
    """Two models with the same names and the source has buffers: which module gets them is asked
    (apply=), not guessed. A tied parameter given two different values is refused, not half-read."""
    from torch import nn

    def mk():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))

    a, b = mk(), mk()
    _, pa = sf.functionalize(a)
    apply_b, pb = sf.functionalize(b)
    src = {k: v.clone() for k, v in mk().state_dict().items()}
    src["1.running_mean"] = torch.full((4,), 5.0)
    like = {k: {n: t.clone() for n, t in v.items()} for k, v in pb.items()}  # not the returned tensors
    with pytest.raises(ValueError, match="say which with apply=apply"):
        sf.import_state_dict(src, like)
    assert a[1].running_mean.abs().sum() == 0 and b[1].running_mean.abs().sum() == 0  # nothing was read
    sf.import_state_dict(src, like, apply=apply_b)
    assert torch.equal(b[1].running_mean, src["1.running_mean"]) and a[1].running_mean.abs().sum() == 0

    model = llama(0)  # ties lm_head.weight to model.embed_tokens.weight
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    _, params = sf.functionalize(model, units=UNITS)
    untied = {**sd, "lm_head.weight": sd["model.embed_tokens.weight"] + 1}
    before = params["model"]["embed_tokens"]["weight"].clone()
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' and 'lm_head.weight' different values"):
        sf.import_state_dict(untied, like=params)
    assert torch.equal(params["model"]["embed_tokens"]["weight"], before)
    sf.import_state_dict({**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()}, like=params)  # equal: fine


def test_import_a_base_model_checkpoint_into_a_model_with_a_head(tmp_path):
    """The hub's `gpt2` checkpoint is a GPT2Model ("h.0.attn..."); read into a GPT2LMHeadModel
    ("transformer.h.0.attn...", the head tied to the embedding) the names are matched through the
    base model's prefix, as from_pretrained does, and the other way round."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

    cfg = GPT2Config(vocab_size=53, n_positions=16, n_embd=24, n_layer=2, n_head=2)
    torch.manual_seed(0)
    base = GPT2Model(cfg)
    base.save_pretrained(tmp_path / "base", safe_serialization=True)
    want = {k: v.clone() for k, v in base.state_dict().items()}
    torch.manual_seed(1)
    lm = GPT2LMHeadModel(cfg)
    apply, params = sf.functionalize(lm)
    sf.import_state_dict(tmp_path / "base", like=params)
    got = sf.to_state_dict(params)
    for k, v in want.items():
        assert torch.equal(got["transformer." + k], v), k
    assert torch.equal(got["lm_head.weight"], want["wte.weight"])  # tied
    torch.manual_seed(2)
    base2 = GPT2Model(cfg)
    apply2, params2 = sf.functionalize(base2)
    sf.import_state_dict({k: v for k, v in got.items()}, like=params2, strict=False)
    assert all(torch.equal(sf.to_state_dict(params2)[k], v) for k, v in want.items())
