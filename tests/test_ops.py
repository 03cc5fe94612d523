"""vsf.ops collectives on simulated ranks: values and gradients against hand-written oracles.

The oracle of each collective is its definition on the list of every member's tensor, written
here in plain torch; gradients come from torch.autograd over that list. The objective is the sum
over ranks of ``(w_r * y_r).sum()`` with random per-rank weights ``w_r`` (the convention
vsf.ops documents).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vsf
from vsf import _compat
from vsf.ops import backend

MESH = ((2, 3), ("a", "b"))


def as_local(values: dict[int, torch.Tensor]) -> torch.Tensor:
    with _compat.local_mode_disabled():
        return _compat.make_local({r: v.clone() for r, v in values.items()})


def per_rank(t: torch.Tensor) -> dict[int, torch.Tensor]:
    with _compat.local_mode_disabled():
        return {r: v.clone() for r, v in _compat.local_shards(t, 0).items()}


def groups(mesh: vsf.Mesh, axes: tuple[str, ...]) -> list[list[int]]:
    """Ranks that communicate over ``axes`` (major to minor), each group in collective order."""
    others = [a for a in mesh.axis_names if a not in axes]
    key = lambda r: tuple(mesh.coordinate(r)[a] for a in others)  # noqa: E731
    order = lambda r: tuple(mesh.coordinate(r)[a] for a in axes)  # noqa: E731
    out: dict[tuple[int, ...], list[int]] = {}
    for r in mesh.devices:
        out.setdefault(key(r), []).append(r)
    return [sorted(g, key=order) for g in out.values()]


def check(mesh, axes, inputs, run, oracle, atol=1e-5):
    """``run(local)`` under simulation equals ``oracle(list of group inputs)`` in value and gradient."""
    with _compat.local_mode_disabled():   # the oracle runs on plain tensors
        xs = {r: v.clone().requires_grad_() for r, v in inputs.items()}
        want = {}
        for g in groups(mesh, axes):
            for r, y in zip(g, oracle([xs[r] for r in g])):
                want[r] = y
        weights = {r: torch.randn(y.shape) for r, y in want.items()}
        objective = sum((weights[r] * want[r]).sum() for r in want) + sum(0 * x.sum() for x in xs.values())
        want_grads = dict(zip(xs, torch.autograd.grad(objective, list(xs.values()))))

    x = as_local(inputs).requires_grad_()
    y = run(x)
    got = per_rank(y)
    for r in want:
        torch.testing.assert_close(got[r], want[r].detach(), atol=atol, rtol=1e-5, msg=f"value on rank {r}")
    (as_local(weights) * y).sum().backward()
    grads = per_rank(x.grad)
    for r in want:
        torch.testing.assert_close(grads[r], want_grads[r], atol=atol, rtol=1e-5, msg=f"gradient on rank {r}")


@pytest.fixture
def mesh(sim):
    sim(6)
    m = vsf.make_mesh(*MESH)
    with vsf.use_mesh(m):
        yield m


def rand(mesh, *shape):
    with _compat.local_mode_disabled():
        return {r: torch.randn(*shape) for r in mesh.devices}


@pytest.mark.parametrize("axes", [("b",), ("a", "b"), ("b", "a")])
def test_psum(mesh, axes):
    check(mesh, axes, rand(mesh, 3, 2), lambda x: vsf.ops.psum(x, axes), lambda xs: [sum(xs)] * len(xs))


@pytest.mark.parametrize("axes,dim,tiled", [(("b",), 1, True), (("b",), 0, False), (("b", "a"), 0, True), (("a", "b"), 1, True)])
def test_all_gather(mesh, axes, dim, tiled):
    join = (lambda xs: torch.cat(xs, dim)) if tiled else (lambda xs: torch.stack(xs, dim))
    check(mesh, axes, rand(mesh, 2, 3), lambda x: vsf.ops.all_gather(x, axes, dim, tiled), lambda xs: [join(xs)] * len(xs))


@pytest.mark.parametrize("axes,dim", [(("b",), 0), (("b",), 1), (("a", "b"), 0), (("b", "a"), 1)])
def test_psum_scatter(mesh, axes, dim):
    n = len(groups(mesh, axes)[0])
    check(mesh, axes, rand(mesh, 6, 12), lambda x: vsf.ops.psum_scatter(x, axes, dim),
          lambda xs: list(torch.chunk(sum(xs), n, dim)))


def test_psum_scatter_untiled(mesh):
    check(mesh, ("b",), rand(mesh, 3, 2), lambda x: vsf.ops.psum_scatter(x, "b", 0, tiled=False),
          lambda xs: list(sum(xs).unbind(0)))


@pytest.mark.parametrize("split,concat", [(0, 1), (1, 0), (1, 1), (2, 0)])
def test_all_to_all(mesh, split, concat):
    def oracle(xs):
        pieces = [torch.chunk(x, len(xs), split) for x in xs]
        return [torch.cat([pieces[i][j] for i in range(len(xs))], concat) for j in range(len(xs))]

    check(mesh, ("b",), rand(mesh, 3, 6, 3), lambda x: vsf.ops.all_to_all(x, "b", split, concat), oracle)


@pytest.mark.parametrize("perm", [[(0, 1), (1, 2), (2, 0)], [(0, 2), (2, 1)], []])
def test_ppermute(mesh, perm):
    def oracle(xs):
        got = {d: xs[s] for s, d in perm}
        return [got[j] if j in got else torch.zeros_like(xs[j]) for j in range(len(xs))]

    check(mesh, ("b",), rand(mesh, 2, 2), lambda x: vsf.ops.ppermute(x, "b", perm), oracle)


def ragged_inputs(mesh, axis, sizes, trailing, dim):
    """Member ``i`` of each ``axis`` group holds ``sizes[i]`` slices along ``dim``."""
    out = {}
    for r in mesh.devices:
        shape = list(trailing)
        shape.insert(dim, sizes[mesh.coordinate(r)[axis]])
        with _compat.local_mode_disabled():
            out[r] = torch.randn(shape)
    return out


@pytest.fixture(params=["exact", "padded"])
def route(request, monkeypatch):
    """Run the ragged collectives on gloo's exact route and on NCCL's padded route."""
    monkeypatch.setattr(backend.AxisGroup, "pads_ragged", property(lambda g: request.param == "padded"))
    return request.param


@pytest.mark.parametrize("sizes,dim", [((1, 0, 3), 0), ((0, 0, 2), 1), ((2, 2, 2), 0)])
def test_all_gather_v(mesh, route, sizes, dim):
    check(mesh, ("b",), ragged_inputs(mesh, "b", sizes, (2,), dim),
          lambda x: vsf.ops.all_gather_v(x, "b", sizes, dim), lambda xs: [torch.cat(xs, dim)] * len(xs))


@pytest.mark.parametrize("sizes,dim", [((1, 0, 3), 0), ((0, 0, 2), 1), ((2, 2, 2), 1)])
def test_reduce_scatter_v(mesh, route, sizes, dim):
    shape = [2, 2]
    shape[dim] = sum(sizes)
    check(mesh, ("b",), rand(mesh, *shape), lambda x: vsf.ops.reduce_scatter_v(x, "b", sizes, dim),
          lambda xs: list(torch.split(sum(xs), list(sizes), dim)))


@settings(max_examples=15, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=3, max_size=3), min_size=3, max_size=3))
def test_all_to_all_v(counts):
    with vsf.simulate(3):
        m = vsf.make_mesh((3,), ("ep",))
        with _compat.local_mode_disabled():
            inputs = {r: torch.randn(sum(counts[r]), 2) for r in m.devices}

        def oracle(xs):
            pieces = [torch.split(x, counts[i]) for i, x in enumerate(xs)]
            return [torch.cat([pieces[i][j] for i in range(3)]) for j in range(3)]

        check(m, ("ep",), inputs, lambda x: vsf.ops.all_to_all_v(x, "ep", counts, mesh=m), oracle)


def test_size_one_axes_are_identities(sim):
    sim(2)
    m = vsf.make_mesh((1, 2), ("pp", "dp"))
    x = torch.randn(3, 2)
    assert vsf.ops.psum(x, "pp", mesh=m) is x
    assert vsf.ops.all_gather(x, "pp", mesh=m) is x
    assert vsf.ops.all_gather_v(x, "pp", (3,), mesh=m) is x
    assert vsf.ops.ppermute(x, "pp", [(0, 0)], mesh=m) is x


def test_planning_only_simulation_gives_shapes(sim):
    sim(4, compute=False)
    m = vsf.make_mesh((4,), ("fsdp",))
    assert vsf.ops.all_gather(torch.ones(2, 3), "fsdp", 1, mesh=m).shape == (2, 12)
    assert vsf.ops.psum_scatter(torch.ones(8, 3), "fsdp", mesh=m).shape == (2, 3)
    assert vsf.ops.all_gather_v(torch.ones(2, 3), "fsdp", (2, 2, 1, 1), mesh=m).shape == (6, 3)


@pytest.mark.parametrize("call,message", [
    (lambda x: vsf.ops.all_gather_v(x, "b", (1, 2)), "needs 3 non-negative sizes"),
    (lambda x: vsf.ops.all_gather_v(x, "b", (1, -1, 2)), "needs 3 non-negative sizes"),
    (lambda x: vsf.ops.all_gather_v(x, "b", (2, 2, 1)), "member 2 should hold 1 rows"),
    (lambda x: vsf.ops.reduce_scatter_v(x, "b", (1, 1, 2)), "should hold 4 rows"),
    (lambda x: vsf.ops.all_to_all_v(x, "b", [[1, 1, 1]] * 3), "must send 3 rows"),
    (lambda x: vsf.ops.ppermute(x, "b", [(0, 1), (1, 1)]), "distinct sources and destinations"),
    (lambda x: vsf.ops.all_to_all(x, ("a", "b"), 0, 0), "runs over one mesh axis"),
    (lambda x: vsf.ops.all_to_all(x, "b", 0, 1), "not divisible by 3"),
    (lambda x: vsf.ops.psum(x, "zz"), "unknown mesh axis 'zz'"),
])
def test_bad_input(mesh, call, message):
    with pytest.raises(ValueError, match=message):
        call(as_local({r: torch.ones(2, 2) for r in mesh.devices}))


def test_needs_a_mesh(sim):
    sim(2)
    vsf.make_mesh((2,), ("dp",))
    with pytest.raises(ValueError, match="needs a mesh"):
        vsf.ops.psum(torch.ones(2), "dp")


def test_every_transpose_is_an_adjoint(mesh):
    """<op(x), w> == <x, op^T(w)> summed over ranks, for each op's backward (second-order check)."""
    x = as_local(rand(mesh, 6, 3))
    for op in (lambda t: vsf.ops.all_to_all(t, "b", 0, 1), lambda t: vsf.ops.psum_scatter(t, ("a", "b"))):
        x_ = x.detach().requires_grad_()
        y = op(x_)
        with _compat.local_mode_disabled():
            w = as_local({r: torch.randn(v.shape) for r, v in per_rank(y).items()}).requires_grad_()
        (g,) = torch.autograd.grad((y * w).sum(), x_, create_graph=True)
        lhs = sum(v.sum() for v in per_rank(y.detach() * w.detach()).values())
        rhs = sum(v.sum() for v in per_rank(x.detach() * g.detach()).values())
        torch.testing.assert_close(lhs, rhs)
        (gg,) = torch.autograd.grad((g * x).sum(), w)   # d<x, op^T(w)>/dw = op(x)
        for r, v in per_rank(gg).items():
            torch.testing.assert_close(v, per_rank(y)[r])


def test_groups_helper_matches_mesh_layout(mesh):
    # the oracle's notion of a group (same coordinates off the axis) for a 2x3 mesh
    assert groups(mesh, ("b",)) == [[0, 1, 2], [3, 4, 5]]
    assert groups(mesh, ("b", "a")) == [[0, 3, 1, 4, 2, 5]]
    assert list(itertools.chain(*groups(mesh, ("a",)))) == [0, 3, 1, 4, 2, 5]
