"""A fused gate/up weight packed over tp (``vsf.packed("tp", 2)``: each rank its slice of gate's
rows and of up's) through ``vsf.jit``: ``linear(x, w).chunk(2, -1)`` gives gate and up each split
over tp from each rank's own columns, the SwiGLU and the down projection run Megatron-split, and
the backward's ``cat`` gives the gradient packed again. Oracles: torch's AdamW on one device
(params after several steps), and the bytes of the one all-reduce Megatron's split needs, by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vsf
from vsf import P, _compat, optim

LR, STEPS = 1e-2, 3
HIDDEN, FFN, BATCH = 16, 32, 8
SPECS = {"gate_up": P(vsf.packed("tp", 2), None), "down": P(None, "tp")}


def swiglu(fused_chunk):
    """The loss of a SwiGLU MLP whose gate and up rows are fused in one weight (gate's, then up's),
    its result cut apart by ``fused_chunk(h)``."""

    def loss(p, x):
        gate, up = fused_chunk(F.linear(x, p["gate_up"]))
        return F.linear(F.silu(gate) * up, p["down"]).square().mean()

    return loss


CHUNKS = {
    "chunk": lambda h: h.chunk(2, dim=-1),  # Mixtral's (aten.split)
    "unbind": lambda h: h.unflatten(-1, (2, -1)).unbind(-2),  # a view and an unbind
}


def _case():
    g = torch.Generator().manual_seed(0)
    params = {
        "gate_up": torch.randn(2 * FFN, HIDDEN, generator=g) / 4,
        "down": torch.randn(HIDDEN, FFN, generator=g) / 6,
    }
    return params, [torch.randn(BATCH, HIDDEN, generator=g) for _ in range(STEPS)]


def _torch_trained(loss_fn, params, batches):
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = torch.optim.AdamW(p.values(), lr=LR)
    for x in batches:
        opt.zero_grad()
        loss_fn(p, x).backward()
        opt.step()
    return {k: v.detach() for k, v in p.items()}


def test_a_packed_gate_up_trains_like_torch_and_only_the_down_projection_is_reduced_over_tp(sim):
    """On a dp x tp mesh, the batch over dp: after 3 AdamW steps the params equal torch's on one
    device; gate_up and its AdamW moments stay packed; over tp the plan sends one all-reduce, the
    down projection's partial sums over a rank's 4 rows x 16 floats (a ring of 2 sends all of it
    once: 256 B), and no weight."""
    params, batches = _case()
    loss_fn = swiglu(CHUNKS["chunk"])
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    tx = optim.adamw(LR)

    @vsf.jit
    def step(p, s, x):
        grads = vsf.grad(loss_fn)(p, x)
        updates, s = tx.update(grads, s, p)
        return optim.apply_updates(p, updates), s

    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, SPECS))
    s = optim.init_sharded(tx, p)
    for x in batches:
        x = vsf.device_put(x, vsf.NamedSharding(mesh, P("dp")))
        p, s = step(p, s, x)
    over_tp = [(c.kind, c.bytes) for c in step.lower(p, s, x).cost().collectives if c.axis == "tp"]
    assert over_tp == [("all_reduce", BATCH // 2 * HIDDEN * 4)]
    want = _torch_trained(loss_fn, params, batches)
    for k, v in vsf.device_get(p).items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    packed = (_compat.StridedShard(0, split_factor=2),)
    assert tuple(p["gate_up"].placements)[1:] == packed
    moments = [t for t in vsf.tree.leaves(s) if isinstance(t, torch.Tensor) and t.shape == (2 * FFN, HIDDEN)]
    assert len(moments) == 2 and all(tuple(t.placements)[1:] == packed for t in moments)


@pytest.mark.parametrize(
    "chunk, spec, gathered",
    [
        ("chunk", SPECS["gate_up"], False),
        ("unbind", SPECS["gate_up"], False),
        ("chunk", P("tp", None), True),  # one rank gate's rows, the other up's: the chunk needs both
    ],
)
def test_the_gradient_of_a_packed_weight_comes_back_packed_and_nothing_is_gathered(sim, chunk, spec, gathered):
    """gate_up's gradient equals one device's and comes back laid out as gate_up, for ``chunk``
    and for an ``unflatten``/``unbind`` of the fused result; packed, nothing is gathered over tp.
    The same function with gate_up split contiguously over tp is planned as before: its chunk
    needs every rank's columns, so something is gathered."""
    params, batches = _case()
    loss_fn = swiglu(CHUNKS[chunk])
    want = vsf.grad(loss_fn)(params, batches[0])
    sim(2)
    mesh = vsf.make_mesh((2,), ("tp",))
    step = vsf.jit(vsf.grad(loss_fn))
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, {**SPECS, "gate_up": spec}))
    grads = step(p, batches[0])
    for k in params:
        torch.testing.assert_close(vsf.device_get(grads[k]), want[k], rtol=1e-5, atol=1e-6)
        assert tuple(grads[k].placements) == tuple(p[k].placements), k
    kinds = [c.kind for c in step.lower(p, batches[0]).cost().collectives]
    assert ("all_gather" in kinds) == gathered, kinds
