"""The flags run_scripts/evaluate.py and run_scripts/translate.py share (export_hf.py the checkpoint's) — which
checkpoint, which tokenizer, how to decode — and the translator they build from them, so the two decode alike and
say the same about truncated sources."""
from __future__ import annotations

import argparse
import sys

from common.cli_args import integer, number


def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """Which checkpoint, which tokenizer, and how they are checked (evaluate.py, translate.py, export_hf.py)."""
    p.add_argument("--ckpt_file", required=True,
                   help="a step_* folder, a checkpoints/ folder, a run's output_dir (→ its latest checkpoint), "
                        "RUN/best (the run's lowest valid_loss), RUN/latest, or a merged/averaged .pt or .safetensors")
    p.add_argument("--tokenizer", default=None,
                   help="the tokenizer.json the checkpoint was trained with, or its folder (default: the copy the "
                        "checkpoint holds; only checkpoints saved before checkpoints recorded it need this)")
    p.add_argument("--ignore_tokenizer_hash", action="store_true",
                   help="go on even if --tokenizer is not byte-identical to the one recorded in the checkpoint")
    p.add_argument("--no_verify", action="store_true",
                   help="load a checkpoint folder without checking its files against the sha256 stored at save "
                        "(default: checked; a damaged file is refused naming it)")


# A hypothesis's score is its summed log-probability / length ** lenpen, in float32. Tuned values lie in 0.6-2
# (GNMT, fairseq, Marian); a negative one rewards short output (-1e30 made every hypothesis empty), NaN makes every
# score NaN, and past 9 length ** lenpen overflows float32 at the longest lengths (16384 ** 9.2 > 3.4e38), so every
# score ties: [0, 5] keeps all that is useful.
LENPEN = number(0, 5, why="0 = no length penalty; tuned values are 0.6-2")


def add_decoding_flags(p: argparse.ArgumentParser) -> None:
    add_checkpoint_flags(p)
    p.add_argument("--beam", type=integer(1, why="1 = greedy"), default=1, help="beam size (default: 1 = greedy)")
    p.add_argument("--lenpen", type=LENPEN, default=1.0,
                   help="beam length penalty: score = sum log-prob / length ** lenpen (default 1.0; 0 = none; "
                        f"{LENPEN.describe()})")
    p.add_argument("--batch_size", type=integer(1), default=64, help="sentences decoded together (default: 64)")
    p.add_argument("--device", default=None, help="torch device to decode on (default: DeepSpeed's accelerator, "
                                                  "e.g. cuda:0, else cpu)")
    p.add_argument("--no_cache", action="store_true",
                   help="recompute the whole target prefix every step instead of using the KV cache (slower, the "
                        "same translations; for comparisons)")
    p.add_argument("--no_progress", action="store_true", help="hide the progress bar")


def load_translator(args: argparse.Namespace):
    """The Translator of --ckpt_file; its `chosen` says which checkpoint a name (best, latest, a run) led to, and
    why ("; best: ..."), for the line each command prints about what it loaded."""
    from training.evaluation.checkpoint_choice import choose
    from training.evaluation.translator import Translator
    path, why = choose(args.ckpt_file)
    translator = Translator.load(path, args.tokenizer, args.ignore_tokenizer_hash, args.device,
                                 verify=not args.no_verify)
    translator.chosen = f"; {why}" if why else ""
    return translator


def warn_truncated(truncated: list, total: int, src_len: int) -> None:
    """One warning line on stderr for sources longer than the model's positions (cut as the training data was)."""
    if not truncated:
        return
    shown = ", ".join(str(i + 1) for i in truncated[:10]) + (", ..." if len(truncated) > 10 else "")
    print(f"warning: {len(truncated)} of {total} sources have more than src_len-1 = {src_len - 1} tokens, the "
          f"model's source positions; each was cut to its first {src_len - 1} tokens + EOS, as the training data "
          f"was (lines {shown})", file=sys.stderr, flush=True)
