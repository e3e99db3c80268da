"""The seed's quickstart network (MindSpore tutorial "分布式并行训练快速入门", net.py): MatMul → ReLU → MatMul with a
strategy on the first MatMul only, trained with MSELoss; the other strategies come from propagation."""

from __future__ import annotations

import torch
from torch import nn

from demos.strategy.ops import MatMul, MSELoss, ReLU

SEED_STRATEGY = ((2, 4), (4, 1))  # x split 2 ways on rows and 4 on columns, the weight 4 ways on rows


class Net(nn.Module):
    """The seed's Net(in_dim, hidden_dim, out_dim); weights drawn from N(0, 0.01) (MindSpore's "normal")."""

    def __init__(
        self,
        in_dim: int = 32,
        hidden_dim: int = 16,
        out_dim: int = 16,
        strategy: tuple | None = SEED_STRATEGY,
        seed: int = 0,
    ):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(in_dim, hidden_dim, generator=gen) * 0.01)  # "w"
        self.weight2 = nn.Parameter(torch.randn(hidden_dim, out_dim, generator=gen) * 0.01)  # "w2"
        self.matmul = MatMul()
        if strategy is not None:
            self.matmul.shard(strategy)
        self.relu = ReLU()
        self.matmul2 = MatMul()

    def forward(self, x):
        out = self.matmul(x, self.weight)
        out = self.relu(out)
        return self.matmul2(out, self.weight2)


class WithLossCell(nn.Module):
    """MindSpore's WithLossCell: the network and its loss as one graph (what the strategies are planned over)."""

    def __init__(self, backbone: nn.Module, loss_fn: nn.Module):
        super().__init__()
        self._backbone, self._loss_fn = backbone, loss_fn

    def forward(self, data, label):
        return self._loss_fn(self._backbone(data), label)


def network_with_loss(**kw) -> WithLossCell:
    return WithLossCell(Net(**kw), MSELoss())
