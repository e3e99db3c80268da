"""A `source<TAB>target` TSV → a token store (preprocess.token_store), streamed in bounded memory.

The TSV is read in blocks of whole lines (`LineBlocks`, about 4 MB each, hashing the file as it goes); each block is
validated, tokenized and cut to the lengths (`ChunkEncoder`), in this process or in `num_proc` worker processes;
the chunks come back in file order and are appended to the store as they arrive. At most two blocks per worker are
in flight, so memory does not depend on the corpus's size. Afterwards the file's hash is compared with the one the
store's key was made from, its size and modification time with the ones the build started with: a TSV that changed
while it was read is refused, and
nothing is left under the store's name.

Worker processes are forked (spawned where fork does not exist): they only read the tokenizer file and run
`tokenizers`, and a fork starts in milliseconds. There are never more of them than blocks. With one process
(`num_proc` 1) `tokenizers` runs its own threads inside `encode_batch`; worker processes each tokenize on one thread.
A failure ends the build at once, never in a hang: a bad line or a full disk terminates the workers (they
take the default signal handlers, not the parent's), a killed worker breaks the pool (BrokenProcessPool: one line
naming the signal), and the workers die with their parent.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import chain, islice
from pathlib import Path

import numpy as np

from common.errors import UserError, fail
from common.text_lines import is_gzip
from preprocess.corpus_source import BATCH_ROWS
from preprocess.textio import LineBlocks, split_tsv_block
from preprocess.token_store import UINT16_IDS, StoreWriter, TokenChunk, token_dtype
from preprocess.tokenizer import load_tokenizer, special_ids

BLOCK_BYTES = 4 << 20  # ~15,000 WMT-sized pairs a block
MAX_WORKERS = 8  # beyond this the single reader/writer process is the limit


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

    def __call__(self, block, first_lineno: int) -> TokenChunk:
        """`block`: TSV lines (bytes), or (sources, targets) already read and checked from a table."""
        sources, targets = block if isinstance(block, tuple) else split_tsv_block(block, self.name, first_lineno)
        src_ids, src_kept, src_before, src_cut = self._side(sources, self.keep["src"])
        tgt_ids, tgt_kept, tgt_before, tgt_cut = self._side(targets, self.keep["tgt"])
        flags = src_cut.astype(np.uint8) | (tgt_cut.astype(np.uint8) << 1)
        stats = {
            "src_tokens_before_cut": int(src_before.sum()),
            "tgt_tokens_before_cut": int(tgt_before.sum()),
            "src_truncated": int(src_cut.sum()),
            "tgt_truncated": int(tgt_cut.sum()),
            "unk": int(np.count_nonzero(src_ids == self.unk) + np.count_nonzero(tgt_ids == self.unk)),
        }
        return TokenChunk(src_ids, src_kept, tgt_ids, tgt_kept, flags, stats)


_worker: ChunkEncoder | None = None
# the parent's handlers of these (train.py's stop request notes SIGTERM and goes on) must not outlive the fork: a
# worker that only noted the SIGTERM of the pool's terminate() kept the build, and the job, from ever ending
WORKER_DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: a worker ends with the process that forked it (a rank ended by os._exit, or kill -9,
    leaves no worker behind blocked on a pipe nobody reads)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _start_worker(parent: int, *args) -> None:
    global _worker
    for s in WORKER_DEFAULT_SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent stops the pool, no trace per worker
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
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
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


GZIP_RATIO = 10  # text rarely packs tighter: a .gz's blocks are estimated from its size x this


def worker_count(num_proc: int | None, file_bytes: int, block_bytes: int, gzipped: bool = False) -> int:
    """Worker processes for a file: --num_proc (default: default_num_proc), never more than its blocks could be (a
    worker without a block only costs its start-up: --num_proc 1000 forked 1000 workers for 3 blocks). build_store
    then reads that many blocks ahead and keeps one worker per block it found."""
    wanted = default_num_proc() if num_proc is None else int(num_proc)
    blocks = max(1, -(-file_bytes * (GZIP_RATIO if gzipped else 1) // block_bytes))
    return max(1, min(wanted, blocks))


def _with_fractions(blocks: LineBlocks) -> Iterator[tuple[bytes, int, float]]:
    """(block, first line number, fraction of the file read up to the block's end)."""
    for block, lineno in blocks:
        yield block, lineno, blocks.consumed / max(blocks.size, 1)


def _table_fractions(source, rows: int) -> Iterator[tuple[tuple, int, float]]:
    """A table's batches as blocks: ((sources, targets), first row, fraction of its rows read, 0 when unknown)."""
    total = source.num_rows
    for pairs, first in source.batches(rows):
        yield pairs, first, (first - 1 + len(pairs[0])) / total if total else 0.0


def _lost_worker(workers: list, name: str) -> UserError:
    """A worker died (kill -9, the out-of-memory killer, a crash): say how, from its exit status where known.
    `workers`: every worker process seen (a broken pool forgets its own, and SIGTERMs the rest: their -15 is not
    the news)."""
    # the pool's own thread reaps its workers too: a join that loses that race sees no status (ECHILD) until the
    # other thread records it on the same process object, so look again until each has one (2 s at most)
    deadline = time.monotonic() + 2
    while any(proc.exitcode is None for proc in workers) and time.monotonic() < deadline:
        for proc in workers:
            proc.join(timeout=0.05)
    codes = [-proc.exitcode for proc in workers if proc.exitcode is not None and proc.exitcode < 0]
    how = ""
    if codes:
        code = next((c for c in codes if c != signal.SIGTERM), codes[0])
        try:
            how = f" (killed by {signal.Signals(code).name}"
        except ValueError:
            how = f" (killed by signal {code}"
        how += ": kill -9, or the kernel's out-of-memory killer: see `dmesg`)" if code == signal.SIGKILL else ")"
    return UserError(
        f"a tokenizer worker process died while tokenizing {name}{how}; nothing was kept. Run again "
        f"(with fewer --num_proc if memory ran out)"
    )


def _encoded_chunks(
    blocks: Iterator[tuple[bytes, int, float]], encoder_args: tuple, workers: int
) -> Iterator[tuple[TokenChunk, float]]:
    """The blocks' TokenChunks in file order, each with its fraction (`_with_fractions`), from `workers` processes
    (1: this one), two blocks per worker in flight at most. A worker that dies ends the build (BrokenProcessPool;
    multiprocessing.Pool replaced a killed worker and waited forever for its block)."""
    if workers <= 1:
        encoder = ChunkEncoder(*encoder_args)
        for block, lineno, fraction in blocks:
            yield encoder(block, lineno), fraction
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    seen: dict = {}  # pid → worker process, for _lost_worker
    pool = ProcessPoolExecutor(
        workers,
        mp_context=_RecordingContext(multiprocessing.get_context(method), seen),
        initializer=_start_worker,
        initargs=(os.getpid(), *encoder_args),
    )
    try:
        pending: deque = deque()
        for block, lineno, read in blocks:
            # tokenizers warns (and turns its threads off) in a child forked after its threads ran; the workers
            # want one thread anyway, and this says so before the fork (the first submit forks them all)
            with _environment(TOKENIZERS_PARALLELISM="false"):
                pending.append((pool.submit(_encode_in_worker, block, lineno), read))
            if len(pending) >= 2 * workers:
                future, fraction = pending.popleft()
                yield future.result(), fraction
        while pending:
            future, fraction = pending.popleft()
            yield future.result(), fraction
    except BrokenProcessPool:
        raise _lost_worker(list(seen.values()), encoder_args[-1]) from None
    except BaseException:
        # a failed block (a bad line), a full disk, Ctrl-C: the blocks in the workers are of no use now, and each
        # would take seconds to finish (SIGTERM ends a worker: its handlers are the default ones)
        _stop_workers(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class _RecordingContext:
    """A multiprocessing context whose processes are recorded in `seen` as they start. The pool forks its workers
    one after another inside the first submit, and forgets them when it breaks: a worker killed during those forks
    was otherwise never seen, and the line named the SIGTERM the pool sent the others."""

    def __init__(self, context, seen: dict):
        class Recorded(context.Process):
            def start(self):
                super().start()
                seen[self.pid] = self

        self._context, self.Process = context, Recorded

    def __getattr__(self, name):
        return getattr(self._context, name)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    stop = getattr(pool, "terminate_workers", None)  # Python 3.14
    if stop is not None:
        stop()
        return
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        with contextlib.suppress(Exception):
            proc.terminate()


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
            from common.progress_bar import ProgressBar

            self.bar = ProgressBar(
                total=total,
                unit=" pairs",
                unit_scale=True,
                desc=f"tokenizing {self.name}",
                dynamic_ncols=True,
                file=sys.stderr,
                smoothing=0.1,
            )
        self.bar.total = total
        self.bar.update(pairs)

    def close(self, finished: bool = True) -> None:
        if self.bar is not None:
            if finished:  # (a build that stopped keeps its bar short of 100%)
                self.bar.total = self.bar.n
            self.bar.close()


def _file_state(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def _reading(tsv_path: Path, expected_sha256: str, num_proc, block_bytes, source, batch_rows):
    """(the worker processes, the (pieces, fraction) it reads, whether the input changed while read): a TSV in
    blocks of lines, hashed as read; a table in batches of rows."""
    if source is None or source.is_tsv:
        before = _file_state(tsv_path)
        block_bytes = block_bytes or BLOCK_BYTES
        blocks = LineBlocks(tsv_path, block_bytes)
        workers = worker_count(num_proc, blocks.size, block_bytes, is_gzip(tsv_path))  # (num_proc >= 1: checked)

        def changed() -> bool:
            return blocks.sha256 != expected_sha256 or _file_state(tsv_path) != before

        return workers, _with_fractions(blocks), changed
    before = source.state()
    rows = batch_rows or BATCH_ROWS
    total = source.num_rows
    wanted = default_num_proc() if num_proc is None else int(num_proc)
    workers = max(1, min(wanted, -(-total // rows))) if total else wanted

    def changed() -> bool:
        return source.state() != before

    return workers, _table_fractions(source, rows), changed


def build_store(
    tsv_path: Path,
    tokenizer_path: Path,
    vocab_size: int,
    src_len: int,
    tgt_len: int,
    final: Path,
    expected_sha256: str,
    num_proc: int | None = None,
    block_bytes: int | None = None,
    progress: bool = True,
    source=None,
    batch_rows: int | None = None,
) -> dict:
    """Tokenize `tsv_path` into a store at `final` (atomically). `expected_sha256`: the TSV hash the store's key
    was made from; the file is hashed again while read and must not differ. `source`: a table
    (preprocess.corpus_source.CorpusSource, not a TSV) read in batches of `batch_rows` rows instead; its files must
    keep their size, time and inode while read. Returns how it went: the worker processes (1: this process) and the
    chunks."""
    tsv_path = Path(tsv_path)
    dtype = token_dtype(vocab_size)
    if vocab_size > UINT16_IDS:
        print(
            f"note: the vocabulary of {tokenizer_path} has {vocab_size} ids, more than 16 bits hold: token ids "
            f"are stored as uint32 (4 bytes each instead of 2)",
            flush=True,
        )
    workers, read, changed = _reading(tsv_path, expected_sha256, num_proc, block_bytes, source, batch_rows)
    ahead = list(islice(read, workers)) if workers > 1 else []
    if len(ahead) < workers:
        workers = max(1, len(ahead))  # fewer blocks than workers: one worker each
    encoder_args = (str(tokenizer_path), src_len, tgt_len, dtype.name, str(tsv_path))
    bar = _Progress(progress, tsv_path.name)
    finished = False
    try:
        with (
            StoreWriter(final, dtype, str(tsv_path)) as writer,
            contextlib.closing(_encoded_chunks(chain(ahead, read), encoder_args, workers)) as chunks,
        ):
            count = 0
            for chunk, fraction in chunks:
                count += 1
                writer.append(chunk, fraction)
                bar.update(chunk.pairs, writer.pairs, fraction)
            if writer.pairs == 0:
                fail(f"{tsv_path}: file is empty" if source is None or source.is_tsv else f"{tsv_path}: no rows")
            if changed():
                fail(
                    f"{tsv_path} changed while it was being read (its contents, size or modification time differ "
                    f"from when this run started); let whatever writes it finish, then run again"
                )
            writer.commit(
                {
                    "src_len": src_len,
                    "tgt_len": tgt_len,
                    "vocab_size": vocab_size,
                    "source": str(tsv_path),
                    "source_sha256": expected_sha256,
                }
            )
        finished = True
    finally:
        bar.close(finished)
    return {"workers": workers, "chunks": count}
