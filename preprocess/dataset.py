"""Tokenized, fixed-length translation data and the layout-invariant global batch schedule.

`TranslationDataset(tsv, tokenizer.json, src_len, tgt_len)` reads a `source<TAB>target` TSV, tokenizes it with
the fast `tokenizers` library inside `datasets.Dataset.map(batched=True)` and keeps three int64 arrays:

    src     [N, src_len]  source tokens[:src_len-1] + [EOS], then PAD
    tgt_in  [N, tgt_len]  [BOS] + y, then PAD            (decoder input; y = target tokens[:tgt_len-1])
    labels  [N, tgt_len]  y + [EOS], then PAD            (PAD labels are ignored by the loss)

The arrays are cached with `save_to_disk` under `<tsv dir>/.tokcache/<tsv stem>-<key>/`, where the key hashes
the TSV bytes, the tokenizer.json bytes, src_len, tgt_len and FORMAT_VERSION, so any change re-tokenizes and
an unchanged input loads in a fraction of a second. The cache is written to a temporary folder and renamed into
place, so a killed run never leaves a half-written cache under a valid name (only a `.tmp-*` folder, safe to
delete); ranks that build it at the same time each write their own temporary folder and the first rename wins.

`GlobalBatchSchedule` decides which samples form global batch k from (seed, epoch, global batch size) alone;
`dp_slice` and `micro_slices` cut that batch for a data-parallel rank and its pipeline micro-batches. Because
a global batch never depends on the parallel layout or on iterator state, resuming from a checkpoint saved
after step s is just calling `global_batch(step)` for step = s, s+1, ... — even with a different DP/PP layout.

Stats:  python -m preprocess.dataset --file_path data/multi30k/train.fr_en.tsv \\
            --tokenizer data/multi30k/bpe8k/tokenizer.json --src_len 32 --tgt_len 32
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from common.errors import fail, run_cli
from common.hashing import file_sha256
from preprocess.textio import check_readable, read_tsv_pairs
from preprocess.tokenizer import TOKENIZER_FILE, load_tokenizer, special_ids

# Bump whenever the cached columns or their meaning change, so old caches are never read as new ones.
FORMAT_VERSION = 1
CACHE_DIRNAME = ".tokcache"
_ARRAY_COLUMNS = ("src", "tgt_in", "labels")
_LENGTH_COLUMNS = ("src_tokens", "tgt_tokens")  # untruncated token counts, for truncation statistics


def cache_key(tsv_path: Path, tokenizer_path: Path, src_len: int, tgt_len: int) -> str:
    parts = [file_sha256(tsv_path), file_sha256(tokenizer_path), str(src_len), str(tgt_len), f"v{FORMAT_VERSION}"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


@contextlib.contextmanager
def _datasets_progress(enabled: bool) -> Iterator[None]:
    """Switch the (process-global) `datasets` progress bars for one block, restoring the caller's setting."""
    import datasets
    was_disabled = datasets.are_progress_bars_disabled()
    if enabled:
        datasets.enable_progress_bars()
    else:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_disabled:
            datasets.disable_progress_bars()
        else:
            datasets.enable_progress_bars()


def _read_saved_table(folder: Path):
    """The table `datasets.Dataset.save_to_disk` wrote, read with pyarrow alone: its state.json lists the Arrow
    stream files. (Importing `datasets` costs every rank about 2 s of start-up; building the cache still uses it.)"""
    import json

    import pyarrow as pa
    with open(folder / "state.json", encoding="utf-8") as f:
        files = [entry["filename"] for entry in json.load(f)["_data_files"]]
    tables = []
    for name in files:
        with pa.memory_map(str(folder / name)) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


class TranslationDataset:
    """Fixed-length token arrays for one TSV; see the module docstring for the layout of src/tgt_in/labels."""

    def __init__(self, tsv_path, tokenizer_path, src_len, tgt_len, cache_dir=None, progress=True):
        for name, value in (("src_len", src_len), ("tgt_len", tgt_len)):
            if int(value) != value or value < 2:
                fail(f"{name}={value} must be an integer >= 2 (at least one token plus BOS/EOS)")
        self.src_len, self.tgt_len = int(src_len), int(tgt_len)
        self.tsv_path = check_readable(tsv_path)
        tokenizer_path = Path(tokenizer_path)
        if tokenizer_path.is_dir():
            tokenizer_path = tokenizer_path / TOKENIZER_FILE
        self.tokenizer_path = tokenizer_path
        self.tokenizer = load_tokenizer(tokenizer_path)
        ids = special_ids(self.tokenizer)
        self.pad_id, self.unk_id, self.bos_id, self.eos_id = ids.pad, ids.unk, ids.bos, ids.eos
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

        cache_root = Path(cache_dir) if cache_dir is not None else self.tsv_path.parent / CACHE_DIRNAME
        key = cache_key(self.tsv_path, tokenizer_path, self.src_len, self.tgt_len)
        self.cache_path = cache_root / f"{self.tsv_path.stem}-{key}"
        self.cache_hit = self.cache_path.is_dir()
        if not self.cache_hit:
            self._build_cache(key, progress)
        self._load_cache()

    # -- building -------------------------------------------------------------------------------------------

    def _encode(self, texts: Sequence[str]) -> list[list[int]]:
        return [enc.ids for enc in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def _encode_batch(self, batch: dict) -> dict:
        src_ids, tgt_ids = self._encode(batch["src_text"]), self._encode(batch["tgt_text"])
        n = len(src_ids)
        src = np.full((n, self.src_len), self.pad_id, dtype=np.int64)
        tgt_in = np.full((n, self.tgt_len), self.pad_id, dtype=np.int64)
        labels = np.full((n, self.tgt_len), self.pad_id, dtype=np.int64)
        for i, (s, t) in enumerate(zip(src_ids, tgt_ids)):
            s = s[: self.src_len - 1]
            src[i, : len(s)] = s
            src[i, len(s)] = self.eos_id
            y = t[: self.tgt_len - 1]
            tgt_in[i, 0] = self.bos_id
            tgt_in[i, 1 : len(y) + 1] = y
            labels[i, : len(y)] = y
            labels[i, len(y)] = self.eos_id
        return {
            "src": src, "tgt_in": tgt_in, "labels": labels,
            "src_tokens": np.fromiter(map(len, src_ids), dtype=np.int64, count=n),
            "tgt_tokens": np.fromiter(map(len, tgt_ids), dtype=np.int64, count=n),
        }

    def _build_cache(self, key: str, progress: bool) -> None:
        import datasets                      # only to build: loading reads the Arrow files with pyarrow (faster start)
        from datasets import Features, List, Value
        sources, targets = read_tsv_pairs(self.tsv_path)
        features = Features({
            "src": List(Value("int64"), length=self.src_len),
            "tgt_in": List(Value("int64"), length=self.tgt_len),
            "labels": List(Value("int64"), length=self.tgt_len),
            "src_tokens": Value("int64"),
            "tgt_tokens": Value("int64"),
        })
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_path.parent / f".tmp-{self.cache_path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with _datasets_progress(progress):
                table = datasets.Dataset.from_dict({"src_text": sources, "tgt_text": targets})
                # new_fingerprint: the cache key already identifies the result; without it `datasets` would
                # pickle and hash this bound method (and the tokenizer inside) only to name an unused cache file.
                table = table.map(self._encode_batch, batched=True, batch_size=2000,
                                  remove_columns=["src_text", "tgt_text"], features=features,
                                  new_fingerprint=key, desc=f"tokenizing {self.tsv_path.name}")
                table.save_to_disk(str(tmp))
            try:
                os.rename(tmp, self.cache_path)
            except OSError:
                if not self.cache_path.is_dir():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # another rank finished the same cache first
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    # -- loading --------------------------------------------------------------------------------------------

    def _load_cache(self) -> None:
        try:
            table = _read_saved_table(self.cache_path)
        except (OSError, ValueError, KeyError) as exc:  # e.g. files deleted by hand from inside the cache folder
            fail(f"{self.cache_path}: unreadable tokenization cache ({exc}); delete the folder to rebuild it")
        self.num_samples = table.num_rows
        widths = {"src": self.src_len, "tgt_in": self.tgt_len, "labels": self.tgt_len}
        for name in _ARRAY_COLUMNS:
            # Straight from Arrow (fixed-size lists flatten to one int64 buffer): much faster than row formatting.
            flat = table.column(name).combine_chunks().flatten().to_numpy(zero_copy_only=False)
            setattr(self, name, np.array(flat, dtype=np.int64).reshape(self.num_samples, widths[name]))
        for name in _LENGTH_COLUMNS:
            setattr(self, name, np.array(table.column(name).to_numpy(), dtype=np.int64))
        del table  # drop the memory map; the arrays above own their data

    # -- access ---------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_samples

    def batch(self, indices, shape: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """{"src_ids", "tgt_ids", "labels"}: int64 tensors of shape [len(indices), L] for the given samples; with
        `shape` = (source length, target length) only those first positions (token batches are padded to their
        own longest pair: the positions cut off are PAD)."""
        idx = np.asarray(indices, dtype=np.int64)
        s, t = shape if shape is not None else (self.src_len, self.tgt_len)
        return {
            "src_ids": torch.from_numpy(self.src[idx, :s]),
            "tgt_ids": torch.from_numpy(self.tgt_in[idx, :t]),
            "labels": torch.from_numpy(self.labels[idx, :t]),
        }

    def real_lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """Each pair's non-PAD source length (tokens + EOS) and target length (labels: tokens + EOS)."""
        return (np.count_nonzero(self.src != self.pad_id, axis=1),
                np.count_nonzero(self.labels != self.pad_id, axis=1))

    def stats(self) -> dict[str, float]:
        real = np.concatenate([self.src.ravel(), self.labels.ravel()])
        return {
            "samples": self.num_samples,
            "src_truncated_pct": 100.0 * float(np.mean(self.src_tokens > self.src_len - 1)),
            "tgt_truncated_pct": 100.0 * float(np.mean(self.tgt_tokens > self.tgt_len - 1)),
            "mean_src_tokens": float(np.mean(self.src_tokens)),
            "mean_tgt_tokens": float(np.mean(self.tgt_tokens)),
            "target_tokens": count_target_tokens(self.labels, self.pad_id),
            "unk_pct": 100.0 * float(np.mean(real[real != self.pad_id] == self.unk_id)),
        }


def seed_fields(batch: dict, pad_id: int, mask_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The MindSpore tutorial's batch fields, for code ported from it.

    Masks follow MindSpore's convention: 1 = may attend, 0 = masked, built as the outer product of the
    query-side and key-side non-PAD masks (as `mindspore.nn.transformer.AttentionMask` does), so rows for PAD
    queries are all 0; MindSpore turns 0 into a -10000 additive bias, so those rows stay finite. The seed
    itself used all-ones source and memory masks, i.e. it attended to padding.
    """
    src_ids, tgt_ids = batch["src_ids"], batch["tgt_ids"]
    bsz, s_len = src_ids.shape
    t_len = tgt_ids.shape[1]
    src_valid, tgt_valid = src_ids != pad_id, tgt_ids != pad_id
    causal = torch.tril(torch.ones(t_len, t_len, dtype=torch.bool))
    return {
        "src_ids": src_ids,
        "src_position": torch.arange(s_len, dtype=torch.int64).expand(bsz, s_len).contiguous(),
        "src_mask": (src_valid[:, :, None] & src_valid[:, None, :]).to(mask_dtype),
        "tgt_ids": tgt_ids,
        "tgt_position": torch.arange(t_len, dtype=torch.int64).expand(bsz, t_len).contiguous(),
        "tgt_mask": (tgt_valid[:, :, None] & tgt_valid[:, None, :] & causal).to(mask_dtype),
        "memory_mask": (tgt_valid[:, :, None] & src_valid[:, None, :]).to(mask_dtype),
        "label": batch["labels"],
    }


class GlobalBatchSchedule:
    """Which samples form global batch k depends only on (seed, epoch, global batch size), never on the layout.

    Step k (counted from 0 across epochs) is batch k % batches_per_epoch of epoch k // batches_per_epoch; an
    epoch's order is `np.random.default_rng([seed, epoch]).permutation(num_samples)` cut into consecutive
    global batches, dropping the remainder. There is no iterator state: to resume after a checkpoint taken at
    step s, keep calling `global_batch(step)` for step >= s — the data is exactly what an uninterrupted run
    would have seen, whatever the new DP/TP/PP layout.
    """

    def __init__(self, num_samples, global_batch_size, seed):
        if global_batch_size <= 0:
            fail(f"global batch size {global_batch_size} must be positive")
        if global_batch_size > num_samples:
            fail(f"global batch size {global_batch_size} exceeds the {num_samples} samples of the dataset; "
                 "lower the batch size or use more data")
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.batches_per_epoch = self.num_samples // self.global_batch_size
        self._epoch_order: tuple[int, np.ndarray] | None = None  # the last epoch's permutation, reused

    def epoch_of(self, step: int) -> int:
        if step < 0:
            fail(f"step {step} must be >= 0")
        return int(step) // self.batches_per_epoch

    def _order(self, epoch: int) -> np.ndarray:
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            self._epoch_order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_samples))
        return self._epoch_order[1]

    def shape(self, step: int) -> None:
        """Fixed batches are padded to the dataset's lengths (token batches: `TokenBatchSchedule.shape`)."""
        return None

    def global_batch(self, step: int) -> np.ndarray:
        """Sample indices (int64, length global_batch_size) of global batch `step`."""
        epoch = self.epoch_of(step)
        start = (int(step) % self.batches_per_epoch) * self.global_batch_size
        return self._order(epoch)[start : start + self.global_batch_size].astype(np.int64, copy=True)


def dp_slice(indices, dp_rank: int, dp_size: int) -> np.ndarray:
    """Data-parallel rank `dp_rank`'s contiguous share of a global batch."""
    indices = np.asarray(indices)
    if dp_size <= 0 or not 0 <= dp_rank < dp_size:
        fail(f"dp_rank {dp_rank} must be in [0, {dp_size}) and dp_size must be positive")
    if len(indices) % dp_size:
        fail(f"global batch of {len(indices)} samples does not divide evenly over {dp_size} data-parallel ranks; "
             "choose a global batch size that is a multiple of the data-parallel size")
    per_rank = len(indices) // dp_size
    return indices[dp_rank * per_rank : (dp_rank + 1) * per_rank]


def micro_slices(indices, micro_batch_num: int) -> list[np.ndarray]:
    """Split a rank's batch into `micro_batch_num` contiguous, equal micro-batches (pipeline order)."""
    indices = np.asarray(indices)
    if micro_batch_num <= 0:
        fail(f"micro_batch_num {micro_batch_num} must be positive")
    if len(indices) % micro_batch_num:
        fail(f"batch of {len(indices)} samples does not divide into {micro_batch_num} equal micro-batches; "
             "choose a global batch size that is a multiple of data-parallel size x micro_batch_num")
    size = len(indices) // micro_batch_num
    return [indices[i * size : (i + 1) * size] for i in range(micro_batch_num)]


def count_target_tokens(labels, pad_id: int) -> int:
    """Non-PAD label tokens: the number the summed token loss is divided by."""
    if isinstance(labels, torch.Tensor):
        return int((labels != pad_id).sum().item())
    return int(np.count_nonzero(np.asarray(labels) != pad_id))


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m preprocess.dataset",
        description="Tokenize a source<TAB>target TSV into fixed-length arrays (or load the cached result) and "
                    "print statistics: samples, truncation, mean lengths, time taken.",
        epilog="example:\n  python -m preprocess.dataset --file_path data/multi30k/train.fr_en.tsv "
               "--tokenizer data/multi30k/bpe8k/tokenizer.json --src_len 32 --tgt_len 32",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--file_path", required=True, metavar="TSV", help="source<TAB>target training file")
    parser.add_argument("--tokenizer", required=True, metavar="tokenizer.json",
                        help="from python -m preprocess.tokenizer (the file or its directory)")
    parser.add_argument("--src_len", type=int, required=True, help="source length incl. EOS")
    parser.add_argument("--tgt_len", type=int, required=True, help="target length incl. BOS (input) / EOS (labels)")
    parser.add_argument("--cache_dir", default=None, help=f"cache folder (default: <TSV dir>/{CACHE_DIRNAME})")
    parser.add_argument("--no_progress", action="store_true", help="hide progress bars")
    args = parser.parse_args()
    start = time.perf_counter()
    dataset = TranslationDataset(args.file_path, args.tokenizer, args.src_len, args.tgt_len,
                                 cache_dir=args.cache_dir, progress=not args.no_progress)
    seconds = time.perf_counter() - start
    stats = dataset.stats()
    print(f"{'loaded cache' if dataset.cache_hit else 'tokenized'} {dataset.tsv_path} in {seconds:.2f} s "
          f"({dataset.cache_path})")
    print(f"samples {stats['samples']}  vocab {dataset.vocab_size}  "
          f"src truncated {stats['src_truncated_pct']:.2f}%  tgt truncated {stats['tgt_truncated_pct']:.2f}%  "
          f"mean tokens before truncation: src {stats['mean_src_tokens']:.2f} tgt {stats['mean_tgt_tokens']:.2f}  "
          f"unk {stats['unk_pct']:.3f}%  target tokens {stats['target_tokens']}")
    return 0


if __name__ == "__main__":
    run_cli(main)
