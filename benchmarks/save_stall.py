#!/usr/bin/env python3
"""How long a checkpoint save stalls the step loop, --save_mode sync against background, through the real train.py.

    python -m benchmarks.save_stall --file_path out/data/train.fr_en.tsv --tokenizer out/data/bpe8k/tokenizer.json

One launch of DeepSpeed's launcher per mode on --nproc processes (default 2: tp2) with a model of 142 M parameters
(d_model 1024, ffn 4096, 4 + 4 blocks, vocab 8000; --size tiny: a 2-block toy for a quick check), --steps steps
saving every --every steps. Rank 0 notes the wall-clock time at the start of every step, so an iteration's time is
everything the loop does for that step: the step, logging and any save. The stall of a save is the iteration that
saves minus a normal iteration: the median of steps 2 to --every - 1 (after the first, a warm-up, and before any
save, whose thread would slow the steps it overlaps).
The last step's save is synchronous in both modes (the job's final save) and is not counted. "after" is what a
background save costs later: the extra time, over a normal iteration, of the iterations after it up to the next save
or the last step (its thread writes and hashes while they run; on a machine with spare cores that is near zero).
The saves go to --output_dir (default: a temporary folder; give one on the storage you care about). The ranks run
under `nice -n 10`. This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {
    "142m": [
        "--d_model",
        "1024",
        "--num_heads",
        "16",
        "--ffn_size",
        "4096",
        "--encoder_layer",
        "4",
        "--decoder_layer",
        "4",
        "--vocab_size",
        "8000",
    ],
    "tiny": ["--d_model", "32", "--num_heads", "4", "--ffn_size", "64", "--encoder_layer", "1", "--decoder_layer", "1"],
}
COMMON = [
    "--src_len",
    "16",
    "--tgt_len",
    "16",
    "--batch_size",
    "4",
    "--dropout",
    "0",
    "--tensorboard",
    "0",
    "--log_interval",
    "1000000",
    "--keep_checkpoint_max",
    "2",
]
MODES = ("sync", "background")


def worker(report: str, argv: list[str]) -> int:
    """train.py's run with rank 0 noting when each step starts, and when the run ends."""
    import torch.distributed as dist

    from training.config.flags import parse_config
    from training.trainer import Trainer

    starts: list[float] = []
    step, finish = Trainer.step, Trainer.finish

    def timed_step(self, *args, **kwargs):
        starts.append(time.perf_counter())
        return step(self, *args, **kwargs)

    def timed_finish(self, *args, **kwargs):
        starts.append(time.perf_counter())  # the end of the last iteration (its save included)
        return finish(self, *args, **kwargs)

    Trainer.step, Trainer.finish = timed_step, timed_finish
    rc = Trainer(parse_config(argv)).train()
    if dist.get_rank() == 0:
        with open(report, "w", encoding="utf-8") as f:
            json.dump(starts, f)
    from training.run.job import leave_job

    leave_job()
    return rc


def launch(nproc: int, port: int, report: str, argv: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    cmd = [
        "nice",
        "-n",
        "10",
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(nproc),
        "--master_port",
        str(port),
        os.path.abspath(__file__),
        "--worker",
        report,
        *argv,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def figures(starts: list[float], every: int) -> dict:
    """Per counted save: (its stall, the extra time of the iterations after it) in seconds; the normal iteration."""
    times = [b - a for a, b in zip(starts, starts[1:])]  # times[i]: the iteration of step i + 1
    steps = len(times)
    saving = [s for s in range(every, steps, every)]  # 1-based steps whose save is counted
    normal = statistics.median(times[1 : every - 1])  # steps 2 … every-1: warmed up, no save anywhere yet
    rows = []
    for s in saving:
        after = [times[i - 1] - normal for i in range(s + 1, min(s + every, steps))]  # the last one saves
        rows.append({"step": s, "stall": times[s - 1] - normal, "after": sum(after)})
    return {"normal": normal, "saves": rows}


def main() -> int:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds --local_rank=N
    if argv[:1] == ["--worker"]:
        report, *train_args = argv[1:]
        return worker(report, train_args)
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--file_path", required=True, help="training TSV")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json (its vocabulary must fit --vocab_size 8000)")
    p.add_argument("--size", choices=list(SIZES), default="142m", help="the model (default 142m; tiny: a toy)")
    p.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    p.add_argument("--layout", default="--mp 2", help="layout flags (default '--mp 2')")
    p.add_argument("--steps", type=int, default=15, help="steps per run (default 15)")
    p.add_argument("--every", type=int, default=5, help="save every N steps (default 5: saves 5 and 10 counted)")
    p.add_argument("--output_dir", default=None, help="where the runs save (default: a temporary folder)")
    p.add_argument("--port", type=int, default=29581)
    args = p.parse_args()
    if args.every < 3:
        p.error(f"--every {args.every}: at least 3 (steps 2 … every-1 are the normal iterations)")
    if args.steps <= args.every:
        p.error(f"--steps {args.steps} must be larger than --every {args.every}: the last step's save is not counted")
    results = {}
    with tempfile.TemporaryDirectory(dir=args.output_dir) as tmp:
        for i, mode in enumerate(MODES):
            report, out = os.path.join(tmp, f"{mode}.json"), os.path.join(tmp, mode)
            launch(
                args.nproc,
                args.port + i,
                report,
                [
                    "--file_path",
                    args.file_path,
                    "--tokenizer",
                    args.tokenizer,
                    *SIZES[args.size],
                    *COMMON,
                    *args.layout.split(),
                    "--steps",
                    str(args.steps),
                    "--save_checkpoint_steps",
                    str(args.every),
                    "--output_dir",
                    out,
                    "--save_mode",
                    mode,
                ],
            )
            with open(report, encoding="utf-8") as f:
                results[mode] = figures(json.load(f), args.every)
            with open(os.path.join(out, "run.json"), encoding="utf-8") as f:
                params = json.load(f).get("params_rank0", 0)
    sync = statistics.mean(r["stall"] for r in results["sync"]["saves"])
    print(
        f"\n{args.size} model, {params:,} parameters on rank 0, '{args.layout}' on {args.nproc} processes, "
        f"{args.steps} steps, a save every {args.every}"
    )
    print("| mode | normal step | stall per save (each) | mean stall | stall / sync's | after (each) |")
    print("|---|---|---|---|---|---|")
    for mode in MODES:
        r = results[mode]
        stalls = [s["stall"] for s in r["saves"]]
        each = ", ".join(f"{s:.2f}" for s in stalls)
        after = ", ".join(f"{s['after']:+.2f}" for s in r["saves"]) if mode == "background" else "—"
        mean = statistics.mean(stalls)
        print(f"| {mode} | {r['normal']:.2f} s | {each} s | {mean:.2f} s | {100 * mean / sync:.0f} % | {after} |")
    return 0


if __name__ == "__main__":
    from common.errors import run_cli

    run_cli(main)  # the ranks leave as train.py's do (common.errors.leave)
