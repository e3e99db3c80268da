"""Translate a source file with a trained checkpoint (greedy or beam search) and score it against references with
sacreBLEU (BLEU and chrF).

    dstr-evaluate --ckpt_file out/quickstart --src data/multi30k/val.fr.gz \\
        --ref data/multi30k/val.en.gz --beam 5 --output out/quickstart/val.hyp.en

--ckpt_file is a step_* folder, a checkpoints/ folder or a run's output_dir (→ its latest checkpoint), saved under
any parallel layout, or a .pt written by merge_checkpoint.py / average_checkpoints.py; it is decoded as the serial
model on one device (training/evaluation/translator.py, model/inference.py: KV cache, batched), with the tokenizer
the checkpoint recorded (--tokenizer only for checkpoints saved before they held one; a given one must be the
checkpoint's). Sources are encoded as the training data is (tokens, then EOS); one longer than the model's src_len
positions is cut to src_len-1 tokens + EOS, with a warning, and counted ("truncated_sources"). Translations are up to
tgt_len tokens, detokenized with the tokenizer's decoder; --beam N uses beam search with score = sum of log-probs /
length ** --lenpen (fairseq's and transformers' length penalty; a hypothesis is final when N have ended). With --ref,
prints sacreBLEU's `BLEU = ...` and `chrF2 = ...` lines with their signatures; without it, only the decoding figures
(translations alone: dstr-translate). Then one JSON line: {"bleu", "chrf" (with --ref), "sentences",
"sentences_per_second", "truncated_sources", ...}. --output writes one hypothesis per line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from common.cli_args import Parser, integer
from common.errors import UserError, console_script
from training.evaluation.decode_cli import add_decoding_flags, checkpoint_inputs, load_translator, warn_truncated


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(
        prog="dstr-evaluate",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_decoding_flags(p)
    p.add_argument("--src", required=True, help="source sentences, one per line (plain or .gz)")
    p.add_argument(
        "--ref",
        default=None,
        help="reference translations, line-aligned with --src (plain or .gz); without it nothing is "
        "scored (decoding speed, --output)",
    )
    p.add_argument("--limit", type=integer(1), default=None, help="only the first N sentences")
    p.add_argument("--output", default=None, help="write the hypotheses here, one per line")
    p.add_argument(
        "--lowercase",
        action="store_true",
        help="case-insensitive BLEU/chrF (e.g. for the lowercasing `word` tokenizer)",
    )
    return p.parse_args(argv)


def _read_inputs(args) -> tuple[list[str], list[str] | None]:
    """The sources and references (line-aligned, cut to --limit), once --output is known not to overwrite them."""
    from common.text_lines import read_lines
    from common.user_files import check_output_file, refuse_output_over_inputs

    if args.output:
        check_output_file(args.output, "--output")
        refuse_output_over_inputs(
            args.output,
            "--output",
            [(f"--src {args.src}", args.src), (f"--ref {args.ref}", args.ref), *checkpoint_inputs(args)],
        )
    sources = read_lines(args.src)
    references = read_lines(args.ref) if args.ref else None
    if references is not None and len(sources) != len(references):
        raise UserError(
            f"--src {args.src} has {len(sources)} lines but --ref {args.ref} has {len(references)}; "
            f"the files must be line-aligned translations of each other"
        )
    if args.limit is not None:
        sources = sources[: args.limit]
        references = references[: args.limit] if references is not None else None
    return sources, references


def _score(hyps: list[str], references: list[str], lowercase: bool) -> tuple[dict, list[str]]:
    """sacreBLEU's BLEU and chrF of the hypotheses: the figures and the lines that report them."""
    from sacrebleu.metrics import BLEU, CHRF

    bleu_metric, chrf_metric = BLEU(lowercase=lowercase), CHRF(lowercase=lowercase)
    bleu = bleu_metric.corpus_score(hyps, [references])
    chrf = chrf_metric.corpus_score(hyps, [references])
    scores = {
        "bleu": round(bleu.score, 4),
        "chrf": round(chrf.score, 4),
        "bleu_signature": str(bleu_metric.get_signature()),
        "chrf_signature": str(chrf_metric.get_signature()),
    }
    lines = [
        f"{bleu}",
        f"BLEU signature: {bleu_metric.get_signature()}",
        f"{chrf}",
        f"chrF signature: {chrf_metric.get_signature()}",
    ]
    return scores, lines


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()

    from common.staging import atomic_write

    sources, references = _read_inputs(args)
    translator = load_translator(args)
    load_seconds = time.perf_counter() - start
    result = translator.translate(
        sources, args.beam, args.lenpen, args.batch_size, use_cache=not args.no_cache, progress=not args.no_progress
    )
    hyps, cfg = result.hypotheses, translator.cfg
    warn_truncated(result.truncated, len(sources), cfg.src_len)

    scores, score_lines = _score(hyps, references, args.lowercase) if references is not None else ({}, [])

    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with atomic_write(args.output) as handle:
            for h in hyps:
                handle.write(h + "\n")
    seconds = time.perf_counter() - start

    for line in score_lines:
        print(line)
    decoding = f"beam {args.beam} (lenpen {args.lenpen})" if args.beam > 1 else "greedy"
    print(
        f"checkpoint {translator.checkpoint} (step {translator.step}{translator.chosen}), {len(hyps)} sentences, "
        f"{decoding} on {translator.device}{'' if not args.no_cache else ' without KV cache'}: "
        f"{result.seconds:.1f} s "
        f"({len(hyps) / result.seconds:.1f} sentences/s), {result.unfinished} reached tgt_len {cfg.tgt_len} "
        f"without EOS, {len(result.truncated)} sources truncated; total {seconds:.1f} s"
        + (f"; hypotheses in {args.output}" if args.output else "")
    )
    summary = {
        **{k: scores[k] for k in ("bleu", "chrf") if k in scores},
        "sentences": len(hyps),
        "beam": args.beam,
        "lenpen": args.lenpen,
        "kv_cache": not args.no_cache,
        "device": str(translator.device),
        "seconds": round(seconds, 3),
        "decode_seconds": round(result.seconds, 3),
        "sentences_per_second": round(len(hyps) / result.seconds, 2),
        "load_seconds": round(load_seconds, 3),
        "unfinished": result.unfinished,
        "truncated_sources": len(result.truncated),
        "step": translator.step,
        "checkpoint": translator.checkpoint,
        "tokenizer": translator.tokenizer_path,
        **{k: scores[k] for k in ("bleu_signature", "chrf_signature") if k in scores},
    }
    if translator.averaged:
        summary["averaged"] = translator.averaged
    print(json.dumps(summary), flush=True)
    return 0


cli = console_script(main)  # the console script (setup.cfg): user mistakes in one line


if __name__ == "__main__":
    cli()
