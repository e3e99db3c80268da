#!/usr/bin/env python3
"""train.py's step time under OpenMP's wait policies, idle and beside other torch processes.

    python -m benchmarks.omp_wait_policy                                  # tiny and benchmark model, 0 and 2 beside
    python -m benchmarks.omp_wait_policy --models tiny --beside 0 2 4 --steps 60 --repeats 2

Each configuration runs train.py (one process, the bundled Multi30k) with OMP_WAIT_POLICY=default (torch's GNU
OpenMP's own: its idle threads spin a while before sleeping), PASSIVE (they sleep at once: the project's default,
common/omp_wait.py) and, if asked, ACTIVE (they spin), alternating
so that a change in the machine's load hits all alike; the figure is the median `step_time` of metrics.jsonl after
the first 10 steps, over the repeats. `--beside N` starts N other torch processes (default threads, small matrix
products in a loop: what a shared node's other jobs do to the cores) for the runs.
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
# fmt: off
MODELS = {
    "tiny": ["--d_model", "32", "--num_heads", "4", "--ffn_size", "64", "--encoder_layer", "2", "--decoder_layer", "2",
             "--src_len", "12", "--tgt_len", "12", "--batch_size", "16"],
    "bench": ["--d_model", "256", "--num_heads", "4", "--ffn_size", "1024", "--encoder_layer", "3",
              "--decoder_layer", "3", "--src_len", "32", "--tgt_len", "32", "--batch_size", "64"],
}
# fmt: on
HOG = (
    "import os, torch\n"
    "parent, a = os.getppid(), torch.randn(96, 96)\n"
    "while os.getppid() == parent:\n"  # ends with the benchmark, however that ends
    "    for _ in range(200):\n"
    "        a = torch.tanh(a @ a)\n"
)
POLICIES = ("default", "PASSIVE", "ACTIVE")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny", "bench"], choices=list(MODELS))
    p.add_argument("--beside", nargs="+", type=int, default=[0, 2], help="other torch processes running beside")
    p.add_argument("--policies", nargs="+", default=["default", "PASSIVE"], choices=POLICIES)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workdir", default=None, help="default: a temporary folder")
    p.add_argument("--json", default=None, metavar="OUT")
    return p.parse_args(argv)


def median_step(workdir: str, model: list, policy: str, steps: int, tsv: str) -> float:
    out = tempfile.mkdtemp(dir=workdir)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env["PYTHONPATH"], env["OMP_WAIT_POLICY"] = ROOT, policy
    cmd = [
        sys.executable,
        os.path.join(ROOT, "run_scripts", "train.py"),
        "--file_path",
        tsv,
        *model,
        "--steps",
        str(steps),
        "--log_interval",
        "1",
        "--tensorboard",
        "0",
        "--dropout",
        "0",
        "--output_dir",
        out,
        "--cache_dir",
        os.path.join(workdir, "cache"),
    ]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=1800)
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        times = [json.loads(line)["step_time"] for line in f if '"step_time"' in line]
    return statistics.median(times[10:])


def measure(args, workdir: str, tsv: str) -> list[dict]:
    rows = []
    for beside in args.beside:
        hogs = [subprocess.Popen([sys.executable, "-c", HOG], stdout=subprocess.DEVNULL) for _ in range(beside)]
        try:
            for name in args.models:
                times = {p: [] for p in args.policies}
                for _ in range(args.repeats):
                    for p in args.policies:
                        times[p].append(median_step(workdir, MODELS[name], p, args.steps, tsv))
                row = {
                    "model": name,
                    "beside": beside,
                    "load": os.getloadavg()[0],
                    **{f"{p}_ms": 1000 * statistics.median(t) for p, t in times.items()},
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
    return rows


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from preprocess.parallel import make_tsv

    workdir = args.workdir or tempfile.mkdtemp(prefix="omp-wait-")
    tsv = os.path.join(workdir, "train.fr_en.tsv")
    if not os.path.exists(tsv):
        data = os.path.join(ROOT, "data", "multi30k")
        make_tsv(os.path.join(data, "train.fr.gz"), os.path.join(data, "train.en.gz"), tsv)
    rows = measure(args, workdir, tsv)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
