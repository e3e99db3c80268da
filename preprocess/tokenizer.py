"""Train the shared source/target vocabulary and save it as one HF `tokenizers` file, DIR/tokenizer.json.

Two types:
- `bpe` (default): joint byte-pair encoding over both sides of every input TSV. NFKC normalisation and a
  Metaspace pre-tokenizer ("▁" marks a word start), which works on Unicode characters, so French accents are
  kept as themselves and `decode` gives back readable text. Specials: <pad>=0, <unk>=1, <s>=2, </s>=3.
- `word`: the MindSpore tutorial's whitespace vocabulary, lowercased: <unk>=0, <pad>=1, <eot>=2 (the seed's
  order; <eot> both begins and ends a sentence), then words by descending frequency, ties alphabetical.

Neither adds special tokens when encoding: the dataset places BOS/EOS itself (`encode_sources` does the same for
text to translate, `decode_hypotheses` turns generated ids back into text). DIR/tokenizer_meta.json records the type,
vocabulary size and the inputs (with their sha256). `save_for_transformers` writes the tokenizer as a
`transformers` tokenizer that appends EOS itself, so `AutoTokenizer(text)` gives what the model was trained on.

The text is streamed into the trainer (memory holds word counts, not the corpus); `--sample_size N` trains on N pairs
drawn uniformly with a fixed seed, for corpora of millions of pairs.

Run:  python -m preprocess.tokenizer --input data/multi30k/train.fr_en.tsv --output data/multi30k/bpe8k
Load: `load_tokenizer(path)`, or transformers.PreTrainedTokenizerFast(tokenizer_file=path, pad_token="<pad>",
      unk_token="<unk>", bos_token="<s>", eos_token="</s>").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from common.errors import fail, run_cli
from common.hashing import file_sha256
from common.staging import atomic_write
from common.user_files import nearest_existing
from preprocess.corpus_source import CorpusSource, add_corpus_flags, open_corpus, options_from_args
from preprocess.textio import iter_tsv_pairs

TOKENIZER_FILE = "tokenizer.json"
META_FILE = "tokenizer_meta.json"
TYPES = ("bpe", "word")
DEFAULT_VOCAB_SIZE = {"bpe": 8000, "word": 20000}  # word: the seed's vocabulary size
BPE_SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")
WORD_SPECIALS = ("<unk>", "<pad>", "<eot>")  # the seed's order: UNK, PAD, EOT


@dataclass(frozen=True)
class SpecialIds:
    pad: int
    unk: int
    bos: int
    eos: int


def _pairs(source) -> Iterator[tuple[str, str]]:
    """A TSV path's pairs, or a preprocess.corpus_source.CorpusSource's (a table read in batches)."""
    return source.pairs() if isinstance(source, CorpusSource) else iter_tsv_pairs(source)


def _input_record(source) -> dict:
    if isinstance(source, CorpusSource):
        return {"path": source.name, "sha256": source.identity()}
    return {"path": str(source), "sha256": file_sha256(source)}


def _count_pairs(tsv_paths: Sequence[str | Path]) -> int:
    return sum(1 for path in tsv_paths for _ in _pairs(path))


def _sentences(tsv_paths: Sequence[str | Path], chosen: np.ndarray | None = None) -> Iterator[str]:
    """Both sides of every TSV, validated and streamed (nothing is held); order is fixed (file, line, source then
    target) for determinism. `chosen`: sorted indices of the pairs to use (counted across the files), else all."""
    k, position = 0, 0
    for path in tsv_paths:
        for src, tgt in _pairs(path):
            if chosen is None or (k < len(chosen) and chosen[k] == position):
                yield src
                yield tgt
                k += 1
            position += 1


def sample_pairs(total: int, sample_size: int | None) -> np.ndarray | None:
    """Sorted indices of `sample_size` of `total` pairs, drawn uniformly with a fixed seed; None: all of them."""
    if sample_size is None or sample_size >= total:
        return None
    return np.sort(np.random.default_rng(0).choice(total, size=sample_size, replace=False))


def _train_bpe(
    sentences: Iterable[str],
    count: int | None,
    vocab_size: int,
    min_frequency: int,
    progress: bool,
    split_punctuation: bool = False,
) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    # split_punctuation: "▁bleu," → "▁bleu" + "," — one vocabulary entry per word instead of one per word ×
    # following punctuation; the Metaspace decoder still restores the exact spacing (no "▁" before the comma)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([metaspace, pre_tokenizers.Punctuation("isolated")]) if split_punctuation else metaspace
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(BPE_SPECIALS), show_progress=progress
    )
    # from an iterator: the trainer keeps word counts (bounded by the distinct words), not the sentences
    tok.train_from_iterator(sentences, trainer=trainer, length=count)
    return tok


def _train_word(sentences: Iterable[str], vocab_size: int, min_frequency: int) -> Tokenizer:
    normalizer = normalizers.Lowercase()
    pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    counts: Counter[str] = Counter()
    for sentence in sentences:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(sentence)))
    for special in WORD_SPECIALS:
        counts.pop(special, None)  # a literal "<unk>" in the text must not take a second id
    # Sorting on (-count, word) rather than Counter.most_common() makes ties independent of input order.
    ranked = sorted((item for item in counts.items() if item[1] >= min_frequency), key=lambda kv: (-kv[1], kv[0]))
    words = [word for word, _ in ranked[: vocab_size - len(WORD_SPECIALS)]]
    vocab = {token: i for i, token in enumerate([*WORD_SPECIALS, *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.add_special_tokens(list(WORD_SPECIALS))  # already in the vocab: keeps their ids, marks them special
    return tok


def _cannot_write(folder: Path, why: str) -> None:
    fail(
        f"cannot write the tokenizer to {folder} ({why}); choose a folder this process can write (train.py: "
        f"--cache_dir DIR, or a --tokenizer made elsewhere)"
    )


def _check_writable(folder: Path) -> None:
    """The folder, or the nearest one above it that exists, can be written (access(2) also says EROFS)."""
    existing = nearest_existing(folder)
    if not existing.is_dir():
        _cannot_write(folder, f"{existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        _cannot_write(folder, f"{existing} is not writable")


def train_tokenizer(
    tsv_paths: Sequence[str | Path],
    output_dir: str | Path,
    type: str = "bpe",
    vocab_size: int | None = None,
    min_frequency: int = 2,
    progress: bool = False,
    split_punctuation: bool = False,
    sample_size: int | None = None,
) -> Path:
    """Train a `bpe` or `word` tokenizer on both sides of the TSVs; return the path of DIR/tokenizer.json.
    The text is streamed: memory holds word counts, not the corpus. `sample_size`: train on that many pairs drawn
    uniformly (fixed seed) from all the files, instead of all of them."""
    if type not in TYPES:
        fail(f"unknown tokenizer type {type!r}; choose one of: {', '.join(TYPES)}")
    if isinstance(tsv_paths, (str, Path, CorpusSource)):
        tsv_paths = [tsv_paths]
    if not tsv_paths:
        fail("no input TSV files given")
    if vocab_size is None:
        vocab_size = DEFAULT_VOCAB_SIZE[type]
    specials = BPE_SPECIALS if type == "bpe" else WORD_SPECIALS
    if vocab_size <= len(specials):
        fail(f"--vocab_size {vocab_size} is too small; it must exceed the {len(specials)} special tokens")
    if min_frequency < 1:
        fail(f"--min_frequency {min_frequency} must be at least 1")
    if sample_size is not None and sample_size < 1:
        fail(f"--sample_size {sample_size} must be >= 1 (pairs to train on)")
    if split_punctuation and type != "bpe":
        fail("--split_punctuation applies to --type bpe only")
    output_dir = Path(output_dir)
    _check_writable(output_dir)  # before the training, not after it
    total = _count_pairs(tsv_paths) if sample_size is not None else None  # a pass over the text: only to sample
    chosen = sample_pairs(total, sample_size) if total is not None else None
    used = total if chosen is None else len(chosen)
    sentences = _sentences(tsv_paths, chosen)
    if type == "bpe":
        tok = _train_bpe(
            sentences, None if used is None else 2 * used, vocab_size, min_frequency, progress, split_punctuation
        )
    else:
        tok = _train_word(sentences, vocab_size, min_frequency)
    for expected_id, token in enumerate(specials):
        if tok.token_to_id(token) != expected_id:  # the dataset and model rely on these exact ids
            raise AssertionError(f"{token} got id {tok.token_to_id(token)}, expected {expected_id}")

    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _cannot_write(output_dir, exc.strerror or str(exc))
    meta = {
        "type": type,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "requested_vocab_size": vocab_size,
        "min_frequency": min_frequency,
        "split_punctuation": split_punctuation,
        "sample_size": None if chosen is None else len(chosen),
        "special_tokens": {token: i for i, token in enumerate(specials)},
        "inputs": [_input_record(p) for p in tsv_paths],
    }
    tokenizer_path = output_dir / TOKENIZER_FILE
    with atomic_write(tokenizer_path) as handle:
        handle.write(tok.to_str(pretty=True))
    with atomic_write(output_dir / META_FILE) as handle:
        json.dump(meta, handle, indent=2, ensure_ascii=False)
        handle.write("\n")
    return tokenizer_path


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load DIR/tokenizer.json (or the file itself); UserError if it is missing or not a tokenizers file."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        fail(f"{path}: tokenizer file not found; train one with python -m preprocess.tokenizer")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for any parse error
        fail(f"{path}: not a valid tokenizers JSON file ({str(exc).splitlines()[0] if str(exc) else exc!r})")


def tokenizer_from_json(text: str, what: str) -> Tokenizer:
    """A tokenizer from its JSON text (a checkpoint's recorded copy); UserError naming `what` if it does not parse."""
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for any parse error
        fail(f"{what} is not a valid tokenizers JSON text ({str(exc).splitlines()[0] if str(exc) else exc!r})")


def special_ids(tok: Tokenizer) -> SpecialIds:
    """Ids of PAD/UNK/BOS/EOS; for the `word` type BOS and EOS are both <eot>, as in the seed."""
    lookup = {token: tok.token_to_id(token) for token in (*BPE_SPECIALS, "<eot>")}
    if lookup["<eot>"] is not None:
        required = ("<pad>", "<unk>", "<eot>")
        bos_token = eos_token = "<eot>"
    else:
        required = BPE_SPECIALS
        bos_token, eos_token = "<s>", "</s>"
    missing = [token for token in required if lookup[token] is None]
    if missing:
        fail(f"tokenizer lacks special token(s) {', '.join(missing)}; train it with python -m preprocess.tokenizer")
    return SpecialIds(pad=lookup["<pad>"], unk=lookup["<unk>"], bos=lookup[bos_token], eos=lookup[eos_token])


def encode_sources(
    tok: Tokenizer, lines: Sequence[str], src_len: int, eos_id: int
) -> tuple[list[list[int]], list[int]]:
    """Each line as preprocess.dataset lays out a source: its tokens, then EOS — at most src_len ids, the model's
    source positions. Returns the id lists and the indices of the lines that had more than src_len-1 tokens: those
    were cut to their first src_len-1 tokens (as the training data is), and the caller must say so."""
    encoded = tok.encode_batch(list(lines), add_special_tokens=False)
    longer = [i for i, enc in enumerate(encoded) if len(enc.ids) > src_len - 1]
    return [enc.ids[: src_len - 1] + [eos_id] for enc in encoded], longer


def decode_hypotheses(
    tok: Tokenizer, rows: Sequence[Sequence[int]], eos_id: int, pad_id: int
) -> tuple[list[str], list[bool]]:
    """Generated id rows → detokenized text (up to the first EOS; PAD and special tokens dropped, one line each)
    and whether each row had produced its EOS."""
    kept, finished = [], []
    for row in rows:
        row = list(row)
        end = row.index(eos_id) if eos_id in row else len(row)
        kept.append([t for t in row[:end] if t != pad_id])
        finished.append(end < len(row))
    texts = [text.replace("\n", " ").strip() for text in tok.decode_batch(kept, skip_special_tokens=True)]
    return texts, finished


def save_for_transformers(tokenizer: str | Path | Tokenizer, output_dir: str | Path, model_max_length: int) -> None:
    """DIR/tokenizer.json + tokenizer_config.json that `transformers.AutoTokenizer.from_pretrained(DIR)` loads (a
    PreTrainedTokenizerFast, no code of ours): the same normalizer, pre-tokenizer, model and decoder, plus a
    post-processor appending EOS, so `tok(text)["input_ids"]` is the source row of preprocess.dataset and
    `tok(text_target=text)` its labels. `tokenizer`: a tokenizer.json path or a loaded Tokenizer (not modified).

    model_max_length = src_len, the model's source positions. tokenizer.json itself truncates to it (the
    `tokenizers` library applies that on every encode: src_len-1 tokens + EOS, as the dataset cuts); transformers 5's
    tokenizer call switches the backend's truncation off unless it is asked for (`truncation=True`), which is why the
    README's lines pass it — without it a longer source reaches the model's position table and generate() fails."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = (
        Tokenizer.from_str(tokenizer.to_str())
        if isinstance(tokenizer, Tokenizer)  # a copy: we change it
        else load_tokenizer(tokenizer)
    )
    ids = special_ids(tok)
    bos, eos, pad, unk = (tok.id_to_token(i) for i in (ids.bos, ids.eos, ids.pad, ids.unk))
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A $B {eos}", special_tokens=[(eos, ids.eos)]
    )
    tok.enable_truncation(max_length=model_max_length)  # counts the EOS the post-processor adds
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token=unk,
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    hf.save_pretrained(str(output_dir))
    config_path = Path(output_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name every transformers version resolves
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(prog: str = "python -m preprocess.tokenizer") -> int:
    """`prog`: the command as the user ran it (`python -m preprocess.tokenizer`, or its dstr-prepare-* command):
    --help names it."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train one tokenizer over both sides of source<TAB>target TSV files and save it as "
        f"DIR/{TOKENIZER_FILE} (plus DIR/{META_FILE}).",
        epilog="examples:\n"
        f"  {prog} --input data/multi30k/train.fr_en.tsv --output data/multi30k/bpe8k\n"
        f"  {prog} --input output/wmt14.fr_en.txt --output output/word --type word",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--input",
        required=True,
        nargs="+",
        metavar="PATH",
        help="training TSV file(s); or datasets save_to_disk folders / .jsonl/.json/.csv/.parquet "
        "files, with the column flags below",
    )
    parser.add_argument("--output", required=True, metavar="DIR", help="directory for tokenizer.json")
    # Validated in train_tokenizer rather than with argparse choices, so a bad value gives the same one-line
    # "error: ..." as every other user mistake.
    parser.add_argument(
        "--type",
        default="bpe",
        metavar="{bpe,word}",
        help="bpe: joint subword BPE (default); word: the MindSpore seed's lowercased "
        "whitespace vocabulary with <unk>=0, <pad>=1, <eot>=2",
    )
    parser.add_argument(
        "--vocab_size",
        type=int,
        default=None,
        help="vocabulary size including special tokens (default: 8000 for bpe, 20000 for word)",
    )
    parser.add_argument(
        "--min_frequency",
        type=int,
        default=2,
        help="least count for a merge (bpe) or word (word) to enter the vocabulary (default: 2)",
    )
    parser.add_argument(
        "--sample_size",
        type=int,
        default=None,
        metavar="PAIRS",
        help="train on this many pairs drawn uniformly (a fixed seed) from the inputs instead of all "
        "of them: a large corpus's vocabulary in a fraction of the time (default: all)",
    )
    parser.add_argument(
        "--split_punctuation",
        action="store_true",
        help="bpe: split punctuation from words before learning merges (decoding still restores the original spacing)",
    )
    add_corpus_flags(parser.add_argument_group("table input (not for a TSV): docs/data.md, Input formats"))
    args = parser.parse_args()
    options = options_from_args(args)
    opened = [open_corpus(p, options, "--input") for p in args.input]
    # a TSV stays a path: read as before
    inputs = [p if source.is_tsv else source for p, source in zip(args.input, opened, strict=True)]
    path = train_tokenizer(
        inputs,
        args.output,
        type=args.type,
        vocab_size=args.vocab_size,
        min_frequency=args.min_frequency,
        progress=sys.stderr.isatty(),
        split_punctuation=args.split_punctuation,
        sample_size=args.sample_size,
    )
    tok = load_tokenizer(path)
    print(f"wrote {args.type} tokenizer with {tok.get_vocab_size()} tokens to {path}")
    return 0


if __name__ == "__main__":
    run_cli(main)
