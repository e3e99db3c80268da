"""A layout's step time, as a sum of terms each scaled by a calibration factor (docs/layout-search.md).

Per micro-batch, each pipeline stage spends: compute (3× the forward FLOPs of its layers, model.costs, at the
device's sustained FLOP/s), recompute (the recomputed blocks' forward again, with its all-reduces and passes),
tensor-parallel all-reduces (model.costs.tp_allreduces: ring volume over the node's link plus a latency per call; not
overlapped, except what MicroBatchInterleaved hides behind the other part's compute), pipeline transfers on both
of its boundaries (model.costs.boundary_bytes) and a fixed cost per layer pass (kernel launches on a GPU, Python and
operator dispatch on a CPU). DeepSpeed's 1F1B schedule then takes (m + p - 1) times the slowest stage: m of them
are the work, p - 1 the bubble. After the last micro-batch each data-parallel group reduces (model.costs.dp_bytes:
fp32 gradients, parameter all-gathers) — partly hidden behind backward where DeepSpeed's optimizer reduces from
gradient hooks — the optimizer steps the rank's (ZeRO-sharded) parameters, and every step pays a fixed cost.

Each term is a prior figure in seconds (the device's data sheet, or measured CPU figures) times one of FACTORS, all
1 before calibration (overlap: the prior share hidden). Given which stage is slowest, the step time is linear in the
factors — what lets training.plan.calibration fit them to trial runs by least squares.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from common.errors import UserError
from model.costs import (
    ALLREDUCE_BUCKET,
    boundary_bytes,
    boundary_tensors,
    dp_bytes,
    peak_flops,
    tp_allreduces,
    uses_bf16_optimizer,
)
from training.plan.layout_space import Layout
from training.plan.search_setting import Setting
from training.plan.speed_prediction import Links

FACTORS = ("compute", "bandwidth", "latency", "overhead", "optimizer", "fixed", "overlap")
CATEGORIES = ("compute", "recompute", "tp", "pp", "overhead", "bubble", "dp", "optimizer", "fixed")


@dataclass(frozen=True)
class Prior:
    """The uncalibrated figures: what each factor multiplies."""

    flops_per_s: float  # one rank's sustained FLOP/s
    latency_s: float  # one collective or point-to-point call
    layer_pass_s: float  # one layer's forward or backward pass, beyond its FLOPs
    micro_pass_s: float  # one micro-batch through a stage, beyond its layers (the engine's own work)
    recompute_pass_s: float  # one recomputed block's checkpoint machinery (RNG state kept and restored, inputs)
    param_step_s: float  # the optimizer step, per parameter a rank updates
    step_s: float  # every step, whatever the layout (the engine's bookkeeping, the data)
    overlap: float  # the share of the hideable communication actually hidden


# GPUs: a ring's per-call latency (NCCL, ~10-30 µs), about ten kernel launches of ~4 µs per layer pass, AdamW
# reading and writing 28-32 bytes per fp32 parameter at ~3 TB/s, a millisecond of host work per step. FLOP/s:
# --assumed_mfu of the device's dense peak (model.costs.PEAK_FLOPS).
GPU_PRIOR = {
    "latency_s": 20e-6,
    "layer_pass_s": 40e-6,
    "micro_pass_s": 5e-4,
    "recompute_pass_s": 8e-5,
    "param_step_s": 1e-11,
    "step_s": 1e-3,
    "overlap": 0.8,
}
# CPUs (one thread per rank, gloo over loopback TCP): fitted to the test suite's TINY model (d_model 32, 2 + 2
# layers, batch 16) over 17 of its 2-rank layouts on this repository's 2-core machine at a quiet moment (load 1-3),
# then rounded — not to the models the goals are judged on (docs/layout-search.md). TINY's steps are mostly the
# fixed cost; compute and the optimizer, which it cannot tell apart, take figures of a core's sgemm (~30 GFLOP/s)
# and of a fused AdamW (~5 ns a parameter). gloo's collectives are synchronous: nothing overlaps.
CPU_PRIOR = {
    "flops_per_s": 3e10,
    "latency_s": 1.1e-3,
    "layer_pass_s": 4e-4,
    "micro_pass_s": 5e-3,
    "recompute_pass_s": 1.6e-3,
    "param_step_s": 5e-9,
    "step_s": 1.7e-2,
    "overlap": 0.05,
}
CPU_LINKS = Links(1.75, 14.0, 1)  # ~1.75 GB/s a rank, fitted as above


def prior_for(setting: Setting) -> Prior:
    if setting.device_type == "cpu":
        return Prior(**CPU_PRIOR)
    peak = peak_flops(setting.device.upper(), setting.precision)
    if peak is None:
        raise UserError(
            f"--search: no peak FLOP/s known for --device {setting.device} in {setting.precision} "
            f"(model/costs.py PEAK_FLOPS): use --device h100, h200, a100 or cpu, or calibrate a file "
            f"with --trials and pass it with --calibration"
        )
    return Prior(flops_per_s=peak * setting.assumed_mfu, **GPU_PRIOR)


def links_for(setting: Setting) -> Links:
    return CPU_LINKS if setting.device_type == "cpu" else setting.links


class Terms(defaultdict):
    """{(category, factor): seconds at factor 1}."""

    def __init__(self, items=()):
        super().__init__(float, items)

    def scaled(self, by: float) -> Terms:
        return Terms((k, v * by) for k, v in self.items())

    def plus(self, other: Terms) -> Terms:
        out = Terms(self)
        for k, v in other.items():
            out[k] += v
        return out

    def seconds(self, factors: dict) -> float:
        return sum(v * factors[f] for (_, f), v in self.items())


def _allreduce(
    terms: Terms, category: str, elements: list[int], el: int, tp: int, bw: float, lat: float, parts: int = 1
) -> None:
    """Ring all-reduces of these element counts (fp32 `el` = 4 for the loss's), `parts` calls each (interleave)."""
    ring = 2 * (tp - 1) / tp
    terms[(category, "bandwidth")] += ring * sum(elements) * el / bw
    terms[(category, "latency")] += len(elements) * parts * lat


def stage_terms(
    setting: Setting,
    prior: Prior,
    layout: Layout,
    names: tuple[str, ...],
    flops: float,
    block_flops: float,
    micro: int,
    hide: bool = True,
) -> Terms:
    """One stage's seconds per micro-batch, without its pipeline transfers. `flops`: the forward FLOPs of its
    layers, `block_flops` of its encoder and decoder blocks (what recompute runs again). Every term but the
    interleaved overlap adds up layer by layer (`hide` False leaves that one out: interleave_hidden adds it)."""
    parallel = layout.parallel(setting.cfg.parallel.gradient_aggregation_group)
    el = 2 if setting.precision in ("fp16", "bf16") else 4
    blocks = [n for n in names if n.startswith(("encoder.", "decoder."))]
    t, il, tp = Terms(), layout.interleave_num, layout.model_parallel
    t[("compute", "compute")] = 3 * flops / prior.flops_per_s
    t[("overhead", "overhead")] = 3 * len(names) * il * prior.layer_pass_s
    if layout.recompute and blocks:
        t[("recompute", "compute")] = block_flops / prior.flops_per_s
        t[("recompute", "overhead")] = len(blocks) * il * prior.recompute_pass_s
    if tp > 1:
        bw = links_for(setting).bytes_per_s(False)
        plain = tp_allreduces(setting.model, parallel, names, micro, recomputed=[])
        _allreduce(t, "tp", plain["forward"] + plain["backward"], el, tp, bw, prior.latency_s, il)
        _allreduce(t, "tp", plain["loss"], 4, tp, bw, prior.latency_s, il)
        if layout.recompute:
            again = tp_allreduces(setting.model, parallel, names, micro)["backward"][len(plain["backward"]) :]
            _allreduce(t, "recompute", again, el, tp, bw, prior.latency_s, il)
    return stage_wide(t, prior, il) if hide else t


def stage_wide(t: Terms, prior: Prior, parts: int) -> Terms:
    """The terms of a whole stage that no layer has: the engine's work per micro-batch (DeepSpeed's forward,
    backward and accumulation bookkeeping, the batch's copy), and with MicroBatchInterleaved the share of the
    tensor-parallel all-reduces run behind the other parts' compute — (parts - 1) / parts of them, at most the
    stage's compute."""
    t[("overhead", "overhead")] += prior.micro_pass_s
    if parts > 1:
        hideable = (t[("tp", "bandwidth")] + t[("tp", "latency")]) * (parts - 1) / parts
        t[("tp", "overlap")] = -min(hideable, t[("compute", "compute")])
    return t


def send_terms(setting: Setting, prior: Prior, layout: Layout, last_layer: str, micro: int, spans: bool) -> Terms:
    """One boundary's transfers per micro-batch (activations forward, their gradient back), charged to both of its
    stages: a point-to-point transfer occupies both ends."""
    el = 2 if setting.precision in ("fp16", "bf16") else 4
    tensors = boundary_tensors(setting.model, last_layer, micro)
    pipe = (
        setting.cfg.parallel.deepspeed_overrides.get("pipeline", {})
        if isinstance(setting.cfg.parallel.deepspeed_overrides, dict)
        else {}
    )
    tp = layout.model_parallel
    fwd, bwd = boundary_bytes(
        tensors,
        el,
        tp,
        tp > 1 and pipe.get("pipe_partitioned", True) is not False,
        tp > 1 and pipe.get("grad_partitioned", True) is not False,
    )
    t = Terms()
    t[("pp", "bandwidth")] = (fwd + bwd) / links_for(setting).bytes_per_s(spans)
    t[("pp", "latency")] = (len(tensors) + 1) * prior.latency_s
    return t


def dp_terms(
    setting: Setting,
    prior: Prior,
    layout: Layout,
    n_params: int,
    zero_cfg: dict,
    spans: bool,
    compute_per_micro: float,
    tensors: int = 0,
) -> Terms:
    """One stage's data-parallel reduction per step (ring volumes, model.costs.dp_bytes), its hideable part, and
    the optimizer step of the rank's parameters. `zero_cfg`: the DeepSpeed config's zero_optimization there;
    `tensors`: the stage's parameter tensors, which ZeRO 3 gathers one by one (a collective and a Python hook
    each, in forward and again in backward: on CPUs the slowest layout by far)."""
    zero, prec, t = zero_cfg["stage"], setting.precision, Terms()
    parallel = layout.parallel(setting.cfg.parallel.gradient_aggregation_group)
    stepped = -(-n_params // layout.data_parallel) if zero >= 1 else n_params
    t[("optimizer", "optimizer")] = stepped * prior.param_step_s
    if layout.data_parallel == 1:
        return t
    sent = dp_bytes(n_params, prec, zero, parallel, bool(zero_cfg.get("use_multi_rank_bucket_allreduce", True)))
    bw = links_for(setting).bytes_per_s(spans)
    bucket = max(1, min(int(zero_cfg.get("reduce_bucket_size", ALLREDUCE_BUCKET)), n_params))
    flat = zero == 0 or uses_bf16_optimizer(zero, prec)  # one flat fp32 buffer all-reduced after backward
    buckets = math.ceil(n_params / (ALLREDUCE_BUCKET if flat else bucket))
    mb = layout.micro_batch_num
    # reductions (+ parameter all-gathers) of `buckets` calls each: per step, or per micro-batch from ZeRO 2
    calls = buckets * {0: 1, 1: 2, 2: mb + 1, 3: mb}[zero]
    if flat and sent["param_bytes_per_step"]:
        calls = 2 * buckets
    if zero == 3:
        calls += 2 * mb * tensors
        t[("dp", "overhead")] = 2 * mb * tensors * prior.layer_pass_s
    t[("dp", "bandwidth")] = sent["bytes_per_step"] / bw
    t[("dp", "latency")] = calls * prior.latency_s
    overlaps = (
        bool(zero_cfg.get("overlap_comm"))
        and zero >= 1
        and layout.pipeline_stage == 1
        and not uses_bf16_optimizer(zero, prec)
    )
    if overlaps:
        hideable = (
            sent["grad_bytes_per_step"] * (1 - bucket / n_params) + (sent["param_bytes_per_step"] if zero == 3 else 0)
        ) / bw
        window = 2 / 3 * compute_per_micro * (layout.micro_batch_num if zero >= 2 else 1)
        t[("dp", "overlap")] = -min(hideable, window)
    return t
