"""Where the sentence pairs of --file_path / --valid_file come from: a `source<TAB>target` TSV (read as it always
was, by preprocess.textio and the store builder's line blocks), or a table read through the `datasets` library — a
folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`, a .jsonl/.json/.csv/.parquet file, or a Hub
dataset name — taken in batches of rows (`CorpusSource.batches`), never as one list. Formats, identity and the
measured memory: docs/data.md, "Input formats".
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from common.errors import UserError, fail
from common.hashing import file_sha256
from common.text_lines import check_readable
from preprocess.textio import iter_tsv_pairs
from preprocess.tsv_digest import tsv_sha256

# the `datasets` builder that reads each file type (streamed: the file is read in record batches, not whole)
TABLE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
TSV_SUFFIXES = (".tsv", ".txt", ".tab", ".gz")
BATCH_ROWS = 10_000  # rows per batch a table is read and tokenized in (a few MB of text)
IDENTITY_VERSION = "corpus-v1"  # bump when what a table's identity covers changes: old stores are then not reused
# a Hub dataset is "name" or "owner/name" (a missing local path with more folders is just not found)
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
FORMATS = "a .tsv (source<TAB>target), .jsonl, .json, .csv or .parquet file, or a folder from datasets' save_to_disk"


@dataclass(frozen=True)
class CorpusOptions:
    """How pairs are taken from a table (a TSV ignores them). `split`: the DatasetDict/Hub split (None: the
    caller's default, `default_split`); `src_field`/`tgt_field`: two text columns; or `src_lang`/`tgt_lang`: the keys
    of a `translation` column of {lang: text} dicts (the Hub's WMT layout); `config`: a Hub dataset's config."""

    split: str | None = None
    src_field: str | None = None
    tgt_field: str | None = None
    src_lang: str | None = None
    tgt_lang: str | None = None
    config: str | None = None
    default_split: str = "train"


def add_corpus_flags(group, split_flag: str = "--split", split_help: str = "") -> None:
    """The column flags every command that reads a corpus takes (train.py adds its own --valid_split)."""
    group.add_argument(
        split_flag,
        default=None,
        metavar="SPLIT",
        help=split_help
        or "split of a DatasetDict folder or Hub dataset (default: train; a plain "
        "Dataset folder or a .jsonl/.json/.csv/.parquet file is read whole)",
    )
    group.add_argument(
        "--src_field", default=None, metavar="COLUMN", help="table input: the source-text column (with --tgt_field)"
    )
    group.add_argument(
        "--tgt_field", default=None, metavar="COLUMN", help="table input: the target-text column (with --src_field)"
    )
    group.add_argument(
        "--src_lang",
        default=None,
        metavar="LANG",
        help="table input with a `translation` column of {lang: text} dicts: the source key, e.g. en",
    )
    group.add_argument("--tgt_lang", default=None, metavar="LANG", help="... and the target key, e.g. fr")
    group.add_argument(
        "--dataset_config",
        default=None,
        metavar="NAME",
        help="a Hub dataset's config (e.g. fr-en for wmt14); needs the network",
    )


def options_from_args(args, split: str | None = None, default_split: str = "train") -> CorpusOptions:
    return CorpusOptions(
        split=split if split is not None else getattr(args, "split", None),
        src_field=args.src_field,
        tgt_field=args.tgt_field,
        src_lang=args.src_lang,
        tgt_lang=args.tgt_lang,
        config=getattr(args, "dataset_config", None),
        default_split=default_split,
    )


def _stat(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def _text(value, name: str, row: int, side: str, where: str) -> str:
    if not isinstance(value, str):
        what = "missing (null)" if value is None else f"not text ({type(value).__name__})"
        fail(f"{name}: row {row}: the {side} side ({where}) is {what}; every row needs text on both sides")
    text = value.strip()  # as a TSV's sides are stripped: the same pairs give the same ids
    if not text:
        fail(f"{name}: row {row}: empty {side} side ({where}); drop the row or fill it in")
    return text


class CorpusSource:
    """One corpus: `kind` is "tsv", "folder" (save_to_disk), "file" (.jsonl/.json/.csv/.parquet) or "hub". Cheap
    to make: a table is opened when first needed (the ranks that only open a built store never open it)."""

    def __init__(self, path: str | os.PathLike, options: CorpusOptions | None = None, flag: str = "--file_path"):
        self.options = options or CorpusOptions()
        self.flag, self.name = flag, str(path)
        self.path = Path(path)
        self._table = None  # (dataset, reader of one batch, columns used), once opened
        if self.path.is_dir():
            if not ((self.path / "state.json").is_file() or (self.path / "dataset_dict.json").is_file()):
                fail(
                    f"{flag} {path} is a folder but not one written by datasets' save_to_disk (no state.json or "
                    f"dataset_dict.json in it); give {FORMATS}"
                )
            self.kind = "folder"
        elif self.path.exists():
            self.kind = self._file_kind()
        elif HUB_NAME.match(self.name) and not self.path.suffix and not self.name.startswith("."):
            self.kind = "hub"
        else:
            self.kind = "tsv"  # missing: the TSV readers say "not found", as they always did

    def __str__(self) -> str:
        return self.name

    def _file_kind(self) -> str:
        suffix = self.path.suffix.lower()
        if suffix in TABLE_BUILDERS:
            return "file"
        if suffix in TSV_SUFFIXES or not suffix or not self.path.is_file():
            return "tsv"  # (not a regular file: the TSV reader says so, as it always did)
        # any other name: a TSV still (the behaviour before tables), if its first line holds a tab or it is empty
        try:
            with open(self.path, "rb") as f:
                head = f.read(1 << 16)
        except OSError:
            return "tsv"  # unreadable: the TSV reader's line names why
        if not head or b"\t" in head.split(b"\n", 1)[0]:
            return "tsv"
        fail(f"{self.flag} {self.name}: unknown extension {suffix!r}; give {FORMATS}")

    @property
    def is_tsv(self) -> bool:
        return self.kind == "tsv"

    # -- opening a table --------------------------------------------------------------------------------------

    def _open(self):
        if self._table is None:
            import datasets

            datasets.disable_progress_bars()  # our own progress bar counts the pairs
            datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a parse error is our one line, not two
            try:
                data = self._load(datasets)
                self._table = (data, *self._columns(data))
            except Exception as exc:  # noqa: BLE001 - a file datasets cannot parse: its reason, in one line
                raise self._unreadable(exc) from None
        return self._table

    def _unreadable(self, exc: Exception) -> Exception:
        """A file `datasets` or pyarrow cannot parse (a broken JSON line, a truncated Parquet file) as one line;
        anything else (our own UserError, a bug) as it is."""
        if (
            isinstance(exc, UserError)
            or type(exc).__module__.split(".")[0] not in ("datasets", "pyarrow", "json")
            and not isinstance(exc, ValueError)
        ):
            return exc
        reason = str(exc.__cause__ or exc).strip().splitlines()
        return UserError(
            f"{self.flag} {self.name}: cannot be read as {self.path.suffix.lstrip('.') or 'a table'} "
            f"({reason[0] if reason else type(exc).__name__}); check the file, or convert it to a TSV"
        )

    def _split(self, names) -> str:
        split = self.options.split or self.options.default_split
        if split not in names:
            fail(
                f"{self.flag} {self.name} has no split {split!r}; its splits: {', '.join(sorted(names))} "
                f"(choose one with {'--valid_split' if self.flag == '--valid_file' else '--split'})"
            )
        return split

    def _load(self, datasets):
        if self.kind == "folder":
            data = datasets.load_from_disk(str(self.path))
            if isinstance(data, datasets.DatasetDict):
                data = data[self._split(list(data))]
            else:
                self.options = replace(self.options, split=None)  # a plain Dataset has no splits: read whole
            return data
        if self.kind == "file":
            self.options = replace(self.options, split=None)
            check_readable(self.path)
            builder = TABLE_BUILDERS[self.path.suffix.lower()]
            if builder == "parquet":
                return _ParquetTable(self.path)
            return datasets.load_dataset(builder, data_files=str(self.path), split="train", streaming=True)
        return self._load_hub(datasets)

    def _load_hub(self, datasets):
        no_network = (
            f"{self.flag} {self.name} is not a file or folder here, and as a Hugging Face Hub dataset it "
            f"needs the network, which this machine cannot reach: download it where there is network "
            f"(datasets.load_dataset), save it with .save_to_disk(DIR), copy DIR here and pass "
            f"{self.flag} DIR"
        )
        if (
            os.environ.get("HF_DATASETS_OFFLINE") == "1"
            or os.environ.get("HF_HUB_OFFLINE") == "1"
            or not _hub_reachable()
        ):
            raise UserError(no_network)
        split = self.options.split or self.options.default_split
        try:
            return datasets.load_dataset(self.name, self.options.config, split=split, streaming=True)
        except ConnectionError:
            raise UserError(no_network) from None
        except ValueError as exc:  # an unknown split or config: datasets names the ones there are
            raise UserError(f"{self.flag} {self.name}: {str(exc).splitlines()[0]}") from None

    def _columns(self, data) -> tuple:
        """(how a batch becomes (sources, targets), the columns read), checking the options against the table."""
        columns = list(data.column_names or [])
        if not columns:  # a streamed CSV may know its columns only once read
            columns = list(next(iter(data.take(1)), {}).keys())
        o = self.options
        shown = ", ".join(columns) or "none"
        if o.src_field or o.tgt_field:
            if not (o.src_field and o.tgt_field):
                fail("pass both --src_field and --tgt_field (the source and target columns)")
            for flag, column in (("--src_field", o.src_field), ("--tgt_field", o.tgt_field)):
                if column not in columns:
                    fail(f"{self.flag} {self.name} has no column {column!r} ({flag}); its columns: {shown}")

            def fields(batch, name=self.name, first=1):
                return (
                    [
                        _text(v, name, first + i, "source", f"column {o.src_field!r}")
                        for i, v in enumerate(batch[o.src_field])
                    ],
                    [
                        _text(v, name, first + i, "target", f"column {o.tgt_field!r}")
                        for i, v in enumerate(batch[o.tgt_field])
                    ],
                )

            return fields, [o.src_field, o.tgt_field]
        if "translation" not in columns:
            fail(
                f"{self.flag} {self.name}: say which columns hold the pairs: --src_field and --tgt_field (its "
                f"columns: {shown}), or --src_lang and --tgt_lang for a `translation` column of {{lang: text}}"
            )
        langs = _languages(data)
        if not (o.src_lang and o.tgt_lang):
            fail(
                f"{self.flag} {self.name} has a `translation` column: pass --src_lang and --tgt_lang (its languages: "
                f"{', '.join(langs) or 'unknown'})"
            )
        for flag, lang in (("--src_lang", o.src_lang), ("--tgt_lang", o.tgt_lang)):
            if langs and lang not in langs:
                fail(
                    f"{self.flag} {self.name}: the `translation` dicts have no language {lang!r} ({flag}); "
                    f"languages present: {', '.join(langs)}"
                )

        def translation(batch, name=self.name, first=1):
            rows = batch["translation"]
            for i, row in enumerate(rows):
                for flag, lang in (("--src_lang", o.src_lang), ("--tgt_lang", o.tgt_lang)):
                    if not isinstance(row, dict) or lang not in row:
                        present = ", ".join(row) if isinstance(row, dict) else "none"
                        fail(
                            f"{name}: row {first + i}: the translation has no language {lang!r} ({flag}); "
                            f"languages present: {present}"
                        )
            return (
                [
                    _text(r[o.src_lang], name, first + i, "source", f"translation[{o.src_lang!r}]")
                    for i, r in enumerate(rows)
                ],
                [
                    _text(r[o.tgt_lang], name, first + i, "target", f"translation[{o.tgt_lang!r}]")
                    for i, r in enumerate(rows)
                ],
            )

        return translation, ["translation"]

    # -- reading --------------------------------------------------------------------------------------------

    @property
    def num_rows(self) -> int | None:
        """Rows of a table when known without reading it (a save_to_disk folder), else None."""
        if self.is_tsv:
            return None
        data = self._open()[0]
        return len(data) if hasattr(data, "__len__") else None

    def batches(self, rows: int = BATCH_ROWS) -> Iterator[tuple[tuple[list[str], list[str]], int]]:
        """((sources, targets), first row number counted from 1) for each batch of at most `rows` rows, checked:
        only one batch of text is held at a time."""
        if self.is_tsv:
            sources, targets, first = [], [], 1
            for src, tgt in iter_tsv_pairs(self.path):
                sources.append(src)
                targets.append(tgt)
                if len(sources) == rows:
                    yield (sources, targets), first
                    first += rows
                    sources, targets = [], []
            if sources:
                yield (sources, targets), first
            return
        data, convert, used = self._open()
        first = 1
        batches = data.select_columns(used).iter(batch_size=rows)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as exc:  # noqa: BLE001 - a file datasets cannot parse: its reason, in one line
                raise self._unreadable(exc) from None
            pairs = convert(batch, first=first)
            yield pairs, first
            first += len(pairs[0])

    def pairs(self) -> Iterator[tuple[str, str]]:
        for (sources, targets), _ in self.batches():
            yield from zip(sources, targets, strict=True)

    # -- identity -------------------------------------------------------------------------------------------

    def files(self) -> list[Path]:
        """The files the pairs are read from (a folder: the split's Arrow files, state.json, dataset_info.json)."""
        if self.kind == "tsv" or self.kind == "file":
            return [self.path]
        if self.kind == "hub":
            return []
        data = self._open()[0]
        arrows = [Path(f["filename"]) for f in data.cache_files]
        folder = arrows[0].parent if arrows else self.path
        extra = [folder / name for name in ("state.json", "dataset_info.json") if (folder / name).is_file()]
        return arrows + extra

    def state(self) -> list:
        """The files' size, modification time and inode: a build refuses a corpus that changed while read."""
        return [_stat(p) for p in self.files()]

    def identity(self, cache_root: Path | None = None) -> str:
        """A sha256 naming the pairs this source yields (it names the token store and an auto-built tokenizer).
        TSV: the file's sha256, as before tables. A table: its files' sha256 (each kept in a record in `cache_root`
        while the file is unchanged, as a TSV's: preprocess.tsv_digest) with the split and column choice, so
        another choice never reuses a store built from this one. A Hub dataset: its name, config and choice."""

        def digest(path: Path) -> str:
            return tsv_sha256(path, cache_root)[0] if cache_root is not None else file_sha256(path)

        if self.is_tsv:
            return digest(check_readable(self.path))
        self._open()  # checks the split and columns first
        choice = {k: v for k, v in asdict(self.options).items() if k != "default_split"}
        if self.kind == "hub":
            choice["split"] = self.options.split or self.options.default_split
            content = {"hub": self.name}
        else:
            root = self.files()[0].parent
            content = {"files": [[os.path.relpath(p, root), digest(p)] for p in self.files()]}
        text = json.dumps({"format": IDENTITY_VERSION, "kind": self.kind, **content, "choice": choice}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


class _ParquetTable:
    """A Parquet file read with pyarrow (what `datasets` reads it with) one row group at a time, handed on in batches
    of the rows asked for. `datasets`' streamed Parquet reader, and pyarrow's own iter_batches under it, kept
    memory growing with the file (peak RSS 485 MB at 200k rows, 994 MB at 3M); a row group at a time stays flat
    (docs/data.md). The few methods of a `datasets` table that CorpusSource uses."""

    def __init__(self, path: Path, columns: list[str] | None = None):
        import pyarrow.parquet as pq

        self.path, self.columns = path, columns
        try:
            self.file = pq.ParquetFile(path)
        except Exception as exc:  # noqa: BLE001 - pyarrow's reasons for a file that is not Parquet vary
            fail(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0] if str(exc) else exc!r})")
        schema = self.file.schema_arrow
        self.column_names = schema.names
        self.features = {
            name: ({f.name: None for f in schema.field(name).type} if schema.field(name).type.num_fields else None)
            for name in schema.names
        }

    def __len__(self) -> int:
        return self.file.metadata.num_rows

    @property
    def cache_files(self) -> list:
        return []

    def select_columns(self, columns: list[str]) -> _ParquetTable:
        return _ParquetTable(self.path, columns)

    def iter(self, batch_size: int) -> Iterator[dict]:
        for group in range(self.file.num_row_groups):
            table = self.file.read_row_group(group, columns=self.columns, use_threads=False)
            for batch in table.to_batches(max_chunksize=batch_size):
                yield batch.to_pydict()
            del table  # the group's buffers go before the next one is read


def _languages(data) -> list[str]:
    feature = (getattr(data, "features", None) or {}).get("translation")
    langs = getattr(feature, "languages", None) or (list(feature) if isinstance(feature, dict) else [])
    return sorted(langs)


def _hub_reachable(timeout: float = 5.0) -> bool:
    """One quick connection to the Hub: without it `datasets` retries for half a minute before it gives up."""
    import socket

    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def open_corpus(path, options: CorpusOptions | None = None, flag: str = "--file_path") -> CorpusSource:
    return CorpusSource(path, options, flag)


def read_pairs(path, options: CorpusOptions | None = None, flag: str = "--file_path") -> tuple[list[str], list[str]]:
    """Every pair of a (small) corpus as (sources, targets): a validation set, whose sources are translated whole."""
    sources, targets = [], []
    for (src, tgt), _ in CorpusSource(path, options, flag).batches():
        sources.extend(src)
        targets.extend(tgt)
    return sources, targets
