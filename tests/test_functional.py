"""Models as pure functions: functionalize, apply, ties, buffers, units, state-dict names."""

from __future__ import annotations

import copy

import optree
import pytest
import torch
from torch import nn

import shardfn as sf
from reference import GPT_CFG, make_model


def test_apply_equals_module_and_module_keeps_no_params():
    model = make_model("gpt")
    twin = copy.deepcopy(model)
    x = torch.randint(0, GPT_CFG.vocab, (2, 8))
    apply, params = sf.functionalize(model, units=r"blocks\.\d+")
    assert torch.equal(apply(params, x), twin(x))
    assert all(p.is_meta for p in model.parameters())
    assert set(params) == {"wte", "wpe", "blocks", "ln_f"}  # head.weight is tied to wte.weight
    assert list(params["blocks"]) == ["0", "1", "2"]
    assert params["blocks"]["0"]["attn"]["qkv"]["weight"].shape == (105, 35)
    assert not any(p.requires_grad for p in torch.utils._pytree.tree_leaves(params))


def test_params_take_the_module_storage():
    model = nn.Linear(3, 2)
    ptr = model.weight.data_ptr()
    _, params = sf.functionalize(model)
    assert params["weight"].data_ptr() == ptr


def test_tied_weight_appears_once_and_stays_tied():
    model = make_model("gpt")
    twin = copy.deepcopy(model)
    apply, params = sf.functionalize(model)
    assert "head" not in params
    x = torch.randint(0, GPT_CFG.vocab, (2, 8))
    params = torch.utils._pytree.tree_map(lambda t: t.clone().requires_grad_(), params)
    apply(params, x).sum().backward()
    twin(x).sum().backward()
    # The embedding's gradient has both uses: lookup and output head.
    assert torch.allclose(params["wte"]["weight"].grad, twin.wte.weight.grad, rtol=1e-5, atol=1e-6)
    new = torch.utils._pytree.tree_map(lambda t: t.detach(), params)
    new["wte"]["weight"] = torch.zeros_like(new["wte"]["weight"])
    # The head reads the same tensor: a zero embedding makes every logit zero.
    assert torch.count_nonzero(apply(new, x)) == 0


def test_buffers_are_the_modules_and_can_be_overridden():
    model = make_model("gpt")
    apply, params = sf.functionalize(model)
    assert apply.buffers["pos"] is model.pos
    assert apply.buffers["emb_scale"] is model.emb_scale
    x = torch.randint(0, GPT_CFG.vocab, (1, 4))
    bufs = torch.utils._pytree.tree_map(lambda b: b.clone(), apply.buffers)
    bufs["pos"] = torch.zeros_like(bufs["pos"])  # every token at position 0
    out = apply(params, x, buffers=bufs)
    twin = make_model("gpt")
    twin.pos.zero_()
    assert torch.allclose(out, twin(x))
    assert not torch.allclose(out, apply(params, x))


def test_method():
    model = make_model("gpt")
    twin = copy.deepcopy(model)
    apply, params = sf.functionalize(model)
    gen = apply.method("generate")
    x = torch.randint(0, GPT_CFG.vocab, (2, 3))
    assert torch.equal(gen(params, x, 4), twin.generate(x, 4))
    with pytest.raises(ValueError, match="no method"):
        apply.method("nope")


def test_units_and_root():
    model = make_model("gpt")
    apply, _ = sf.functionalize(model, units=[r"blocks\.\d+"])
    info = apply.info
    assert apply.units == ["blocks.0", "blocks.1", "blocks.2"]
    assert info.unit_of["blocks.1.fc.weight"] == 1
    assert info.unit_of["wte.weight"] == -1 and info.unit_of["ln_f.bias"] == -1


def test_parameter_tied_across_units_goes_to_root():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    apply, params = sf.functionalize(Shared(), units=r"a|b")
    assert apply.info.unit_of["a.weight"] == -1
    assert apply.info.unit_of["a.bias"] == 0 and apply.info.unit_of["b.bias"] == 1


def test_user_errors():
    model = make_model("mlp")
    with pytest.raises(ValueError, match="match no submodule"):
        sf.functionalize(copy.deepcopy(model), units=r"blocks\.\d+")
    apply, params = sf.functionalize(model)
    with pytest.raises(ValueError, match="already functionalized"):
        sf.functionalize(model)
    with pytest.raises(ValueError, match="missing"):
        apply({"0": params["0"]}, torch.zeros(1, 7))


def test_tree_paths_and_state_dict_round_trip():
    model = make_model("gpt")
    sd = copy.deepcopy(model.state_dict())
    apply, params = sf.functionalize(model)
    paths = sf.tree_paths(params)
    assert "blocks.0.attn.qkv.weight" in paths and "head.weight" not in paths
    full = sf.to_state_dict(params)  # the model found by its names: tied head and buffers included
    assert list(full) == list(sd) and "head.weight" in full and "pos" in full
    assert all(torch.equal(full[k], sd[k]) for k in sd)
    assert full.keys() == sf.to_state_dict(params, apply).keys()
    twin = make_model("gpt", seed=1)
    twin.load_state_dict(full, strict=True)
    x = torch.randint(0, GPT_CFG.vocab, (2, 8))
    assert torch.equal(twin(x), apply(params, x))
    back = sf.from_state_dict(apply, sd)
    assert sf.tree_paths(back) == paths
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(back), torch.utils._pytree.tree_leaves(params)))
    with pytest.raises(ValueError, match="missing"):
        sf.from_state_dict(apply, {k: v for k, v in sd.items() if k != "ln_f.weight"})
    # What load_state_dict checks, before anything is written: shapes (a buffer of another shape
    # would broadcast into the module's), tied names holding other values; the module's dtypes.
    pos = apply.buffers["pos"].clone()
    for bad, match in [({"pos": torch.tensor(3)}, r"pos: \(\) where the module has \(8,\)"),
                       ({"ln_f.weight": torch.ones(3)}, r"ln_f.weight: \(3,\) where"),
                       ({"head.weight": sd["head.weight"] + 1}, "head.weight: tied to wte.weight, holds other values")]:
        with pytest.raises(ValueError, match=match):
            sf.from_state_dict(apply, {**sd, **bad})
        assert torch.equal(apply.buffers["pos"], pos)
    half = sf.from_state_dict(apply, {k: v.half() if v.is_floating_point() else v for k, v in sd.items()})
    assert {x.dtype for x in optree.tree_leaves(half)} == {torch.float32}


def test_to_state_dict_of_gradients_with_frozen_leaves():
    """A gradient tree holds None at its frozen leaves: its state dict keeps them as None."""
    model = make_model("gpt")
    model.blocks[0].attn.qkv.weight.requires_grad_(False)
    apply, params = sf.functionalize(model)
    mesh = sf.mesh(dp=1)
    x = torch.randint(0, GPT_CFG.vocab, (2, 8))
    _, grads = sf.value_and_grad(lambda p, x: apply(p, x).float().pow(2).mean())(sf.shard(params, sf.specs(params, mesh), mesh), x)
    for tree in (grads, sf.gather(grads)):
        for a in (apply, None):
            full = sf.to_state_dict(tree, a)
            assert full["blocks.0.attn.qkv.weight"] is None and full["blocks.1.attn.qkv.weight"] is not None, list(full)
            assert list(full) == list(model.state_dict()), list(full)


def test_to_state_dict_between_models_with_the_same_names():
    """Twins that would give the same state dict are no ambiguity; twins whose buffers differ are."""
    a_apply, a_params = sf.functionalize(make_model("gpt"))
    b_model = make_model("gpt", seed=1)
    b_apply, b_params = sf.functionalize(b_model)
    plain = {k: v.clone() for k, v in sf.to_state_dict(a_params).items()}  # not the tensors either returned
    tree = sf.from_state_dict(a_apply, plain)
    tree = torch.utils._pytree.tree_map(torch.clone, tree)
    assert list(sf.to_state_dict(tree)) == list(plain)
    b_model.pos.add_(1)
    with pytest.raises(ValueError, match="apply=apply"):
        sf.to_state_dict(tree)
    assert torch.equal(sf.to_state_dict(tree, b_apply)["pos"], b_model.pos)
    assert list(sf.to_state_dict({"w": torch.zeros(2)})) == ["w"]  # no model has these names
    del a_apply, b_apply


def test_a_module_whose_parameters_an_earlier_functionalize_took_is_refused():
    """Two models sharing a submodule, functionalized one after the other: the second found the
    shared parameter already on the meta device and returned it as a leaf (a tied head then computed
    on uninitialized memory, 2e12 off). Refused, saying to functionalize one module holding both."""

    class Enc(torch.nn.Module):
        def __init__(self, emb):
            super().__init__()
            self.emb = emb

        def forward(self, x):
            return self.emb(x)

    emb = torch.nn.Embedding(11, 8)
    enc, dec = Enc(emb), Enc(emb)
    sf.functionalize(enc)
    with pytest.raises(ValueError, match=r"parameters \['emb.weight'\] of this Enc were handed to the tree of an earlier"):
        sf.functionalize(dec)
    model = make_model("gpt")
    sf.functionalize(model)
    with pytest.raises(ValueError, match="an nn.Module with both as children"):
        sf.functionalize(model.blocks[0])
    both = torch.nn.ModuleDict({"enc": Enc(emb2 := torch.nn.Embedding(11, 8)), "dec": Enc(emb2)})
    apply, params = sf.functionalize(both)  # one module holding both: tied, exact
    assert sf.tree_paths(params) == ["enc.emb.weight"]


def test_apply_refuses_meta_parameters_with_real_inputs():
    """torch computes a CPU matmul with a meta operand on uninitialized memory: refused."""
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    apply, params = sf.functionalize(model)
    with pytest.raises(ValueError, match="parameters on the meta device and inputs on cpu"):
        apply(params, torch.randn(4, 3))
    assert apply(params, torch.randn(4, 3, device="meta")).shape == (4, 2)  # shapes only: as torch

