"""Compiled code and steps: what a user compiled is refused before anything is traced, with the
fix; `compile=True` is refused until compiled steps exist (Note [compiled code in a step] in
`shardfn/_compiled.py`). Nothing here compiles: every refusal comes before a trace."""

from __future__ import annotations

import functools

import pytest
import torch

import shardfn as sf
from shardfn import _compiled
from reference import OPT, global_batch, make_loss_fn, make_model, units_of

# torch's own: the first torch.compile imports torch.utils.mkldnn, whose TorchScript classes warn.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def _gpt(compile_blocks: str | None = None):
    """The test GPT functionalized, its blocks compiled as a user would (`"method"`:
    `block.compile()`; `"wrapper"`: `torch.compile(block)` put back into the parent)."""
    model = make_model("gpt")
    for i in range(len(model.blocks)):
        if compile_blocks == "method":
            model.blocks[i].compile()
        elif compile_blocks == "wrapper":
            model.blocks[i] = torch.compile(model.blocks[i])
    apply, params = sf.functionalize(model, units=units_of("gpt"))
    return apply, params


def _never_traced(loss_fn, calls: list):
    """`loss_fn`, recording each call: a refusal before tracing leaves `calls` empty."""
    def counted(params, batch):
        calls.append(1)
        return loss_fn(params, batch)
    return counted


@pytest.mark.parametrize("how", ["method", "wrapper"])
def test_blocks_compiled_before_functionalize_are_refused_at_init(how):
    apply, params = _gpt(how)
    calls: list = []
    step = sf.train_step(_never_traced(make_loss_fn("gpt", apply), calls), sf.optim.adamw(**OPT), sf.mesh(dp=-1))
    with pytest.raises(ValueError, match=r"'blocks\.0'") as e:
        step.init(params)
    msg = str(e.value)
    assert "'blocks.1'" in msg and "'blocks.2'" in msg and "_orig_mod'" not in msg, msg  # the blocks, not inside them
    assert "uncompiled module" in msg and "compile=True" in msg, msg
    assert ("compiled by .compile()" if how == "method" else "torch.compile(...) wrapper") in msg, msg
    assert calls == []


def test_compiled_loss_fn_is_refused_at_init():
    apply, params = _gpt()
    calls: list = []
    loss_fn = torch.compile(_never_traced(make_loss_fn("gpt", apply), calls))
    step = sf.train_step(loss_fn, sf.optim.adamw(**OPT), sf.mesh(dp=-1))
    with pytest.raises(ValueError, match=r"loss_fn 'counted' is compiled") as e:
        step.init(params)
    assert "uncompiled function" in str(e.value) and "sf.train_step(..., compile=True)" in str(e.value)
    assert calls == []


@pytest.mark.parametrize("what", ["loss_fn", "blocks"])
def test_value_and_grad_refuses_compiled_code_at_its_first_call(what):
    apply, params = _gpt("method" if what == "blocks" else None)
    mesh = sf.mesh(dp=-1)
    sharded = sf.shard(params, sf.specs(params, mesh), mesh)
    calls: list = []
    loss_fn = _never_traced(make_loss_fn("gpt", apply), calls)
    fn = sf.value_and_grad(torch.compile(loss_fn) if what == "loss_fn" else loss_fn)
    with pytest.raises(ValueError, match="is compiled" if what == "loss_fn" else r"'blocks\.0'") as e:
        fn(sharded, global_batch("gpt", 0, 1))
    assert "sf.value_and_grad(..., compile=True)" in str(e.value)
    assert calls == []


@pytest.mark.parametrize("setting", [True, {"mode": "max-autotune"}])
def test_compile_true_is_not_supported_yet(setting):
    apply, params = _gpt()
    loss_fn = make_loss_fn("gpt", apply)
    for build in (
        lambda: sf.train_step(loss_fn, sf.optim.adamw(**OPT), sf.mesh(dp=-1), compile=setting),
        lambda: sf.value_and_grad(loss_fn, compile=setting),
        lambda: sf.grad(loss_fn, compile=setting),
    ):
        with pytest.raises(NotImplementedError, match="compiled steps are not supported yet") as e:
            build()
        assert "compile=False" in str(e.value)
    with pytest.raises(ValueError, match="compile must be False"):
        sf.train_step(loss_fn, sf.optim.adamw(**OPT), sf.mesh(dp=-1), compile="yes")


def test_compile_false_is_todays_eager_step():
    model = make_model("mlp")
    apply, params = sf.functionalize(model, units=units_of("mlp"))
    step = sf.train_step(make_loss_fn("mlp", apply), sf.optim.adamw(**OPT), sf.mesh(dp=-1), compile=False)
    state, metrics = step(step.init(params), global_batch("mlp", 0, 1))
    assert torch.isfinite(metrics["loss"]) and state.step == 1


def test_what_counts_as_compiled():
    inner = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    outer = torch.nn.Sequential(torch.nn.Linear(2, 2), inner)
    assert _compiled.compiled_modules(outer) == []
    outer[1] = torch.compile(inner)
    assert _compiled.compiled_modules(outer) == [("1", "a torch.compile(...) wrapper")]
    whole = torch.nn.Sequential(torch.nn.Linear(2, 2))
    whole.compile()
    assert _compiled.compiled_modules(whole) == [("", "compiled by .compile()")]

    def f(params, batch):
        return batch

    assert not _compiled.compiled_function(f) and not _compiled.compiled_function(functools.partial(f, {}))
    assert _compiled.compiled_function(torch.compile(f))
    assert _compiled.compiled_function(functools.partial(torch.compile(f), {}))
    assert _compiled.compiled_function(torch.compile(torch.nn.Linear(2, 2)))
    assert not _compiled.compiled_function(torch.nn.Linear(2, 2))
