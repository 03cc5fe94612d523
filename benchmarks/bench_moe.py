"""Expert parallelism: Hugging Face Mixtral (8 experts, top-2) with its experts split over ``ep``
on a ``("dp", "ep") = 2x2`` mesh, the tokens over both axes, planned two ways side by side:

* ``dispatch``: the specs alone (``vsf.jit`` runs the experts through ``vsf.nn.expert_parallel``:
  tokens sent to the experts' ranks and back by ragged all-to-alls);
* ``gather``: the same specs with ``vsf.config.dispatch_experts = False``: the model's own
  ``grouped_mm`` experts, planned by ``vsf.jit`` as they are (the planner brings the experts'
  weights to the tokens).

Rows: the bytes each rank sends over ``ep`` per training step (the plan's ``Cost``) of the two;
the same for the model in two pipeline stages on ``("pp", "ep") = 2x2`` (two microbatches, the
batch over ep: the dispatch exchanges each microbatch's tokens, the gather brings each stage's
experts once a step and reduce-scatters their gradients once; ``PipelineCost``);
the dispatch plan's all-to-all bytes against the analytic dispatch + combine volume (per layer:
the rank's tokens x top-k x hidden x 4 bytes, four times: dispatch and combine, forward and
backward); the step time of the two on 4 ranks simulated in this process (every rank's compute
in one process, so it says how much work and copying each plan does, not network time). Run::

    python -m benchmarks.bench_moe [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPERTS, TOP_K = 8, 2


def _sizes(quick: bool) -> dict[str, int]:
    return (
        {"hidden": 32, "ffn": 64, "layers": 2, "batch": 4, "seq": 16}
        if quick
        else {"hidden": 128, "ffn": 256, "layers": 2, "batch": 8, "seq": 64}
    )


def _with_dispatch(on: bool, f):
    """``f()`` with ``vsf.config.dispatch_experts`` set to ``on`` (restored after)."""
    import vsf

    before, vsf.config.dispatch_experts = vsf.config.dispatch_experts, on
    try:
        return f()
    finally:
        vsf.config.dispatch_experts = before


def run(quick: bool) -> list[dict]:
    import torch
    import transformers as T

    sys.path.insert(0, str(ROOT / "tests" / "models"))
    import zoo

    import vsf
    from vsf import P, optim

    z = _sizes(quick)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return T.MixtralForCausalLM(
            T.MixtralConfig(
                vocab_size=zoo.VOCAB,
                hidden_size=z["hidden"],
                intermediate_size=z["ffn"],
                num_hidden_layers=z["layers"],
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=2 * z["seq"],
                num_local_experts=EXPERTS,
                num_experts_per_tok=TOP_K,
            )
        )

    ids = torch.randint(0, zoo.VOCAB, (z["batch"], z["seq"]), generator=torch.Generator().manual_seed(1))
    tx = zoo.adamw()
    cost, steps = {}, {}
    with vsf.simulate(4):
        mesh = vsf.make_mesh((2, 2), ("dp", "ep"))
        batch = vsf.device_put({"input_ids": ids, "labels": ids}, vsf.NamedSharding(mesh, P(("dp", "ep"))))
        for name in ("dispatch", "gather"):
            model = build()
            params = vsf.tree.from_module(model)
            specs = {k: P("ep") if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else P() for k in params}
            p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs))
            s = optim.init_sharded(tx, p)
            step = vsf.jit(zoo.train_step(model, tx))
            dispatch = name == "dispatch"
            cost[name] = _with_dispatch(dispatch, lambda: step.lower(p, s, batch).cost())
            state = [p, s]

            def one(step=step, state=state, dispatch=dispatch) -> None:
                state[0], state[1], loss = _with_dispatch(dispatch, lambda: step(state[0], state[1], batch))
                vsf.device_get(loss)

            one()  # the first call compiles, the second records the replay
            one()
            steps[name] = one
        times: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(3 if quick else 10):
            for name, one in steps.items():
                t0 = time.perf_counter()
                one()
                times[name].append(time.perf_counter() - t0)
        piped = {name: _with_dispatch(name == "dispatch", lambda: _pipelined_ep_bytes(build, ids)) for name in cost}
    ep = {k: c.comm_bytes.get("ep", 0) for k, c in cost.items()}
    exchanged = sum(c.bytes for c in cost["dispatch"].collectives if c.axis == "ep" and c.kind == "all_to_all_v")
    analytic = z["layers"] * 4 * (z["batch"] * z["seq"] // 4) * TOP_K * z["hidden"] * 4
    t = {k: statistics.median(v) for k, v in times.items()}
    where = f"Mixtral {EXPERTS} experts top-{TOP_K}, hidden {z['hidden']}, {z['layers']} layers, {z['batch']}x{z['seq']} tokens, dp x ep = 2x2"
    return [
        {
            "name": f"bytes over ep per step, dispatch plan vs gather plan ({where})",
            "vsf": ep["dispatch"],
            "ref": ep["gather"],
            "unit": "B",
            "ratio": ep["dispatch"] / ep["gather"],
            "target": "< 1",
            "met": ep["dispatch"] < ep["gather"],
        },
        {
            "name": "bytes over ep per step, pipelined (pp x ep = 2x2, 2 microbatches), dispatch plan vs gather plan",
            "vsf": piped["dispatch"],
            "ref": piped["gather"],
            "unit": "B",
            "ratio": piped["dispatch"] / piped["gather"],
            "target": "-",
            "met": None,
        },
        {
            "name": "dispatch plan's all-to-all bytes over ep vs analytic dispatch + combine volume",
            "vsf": exchanged,
            "ref": analytic,
            "unit": "B",
            "ratio": exchanged / analytic,
            "target": "<= 1",
            "met": exchanged <= analytic,
        },
        {
            "name": "step time on 4 simulated ranks, dispatch plan vs gather plan",
            "vsf": t["dispatch"],
            "ref": t["gather"],
            "unit": "s",
            "ratio": t["dispatch"] / t["gather"],
            "target": "-",
            "met": None,
        },
    ]


def _pipelined_ep_bytes(build, ids) -> int:
    """The most bytes a rank sends over ``ep`` per step, the model ``build()`` makes cut into two
    stages (``zoo.pipeline_stages``) over ``pp`` of a ``("pp", "ep") = 2x2`` mesh, 1F1B with two
    microbatches, the experts ``P("ep")`` and the batch ``ids`` over ep (planned, not run)."""
    import zoo

    import vsf
    from vsf import P

    model = build()
    params = vsf.tree.from_module(model)
    fns, prefixes, tied = zoo.pipeline_stages("mixtral", model)
    mesh = vsf.make_mesh((2, 2), ("pp", "ep"))
    pipe = vsf.pipeline.Pipeline(fns, zoo.causal_lm_loss, prefixes, mesh=mesh, microbatches=2, batch=P("ep"), tied=tied)
    specs = {k: P("ep") if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else P() for k in params}
    p, layout = pipe.place(params, specs)
    return pipe.lower(p, ids, ids, layout=layout).cost().comm_bytes.get("ep", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the zoo's tiny sizes, fewer repetitions")
    for row in run(parser.parse_args().quick):
        print(
            f"{row['name']:<100} vsf {row['vsf']:12.6g}  ref {row['ref']:12.6g}  ratio {row['ratio']:6.3f}  (target {row['target']})"
        )


if __name__ == "__main__":
    main()
