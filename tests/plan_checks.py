"""Checks that two plans of one step are the same plan, for the tests of the planner's shortcuts
(``tests/jit/test_plan_time.py``, ``tests/models/test_stamped_zoo.py``)."""

from __future__ import annotations


def assert_same_plans(a, b) -> None:
    """Two lowered steps have the same graph (ops in order, each reading the values at the same
    places) and plan: every op's placements, every redistribution (of the value at the same place
    in the graph), the bytes and collectives."""
    ga, gb = a.plan.graph.graph, b.plan.graph.graph
    assert _ops(ga) == _ops(gb)
    assert [(p.ins, p.outs) for p in a.plan.nodes.values()] == [(p.ins, p.outs) for p in b.plan.nodes.values()]
    at = lambda g, v: list(g.nodes).index(v[0])  # noqa: E731
    assert [(at(ga, r.value), r.src, r.dst) for r in a.plan.redistributions] == [
        (at(gb, r.value), r.src, r.dst) for r in b.plan.redistributions
    ]
    assert a.cost().comm_bytes == b.cost().comm_bytes
    assert a.cost().collectives == b.cost().collectives


def _ops(graph) -> list[tuple]:
    """Each node of ``graph``: its kind, its op, and the places in the graph of the nodes it reads."""
    at = {n: i for i, n in enumerate(graph.nodes)}
    return [(n.op, n.target, tuple(at[a] for a in n.all_input_nodes)) for n in graph.nodes]


def assert_same_stack_traces(a, b) -> None:
    """Every op of two lowered steps' graphs records the same stack trace (the plan's text and its
    errors name the same user lines)."""
    traces = lambda lowered: [n.stack_trace for n in lowered.plan.graph.graph.nodes]  # noqa: E731
    assert traces(a) == traces(b)
