"""How a full (serial) tensor maps to TP shards and back — the one place that knows the slicing rule.

A parameter tagged by `model.parallel.layers.mark_tensor_parallel` is split along `partition_dim` into tp equal pieces,
the
full size padded up to a multiple of tp with zero rows (vocab padding). Untagged parameters are replicated.
Tests compare TP gradients with the serial model through `take_shard`; checkpoints reshard through both functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def partition_dim(param) -> int | None:
    return getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None


def take_shard(full: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int, shard_len: int) -> torch.Tensor:
    """Rank `tp_rank`'s piece of `full` along `dim`, `shard_len` long, zero-padded past the end of `full`."""
    if dim is None or tp_size == 1 and full.shape[dim] == shard_len:
        return full
    lo = tp_rank * shard_len
    avail = max(0, min(shard_len, full.shape[dim] - lo))
    piece = full.narrow(dim, lo, avail) if avail else full.narrow(dim, 0, 0)
    if avail < shard_len:
        pad_shape = list(full.shape)
        pad_shape[dim] = shard_len - avail
        piece = torch.cat([piece, full.new_zeros(pad_shape)], dim=dim)
    return piece


def merge_shards(shards: Sequence[torch.Tensor], dim: int | None, full_len: int | None = None) -> torch.Tensor:
    """Concatenate TP shards along `dim` and drop padding beyond `full_len` (replicated: the first shard)."""
    if dim is None:
        return shards[0]
    full = torch.cat(list(shards), dim=dim)
    if full_len is not None and full.shape[dim] > full_len:
        full = full.narrow(dim, 0, full_len)
    return full


def shard_rows(full_len: int, tp_rank: int, shard_len: int) -> tuple[int, int, int]:
    """take_shard's rule as row numbers: TP rank `tp_rank`'s piece is rows [lo, hi) of the full tensor along the
    partition dim followed by `pad` zero rows. Returns (lo, hi, pad)."""
    lo = tp_rank * shard_len
    hi = max(lo, min(lo + shard_len, full_len))
    return lo, hi, shard_len - (hi - lo)


def saved_pieces(lo: int, hi: int, saved_len: int, saved_tp: int) -> list[tuple[int, int, int]]:
    """Rows [lo, hi) of a full tensor saved as `saved_tp` shards of `saved_len` rows (merge_shards' layout), as
    [(saved TP rank, start, stop within that shard), ...] in order: what to read instead of merging every shard."""
    pieces = []
    for t in range(saved_tp):
        a, b = max(lo, t * saved_len), min(hi, (t + 1) * saved_len)
        if a < b:
            pieces.append((t, a - t * saved_len, b - t * saved_len))
    return pieces
