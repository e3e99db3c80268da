#!/usr/bin/env python3
"""What a resume costs before its first step: the bytes each rank hashes (sha256 of the training TSV, the
checkpoint's files, the tokenizer, the token store) and the time from launch to the end of the first step.

    python -m benchmarks.start_cost --file_path $PWD/out/data/train.fr_en.tsv \
        --tokenizer $PWD/out/data/bpe8k/tokenizer.json --compare /path/to/another/checkout

For each layout (--layouts, default tp2xdp2,pp2xdp2 on --nproc 4 processes): one launch of train.py trains --steps 1
and saves a checkpoint (--size big: d_model 1024, FFN 8192, 1 + 1 layers, vocab 8000: about 700 MB with the AdamW
moments); then train.py resumes from it with `--resume auto` and trains one step, without saving, through the code
of --repo (default: this checkout) and, with --compare, through that checkout's too, alternately (--repeats times),
from the same checkpoint. The ranks run this file's worker: it wraps common.hashing.file_sha256 (the one way the
code hashes files) before anything imports it, so every file it hashes is counted with its size, and notes when the
first training step ends. The page cache is warm (the checkpoint was just written): hashing is CPU time. Ranks run
under `nice -n 10`. --json writes every figure (per rank, per file). This is a measurement, not a test (a test runs
it at --size tiny: tests/test_start_cost.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {
    "big": [
        "--d_model",
        "1024",
        "--num_heads",
        "16",
        "--ffn_size",
        "8192",
        "--encoder_layer",
        "1",
        "--decoder_layer",
        "1",
        "--src_len",
        "16",
        "--tgt_len",
        "16",
        "--batch_size",
        "8",
        "--vocab_size",
        "8000",
    ],
    "tiny": [
        "--d_model",
        "32",
        "--num_heads",
        "4",
        "--ffn_size",
        "64",
        "--encoder_layer",
        "1",
        "--decoder_layer",
        "1",
        "--src_len",
        "12",
        "--tgt_len",
        "12",
        "--batch_size",
        "8",
    ],
}
COMMON = ["--dropout", "0", "--tensorboard", "0", "--log_interval", "1", "--seed", "7"]


# ------------------------------------------------------------------------------------------------ inside a rank
class Counter:
    """Every file_sha256 call of this rank: {path: bytes hashed}, the CPU seconds spent, when the first step ended;
    rewritten to `report` after each event (a rank may leave without running atexit handlers)."""

    def __init__(self, report: str):
        self.report, self.files, self.seconds, self.first_step = report, {}, 0.0, None

    def wrap_hash(self, fn):
        def counted(path):
            start = time.thread_time()  # CPU time: other ranks on the same cores do not add to it
            digest = fn(path)
            self.seconds += time.thread_time() - start
            key = os.path.realpath(str(path))
            self.files[key] = self.files.get(key, 0) + os.path.getsize(key)
            self.write()
            return digest

        return counted

    def wrap_step(self, fn):
        def timed(*args, **kwargs):
            out = fn(*args, **kwargs)
            if self.first_step is None:
                self.first_step = time.time()
                self.write()
            return out

        return timed

    def write(self) -> None:
        from common.staging import atomic_write

        with atomic_write(self.report) as f:
            json.dump({"files": self.files, "hash_seconds": self.seconds, "first_step_end": self.first_step}, f)


def worker(repo: str, report_dir: str, argv: list[str]) -> int:
    rank = int(os.environ.get("RANK", "0"))
    counter = Counter(os.path.join(report_dir, f"rank{rank}.json"))
    import common.hashing as hashing

    hashing.file_sha256 = counter.wrap_hash(hashing.file_sha256)  # before any module binds the name
    import training.core.step as step

    step.train_step = counter.wrap_step(step.train_step)  # before the trainer imports it
    from training.config.flags import parse_config
    from training.run.job import leave_job
    from training.trainer import run_training

    rc = run_training(parse_config(argv))
    leave_job()
    return rc


# ------------------------------------------------------------------------------------------------ the launches
def layout_flags(name: str, nproc: int) -> list[str]:
    """'tp2xdp2' → --mp 2 (dp is what is left of the world); 'pp2xdp2' → --pipeline_stage 2 --micro_batch_num 2."""
    degrees = {"tp": 1, "pp": 1, "dp": 1}
    for part in name.split("x"):
        kind, value = part[:2], part[2:]
        if kind not in degrees or not value.isdigit():
            raise SystemExit(f"error: --layouts {name}: write layouts as tp2xdp2, pp2xdp2, dp2 (degrees tp, pp, dp)")
        degrees[kind] = int(value)
    if degrees["tp"] * degrees["pp"] * degrees["dp"] != nproc:
        raise SystemExit(
            f"error: --layouts {name} is {degrees['tp'] * degrees['pp'] * degrees['dp']} processes, --nproc is {nproc}"
        )
    flags = ["--mp", str(degrees["tp"])]
    if degrees["pp"] > 1:
        flags += ["--pipeline_stage", str(degrees["pp"]), "--micro_batch_num", str(degrees["pp"])]
    return flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(repo: str, nproc: int, report_dir: str, argv: list[str], tries: int = 2) -> float:
    """train.py's work through this file's worker on `nproc` ranks (DeepSpeed's per-node launcher); returns the
    wall time the launch started at. A failed launch is tried once more (on a shared machine another program may
    take the free port between its choice and rank 0's bind), its whole output kept in report_dir/launch-N.log."""
    from deepspeed.launcher.runner import encode_world_info

    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    world = encode_world_info({"localhost": list(range(nproc))})
    for attempt in range(1, tries + 1):
        cmd = [
            "nice",
            "-n",
            "10",
            sys.executable,
            "-u",
            "-m",
            "deepspeed.launcher.launch",
            f"--world_info={world}",
            "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}",
            os.path.abspath(__file__),
            "--worker",
            repo,
            report_dir,
            *argv,
        ]
        start = time.time()
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
        if proc.returncode == 0:
            return start
        log = os.path.join(report_dir, f"launch-{attempt}.log")
        with open(log, "w", encoding="utf-8") as f:
            f.write(proc.stdout + "\n" + proc.stderr)
        said = [
            line
            for line in (proc.stdout + proc.stderr).splitlines()
            if line.startswith("error: ") or "Error" in line.split(":", 1)[0]
        ]
        print(f"launch {attempt} failed (rc={proc.returncode}; {log}): {said[:3]}", file=sys.stderr, flush=True)
    raise SystemExit(f"error: launch failed {tries} times: {' '.join(cmd)}")


def _kind(path: str, tsv: str, ckpt_root: str) -> str:
    if path == tsv:
        return "tsv"
    return "checkpoint" if path.startswith(ckpt_root + os.sep) else "other"


def resume_figures(repo: str, nproc: int, argv: list[str], out: str, tsv: str, work: str) -> dict:
    """One --resume auto launch: per rank, bytes hashed by kind and per file, hashing seconds; the time from the
    launch to the end of the first step (the last rank's)."""
    report_dir = tempfile.mkdtemp(dir=work, prefix="resume-")
    start = launch(
        repo,
        nproc,
        report_dir,
        [*argv, "--output_dir", out, "--resume", "auto", "--steps", "2", "--save_checkpoint_steps", "0"],
    )
    ckpt_root = os.path.realpath(os.path.join(out, "checkpoints"))
    ranks = []
    for rank in range(nproc):
        with open(os.path.join(report_dir, f"rank{rank}.json"), encoding="utf-8") as f:
            seen = json.load(f)
        by_kind = {"tsv": 0, "checkpoint": 0, "other": 0}
        for path, n in seen["files"].items():
            by_kind[_kind(path, os.path.realpath(tsv), ckpt_root)] += n
        ranks.append(
            {
                "rank": rank,
                "bytes": by_kind,
                "files": seen["files"],
                "hash_seconds": seen["hash_seconds"],
                "first_step_s": seen["first_step_end"] - start,
            }
        )
    return {"ranks": ranks, "first_step_s": max(r["first_step_s"] for r in ranks)}


def checkpoint_files(out: str) -> dict:
    """{real path: size} of the files of the run's latest checkpoint that meta.json lists (shards, RNG states)."""
    root = os.path.join(out, "checkpoints")
    with open(os.path.join(root, "latest"), encoding="utf-8") as f:
        path = os.path.realpath(os.path.join(root, f.read().strip()))
    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    return {os.path.join(path, n): os.path.getsize(os.path.join(path, n)) for n in meta["shards"] + meta["rng"]}


def measure(args) -> dict:
    repos = {"after": os.path.abspath(args.repo)}
    if args.compare:
        repos = {"before": os.path.abspath(args.compare), **repos}
    results = {"nproc": args.nproc, "size": args.size, "repos": repos, "layouts": {}}
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        for name in args.layouts.split(","):
            base = [
                "--file_path",
                args.file_path,
                "--tokenizer",
                args.tokenizer,
                "--cache_dir",
                os.path.join(work, "cache"),
                *SIZES[args.size],
                *COMMON,
                *layout_flags(name, args.nproc),
            ]
            out = os.path.join(work, name)
            launch(
                repos["after"],
                args.nproc,
                tempfile.mkdtemp(dir=work),
                [*base, "--output_dir", out, "--steps", "1", "--save_checkpoint_steps", "1"],
            )
            files = checkpoint_files(out)
            row = {"checkpoint_bytes": sum(files.values()), "checkpoint_files": files, "runs": {k: [] for k in repos}}
            for _ in range(args.repeats):
                for label, repo in repos.items():
                    row["runs"][label].append(resume_figures(repo, args.nproc, base, out, args.file_path, work))
            results["layouts"][name] = row
    return results


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def table(results: dict) -> str:
    """One row per layout; "a → b" is --compare's figure, then --repo's. Bytes are the same in every repeat; times
    are the least of the repeats (a shared machine only ever adds to them)."""
    labels = list(results["repos"])
    lines = [
        "| layout | checkpoint | checkpoint bytes hashed, all ranks | checkpoint bytes hashed per rank, max | "
        "all bytes hashed per rank, max | TSV bytes hashed per rank | hashing CPU time, all ranks | "
        "time to first step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results["layouts"].items():

        def figure(label, what, row=row):
            runs = row["runs"][label]
            ranks = runs[0]["ranks"]
            if what == "time":
                return f"{min(r['first_step_s'] for r in runs):.1f} s"
            if what == "hashing":
                return f"{min(sum(rk['hash_seconds'] for rk in r['ranks']) for r in runs):.2f} s"
            mine = [sum(n for path, n in rk["files"].items() if path in row["checkpoint_files"]) for rk in ranks]
            if what in ("total", "rank"):
                return _mb(sum(mine) if what == "total" else max(mine))
            return _mb(max(sum(rk["bytes"].values()) if what == "all" else rk["bytes"][what] for rk in ranks))

        lines.append(
            f"| {name} | {_mb(row['checkpoint_bytes'])} | "
            + " | ".join(
                " → ".join(figure(label, what) for label in labels)
                for what in ("total", "rank", "all", "tsv", "hashing", "time")
            )
            + " |"
        )
    return "\n".join(lines)


def main() -> int:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds --local_rank=N
    if argv[:1] == ["--worker"]:
        repo, report_dir, *train_args = argv[1:]
        return worker(repo, report_dir, train_args)
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--file_path", required=True, help="training TSV (an absolute path: the ranks run in --repo)")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json (its vocabulary must fit --vocab_size 8000)")
    p.add_argument("--repo", default=ROOT, help="the checkout whose code is measured (default: this one)")
    p.add_argument("--compare", default=None, help="another checkout measured the same way (e.g. the code before)")
    p.add_argument("--nproc", type=int, default=4, help="processes (default 4)")
    p.add_argument("--layouts", default="tp2xdp2,pp2xdp2", help="comma-separated (default tp2xdp2,pp2xdp2)")
    p.add_argument("--size", default="big", choices=sorted(SIZES), help="model size (default big: ~700 MB checkpoint)")
    p.add_argument("--repeats", type=int, default=1, help="resumes per checkout and layout (default 1)")
    p.add_argument("--work", default=None, help="where the runs go (default: the system's temporary folder)")
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args()
    args.file_path, args.tokenizer = os.path.abspath(args.file_path), os.path.abspath(args.tokenizer)
    results = measure(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    print(f"{args.nproc} processes, --size {args.size}; " + ", ".join(f"{k}: {v}" for k, v in results["repos"].items()))
    print(table(results))
    return 0


if __name__ == "__main__":
    from common.errors import run_cli

    run_cli(main)  # the ranks leave as train.py's do (common.errors.leave)
