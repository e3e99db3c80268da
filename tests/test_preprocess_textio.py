"""Strict UTF-8 reading (common.text_lines), atomic writes (common.staging) and TSV validation (preprocess.textio)."""

from __future__ import annotations

import gzip

import pytest

from common.errors import UserError
from common.staging import atomic_write
from common.text_lines import count_lines, decode_lines, iter_lines, read_lines
from preprocess.textio import read_tsv_pairs


def test_reads_plain_and_gzip_the_same(tmp_path, multi30k_dir):
    lines = read_lines(multi30k_dir / "val.fr.gz")
    assert len(lines) == 1014 and all(lines)
    plain = tmp_path / "val.fr"
    plain.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert read_lines(plain) == lines
    assert count_lines(multi30k_dir / "train.en.gz") == 29000


def test_only_newline_ends_a_line(tmp_path):
    path = tmp_path / "odd.txt"
    path.write_bytes("\ufeffa\u2028b\r\nc\x85d\n".encode("utf-8"))
    assert read_lines(path) == ["a\u2028b", "c\x85d"]


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine\nstill fine\nbad \xff byte\n")
    with pytest.raises(UserError, match=r"bad\.txt:3: invalid UTF-8"):
        read_lines(path)
    gz = tmp_path / "bad.txt.gz"
    gz.write_bytes(gzip.compress(b"ok\n\xc3\x28\n"))
    with pytest.raises(UserError, match=r"bad\.txt\.gz:2: invalid UTF-8"):
        read_lines(gz)
    with pytest.raises(UserError, match=r"member\.sgm:1: invalid UTF-8"):
        decode_lines(b"\xfe\n", "member.sgm")


@pytest.mark.parametrize("content", [b"", gzip.compress(b"")], ids=["plain", "gzip"])
def test_empty_file(tmp_path, content):
    path = tmp_path / ("empty.txt.gz" if content else "empty.txt")
    path.write_bytes(content)
    with pytest.raises(UserError, match=rf"{path.name}: file is empty"):
        list(iter_lines(path))


def test_missing_file_and_broken_gzip(tmp_path):
    with pytest.raises(UserError, match=r"nope\.txt: file not found"):
        read_lines(tmp_path / "nope.txt")
    broken = tmp_path / "broken.gz"
    broken.write_bytes(b"not gzip at all\n")
    with pytest.raises(UserError, match=r"broken\.gz: not a valid gzip file"):
        read_lines(broken)


def test_atomic_write_replaces_only_on_success(tmp_path):
    path = tmp_path / "out.txt"
    with atomic_write(path) as handle:
        handle.write("first\n")
    assert path.read_text() == "first\n"
    with pytest.raises(RuntimeError), atomic_write(path) as handle:
        handle.write("partial")
        raise RuntimeError("boom")
    assert path.read_text() == "first\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]

    fresh = tmp_path / "never.txt"
    with pytest.raises(KeyboardInterrupt), atomic_write(fresh) as handle:
        handle.write("partial")
        raise KeyboardInterrupt
    assert not fresh.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_tsv_pairs_are_stripped(tmp_path):
    path = tmp_path / "ok.tsv"
    path.write_text(" Bonjour .\t Hello . \nUn chat\tA cat\n", encoding="utf-8")
    assert read_tsv_pairs(path) == (["Bonjour .", "Un chat"], ["Hello .", "A cat"])


@pytest.mark.parametrize(
    "line, message",
    [
        ("no tab here", r"bad\.tsv:2: no tab"),
        ("", r"bad\.tsv:2: empty line"),
        ("a\tb\tc", r"bad\.tsv:2: 2 tabs"),
        ("  \tHello", r"bad\.tsv:2: empty source side"),
        ("Bonjour\t  ", r"bad\.tsv:2: empty target side"),
    ],
)
def test_tsv_errors_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.tsv"
    path.write_text(f"Un chat\tA cat\n{line}\nUn chien\tA dog\n", encoding="utf-8")
    with pytest.raises(UserError, match=message):
        read_tsv_pairs(path)
