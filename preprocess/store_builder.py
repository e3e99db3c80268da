"""A `source<TAB>target` TSV → a token store (preprocess.token_store), streamed in bounded memory.

The TSV is read in blocks of whole lines (`LineBlocks`, about 4 MB each, hashing the file as it goes); each block is
validated, tokenized and cut to the lengths (`ChunkEncoder`), in this process or in `num_proc` worker processes;
the chunks come back in file order and are appended to the store as they arrive. At most two blocks per worker are
in flight, so memory does not depend on the corpus's size. Afterwards the file's hash is compared with the one the
store's key was made from, its size and modification time with the ones the build started with: a TSV that changed
while it was read is refused, and
nothing is left under the store's name.

Worker processes are forked (spawned where fork does not exist): they only read the tokenizer file and run
`tokenizers`, and a fork starts in milliseconds. With one process (`num_proc` 1) `tokenizers` runs its own threads
inside `encode_batch`; worker processes each tokenize on one thread.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections import deque
from itertools import chain
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from common.errors import fail
from preprocess.textio import LineBlocks, split_tsv_block
from preprocess.token_store import UINT16_IDS, StoreWriter, TokenChunk, token_dtype
from preprocess.tokenizer import load_tokenizer, special_ids

BLOCK_BYTES = 4 << 20                   # ~15,000 WMT-sized pairs a block
MAX_WORKERS = 8                         # beyond this the single reader/writer process is the limit


class ChunkEncoder:
    """One block of TSV lines → a TokenChunk: the ids of each side, cut to src_len-1 / tgt_len-1 tokens."""

    def __init__(self, tokenizer_path: str, src_len: int, tgt_len: int, dtype: str, name: str):
        self.tokenizer = load_tokenizer(tokenizer_path)
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets nobody here reads: the same ids, ~25%
        # less time
        self.encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        self.unk = special_ids(self.tokenizer).unk
        self.keep = {"src": src_len - 1, "tgt": tgt_len - 1}
        self.dtype, self.name = np.dtype(dtype), name

    def _side(self, texts: list[str], keep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(the kept ids back to back, kept tokens per text, tokens before the cut, which texts were cut)"""
        rows = [enc.ids for enc in self.encode(texts, add_special_tokens=False)]
        before = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        cut = before > keep
        if cut.any():
            rows = [row[:keep] for row in rows]
        kept = np.minimum(before, keep)
        ids = np.fromiter(chain.from_iterable(rows), dtype=self.dtype, count=int(kept.sum()))
        return ids, kept, before, cut

    def __call__(self, block: bytes, first_lineno: int) -> TokenChunk:
        sources, targets = split_tsv_block(block, self.name, first_lineno)
        src_ids, src_kept, src_before, src_cut = self._side(sources, self.keep["src"])
        tgt_ids, tgt_kept, tgt_before, tgt_cut = self._side(targets, self.keep["tgt"])
        flags = src_cut.astype(np.uint8) | (tgt_cut.astype(np.uint8) << 1)
        stats = {"src_tokens_before_cut": int(src_before.sum()), "tgt_tokens_before_cut": int(tgt_before.sum()),
                 "src_truncated": int(src_cut.sum()), "tgt_truncated": int(tgt_cut.sum()),
                 "unk": int(np.count_nonzero(src_ids == self.unk) + np.count_nonzero(tgt_ids == self.unk))}
        return TokenChunk(src_ids, src_kept, tgt_ids, tgt_kept, flags, stats)


_worker: Optional[ChunkEncoder] = None


def _start_worker(*args) -> None:
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"      # one thread per worker: the workers are the parallelism
    _worker = ChunkEncoder(*args)


def _encode_in_worker(block: bytes, first_lineno: int) -> TokenChunk:
    return _worker(block, first_lineno)


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    old = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def default_num_proc() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:                               # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


def _encoded_chunks(blocks: LineBlocks, encoder_args: tuple, workers: int) -> Iterator[tuple[TokenChunk, float]]:
    """The blocks' TokenChunks in file order, each with the fraction of the file read up to its end, from `workers`
    processes (1: this one), two blocks per worker in flight at most."""
    if workers <= 1:
        encoder = ChunkEncoder(*encoder_args)
        for block, lineno in blocks:
            yield encoder(block, lineno), blocks.consumed / max(blocks.size, 1)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    # tokenizers warns (and turns its threads off) in a child forked after its threads ran; the workers want one
    # thread anyway, and this says so before the fork
    with _environment(TOKENIZERS_PARALLELISM="false"):
        pool = multiprocessing.get_context(method).Pool(workers, initializer=_start_worker, initargs=encoder_args)
    try:
        pending: deque = deque()
        for block, lineno in blocks:
            pending.append((pool.apply_async(_encode_in_worker, (block, lineno)),
                            blocks.consumed / max(blocks.size, 1)))
            if len(pending) >= 2 * workers:
                result, fraction = pending.popleft()
                yield result.get(), fraction
        while pending:
            result, fraction = pending.popleft()
            yield result.get(), fraction
    finally:
        pool.terminate()
        pool.join()


class _Progress:
    """A progress bar in pairs, with pairs/s and an ETA; the total is projected from the bytes read so far. It
    appears with the first chunk written (a folder that cannot be written fails before any bar is drawn)."""

    def __init__(self, enabled: bool, name: str):
        self.enabled, self.name, self.bar = enabled, name, None

    def update(self, pairs: int, done_pairs: int, fraction: float) -> None:
        if not self.enabled:
            return
        total = max(done_pairs, int(round(done_pairs / fraction))) if fraction > 0 else done_pairs
        if self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit=" pairs", unit_scale=True, desc=f"tokenizing {self.name}",
                            dynamic_ncols=True, file=sys.stderr, smoothing=0.1)
        self.bar.total = total
        self.bar.update(pairs)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.total = self.bar.n
            self.bar.close()


def _file_state(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def build_store(tsv_path: Path, tokenizer_path: Path, vocab_size: int, src_len: int, tgt_len: int, final: Path,
                expected_sha256: str, num_proc: Optional[int] = None, block_bytes: Optional[int] = None,
                progress: bool = True) -> dict:
    """Tokenize `tsv_path` into a store at `final` (atomically). `expected_sha256`: the TSV hash the store's key
    was made from; the file is hashed again while read and must not differ. Returns how it went: the worker
    processes (1: this process) and the chunks."""
    tsv_path = Path(tsv_path)
    dtype = token_dtype(vocab_size)
    if vocab_size > UINT16_IDS:
        print(f"note: the vocabulary of {tokenizer_path} has {vocab_size} ids, more than 16 bits hold: token ids "
              f"are stored as uint32 (4 bytes each instead of 2)", flush=True)
    before = _file_state(tsv_path)
    block_bytes = block_bytes or BLOCK_BYTES
    blocks = LineBlocks(tsv_path, block_bytes)
    workers = default_num_proc() if num_proc is None else int(num_proc)    # (>= 1: TranslationDataset checks)
    if blocks.size <= block_bytes:
        workers = 1                                      # one block: a worker would only add its start-up
    encoder_args = (str(tokenizer_path), src_len, tgt_len, dtype.name, str(tsv_path))
    bar = _Progress(progress, tsv_path.name)
    try:
        with StoreWriter(final, dtype, str(tsv_path)) as writer, \
                contextlib.closing(_encoded_chunks(blocks, encoder_args, workers)) as chunks:
            count = 0
            for chunk, fraction in chunks:
                count += 1
                writer.append(chunk, fraction)
                bar.update(chunk.pairs, writer.pairs, fraction)
            if writer.pairs == 0:
                fail(f"{tsv_path}: file is empty")
            if blocks.sha256 != expected_sha256 or _file_state(tsv_path) != before:
                fail(f"{tsv_path} changed while it was being read (its contents, size or modification time differ "
                     f"from when this run started); let whatever writes it finish, then run again")
            writer.commit({"src_len": src_len, "tgt_len": tgt_len, "vocab_size": vocab_size,
                           "source": str(tsv_path), "source_sha256": expected_sha256})
    finally:
        bar.close()
    return {"workers": workers, "chunks": count}
