#!/usr/bin/env python3
"""Translate a source file with a trained checkpoint (greedy or beam search) and score it against references with
sacreBLEU (BLEU and chrF).

    python run_scripts/evaluate.py --ckpt_file out/quickstart --tokenizer out/data/bpe8k/tokenizer.json \\
        --src data/multi30k/val.fr.gz --ref data/multi30k/val.en.gz --beam 5 --output out/quickstart/val.hyp.en

--ckpt_file is a step_* folder, a checkpoints/ folder or a run's output_dir (→ its latest checkpoint), saved under
any parallel layout, or a .pt written by merge_checkpoint.py / average_checkpoints.py; it is decoded as the serial
model on one device (training/evaluation/translator.py, model/inference.py: KV cache, batched). Sources are encoded as the
training data is (tokens, then EOS); one longer than the model's src_len positions is cut to src_len-1 tokens + EOS,
with a warning, and counted ("truncated_sources"). Translations are up to tgt_len tokens, detokenized with the
tokenizer's decoder; --beam N uses beam search with score = sum of log-probs / length ** --lenpen (fairseq's and
transformers' length penalty; a hypothesis is final when N have ended). The --tokenizer must be the one the
checkpoint was trained with. Prints sacreBLEU's `BLEU = ...` and `chrF2 = ...` lines with their signatures, then one
JSON line: {"bleu", "chrf", "sentences", "sentences_per_second", "truncated_sources", ...}. --output writes one
hypothesis per line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.errors import UserError, run_cli  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt_file", required=True, help="a step_* folder, a checkpoints/ folder, a run's output_dir, "
                                                      "or a merged/averaged .pt")
    p.add_argument("--tokenizer", required=True, help="the tokenizer.json the checkpoint was trained with (or its "
                                                      "folder)")
    p.add_argument("--src", required=True, help="source sentences, one per line (plain or .gz)")
    p.add_argument("--ref", required=True, help="reference translations, line-aligned with --src (plain or .gz)")
    p.add_argument("--beam", type=int, default=1, help="beam size (default: 1 = greedy)")
    p.add_argument("--lenpen", type=float, default=1.0,
                   help="beam length penalty: score = sum log-prob / length ** lenpen (default 1.0; 0 = none)")
    p.add_argument("--batch_size", type=int, default=64, help="sentences decoded together (default: 64)")
    p.add_argument("--limit", type=int, default=None, help="only the first N sentences")
    p.add_argument("--output", default=None, help="write the hypotheses here, one per line")
    p.add_argument("--lowercase", action="store_true", help="case-insensitive BLEU/chrF (e.g. for the lowercasing "
                                                            "`word` tokenizer)")
    p.add_argument("--device", default=None, help="torch device to decode on (default: DeepSpeed's accelerator, "
                                                  "e.g. cuda:0, else cpu)")
    p.add_argument("--no_cache", action="store_true",
                   help="recompute the whole target prefix every step instead of using the KV cache (slower, the "
                        "same translations; for comparisons)")
    p.add_argument("--ignore_tokenizer_hash", action="store_true",
                   help="decode even if --tokenizer is not byte-identical to the one recorded in the checkpoint")
    p.add_argument("--no_progress", action="store_true", help="hide the progress bar")
    p.add_argument("--no_verify", action="store_true",
                   help="load a checkpoint folder without checking its files against the sha256 stored at save "
                        "(default: checked; a damaged file is refused naming it)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    if args.beam < 1:
        raise UserError(f"--beam {args.beam} must be >= 1 (1 = greedy)")
    if args.batch_size < 1:
        raise UserError(f"--batch_size {args.batch_size} must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit {args.limit} must be >= 1")

    from preprocess.textio import atomic_write, check_output_file, read_lines
    if args.output:
        check_output_file(args.output, "--output")
    sources, references = read_lines(args.src), read_lines(args.ref)
    if len(sources) != len(references):
        raise UserError(f"--src {args.src} has {len(sources)} lines but --ref {args.ref} has {len(references)}; "
                        f"the files must be line-aligned translations of each other")
    if args.limit is not None:
        sources, references = sources[: args.limit], references[: args.limit]

    from training.evaluation.translator import Translator
    translator = Translator.load(args.ckpt_file, args.tokenizer, args.ignore_tokenizer_hash, args.device,
                                 verify=not args.no_verify)
    load_seconds = time.perf_counter() - start
    result = translator.translate(sources, args.beam, args.lenpen, args.batch_size, use_cache=not args.no_cache,
                                  progress=not args.no_progress)
    hyps, cfg = result.hypotheses, translator.cfg
    if result.truncated:
        shown = ", ".join(str(i + 1) for i in result.truncated[:10]) + (", ..." if len(result.truncated) > 10 else "")
        print(f"warning: {len(result.truncated)} of {len(sources)} sources have more than src_len-1 = "
              f"{cfg.src_len - 1} tokens, the model's source positions; each was cut to its first {cfg.src_len - 1} "
              f"tokens + EOS, as the training data was (lines {shown})", file=sys.stderr, flush=True)

    from sacrebleu.metrics import BLEU, CHRF
    bleu_metric, chrf_metric = BLEU(lowercase=args.lowercase), CHRF(lowercase=args.lowercase)
    bleu = bleu_metric.corpus_score(hyps, [references])
    chrf = chrf_metric.corpus_score(hyps, [references])

    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with atomic_write(args.output) as handle:
            for h in hyps:
                handle.write(h + "\n")
    seconds = time.perf_counter() - start

    print(f"{bleu}")
    print(f"BLEU signature: {bleu_metric.get_signature()}")
    print(f"{chrf}")
    print(f"chrF signature: {chrf_metric.get_signature()}")
    decoding = f"beam {args.beam} (lenpen {args.lenpen})" if args.beam > 1 else "greedy"
    print(f"checkpoint {translator.checkpoint} (step {translator.step}), {len(hyps)} sentences, {decoding} on "
          f"{translator.device}{'' if not args.no_cache else ' without KV cache'}: {result.seconds:.1f} s "
          f"({len(hyps) / result.seconds:.1f} sentences/s), {result.unfinished} reached tgt_len {cfg.tgt_len} "
          f"without EOS, {len(result.truncated)} sources truncated; total {seconds:.1f} s"
          + (f"; hypotheses in {args.output}" if args.output else ""))
    summary = {"bleu": round(bleu.score, 4), "chrf": round(chrf.score, 4), "sentences": len(hyps),
               "beam": args.beam, "lenpen": args.lenpen, "kv_cache": not args.no_cache,
               "device": str(translator.device), "seconds": round(seconds, 3),
               "decode_seconds": round(result.seconds, 3),
               "sentences_per_second": round(len(hyps) / result.seconds, 2), "load_seconds": round(load_seconds, 3),
               "unfinished": result.unfinished, "truncated_sources": len(result.truncated), "step": translator.step,
               "checkpoint": translator.checkpoint, "bleu_signature": str(bleu_metric.get_signature()),
               "chrf_signature": str(chrf_metric.get_signature())}
    if translator.averaged:
        summary["averaged"] = translator.averaged
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)
