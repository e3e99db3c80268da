"""The two files the seed reads its strategies from, as text:

step_parallel_begin.txt   every operator's strategy (given or propagated), global shapes, DTensor placements
                          and the collectives the plan implies (the seed's step_parallel_begin_*.ir)
execute.txt               per rank: the local shapes each operator ran with and the collectives counted while
                          it ran (the seed's 18_execute_*.ir: (8, 8) @ (8, 16) on rank 0)
"""

from __future__ import annotations

from collections.abc import Sequence

from demos.strategy.execute import OpRecord
from demos.strategy.layout import Layout, format_strategy, group_ranks, mesh_coords
from demos.strategy.propagate import Plan


def _name(type_name: str) -> str:
    return {"Shard": "S", "Replicate": "R", "Partial": "P"}[type_name]


def implied_collectives(src: Layout, dst: Layout) -> list[tuple[str, int]]:
    """(collective, mesh dim) DTensor runs to turn `src` into `dst`, mesh dim by mesh dim ('slice' = local)."""
    out = []
    for m, (a, b) in enumerate(zip(src.placements(), dst.placements())):
        if a == b:
            continue
        ka, kb = type(a).__name__, type(b).__name__
        kind = {
            ("Partial", "Replicate"): "all_reduce",
            ("Partial", "Shard"): "reduce_scatter",
            ("Shard", "Replicate"): "all_gather",
            ("Replicate", "Shard"): "slice",
            ("Shard", "Shard"): "all_to_all",
        }.get((ka, kb), f"{_name(ka)}→{_name(kb)}")
        out.append((kind, m))
    return out


def _collectives_text(items: Sequence[tuple[str, int]]) -> str:
    return ", ".join(f"{k} over mesh dim {m}" if k != "slice" else f"local slice on mesh dim {m}" for k, m in items)


def _tensor(shape) -> str:
    return f"<Tensor[Float32], {tuple(shape)}>"


def strategy_dump(plan: Plan) -> str:
    """Every operator's strategy and what it implies (the same text on every rank)."""
    mesh = plan.mesh
    lines = [
        f"# strategies on a DeviceMesh {mesh} ({len(mesh_coords(mesh))} ranks, rank = row-major mesh "
        f"coordinate); dataset_strategy data_parallel; placements per mesh dim: S(d) shard tensor dim d, "
        f"R replicate, P partial sum"
    ]
    for name, layout in plan.inputs.items():
        lines.append(
            f"%{name} = Input {{in_strategy: {format_strategy((layout.splits,))}}} : {_tensor(layout.shape)}"
            f"  placements {layout.describe()}"
        )
    for name, layout in plan.params.items():
        lines.append(
            f"%{name.rsplit('.', 1)[-1]} = Parameter({name}) {{layout: {format_strategy((layout.splits,))}}}"
            f" : {_tensor(layout.shape)}  placements {layout.describe()}"
        )
    for name, p in plan.ops.items():
        op = p.op
        args = ", ".join("%" + v.rsplit(".", 1)[-1] for v in op.inputs)
        lines.append(
            f"%{op.instance} = {op.kind}({args}) {{instance name: {op.instance}}} "
            f"{{in_strategy: {format_strategy(p.strategy)}}}  [{p.source}]"
        )
        lines.append(f"    : ({', '.join(_tensor(s) for s in op.in_shapes)}) -> ({_tensor(op.out_shape)})")
        placed = ", ".join(lay.describe() for lay in p.in_layouts)
        lines.append(f"    # placements: {placed} -> {p.out_layout.describe()}")
        notes = []
        for value, layout in zip(op.inputs, p.in_layouts):
            moves = implied_collectives(plan.value_layout(value), layout)
            if moves:
                notes.append(
                    f"%{value.rsplit('.', 1)[-1]} {plan.value_layout(value).describe()} -> "
                    f"{layout.describe()}: {_collectives_text(moves)}"
                )
        if p.reduction_dims:
            notes.append(f"forward AllReduce of the partial sums over mesh dim(s) {list(p.reduction_dims)}")
        if notes:
            lines.append("    # collectives: " + "; ".join(notes))
        lines.append(f"    # scope: {name.rsplit('.', 1)[0] if '.' in name else '(top)'}")
    return "\n".join(lines)


def _ranks(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 3] → '[0-3]'; other lists as they are."""
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"[{ranks[0]}-{ranks[-1]}]"
    return str(ranks)


def _counts(c: dict[str, int]) -> str:
    return ", ".join(f"{k} ×{n}" for k, n in sorted(c.items())) or "no communication"


def execute_dump(plan: Plan, records: Sequence[OpRecord], rank: int, backward: dict[str, int] | None = None) -> str:
    """What rank `rank` ran in a step: local shapes per operator and the collectives counted."""
    mesh = plan.mesh
    coord = mesh_coords(mesh)[rank]
    lines = [
        f"# rank {rank}, mesh coordinate {coord} of {mesh}: local shapes and counted collectives of one training step"
    ]
    for rec in records:
        p = plan.ops[rec.name]
        shapes = ", ".join(str(i.after) for i in rec.inputs)
        names = ", ".join("%" + i.value.rsplit(".", 1)[-1] for i in rec.inputs)
        lines.append(
            f"%{p.op.instance} = {p.op.kind}({names})"
            f" {{in_strategy: {format_strategy(p.strategy)}}} : ({shapes}) -> {rec.out_shape}"
        )
        for i, layout in zip(rec.inputs, p.in_layouts):
            moved = [m for _, m in implied_collectives(plan.value_layout(i.value), layout)]
            if i.before == i.after and not i.collectives:
                continue
            where = (
                f" over ranks {_ranks(group_ranks(mesh, coord, moved))}" if i.collectives else " (local StridedSlice)"
            )
            lines.append(f"    %{i.value.rsplit('.', 1)[-1]}: {i.before} -> {i.after}  {_counts(i.collectives)}{where}")
        if p.reduction_dims:
            group = _ranks(group_ranks(mesh, coord, p.reduction_dims))
            lines.append(f"    AllReduce {rec.out_shape} over ranks {group}  {_counts(rec.reduction)}")
    if backward is not None:
        lines.append(f"# backward: {_counts(backward)}")
    for name, layout in plan.params.items():
        replicated = [m for m in range(len(mesh)) if not any(m in ms for ms in layout.dims)]
        if replicated:
            lines.append(
                f"#   gradient of {name} {layout.local_shape} summed over ranks "
                f"{_ranks(group_ranks(mesh, coord, replicated))} (the ranks holding the same block)"
            )
    return "\n".join(lines)
