"""--file_path beyond a TSV (preprocess.corpus_source): a datasets save_to_disk folder (Dataset or DatasetDict, plain
columns or a `translation` column of {lang: text}), .jsonl/.json/.csv/.parquet files. Each builds the token store
of the TSV of the same Multi30k pairs id for id; a changed column or split choice never reuses another choice's
store; user mistakes end in one line; a table is tokenized in row batches; train.py trains from a folder and from
JSONL, its tokenizer built from them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from common.errors import UserError
from common.text_lines import read_lines
from preprocess.corpus_source import CorpusOptions, open_corpus, read_pairs
from preprocess.dataset import TranslationDataset
from tests.launch import REPO_ROOT, TINY, read_metrics, run_train

datasets = pytest.importorskip("datasets")

PAIRS = 3000
FIELDS = CorpusOptions(src_field="english", tgt_field="french")
LANGS = CorpusOptions(src_lang="en", tgt_lang="fr")


@pytest.fixture(scope="module")
def pairs() -> tuple[list[str], list[str]]:
    data = REPO_ROOT / "data" / "multi30k"
    return read_lines(data / "train.en.gz")[:PAIRS], read_lines(data / "train.fr.gz")[:PAIRS]


def translation_dict(en, fr):
    return datasets.Dataset.from_dict({"translation": [{"en": a, "fr": b} for a, b in zip(en, fr, strict=True)]})


@pytest.fixture(scope="module")
def corpora(pairs, tmp_path_factory):
    """The same pairs as a TSV (English<TAB>French) and in every table format."""
    en, fr = pairs
    root = tmp_path_factory.mktemp("corpora")
    (root / "pairs.tsv").write_text(
        "".join(f"{a.strip()}\t{b.strip()}\n" for a, b in zip(en, fr, strict=True)), encoding="utf-8"
    )
    table = datasets.Dataset.from_dict({"id": list(range(len(en))), "english": en, "french": fr})
    table.to_json(str(root / "pairs.jsonl"))
    (root / "pairs.json").write_text(json.dumps(table.to_list(), ensure_ascii=False), encoding="utf-8")  # one array
    table.to_csv(str(root / "pairs.csv"), index=False)
    table.to_parquet(str(root / "pairs.parquet"))
    table.save_to_disk(str(root / "plain"))
    datasets.DatasetDict(
        {"train": translation_dict(en, fr), "validation": translation_dict(en[:40], fr[:40])}
    ).save_to_disk(str(root / "wmt"))
    return root


@pytest.fixture(scope="module")
def tokenizer(corpora):
    from preprocess.tokenizer import train_tokenizer

    return train_tokenizer([corpora / "pairs.tsv"], corpora / "bpe", vocab_size=1000)


def store(path, tokenizer, cache, corpus=None, **kw) -> TranslationDataset:
    return TranslationDataset(path, tokenizer, 16, 16, cache_dir=cache, progress=False, corpus=corpus, **kw)


@pytest.mark.parametrize(
    "name,corpus",
    [
        ("pairs.jsonl", FIELDS),
        ("pairs.json", FIELDS),
        ("pairs.csv", FIELDS),
        ("pairs.parquet", FIELDS),
        ("plain", FIELDS),
        ("wmt", LANGS),
    ],
)
def test_each_format_builds_the_store_of_the_same_pairs_as_tsv(corpora, tokenizer, tmp_path, name, corpus):
    tsv = store(corpora / "pairs.tsv", tokenizer, tmp_path)
    table = store(corpora / name, tokenizer, tmp_path, corpus)
    assert len(table) == len(tsv) == PAIRS
    assert table.cache_path != tsv.cache_path
    every = np.arange(PAIRS)
    mine, theirs = table.batch(every), tsv.batch(every)
    for key in theirs:
        assert np.array_equal(mine[key].numpy(), theirs[key].numpy()), key
    assert table.stats() == {**tsv.stats(), "store_bytes": table.stats()["store_bytes"]}


def test_another_column_or_split_choice_builds_another_store(corpora, tokenizer, tmp_path):
    forward = store(corpora / "wmt", tokenizer, tmp_path, LANGS)
    again = store(corpora / "wmt", tokenizer, tmp_path, LANGS)
    assert again.cache_hit and again.cache_path == forward.cache_path
    backward = store(corpora / "wmt", tokenizer, tmp_path, CorpusOptions(src_lang="fr", tgt_lang="en"))
    assert backward.cache_path != forward.cache_path and not backward.cache_hit
    assert np.array_equal(backward.batch([0])["labels"][0, :5], forward.batch([0])["src_ids"][0, :5])
    valid = store(corpora / "wmt", tokenizer, tmp_path, CorpusOptions(src_lang="en", tgt_lang="fr", split="validation"))
    assert len(valid) == 40 and valid.cache_path != forward.cache_path
    swapped = store(corpora / "plain", tokenizer, tmp_path, CorpusOptions(src_field="french", tgt_field="english"))
    assert swapped.cache_path != store(corpora / "plain", tokenizer, tmp_path, FIELDS).cache_path


def test_a_changed_arrow_file_is_not_read_from_the_old_store(pairs, tokenizer, tmp_path):
    en, fr = pairs
    folder = tmp_path / "data"
    datasets.Dataset.from_dict({"english": en[:100], "french": fr[:100]}).save_to_disk(str(folder / "a"))
    first = store(folder / "a", tokenizer, tmp_path / "cache", FIELDS)
    datasets.Dataset.from_dict({"english": en[100:200], "french": fr[100:200]}).save_to_disk(str(folder / "b"))
    (folder / "a").rename(folder / "old")
    (folder / "b").rename(folder / "a")
    second = store(folder / "a", tokenizer, tmp_path / "cache", FIELDS)
    assert not second.cache_hit and second.cache_path != first.cache_path


def test_a_table_is_tokenized_in_row_batches_not_read_whole(pairs, tokenizer, tmp_path):
    """20,000 rows in batches of 1,000: 20 chunks reach the store writer, none holds more than 1,000 rows (a reader
    that loaded the table whole would hand over one)."""
    en, fr = pairs
    rows = 20_000
    picks = np.random.default_rng(0).integers(0, len(en), size=rows)
    path = tmp_path / "big.parquet"
    datasets.Dataset.from_dict({"english": [en[i] for i in picks], "french": [fr[i] for i in picks]}).to_parquet(
        str(path), batch_size=1000
    )
    source = open_corpus(path, FIELDS)
    sizes = [len(src) for (src, _), _ in source.batches(1000)]
    assert max(sizes) <= 1000 and sum(sizes) == rows
    built = store(path, tokenizer, tmp_path, FIELDS, batch_rows=1000, num_proc=1)
    assert built.build_info == {"workers": 1, "chunks": rows // 1000}
    assert len(built) == rows


def test_validation_bleu_reads_the_validation_split_pairs(corpora, pairs):
    sources, references = read_pairs(
        corpora / "wmt", CorpusOptions(src_lang="en", tgt_lang="fr", default_split="validation"), "--valid_file"
    )
    assert sources == [s.strip() for s in pairs[0][:40]] and references == [t.strip() for t in pairs[1][:40]]


# ------------------------------------------------------------------------------------------------- one-line errors
def bad(path, corpus, *needles):
    with pytest.raises(UserError) as info:
        source = open_corpus(path, corpus)
        source.identity()
        for _ in source.batches():
            pass
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_errors_name_what_is_there(corpora, tmp_path, pairs):
    bad(
        corpora / "pairs.jsonl",
        CorpusOptions(src_field="en", tgt_field="french"),
        "no column 'en' (--src_field)",
        "its columns: id, english, french",
    )
    bad(corpora / "pairs.parquet", None, "--src_field and --tgt_field", "english, french")
    bad(
        corpora / "wmt",
        CorpusOptions(src_lang="en", tgt_lang="fr", split="test"),
        "no split 'test'",
        "its splits: train, validation",
        "--split",
    )
    bad(
        corpora / "wmt",
        CorpusOptions(src_lang="en", tgt_lang="de"),
        "no language 'de' (--tgt_lang)",
        "languages present: en, fr",
    )
    bad(corpora / "wmt", None, "pass --src_lang and --tgt_lang", "en, fr")
    en, fr = pairs
    (tmp_path / "holes.jsonl").write_text(
        '{"english": "a dog", "french": "un chien"}\n{"english": "a cat", "french": "  "}\n', encoding="utf-8"
    )
    bad(tmp_path / "holes.jsonl", FIELDS, "row 2: empty target side (column 'french')")
    ragged = datasets.Dataset.from_list(
        [{"translation": {"en": "a", "fr": "b"}}, {"translation": {"en": "c", "de": "d"}}]
    )
    ragged.save_to_disk(str(tmp_path / "ragged"))
    bad(tmp_path / "ragged", LANGS, "row 2", "'fr'")
    (tmp_path / "pairs.xlsx").write_bytes(b"PK\x03\x04 not text")
    bad(tmp_path / "pairs.xlsx", None, "unknown extension '.xlsx'", ".jsonl")
    (tmp_path / "folder").mkdir()
    bad(tmp_path / "folder", None, "not one written by datasets' save_to_disk")


def test_cli_errors_are_one_line(corpora, tokenizer, run_module, assert_user_error, tmp_path, monkeypatch):
    common = ["--tokenizer", tokenizer, "--src_len", 16, "--tgt_len", 16, "--cache_dir", tmp_path, "--no_progress"]
    assert_user_error(
        run_module(
            "preprocess.dataset",
            "--file_path",
            corpora / "wmt",
            "--split",
            "test",
            "--src_lang",
            "en",
            "--tgt_lang",
            "fr",
            *common,
        ),
        "no split 'test'",
        "train, validation",
    )
    assert_user_error(
        run_module("preprocess.dataset", "--file_path", corpora / "pairs.jsonl", *common),
        "--src_field and --tgt_field",
        "english, french",
    )
    (tmp_path / "broken.jsonl").write_text('{"english": "a", "french": "b"}\n{"english": "c", "fren\n')
    assert_user_error(
        run_module(
            "preprocess.dataset",
            "--file_path",
            tmp_path / "broken.jsonl",
            "--src_field",
            "english",
            "--tgt_field",
            "french",
            *common,
        ),
        "broken.jsonl: cannot be read as jsonl",
    )
    # a Hub name without the network: at once, naming the fix (not half a minute of retries and a traceback). Offline
    # said outright, so that a machine with the network does not download wmt14 here; without it (this machine) the
    # one connection attempt gives the same line
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = run_module(
        "preprocess.dataset",
        "--file_path",
        "wmt14",
        "--dataset_config",
        "fr-en",
        "--src_lang",
        "fr",
        "--tgt_lang",
        "en",
        *common,
    )
    assert_user_error(hub, "wmt14", "network", "save_to_disk", "--file_path DIR")


# ------------------------------------------------------------------------------------------------ train.py, end to end
def train_from(tmp_path, *data_flags):
    out = tmp_path / "run"
    run_train(
        1,
        [
            *data_flags,
            "--tokenizer_vocab_size",
            "500",
            "--cache_dir",
            tmp_path / "cache",
            "--output_dir",
            out,
            *TINY,
            "--steps",
            "20",
        ],
        timeout=600,
    )
    return read_metrics(out)


def test_train_20_steps_from_a_save_to_disk_folder_of_translation_dicts(corpora, tmp_path):
    """The issue's user check: no TSV, no tokenizer; validation from the folder's validation split."""
    metrics = train_from(
        tmp_path,
        "--file_path",
        corpora / "wmt",
        "--src_lang",
        "en",
        "--tgt_lang",
        "fr",
        "--valid_file",
        corpora / "wmt",
        "--valid_interval",
        "20",
    )
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 20 and steps[-1]["loss"] < steps[0]["loss"]
    assert any("valid_loss" in m for m in metrics)


def test_train_20_steps_from_jsonl_columns(corpora, tmp_path):
    metrics = train_from(
        tmp_path, "--file_path", corpora / "pairs.jsonl", "--src_field", "english", "--tgt_field", "french"
    )
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 20 and steps[-1]["loss"] < steps[0]["loss"]


def test_a_table_trains_the_losses_of_the_tsv_of_its_pairs_also_on_2_ranks(corpora, tmp_path):
    """Same pairs, same auto-built tokenizer (from the table's pairs, in the same order), same store: the losses
    of the TSV's run, bit for bit; on 2 ranks rank 0 takes the table's identity and hands it to rank 1."""

    def run(nproc, name, *flags):
        out = tmp_path / name
        run_train(
            nproc,
            [
                *flags,
                "--tokenizer_vocab_size",
                "500",
                "--cache_dir",
                tmp_path / f"cache-{name}",
                "--output_dir",
                out,
                *TINY,
                "--steps",
                "10",
            ],
            timeout=600,
        )
        return [m["loss"] for m in read_metrics(out) if "loss" in m]

    tsv = run(1, "tsv", "--file_path", corpora / "pairs.tsv")
    assert run(1, "folder", "--file_path", corpora / "wmt", "--src_lang", "en", "--tgt_lang", "fr") == tsv
    assert run(2, "folder2", "--file_path", corpora / "wmt", "--src_lang", "en", "--tgt_lang", "fr") == run(
        2, "tsv2", "--file_path", corpora / "pairs.tsv"
    )
