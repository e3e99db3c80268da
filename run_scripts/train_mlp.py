#!/usr/bin/env python3
"""The seed's MicroBatchInterleaved example: its MLP classifier (784-512-512-10, SGD lr 1e-2, batch 32,
cross-entropy) on handwritten digits, tensor-parallel, each batch run as `--interleave_num` parts.

    deepspeed --num_gpus 2 run_scripts/train_mlp.py --mp 2 --interleave_num 2          # the seed's setting
    bash recipes/interleaved-mlp/run.sh                                                 # the same, as a recipe

Data: scikit-learn's bundled digits (offline), resized from 8×8 to the seed's 28×28 (preprocess/digits.py).
"""

from __future__ import annotations

import argparse
import sys

try:
    from common.script_entry import require_own_checkout
except ModuleNotFoundError:  # no package to import: one line, not a traceback
    print(
        "error: this checkout's Python packages are not installed (or an older copy is): run `pip install -e .` "
        "in the checkout (README), or set PYTHONPATH to its folder",
        file=sys.stderr,
    )
    sys.exit(2)
require_own_checkout(__file__)  # and it is this checkout's (common/script_entry.py)

from common.errors import run_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train_mlp.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--distribute",
        default="auto",
        choices=["true", "false", "auto"],
        help="true: join the launcher's process group; false: one process; auto (default)",
    )
    p.add_argument("--mp", type=int, default=2, help="tensor-parallel size (default 2); dp = processes / mp")
    p.add_argument(
        "--interleave_num",
        type=int,
        default=2,
        help="batch parts whose TP communication overlaps each other's compute (default 2, the seed's; "
        "1 = off); must divide the per-rank batch",
    )
    p.add_argument("--batch_size", type=int, default=32, help="global batch (default 32, the seed's)")
    p.add_argument("--lr", type=float, default=1e-2, help="SGD learning rate (default 1e-2, the seed's)")
    p.add_argument("--epochs", type=int, default=10, help="epochs (default 10, the seed's)")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps instead")
    p.add_argument(
        "--train_size",
        type=int,
        default=1500,
        help="digits used for training; the rest (of 1,797) measure accuracy (default 1500)",
    )
    p.add_argument("--log_interval", type=int, default=100, help="print the loss every N steps (default 100)")
    p.add_argument("--seed", type=int, default=0, help="weights and data order (default 0)")
    p.add_argument("--output_dir", default="out/interleaved-mlp", help="metrics.jsonl goes here")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from demos.interleaved_mlp.train import train_digits

    train_digits(args)
    from training.run.job import leave_job

    leave_job()
    return 0


if __name__ == "__main__":
    run_cli(main)
