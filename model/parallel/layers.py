"""Tensor-parallel layers: column-parallel and row-parallel linear, vocab-parallel embedding.

Each is written as math on top of `model.parallel.mappings`. Weights are drawn at serial size from the block's generator
and
sliced, so shard r of any TP size equals rows/columns r of the serial weight (see `model.parallel.random`).

    ColumnParallelLinear  Y_r = X A_r (+ b_r)     A split by output features; input enters with copy_to_tp
    RowParallelLinear     Y = Σ_r X_r B_r (+ b)   B split by input features; partial sums leave with reduce_from_tp
    VocabParallelEmbedding  rows of the table split over TP ranks, out-of-shard ids masked, partials reduced —
                            or (vocab_emb_dp, the seed's default) the whole table on every rank, no communication.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.parallel.mappings import copy_to_tp, gather_from_tp, reduce_from_tp
from model.parallel.topology import ParallelContext


def _normal(shape, std: float, gen: torch.Generator | None) -> torch.Tensor:
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def mark_tensor_parallel(p: nn.Parameter, dim: int, full_size: int) -> nn.Parameter:
    """Tag a sharded parameter: DeepSpeed's grad-norm and our checkpoint resharding read these attributes.
    `full_size`: the serial length along `dim` (without vocab padding), so a checkpoint can drop the padding."""
    p.tensor_model_parallel = True
    p.partition_dim = dim
    p.full_size = full_size
    return p


class ColumnParallelLinear(nn.Module):
    """out_features split over TP ranks. `input_is_copied`: the caller already entered the TP region (one
    copy_to_tp shared by several projections of the same input, so backward all-reduces the input grad once)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ctx: ParallelContext,
        bias: bool = True,
        gather_output: bool = False,
        input_is_copied: bool = False,
        std: float = 0.02,
        gen: torch.Generator | None = None,
        padded_out: int | None = None,
    ):
        super().__init__()
        self.ctx, self.gather_output, self.input_is_copied = ctx, gather_output, input_is_copied
        total = padded_out or out_features
        assert total % ctx.tp_size == 0, f"out_features {total} not divisible by tp {ctx.tp_size}"
        self.out_per_rank = total // ctx.tp_size
        full = _normal((out_features, in_features), std, gen)
        if total > out_features:  # padded rows (vocab padding) are zero and masked out by the loss
            full = torch.cat([full, torch.zeros(total - out_features, in_features)], dim=0)
        lo = ctx.tp_rank * self.out_per_rank
        self.weight = mark_tensor_parallel(nn.Parameter(full[lo : lo + self.out_per_rank].clone()), 0, out_features)
        self.bias = (
            mark_tensor_parallel(nn.Parameter(torch.zeros(self.out_per_rank)), 0, out_features) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_copied:
            x = copy_to_tp(x, self.ctx.tp_group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tp(y, self.ctx.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """in_features split over TP ranks; the input is already this rank's shard (output of a column-parallel op)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ctx: ParallelContext,
        bias: bool = True,
        std: float = 0.02,
        gen: torch.Generator | None = None,
    ):
        super().__init__()
        self.ctx = ctx
        assert in_features % ctx.tp_size == 0, f"in_features {in_features} not divisible by tp {ctx.tp_size}"
        self.in_per_rank = in_features // ctx.tp_size
        full = _normal((out_features, in_features), std, gen)
        lo = ctx.tp_rank * self.in_per_rank
        self.weight = mark_tensor_parallel(nn.Parameter(full[:, lo : lo + self.in_per_rank].clone()), 1, in_features)
        # The bias is replicated and added once, after the reduction.
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x_shard: torch.Tensor) -> torch.Tensor:
        return self.add_bias(reduce_from_tp(self.partial(x_shard), self.ctx.tp_group))

    def partial(self, x_shard: torch.Tensor) -> torch.Tensor:
        """This rank's term of the sum (what the all-reduce adds up)."""
        return F.linear(x_shard, self.weight)

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Word embedding. split=False (vocab_emb_dp): replicated table, data-parallel lookup, no TP communication.
    split=True: rows [r·V/tp, (r+1)·V/tp) on rank r; ids outside the shard contribute zeros; one all-reduce."""

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        ctx: ParallelContext,
        split: bool,
        padded_num: int | None = None,
        std: float = 0.02,
        gen: torch.Generator | None = None,
    ):
        super().__init__()
        self.ctx, self.split = ctx, split and ctx.tp_size > 1
        self.init_generator = gen  # the block's generator, for the tables drawn after this one
        total = (padded_num or num_embeddings) if self.split else num_embeddings
        full = _normal((num_embeddings, dim), std, gen)
        if total > num_embeddings:
            full = torch.cat([full, torch.zeros(total - num_embeddings, dim)], dim=0)
        if self.split:
            assert total % ctx.tp_size == 0, f"vocab {total} not divisible by tp {ctx.tp_size}"
            per = total // ctx.tp_size
            self.start, self.end = ctx.tp_rank * per, (ctx.tp_rank + 1) * per
            self.weight = mark_tensor_parallel(nn.Parameter(full[self.start : self.end].clone()), 0, num_embeddings)
        else:
            self.start, self.end = 0, total
            self.weight = nn.Parameter(full)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.ctx.tp_group)
