"""Tokenized translation pairs (a compact, memory-mapped token store) and the layout-invariant global batch schedule.

`TranslationDataset(tsv, tokenizer.json, src_len, tgt_len)` tokenizes a `source<TAB>target` TSV once into a token
store (preprocess.token_store: each side's ids at 16 bits where the vocabulary allows, no padding, offsets per pair;
built in bounded memory by preprocess.store_builder) and maps it read-only. `batch(indices)` builds the padded int64
tensors the model takes:

    src_ids [n, src_len]  source tokens[:src_len-1] + [EOS], then PAD
    tgt_ids [n, tgt_len]  [BOS] + y, then PAD            (decoder input; y = target tokens[:tgt_len-1])
    labels  [n, tgt_len]  y + [EOS], then PAD            (PAD labels are ignored by the loss)

The store lives under `<tsv dir>/.tokcache/<tsv stem>-<key>/` (or `cache_dir`), where the key hashes the TSV bytes,
the tokenizer.json bytes, src_len, tgt_len and the store's FORMAT_VERSION, so any change re-tokenizes (an old
format's cache is never read as a new one) and an unchanged input opens in milliseconds. The store is written to a
temporary folder and renamed into place, so a killed run never leaves a half-written cache under a valid name
(only a `.tmp-*` folder, safe to delete). One process builds a store at a time, also across nodes sharing the cache
folder (preprocess.build_lock: a flock on `.<store>.lock` beside it); the others wait and then open its result.
A store that already exists is only read: the data folder may be read-only.
Opening it checks it (preprocess.token_store: structure always; with `verify`, the files' sha256, once per unchanged
file); a damaged store is rebuilt from the TSV, saying which file was damaged and how.

`GlobalBatchSchedule` decides which samples form global batch k from (seed, epoch, global batch size) alone;
`dp_slice` and `micro_slices` cut that batch for a data-parallel rank and its pipeline micro-batches. Because
a global batch never depends on the parallel layout or on iterator state, resuming from a checkpoint saved
after step s is just calling `global_batch(step)` for step = s, s+1, ... — even with a different DP/PP layout.

Stats:  python -m preprocess.dataset --file_path data/multi30k/train.fr_en.tsv \\
            --tokenizer data/multi30k/bpe8k/tokenizer.json --src_len 32 --tgt_len 32
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from common.errors import UserError, fail, run_cli
from common.hashing import file_sha256
from common.text_lines import check_readable
from common.units import human_bytes
from preprocess.build_lock import one_builder
from preprocess.corpus_source import CorpusOptions, add_corpus_flags, open_corpus, options_from_args
from preprocess.store_builder import build_store
from preprocess.token_batches import compact_permutation
from preprocess.token_store import FORMAT_VERSION, DamagedStore, TokenStore
from preprocess.tokenizer import TOKENIZER_FILE, load_tokenizer, special_ids

CACHE_DIRNAME = ".tokcache"


def cache_key(
    tsv_path: Path,
    tokenizer_path: Path,
    src_len: int,
    tgt_len: int,
    tsv_sha256: str | None = None,
    version: int = FORMAT_VERSION,
) -> str:
    """The store's name: the TSV's and tokenizer's sha256, the lengths, the format version (`tsv_sha256`: the TSV's
    hash if already known)."""
    parts = [
        tsv_sha256 or file_sha256(tsv_path),
        file_sha256(tokenizer_path),
        str(src_len),
        str(tgt_len),
        f"v{version}",
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def default_cache_root(tsv_path: Path) -> Path:
    return Path(tsv_path).parent / CACHE_DIRNAME


class TranslationDataset:
    """A TSV's pairs as a token store; see the module docstring for what `batch` builds. `verify`: check the store's
    files against their sha256 and rebuild a damaged one (False for a node's other ranks, which open it after the
    one that verified it; they still make the structural checks, and refuse a damaged store)."""

    def __init__(
        self,
        tsv_path,
        tokenizer_path,
        src_len,
        tgt_len,
        cache_dir=None,
        progress=True,
        num_proc: int | None = None,
        tsv_sha256: str | None = None,
        block_bytes: int | None = None,
        verify: bool = True,
        corpus: CorpusOptions | None = None,
        batch_rows: int | None = None,
    ):
        for name, value in (("src_len", src_len), ("tgt_len", tgt_len)):
            if int(value) != value or value < 2:
                fail(f"{name}={value} must be an integer >= 2 (at least one token plus BOS/EOS)")
        if num_proc is not None and num_proc < 1:
            fail(f"--num_proc {num_proc} must be >= 1")
        self.src_len, self.tgt_len = int(src_len), int(tgt_len)
        # a TSV as always; a datasets folder, a .jsonl/.json/.csv/.parquet file or a Hub name through `corpus`
        self.source = open_corpus(tsv_path, corpus)
        self.tsv_path = check_readable(tsv_path) if self.source.is_tsv else self.source.path
        tokenizer_path = Path(tokenizer_path)
        if tokenizer_path.is_dir():
            tokenizer_path = tokenizer_path / TOKENIZER_FILE
        self.tokenizer_path = tokenizer_path
        self.tokenizer = load_tokenizer(tokenizer_path)
        ids = special_ids(self.tokenizer)
        self.pad_id, self.unk_id, self.bos_id, self.eos_id = ids.pad, ids.unk, ids.bos, ids.eos
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

        cache_root = Path(cache_dir) if cache_dir is not None else default_cache_root(self.tsv_path)
        sha = tsv_sha256 or self.source.identity()
        key = cache_key(self.tsv_path, tokenizer_path, self.src_len, self.tgt_len, tsv_sha256=sha)
        self.cache_path = cache_root / f"{self.tsv_path.stem}-{key}"
        self.cache_hit = self.cache_path.is_dir()
        self.build_info: dict | None = None  # how the store was built, when this object built it

        def build() -> dict:
            return build_store(
                self.tsv_path,
                tokenizer_path,
                self.vocab_size,
                self.src_len,
                self.tgt_len,
                self.cache_path,
                sha,
                num_proc=num_proc,
                progress=progress,
                block_bytes=block_bytes,
                source=self.source,
                batch_rows=batch_rows,
            )

        if not self.cache_hit:
            # one builder per store, also across nodes sharing the cache folder; a process that waited for another
            # one's build finds it done and only opens it
            with one_builder(self.cache_path, f"the token store {self.cache_path}", self.cache_path.is_dir) as mine:
                if mine:
                    self.build_info = build()
                else:
                    self.cache_hit = True
        try:
            self.store = TokenStore(self.cache_path, verify=verify)
        except DamagedStore as damage:
            if not verify:
                raise
            self._set_aside(damage)
            self.cache_hit, self.build_info = False, build()
            self.store = TokenStore(self.cache_path)  # damaged again: raised, never a second rebuild
        self.num_samples = self.store.pairs

    def _set_aside(self, damage: DamagedStore) -> None:
        """Say what is damaged, and move the store out of its name (a rename, so another node's builder never finds
        half of it) before deleting it, for build_store to write it anew."""
        print(
            f"warning: token store {self.cache_path}: {damage.name} {damage.reason}; rebuilding it from "
            f"{self.tsv_path}",
            flush=True,
        )
        aside = self.cache_path.parent / f".damaged-{self.cache_path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.cache_path, aside)
        except FileNotFoundError:
            return  # another process set it aside first
        except OSError as exc:
            raise UserError(
                f"token store {self.cache_path}: {damage.name} {damage.reason}, and it cannot be rebuilt "
                f"there ({exc.strerror or exc}); pass --cache_dir DIR, a folder this process can write, "
                f"to build a new one there"
            ) from None
        shutil.rmtree(aside, ignore_errors=True)

    # -- access ---------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_samples

    def _rows(self, indices) -> np.ndarray:
        """Sample indices as int64; a negative one counts from the end, as numpy indexing does."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        return np.where(idx < 0, idx + self.num_samples, idx)

    def batch(self, indices, shape: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """{"src_ids", "tgt_ids", "labels"}: int64 tensors of shape [len(indices), L] for the given samples, padded
        here; with `shape` = (source length, target length) only those first positions (token batches are padded to
        their own longest pair: the positions cut off are PAD)."""
        idx = self._rows(indices)
        s, t = shape if shape is not None else (self.src_len, self.tgt_len)
        rows = self.store.padded_rows
        return {
            "src_ids": torch.from_numpy(rows("src", idx, s, self.pad_id, end=self.eos_id)),
            "tgt_ids": torch.from_numpy(rows("tgt", idx, t, self.pad_id, lead=self.bos_id)),
            "labels": torch.from_numpy(rows("tgt", idx, t, self.pad_id, end=self.eos_id)),
        }

    def real_lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """Each pair's non-PAD source length (tokens + EOS) and target length (labels: tokens + EOS), int32 (4 bytes
        a pair each: these are built for a whole corpus)."""
        return tuple((self.store.lengths(side) + 1).astype(np.int32) for side in ("src", "tgt"))

    def source_tokens(self, indices) -> int:
        """Non-PAD source positions (tokens + EOS) of these samples."""
        idx = self._rows(indices)
        return int(self.store.lengths("src", idx).sum()) + len(idx)

    def target_tokens(self, indices) -> int:
        """Non-PAD labels (tokens + EOS) of these samples: what the summed token loss is divided by."""
        idx = self._rows(indices)
        return int(self.store.lengths("tgt", idx).sum()) + len(idx)

    @property
    def src_truncated(self) -> np.ndarray:
        """bool [pairs]: the source had more than src_len-1 tokens and was cut."""
        return (np.asarray(self.store.flags) & 1).astype(bool)

    @property
    def tgt_truncated(self) -> np.ndarray:
        """bool [pairs]: the target had more than tgt_len-1 tokens and was cut."""
        return (np.asarray(self.store.flags) & 2).astype(bool)

    def stats(self) -> dict[str, float]:
        """Figures counted while the store was built (meta.json), and its size."""
        meta = self.store.meta
        counts, n = meta["counts"], self.num_samples
        stored = meta["tokens"]["src"] + meta["tokens"]["tgt"]
        real = stored + 2 * n  # + EOS on the source, EOS on the labels
        return {
            "samples": n,
            "src_truncated_pct": 100.0 * counts["src_truncated"] / n,
            "tgt_truncated_pct": 100.0 * counts["tgt_truncated"] / n,
            "mean_src_tokens": counts["src_tokens_before_cut"] / n,
            "mean_tgt_tokens": counts["tgt_tokens_before_cut"] / n,
            "target_tokens": meta["tokens"]["tgt"] + n,
            "unk_pct": 100.0 * counts["unk"] / real,
            "real_tokens": real,
            "token_dtype": meta["token_dtype"],
            "store_bytes": self.store.nbytes(),
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
            fail(
                f"global batch size {global_batch_size} exceeds the {num_samples} samples of the dataset; "
                "lower the batch size or use more data"
            )
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
            self._epoch_order = None  # the old epoch's order goes before the new one comes
            self._epoch_order = (epoch, compact_permutation([self.seed, epoch], self.num_samples))
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
        fail(
            f"global batch of {len(indices)} samples does not divide evenly over {dp_size} data-parallel ranks; "
            "choose a global batch size that is a multiple of the data-parallel size"
        )
    per_rank = len(indices) // dp_size
    return indices[dp_rank * per_rank : (dp_rank + 1) * per_rank]


def micro_slices(indices, micro_batch_num: int) -> list[np.ndarray]:
    """Split a rank's batch into `micro_batch_num` contiguous, equal micro-batches (pipeline order)."""
    indices = np.asarray(indices)
    if micro_batch_num <= 0:
        fail(f"micro_batch_num {micro_batch_num} must be positive")
    if len(indices) % micro_batch_num:
        fail(
            f"batch of {len(indices)} samples does not divide into {micro_batch_num} equal micro-batches; "
            "choose a global batch size that is a multiple of data-parallel size x micro_batch_num"
        )
    size = len(indices) // micro_batch_num
    return [indices[i * size : (i + 1) * size] for i in range(micro_batch_num)]


def count_target_tokens(labels, pad_id: int) -> int:
    """Non-PAD label tokens: the number the summed token loss is divided by."""
    if isinstance(labels, torch.Tensor):
        return int((labels != pad_id).sum().item())
    return int(np.count_nonzero(np.asarray(labels) != pad_id))


def main(prog: str = "python -m preprocess.dataset") -> int:
    """`prog`: the command as the user ran it (`python -m preprocess.dataset`, or its dstr-prepare-* command):
    --help names it."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Tokenize a source<TAB>target TSV into a token store (compact, memory-mapped ids; or open the "
        "one already built) and print statistics: samples, truncation, mean lengths, size, time taken. "
        "The TSV is read in chunks over --num_proc processes, in bounded memory, however large it is.",
        epilog=f"examples:\n  {prog} --file_path data/multi30k/train.fr_en.tsv "
        "--tokenizer data/multi30k/bpe8k/tokenizer.json --src_len 32 --tgt_len 32\n"
        f"  {prog} --file_path /readonly/wmt14.tsv --tokenizer bpe/tokenizer.json "
        "--src_len 128 --tgt_len 128 --cache_dir /scratch/tokcache --num_proc 8",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--file_path",
        required=True,
        metavar="PATH",
        help="source<TAB>target TSV; or a datasets save_to_disk folder, or a .jsonl/.json/.csv/"
        ".parquet file, with the column flags below",
    )
    parser.add_argument(
        "--tokenizer",
        required=True,
        metavar="tokenizer.json",
        help="from dstr-prepare-tokenizer (the file or its directory)",
    )
    parser.add_argument("--src_len", type=int, required=True, help="source length incl. EOS")
    parser.add_argument("--tgt_len", type=int, required=True, help="target length incl. BOS (input) / EOS (labels)")
    parser.add_argument(
        "--cache_dir",
        default=None,
        help=f"where the token store goes (default: <TSV dir>/{CACHE_DIRNAME}); pass the same --cache_dir to train.py",
    )
    parser.add_argument(
        "--num_proc",
        type=int,
        default=None,
        help="tokenizer processes (default: the cores this process may use, at most 8; 1: this process alone)",
    )
    parser.add_argument("--no_progress", action="store_true", help="hide progress bars")
    add_corpus_flags(parser.add_argument_group("table input (not for a TSV): docs/data.md, Input formats"))
    args = parser.parse_args()
    start = time.perf_counter()
    dataset = TranslationDataset(
        args.file_path,
        args.tokenizer,
        args.src_len,
        args.tgt_len,
        cache_dir=args.cache_dir,
        progress=not args.no_progress,
        num_proc=args.num_proc,
        corpus=options_from_args(args),
    )
    seconds = time.perf_counter() - start
    stats = dataset.stats()
    print(
        f"{'loaded cache' if dataset.cache_hit else 'tokenized'} {dataset.tsv_path} in {seconds:.2f} s "
        f"({dataset.cache_path})"
    )
    print(
        f"samples {stats['samples']}  vocab {dataset.vocab_size}  "
        f"src truncated {stats['src_truncated_pct']:.2f}%  tgt truncated {stats['tgt_truncated_pct']:.2f}%  "
        f"mean tokens before truncation: src {stats['mean_src_tokens']:.2f} tgt {stats['mean_tgt_tokens']:.2f}  "
        f"unk {stats['unk_pct']:.3f}%  target tokens {stats['target_tokens']}"
    )
    itemsize = np.dtype(stats["token_dtype"]).itemsize
    print(
        f"store {human_bytes(stats['store_bytes'], base=1000)} ({stats['token_dtype']} ids): "
        f"{stats['store_bytes'] / (stats['real_tokens'] * itemsize):.2f}x its {stats['real_tokens']} real tokens "
        f"x {itemsize} bytes"
    )
    return 0


if __name__ == "__main__":
    run_cli(main)
