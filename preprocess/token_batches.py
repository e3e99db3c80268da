"""Token-based global batches (`--max_tokens`, fairseq's batching): pairs of similar length, each batch padded only
to its own longest pair, as many pairs as fit a token budget.

    lengths      a pair's source and target lengths in tokens (with EOS), each rounded up to a multiple of
                 `pad_multiple`; with `num_buckets` N > 0 then up to one of at most N lengths per side, those that
                 add the fewest PAD positions (`length_buckets`; fairseq's --num-batch-buckets): batches come in
                 fewer shapes, so pipeline stages exchange fewer tensor sizes and the kernels see fewer sizes
    order        all pairs sorted by (target, source) padded length, ties broken by a permutation drawn from
                 `seed` — fixed for the whole run
    batches      the sorted pairs cut into groups of `batch_multiple`; consecutive groups join a batch while
                 pairs × max(padded source, padded target length) ≤ max_tokens; a last incomplete group is
                 dropped, like the fixed-size schedule's remainder
    epoch e      the same batches, in the order `np.random.default_rng([seed, e]).permutation(n_batches)`

Like `preprocess.dataset.GlobalBatchSchedule`, which pairs form step k's batch — and how long it is padded —
depends only on the data, max_tokens, batch_multiple, pad_multiple, num_buckets and seed, never on the parallel
layout or iterator state: every layout trains on the same batches and a resume is `global_batch(step)` again.
Every batch holds a multiple of `batch_multiple` pairs, so data_parallel × micro_batch_num (× interleave_num) must
divide batch_multiple (checked with the layout, `model.config.validate_layout`).
"""

from __future__ import annotations

import numpy as np

from common.errors import fail


def compact_permutation(seed, n: int) -> np.ndarray:
    """`np.random.default_rng(seed).permutation(n)` — the same numbers, from the same shuffle — in int32 where n
    allows: half the memory of int64 for a corpus of millions of pairs."""
    order = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
    np.random.default_rng(seed).shuffle(order)
    return order


def padded_length(real: np.ndarray, multiple: int, cap: int) -> np.ndarray:
    """Lengths rounded up to a multiple of `multiple`, at most `cap` (the dataset's fixed width)."""
    return np.minimum(-(-real // multiple) * multiple, cap)


def length_buckets(padded: np.ndarray, n: int) -> np.ndarray:
    """The at most N lengths a side's padded lengths snap to, chosen to add the fewest PAD positions: the distinct
    lengths, in order, cut into N runs, each padded to its longest (the longest pair's length is always one). An
    exact dynamic program over the distinct lengths (a few dozen to a few hundred), not over the pairs."""
    counts = np.bincount(padded)
    values = np.flatnonzero(counts)
    if len(values) <= n:
        return values
    c = counts[values].astype(np.float64)
    cum_c = np.concatenate([[0.0], np.cumsum(c)])
    cum_cv = np.concatenate([[0.0], np.cumsum(c * values)])
    v = len(values)

    def cost(j: int) -> np.ndarray:
        """PAD positions added when lengths i..j (i = 0..j) all pad to values[j]: one column, O(v) memory."""
        return values[j] * (cum_c[j + 1] - cum_c[: j + 1]) - (cum_cv[j + 1] - cum_cv[: j + 1])

    best = np.array([cost(j)[0] for j in range(v)])  # best[j]: lengths 0..j in one run
    cut = [np.zeros(v, dtype=np.int64)]  # cut[k][j]: where the last of k+1 runs covering 0..j starts
    for _ in range(1, n):
        # a last run i..j after the best k runs over 0..i-1 (i = 0: one run only)
        before = np.concatenate([[0.0], best[:-1]])
        start, new = np.zeros(v, dtype=np.int64), np.empty(v)
        for j in range(v):
            total = before[: j + 1] + cost(j)
            total[0] = cost(j)[0]
            start[j] = int(np.argmin(total))
            new[j] = total[start[j]]
        best = new
        cut.append(start)
    ends, j = [], v - 1
    for k in range(n - 1, -1, -1):
        if j < 0:
            break
        ends.append(values[j])
        j = cut[k][j] - 1
    return np.unique(ends)


def snap(padded: np.ndarray, buckets: np.ndarray) -> np.ndarray:
    """Each length up to the smallest bucket that holds it."""
    return buckets[np.searchsorted(buckets, padded)].astype(padded.dtype)


def _sort_order(src_pad: np.ndarray, tgt_pad: np.ndarray, tie: np.ndarray) -> np.ndarray:
    """`np.lexsort((tie, src_pad, tgt_pad))`: by padded target, then source length, then tie — computed as the pairs
    in tie order, stably sorted by their (target, source) bucket. The buckets are few small integers, which numpy
    sorts by radix in linear time: 10 M pairs in well under a second instead of lexsort's ~10 s. Indices in the
    dtype of `tie` (int32 below 2**31 pairs)."""
    n = len(tie)
    by_tie = np.empty(n, dtype=tie.dtype)
    by_tie[tie] = np.arange(n, dtype=tie.dtype)  # by_tie[k]: the pair whose tie value is k
    s_span = int(src_pad.max()) + 1
    bucket = tgt_pad[by_tie].astype(np.int64 if (int(tgt_pad.max()) + 1) * s_span >= 2**31 else np.int32)
    bucket *= s_span
    bucket += src_pad[by_tie]
    if n and bucket.max() < 2**16:
        bucket = bucket.astype(np.uint16)  # radix sort
    return by_tie[np.argsort(bucket, kind="stable")]


def _pack(group_src: list, group_tgt: list, multiple: int, max_tokens: int) -> list:
    """Greedy packing of consecutive groups: a batch takes the next group while its pairs × max(padded source,
    padded target length) stay within max_tokens (always at least one group). Returns the first group of each batch,
    and the end. A loop over plain ints: 10 M pairs in 16s are 625,000 groups, well under a second."""
    starts, s_max, t_max, count = [0], 0, 0, 0
    for g, (s, t) in enumerate(zip(group_src, group_tgt)):
        s_new, t_new = max(s_max, s), max(t_max, t)
        if count and (count + 1) * multiple * max(s_new, t_new) > max_tokens:
            starts.append(g)
            s_new, t_new, count = s, t, 0
        s_max, t_max, count = s_new, t_new, count + 1
    starts.append(len(group_src))
    return starts


class TokenBatchSchedule:
    def __init__(
        self,
        src_real: np.ndarray,
        tgt_real: np.ndarray,
        max_tokens: int,
        batch_multiple: int,
        seed: int,
        src_len: int,
        tgt_len: int,
        pad_multiple: int = 8,
        num_buckets: int = 0,
    ):
        """src_real / tgt_real: each pair's real (non-PAD) source and target length, as stored (with EOS)."""
        for name, value in (
            ("max_tokens", max_tokens),
            ("batch_multiple", batch_multiple),
            ("pad_multiple", pad_multiple),
        ):
            if value < 1:
                fail(f"--{name} {value} must be >= 1")
        if num_buckets < 0:
            fail(f"--num_batch_buckets {num_buckets} must be >= 0 (0: no buckets)")
        self.seed, self.max_tokens, self.batch_multiple = int(seed), int(max_tokens), int(batch_multiple)
        # small integer types throughout: for 10 M pairs every byte per pair is 10 MB of each rank's memory
        src_pad = padded_length(np.asarray(src_real, dtype=np.int32), pad_multiple, src_len)
        tgt_pad = padded_length(np.asarray(tgt_real, dtype=np.int32), pad_multiple, tgt_len)
        if max(src_len, tgt_len) < 2**16:
            src_pad, tgt_pad = src_pad.astype(np.uint16), tgt_pad.astype(np.uint16)
        n = len(src_pad)
        if num_buckets and n:
            self.buckets = (length_buckets(src_pad, num_buckets), length_buckets(tgt_pad, num_buckets))
            src_pad, tgt_pad = snap(src_pad, self.buckets[0]), snap(tgt_pad, self.buckets[1])
        else:
            self.buckets = None
        groups = n // batch_multiple
        if groups == 0:
            fail(f"--batch_multiple {batch_multiple} exceeds the {n} pairs of the dataset")
        tie = compact_permutation([self.seed, 2**31], n)
        order = _sort_order(src_pad, tgt_pad, tie)[: groups * batch_multiple]
        del tie
        # each group's longest padded source and target (groups are consecutive pairs of the sorted order)
        group_src = src_pad[order].reshape(groups, batch_multiple).max(axis=1).astype(np.int64)
        group_tgt = tgt_pad[order].reshape(groups, batch_multiple).max(axis=1).astype(np.int64)
        widest = int(np.max(np.maximum(group_src, group_tgt)))
        if batch_multiple * widest > max_tokens:
            fail(
                f"--max_tokens {max_tokens} cannot hold batch_multiple {batch_multiple} pairs of the longest padded "
                f"length {widest} ({batch_multiple * widest} tokens): raise --max_tokens to at least "
                f"{batch_multiple * widest} or lower --batch_multiple"
            )
        starts = np.asarray(_pack(group_src.tolist(), group_tgt.tolist(), batch_multiple, max_tokens), dtype=np.int64)
        # batch b is order[self._starts[b]:self._starts[b + 1]], padded to self._shapes[b]
        self._order = order
        self._starts = starts * batch_multiple
        self._shapes = np.stack(
            [np.maximum.reduceat(group_src, starts[:-1]), np.maximum.reduceat(group_tgt, starts[:-1])], axis=1
        ).astype(np.int32)
        self.batches_per_epoch = len(starts) - 1
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
        b = self._batch_id(step)
        return self._order[self._starts[b] : self._starts[b + 1]].astype(np.int64)

    def shape(self, step: int) -> tuple[int, int]:
        """(source, target) length global batch `step` is padded to."""
        s, t = self._shapes[self._batch_id(step)]
        return int(s), int(t)

    def stats(self) -> dict:
        """Batch sizes and shapes of one epoch (every epoch has the same batches)."""
        sizes = np.diff(self._starts)
        return {
            "batches": self.batches_per_epoch,
            "pairs": int(sizes.sum()),
            "min_pairs": int(sizes.min()),
            "max_pairs": int(sizes.max()),
            "shapes": sorted({(int(s), int(t)) for s, t in self._shapes.tolist()}),
        }
