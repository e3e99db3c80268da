"""The one cost model: FLOPs, memory and communication of a step, as pure functions of the model, the layout and the
batch. plan.py (training/plan/planner.py) sizes a run with it before it starts, train.py reports achieved FLOP/s and MFU
with it (training/core/metrics.py), and the benchmarks (benchmarks/) count work with it. Nothing here touches a process
group or a device. What each function counts, its formulas and the DeepSpeed behaviour behind them:
docs/cost-model.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from model.config import ModelConfig, ParallelConfig

INT64 = 8


# ----------------------------------------------------------------------------------------------------------- FLOPs


def forward_flops(m: ModelConfig, src_tokens: int, tgt_tokens: int, pairs: int, src_len: int, tgt_len: int) -> int:
    """Forward FLOPs of the whole model for `pairs` sentence pairs with `src_tokens` / `tgt_tokens` real tokens,
    padded to `src_len` / `tgt_len` (formulas: docs/cost-model.md#flops)."""
    h, f, v, b, s, t = m.d_model, m.ffn, m.vocab_size, pairs, src_len, tgt_len
    enc = src_tokens * (8 * h * h + 4 * h * f) + 4 * b * s * s * h
    dec = tgt_tokens * (12 * h * h + 4 * h * f) + src_tokens * 4 * h * h + 4 * b * t * (t + s) * h
    return m.encoder_layers * enc + m.decoder_layers * dec + tgt_tokens * 2 * h * v


def layer_forward_flops(m: ModelConfig, name: str, pairs: int, src_len: int, tgt_len: int, tp: int = 1) -> float:
    """Forward FLOPs of one pipeline layer ("embeddings", "encoder.i", "decoder.i", "head") on one of `tp` tensor
    parallel ranks, for `pairs` pairs padded to src_len / tgt_len (every position counted): the terms of
    forward_flops, split by layer, so a pipeline stage's compute is the sum of its layers'. Lookups count 0."""
    h, f, b, s, t = m.d_model, m.ffn, pairs, src_len, tgt_len
    if name.startswith("encoder."):
        total = b * s * (8 * h * h + 4 * h * f) + 4 * b * s * s * h
    elif name.startswith("decoder."):
        total = b * t * (12 * h * h + 4 * h * f) + b * s * 4 * h * h + 4 * b * t * (t + s) * h
    elif name == "head":
        total = b * t * 2 * h * m.vocab_size
    else:
        total = 0
    return total / tp


def model_flops(m: ModelConfig, src_tokens: int, tgt_tokens: int, pairs: int, src_len: int, tgt_len: int) -> int:
    """FLOPs of one training step's forward and backward over a global batch (3× forward; no recompute)."""
    return 3 * forward_flops(m, src_tokens, tgt_tokens, pairs, src_len, tgt_len)


# dense peak FLOP/s per GPU by (name fragment, precision), from the vendors' data sheets (no sparsity). fp32 is the
# non-tensor-core rate: torch runs fp32 matrix products in true fp32 unless TF32 is switched on. A device not listed
# here (every CPU) has no MFU: its peak is not guessed.
PEAK_FLOPS = [
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12}),
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
]


def peak_flops(device_name: str, precision: str) -> float | None:
    """Peak dense FLOP/s of one device of that name in `precision`, or None when unknown."""
    for fragment, peaks in PEAK_FLOPS:
        if fragment in device_name:
            return peaks.get(precision)
    return None


def state_bytes(n_params: int, dp: int, zero: int, precision: str = "fp32") -> dict[str, int]:
    """Per-rank bytes of parameters, gradients and AdamW state for n_params parameters
    (docs/cost-model.md#memory-per-rank, State). The optimizer state is AdamW's two fp32 moments, plus — wherever
    DeepSpeed wraps the optimizer (every ZeRO stage >= 1, and every half-precision run) — the fp32 master copy of the
    parameters it steps, which DeepSpeed keeps even in fp32 (measured against its allocations in tests/test_plan.py)."""
    half = precision in ("fp16", "bf16")
    p_b, g_b = (2, 2) if half else (4, 4)
    o_b = 12 if half or zero >= 1 else 8
    part = -(-n_params // dp)  # ZeRO partition: ⌈n/dp⌉ elements

    def n(stage_needed: int) -> int:
        return part if zero >= stage_needed else n_params

    out = {"param_bytes": n(3) * p_b, "grad_bytes": n(2) * g_b, "optimizer_bytes": n(1) * o_b}
    out["total_bytes"] = sum(out.values())
    return out


ALLREDUCE_BUCKET = 500_000_000  # deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE: ZeRO 0's flattened gradients
ZERO3_PREFETCH = 50_000_000  # DeepSpeed's stage3_prefetch_bucket_size default (elements)
# bytes of a gradient element on the data-parallel wire and in DeepSpeed's reduction buffers: fp32 under every
# precision (training.core.engine.GRAD_REDUCE_DTYPE, DeepSpeed's communication_data_type), and half precision
# accumulates gradients in fp32 too
GRAD_BYTES = 4


def deepspeed_zero_stage(requested: int, precision: str) -> int:
    """The ZeRO stage DeepSpeed runs for the requested one: fp16/bf16 at ZeRO 0 run stage 1, the only one that keeps
    fp32 master weights and accumulation (why: training.core.engine.optimizer_zero_stage, which builds the DeepSpeed
    config and must agree: tests/test_plan_advice.py). plan.py --check prints it without importing DeepSpeed."""
    return max(requested, 1) if precision in ("fp16", "bf16") else requested


def uses_bf16_optimizer(zero: int, precision: str) -> bool:
    """bf16 at DeepSpeed's stage 1 (ZeRO 0 and 1 here) runs BF16_Optimizer: ZeRO 0's flat all-reduce, no reduce
    bucket (training.core.engine.optimizer_zero_stage)."""
    return precision == "bf16" and zero == 1


def _flat_allreduce_buffers(n_params: int, precision: str) -> tuple[int, int]:
    """(during, after) backward for fp32 ZeRO 0 and BF16_Optimizer: the gradients flattened into one fp32 buffer for
    the all-reduce after backward, and BF16_Optimizer's fp32 gradient accumulation."""
    during = n_params * GRAD_BYTES if precision == "bf16" else 0
    return during, min(n_params, ALLREDUCE_BUCKET) * GRAD_BYTES


def _zero12_buffers(
    n_params: int, dp: int, zero: int, half: bool, bucket: int, overlap_comm: bool, contiguous: bool
) -> tuple[int, int]:
    """(during, after) backward for DeepSpeedZeroOptimizer (docs/cost-model.md#memory-per-rank, ZeRO 1/2)."""
    staged = 2 if half and zero == 2 else GRAD_BYTES
    ipg = (int(contiguous) + int(contiguous and overlap_comm)) * bucket * staged
    reduce = bucket * staged + (bucket * GRAD_BYTES if staged != GRAD_BYTES else 0)  # flattened, cast to fp32
    partition = -(-n_params // dp) * GRAD_BYTES
    accumulation = n_params * GRAD_BYTES if half and zero == 1 else 0  # fp16's fp32 grad_accum
    in_backward = zero == 2 or overlap_comm
    accumulates_in_partition = half and zero == 2
    during = ipg + accumulation + (reduce if in_backward else 0) + (partition if accumulates_in_partition else 0)
    after = (0 if in_backward else reduce) + (0 if accumulates_in_partition else partition)
    return during, after


def _zero3_buffers(
    n_params: int, dp: int, half: bool, bucket: int, contiguous: bool, largest_block: int
) -> tuple[int, int]:
    """(during, after) backward for DeepSpeedZeroOptimizer_Stage3 (docs/cost-model.md#memory-per-rank, ZeRO 3);
    all of it lives during backward."""
    staging = bucket * GRAD_BYTES if contiguous or half else 0
    gathered = (min(largest_block, n_params) + min(ZERO3_PREFETCH, n_params)) * (2 if half else 4)
    return staging + bucket * GRAD_BYTES + -(-n_params // dp) * GRAD_BYTES + gathered, 0


def deepspeed_buffer_bytes(
    n_params: int,
    dp: int,
    zero: int,
    precision: str,
    reduce_bucket: int,
    overlap_comm: bool,
    largest_block: int = 0,
    contiguous_gradients: bool = False,
) -> dict[str, int]:
    """DeepSpeed's own allocations beyond params / grads / optimizer state on one rank of `n_params` parameters
    (docs/cost-model.md#memory-per-rank): {"during_backward": bytes live while activations are, "after_backward":
    bytes that exist only once backward is done}. `zero`: the stage DeepSpeed runs
    (training.core.engine.optimizer_zero_stage); `reduce_bucket`: the ZeRO reduce bucket in elements; `overlap_comm` /
    `contiguous_gradients`: the ZeRO settings DeepSpeed applies (a pipeline runs without overlap); `largest_block`:
    the parameters of the largest block (ZeRO 3 gathers one at a time)."""
    half = precision in ("fp16", "bf16")
    bucket = min(reduce_bucket, n_params)
    if zero == 0 or uses_bf16_optimizer(zero, precision):
        during, after = _flat_allreduce_buffers(n_params, precision)
    elif zero == 3:
        during, after = _zero3_buffers(n_params, dp, half, bucket, contiguous_gradients, largest_block)
    else:
        during, after = _zero12_buffers(n_params, dp, zero, half, bucket, overlap_comm, contiguous_gradients)
    return {"during_backward": during, "after_backward": after}


def rank_peak(state: int, activations: int, buffers: dict[str, int]) -> int:
    """A rank's peak bytes: its state, its activations and all of DeepSpeed's buffers (why those made after backward
    add too: docs/cost-model.md#memory-per-rank)."""
    return state + activations + buffers["during_backward"] + buffers["after_backward"]


def _encoder_elems(m: ModelConfig, tp: int, b: int, last: bool) -> tuple[int, int]:
    """(float elements, mask bytes) saved by one encoder layer for one micro-batch."""
    s, h, f, a = m.src_len, m.d_model, m.ffn, m.num_heads // tp
    k = 2 if m.attention_dropout > 0 else 1
    elems = b * s * (4 * h + 4 * h // tp + 2 * f // tp) + k * b * a * s * s + (b * s * h if last else 0)
    masks = (2 * b * s * h if m.dropout > 0 else 0) + (b * a * s * s if m.attention_dropout > 0 else 0)
    return elems, masks


def _decoder_elems(m: ModelConfig, tp: int, b: int) -> tuple[int, int]:
    s, t, h, f, a = m.src_len, m.tgt_len, m.d_model, m.ffn, m.num_heads // tp
    k = 2 if m.attention_dropout > 0 else 1
    elems = b * t * (6 * h + 6 * h // tp + 2 * f // tp) + 2 * b * s * h // tp + k * b * a * (t * t + t * s)
    masks = (3 * b * t * h if m.dropout > 0 else 0) + (b * a * (t * t + t * s) if m.attention_dropout > 0 else 0)
    return elems, masks


def activation_bytes(
    m: ModelConfig,
    p: ParallelConfig,
    names: Sequence[str],
    micro: int,
    precision: str = "fp32",
    recomputed: Sequence[str] | None = None,
) -> dict[str, int]:
    """Activation estimate of one stage holding the layers `names` (formulas: docs/cost-model.md#memory-per-rank,
    Activations); `recomputed`: the blocks pipeline_func recomputes (default: every block when p.recompute)."""
    tp, b, s, t, h = p.model_parallel, micro, m.src_len, m.tgt_len, m.d_model
    el = 2 if precision in ("fp16", "bf16") else 4
    recomputed = _recomputed(p, names, recomputed)
    kept = other = carried = 0
    largest = 0
    for name in names:
        if name == "embeddings":
            other += b * (s + t) * h if m.dropout > 0 else 0  # dropout masks
        elif name.startswith(("encoder.", "decoder.")):
            if name.startswith("encoder."):
                e, k = _encoder_elems(m, tp, b, last=name == f"encoder.{m.encoder_layers - 1}")
                block_input = b * s * h * el
                carried = max(carried, b * t * h * el) if name in recomputed else carried  # tgt_h rides along
            else:
                e, k = _decoder_elems(m, tp, b)
                block_input = b * t * h * el
                carried = b * s * h * el if name in recomputed else carried  # the encoder memory
            if name in recomputed:
                kept, largest = kept + block_input, max(largest, e * el + k)
            else:
                kept += e * el + k
        elif name == "head":
            other += (2 * b * t * h + 2 * b * t * m.padded_vocab(tp) // tp) * el
    decoders = [n for n in names if n.startswith("decoder.")]
    # the memory, input of every cross-attention K/V: counted once per stage unless only carried (all recomputed)
    memory = b * s * h * el if decoders and not all(n in recomputed for n in decoders) else 0
    if memory:
        carried = 0
    return {"per_micro_batch": other + kept + carried + memory, "recompute_transient": largest}


def _recomputed(p: ParallelConfig, names: Sequence[str], recomputed: Sequence[str] | None) -> set[str]:
    """The blocks among `names` whose forward is recomputed in backward."""
    blocks = {n for n in names if n.startswith(("encoder.", "decoder."))}
    if recomputed is None:
        return blocks if p.recompute else set()
    return blocks & set(recomputed)


def in_flight(p: ParallelConfig, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once (DeepSpeed 1F1B; gradient accumulation: 1)."""
    if p.pipeline_stage == 1:
        return 1
    return min(p.pipeline_stage - stage, p.micro_batch_num)


# ---------------------------------------------------------------------------------------------------- communication


def tp_allreduces(
    m: ModelConfig, p: ParallelConfig, names: Sequence[str], micro: int, recomputed: Sequence[str] | None = None
) -> dict[str, list[int]]:
    """Element counts of every TP all-reduce one rank of this stage issues per micro-batch: "forward" and
    "backward" (activations and their gradients, `CommLog` op "all_reduce") and "loss" (the vocab-parallel loss's
    statistics, fp32, op "loss_all_reduce"). `recomputed` as in activation_bytes."""
    fwd: list[int] = []
    bwd: list[int] = []
    loss: list[int] = []
    if p.model_parallel > 1:
        b, s, t, h = micro, m.src_len, m.tgt_len, m.d_model
        n_enc = sum(1 for n in names if n.startswith("encoder."))
        n_dec = sum(1 for n in names if n.startswith("decoder."))
        fwd += [b * s * h] * (2 * n_enc) + [b * t * h] * (3 * n_dec)
        bwd += [b * s * h] * (2 * n_enc) + [b * t * h] * (3 * n_dec)
        if "embeddings" in names and not p.vocab_emb_dp:
            fwd += [b * s * h, b * t * h]  # split word tables: partial lookups summed
        if n_dec:
            bwd.append(b * s * h)  # the memory's gradient, once per stage
        if "head" in names:
            bwd.append(b * t * h)  # the head's input gradient
            loss += [b * t, b * t, 2 * b * t]  # max, sum-exp, (target logit, logit sum)
        rc = _recomputed(p, names, recomputed)  # the recomputed blocks' forward, again inside backward
        bwd += [b * s * h] * (2 * sum(1 for n in rc if n.startswith("encoder.")))
        bwd += [b * t * h] * (3 * sum(1 for n in rc if n.startswith("decoder.")))
    return {"forward": fwd, "backward": bwd, "loss": loss}


def boundary_tensors(m: ModelConfig, last_layer: str, micro: int) -> list[dict]:
    """What crosses a stage boundary after `last_layer`, per micro-batch (`model.pipeline.join_boundary`)."""
    b, s, t, h = micro, m.src_len, m.tgt_len, m.d_model
    tgt_ids = {"name": "tgt_ids", "shape": [b, t], "float": False}
    if last_layer == f"decoder.{m.decoder_layers - 1}":
        return [{"name": "tgt_h", "shape": [b, t, h], "float": True}, tgt_ids]
    if last_layer.startswith("decoder.") or last_layer == f"encoder.{m.encoder_layers - 1}":
        joined = {"name": "tgt_h+memory", "shape": [b, t + s, h], "float": True}
    else:  # embeddings or a non-last encoder block
        joined = {"name": "src_h+tgt_h", "shape": [b, s + t, h], "float": True}
    return [joined, {"name": "src_ids", "shape": [b, s], "float": False}, tgt_ids]


def tensor_bytes(tensor: dict, float_bytes: int) -> int:
    """Bytes of one `boundary_tensors` entry: its float tensor at `float_bytes` an element, ids as int64."""
    return math.prod(tensor["shape"]) * (float_bytes if tensor["float"] else INT64)


def boundary_bytes(
    tensors: list[dict], float_bytes: int, tp: int, split_forward: bool, split_backward: bool
) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends across a stage boundary per micro-batch: the ids whole, the float
    tensor — and its gradient — 1/tp of it where DeepSpeed splits it over the TP ranks."""

    def share(n: int, split: bool) -> int:
        return n // tp if split else n

    floats = sum(tensor_bytes(x, float_bytes) for x in tensors if x["float"])
    ids = sum(tensor_bytes(x, float_bytes) for x in tensors if not x["float"])
    return share(floats, split_forward) + ids, share(floats, split_backward)


def dp_bytes(n_params: int, precision: str, zero: int, p: ParallelConfig, bucket_allreduce: bool = True) -> dict:
    """Bytes one rank of `n_params` parameters sends per step for data-parallel sync (ring volumes:
    docs/cost-model.md#communication-per-rank): `zero` is the stage DeepSpeed runs, `bucket_allreduce` ZeRO 1/2's
    use_multi_rank_bucket_allreduce. Gradients travel in fp32 (GRAD_BYTES) under every precision, parameters in the
    training precision."""
    dp, mb = p.data_parallel, p.micro_batch_num
    if dp == 1:
        return {
            "bytes_per_step": 0,
            "grad_bytes_per_step": 0,
            "param_bytes_per_step": 0,
            "how": "dp = 1: no data-parallel communication",
        }
    r = (dp - 1) / dp
    G, P = n_params * GRAD_BYTES, n_params * (2 if precision in ("fp16", "bf16") else 4)
    gather = r * P
    if zero == 0:
        grads, gather, how = 2 * r * G, 0, "all-reduce of the fp32 gradients once per step: 2·(dp-1)/dp × grads"
    elif uses_bf16_optimizer(zero, precision):
        grads, how = (
            2 * r * G,
            (
                "BF16_Optimizer: all-reduce of the fp32 gradients + all-gather of the updated bf16 "
                "parameters once per step: (dp-1)/dp × (2·grads + params)"
            ),
        )
    elif zero in (1, 2):
        per_reduction = (2 if bucket_allreduce else 1) * r * G
        how_reduce = (
            "all-reduce of the fp32 gradient buckets"
            if bucket_allreduce
            else "reduce of each fp32 gradient slice to its owner"
        )
        if zero == 1:
            grads, how = per_reduction, f"{how_reduce} + all-gather of the updated parameters once per step"
        else:
            grads, how = mb * per_reduction, (f"{how_reduce} every micro-batch + all-gather of the parameters per step")
    else:
        grads, gather, how = (
            mb * r * G,
            mb * 2 * r * P,
            (
                "per micro-batch: all-gather of the parameters in forward "
                "and backward + reduce-scatter of the fp32 gradients"
            ),
        )
    return {
        "bytes_per_step": int(round(grads + gather)),
        "grad_bytes_per_step": int(round(grads)),
        "param_bytes_per_step": int(round(gather)),
        "how": how,
    }
