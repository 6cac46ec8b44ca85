"""Compiled code and steps: what a user compiled is refused before anything is traced, with the
fix (Note [compiled code in a step] in `shardfn/_compiled.py`); and `compile=True`, each unit's forward
compiled (Note [compiled units]): steps equal eager ones, graphs counted. Most cases compile with
the "aot_eager" backend (AOTAutograd's graphs run by eager kernels: what shardfn controls, without
Inductor's code generation time); one runs Inductor's C++ backend end to end."""

from __future__ import annotations

import contextlib
import functools

import optree
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
    assert "uncompiled function" in str(e.value) and "sf.train_step(..., compile=True) to compile" in str(e.value)
    assert calls == []


# dynamo reads `.grad` of the graph inputs it resumes with after the break (apply's output, not a leaf)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_apply_compiled_inside_a_loss_fn_runs_eager():
    """`torch.compile(apply)` called from a plain `loss_fn`, or a compiled function calling `apply`:
    dynamo would trace the engine's gathers and hooks (and AOTAutograd failed on its views of the
    flat buffers); `apply` runs eager there, equal to the eager step."""
    apply, params = _gpt()
    batch = global_batch("gpt", 0, 1)
    eager = make_loss_fn("gpt", apply)
    losses = {}
    ways = {
        "eager": eager,
        "compiled apply": make_loss_fn("gpt", torch.compile(apply, backend="aot_eager")),
        "compiled apply, fullgraph": make_loss_fn("gpt", torch.compile(apply, backend="aot_eager", fullgraph=True)),
        "a compiled function calling apply": lambda p, b: torch.compile(lambda p, b: eager(p, b) * 1.0, backend="aot_eager")(p, b),
    }
    for how, loss_fn in ways.items():
        step = sf.train_step(loss_fn, sf.optim.adamw(**OPT), sf.mesh(dp=-1))
        state = step.init(optree.tree_map(torch.clone, params))
        for _ in range(2):
            state, m = step(state, batch)
        losses[how] = (m["loss"].item(), optree.tree_leaves(sf.gather(state.params)))
    for how, (loss, leaves) in losses.items():
        assert loss == losses["eager"][0], how
        assert all(torch.equal(a, b) for a, b in zip(leaves, losses["eager"][1])), how


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


def test_compile_settings_are_checked_where_the_step_is_built():
    apply, params = _gpt()
    loss_fn = make_loss_fn("gpt", apply)
    with pytest.raises(ValueError, match="compile must be False"):
        sf.train_step(loss_fn, sf.optim.adamw(**OPT), sf.mesh(dp=-1), compile="yes")
    with pytest.raises(ValueError, match=r"\['fulgraph'\] are not torch.compile options"):
        sf.value_and_grad(loss_fn, compile={"fulgraph": True})
    assert _compiled.compile_options(True, "x") == {"fullgraph": True}
    assert _compiled.compile_options({"mode": "max-autotune", "fullgraph": False}, "x") == {"fullgraph": False, "mode": "max-autotune"}
    assert _compiled.compile_options(False, "x") is None
    # CUDA graphs replay recorded addresses; a unit's parameters move every step
    for cuda_graphs in ({"mode": "reduce-overhead"}, {"options": {"triton.cudagraphs": True}}):
        with pytest.raises(NotImplementedError, match="CUDA graphs are not supported yet.*max-autotune-no-cudagraphs"):
            sf.train_step(loss_fn, sf.optim.adamw(**OPT), sf.mesh(dp=-1), compile=cuda_graphs)


def test_compile_needs_a_functionalized_model():
    tree = {"w": torch.randn(3, 2)}
    step = sf.train_step(lambda p, x: (x @ p["w"]).pow(2).mean(), sf.optim.sgd(0.1), sf.mesh(dp=-1), compile=True)
    with pytest.raises(NotImplementedError, match="compiles the units of a model from sf.functionalize"):
        step.init(tree)


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


# -- compile=True -------------------------------------------------------------------------------------

def _fresh_dynamo():
    """Dynamo's caches and counters as a fresh process has them."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return counters


def _graphs(counters) -> tuple[int, int]:
    """(graphs compiled, graph breaks) since `_fresh_dynamo`."""
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _counting_aot_eager():
    """The "aot_eager" backend, counting: `runs[0]`, how many times compiled graphs ran; `compiled`,
    for each graph compiled (a first compile or a recompile), how many runs came before it. A step
    that recompiles shows as a compile after the first step's runs."""
    runs, compiled = [0], []

    def backend(gm, inputs):
        import torch._dynamo

        compiled.append(runs[0])
        fn = torch._dynamo.lookup_backend("aot_eager")(gm, inputs)

        def run(*args):
            runs[0] += 1
            return fn(*args)

        return run

    return backend, runs, compiled


CASES = {  # option -> train_step keywords (besides strategy), at world 2 unless the strategy says
    "plain": {},
    "remat": {"remat": True},
    "bf16": {"mixed_precision": sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
    "accumulation": {"accumulation_steps": 2},
    "clip_frozen": {"max_grad_norm": 0.05, "frozen": r"blocks\.0\..*"},
}


def rank_compiled_against_eager(strategy: str, case: str, backend: str) -> dict:
    import warnings

    from reference import local_batch, rel_err

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mesh = sf.mesh(replicate=2, shard=-1) if strategy == "hybrid_shard" else sf.mesh(dp=-1)
    out = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
        counters = _fresh_dynamo()
        for compile in (False, {"backend": backend}):
            apply, params = _gpt()
            step = sf.train_step(make_loss_fn("gpt", apply), sf.optim.adamw(**OPT), mesh, strategy=strategy,
                                 compile=compile, **CASES[case])
            state = step.init(params)
            losses = []
            for i in range(5):
                state, metrics = step(state, local_batch(global_batch("gpt", i, world), rank, world))
                losses.append(metrics["loss"].item())
            out[bool(compile)] = (sf.to_state_dict(sf.gather(state.params), apply), losses)
        graphs, breaks = _graphs(counters)
    (eager, le), (compiled, lc) = out[False], out[True]
    return dict(params=max(rel_err(compiled[k], v) for k, v in eager.items()),
                loss=max(abs(a - b) / abs(b) for a, b in zip(lc, le)), graphs=graphs, breaks=breaks)


@pytest.mark.parametrize("strategy,case", [("full_shard", c) for c in CASES]
                         + [("shard_grad_op", "plain"), ("no_shard", "remat"), ("hybrid_shard", "plain")])
def test_compiled_units_equal_the_eager_step(pools, strategy, case):
    """5 AdamW steps of the test GPT, compiled units against the eager step, on every rank: the
    parameters within 1e-5, no graph break, one graph for its three identical blocks (a frozen
    block, whose parameters need no gradient, is a second)."""
    world = 4 if strategy == "hybrid_shard" else 2
    for r in pools(world).run(rank_compiled_against_eager, strategy, case, "aot_eager"):
        assert r["params"] < 1e-5 and r["loss"] < 1e-5, r
        assert r["breaks"] == 0, r
        assert r["graphs"] == (2 if case == "clip_frozen" else 1), r


def test_compiled_units_with_inductor_equal_the_eager_step(pools):
    """The same with Inductor's C++ code. Its kernels fuse and reorder fp32 sums, by the vector width
    of the machine's CPU, and AdamW's normalized update carries that rounding into the parameters:
    1.27e-5 on one machine, under 1e-5 on another; a wrong gradient or a stale parameter is 1e-3 or
    more. The loss stays within 1e-5."""
    for r in pools(2).run(rank_compiled_against_eager, "full_shard", "plain", "inductor"):
        assert r["params"] < 3e-5 and r["loss"] < 1e-5, r
        assert r["breaks"] == 0 and r["graphs"] == 1, r


class _Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.fc, self.out = torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.out(torch.nn.functional.gelu(self.fc(self.norm(x))))


def test_identical_blocks_share_one_graph_and_steps_do_not_recompile():
    """32 identical blocks: one compiled graph, no graph break, and no recompile over 50 steps at
    fixed shapes; `apply` outside the step runs eager (no graph added), and gives the step's values."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), *[_Block(8) for _ in range(32)])  # every block's input needs a gradient
    apply, params = sf.functionalize(model, units=r"[1-9]\d*")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
        counters = _fresh_dynamo()
        counted, runs, compiled = _counting_aot_eager()
        step = sf.train_step(lambda p, b: (apply(p, b[0]) - b[1]).pow(2).mean(), sf.optim.adamw(1e-3), sf.mesh(dp=-1),
                             compile={"backend": counted})
        state = step.init(params)
        g = torch.Generator().manual_seed(0)
        for i in range(50):
            state, _ = step(state, (torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)))
            if i == 0:
                first = _graphs(counters)
        assert first == (1, 0), first
        assert _graphs(counters) == (1, 0), dict(counters["stats"])
        assert runs[0] == 50 * 32, runs  # every block of every step ran the compiled graph
        assert compiled == [0], compiled  # compiled once, before its first run: no recompile
        x = torch.randn(2, 8)
        with torch.no_grad():
            apply(sf.gather(state.params), x)
        assert _graphs(counters) == (1, 0)
        assert step.core.compiled.first_call_s and len(step.core.compiled.first_call_s) == 32


def _hf(name: str):
    import transformers as tf

    torch.manual_seed(0)
    if name == "llama":
        cfg = tf.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
                             attn_implementation="sdpa")
        return tf.LlamaForCausalLM(cfg).float().train(), r"model\.layers\.\d+"
    cfg = tf.GPT2Config(vocab_size=61, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return tf.GPT2LMHeadModel(cfg).float().train(), r"transformer\.h\.\d+"


def rank_hf_compiled(name: str) -> dict:
    import warnings

    from reference import rel_err

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
        counters = _fresh_dynamo()
        for compile in (False, {"backend": "aot_eager"}):
            model, units = _hf(name)
            apply, params = sf.functionalize(model, units=units)

            def loss_fn(p, batch):  # no key/value cache in training (each layer's would be a new graph)
                return apply(p, **batch, use_cache=False).loss

            step = sf.train_step(loss_fn, sf.optim.adamw(1e-2), sf.mesh(dp=-1), compile=compile)
            state = step.init(params)
            for i in range(5):
                ids = torch.randint(0, 61, (2 * world, 12), generator=torch.Generator().manual_seed(i)).chunk(world)[rank]
                state, _ = step(state, dict(input_ids=ids, labels=ids))
            out[bool(compile)] = sf.gather(state.params)
        graphs, breaks = _graphs(counters)
    err = max(rel_err(a, b) for a, b in zip(optree.tree_leaves(out[True]), optree.tree_leaves(out[False])))
    return dict(params=err, graphs=graphs, breaks=breaks)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hugging_face_models_compiled_equal_eager(pools, name):
    pytest.importorskip("transformers", reason="the Hugging Face cases build tiny transformers models")
    for r in pools(2).run(rank_hf_compiled, name):
        assert r["params"] < 1e-5 and r["breaks"] == 0 and r["graphs"] == 1, r


LENGTHS = [9, 12, 10, 15, 11]  # a new sequence length every step


def rank_variable_lengths(dynamic: bool, lengths: list[int]) -> dict:
    """Hugging Face Llama trained on a new sequence length each step, compiled (`dynamic` as asked)
    against eager: the parameters, and dynamo's graphs and recompiles over the steps."""
    import warnings

    from reference import rel_err

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
        counters = _fresh_dynamo()
        backend, runs, compiled = _counting_aot_eager()
        for compile in (False, {"backend": backend, "dynamic": dynamic}):
            model, units = _hf("llama")
            apply, params = sf.functionalize(model, units=units)

            def loss_fn(p, batch):
                return apply(p, **batch, use_cache=False).loss

            step = sf.train_step(loss_fn, sf.optim.adamw(1e-2), sf.mesh(dp=-1), compile=compile)
            state = step.init(params)
            for i, n in enumerate(lengths):
                ids = torch.randint(0, 61, (2 * world, n), generator=torch.Generator().manual_seed(i)).chunk(world)[rank]
                state, _ = step(state, dict(input_ids=ids, labels=ids))
            out[bool(compile)] = sf.gather(state.params)
        graphs, breaks = _graphs(counters)
    err = max(rel_err(a, b) for a, b in zip(optree.tree_leaves(out[True]), optree.tree_leaves(out[False])))
    per_step = runs[0] // len(lengths)  # the compiled graphs' runs in one step (the same each step)
    return dict(params=err, graphs=graphs, breaks=breaks, after_first_step=[c for c in compiled if c >= per_step])


def test_variable_sequence_lengths_compile_once_with_dynamic_shapes(pools):
    """docs/API.md's recipe for lengths that change every step: `compile={"dynamic": True}` gives
    one graph for all five lengths, compiled in the first step and never again, and the eager
    step's parameters. Without it each new length is a recompile, a graph of its own (what the
    recipe avoids)."""
    pytest.importorskip("transformers", reason="the Hugging Face cases build tiny transformers models")
    dynamic = pools(2).run(rank_variable_lengths, True, LENGTHS)
    static = pools(2).run(rank_variable_lengths, False, LENGTHS[:3])
    for r in dynamic:
        assert r["params"] < 1e-5 and r["breaks"] == 0, r
        assert r["graphs"] == 1 and r["after_first_step"] == [], r
    for r in static:
        assert r["params"] < 1e-5 and r["breaks"] == 0, r
        assert r["graphs"] == 3 and len(r["after_first_step"]) == 2, r


def rank_compile_refusals() -> dict:
    import warnings

    res = {}
    apply, params = _gpt()
    try:
        sf.train_step(make_loss_fn("gpt", apply), sf.optim.adamw(**OPT), sf.mesh(dp=1, tp=2, cp=2), compile=True,
                      batch_specs=sf.P(None, "cp"))
        res["tp_cp"] = "not refused"
    except NotImplementedError as e:
        res["tp_cp"] = str(e)
    try:
        sf.train_step(make_loss_fn("gpt", apply), sf.optim.adamw(**OPT), sf.mesh(dp=2, tp=2), compile=True,
                      activation_specs=sf.rules.GPT_SP)
        res["sp"] = "not refused"
    except NotImplementedError as e:
        res["sp"] = str(e)
    mp = sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for tp in (2, 4):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            sf.train_step(make_loss_fn("gpt", apply), sf.optim.adamw(**OPT), sf.mesh(dp=4 // tp, tp=tp), compile=True,
                          mixed_precision=mp)
        res[f"warned tp={tp}"] = [str(w.message) for w in seen if "reduce_dtype" in str(w.message)]
    return res


def test_compile_on_tensor_parallel_meshes_refuses_what_it_cannot_run(pools):
    """tp with cp, and sequence parallelism, are refused where the step is built; a reduce_dtype wider
    than the compute dtype is warned of where it changes a sum (tp > 2)."""
    for r in pools(4).run(rank_compile_refusals):
        assert "tensor parallel" in r["tp_cp"] and "tp and cp" in r["tp_cp"] and "compile=False" in r["tp_cp"], r
        assert "activation_specs" in r["sp"] and "compile=False" in r["sp"], r
        assert r["warned tp=2"] == [] and len(r["warned tp=4"]) == 1, r
        assert "not in reduce_dtype" in r["warned tp=4"][0] and "compile=False" in r["warned tp=4"][0], r


def rank_context_parallel_compiled(dims: dict, kind: str, options: dict) -> dict:
    import test_context_parallel as cp

    counters = _fresh_dynamo()
    backend, runs, compiles = _counting_aot_eager()
    eager = cp.rank_context_parallel(dims, kind, dict(options))
    compiled = cp.rank_context_parallel(dims, kind, dict(options, compile={"backend": backend}))
    graphs, breaks = _graphs(counters)
    where = {k.split("Developer debug context:")[-1].strip().split(" at ")[0] for k in counters["graph_break"]}
    per_step = runs[0] // 3  # the compiled graphs' runs in one of its 3 steps (the same each step)
    return dict(eager=eager, compiled=compiled, graphs=graphs, breaks=breaks, where=where,
                after_first_step=[c for c in compiles if c >= per_step])


@pytest.mark.parametrize("world,dims,kind,options", [
    (2, dict(cp=2), "llama", dict(remat=True)),
    (4, dict(dp=2, cp=2), "gpt", dict(accumulation_steps=2)),
])
def test_compiled_units_on_a_context_parallel_mesh(pools, world, dims, kind, options):
    """On a cp mesh the units compile around the ring attention, which runs eager (a graph break
    there and nowhere else): 3 AdamW steps against one process on the global batch, as the eager
    step does, with the same ring exchanges, the identical blocks sharing their graphs."""
    if kind == "llama":
        pytest.importorskip("transformers", reason="the Hugging Face case builds a tiny transformers model")
    for r in pools(world).run(rank_context_parallel_compiled, dims, kind, options):
        assert r["compiled"]["err"] < 1e-5 and r["compiled"]["loss"] < 1e-5, r
        assert r["compiled"]["calls"] == r["eager"]["calls"], r
        assert r["where"] == {"<function ContextParallel.attend"}, r
        assert r["after_first_step"] == [] and 0 < r["graphs"] <= 6, r


class _Res(torch.nn.Module):
    def __init__(self, i: int = 0, inplace: bool = False):
        super().__init__()
        self.l1, self.i, self.inplace = torch.nn.Linear(8, 8), i, inplace

    def forward(self, x):
        if self.inplace:
            return torch.relu_(x) + self.l1(x)
        return x + torch.tanh(self.l1(x)) * (1.0 + 0.1 * self.i)  # reads a constant of its own


def _run_small(loss_kind: str, compile, units=r"[1-9]\d*", blocks=2, constants=False, inplace=False, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), *[_Res(i if constants else 0, inplace) for i in range(blocks)],
                                torch.nn.Linear(8, 2))
    if units == "nested":
        model[1].sub = _Res()  # a unit inside a unit
        model[1].forward = lambda x, m=model[1]: m.sub(x) + m.l1(x)
        units = [r"1", r"1\.sub", r"[2-9]\d*"]
    apply, params = sf.functionalize(model, units=units)

    def loss_fn(p, b):
        x, y = b
        if loss_kind == "penalty":  # a gradient penalty: a backward inside loss_fn
            x = x.clone().requires_grad_(True)
            out = apply(p, x)
            (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            return torch.nn.functional.mse_loss(out, y) + 0.1 * gx.pow(2).mean()
        if loss_kind == "vmap":  # a vmap over the inputs, eager around the model
            return torch.func.vmap(lambda r: apply(p, r[None]).pow(2).mean())(x).mean()
        return torch.nn.functional.mse_loss(apply(p, x), y)

    step = sf.train_step(loss_fn, sf.optim.adamw(1e-2), sf.mesh(dp=-1), compile=compile)
    state = step.init(params)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        state, _ = step(state, (torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)))
    return sf.gather(state.params)


@pytest.mark.parametrize("case", ["penalty", "vmap", "nested", "constants"])
def test_compiled_units_where_the_step_leaves_the_schedule_or_units_differ(case):
    """A backward inside loss_fn (the step retries on the gathered tree, eager) and a vmap over
    the inputs run the units eager; with units nested in units only the innermost compile; twelve
    blocks that read a constant of their own compile as twelve graphs, past dynamo's recompile
    limit of 8; every one equal to the eager step."""
    import warnings

    kw = dict(nested=dict(units="nested"), constants=dict(blocks=12, constants=True)).get(case, {})
    loss_kind = case if case in ("penalty", "vmap") else "mse"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
        counters = _fresh_dynamo()
        backend, runs, _ = _counting_aot_eager()
        eager = _run_small(loss_kind, False, **kw)
        compiled = _run_small(loss_kind, {"backend": backend}, **kw)
        graphs, breaks = _graphs(counters)
    from reference import rel_err

    assert max(rel_err(a, b) for a, b in zip(optree.tree_leaves(compiled), optree.tree_leaves(eager))) < 1e-6
    assert breaks == 0
    # (graphs, compiled runs) over the 3 steps: the penalty's first step tries the schedule
    # (compiled: the two blocks share a graph, the last Linear has its own; one run each), then
    # every step runs eager on the gathered tree; the vmap runs eager throughout; nested units
    # compile the innermost three (1.sub, 2 and the last Linear) and never the outer unit 1.
    want = {"penalty": (2, 3), "vmap": (0, 0), "nested": (2, 3 * 3), "constants": (13, 3 * 13)}[case]
    assert (graphs, runs[0]) == want, (graphs, runs[0], want)  # constants: the 12 blocks and the last Linear


def test_a_unit_writing_its_input_in_place_is_refused_compiled_as_eager():
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
        _fresh_dynamo()
        for compile in (False, {"backend": "aot_eager"}):
            with pytest.raises(ValueError, match="modifies one of its inputs in place"):
                _run_small("mse", compile, inplace=True, steps=1)


class _Counted(torch.nn.Module):
    """A block that counts its calls in a buffer and reads the count (or a BatchNorm's statistics,
    written and not read again)."""

    def __init__(self, count: str | None):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.register_buffer("n", torch.ones(2))
        self.count = count  # None: no count; else how it is written: in place, through a view, by item

    def forward(self, x):
        x = self.norm(x)
        if self.count is None:
            return x + torch.tanh(self.fc(x))
        if self.count == "in place":
            self.n += 1
        elif self.count == "through a view":
            self.n[0] += 1
        else:
            self.n[0] = self.n[0] + 1
        return x + torch.tanh(self.fc(x)) / self.n[0]


def test_a_buffer_written_then_read_in_a_compiled_unit_is_refused():
    """Note [a buffer written, then read, in a compiled unit]: torch's AOTAutograd gets the gradient
    of such a unit wrong; it is refused, naming the unit and the buffer. BatchNorm's statistics,
    written in place and not read again, compile, equal to the eager step."""
    from reference import rel_err

    def run(count: str | None, compile) -> dict:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), _Counted(count), torch.nn.Linear(6, 2))
        apply, params = sf.functionalize(model, units=r"1")
        step = sf.train_step(lambda p, b: torch.nn.functional.mse_loss(apply(p, b[0]), b[1]), sf.optim.adamw(1e-2),
                             sf.mesh(dp=-1), compile=compile)
        state = step.init(params)
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            state, _ = step(state, (torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)))
        return sf.gather(state.params)

    for count in ("in place", "through a view", "by item"):
        _fresh_dynamo()
        with pytest.raises(NotImplementedError, match=r"unit '1' writes its input 'n' in place .* then reads it") as e:
            run(count, {"backend": "aot_eager"})
        assert "compile=False" in str(e.value), count
    eager, compiled = run(None, False), run(None, {"backend": "aot_eager"})
    assert max(rel_err(a, b) for a, b in zip(optree.tree_leaves(compiled), optree.tree_leaves(eager))) < 1e-6


def rank_tp_compiled(name: str, axes: dict, options: dict, steps: int = 4) -> dict:
    """`steps` AdamW steps of `name` on a (dp, tp) mesh with the ready rules, eager and compiled
    (aot_eager); the parameters, the losses, the graphs after each step, and the gloo collectives
    of the last step (torch's profiler: what ran, wherever it was issued)."""
    import collections
    import warnings

    import test_tp as tpt
    from torch.profiler import profile

    from reference import rel_err

    mesh = sf.mesh(**axes)
    dp_axis = next(iter(axes))
    dp, dp_rank = mesh.size(0), mesh.get_local_rank(dp_axis)
    out = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
        counters = _fresh_dynamo()
        for compile in (False, {"backend": "aot_eager"}):
            apply, params = sf.functionalize(tpt._model(name), units=tpt.UNITS[name])
            specs = sf.specs(params, mesh, rules=tpt.RULES[name], default=sf.P(dp_axis))

            def loss_fn(p, ids):
                return tpt._loss(name, apply(p, ids) if name == "gpt" else apply(p, input_ids=ids, labels=ids, use_cache=False), ids)

            step = sf.train_step(loss_fn, sf.optim.adamw(tpt.LR, eps=tpt.EPS, weight_decay=tpt.WD), mesh, specs=specs,
                                 compile=compile, **options)
            state = step.init(params)
            losses, graphs = [], []
            for s in range(steps):
                ids = tpt._batch(s, tpt.PER_RANK * dp).chunk(dp)[dp_rank]
                with profile() if s == steps - 1 else contextlib.nullcontext() as prof:
                    state, metrics = step(state, ids)
                losses.append(metrics["loss"].item())
                graphs.append(_graphs(counters))
            ran = collections.Counter(e.name for e in prof.events() if e.name.startswith("gloo:"))
            out[bool(compile)] = (sf.to_state_dict(sf.gather(state.params), apply), losses, graphs, ran)
    (eager, le, _, ran_eager), (compiled, lc, graphs, ran_compiled) = out[False], out[True]
    return dict(params=max(rel_err(compiled[k], v) for k, v in eager.items()),
                loss=max(abs(a - b) / abs(b) for a, b in zip(lc, le)), graphs=graphs,
                ran_eager=dict(ran_eager), ran_compiled=dict(ran_compiled))


BF16 = {"mixed_precision": sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


@pytest.mark.parametrize("world,axes,name,options,more", [
    (2, dict(dp=1, tp=2), "gpt", {}, {}),
    (2, dict(dp=1, tp=2), "gpt", BF16, {}),
    (2, dict(dp=1, tp=2), "gpt2", {}, {}),
    (2, dict(dp=1, tp=2), "llama_sdpa", {}, {"gloo:all_reduce": 6, "gloo:all_gather": 6}),
    (4, dict(dp=2, tp=2), "gpt", {"remat": True, "accumulation_steps": 2}, {"gloo:all_reduce": 4}),
])
def test_compiled_units_on_a_tensor_parallel_mesh_equal_the_eager_step(pools, world, axes, name, options, more):
    """4 AdamW steps on a (dp, tp) mesh with the ready rules, compiled units against the eager step:
    the same parameters and losses; the first step eager (it watches for fallback gathers), then one
    graph for the identical blocks, no graph break and no recompile. The collectives that ran in the
    last step (torch's profiler, wherever issued): the eager step's, plus `more` where the partial
    sums that DTensor keeps in a compiled backward are reduced where its ops need them (Llama's
    attention; remat's recompute), as measured (Note [compiled units])."""
    if name != "gpt":
        pytest.importorskip("transformers", reason="the Hugging Face cases build tiny transformers models")
    for r in pools(world).run(rank_tp_compiled, name, axes, options):
        assert r["params"] < 1e-5 and r["loss"] < 1e-5, r
        assert r["graphs"] == [(0, 0), (1, 0), (1, 0), (1, 0)], r
        expected = dict(r["ran_eager"])
        for k, n in more.items():
            expected[k] = expected.get(k, 0) + n
        assert r["ran_compiled"] == expected, r


def rank_to_local_compiled() -> dict:
    """The stacked experts of `test_tp` (a module calling `.to_local()` on its leaf, whole on tp),
    compile=True: served in the eager first step, then warned of, the units staying eager; the
    parameters as one process's."""
    import copy
    import warnings

    import test_tp as tpt

    mesh = sf.mesh(dp=2, tp=2)
    dp_rank = mesh.get_local_rank(0)
    torch.manual_seed(0)
    model = tpt._MoE()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    apply, params = sf.functionalize(model, units=r"experts")
    rules = [(r"out\.weight", sf.P("tp", None)), (r"out\.bias", sf.P("tp"))]
    counters = _fresh_dynamo()
    step = sf.train_step(lambda p, b: torch.nn.functional.mse_loss(apply(p, b[0]), b[1]), sf.optim.sgd(0.1), mesh,
                         specs=sf.specs(params, mesh, rules=rules), compile={"backend": "aot_eager"})
    state = step.init(params)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
            state, _ = step(state, (x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]))
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
    full = sf.to_state_dict(sf.gather(state.params), apply)
    return dict(err=max(tpt._rel(full[k], v) for k, v in ref.state_dict().items()), graphs=_graphs(counters),
                warned=[str(w.message) for w in seen if issubclass(w.category, sf.FallbackWarning)])


def test_a_model_taking_local_tensors_of_tp_leaves_runs_eager_when_compiled_and_says_so(pools):
    for r in pools(4).run(rank_to_local_compiled):
        assert r["err"] < 1e-5 and r["graphs"] == (0, 0), r
        assert len(r["warned"]) == 1 and "module holding no split leaf) took the local tensor" in r["warned"][0], r
        assert "units run eager on this mesh" in r["warned"][0], r


def rank_tp_new_length(dynamic: bool | None) -> dict:
    """Hugging Face Llama on (dp=1, tp=2), compiled, at sequence lengths 8, 8, 12: a new length is
    a new graph (static shapes there), equal to the eager step; `dynamic=True` is refused."""
    import warnings

    import test_tp as tpt

    from reference import rel_err

    mesh = sf.mesh(dp=1, tp=2)
    out: dict = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
        counters = _fresh_dynamo()
        for compile in (False, {"backend": "aot_eager"} if dynamic is None else {"backend": "aot_eager", "dynamic": dynamic}):
            apply, params = sf.functionalize(tpt._model("llama"), units=tpt.UNITS["llama"])
            specs = sf.specs(params, mesh, rules=tpt.RULES["llama"])
            try:
                step = sf.train_step(lambda p, ids: apply(p, input_ids=ids, labels=ids, use_cache=False).loss,
                                     sf.optim.adamw(tpt.LR, eps=tpt.EPS, weight_decay=tpt.WD), mesh, specs=specs, compile=compile)
            except NotImplementedError as e:
                return dict(refused=str(e))
            state = step.init(params)
            graphs = []
            for s, length in enumerate((8, 8, 12)):
                ids = torch.randint(0, tpt.VOCAB, (2, length), generator=torch.Generator().manual_seed(s))
                state, _ = step(state, ids)
                graphs.append(_graphs(counters))
            out[bool(compile)] = (sf.to_state_dict(sf.gather(state.params), apply), graphs)
    (eager, _), (compiled, graphs) = out[False], out[True]
    return dict(params=max(rel_err(compiled[k], v) for k, v in eager.items()), graphs=graphs)


def test_a_new_sequence_length_on_a_tensor_parallel_mesh_is_a_new_graph(pools):
    """Dynamo's automatic dynamic shapes (at a frame's second shape) would fail in DTensor's sharding
    propagation on symbolic sizes: on a tp mesh the units compile with static shapes."""
    pytest.importorskip("transformers", reason="the case builds a tiny transformers Llama")
    for r in pools(2).run(rank_tp_new_length, None):
        assert r["params"] < 1e-5, r
        assert r["graphs"] == [(0, 0), (1, 0), (2, 0)], r
    for r in pools(2).run(rank_tp_new_length, True):
        assert "'dynamic': True" in r["refused"] and "tensor-parallel mesh" in r["refused"], r


def test_compile_warns_when_no_unit_forward_runs():
    """Units whose forward the model never calls (the parent calls their children) have nothing to
    compile: compile=True would compile nothing; it says so. (Containers, which have no forward at
    all, are not units: Note [containers are not units].)"""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return x + self.fc(x)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                x = x + b.fc(x)
            return x.pow(2).mean()

    torch.manual_seed(0)
    apply, params = sf.functionalize(Net(), units=r"blocks\.\d+")
    step = sf.train_step(lambda p, x: apply(p, x), sf.optim.sgd(0.1), sf.mesh(dp=-1), compile={"backend": "aot_eager"})
    state = step.init(params)
    with pytest.warns(UserWarning, match=r"compiled nothing in this step: no unit's forward ran \(units \['blocks\.0', 'blocks\.1'\]\)"):
        state, _ = step(state, torch.randn(3, 4))
    state, _ = step(state, torch.randn(3, 4))  # said once


# -- compile="step": the whole step as one graph --------------------------------------------------

class _WithUnusedHead(torch.nn.Module):
    """The test GPT and a head no loss reaches: torch.optim skips it (no weight decay, no moments),
    and so must a step whose graph never reads it (Note [leaves without a gradient])."""

    def __init__(self):
        super().__init__()
        self.gpt = make_model("gpt")
        self.unused = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.gpt(x)


STEP_CASES = {  # option -> train_step keywords (besides strategy)
    "plain": {},
    # a head no loss reaches, a frozen block, clipping and accumulation at once
    "options": {"accumulation_steps": 2, "max_grad_norm": 0.05, "frozen": r"gpt\.blocks\.0\..*"},
    # bf16 compute, fp32 reductions (the gather's own backward: Note [mixed precision in the graph])
    "bf16": {"mixed_precision": sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
    # each block's forward checkpointed in the graph (Note [remat in the graph])
    "remat": {"remat": True, "mixed_precision": sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
    # bf16 compute and reductions, bf16 buffers
    "bf16_all": {"mixed_precision": sf.MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)},
}


def rank_step_graph_against_eager(strategy: str, case: str, backend: str) -> dict:
    """5 AdamW steps eager, then the same with compile="step": the parameters, the losses, the graphs
    compiled, and the gathers and reductions shardfn itself issued in the steps the graph ran."""
    import warnings

    from shardfn import _collectives as C
    from reference import local_batch, rel_err

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
        _fresh_dynamo()
        for compile in (False, {"step": True, "backend": backend}):
            if case == "options":
                torch.manual_seed(0)
                apply, params = sf.functionalize(_WithUnusedHead(), units=r"gpt\.blocks\.\d+")
            else:
                apply, params = _gpt()
            kw = STEP_CASES[case]
            mesh = sf.mesh(replicate=2, shard=-1) if strategy == "hybrid_shard" else sf.mesh(dp=-1)
            step = sf.train_step(make_loss_fn("gpt", apply), sf.optim.adamw(**OPT), mesh, strategy=strategy,
                                 compile=compile, **kw)
            state = step.init(params)
            losses, sent = [], {}
            for i in range(5):
                C.STATS.reset()
                state, metrics = step(state, local_batch(global_batch("gpt", i, world, per_rank=2 * kw.get("accumulation_steps", 1)), rank, world))
                losses.append(metrics["loss"].item())
                if i > 0:
                    sent = {k: v for k, v in C.STATS.calls.items() if v}
            out[bool(compile)] = (sf.to_state_dict(sf.gather(state.params), apply), losses, sent,
                                  step.core.step_graph.graphs if compile else 0)
    (eager, le, _, _), (compiled, lc, sent, graphs) = out[False], out[True]
    return dict(params=max(rel_err(compiled[k], v) for k, v in eager.items()),
                loss=max(abs(a - b) / abs(b) for a, b in zip(lc, le)), graphs=graphs, sent=sent,
                # functional collectives the graphs issued and never waited for (torch's registry)
                unwaited=torch._C._distributed_c10d._get_work_registry_size(),
                head_kept=case != "options" or torch.equal(compiled["unused.weight"], eager["unused.weight"]))


@pytest.mark.parametrize("world,strategy,case", [(2, "full_shard", "plain"), (3, "full_shard", "options"),
                                                 (2, "shard_grad_op", "options"), (3, "no_shard", "plain"),
                                                 (3, "full_shard", "bf16"), (2, "full_shard", "bf16_all"),
                                                 (2, "no_shard", "bf16_all"), (4, "hybrid_shard", "bf16"),
                                                 (3, "shard_grad_op", "remat")])
def test_the_step_as_one_graph_equals_the_eager_step(pools, world, strategy, case):
    """compile="step" (Note [the step as one graph]): after its first, eager, step, the forward, the
    gathers, the backward and the reduce-scatters run as one compiled graph; 5 AdamW steps equal the
    eager step's, a head no loss reaches is skipped as eagerly, one graph is compiled, and shardfn's
    own collectives in the graph's steps are the metrics' all-reduce (and the all-reduce of the
    leaves whole on every rank under no_shard) alone: the gathers and reduce-scatters are the graph's."""
    for r in pools(world).run(rank_step_graph_against_eager, strategy, case, "aot_eager"):
        assert r["params"] < 1e-5 and r["loss"] < 1e-5, r
        assert r["graphs"] == 1 and r["head_kept"] and r["unwaited"] == 0, r
        assert set(r["sent"]) == {"all_reduce"}, r


def test_the_step_as_one_graph_with_inductor(pools):
    """The same with Inductor's C++ code (its fused sums round differently: see the compiled units'
    test above)."""
    for r in pools(2).run(rank_step_graph_against_eager, "full_shard", "plain", "inductor"):
        assert r["params"] < 3e-5 and r["loss"] < 1e-5, r
        assert r["graphs"] == 1, r


def test_the_step_as_one_graph_refuses_what_it_does_not_run_yet():
    apply, params = _gpt()
    loss_fn = make_loss_fn("gpt", apply)
    mesh = sf.mesh(dp=-1)
    assert _compiled.compile_options("step", "x") == {"fullgraph": True, "step": True}
    for kw, what in [(dict(offload="cpu"), "offload")]:
        with pytest.raises(NotImplementedError, match=f'compile="step" .* does not run with {what}'):
            sf.train_step(loss_fn, sf.optim.adamw(**OPT), mesh, compile="step", **kw)
    with pytest.raises(NotImplementedError, match="takes the torch.compile options backend and dynamic"):
        sf.train_step(loss_fn, sf.optim.adamw(**OPT), mesh, compile={"step": True, "mode": "max-autotune"}).init(params)
    step = sf.train_step(loss_fn, sf.optim.adamw(**OPT), mesh, compile="step")
    state = step.init(params)
    with pytest.raises(NotImplementedError, match="sf.estimate_memory replays the unit schedule"):
        sf.estimate_memory(step, params, global_batch("gpt", 0, 1))
    del state


def _step_graph_peak(remat: bool) -> tuple[int, float]:
    """(the measured peak growth of a compile="step" step, its loss) for a GPT whose activations
    outweigh its parameters (4 blocks, 256 tokens)."""
    from shardfn._peak import step_peak
    from shardfn.models import GPT, GPTConfig

    torch.manual_seed(0)
    apply, params = sf.functionalize(GPT(GPTConfig(vocab=64, block_size=256, n_layer=4, n_head=2, d=64)), units=r"blocks\.\d+")

    def loss_fn(p, b):
        return torch.nn.functional.cross_entropy(apply(p, b[:, :-1]).reshape(-1, 64), b[:, 1:].reshape(-1))

    step = sf.train_step(loss_fn, sf.optim.sgd(0.1), sf.mesh(dp=-1), compile={"step": True, "backend": "aot_eager"}, remat=remat)
    batch = torch.randint(0, 64, (4, 257), generator=torch.Generator().manual_seed(1))
    state = step.init(params)
    for _ in range(2):  # the second compiles the graph
        state, metrics = step(state, batch)
    section = step_peak(step, state.params, batch)
    assert step.core.step_graph.graphs == 1
    return section.peak - section.start, metrics["loss"].item()


def _step_graph_peaks() -> tuple:
    return _step_graph_peak(False), _step_graph_peak(True)


def test_remat_in_the_step_graph_recomputes_what_the_units_computed():
    """Note [remat in the graph]: with remat each block's forward is checkpointed inside the graph,
    and the compiler recomputes its activations in the backward: the step's measured peak falls to
    well under half (18.3 MB to 6.4 MB when written), with the same loss. In a process of its own:
    after these compiles, every later compile of the process ran about 3x slower."""
    from shardfn._pool import RankPool

    pool = RankPool(1, timeout=300, pg_timeout=60, warm=True)
    try:
        ((plain, loss), (remat, loss_remat)), = pool.run(_step_graph_peaks)
    finally:
        pool.close()
    assert loss_remat == loss
    assert remat < 0.5 * plain, (remat, plain)


def test_the_step_graph_with_dynamic_batch_dims_compiles_once():
    """Note [dynamic shapes in the graph]: compile={"step": True, "dynamic": True} marks the batch's
    dims dynamic, not the layout's ints: one graph for six sequence lengths (torch's dynamic=True
    traced the frame twice, with every shard length and offset a symbol), and the losses and
    parameters equal the eager step's."""
    from shardfn.models import GPT, GPTConfig

    out = {}
    for compile in (False, {"step": True, "backend": "aot_eager", "dynamic": True}):
        torch.manual_seed(0)
        apply, params = sf.functionalize(GPT(GPTConfig(vocab=64, block_size=64, n_layer=2, n_head=2, d=32)), units=r"blocks\.\d+")

        def loss_fn(p, b):
            return torch.nn.functional.cross_entropy(apply(p, b[:, :-1]).reshape(-1, 64), b[:, 1:].reshape(-1))

        step = sf.train_step(loss_fn, sf.optim.adamw(**OPT), sf.mesh(dp=-1), compile=compile)
        state, losses = step.init(params), []
        for t in [33, 33, 40, 50, 20, 61]:
            state, metrics = step(state, torch.randint(0, 64, (2, t), generator=torch.Generator().manual_seed(t)))
            losses.append(metrics["loss"].item())
        out[bool(compile)] = (sf.to_state_dict(sf.gather(state.params), apply), losses,
                              step.core.step_graph.graphs if compile else 0)
    (eager, le, _), (compiled, lc, graphs) = out[False], out[True]
    assert graphs == 1
    assert max(abs(a - b) / abs(b) for a, b in zip(lc, le)) < 1e-5, (lc, le)
    assert max(((compiled[k] - v).norm() / v.norm()).item() for k, v in eager.items() if v.is_floating_point()) < 1e-5


def test_a_step_graph_dropped_lets_its_model_go():
    """torch keeps every backend it was given and dynamo its graphs on the code object it compiled:
    a compile="step" step, once dropped, must not keep its model (and every buffer) alive, nor make
    the next step of the process a recompile of a shared frame."""
    import gc
    import weakref

    from reference import OPT

    alive = []
    for i in range(2):
        model = make_model("gpt")
        apply, params = sf.functionalize(model, units=units_of("gpt"))
        step = sf.train_step(make_loss_fn("gpt", apply), sf.optim.adamw(**OPT), sf.mesh(dp=-1), compile={"step": True, "backend": "aot_eager"})
        state = step.init(params)
        for j in range(2):
            state, _ = step(state, global_batch("gpt", j, 1))
        assert step.core.step_graph.graphs == 1
        alive.append(weakref.ref(model))
        del model, apply, params, step, state
        gc.collect()
    assert [r() for r in alive] == [None, None]


def test_what_the_step_graph_cannot_trace_is_refused_with_dynamo_s_reason():
    """A loss_fn that logs (as Hugging Face's loss does with labels=) cannot be one graph: the first
    graph step is a NotImplementedError naming compile=True and dynamo's reason, and leaves the state
    as it was; a Python side effect (a call counter) traces."""
    import logging

    from reference import OPT

    apply, params = _gpt()
    calls = [0]

    def logs(p, b):
        calls[0] += 1
        logging.getLogger("a user's model").warning("once")
        return make_loss_fn("gpt", apply)(p, b)

    step = sf.train_step(logs, sf.optim.adamw(**OPT), sf.mesh(dp=-1), compile={"step": True, "backend": "aot_eager"})
    state = step.init(params)
    state, _ = step(state, global_batch("gpt", 0, 1))  # the first step runs eager
    before = sf.copy(state)
    with pytest.raises(NotImplementedError, match=r'compile="step" could not trace .* compile=True .* Dynamo said'):
        step(state, global_batch("gpt", 1, 1))
    for a, b in zip(optree.tree_leaves(sf.gather(before.params)), optree.tree_leaves(sf.gather(state.params))):
        assert torch.equal(a, b)

    def counts(p, b):
        calls[0] += 1
        return make_loss_fn("gpt", apply)(p, b)

    apply, params = _gpt()
    step = sf.train_step(counts, sf.optim.adamw(**OPT), sf.mesh(dp=-1), compile={"step": True, "backend": "aot_eager"})
    state = step.init(params)
    for i in range(3):
        state, _ = step(state, global_batch("gpt", i, 1))
    assert step.core.step_graph.graphs == 1
