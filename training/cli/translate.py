"""Translate text with a trained checkpoint: sentences from stdin or a file, one translation per line on stdout.

    echo "Un homme en vélo devant une maison." | python run_scripts/translate.py --ckpt_file out/quickstart
    python run_scripts/translate.py --ckpt_file out/quickstart/avg2.pt --input news.fr --beam 5 --output news.en

--ckpt_file is anything evaluate.py takes (a checkpoint of any layout, a run's output_dir → its latest checkpoint, a
merged or averaged .pt), and the tokenizer is the one it recorded: nothing else is needed (--tokenizer only for
checkpoints saved before checkpoints held their tokenizer). Decoding is evaluate.py's (the same flags: --beam,
--lenpen, --batch_size, --device, --no_cache): each input line becomes one output line, in order; an empty line
stays empty. A source longer than the model's src_len positions is cut to src_len-1 tokens + EOS, as the training
data was, with a warning on stderr. What was loaded and how fast it went go to stderr, so stdout holds only the
translations.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from typing import NoReturn

from common.cli_args import Parser
from common.errors import UserError, run_cli
from training.evaluation.decode_cli import add_decoding_flags, load_translator, warn_truncated


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_decoding_flags(p)
    p.add_argument("--input", "-i", default="-",
                   help="sentences to translate, one per line (plain or .gz; default '-': stdin)")
    p.add_argument("--output", "-o", default=None, help="write the translations here instead of stdout")
    return p.parse_args(argv)


def read_input(path: str) -> list[str]:
    from preprocess.textio import decode_lines, read_lines
    if path == "-":
        if sys.stdin.isatty():
            print("reading sentences from the terminal, one per line; end with Ctrl-D", file=sys.stderr, flush=True)
        return decode_lines(sys.stdin.buffer.read(), "stdin")
    return read_lines(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    from preprocess.textio import atomic_write, check_output_file
    if args.output:
        check_output_file(args.output, "--output")
    lines = read_input(args.input)
    if not lines:
        raise UserError(f"nothing to translate: {'stdin' if args.input == '-' else args.input} is empty")
    # DeepSpeed's logger writes to the stdout it finds when first imported (here): make that stderr, so stdout holds
    # the translations alone
    with contextlib.redirect_stdout(sys.stderr):
        translator = load_translator(args)
    cfg = translator.cfg
    print(f"checkpoint {translator.checkpoint} (step {translator.step}), tokenizer {translator.tokenizer_path}, "
          f"{'greedy' if args.beam == 1 else f'beam {args.beam} (lenpen {args.lenpen})'} on {translator.device}",
          file=sys.stderr, flush=True)
    keep = [i for i, line in enumerate(lines) if line.strip()]        # empty lines stay empty, undecoded
    result = translator.translate([lines[i] for i in keep], args.beam, args.lenpen, args.batch_size,
                                  use_cache=not args.no_cache, progress=not args.no_progress and sys.stderr.isatty())
    warn_truncated([keep[i] for i in result.truncated], len(lines), cfg.src_len)
    out = [""] * len(lines)
    for i, hyp in zip(keep, result.hypotheses):
        out[i] = hyp
    if args.output:
        with atomic_write(args.output) as handle:
            handle.writelines(h + "\n" for h in out)
    else:
        sys.stdout.writelines(h + "\n" for h in out)
        sys.stdout.flush()
    print(f"{len(keep)} sentences in {result.seconds:.1f} s ({len(keep) / max(result.seconds, 1e-9):.1f} "
          f"sentences/s), {result.unfinished} reached tgt_len {cfg.tgt_len} without EOS"
          + (f"; translations in {args.output}" if args.output else ""), file=sys.stderr, flush=True)
    return 0


def cli() -> NoReturn:
    """The console script (setup.cfg): one exit path, user mistakes in one line."""
    run_cli(main)


if __name__ == "__main__":
    cli()
