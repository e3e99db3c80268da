"""The token store (preprocess.token_store) and its streamed preprocessing (preprocess.store_builder): the round trip
against the tokenizer, memory mapping and pages shared between processes, chunked/parallel = one-shot, bad input
(a full disk, a TSV that changes while read, a folder that cannot be written, a vocabulary past 16 bits), an old
format never misread, --cache_dir with a read-only data folder, and the schedules at 10 M pairs. Padded batches from
the store against the contract: tests/test_dataset.py."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from common.errors import UserError
from common.hashing import file_sha256
from preprocess.dataset import GlobalBatchSchedule, TranslationDataset, cache_key
from preprocess.textio import read_tsv_pairs
from preprocess.token_batches import TokenBatchSchedule
from preprocess.token_store import FORMAT_VERSION, SIDES, TokenStore
from preprocess.tokenizer import load_tokenizer, train_tokenizer
from tests.launch import REPO_ROOT, TINY, concurrently, env, read_metrics, run_train
from tests.progress import scaled


def store_files(folder) -> dict:
    """The store's files, byte for byte (verified.json is a verdict about them, not data: its times differ)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "verified.json"}


def leftovers(folder) -> list:
    """Everything under `folder` (nothing may be left by a failed build, not even a temporary folder)."""
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# ------------------------------------------------------------------------------------------------ the store itself
def test_round_trip_equals_the_tokenizer_and_nothing_is_padded(val_tsv, bpe_tokenizer, tmp_path):
    ds = TranslationDataset(val_tsv, bpe_tokenizer, 16, 12, cache_dir=tmp_path, progress=False)
    tok = load_tokenizer(bpe_tokenizer)
    sources, targets = read_tsv_pairs(val_tsv)
    store = ds.store
    assert store.dtype == np.uint16 and ds.num_samples == len(sources) == 1014
    kept, kept_tokens = {"src": 15, "tgt": 11}, 0
    for side, texts in (("src", sources), ("tgt", targets)):
        encoded = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
        off, ids = store.offsets[side], store.tokens[side]
        for i, want in enumerate(encoded):
            assert ids[off[i] : off[i + 1]].tolist() == want[: kept[side]], (side, i)
        # no padding and no specials on disk: exactly the kept tokens, 2 bytes each
        total = sum(min(len(e), kept[side]) for e in encoded)
        kept_tokens += total
        assert (ds.cache_path / f"{side}.tokens").stat().st_size == 2 * total
        assert (ds.cache_path / f"{side}.offsets").stat().st_size == 8 * (len(texts) + 1)
        flagged = ds.src_truncated if side == "src" else ds.tgt_truncated
        assert flagged.tolist() == [len(e) > kept[side] for e in encoded]
    stats = ds.stats()
    assert stats["real_tokens"] == sum(int(x.sum()) for x in ds.real_lengths())
    # the documented size: 2 bytes a kept token, 17 bytes a pair (two int64 offsets, one flag byte), plus the
    # offsets' closing entries, meta.json and verified.json
    pairs = len(sources)
    assert stats["store_bytes"] == (
        2 * kept_tokens
        + 17 * pairs
        + 2 * 8
        + sum((ds.cache_path / name).stat().st_size for name in ("meta.json", "verified.json"))
    )


def test_two_builders_of_one_store_leave_the_first_one_and_nothing_else(tmp_path):
    """Two ranks (or nodes) that find no store build it at once: each writes its own temporary folder, the first
    rename wins, the second writer drops its copy; what stays is the first one's, whole, and no `.tmp-*`."""
    from preprocess.token_store import StoreWriter, TokenChunk

    def chunk(token: int) -> TokenChunk:
        return TokenChunk(
            np.full(3, token, np.uint16),
            np.array([3], np.int64),
            np.full(2, token, np.uint16),
            np.array([2], np.int64),
            np.zeros(1, np.uint8),
        )

    final = tmp_path / "store"
    first, second = StoreWriter(final, np.uint16, "a.tsv"), StoreWriter(final, np.uint16, "a.tsv")
    with first, second:
        first.append(chunk(7), 1.0)
        second.append(chunk(9), 1.0)
        first.commit({"src_len": 4, "tgt_len": 3, "vocab_size": 10})
        second.commit({"src_len": 4, "tgt_len": 3, "vocab_size": 10})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    store = TokenStore(final)
    assert store.pairs == 1 and store.tokens["src"].tolist() == [7, 7, 7] and store.tokens["tgt"].tolist() == [7, 7]


def test_the_store_is_memory_mapped_read_only(val_tsv, bpe_tokenizer, tmp_path):
    ds = TranslationDataset(val_tsv, bpe_tokenizer, 16, 16, cache_dir=tmp_path, progress=False)
    for side in SIDES:
        for array in (ds.store.tokens[side], ds.store.offsets[side]):
            assert isinstance(array, np.memmap) and not array.flags.writeable
    mapped = Path("/proc/self/maps").read_text() if os.path.exists("/proc/self/maps") else ""
    if mapped:
        for name in ("src.tokens", "tgt.tokens", "src.offsets", "tgt.offsets", "truncated.flags"):
            assert str(ds.cache_path / name) in mapped, name


SMAPS_CHILD = """
import sys
from pathlib import Path
sys.path.insert(0, {root!r})
from preprocess.token_store import TokenStore
store = TokenStore(sys.argv[1])
touched = sum(int(store.tokens[s].sum()) + int(store.offsets[s].sum()) for s in ("src", "tgt"))  # every page
print("ready", flush=True)
sys.stdin.readline()
"""


def mapping_figures(pid: int, path) -> dict:
    """/proc/PID/smaps: the kB figures of the mapping of `path`."""
    figures, inside = {}, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split()[0]
            if not first.endswith(":"):  # a mapping's header line
                inside = line.rstrip().endswith(str(path))
            elif inside and line.rstrip().endswith("kB"):
                figures[first[:-1]] = figures.get(first[:-1], 0) + int(line.split()[1])
    return figures


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/PID/smaps")
def test_two_processes_share_one_copy_of_the_store(multi30k_dataset_factory):
    """Two readers of the same store (as two ranks of a node) map the same page-cache pages: every resident page of
    the token files is shared, each process is charged half (PSS), and none is anonymous memory of its own."""
    ds = multi30k_dataset_factory(32, 32)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", SMAPS_CHILD.format(root=str(REPO_ROOT)), str(ds.cache_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for child in children:
            assert child.stdout.readline().strip() == "ready"
        for side in SIDES:
            path = ds.cache_path / f"{side}.tokens"
            size_kb = path.stat().st_size / 1024
            for child in children:
                f = mapping_figures(child.pid, path)
                assert f["Rss"] >= size_kb - 4, f  # all of it resident (the child read it all)
                assert f["Shared_Clean"] == f["Rss"], f  # ... every page shared with the other reader
                assert f["Pss"] <= f["Rss"] / 2 + 4, f  # ... and charged half to each
                assert f["Anonymous"] == 0 and f["Private_Dirty"] == 0, f
    finally:
        for child in children:
            child.stdin.close()
            child.wait(timeout=scaled(30))


def test_chunked_parallel_preprocessing_equals_one_shot(multi30k_tsv, bpe_tokenizer, tmp_path):
    """One process, one block vs two worker processes over ~60 blocks of 64 KiB (lengths that cut many pairs): the
    same bytes in every file of the store; a gzipped TSV gives the same ids too."""
    one = TranslationDataset(
        multi30k_tsv,
        bpe_tokenizer,
        12,
        12,
        cache_dir=tmp_path / "one",
        progress=False,
        num_proc=1,
        block_bytes=64 << 20,
    )
    chunked = TranslationDataset(
        multi30k_tsv,
        bpe_tokenizer,
        12,
        12,
        cache_dir=tmp_path / "chunked",
        progress=False,
        num_proc=2,
        block_bytes=64 << 10,
    )
    assert one.build_info == {"workers": 1, "chunks": 1}
    assert chunked.build_info["workers"] == 2 and chunked.build_info["chunks"] > 50
    assert store_files(one.cache_path) == store_files(chunked.cache_path)
    assert one.src_truncated.sum() > 1000 and one.tgt_truncated.sum() > 1000

    packed = tmp_path / "train.fr_en.tsv.gz"
    with gzip.open(packed, "wb") as f:
        f.write(multi30k_tsv.read_bytes())
    unpacked = TranslationDataset(
        packed, bpe_tokenizer, 12, 12, cache_dir=tmp_path / "gz", progress=False, num_proc=2, block_bytes=64 << 10
    )
    for name in ("src.tokens", "tgt.tokens", "src.offsets", "tgt.offsets", "truncated.flags"):
        assert (unpacked.cache_path / name).read_bytes() == (one.cache_path / name).read_bytes(), name


def test_a_bad_line_in_a_worker_is_one_error_naming_the_line(multi30k_tsv, bpe_tokenizer, tmp_path):
    bad = tmp_path / "bad.tsv"
    lines = multi30k_tsv.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[20_000] = "no tab here\n"
    bad.write_text("".join(lines), encoding="utf-8")
    with pytest.raises(UserError, match=r"bad\.tsv:20001: no tab"):
        TranslationDataset(
            bad, bpe_tokenizer, 12, 12, cache_dir=tmp_path / "c", progress=False, num_proc=2, block_bytes=64 << 10
        )
    assert leftovers(tmp_path / "c") == []


def test_vocabulary_past_16_bits_is_stored_in_32(tmp_path, capsys):
    tsv = tmp_path / "wide.tsv"
    tsv.write_text("".join(f"a{i} b{i} a{i + 1}\tc{i} d{i}\n" for i in range(20_000)), encoding="utf-8")
    tok_path = train_tokenizer([tsv], tmp_path / "word", type="word", vocab_size=90_000, min_frequency=1)
    ds = TranslationDataset(tsv, tok_path, 8, 8, cache_dir=tmp_path / "c", progress=False)
    assert ds.vocab_size > 65_536 and ds.store.dtype == np.uint32
    assert "stored as uint32" in capsys.readouterr().out
    tok = load_tokenizer(tok_path)
    sources, targets = read_tsv_pairs(tsv)
    high = 0
    for i in (0, 7_777, 19_999):
        batch = ds.batch([i])
        for key, text in (("src_ids", sources[i]), ("labels", targets[i])):
            want = tok.encode(text).ids
            assert batch[key][0].tolist()[: len(want)] == want
            high = max(high, *want)
    assert high > 65_535  # ids a uint16 would have wrapped, kept exactly


def test_an_old_format_cache_is_rebuilt_never_misread(val_tsv, bpe_tokenizer, tmp_path, capsys):
    old = tmp_path / f"{val_tsv.stem}-{cache_key(val_tsv, bpe_tokenizer, 16, 16, version=1)}"
    old.mkdir()
    (old / "state.json").write_text('{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}')  # format 1's
    ds = TranslationDataset(val_tsv, bpe_tokenizer, 16, 16, cache_dir=tmp_path, progress=False)
    assert FORMAT_VERSION == 3 and not ds.cache_hit and ds.cache_path != old and old.is_dir()
    # format 2 (no checksums) had its own key: never opened as format 3 either
    assert cache_key(val_tsv, bpe_tokenizer, 16, 16, version=2) not in ds.cache_path.name
    # a store that says another format under the current name is never read as this one: refused naming meta.json
    # when opened alone, rebuilt when its TSV is there
    meta = json.loads((ds.cache_path / "meta.json").read_text())
    (ds.cache_path / "meta.json").write_text(json.dumps({**meta, "format": 1}))
    with pytest.raises(UserError, match=r"meta\.json cannot be read \(names format 1, this code reads 3\); delete"):
        TokenStore(ds.cache_path)
    capsys.readouterr()
    again = TranslationDataset(val_tsv, bpe_tokenizer, 16, 16, cache_dir=tmp_path, progress=False)
    assert not again.cache_hit and json.loads((again.cache_path / "meta.json").read_text()) == meta
    assert "meta.json cannot be read (names format 1, this code reads 3); rebuilding it from" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------------ integrity
DATA_FILES = ("src.tokens", "src.offsets", "tgt.tokens", "tgt.offsets", "truncated.flags")  # hashed, in this order


def set_mtime(path, ns: int) -> None:
    os.utime(path, ns=(path.stat().st_atime_ns, ns))


def backdate(folder) -> None:
    """The data files' modification times of a store written a while ago, one millisecond apart in DATA_FILES
    order (a verdict written now is then later than all of them)."""
    base = time.time_ns() - 100 * 10**9
    for i, name in enumerate(DATA_FILES):
        set_mtime(folder / name, base + i * 10**6)


def write_at(path, index: int, value, dtype) -> None:
    """Overwrite item `index` of a store file of `dtype` items in place (same size)."""
    with open(path, "r+b") as f:
        f.seek(index * np.dtype(dtype).itemsize)
        f.write(np.array([value], dtype=dtype).tobytes())


def shift_a_boundary(folder) -> None:
    """Move one source boundary by a token: still a valid layout, but two pairs garbled (only the sha256 tells)."""
    off = np.fromfile(folder / "src.offsets", dtype=np.int64)
    i = int(np.flatnonzero(off[1:-1] < off[2:])[10]) + 1  # off[i] < off[i+1]: off[i] + 1 keeps the order
    write_at(folder / "src.offsets", i, off[i] + 1, np.int64)


def other_valid_id(folder) -> None:
    ids = np.fromfile(folder / "tgt.tokens", dtype=np.uint16)
    write_at(folder / "tgt.tokens", 100, (int(ids[100]) + 1) % 8000, np.uint16)


def flip_offset_bytes(folder) -> None:
    """Flipped bytes in the middle of the offsets (the issue's damage): a huge offset, then a decrease."""
    with open(folder / "src.offsets", "r+b") as f:
        f.seek(500 * 8 + 6)
        f.write(b"\xff\x0f")


def truncate(name: str, keep: int):
    def damage(folder):
        (folder / name).write_bytes((folder / name).read_bytes()[:keep])

    return damage


DAMAGES = {  # name: (damage, the file named, how its damage is said, found without the sha256)
    "a token changed to another valid id": (
        other_valid_id,
        "tgt.tokens",
        "does not match the sha256 recorded when the store was built",
        False,
    ),
    "a pair boundary moved by one token": (
        shift_a_boundary,
        "src.offsets",
        "does not match the sha256 recorded when the store was built",
        False,
    ),
    "a truncation flag flipped": (
        lambda f: write_at(f / "truncated.flags", 3, 2, np.uint8),
        "truncated.flags",
        "does not match the sha256 recorded when the store was built",
        False,
    ),
    "flipped offset bytes": (flip_offset_bytes, "src.offsets", "decreases at pair 500", True),
    "an id past the vocabulary": (
        lambda f: write_at(f / "tgt.tokens", 7, 65535, np.uint16),
        "tgt.tokens",
        "holds id 65535 (first past the vocabulary at token 7), but the vocabulary has 8000 ids",
        True,
    ),
    "a tokens file cut short": (truncate("src.tokens", 10), "src.tokens", "holds 10 bytes, ", True),
    "an offsets file cut short": (truncate("tgt.offsets", 16), "tgt.offsets", "holds 16 bytes, 8120 expected", True),
    "the last offset changed": (
        lambda f: write_at(f / "tgt.offsets", 1014, 5, np.int64),
        "tgt.offsets",
        "runs from 0 to 5, not from 0 to the",
        True,
    ),
    "meta.json deleted": (lambda f: (f / "meta.json").unlink(), "meta.json", "cannot be read", True),
}


@pytest.fixture
def store(val_tsv, bpe_tokenizer, tmp_path):
    """A freshly built store of val (1,014 pairs) in tmp_path, its files as built."""
    ds = TranslationDataset(val_tsv, bpe_tokenizer, 16, 16, cache_dir=tmp_path, progress=False)
    return ds.cache_path, {name: (ds.cache_path / name).read_bytes() for name in (*DATA_FILES, "meta.json")}


def test_every_file_is_recorded_with_its_sha256_as_written(store):
    folder, _ = store
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["sha256"] == {name: file_sha256(folder / name) for name in DATA_FILES}
    verdict = json.loads((folder / "verified.json").read_text())
    assert verdict["sha256"] == meta["sha256"] and sorted(verdict["files"]) == sorted(DATA_FILES)


@pytest.mark.parametrize("case", DAMAGES)
def test_a_damaged_store_opened_without_its_tsv_is_refused_naming_the_file(case, store, val_tsv):
    """TokenStore alone has no TSV to rebuild from: one line naming the file, how it is damaged and the fix. Damage
    the structural checks see is refused even when the file keeps its size and modification time (a verdict
    recorded earlier would vouch for it) and by the ranks that do not hash (verify=False)."""
    folder, _ = store
    backdate(folder)
    TokenStore(folder)  # verified: a verdict for every file, as they are
    damage, name, reason, structural = DAMAGES[case]
    before = {n: (folder / n).stat().st_mtime_ns for n in DATA_FILES}
    damage(folder)
    if structural:
        for n, ns in before.items():
            if (folder / n).exists():
                set_mtime(folder / n, ns)  # the verdict still matches: no hash will look
    for verify in (True, False) if structural else (True,):
        with pytest.raises(UserError) as err:
            TokenStore(folder, verify=verify)
        message = str(err.value)
        assert message.startswith(f"token store {folder}: {name} {reason}"), message
        assert message.endswith(
            "delete the folder and run train.py or python -m preprocess.dataset with "
            + (
                f"its TSV ({val_tsv}), which rebuild it"
                if name != "meta.json"
                else "the TSV it was built from, which rebuild it"
            )
        ), message


@pytest.mark.parametrize("case", DAMAGES)
def test_a_damaged_store_is_rebuilt_from_its_tsv_saying_why(case, store, val_tsv, bpe_tokenizer, tmp_path, capsys):
    """With the TSV there (train.py, preprocess.dataset), the store is rebuilt, byte for byte what it was, after a
    line naming the damaged file; the damaged copy is not left behind."""
    folder, built = store
    damage, name, reason, _ = DAMAGES[case]
    damage(folder)
    capsys.readouterr()
    ds = TranslationDataset(val_tsv, bpe_tokenizer, 16, 16, cache_dir=tmp_path, progress=False)
    out = capsys.readouterr().out
    assert f"warning: token store {folder}: {name} {reason}" in out and f"; rebuilding it from {val_tsv}" in out
    assert not ds.cache_hit and ds.cache_path == folder and ds.num_samples == 1014
    assert {n: (folder / n).read_bytes() for n in built} == built
    assert leftovers(tmp_path) == [folder.name]  # no .damaged-* or .tmp-* folder


def test_an_unchanged_store_is_hashed_once(store, val_tsv, bpe_tokenizer, tmp_path, monkeypatch):
    """The verdict (verified.json) spares every later open the hashing; a file whose modification time changed is
    hashed again, alone; a verdict no later than a file's time is not trusted (a change within the same clock tick
    keeps the time); a node's other ranks (verify=False) never hash."""
    import preprocess.token_store as token_store

    hashed = []

    def counting(path):
        hashed.append(os.path.basename(path))
        return file_sha256(path)

    monkeypatch.setattr(token_store, "file_sha256", counting, raising=False)
    folder, _ = store
    backdate(folder)  # the writer's verdict no longer matches the times
    TokenStore(folder)
    assert sorted(hashed) == sorted(DATA_FILES)
    hashed.clear()
    assert TokenStore(folder).hashed == [] and hashed == []
    again = TranslationDataset(val_tsv, bpe_tokenizer, 16, 16, cache_dir=tmp_path, progress=False)
    assert again.cache_hit and hashed == []
    set_mtime(folder / "verified.json", (folder / "truncated.flags").stat().st_mtime_ns)  # racy for that file
    assert TokenStore(folder).hashed == ["truncated.flags"] == hashed
    hashed.clear()
    (folder / "src.tokens").write_bytes((folder / "src.tokens").read_bytes())  # rewritten: a new time
    assert TokenStore(folder).hashed == ["src.tokens"] == hashed
    hashed.clear()
    (folder / "verified.json").unlink()
    assert TokenStore(folder, verify=False).hashed == [] and hashed == []


def test_a_damaged_store_that_cannot_be_rebuilt_in_place_is_one_line(val_tsv, bpe_tokenizer, tmp_path):
    with Tmpfs(tmp_path / "ro", "64m") as disk:
        tsv = disk.path / val_tsv.name
        shutil.copy(val_tsv, tsv)
        folder = TranslationDataset(tsv, bpe_tokenizer, 16, 16, progress=False).cache_path
        shift_a_boundary(folder)
        disk.read_only()
        with pytest.raises(
            UserError,
            match=r"src\.offsets does not match the sha256 recorded when the store was "
            r"built, and it cannot be rebuilt there \(Read-only file system\); "
            r"pass --cache_dir DIR",
        ):
            TranslationDataset(tsv, bpe_tokenizer, 16, 16, progress=False)
        ds = TranslationDataset(tsv, bpe_tokenizer, 16, 16, cache_dir=tmp_path / "c", progress=False)
        assert ds.num_samples == 1014
        del ds


def test_train_py_rebuilds_a_damaged_store_before_training(multi30k_tsv, bpe_tokenizer, tmp_path):
    """The issue's case: a prepared store whose offsets have flipped bytes. train.py (local rank 0 verifies) says
    which file, rebuilds the store from the TSV, and trains on the real pairs."""
    cache = tmp_path / "cache"
    folder = TranslationDataset(multi30k_tsv, bpe_tokenizer, 12, 12, cache_dir=cache, progress=False).cache_path
    flip_offset_bytes(folder)
    proc = run_train(
        1,
        [
            "--file_path",
            multi30k_tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--cache_dir",
            cache,
            "--output_dir",
            tmp_path / "out",
            *TINY,
            "--steps",
            1,
        ],
    )
    assert f"warning: token store {folder}: src.offsets decreases at pair 500" in proc.stdout, proc.stdout[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1]
    TokenStore(folder)  # whole again


# ----------------------------------------------------------------------------------------------------- bad input
def test_a_tsv_that_changes_while_read_is_refused(val_tsv, bpe_tokenizer, tmp_path):
    """The store's key was made from the TSV's hash; the file then grows (another program still writing it): the
    hash computed while reading differs, and nothing is left under any name."""
    tsv = tmp_path / "growing.tsv"
    shutil.copy(val_tsv, tsv)
    key_hash = file_sha256(tsv)
    with open(tsv, "a", encoding="utf-8") as f:
        f.write("Un chat.\tA cat.\n")
    with pytest.raises(UserError, match=r"growing\.tsv changed while it was being read"):
        TranslationDataset(tsv, bpe_tokenizer, 16, 16, cache_dir=tmp_path / "c", progress=False, tsv_sha256=key_hash)
    assert leftovers(tmp_path / "c") == []


class Tmpfs:
    """A small tmpfs of our own at `path` (root may mount one; elsewhere the test is skipped), unmounted after."""

    def __init__(self, path, size: str):
        self.path, self.size, self.mounted = path, size, False

    def __enter__(self):
        self.path.mkdir()
        if (
            os.geteuid() != 0
            or subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.path)], capture_output=True
            ).returncode
            != 0
        ):
            pytest.skip("needs root's permission to mount a small tmpfs")
        self.mounted = True
        return self

    def read_only(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True)

    def __exit__(self, *exc):
        if self.mounted and subprocess.run(["umount", str(self.path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(self.path)], check=True)  # still mapped somewhere: detach it


def test_a_store_larger_than_the_disk_stops_early_and_leaves_nothing(multi30k_tsv, bpe_tokenizer, tmp_path):
    """A 1 MiB disk for a ~2 MB store: after the first 64 KiB of TSV the projected size is over the free space, so
    the build stops then (not at a full disk), names what it needs, and removes what it wrote."""
    with Tmpfs(tmp_path / "small", "1m") as disk:
        with pytest.raises(
            UserError,
            match=r"the token store for .*train\.fr_en\.tsv needs about 2\.\d MB but "
            r".*small has .* free; free space there or pass --cache_dir DIR",
        ):
            TranslationDataset(
                multi30k_tsv,
                bpe_tokenizer,
                32,
                32,
                cache_dir=disk.path,
                progress=False,
                num_proc=1,
                block_bytes=64 << 10,
            )
        assert leftovers(disk.path) == []


def test_a_write_that_runs_out_of_room_is_one_line_and_leaves_nothing(
    multi30k_tsv, bpe_tokenizer, tmp_path, assert_user_error
):
    """The disk has room by its free space, but a write still fails (here the file-size limit: EFBIG, as ENOSPC
    or a quota would): one line, no traceback, nothing left in the cache folder."""
    limit = 256 << 10
    cache = tmp_path / "c"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "preprocess.dataset",
            "--file_path",
            str(multi30k_tsv),
            "--tokenizer",
            str(bpe_tokenizer),
            "--src_len",
            "32",
            "--tgt_len",
            "32",
            "--cache_dir",
            str(cache),
            "--no_progress",
            "--num_proc",
            "1",
        ],
        cwd=REPO_ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=scaled(120),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )
    assert_user_error(proc, "file too large", "writing the token store for", "pass --cache_dir DIR")
    assert leftovers(cache) == []


@contextlib.contextmanager
def read_only_data_folder(tmp_path, tsv):
    """A data folder holding `tsv` that this process cannot write: a tmpfs remounted read-only (root), or a folder
    without write permission (anyone else)."""
    if os.geteuid() != 0:
        folder = tmp_path / "ro"
        folder.mkdir()
        shutil.copy(tsv, folder / tsv.name)
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)
        return
    with Tmpfs(tmp_path / "ro", "64m") as disk:
        shutil.copy(tsv, disk.path / tsv.name)
        yield disk


def test_a_folder_that_cannot_be_written_is_one_line(val_tsv, bpe_tokenizer, tmp_path, run_module, assert_user_error):
    with read_only_data_folder(tmp_path, val_tsv) as data:
        folder = getattr(data, "path", data)
        tsv = folder / val_tsv.name
        if isinstance(data, Tmpfs):  # a store prepared before the folder became read-only...
            TranslationDataset(tsv, bpe_tokenizer, 24, 24, progress=False)
            data.read_only()
            ready = TranslationDataset(tsv, bpe_tokenizer, 24, 24, progress=False)
            assert ready.cache_hit and ready.num_samples == 1014  # ... is read without writing anything
            del ready  # (its maps would keep the tmpfs busy)
        error = run_module(
            "preprocess.dataset",
            "--file_path",
            tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--src_len",
            16,
            "--tgt_len",
            16,
            "--no_progress",
        )
        assert_user_error(error, f"cannot write the token store under {folder / '.tokcache'}", "pass --cache_dir DIR")
        elsewhere = TranslationDataset(tsv, bpe_tokenizer, 16, 16, cache_dir=tmp_path / "c", progress=False)
        assert not elsewhere.cache_hit and elsewhere.num_samples == 1014


def test_train_py_with_a_read_only_data_folder_needs_and_takes_cache_dir(
    multi30k_tsv, bpe_tokenizer, tmp_path, assert_user_error
):
    """Without --cache_dir: one line naming the flag, for the store and for a tokenizer train.py would build; with
    it, the tokenizer (auto-built here) and the store go there and training runs."""
    with read_only_data_folder(tmp_path, multi30k_tsv) as data:
        folder = getattr(data, "path", data)
        if isinstance(data, Tmpfs):
            data.read_only()
        tsv = folder / multi30k_tsv.name
        cache = tmp_path / "cache"
        refused, no_tokenizer, trained = concurrently(
            lambda: run_train(
                1,
                ["--file_path", tsv, "--tokenizer", bpe_tokenizer, "--output_dir", tmp_path / "a", *TINY, "--steps", 1],
                check=False,
            ),
            lambda: run_train(
                1, ["--file_path", tsv, "--output_dir", tmp_path / "c", *TINY, "--steps", 1], check=False
            ),
            lambda: run_train(
                1,
                ["--file_path", tsv, "--cache_dir", cache, "--output_dir", tmp_path / "b", *TINY, "--steps", 2],
                check=False,
            ),
        )
    assert_user_error(refused, "cannot write the token store under", "pass --cache_dir DIR")
    assert_user_error(no_tokenizer, f"cannot write the tokenizer to {folder / '.tokcache'}", "--cache_dir DIR")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [1, 2]
    built = sorted(p.name.split("-")[0] for p in cache.iterdir())
    # the tokenizer, the store and the TSV's digest record (preprocess.tsv_digest), all in the cache
    assert built == ["bpe8000", "train.fr_en", "tsv"], built


# --------------------------------------------------------------------------------------------- schedules at scale
def test_schedules_for_10_million_pairs(tmp_path):
    """Both schedules over 10 M pairs of WMT-like lengths (no timing asserted; benchmarks/data_scale.py times them):
    token batches within the budget, each pair at most once an epoch, only a remainder left out."""
    n = 10_000_000
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(2, 129, n, dtype=np.int32), rng.integers(2, 129, n, dtype=np.int32)
    sched = TokenBatchSchedule(src, tgt, 4096, 16, seed=1, src_len=128, tgt_len=128)
    stats = sched.stats()
    assert stats["pairs"] == n // 16 * 16 and stats["min_pairs"] % 16 == 0
    seen = np.concatenate([sched.global_batch(k) for k in range(sched.batches_per_epoch)])
    assert len(seen) == stats["pairs"] and len(np.unique(seen)) == len(seen)
    for k in (0, 1, sched.batches_per_epoch // 2, sched.batches_per_epoch - 1):
        idx, (s, t) = sched.global_batch(k), sched.shape(k)
        assert len(idx) * max(s, t) <= 4096 and src[idx].max() <= s and tgt[idx].max() <= t
    fixed = GlobalBatchSchedule(n, 4096, seed=1)
    first = fixed.global_batch(0)
    assert len(first) == 4096 and len(np.unique(first)) == 4096 and first.max() < n
    np.testing.assert_array_equal(
        fixed.global_batch(fixed.batches_per_epoch - 1),
        np.random.default_rng([1, 0]).permutation(n)[
            (fixed.batches_per_epoch - 1) * 4096 : fixed.batches_per_epoch * 4096
        ],
    )
