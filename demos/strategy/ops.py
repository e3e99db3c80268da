"""Operators that take a MindSpore strategy: `MatMul().shard(((2, 4), (4, 1)))`, as `ops.MatMul().shard(...)`.

Each is a leaf module (torch.fx keeps it as one node, named like the seed's "instance name": matmul, relu, ...)
with an einsum-like signature: one letter per tensor dimension, shared letters split the same way, letters missing
from the output are contracted (summed, so split ones leave partial sums). `forward` is the plain torch op: the same
module runs serially on tensors and, under `demos.strategy.execute`, on DTensors laid out as the strategy says.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from demos.strategy.layout import Strategy, StrategyError

LETTERS = "abcdefgh"


class Primitive(nn.Module):
    """An operator with an optional MindSpore strategy (None: the propagation chooses one)."""

    def __init__(self):
        super().__init__()
        self.strategy: Strategy | None = None

    def shard(self, strategy) -> Primitive:
        """The seed's `Primitive.shard(in_strategy)`: a tuple per input of splits per dimension."""
        self.strategy = normalize_strategy(strategy, type(self).__name__)
        return self

    def signature(self, shapes: Sequence[tuple[int, ...]]) -> tuple[tuple[str, ...], str]:
        """(letters of each input, letters of the output) for inputs of these shapes."""
        raise NotImplementedError


def normalize_strategy(strategy, op: str) -> Strategy:
    """((2, 4), (4, 1)) as tuples of positive ints; lists are accepted, anything else is an error naming it."""
    try:
        out = tuple(tuple(int(s) for s in per_input) for per_input in strategy)
        ok = all(s >= 1 and s == v for per, raw in zip(out, strategy) for s, v in zip(per, raw))
    except (TypeError, ValueError):
        out, ok = (), False
    if not ok or not out:
        raise StrategyError(
            f"{op}.shard({strategy!r}): a strategy is one tuple per input of positive split counts "
            f"per dimension, e.g. ((2, 4), (4, 1)) for a MatMul"
        )
    return out


def shard(op: Primitive, strategy) -> Primitive:
    """`shard(op, ((2, 4), (4, 1)))` = `op.shard(((2, 4), (4, 1)))`."""
    return op.shard(strategy)


class MatMul(Primitive):
    """x[i, k] @ w[k, j] (the seed's ops.MatMul, no transposes)."""

    def signature(self, shapes):
        return ("ik", "kj"), "ij"

    def forward(self, x, w):
        return torch.matmul(x, w)


class _Elementwise(Primitive):
    def signature(self, shapes):
        first = shapes[0]
        if any(tuple(s) != tuple(first) for s in shapes[1:]):
            raise StrategyError(
                f"{type(self).__name__} needs inputs of one shape, got "
                f"{', '.join(str(tuple(s)) for s in shapes)} (broadcasting is not supported)"
            )
        letters = LETTERS[: len(first)]
        return tuple(letters for _ in shapes), letters


class ReLU(_Elementwise):
    def forward(self, x):
        return torch.relu(x)


class Sub(_Elementwise):
    def forward(self, x, y):
        return x - y


class Square(_Elementwise):
    def forward(self, x):
        return x * x


class ReduceMean(Primitive):
    """Mean over every dimension (the reduction of MindSpore's loss cells): split dims leave partial means."""

    def signature(self, shapes):
        return (LETTERS[: len(shapes[0])],), ""

    def forward(self, x):
        return x.mean()


class MSELoss(nn.Module):
    """MindSpore's MSELoss as its operators: ReduceMean(Square(Sub(logits, labels)))."""

    def __init__(self):
        super().__init__()
        self.sub, self.square, self.reduce_mean = Sub(), Square(), ReduceMean()

    def forward(self, logits, labels):
        return self.reduce_mean(self.square(self.sub(logits, labels)))
