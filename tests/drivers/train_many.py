#!/usr/bin/env python3
"""Several train.py runs of the same world size, one after another, in ONE launch (one process group).

    deepspeed --num_gpus N tests/drivers/train_many.py RUNS.json [--check_devices]

RUNS.json is a list of train.py argument lists. Each run is exactly `run_scripts/train.py ARGS` — the same
`parse_config` and `run_training`, the same DeepSpeed engine — only the processes, the DeepSpeed import and the
rendezvous are shared, which is most of a small test run's cost on a CPU. Every run seeds everything it uses
(weights per block, dropout streams, data order), so runs do not see each other's state; the parity tests' single-
process reference would disagree with any run that did.

An entry {"load_and_save": ARGS} instead builds train.py's engine for ARGS, loads its --ckpt_file and saves it again
at once (tests/drivers/load_and_save.py): what a layout and optimizer loaded, written back out for comparison.

--check_devices first installs `tests.device_check.HostTensorChecker`: a collective given a host tensor fails the
run (nccl only accepts device tensors; on a CPU machine this is how the rule is enforced).

--trace_collectives records every collective of each run (tests.collective_trace.CollectiveTrace: op, dtype, element
count, group ranks) and writes it, per rank, to the run's OUTPUT_DIR/collectives-rank{R}.json.
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from common.errors import run_cli


def traced_training(config) -> None:
    """train.py's run under a collective trace; the records go to OUTPUT_DIR/collectives-rank{R}.json."""
    import torch.distributed as dist

    from tests.collective_trace import CollectiveTrace
    from training.trainer import run_training

    with CollectiveTrace() as trace:
        run_training(config)
    path = os.path.join(config.checkpoint.output_dir, f"collectives-rank{dist.get_rank()}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace.records, f)


def main() -> int:
    import torch.distributed as dist

    from training.config.flags import parse_config
    from training.trainer import run_training

    # the deepspeed launcher adds --local_rank=N
    runs_file, *flags = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    with open(runs_file, encoding="utf-8") as f:
        runs = json.load(f)
    checker = None
    if "--check_devices" in flags:
        from tests.device_check import HostTensorChecker

        checker = HostTensorChecker().install()
    for entry in runs:
        if isinstance(entry, dict):
            from tests.drivers.load_and_save import load_and_save

            load_and_save(parse_config([str(a) for a in entry["load_and_save"]]))
        elif "--trace_collectives" in flags:
            traced_training(parse_config([str(a) for a in entry]))
        else:
            run_training(parse_config([str(a) for a in entry]))
        dist.barrier()
    if checker is not None:
        checker.uninstall()
        print(f"device check: {checker.checked} collective calls, every tensor on the engine's device", flush=True)
    from training.run.job import leave_job

    leave_job()  # as train.py leaves: job watches stopped, barrier, process group torn down
    return 0


if __name__ == "__main__":
    run_cli(main)
