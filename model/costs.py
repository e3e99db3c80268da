"""The one cost model: FLOPs, memory and communication of a step, as pure functions of the model, the layout and the
batch. plan.py (training/plan/planner.py) sizes a run with it before it starts, train.py reports achieved FLOP/s and MFU
with it (training/core/metrics.py), and the benchmarks (benchmarks/) count work with it. Nothing here touches a process
group or a device.

FLOPs (multiply-add = 2) of what a step executes, forward; h = d_model, f = FFN size, V = vocab, b pairs padded
to s/t source/target positions. The projections, the MLP and the head run on the real tokens only
(`model.packing`), attention on the padded layout (every position attends to every key):
           encoder layer   per real source token   8h² + 4hf  (QKV 6h², output 2h², MLP 4hf)
                           attention                4·b·s·s·h
           decoder layer   per real target token   12h² + 4hf (self QKV + out 8h², cross Q + out 4h², MLP)
                           per real source token   4h² (cross-attention K/V)
                           attention                4·b·t·t·h + 4·b·t·s·h
           head            per real target token   2hV
           A training step is 3× the forward (backward = 2×); recomputed blocks add their forward once more, which
           `model_flops` leaves out (MFU counts the model's work, not the recomputation). tests/test_plan.py checks
           this count against torch's FlopCounterMode on the model itself.

What is counted (per rank; b = micro-batch size, s/t = source/target length, h = d_model, f = FFN size,
a = heads, tp = model_parallel, V' = vocab padded to a multiple of tp, n = the rank's parameter count):

memory     fp32: params 4n, grads 4n, AdamW exp_avg + exp_avg_sq 8n, and with ZeRO >= 1 DeepSpeed's fp32 master
           copy 4n more; fp16/bf16: 2n, 2n and 12n (fp32 master copy + 2 states). ZeRO >= 1 divides the optimizer
           state by dp, ZeRO >= 2 the grads, ZeRO 3 the params (⌈n/dp⌉; DeepSpeed's bucket alignment padding is
           ignored).
DeepSpeed's buffers (deepspeed_buffer_bytes; DeepSpeed 0.19.8's engine and ZeRO optimizers), per rank, with
           G = 4: every gradient reduction is in fp32 under every precision (training.core.engine sets
           communication_data_type fp32), and half precision accumulates gradients in fp32. b = the reduce bucket
           (min(reduce_bucket_size, n) elements), p = ⌈n/dp⌉.
           ZeRO 0 (fp32) and BF16_Optimizer (bf16 at ZeRO 0/1, pipelined or not): the all-reduce after backward
           (engine.allreduce_gradients → buffered_allreduce_fallback → allreduce_bucket, also at dp 1) concatenates
           the gradients — BF16_Optimizer's fp32 accumulation groups — into one fp32 buffer of up to 5e8 elements:
           min(n, 5e8)·G, reduced in place (no cast). BF16_Optimizer also holds its fp32 accumulation, n·4.
           ZeRO 1/2 (DeepSpeedZeroOptimizer): the bucket's gradients are staged in fp32 at ZeRO 1 (fp32 gradients,
           or fp16's fp32 grad_accum copies, n·4 more) and in the training precision at ZeRO 2 (s = 4 or 2 bytes:
           stage_1_and_2's _gradient_reduction_buffer_dtype); with contiguous_gradients (the GPU default) they are
           copied into a contiguous buffer of b·s, two with overlap_comm; allreduce_bucket flattens a bucket (b·s)
           and casts it to fp32 when staged in half (b·G more); the fp32 gradient partition the optimizer steps is
           p·4 (in half precision also where gradients accumulate: counted once). ZeRO 2 reduces in backward every
           micro-batch, ZeRO 1 after backward, or in the last micro-batch's backward with overlap_comm.
           ZeRO 3: its bucket is a buffer of the communication dtype (b·G, with contiguous_gradients; without, a half
           bucket is cast to fp32: b·G too), reduce_scatter_coalesced concatenates it (b·G), the fp32 gradient
           partitions (p·4) exist from the start, and the parameters gathered for the layer being computed plus a
           prefetch bucket (5e7 elements) are in the training precision.
           peak = state + activations + every buffer (`rank_peak`). The buffers made after backward (the ZeRO 0/1
           flattened gradients, the fp32 gradient partition) come when the activations are freed, yet they add:
           measured on a CPU, the freed activation memory stays resident and the 131 MiB flattened gradients of a
           34 M-parameter model arrive on top of it (docs/memory.md), and CUDA's caching allocator keeps freed
           activation blocks reserved the same way (a buffer that large needs a segment of its own).
activations  tensors saved for backward per micro-batch, in elements of the training precision (4 bytes in fp32;
           dropout masks 1 byte each when dropout > 0):
           encoder layer  b·s·(4h + 4h/tp + 2f/tp) + k·b·(a/tp)·s²            (+ b·s·h for the final LayerNorm)
           decoder layer  b·t·(6h + 6h/tp + 2f/tp) + 2·b·s·h/tp + k·b·(a/tp)·(t² + t·s)
           per stage with decoder layers  + b·s·h (the encoder memory, input of every cross-attention K/V)
           head           2·b·t·h + 2·b·t·V'/tp (logits shard and the loss's exp)
           k = 2 with attention dropout (probabilities and their dropped copy), else 1. With recompute a block keeps
           only its input (b·s·h or b·t·h) plus the carried tensor once, and one block's full set is live while it
           is recomputed. Peak ≈ micro-batches in flight × per-micro-batch (+ that one block): in flight =
           min(pp - stage, micro_batch_num) under DeepSpeed's 1F1B schedule, 1 without pipelining.
The memory and communication figures are for batches padded to s/t (the most a step can hold): the blocks compute
on real tokens only (`model.packing`), so their activations and tensor-parallel all-reduces scale with the real
tokens of the batch — b·s below is then the batch's source tokens — while pipeline stages exchange padded tensors.

tensor parallel  all-reduces of b·s·h (encoder) or b·t·h (decoder) elements: per encoder layer 2 forward + 2
           backward, per decoder layer 3 + 3; per stage holding decoder layers 1 backward (the memory's gradient);
           the head's input 1 backward; the loss 3 small forward ones (b·t, b·t, 2·b·t); split embeddings
           (vocab_emb_dp false) 2 forward (b·s·h, b·t·h); recompute repeats the blocks' forward ones in backward.
           These are exactly the calls `model.parallel.mappings.CommLog` records (tests/test_tp_model.py,
           tests/test_plan.py).
           A ring all-reduce of P bytes over tp ranks sends 2·(tp-1)/tp·P per rank.
pipeline   per micro-batch across each stage boundary (`model.pipeline`): after an encoder block or a non-last
           decoder block one float [b,s+t,h] (the two hidden tensors joined) and src_ids [b,s], tgt_ids [b,t] int64,
           backward the float's gradient; after the last decoder block [b,t,h] and tgt_ids, backward [b,t,h]. With
           tp > 1 DeepSpeed splits the float over the TP ranks (pipe_partitioned / grad_partitioned, on by default:
           training.core.engine), so each TP rank sends 1/tp of it and of its gradient (plus a few bytes of split
           layout, not counted); with the split off every TP rank sends its own full copy.
data parallel  ring volume sent per rank, G = the rank's gradient bytes in fp32 (4 per parameter, under every
           precision), P = its parameter bytes in the training precision, r = (dp-1)/dp; an all-reduce sends 2r
           times its size, a reduce-scatter or an all-gather r times the whole. By the optimizer DeepSpeed builds:
           ZeRO 0 (fp32) all-reduce 2r·G per step; BF16_Optimizer (bf16 at ZeRO 0/1) all-reduce 2r·G + all-gather of
           the updated parameters r·P per step; ZeRO 1 (fp32, fp16 at ZeRO 0/1) the gradient buckets all-reduced
           whole (DeepSpeed's default use_multi_rank_bucket_allreduce; each rank keeps its partition's slice) 2r·G
           + all-gather r·P per step — with use_multi_rank_bucket_allreduce false each slice is reduced to its owner,
           r·G; ZeRO 2 the same every micro-batch + all-gather r·P per step; ZeRO 3 per micro-batch all-gather 2r·P
           (forward and backward) + reduce-scatter r·G. tests/test_grad_reduce_dtype.py checks the gradient part
           against the collectives DeepSpeed issues.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from model.config import ModelConfig, ParallelConfig

INT64 = 8


# ----------------------------------------------------------------------------------------------------------- FLOPs

def forward_flops(m: ModelConfig, src_tokens: int, tgt_tokens: int, pairs: int, src_len: int, tgt_len: int) -> int:
    """Forward FLOPs of the whole model for `pairs` sentence pairs with `src_tokens` / `tgt_tokens` real tokens,
    padded to `src_len` / `tgt_len` (formula in the module docstring)."""
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
    """Per-rank bytes of parameters, gradients and AdamW state for n_params parameters (see module docstring).
    The optimizer state is AdamW's two fp32 moments, plus — wherever DeepSpeed wraps the optimizer (every ZeRO
    stage >= 1, and every half-precision run) — the fp32 master copy of the parameters it steps, which DeepSpeed
    keeps even in fp32 (measured against its allocations in tests/test_plan.py)."""
    half = precision in ("fp16", "bf16")
    p_b, g_b = (2, 2) if half else (4, 4)
    o_b = 12 if half or zero >= 1 else 8
    part = -(-n_params // dp)           # ZeRO partition: ⌈n/dp⌉ elements

    def n(stage_needed: int) -> int:
        return part if zero >= stage_needed else n_params

    out = {"param_bytes": n(3) * p_b, "grad_bytes": n(2) * g_b, "optimizer_bytes": n(1) * o_b}
    out["total_bytes"] = sum(out.values())
    return out


ALLREDUCE_BUCKET = 500_000_000      # deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE: ZeRO 0's flattened gradients
ZERO3_PREFETCH = 50_000_000         # DeepSpeed's stage3_prefetch_bucket_size default (elements)
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


def _zero12_buffers(n_params: int, dp: int, zero: int, half: bool, bucket: int, overlap_comm: bool,
                    contiguous: bool) -> tuple[int, int]:
    """(during, after) backward for DeepSpeedZeroOptimizer (module docstring)."""
    staged = 2 if half and zero == 2 else GRAD_BYTES
    ipg = (int(contiguous) + int(contiguous and overlap_comm)) * bucket * staged
    reduce = bucket * staged + (bucket * GRAD_BYTES if staged != GRAD_BYTES else 0)     # flattened, cast to fp32
    partition = -(-n_params // dp) * GRAD_BYTES
    accumulation = n_params * GRAD_BYTES if half and zero == 1 else 0                  # fp16's fp32 grad_accum
    in_backward = zero == 2 or overlap_comm
    accumulates_in_partition = half and zero == 2
    during = ipg + accumulation + (reduce if in_backward else 0) + (partition if accumulates_in_partition else 0)
    after = (0 if in_backward else reduce) + (0 if accumulates_in_partition else partition)
    return during, after


def _zero3_buffers(n_params: int, dp: int, half: bool, bucket: int, contiguous: bool,
                   largest_block: int) -> tuple[int, int]:
    """(during, after) backward for DeepSpeedZeroOptimizer_Stage3 (module docstring); all of it lives during
    backward."""
    staging = bucket * GRAD_BYTES if contiguous or half else 0
    gathered = (min(largest_block, n_params) + min(ZERO3_PREFETCH, n_params)) * (2 if half else 4)
    return staging + bucket * GRAD_BYTES + -(-n_params // dp) * GRAD_BYTES + gathered, 0


def deepspeed_buffer_bytes(n_params: int, dp: int, zero: int, precision: str, reduce_bucket: int,
                           overlap_comm: bool, largest_block: int = 0,
                           contiguous_gradients: bool = False) -> dict[str, int]:
    """DeepSpeed's own allocations beyond params / grads / optimizer state on one rank of `n_params` parameters
    (module docstring): {"during_backward": bytes live while activations are, "after_backward": bytes that exist
    only once backward is done}. `zero`: the stage DeepSpeed runs (training.core.engine.optimizer_zero_stage);
    `reduce_bucket`: the ZeRO reduce bucket in elements; `overlap_comm` / `contiguous_gradients`: the ZeRO settings
    DeepSpeed applies (a pipeline runs without overlap); `largest_block`: the parameters of the largest block
    (ZeRO 3 gathers one at a time)."""
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
    """A rank's peak bytes: its state, its activations and all of DeepSpeed's buffers (see the module docstring for
    why those made after backward add too)."""
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


def activation_bytes(m: ModelConfig, p: ParallelConfig, names: Sequence[str], micro: int,
                     precision: str = "fp32", recomputed: Sequence[str] | None = None) -> dict[str, int]:
    """Activation estimate of one stage holding the layers `names` (formula in the module docstring);
    `recomputed`: the blocks pipeline_func recomputes (default: every block when p.recompute)."""
    tp, b, s, t, h = p.model_parallel, micro, m.src_len, m.tgt_len, m.d_model
    el = 2 if precision in ("fp16", "bf16") else 4
    recomputed = _recomputed(p, names, recomputed)
    kept = other = carried = 0
    largest = 0
    for name in names:
        if name == "embeddings":
            other += b * (s + t) * h if m.dropout > 0 else 0                  # dropout masks
        elif name.startswith(("encoder.", "decoder.")):
            if name.startswith("encoder."):
                e, k = _encoder_elems(m, tp, b, last=name == f"encoder.{m.encoder_layers - 1}")
                block_input = b * s * h * el
                carried = max(carried, b * t * h * el) if name in recomputed else carried    # tgt_h rides along
            else:
                e, k = _decoder_elems(m, tp, b)
                block_input = b * t * h * el
                carried = b * s * h * el if name in recomputed else carried                  # the encoder memory
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

def tp_allreduces(m: ModelConfig, p: ParallelConfig, names: Sequence[str], micro: int,
                  recomputed: Sequence[str] | None = None) -> dict[str, list[int]]:
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
            fwd += [b * s * h, b * t * h]               # split word tables: partial lookups summed
        if n_dec:
            bwd.append(b * s * h)                       # the memory's gradient, once per stage
        if "head" in names:
            bwd.append(b * t * h)                       # the head's input gradient
            loss += [b * t, b * t, 2 * b * t]           # max, sum-exp, (target logit, logit sum)
        rc = _recomputed(p, names, recomputed)          # the recomputed blocks' forward, again inside backward
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
    else:                                           # embeddings or a non-last encoder block
        joined = {"name": "src_h+tgt_h", "shape": [b, s + t, h], "float": True}
    return [joined, {"name": "src_ids", "shape": [b, s], "float": False}, tgt_ids]


def tensor_bytes(tensor: dict, float_bytes: int) -> int:
    """Bytes of one `boundary_tensors` entry: its float tensor at `float_bytes` an element, ids as int64."""
    return math.prod(tensor["shape"]) * (float_bytes if tensor["float"] else INT64)


def boundary_bytes(tensors: list[dict], float_bytes: int, tp: int, split_forward: bool,
                   split_backward: bool) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends across a stage boundary per micro-batch: the ids whole, the float
    tensor — and its gradient — 1/tp of it where DeepSpeed splits it over the TP ranks."""
    def share(n: int, split: bool) -> int:
        return n // tp if split else n
    floats = sum(tensor_bytes(x, float_bytes) for x in tensors if x["float"])
    ids = sum(tensor_bytes(x, float_bytes) for x in tensors if not x["float"])
    return share(floats, split_forward) + ids, share(floats, split_backward)


def dp_bytes(n_params: int, precision: str, zero: int, p: ParallelConfig,
             bucket_allreduce: bool = True) -> dict:
    """Bytes one rank of `n_params` parameters sends per step for data-parallel sync (ring volumes; module
    docstring): `zero` is the stage DeepSpeed runs, `bucket_allreduce` ZeRO 1/2's use_multi_rank_bucket_allreduce.
    Gradients travel in fp32 (GRAD_BYTES) under every precision, parameters in the training precision."""
    dp, mb = p.data_parallel, p.micro_batch_num
    if dp == 1:
        return {"bytes_per_step": 0, "grad_bytes_per_step": 0, "param_bytes_per_step": 0,
                "how": "dp = 1: no data-parallel communication"}
    r = (dp - 1) / dp
    G, P = n_params * GRAD_BYTES, n_params * (2 if precision in ("fp16", "bf16") else 4)
    gather = r * P
    if zero == 0:
        grads, gather, how = 2 * r * G, 0, "all-reduce of the fp32 gradients once per step: 2·(dp-1)/dp × grads"
    elif uses_bf16_optimizer(zero, precision):
        grads, how = 2 * r * G, ("BF16_Optimizer: all-reduce of the fp32 gradients + all-gather of the updated bf16 "
                                 "parameters once per step: (dp-1)/dp × (2·grads + params)")
    elif zero in (1, 2):
        per_reduction = (2 if bucket_allreduce else 1) * r * G
        how_reduce = ("all-reduce of the fp32 gradient buckets" if bucket_allreduce
                      else "reduce of each fp32 gradient slice to its owner")
        if zero == 1:
            grads, how = per_reduction, f"{how_reduce} + all-gather of the updated parameters once per step"
        else:
            grads, how = mb * per_reduction, (f"{how_reduce} every micro-batch + all-gather of the parameters "
                                              f"per step")
    else:
        grads, gather, how = mb * r * G, mb * 2 * r * P, ("per micro-batch: all-gather of the parameters in forward "
                                                          "and backward + reduce-scatter of the fp32 gradients")
    return {"bytes_per_step": int(round(grads + gather)), "grad_bytes_per_step": int(round(grads)),
            "param_bytes_per_step": int(round(gather)), "how": how}
