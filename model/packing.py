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

Computed once per micro-batch. Finding the non-PAD positions is a `nonzero()`, whose output size the host must read
(on a GPU a synchronisation that stalls the queue of kernels), so a packing is built once per ids tensor and kept on
it (`of`), and the `interleave_num` batch parts of an ids tensor are cut once and keep theirs (`parts`): every layer
of a stage gets the same ids tensor (blocks hand it on unchanged, and recompute, `model.parallel.random.checkpoint`,
passes it through as it is), so a stage builds one packing per side (source, target) and part per micro-batch,
whatever its number of layers and whether they are recomputed. The whole batch's packing of an ids tensor whose parts
are packed is joined from theirs, without another `nonzero()`.

Training batches skip even that: the ids are host arrays before they are copied to the device, so the batch builds
each side's packing there (`from_host`: numpy on the host, the index copied with the ids) and keeps it on the
device ids tensor (`keep_on`), with the tokens per row; `parts` then cuts the parts' packings out of it by host-known
bounds. DeepSpeed's pipeline engine hands each stage copies of the ids (cloned, or received from the stage before),
so a pipeline stage keeps the step's packings in micro-batch order and puts each on the ids its forward receives
(model.pipeline). A step then reads nothing back from the device to pack (tests/test_sync_count.py).
"""

from __future__ import annotations

import numpy as np
import torch


class Packing:
    row_tokens = None  # real tokens per row, a host array, when the packing was built on the host

    def __init__(self, ids: torch.Tensor, pad_id: int):
        self.batch, self.length = ids.shape
        self.index = (ids != pad_id).reshape(-1).nonzero().squeeze(1)
        self.tokens = int(self.index.numel())

    @classmethod
    def from_host(cls, host_ids: np.ndarray, pad_id: int, copy) -> Packing:
        """The packing of ids whose host copy is `host_ids`: the same index `nonzero()` finds, computed by numpy
        and moved with `copy` (the batch's host→device copy), so nothing is read back from the device."""
        real = host_ids != pad_id
        pack = cls.__new__(cls)
        pack.batch, pack.length = real.shape
        pack.index = copy(torch.from_numpy(np.flatnonzero(real)))
        pack.row_tokens = real.sum(axis=1)
        pack.tokens = int(pack.row_tokens.sum())
        return pack

    def keep_on(self, ids: torch.Tensor, pad_id: int) -> Packing:
        """Keep this packing on `ids` (the device tensor of the ids it packs), where `of` and `parts` find it."""
        _store(ids)[(pad_id, 1)] = (ids._version, self)
        return self

    def split(self, n: int) -> list[Packing]:
        """The packings of the n equal row blocks of a host-built packing: slices of its index at host-known
        bounds, shifted to each block's first flat position — what `nonzero()` over each block gives."""
        rows = self.batch // n
        bounds = np.concatenate([[0], np.cumsum(self.row_tokens)])[::rows]
        parts = []
        for i in range(n):
            part = Packing.__new__(Packing)
            part.batch, part.length = rows, self.length
            part.row_tokens = self.row_tokens[i * rows : (i + 1) * rows]
            start, end = int(bounds[i]), int(bounds[i + 1])
            part.index = self.index[start:end] - i * rows * self.length
            part.tokens = end - start
            parts.append(part)
        return parts

    @classmethod
    def joined(cls, parts: list[Packing]) -> Packing:
        """The packing of the batch whose consecutive row blocks `parts` pack: their indices shifted by each part's
        first flat position, concatenated — what `nonzero()` over the whole batch gives, without it."""
        whole = cls.__new__(cls)
        whole.length = parts[0].length
        whole.batch = sum(p.batch for p in parts)
        offsets, start = [], 0
        for p in parts:
            offsets.append(p.index + start)
            start += p.batch * p.length
        whole.index = torch.cat(offsets)
        whole.tokens = sum(p.tokens for p in parts)
        return whole

    @classmethod
    def of(cls, ids: torch.Tensor, pad_id: int) -> Packing:
        """The packing of `ids`, built once per ids tensor and kept on it (an integer tensor, never part of
        autograd), valid while the tensor is not written in place (its version counter). Inference-mode tensors
        have no version counter, so their packing is not kept (decoding builds it per call; it is one nonzero over
        the ids)."""
        if ids.is_inference():
            return cls(ids, pad_id)
        kept = _kept(ids, pad_id, 1)
        if kept is None:  # the parts' packings, if the interleaved layers built them, joined
            parts = next(
                filter(None, (_kept(ids, pad_id, n) for pad, n in list(_store(ids)) if pad == pad_id and n > 1)), None
            )
            kept = cls.joined(parts) if parts is not None else cls(ids, pad_id)
            _store(ids)[(pad_id, 1)] = (ids._version, kept)
        return kept

    @classmethod
    def parts(cls, ids: torch.Tensor, pad_id: int, n: int) -> list[Packing]:
        """The packings of `ids.chunk(n)` (`model.interleave`'s batch parts, n > 1), built once per ids tensor and n
        and kept on it like `of`'s."""
        if ids.is_inference():
            return [cls(part, pad_id) for part in ids.chunk(n)]
        kept = _kept(ids, pad_id, n)
        if kept is None:
            whole = _kept(ids, pad_id, 1)
            if whole is not None and whole.row_tokens is not None and whole.batch % n == 0:
                kept = whole.split(n)  # host-built (`from_host`): no nonzero
            else:
                kept = [cls(part, pad_id) for part in ids.chunk(n)]
            _store(ids)[(pad_id, n)] = (ids._version, kept)
        return kept

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] → [N, ...]: the non-PAD positions, in (batch, position) order."""
        return x.reshape(self.batch * self.length, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, ...] → [B, S, ...] with zeros at the PAD positions (finite values there: attention multiplies the
        masked keys' values by 0). The rows are written into the fresh zeros in place: one buffer, no copy of it."""
        out = rows.new_zeros((self.batch * self.length, *rows.shape[1:]))
        return out.index_copy_(0, self.index, rows).view(self.batch, self.length, *rows.shape[1:])

    def scatter(self, base: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`base` [B, S, ...] with its non-PAD positions replaced by `rows` [N, ...] (PAD positions keep base's)."""
        flat = base.reshape(self.batch * self.length, *base.shape[2:])
        return flat.index_copy(0, self.index, rows).view_as(base)


def _store(ids: torch.Tensor) -> dict:
    """What is kept on an ids tensor: {(pad_id, n): (ids._version when built, the packing (n 1) or the packings of
    its n parts)}."""
    store = getattr(ids, "_packings", None)
    if store is None:
        store = ids._packings = {}
    return store


def _kept(ids: torch.Tensor, pad_id: int, n: int):
    entry = _store(ids).get((pad_id, n))
    return entry[1] if entry is not None and entry[0] == ids._version else None
