"""Small models for tests and benchmarks, written as plain PyTorch modules."""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq: int = 16
    dim: int = 32
    heads: int = 4
    layers: int = 2
    tied: bool = True
    qkv_bias: bool = True
    fused_qkv: bool = True  # False: separate q, k, v projections (what torch TP's colwise split needs)
    sdpa: bool = False  # True: causal F.scaled_dot_product_attention in place of the explicit masked softmax


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        # The key bias gets an exactly-zero gradient (softmax ignores a per-query constant), which
        # Adam turns into noise-sized steps; optimizer tests turn it off.
        self.hd = cfg.dim // cfg.heads
        if cfg.fused_qkv:
            self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=cfg.qkv_bias)
        else:
            self.q, self.k, self.v = (nn.Linear(cfg.dim, cfg.dim, bias=cfg.qkv_bias) for _ in range(3))
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.sdpa = cfg.sdpa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.qkv(x).split(c, dim=-1) if hasattr(self, "qkv") else (self.q(x), self.k(x), self.v(x))
        # heads as -1: under torch TP each rank holds its own heads' columns (a local width)
        q, k, v = (z.reshape(b, t, -1, self.hd).transpose(1, 2) for z in qkv)
        if self.sdpa:
            return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, -1)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc1 = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.fc2 = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.lnf = nn.LayerNorm(cfg.dim)
        self.head = None if cfg.tied else nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        x = self.lnf(x)
        logits = x @ self.wte.weight.t() if self.head is None else self.head(x)
        return F.cross_entropy(logits.reshape(b * t, -1), targets.reshape(b * t))


def params_saved_for_backward(model: nn.Module, *args) -> set[str]:
    """The names of ``model``'s params whose storage autograd saves for the backward of one plain
    ``model(*args)`` (what a backward reads of them: FSDP gathers these again when it reshards
    after forward)."""
    storages = {p.untyped_storage().data_ptr(): name for name, p in model.named_parameters()}
    saved: set[str] = set()

    def storage(t: torch.Tensor) -> int | None:
        try:
            return t.untyped_storage().data_ptr()
        except RuntimeError:  # (a tensor without storage: not a param)
            return None

    def pack(t: torch.Tensor) -> torch.Tensor:
        if storage(t) in storages:
            saved.add(storages[storage(t)])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args)
    return saved


def adamw_gpt_case():
    """A 1-layer GPT (no qkv bias: the key bias gets an exactly-zero gradient, which Adam turns into
    noise-sized steps), its params, a batch, ``chain(clip, adamw)`` and the train step over them."""
    import vsf
    from vsf import optim

    cfg = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1, qkv_bias=False)
    model = GPT(cfg)
    params = vsf.tree.from_module(model)
    batch = (torch.randint(0, cfg.vocab, (8, cfg.seq)), torch.randint(0, cfg.vocab, (8, cfg.seq)))
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(3e-3, weight_decay=0.1))

    def train_step(params, opt_state, idx, tgt):
        loss, grads = vsf.value_and_grad(lambda p: vsf.tree.apply(model, p, idx, tgt))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    return params, batch, tx, train_step


class Counted(nn.Module):
    """``tanh(linear(x))`` that, training, counts the rows it sees and sums them: buffers written in
    forward with ``add_`` (as torchtitan's MoE router counts its tokens)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.register_buffer("rows", torch.zeros((), dtype=torch.int64))
        self.register_buffer("total", torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.rows.add_(x.shape[0])
                self.total.add_(x.sum(0))
        return torch.tanh(self.lin(x))


COUNTED_LR, COUNTED_WD = 1e-2, 0.1


def squared_error(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).mean()


def counted_case(layers: int, steps: int = 3):
    """``layers`` :class:`Counted` layers in a ``Sequential``, ``steps`` batches of 8 rows (inputs,
    targets), and torch's result on one device of ``steps`` AdamW steps on the whole batches: the
    losses, the params and the buffers after them."""
    torch.manual_seed(0)
    model = nn.Sequential(*(Counted(8) for _ in range(layers)))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(steps)]
    trained = copy.deepcopy(model)
    opt = torch.optim.AdamW(trained.parameters(), lr=COUNTED_LR, weight_decay=COUNTED_WD)
    losses = []
    for x, t in batches:
        opt.zero_grad()
        loss = squared_error(trained(x), t)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = {k: v.detach() for k, v in trained.named_parameters()}
    return model, batches, (losses, params, dict(trained.named_buffers()))


def counted_pipelined(model: nn.Sequential, batches, mesh, schedule: str):
    """``model`` (:func:`counted_case`'s) trained by ``vsf.pipeline`` one layer a stage over ``mesh``'s
    ``pp``, the batch over its ``dp``, 2 microbatches, each stage carrying the buffers its layer
    writes as the step's state: each step's loss, the params and the state after the last, and the
    step's plan (``pipe.lower`` on the first batch)."""
    import vsf
    from vsf import P, optim

    def stage(s: int):
        prefix = f"{s}."

        def layer(params, state, x):
            own = {k[len(prefix) :]: v for k, v in {**params, **state}.items()}
            y, written = vsf.tree.apply(model[s], own, x, mutable=True)
            return y, {prefix + k: v for k, v in written.items()}

        return layer

    layers = range(len(model))
    pipe = vsf.pipeline.Pipeline(
        [stage(s) for s in layers],
        squared_error,
        [[f"{s}."] for s in layers],
        mesh=mesh,
        microbatches=2,
        schedule=schedule,
        batch=P("dp"),
    )
    params, layout = pipe.place(vsf.tree.from_module(model))
    state = pipe.place(vsf.tree.from_module(model, params=False, buffers=True), state=True)
    lowered = pipe.lower(params, *batches[0], layout=layout, state=state)
    tx = optim.adamw(COUNTED_LR, weight_decay=COUNTED_WD)
    opt_state, losses = tx.init(params), []
    for x, t in batches:
        (loss, state), grads = pipe.value_and_grad(params, x, t, layout=layout, state=state)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optim.apply_updates(params, updates)
        losses.append(vsf.device_get(loss).item())
    return losses, params, state[0], lowered


def chain_program(*ops):
    """An fx program of one input through ``ops`` in turn, each called on the last one's result
    (for the tests that read which ops a program holds, never run)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    for op in ops:
        x = graph.call_function(op, (x,))
    graph.output(x)
    return torch.fx.GraphModule({}, graph)
