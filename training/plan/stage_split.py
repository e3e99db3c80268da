"""Which blocks each pipeline stage holds: the split that minimises the slowest stage, by dynamic programming over
split points (what `--pipeline_func blocks:N0,N1,...` then expresses).

A 1F1B step takes (m + p - 1) × the slowest stage's time per micro-batch, so the best split is the min-max one. The
embeddings sit on stage 0 and the head on the last (model.placement); middle stages hold at least one block; the
first and the last may hold none. Stage k holding blocks i..j-1 costs the sum of its blocks, a once-per-stage extra
when it holds a decoder block (the encoder memory's gradient all-reduce), the embeddings or the head, and the
transfers on its two boundaries, which depend on the block before each cut (after the last decoder block only the
target side crosses). best[k][j], the lightest slowest-stage of blocks 0..j-1 on stages 0..k, is
min over i of max(best[k-1][i], cost_k(i, j)): O(p·n²), one numpy operation per stage. `feasible` can forbid
stages (memory); tests/test_layout_search.py checks the result against every split, by brute force.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SplitCosts:
    """Seconds per micro-batch of the parts a stage is made of."""

    block: np.ndarray  # (n,): each block's own cost (encoder blocks, then decoder blocks)
    encoders: int  # blocks 0..encoders-1 are encoder blocks
    decoder_extra: float  # once per stage holding a decoder block
    embeddings: float  # on stage 0
    head: float  # on the last stage
    send: np.ndarray  # (n + 1,): a boundary after block j - 1 (send[0]: after the embeddings)


def stage_cost(c: SplitCosts, k: int, stages: int, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Cost of stage k holding blocks i..j-1 (arrays broadcast against each other)."""
    pre = np.concatenate([[0.0], np.cumsum(c.block)])
    cost = pre[j] - pre[i] + c.decoder_extra * (np.maximum(i, c.encoders) < j)
    cost = cost + (c.embeddings if k == 0 else c.send[i])
    return cost + (c.head if k == stages - 1 else c.send[j])


def best_split(
    c: SplitCosts, stages: int, feasible: Callable[[int, np.ndarray, np.ndarray], np.ndarray] | None = None
) -> list[int] | None:
    """Blocks per stage of the min-max split (None when `feasible` leaves no split)."""
    n = len(c.block)
    i, j = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")  # [i, j]: stage holds i..j-1
    first = stage_cost(c, 0, stages, np.zeros(n + 1, dtype=int), np.arange(n + 1))
    if feasible:
        first = np.where(feasible(0, np.zeros(n + 1, dtype=int), np.arange(n + 1)), first, np.inf)
    best, cuts = first, []
    middle = np.where(i < j, stage_cost(c, 1, stages + 1, i, j), np.inf)  # the same for every middle stage
    for k in range(1, stages):
        if k == stages - 1:  # the last stage ends after block n: one column
            cost = stage_cost(c, k, stages, np.arange(n + 1), np.full(n + 1, n))[:, None]
            cost = np.where(np.arange(n + 1)[:, None] <= n, cost, np.inf)
            cols = [n]
        else:
            cost, cols = middle, list(range(n + 1))
        if feasible:
            ii, jj = (i, j) if k < stages - 1 else (np.arange(n + 1)[:, None], np.full((n + 1, 1), n))
            cost = np.where(feasible(k, ii, jj), cost, np.inf)
        total = np.maximum(best[:, None], cost)  # rows i, columns j
        arg = np.argmin(total, axis=0)
        cuts.append(dict(zip(cols, arg.tolist(), strict=True)))
        best = total[arg, np.arange(len(cols))]
    if not np.isfinite(best[-1]):
        return None
    counts, j_end = [], n
    for k in range(stages - 1, 0, -1):
        start = int(cuts[k - 1][j_end])
        counts.append(j_end - start)
        j_end = start
    counts.append(j_end)
    return counts[::-1]


def split_cost(c: SplitCosts, counts: list[int]) -> float:
    """The slowest stage of a split (what best_split minimises)."""
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return max(
        float(stage_cost(c, k, len(counts), np.array(bounds[k]), np.array(bounds[k + 1]))) for k in range(len(counts))
    )
