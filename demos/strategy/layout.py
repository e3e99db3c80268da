"""MindSpore strategy tuples ↔ DTensor placements on a device mesh.

A MindSpore strategy gives, for each input of an operator, how many ways each tensor dimension is split:
`MatMul().shard(((2, 4), (4, 1)))` splits x[i, k] 2 ways along i and 4 along k, and w[k, j] 4 ways along k. The
operator's device matrix is the list of its dimension splits, [i=2, k=4, j=1], laid out row-major over the ranks.
On a DeviceMesh whose dimensions are that device matrix — (2, 4) here — every split maps to mesh dimensions:

    i split 2 → mesh dim 0        x: [Shard(0), Shard(1)]        rank (a, b) holds x[8a:8a+8, 8b:8b+8]
    k split 4 → mesh dim 1        w: [Replicate(), Shard(0)]     w[8b:8b+8, :] on every a
    j split 1 → no mesh dim       out[i, j]: [Shard(0), Partial()]

A dimension that is contracted (k: in the inputs, not in the output) leaves every rank of a mesh-dim-1 group with a
partial sum: `Partial()` on that mesh dim. MindSpore resolves it inside the operator with an AllReduce over those
ranks (the seed's IR: AllReduce over ranks (0, 1, 2, 3), then a StridedSlice to the next operator's layout); so do
we (`demos.strategy.execute`). A split may use several mesh dimensions (8 = 2 × 4: Shard on both, mesh dim 0 the
major one, DTensor's order); a strategy whose splits use fewer devices than the mesh leaves the remaining mesh
dimensions replicated (MindSpore's "repeated calculation"). Splits that cannot be made of distinct mesh dimensions
(2 × 2 on a (2, 4) mesh) are refused: DTensor places a tensor dimension on whole mesh dimensions.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from common.errors import UserError

Strategy = tuple[tuple[int, ...], ...]


class StrategyError(UserError):
    """A strategy that cannot run: the message names the op, the strategy and the shapes."""


@dataclass(frozen=True)
class Layout:
    """How a tensor of global `shape` lies on a mesh of `mesh` sizes: `dims[d]` are the mesh dims that split tensor
    dim d (major first), `partial` the mesh dims over whose ranks the values are partial sums."""

    shape: tuple[int, ...]
    mesh: tuple[int, ...]
    dims: tuple[tuple[int, ...], ...]
    partial: tuple[int, ...] = ()

    @property
    def splits(self) -> tuple[int, ...]:
        """The MindSpore strategy of this tensor: ways each dimension is split."""
        return tuple(math.prod(self.mesh[m] for m in ms) for ms in self.dims)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(n // s for n, s in zip(self.shape, self.splits))

    def placements(self) -> list:
        """DTensor placements, one per mesh dimension."""
        from torch.distributed.tensor import Partial, Replicate, Shard

        out = []
        for m in range(len(self.mesh)):
            owner = [d for d, ms in enumerate(self.dims) if m in ms]
            out.append(Shard(owner[0]) if owner else Partial() if m in self.partial else Replicate())
        return out

    def reduced(self) -> Layout:
        """The layout after the partial sums are all-reduced (replicated on those mesh dims)."""
        return Layout(self.shape, self.mesh, self.dims)

    def block(self, coord: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """[start, stop) per dimension of the block the rank at mesh coordinate `coord` holds."""
        out = []
        for n, ms in zip(self.shape, self.dims):
            index, count = 0, 1
            for m in ms:  # mixed radix, the first mesh dim the most significant
                index, count = index * self.mesh[m] + coord[m], count * self.mesh[m]
            size = n // count
            out.append((index * size, (index + 1) * size))
        return tuple(out)

    def describe(self) -> str:
        names = []
        for p in self.placements():
            kind = type(p).__name__
            names.append(f"S({p.dim})" if kind == "Shard" else "P" if kind == "Partial" else "R")
        return "(" + ", ".join(names) + ")"


def mesh_coords(mesh: Sequence[int]) -> list[tuple[int, ...]]:
    """Mesh coordinate of every rank, rank = row-major index (rank 0 first)."""
    return list(itertools.product(*(range(n) for n in mesh)))


def group_ranks(mesh: Sequence[int], coord: Sequence[int], mesh_dims: Sequence[int]) -> list[int]:
    """The ranks that share `coord` on every mesh dim but `mesh_dims` (a collective's group)."""
    out = []
    for c in mesh_coords(mesh):
        if all(c[m] == coord[m] for m in range(len(mesh)) if m not in mesh_dims):
            out.append(rank_of(mesh, c))
    return out


def rank_of(mesh: Sequence[int], coord: Sequence[int]) -> int:
    r = 0
    for n, c in zip(mesh, coord):
        r = r * n + c
    return r


def _subsets_with_product(mesh: Sequence[int], free: Sequence[int], target: int) -> list[tuple[int, ...]]:
    """Sets of the free mesh dims (in increasing order) whose sizes multiply to `target`, smallest dims first."""
    out = []
    for k in range(0, len(free) + 1):
        for combo in itertools.combinations(free, k):
            if math.prod(mesh[m] for m in combo) == target:
                out.append(combo)
    return out


def assign_mesh_dims(mesh: Sequence[int], splits: dict[str, int]) -> dict[str, tuple[int, ...]] | None:
    """Mesh dims for every labelled split (labels in the order of the operator's device matrix), using each mesh
    dim at most once; the first assignment in that order, so a device matrix equal to the mesh maps one to one.
    None when the splits cannot be laid out on the mesh."""
    labels = list(splits)

    def search(i: int, free: tuple[int, ...]):
        if i == len(labels):
            return {}
        for combo in _subsets_with_product(mesh, free, splits[labels[i]]):
            rest = search(i + 1, tuple(m for m in free if m not in combo))
            if rest is not None:
                return {labels[i]: combo, **rest}
        return None

    return search(0, tuple(range(len(mesh))))


def format_strategy(strategy: Strategy | None) -> str:
    if strategy is None:
        return "None"
    return (
        "("
        + ", ".join("(" + ", ".join(map(str, s)) + ("," if len(s) == 1 else "") + ")" for s in strategy)
        + ("," if len(strategy) == 1 else "")
        + ")"
    )
