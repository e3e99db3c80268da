"""The flags run_scripts/evaluate.py and run_scripts/translate.py share (export_hf.py the checkpoint's) — which
checkpoint, which tokenizer, how to decode — and the translator they build from them, so the two decode alike and
say the same about truncated sources."""

from __future__ import annotations

import argparse
import os
import sys

from common.cli_args import integer, number


def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """Which checkpoint, which tokenizer, and how they are checked (evaluate.py, translate.py, export_hf.py)."""
    p.add_argument(
        "--ckpt_file",
        required=True,
        help="a step_* folder, a checkpoints/ folder, a run's output_dir (→ its latest checkpoint), "
        "RUN/best (the run's lowest valid_loss), RUN/latest, or a merged/averaged .pt or .safetensors",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="the tokenizer.json the checkpoint was trained with, or its folder (default: the copy the "
        "checkpoint holds; only checkpoints saved before checkpoints recorded it need this)",
    )
    p.add_argument(
        "--ignore_tokenizer_hash",
        action="store_true",
        help="go on even if --tokenizer is not byte-identical to the one recorded in the checkpoint",
    )
    p.add_argument(
        "--no_verify",
        action="store_true",
        help="load a checkpoint folder without checking its files against the sha256 stored at save "
        "(default: checked; a damaged file is refused naming it)",
    )


# A hypothesis's score is its summed log-probability / length ** lenpen, in float32. Tuned values lie in 0.6-2
# (GNMT, fairseq, Marian); a negative one rewards short output (-1e30 made every hypothesis empty), NaN makes every
# score NaN, and past 9 length ** lenpen overflows float32 at the longest lengths (16384 ** 9.2 > 3.4e38), so every
# score ties: [0, 5] keeps all that is useful.
LENPEN = number(0, 5, why="0 = no length penalty; tuned values are 0.6-2")


def devices_here() -> str:
    """The devices this process can decode on, as --device takes them: cpu and each of the accelerator's."""
    import torch

    if not hasattr(torch, "accelerator"):  # torch < 2.6: CUDA only
        return ", ".join(["cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))])
    accelerator = torch.accelerator.current_accelerator()
    count = torch.accelerator.device_count() if accelerator is not None else 0
    return ", ".join(["cpu", *(f"{accelerator.type}:{i}" for i in range(count))])


def decode_device(name: str) -> str:
    """--device, checked when the flags are read: a device torch names and this machine has, or one line naming
    it and what is here — a missing CUDA device was a 36-line traceback from inside the model's .to()."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"{name} is not a torch device name (cpu, cuda, cuda:N, mps, xpu, ...); available here: {devices_here()}"
        ) from None
    if device.type == "meta":
        raise argparse.ArgumentTypeError(
            f"{name} holds shapes, not values: nothing can be decoded on it; available here: {devices_here()}"
        )
    try:
        torch.empty(1, device=device)  # what the model's .to() would meet: no such backend, or index
    except (RuntimeError, AssertionError) as exc:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0][:160]  # its first sentence
        raise argparse.ArgumentTypeError(
            f"{name} is not available on this machine ({why}); available here: {devices_here()}"
        ) from None
    return name


def add_decoding_flags(p: argparse.ArgumentParser) -> None:
    add_checkpoint_flags(p)
    p.add_argument("--beam", type=integer(1, why="1 = greedy"), default=1, help="beam size (default: 1 = greedy)")
    p.add_argument(
        "--lenpen",
        type=LENPEN,
        default=1.0,
        help="beam length penalty: score = sum log-prob / length ** lenpen (default 1.0; 0 = none; "
        f"{LENPEN.describe()})",
    )
    p.add_argument("--batch_size", type=integer(1), default=64, help="sentences decoded together (default: 64)")
    p.add_argument(
        "--device",
        type=decode_device,
        default=None,
        help="torch device to decode on (default: DeepSpeed's accelerator, e.g. cuda:0, else cpu)",
    )
    p.add_argument(
        "--no_cache",
        action="store_true",
        help="recompute the whole target prefix every step instead of using the KV cache (slower, the "
        "same translations; for comparisons)",
    )
    p.add_argument("--no_progress", action="store_true", help="hide the progress bar")


def load_translator(args: argparse.Namespace):
    """The Translator of --ckpt_file; its `chosen` says which checkpoint a name (best, latest, a run) led to, and
    why ("; best: ..."), for the line each command prints about what it loaded."""
    from training.evaluation.checkpoint_choice import choose
    from training.evaluation.translator import Translator

    path, why = choose(args.ckpt_file)
    translator = Translator.load(
        path, args.tokenizer, args.ignore_tokenizer_hash, args.device, verify=not args.no_verify
    )
    translator.chosen = f"; {why}" if why else ""
    return translator


def checkpoint_inputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """What --ckpt_file and --tokenizer make the command read, as (what the user calls it, path), for
    refuse_output_over_inputs: a consolidated file itself, or the files of the checkpoint folder it names; the
    tokenizer file. A --ckpt_file that leads nowhere gives none: the load says why, in its turn."""
    from common.errors import UserError
    from training.checkpoint.folder import checkpoint_files
    from training.evaluation.checkpoint_choice import choose

    found = []
    if args.tokenizer:
        tokenizer = args.tokenizer
        found.append(
            (
                f"--tokenizer {tokenizer}",
                os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer,
            )
        )
    try:
        path, _ = choose(args.ckpt_file)
    except UserError:
        return found
    if os.path.isfile(path):
        return [*found, (f"--ckpt_file {path}", path)]
    return [*found, *((f"{os.path.basename(f)} of the checkpoint {path}", f) for f in checkpoint_files(path))]


def warn_truncated(truncated: list, total: int, src_len: int) -> None:
    """One warning line on stderr for sources longer than the model's positions (cut as the training data was)."""
    if not truncated:
        return
    shown = ", ".join(str(i + 1) for i in truncated[:10]) + (", ..." if len(truncated) > 10 else "")
    print(
        f"warning: {len(truncated)} of {total} sources have more than src_len-1 = {src_len - 1} tokens, the "
        f"model's source positions; each was cut to its first {src_len - 1} tokens + EOS, as the training data "
        f"was (lines {shown})",
        file=sys.stderr,
        flush=True,
    )
