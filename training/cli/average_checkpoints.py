"""Average the weights of several checkpoints of one run (fairseq's average_checkpoints.py), usually its last K.

    dstr-average-checkpoints out/run --last 5 --output out/run/avg5.pt
    dstr-average-checkpoints out/run/checkpoints/step_00000400 out/run-pp2/checkpoints/step_00000600 \\
        --output out/avg.pt

Each checkpoint is consolidated into the serial model's fp32 weights (any layout: TP shards, pipeline stages, ZeRO
partitions — checkpoints of one run saved under different layouts can be mixed), then every parameter is the
elementwise mean (summed in float64). The output is a consolidated .pt like merge_checkpoint.py's, with the last
checkpoint's step and config and the list of averaged checkpoints; evaluate.py and export_hf.py take it as
--ckpt_file. --last K takes the K newest step_* checkpoints of a run's output_dir (or checkpoints/ folder); train
with --keep_checkpoint_max >= K to have them.
"""

from __future__ import annotations

import argparse

from common.errors import UserError, console_script


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="dstr-average-checkpoints",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "inputs",
        nargs="+",
        help="with --last K: one run's output_dir (or checkpoints/ folder); without: "
        "the checkpoints to average (step folders or consolidated .pt files)",
    )
    p.add_argument("--last", type=int, default=None, help="average the K newest checkpoints of the run")
    p.add_argument("--output", "-o", required=True, help="where to write the averaged .pt file")
    p.add_argument(
        "--no_verify",
        action="store_true",
        help="load a checkpoint folder without checking its files against the sha256 stored at save "
        "(default: checked; a damaged file is refused naming it)",
    )
    args = p.parse_args(argv)
    from training.checkpoint import consolidated, folder

    if args.last is not None:
        if len(args.inputs) != 1:
            raise UserError(f"--last {args.last} takes one run folder, got {len(args.inputs)}: {' '.join(args.inputs)}")
        paths = folder.last_checkpoints(args.inputs[0], args.last)
    else:
        paths = args.inputs
    from common.user_files import refuse_output_over_inputs

    refuse_output_over_inputs(args.output, "--output", consolidated.source_files(paths))  # before the reads
    averaged = consolidated.average(paths, verify=not args.no_verify)
    consolidated.save(averaged, args.output)
    steps = ", ".join(str(s["step"]) for s in averaged["averaged"])
    print(
        f"wrote {args.output}: the mean of {len(paths)} checkpoints (steps {steps}), "
        f"{sum(t.numel() for t in averaged['model'].values()):,} parameters"
    )
    return 0


cli = console_script(main)  # the console script (setup.cfg): user mistakes in one line


if __name__ == "__main__":
    cli()
