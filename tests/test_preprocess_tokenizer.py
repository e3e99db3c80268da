"""preprocess.tokenizer: joint BPE and the seed's word vocabulary, saved as tokenizer.json."""

from __future__ import annotations

import json
import unicodedata

import numpy as np
import pytest
from tokenizers import Tokenizer

from common.errors import UserError
from common.text_lines import read_lines
from preprocess.tokenizer import SpecialIds, load_tokenizer, special_ids, train_tokenizer

MODULE = "preprocess.tokenizer"


def test_bpe_specials_and_size(bpe_tokenizer):
    tok = Tokenizer.from_file(str(bpe_tokenizer))
    assert [tok.id_to_token(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert tok.get_vocab_size() == 8000
    assert special_ids(tok) == SpecialIds(pad=0, unk=1, bos=2, eos=3)
    meta = json.loads((bpe_tokenizer.parent / "tokenizer_meta.json").read_text())
    assert meta["type"] == "bpe" and meta["vocab_size"] == 8000 and len(meta["inputs"]) == 1
    assert len(meta["inputs"][0]["sha256"]) == 64


def test_bpe_round_trips_unseen_french_and_english(bpe_tokenizer, multi30k_dir):
    tok = load_tokenizer(bpe_tokenizer)
    for name in ("val.fr.gz", "test_2017_flickr.fr.gz", "val.en.gz"):
        for line in read_lines(multi30k_dir / name):
            text = unicodedata.normalize("NFKC", line.strip())
            ids = tok.encode(text).ids
            assert 1 not in ids, f"<unk> in {text!r}"
            assert tok.decode(ids) == text
    accents = "L'été, où la forêt çà et là brûle, Noël à côté d'un garçon."
    assert tok.decode(tok.encode(accents).ids) == accents
    assert tok.encode("Un chat").ids[0] not in (2, 3), "the tokenizer must not add BOS/EOS itself"


def test_pretrained_tokenizer_fast_loads_it(bpe_tokenizer):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(bpe_tokenizer), pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    assert (hf.pad_token_id, hf.unk_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2, 3)
    assert len(hf) == 8000
    text = "Deux jeunes hommes blancs sont dehors près de buissons."
    ids = hf(text)["input_ids"]
    assert ids == load_tokenizer(bpe_tokenizer).encode(text).ids
    assert hf.decode(ids) == text
    batch = hf([text, "Un chat."], padding=True)
    assert batch["input_ids"][1][-1] == 0


def test_word_type_follows_the_seed(tmp_path, run_module):
    tsv = tmp_path / "tiny.tsv"
    tsv.write_text("le chat mange\tthe cat eats\nLe chien mange\tthe dog eats\nle zèbre\tA zebra\n", encoding="utf-8")
    result = run_module(MODULE, "--input", tsv, "--output", tmp_path / "word", "--type", "word", "--min_frequency", "1")
    assert result.returncode == 0, result.stderr
    tok = load_tokenizer(tmp_path / "word")
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    # Seed order <unk>, <pad>, <eot>; then by count (the: 2, le: 3, eats/mange: 2, ...) with ties alphabetical.
    assert [token for token, _ in vocab] == [
        "<unk>",
        "<pad>",
        "<eot>",
        "le",
        "eats",
        "mange",
        "the",
        "a",
        "cat",
        "chat",
        "chien",
        "dog",
        "zebra",
        "zèbre",
    ]
    assert special_ids(tok) == SpecialIds(pad=1, unk=0, bos=2, eos=2)
    assert tok.encode("Le CHAT inconnu").ids == [3, 9, 0]
    meta = json.loads((tmp_path / "word" / "tokenizer_meta.json").read_text())
    assert meta["type"] == "word" and meta["special_tokens"] == {"<unk>": 0, "<pad>": 1, "<eot>": 2}


def test_word_type_vocab_size_cap_and_default(val_tsv, tmp_path):
    capped = load_tokenizer(train_tokenizer([val_tsv], tmp_path / "w10", type="word", vocab_size=10))
    assert capped.get_vocab_size() == 10
    full = load_tokenizer(train_tokenizer([val_tsv], tmp_path / "w", type="word"))
    assert full.get_vocab_size() < 20000  # default cap (the seed's 20000) is above Multi30k val's vocabulary
    assert [full.id_to_token(i) for i in range(3)] == ["<unk>", "<pad>", "<eot>"]


@pytest.mark.parametrize("kind", ["bpe", "word"])
def test_training_is_deterministic(val_tsv, tmp_path, kind):
    first = train_tokenizer([val_tsv], tmp_path / "a", type=kind, vocab_size=2000)
    second = train_tokenizer([val_tsv], tmp_path / "b", type=kind, vocab_size=2000)
    assert first.read_bytes() == second.read_bytes()


def test_cli_bpe_and_help(run_module, val_tsv, tmp_path):
    help_result = run_module(MODULE, "--help")
    assert help_result.returncode == 0 and "--vocab_size" in help_result.stdout and "example" in help_result.stdout
    result = run_module(MODULE, "--input", val_tsv, val_tsv, "--output", tmp_path / "bpe", "--vocab_size", "1000")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote bpe tokenizer with 1000 tokens to {tmp_path / 'bpe' / 'tokenizer.json'}"
    assert sorted(p.name for p in (tmp_path / "bpe").iterdir()) == ["tokenizer.json", "tokenizer_meta.json"]


def test_unknown_type_is_one_line_error(run_module, assert_user_error, val_tsv, tmp_path):
    out = tmp_path / "out"
    assert_user_error(
        run_module(MODULE, "--input", val_tsv, "--output", out, "--type", "sentencepiece"),
        "unknown tokenizer type 'sentencepiece'",
        "bpe, word",
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "content, needle",
    [
        (None, "missing.tsv: file not found"),
        ("", "bad.tsv: file is empty"),
        ("Un chat\tA cat\nno tab on this line\n", "bad.tsv:2: no tab"),
        ("Un chat\tA cat\n\tA dog\n", "bad.tsv:2: empty source side"),
        ("Un chat\tA cat\nUn chien\t \n", "bad.tsv:2: empty target side"),
        (b"Un chat\tA cat\nUn caf\xe9\tA coffee\n", "bad.tsv:2: invalid UTF-8"),
    ],
)
def test_bad_tsv_is_one_line_error(run_module, assert_user_error, tmp_path, content, needle):
    tsv = tmp_path / ("missing.tsv" if content is None else "bad.tsv")
    if isinstance(content, bytes):
        tsv.write_bytes(content)
    elif content is not None:
        tsv.write_text(content, encoding="utf-8")
    out = tmp_path / "out"
    assert_user_error(run_module(MODULE, "--input", tsv, "--output", out), f"{tmp_path / needle}")
    assert not out.exists()


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(UserError, match="tokenizer file not found"):
        load_tokenizer(tmp_path / "nothing.json")
    with pytest.raises(UserError, match="tokenizer file not found"):
        load_tokenizer(tmp_path)  # a directory without tokenizer.json
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(UserError, match="not a valid tokenizers JSON file"):
        load_tokenizer(bad)


def test_split_punctuation_round_trips_and_splits(multi30k_tsv, val_tsv, multi30k_dir, tmp_path):
    path = train_tokenizer([multi30k_tsv], tmp_path / "p", type="bpe", vocab_size=8000, split_punctuation=True)
    tok = load_tokenizer(path)
    assert tok.encode("Un homme, l'air fatigué.", add_special_tokens=False).tokens[-1] == "."
    assert "," in tok.encode("Un homme, l'air fatigué.", add_special_tokens=False).tokens
    for line in read_lines(multi30k_dir / "test_2016_flickr.fr.gz"):
        text = unicodedata.normalize("NFKC", line.strip())
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    assert json.loads((tmp_path / "p" / "tokenizer_meta.json").read_text())["split_punctuation"] is True
    with pytest.raises(UserError, match="--split_punctuation applies to --type bpe only"):
        train_tokenizer([val_tsv], tmp_path / "w", type="word", split_punctuation=True)


def test_sample_size_trains_on_a_fixed_uniform_sample(multi30k_tsv, bpe_tokenizer, tmp_path):
    """--sample_size N: N pairs drawn uniformly with a fixed seed from all inputs (the same N pairs every time), the
    rest still validated; recorded in tokenizer_meta.json."""
    from preprocess.tokenizer import sample_pairs

    first = train_tokenizer([multi30k_tsv], tmp_path / "a", vocab_size=2000, sample_size=3000)
    again = train_tokenizer([multi30k_tsv], tmp_path / "b", vocab_size=2000, sample_size=3000)
    assert first.read_text() == again.read_text()
    assert json.loads((tmp_path / "a" / "tokenizer_meta.json").read_text())["sample_size"] == 3000
    assert first.read_text() != train_tokenizer([multi30k_tsv], tmp_path / "c", vocab_size=2000).read_text()
    chosen = sample_pairs(29_000, 3000)
    assert len(np.unique(chosen)) == 3000 and chosen[0] < 100 and chosen[-1] > 28_900  # spread over the file
    assert sample_pairs(29_000, None) is None and sample_pairs(100, 500) is None
    with pytest.raises(UserError, match="--sample_size 0 must be >= 1"):
        train_tokenizer([multi30k_tsv], tmp_path / "d", sample_size=0)
    bad = tmp_path / "bad.tsv"  # a broken line outside any sample of 5 is still found
    lines = [f"une phrase {i}\ta sentence {i}" for i in range(50)]
    lines[40] = "no tab on this line"
    bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert 40 not in sample_pairs(50, 5)
    with pytest.raises(UserError, match="bad.tsv:41: no tab"):
        train_tokenizer([bad], tmp_path / "e", vocab_size=100, sample_size=5)
