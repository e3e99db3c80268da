#!/usr/bin/env python3
"""Step time with and without interleaving (interleave_num N vs 1), measured through the real train.py.

    python -m benchmarks.interleave_step_time --file_path out/data/train.fr_en.tsv                # tp2, CPU/gloo
    python -m benchmarks.interleave_step_time --file_path DATA --nproc 4 --layout "--mp 4" --interleave 2 4
    python -m benchmarks.interleave_step_time --mlp                       # the seed's MLP (recipes/interleaved-mlp)

Each configuration runs `--repeats` times, alternating (1, N, 1, N, ...) so that a change in machine load hits both
alike; the figure is the median step_time of metrics.jsonl after `--warmup` steps, over all repeats. This is a
measurement, not a test: run it on an otherwise idle machine. On GPUs the ranks must each have their own device
(NCCL refuses two ranks on one GPU), so a tensor-parallel timing needs at least `--nproc` GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = [
    "--d_model",
    "256",
    "--num_heads",
    "8",
    "--ffn_size",
    "1024",
    "--encoder_layer",
    "2",
    "--decoder_layer",
    "2",
    "--src_len",
    "32",
    "--tgt_len",
    "32",
    "--batch_size",
    "32",
    "--dropout",
    "0",
    "--tensorboard",
    "0",
    "--log_interval",
    "1000",
]


def launch(nproc: int, script: str, args: list[str], port: int) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(nproc),
        "--master_port",
        str(port),
        os.path.join(ROOT, script),
        *args,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def step_times(output_dir: str, warmup: int) -> list[float]:
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["step_time"] for line in f if line.strip()][warmup:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file_path", help="training TSV (the Transformer); not needed with --mlp")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: train.py builds and caches one)")
    p.add_argument("--mlp", action="store_true", help="time the seed's MLP example instead of the Transformer")
    p.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    p.add_argument("--layout", default="--mp 2", help="layout flags for train.py (default '--mp 2')")
    p.add_argument("--interleave", type=int, nargs="+", default=[2], help="interleave_num values to compare with 1")
    p.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of each run's figure (default 5)")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration (default 3)")
    p.add_argument("--extra", default="", help="more train.py flags, e.g. '--d_model 1024 --batch_size 64'")
    p.add_argument("--port", type=int, default=29555)
    args = p.parse_args()
    if not args.mlp and not args.file_path:
        p.error("--file_path is required (or --mlp)")
    times: dict[int, list[float]] = {n: [] for n in [1, *args.interleave]}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for n in times:
                out = os.path.join(tmp, f"il{n}-r{r}")
                if args.mlp:
                    script, flags = (
                        "run_scripts/train_mlp.py",
                        ["--steps", str(args.steps), "--log_interval", "1000", "--mp", str(args.nproc)],
                    )
                else:
                    script = "run_scripts/train.py"
                    flags = [
                        "--file_path",
                        args.file_path,
                        *MODEL,
                        "--steps",
                        str(args.steps),
                        *(["--tokenizer", args.tokenizer] if args.tokenizer else []),
                        *args.layout.split(),
                    ]
                launch(
                    args.nproc,
                    script,
                    [
                        "--distribute",
                        "true",
                        *flags,
                        *args.extra.split(),
                        "--interleave_num",
                        str(n),
                        "--output_dir",
                        out,
                    ],
                    args.port + r,
                )
                times[n] += step_times(out, args.warmup)
                print(
                    f"repeat {r + 1}/{args.repeats} interleave_num {n}: median "
                    f"{1000 * statistics.median(step_times(out, args.warmup)):.1f} ms",
                    flush=True,
                )
    base = statistics.median(times[1])
    what = "MLP" if args.mlp else f"Transformer ({args.layout} {args.extra})".replace(" )", ")")
    print(f"\n{what} on {args.nproc} processes, median step time over {args.repeats}×{args.steps - args.warmup} steps:")
    for n, ts in times.items():
        med = statistics.median(ts)
        print(f"  interleave_num {n}: {1000 * med:8.1f} ms   ({med / base:.2f}× interleave_num 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
