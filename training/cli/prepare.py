"""The data preparation commands (README's "Prepare data"): each runs a preprocess/ tool's own main, as
`python -m preprocess.X` does, through the one exit path of every command, under its own name (--help names it)."""

from __future__ import annotations

from typing import NoReturn

from common.errors import run_cli


def tsv() -> NoReturn:
    """dstr-prepare-tsv: two line-aligned files → a source<TAB>target TSV (preprocess/parallel.py)."""
    from preprocess.parallel import main

    run_cli(lambda: main(prog="dstr-prepare-tsv"))


def tokenizer() -> NoReturn:
    """dstr-prepare-tokenizer: a BPE or word tokenizer from a TSV (preprocess/tokenizer.py)."""
    from preprocess.tokenizer import main

    run_cli(lambda: main(prog="dstr-prepare-tokenizer"))


def dataset() -> NoReturn:
    """dstr-prepare-dataset: tokenize a TSV once into the token store, with statistics (preprocess/dataset.py)."""
    from preprocess.dataset import main

    run_cli(lambda: main(prog="dstr-prepare-dataset"))


def wmt14() -> NoReturn:
    """dstr-prepare-wmt14: the seed's WMT14 preprocess (preprocess/wmt14.py)."""
    from preprocess.wmt14 import main

    run_cli(lambda: main(prog="dstr-prepare-wmt14"))
