"""A corpus or token store whose bytes changed while its size and modification time were kept is never trained on
as if it were the old one: a start samples 1 MiB of each file it takes on its record (a copy over the corpus with
`cp` + `touch -r` is hashed again at once, and gets its own store), and the full sha256 of those files, checked once
per job beside the first steps, stops the run in one line (an edit between the sampled places, ids changed in place
in the store) — after which the same command rebuilds what the file feeds. Real train.py processes on Multi30k."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from common.hashing import SAMPLE_BLOCK, file_sha256, sample_offsets
from preprocess.token_store import VERIFIED_FILE
from preprocess.tsv_digest import RECORDS
from tests.launch import run_train, train_flags
from tests.test_faults import one_error


def stores(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.is_dir() and p.name != RECORDS)


def gap(size: int) -> int:
    """An offset no sampled block covers (between the 10th and the 11th), where an edit keeps the sample."""
    offsets = sample_offsets(size)
    assert len(offsets) > 11, f"a file of {size} bytes is read whole: no gap"
    return (offsets[10] + SAMPLE_BLOCK + offsets[11]) // 2


def keep_stat(path: Path, edit) -> None:
    """`edit(path)` changes bytes in place; the size and times are then put back, as `touch -r` or os.utime do."""
    st = path.stat()
    edit(path)
    assert path.stat().st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def swap_letter(path: Path, offset: int) -> None:
    """Another letter at the first letter from `offset` (the TSV stays valid: no tab or newline touched)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(64)
        at = next(i for i, c in enumerate(data) if chr(c).isalpha())
        f.seek(offset + at)
        f.write(b"q" if data[at : at + 1] != b"q" else b"z")


def swap_id(path: Path, offset: int, dtype=np.uint16) -> None:
    """The token id at `offset` (rounded to an id) turned into another valid id (below the vocabulary)."""
    ids = np.memmap(path, dtype=dtype, mode="r+")
    i = offset // ids.itemsize
    ids[i] = ids[i] ^ 1 if ids[i] > 8 else ids[i] + 1
    ids.flush()
    del ids


@pytest.fixture
def tsv(multi30k_tsv, tmp_path) -> Path:
    path = tmp_path / "train.tsv"
    shutil.copyfile(multi30k_tsv, path)
    os.utime(path, ns=(1, 1_000_000_000))  # older than the records every run writes
    return path


def test_a_corpus_copied_over_with_its_size_and_time_kept_gets_its_own_store(tsv, bpe_tokenizer, tmp_path):
    """`cp other.tsv train.tsv; touch -r old train.tsv`: before, the record (size, time, inode) said "unchanged" and
    the old store was trained on; now the sample differs, the corpus is hashed again and a new store is built."""
    cache = tmp_path / "cache"
    run_train(1, train_flags(tsv, bpe_tokenizer, tmp_path / "a", "--steps", 1, cache=cache))
    other = tmp_path / "other.tsv"
    shutil.copyfile(tsv, other)
    swap_letter(other, 0)  # the first line: inside the sample's first block
    keep_stat(tsv, lambda path: shutil.copyfile(other, path))
    run_train(1, train_flags(tsv, bpe_tokenizer, tmp_path / "b", "--steps", 1, cache=cache))
    built = stores(cache)
    assert len(built) == 2, built
    sources = {json.loads((s / "meta.json").read_text())["source_sha256"] for s in built}
    assert file_sha256(tsv) in sources


@pytest.mark.parametrize("nproc", [1, 2])
def test_an_edit_between_the_sampled_places_stops_the_run_and_the_next_start_rebuilds(
    nproc, tsv, bpe_tokenizer, tmp_path
):
    """An in-place edit with os.utime, where the sample does not look: the start trusts the record, the full hash
    beside the steps finds the change and stops the run in one line naming the file and the fix (1 rank: at its
    last step, where every rank waits for the check; 2 ranks: after a step, the others stopped by the job watch).
    Before: trained to the end on the old store."""
    cache = tmp_path / "cache"
    layout = ["--mp", 2] if nproc == 2 else []
    run_train(nproc, train_flags(tsv, bpe_tokenizer, tmp_path / "a", "--steps", 1, *layout, cache=cache))
    keep_stat(tsv, lambda path: swap_letter(path, gap(path.stat().st_size)))
    steps = 3 if nproc == 2 else 1
    proc = run_train(
        nproc, train_flags(tsv, bpe_tokenizer, tmp_path / "b", "--steps", steps, *layout, cache=cache), check=False
    )
    line = one_error(
        proc, str(tsv.resolve()), "has changed since its sha256 was recorded", "Run the same command again"
    )
    assert line.startswith("error: stopped after step "), line
    if nproc == 2:
        return
    run_train(1, train_flags(tsv, bpe_tokenizer, tmp_path / "c", "--steps", 1, cache=cache))
    built = stores(cache)
    assert len(built) == 2 and file_sha256(tsv) in {
        json.loads((s / "meta.json").read_text())["source_sha256"] for s in built
    }, built


def test_store_ids_changed_with_size_and_time_kept_are_rebuilt_at_start(tsv, bpe_tokenizer, tmp_path):
    """Multi30k's store files are under 1 MiB: the sample is the whole file, so the start itself finds the id
    changed in place, says so and rebuilds. Before: trained on the changed ids."""
    cache = tmp_path / "cache"
    run_train(1, train_flags(tsv, bpe_tokenizer, tmp_path / "a", "--steps", 1, cache=cache))
    [store] = stores(cache)
    keep_stat(store / "src.tokens", lambda path: swap_id(path, 1000))
    proc = run_train(1, train_flags(tsv, bpe_tokenizer, tmp_path / "b", "--steps", 1, cache=cache))
    assert f"warning: token store {store}: src.tokens does not match the sha256 recorded" in proc.stdout, proc.stdout


def test_store_ids_changed_between_the_sampled_places_stop_the_run_and_the_store_is_rebuilt(
    multi30k_tsv, bpe_tokenizer, tmp_path
):
    """A store whose src.tokens is larger than the sample (Multi30k three times over: 1.9 MB): an id changed where
    the sample does not look is found by the full check beside the first step; the run stops naming the file, the
    verdict is dropped, and the next start hashes the store, finds the change and rebuilds it."""
    tsv, cache = tmp_path / "train3.tsv", tmp_path / "cache"
    tsv.write_bytes(multi30k_tsv.read_bytes() * 3)
    run_train(1, train_flags(tsv, bpe_tokenizer, tmp_path / "a", "--steps", 1, cache=cache))
    [store] = stores(cache)
    keep_stat(store / "src.tokens", lambda path: swap_id(path, gap(path.stat().st_size)))
    proc = run_train(1, train_flags(tsv, bpe_tokenizer, tmp_path / "b", "--steps", 1, cache=cache), check=False)
    one_error(proc, f"token store {store}: src.tokens does not match the sha256 recorded", "run the same command again")
    assert not (store / VERIFIED_FILE).exists()
    proc = run_train(1, train_flags(tsv, bpe_tokenizer, tmp_path / "c", "--steps", 1, cache=cache))
    assert f"warning: token store {store}: src.tokens does not match" in proc.stdout, proc.stdout
