"""Two line-aligned text files (plain or .gz) → one `source<TAB>target` TSV, the format every later step reads.

Line i of --src and line i of --tgt must be translations of each other. The tool refuses (one-line error, no
output written) when the files have different line counts, a line is empty on either side (unless
--skip_empty, which drops such pairs and reports how many), a sentence contains a tab, or a file is missing,
empty or not UTF-8.

Run:  python -m preprocess.parallel --src data/multi30k/train.fr.gz --tgt data/multi30k/train.en.gz \\
          --output data/multi30k/train.fr_en.tsv
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from common.errors import fail, run_cli
from common.staging import atomic_write
from common.text_lines import check_readable, iter_lines
from common.user_files import refuse_output_over_inputs


def make_tsv(src: str | Path, tgt: str | Path, output: str | Path, skip_empty: bool = False) -> tuple[int, int]:
    """Write `output` as src<TAB>tgt lines; return (pairs written, pairs dropped for an empty side)."""
    src, tgt, output = str(src), str(tgt), Path(output)
    # Check both inputs before creating anything, so a typo in --tgt leaves no empty output folder behind.
    check_readable(src)
    check_readable(tgt)
    refuse_output_over_inputs(output, "--output", [(f"--src {src}", src), (f"--tgt {tgt}", tgt)])
    output.parent.mkdir(parents=True, exist_ok=True)
    written = dropped = 0
    src_count = tgt_count = 0
    with atomic_write(output) as out:
        # Streaming in lockstep keeps memory flat for multi-million-line corpora; counting continues past the
        # shorter file so the error can state both line counts.
        for src_item, tgt_item in itertools.zip_longest(iter_lines(src), iter_lines(tgt)):
            if src_item is None or tgt_item is None:
                src_count += src_item is not None
                tgt_count += tgt_item is not None
                continue
            (lineno, src_line), (_, tgt_line) = src_item, tgt_item
            src_count += 1
            tgt_count += 1
            src_text, tgt_text = src_line.strip(), tgt_line.strip()
            for name, raw in ((src, src_line), (tgt, tgt_line)):
                if "\t" in raw:
                    fail(
                        f"{name}:{lineno}: sentence contains a tab, which would break the TSV format; "
                        "replace it with a space"
                    )
            if not src_text or not tgt_text:
                if skip_empty:
                    dropped += 1
                    continue
                name = src if not src_text else tgt
                fail(f"{name}:{lineno}: empty line; fix the alignment or pass --skip_empty to drop such pairs")
            out.write(f"{src_text}\t{tgt_text}\n")
            written += 1
        if src_count != tgt_count:
            fail(
                f"line counts differ: {src} has {src_count} lines, {tgt} has {tgt_count} lines; "
                "the files must be line-aligned translations"
            )
        if written == 0:
            fail(f"no pairs left to write from {src} and {tgt} (all {dropped} had an empty side)")
    return written, dropped


def main(prog: str = "python -m preprocess.parallel") -> int:
    """`prog`: the command as the user ran it (`python -m preprocess.parallel`, or its dstr-prepare-* command):
    --help names it."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Join two line-aligned parallel text files (plain or .gz, UTF-8) into one "
        "source<TAB>target TSV file.",
        epilog="example (Multi30k French→English):\n"
        f"  {prog} --src data/multi30k/train.fr.gz --tgt data/multi30k/train.en.gz "
        "--output data/multi30k/train.fr_en.tsv",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--src", required=True, metavar="FILE[.gz]", help="source-language sentences, one a line")
    parser.add_argument("--tgt", required=True, metavar="FILE[.gz]", help="target-language sentences, one a line")
    parser.add_argument(
        "--output", required=True, metavar="OUT.tsv", help="TSV to write (parent directories are created)"
    )
    parser.add_argument(
        "--skip_empty",
        action="store_true",
        help="drop pairs where either side is empty instead of stopping with an error",
    )
    args = parser.parse_args()
    written, dropped = make_tsv(args.src, args.tgt, args.output, skip_empty=args.skip_empty)
    note = f" (dropped {dropped} pairs with an empty side)" if args.skip_empty else ""
    print(f"wrote {written} pairs to {args.output}{note}")
    return 0


if __name__ == "__main__":
    run_cli(main)
