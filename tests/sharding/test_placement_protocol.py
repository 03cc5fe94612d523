"""The placement protocol (``vsf.sharding.placement``): its answers for every layout kind against
layouts written out by hand, and the rule that keeps it the one home of the kinds: no other
module tests a placement's type against them (so a new kind is added in one module)."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import vsf
from vsf import _compat
from vsf.sharding.placement import (
    BalancedPlacement,
    RaggedPlacement,
    as_contiguous,
    balanced_of,
    balanced_order,
    contiguous,
    dtensor_native,
    has_balanced,
    has_ragged,
    has_strided,
    is_shard,
    kind_of,
    layout_of,
    on_dim,
    one_d,
    per_axis,
    split_dim,
    split_factor,
)

ROOT = pathlib.Path(vsf.__file__).parent

STRIDED = _compat.StridedShard(1, split_factor=2)
RAGGED = RaggedPlacement(vsf.ragged("fsdp", (1, 2, 1, 0)))
BALANCED = BalancedPlacement(2)
MERGED = BalancedPlacement(0, split_factor=2)  # a view merged the balanced dim into a larger one


@pytest.mark.parametrize(
    "p, kind, shard, dim, factor, native",
    [
        (Replicate(), "replicate", False, None, None, True),
        (Partial(), "partial", False, None, None, True),
        (Partial("max"), "partial", False, None, None, True),
        (Shard(1), "shard", True, 1, None, True),
        (STRIDED, "strided", True, 1, 2, True),
        (RAGGED, "ragged", True, 0, None, False),
        (BALANCED, "balanced", True, 2, None, False),
        (MERGED, "balanced", True, 0, 2, False),
        (None, "other", False, None, None, False),
    ],
)
def test_each_kind_answers_the_questions(p, kind, shard, dim, factor, native):
    assert kind_of(p) == kind
    assert is_shard(p) is shard
    assert split_factor(p) == factor
    assert dtensor_native(p) is native
    if shard:
        assert split_dim(p) == dim


def test_the_solver_sees_a_strided_shard_as_a_plain_one_and_every_other_placement_as_it_is():
    assert one_d(STRIDED) == Shard(1)
    for p in (Replicate(), Partial(), Shard(0), RAGGED, BALANCED, MERGED):
        assert one_d(p) == p


def test_the_solver_keeps_a_packed_split_strided_and_sees_a_nested_one_as_a_plain_shard():
    """A strided shard of a dim no other mesh dim splits is a packed split (its factor the dim's own
    pieces); beside another mesh dim's split of that dim it is the nesting of ``P(("tp", "dp"))``."""
    assert per_axis((Replicate(), STRIDED), 1) == STRIDED
    assert per_axis((Shard(0), STRIDED), 1) == STRIDED
    assert per_axis((STRIDED, Shard(1)), 0) == Shard(1)
    assert per_axis((Shard(1), STRIDED, Partial()), 2) == Partial()


def test_on_dim_keeps_the_kind_and_its_factor_and_refuses_a_ragged_split():
    assert on_dim(Shard(2), 0) == Shard(0)
    assert on_dim(STRIDED, 0) == _compat.StridedShard(0, split_factor=2)
    assert on_dim(MERGED, 3) == BalancedPlacement(3, split_factor=2)
    with pytest.raises(ValueError, match="ragged"):
        on_dim(RAGGED, 1)


def test_a_strided_shard_holds_the_interleaved_pieces_written_out_by_hand():
    # 8 positions as sf=2 groups of 2 ranks' pieces: rank 0 holds 0 1 | 4 5, rank 1 holds 2 3 | 6 7
    p = on_dim(STRIDED, 0)
    got = [_compat.shard_of(torch.arange(8), (p,), (2,), (r,)).tolist() for r in range(2)]
    assert got == [[0, 1, 4, 5], [2, 3, 6, 7]]


@pytest.mark.parametrize(
    "p, size, held",
    [
        # 8 positions in 4 chunks of 2: rank i holds chunks i and 3 - i
        (BalancedPlacement(0), 8, [[0, 1, 6, 7], [2, 3, 4, 5]]),
        # 16 positions as 2 groups of 8, each balanced: rank 0 holds chunks 0, 3 of each group
        (BalancedPlacement(0, split_factor=2), 16, [[0, 1, 6, 7, 8, 9, 14, 15], [2, 3, 4, 5, 10, 11, 12, 13]]),
    ],
)
def test_a_balanced_split_is_its_contiguous_placement_over_the_balanced_view(p, size, held):
    view = torch.arange(size)[balanced_order(size, 2, p.groups)]
    got = [_compat.shard_of(view, (contiguous(p),), (2,), (r,)).tolist() for r in range(2)]
    assert got == held
    assert balanced_of(contiguous(p)) == p


def test_contiguous_is_every_other_placement_itself_and_maps_over_a_layout():
    for p in (Replicate(), Partial(), Shard(1), STRIDED, RAGGED):
        assert contiguous(p) == p
    assert as_contiguous((Replicate(), BALANCED, MERGED)) == (
        Replicate(),
        Shard(2),
        _compat.StridedShard(0, split_factor=2),
    )
    assert as_contiguous(None) is None


def test_a_ragged_placement_moves_as_its_uneven_spec_layout():
    # units (1, 2, 1, 0) of 8 rows: 2 rows a unit, so ranks hold rows [0, 2), [2, 6), [6, 8), none
    layout = layout_of(RAGGED)
    assert layout == vsf.ragged("fsdp", (1, 2, 1, 0))
    assert [layout.row_range((8, 3), r) for r in range(4)] == [(0, 2), (2, 6), (6, 8), (8, 8)]
    assert [layout.local_shape((8, 3), r) for r in range(4)] == [(2, 3), (4, 3), (2, 3), (0, 3)]
    for p in (Replicate(), Partial(), Shard(0), STRIDED, BALANCED):
        assert layout_of(p) == p


def test_has_finds_a_kind_in_any_layout_and_skips_none():
    layouts = [None, (Replicate(), Shard(0)), (STRIDED, Partial())]
    assert has_strided(layouts) and not has_ragged(layouts) and not has_balanced(layouts)
    assert has_ragged([(RAGGED,)]) and has_balanced([None, (Replicate(), MERGED)])
    assert not has_strided([]) and not has_strided([None])


# -- the rule: one home per layout kind ------------------------------------------------------

KINDS = {"StridedShard", "_StridedShard", "RaggedPlacement", "BalancedPlacement"}
HOME = {"vsf/sharding/placement.py", "vsf/_compat.py"}  # _compat: DTensor's own split of a strided shard
ENTRIES = {
    "RaggedShard",
    "BalancedShard",
    "PackedShard",
}  # spec entries: values of entries.py, taken by spec.py, moved by ragged.py, stored by the checkpoint
ENTRY_HOMES = {
    "vsf/sharding/entries.py",
    "vsf/sharding/spec.py",
    "vsf/sharding/ragged.py",
    "vsf/checkpoint/format.py",
}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def type_tests(source: str, kinds: set[str]) -> list[int]:
    """Lines of ``source`` that test a value's type against ``kinds``: ``isinstance(x, K)``,
    ``type(x) is K``, ``type(x) in (K, ...)``, ``K in (type(x), ...)``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
        ):
            if _names(node.args[1]) & kinds:
                lines.append(node.lineno)
        elif isinstance(node, ast.Compare):
            calls_type = any(
                isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "type" for n in ast.walk(node)
            )
            if calls_type and _names(node) & kinds:
                lines.append(node.lineno)
    return lines


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT.parent)): p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def test_no_module_but_the_protocol_tests_a_placement_against_the_kinds():
    found = {
        path: lines for path, text in _sources().items() if path not in HOME and (lines := type_tests(text, KINDS))
    }
    assert not found, (
        f"type tests against {sorted(KINDS)} outside vsf/sharding/placement.py (ask its protocol instead): {found}"
    )


def test_spec_entries_are_told_apart_only_where_they_live():
    found = {
        path: lines
        for path, text in _sources().items()
        if path not in ENTRY_HOMES and (lines := type_tests(text, ENTRIES))
    }
    assert not found, f"type tests against {sorted(ENTRIES)} outside {sorted(ENTRY_HOMES)}: {found}"


def test_the_rule_catches_each_form_of_type_test():
    source = "\n".join(
        [
            "a = isinstance(p, _compat.StridedShard)",
            "b = isinstance(p, (Shard, RaggedPlacement))",
            "c = type(p) is BalancedPlacement",
            "d = type(p) in (Shard, _compat.StridedShard)",
            "e = BalancedPlacement in (type(p), type(q))",
            "f = isinstance(p, Shard) or kind_of(p) == 'strided'",
        ]
    )
    assert type_tests(source, KINDS) == [1, 2, 3, 4, 5]
