#!/usr/bin/env python3
"""Where a training step's time goes: torch.profiler over a few steps of train.py's own engine (one process), or of
the same-sized `transformers` model with a plain AdamW loop, on the same batches.

    python -m benchmarks.profile_step --file_path out/data/train.fr_en.tsv --tokenizer out/data/bpe8k/tokenizer.json
    python -m benchmarks.profile_step ... --hf            # the transformers model instead
    python -m benchmarks.profile_step ... --extra "--max_tokens 2048"

Prints the profiler's operator table (self CPU time) and the step times. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.harness import BENCH_MODEL, build_hf, build_ours
from common.errors import run_cli


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file_path", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--hf", action="store_true", help="profile the transformers model instead of ours")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--extra", default="", help="more train.py flags for our model")
    p.add_argument("--sort", default="self_cpu_time_total")
    args = p.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    flags = ["--file_path", args.file_path, "--tokenizer", args.tokenizer, *BENCH_MODEL, *args.extra.split()]
    runner = build_hf(flags) if args.hf else build_ours(flags)
    for step in range(args.warmup):
        runner.step(step)
    times = []
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for step in range(args.warmup, args.warmup + args.steps):
            t = time.perf_counter()
            runner.step(step)
            times.append(time.perf_counter() - t)
    print(prof.key_averages().table(sort_by=args.sort, row_limit=args.rows))
    print(
        f"{'transformers' if args.hf else 'ours'}: median step {1000 * statistics.median(times):.1f} ms "
        f"over {len(times)} profiled steps (threads {torch.get_num_threads()})"
    )
    return 0


if __name__ == "__main__":
    run_cli(main)
