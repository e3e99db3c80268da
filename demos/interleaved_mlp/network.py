"""The seed's MicroBatchInterleaved example network — Dense(784, 512) ReLU Dense(512, 512) ReLU Dense(512, 10) —
tensor-parallel, with the same `interleave_num` as the Transformer blocks.

    fc1  ColumnParallelLinear 784 → 512/tp     the input enters the TP region (data: no gradient, no all-reduce)
    fc2  RowParallelLinear    512/tp → 512     forward all-reduce of the partial sums
    fc3  ColumnParallelLinear 512 → 10/tp      logits split by class; backward all-reduce of its input gradient
    loss vocab-parallel cross-entropy over the 10 classes (model.parallel.cross_entropy; padded classes when tp ∤ 10)

Weights are the seed's `weight_init="normal"` (MindSpore's Normal: σ = 0.01) and zero biases, drawn at serial size
and sliced, so every tp and interleave_num starts from the same network. With interleave_num N the batch runs as N
parts on `model.interleave`'s staggered schedule: fc2's all-reduce and fc3's input-gradient all-reduce of one part
overlap the other part's matrix products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ConfigError
from model.interleave import run_staggered, tp_region
from model.parallel.cross_entropy import vocab_parallel_cross_entropy
from model.parallel.layers import ColumnParallelLinear, RowParallelLinear
from model.parallel.mappings import GradAllReduce, await_tp_grad, copy_to_tp, copy_to_tp_async
from model.parallel.random import block_generator
from model.parallel.topology import ParallelContext

SIZES = (784, 512, 512, 10)
INIT_STD = 0.01
NO_LABEL = -100  # the loss's ignore index: every digit label (0..9) counts


class MLPClassifier(nn.Module):
    def __init__(self, ctx: ParallelContext, sizes=SIZES, interleave_num: int = 1, seed: int = 0):
        super().__init__()
        d_in, h1, h2, classes = sizes
        if h1 % ctx.tp_size:
            raise ConfigError(f"hidden size {h1} is not divisible by model_parallel={ctx.tp_size}")
        self.ctx, self.classes, self.interleave_num = ctx, classes, interleave_num
        padded = -(-classes // ctx.tp_size) * ctx.tp_size
        gen = block_generator(seed, "mlp")
        self.fc1 = ColumnParallelLinear(d_in, h1, ctx, input_is_copied=True, std=INIT_STD, gen=gen)
        self.fc2 = RowParallelLinear(h1, h2, ctx, std=INIT_STD, gen=gen)
        self.fc3 = ColumnParallelLinear(
            h2, classes, ctx, input_is_copied=True, std=INIT_STD, gen=gen, padded_out=padded
        )
        self.class_start = ctx.tp_rank * (padded // ctx.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's logits shard [B, classes/tp] of flattened images [B, 784]."""
        n = self.interleave_num
        if n > 1 and x.shape[0] % n == 0:
            return torch.cat(run_staggered([self._part(p) for p in x.chunk(n)]))
        g = self.ctx.tp_group
        h = F.relu(self.fc2(self._hidden(copy_to_tp(x, g))))
        return self.fc3(copy_to_tp(h, g))

    def _hidden(self, x_tp):
        return F.relu(self.fc1(x_tp))

    def _part(self, x):
        g = self.ctx.tp_group
        h = F.relu((yield from tp_region(x, self._hidden, self.fc2, g)))
        link = GradAllReduce()
        h = await_tp_grad(h, link)
        yield
        return self.fc3(copy_to_tp_async(h, g, link))

    def loss(self, logits_shard: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the batch (the seed's CrossEntropyLoss), identical on every TP rank."""
        per_sample = vocab_parallel_cross_entropy(
            logits_shard, labels, self.class_start, self.classes, NO_LABEL, group=self.ctx.tp_group
        )
        return per_sample.mean()
