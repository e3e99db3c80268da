#!/usr/bin/env python3
"""Consolidate a ds-transformer-recipes checkpoint into one fp32 state dict of the serial model.

This file is copied into every checkpoint folder, as DeepSpeed copies its own zero_to_fp32.py: these checkpoints are
not DeepSpeed's format (DeepSpeed's `python -m deepspeed.utils.zero_to_fp32` cannot read them), and this script,
run from the folder, does that job for them, from any layout (TP, pipeline, ZeRO 1/2/3), checking every file read
against the sha256 the save recorded:

    python zero_to_fp32.py . model.safetensors       # or model.pt (with config/step), pytorch_model.bin
    python zero_to_fp32.py . OUTPUT_DIR/             # a folder: pytorch_model.bin in it (model.safetensors with
                                                     # --safe_serialization), as DeepSpeed's script names them

It needs the repository's package importable (`pip install -e` the repository); the same command there is
`python run_scripts/merge_checkpoint.py CHECKPOINT --output OUT`.
"""

import argparse
import os
import sys

NEEDS_PACKAGE = (
    "error: zero_to_fp32.py needs the ds-transformer-recipes package, which is not importable here: "
    "`pip install -e /path/to/ds-transformer-recipes` (the repository that trained this checkpoint), or "
    "run `python run_scripts/merge_checkpoint.py CHECKPOINT --output OUT` in it"
)


def output_path(output: str, safe_serialization: bool) -> str:
    """A file named by its extension, or (a folder, or no known extension) the file DeepSpeed's script writes in it."""
    if output.endswith((".safetensors", ".pt", ".bin")) and not os.path.isdir(output):
        return output
    return os.path.join(output, "model.safetensors" if safe_serialization else "pytorch_model.bin")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "checkpoint_dir",
        help="this checkpoint's folder (.), a checkpoints/ folder or a run's output_dir (→ its latest)",
    )
    p.add_argument("output", help="a .safetensors, .pt or .bin file, or a folder")
    p.add_argument(
        "--safe_serialization",
        action="store_true",
        help="into a folder: model.safetensors instead of pytorch_model.bin",
    )
    p.add_argument("--no_verify", action="store_true", help="skip the sha256 checks of the files read")
    args = p.parse_args(argv)
    try:
        from common.errors import run_cli
        from common.user_files import refuse_output_over_inputs
        from training.checkpoint.consolidated import merge, save, source_files
    except ImportError:
        print(NEEDS_PACKAGE, file=sys.stderr)
        return 1

    def consolidate() -> int:
        out = output_path(args.output, args.safe_serialization)
        refuse_output_over_inputs(out, "output", source_files([os.path.abspath(args.checkpoint_dir)]))
        merged = merge(os.path.abspath(args.checkpoint_dir), verify=not args.no_verify)  # "." named in full
        save(merged, out)
        print(f"wrote {out}: {len(merged['model'])} fp32 tensors, step {merged['step']}, from {merged['checkpoint']}")
        return 0

    run_cli(consolidate)  # one `error:` line for a damaged or wrong checkpoint; exits


if __name__ == "__main__":
    sys.exit(main())
