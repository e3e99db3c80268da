"""preprocess.wmt14: newstest2014 SGML (directory or test-full.tgz) → wmt14.en_fr.txt / wmt14.fr_en.txt."""

from __future__ import annotations

import io
import tarfile

import pytest

MODULE = "preprocess.wmt14"
EN = "newstest2014-fren-ref.en.sgm"
FR = "newstest2014-fren-ref.fr.sgm"

# Documents and segments as (docid, seg id, text); the French file lists them in a different order.
EN_DOCS = {
    "1012-bbc": [
        ("1", "India and Japan prime ministers meet in Tokyo"),
        ("2", "Tom &amp; Jerry said &quot;hello&quot; &lt;twice&gt;"),
        ("3", "  Padded   with spaces  "),
    ],
    "1018-lenta": [("1", "Only one sentence here.")],
}
FR_DOCS = {
    "1018-lenta": [("1", "Une seule phrase ici.")],
    "1012-bbc": [
        ("3", "Entour\u00e9 d'espaces"),
        ("1", "Les premiers ministres indien et japonais se rencontrent \u00e0 Tokyo"),
        ("2", "Tom &amp; Jerry ont dit &#171;bonjour&#187; deux fois"),
    ],
}
EXPECTED_EN_FR = [
    (
        "India and Japan prime ministers meet in Tokyo",
        "Les premiers ministres indien et japonais se rencontrent \u00e0 Tokyo",
    ),
    ('Tom & Jerry said "hello" <twice>', "Tom & Jerry ont dit \u00abbonjour\u00bb deux fois"),
    ("Padded   with spaces", "Entour\u00e9 d'espaces"),
    ("Only one sentence here.", "Une seule phrase ici."),
]


def sgm(docs: dict, lang: str) -> bytes:
    lines = [f'<refset setid="newstest2014" srclang="any" trglang="{lang}">']
    for docid, segs in docs.items():
        lines += [f'<doc sysid="ref" docid="{docid}" genre="news" origlang="en">', "<p>"]
        lines += [f'<seg id="{seg_id}">{text}</seg>' for seg_id, text in segs]
        lines += ["</p>", "</doc>"]
    lines.append("</refset>")
    return ("\n".join(lines) + "\n").encode("utf-8")


def make_tgz(path, members: dict[str, bytes]):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def read_pairs(path):
    return [tuple(line.split("\t")) for line in path.read_text(encoding="utf-8").splitlines()]


def test_help(run_module):
    result = run_module(MODULE, "--help")
    assert result.returncode == 0
    assert "--input" in result.stdout and "example" in result.stdout


def test_tgz_pairs_by_id_not_position(run_module, tmp_path):
    tgz = make_tgz(
        tmp_path / "test-full.tgz",
        {
            "test-full/newstest2014-deen-ref.de.sgm": b"<refset></refset>\n",
            f"test-full/{EN}": sgm(EN_DOCS, "en"),
            f"test-full/{FR}": sgm(FR_DOCS, "fr"),
        },
    )
    out = tmp_path / "output"
    result = run_module(MODULE, "--input", tgz, "--output", out)
    assert result.returncode == 0, result.stderr
    assert "wrote 4 pairs" in result.stdout
    assert read_pairs(out / "wmt14.en_fr.txt") == EXPECTED_EN_FR
    assert read_pairs(out / "wmt14.fr_en.txt") == [(fr, en) for en, fr in EXPECTED_EN_FR]
    assert sorted(p.name for p in out.iterdir()) == ["wmt14.en_fr.txt", "wmt14.fr_en.txt"]


def test_directory_input_found_below(run_module, tmp_path):
    nested = tmp_path / "downloads" / "test-full"
    nested.mkdir(parents=True)
    (nested / EN).write_bytes(sgm(EN_DOCS, "en"))
    (nested / FR).write_bytes(sgm(FR_DOCS, "fr"))
    result = run_module(MODULE, "--input", tmp_path / "downloads", "--output", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert read_pairs(tmp_path / "out" / "wmt14.en_fr.txt") == EXPECTED_EN_FR


def _fr_variant(case: str) -> bytes:
    if case == "seg ids do not match":
        docs = {"1018-lenta": FR_DOCS["1018-lenta"], "1012-bbc": FR_DOCS["1012-bbc"][:2]}  # seg 2 missing
        return sgm(docs, "fr")
    if case == "duplicate segment":
        docs = {**FR_DOCS, "1018-lenta": FR_DOCS["1018-lenta"] * 2}
        return sgm(docs, "fr")
    if case == "empty segment":
        docs = {**FR_DOCS, "1018-lenta": [("1", "   ")]}
        return sgm(docs, "fr")
    if case == "invalid UTF-8":
        return sgm(FR_DOCS, "fr").replace("\u00e0".encode(), b"\xe0")  # Latin-1 byte in a UTF-8 file
    raise AssertionError(case)


@pytest.mark.parametrize("layout", ["dir", "tgz"])
@pytest.mark.parametrize(
    "case, needles",
    [
        ("seg ids do not match", ["lacks doc '1012-bbc' seg '2'"]),
        ("duplicate segment", [":5: duplicate segment (doc '1018-lenta', seg '1'); first seen at line 4"]),
        ("empty segment", [":4: empty segment text (doc '1018-lenta', seg '1')"]),
        ("invalid UTF-8", [":10: invalid UTF-8"]),
    ],
)
def test_bad_sgm_is_one_line_error_and_no_output(run_module, assert_user_error, tmp_path, layout, case, needles):
    fr_bytes = _fr_variant(case)
    if layout == "dir":
        src = tmp_path / "test-full"
        src.mkdir()
        (src / EN).write_bytes(sgm(EN_DOCS, "en"))
        (src / FR).write_bytes(fr_bytes)
        fr_name = str(src / FR)
    else:
        src = make_tgz(tmp_path / "test-full.tgz", {f"test-full/{EN}": sgm(EN_DOCS, "en"), f"test-full/{FR}": fr_bytes})
        fr_name = f"{src}:test-full/{FR}"
    out = tmp_path / "out"
    message = assert_user_error(run_module(MODULE, "--input", src, "--output", out), *needles)
    assert message.startswith(f"error: {fr_name}"), message
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("layout", ["dir", "tgz", "nothing"])
def test_missing_sgm_file(run_module, assert_user_error, tmp_path, layout):
    if layout == "dir":
        src = tmp_path / "test-full"
        src.mkdir()
        (src / EN).write_bytes(sgm(EN_DOCS, "en"))
        needles = [str(src), f"{FR} not found"]
    elif layout == "tgz":
        src = make_tgz(tmp_path / "test-full.tgz", {f"test-full/{FR}": sgm(FR_DOCS, "fr")})
        needles = [str(src), f"{EN} not found in the archive"]
    else:
        src = tmp_path / "test-full.tgz"
        needles = [f"{src}: file not found"]
    out = tmp_path / "out"
    assert_user_error(run_module(MODULE, "--input", src, "--output", out), *needles)
    assert not out.exists()


def test_empty_sgm_file(run_module, assert_user_error, tmp_path):
    src = tmp_path / "test-full"
    src.mkdir()
    (src / EN).write_bytes(b"")
    (src / FR).write_bytes(sgm(FR_DOCS, "fr"))
    assert_user_error(run_module(MODULE, "--input", src, "--output", tmp_path / "out"), f"{src / EN}: file is empty")
    assert not (tmp_path / "out").exists()
