"""preprocess.parallel: two aligned text files → one TSV, through the real command line."""

from __future__ import annotations

import gzip

import pytest

from common.text_lines import read_lines
from preprocess.textio import read_tsv_pairs

MODULE = "preprocess.parallel"


def test_help(run_module):
    result = run_module(MODULE, "--help")
    assert result.returncode == 0
    assert "--skip_empty" in result.stdout and "example" in result.stdout


def test_multi30k_val_to_tsv(run_module, multi30k_dir, tmp_path):
    out = tmp_path / "new" / "dir" / "val.fr_en.tsv"
    result = run_module(
        MODULE, "--src", multi30k_dir / "val.fr.gz", "--tgt", multi30k_dir / "val.en.gz", "--output", out
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote 1014 pairs to {out}"
    sources, targets = read_tsv_pairs(out)
    # Sides are stripped: a few Multi30k lines carry stray leading/trailing spaces.
    assert sources == [line.strip() for line in read_lines(multi30k_dir / "val.fr.gz")]
    assert targets == [line.strip() for line in read_lines(multi30k_dir / "val.en.gz")]


def test_session_fixture_is_multi30k_train(multi30k_tsv, multi30k_dir):
    sources, targets = read_tsv_pairs(multi30k_tsv)
    assert len(sources) == 29000
    assert sources[0] == read_lines(multi30k_dir / "train.fr.gz")[0].strip()
    assert targets[-1] == read_lines(multi30k_dir / "train.en.gz")[-1].strip()


def _write(path, text: str):
    data = text.encode("utf-8")
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def test_skip_empty_drops_and_reports(run_module, tmp_path):
    src = _write(tmp_path / "s.fr", "Un chat\n\nUn chien\n")
    tgt = _write(tmp_path / "t.en.gz", "A cat\nA bird\n  \n")
    out = tmp_path / "o.tsv"
    result = run_module(MODULE, "--src", src, "--tgt", tgt, "--output", out, "--skip_empty")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote 1 pairs to {out} (dropped 2 pairs with an empty side)"
    assert out.read_text(encoding="utf-8") == "Un chat\tA cat\n"


def _bad_cases(tmp_path):
    """(name, src, tgt, expected message parts) for each user mistake."""
    good_src = _write(tmp_path / "good.fr", "Un chat\nUn chien\n")
    good_tgt = _write(tmp_path / "good.en", "A cat\nA dog\n")
    return {
        "missing file": (good_src, tmp_path / "missing.en", [f"{tmp_path / 'missing.en'}: file not found"]),
        "empty file": (_write(tmp_path / "empty.fr", ""), good_tgt, [f"{tmp_path / 'empty.fr'}: file is empty"]),
        "different line counts": (
            good_src,
            _write(tmp_path / "three.en.gz", "A cat\nA dog\nA bird\n"),
            [f"{good_src} has 2 lines", f"{tmp_path / 'three.en.gz'} has 3 lines"],
        ),
        "empty line": (
            good_src,
            _write(tmp_path / "hole.en", "A cat\n \n"),
            [f"{tmp_path / 'hole.en'}:2: empty line", "--skip_empty"],
        ),
        "tab in sentence": (
            _write(tmp_path / "tab.fr", "Un chat\nUn\tchien\n"),
            good_tgt,
            [f"{tmp_path / 'tab.fr'}:2: sentence contains a tab"],
        ),
        "invalid UTF-8": (good_src, tmp_path / "latin1.en.gz", [f"{tmp_path / 'latin1.en.gz'}:2: invalid UTF-8"]),
    }


@pytest.mark.parametrize(
    "case", ["missing file", "empty file", "different line counts", "empty line", "tab in sentence", "invalid UTF-8"]
)
def test_bad_input_is_one_line_error_and_no_output(run_module, assert_user_error, tmp_path, case):
    (tmp_path / "latin1.en.gz").write_bytes(gzip.compress("A cat\nA café\n".encode("latin-1")))
    src, tgt, needles = _bad_cases(tmp_path)[case]
    out_dir = tmp_path / "out"
    out = out_dir / "pairs.tsv"
    result = run_module(MODULE, "--src", src, "--tgt", tgt, "--output", out)
    assert_user_error(result, *needles)
    assert not out.exists()
    assert not out_dir.exists() or not any(out_dir.iterdir()), "a temporary file was left behind"
