"""Partition specs, spec trees from rules, meshes, and the errors that name the culprit."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import shardfn as sf
from reference import make_model
from shardfn._spec import placements_for, shard_slices, spec_of


@pytest.fixture(scope="module")
def mesh():
    return sf.mesh(dp=-1)  # no distributed environment: a one-rank mesh


def test_p_is_an_immutable_hashable_validated_leaf():
    p = sf.P("dp", None)
    assert repr(p) == "P('dp', None)" and repr(sf.P()) == "P()"
    assert p == sf.P("dp", None) and hash(p) == hash(sf.P("dp", None))
    assert {p: 1}[sf.P("dp", None)] == 1
    assert sf.P(("a", "b"), None).axes == ("a", "b")
    with pytest.raises(TypeError):
        p[0] = "x"  # type: ignore[index]
    with pytest.raises(AttributeError):
        p.extra = 1  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="appears twice"):
        sf.P("dp", "dp")
    with pytest.raises(ValueError, match="entry 0"):
        sf.P(3)
    import optree

    assert optree.tree_leaves({"a": sf.P(), "b": sf.P("dp")}) == [sf.P(), sf.P("dp")]


def test_mesh_one_rank_without_environment(mesh):
    assert mesh.size() == 1 and mesh.mesh_dim_names == ("dp",)
    assert sf.mesh(replicate=1, shard=-1).mesh_dim_names == ("replicate", "shard")
    with pytest.raises(ValueError, match="-1"):
        sf.mesh(a=-1, b=-1, c=-1)  # two: the nodes, then the ranks of a node (Note [node layout])
    with pytest.raises(ValueError, match="ranks"):
        sf.mesh(dp=2)


def test_specs_rules_first_match_wins_and_default(mesh):
    _, params = sf.functionalize(make_model("gpt"))
    tree = sf.specs(params, mesh, rules=[(r".*ln.*", sf.P()), (r".*\.bias", sf.P(None)), (r".*", sf.P("dp"))])
    assert tree["ln_f"]["bias"] == sf.P()  # first rule wins over the bias rule
    assert tree["blocks"]["0"]["fc"]["bias"] == sf.P(None)
    assert tree["wte"]["weight"] == sf.P("dp")
    default = sf.specs(params, mesh)
    assert all(s == sf.P("dp") for s in torch.utils._pytree.tree_leaves(default, is_leaf=lambda x: isinstance(x, sf.P)))
    scalar = sf.specs({"s": torch.zeros(())}, mesh)
    assert scalar["s"] == sf.P()  # the default drops entries a leaf has no dim for


@pytest.mark.parametrize(
    "rules, leaf, match",
    [
        ([(r".*", sf.P("tp"))], torch.zeros(4, 3), r"unknown mesh axis 'tp'"),
        ([(r".*", sf.P("dp", None, None))], torch.zeros(4, 3), r"3 entries for a 2-d tensor"),
        ([(r".*", sf.P("dp"))], torch.zeros(()), r"a scalar cannot be split"),
        ([], torch.zeros(4, dtype=torch.int64), r"dtype torch.int64"),
    ],
)
def test_spec_errors_name_path_shape_spec_and_axes(mesh, rules, leaf, match):
    with pytest.raises(ValueError, match=match) as e:
        sf.specs({"layer": {"w": leaf}}, mesh, rules=rules)
    msg = str(e.value)
    assert "'layer.w'" in msg and str(tuple(leaf.shape)) in msg and "('dp',)" in msg and "P(" in msg


def test_spec_tree_must_match_params(mesh):
    params = {"a": torch.zeros(4), "b": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"no spec for \['b'\]"):
        sf.shard(params, {"a": sf.P("dp")}, mesh)
    with pytest.raises(ValueError, match=r"unknown leaves \['c'\]"):
        sf.shard(params, {"a": sf.P(), "b": sf.P(), "c": sf.P()}, mesh)
    with pytest.raises(ValueError, match="regex"):
        sf.specs(params, mesh, rules=[("(", sf.P())])


def _llama_tree(bias: bool) -> dict:
    """The leaves of a two-layer Llama (q/k/v biases as Qwen2 has them, or none), tied head."""
    def linear(out: int, inp: int, b: bool = False) -> dict:
        return {"weight": torch.zeros(out, inp), **({"bias": torch.zeros(out)} if b else {})}

    layer = {"self_attn": {n: linear(8, 8, bias) for n in ("q_proj", "k_proj", "v_proj")} | {"o_proj": linear(8, 8)},
             "mlp": {"gate_proj": linear(16, 8), "up_proj": linear(16, 8), "down_proj": linear(8, 16)},
             "input_layernorm": {"weight": torch.zeros(8)}}
    return {"model": {"embed_tokens": {"weight": torch.zeros(32, 8)}, "layers": {"0": layer, "1": layer}}}


def test_specs_refuses_rules_that_decide_no_leaf(mesh):
    """A rule with a typo, one without its '.*' prefix and one an earlier rule shadows are named in
    one ValueError, with the nearest paths and the fix; allow_unmatched=True accepts them; the ready
    rules are exempt (a Llama without biases, a tied head) unless none of them matches the tree."""
    _, params = sf.functionalize(make_model("gpt"))
    typo = (r"blocks\.\d+\.fc\.weigth", sf.P())
    no_prefix = (r"fc\.bias", sf.P())
    shadowed = (r"ln_f\.weight", sf.P())
    rules = [(r".*ln.*", sf.P()), typo, no_prefix, shadowed]
    with pytest.raises(ValueError) as e:
        sf.specs(params, mesh, rules=rules)
    msg = str(e.value)
    assert "3 of 4 rules decide no leaf" in msg, msg
    assert f"rule 1 ({typo[0]!r}, P()) matches no leaf" in msg and "'blocks.0.fc.weight'" in msg, msg
    assert f"rule 2 ({no_prefix[0]!r}, P()) matches no leaf" in msg and "'blocks.0.fc.bias'" in msg, msg
    assert "rule 3" in msg and "matches only leaves an earlier rule decides, e.g. 'ln_f.weight'" in msg, msg
    assert "'.*'" in msg and "allow_unmatched=True" in msg, msg
    allowed = sf.specs(params, mesh, rules=rules, allow_unmatched=True)
    assert allowed == sf.specs(params, mesh, rules=rules[:1])
    # Ready rules: idle ones are fine while one of them decides a leaf; a custom rule beside them is not exempt.
    tp = _virtual_mesh(dp=1, tp=2)
    for bias in (False, True):
        tree = sf.specs(_llama_tree(bias), tp, rules=sf.rules.LLAMA)
        assert tree["model"]["layers"]["1"]["mlp"]["down_proj"]["weight"] == sf.P(None, "tp")
    sf.specs(params, tp, rules=sf.rules.GPT)
    n = len(sf.rules.LLAMA)
    with pytest.raises(ValueError, match=rf"1 of {n + 1} rules") as e:
        sf.specs(_llama_tree(False), tp, rules=[*sf.rules.LLAMA, (r".*\.mlp\.gate\.weight", sf.P("tp"))])
    assert f"rule {n} (" in str(e.value) and "'model.layers.1.mlp.gate_proj.weight'" in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="another model's list") as e:
        sf.specs(params, tp, rules=sf.rules.LLAMA)
    assert "rule 0" in str(e.value) and f"rule {n - 1}" in str(e.value), str(e.value)
    assert sf.specs(params, tp, rules=sf.rules.LLAMA, allow_unmatched=True) == sf.specs(params, tp)


def test_p_construction_errors_say_the_fix():
    for bad, match in [
        (lambda: sf.P("dp", "dp"), "appears twice"),
        (lambda: sf.P(("dp", "tp"), "tp"), "appears twice"),
        (lambda: sf.P(("dp", "dp")), "appears twice"),
        (lambda: sf.P(()), "entry 0"),
        (lambda: sf.P(None, ("dp", 3)), "entry 1"),
        (lambda: sf.P(1.5), "a mesh axis name, a tuple of names, or None"),
    ]:
        with pytest.raises(ValueError, match=match):
            bad()
    assert sf.P(("dp",)) == sf.P("dp") and sf.P(["dp", "tp"]) == sf.P(("dp", "tp"))
    assert sf.P(("tp", "dp")) != sf.P(("dp", "tp"))  # the order of a dim's axes is the layout
    assert sf.P("dp", "tp").axes_of(1) == ("tp",) and sf.P(("tp", "dp")).axes_of(0) == ("tp", "dp")


def _virtual_mesh(**axes: int):
    """A mesh of more devices than this process has ranks: placements only, no collectives."""
    from torch.distributed.device_mesh import DeviceMesh

    sf.mesh(dp=-1)  # the process group
    sizes = tuple(axes.values())
    return DeviceMesh("cpu", torch.arange(math.prod(sizes)).view(sizes), mesh_dim_names=tuple(axes), _init_backend=False)


def _torch_split(placements, sizes, coord, n: int) -> list[int]:
    """The rows DTensor gives the rank at `coord`: placements applied in mesh order, as distribute_tensor does."""
    t = torch.arange(n)
    for p, size, c in zip(placements, sizes, coord):
        if p.is_shard() or isinstance(p, _StridedShard):
            t = p._split_tensor(t, size, with_padding=False)[0][c]
    return t.tolist()


def test_shard_slices_is_the_nested_split_first_axis_major():
    sizes = {"dp": 2, "tp": 2}
    at = lambda spec, shape, dp, tp: shard_slices(spec, shape, sizes, {"dp": dp, "tp": tp})  # noqa: E731
    # 8 rows: JAX's layout, chunk index tp * 2 + dp for P(("tp", "dp")), dp * 2 + tp for P(("dp", "tp")).
    assert [at(sf.P(("tp", "dp")), (8,), dp, tp)[0] for dp in (0, 1) for tp in (0, 1)] == [slice(0, 2), slice(4, 6), slice(2, 4), slice(6, 8)]
    assert [at(sf.P(("dp", "tp")), (8,), dp, tp)[0] for dp in (0, 1) for tp in (0, 1)] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    # Uneven, as torch.chunk cuts: 5 rows -> tp halves [0, 3) and [3, 5), each cut by dp.
    assert [at(sf.P(("tp", "dp")), (5, 3), dp, tp) for dp in (0, 1) for tp in (0, 1)] == [
        (slice(0, 2), slice(0, 3)), (slice(3, 4), slice(0, 3)), (slice(2, 3), slice(0, 3)), (slice(4, 5), slice(0, 3))]
    # 7 rows: [0, 4) and [4, 7); axes on two dims cut each dim on its own.
    assert [at(sf.P(("tp", "dp")), (7,), dp, tp)[0] for dp in (0, 1) for tp in (0, 1)] == [slice(0, 2), slice(4, 6), slice(2, 4), slice(6, 7)]
    assert at(sf.P("tp", "dp"), (5, 3), 1, 1) == (slice(3, 5), slice(2, 3))
    assert at(sf.P(None, ("dp", "tp")), (2, 3), 1, 1) == (slice(0, 2), slice(3, 3))  # an empty shard
    assert at(sf.P(), (5, 3), 1, 0) == (slice(0, 5), slice(0, 3))


def test_placements_for_every_spec_match_the_nested_split():
    mesh = _virtual_mesh(dp=2, tp=2)
    S = _StridedShard
    assert placements_for(sf.P(("tp", "dp"), None), mesh, (5, 3)) == (S(0, split_factor=2), Shard(0))
    assert placements_for(sf.P(("dp", "tp")), mesh, (5,)) == (Shard(0), Shard(0))
    assert placements_for(sf.P("tp", "dp"), mesh, (5, 3)) == (Shard(1), Shard(0))
    assert placements_for(sf.P(None, "tp"), mesh) == (Replicate(), Shard(1))
    with pytest.raises(TypeError, match="shape="):
        placements_for(sf.P(("tp", "dp")), mesh)
    # Every spec of one dim over one or two axes (sizes 1-3) or three (sizes 2-3), 0..10 rows: where
    # placements_for answers, DTensor's own split of every rank is the spec's nested split.
    answered = refused = 0
    for axes, choices in ((("dp", "tp"), (1, 2, 3)), (("a", "b", "c"), (2, 3))):
        for sizes in itertools.product(choices, repeat=len(axes)):
            m = _virtual_mesh(**dict(zip(axes, sizes)))
            for k in range(1 if len(axes) == 2 else 3, len(axes) + 1):
                for order in itertools.permutations(axes, k):
                    for n in range(11):
                        spec = sf.P(order)
                        try:
                            pl = placements_for(spec, m, (n,))
                        except NotImplementedError:
                            refused += 1
                            continue
                        answered += 1
                        assert placements_for(spec_of(pl, m, 1), m, (n,)) == pl  # the inverse (up to axes of size 1)
                        for coord in itertools.product(*(range(s) for s in sizes)):
                            box = shard_slices(spec, (n,), dict(zip(axes, sizes)), dict(zip(axes, coord)))[0]
                            assert _torch_split(pl, sizes, coord, n) == list(range(box.start, box.stop)), (spec, sizes, coord, n)
    assert answered > 10 * refused > 0
    # (dp=2, tp=2): every row count is answered; 9 rows at (dp=4, tp=2) cannot be said by DTensor.
    assert all(placements_for(sf.P(("tp", "dp")), mesh, (n,)) for n in range(64))
    with pytest.raises(NotImplementedError, match=r"leaf 'w' \(shape \(9, 3\)\).*dim 0.*mesh order"):
        sf.specs({"w": torch.zeros(9, 3)}, _virtual_mesh(dp=4, tp=2), rules=[("w", sf.P(("tp", "dp")))])


def test_spec_errors_on_a_two_axis_mesh():
    mesh = _virtual_mesh(dp=2, tp=2)
    for spec, match in [(sf.P(("dp", "sp")), "unknown mesh axis 'sp'"), (sf.P(None, None, "tp"), "3 entries for a 2-d tensor")]:
        with pytest.raises(ValueError, match=match) as e:
            sf.specs({"w": torch.zeros(5, 3)}, mesh, rules=[("w", spec)])
        assert "'w'" in str(e.value) and "(5, 3)" in str(e.value) and "('dp', 'tp')" in str(e.value) and repr(spec) in str(e.value)
