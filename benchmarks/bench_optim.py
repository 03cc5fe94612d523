"""``vsf.optim.adamw`` update vs ``torch.optim.AdamW(foreach=True)`` on the same tensors, one process.

The pytree is a GPT-2-small-like parameter set of mixed shapes (~110M fp32 parameters; about
0.5M with ``--quick``). One vsf step is ``tx.update`` + ``apply_updates``, eagerly (functional:
new params and state each step) and in a ``vsf.jit`` step that donates params and state (on a
one-rank mesh); one torch step is ``optimizer.step()`` (in place). Both run in
the same process, interleaved, after a warm-up; the time is the median over repetitions.
A ratio above 1 means vsf is slower. A last row sets the jitted step against torch's fastest,
``torch.optim.AdamW(fused=True)`` (no target: the reference the issue names is ``foreach``). Run::

    python -m benchmarks.bench_optim [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import vsf


def param_shapes(quick: bool) -> dict[str, tuple[int, ...]]:
    """Embedding, per-block attention / MLP weights and biases, norms: a GPT-2-small layout."""
    d, layers, vocab = (128, 2, 1000) if quick else (768, 12, 32000)
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, d), "pos": (1024, d), "ln_f.w": (d,), "ln_f.b": (d,)}
    for i in range(layers):
        block = {
            "ln1.w": (d,),
            "ln1.b": (d,),
            "qkv.w": (3 * d, d),
            "qkv.b": (3 * d,),
            "proj.w": (d, d),
            "proj.b": (d,),
            "ln2.w": (d,),
            "ln2.b": (d,),
            "fc1.w": (4 * d, d),
            "fc1.b": (4 * d,),
            "fc2.w": (d, 4 * d),
            "fc2.b": (d,),
        }
        shapes.update({f"blocks.{i}.{k}": v for k, v in block.items()})
    return shapes


def _timed(step: Callable[[], None], reps: list[float]) -> None:
    start = time.perf_counter()
    step()
    reps.append(time.perf_counter() - start)


HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _setup(quick: bool) -> tuple[dict, dict]:
    """The params and their grads."""
    torch.manual_seed(0)
    params = {k: torch.randn(s) for k, s in param_shapes(quick).items()}
    return params, {k: torch.randn_like(v) for k, v in params.items()}


def _torch_adamw(params: dict, grads: dict, impl: str) -> torch.optim.Optimizer:
    """torch's AdamW (its ``foreach`` or ``fused`` implementation) over clones of the params."""
    torch_params = {k: v.clone().requires_grad_() for k, v in params.items()}
    for k, p in torch_params.items():
        p.grad = grads[k]
    return torch.optim.AdamW(list(torch_params.values()), **{impl: True}, **HYPER)


def _race(
    name: str,
    vsf_step: Callable[[], None],
    ref_step: Callable[[], None],
    numel: int,
    leaves: int,
    repeats: int,
    impl: str = "foreach",
) -> dict:
    """One row: median seconds per step of ``vsf_step`` and ``ref_step``, interleaved after a warm-up."""
    vsf_times: list[float] = []
    ref_times: list[float] = []
    for _ in range(2):  # warm-up: allocator, lazy state, the jit's plan
        vsf_step()
        ref_step()
    for _ in range(repeats):
        _timed(vsf_step, vsf_times)
        _timed(ref_step, ref_times)
    vsf_s, ref_s = statistics.median(vsf_times), statistics.median(ref_times)
    return {
        "name": f"{name} vs torch.optim.AdamW({impl}=True), {numel / 1e6:.1f}M fp32 params, {leaves} leaves",
        "vsf": vsf_s,
        "ref": ref_s,
        "unit": "s",
        "ratio": vsf_s / ref_s,
        "target": "<= 1.1" if impl == "foreach" else "none set",
        "met": vsf_s / ref_s <= 1.1 if impl == "foreach" else None,
    }


def bench_adamw(quick: bool, *, repeats: int) -> list[dict]:
    """Three rows, vsf vs torch on the same tensors and hyperparameters: the eager functional update
    (``tx.update`` + ``apply_updates``, new params and state each step) and the same in a
    ``vsf.jit`` step with params and state donated (the plan updates their buffers in place),
    each against torch's ``foreach`` AdamW; then the jitted step against torch's ``fused`` one."""
    params, grads = _setup(quick)
    tx = vsf.optim.adamw(HYPER["lr"], *HYPER["betas"], HYPER["eps"], HYPER["weight_decay"])
    numel = sum(v.numel() for v in params.values())
    carry = {"params": params, "state": tx.init(params)}

    def eager_step() -> None:
        updates, carry["state"] = tx.update(grads, carry["state"], carry["params"])
        carry["params"] = vsf.optim.apply_updates(carry["params"], updates)

    @vsf.jit(donate_argnums=(0, 1))
    def jit_step(params: dict, state: Any, grads: dict) -> tuple[dict, Any]:
        updates, state = tx.update(grads, state, params)
        return vsf.optim.apply_updates(params, updates), state

    mesh = vsf.make_mesh((1,), ("dp",))
    put = vsf.NamedSharding(mesh, vsf.P())
    jit_carry = {
        "params": vsf.device_put({k: v.clone() for k, v in params.items()}, put),
        "grads": vsf.device_put(grads, put),
    }
    jit_carry["state"] = tx.init(jit_carry["params"])

    def donated_step() -> None:
        jit_carry["params"], jit_carry["state"] = jit_step(jit_carry["params"], jit_carry["state"], jit_carry["grads"])

    foreach, fused = _torch_adamw(params, grads, "foreach"), _torch_adamw(params, grads, "fused")
    return [
        _race("adamw update (eager, functional)", eager_step, foreach.step, numel, len(params), repeats),
        _race("adamw update in a donated vsf.jit step", donated_step, foreach.step, numel, len(params), repeats),
        _race(
            "adamw update in a donated vsf.jit step",
            donated_step,
            fused.step,
            numel,
            len(params),
            repeats,
            impl="fused",
        ),
    ]


def run(quick: bool) -> list[dict]:
    """Rows of the suite's table (see ``benchmarks``); ``ref``: ``torch.optim.AdamW(foreach=True)``."""
    return bench_adamw(quick, repeats=5 if quick else 7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model (seconds instead of a minute)")
    args = parser.parse_args()
    for row in run(args.quick):
        print(
            f"{row['name']}: vsf {row['vsf'] * 1e3:.1f} ms, torch {row['ref'] * 1e3:.1f} ms, ratio {row['ratio']:.2f}"
        )


if __name__ == "__main__":
    main()
