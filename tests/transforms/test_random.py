"""vsf.random: Philox against its published answers, samplers on every layout against the
unsharded call (bit for bit), statistics, keyed torch RNG, dropout and sharded init."""

from __future__ import annotations

import math
import resource
import threading

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import vsf
from vsf import P
from vsf.random import bits, samplers
from vsf.random.philox import Scratch, philox4x32
from vsf.errors import TraceError

# -- Philox known answers -----------------------------------------------------------------------

# Random123 1.14's examples/kat_vectors (Salmon, Moraes, Dror, Shaw, "Parallel Random Numbers: As
# Easy as 1, 2, 3", SC 2011): "philox4x32 10 <ctr0..3> <key0..1> <out0..3>".
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter,key,expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    as_tensors = philox4x32(tuple(torch.tensor([k]) for k in key), tuple(torch.tensor([c]) for c in counter))
    assert tuple(int(w) for w in as_tensors) == expected
    # Python ints for the constant words (the samplers' fast path) give the same words
    assert tuple(int(w) for w in philox4x32(key, (torch.tensor([counter[0]]), *counter[1:]))) == expected
    # in place on scratch buffers (eager fills), into strided views of one buffer
    words = torch.zeros(1, 4, dtype=torch.int64)
    scratch = Scratch([words[:, i] for i in range(4)], [torch.empty(1, dtype=torch.int64) for _ in range(6)])
    philox4x32(key, (torch.tensor([counter[0]]), *counter[1:]), out=scratch)
    assert tuple(words[0].tolist()) == expected


# -- keys -----------------------------------------------------------------------------------------


def test_keys_split_fold_in():
    k = vsf.random.key(0)
    assert k.dtype == torch.int64 and tuple(k.shape) == (2,)
    assert torch.equal(vsf.random.key(2**40 + 3), torch.tensor([256, 3]))
    a, b = vsf.random.split(k)
    assert not torch.equal(a, b) and not torch.equal(a, k)
    assert torch.equal(vsf.random.split(k, 4)[:2], vsf.random.split(k))  # key i does not depend on num
    assert torch.equal(vsf.random.fold_in(k, 5), vsf.random.fold_in(k, torch.tensor(5)))
    assert not torch.equal(vsf.random.fold_in(k, 5), vsf.random.fold_in(k, 6))
    assert ((vsf.random.split(k, 16) >= 0) & (vsf.random.split(k, 16) < 2**32)).all()
    with pytest.raises(TypeError, match="needs a key"):
        vsf.random.normal(torch.zeros(2), (3,))


# -- every layout gives the unsharded bits ---------------------------------------------------------

MESHES = [
    ((8,), ("a",)),
    ((2, 4), ("a", "b")),
    ((4, 2), ("b", "a")),
    ((2, 2, 2), ("a", "b", "c")),
    ((1, 2, 2, 1, 2), ("pp", "dp", "fsdp", "cp", "tp")),
]

SAMPLERS = {
    "normal": lambda k, shape, **kw: vsf.random.normal(k, shape, **kw),
    "normal_bf16": lambda k, shape, **kw: vsf.random.normal(k, shape, torch.bfloat16, **kw),
    "uniform_f64": lambda k, shape, **kw: vsf.random.uniform(k, shape, torch.float64, -2.0, 3.0, **kw),
    "uniform_f16": lambda k, shape, **kw: vsf.random.uniform(k, shape, torch.float16, **kw),
    "truncated_normal": lambda k, shape, **kw: vsf.random.truncated_normal(k, -1.5, 2.0, shape, **kw),
    "bernoulli": lambda k, shape, **kw: vsf.random.bernoulli(k, 0.3, shape, **kw),
    "randint": lambda k, shape, **kw: vsf.random.randint(k, shape, -5, 1000, **kw),
    "normal_init": lambda k, shape, **kw: vsf.nn.initializers.normal(0.02)(k, shape, **kw),
}


@st.composite
def layouts(draw):
    sizes, names = draw(st.sampled_from(MESHES))
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=rank, max_size=rank)))
    free = draw(st.permutations([a for a, n in zip(names, sizes) if n > 1]))  # the order within an entry
    entries: list[list[str]] = [[] for _ in range(rank)]
    for axis in free:  # each mesh axis shards one dim (or none)
        dim = draw(st.integers(-1, rank - 1))
        if dim >= 0:
            entries[dim].append(axis)
    entries = [None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries]
    ragged = draw(st.integers(0, 3)) == 0 and bool(free)
    return (
        sizes,
        names,
        shape,
        entries,
        ragged,
        draw(st.sampled_from(sorted(SAMPLERS))),
        draw(st.integers(0, 2**64 - 1)),
    )


def _ragged_units(draw_seed: int, n: int, rows: int) -> tuple[int, ...]:
    """Split ``rows`` units over ``n`` ranks unevenly (some ranks none), reproducibly."""
    cuts = sorted((draw_seed >> (5 * i)) % (rows + 1) for i in range(n - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, rows]))


@given(layouts())
@settings(max_examples=60)
def test_sampler_layout_invariant(case):
    sizes, names, shape, entries, ragged, name, seed = case
    key = vsf.random.key(seed)
    full = SAMPLERS[name](key, shape)
    with vsf.simulate(math.prod(sizes)):
        mesh = vsf.make_mesh(sizes, names)
        try:
            if ragged and math.prod(shape) > 0:
                axis = next(a for a, n in zip(names, sizes) if n > 1)
                dims = 1 + seed % len(shape)
                rows = math.prod(shape[:dims])
                later = [
                    None if e is None or axis in (e if isinstance(e, tuple) else (e,)) else e for e in entries[dims:]
                ]
                spec = P(
                    vsf.ragged(axis, _ragged_units(seed, mesh.axis_size(axis), rows), dims=dims),
                    *([None] * (dims - 1)),
                    *later,
                )
            else:
                spec = P(*entries)
            s = vsf.NamedSharding(mesh, spec)
            s.check(shape)
        except ValueError:
            return  # a layout DTensor cannot hold (uneven strided split): nothing to compare
        x = SAMPLERS[name](key, shape, sharding=s)
        assert vsf.sharding.sharding_of(x) == s
        for shard in vsf.debug.shards(x):  # each rank holds exactly its part of the unsharded sample
            assert torch.equal(shard.data, s.index_view(full)[shard.index]), (spec, shard.rank)


@given(
    st.sampled_from(MESHES[:4]),
    st.lists(st.integers(1, 9), min_size=1, max_size=3),
    st.sampled_from(sorted(SAMPLERS)),
    st.integers(0, 2**32),
)
@settings(max_examples=12)
def test_sampler_inside_jit_equals_eager(mesh_case, shape, name, seed):
    """The traced path (elementwise over arange) equals the eager fill, on the planner's layout."""
    sizes, names = mesh_case
    shape = tuple(shape)
    key = vsf.random.key(seed)
    full = SAMPLERS[name](key, shape)
    with vsf.simulate(math.prod(sizes)):
        mesh = vsf.make_mesh(sizes, names)
        s = vsf.NamedSharding(mesh, P(names[0]))
        x = vsf.device_put(torch.zeros(shape), s)
        out = vsf.jit(lambda x, k: (x, SAMPLERS[name](k, shape)))(x, key)[1]
        assert torch.equal(vsf.device_get(out), full)


def test_sampler_sharding_inside_jit():
    key = vsf.random.key(1)
    with vsf.simulate(4):
        mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
        s = vsf.NamedSharding(mesh, P("tp", "dp"))
        out = vsf.jit(lambda k: vsf.random.normal(k, (5, 6), sharding=s))(
            vsf.device_put(key, vsf.NamedSharding(mesh, P()))
        )
        assert vsf.sharding.sharding_of(out) == s
        assert torch.equal(vsf.device_get(out), vsf.random.normal(key, (5, 6)))


def test_permutation():
    key = vsf.random.key(4)
    perm = vsf.random.permutation(key, 100)
    assert sorted(perm.tolist()) == list(range(100)) and perm.tolist() != list(range(100))
    x = torch.arange(24.0).reshape(6, 4)
    rows = vsf.random.permutation(key, x)
    assert torch.equal(rows, x[vsf.random.permutation(key, 6)])
    cols = vsf.random.permutation(key, x, axis=1, independent=True)
    assert all(sorted(r.tolist()) == sorted(o.tolist()) for r, o in zip(cols, x))
    with vsf.simulate(4):
        mesh = vsf.make_mesh((4,), ("dp",))
        sharded = vsf.random.permutation(key, 10, sharding=vsf.NamedSharding(mesh, P("dp")))
        assert torch.equal(vsf.device_get(sharded), vsf.random.permutation(key, 10))


@pytest.mark.parametrize("threads", [1, 3])
def test_fill_in_chunks_equals_the_per_element_formula(monkeypatch, threads):
    """``bits.CHUNK`` only sizes the work: drawn in chunks of 3 counters (a row in pieces, several
    rows per chunk, partial chunks) on in-place Philox, on the caller's thread or shared out over
    3 worker threads, any box of a sample equals the traced per-element formula ``bits.at``
    (functional Philox, each element picking its own lane)."""
    monkeypatch.setattr(bits, "CHUNK", 3)
    monkeypatch.setattr(bits, "SERIAL", 0)  # tiny fills use the workers too
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the fill's worker count (the caller's, so 1: on the caller)
    try:
        _check_fill_boxes()
    finally:
        torch.set_num_threads(before)


def _check_fill_boxes():
    key = (12345, 2**32 - 7)
    cases = [(samplers.normal_transform(torch.float32), 1, torch.float32), (samplers._bits63, 2, torch.int64)]
    for transform, width, dtype in cases:
        for shape, box in [
            ((5, 13), ((0, 5), (0, 13))),
            ((5, 13), ((1, 4), (3, 11))),
            ((7, 2), ((2, 7), (1, 2))),
            ((2, 3, 9), ((0, 2), (1, 3), (2, 9))),
            ((11, 31), ((0, 11), (0, 31))),
        ]:
            row, col = bits.grid(shape)
            ref = bits.at(key, row, col, shape[-1], width, transform).reshape(shape)
            got = bits.fill(key, shape, box, width, transform, dtype, torch.device("cpu"))
            assert torch.equal(got, ref[tuple(slice(a, b) for a, b in box)]), (shape, box, width)


def test_workers_run_single_threaded_and_leave_the_caller_alone():
    """The fill's workers run torch ops on one thread each (no OpenMP team to wait for), while the
    caller and threads started later keep the caller's count; an error in a worker reaches the caller."""
    from vsf.random import workers

    mine = torch.get_num_threads()
    counts = []
    workers.run(lambda take: counts.extend(torch.get_num_threads() for _ in take), range(4), threads=2)
    assert counts == [1] * 4
    assert torch.get_num_threads() == mine
    later = []
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert later == [mine]

    def fail(take):
        for _ in take:
            raise ValueError("in a worker")

    with pytest.raises(ValueError, match="in a worker"):
        workers.run(fail, range(3), threads=2)


# -- statistics -----------------------------------------------------------------------------------


def test_statistics():
    key = vsf.random.key(123)
    n = 1 << 20
    z = vsf.random.normal(key, (n,)).double()
    assert abs(z.mean()) < 0.01 and abs(z.var() - 1) < 0.01
    assert abs((z.abs() < 1).double().mean() - 0.6827) < 0.005 and z.abs().max() < 6
    u = vsf.random.uniform(key, (n,), minval=-1.0, maxval=2.0)
    assert u.min() >= -1 and u.max() < 2 and abs(u.double().mean() - 0.5) < 0.01
    u64 = vsf.random.uniform(key, (n,), torch.float64)
    assert u64.dtype == torch.float64 and (u64 * 2**53 % 1 == 0).all() and abs(u64.mean() - 0.5) < 0.005
    b = vsf.random.bernoulli(key, 0.3, (n,))
    assert b.dtype == torch.bool and abs(b.double().mean() - 0.3) < 0.005
    r = vsf.random.randint(key, (n,), 3, 13)
    counts = torch.bincount(r - 3, minlength=10).double() / n
    assert r.min() == 3 and r.max() == 12 and (counts - 0.1).abs().max() < 0.005
    t = vsf.random.truncated_normal(key, -0.5, 1.0, (n,))
    assert t.min() >= -0.5 and t.max() <= 1.0
    a, b_ = -0.5, 1.0  # mean of N(0, 1) truncated to [a, b]
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    assert abs(t.double().mean() - (pdf(a) - pdf(b_)) / (cdf(b_) - cdf(a))) < 0.005
    # different keys give different (uncorrelated) streams
    z2 = vsf.random.normal(vsf.random.fold_in(key, 1), (n,)).double()
    assert abs((z * z2).mean()) < 0.01


# -- keyed torch RNG and dropout --------------------------------------------------------------------


def test_dropout():
    key = vsf.random.key(7)
    x = torch.randn(64, 32)
    y = vsf.nn.dropout(key, x, 0.25)
    kept = y != 0
    assert abs(kept.double().mean() - 0.75) < 0.03
    torch.testing.assert_close(y[kept], x[kept] / 0.75)
    assert torch.equal(vsf.nn.dropout(key, x, 0.25), y)
    assert vsf.nn.dropout(key, x, 0.25, deterministic=True) is x
    with vsf.simulate(4):
        mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
        xs = vsf.device_put(x, vsf.NamedSharding(mesh, P("tp", "dp")))
        assert torch.equal(vsf.device_get(vsf.nn.dropout(key, xs, 0.25)), y)


def test_keyed_replaces_torch_rng():
    key = vsf.random.key(9)
    drop = nn.Dropout(0.5)
    x = torch.ones(16, 8)
    with vsf.random.keyed(key) as k:
        a = drop(x)
        r = torch.rand(3, 4)
        n = torch.randn(5)
        i = torch.randint(0, 10, (6,))
        w = torch.empty(4, 4)
        nn.init.normal_(w, std=0.1)
    assert k.draws == 5
    assert torch.equal(a, vsf.nn.dropout(vsf.random.fold_in(key, 0), x, 0.5))
    assert torch.equal(r, vsf.random.uniform(vsf.random.fold_in(key, 1), (3, 4)))
    assert torch.equal(n, vsf.random.normal(vsf.random.fold_in(key, 2), (5,)))
    assert torch.equal(i, vsf.random.randint(vsf.random.fold_in(key, 3), (6,), 0, 10))
    assert torch.equal(w, vsf.random.normal(vsf.random.fold_in(key, 4), (4, 4)) * 0.1)
    with vsf.random.keyed(key):  # CUDA's dropout path, at the aten level: the same mask as vsf.nn.dropout
        out, mask = torch.ops.aten.native_dropout.default(x, 0.5, True)
    assert torch.equal(out, a) and torch.equal(mask, a != 0)
    with pytest.raises(RuntimeError, match="no keyed replacement"):
        with vsf.random.keyed(key):
            torch.multinomial(torch.ones(4), 2)


def test_keyed_reset_parameters_on_dtensors():
    """A module's own reset_parameters under keyed() gives the same values on any layout."""
    key = vsf.random.key(3)
    plain = nn.Linear(6, 10)
    with vsf.random.keyed(key):
        plain.reset_parameters()
    with vsf.simulate(4):
        mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
        m = nn.Linear(6, 10)
        m.weight = nn.Parameter(vsf.device_put(m.weight.detach(), vsf.NamedSharding(mesh, P("tp", "dp"))))
        m.bias = nn.Parameter(vsf.device_put(m.bias.detach(), vsf.NamedSharding(mesh, P("dp"))))
        with vsf.random.keyed(key):
            m.reset_parameters()
        assert torch.equal(vsf.device_get(m.weight.detach()), plain.weight.detach())
        assert torch.equal(vsf.device_get(m.bias.detach()), plain.bias.detach())


def test_jit_refuses_unkeyed_rng():
    drop = nn.Dropout(0.1)
    with vsf.simulate(2):
        mesh = vsf.make_mesh((2,), ("dp",))
        x = vsf.device_put(torch.ones(4, 4), vsf.NamedSharding(mesh, P("dp")))
        with pytest.raises(TraceError, match="vsf.random.keyed"):
            vsf.jit(lambda x: drop(x))(x)
        with pytest.raises(TraceError, match="randn"):
            vsf.jit(lambda x: x + torch.randn(4, 4))(x)
        drop.eval()  # no draw: fine
        assert torch.equal(vsf.device_get(vsf.jit(lambda x: drop(x))(x)), torch.ones(4, 4))


# -- training with dropout through vsf.jit on every layout --------------------------------------------


class DropoutMLP(nn.Module):
    """A GPT-style MLP block with torch's nn.Dropout (0.1) and a vsf.nn.dropout on the residual."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.nn.functional.gelu(self.fc1(x)))
        out = x + vsf.nn.dropout(key, self.fc2(h), 0.1)
        return ((out - y) ** 2).mean()


def _train(params, x, y, keys, step):
    losses = []
    for k in keys:
        params, loss = step(params, x, y, k)
        losses.append(loss)
    return params, losses


LAYOUTS = {
    "dp": (((4,), ("dp",)), {"fc1.weight": P(), "fc1.bias": P(), "fc2.weight": P(), "fc2.bias": P()}, P("dp")),
    "fsdp": (
        ((4,), ("fsdp",)),
        {"fc1.weight": P("fsdp"), "fc1.bias": P("fsdp"), "fc2.weight": P("fsdp"), "fc2.bias": P("fsdp")},
        P("fsdp"),
    ),
    "tp": (
        ((4,), ("tp",)),
        {"fc1.weight": P("tp"), "fc1.bias": P("tp"), "fc2.weight": P(None, "tp"), "fc2.bias": P()},
        P(),
    ),
    "5d": (
        ((1, 2, 2, 1, 2), ("pp", "dp", "fsdp", "cp", "tp")),
        {"fc1.weight": P("tp", "fsdp"), "fc1.bias": P("tp"), "fc2.weight": P("fsdp", "tp"), "fc2.bias": P()},
        P(("dp", "fsdp")),
    ),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dropout_training_matches_one_device(layout):
    torch.manual_seed(0)
    model = DropoutMLP().train()
    params = vsf.tree.from_module(model)
    params = {k: v.detach().clone() for k, v in params.items()}
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    base = vsf.random.key(11)
    keys = [vsf.random.fold_in(base, i) for i in range(5)]

    def step(params, x, y, key):
        k_torch, k_vsf = vsf.random.split(key)
        with vsf.random.keyed(k_torch):
            loss, grads = vsf.value_and_grad(lambda p: vsf.tree.apply(model, p, x, y, k_vsf))(params)
        return vsf.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    ref_params, ref_losses = _train(params, x, y, keys, step)
    (sizes, names), specs, batch_spec = LAYOUTS[layout]
    with vsf.simulate(math.prod(sizes)):
        mesh = vsf.make_mesh(sizes, names)
        sharded = vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs))
        xb, yb = (vsf.device_put(t, vsf.NamedSharding(mesh, batch_spec)) for t in (x, y))
        keys_r = [vsf.device_put(k, vsf.NamedSharding(mesh, P())) for k in keys]
        jitted = vsf.jit(step)
        out_params, losses = _train(sharded, xb, yb, keys_r, jitted)
        assert jitted.plan_count == 1
        torch.testing.assert_close(
            torch.stack([vsf.device_get(l) for l in losses]), torch.stack(ref_losses), rtol=1e-5, atol=1e-6
        )
        for name, p in vsf.device_get(out_params).items():
            torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(ref_losses[0], ref_losses[1])  # the masks change with the step key


# -- sharded init --------------------------------------------------------------------------------


def test_init_sharded_equals_unsharded():
    from toy_models import GPT, GPTConfig

    cfg = GPTConfig(vocab=31, seq=7, dim=10, heads=2, layers=2)  # uneven dims
    with torch.device("meta"):
        shapes = vsf.tree.from_module(GPT(cfg))
    inits = {
        k: vsf.nn.initializers.zeros
        if k.endswith("bias")
        else vsf.nn.initializers.ones
        if ".ln" in k or k.startswith("lnf")
        else vsf.nn.initializers.xavier_uniform()
        if v.ndim == 2 and "wte" not in k
        else vsf.nn.initializers.normal(0.02)
        for k, v in shapes.items()
    }
    key = vsf.random.key(5)
    full = vsf.random.init_sharded(inits, key, shapes)
    assert all(not isinstance(v, torch.distributed.tensor.DTensor) for v in full.values())
    with vsf.simulate(8):
        mesh = vsf.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
        specs = vsf.sharding.match(
            shapes, [(r".*(qkv|proj|fc1|fc2|wte|wpe)\.weight", P("fsdp", "tp")), (r".*", P(("dp", "tp")))]
        )
        params = vsf.random.init_sharded(inits, key, shapes, vsf.NamedSharding.tree(mesh, specs))
        for name, p in params.items():
            assert (
                vsf.sharding.sharding_of(p).spec == specs[name].normalized()
                or vsf.sharding.sharding_of(p).is_fully_replicated
            )
            assert torch.equal(vsf.device_get(p), full[name]), name
    # a leaf's values do not depend on the other leaves
    alone = vsf.random.init_sharded(
        inits["blocks.0.fc1.weight"], key, {"blocks.0.fc1.weight": shapes["blocks.0.fc1.weight"]}
    )
    assert torch.equal(alone["blocks.0.fc1.weight"], full["blocks.0.fc1.weight"])


def test_initializers_match_torch_formulas():
    key = vsf.random.key(0)
    w = vsf.nn.initializers.kaiming_uniform(a=math.sqrt(5))(key, (512, 256))
    bound = 1 / math.sqrt(256)  # nn.Linear's weight bound
    assert w.abs().max() <= bound and w.abs().max() > 0.99 * bound
    x = vsf.nn.initializers.xavier_uniform()(key, (300, 200))
    assert x.abs().max() <= math.sqrt(6 / 500) and abs(x.var() - 2 / 500) < 2e-4
    h = vsf.nn.initializers.he_normal()(key, (400, 300))
    assert abs(h.var() - 2 / 300) < 3e-4
    t = vsf.nn.initializers.truncated_normal(0.02)(key, (500, 500))
    assert t.abs().max() <= 0.04 and abs(t.std() - 0.02 * 0.8796) < 3e-4
    ln = vsf.nn.initializers.lecun_normal()(key, (400, 400))
    assert abs(ln.var() - 1 / 400) < 1e-4
    assert torch.equal(vsf.nn.initializers.ones(key, (3,)), torch.ones(3))


def test_init_sharded_planning_only_allocates_local_shards():
    """A ~1B-parameter pytree on a planning-only 1024-rank 5D mesh: this process holds rank 0's shards."""
    d, layers = 2048, 20
    shapes = {"embed": vsf.ShapeDtypeStruct((32000, d), torch.float32)}
    for i in range(layers):
        shapes |= {
            f"{i}.qkv": vsf.ShapeDtypeStruct((3 * d, d), torch.float32),
            f"{i}.proj": vsf.ShapeDtypeStruct((d, d), torch.float32),
            f"{i}.fc1": vsf.ShapeDtypeStruct((4 * d, d), torch.float32),
            f"{i}.fc2": vsf.ShapeDtypeStruct((d, 4 * d), torch.float32),
            f"{i}.ln": vsf.ShapeDtypeStruct((d,), torch.float32),
        }
    total = sum(math.prod(s.shape) for s in shapes.values())
    assert total > 1e9
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with vsf.simulate(1024, compute=False):
        mesh = vsf.make_mesh((4, 4, 8, 2, 4), ("pp", "dp", "fsdp", "cp", "tp"))
        specs = {k: P(("dp", "fsdp"), "tp") if s.ndim == 2 else P("tp") for k, s in shapes.items()}
        shardings = vsf.NamedSharding.tree(mesh, specs)
        params = vsf.random.init_sharded(vsf.nn.initializers.normal(0.02), vsf.random.key(0), shapes, shardings)
        report = vsf.debug.memory_report(params)
        expected = sum(math.prod(shardings[k].shard_shape(s.shape, 0)) * 4 for k, s in shapes.items())
        assert report == {0: expected}
        assert expected < total * 4 / 100
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    assert rss_growth < total * 4 / 8, f"peak RSS grew by {rss_growth / 2**20:.0f} MiB"


# -- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bits_equal_cpu():
    key = vsf.random.key(2024)
    shape = (333, 77)
    for name in ("uniform_f64", "uniform_f16", "bernoulli", "randint"):
        cpu = SAMPLERS[name](key, shape)
        cuda = SAMPLERS[name](key.cuda(), shape)
        assert cuda.is_cuda and torch.equal(cuda.cpu(), cpu), name
    # normal uses torch.erfinv, whose CUDA and CPU kernels may differ in the last bit
    torch.testing.assert_close(
        vsf.random.normal(key.cuda(), shape).cpu(), vsf.random.normal(key, shape), rtol=2e-7, atol=0
    )


def test_compiled_philox_gives_the_same_bits(monkeypatch):
    """vsf.config.compile_random: the Philox chunk as one torch.compile'd kernel, same integers."""
    key = vsf.random.key(77)
    shape = (3, 70001)  # more than one chunk, and a partial one
    eager = {name: SAMPLERS[name](key, shape) for name in ("normal", "randint", "uniform_f64")}
    monkeypatch.setattr(vsf.config, "compile_random", True)
    for name, ref in eager.items():
        assert torch.equal(SAMPLERS[name](key, shape), ref), name


def test_jitted_dropout_mask_is_computed_on_shards():
    """Inside vsf.jit each rank computes only its shard of the mask: every full-size op of the
    sampler runs sharded like the input, and the step sends nothing."""
    from torch.distributed.tensor import Shard

    with vsf.simulate(4):
        mesh = vsf.make_mesh((4,), ("dp",))
        x = vsf.device_put(torch.zeros(64, 32), vsf.NamedSharding(mesh, P("dp")))
        lowered = vsf.jit(lambda x, k: vsf.nn.dropout(k, x, 0.1)).lower(x, vsf.random.key(0))
        full = [
            (n, p.outs[0])
            for n, p in lowered.plan.nodes.items()
            if isinstance(n.meta.get("val"), torch.Tensor) and tuple(n.meta["val"].shape) == (64, 32)
        ]
        assert len(full) > 50 and all(out == (Shard(0),) for _, out in full)
        assert lowered.cost().comm_bytes == {} or not any(lowered.cost().comm_bytes.values())


def test_allow_unkeyed_random_runs_torch_rng(monkeypatch):
    monkeypatch.setattr(vsf.config, "allow_unkeyed_random", True)
    monkeypatch.setattr(vsf.config, "allow_replicated_fallback", True)  # CPU dropout's bernoulli has no strategy
    with vsf.simulate(2):
        mesh = vsf.make_mesh((2,), ("dp",))
        x = vsf.device_put(torch.ones(4, 4), vsf.NamedSharding(mesh, P("dp")))
        y = vsf.device_get(vsf.jit(lambda x: torch.nn.functional.dropout(x, 0.5))(x))
        assert set(y.unique().tolist()) <= {0.0, 2.0}


def test_hf_gpt2_with_dropout_through_jit_matches_one_device():
    """A model no one here wrote: GPT-2 (transformers, tiny random config) with every dropout at
    0.1, its F.dropout calls keyed, one DP step through vsf.jit against the same step on one device."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(cfg).train()
    params = {k: v.detach().clone() for k, v in vsf.tree.from_module(model).items()}
    idx = torch.randint(0, 64, (4, 8))
    key = vsf.random.key(1)

    def step(params, idx, key):
        with vsf.random.keyed(key):
            return vsf.value_and_grad(
                lambda p: vsf.tree.apply(model, p, input_ids=idx, labels=idx, use_cache=False).loss
            )(params)

    ref_loss, ref_grads = step(params, idx, key)
    assert not torch.equal(ref_loss, step(params, idx, vsf.random.key(2))[0])  # the masks matter
    with vsf.simulate(2):
        mesh = vsf.make_mesh((2,), ("dp",))
        loss, grads = vsf.jit(step)(
            vsf.device_put(params, vsf.NamedSharding(mesh, P())),
            vsf.device_put(idx, vsf.NamedSharding(mesh, P("dp"))),
            key,
        )
        torch.testing.assert_close(vsf.device_get(loss), ref_loss, rtol=1e-5, atol=1e-6)
        for name, g in vsf.device_get(grads).items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
