"""Translate text with a trained checkpoint: sentences from stdin or a file, one translation per line on stdout.

    echo "Un homme en vélo devant une maison." | dstr-translate --ckpt_file out/quickstart
    dstr-translate --ckpt_file out/quickstart/avg2.pt --input news.fr --beam 5 --output news.en

--ckpt_file is anything evaluate.py takes (a checkpoint of any layout, a run's output_dir → its latest checkpoint, a
merged or averaged .pt), and the tokenizer is the one it recorded: nothing else is needed (--tokenizer only for
checkpoints saved before checkpoints held their tokenizer). Decoding is evaluate.py's (the same flags: --beam,
--lenpen, --batch_size, --device, --no_cache): each input line becomes one output line, in order; an empty line
stays empty. A source longer than the model's src_len positions is cut to src_len-1 tokens + EOS, as the training
data was, with a warning on stderr. What was loaded and how fast it went go to stderr, so stdout holds only the
translations.

A pipe or a terminal on stdin is translated as it arrives: each line is answered (written and flushed) as soon as it
is read, and lines that arrive together are decoded together, in batches of --batch_size; a file (--input FILE, or
stdin redirected from one) is read whole and decoded in length-sorted batches.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass

from common.cli_args import Parser
from common.errors import UserError, console_script
from training.evaluation.decode_cli import add_decoding_flags, checkpoint_inputs, load_translator, warn_truncated


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(
        prog="dstr-translate",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_decoding_flags(p)
    p.add_argument(
        "--input", "-i", default="-", help="sentences to translate, one per line (plain or .gz; default '-': stdin)"
    )
    p.add_argument("--output", "-o", default=None, help="write the translations here instead of stdout")
    return p.parse_args(argv)


def read_input(path: str) -> list[str]:
    from common.text_lines import decode_lines, read_lines

    if path == "-":
        return decode_lines(sys.stdin.buffer.read(), "stdin")
    return read_lines(path)


@dataclass
class Totals:
    sentences: int = 0  # non-empty lines translated
    seconds: float = 0.0
    unfinished: int = 0


def translate_lines(translator, lines: list[str], first: int, args, totals: Totals, progress: bool) -> list[str]:
    """One output line per input line (empty stays empty); `first`: the index of lines[0] in the whole input, for
    the truncation warning's line numbers."""
    keep = [i for i, line in enumerate(lines) if line.strip()]  # empty lines stay empty, undecoded
    out = [""] * len(lines)
    if not keep:
        return out
    result = translator.translate(
        [lines[i] for i in keep],
        args.beam,
        args.lenpen,
        args.batch_size,
        use_cache=not args.no_cache,
        progress=progress,
    )
    warn_truncated([first + keep[i] for i in result.truncated], len(lines), translator.cfg.src_len)
    for i, hyp in zip(keep, result.hypotheses, strict=True):
        out[i] = hyp
    totals.sentences += len(keep)
    totals.seconds += result.seconds
    totals.unfinished += result.unfinished
    return out


def translate_stream(translator, args, totals: Totals) -> list[str] | None:
    """stdin as a pipe or a terminal: every group of lines that has arrived is translated and written (flushed)
    before more is read, so each line is answered while the next is still being typed or produced. With --output,
    the translations are kept for one atomic write at the end (returned)."""
    from training.evaluation.line_stream import arriving_lines

    if sys.stdin.isatty():
        print("reading sentences from the terminal, one per line; end with Ctrl-D", file=sys.stderr, flush=True)
    kept, seen = ([] if args.output else None), 0
    for group in arriving_lines(sys.stdin.fileno(), "stdin"):
        out = translate_lines(translator, group, seen, args, totals, progress=False)
        seen += len(group)
        if kept is not None:
            kept.extend(out)
        else:
            sys.stdout.writelines(h + "\n" for h in out)
            sys.stdout.flush()
    if not seen:
        raise UserError("nothing to translate: stdin is empty")
    return kept


def main(argv=None) -> int:
    args = parse_args(argv)
    from common.staging import atomic_write
    from common.user_files import check_output_file, refuse_output_over_inputs
    from training.evaluation.line_stream import is_stream

    if args.output:
        check_output_file(args.output, "--output")
        # stdin redirected from a file is that file (/dev/stdin: the file on descriptor 0)
        given = ("the file on stdin", "/dev/stdin") if args.input == "-" else (f"--input {args.input}", args.input)
        refuse_output_over_inputs(args.output, "--output", [given, *checkpoint_inputs(args)])
    # a file (or stdin redirected from one) is read whole and translated in length-sorted batches; a pipe or a
    # terminal is translated as its lines arrive
    streaming = args.input == "-" and is_stream(sys.stdin.fileno())
    lines = None if streaming else read_input(args.input)
    if lines is not None and not lines:
        raise UserError(f"nothing to translate: {'stdin' if args.input == '-' else args.input} is empty")
    # DeepSpeed's logger writes to the stdout it finds when first imported (here): make that stderr, so stdout holds
    # the translations alone
    with contextlib.redirect_stdout(sys.stderr):
        translator = load_translator(args)
    cfg = translator.cfg
    print(
        f"checkpoint {translator.checkpoint} (step {translator.step}{translator.chosen}), tokenizer "
        f"{translator.tokenizer_path}, {'greedy' if args.beam == 1 else f'beam {args.beam} (lenpen {args.lenpen})'}"
        f" on {translator.device}",
        file=sys.stderr,
        flush=True,
    )
    totals = Totals()
    if streaming:
        out = translate_stream(translator, args, totals)
    else:
        out = translate_lines(translator, lines, 0, args, totals, progress=not args.no_progress and sys.stderr.isatty())
        if not args.output:
            sys.stdout.writelines(h + "\n" for h in out)
            sys.stdout.flush()
    if args.output:
        with atomic_write(args.output) as handle:
            handle.writelines(h + "\n" for h in out)
    print(
        f"{totals.sentences} sentences in {totals.seconds:.1f} s ({totals.sentences / max(totals.seconds, 1e-9):.1f} "
        f"sentences/s), {totals.unfinished} reached tgt_len {cfg.tgt_len} without EOS"
        + (f"; translations in {args.output}" if args.output else ""),
        file=sys.stderr,
        flush=True,
    )
    return 0


cli = console_script(main)  # the console script (setup.cfg): user mistakes in one line


if __name__ == "__main__":
    cli()
