#!/usr/bin/env python3
"""plan.py's predicted peak memory per rank against a measured run, on this machine's CPU, for a few layouts.

    python -m benchmarks.plan_memory --file_path out/data/train.fr_en.tsv --tokenizer out/data/bpe8k/tokenizer.json

For each layout, train.py runs --steps steps twice through DeepSpeed's launcher: with the benchmark model (34.4 M
parameters: d_model 512, ffn 2048, 3 + 3 blocks, vocab 8000, 24 tokens a side, batch 32) and with a tiny one (d_model
16, 1 + 1 blocks) that is otherwise the same run. Rank 0's `peak_mem_mib` (metrics.jsonl; on a CPU the process's
peak resident set, ru_maxrss) holds the interpreter, torch, DeepSpeed, gloo, the data and tokenizer besides the
model: the tiny run measures that baseline, so the model's own memory is measured − baseline, and compared with
plan.py's prediction for rank 0 (training.plan.planner.make_plan with device_type "cpu": DeepSpeed's CPU settings) for
the big model minus its prediction for the tiny one. Prints a table and writes it as JSON (--output). A
measurement, not a test; the figures are in docs/memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BIG = ["--d_model", "512", "--num_heads", "8", "--ffn_size", "2048", "--encoder_layer", "3", "--decoder_layer", "3"]
TINY = ["--d_model", "16", "--num_heads", "2", "--ffn_size", "16", "--encoder_layer", "1", "--decoder_layer", "1"]
COMMON = [
    "--src_len",
    "24",
    "--tgt_len",
    "24",
    "--batch_size",
    "32",
    "--vocab_size",
    "8000",
    "--dropout",
    "0.1",
    "--tensorboard",
    "0",
    "--log_interval",
    "1",
]
LAYOUTS = {  # name: (processes, flags)
    "serial": (1, []),
    "serial-recompute": (1, ["--recompute", "1"]),
    "mp2": (2, ["--mp", "2"]),
    "pp2": (2, ["--pipeline_stage", "2", "--micro_batch_num", "2"]),
    "dp2-zero1": (2, ["--enable_parallel_optimizer", "1"]),
    "dp2-zero2": (2, ["--zero_stage", "2"]),
}
MIB = 2**20


def measured_peak_mib(nproc: int, flags: list, out: str, steps: int) -> float:
    from training.core.distributed import free_port

    env = dict(
        os.environ,
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, os.cpu_count() // nproc))),
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    train = os.path.join(ROOT, "run_scripts", "train.py")
    if nproc == 1:
        cmd = [sys.executable, train]
    else:
        cmd = [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            str(nproc),
            "--master_port",
            str(free_port()),
            train,
            "--distribute",
            "true",
        ]
    cmd += [*flags, "--steps", str(steps), "--output_dir", out]
    proc = subprocess.run(["nice", "-n", "10", *cmd], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"train.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        return max(json.loads(line)["peak_mem_mib"] for line in f if line.strip())


def predicted_mib(nproc: int, flags: list) -> float:
    from training.config.flags import parse_args
    from training.config.sections import TrainConfig
    from training.plan.planner import build_plan_parser, make_plan

    cfg = TrainConfig.from_flags(parse_args(flags, parser=build_plan_parser()))
    plan = make_plan(cfg, nproc, device_type="cpu")
    return plan["ranks"][0]["total_bytes"] / MIB


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--file_path", required=True, help="training TSV")
    p.add_argument("--tokenizer", required=True, help="its tokenizer.json (8000 tokens: the vocabulary planned)")
    p.add_argument("--steps", type=int, default=3, help="steps per run (default 3: AdamW's moments exist from step 1)")
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--output", default=None, help="write the table here as JSON")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="plan-memory-") as tmp:
        for name in args.layouts:
            nproc, layout = LAYOUTS[name]
            row = {"layout": name, "processes": nproc}
            for size, model in (("big", BIG), ("tiny", TINY)):
                flags = ["--file_path", args.file_path, "--tokenizer", args.tokenizer, *COMMON, *model, *layout]
                row[f"measured_{size}_mib"] = measured_peak_mib(
                    nproc, flags, os.path.join(tmp, f"{name}-{size}"), args.steps
                )
                row[f"predicted_{size}_mib"] = predicted_mib(nproc, flags)
            row["measured_model_mib"] = row["measured_big_mib"] - row["measured_tiny_mib"]
            row["predicted_model_mib"] = row["predicted_big_mib"] - row["predicted_tiny_mib"]
            row["ratio"] = row["measured_model_mib"] / row["predicted_model_mib"]
            rows.append(row)
            print(
                f"{name:<17} rank 0: measured {row['measured_big_mib']:7.1f} MiB − baseline "
                f"{row['measured_tiny_mib']:6.1f} = {row['measured_model_mib']:6.1f} MiB; predicted "
                f"{row['predicted_model_mib']:6.1f} MiB; measured/predicted {row['ratio']:.2f}",
                flush=True,
            )
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
