"""The per-axis solver: on one mesh axis, choose one strategy per op so that the
redistributions they imply cost the fewest bytes, counting the work an op that does real work
(a matmul, attention) runs beyond its share when it runs unsplit as bytes too (:mod:`vsf.jit.cost`).

It is greedy in graph order, then repairs locally (an op's choice is revisited when a producer's
or a consumer's changed), then tries to remove each redistribution left by changing a region of
ops at once (:meth:`AxisSolver._cascades`). A value redistributed to one placement is redistributed once however
many ops use it there, and a ``Partial`` result stays partial until the cheapest point to reduce it.
The greedy pass, the repairs and the cascades share the solver's state (each op's choice and the
redistributions it implies) and its incremental cost bookkeeping, so they are one piece.

Example::

    >>> solver = AxisSolver(problem, "tp", AxisTables.build(problem, "tp", Codes(2, 65536.0)))
    >>> solver.solve(); solver.placement_of(0)
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Placement

from vsf.errors import PlanError
from vsf.jit.copies import Graph, Left, Placed, Region, Run, runs_of
from vsf.jit.cost import (
    INF,
    NOT_PARTIAL,
    Codes,
    OrSum,
    op_flops,
    splits_work,
    transition_bytes,
    unsplit_bytes,
)
from vsf.jit.graph import Value, is_view, meta_of, outputs_meta, placeholders_of, user_line
from vsf.jit.plan import R, split_dim
from vsf.jit.strategies import Strategies, Strategy
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import RaggedPlacement

__all__ = ["BUCKET_SHARE", "AxisSolver", "AxisTables", "Problem"]


# the share of a collective's start-up charged to a value that joins a bucket (:attr:`Problem.alone`):
# one of the about 16 a bucket holds (a small GPT's per-block parameters or gradients)
BUCKET_SHARE = 1 / 16


_TIE = 1e-9

# how many producers up a partial-sum merge reaches (:meth:`AxisSolver._make_partial`)
_MERGE_DEPTH = 3


def _numbered(numbers: dict[Any, int], parts: Any) -> list[int]:
    """Each of ``parts`` (hashable) as its number in ``numbers`` (a new one for a part not yet
    there): equal numbers for equal parts."""
    return [numbers.setdefault(part, len(numbers)) for part in parts]


def _nothing(entries: list[int]) -> tuple[()]:
    return ()


def _items_of(ids: Collection[int]) -> Callable[[list[int]], Any]:
    """What reads the entries ``ids`` of a list: the one entry, a tuple of them, or ``()`` (an
    :func:`operator.itemgetter`, fast)."""
    return operator.itemgetter(*ids) if ids else _nothing


def _encode(codes: "Codes", strategies: list[Strategy]) -> "Encoded":
    return [
        (tuple(codes.code(p) for p in st.ins), tuple(-1 if p is None else codes.code(p) for p in st.outs))
        for st in strategies
    ]


class AxisSolver:
    """Chooses one strategy per op for one mesh axis (greedy in graph order, then local repair)."""

    # decide once per op context (:meth:`_context`), cost a value once per state (:meth:`_value_costs`)
    # and solve an axis's problem once (:meth:`poses_as`); False costs every op and value anew and
    # solves every sweep (tests compare)
    reuse = True

    def __init__(self, problem: "Problem", axis: str, tables: "AxisTables", held: frozenset[int] = frozenset()) -> None:
        self.p = problem
        self.axis = axis
        self.n = problem.mesh.axis_size(axis)
        self.codes = tables.codes
        self.fb = self._full_bytes()
        self.fr = self._reduced_bytes()
        self.alone = problem.alone
        self.share = [1.0 if a else BUCKET_SHARE for a in self.alone]
        self.label = list(tables.label)
        self.need = [dict(d) for d in tables.need]
        self.clamp = problem.clamp
        if tables.first_wants is None:  # (the outputs' requirements: the same for every solve of the axis)
            tables.first_wants = _numbered(tables.wants, map(self._wanted, range(len(self.need))))
        self.wants = list(tables.first_wants)  # (:meth:`_context`)
        self.final = tables.final
        self.ins, self.outs, self.view = problem.op_ins, problem.op_outs, problem.views
        self.strategies, self.splitting, self.divided = tables.strategies, tables.splitting, tables.divided
        self.dividing = tables.dividing
        self.summing, self.gives, self.reading = tables.summing, tables.gives, tables.reading
        self.hints = tables.hints
        self.choice = [-1] * len(problem.ops)
        self.tables = tables
        self.picked = tables.picked  # decisions by context (_context), kept for the axis's next solve
        self.costed = tables.costed  # every strategy's cost by context (_costs), likewise
        self.valued = tables.valued  # values' costs (_value_costs), likewise
        self.work = self._unsplit_work()
        self.reorder = self._reorders()
        self.fixed_context: list[int] = []  # (numbered when solving: :meth:`_fixed_contexts`)
        self.held = held  # values the greedy pass reads as they are where some strategy can (:meth:`_dropped_split`)
        self.other_start: frozenset[int] = frozenset()  # (what :meth:`_dropped_split` found after the greedy pass)

    def poses_as(self, other: "AxisSolver") -> bool:
        """Is this the problem ``other`` (solved) solved, so that solving it gives ``other``'s choices?
        A solver reads the other axes' choices only as each value's bytes and reduced bytes, each
        op's unsplit work and the reorder costs (:meth:`_full_bytes`, :meth:`_reduced_bytes`,
        :meth:`_unsplit_work`, :meth:`_reorders`), and everything else it reads is its axis's tables: where those are
        equal, so is every step of the solve (the last axis of the second sweep, when the others'
        choices are the first sweep's again).

        Example::

            >>> again = AxisSolver(problem, "tp", tables)
            >>> again.poses_as(problem.solved["tp"])   # then problem.solved["tp"] stands
            True
        """
        return (
            self.reuse
            and self.axis == other.axis
            and self.fb == other.fb
            and self.fr == other.fr
            and self.work == other.work
            and self.reorder == other.reorder
        )

    def _reorders(self) -> dict[int, dict[int, float]]:
        """For values that a later mesh axis already shards on some dim: what sharding that dim on
        this (earlier, hence major) axis as well costs besides this axis's own move. The nested
        layout changes which block the later axis's ranks hold, so DTensor gathers over it first."""
        order = list(self.p.mesh.device_axes)
        here = order.index(self.axis)
        out: dict[int, dict[int, float]] = {}
        for other, solver in self.p.solved.items():
            if other == self.axis or order.index(other) < here:
                continue
            label, shard, placements = solver.label, solver.codes.shard, solver.codes.placements
            dims = {c: split_dim(placements[c]) for c in set(label) if shard[c]}  # (a few codes, many values)
            gather = transition_bytes("all_gather", solver.n, 1.0)
            for v, c in enumerate(label):
                if c in dims:
                    out.setdefault(v, {})[dims[c]] = gather * self.fb[v]
        return out

    def _unsplit_work(self) -> list[float]:
        """Per op, what running it unsplit on this axis costs beyond its share (:func:`~vsf.jit.cost.unsplit_bytes`),
        its FLOPs counted on what the axes solved so far leave of them (an op those split runs
        ``1/n`` of its work on each of their ranks)."""
        per_flop = self.p.bytes_per_flop
        flops = [float(f) for f in self.p.flops] if per_flop else [0.0] * len(self.p.ops)
        for other, solver in self.p.solved.items():
            if other != self.axis:
                splitting, choice, n = solver.splitting, solver.choice, solver.n
                flops = [f / n if f and splitting[k][choice[k]] else f for k, f in enumerate(flops)]
        costs = {
            f: unsplit_bytes(f, self.n, per_flop) for f in set(flops)
        }  # (the ops of a block repeat a few FLOP counts)
        return [costs[f] for f in flops]

    def _op_work(self, k: int, j: int) -> float:
        """The unsplit-work cost of op ``k`` under strategy ``j``."""
        return self.work[k] if self.work[k] and not self.splitting[k][j] else 0.0

    def _full_bytes(self) -> list[float]:
        """Per value, its bytes on what the axes solved so far leave of it (split by each other
        axis that shards it)."""
        sizes = list(self.p.value_bytes)
        for other, solver in self.p.solved.items():
            if other != self.axis:
                shard, n = solver.codes.shard, solver.n
                sizes = [size / n if shard[c] else size for size, c in zip(sizes, solver.label)]
        return sizes

    def _reduced_bytes(self) -> list[float]:
        """Per value, the bytes its reduction on this axis moves (an all-reduce or a reduce-scatter of
        a partial sum): :meth:`_full_bytes`, further split by each other axis whose solution
        reduce-scatters the value. With those choices held, as the solver holds them, the
        reductions cost least run scattering there first, and this axis's choice changes the cost
        of its own reduction of what is left: a weight's gradient that fsdp reduce-scatters costs dp
        its all-reduce of the fsdp shard, or its reduce-scatter (for a ZeRO update) of it.

        Example::

            >>> solver.fb[g], solver.fr[g]   # on dp, the gradient g reduce-scattered over fsdp=4
            (4096.0, 1024.0)
        """
        sizes = list(self.fb)
        for other, solver in self.p.solved.items():
            if other != self.axis:
                partial, shard, n = solver.codes.partial, solver.codes.shard, solver.n
                for v, c in enumerate(solver.label):
                    if partial[c] and any(k and shard[req] for req, k in solver.need[v].items()):
                        sizes[v] /= n
        return sizes

    def _moved_bytes(self, v: int, label: int, req: int) -> float:
        """The bytes value ``v`` moves from placement ``label`` to ``req`` (:meth:`_reduced_bytes`)."""
        return self.fr[v] if self.codes.reduces[label][req] else self.fb[v]

    def _value_cost(self, v: int, label: int, need: dict[int, int]) -> float:
        if not need:  # (most values, while the greedy pass has not reached their readers)
            return 0.0
        fixed, share = self.codes.fixed[label], self.share[v]
        return self._sent(v, label, need) + sum(fixed[req] * share for req, c in need.items() if c > 0)

    def _sent(self, v: int, label: int, need: dict[int, int]) -> float:
        """The bytes value ``v``, placed as ``label``, sends to reach the placements ``need`` counts."""
        row, moved = self.codes.factor[label], self._moved_bytes
        return sum(moved(v, label, req) * row[req] for req, c in need.items() if c > 0)

    def _value_costs(self, v: int) -> tuple[float, float]:
        """Value ``v``'s cost as it stands, and the part of it that is bytes sent (no start-ups),
        found once per bytes, start-up share, placement and wants (:attr:`AxisTables.valued`,
        :attr:`reuse`): all that the sums read (the wants' number says which placements are wanted,
        in their order)."""
        key = (self.fb[v], self.fr[v], self.share[v], self.label[v], self.wants[v]) if self.reuse else None
        costs = self.valued.get(key) if key is not None else None
        if costs is None:
            costs = (self._value_cost(v, self.label[v], self.need[v]), self._sent(v, self.label[v], self.need[v]))
            if key is not None:
                self.valued[key] = costs
        return costs

    def _gratuitous(self, k: int, ins: tuple[int, ...]) -> bool:
        """Does this strategy shard an input on this axis when no input already arrives sharded
        here, and no later op wants it so (:meth:`_hints`)?"""
        is_shard, label, hints = self.codes.is_shard, self.label, self.hints
        reshards = anchored = False
        for v, req in zip(self.ins[k], ins):
            if is_shard(req):
                if req == label[v] or req in hints[v]:
                    anchored = True
                else:
                    reshards = True
        return reshards and not anchored

    def _moves_held(self, k: int, ins: tuple[int, ...]) -> bool:
        """Does this strategy read a value of :attr:`held` other than as it is?"""
        return bool(self.held) and any(v in self.held and req != self.label[v] for v, req in zip(self.ins[k], ins))

    def _evaluate(self, k: int, j: int, greedy: bool, strict: bool) -> float:
        ins, outs = self.strategies[k][j]
        if strict and (self._gratuitous(k, ins) or self._moves_held(k, ins)):
            return INF
        factor, label, need, fb = self.codes.factor, self.label, self.need, self.fb
        total = self._op_work(k, j)
        shard, placements, reorder = self.codes.is_shard, self.codes.placements, self.reorder
        hints = self.hints
        for v, req in zip(self.ins[k], ins):
            if req != label[v]:
                # ties go to using a value where it is (redistribute as late as possible), or else
                # to moving it where a later op wants it anyway
                total += _TIE * fb[v] * (0.5 if req in hints[v] else 1.0)
                if v in reorder and shard(req) and not shard(label[v]) and req not in hints[v]:
                    # (a sharding wanted later comes from a layout that already orders the axes:
                    # ZeRO's minor axis, say)
                    total += reorder[v].get(split_dim(placements[req]), 0.0)
        if greedy:
            for v, req in zip(self.ins[k], ins):
                cur = label[v]
                if req != cur and not need[v].get(req):
                    total += (
                        factor[cur][req] * self._moved_bytes(v, cur, req) + self.codes.fixed[cur][req] * self.share[v]
                    )
        else:
            old = self.strategies[k][self.choice[k]][0]
            changed: dict[int, dict[int, int]] = {}
            for v, req in zip(self.ins[k], ins):
                d = changed.setdefault(v, dict(need[v]))
                d[req] = d.get(req, 0) + 1
            for v, req in zip(self.ins[k], old):
                changed[v][req] -= 1
            for v, d in changed.items():
                total += self._value_cost(v, label[v], d) - self._value_cost(v, label[v], need[v])
        for v, lab in zip(self.outs[k], outs):
            if v < 0 or lab < 0:
                continue
            if need[v]:
                total += self._value_cost(v, lab, need[v])
            if self.final.get(v, lab) != lab:
                # ties go to computing a result in the layout it leaves in: moved after the last
                # op it lands in a fresh buffer, where a donated input's buffer could have held it
                total += _TIE * fb[v]
            if greedy and self.codes.is_partial(lab):
                # a partial will have to be reduced: charge an all-reduce's bytes (not its start-up:
                # independent reductions share one bucket)
                total += factor[lab][0] * self.fr[v]
        return total

    def _apply(self, k: int, j: int) -> None:
        need, values, options, was = self.need, self.ins[k], self.strategies[k], self.choice[k]
        if was >= 0:
            for v, req in zip(values, options[was][0]):
                need[v][req] -= 1
        self.choice[k] = j
        reqs, outs = options[j]
        for v, req in zip(values, reqs):
            counts = need[v]
            counts[req] = counts.get(req, 0) + 1
        wants, numbers, wanted = self.wants, self.tables.wants, self._wanted
        for v in values:
            wants[v] = numbers.setdefault(wanted(v), len(numbers))
        label = self.label
        for v, lab in zip(self.outs[k], outs):
            if v >= 0 and lab >= 0:
                label[v] = lab

    def _wanted(self, v: int) -> tuple[tuple[int, int], ...]:
        """The placements wanted of value ``v`` and how often, in their order, each count capped at
        :attr:`Problem.clamp`: what :meth:`_evaluate` reads of them (whether a count is above 0,
        before and after an op's reads move), so that the readers of a value every op reads (an
        optimizer's step count, read by each leaf's update) meet one context, not one per count."""
        cap = self.clamp[v]
        if not cap:
            return tuple(self.need[v].items())
        return tuple([(req, c if c < cap else cap) for req, c in self.need[v].items()])

    def _context(self, k: int, greedy: bool) -> tuple[Any, ...]:
        """Everything :meth:`_evaluate` reads to cost op ``k``'s strategies: what no choice changes
        (:meth:`_fixed_contexts`), its current choice (repair passes), and per input its placement
        and per input and output the placements wanted of it (in their order: the sums run in it).
        Ops of a model's repeated blocks meet the same context, block after block, so :meth:`_pick`
        decides once per context (:attr:`reuse`) what it would decide for each (the same arithmetic
        on the same numbers). The placements wanted of a value are read as their number
        (:attr:`wants`, kept by :meth:`_apply`): equal numbers, equal placements in the same order.
        The inputs' and outputs' entries are read by :attr:`Problem.in_items` and
        :attr:`Problem.out_items` (one entry, a tuple of several, or ``()``): ops of one fixed
        context have as many inputs and outputs, so their contexts are equal where the entries are."""
        ins = self.p.in_items[k]
        return (
            self.fixed_context[k],
            -2 if greedy else self.choice[k],  # (every op has a choice once the greedy pass placed it)
            ins(self.label),
            ins(self.wants),
            self.p.out_items[k](self.wants),
        )

    def _fixed_contexts(self) -> list[int]:
        """Per op, a number for the part of its :meth:`_context` that no choice on this axis
        changes (equal numbers: equal parts): its strategy list, its work, which of its inputs are
        one value, and per input its bytes, hints and reorder costs, per output its bytes and
        required placement, and per input and output whether its collective runs alone (:attr:`Problem.alone`)."""
        fb, hints, reorder, final, alone = self.fb, self.hints, self.reorder, self.final, self.alone
        numbers = self.tables.parts
        moves: list[tuple[tuple[int, float], ...] | None] = [None] * len(fb)
        for v, costs in reorder.items():
            moves[v] = tuple(costs.items())
        # per value, a number for its part as an input, and as an output
        held = [v in self.held for v in range(len(fb))] if self.held else itertools.repeat(False)
        read = _numbered(numbers, zip(itertools.repeat("in"), fb, self.fr, alone, hints, moves, held))
        made = _numbered(numbers, zip(itertools.repeat("out"), fb, self.fr, alone, map(final.get, range(len(fb)))))
        ids, work, same, in_items, outs = (
            list(map(id, self.strategies)),
            self.work,
            self.p.same_inputs,
            self.p.in_items,
            self.outs,
        )

        def numbered(ops: range) -> list[int]:
            return _numbered(
                numbers,
                (
                    (
                        ids[k],
                        work[k],
                        same[k],  # (as many entries as inputs: :attr:`Problem.in_items` reads them)
                        in_items[k](read),
                        tuple([None if v < 0 else made[v] for v in outs[k]]),
                    )
                    for k in ops
                ),
            )

        # a run whose ops have the strategy lists and work, and its values the numbers, that a run of
        # its shape had gets the numbers that run got (:mod:`vsf.jit.copies`)
        runs, known = (self.p.runs if self.reuse else {}), self.tables.fixed
        out: list[int] = []
        k = 0
        while k < len(ids):
            run = runs.get(k)
            if run is None:
                out += numbered(range(k, k + 1))
                k += 1
                continue
            own = run.own
            key = (own.shape, own.ops_of(ids), own.ops_of(work), own.values_of(read), own.values_of(made))
            if key not in known:
                known[key] = numbered(range(run.start, run.stop))
            out += known[key]
            k = run.stop
        return out

    def _pick(self, k: int, greedy: bool) -> bool:
        if len(self.strategies[k]) == 1 and not greedy:
            return False
        key = self._context(k, greedy) if self.reuse else None
        j = self.picked.get(key, -1) if key is not None else -1  # (-1: not decided in this context yet)
        if j != -1:
            if j is not None:
                self._apply(k, j)
            return j is not None
        changed = self._choose(k, greedy)
        if key is not None:
            self.picked[key] = self.choice[k] if changed else None
        return changed

    def _costs(self, k: int) -> tuple[float, ...]:
        """What each strategy of op ``k`` costs in the solution as it stands (:meth:`_evaluate` of a
        repair: every strategy allowed), computed once per context (:meth:`_context`): the cascades
        and the partial-sum merges ask it of the same ops of every repeated block."""
        key = self._context(k, False) if self.reuse else None
        costs = self.costed.get(key) if key is not None else None
        if costs is None:
            costs = tuple(self._evaluate(k, j, False, False) for j in range(len(self.strategies[k])))
            if key is not None:
                self.costed[key] = costs
        return costs

    def _choose(self, k: int, greedy: bool) -> bool:
        """:meth:`_pick` for op ``k``, its strategies costed one by one."""
        options = range(len(self.strategies[k]))
        # The first, greedy pass never shards inputs no other input is sharded like (it cannot see
        # that a later op will want them so); the repair passes take any strategy that pays.
        costs = [(self._evaluate(k, j, greedy, greedy), j) for j in options]
        if all(c == INF for c, _ in costs):
            costs = [(self._evaluate(k, j, greedy, False), j) for j in options]
        best_cost, best = min(costs)
        if best_cost == INF:
            node = self.p.ops[k]
            raise PlanError(
                f"{node.target} cannot be placed on axis {self.axis!r}{user_line(node)}: every strategy needs an impossible redistribution"
            )
        if not greedy and (
            best == self.choice[k] or best_cost >= costs[[j for _, j in costs].index(self.choice[k])][0] - 1e-9
        ):
            return False
        self._apply(k, best)
        return True

    def solve(self, max_repairs: int = 3) -> None:
        self.fixed_context = self._fixed_contexts()
        self._greedy()
        self.other_start = self._dropped_split()
        self._repairs(max_repairs)
        self._cascades()
        self._merges()

    def objective(self) -> float:
        """What the solution as it stands costs: every value's redistributions and every op's work
        beyond its share (what each pass lowers)."""
        values = sum(self._value_costs(v)[0] for v in range(len(self.need)))
        return values + sum(self._op_work(k, j) for k, j in enumerate(self.choice))

    def _dropped_split(self) -> frozenset[int]:
        """The values to hold where they arrive in another solve of this axis (its :attr:`held`), as
        the greedy pass left the solution: the integer values (token ids, labels, positions) split
        on this axis that no work computes (the inputs, and what is computed from them without a
        matmul or attention: :attr:`Problem.worked`) and that a reader redistributes into a result
        larger than they are. The greedy pass gives up such a split for what its first reader
        saves, which is little: a batch of token ids gathered where an embedding would otherwise
        gather its weight. The split would have carried to what is computed from them, which is
        all the activations. A Llama of hidden 4096 on 8 fsdp ranks with 4096-token sequences,
        planned from its token ids gathered, moved 6.3x the bytes of the FSDP plan holding them
        split (each weight gathered, each gradient reduce-scattered)."""
        held = []
        for v, worked in enumerate(self.p.worked):
            label, need = self.label[v], self.need[v]
            if worked or not self.codes.is_shard(label) or not self.fb[v]:
                continue
            if not any(c and req != label for req, c in need.items()) or meta_of(self.p.values[v]).is_floating_point():
                continue
            made = [
                self.fb[u]
                for k in self.p.consumers_of.get(v, ())
                if self.strategies[k][self.choice[k]][0][self.ins[k].index(v)] != label
                for u in self.outs[k]
                if u >= 0
            ]
            if max(made, default=0.0) > self.fb[v]:
                held.append(v)
        return frozenset(held)

    def _greedy(self) -> None:
        """The greedy pass: each op in graph order takes its cheapest strategy (:meth:`_pick`); a run
        of one copy of a repeated block (:mod:`vsf.jit.copies`) that meets the state a run of its
        shape met before (its ops' fixed contexts, its values' placements and wants) takes what
        that run took, copied with what it did to the values (:meth:`_copy_run`), where
        :attr:`reuse` is on."""
        runs, placed = (self.p.runs if self.reuse else {}), self.tables.placed
        k = 0
        while k < len(self.p.ops):
            run = runs.get(k)
            if run is None:
                self._pick(k, greedy=True)
                k += 1
                continue
            key = self._state(run.own)  # (its choices all still to make)
            done = placed.get(key)
            if done is None:
                for op in range(run.start, run.stop):
                    self._pick(op, greedy=True)
                placed[key] = self._placed(run)
            else:
                self._copy_run(run, done)
            k = run.stop

    def _repairs(self, max_repairs: int) -> None:
        """The repair passes: each op, in graph order, takes a cheaper strategy if one is (a
        non-greedy :meth:`_pick`), and an op next to one that changed is revisited, at most
        ``max_repairs`` visits an op in all. A run of one copy (:mod:`vsf.jit.copies`) that the first
        visits reach in a state in which a run of its shape changed nothing (its ops' choices as
        well as their contexts' fixed parts, its values' placements and wants) is passed over: its
        ops would each keep their strategy again."""
        producers, consumers = self.p.producer_of, self.p.consumers_of
        work = list(range(len(self.p.ops) - 1, -1, -1))
        queued = set(work)
        budget = max_repairs * len(work)
        runs, steady = (self.p.runs if self.reuse else {}), self.tables.steady
        changes, watched = 0, None  # (the key of a run whose visits began, its last op, the changes then)
        while work and budget > 0:
            run = runs.get(work[-1])
            if run is not None and (n := run.stop - run.start) <= budget and work[-n:] == run.visits:
                key = self._state(run.own)
                if key in steady:
                    del work[-n:]
                    queued.difference_update(range(run.start, run.stop))
                    budget -= n
                    continue
                watched = (key, run.stop - 1, changes)
            budget -= 1
            k = work.pop()
            queued.discard(k)
            if self._pick(k, greedy=False):
                changes += 1
                for other in [producers.get(v) for v in self.ins[k]] + [
                    c for v in self.outs[k] if v >= 0 for c in consumers.get(v, ())
                ]:
                    if other is not None and other not in queued:
                        queued.add(other)
                        work.append(other)
            if watched is not None and k == watched[1]:
                if changes == watched[2]:  # (no op of the run changed: they were visited in turn)
                    steady.add(watched[0])
                watched = None

    def _placed(self, run: Run) -> Placed:
        """What the greedy pass did on ``run``, just placed."""
        choice, strategies, own = self.choice, self.strategies, run.own
        counted = tuple(
            [
                (own.position[v], req)
                for k in range(run.start, run.stop)
                for v, req in zip(self.ins[k], strategies[k][choice[k]][0])
            ]
        )
        return Placed(
            tuple(choice[run.start : run.stop]), counted, own.values_of(self.wants), own.values_of(self.label)
        )

    def _copy_run(self, run: Run, done: Placed) -> None:
        """Place ``run`` as ``done`` placed a run of its shape that met its state: the same
        strategies, the same reads counted in the same order, the values left with the same
        wants and placements (:mod:`vsf.jit.copies`)."""
        self.choice[run.start : run.stop] = done.choices
        need, values, wants, label = self.need, run.own.values, self.wants, self.label
        for i, req in done.counted:
            counts = need[values[i]]
            counts[req] = counts.get(req, 0) + 1
        for v, w, lab in zip(values, done.wants, done.labels):
            wants[v] = w
            label[v] = lab

    def _cascades(self, max_ops: int = 256, rounds: int = 3) -> None:
        """Try to remove each redistribution the solution still has, largest first, by a move no
        single op's change pays for: its value's producer made to give the wanted placement, or a
        consumer made to take the value as it is, and every op next to a changed one then taking
        its best strategy (:meth:`_cascade`). A chain of ops that passes a layout along (a
        column-parallel matmul's output through a view, an activation and another view, in forward
        and backward) changes only as a whole: each op alone just moves the redistribution by one."""
        failed = _Failed(len(self.p.ops))
        for _round in range(rounds):  # (a move can make another pay: the next round sees it)
            if not self._cascade_round(max_ops, failed):
                return

    def _cascade_round(self, max_ops: int, failed: "_Failed") -> bool:
        """One pass of :meth:`_cascades` over the redistributions; did any move pay? A
        redistribution whose moves all failed in an earlier round is not tried again while no move
        kept since changed what they read (:class:`_Failed`)."""
        moves, improved, label = [], False, self.label
        for v in self._elsewhere():
            for req, count in self.need[v].items():
                if count > 0 and req != label[v]:
                    moves.append((self._value_cost(v, label[v], {req: 1}), v, req))
        for _cost, v, req in sorted(moves, reverse=True):
            if not self.need[v].get(req) or req == self.label[v]:
                continue  # an earlier move removed it
            if failed.again((v, req)):
                continue
            p = self.p.producer_of.get(v)
            read = {k for k in (p, *self.p.consumers_of.get(v, ())) if k is not None}  # (the tries' ops)
            tries = []
            if p is not None:
                tries += [[(p, j)] for j in self._giving(p, self.outs[p].index(v), req) if j != self.choice[p]]
            takers = self._takers(v, req)
            tries += [[(c, j)] for c, takes in takers for j in takes] + [m for m in [self._joint(takers, {})] if m]
            for start in tries:
                if all(self._keeps_split(k, j) for k, j in start) and (changed := self._cascade(start, max_ops, read)):
                    near = self._around(changed)
                    failed.changed(near, self._around(near))
                    improved = True
                    break
            else:
                failed.add((v, req), read, joint=any(len(start) > 1 for start in tries))
        return improved

    def _elsewhere(self) -> list[int]:
        """The values that may cost something: all but those wanted only where they are (one want,
        of their placement, which sends nothing and starts no collective: 0 in :class:`Codes`' rows),
        most of them."""
        free, label = self.codes.free, self.label
        return [v for v, need in enumerate(self.need) if len(need) > 1 or not free[label[v]] or label[v] not in need]

    def _takers(self, v: int, req: int) -> list[tuple[int, list[int]]]:
        """The consumers that read value ``v`` redistributed to ``req``, each with its strategies
        that read it as it is (and keep its work split)."""
        out, lab = [], self.label[v]
        for c in self.p.consumers_of.get(v, ()):
            here = tuple([i for i, u in enumerate(self.ins[c]) if u == v])
            if any(self.strategies[c][self.choice[c]][0][i] == req for i in here):
                out.append((c, self._reading(c, here, lab)))
        return out

    def _reading(self, c: int, here: tuple[int, ...], lab: int) -> list[int]:
        """The strategies of op ``c`` that keep its work split (:meth:`_kept`) and read its inputs
        ``here`` as ``lab``, in their order, found once per strategy list, inputs, placement and
        whether every strategy keeps the work split (:attr:`AxisTables.reading`)."""
        kept = self._kept(c)
        key = (id(self.strategies[c]), here, lab, isinstance(kept, range))
        found = self.reading.get(key)
        if found is None:
            options = self.strategies[c]
            found = self.reading[key] = [j for j in kept if all(options[j][0][i] == lab for i in here)]
        return found

    def _giving(self, p: int, i: int, req: int) -> list[int]:
        """The strategies of op ``p`` whose output ``i`` is ``req``, in their order, found once per
        strategy list (:attr:`AxisTables.gives`)."""
        key = (id(self.strategies[p]), i, req)
        found = self.gives.get(key)
        if found is None:
            found = self.gives[key] = [j for j, (_, outs) in enumerate(self.strategies[p]) if outs[i] == req]
        return found

    def _joint(self, takers: list[tuple[int, list[int]]], changed: dict[int, int]) -> list[tuple[int, int]]:
        """All the ops that read a value redistributed (``takers``: :meth:`_takers`; two or more,
        none ``changed``) reading it as it is, each in its cheapest such strategy, or ``[]``: the
        redistribution stays while any one of them needs it, so none gains alone."""
        if len(takers) < 2 or any(c in changed or not takes for c, takes in takers):
            return []
        return [(c, min(takes, key=self._costs(c).__getitem__)) for c, takes in takers]

    def _keeps_split(self, k: int, j: int) -> bool:
        """Does strategy ``j`` keep op ``k``'s work split over this axis if its current one does?
        The cost counts the work of matmuls and attention (:attr:`work`), not that of the
        elementwise ops around them, which a cascade would otherwise make whole on every rank
        along with the values it moves. A cascade may make a view whole (it computes nothing),
        not another op."""
        divided = self.divided[k]
        return self.view[k] or divided[j] or not divided[self.choice[k]]

    def _kept(self, k: int) -> range | tuple[int, ...]:
        """The strategies of op ``k`` that keep its work split where its current one does
        (:meth:`_keeps_split`), in their order."""
        if self.view[k] or not self.divided[k][self.choice[k]]:
            return range(len(self.strategies[k]))
        return self.dividing[k]

    def _cascade(self, start: list[tuple[int, int]], max_ops: int, read: set[int]) -> list[int]:
        """Each op ``k`` of ``start`` takes its strategy ``j``; then each op next to a changed one
        (the producers of its inputs, the consumers of its results) takes its best strategy where
        that is cheaper than its own, spreading until none is (at most ``max_ops`` ops change);
        from a joint start (:meth:`_joint`: several readers of one value at once) an op that
        gains nothing alone also joins the other readers of a value it reads redistributed. The
        whole is kept if the values it touched then cost less, else undone; a joint move must
        also send fewer bytes (it may trade many small redistributions for a few, and each
        value's start-up cost ignores buckets). Single starts spread as before: joint takes
        change where a cascade that pays without them goes, and cost planning time. Adds to
        ``read`` the ops whose choice or context it read (the readers of a value it reads, which
        a joint move reads, are next to those); returns the ops it changed, if kept (else ``[]``)."""
        old: dict[int, int] = {}
        before: dict[int, tuple[float, float]] = {}
        joint = len(start) > 1

        def change(op: int, st: int) -> None:
            for v in (*self.ins[op], *self.outs[op]):
                if v >= 0 and v not in before:
                    before[v] = self._value_costs(v)
            old.setdefault(op, self.choice[op])
            self._apply(op, st)
            for v in self.ins[op]:
                p = self.p.producer_of.get(v)
                if p is not None and p not in old:
                    queue.append(p)
            for v in self.outs[op]:
                queue.extend(c for c in self.p.consumers_of.get(v, ()) if c not in old)

        queue: collections.deque[int] = collections.deque()
        for k, j in start:
            change(k, j)
        while queue and len(old) < max_ops:
            c = queue.popleft()
            read.add(c)
            if c in old or len(self.strategies[c]) == 1:
                continue
            costs = self._costs(c)
            best = min(self._kept(c), key=costs.__getitem__)  # (the first of the cheapest, as min of (cost, s))
            if costs[best] < costs[self.choice[c]] - 1e-6:
                change(c, best)
                continue
            if joint:
                reads = zip(
                    self.ins[c], self.strategies[c][self.choice[c]][0]
                )  # a value c reads redistributed, as others do?
                for op, st in next(
                    (
                        m
                        for v, req in reads
                        if req != self.label[v]
                        for m in [self._joint(self._takers(v, req), old)]
                        if m
                    ),
                    [],
                ):
                    change(op, st)
        work = sum(self._op_work(op, self.choice[op]) - self._op_work(op, was) for op, was in old.items())
        now = [self._value_costs(v) for v in before]
        cost_was, bytes_was = (sum(c[i] for c in before.values()) for i in (0, 1))
        read.update(old)
        if sum(c for c, _ in now) + work < cost_was - 1e-6 and (
            not joint or sum(b for _, b in now) + work < bytes_was - 1e-6
        ):
            return list(old)
        for op in reversed(list(old)):
            self._apply(op, old[op])
        return []

    def _merges(self) -> None:
        """:meth:`_merge_partials` of each op in graph order, skipping the ops whose merges cannot pay
        (:meth:`_near_costs`): a move's ops are the op and its producers up to :data:`_MERGE_DEPTH`
        hops up, and it is kept only if the values they read and write and their work cost less
        after it than before; every cost is at least 0, so a move among ops none of which reads or
        writes a value that costs something or runs work beyond its share costs 0 before and cannot
        cost less after. A move kept changes costs only at its ops' values: the ops near those join.
        A run of one copy (:mod:`vsf.jit.copies`) whose reach (its ops and their producers up to
        :data:`_MERGE_DEPTH` hops up: all that its ops' moves read) meets the state in which the
        merges of a run of its shape kept nothing (the reach's fixed contexts, choices, its values'
        placements and wants, which of the run's ops are near) keeps nothing either: it is left as
        those merges left it (:meth:`_leave`), where :attr:`reuse` is on."""
        near = self._near_costs(self._costly_ops())
        runs, merged = (self.p.runs if self.reuse else {}), self.tables.merged
        k = 0
        while k < len(self.p.ops):
            run = runs.get(k)
            ops = range(k, k + 1) if run is None else range(run.start, run.stop)
            key = had = None
            if run is not None:
                key = (*self._state(run.reach), tuple([op in near for op in ops]))
                done = merged.get(key)
                if done is not None:
                    self._leave(run.reach, done)
                    k = run.stop
                    continue
                had = list(map(len, run.reach.values_of(self.need)))
            kept = False
            for op in ops:
                if op in near:
                    changed = self._merge_partials(op)
                    if changed:
                        kept = True
                        near |= self._near_costs(self._around(changed))
            if had is not None and not kept:
                merged[key] = self._left(run.reach, had)
            k = ops.stop

    def _state(self, region: Region) -> tuple[Any, ...]:
        """All that the solver's passes read of ``region``'s ops as the solution stands (the key of
        what a pass did to a region of its shape: :mod:`vsf.jit.copies`): its shape, its ops'
        fixed contexts and choices, its values' placements and wants."""
        return (
            region.shape,
            region.ops_of(self.fixed_context),
            region.ops_of(self.choice),
            region.values_of(self.label),
            region.values_of(self.wants),
        )

    def _left(self, region: Region, had: list[int]) -> Left:
        """What moves tried among ``region``'s ops and taken back left there, its values' need
        having held ``had`` placements each before (:class:`~vsf.jit.copies.Left`)."""
        need = self.need
        zeros = tuple(
            [(i, tuple(list(need[v])[n:])) for i, (v, n) in enumerate(zip(region.values, had)) if len(need[v]) > n]
        )
        return Left(zeros, region.values_of(self.wants))

    def _leave(self, region: Region, left: Left) -> None:
        """Leave ``region`` as the moves that ``left`` says of left a region of its shape in its
        state: the placements they counted and took back (each with a count of 0, in order), and
        the values' wants."""
        need, values, wants = self.need, region.values, self.wants
        for i, zeros in left.zeros:
            counts = need[values[i]]
            for req in zeros:
                counts[req] = 0
        for v, w in zip(values, left.wants):
            wants[v] = w

    def _costly_ops(self) -> set[int]:
        """The ops that read or write a value that costs something as the solution stands, or run
        work beyond their share: every op while a cost may be negative (none is, unless a start-up
        or a FLOP is set to cost less than nothing)."""
        if self.codes.latency < 0 or self.p.bytes_per_flop < 0:
            return set(range(len(self.p.ops)))
        costly = [v for v in self._elsewhere() if self._value_cost(v, self.label[v], self.need[v])]
        return self._around([k for k in range(len(self.p.ops)) if self._op_work(k, self.choice[k])], costly)

    def _around(self, ops: Collection[int], values: Collection[int] = ()) -> set[int]:
        """``ops``, and the ops that read or write a value of them or of ``values``."""
        out = set(ops)
        for v in [*values, *(v for k in ops for v in (*self.ins[k], *self.outs[k]) if v >= 0)]:
            if v in self.p.producer_of:
                out.add(self.p.producer_of[v])
            out.update(self.p.consumers_of.get(v, ()))
        return out

    def _near_costs(self, seeds: set[int]) -> set[int]:
        """The ops ``seeds`` lie within :data:`_MERGE_DEPTH` producer hops of (the ops whose merge
        moves may include a seed)."""
        near, frontier = set(seeds), set(seeds)
        for _hop in range(_MERGE_DEPTH):
            frontier = {
                c for k in frontier for v in self.outs[k] if v >= 0 for c in self.p.consumers_of.get(v, ())
            } - near
            near |= frontier
        return near

    def _merge_partials(self, k: int) -> list[int]:
        """Try each strategy of op ``k`` that sums partial inputs into a partial result together with
        the producers (through views) that would make those inputs partial, as one move, kept if
        the whole costs less: partial products summed before one reduction (the gradients of one
        input used by the q, k and v projections), which no single op's change pays for (each alone
        adds a reduction the sum would have shared). Returns the ops of the moves kept."""
        partial, options, ins, label = self.codes.partial, self.strategies[k], self.ins[k], self.label
        if id(options) not in self.summing:  # (a strategy that takes no partial input makes no move)
            self.summing[id(options)] = [
                (j, sums)
                for j, (takes, outs) in enumerate(options)
                if any(o >= 0 and partial[o] for o in outs)
                for sums in [[(i, req) for i, req in enumerate(takes) if partial[req]]]
                if sums
            ]
        changed: list[int] = []
        for j, sums in self.summing[id(options)]:
            if j == self.choice[k]:
                continue
            moves: dict[int, int] = {}
            if all(label[ins[i]] == req or self._make_partial(ins[i], req, moves) for i, req in sums) and moves:
                moves[k] = j
                if self._try(moves):
                    changed += moves
        return changed

    def _make_partial(self, v: int, req: int, moves: dict[int, int], depth: int = _MERGE_DEPTH) -> bool:
        """Add to ``moves`` the strategies that make value ``v`` the partial ``req``: its producer's
        cheapest strategy giving it, and so on up through its own partial inputs (``depth`` ops)."""
        p = self.p.producer_of.get(v)
        if p is None or depth == 0 or p in moves:
            return False
        gives = self._giving(p, self.outs[p].index(v), req)
        if not gives:
            return False
        costs = self._costs(p)
        best_cost, j = min((costs[j], j) for j in gives)
        if best_cost == INF and not self.view[p]:
            # (a view of a value not yet partial costs infinite as a partial until its producer is
            # made partial too, below; :meth:`_try` costs the whole move)
            return False
        moves[p] = j
        return all(
            not self.codes.is_partial(r) or self.label[u] == r or self._make_partial(u, r, moves, depth - 1)
            for u, r in zip(self.ins[p], self.strategies[p][j][0])
        )

    def _try(self, moves: dict[int, int]) -> bool:
        """Apply ``moves`` (op -> strategy) if the values they touch and the ops' work then cost less, else undo them."""
        touched = {v for k in moves for v in (*self.ins[k], *self.outs[k]) if v >= 0}
        before = sum(self._value_cost(v, self.label[v], self.need[v]) for v in touched) + sum(
            self._op_work(k, self.choice[k]) for k in moves
        )
        old = {k: self.choice[k] for k in moves}
        for k in sorted(moves):
            self._apply(k, moves[k])
        after = sum(self._value_cost(v, self.label[v], self.need[v]) for v in touched) + sum(
            self._op_work(k, j) for k, j in moves.items()
        )
        if after < before - 1e-6:
            return True
        for k in sorted(old, reverse=True):
            self._apply(k, old[k])
        return False

    def placement_of(self, node_index: int) -> tuple[list[Any], list[Any]]:
        ins, outs = self.strategies[node_index][self.choice[node_index]]
        pl = self.codes.placements
        return [pl[c] for c in ins], [None if c < 0 else pl[c] for c in outs]


class _Failed:
    """The redistributions whose cascades (:meth:`AxisSolver._cascade`) all failed, each with the
    ops they read (those ops' choices, and the placements and wants of their values: their
    contexts), when, and whether a joint move was among them; and when a kept move last changed
    something within one value, and within two values, of each op. A cascade undone leaves the
    solution as it was, so tried again it reads what it read and fails again unless a move kept
    since changed something it read. What an op's cost reads (its choice, the placements of its
    inputs, the wants of its values) changes only by a change of an op within one value of it
    (one that writes or reads a value it reads or writes): a kept move marks those ops *near*. A
    joint move also reads the costs of the other readers of a value an op it read reads, which
    change by a change within two values: a kept move marks those ops *far*, and the tries that
    held a joint move are checked against those.

    Example::

        >>> failed = _Failed(len(ops)); failed.add((v, req), {3, 4}, joint=False)
        >>> failed.again((v, req))   # nothing kept since: the same moves would fail again
        True
    """

    def __init__(self, ops: int) -> None:
        self.clock = 0
        # per op, the clock when a kept move last changed something within one value of it, and two
        self.near, self.far = [0] * ops, [0] * ops
        self.tried: dict[tuple[int, int], tuple[int, set[int], list[int]]] = {}

    def add(self, key: tuple[int, int], read: set[int], joint: bool) -> None:
        """``key``'s cascades failed now, having read the ops ``read`` (``joint``: a joint move among them)."""
        self.tried[key] = (self.clock, read, self.far if joint else self.near)

    def changed(self, near: set[int], far: set[int]) -> None:
        """A move was kept that changed something within one value of the ops ``near``, and
        within two values of the ops ``far`` (``near`` among them)."""
        self.clock += 1
        for k in near:
            self.near[k] = self.clock
        for k in far:
            self.far[k] = self.clock

    def again(self, key: tuple[int, int]) -> bool:
        """Would ``key``'s cascades fail again: they failed, and nothing they read changed since?"""
        tried = self.tried.get(key)
        if tried is None:
            return False
        when, read, stamp = tried
        return all(stamp[k] <= when for k in read)


Encoded = list[tuple[tuple[int, ...], tuple[int, ...]]]  # strategies as (input codes, output codes; -1: none)


@dataclasses.dataclass
class AxisTables:
    """What the solvers of one axis read that no sweep changes, built once per axis
    (:meth:`build`) and shared by its solvers: the placement codes; the seeds' labels; the
    outputs' requirements (``need``; ``final`` where one is a placement); per op its strategies
    encoded (ops of one signature share one list), which of them split its work (``splitting``),
    which leave an operand split, a shard or a partial sum (``divided``; ``dividing``: their
    numbers), and the hints
    (:func:`_hints`); per strategy list the strategies giving a partial result from partial
    inputs, each with those inputs' positions and placements (``summing``), and
    per list, output and placement those giving it (``gives``), and per list, inputs, placement
    and whether all keep the work split those reading the inputs so (``reading``), filled as the
    solvers ask; and,
    kept from one solve of the axis to the next (a sweep's), the numbers of the ops' fixed contexts
    (``parts``: :meth:`AxisSolver._fixed_contexts`), of the placements wanted of a value and how
    often (``wants``: :meth:`AxisSolver._context`; ``first_wants``: each value's before any op is
    placed), the decisions and costs by context
    (``picked``, ``costed``: :meth:`AxisSolver._pick`, :meth:`AxisSolver._costs`) and the values'
    costs (``valued``: :meth:`AxisSolver._value_costs`), which depend on
    nothing else a solve reads: an op whose context the last solve met is decided as it was then;
    and likewise per run state (:mod:`vsf.jit.copies`) what the greedy pass placed (``placed``),
    the states the repairs changed nothing in (``steady``), what the merges that kept nothing left
    (``merged``) and the ops' fixed-context numbers (``fixed``)."""

    codes: Codes
    label: list[int]
    need: list[dict[int, int]]
    final: dict[int, int]
    strategies: list[Encoded]
    splitting: list[tuple[bool, ...]]
    divided: list[tuple[bool, ...]]
    dividing: list[tuple[int, ...]]  # per op, its strategies that leave an operand split (``divided``)
    hints: list[frozenset[int]]
    summing: dict[int, list[tuple[int, list[tuple[int, int]]]]] = dataclasses.field(default_factory=dict)
    gives: dict[tuple[int, int, int], list[int]] = dataclasses.field(default_factory=dict)
    reading: dict[tuple[int, tuple[int, ...], int, bool], list[int]] = dataclasses.field(default_factory=dict)
    parts: dict[Any, int] = dataclasses.field(default_factory=dict)
    wants: dict[tuple[tuple[int, int], ...], int] = dataclasses.field(default_factory=dict)
    first_wants: list[int] | None = None  # the wants' numbers before any op is placed (:class:`AxisSolver`)
    picked: dict[tuple[Any, ...], int | None] = dataclasses.field(default_factory=dict)
    costed: dict[tuple[Any, ...], tuple[float, ...]] = dataclasses.field(default_factory=dict)
    valued: dict[tuple[float, float, float, int, int], tuple[float, float]] = dataclasses.field(default_factory=dict)
    placed: dict[tuple[Any, ...], Placed] = dataclasses.field(default_factory=dict)
    steady: set[tuple[Any, ...]] = dataclasses.field(default_factory=set)
    merged: dict[tuple[Any, ...], Left] = dataclasses.field(default_factory=dict)
    fixed: dict[tuple[Any, ...], list[int]] = dataclasses.field(default_factory=dict)

    @classmethod
    def build(cls, problem: "Problem", axis: str, codes: Codes) -> "AxisTables":
        """The tables of ``axis``, its placements coded in ``codes``."""
        vid = problem.value_ids
        label = [codes.code(R)] * len(problem.values)
        need: list[dict[int, int]] = [{} for _ in problem.values]
        for v, pl in problem.seeds[axis].items():
            label[vid[v]] = codes.code(pl)
        final: dict[int, int] = {}
        for v, req in problem.out_req[axis]:
            c = codes.code(req)
            need[vid[v]][c] = need[vid[v]].get(c, 0) + 1
            if req is not NOT_PARTIAL and not isinstance(req, OrSum):
                final[vid[v]] = c
        strategies = _strategy_lists(problem, axis, codes)
        by_list: dict[int, tuple[tuple[bool, ...], tuple[bool, ...], tuple[int, ...]]] = {}
        for options in strategies:
            if id(options) not in by_list:
                divided = tuple(
                    any(c >= 0 and (codes.is_shard(c) or codes.is_partial(c)) for c in (*ins, *outs))
                    for ins, outs in options
                )
                by_list[id(options)] = (
                    tuple(splits_work([codes.placements[c] for c in (*ins, *outs) if c >= 0]) for ins, outs in options),
                    divided,
                    tuple([j for j, split in enumerate(divided) if split]),
                )
        rows = [by_list[id(options)] for options in strategies]
        return cls(
            codes,
            label,
            need,
            final,
            strategies,
            [row[0] for row in rows],
            [row[1] for row in rows],
            [row[2] for row in rows],
            _hints(problem, codes, need, strategies),
        )


def _strategy_lists(problem: "Problem", axis: str, codes: Codes) -> list[Encoded]:
    """Per op, its strategies on ``axis`` encoded: a manual region's fixed one, those giving a
    constrained sharding, or DTensor's (:meth:`Strategies.of`, encoded once per list)."""
    n = problem.mesh.axis_size(axis)
    manual, constrained, of = problem.fixed.get(axis, {}), problem.pinned[axis], problem.strategies.of
    ragged, balanced = tuple(problem.ragged[axis]), problem.balanced.get(axis, False)
    encoded: dict[int, Encoded] = {}
    out = []
    for node in problem.ops:
        fixed = manual.get(node)
        if fixed is not None:  # a manual region: its specs are its only strategies
            out.append(_encode(codes, fixed))
            continue
        allowed = of(node, n, ragged, balanced)[0]
        pinned = constrained.get(node)
        if pinned is not None:
            allowed = [st for st in allowed if st.outs[0] in pinned]
            if not allowed:
                raise PlanError(
                    f"no strategy of {node.target} can give the constrained sharding on axis {axis!r}{user_line(node)}"
                )
            out.append(_encode(codes, allowed))
            continue
        if id(allowed) not in encoded:  # ops with one signature share one list: encode it once
            encoded[id(allowed)] = _encode(codes, allowed)
        out.append(encoded[id(allowed)])
    return out


def _hints(
    problem: "Problem", codes: Codes, need: list[dict[int, int]], strategies: list[Encoded]
) -> list[frozenset[int]]:
    """Shardings each value will be wanted in later, propagated backwards (as GSPMD does) from
    the outputs' required shardings (``need``) through ops that keep a sharding as it is
    (elementwise ones: the same placement in and out). The greedy pass may shard a value into one
    of its hints even where no input is sharded yet, e.g. reduce-scatter a gradient that a ZeRO
    optimizer will want sharded, before a norm of it decides for a full reduction."""
    none: frozenset[int] = frozenset()
    hints: dict[int, set[int]] = {}  # (the values that have some)
    for v, wants in enumerate(need):
        if shards := {c for c in wants if codes.is_shard(c)}:
            hints[v] = shards
    for k in range(len(problem.ops) - 1, -1, -1):
        wanted = [hints.get(v, none) for v in problem.op_outs[k]]  # (-1, no output: none)
        if not any(wanted):
            continue
        for ins, outs in strategies[k]:
            if any(o >= 0 and o in w for o, w in zip(outs, wanted)):
                for v, req in zip(problem.op_ins[k], ins):
                    if codes.is_shard(req) and req in outs:
                        hints.setdefault(v, set()).add(req)
    return [frozenset(hints[v]) if v in hints else none for v in range(len(problem.values))]


@dataclasses.dataclass
class Problem:
    """What every axis solver shares: the graph's ops and values, the seeds from the inputs, the
    outputs' requirements, the constraints and the manual regions' fixed strategies, per axis; and the solvers of the axes solved so far."""

    mesh: Mesh
    gm: torch.fx.GraphModule
    ops: list[torch.fx.Node]
    inputs: dict[torch.fx.Node, list[Value]]
    strategies: Strategies
    seeds: dict[str, dict[Value, Placement]]
    out_req: dict[str, list[tuple[Value, Any]]]
    pinned: dict[str, dict[torch.fx.Node, set[Placement]]]
    solved: dict[str, AxisSolver]
    ragged: dict[str, list[tuple[RaggedPlacement, int]]] = dataclasses.field(default_factory=dict)
    balanced: dict[str, bool] = dataclasses.field(default_factory=dict)  # axes some input is split balanced over
    fixed: dict[str, dict[torch.fx.Node, list[Strategy]]] = dataclasses.field(default_factory=dict)
    bytes_per_flop: float = 0.0  # what a FLOP an op runs beyond its share costs (vsf.config.compute_bytes_per_flop)
    flops: list[int] = dataclasses.field(
        default_factory=list
    )  # per op, its FLOPs on global shapes (vsf.jit.cost.op_flops)
    values: list[Value] = dataclasses.field(default_factory=list)
    value_ids: dict[Value, int] = dataclasses.field(default_factory=dict)
    producer_of: dict[int, int] = dataclasses.field(default_factory=dict)
    consumers_of: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    op_ins: list[tuple[int, ...]] = dataclasses.field(default_factory=list)  # per op, its tensor inputs' value ids
    op_outs: list[tuple[int, ...]] = dataclasses.field(default_factory=list)  # per op, its outputs' (-1: none)
    views: list[bool] = dataclasses.field(default_factory=list)  # per op, is it a view (vsf.jit.graph.is_view)
    # per op, each input's first position among its inputs (which of them are one value)
    same_inputs: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    value_bytes: list[float] = dataclasses.field(default_factory=list)  # per value, its bytes on global shapes

    alone: list[bool] = dataclasses.field(default_factory=list)  # per value: its collective runs alone (:meth:`index`)
    # per value: some work computes it, or a value it is computed from (:meth:`index`)
    worked: list[bool] = dataclasses.field(default_factory=list)
    # per value, the count its wants are capped at (:meth:`AxisSolver._wanted`): one more than any op
    # reads it; 0 where its readers cannot count past that
    clamp: list[int] = dataclasses.field(default_factory=list)
    # per op, what reads its inputs' and its outputs' entries of a per-value list (:meth:`AxisSolver._context`)
    in_items: list[Callable[[list[int]], Any]] = dataclasses.field(default_factory=list)
    out_items: list[Callable[[list[int]], Any]] = dataclasses.field(default_factory=list)
    runs: dict[int, Run] = dataclasses.field(default_factory=dict)  # by first op: a copy's runs (:mod:`vsf.jit.copies`)

    def index(self) -> None:
        """Number the values, record which op produces and which ops consume each, count each op's
        FLOPs, and mark the values whose collective runs alone (:attr:`alone`): those between two ops
        that do work, one before them (a matmul, attention: :func:`~vsf.jit.cost.op_flops`) and one
        after. Only they are charged a collective's whole start-up (``vsf.config.collective_latency_bytes``):
        such a collective waits for the work before it and holds up the work after it (Megatron's
        activation all-reduces, one after another). A value computed from the inputs without work
        (a parameter gathered, a count of tokens) or read by no work after it (a gradient reduced
        for the optimizer) is independent of the others like it, which join it in a bucket, one
        collective for many (:mod:`vsf.jit.buckets`): it is charged :data:`BUCKET_SHARE` of a
        start-up. Charged a whole one each at 64 KiB, 59 parameters of a small FSDP GPT gathered
        looked dearer than moving its activations, which sent 1.7x the bytes in 18 collectives
        instead of 4."""
        metas = []  # per value, its fake tensor
        for ph in placeholders_of(self.gm):
            metas.append(meta_of((ph, 0)))
            self._add((ph, 0))
        for k, node in enumerate(self.ops):
            outs = outputs_meta(node)
            for i, meta in enumerate(outs):
                if meta is not None:
                    self.producer_of[self._add((node, i))] = k
                    metas.append(meta)
            self.op_outs.append(tuple(-1 if meta is None else self.value_ids[(node, i)] for i, meta in enumerate(outs)))
        self.op_ins = [tuple([self.value_ids[v] for v in self.inputs[node]]) for node in self.ops]
        for k, ins in enumerate(self.op_ins):
            for v in ins:
                self.consumers_of.setdefault(v, []).append(k)
        self.views = [is_view(node) for node in self.ops]
        self.same_inputs = [tuple([ins.index(v) for v in ins]) for ins in self.op_ins]
        self.in_items = [_items_of(ins) for ins in self.op_ins]
        self.out_items = [_items_of([v for v in outs if v >= 0]) for outs in self.op_outs]
        self.clamp = [0] * len(self.values)
        for v, readers in self.consumers_of.items():
            # (an op reads a value once, most often: a count of 1 each)
            cap = 2 if len(set(readers)) == len(readers) else 1 + max(collections.Counter(readers).values())
            if len(readers) >= cap:
                self.clamp[v] = cap
        self.value_bytes = [float(t.numel() * t.element_size()) for t in metas]
        counted: dict[tuple[Any, ...], int] = {}  # by op signature (an op's FLOPs are its arguments' shapes')
        for node in self.ops:
            sig = self.strategies.signature(node)
            if sig not in counted:
                counted[sig] = op_flops(node)
            self.flops.append(counted[sig])
        outs = [[v for v in vs if v >= 0] for vs in self.op_outs]
        after = [False] * len(self.values)  # some work computes it (or a value it is computed from)
        for k in range(len(self.ops)):
            worked = bool(self.flops[k]) or any(after[v] for v in self.op_ins[k])
            for v in outs[k]:
                after[v] = worked
        before = [False] * len(self.values)  # some work reads it (or a value computed from it)
        for k in range(len(self.ops) - 1, -1, -1):
            if self.flops[k] or any(before[v] for v in outs[k]):
                for v in self.op_ins[k]:
                    before[v] = True
        self.alone = [a and b for a, b in zip(after, before)]
        self.worked = after
        graph = Graph(self.ops, self.op_ins, self.op_outs, self.clamp, self.producer_of)
        self.runs = runs_of(graph, _MERGE_DEPTH)

    def _add(self, v: Value) -> int:
        self.value_ids[v] = len(self.values)
        self.values.append(v)
        return self.value_ids[v]
