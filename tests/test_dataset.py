"""preprocess.dataset: padded batches from the token store, the cache, seed fields and the layout-invariant batch
schedule (the store itself, its preprocessing and its failures: tests/test_data_store.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from common.errors import UserError
from preprocess.dataset import (
    GlobalBatchSchedule,
    TranslationDataset,
    count_target_tokens,
    dp_slice,
    micro_slices,
    seed_fields,
)
from preprocess.parallel import make_tsv
from preprocess.textio import read_tsv_pairs
from preprocess.token_store import TokenStore
from preprocess.tokenizer import load_tokenizer, train_tokenizer
from tests.launch import concurrently
from tests.progress import scaled


def padded(ds, rows=None):
    """(src, tgt_in, labels) as numpy arrays: the padded batch of `rows` (default: every pair)."""
    batch = ds.batch(np.arange(ds.num_samples) if rows is None else rows)
    return tuple(batch[k].numpy() for k in ("src_ids", "tgt_ids", "labels"))


def expected_rows(ds, tsv, i):
    """Row i as the contract builds it from a direct encode of the TSV line: src, tgt_in, labels."""
    tok = load_tokenizer(ds.tokenizer_path)
    sources, targets = read_tsv_pairs(tsv)
    s = tok.encode(sources[i], add_special_tokens=False).ids[: ds.src_len - 1]
    y = tok.encode(targets[i], add_special_tokens=False).ids[: ds.tgt_len - 1]
    pad_s, pad_t = ds.src_len - len(s) - 1, ds.tgt_len - len(y) - 1
    return (
        s + [ds.eos_id] + [ds.pad_id] * pad_s,
        [ds.bos_id] + y + [ds.pad_id] * pad_t,
        y + [ds.eos_id] + [ds.pad_id] * pad_t,
    )


def _check_layout(ds, tsv, rows):
    """Every listed row matches a direct encode: src/tgt_in/labels built as the contract says."""
    src, tgt_in, labels = padded(ds, rows)
    for k, i in enumerate(rows):
        assert (src[k].tolist(), tgt_in[k].tolist(), labels[k].tolist()) == expected_rows(ds, tsv, i)


def test_shapes_and_token_placement(multi30k_dataset_factory, multi30k_tsv):
    ds = multi30k_dataset_factory(32, 32)
    assert ds.num_samples == len(ds) == 29000
    assert (ds.pad_id, ds.unk_id, ds.bos_id, ds.eos_id, ds.vocab_size) == (0, 1, 2, 3, 8000)
    src, tgt_in, labels = padded(ds)
    for array, width in ((src, 32), (tgt_in, 32), (labels, 32)):
        assert array.shape == (29000, width) and array.dtype == np.int64
    assert (tgt_in[:, 0] == ds.bos_id).all()
    assert ((src == ds.eos_id).sum(axis=1) == 1).all()
    assert ((labels == ds.eos_id).sum(axis=1) == 1).all()
    # Teacher forcing: every target token in labels is the next decoder input.
    tokens = (labels[:, :-1] != ds.pad_id) & (labels[:, :-1] != ds.eos_id)
    assert (tgt_in[:, 1:][tokens] == labels[:, :-1][tokens]).all()
    assert ((tgt_in != ds.pad_id).sum(axis=1) == (labels != ds.pad_id).sum(axis=1)).all()
    assert [(a != ds.pad_id).sum(axis=1).tolist() for a in (src, labels)] == [x.tolist() for x in ds.real_lengths()]
    _check_layout(ds, multi30k_tsv, rows=[0, 1, 2, 14_500, 28_999])


def test_truncation(multi30k_dataset_factory, multi30k_tsv):
    ds = multi30k_dataset_factory(8, 6)
    src, tgt_in, labels = padded(ds)
    assert src.shape == (29000, 8) and tgt_in.shape == (29000, 6)
    long_src = np.flatnonzero(ds.src_truncated)
    long_tgt = np.flatnonzero(ds.tgt_truncated)
    assert len(long_src) > 1000 and len(long_tgt) > 1000
    assert (src[long_src, -1] == ds.eos_id).all() and (src[long_src] != ds.pad_id).all()
    assert (labels[long_tgt, -1] == ds.eos_id).all() and (tgt_in[long_tgt] != ds.pad_id).all()
    _check_layout(ds, multi30k_tsv, rows=[int(long_src[0]), int(long_tgt[0]), int(long_tgt[-1])])
    tok = load_tokenizer(ds.tokenizer_path)
    sources = read_tsv_pairs(multi30k_tsv)[0]
    cut = [len(e.ids) > 7 for e in tok.encode_batch(sources, add_special_tokens=False)]
    assert ds.src_truncated.tolist() == cut  # flagged exactly where the tokenizer overflows
    stats = ds.stats()
    assert stats["src_truncated_pct"] == pytest.approx(100 * len(long_src) / 29000)


def test_cold_build_then_cache_hit(multi30k_tsv, bpe_tokenizer, tmp_path):
    start = time.perf_counter()
    cold = TranslationDataset(multi30k_tsv, bpe_tokenizer, 24, 24, cache_dir=tmp_path, progress=False)
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    warm = TranslationDataset(multi30k_tsv, bpe_tokenizer, 24, 24, cache_dir=tmp_path, progress=False)
    warm_s = time.perf_counter() - start
    assert not cold.cache_hit and warm.cache_hit
    assert cold_s < scaled(20), f"cold tokenization of Multi30k train took {cold_s:.1f}s"
    assert warm_s < cold_s / 4, f"cache load {warm_s:.2f}s is not much faster than cold {cold_s:.2f}s"
    for a, b in zip(padded(cold), padded(warm)):
        np.testing.assert_array_equal(a, b)
    assert [p.name for p in tmp_path.iterdir()] == [cold.cache_path.name], "temporary folder left behind"
    # Any change of lengths (or TSV, or tokenizer) is a different cache entry.
    other = TranslationDataset(multi30k_tsv, bpe_tokenizer, 24, 16, cache_dir=tmp_path, progress=False)
    assert not other.cache_hit and other.cache_path != cold.cache_path


def test_default_cache_dir_and_stale_temp_is_ignored(multi30k_dir, bpe_tokenizer, tmp_path):
    tsv = tmp_path / "val.fr_en.tsv"
    make_tsv(multi30k_dir / "val.fr.gz", multi30k_dir / "val.en.gz", tsv)
    first = TranslationDataset(tsv, bpe_tokenizer, 16, 16, progress=False)
    assert first.cache_path.parent == tmp_path / ".tokcache"
    # What a killed run leaves behind: a temporary folder, never something under the final name.
    final = first.cache_path
    stale = final.parent / f".tmp-{final.name}-999-deadbeef"
    final.rename(stale)
    rebuilt = TranslationDataset(tsv, bpe_tokenizer, 16, 16, progress=False)
    assert not rebuilt.cache_hit and rebuilt.cache_path.is_dir()
    np.testing.assert_array_equal(padded(rebuilt)[0], padded(first)[0])
    # A changed TSV gets a new key even under the same name.
    tsv.write_text(tsv.read_text(encoding="utf-8") + "Un chat.\tA cat.\n", encoding="utf-8")
    grown = TranslationDataset(tsv, bpe_tokenizer, 16, 16, progress=False)
    assert not grown.cache_hit and grown.num_samples == 1015


def test_a_cache_with_missing_files_is_refused_alone_and_rebuilt_from_its_tsv(
    multi30k_dir, bpe_tokenizer, tmp_path, capsys
):
    """(Every other kind of damage: tests/test_data_store.py.)"""
    tsv = tmp_path / "val.fr_en.tsv"
    make_tsv(multi30k_dir / "val.fr.gz", multi30k_dir / "val.en.gz", tsv)
    built = TranslationDataset(tsv, bpe_tokenizer, 16, 16, progress=False)
    want = padded(built)
    for tokens in built.cache_path.glob("*.tokens"):
        tokens.unlink()
    with pytest.raises(
        UserError,
        match=r"src\.tokens cannot be read \(No such file or directory\); delete the "
        r"folder and run train\.py or python -m preprocess\.dataset with its TSV",
    ):
        TokenStore(built.cache_path)
    capsys.readouterr()
    rebuilt = TranslationDataset(tsv, bpe_tokenizer, 16, 16, progress=False)
    assert "src.tokens cannot be read (No such file or directory); rebuilding it from" in capsys.readouterr().out
    assert not rebuilt.cache_hit
    for got, expected in zip(padded(rebuilt), want):
        np.testing.assert_array_equal(got, expected)


def test_word_tokenizer_dataset_uses_eot(multi30k_dir, tmp_path):
    tsv = tmp_path / "val.fr_en.tsv"
    make_tsv(multi30k_dir / "val.fr.gz", multi30k_dir / "val.en.gz", tsv)
    word = train_tokenizer([tsv], tmp_path / "word", type="word")
    ds = TranslationDataset(tsv, word, 12, 12, progress=False)
    assert (ds.unk_id, ds.pad_id, ds.bos_id, ds.eos_id) == (0, 1, 2, 2)
    assert (padded(ds)[1][:, 0] == 2).all()
    _check_layout(ds, tsv, rows=[0, 500, 1013])


def test_batch_and_seed_fields(multi30k_dataset_factory, multi30k_tsv):
    ds = multi30k_dataset_factory(32, 32)
    idx = np.array([5, 0, 28_999, 77])
    batch = ds.batch(idx)
    assert set(batch) == {"src_ids", "tgt_ids", "labels"}
    for k, i in enumerate(idx):
        for key, row in zip(("src_ids", "tgt_ids", "labels"), expected_rows(ds, multi30k_tsv, i)):
            assert batch[key].dtype == torch.int64 and batch[key].shape == (4, 32)
            assert batch[key][k].tolist() == row
    # a negative index counts from the end (the filler rows of a last validation batch)
    assert torch.equal(ds.batch([-1])["src_ids"], ds.batch([28_999])["src_ids"])

    fields = seed_fields(batch, ds.pad_id)
    assert set(fields) == {
        "src_ids",
        "src_position",
        "src_mask",
        "tgt_ids",
        "tgt_position",
        "tgt_mask",
        "memory_mask",
        "label",
    }
    assert fields["src_mask"].shape == (4, 32, 32) and fields["tgt_mask"].shape == (4, 32, 32)
    assert fields["memory_mask"].shape == (4, 32, 32)
    assert torch.equal(fields["src_position"][2], torch.arange(32))
    assert torch.equal(fields["label"], batch["labels"])
    src_valid = (batch["src_ids"] != ds.pad_id).float()
    tgt_valid = (batch["tgt_ids"] != ds.pad_id).float()
    for b in range(4):
        n_src, n_tgt = int(src_valid[b].sum()), int(tgt_valid[b].sum())
        expected_src = torch.zeros(32, 32)
        expected_src[:n_src, :n_src] = 1
        assert torch.equal(fields["src_mask"][b], expected_src)
        expected_tgt = torch.zeros(32, 32)
        expected_tgt[:n_tgt, :n_tgt] = torch.tril(torch.ones(n_tgt, n_tgt))
        assert torch.equal(fields["tgt_mask"][b], expected_tgt)
        expected_mem = torch.zeros(32, 32)
        expected_mem[:n_tgt, :n_src] = 1
        assert torch.equal(fields["memory_mask"][b], expected_mem)


def test_count_target_tokens(multi30k_dataset_factory, multi30k_tsv, bpe_tokenizer):
    """The tokens the loss is normalised by, against the tokenizer itself: each target's tokens cut to tgt_len - 1,
    plus EOS (each source's likewise, plus EOS)."""
    ds = multi30k_dataset_factory(32, 32)
    batch = ds.batch(np.arange(10))
    tok = load_tokenizer(bpe_tokenizer)
    sources, targets = read_tsv_pairs(multi30k_tsv)

    def real(texts, length):
        return sum(min(len(tok.encode(t, add_special_tokens=False).ids), length - 1) + 1 for t in texts[:10])

    expected = real(targets, 32)
    assert count_target_tokens(batch["labels"], ds.pad_id) == expected
    assert count_target_tokens(batch["labels"].numpy(), ds.pad_id) == expected
    assert ds.target_tokens(np.arange(10)) == expected  # from the store's offsets
    assert ds.source_tokens(np.arange(10)) == real(sources, 32)
    assert count_target_tokens(np.array([[5, 3, 0, 0]]), 0) == 2


def test_bad_tsv_errors(multi30k_dir, bpe_tokenizer, tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_text("Un chat\tA cat\nsans tabulation\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"bad\.tsv:2: no tab"):
        TranslationDataset(bad, bpe_tokenizer, 16, 16, progress=False)
    assert not (tmp_path / ".tokcache").exists() or not any((tmp_path / ".tokcache").iterdir())
    with pytest.raises(UserError, match="tokenizer file not found"):
        TranslationDataset(bad, tmp_path / "none.json", 16, 16, progress=False)
    with pytest.raises(UserError, match="src_len=1"):
        TranslationDataset(bad, bpe_tokenizer, 1, 16, progress=False)


def test_cli_stats_and_error(run_module, assert_user_error, multi30k_tsv, bpe_tokenizer, tmp_path, multi30k_dir):
    tsv = tmp_path / "val.fr_en.tsv"
    make_tsv(multi30k_dir / "val.fr.gz", multi30k_dir / "val.en.gz", tsv)
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    help_result, result, error, shown, workers = concurrently(
        lambda: run_module("preprocess.dataset", "--help"),
        lambda: run_module(
            "preprocess.dataset",
            "--file_path",
            tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--src_len",
            32,
            "--tgt_len",
            32,
            "--no_progress",
        ),
        lambda: run_module(
            "preprocess.dataset", "--file_path", empty, "--tokenizer", bpe_tokenizer, "--src_len", 32, "--tgt_len", 32
        ),
        lambda: run_module(
            "preprocess.dataset",
            "--file_path",
            tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--src_len",
            16,
            "--tgt_len",
            16,
            "--cache_dir",
            tmp_path / "shown",
        ),
        lambda: run_module(
            "preprocess.dataset",
            "--file_path",
            tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--src_len",
            32,
            "--tgt_len",
            32,
            "--num_proc",
            0,
        ),
    )
    assert help_result.returncode == 0 and "--src_len" in help_result.stdout and "example" in help_result.stdout
    assert "--cache_dir" in help_result.stdout and "--num_proc" in help_result.stdout
    assert result.returncode == 0, result.stderr
    assert f"tokenized {tsv} in " in result.stdout and "samples 1014" in result.stdout
    assert "(uint16 ids)" in result.stdout and "real tokens x 2 bytes" in result.stdout
    assert_user_error(error, f"{empty}: file is empty")
    assert shown.returncode == 0 and "tokenizing val.fr_en.tsv" in shown.stderr and "pairs/s" in shown.stderr
    assert str(tmp_path / "shown") in shown.stdout
    assert_user_error(workers, "--num_proc 0 must be >= 1")


# -- the global batch schedule ----------------------------------------------------------------------------------


def test_same_seed_and_step_give_same_batch_whatever_else():
    a = GlobalBatchSchedule(1000, 64, seed=7)
    b = GlobalBatchSchedule(1000, 64, seed=7)
    for step in (0, 14, 15, 31, 200):  # b visits steps in another order: no hidden iterator state
        b.global_batch(step + 3)
    for step in (200, 0, 31, 15, 14):
        np.testing.assert_array_equal(a.global_batch(step), b.global_batch(step))
    assert a.global_batch(3).dtype == np.int64 and a.global_batch(3).shape == (64,)
    assert not np.array_equal(a.global_batch(3), GlobalBatchSchedule(1000, 64, seed=8).global_batch(3))


def test_each_epoch_is_a_permutation_and_epochs_differ():
    sched = GlobalBatchSchedule(96, 8, seed=3)
    assert sched.batches_per_epoch == 12
    epochs = []
    for epoch in range(3):
        steps = range(epoch * 12, (epoch + 1) * 12)
        assert {sched.epoch_of(s) for s in steps} == {epoch}
        order = np.concatenate([sched.global_batch(s) for s in steps])
        assert sorted(order.tolist()) == list(range(96))  # every sample exactly once per epoch
        epochs.append(order)
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    np.testing.assert_array_equal(epochs[1], np.random.default_rng([3, 1]).permutation(96))


def test_drop_last_within_epoch():
    sched = GlobalBatchSchedule(100, 30, seed=0)
    assert sched.batches_per_epoch == 3
    seen = np.concatenate([sched.global_batch(s) for s in range(3)])
    assert len(set(seen.tolist())) == 90
    assert sched.epoch_of(3) == 1


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_dp_and_micro_slices_rebuild_the_global_batch(dp, micro):
    sched = GlobalBatchSchedule(29000, 32, seed=1234)
    for step in (0, 905, 906):
        global_batch = sched.global_batch(step)
        pieces = []
        for rank in range(dp):
            shard = dp_slice(global_batch, rank, dp)
            assert len(shard) == 32 // dp
            micros = micro_slices(shard, micro)
            assert [len(m) for m in micros] == [32 // dp // micro] * micro
            pieces.extend(micros)
        np.testing.assert_array_equal(np.concatenate(pieces), global_batch)


def test_schedule_and_slice_errors():
    with pytest.raises(UserError, match="exceeds the 10 samples"):
        GlobalBatchSchedule(10, 11, seed=0)
    with pytest.raises(UserError, match="must be positive"):
        GlobalBatchSchedule(10, 0, seed=0)
    with pytest.raises(UserError, match="does not divide evenly over 4"):
        dp_slice(np.arange(6), 0, 4)
    with pytest.raises(UserError, match="dp_rank 2"):
        dp_slice(np.arange(8), 2, 2)
    with pytest.raises(UserError, match="does not divide into 4 equal micro-batches"):
        micro_slices(np.arange(6), 4)
