"""Train the encoder-decoder Transformer (the MindSpore seed's train.py) on DeepSpeed, on CPU or GPU.

    # one process, CPU, bundled Multi30k (make the TSV first: see README)
    dstr-train --file_path out/data/train.fr_en.tsv --steps 20 --output_dir out/serial
    # 2 processes, tensor parallel (the seed's run.sh with RANK_SIZE=2); DeepSpeed's launcher takes a script's
    # path: run_scripts/train.py, or $(which dstr-train)
    deepspeed --num_gpus 2 run_scripts/train.py --distribute true --file_path out/data/train.fr_en.tsv \
        --mp 2 --steps 20 --output_dir out/tp2
    # a recipe, flags override it
    deepspeed --num_gpus 8 run_scripts/train.py --recipe recipes/8pcs/8pcs.json --file_path DATA.tsv

On a CPU-only machine DeepSpeed's launcher counts NUMA nodes, not cores, as "GPUs"; `--num_gpus N` starts N
processes regardless. dp is derived as world_size // mp // pipeline_stage, as in the seed. `--help` lists all flags.
"""

from __future__ import annotations

import sys

from common import launch_payload, slurm
from common.errors import console_script
from common.omp_wait import choose_omp_wait_policy
from training.run.rank_supervisor import reported_collective_failures, supervise_rank


def main(argv=None) -> int:
    choose_omp_wait_policy()  # before torch loads its OpenMP runtime, which reads the variable once
    # run_cluster.sh sends the arguments as one token, so no remote shell re-parses a path (common/launch_payload)
    argv = launch_payload.apply(sys.argv[1:] if argv is None else argv)
    slurm.adopt()  # a task srun started: rank and world from SLURM's variables, before anything reads them
    supervise_rank()  # several ranks: a small parent per rank reports how its rank died (no torch yet)
    from training.config.flags import parse_config

    config = parse_config(argv)
    from training.trainer import run_training

    with reported_collective_failures(config.faults.comm_timeout):  # a peer died or hung: one line, no traceback
        rc = run_training(config)
        from training.run.job import leave_job

        leave_job()  # every rank's job watch stopped, then one barrier, then the group
    return rc


cli = console_script(main)  # the console script (setup.cfg): user mistakes in one line


if __name__ == "__main__":
    cli()
