"""plan.py --slurm: the sbatch line that runs a recipe's layout through run_scripts/slurm.sbatch — nodes, one task
per GPU, GPUs per node — and the signal lead, sized from the predicted save time.

The lead is what a job needs between SLURM's USR1 and its time limit (docs/slurm.md, "Sizing the signal lead"):
the step in flight and the next one (a stop request is agreed one step after it is noted: training.run.
stop_request), the checkpoint of the step it stops at — twice, since a background save still in flight is finished
first — written at the storage's bandwidth, then the ranks' exit, the batch script's decision and `scontrol
requeue` (EXIT_AND_REQUEUE_S); rounded up to 10 s, and never under MIN_LEAD_S. A checkpoint holds every parameter's
fp32 weight and AdamW's two fp32 moments: 12 bytes per parameter, whatever the layout (docs/checkpoints.md).
"""

from __future__ import annotations

import math

SAVE_GB_S = 1.0  # a job's write bandwidth to shared storage (a conservative network file system)
EXIT_AND_REQUEUE_S = 30.0  # ranks leave, the batch script decides, scontrol requeue
MIN_LEAD_S = 60
CHECKPOINT_BYTES_PER_PARAM = 12
SIGNAL_EARLY_S = 60  # SLURM sends the signal up to this much earlier than asked (its event resolution)


def checkpoint_bytes(plan: dict) -> int:
    """Bytes of one checkpoint of the plan's layout: the parameters of every (stage, TP rank) once."""
    L = plan["layout"]
    tp, dp = L["model_parallel"], L["data_parallel"]
    params = sum(plan["ranks"][k * dp * tp + t]["params"] for k in range(L["pipeline_stage"]) for t in range(tp))
    return params * CHECKPOINT_BYTES_PER_PARAM


def signal_lead(save_s: float, step_s: float) -> int:
    return max(MIN_LEAD_S, int(math.ceil((2 * save_s + 2 * step_s + EXIT_AND_REQUEUE_S) / 10.0) * 10))


def slurm_section(plan: dict, step_s: float, gpus_per_node: int, save_gb_s: float = SAVE_GB_S) -> dict:
    """plan["slurm"]: the nodes, tasks and lead, and the sbatch line (DATA_PATH left for the user)."""
    world = plan["world_size"]
    nodes = -(-world // gpus_per_node)
    per_node = -(-world // nodes)
    size = checkpoint_bytes(plan)
    save_s = size / (save_gb_s * 1e9)
    lead = signal_lead(save_s, step_s)
    tasks = [f"-N {nodes}", f"--ntasks-per-node={per_node}"]
    if per_node * nodes != world:  # uneven: the total, with at most per_node on a node
        tasks.append(f"--ntasks={world}")
    line = " ".join(
        [
            "sbatch",
            *tasks,
            f"--gpus-per-node={per_node}",
            f"--signal=B:USR1@{lead}",
            "run_scripts/slurm.sbatch",
            "DATA_PATH",
            plan["recipe"] or "RECIPE_JSON",
        ]
    )
    return {
        "nodes": nodes,
        "tasks_per_node": per_node,
        "gpus_per_node": per_node,
        "world_size": world,
        "checkpoint_bytes": size,
        "save_GB_s": save_gb_s,
        "save_s": save_s,
        "step_s": step_s,
        "signal_lead_s": lead,
        "sbatch": line,
    }


def format_slurm(sec: dict, layout: dict) -> list[str]:
    gb = sec["checkpoint_bytes"] / 1e9
    return [
        sec["sbatch"],
        f"  {sec['nodes']} node(s) × {sec['tasks_per_node']} tasks (one per GPU) = world {sec['world_size']} (dp "
        f"{layout['data_parallel']} × mp {layout['model_parallel']} × pp {layout['pipeline_stage']}); DATA_PATH: "
        f"your TSV, on storage every node mounts",
        f"  signal lead {sec['signal_lead_s']} s: a checkpoint of at most {gb:.3g} GB (12 bytes per parameter) at "
        f"{sec['save_GB_s']:g} GB/s (--save_GB_s) ≈ {sec['save_s']:.1f} s, twice (a background save in flight is "
        f"finished first), + 2 steps of {sec['step_s'] * 1e3:.3g} ms (predicted: --predict_speed) + "
        f"{EXIT_AND_REQUEUE_S:.0f} s to exit and requeue; at least {MIN_LEAD_S} s. SLURM may send it up to "
        f"{SIGNAL_EARLY_S} s earlier",
        f"  time limit: add --time=HH:MM:SS (your partition's limit, e.g. --time=24:00:00). Each job trains for the "
        f"limit less its start (imports, rendezvous, the checkpoint read) and the lead, then requeues itself (at "
        f"most 20 times: --max_requeues) and waits in the queue again — SLURM also holds a requeued job for its "
        f"credential lifetime (120 s by default). A limit shorter than start + lead + {SIGNAL_EARLY_S} s never "
        f"trains a step",
    ]
