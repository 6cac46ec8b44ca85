"""Partition specs, spec trees from rules, meshes, and the errors that name the culprit."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from reference import make_model


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
