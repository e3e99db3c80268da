"""Compute on real tokens only: the non-PAD positions of a padded batch, packed into one row per token.

Every operation of a Transformer layer but attention is position-wise — LayerNorm, the QKV / Q / KV / output
projections, the MLP, dropout, the output projection and the loss — so its result at a non-PAD position does not
depend on what the PAD positions hold, and PAD positions are never read by the loss. `Packing(ids, pad_id)` holds the
flat indices of the non-PAD positions; a block runs its position-wise work on `pack(x)` ([N, ...] with N the real
tokens of the batch) and only attention sees the padded layout (`unpack`: zeros at PAD, which the key-padding mask
hides). On Multi30k padded to 32 tokens about half the positions are PAD, so this halves the matrix products.

Blocks still take and return padded [B, S, d] tensors (`scatter` writes the packed rows back), so pipeline stages
exchange fixed shapes and recompute / interleaving see the same tuples. The packing is a function of the token ids
only, so every tensor-parallel rank packs alike and every layout computes the same tokens.
"""
from __future__ import annotations

import torch


class Packing:
    def __init__(self, ids: torch.Tensor, pad_id: int):
        self.batch, self.length = ids.shape
        self.index = (ids != pad_id).reshape(-1).nonzero().squeeze(1)
        self.tokens = int(self.index.numel())

    @classmethod
    def of(cls, ids: torch.Tensor, pad_id: int) -> "Packing":
        """The packing of `ids`, built once per ids tensor: the blocks of a stage all get the same ids tensor, and
        the index is kept on it (an integer tensor, never part of autograd), valid while the tensor is not written
        in place (its version counter). Inference-mode tensors have no version counter, so their packing is not
        kept (decoding builds it per call; it is one nonzero over the ids)."""
        if ids.is_inference():
            return cls(ids, pad_id)
        cached = getattr(ids, "_packing", None)
        if cached is None or cached[:2] != (pad_id, ids._version):
            cached = (pad_id, ids._version, cls(ids, pad_id))
            ids._packing = cached
        return cached[2]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] → [N, ...]: the non-PAD positions, in (batch, position) order."""
        return x.reshape(self.batch * self.length, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, ...] → [B, S, ...] with zeros at the PAD positions."""
        out = rows.new_zeros((self.batch * self.length, *rows.shape[1:]))
        return out.index_copy(0, self.index, rows).view(self.batch, self.length, *rows.shape[1:])

    def scatter(self, base: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`base` [B, S, ...] with its non-PAD positions replaced by `rows` [N, ...] (PAD positions keep base's)."""
        flat = base.reshape(self.batch * self.length, *base.shape[2:])
        return flat.index_copy(0, self.index, rows).view_as(base)
