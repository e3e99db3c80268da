"""Token-based global batches (`--max_tokens`, fairseq's batching): pairs of similar length, each batch padded only
to its own longest pair, as many pairs as fit a token budget.

    lengths      a pair's source and target lengths in tokens (with EOS), each rounded up to a multiple of
                 `pad_multiple` (a few distinct shapes: a pipeline's buffers and the kernels see few sizes)
    order        all pairs sorted by (target, source) padded length, ties broken by a permutation drawn from
                 `seed` — fixed for the whole run
    batches      the sorted pairs cut into groups of `batch_multiple`; consecutive groups join a batch while
                 pairs × max(padded source, padded target length) ≤ max_tokens; a last incomplete group is
                 dropped, like the fixed-size schedule's remainder
    epoch e      the same batches, in the order `np.random.default_rng([seed, e]).permutation(n_batches)`

Like `preprocess.dataset.GlobalBatchSchedule`, which pairs form step k's batch — and how long it is padded —
depends only on the data, max_tokens, batch_multiple, pad_multiple and seed, never on the parallel layout or
iterator state: every layout trains on the same batches and a resume is `global_batch(step)` again. Every batch
holds a multiple of `batch_multiple` pairs, so data_parallel × micro_batch_num (× interleave_num) must divide
batch_multiple (checked with the layout, `model.config.validate_layout`).
"""
from __future__ import annotations

import numpy as np

from common.errors import fail


def padded_length(real: np.ndarray, multiple: int, cap: int) -> np.ndarray:
    """Lengths rounded up to a multiple of `multiple`, at most `cap` (the dataset's fixed width)."""
    return np.minimum(-(-real // multiple) * multiple, cap)


class TokenBatchSchedule:
    def __init__(self, src_real: np.ndarray, tgt_real: np.ndarray, max_tokens: int, batch_multiple: int, seed: int,
                 src_len: int, tgt_len: int, pad_multiple: int = 8):
        """src_real / tgt_real: each pair's real (non-PAD) source and target length, as stored (with EOS)."""
        for name, value in (("max_tokens", max_tokens), ("batch_multiple", batch_multiple),
                            ("pad_multiple", pad_multiple)):
            if value < 1:
                fail(f"--{name} {value} must be >= 1")
        self.seed, self.max_tokens, self.batch_multiple = int(seed), int(max_tokens), int(batch_multiple)
        src_pad = padded_length(np.asarray(src_real, dtype=np.int64), pad_multiple, src_len)
        tgt_pad = padded_length(np.asarray(tgt_real, dtype=np.int64), pad_multiple, tgt_len)
        n = len(src_pad)
        tie = np.random.default_rng([self.seed, 2 ** 31]).permutation(n)
        order = np.lexsort((tie, src_pad, tgt_pad))                       # by target, then source length
        groups = n // batch_multiple
        if groups == 0:
            fail(f"--batch_multiple {batch_multiple} exceeds the {n} pairs of the dataset")
        widest = int(np.max(np.maximum(src_pad, tgt_pad)[order[:groups * batch_multiple]]))
        if batch_multiple * widest > max_tokens:
            fail(f"--max_tokens {max_tokens} cannot hold batch_multiple {batch_multiple} pairs of the longest padded "
                 f"length {widest} ({batch_multiple * widest} tokens): raise --max_tokens to at least "
                 f"{batch_multiple * widest} or lower --batch_multiple")
        self._batches: list[np.ndarray] = []
        self._shapes: list[tuple[int, int]] = []
        start = 0
        while start + batch_multiple <= groups * batch_multiple:
            end, s_max, t_max = start, 0, 0
            while end + batch_multiple <= groups * batch_multiple:
                group = order[end:end + batch_multiple]
                s_new, t_new = max(s_max, int(src_pad[group].max())), max(t_max, int(tgt_pad[group].max()))
                if end > start and (end + batch_multiple - start) * max(s_new, t_new) > max_tokens:
                    break
                end, s_max, t_max = end + batch_multiple, s_new, t_new
            self._batches.append(order[start:end].astype(np.int64))
            self._shapes.append((s_max, t_max))
            start = end
        self.batches_per_epoch = len(self._batches)
        self._epoch_order: tuple[int, np.ndarray] | None = None

    def epoch_of(self, step: int) -> int:
        if step < 0:
            fail(f"step {step} must be >= 0")
        return int(step) // self.batches_per_epoch

    def _batch_id(self, step: int) -> int:
        epoch = self.epoch_of(step)
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            self._epoch_order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.batches_per_epoch))
        return int(self._epoch_order[1][int(step) % self.batches_per_epoch])

    def global_batch(self, step: int) -> np.ndarray:
        """Sample indices (int64) of global batch `step`: a multiple of batch_multiple pairs of similar length."""
        return self._batches[self._batch_id(step)].copy()

    def shape(self, step: int) -> tuple[int, int]:
        """(source, target) length global batch `step` is padded to."""
        return self._shapes[self._batch_id(step)]

    def stats(self) -> dict:
        """Batch sizes and shapes of one epoch (every epoch has the same batches)."""
        sizes = np.array([len(b) for b in self._batches])
        return {"batches": self.batches_per_epoch, "pairs": int(sizes.sum()), "min_pairs": int(sizes.min()),
                "max_pairs": int(sizes.max()), "shapes": sorted(set(self._shapes))}
