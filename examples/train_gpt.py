"""Train a small GPT with vsf on a 5D mesh (pp, dp, fsdp, cp, tp), end to end.

Params are a pytree laid out by regex rules (Megatron tensor parallelism over ``tp``, FSDP over
``fsdp``), the AdamW state is sharded further over ``dp`` (ZeRO), one ``vsf.jit`` step with
donated params and state does forward, backward, clipping and the update, and a
``CheckpointManager`` saves every ``--save-every`` steps in the background. The data is
generated (repeated random patterns, see ``gpt.py``), and the batch of step ``s`` depends only
on ``s``, so ``--resume`` continues from the last committed checkpoint with exactly the losses
an uninterrupted run has. Each process hands vsf only its own slice of every batch
(``vsf.make_array_from_process_local_data``), as a data loader reading a shard per process does.

Run it::

    python examples/train_gpt.py --simulate 8               # 8 ranks simulated in this process
    python -m vsf.launch -n 4 examples/train_gpt.py         # 4 processes (gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 4 examples/train_gpt.py       # the same, with torchrun's own flags
    python examples/train_gpt.py --simulate 8 --resume      # continue from the last checkpoint

The mesh is derived from the number of ranks (factors of 2 go to dp, fsdp, tp in turn) unless
``--dp/--fsdp/--tp`` say otherwise; ``--cp N`` splits every sequence over N ranks (context
parallelism: attention runs on sequence shards); ``--pp N`` cuts the blocks into N pipeline stages
over the pp axis (``vsf.pipeline``: GPipe, 1F1B or, with two stages per pp rank, interleaved 1F1B
and the zero-bubble zb, zbv and dualpipev, over ``--microbatches``); dp, fsdp, cp and tp apply
inside each stage; checkpoints hold each stage's leaves once, so ``--resume`` works and a
pipelined checkpoint loads onto any other layout).
At the end it prints per-rank memory, the collective bytes per mesh axis from the step's plan,
and writes the loss curve to ``<out>/loss.png`` (with matplotlib installed).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

import vsf
from vsf import P, optim
from vsf.stages import Cost, Jitted

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import GPT, GPTConfig, batch_at, floor_loss, pipeline_stages  # noqa: E402

AXES = ("pp", "dp", "fsdp", "cp", "tp")

# Megatron's split over tp (column-parallel qkv and fc1, row-parallel proj and fc2), the other
# dim of each matrix over fsdp; embeddings split over fsdp by rows; norms replicated.
RULES = [
    (r".*(qkv|fc1)\.weight", P("tp", "fsdp")),
    (r".*(proj|fc2)\.weight", P("fsdp", "tp")),
    (r"(wte|wpe)\.weight", P("fsdp")),
    (r".*", P()),
]
BATCH = P(("dp", "fsdp"), "cp")  # the batch dim over every data-parallel axis, each sequence over cp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run = p.add_argument_group("ranks and mesh")
    run.add_argument(
        "--simulate",
        type=int,
        metavar="N",
        help="simulate N ranks in this process (default: the ranks torchrun started, or 1)",
    )
    for axis in ("dp", "fsdp", "tp"):
        run.add_argument(
            f"--{axis}", type=int, help=f"size of the {axis} axis (default: derived from the number of ranks)"
        )
    run.add_argument(
        "--cp", type=int, default=1, help="size of the cp axis: each sequence split over this many ranks (default 1)"
    )
    run.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages over the pp axis, each a run of consecutive blocks (default 1)",
    )
    run.add_argument("--microbatches", type=int, default=4, help="microbatches per step with --pp (default 4)")
    run.add_argument(
        "--schedule",
        choices=sorted(vsf.pipeline.SCHEDULES),
        default="1f1b",
        help="pipeline schedule with --pp (default 1f1b; interleaved and zb, its zero-bubble form, and the V-shaped zero-bubble zbv and dualpipev: two stages on each pp rank)",
    )
    model = p.add_argument_group("model and data")
    model.add_argument("--vocab", type=int, default=16)
    model.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    model.add_argument("--dim", type=int, default=64)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--period", type=int, default=4, help="longest repeated pattern in the data")
    model.add_argument("--batch", type=int, default=64, help="sequences per step (global)")
    model.add_argument("--seed", type=int, default=0, help="seeds the params and the data")
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=200)
    train.add_argument(
        "--lr", type=float, default=1e-2, help="peak learning rate (linear warmup, cosine decay to 0 at --steps)"
    )
    train.add_argument("--warmup", type=int, default=None, help="warmup steps (default: steps // 10)")
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm")
    out = p.add_argument_group("checkpoints and output")
    out.add_argument(
        "--out", type=Path, default=Path("runs/train_gpt"), help="checkpoints, metrics.jsonl and loss.png go here"
    )
    out.add_argument("--save-every", type=int, default=50, help="save a checkpoint every N steps (and at the end)")
    out.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    out.add_argument("--resume", action="store_true", help="continue from the last committed checkpoint in <out>/ckpt")
    out.add_argument(
        "--log-every",
        type=int,
        default=None,
        help="steps between log lines when stdout is not a terminal (default: steps // 10)",
    )
    out.add_argument(
        "--print-plan",
        action="store_true",
        help="print the jitted step's plan (every op's shardings and every collective)",
    )
    args = p.parse_args(argv)
    if not 1 <= args.pp <= args.layers:
        p.error(f"--pp {args.pp} must be between 1 and --layers {args.layers}: each stage holds at least one block")
    if args.schedule in vsf.pipeline.INTERLEAVED and args.pp > 1 and 2 * args.pp > args.layers:
        p.error(
            f"--schedule {args.schedule} puts two stages on each of the --pp {args.pp} ranks: it needs --layers {2 * args.pp} or more, got {args.layers}"
        )
    if args.cp < 1 or args.seq % args.cp:
        p.error(
            f"--cp {args.cp} must be a positive divisor of --seq {args.seq} (each rank holds an equal part of every sequence)"
        )
    return args


def config(args: argparse.Namespace) -> GPTConfig:
    """The model and data sizes the command line asks for."""
    return GPTConfig(
        vocab=args.vocab, seq=args.seq, dim=args.dim, heads=args.heads, layers=args.layers, period=args.period
    )


def mesh_shape(
    world: int, dp: int | None = None, fsdp: int | None = None, tp: int | None = None, cp: int = 1, pp: int = 1
) -> dict[str, int]:
    """The 5D mesh for ``world`` ranks: ``pp``, ``cp`` and the given sizes are kept, factors of 2 of the
    rest go to the unset axes among dp, fsdp, tp in turn (8 ranks: 2 x 2 x 2), an odd remainder
    to the first unset.

    Example::

        >>> mesh_shape(8)
        {'pp': 1, 'dp': 2, 'fsdp': 2, 'cp': 1, 'tp': 2}
        >>> mesh_shape(4, tp=1)
        {'pp': 1, 'dp': 2, 'fsdp': 2, 'cp': 1, 'tp': 1}
        >>> mesh_shape(8, cp=2)
        {'pp': 1, 'dp': 2, 'fsdp': 2, 'cp': 2, 'tp': 1}
        >>> mesh_shape(4, pp=2)
        {'pp': 2, 'dp': 2, 'fsdp': 1, 'cp': 1, 'tp': 1}
    """
    given = {"dp": dp, "fsdp": fsdp, "tp": tp}
    if world % (cp * pp):
        raise ValueError(f"{world} ranks cannot be split as pp={pp} x cp={cp}: it must divide {world}")
    world //= cp * pp
    fixed = math.prod(v for v in given.values() if v is not None)
    if world % fixed:
        raise ValueError(
            f"{world} ranks cannot be split as { ({k: v for k, v in given.items() if v is not None}) }: their product {fixed} must divide {world}"
        )
    free = [k for k, v in given.items() if v is None]
    sizes = {k: v or 1 for k, v in given.items()}
    rest = world // fixed
    if not free and rest != 1:
        raise ValueError(f"dp x fsdp x tp = {fixed}, but there are {world} ranks")
    i = 0
    while rest % 2 == 0 and free:
        sizes[free[i % len(free)]] *= 2
        rest //= 2
        i += 1
    if free:
        sizes[free[0]] *= rest
    return {"pp": pp, "dp": sizes["dp"], "fsdp": sizes["fsdp"], "cp": cp, "tp": sizes["tp"]}


@dataclasses.dataclass
class Result:
    """What a run did: ``losses[s]`` is the loss of step ``s`` (0-based), for the steps this run took."""

    losses: dict[int, float]
    first_step: int
    mesh: dict[str, int]
    seconds: float
    comm_bytes: dict[str, int]
    memory: dict[int, int]


class Reporter:
    """A progress bar on a terminal, plain periodic lines otherwise (only rank 0 writes)."""

    def __init__(
        self, total: int, tokens_per_step: int, every: int, enabled: bool, stream: TextIO | None = None
    ) -> None:
        self.total, self.tokens, self.every, self.enabled = total, tokens_per_step, every, enabled
        self.stream = sys.stdout if stream is None else stream
        self.bar = enabled and self.stream.isatty()
        self.start = time.perf_counter()
        self.steps = 0
        self.open_line = False  # the bar is drawn and its line not ended yet

    def step(self, step: int, loss: float, seconds: float) -> None:
        self.steps += 1
        if not self.enabled:
            return
        rate = self.tokens / seconds
        done = step + 1
        if self.bar:
            width = 30
            fill = width * done // self.total
            eta = (time.perf_counter() - self.start) / self.steps * (self.total - done)
            self.stream.write(
                f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total}  loss {loss:.4f}  {rate:,.0f} tok/s  eta {eta:.0f}s "
            )
            self.open_line = done < self.total
            if not self.open_line:
                self.stream.write("\n")
        elif done % self.every == 0 or done == self.total:
            self.stream.write(f"step {done:>5}/{self.total}  loss {loss:.4f}  {rate:,.0f} tok/s\n")
        self.stream.flush()

    def say(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\n" if self.open_line else "") + text + "\n")
            self.open_line = False
            self.stream.flush()


def make_step(model: torch.nn.Module, tx: optim.GradientTransformation) -> Jitted:
    """The jitted train step: loss and gradients, clipping and AdamW, new params and state."""

    def train_step(params: dict[str, torch.Tensor], opt_state: Any, idx: torch.Tensor, targets: torch.Tensor):
        loss, grads = vsf.value_and_grad(lambda p: vsf.tree.apply(model, p, idx, targets))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    return vsf.jit(train_step, donate_argnums=(0, 1))


def make_pipeline(args: argparse.Namespace, model: GPT, mesh: vsf.Mesh) -> vsf.pipeline.Pipeline:
    """The model cut into ``--pp`` stages of consecutive blocks over the mesh's pp axis, the batch
    over every data-parallel axis and each sequence over cp (the activations between stages too),
    the tied embedding held by the first stage."""
    fns, loss, prefixes = pipeline_stages(model, args.pp * (2 if args.schedule in vsf.pipeline.INTERLEAVED else 1))
    return vsf.pipeline.Pipeline(
        fns,
        loss,
        prefixes,
        mesh=mesh,
        microbatches=args.microbatches,
        schedule=args.schedule,
        batch=BATCH,
        activations=BATCH,
        tied=("wte.weight",),
    )


def make_pipelined_step(
    pipe: vsf.pipeline.Pipeline, layout: vsf.pipeline.Layout, tx: optim.GradientTransformation
) -> Any:
    """The train step with the pipelined loss and gradients: each stage's update where it lives."""

    def train_step(params: dict[str, torch.Tensor | None], opt_state: Any, idx: torch.Tensor, targets: torch.Tensor):
        loss, grads = pipe.value_and_grad(params, idx, targets, layout=layout)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    return train_step


def make_optimizer(args: argparse.Namespace) -> optim.GradientTransformation:
    warmup = args.steps // 10 if args.warmup is None else args.warmup
    lr = optim.warmup_cosine_decay(0.0, args.lr, warmup_steps=warmup, decay_steps=args.steps)
    return optim.chain(optim.clip_by_global_norm(args.clip), optim.adamw(lr, weight_decay=args.weight_decay))


def train(args: argparse.Namespace, model: GPT, params: dict[str, torch.Tensor]) -> Result:
    """Lay out, restore or initialise, and train; runs on every rank (or inside ``vsf.simulate``)."""
    shape = mesh_shape(
        args.simulate or int(os.environ.get("WORLD_SIZE", "1")), args.dp, args.fsdp, args.tp, args.cp, args.pp
    )
    mesh = vsf.make_mesh(tuple(shape.values()), AXES)
    cfg = model.cfg
    rep = Reporter(
        args.steps, args.batch * cfg.seq, args.log_every or max(1, args.steps // 10), vsf.runtime.rank() == 0
    )
    rep.say(
        f"mesh {' x '.join(f'{a}={n}' for a, n in shape.items())} ({mesh.size} ranks, {mesh.device_type}"
        f"{', simulated' if vsf.runtime.is_simulated() else ''}); {sum(p.numel() for p in params.values()):,} params"
    )

    tx = make_optimizer(args)
    specs = vsf.sharding.match(params, RULES)
    pipe = make_pipeline(args, model, mesh) if args.pp > 1 else None
    placed, layout = (
        pipe.place(params, specs) if pipe else (vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs)), None)
    )
    state = {"params": placed}
    state["opt"] = optim.init_sharded(tx, state["params"], zero_axes=("dp",))
    for name in ("blocks.0.attn.qkv.weight", "wte.weight"):  # (both on rank 0; None on the later stages' ranks)
        if rep.enabled:
            rep.say(
                f"  {name:<26} {vsf.typeof(state['params'][name]):<24} adam mu {vsf.typeof(state['opt'][1].mu[name])}"
            )
    if pipe:
        for s in range(pipe.num_stages):
            rep.say(f"  stage {s}: ranks {list(pipe.meshes[s].devices)}, {', '.join(pipe.prefixes[s])}")
    mngr = vsf.checkpoint.CheckpointManager(
        args.out / "ckpt", max_to_keep=args.keep, save_interval_steps=args.save_every, progress=False
    )
    first, state = restore(args, mngr, state, rep)

    if pipe:
        step_fn, put_batch, lowered = make_pipelined_step(pipe, layout, tx), None, None
    else:
        step_fn = make_step(model, tx)
        put_batch = vsf.NamedSharding(mesh, BATCH)
        batch = load_batch(first, args, cfg, put_batch)
        lowered = step_fn.lower(state["params"], state["opt"], *batch)  # plans the step once; calls reuse it
        if args.print_plan:
            rep.say(lowered.as_text())

    losses: dict[int, float] = {}
    metrics = (args.out / "metrics.jsonl").open("a" if first else "w") if rep.enabled else None
    started = time.perf_counter()
    for step in range(first, args.steps):
        t0 = time.perf_counter()
        batch = load_batch(step, args, cfg, put_batch) if put_batch else batch_at(step, args.batch, cfg, seed=args.seed)
        state["params"], state["opt"], loss = step_fn(state["params"], state["opt"], *batch)
        losses[step] = float(vsf.device_get(loss))
        seconds = time.perf_counter() - t0
        rep.step(step, losses[step], seconds)
        if metrics:
            metrics.write(
                json.dumps({"step": step, "loss": losses[step], "tokens_per_s": args.batch * cfg.seq / seconds}) + "\n"
            )
            metrics.flush()
        if mngr.save(step + 1, {**state, "step": step + 1}, force=step + 1 == args.steps, blocking=False):
            rep.say(f"checkpoint {step + 1}: saving in the background to {mngr.step_path(step + 1)}")
    elapsed = time.perf_counter() - started
    mngr.wait()
    if metrics:
        metrics.close()
    cost = lowered.cost() if lowered else None
    result = Result(losses, first, shape, elapsed, cost.comm_bytes if cost else {}, _memory(state))
    if rep.enabled and losses:
        _summary(rep, args, cfg, result, cost, mngr, pipe)
    return result


def load_batch(
    step: int, args: argparse.Namespace, cfg: GPTConfig, sharding: vsf.NamedSharding
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s ``(inputs, targets)`` as global DTensors laid out as ``sharding``, each process
    passing only its slice: its rank's rows and sequence part under torchrun, everything under
    vsf.simulate (one process holding every rank). The data is generated whole here; a real loader
    reads only the process's slice."""
    inputs, targets = batch_at(step, args.batch, cfg, seed=args.seed)
    mine = vsf.sharding.process_slice(sharding, inputs.shape)
    return vsf.make_array_from_process_local_data(
        sharding, (inputs[mine], targets[mine]), (inputs.shape, targets.shape)
    )


def restore(
    args: argparse.Namespace, mngr: vsf.checkpoint.CheckpointManager, state: dict[str, Any], rep: Reporter
) -> tuple[int, dict[str, Any]]:
    """The step to start from and the state there: the latest committed checkpoint's with
    ``--resume`` (read straight into ``state``'s layouts), else step 0 and ``state`` itself."""
    if not args.resume:
        if mngr.all_steps():
            raise SystemExit(
                f"{mngr.directory} already holds checkpoints {mngr.all_steps()}: pass --resume, or choose another --out"
            )
        return 0, state
    first = mngr.latest_step()
    if first is None:
        rep.say(f"no checkpoint in {mngr.directory}: starting from step 0")
        return 0, state
    restored = mngr.restore(first, target={**state, "step": 0})
    if restored.pop("step") != first:
        raise RuntimeError(f"checkpoint {mngr.step_path(first)} holds another step")
    rep.say(
        f"resumed from {mngr.step_path(first)}" + (" (the last step: nothing to do)" if first >= args.steps else "")
    )
    return first, restored


def _memory(state: dict[str, Any]) -> dict[int, int]:
    """Bytes of params + optimizer state on every rank (gathered from the processes under torchrun)."""
    mine = vsf.debug.memory_report(state)
    if vsf.runtime.is_simulated() or not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    every: list[dict[int, int]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    return {r: b for d in every for r, b in d.items()}


def _pipeline_summary(rep: Reporter, args: argparse.Namespace, result: Result, pipe: vsf.pipeline.Pipeline) -> None:
    """Per pp rank (its stages): the params + optimizer state its ranks hold (the most on one
    rank), and the schedule's bubble (idle fraction of the step when a backward costs two forwards,
    its weight part, under zb, one)."""
    idle = vsf.pipeline.bubble(pipe.actions())
    v, p, m = pipe.stages_per_rank, args.pp, args.microbatches
    if args.schedule in vsf.pipeline.V_SHAPED:
        theory = "replayed from torch's order"
    elif args.schedule == "zb":
        theory = f"theory: ZB-H1's (p-1)/(3vm+p-1) = {(p - 1) / (3 * v * m + p - 1):.1%}"
    else:
        theory = f"theory: (p-1)/({'v' if v > 1 else ''}m+p-1) = {(p - 1) / (v * m + p - 1):.1%}"
    for r in range(args.pp):
        ranks = pipe.meshes[r].devices
        held = max(result.memory.get(k, 0) for k in ranks)
        label = f"stage {r}" if v == 1 else f"stages {[s for s in range(pipe.num_stages) if pipe.rank_of(s) == r]}"
        rep.say(
            f"{label} (ranks {list(ranks)}): params + optimizer state {_kib(held)} per rank; "
            f"{args.schedule} bubble {idle[r]:.1%} of the step ({theory})"
        )


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def _summary(
    rep: Reporter,
    args: argparse.Namespace,
    cfg: GPTConfig,
    result: Result,
    cost: Cost | None,
    mngr: vsf.checkpoint.CheckpointManager | None,
    pipe: vsf.pipeline.Pipeline | None,
) -> None:
    steps = sorted(result.losses)
    n = len(steps)
    tokens = n * args.batch * cfg.seq
    head, tail = result.losses[steps[0]], result.losses[steps[-1]]
    rep.say(
        f"\n{n} steps in {result.seconds:.1f} s ({tokens / result.seconds:,.0f} tokens/s); "
        f"loss {head:.4f} (step {steps[0]}) -> {tail:.4f} (step {steps[-1]}); a perfect copier reaches {floor_loss(cfg):.4f}"
    )
    if pipe:
        _pipeline_summary(rep, args, result, pipe)
    else:
        rep.say("params + optimizer state per rank: " + ", ".join(f"{r}: {_kib(b)}" for r, b in result.memory.items()))
        kinds = collections.Counter(c.kind for c in cost.collectives)
        per_axis = ", ".join(f"{a} {_kib(b)}" for a, b in result.comm_bytes.items() if b)
        rep.say(
            f"each step sends per rank (from the plan): {per_axis}; {len(cost.collectives)} collectives "
            f"({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})"
            if kinds
            else "each step sends nothing (one rank)"
        )
    rep.say(f"checkpoints: {mngr.directory} steps {mngr.all_steps()}; metrics: {args.out / 'metrics.jsonl'}")
    rep.say(plot_losses(args.out / "metrics.jsonl", args.out / "loss.png", floor_loss(cfg)))


def plot_losses(metrics: Path, png: Path, floor: float) -> str:
    """The loss curve of every step in ``metrics`` (a resumed run's last value per step) as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "loss curve: skipped, matplotlib is not installed (pip install matplotlib)"
    losses: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        losses[row["step"]] = row["loss"]
    steps = sorted(losses)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [losses[s] for s in steps], label="training loss")
    ax.axhline(floor, color="gray", linestyle="--", label="perfect copier")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return f"loss curve: {png}"


def main(argv: list[str] | None = None) -> Result:
    args = parse_args(argv)
    cfg = config(args)
    args.out.mkdir(parents=True, exist_ok=True)
    # Built before any simulation starts: under vsf.simulate every op runs once per rank, and
    # drawing random numbers there would give each simulated rank different values.
    model = GPT(cfg, seed=args.seed)
    params = vsf.tree.from_module(model)
    if args.simulate:
        # The simulated ranks run many small ops one after another, where intra-op threads cost
        # more than they save (the run took twice as long with 2 threads on 2 busy cores).
        torch.set_num_threads(1)
        with vsf.simulate(args.simulate):
            return train(args, model, params)
    try:
        return train(args, model, params)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
