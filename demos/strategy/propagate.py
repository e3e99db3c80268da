"""Sharding propagation: every operator without a strategy gets one from its neighbours, as MindSpore's
`search_mode="sharding_propagation"` does.

From each operator with a strategy (`shard()`), then from the dataset inputs (split along the batch over all ranks,
the seed's `dataset_strategy="data_parallel"`), a breadth-first walk visits the neighbours — consumers and
producers — that have none, and gives each the candidate strategy that is cheapest *on the edge it was reached
by*, with MindSpore's order of preference (mindspore/ccsrc/frontend/parallel/auto_parallel/edge_costmodel.cc):

  1. no communication on the edge (every rank already holds the block it needs), and among those the least local
     work: a split of a dimension that was whole costs the block's size, and splitting one tensor dimension over
     several mesh dimensions another 2× (MindSpore's reshape of the expanded tensor shape);
  2. then the fewest elements a rank must receive;
  3. ties: the operator's own communication (a contracted split's all-reduce), then MindSpore's `Compare`: more
     partitions first, then the larger strategy tuple.

Candidates use every rank (the splits multiply to the mesh size) and divide their dimensions. Parameters are laid
out as the first operator that reads them needs; another reader must agree (it cannot redistribute a weight). This
is what makes the seed's result: after `matmul` ((2, 4), (4, 1)) the ReLU gets ((2, 4),) — only a column split of
the block each rank already has — and the second MatMul ((2, 4), (4, 1)), the one candidate that reads that
layout as it is. (DTensor's own per-op rules choose otherwise: they reduce-scatter the partial sums into rows over
all 8 ranks — ReLU (8, 1) — after which the second MatMul runs data-parallel; tests/test_strategy.py shows both.)
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from demos.strategy.graph import OpGraph, OpNode
from demos.strategy.layout import Layout, Strategy, StrategyError, assign_mesh_dims, format_strategy, mesh_coords


@dataclass
class OpPlan:
    op: OpNode
    strategy: Strategy
    source: str  # "shard()" or "propagated from <op>"
    in_layouts: list[Layout]
    out_layout: Layout  # as computed: partial on contracted split dims

    @property
    def reduction_dims(self) -> tuple[int, ...]:
        """Mesh dims the operator all-reduces its output over (MindSpore's forward AllReduce)."""
        return self.out_layout.partial


@dataclass
class Plan:
    mesh: tuple[int, ...]
    graph: OpGraph
    ops: dict[str, OpPlan]
    inputs: dict[str, Layout]
    params: dict[str, Layout]
    notes: list[str] = field(default_factory=list)

    def value_layout(self, value: str) -> Layout:
        """Layout a value is produced in: dataset / parameter layout, or an op's output after its all-reduce."""
        if value in self.inputs:
            return self.inputs[value]
        if value in self.params:
            return self.params[value]
        return self.ops[value].out_layout.reduced()


def _shapes(op: OpNode) -> str:
    return ", ".join(str(tuple(s)) for s in op.in_shapes)


def layouts_for(op: OpNode, strategy: Strategy, mesh: Sequence[int]) -> tuple[list[Layout], Layout]:
    """The input and output layouts `strategy` gives `op` on `mesh`; StrategyError naming op, strategy and shapes."""
    where = f"{op.name} ({op.kind}) strategy {format_strategy(strategy)} for inputs of shape {_shapes(op)}"
    if len(strategy) != len(op.in_shapes) or any(len(s) != len(sh) for s, sh in zip(strategy, op.in_shapes)):
        raise StrategyError(f"{where}: give one split per dimension of each of its {len(op.in_shapes)} input(s)")
    splits: dict[str, int] = {}
    for i, (letters, per, shape) in enumerate(zip(op.in_letters, strategy, op.in_shapes)):
        for d, (letter, s, n) in enumerate(zip(letters, per, shape)):
            if n % s:
                raise StrategyError(f"{where}: split {s} does not divide dimension {d} (size {n}) of input {i}")
            if splits.setdefault(letter, s) != s:
                raise StrategyError(
                    f"{where}: the inputs split a shared dimension differently ({splits[letter]} "
                    f"and {s}; e.g. a MatMul's x columns and w rows must be split alike)"
                )
    size, used = math.prod(mesh), math.prod(splits.values())
    if used > size or size % used:
        raise StrategyError(
            f"{where}: it splits over {used} devices but the mesh {tuple(mesh)} has {size} "
            f"(the splits' product must divide {size})"
        )
    assigned = assign_mesh_dims(mesh, {k: v for k, v in splits.items() if v > 1})
    if assigned is None:
        raise StrategyError(
            f"{where}: splits {sorted(v for v in splits.values() if v > 1)} cannot each take whole "
            f"dimensions of the mesh {tuple(mesh)}"
        )

    def dims_of(letters):
        return tuple(assigned.get(c, ()) for c in letters)

    ins = [Layout(tuple(sh), tuple(mesh), dims_of(letters)) for letters, sh in zip(op.in_letters, op.in_shapes)]
    contracted = sorted(m for c, ms in assigned.items() if c not in op.out_letters for m in ms)
    out = Layout(tuple(op.out_shape), tuple(mesh), dims_of(op.out_letters), tuple(contracted))
    return ins, out


def candidates(op: OpNode, mesh: Sequence[int]) -> list[Strategy]:
    """Every strategy that uses all ranks, divides its dimensions and fits the mesh."""
    size = math.prod(mesh)
    letters = list(dict.fromkeys("".join(op.in_letters)))
    extent = {c: n for ls, sh in zip(op.in_letters, op.in_shapes) for c, n in zip(ls, sh)}
    options = [[s for s in range(1, size + 1) if size % s == 0 and extent[c] % s == 0] for c in letters]
    out = []
    for combo in itertools.product(*options):
        if math.prod(combo) != size:
            continue
        split = dict(zip(letters, combo))
        strategy = tuple(tuple(split[c] for c in ls) for ls in op.in_letters)
        if assign_mesh_dims(mesh, {k: v for k, v in split.items() if v > 1}) is not None:
            out.append(strategy)
    return out


def redistribution_cost(src: Layout, dst: Layout) -> tuple[int, int]:
    """(elements the busiest rank must receive, local slicing work) to turn `src` (no partial sums) into `dst`."""
    comm = 0
    for coord in mesh_coords(src.mesh):
        have, need = src.block(coord), dst.block(coord)
        overlap = math.prod(max(0, min(h1, n1) - max(h0, n0)) for (h0, h1), (n0, n1) in zip(have, need))
        comm = max(comm, math.prod(n1 - n0 for n0, n1 in need) - overlap)
    if comm:
        return comm, 0
    local = math.prod(src.local_shape)
    src_sharding = {(d, m) for d, ms in enumerate(src.dims) for m in ms}
    work = sum(local for d, ms in enumerate(dst.dims) for m in ms if (d, m) not in src_sharding)
    if any(len(ms) > 1 and ms != src.dims[d] for d, ms in enumerate(dst.dims)):
        work += 2 * local
    return 0, work


def _own_comm(out: Layout) -> int:
    return math.prod(out.local_shape) if out.partial else 0


def _compare_key(strategy: Strategy):
    """MindSpore's Strategy::Compare as a sort key: more partitions first, then the larger tuple."""
    flat = [s for per in strategy for s in per]
    return (-math.prod(flat), [-s for s in flat])


def data_parallel_layout(name: str, shape: tuple[int, ...], mesh: Sequence[int]) -> Layout:
    """The seed's dataset_strategy="data_parallel": the batch dimension split over every rank."""
    size = math.prod(mesh)
    if shape[0] % size:
        raise StrategyError(
            f"input {name} of shape {tuple(shape)}: data-parallel input needs the batch ({shape[0]}) "
            f"to divide over the {size} ranks of the mesh {tuple(mesh)}"
        )
    return Layout(tuple(shape), tuple(mesh), (tuple(range(len(mesh))),) + ((),) * (len(shape) - 1))


class _Propagation:
    def __init__(self, graph: OpGraph, mesh: Sequence[int]):
        self.graph, self.mesh = graph, tuple(mesh)
        self.chosen: dict[str, OpPlan] = {}
        self.params: dict[str, tuple[Layout, str]] = {}  # layout, the op that fixed it
        self.inputs = {n: data_parallel_layout(n, s, self.mesh) for n, s in graph.inputs.items()}
        self.configured = {o.name for o in graph.ops if o.prim.strategy is not None}

    def fix(self, op: OpNode, strategy: Strategy, source: str) -> OpPlan:
        ins, out = layouts_for(op, strategy, self.mesh)
        for value, layout in zip(op.inputs, ins):
            if value not in self.graph.params:
                continue
            if value in self.params and self.params[value][0] != layout:
                other = self.chosen[self.params[value][1]]
                raise StrategyError(
                    f"{op.name} ({op.kind}) strategy {format_strategy(strategy)} for inputs of shape {_shapes(op)} "
                    f"conflicts with {other.op.name} ({other.op.kind}) strategy {format_strategy(other.strategy)}: "
                    f"both read parameter {value} of shape {tuple(layout.shape)}, split {layout.splits} vs "
                    f"{self.params[value][0].splits}; give them strategies that split it alike"
                )
            self.params.setdefault(value, (layout, op.name))
        plan = OpPlan(op, strategy, source, ins, out)
        self.chosen[op.name] = plan
        return plan

    def _allowed(self, op: OpNode, strategy: Strategy) -> bool:
        """A candidate reads every already-placed parameter as it lies."""
        ins, _ = layouts_for(op, strategy, self.mesh)
        return all(v not in self.params or self.params[v][0] == lay for v, lay in zip(op.inputs, ins))

    def choose(self, op: OpNode, cost_of) -> Strategy:
        """The candidate of `op` MindSpore's rule prefers; cost_of(in_layouts, out_layout) → edge cost."""
        options = candidates(op, self.mesh)
        if not options:
            raise StrategyError(
                f"{op.name} ({op.kind}) for inputs of shape {_shapes(op)}: no strategy splits its "
                f"dimensions over all {math.prod(self.mesh)} ranks of the mesh {self.mesh}; give it "
                f"one with shard()"
            )
        scored = []
        for s in options:
            if not self._allowed(op, s):
                continue
            ins, out = layouts_for(op, s, self.mesh)
            comm, work = cost_of(ins, out)
            scored.append((s, comm, work, _own_comm(out)))
        if not scored:
            raise StrategyError(
                f"{op.name} ({op.kind}) for inputs of shape {_shapes(op)}: no strategy over the mesh "
                f"{self.mesh} reads its parameters as their other readers split them"
            )
        free = [x for x in scored if x[1] == 0]
        if free:
            best = min(free, key=lambda x: (x[2], x[3], _compare_key(x[0])))
        else:
            best = min(scored, key=lambda x: (x[1], _compare_key(x[0])))
        return best[0]

    def walk(self, start: str) -> None:
        """Breadth-first from an op with a strategy, or from a dataset input."""
        queue = deque([start])
        while queue:
            name = queue.popleft()
            produced = self.inputs[name] if name in self.inputs else self.chosen[name].out_layout.reduced()
            for consumer, i in self.graph.consumers(name):  # forward edges
                if consumer.name in self.chosen:
                    continue
                s = self.choose(
                    consumer, lambda ins, out, i=i, produced=produced: redistribution_cost(produced, ins[i])
                )
                self.fix(consumer, s, f"propagated from {name}")
                queue.append(consumer.name)
            if name in self.inputs:
                continue
            plan = self.chosen[name]
            for i, value in enumerate(plan.op.inputs):  # backward edges
                if value in self.graph.params:  # through a parameter to its readers
                    for reader, j in self.graph.consumers(value):
                        if reader.name not in self.chosen:
                            s = self.choose(
                                reader,
                                lambda ins, out, j=j, value=value: redistribution_cost(self.params[value][0], ins[j]),
                            )
                            self.fix(reader, s, f"propagated from {name} through {value}")
                            queue.append(reader.name)
                    continue
                if value in self.inputs or value in self.chosen:
                    continue
                producer = self.graph.op(value)
                need = plan.in_layouts[i]
                s = self.choose(producer, lambda ins, out, need=need: redistribution_cost(out.reduced(), need))
                self.fix(producer, s, f"propagated from {name}")
                queue.append(producer.name)


def propagate(graph: OpGraph, mesh: Sequence[int]) -> Plan:
    """A strategy for every operator: the given ones, the rest propagated (module docstring)."""
    prop = _Propagation(graph, mesh)
    for op in graph.ops:  # the user's strategies first, checked and fixed
        if op.prim.strategy is not None:
            prop.fix(op, op.prim.strategy, "shard()")
    for op in graph.ops:
        if op.name in prop.configured:
            prop.walk(op.name)
    for name in graph.inputs:
        prop.walk(name)
    missing = [o.name for o in graph.ops if o.name not in prop.chosen]
    if missing:  # e.g. an op of parameters only, no strategy near it
        raise StrategyError(
            f"no strategy reaches {', '.join(missing)} from a dataset input or a shard(): give it one with shard()"
        )
    params = {v: lay for v, (lay, _) in prop.params.items()}
    return Plan(prop.mesh, graph, {o.name: prop.chosen[o.name] for o in graph.ops}, prop.inputs, params)
