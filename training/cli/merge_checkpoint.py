"""Merge a checkpoint saved under any layout (TP shards, pipeline stages, ZeRO partitions) into one consolidated
fp32 state dict for the serial model.

    dstr-merge-checkpoint out/tp2/checkpoints/step_00000020 --output model.pt
    dstr-merge-checkpoint out/tp2 --output model.pt          # the latest checkpoint of a run
    dstr-merge-checkpoint out/zero2 --output model.safetensors   # the state dict + metadata

The output is `torch.save({"model": state_dict, "model_config": {...}, "step": N, ...})`
(training/checkpoint/consolidated.py); the state dict loads with
`Seq2SeqTransformer(ModelConfig(**obj["model_config"])).load_state_dict(obj["model"])`, and evaluate.py /
export_hf.py take the file as --ckpt_file. `--with_optimizer` also stores AdamW's exp_avg / exp_avg_sq per
parameter. The output's extension picks the form: .safetensors (the state dict, the rest as header metadata;
evaluate.py / export_hf.py take it too), .bin (the bare state dict, as DeepSpeed's zero_to_fp32 writes), anything
else the .pt dict above. This replaces DeepSpeed's zero_to_fp32, which cannot read these checkpoints (each checkpoint
folder also holds a zero_to_fp32.py that runs this).
"""

from __future__ import annotations

import argparse

from common.errors import console_script
from training.checkpoint.consolidated import merge, save, source_files


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="dstr-merge-checkpoint",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="a step_* folder, a checkpoints/ folder or a run's output_dir (→ latest)")
    p.add_argument(
        "--output",
        "-o",
        required=True,
        help="the file to write: .safetensors, .bin (state dict only) or .pt (the whole dict; any other extension too)",
    )
    p.add_argument("--with_optimizer", action="store_true", help="include AdamW moments")
    p.add_argument(
        "--no_verify",
        action="store_true",
        help="load a checkpoint folder without checking its files against the sha256 stored at save "
        "(default: checked; a damaged file is refused naming it)",
    )
    args = p.parse_args(argv)
    from common.user_files import check_output_file, refuse_output_over_inputs

    check_output_file(args.output, "--output")  # before the (long) merge
    refuse_output_over_inputs(args.output, "--output", source_files([args.checkpoint]))
    merged = merge(args.checkpoint, args.with_optimizer, verify=not args.no_verify)
    save(merged, args.output)
    n = sum(t.numel() for t in merged["model"].values())
    print(
        f"wrote {args.output}: {len(merged['model'])} tensors, {n:,} parameters, step {merged['step']}, "
        f"saved under {merged['saved_layout']['data_parallel']}dp×{merged['saved_layout']['model_parallel']}mp×"
        f"{merged['saved_layout']['pipeline_stage']}pp"
    )
    return 0


cli = console_script(main)  # the console script (setup.cfg): user mistakes in one line


if __name__ == "__main__":
    cli()
