"""Writes into a tensor every simulated rank shares, under ``vsf.simulate``.

A plain tensor made outside the simulation holds one value for every rank (as each of ``n``
processes holds its own copy of it). PyTorch's ``LocalTensorMode`` runs an op that reads a per-rank
value once per rank, so an op writing into such a tensor wrote it once per rank into the same
memory (``buf.add_(x)`` added ``x`` four times on four ranks: torchtitan's MoE router counted its
tokens four times). The oracle is the number one process computes, by hand; where the ranks
compute different values for the tensor, the op is an error.
"""

from __future__ import annotations

import copy

import pytest
import torch

import vsf
from vsf import P

# name -> (the plain tensor made outside, the write given x = torch.ones(3, 2) made inside, what one process holds after)
WRITES = {
    "add_": (lambda: torch.zeros(2), lambda buf, x: buf.add_(x.sum(0)), [3.0, 3.0]),
    "+=": (lambda: torch.zeros(2), lambda buf, x: buf.__iadd__(x.sum(0)), [3.0, 3.0]),
    "mul_": (lambda: torch.full((2,), 2.0), lambda buf, x: buf.mul_(x[0] * 3), [6.0, 6.0]),
    "index_add_": (
        lambda: torch.zeros(2),
        lambda buf, x: buf.index_add_(0, torch.tensor([1, 1]), x[:2, 0]),
        [0.0, 2.0],
    ),
    "copy_": (lambda: torch.zeros(2), lambda buf, x: buf.copy_(x[0] * 5), [5.0, 5.0]),
    "out=": (lambda: torch.zeros(2), lambda buf, x: torch.sum(x, 0, out=buf), [3.0, 3.0]),
    "out= resized": (lambda: torch.empty(0), lambda buf, x: torch.add(x[0], 1, out=buf), [2.0, 2.0]),
    "setitem": (lambda: torch.zeros(2), lambda buf, x: buf.__setitem__(1, x[0, 0] * 7), [0.0, 7.0]),
    "a slice's add_": (lambda: torch.zeros(4), lambda buf, x: buf[1:3].add_(x[0]), [0.0, 1.0, 1.0, 0.0]),
    "a column's add_": (lambda: torch.zeros(2, 2), lambda buf, x: buf[:, 1].add_(x[0]), [[0.0, 1.0], [0.0, 1.0]]),
}


@pytest.mark.parametrize("name", list(WRITES))
def test_a_write_into_a_plain_tensor_from_per_rank_values_is_done_once(sim, name):
    make, write, want = WRITES[name]
    buf = make()
    sim(4)
    x = torch.ones(3, 2)
    assert len(vsf.debug.shards(x)) == 4  # made inside: a value per rank
    out = write(buf, x)
    assert len(vsf.debug.shards(buf)) == 1  # still one plain tensor
    torch.testing.assert_close(buf, torch.tensor(want), rtol=0, atol=0)
    if name not in ("setitem", "a slice's add_", "a column's add_"):
        assert out is buf  # the op returns the tensor it wrote, as in one process


def test_foreach_and_tuple_out_writes_are_done_once(sim):
    a, b = torch.zeros(2), torch.zeros(3)
    values, indices = torch.empty(2), torch.empty(2, dtype=torch.long)
    sim(4)
    x = torch.ones(3, 2)
    torch._foreach_add_([a, b], [x[0], x[:, 0]])
    got = torch.max(x * torch.tensor([[1.0], [3.0], [2.0]]), 0, out=(values, indices))
    assert got[0] is values and got[1] is indices
    torch.testing.assert_close(a, torch.ones(2), rtol=0, atol=0)
    torch.testing.assert_close(b, torch.ones(3), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.tensor([3.0, 3.0]), rtol=0, atol=0)
    assert indices.tolist() == [1, 1]


def test_a_module_buffer_counting_in_an_eager_forward_counts_once(sim):
    """torchtitan's router pattern: a buffer made outside, updated by each forward inside."""

    class Router(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("tokens_per_expert", torch.zeros(3))

        def forward(self, scores: torch.Tensor) -> torch.Tensor:
            expert = scores.argmax(-1)
            with torch.no_grad():
                self.tokens_per_expert.add_(torch.bincount(expert, minlength=3).float())
            return expert

    router = Router()
    sim(4)
    scores = torch.eye(3)[torch.tensor([0, 2, 2, 1, 2])]  # each token's expert: 0, 2, 2, 1, 2
    assert len(vsf.debug.shards(scores)) == 4
    for _ in range(2):
        router(scores)
    torch.testing.assert_close(router.tokens_per_expert, torch.tensor([2.0, 2.0, 6.0]), rtol=0, atol=0)


def test_a_plain_write_from_plain_values_stays_once(sim):
    buf, other = torch.zeros(2), torch.ones(2)
    sim(4)
    buf.add_(other)
    torch.testing.assert_close(buf, torch.ones(2), rtol=0, atol=0)


def sharded_rows(n=4):
    """Each rank's own row of ``arange(2n).reshape(n, 2)`` (rank r holds ``[2r, 2r + 1]``)."""
    mesh = vsf.make_mesh((n,), ("dp",))
    return vsf.device_put(torch.arange(2.0 * n).reshape(n, 2), vsf.NamedSharding(mesh, P("dp"))).to_local()[0]


@pytest.mark.parametrize(
    "write",
    [
        lambda buf, row: buf.add_(row),
        lambda buf, row: buf.copy_(row),  # wrote the last rank's value before
        lambda buf, row: torch.mul(row, 2, out=buf),
    ],
    ids=["add_", "copy_", "out="],
)
def test_a_write_whose_ranks_differ_is_an_error_naming_the_op_and_what_to_do(sim, write):
    buf = torch.zeros(2)
    sim(4)
    row = sharded_rows()
    assert [s.data.tolist() for s in vsf.debug.shards(row)] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    with pytest.raises(ValueError) as e:
        write(buf, row)
    for part in ("(2,) torch.float32 tensor", "simulated ranks 0 and 1", "different values", "vsf.device_put"):
        assert part in str(e.value)
    assert "aten." in str(e.value)
    torch.testing.assert_close(buf, torch.zeros(2), rtol=0, atol=0)  # nothing written


def test_a_slices_write_whose_ranks_differ_is_an_error_and_leaves_the_tensor(sim):
    buf = torch.zeros(4)
    sim(4)
    with pytest.raises(
        ValueError, match=r"aten\.add_\.Tensor writes into a \(2,\) torch\.float32 tensor \(its argument 'self'\)"
    ):
        buf[1:3].add_(sharded_rows())
    torch.testing.assert_close(buf, torch.zeros(4), rtol=0, atol=0)


def test_setting_a_plain_tensors_storage_from_per_rank_values_is_an_error(sim):
    buf = torch.zeros(2)
    sim(4)
    with pytest.raises(ValueError, match=r"aten\.set_\.source_Tensor changes the shape or storage"):
        buf.set_(torch.ones(2))


def _increments_per_call(step, x, calls=4):
    """How much each call of ``step`` after the first adds to the constant ``buf`` it writes (the
    first call also traces, and tracing runs the write on the real constant)."""
    seen = []
    for _ in range(calls):
        step(x)
        seen.append(BUF[0].item())
    return [b - a for a, b in zip(seen, seen[1:])]


BUF = torch.zeros(2)


def _step(x):
    BUF.add_(1.0)  # a tensor the step closes over, written in place: a constant of the jitted program
    return x * 2


@pytest.mark.parametrize("mode", ["auto", "interpret"])
def test_a_jitted_step_writing_a_constant_it_closes_over_is_refused_before_the_write(sim, monkeypatch, mode):
    """The program a jitted step lowers to would hold such a constant as one tensor every simulated
    rank shares (its write ran once per rank, 4 a call on 4 ranks, and a replayed program dropped
    it), and the trace itself wrote it: the step is a TraceError before any write, and the tensor
    is as it was (torch in this process adds 1 a call: ``_increments_per_call``'s oracle)."""
    monkeypatch.setattr(vsf.config, "jit_mode", mode)
    assert _increments_per_call(_step, torch.ones(8, 2)) == [1.0, 1.0, 1.0]
    sim(4)
    mesh = vsf.make_mesh((4,), ("dp",))
    x = vsf.device_put(torch.ones(8, 2), vsf.NamedSharding(mesh, P("dp")))
    before = BUF.clone()
    with pytest.raises(vsf.TraceError, match=r"_step writes a tensor it does not take as an argument"):
        vsf.jit(_step)(x)
    assert torch.equal(BUF, before)


def test_an_empty_plain_out_resized_from_differing_ranks_is_an_error(sim):
    buf = torch.empty(0)
    sim(4)
    with pytest.raises(
        ValueError, match=r"aten\.add\.out writes into a \(0,\) torch\.float32 tensor \(its argument 'out'\)"
    ):
        torch.add(sharded_rows(), 1, out=buf)
    assert buf.shape == (0,)


def test_per_rank_tensors_without_elements_are_not_shared_memory(sim):
    """Every rank's empty tensor has data pointer 0; a copy of a module inside the simulation sets
    such tensors' storages (``set_``), which is no write into one shared tensor."""
    sim(2)
    layer = torch.nn.Linear(2, 3)
    twin = copy.deepcopy(layer)
    for a, b in zip(layer.parameters(), twin.parameters()):
        assert all(torch.equal(x.data, y.data) for x, y in zip(vsf.debug.shards(a), vsf.debug.shards(b)))
