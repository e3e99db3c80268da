"""plan.py --predict_speed: a layout's step time and scaling efficiency, from one GPU's step time and the plan's
communication bytes over named link bandwidths. A bandwidth model (latency ignored: the messages are megabytes);
the assumptions and the figures for transformer-big: docs/speed.md ("Predicted scaling").
"""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import UserError
from model.costs import model_flops, peak_flops, uses_bf16_optimizer

# NVIDIA H100 SXM data sheet: NVLink 4 at 900 GB/s per GPU, both directions together → 450 GB/s each way, which a
# ring all-reduce's bus bandwidth approaches inside an NVSwitch node.
INTRA_NODE_GB_S = 450.0
# DGX H100: 8 ConnectX-7 NICs of 400 Gb/s (InfiniBand NDR) per node, one per GPU → 3200 Gb/s a node each way.
INTER_NODE_GB_S = 3200.0
# One GPU's default step time, when none is measured: the model's FLOPs per step at this share of the device's dense
# bf16 peak. Published bf16 Transformer training reaches 30-50% MFU on A100/H100 (larger models nearer 50%); a
# 210 M-parameter model with d_model 1024 sits at the low end.
ASSUMED_MFU = 0.35
# Below this a step is a few hundred kernel launches (~5 µs each) and collectives (~10-30 µs each): not modelled.
SHORT_STEP_S = 0.01


@dataclass(frozen=True)
class Links:
    intra_node_gb_s: float  # GB/s one GPU sends to another GPU of its node (NVLink / NVSwitch)
    inter_node_gb_s: float  # Gb/s one node sends to the network (all its NICs)
    gpus_per_node: int

    def __post_init__(self):
        for name, value in (
            ("--intra_node_GB_s", self.intra_node_gb_s),
            ("--inter_node_Gb_s", self.inter_node_gb_s),
            ("--gpus_per_node", self.gpus_per_node),
        ):
            if not value > 0:
                raise UserError(f"{name} {value:g}: a bandwidth or GPU count must be > 0")

    def bytes_per_s(self, spans_nodes: bool) -> float:
        """A ring's bus bandwidth per GPU: its slowest hop — the GPU's share of its node's NICs when it crosses
        nodes (NCCL runs one ring per NIC), NVLink inside a node."""
        inter = self.inter_node_gb_s / 8 * 1e9 / self.gpus_per_node
        return min(inter, self.intra_node_gb_s * 1e9) if spans_nodes else self.intra_node_gb_s * 1e9


def default_step_time(flops_per_step: float, device: str, precision: str, mfu: float = ASSUMED_MFU) -> float:
    """One GPU's step time at `mfu` of the device's dense peak in `precision` (model.costs.PEAK_FLOPS)."""
    peak = peak_flops(device.upper(), precision)
    if peak is None:
        raise UserError(
            f"--predict_speed: no peak FLOP/s known for --device {device} in {precision} (model/costs.py "
            f"PEAK_FLOPS); give the one-GPU step time with --step_time_1gpu SECONDS"
        )
    if not 0 < mfu <= 1:
        raise UserError(f"--assumed_mfu {mfu:g}: it is a share of the peak, in (0, 1]")
    return flops_per_step / (mfu * peak)


def predict(t1: float, world: int, dp: int, tp: int, pp: int, micro_batch_num: int, comm: dict, links: Links) -> dict:
    """Step time and scaling of a layout from `t1`, one GPU's step time on one data-parallel rank's batch.

    comm (bytes each rank sends per step, and whether that group crosses nodes): "tp_bytes", "tp_spans";
    "pp_bytes" (the largest stage boundary's, per TP rank), "pp_spans"; "dp_grad_bytes", "dp_param_bytes", "dp_spans";
    "dp_overlap_share": the part of the gradient reduction that may hide behind backward (0 when DeepSpeed reduces
    after backward). Assumed: compute splits evenly over the tp·pp GPUs of a replica; the pipeline bubble stretches it
    by (m+p-1)/m (idle share (p-1)/(m+p-1)); tensor- and pipeline-parallel transfers do not overlap compute; the
    gradient reduction hides behind at most the last micro-batch's backward (2/3 of its compute); the parameter
    all-gather after the optimizer step does not overlap."""
    if not t1 > 0:
        raise UserError(f"--step_time_1gpu {t1:g}: a step time must be > 0 seconds")
    compute = t1 / (tp * pp)
    bubble = (pp - 1) / (micro_batch_num + pp - 1)
    pipelined = compute * (micro_batch_num + pp - 1) / micro_batch_num
    tp_s = comm["tp_bytes"] / links.bytes_per_s(comm["tp_spans"])
    pp_s = comm["pp_bytes"] / links.bytes_per_s(comm["pp_spans"])
    dp_bw = links.bytes_per_s(comm["dp_spans"])
    grad_s, param_s = comm["dp_grad_bytes"] / dp_bw, comm["dp_param_bytes"] / dp_bw
    hidden = min(grad_s * comm["dp_overlap_share"], 2 / 3 * compute / micro_batch_num)
    dp_exposed = grad_s - hidden + param_s
    step = pipelined + tp_s + pp_s + dp_exposed
    speedup = dp * t1 / step  # dp replicas' batches in `step` against one replica's batch in t1
    return {
        "step_time_1gpu_s": t1,
        "step_time_s": step,
        "speedup": speedup,
        "efficiency": speedup / world,
        "compute_s": compute,
        "pipeline_bubble_share": bubble,
        "pipeline_bubble_s": pipelined - compute,
        "tp_s": tp_s,
        "pp_s": pp_s,
        "dp_gradient_s": grad_s,
        "dp_hidden_s": hidden,
        "dp_param_gather_s": param_s,
        "dp_exposed_s": dp_exposed,
    }


def plan_comm(plan: dict) -> dict:
    """The figures `predict` needs, from a plan (training.plan.planner.make_plan): per-rank bytes per step of the
    busiest stage, and whether each kind of group crosses nodes."""
    L, S, ranks = plan["layout"], plan["stages"], plan["ranks"]
    tp, dp = L["model_parallel"], L["data_parallel"]
    zero_cfg = plan["deepspeed"]["zero_optimization"]
    zero, prec = zero_cfg["stage"], plan["model"]["precision"]
    # what reduces from gradient hooks while backward runs (docs/speed.md, "Gradient reduction"): ZeRO 1/2/3 with
    # overlap_comm, never in a pipeline, never BF16_Optimizer (bf16 at ZeRO 0/1) or fp32 ZeRO 0
    overlaps = (
        bool(zero_cfg.get("overlap_comm"))
        and zero >= 1
        and L["pipeline_stage"] == 1
        and not uses_bf16_optimizer(zero, prec)
    )
    biggest = max(S, key=lambda st: st["dp"]["bytes_per_step"])
    n = biggest["params_per_rank"]
    last_bucket = min(1.0, int(zero_cfg.get("reduce_bucket_size", n)) / max(n, 1))
    boundaries = [st for st in S if "send_next" in st]
    # rank r of a stage sends to rank r + dp·tp of the next: do the ends of a boundary's pairs sit on other nodes?
    pp_spans = any(ranks[r]["node"] != ranks[r + dp * tp]["node"] for st in boundaries for r in st["ranks"])
    return {
        "tp_bytes": max(st["tp_allreduce"]["sent_per_rank_per_step"] for st in S) if tp > 1 else 0,
        "tp_spans": L["tp_groups_spanning_nodes"] > 0,
        "pp_bytes": max((st["send_next"]["bytes_per_step"] for st in boundaries), default=0),
        "pp_spans": pp_spans,
        "dp_grad_bytes": biggest["dp"]["grad_bytes_per_step"] if dp > 1 else 0,
        "dp_param_bytes": biggest["dp"]["param_bytes_per_step"] if dp > 1 else 0,
        "dp_spans": L["dp_groups_spanning_nodes"] > 0,
        "dp_overlap_share": (1 - last_bucket) if overlaps else 0.0,
        "dp_overlaps_backward": overlaps,
    }


def speed_section(
    plan: dict, model, step_time_1gpu: float | None, device: str | None, links: Links, mfu: float = ASSUMED_MFU
) -> dict:
    """plan["speed"]: the prediction for the plan's layout, with where its one-GPU time came from."""
    L = plan["layout"]
    pairs = L["global_batch"] // L["data_parallel"]  # one data-parallel rank's batch, padded
    s, t = model.src_len, model.tgt_len
    flops = model_flops(model, pairs * s, pairs * t, pairs, s, t)
    name = (device or "h100").lower()
    if step_time_1gpu is None:
        t1 = default_step_time(flops, name, plan["model"]["precision"], mfu)
        source = (
            f"assumed, not measured: {flops:.3g} FLOPs per step (model/costs.py, {pairs} pairs padded to "
            f"{s}/{t} tokens) at {mfu:.0%} MFU of the {name}'s dense {plan['model']['precision']} peak"
        )
    else:
        t1, source = step_time_1gpu, "given: --step_time_1gpu"
    comm = plan_comm(plan)
    out = predict(
        t1,
        plan["world_size"],
        L["data_parallel"],
        L["model_parallel"],
        L["pipeline_stage"],
        L["micro_batch_num"],
        comm,
        links,
    )
    return {
        **out,
        "step_time_1gpu_source": source,
        "flops_per_step_1gpu": flops,
        "comm": comm,
        "links": {
            "intra_node_GB_s": links.intra_node_gb_s,
            "inter_node_Gb_s": links.inter_node_gb_s,
            "gpus_per_node": links.gpus_per_node,
            "inter_node_GB_s_per_gpu": links.bytes_per_s(True) / 1e9,
        },
    }


def format_speed(sp: dict, world: int) -> list[str]:
    c, lk = sp["comm"], sp["links"]

    def ms(x: float) -> str:
        return f"{x * 1e3:.1f} ms" if x >= 1e-3 or x == 0 else f"{x * 1e3:.2g} ms"

    where = {
        True: f"across nodes, {lk['inter_node_GB_s_per_gpu']:.0f} GB/s per GPU",
        False: f"inside a node, {lk['intra_node_GB_s']:.0f} GB/s",
    }
    overlap = (
        "overlaps the last micro-batch's backward except its last bucket"
        if c["dp_overlaps_backward"]
        else "after backward, not overlapped (the optimizer DeepSpeed builds: docs/speed.md)"
    )
    pp_where = " (across nodes)" if c["pp_spans"] else ""
    out = [
        f"speed (prediction, not a measurement): one GPU {ms(sp['step_time_1gpu_s'])} per step "
        f"({sp['step_time_1gpu_source']})",
        f"  step on {world} GPU{'s' if world > 1 else ''} {ms(sp['step_time_s'])} = compute "
        f"{ms(sp['compute_s'])} + pipeline bubble "
        f"{ms(sp['pipeline_bubble_s'])} ({sp['pipeline_bubble_share']:.0%} idle) + tensor parallel "
        f"{ms(sp['tp_s'])} + pipeline sends {ms(sp['pp_s'])}{pp_where} + data parallel "
        f"{ms(sp['dp_exposed_s'])} exposed "
        f"(gradients {ms(sp['dp_gradient_s'])}, {ms(sp['dp_hidden_s'])} of it behind backward, parameter "
        f"all-gather {ms(sp['dp_param_gather_s'])}; {where[c['dp_spans']]})",
        f"  speed-up {sp['speedup']:.2f}× one GPU at equal per-GPU batch, scaling efficiency {sp['efficiency']:.0%}",
        f"  links: NVLink {lk['intra_node_GB_s']:.0f} GB/s per GPU each way (--intra_node_GB_s), network "
        f"{lk['inter_node_Gb_s']:.0f} Gb/s per node of {lk['gpus_per_node']} GPUs (--inter_node_Gb_s); "
        f"gradient reduction {overlap}; "
        f"TP and pipeline transfers not overlapped; latency ignored",
    ]
    if sp["step_time_s"] < SHORT_STEP_S:
        out.append(
            f"  a step under {SHORT_STEP_S * 1e3:.0f} ms is bound by kernel launches and collective latency, "
            f"which this bandwidth model leaves out: read these times as lower bounds"
        )
    return out
