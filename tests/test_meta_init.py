"""Meta-device init: a module built under `sf.meta_device()`, its recorded construction replayed.

`sf.shard(..., init=model)` and `step.init(params)` give exactly the values (parameters and
buffers) of the same model built eagerly in one process with the same seed, at world sizes 1, 2
and 3, for models whose construction does more than `reset_parameters()`: a plain torch model with
a tied head, Hugging Face Llama, GPT-2, T5, ViT, DINOv2, CLIP and ConvNeXt, a nanoGPT-style model
that re-initializes itself with `self.apply(self._init_weights)`, a random draw in `__init__` that
is no parameter, a cast to bfloat16 at the end of construction, tensors made from data
(`torch.tensor`, numpy, `.data[...] =`, `sparse_`), `trunc_normal_` (replayed whole), values read
into Python (computed while recording), deep copies and an orthogonal parametrization. The block
leaves the generator where the eager build does (a draw after it, and a second block, get eager's
values). A rank seeded otherwise than rank 0 is refused where the construction read a drawn value.
A refusal that the construction catches still refuses the module at replay. What cannot be replayed is refused while
recording or before any value is given, naming the construction code. A plain meta-device model is
accepted where values do not matter (`init="empty"`: uninitialized shards laid out as a real
model's). Memory: on a model whose whole size exceeds what the check allows, each rank's peak RSS
growth stays within its shards plus one unit plus a margin.
"""

from __future__ import annotations

import copy
import gc
import re

import numpy as np
import optree
import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardfn as sf
from shardfn._pool import RankPool


class Net(nn.Module):
    """Plain torch layers; custom init outside reset_parameters; a draw that is no parameter; a tied head."""

    def __init__(self, vocab: int = 11, d: int = 7, n: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.noise = torch.randn(5)  # not a parameter: it shifts every later draw
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d + 1), nn.GELU(), nn.Linear(2 * d + 1, d)) for _ in range(n))
        nn.init.orthogonal_(self.blocks[0][1].weight)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


class FromData(nn.Module):
    """Tensors made from data and initializers that branch on what they draw: a buffer and a
    parameter from Python numbers (CLIP's logit_scale), a slice set through `.data`, `sparse_`, a
    copy from numpy, `trunc_normal_` in both of its ways of drawing (whole, a view, overwritten);
    values read into Python (drop-path rates, a branch on a drawn value); deep copies."""

    def __init__(self, d: int = 5):
        super().__init__()
        rates = torch.linspace(0, 0.1, 3).tolist()
        self.register_buffer("mean", torch.tensor([0.5, -1.0, 2.0, 0.25, 3.0]))
        self.scale = nn.Parameter(torch.tensor(2.66))
        self.pos = nn.Parameter(torch.empty(4, d))
        nn.init.trunc_normal_(self.pos, std=0.02)  # rejection from normal draws
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.blocks[0].weight.data[:, 0] = 1.0
        nn.init.sparse_(self.blocks[1].weight, 0.5)
        with torch.no_grad():
            self.blocks[1].bias.copy_(torch.from_numpy(np.arange(d, dtype=np.float32)))
        nn.init.trunc_normal_(self.blocks[2].weight[:, :2], mean=0.0, std=1.0, a=0.0, b=0.1)  # uniform draws
        nn.init.trunc_normal_(self.blocks[2].bias)  # overwritten: only its draws matter
        self.blocks[2].bias.data.fill_(0.125)
        nn.init.constant_(self.blocks[0].bias, rates[1])
        self.twin = copy.deepcopy(self.blocks[0])  # nn.Transformer's clones
        self.stats = nn.Module()
        base = torch.randn(6)
        self.stats.register_buffer("a", base[:4])
        self.stats.register_buffer("b", base[2:])
        self.stats_copy = copy.deepcopy(self.stats)
        self.stats_copy.a.mul_(10)  # its b changes too: one copy of the storage, as in an eager deep copy
        self.head = nn.Linear(d, 2)  # after them: the generator advanced as in the eager build
        if self.pos.sum() > 0:
            self.head.bias.data.mul_(2)

    def forward(self, x):
        h = (x + self.pos.sum(0) - self.mean) * self.scale
        for b in self.blocks:
            h = h + b(h)
        return self.head(h + self.twin(h) + self.stats_copy.b[0])


def build(kind: str) -> nn.Module:
    if kind == "data":
        return FromData()
    if kind == "net":
        return Net()
    if kind == "net-bf16":
        return Net().to(torch.bfloat16)
    if kind == "orthogonal":  # a parametrization: right_inverse reads a value (allclose), a buffer set from it
        return nn.Sequential(*(nn.utils.parametrizations.orthogonal(nn.Linear(4, 4)) for _ in range(2)))
    if kind == "gpt":  # nanoGPT style: self.apply(self._init_weights) in __init__, a causal-mask buffer
        from shardfn.models import GPT, GPTConfig

        return GPT(GPTConfig(vocab=11, block_size=4, n_layer=2, n_head=1, d=8))
    import transformers as T

    if kind == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=53, hidden_size=40, intermediate_size=52, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                                max_position_embeddings=16))
    if kind == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                              bos_token_id=0, eos_token_id=0))
    if kind == "t5":
        return T.T5ForConditionalGeneration(T.T5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2))
    if kind == "vit":  # trunc_normal_
        return T.ViTForImageClassification(T.ViTConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                                                       intermediate_size=12, image_size=4, patch_size=2, num_labels=3))
    if kind == "dinov2":  # trunc_normal_, layer scale
        return T.Dinov2Model(T.Dinov2Config(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
                                            image_size=4, patch_size=2))
    if kind == "clip":  # logit_scale from a Python number, position ids
        tiny = dict(hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2, projection_dim=4)
        return T.CLIPModel(T.CLIPConfig(
            text_config=dict(vocab_size=20, max_position_embeddings=6, bos_token_id=0, eos_token_id=1, pad_token_id=1, **tiny),
            vision_config=dict(image_size=4, patch_size=2, **tiny), projection_dim=4))
    if kind == "convnext":  # drop-path rates read into Python
        return T.ConvNextModel(T.ConvNextConfig(num_stages=2, hidden_sizes=[4, 8], depths=[1, 1], drop_path_rate=0.1))
    raise ValueError(kind)


UNITS = {"data": r"blocks\.\d+", "convnext": r"encoder\.stages\.\d+", "vit": r"vit\.layers\.\d+",
         "dinov2": r"encoder\.layer\.\d+", "clip": r"(text|vision)_model\.encoder\.layers\.\d+",
         "net": r"blocks\.\d+", "net-bf16": r"blocks\.\d+", "gpt": r"blocks\.\d+", "llama": r"model\.layers\.\d+",
         "gpt2": r"transformer\.h\.\d+", "t5": r"(en|de)coder\.block\.\d+", "orthogonal": r"\d+"}


def _differ(model: nn.Module, got: dict, want: dict) -> list[str]:
    got = {**{k: v for k, v in model.state_dict().items() if k not in got}, **got}  # buffers: the module's
    return sorted(k for k in want if k not in got or got[k].dtype != want[k].dtype or not torch.equal(got[k].cpu(), want[k]))


def rank_equal_to_eager() -> dict:
    out = {}
    mesh = sf.mesh(dp=-1)
    for kind in UNITS:
        torch.manual_seed(0)
        want = {k: v.clone() for k, v in build(kind).state_dict().items()}
        want_next = torch.randn(3)
        torch.manual_seed(0)
        with sf.meta_device():
            model = build(kind)
        # The block leaves the generator where the eager build does.
        out[kind, "generator"] = [] if torch.equal(torch.randn(3), want_next) else ["the generator after the block"]
        apply, params = sf.functionalize(model, units=UNITS[kind])
        torch.manual_seed(123)  # later draws do not change the values
        sharded = sf.shard(params, sf.specs(params, mesh), mesh, init=model)
        out[kind, "shard"] = _differ(model, sf.to_state_dict(sf.gather(sharded)), want)
        step = sf.train_step(lambda p, b: p, sf.optim.sgd(0.1), mesh, apply=apply)
        state = step.init(params)
        out[kind, "init"] = _differ(model, sf.to_state_dict(sf.gather(state.params)), want)
        out[kind, "buffers"] = all(not b.is_meta for b in model.buffers())
    out["empty"] = rank_empty(mesh)
    # Two blocks one after the other (a GAN's two models): the second draws where the first ended.
    torch.manual_seed(0)
    eager = [nn.Linear(4, 4), nn.Linear(4, 4), torch.randn(2)]
    torch.manual_seed(0)
    built = []
    for _ in range(2):
        with sf.meta_device():
            built.append(nn.Linear(4, 4))
    after = torch.randn(2)
    out["two", "blocks"] = [] if torch.equal(after, eager[2]) else ["the generator after both blocks"]
    for i, lin in enumerate(built):
        _, params = sf.functionalize(lin)
        got = sf.gather(sf.shard(params, sf.specs(params, mesh), mesh, init=lin))
        out["two", "blocks"] += [f"{i}.{k}" for k in got if not torch.equal(got[k], getattr(eager[i], k))]
    torch.manual_seed(dist.get_rank())  # last: rank 0 goes on alone where another rank refuses
    with sf.meta_device():
        model = ReadsValue()
    _, params = sf.functionalize(model)
    try:
        sf.shard(params, sf.specs(params, mesh), mesh, init=model)
        out["seeds"] = None
    except ValueError as e:
        out["seeds"] = str(e)
    return out


def _layout(tree) -> list:
    return [(tuple(x.shape), x.placements, tuple(x.to_local().shape), x.to_local().device.type) for x in optree.tree_leaves(tree)]


def rank_empty(mesh) -> bool:
    """Where values do not matter, a plain meta-device model gives uninitialized shards laid out as
    a real model's would be, and real buffers."""
    want_apply, want = sf.functionalize(Net(), units=r"blocks\.\d+")
    want_shard = _layout(sf.shard(want, sf.specs(want, mesh), mesh))
    want_init = _layout(sf.train_step(lambda p, b: p, sf.optim.sgd(0.1), mesh, apply=want_apply).init(want).params)
    got = []
    for what in ("shard", "init"):
        with torch.device("meta"):
            model = Net()
            model.register_buffer("mask", torch.ones(3))
        apply, params = sf.functionalize(model, units=r"blocks\.\d+")
        if what == "shard":
            got.append(_layout(sf.shard(params, sf.specs(params, mesh), mesh, init="empty")) == want_shard)
        else:
            step = sf.train_step(lambda p, b: p, sf.optim.sgd(0.1), mesh, apply=apply)
            got.append(_layout(step.init(params, init="empty").params) == want_init)
        got.append(not model.mask.is_meta and model.mask.shape == (3,))
    return all(got)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_equal_to_eager_build(pools, world):
    results = pools(world).run(rank_equal_to_eager)
    for r in results:
        assert r.pop("empty")
        seeds = r.pop("seeds")
        if r is results[0]:
            assert seeds is None, seeds
        else:  # seeded otherwise, and the construction read a drawn value
            assert re.search("another CPU generator state than rank 0.*read a drawn", seeds), seeds
        assert all(v == [] for k, v in r.items() if k[1] != "buffers"), r
        assert all(v for k, v in r.items() if k[1] == "buffers")


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """The in-process checks below make a one-process group; later test modules expect none."""
    was = dist.is_initialized()
    yield
    if not was and dist.is_initialized():
        dist.destroy_process_group()


def _init(model: nn.Module) -> None:
    _, params = sf.functionalize(model)
    mesh = sf.mesh(dp=-1)
    sf.shard(params, sf.specs(params, mesh), mesh, init=model)


def test_plain_meta_is_refused():
    """A module built under plain torch.device("meta") has no record of what its construction did:
    refused unless the caller says values do not matter (init="empty")."""
    with torch.device("meta"):
        net = Net()
    apply, params = sf.functionalize(net)
    mesh = sf.mesh(dp=-1)
    with pytest.raises(ValueError, match=r"with sf.meta_device.*init=\"empty\""):
        sf.shard(params, sf.specs(params, mesh), mesh, init=net)
    with pytest.raises(ValueError, match="init=model"):
        sf.shard(params, sf.specs(params, mesh), mesh)
    step = sf.train_step(lambda p, b: p, sf.optim.sgd(0.1), mesh, apply=apply)
    with pytest.raises(ValueError, match=r"plain torch.device\(\"meta\"\).*init=\"empty\""):
        step.init(params)
    with pytest.raises(ValueError, match="init='empty'"):
        sf.shard(params, sf.specs(params, mesh), mesh, init="zeros")
    with pytest.raises(ValueError, match="init='empty'"):
        step.init(params, init="zeros")
    with pytest.raises(ValueError, match=r"init='empty'.* or nothing.*; got a Net$"):  # its type, not its repr
        step.init(params, init=net)


class ReadsValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        if self.w.sum() > 0:  # data-dependent construction
            self.w.data.mul_(2)


class SizeFromValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.register_buffer("positive", torch.nonzero(self.w > 0))


class Seeds(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.w = nn.Parameter(torch.randn(3))


class Uninitialized(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))


class ToNumpy(nn.Module):
    """A parametrization whose right_inverse is refused: torch's ParametrizationList catches it."""

    def forward(self, x):
        return x

    def right_inverse(self, x):
        x.detach().numpy()
        return x


class OwnGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))
        nn.init.trunc_normal_(self.w, generator=torch.Generator().manual_seed(0))


def test_what_cannot_be_replayed_is_refused():
    """Refused while recording, naming the construction code and the operation."""
    with pytest.raises(NotImplementedError, match=r"in SizeFromValues.__init__ \(.*test_meta_init.py:\d+\): "
                                                  r"aten.nonzero.default makes a tensor whose size depends on values"), \
            sf.meta_device():
        SizeFromValues()
    with pytest.raises(NotImplementedError, match=r"\.numpy\(\) of a recorded tensor"), sf.meta_device():
        nn.Linear(2, 2).weight.detach().numpy()
    with pytest.raises(NotImplementedError, match=r"in Seeds.__init__ .*random generator's state"), sf.meta_device():
        Seeds()
    with pytest.raises(NotImplementedError, match=r"in OwnGenerator.__init__ .*nn.init.trunc_normal_ draws from an "
                                                  r"explicit generator="), sf.meta_device():
        OwnGenerator()
    with sf.meta_device():
        m = Uninitialized()
    with pytest.raises(NotImplementedError, match=r"\['w'\] would hold uninitialized memory"):
        _init(m)
    with pytest.raises(ValueError, match="do not nest"), sf.meta_device(), sf.meta_device():
        pass
    with sf.meta_device():  # the refusal is caught by the construction: refused at replay, with its message
        caught = nn.utils.parametrize.register_parametrization(nn.Linear(2, 2), "weight", ToNumpy())
    with pytest.raises(NotImplementedError, match=r"in ToNumpy.right_inverse .*\.numpy\(\) of a recorded tensor.*"
                                                  r"caught by its construction code"):
        _init(caught)
    with pytest.raises(ValueError, match="sf.functionalize is called inside an sf.meta_device"), sf.meta_device():
        sf.functionalize(nn.Linear(2, 2))


def test_changes_after_the_block_are_refused():
    with sf.meta_device():
        a = nn.Linear(3, 4)
    nn.init.zeros_(a.weight)  # in place, not recorded
    with pytest.raises(ValueError, match="'weight' was changed after the sf.meta_device"):
        _init(a)
    with sf.meta_device():
        b = nn.Linear(3, 4)
    b.to(torch.bfloat16)  # new tensors, not recorded
    with pytest.raises(ValueError, match="'weight' was not made inside the sf.meta_device"):
        _init(b)
    with sf.meta_device():
        c = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="'0.weight' was not made inside.*deep copy.*copy.deepcopy the module inside"):
        _init(copy.deepcopy(c))
    _, params = sf.functionalize(c)
    mesh = sf.mesh(dp=-1)
    with pytest.raises(ValueError, match=r"whole tree it returned \(not a subtree\)"):
        sf.shard({"1": params["1"]}, sf.specs({"1": params["1"]}, mesh), mesh, init=c)


# -- memory --------------------------------------------------------------------------------------
D, LAYERS = 1024, 8  # 8 units of 4 MiB (+ bias): 32 MiB in all


def rank_memory() -> dict:
    world = dist.get_world_size()
    mesh = sf.mesh(dp=-1)
    torch.manual_seed(0)
    with sf.meta_device():
        model = nn.Sequential(*[nn.Linear(D, D) for _ in range(LAYERS)])
        for layer in model:  # data and trunc_normal_ replay within their unit too
            layer.weight.data[:, 0] = 1.0
            layer.register_buffer("scale", torch.tensor([1.0, 2.0]))
            nn.init.trunc_normal_(layer.bias, std=0.02)
    apply, params = sf.functionalize(model, units=r"\d+")
    with sf.meta_device():  # warm-up: the first DTensor calls of a process cost ~30 MB once
        small = nn.Sequential(nn.Linear(8, 8))
    _, small_params = sf.functionalize(small)
    sf.shard(small_params, sf.specs(small_params, mesh), mesh, init=small)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS
    base = _kb("VmHWM")
    sharded = sf.shard(params, sf.specs(params, mesh), mesh, init=model)
    growth = (_kb("VmHWM") - base) * 1024
    local = sum(x.to_local().numel() * 4 for x in optree.tree_leaves(sharded))
    # A check of the values: the first layer's shard equals an eager build's rows.
    torch.manual_seed(0)
    first = nn.Linear(D, D).weight
    first.data[:, 0] = 1.0
    rows = sharded["0"]["weight"].to_local()
    r = dist.get_rank()
    ok = torch.equal(rows, first.detach().chunk(world)[r])
    return dict(growth=growth, local=local, unit=(D * D + D) * 4, model=LAYERS * (D * D + D) * 4, ok=ok)


def _kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


MARGIN = 4 << 20  # allocator and interpreter slack on this machine (see the test's docstring)


def test_peak_memory_is_shards_plus_one_unit(monkeypatch):
    """Peak RSS growth per rank during `sf.shard(init=)` at world size 2: the local shards (half
    the model), one unit's full parameters (the module being initialized, dropped once its shard is
    copied out), and a margin of 4 MiB for the allocator's and interpreter's own growth. With
    `MALLOC_MMAP_THRESHOLD_=65536` every freed unit leaves the RSS, so the high-water mark is
    what was held at once. Holding the whole model (32 MiB) would exceed the bound (16 + 4 + 4).
    Each layer's weight is changed in part after every layer is built (as constructions that rescale
    or patch weights at the end do): that change runs right after its layer is drawn.
    A warm-up call first pays the process's one-time cost of its first DTensor calls."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    with RankPool(2, timeout=120, pg_timeout=60, warm=True) as pool:
        results = pool.run(rank_memory)
    for r in results:
        bound = r["local"] + r["unit"] + MARGIN
        assert r["ok"]
        assert r["model"] > bound, r  # the check would fail a rank that held the model
        assert r["growth"] <= bound, (r, bound)
