"""Choosing specs by rule: ``match`` (key-path regexes) and ``logical_to_mesh`` (flax's meaning)."""

from __future__ import annotations

import pytest
import torch

import vsf
from vsf import P
from vsf.sharding import logical_to_mesh, match

PARAMS = {
    "embed.weight": torch.zeros(32, 16),
    "blocks.0.attn.qkv.weight": torch.zeros(48, 16),
    "blocks.0.mlp.fc2.weight": torch.zeros(16, 64),
    "blocks.0.mlp.fc2.bias": torch.zeros(16),
    "opt": {"mu": [torch.zeros(4)], "count": None},
}


def test_first_matching_rule_wins_on_the_whole_key_path():
    specs = match(
        PARAMS,
        [
            (r".*attn\.qkv\.weight", P("tp", "fsdp")),
            (r".*\.weight", P("fsdp")),
            (r".*fc2\.weight", P(None, "tp")),  # never reached: the rule above matches first
            (r"bias", P("tp")),  # whole-path match: does not match blocks.0.mlp.fc2.bias
            (r".*", P()),
        ],
    )
    assert specs == {
        "embed.weight": P("fsdp"),
        "blocks.0.attn.qkv.weight": P("tp", "fsdp"),
        "blocks.0.mlp.fc2.weight": P("fsdp"),
        "blocks.0.mlp.fc2.bias": P(),
        "opt": {"mu": [P()], "count": None},
    }


def test_rule_paths_use_keystr_of_nested_trees():
    specs = match(PARAMS, [(r"\['opt'\]\['mu'\]\[0\]", P("dp")), (r".*", P())])
    assert specs["opt"]["mu"] == [P("dp")]


def test_unmatched_leaves_are_listed():
    with pytest.raises(ValueError) as e:
        match(PARAMS, [(r".*weight", P())])
    msg = str(e.value)
    assert "no rule matches 2 leaves: ['blocks.0.mlp.fc2.bias', \"['opt']['mu'][0]\"]" in msg
    assert "(r'.*', P())" in msg


def test_bad_rules():
    with pytest.raises(
        ValueError, match=r"rule spec P\('dp', 'tp'\) matched blocks.0.mlp.fc2.bias, which has rank 1 \(shape \(16,\)\)"
    ):
        match(PARAMS, [(r".*bias", P("dp", "tp")), (r".*", P())])
    with pytest.raises(ValueError, match=r"rule 0 has an invalid regex '\(\['"):
        match(PARAMS, [(r"([", P())])
    with pytest.raises(TypeError, match=r"rule 1 must be a \(regex, P\) pair, got \('.\*', \('dp',\)\)"):
        match(PARAMS, [(r"x", P()), (r".*", ("dp",))])


def test_match_then_place(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("fsdp", "tp"))
    specs = match(PARAMS, [(r".*attn\.qkv\.weight", P("tp", "fsdp")), (r".*", P())])
    placed = vsf.device_put(PARAMS, vsf.NamedSharding.tree(mesh, specs))
    assert vsf.typeof(placed["blocks.0.attn.qkv.weight"]) == "f32[48@tp,16@fsdp]"
    assert placed["opt"]["count"] is None


# -- logical axis names: flax's logical_to_mesh_axes ------------------------------------------------


def test_flax_documented_example():
    # flax.linen.logical_to_mesh_axes docstring: rules are in order of precedence.
    rules = (("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z"))
    assert logical_to_mesh(("batch", "length", "heads", "features"), rules) == P("X", None, "Y", None)


def test_rules_claim_dims_in_priority_order_not_dim_order():
    # flax walks the rules: "mlp" takes tp first, so "embed" finds tp used and stays unsharded.
    assert logical_to_mesh(("embed", "mlp"), [("mlp", "tp"), ("embed", "tp")]) == P(None, "tp")
    assert logical_to_mesh(("embed", "mlp"), [("embed", "tp"), ("mlp", "tp")]) == P("tp", None)


def test_fallback_rules_multi_axis_and_none():
    rules = [("batch", ("dp", "fsdp")), ("embed", "fsdp"), ("embed", "tp"), ("seq", None), ("seq", "cp")]
    # embed's first rule needs fsdp, which batch took; its next rule gives tp.
    assert logical_to_mesh(("batch", "seq", "embed"), rules) == P(("dp", "fsdp"), None, "tp")
    # ("seq", None) pins seq to unsharded, so ("seq", "cp") never applies.
    assert logical_to_mesh(("seq",), rules) == P(None)
    assert logical_to_mesh((None, "embed", "unknown"), rules) == P(None, "fsdp", None)
    assert logical_to_mesh((), rules) == P()


def test_logical_name_used_twice_is_an_error():
    with pytest.raises(
        ValueError, match=r"logical axes \('embed', 'embed'\) name \['embed'\] for more than one dimension"
    ):
        logical_to_mesh(("embed", "embed"), [("embed", "tp")])
    with pytest.raises(TypeError, match="logical rule 0 must be a"):
        logical_to_mesh(("embed",), ["embed"])
