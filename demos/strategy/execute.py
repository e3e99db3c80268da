"""Run a strategy plan on DTensors: each operator's inputs are redistributed to its strategy's layout, it runs on
its blocks, and a contracted split is all-reduced inside the operator (MindSpore's forward AllReduce). In backward,
DTensor brings each parameter's gradient to the parameter's own placements: the partial sums of the ranks that hold
the same block are all-reduced (MindSpore's mirror AllReduce). Every step of this is recorded per operator — the local
shapes this rank computed with and the
collectives `CommDebugMode` counted — which is what `demos.strategy.dump` prints.

Works the same in real processes (one rank each, gloo/nccl) and in one process simulating all ranks
(`torch.distributed._local_tensor.LocalTensorMode` over a fake process group, `simulation.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from demos.strategy.layout import Layout
from demos.strategy.propagate import Plan


def collective_name(op) -> str:
    """'c10d_functional.all_reduce' / '_dtensor.shard_dim_alltoall' → 'all_reduce' / 'all_to_all'."""
    name = str(op).rsplit(".", 1)[-1]
    return {
        "shard_dim_alltoall": "all_to_all",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
        "all_to_all_single": "all_to_all",
    }.get(name, name)


def counted(comm) -> dict[str, int]:
    out: dict[str, int] = {}
    for op, n in comm.get_comm_counts().items():
        if n:
            out[collective_name(op)] = out.get(collective_name(op), 0) + n
    return out


def _shape(t) -> tuple[int, ...]:
    return tuple(int(n) for n in t.to_local().shape)


@dataclass
class InputRecord:
    value: str
    before: tuple[int, ...]  # local shape as produced
    after: tuple[int, ...]  # local shape the operator reads
    collectives: dict[str, int]


@dataclass
class OpRecord:
    name: str
    inputs: list[InputRecord]
    out_shape: tuple[int, ...]  # local result, before the operator's all-reduce
    reduction: dict[str, int] = field(default_factory=dict)


def _kinds(placements) -> list:
    """Placements without a Partial's reduce op (a mean's partials are "avg", a matmul's "sum")."""
    return [("P",) if type(q).__name__ == "Partial" else q for q in placements]


def _wait(t):
    """A DTensor whose local tensor is ready (functional collectives are asynchronous)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    local = t._local_tensor
    if isinstance(local, AsyncCollectiveTensor):
        local.wait()
    return t


class ShardedRunner:
    """The plan's network on `mesh`: parameters distributed from the serial module's full values."""

    def __init__(self, plan: Plan, mesh, module: nn.Module):
        from torch.distributed.tensor import distribute_tensor

        self.plan, self.mesh = plan, mesh
        full = dict(module.named_parameters())
        self.params: dict[str, nn.Parameter] = {}
        for name, layout in plan.params.items():
            # every rank holds the same full initial value (same seed): each keeps its block, nothing is sent
            local = distribute_tensor(full[name].detach(), mesh, layout.placements(), src_data_rank=None)
            self.params[name] = nn.Parameter(local)
        self.records: list[OpRecord] = []
        self._groups: dict[tuple[int, ...], object] = {}  # mesh dims → their flattened 1-D mesh, made once

    def parameters(self):
        return list(self.params.values())

    def distribute_input(self, name: str, global_tensor: torch.Tensor):
        """A dataset tensor in its data-parallel layout: each rank keeps its own rows (the seed's per-rank data)."""
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(global_tensor, self.mesh, self.plan.inputs[name].placements(), src_data_rank=None)

    def _reduce(self, t, layout: Layout):
        """All-reduce the partial sums over the op's contracted mesh dims in one collective (a flattened group)."""
        from torch.distributed.tensor import DTensor, Partial, Replicate

        dims = layout.partial
        target = layout.reduced().placements()
        if len(dims) == 1:
            return t.redistribute(self.mesh, target)
        if dims not in self._groups:  # DeviceMesh._flatten: the way DTensor itself groups several mesh dims
            names = tuple(self.mesh.mesh_dim_names[m] for m in dims)
            self._groups[dims] = self.mesh[names]._flatten("_".join(names))
        group = self._groups[dims]
        reduce_op = next(p for p in t.placements if isinstance(p, Partial)).reduce_op
        summed = DTensor.from_local(t.to_local(), group, [Partial(reduce_op)]).redistribute(group, [Replicate()])
        return DTensor.from_local(summed.to_local(), self.mesh, target, run_check=False)

    def forward(self, inputs: dict, record: bool = False):
        """Run the graph on DTensor inputs; returns the output (replicated). `record`: keep per-op records."""
        from torch.distributed.tensor.debug import CommDebugMode

        values = dict(inputs)
        values.update(self.params)
        records = []
        for op in self.plan.graph.ops:
            p = self.plan.ops[op.name]
            args, ins = [], []
            for value, layout in zip(op.inputs, p.in_layouts):
                src = values[value]
                with CommDebugMode() as comm:
                    arg = _wait(src.redistribute(self.mesh, layout.placements()))
                args.append(arg)
                ins.append(InputRecord(value, _shape(src), _shape(arg), counted(comm)))
            out = op.prim(*args)
            if _kinds(out.placements) != _kinds(p.out_layout.placements()):
                # our reading of a strategy and DTensor's rule for the op disagree: a bug here, not a user error
                raise RuntimeError(
                    f"{op.name}: DTensor computed placements {out.placements}, the plan says "
                    f"{p.out_layout.placements()}"
                )
            rec = OpRecord(op.name, ins, _shape(out))
            if p.reduction_dims:
                with CommDebugMode() as comm:
                    out = _wait(self._reduce(out, p.out_layout))
                rec.reduction = counted(comm)
            values[op.name] = out
            records.append(rec)
        if record:
            self.records = records
        return values[self.plan.graph.output]


def loss_value(loss) -> float:
    """The replicated scalar as a Python float (on every rank the same)."""
    return float(loss.full_tensor().detach())


def make_mesh(mesh_shape, device: str = "cpu"):
    """A DeviceMesh of `mesh_shape` over ranks in row-major order (rank = MindSpore's device-matrix index)."""
    from torch.distributed.device_mesh import DeviceMesh

    n = 1
    for s in mesh_shape:
        n *= s
    names = tuple(f"m{i}" for i in range(len(mesh_shape)))
    return DeviceMesh(device, torch.arange(n).reshape(tuple(mesh_shape)), mesh_dim_names=names)
