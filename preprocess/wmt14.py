"""WMT14 newstest2014 En-Fr (SGML) → the MindSpore tutorial's two TSV files.

The MindSpore distributed-Transformer tutorial trains on `newstest2014-fren-ref.{en,fr}.sgm` from
http://statmt.org/wmt14/test-full.tgz. This tool reads both files (from the .tgz directly, or from a directory
holding them anywhere below it), pairs segments by (document id, segment id) rather than by line position (the
seed zipped lines, which silently misaligns on any layout difference), unescapes SGML/HTML entities, strips
whitespace and writes, atomically:

    OUTPUT/wmt14.en_fr.txt   english<TAB>french
    OUTPUT/wmt14.fr_en.txt   french<TAB>english

Run:  python -m preprocess.wmt14 --input test-full.tgz --output data/wmt14
"""

from __future__ import annotations

import argparse
import html
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from common.errors import fail, run_cli
from common.progress_bar import ProgressBar
from common.staging import atomic_write
from common.text_lines import check_readable, decode_lines

EN_NAME = "newstest2014-fren-ref.en.sgm"
FR_NAME = "newstest2014-fren-ref.fr.sgm"
OUTPUT_EN_FR = "wmt14.en_fr.txt"
OUTPUT_FR_EN = "wmt14.fr_en.txt"

_DOC_RE = re.compile(r"<doc\b[^>]*?\bdocid\s*=\s*\"([^\"]*)\"", re.IGNORECASE)
_DOC_END_RE = re.compile(r"</doc\s*>", re.IGNORECASE)
_SEG_OPEN_RE = re.compile(r"<seg\b", re.IGNORECASE)
_SEG_RE = re.compile(r"<seg\b[^>]*?\bid\s*=\s*\"?([^\"\s>]+)\"?[^>]*>(.*?)</seg\s*>", re.IGNORECASE)

Key = tuple[str, str]  # (docid, seg id)


@dataclass(frozen=True)
class SgmFile:
    name: str  # what error messages call it: a path, or "archive.tgz:member"
    data: bytes


def _find_in_directory(root: Path, filename: str) -> SgmFile:
    matches = sorted(p for p in root.rglob(filename) if p.is_file())
    if not matches:
        fail(
            f"{root}: {filename} not found anywhere below this directory "
            "(extract test-full.tgz from http://statmt.org/wmt14/ or pass the .tgz itself)"
        )
    if len(matches) > 1:
        fail(
            f"{root}: {filename} found {len(matches)} times ({', '.join(map(str, matches))}); "
            "pass the directory that holds exactly one copy"
        )
    path = check_readable(matches[0])
    return SgmFile(str(path), path.read_bytes())


def _find_in_archive(archive: Path, filenames: list[str]) -> list[SgmFile]:
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = {}
            for member in tar:
                base = member.name.rsplit("/", 1)[-1]
                if member.isfile() and base in filenames:
                    if base in members:
                        fail(f"{archive}: {base} occurs twice in the archive ({members[base].name} and {member.name})")
                    members[base] = member
            found = []
            for filename in filenames:
                if filename not in members:
                    fail(
                        f"{archive}: {filename} not found in the archive "
                        "(expected WMT14 test-full.tgz, which holds it under test-full/)"
                    )
                member = members[filename]
                handle = tar.extractfile(member)
                found.append(SgmFile(f"{archive}:{member.name}", handle.read()))
            return found
    except (tarfile.TarError, EOFError, OSError) as exc:
        fail(f"{archive}: cannot read as a tar archive ({exc})")


def locate_inputs(input_path: str | Path) -> tuple[SgmFile, SgmFile]:
    """Return the English and French reference SGML files from a directory or a (compressed) tar archive."""
    path = Path(input_path)
    if path.is_dir():
        return _find_in_directory(path, EN_NAME), _find_in_directory(path, FR_NAME)
    check_readable(path)
    if not tarfile.is_tarfile(path):
        fail(f"{path}: neither a directory nor a tar archive; pass test-full.tgz or the folder it was extracted to")
    en, fr = _find_in_archive(path, [EN_NAME, FR_NAME])
    return en, fr


def parse_sgm(sgm: SgmFile) -> dict[Key, str]:
    """Map (docid, seg id) → unescaped, stripped segment text, in file order; raise UserError on bad input."""
    segments: dict[Key, str] = {}
    first_line: dict[Key, int] = {}
    docid = None
    for lineno, line in enumerate(decode_lines(sgm.data, sgm.name), start=1):
        doc = _DOC_RE.search(line)
        if doc:
            docid = doc.group(1)
        if _SEG_OPEN_RE.search(line):
            seg = _SEG_RE.search(line)
            if seg is None:
                fail(f'{sgm.name}:{lineno}: malformed <seg> (expected <seg id="N">text</seg> on one line)')
            if docid is None:
                fail(f'{sgm.name}:{lineno}: <seg> outside any <doc docid="...">')
            key = (docid, seg.group(1))
            if key in segments:
                fail(
                    f"{sgm.name}:{lineno}: duplicate segment (doc {key[0]!r}, seg {key[1]!r}); "
                    f"first seen at line {first_line[key]}"
                )
            # Entities such as &amp; &quot; &#39; are SGML escapes, not part of the sentence; a tab produced by
            # &#9; would break the TSV format and carries no meaning, so it becomes a space.
            text = html.unescape(seg.group(2)).replace("\t", " ").strip()
            if not text:
                fail(f"{sgm.name}:{lineno}: empty segment text (doc {key[0]!r}, seg {key[1]!r})")
            segments[key] = text
            first_line[key] = lineno
        if _DOC_END_RE.search(line):
            docid = None
    if not segments:
        fail(f"{sgm.name}: no <seg> elements found; is this a WMT .sgm file?")
    return segments


def pair_segments(en: dict[Key, str], fr: dict[Key, str], en_name: str, fr_name: str) -> list[tuple[str, str]]:
    """(english, french) pairs in the English file's order; raise UserError naming the first unmatched key."""
    for keys, have, lacks, other in ((en, en_name, fr_name, fr), (fr, fr_name, en_name, en)):
        for key in keys:
            if key not in other:
                fail(
                    f"{lacks}: lacks doc {key[0]!r} seg {key[1]!r}, which {have} has; "
                    "the two files must contain the same (docid, seg id) pairs"
                )
    return [(en[key], fr[key]) for key in ProgressBar(en, desc="pairing segments", unit="seg", disable=None)]


def convert(input_path: str | Path, output_dir: str | Path) -> tuple[int, Path, Path]:
    """Write OUTPUT/wmt14.en_fr.txt and OUTPUT/wmt14.fr_en.txt; return (pairs, en_fr path, fr_en path)."""
    en_file, fr_file = locate_inputs(input_path)
    pairs = pair_segments(parse_sgm(en_file), parse_sgm(fr_file), en_file.name, fr_file.name)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    en_fr, fr_en = output_dir / OUTPUT_EN_FR, output_dir / OUTPUT_FR_EN
    with atomic_write(en_fr) as out_en_fr, atomic_write(fr_en) as out_fr_en:
        for en_text, fr_text in pairs:
            out_en_fr.write(f"{en_text}\t{fr_text}\n")
            out_fr_en.write(f"{fr_text}\t{en_text}\n")
    return len(pairs), en_fr, fr_en


def main(prog: str = "python -m preprocess.wmt14") -> int:
    """`prog`: the command as the user ran it (`python -m preprocess.wmt14`, or its dstr-prepare-* command):
    --help names it."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Convert WMT14 newstest2014 En-Fr reference SGML files into the MindSpore tutorial's TSV files "
        f"({OUTPUT_EN_FR}: english<TAB>french, {OUTPUT_FR_EN}: french<TAB>english), pairing segments "
        "by (docid, seg id).",
        epilog=f"example:\n  {prog} --input test-full.tgz --output data/wmt14\n"
        f"  {prog} --input ./test-full --output data/wmt14",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--input",
        required=True,
        metavar="DIR_OR_TGZ",
        help=f"test-full.tgz, or a directory with {EN_NAME} and {FR_NAME} anywhere below it",
    )
    parser.add_argument("--output", required=True, metavar="DIR", help="output directory (created if missing)")
    args = parser.parse_args()
    count, en_fr, fr_en = convert(args.input, args.output)
    print(f"wrote {count} pairs to {en_fr} and {fr_en}")
    return 0


if __name__ == "__main__":
    run_cli(main)
