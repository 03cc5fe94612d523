"""vsf.tree: optree in vsf's namespace, None as an empty node, key paths, modules as pytrees."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, NamedTuple

import pytest
import torch

from vsf import tree


class Pair(NamedTuple):
    mu: Any
    nu: Any


@tree.register_dataclass
@dataclasses.dataclass
class State:
    mu: Any
    count: Any


@dataclasses.dataclass
class Hyper:
    w: Any
    lr: float


tree.register_dataclass(Hyper, data_fields=["w"])

NESTED = {"opt": [Pair(1, None), State(2, 3)], "b": None, "a": (4, [5])}


def test_leaves_flatten_unflatten_structure():
    assert tree.leaves(NESTED) == [4, 5, 1, 2, 3]  # dict keys sorted, None has no leaves
    leaves, spec = tree.flatten(NESTED)
    assert leaves == [4, 5, 1, 2, 3] and spec.num_leaves == 5
    assert tree.unflatten(spec, [10, 20, 30, 40, 50]) == {
        "opt": [Pair(30, None), State(40, 50)],
        "b": None,
        "a": (10, [20]),
    }
    assert tree.structure(NESTED) == spec
    assert tree.structure(NESTED) != tree.structure({**NESTED, "b": 0})  # None is a node, 0 a leaf
    assert tree.leaves(None) == [] and tree.leaves({"bias": None}) == []


def test_map_keeps_structure_and_none_and_zips_several_trees():
    assert tree.map(lambda x: x * 10, NESTED) == {"opt": [Pair(10, None), State(20, 30)], "b": None, "a": (40, [50])}
    assert tree.map(lambda x, y: x + y, {"a": 1, "b": [2]}, {"a": 10, "b": [20]}) == {"a": 11, "b": [22]}
    with pytest.raises(ValueError):
        tree.map(lambda x, y: x, {"a": 1}, {"b": 1})
    is_pair = lambda x: isinstance(x, Pair)  # noqa: E731
    assert tree.map(lambda p: p.mu, {"p": Pair(1, 2)}, is_leaf=is_pair) == {"p": 1}


def test_map_with_path_and_keystr_both_styles():
    paths = tree.map_with_path(lambda path, x: tree.keystr(path), NESTED)
    assert paths == {
        "opt": [Pair("['opt'][0].mu", None), State("['opt'][1].mu", "['opt'][1].count")],
        "b": None,
        "a": ("['a'][0]", ["['a'][1][0]"]),
    }
    # Every step a name: the dotted style of module parameter names.
    module_style = {"blocks.0.attn.weight": 1, "embed": {"weight": 2}, "s": State(3, 4), "h": Hyper(5, 0.1)}
    assert [tree.keystr(p) for p, _ in tree.leaves_with_path(module_style)] == [
        "blocks.0.attn.weight",
        "embed.weight",
        "h.w",
        "s.mu",
        "s.count",
    ]
    assert [tree.keystr(p) for p, _ in tree.leaves_with_path({1: "x", "k": [7]})] == ["[1]", "['k'][0]"]
    assert tree.keystr(()) == "<root>"
    pairs, spec = tree.flatten_with_path(NESTED)
    assert [leaf for _, leaf in pairs] == tree.leaves(NESTED) and spec == tree.structure(NESTED)


def test_register_dataclass_children_and_metadata():
    leaves, spec = tree.flatten(Hyper(torch.ones(2), 0.1))
    assert len(leaves) == 1 and torch.equal(leaves[0], torch.ones(2))
    doubled = tree.map(lambda x: x * 2, Hyper(torch.ones(2), 0.1))
    assert isinstance(doubled, Hyper) and doubled.lr == 0.1 and torch.equal(doubled.w, torch.full((2,), 2.0))
    assert tree.structure(Hyper(1, 0.1)) != tree.structure(Hyper(1, 0.2))  # metadata is part of the structure
    with pytest.raises(TypeError, match="dataclass"):
        tree.register_dataclass(Pair)
    with pytest.raises(ValueError, match=r"\['nope'\].*fields: \['w', 'lr'\]"):

        @dataclasses.dataclass
        class Other:
            w: Any
            lr: float

        tree.register_dataclass(Other, data_fields=["w", "nope"])


# -- broadcast_prefix ----------------------------------------------------------------------------

VALUES = {"a": {"x": torch.ones(1), "y": torch.ones(2)}, "b": [torch.ones(3), None], "c": Pair(torch.ones(4), None)}
is_int = lambda x: isinstance(x, int)  # noqa: E731


def test_broadcast_prefix_expands_each_prefix_leaf_over_its_subtree():
    assert tree.broadcast_prefix(7, VALUES, is_leaf=is_int) == [7, 7, 7, 7]
    assert tree.broadcast_prefix({"a": 1, "b": 2, "c": 3}, VALUES, is_leaf=is_int) == [1, 1, 2, 3]
    prefix = {"a": {"x": 1, "y": 2}, "b": [3, None], "c": Pair(4, None)}
    assert tree.broadcast_prefix(prefix, VALUES, is_leaf=lambda x: x is None or is_int(x)) == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "prefix, where, found",
    [
        ({"a": 1, "b": 2}, "<root>:", r"expected dict with keys \['a', 'b', 'c'\], found dict with keys \['a', 'b'\]"),
        ({"a": {"x": 1}, "b": 2, "c": 3}, "a:", r"keys \['x', 'y'\], found dict with keys \['x'\]"),
        ({"a": 1, "b": (2, 3), "c": 4}, "b:", "expected list with keys \\[0, 1\\], found tuple"),
        ({"a": 1, "b": [{"z": 2}, 3], "c": 4}, r"\['b'\]\[0\]", r"the leaf tensor\[3\].*has dict \{'z': 2\}"),
        ({"a": 1, "b": 2, "c": State(3, 4)}, "c:", r"expected Pair with keys \['mu', 'nu'\], found State"),
    ],
)
def test_broadcast_prefix_errors_name_the_key_path(prefix, where, found):
    with pytest.raises(ValueError, match=f"shardings is not a prefix of the value tree at {where}.*{found}"):
        tree.broadcast_prefix(prefix, VALUES, is_leaf=is_int, what="shardings")


def test_broadcast_prefix_leaf_over_an_empty_subtree_is_fine():
    assert tree.broadcast_prefix({"a": 1, "b": [2, 3], "c": Pair(4, 5)}, VALUES, is_leaf=is_int) == [1, 1, 2, 4]


# -- modules -------------------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self.mlp(self.norm(self.attn(x))) * scale


def test_from_module_names_and_apply_matches_the_module_forward():
    model = Block().eval()
    params = tree.from_module(model)
    assert sorted(params) == sorted(k for k, _ in model.named_parameters())
    assert "mlp.2.weight" in params and "norm.running_mean" not in params
    assert all(not p.requires_grad for p in params.values())
    assert sorted(tree.from_module(model, buffers=True)) == sorted(
        [k for k, _ in model.named_parameters()] + [k for k, _ in model.named_buffers()]
    )
    x = torch.randn(3, 4)
    assert torch.equal(tree.apply(model, params, x, scale=2.0), model(x, scale=2.0))

    # New params: the oracle is a copy of the module holding them, called directly.
    new = tree.map(lambda p: p * 0.5 + 1, params)
    oracle = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in oracle.named_parameters():
            p.copy_(new[name])
    assert torch.allclose(tree.apply(model, new, x), oracle(x), rtol=0, atol=0)
    assert torch.equal(model(x), tree.apply(model, params, x))  # the module's own weights untouched


def test_apply_refuses_missing_and_unknown_names():
    model = Block()
    params = tree.from_module(model)
    missing = {k: v for k, v in params.items() if k != "attn.bias"}
    with pytest.raises(ValueError, match=r"missing \['attn.bias'\], unknown \[\]"):
        tree.apply(model, missing, torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"missing \[\], unknown \['attn.wieght'\]"):
        tree.apply(model, {**params, "attn.wieght": params["attn.weight"]}, torch.randn(2, 4))
