"""``P`` (PartitionSpec): JAX's entries, immutable, hashable, repr and pickle round trips."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

import vsf
from vsf import P

NAMES = ("pp", "dp", "fsdp", "cp", "tp")


@st.composite
def specs(draw):
    """A valid P: each axis used at most once, in entries (alone or in tuples) or as unreduced."""
    n_dims = draw(st.integers(0, 4))
    owner = {a: draw(st.sampled_from([None, "unreduced", *range(n_dims)])) for a in draw(st.permutations(NAMES))}
    entries = []
    for dim in range(n_dims):
        axes = tuple(a for a, d in owner.items() if d == dim)
        special = draw(st.sampled_from([None, P.UNCONSTRAINED]))
        entries.append(special if not axes else axes[0] if len(axes) == 1 and draw(st.booleans()) else axes)
    return P(*entries, unreduced=[a for a, d in owner.items() if d == "unreduced"])


@given(specs())
def test_spec_is_a_value(spec):
    assert eval(repr(spec), vars(vsf)) == spec
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert hash(eval(repr(spec), vars(vsf))) == hash(spec)
    assert len(spec) == len(tuple(spec)) and all(spec[i] == e for i, e in enumerate(spec))
    with pytest.raises(AttributeError, match="immutable"):
        spec._entries = ()


def test_entries_normalize_like_jax():
    assert P(("dp",)) == P("dp") and P(()) == P(None) and P(["dp", "tp"]) == P(("dp", "tp"))
    assert P("dp") != P("dp", None) and P("dp", None).normalized() == P("dp")
    assert P(("dp", "tp")) != P(("tp", "dp"))  # major -> minor order is meaningful
    assert P(unreduced=("tp", "dp")) == P(unreduced=["dp", "tp"])  # unreduced is a set (kept sorted)
    assert P(unreduced="tp").unreduced == ("tp",)
    assert repr(P("dp", None, ("fsdp", "tp"), unreduced=("cp",))) == "P('dp', None, ('fsdp', 'tp'), unreduced=('cp',))"
    assert repr(P(P.UNCONSTRAINED)) == "P(P.UNCONSTRAINED)" and P.UNCONSTRAINED is vsf.sharding.UNCONSTRAINED
    assert pickle.loads(pickle.dumps(P.UNCONSTRAINED)) is P.UNCONSTRAINED


def test_axes_and_entry_axes():
    spec = P("dp", None, ("fsdp", "tp"), unreduced=("cp",))
    assert spec.axes == ("dp", "fsdp", "tp", "cp")
    assert spec.entry_axes(0) == ("dp",) and spec.entry_axes(1) == () and spec.entry_axes(2) == ("fsdp", "tp")
    assert spec.entry_axes(7) == ()  # dims past the spec are unsharded
    assert spec.unreduced == ("cp",)


def test_without_takes_axes_out_of_every_entry():
    spec = P(("fsdp", "tp"), "dp", None, vsf.balanced("cp"), unreduced=("pp",))
    assert spec.without(("fsdp", "dp")) == P("tp", None, None, vsf.balanced("cp"), unreduced=("pp",))
    assert spec.without(("cp", "pp")) == P(("fsdp", "tp"), "dp", None, None)
    assert P(("dp", "fsdp", "tp")).without(("fsdp",)) == P(("dp", "tp"))
    assert P(vsf.ragged("fsdp", (1, 2))).without(("fsdp",)) == P(None)
    assert P(P.UNCONSTRAINED, "tp").without(("tp",)) == P(P.UNCONSTRAINED, None)
    assert spec.without(()) == spec


@given(specs(), st.sets(st.sampled_from(NAMES)))
def test_without_leaves_exactly_the_other_axes_in_order(spec, axes):
    out = spec.without(axes)
    assert len(out) == len(spec) and out.unreduced == tuple(a for a in spec.unreduced if a not in axes)
    for dim in range(len(spec)):
        assert out.entry_axes(dim) == tuple(a for a in spec.entry_axes(dim) if a not in axes)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: P("dp", "dp"), r"mesh axis 'dp' is used twice in P\('dp', 'dp'\): by dim 0 and by dim 1"),
        (lambda: P(("dp", "tp"), "tp"), r"'tp' is used twice in P\(\('dp', 'tp'\), 'tp'\): by dim 0 and by dim 1"),
        (lambda: P(("tp", "tp")), r"'tp' is used twice in P\(\('tp', 'tp'\)\): by dim 0 and by dim 0"),
        (
            lambda: P("tp", unreduced=("tp",)),
            r"'tp' in P\('tp', unreduced=\('tp',\)\) both shards dim 0 and is unreduced",
        ),
    ],
)
def test_axis_used_twice_is_a_value_error_naming_spec_and_dims(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: P(1),
            r"P entry for dim 0 must be None, an axis name, a tuple of axis names, vsf\.balanced\(axis\), "
            r"vsf\.packed\(axis, parts\) or P.UNCONSTRAINED, got 1 \(int\)",
        ),
        (lambda: P(None, ("dp", 2)), r"P entry for dim 1 must name mesh axes as strings, got \('dp', 2\)"),
        (lambda: P(unreduced=("tp", 3)), r"unreduced must name mesh axes as strings, got \('tp', 3\)"),
    ],
)
def test_malformed_entries_are_type_errors(make, message):
    with pytest.raises(TypeError, match=message):
        make()
