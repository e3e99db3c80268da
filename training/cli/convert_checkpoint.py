"""Convert a format-1 checkpoint (torch .pt shards, written before checkpoints became safetensors) to the current
format, once; train.py, merge_checkpoint.py, evaluate.py... then load the converted folder.

    dstr-convert-checkpoint out/run/checkpoints/step_00000020 out/run/checkpoints/v2-step_00000020
    dstr-convert-checkpoint out/run out/run-v2/step_00000020      # a run's latest checkpoint

Every tensor — fp32 master weights, AdamW moments, RNG states — is copied unchanged, and meta.json keeps the step,
data position, LR schedule and configs. The old files are read with torch.load(weights_only=True) (no code runs)
and left in place. NEW must not exist. Resume from it with train.py --ckpt_file NEW.
"""

from __future__ import annotations

import argparse

from common.errors import console_script


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="dstr-convert-checkpoint",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("old", help="a format-1 step_* folder, or a run's output_dir / checkpoints/ folder (→ latest)")
    p.add_argument("new", help="the folder to write the converted checkpoint to (must not exist)")
    args = p.parse_args(argv)
    from training.checkpoint.convert import convert_format_1

    meta = convert_format_1(args.old, args.new)
    print(
        f"wrote {args.new}: step {meta['step']}, {len(meta['shards'])} shard(s), {len(meta['rng'])} RNG file(s), "
        f"format {meta['format_version']}"
    )
    return 0


cli = console_script(main)  # the console script (setup.cfg): user mistakes in one line


if __name__ == "__main__":
    cli()
