#!/usr/bin/env python3
"""How long `plan.py --search` takes, and how many layouts it considers, at 64 to 1024 ranks (issue 42's goal: 10⁴
layouts in 10 s on one core; 1024 GPUs in 60 s).

    python -m benchmarks.layout_search                       # the default large model at 64 and 1024 ranks
    python -m benchmarks.layout_search --worlds 64 --flags "--recipe recipes/16pcs/16pcs.json"


Each world is searched in this process after one warm-up search at the smallest world (the imports of torch and
DeepSpeed, and the first meta-device build, are start-up, not search: plan.py pays them once, about 3 s). Prints wall
and CPU seconds per search (the CPU figure is what one core spends: on a busy machine wall time is longer).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

# an encoder-decoder of 24 + 24 layers, d_model 4096 (≈ 10 B parameters), bf16, 6144 pairs of 512 tokens a step:
# large enough that memory rejects many layouts, deep enough for 32 pipeline stages
MODEL = (
    "--d_model 4096 --num_heads 32 --ffn_size 16384 --encoder_layer 24 --decoder_layer 24 --src_len 512 "
    "--tgt_len 512 --vocab_size 32000 --batch_size 6144 --precision bf16"
)


def setting_for(flags: list[str], world: int):
    from training.config.flags import parse_args
    from training.config.sections import TrainConfig
    from training.plan.planner import build_plan_parser
    from training.plan.search_setting import make_setting
    from training.plan.speed_prediction import Links

    args = parse_args(flags, parser=build_plan_parser())
    links = Links(args.intra_node_GB_s, args.inter_node_Gb_s, args.gpus_per_node)
    return make_setting(
        TrainConfig.from_flags(args),
        world,
        None,
        args.gpus_per_node,
        args.device or "h100",
        args.device_memory,
        links,
        args.assumed_mfu,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--flags", default=MODEL, help="plan.py flags of the model and batch (default: the large model)")
    args = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from training.plan.layout_search import search

    flags = shlex.split(args.flags)
    search(setting_for(flags, min(args.worlds)))  # warm-up: imports, first builds
    print(f"flags: {args.flags}")
    for world in args.worlds:
        setting = setting_for(flags, world)
        wall, cpu = time.perf_counter(), time.process_time()
        result = search(setting)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        best = result.candidates[0] if result.candidates else None
        print(
            f"{world:>5} ranks: {result.considered:>6,} layouts considered ({len(result.candidates):,} ranked, "
            f"{len(result.rejected):,} rejected) in {wall:.2f} s wall, {cpu:.2f} s CPU; best "
            f"{best.layout.short() if best else 'none'}"
            + (f" at {best.seconds(result.factors) * 1e3:.1f} ms" if best else ""),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
