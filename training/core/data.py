"""From --file_path/--tokenizer to the micro-batches one rank feeds its engine.

The TSV's sha256 names the token store: rank 0 takes it (hashed once per change of the file) and broadcasts it
(training.core.tsv_identity). Tokenizer training and tokenization then run once per node (local rank 0; once per
cache folder shared by several nodes: preprocess.build_lock) while the other ranks wait — on the job's store, not in
a collective bounded by --comm_timeout (training.core.data_wait) — and every rank maps the store read-only, so a
node's ranks share its pages (preprocess.token_store). Local rank 0 also verifies the store's checksums (rebuilding
a damaged one) before the others open it; they make only the structural checks. `cache_dir` (--cache_dir) is where
the store
and an auto-built tokenizer go when the data folder is read-only or shared. Which samples make global batch `step`
is `GlobalBatchSchedule.global_batch(step)`, layout-free; a rank takes its data-parallel slice and cuts it into
micro-batches, padded only then. Each step also carries the global batch's non-PAD target-token count, which the
training objective divides by (`training.core.objective`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from common.errors import UserError
from common.ranks import local_rank_from_env
from model.packing import Packing
from preprocess.build_lock import one_builder
from preprocess.corpus_source import CorpusOptions, open_corpus
from preprocess.dataset import GlobalBatchSchedule, TranslationDataset, default_cache_root, dp_slice, micro_slices
from preprocess.token_batches import TokenBatchSchedule
from training.core.data_wait import DataWait
from training.core.tsv_identity import shared_tsv_sha256


def auto_tokenizer_path(tsv_path: str, vocab_size: int, cache_dir: str | None, tsv_sha256: str) -> str:
    """Where the BPE tokenizer built for a TSV (when --tokenizer is not given) is cached."""
    digest = tsv_sha256[:16]
    root = cache_dir if cache_dir is not None else default_cache_root(os.path.abspath(tsv_path))
    return os.path.join(root, f"bpe{vocab_size}-{digest}", "tokenizer.json")


def prepare_data(
    file_path: str | None,
    tokenizer: str | None,
    src_len: int,
    tgt_len: int,
    tokenizer_vocab_size: int = 8000,
    progress: bool = True,
    flag: str = "--file_path",
    cache_dir: str | None = None,
    corpus: CorpusOptions | None = None,
) -> TranslationDataset:
    """`corpus`: how pairs are taken from a table (a datasets folder, .jsonl/.json/.csv/.parquet, a Hub name)."""
    if not file_path:
        raise UserError(
            f"{flag} is required: a TSV of 'source<TAB>target' pairs, e.g. made by "
            "`python -m preprocess.parallel --src data/multi30k/train.fr.gz --tgt "
            "data/multi30k/train.en.gz --output out/data/train.fr_en.tsv` (or a datasets folder or "
            ".jsonl/.parquet file: docs/data.md)"
        )
    source = open_corpus(file_path, corpus, flag)
    if source.is_tsv and not os.path.isfile(file_path):
        raise UserError(f"{flag} {file_path} not found (make it with python -m preprocess.parallel)")
    if tokenizer and not os.path.isfile(tokenizer):
        raise UserError(
            f"--tokenizer {tokenizer} not found (make one with python -m preprocess.tokenizer, or "
            f"leave --tokenizer out to build one from --file_path)"
        )
    sha = shared_tsv_sha256(file_path, cache_dir, source)  # rank 0 reads it (or its record) and broadcasts it
    tok_path = tokenizer or auto_tokenizer_path(file_path, tokenizer_vocab_size, cache_dir, sha)
    local_rank = local_rank_from_env()
    wait = DataWait.for_job(local_rank)
    if local_rank == 0:
        with wait.preparing(f"prepares {file_path}") if wait else contextlib.nullcontext():
            if not tokenizer and not os.path.isfile(tok_path):
                _build_tokenizer(file_path if source.is_tsv else source, tok_path, tokenizer_vocab_size, progress)
            data = TranslationDataset(
                file_path,
                tok_path,
                src_len,
                tgt_len,
                cache_dir=cache_dir,
                progress=progress,
                tsv_sha256=sha,
                corpus=corpus,
            )
    else:
        if wait:
            wait.wait_for_leader()
        # local rank 0 verified the store's checksums (or rebuilt it) before saying it is ready: hashing it again
        # here would read every byte once more per rank; the structural checks still run
        data = TranslationDataset(
            file_path,
            tok_path,
            src_len,
            tgt_len,
            cache_dir=cache_dir,
            progress=False,
            tsv_sha256=sha,
            verify=False,
            corpus=corpus,
        )
    if wait:
        wait.wait_for_all()
    return data


def _build_tokenizer(file_path, tok_path: str, vocab_size: int, progress: bool) -> None:
    """The BPE tokenizer train.py builds when --tokenizer is not given: one builder per cache folder (another
    node's, sharing it, may be building it already: then this one waits for it)."""
    from preprocess.tokenizer import train_tokenizer

    with one_builder(Path(tok_path).parent, f"the tokenizer {tok_path}", lambda: os.path.isfile(tok_path)) as mine:
        if mine:
            print(f"building a BPE tokenizer ({vocab_size}) from {file_path} → {tok_path}", flush=True)
            train_tokenizer(
                [file_path], os.path.dirname(tok_path), type="bpe", vocab_size=vocab_size, progress=progress
            )


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch tensor on the training device. To a CUDA device it goes through page-locked memory, so the copy
    is a DMA that does not wait for the host (pageable memory is first staged by the driver, synchronously); on the
    CPU it is the tensor itself."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass
class StepBatches:
    """This rank's micro-batches of one global batch, built lazily (middle pipeline stages build only their
    packings).
    A negative sample index is a filler row (the last batch of a validation pass): real inputs, PAD labels, so it
    adds no loss and no tokens. `shape`: the (source, target) length the batch is padded to (token batches; None:
    the dataset's). `src_tokens`: the global batch's real source tokens (global_tokens: its target tokens, the
    loss's denominator); `padding`: the fraction of its source and target positions that are PAD; `pairs`: its
    sentence pairs."""

    data: TranslationDataset
    micro: list
    global_tokens: int
    device: torch.device
    shape: tuple | None = None
    src_tokens: int = 0
    padding: float = 0.0
    pairs: int = 0
    _packings: list | None = field(default=None, init=False, repr=False)

    def packings(self) -> list[tuple[Packing, Packing]]:
        """Each micro-batch's (source, target) packing, found on the host and copied to the device with the batch
        (`model.packing`): what every layer, the head and the loss use, with no nonzero() on the device. Built
        once; a pipeline stage gets them even where it never loads the batch (training.core.step)."""
        if self._packings is None:
            self._packings = [
                tuple(
                    Packing.from_host(self.data.batch(idx, self.shape)[key].numpy(), self.data.pad_id, self._copy)
                    for key in ("src_ids", "tgt_ids")
                )
                for idx in self.micro
            ]
        return self._packings

    def _copy(self, host: torch.Tensor) -> torch.Tensor:
        return to_device(host, self.device)

    @property
    def lengths(self) -> tuple[int, int]:
        """The (source, target) length every sequence of this batch is padded to."""
        return self.shape if self.shape is not None else (self.data.src_len, self.data.tgt_len)

    @property
    def micro_shape(self) -> tuple[int, int, int]:
        """(rows, source length, target length) of each of this rank's micro-batches (all of a step have one)."""
        return (len(self.micro[0]), *self.lengths)

    def __iter__(self) -> Iterator[tuple]:
        for idx, packs in zip(self.micro, self.packings()):
            b = self.data.batch(idx, self.shape)
            if (idx < 0).any():
                b["labels"][torch.from_numpy(idx < 0)] = self.data.pad_id
            inputs = tuple(self._copy(b[k]) for k in ("src_ids", "tgt_ids"))
            for ids, pack in zip(inputs, packs):  # each side's real tokens, found on the host (model.packing)
                pack.keep_on(ids, self.data.pad_id)
            yield inputs, self._copy(b["labels"])


def validation_batches(
    data: TranslationDataset, global_batch: int, dp_rank: int, dp_size: int, micro_batch_num: int, device: torch.device
) -> Iterator[StepBatches]:
    """The whole validation set in file order, in global batches the layout can run (the training batch shape);
    the last one is filled up with filler rows."""
    for start in range(0, data.num_samples, global_batch):
        idx = np.arange(start, start + global_batch, dtype=np.int64)
        idx[idx >= data.num_samples] = -1
        tokens = data.target_tokens(idx[idx >= 0])
        yield StepBatches(data, micro_slices(dp_slice(idx, dp_rank, dp_size), micro_batch_num), tokens, device)


def batch_schedule(
    data: TranslationDataset,
    global_batch: int,
    seed: int,
    max_tokens: int = 0,
    batch_multiple: int = 16,
    pad_multiple: int = 8,
    num_batch_buckets: int = 0,
):
    """Fixed-size global batches of `global_batch` pairs padded to the dataset's lengths, or with `max_tokens`
    token batches (`preprocess.token_batches`); both layout-free."""
    if max_tokens:
        src_real, tgt_real = data.real_lengths()
        return TokenBatchSchedule(
            src_real,
            tgt_real,
            max_tokens,
            batch_multiple,
            seed,
            data.src_len,
            data.tgt_len,
            pad_multiple,
            num_batch_buckets,
        )
    return GlobalBatchSchedule(data.num_samples, global_batch, seed)


class BatchFeeder:
    """Step k's global batch (from `schedule`: `batch_schedule`'s fixed or token batches), cut for this rank."""

    def __init__(
        self, data: TranslationDataset, schedule, dp_rank: int, dp_size: int, micro_batch_num: int, device: torch.device
    ):
        self.data, self.schedule = data, schedule
        self.dp_rank, self.dp_size, self.gas, self.device = dp_rank, dp_size, micro_batch_num, device

    def step(self, step: int) -> StepBatches:
        idx = self.schedule.global_batch(step)
        shape = self.schedule.shape(step)
        s, t = shape if shape is not None else (self.data.src_len, self.data.tgt_len)
        # a batch's shape never cuts a real token (fixed: the dataset's lengths; token batches: the longest pair)
        tokens = self.data.target_tokens(idx)
        src_tokens = self.data.source_tokens(idx)
        mine = dp_slice(idx, self.dp_rank, self.dp_size)
        return StepBatches(
            self.data,
            micro_slices(mine, self.gas),
            tokens,
            self.device,
            shape,
            src_tokens,
            1.0 - (src_tokens + tokens) / (len(idx) * (s + t)),
            len(idx),
        )

    def epoch_of(self, step: int) -> int:
        return self.schedule.epoch_of(step)


# ------------------------------------------------------------------------------------------ the data position
def data_order(args) -> dict:
    """What decides which pairs form step k's batch (besides the data itself): a checkpoint stores it, and a resume
    with different values would train on another sequence of batches than the uninterrupted run."""
    if args.max_tokens:
        order = {
            "batching": "tokens",
            "max_tokens": args.max_tokens,
            "batch_multiple": args.batch_multiple,
            "pad_multiple": args.pad_multiple,
            "seed": args.seed,
        }
        if args.num_batch_buckets:  # absent = 0, as in checkpoints saved before the flag existed
            order["num_batch_buckets"] = args.num_batch_buckets
        return order
    return {"batching": "fixed", "batch_size": args.batch_size, "seed": args.seed}


def _describe(order: dict) -> str:
    kind = "token batches" if order["batching"] == "tokens" else "fixed batches"
    return kind + " " + " ".join(f"{k}={v}" for k, v in order.items() if k != "batching")


def _flags(order: dict) -> str:
    if order["batching"] == "tokens":
        order = {**order, "num_batch_buckets": order.get("num_batch_buckets", 0)}
    flags = " ".join(f"--{k} {v}" for k, v in order.items() if k != "batching")
    return flags if order["batching"] == "tokens" else flags + " (and no --max_tokens)"


def check_data_order(saved: dict, now: dict, path: str) -> None:
    """Refuse a resume whose batching flags differ from the checkpoint's: the run would go on silently with other
    batches (a different data order, other batch sizes) than the one it continues."""
    if saved == now:
        return
    raise UserError(
        f"checkpoint {path} was trained with {_describe(saved)}; resuming with {_describe(now)} would "
        f"change the data order. Pass {_flags(saved)}"
    )


def legacy_data_order(meta: dict, now: dict) -> dict:
    """Checkpoints written before `data_order` was stored hold only batch_size and seed: with token batches now,
    the batch_size is not part of the order, so only the seed can be checked."""
    if now["batching"] == "tokens":
        return {**now, "seed": meta["seed"]}
    return {"batching": "fixed", "batch_size": meta["batch_size"], "seed": meta["seed"]}
