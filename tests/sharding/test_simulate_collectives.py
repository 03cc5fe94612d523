"""torch.distributed's collectives called eagerly on plain tensors under ``vsf.simulate``.

A plain tensor made outside the simulation holds one value for every rank, as each of ``n``
processes holds its own copy of it. A collective on it runs as on ``n`` processes: each rank's
result, written into the tensor once where the ranks agree (``all_reduce`` sums ``n`` copies),
and an error naming the op where they do not (a plain tensor cannot hold a value per rank).
Before, PyTorch's fake process group left the tensor as it was (``all_reduce`` did not sum), and
an in-place collective whose ranks disagree wrote the last rank's value. The oracle is the
arithmetic ``n`` processes do, by hand.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import vsf

N = 4


def arange(n):
    return torch.arange(float(n))


# name -> (the plain tensors, made outside; the collective on them; what each of N processes holds after)
AGREE = {
    "all_reduce sum": ([arange(3)], lambda x: dist.all_reduce(x), [[0.0, 4.0, 8.0]]),
    "all_reduce product": (
        [arange(3) + 1],
        lambda x: dist.all_reduce(x, op=dist.ReduceOp.PRODUCT),
        [[1.0, 16.0, 81.0]],
    ),
    "all_reduce max": ([arange(3)], lambda x: dist.all_reduce(x, op=dist.ReduceOp.MAX), [[0.0, 1.0, 2.0]]),
    "all_reduce_coalesced": (
        [arange(2), arange(3)],
        lambda a, b: dist.all_reduce_coalesced([a, b]),
        [[0.0, 4.0], [0.0, 4.0, 8.0]],
    ),
    "all_gather_into_tensor": (
        [torch.zeros(2 * N), torch.tensor([1.0, 2.0])],
        lambda out, x: dist.all_gather_into_tensor(out, x),
        [[1.0, 2.0] * N, [1.0, 2.0]],
    ),
    "all_gather": (
        [torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.tensor([5.0, 6.0])],
        lambda a, b, c, d, x: dist.all_gather([a, b, c, d], x),
        [[5.0, 6.0]] * 5,
    ),
    "broadcast": ([arange(3)], lambda x: dist.broadcast(x, src=2), [[0.0, 1.0, 2.0]]),
    "reduce_scatter_tensor of equal chunks": (
        [torch.zeros(2), torch.ones(8)],
        lambda out, x: dist.reduce_scatter_tensor(out, x),
        [[4.0, 4.0], [1.0] * 8],
    ),
}


def _run(collective, tensors):
    """Call ``collective`` on ``tensors`` under an ``N``-rank simulation (over the default group)."""
    with vsf.simulate(N), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (all_gather_into_tensor's deprecation)
        return collective(*tensors)


@pytest.mark.parametrize("name", list(AGREE))
def test_a_collective_on_plain_tensors_gives_what_n_processes_hold(name):
    tensors, collective, want = AGREE[name]
    tensors = [t.clone() for t in tensors]
    _run(collective, tensors)
    assert all(type(t) is torch.Tensor for t in tensors)  # still plain tensors
    assert [t.tolist() for t in tensors] == want


def test_an_all_reduce_over_a_mesh_axis_sums_that_axis_copies():
    """Over ``tp`` of a (2, 2) mesh, each rank sums its own and its ``tp`` peer's copy: 2 copies."""
    x = arange(3)
    with vsf.simulate(N):
        mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
        dist.all_reduce(x, group=mesh.device_mesh.get_group("tp"))
    assert x.tolist() == [0.0, 2.0, 4.0]


def test_a_functional_collective_on_a_plain_tensor_gives_each_ranks_result():
    x = arange(3)
    with vsf.simulate(N):
        summed = funcol.all_reduce(x, "sum", dist.group.WORLD).wait()
        shards = vsf.debug.shards(summed)
    assert [s.rank for s in shards] == list(range(N))
    assert all(s.data.tolist() == [0.0, 4.0, 8.0] for s in shards)
    assert x.tolist() == [0.0, 1.0, 2.0]  # (functional: its input as it was)


def test_a_plain_input_gathered_into_a_per_rank_output():
    """A tensor made inside (one per rank) gathering a plain one: each rank holds the copies (before:
    PyTorch's own assertion that the input must be a LocalTensor)."""
    x = torch.tensor([1.0, 2.0])
    with vsf.simulate(N), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = torch.zeros(2 * N)
        dist.all_gather_into_tensor(out, x)
        shards = vsf.debug.shards(out)
    assert len(shards) == N and all(s.data.tolist() == [1.0, 2.0] * N for s in shards)


# name -> (the plain tensors, made outside; a collective whose ranks hold different values for the plain output)
DIFFER = {
    "reduce_scatter_tensor": (
        [torch.zeros(2), arange(8)],
        lambda out, x: dist.reduce_scatter_tensor(out, x),
        r"c10d\._reduce_scatter_base_\.default writes into a \(2,\) torch\.float32 tensor \(its argument 'output_tensor'\)",
    ),
    "all_to_all_single": (
        [torch.zeros(4), arange(4)],
        lambda out, x: dist.all_to_all_single(out, x),
        r"c10d\.alltoall_base_\.default writes into a \(4,\) torch\.float32 tensor \(its argument 'output'\)",
    ),
    "scatter": (
        [torch.zeros(2)],
        lambda out: dist.scatter(out, [torch.full((2,), float(r)) for r in range(N)], src=0),
        r"c10d\.scatter_\.default writes into a \(2,\) torch\.float32 tensor \(its argument 'output_tensors'\)",
    ),
}


@pytest.mark.parametrize("name", list(DIFFER))
def test_a_collective_whose_ranks_differ_on_a_plain_output_is_an_error_naming_the_op(name):
    """Rank r of ``n`` processes would hold its own chunk, which one plain tensor cannot (before:
    the last rank's value, written with no error); the tensor is left as it was."""
    tensors, collective, message = DIFFER[name]
    before = [t.clone() for t in tensors]
    with pytest.raises(ValueError, match=message + r" that simulated ranks 0 and 1 share .* different values"):
        _run(collective, tensors)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))


# c10d ops that run on some ranks only or differently on each (no SPMD program runs them): the op's name
# in the error, and the collective every rank runs instead (before: torch's NotImplementedError for reduce
# and gather, an AttributeError of LocalTensor's for send and recv)
NOT_SPMD = {
    "send": (lambda t: dist.send(t, dst=1), "c10d.send.default", "vsf.ops.ppermute"),
    "recv": (lambda t: dist.recv(t, src=1), "c10d.recv_.default", "vsf.ops.ppermute"),
    "reduce": (lambda t: dist.reduce(t, dst=0), "c10d.reduce_.default", "dist.all_reduce"),
    "gather": (
        lambda t: dist.gather(t, [torch.zeros(2) for _ in range(N)], dst=0),
        "c10d.gather_.default",
        "dist.all_gather",
    ),
}


@pytest.mark.parametrize("name", list(NOT_SPMD))
def test_a_point_to_point_or_rooted_op_is_an_error_naming_the_op_and_its_spmd_form(name):
    collective, op, instead = NOT_SPMD[name]
    t = arange(2)
    with pytest.raises(
        NotImplementedError, match=rf"^{re.escape(op)} under vsf\.simulate: .*; use {re.escape(instead)}, "
    ):
        _run(collective, [t])
    assert t.tolist() == [0.0, 1.0]
