#!/usr/bin/env python3
"""Peak resident memory of every rank while it saves a checkpoint and while it loads one, through the real train.py.

    python -m benchmarks.checkpoint_memory --file_path out/data/train.fr_en.tsv \
        --tokenizer out/data/bpe8k/tokenizer.json
    python -m benchmarks.checkpoint_memory ... --repo /path/to/another/checkout      # the same measurement, other code

Two launches of DeepSpeed's launcher on --nproc processes (default 4: tp2 × pp2) with a model of 142 M
parameters (d_model 1024, ffn 4096, 4 + 4 blocks, vocab 8000): the first trains --steps steps and saves, the second
loads that checkpoint (a resume with nothing left to train). Around training.checkpoint.manager.save and .load each rank
resets its high-water mark (/proc/self/clear_refs 5) and reads VmHWM after: the peak resident set during that call
(anonymous memory plus mapped file pages), next to the resident set just before it (and, for the load, just after:
a fresh engine has no AdamW moments until the load makes them, so peak − after is what loading needs beyond the
state it leaves). The code measured is whatever
`--repo` holds (default: this checkout), so the same command measures a before and an after. The ranks run under
`nice -n 10`. This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = [
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
    "1",
    "--vocab_size",
    "8000",
]
LAYOUT = ["--mp", "2", "--pipeline_stage", "2", "--micro_batch_num", "2"]


def _status() -> dict:
    with open("/proc/self/status", encoding="ascii") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def _measured(fn, phase: str, report: str):
    """fn wrapped: reset the high-water mark, call, write {phase, rank, rss_before, peak, rss_after} to `report`."""

    def wrapper(*args, **kwargs):
        import torch.distributed as dist

        dist.barrier()
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        before = _status()["VmRSS"]
        result = fn(*args, **kwargs)
        after = _status()
        with open(report, "a", encoding="utf-8") as f:
            f.write(
                json.dumps(
                    {
                        "phase": phase,
                        "rank": dist.get_rank(),
                        "rss_before": before,
                        "peak": after["VmHWM"],
                        "rss_after": after["VmRSS"],
                    }
                )
                + "\n"
            )
        return result

    return wrapper


def worker(repo: str, report: str, argv: list[str]) -> int:
    from training.checkpoint import manager
    from training.config.flags import parse_config
    from training.trainer import run_training

    manager.save = _measured(manager.save, "save", report)  # the CheckpointManager looks them up here
    manager.load = _measured(manager.load, "load", report)
    from training.run.job import leave_job

    rc = run_training(parse_config(argv))
    leave_job()
    return rc


def _serial_params(run_dir: str) -> int:
    """Parameters of the serial model the run trained (built on the meta device: no memory), by this checkout's
    model code: the measured checkouts differ in how they save and load, not in the model."""
    import torch

    from model.config import ModelConfig
    from model.transformer import Seq2SeqTransformer

    ckpts = os.path.join(run_dir, "checkpoints")
    with open(os.path.join(ckpts, open(os.path.join(ckpts, "latest")).read().strip(), "meta.json")) as f:
        cfg = ModelConfig(**json.load(f)["model"])
    with torch.device("meta"):
        return sum(p.numel() for p in Seq2SeqTransformer(cfg).parameters())


def launch(repo: str, nproc: int, report: str, argv: list[str], port: int) -> None:
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
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
        repo,
        report,
        *argv,
    ]
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main() -> int:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds --local_rank=N
    if argv[:1] == ["--worker"]:
        repo, report, *train_args = argv[1:]
        return worker(repo, report, train_args)
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--file_path", required=True, help="training TSV")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json (its vocabulary must fit --vocab_size 8000)")
    p.add_argument("--repo", default=ROOT, help="the checkout whose code is measured (default: this one)")
    p.add_argument("--nproc", type=int, default=4, help="processes (default 4)")
    p.add_argument("--layout", default=" ".join(LAYOUT), help=f"layout flags (default '{' '.join(LAYOUT)}')")
    p.add_argument("--steps", type=int, default=1, help="training steps before the save (default 1)")
    p.add_argument("--extra", default="", help="more train.py flags (they override the model's)")
    p.add_argument("--port", type=int, default=29571)
    args = p.parse_args()
    repo = os.path.abspath(args.repo)
    with tempfile.TemporaryDirectory() as tmp:
        report, out = os.path.join(tmp, "report.jsonl"), os.path.join(tmp, "run")
        common = [
            "--file_path",
            args.file_path,
            "--tokenizer",
            args.tokenizer,
            *MODEL,
            *args.layout.split(),
            "--steps",
            str(args.steps),
            *args.extra.split(),
        ]
        launch(
            repo,
            args.nproc,
            report,
            [*common, "--save_checkpoint_steps", str(args.steps), "--output_dir", out],
            args.port,
        )
        launch(repo, args.nproc, report, [*common, "--output_dir", out + "-resumed", "--ckpt_file", out], args.port + 1)
        with open(os.path.join(out, "run.json"), encoding="utf-8") as f:
            info = json.load(f)
        info["params"] = _serial_params(out)
        with open(report, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
    mib = 1024 * 1024
    print(
        f"\n{repo} — {args.layout} on {args.nproc} processes, a model of {info['params']:,} parameters "
        f"({info.get('params_rank0', 0):,} on rank 0), optimizer {info.get('optimizer')}"
    )
    print(
        "| rank | save: RSS before | save: peak | save: peak − before | load: RSS before | load: peak | "
        "load: RSS after | load: peak − after |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for rank in range(args.nproc):
        s = next(r for r in rows if r["rank"] == rank and r["phase"] == "save")
        ld = next(r for r in rows if r["rank"] == rank and r["phase"] == "load")
        print(
            f"| {rank} | {s['rss_before'] / mib:.0f} MiB | {s['peak'] / mib:.0f} MiB | "
            f"{(s['peak'] - s['rss_before']) / mib:+.0f} MiB | {ld['rss_before'] / mib:.0f} MiB | "
            f"{ld['peak'] / mib:.0f} MiB | {ld['rss_after'] / mib:.0f} MiB | "
            f"{(ld['peak'] - ld['rss_after']) / mib:+.0f} MiB |"
        )
    return 0


if __name__ == "__main__":
    from common.errors import run_cli

    run_cli(main)  # the ranks leave as train.py's do (common.errors.leave)
