"""Lowering a plan to a program over local shards.

:func:`execute` walks the planned graph on DTensors: before each op it redistributes every input
to the placement the plan chose (once per value and placement), then lets DTensor run the op on
the local shards. That walk is the program. Under ``vsf.simulate`` it runs as is (every simulated
rank at once). In a real run it is traced once with ``make_fx`` on this rank's local shards into
an fx graph of local aten ops and functional collectives, with no DTensor dispatch left, and that
graph is what each step runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import DTensor, Replicate
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from vsf import _compat
from vsf.sharding.constraint import CONSTRAINT_OP
from vsf.sharding.propagate import Placements, Plan, Value, _is_tensor_node, _op_nodes, _placeholders, _value

__all__ = ["PlanMismatch", "compile_local", "execute"]


class PlanMismatch(RuntimeError):
    """DTensor produced a placement the plan did not predict (a bug in vsf: please report it)."""


def _replicated(t: torch.Tensor, plan: Plan) -> DTensor:
    dm = plan.mesh.device_mesh
    if _compat.active_local_mode() is not None and not isinstance(t, _compat.LocalTensor):
        t = _compat.make_local({r: t for r in plan.mesh.devices})
    return DTensor.from_local(t, dm, [Replicate()] * dm.ndim, run_check=False)


def execute(plan: Plan, inputs: Sequence[DTensor]) -> list[DTensor]:
    """Run ``plan`` on DTensor inputs laid out as ``plan.inputs``; return outputs laid out as ``plan.outputs``."""
    gm = plan.graph
    dm = plan.mesh.device_mesh
    env: dict[Value, Any] = {(ph, 0): x for ph, x in zip(_placeholders(gm), inputs)}
    moved: dict[tuple[Value, Placements], DTensor] = {}

    def get(v: Value, dst: Placements) -> DTensor:
        x = env[v]
        if tuple(x.placements) == dst:
            return x
        if (v, dst) not in moved:
            with _compat.quiet_redistribute():
                moved[(v, dst)] = x.redistribute(dm, dst)
        return moved[(v, dst)]

    for node in _op_nodes(gm):
        step = plan.nodes[node]
        wanted = iter(step.ins)

        def arg(a: Any) -> Any:
            if isinstance(a, torch.fx.Node) and _is_tensor_node(a):
                return get(_value(a), next(wanted))
            return a

        args, kwargs = pytree.tree_map(arg, (node.args, node.kwargs))
        if node.op == "get_attr":
            out: Any = _replicated(getattr(gm, node.target), plan)
        elif node.target is CONSTRAINT_OP:
            out = args[0]
        elif step.fallback:
            local = pytree.tree_map(lambda x: x.to_local() if isinstance(x, DTensor) else x, (args, kwargs))
            out = pytree.tree_map(lambda t: _replicated(t, plan) if isinstance(t, torch.Tensor) else t, node.target(*local[0], **local[1]))
        elif not step.ins:
            out = pytree.tree_map(lambda t: _replicated(t, plan) if isinstance(t, torch.Tensor) else t, node.target(*args, **kwargs))
        else:
            out = node.target(*args, **kwargs)
        outs = out if isinstance(out, (list, tuple)) else [out]
        for i, (o, want) in enumerate(zip(outs, step.outs)):
            if want is None:
                continue
            if tuple(o.placements) != want:
                raise PlanMismatch(f"{node.target} (node {node.name}) produced {tuple(o.placements)}, the plan said {want}")
            env[(node, i)] = o
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return [get(_value(a), dst) for a, dst in zip(pytree.tree_leaves(output.args), plan.outputs)]


def compile_local(plan: Plan, local_inputs: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    """Trace :func:`execute` on this rank's local shards into a graph of local ops and collectives."""
    dm = plan.mesh.device_mesh
    metas = [ph.meta["val"] for ph in _placeholders(plan.graph)]

    def local_program(*locals_: torch.Tensor) -> list[torch.Tensor]:
        inputs = [
            DTensor.from_local(t, dm, p, run_check=False, shape=m.shape, stride=m.stride())
            for t, p, m in zip(locals_, plan.inputs, metas)
        ]
        return [o.to_local() for o in execute(plan, inputs)]

    with _compat.quiet_redistribute():
        gm = make_fx(local_program, tracing_mode="fake")(*local_inputs)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
