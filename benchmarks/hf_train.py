#!/usr/bin/env python3
"""Train `transformers`' Blenderbot of our dimensions with a plain AdamW loop on our batches, and print each step's
time as JSON lines — the reference benchmarks/throughput.py compares train.py with (benchmarks/harness.py).

    python -m benchmarks.hf_train --file_path out/data/train.fr_en.tsv --tokenizer out/data/bpe8k/tokenizer.json \\
        --steps 20 [--fused_adamw] [train.py flags, e.g. --precision bf16]
"""

from __future__ import annotations

import json
import sys
import time

from benchmarks.harness import BENCH_MODEL, build_hf


def main() -> int:
    argv = sys.argv[1:]
    fused = "--fused_adamw" in argv
    argv = [a for a in argv if a != "--fused_adamw"]
    runner = build_hf([*BENCH_MODEL, *argv], fused_adamw=fused)
    steps = int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 20
    for step in range(steps):
        t = time.perf_counter()
        loss, tokens = runner.step(step)
        seconds = time.perf_counter() - t
        print(
            json.dumps(
                {
                    "step": step + 1,
                    "loss": loss,
                    "tokens": tokens,
                    "step_time": seconds,
                    "tokens_per_sec": tokens / seconds,
                    "padding": runner.last_padding,
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
