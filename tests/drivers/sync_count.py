#!/usr/bin/env python3
"""Count the calls that read a tensor on the host (on a GPU: a device→host synchronisation) in train.py's steps.

    python tests/drivers/sync_count.py RUNS.json OUT.json
    python tests/drivers/spawn_ranks.py --nproc=2 --master_port=P tests/drivers/sync_count.py RUNS.json OUT.json

RUNS.json is a list of train.py argument lists (without --steps and --output_dir). Each is run twice in this one
process, the real `run_training` for 2 and for 3 steps, with every call of torch.nonzero, Tensor.nonzero, .item(),
.tolist() and bool/int/float of a tensor counted; the difference is what one more step costs, setup and the end of
the run (the last save) cancelling out. OUT.json gets, per run, {"nonzero": n, "item": n, ...} of that one step;
started on several ranks (train.py's flags then say --distribute true), each rank writes OUT-rank{R}.json.
"""

from __future__ import annotations

import collections
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from common.errors import run_cli

COUNTED = ("nonzero", "item", "tolist", "__bool__", "__int__", "__float__")


class SyncCounter:
    """Wraps the host-reading methods of torch.Tensor (and torch.nonzero) with counting ones while active."""

    def __init__(self):
        self.counts = collections.Counter()
        self._saved = {}

    def __enter__(self):
        import torch

        for name in COUNTED:
            self._wrap(torch.Tensor, name, name)
        self._wrap(torch, "nonzero", "nonzero")
        return self

    def _wrap(self, owner, attr, key):
        original = getattr(owner, attr)
        self._saved[(owner, attr)] = original
        counts = self.counts

        def counted(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)

        setattr(owner, attr, counted)

    def __exit__(self, *exc):
        for (owner, attr), original in self._saved.items():
            setattr(owner, attr, original)


def run_counted(argv: list, steps: int, out_dir: str) -> collections.Counter:
    from training.config.flags import parse_config
    from training.trainer import run_training

    config = parse_config([*argv, "--steps", str(steps), "--output_dir", out_dir])
    with SyncCounter() as counter:
        run_training(config)
    return counter.counts


def main() -> int:
    runs_file, out_file = [a for a in sys.argv[1:] if not a.startswith("--local_rank")][:2]
    work = os.path.splitext(out_file)[0] + "-runs"  # the runs' output folders, the same on every rank
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        out_file = out_file.replace(".json", f"-rank{os.environ['RANK']}.json")
    with open(runs_file, encoding="utf-8") as f:
        runs = json.load(f)
    results = []
    for i, argv in enumerate(runs):
        two = run_counted(argv, 2, os.path.join(work, f"{i}-2"))
        three = run_counted(argv, 3, os.path.join(work, f"{i}-3"))
        results.append({key.strip("_"): three[key] - two[key] for key in COUNTED})
    with open(out_file, "w", encoding="utf-8") as f:
        json.dump(results, f)
    from training.run.job import leave_job

    leave_job()
    return 0


if __name__ == "__main__":
    run_cli(main)
