"""plan.py's advice on a layout that fits but runs badly: pipeline stages out of balance, and batches too small for
the GPUs. Every remedy is re-planned (its ratios are those of the changed plan, not guesses) and keeps the GPU count.
Why these thresholds: docs/parallelism.md ("What plan.py advises").
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Callable

from common.errors import UserError
from model.config import ModelConfig, ParallelConfig
from model.placement import BUILTIN_PIPELINE_FUNCS, assign_stages, load_pipeline_func
from training.config.sections import TrainConfig

# A stage holding more than this many times another's parameters, memory or compute is flagged: a pipeline runs at
# its slowest stage's pace, and its largest stage sets the memory every GPU of the layout must have.
IMBALANCE = 1.5
MEASURES = {"params": "parameters", "peak_bytes": "peak memory", "flops": "compute"}
# Splits searched exhaustively up to this many; beyond, the min-max split of the combined share (dynamic programming).
SEARCH_LIMIT = 50_000
# Streaming multiprocessors by --device name (data sheets), for the small-batch note; unknown devices: an H100's.
SMS = {"h100": 132, "h200": 132, "a100": 108, "a100-40gb": 108, "v100": 80, "l40s": 142, "a10": 72, "l4": 58}
TILE = 128  # rows and columns of the output tile one SM computes at a time (cuBLAS/CUTLASS)


def ratios(measures: dict) -> dict:
    """Per measure: the largest stage over the smallest, and which stages they are (None when the smallest is 0: a
    stage with no compute, e.g. one holding the embeddings only)."""
    out = {}
    for key in MEASURES:
        vals = measures[key]
        hi, lo = max(range(len(vals)), key=vals.__getitem__), min(range(len(vals)), key=vals.__getitem__)
        out[key] = {"ratio": vals[hi] / vals[lo] if vals[lo] > 0 else None, "high_stage": hi, "low_stage": lo}
    return out


def _worst(r: dict) -> float:
    return max(math.inf if v["ratio"] is None else v["ratio"] for v in r.values())


def _cut_score(cuts: tuple[int, ...], params: list[int], flops: list[int]) -> float:
    """The largest params or compute ratio of the split whose stage k + 1 starts at block cuts[k]; `params` and
    `flops` are prefix sums over the layers (embeddings, the blocks, the head): O(pp) a split, not O(layers)."""
    bounds = [0, *(c + 1 for c in cuts), len(params) - 1]  # stage k holds layers bounds[k]..bounds[k+1]-1
    ratio = 0.0
    for pre in (params, flops):
        sums = [pre[b] - pre[a] for a, b in zip(bounds, bounds[1:])]
        ratio = max(ratio, max(sums) / min(sums) if min(sums) > 0 else math.inf)
    return ratio


def _splits(n: int, pp: int):
    """Every block → stage assignment that is non-decreasing and leaves no middle stage empty (model.placement)."""
    for cuts in itertools.combinations_with_replacement(range(n + 1), pp - 1):
        if all(a < b for a, b in zip(cuts, cuts[1:], strict=False)):
            yield [sum(1 for c in cuts if c <= i) for i in range(n)]


def _first_best_cut(prev: list[float], pre: list[float], j: int, lo: int, hi: int, tail: float) -> int:
    """The first i in lo..hi minimising max(prev[i], pre[j] - pre[i] + tail): prev is non-decreasing and the
    second term non-increasing in i, so the minimum sits where they cross, found by bisection."""

    def weight(i: int) -> float:
        return pre[j] - pre[i] + tail

    a, b = lo, hi + 1
    while a < b:  # the first i where prev[i] >= weight(i)
        m = (a + b) // 2
        if prev[m] >= weight(m):
            b = m
        else:
            a = m + 1
    if a == lo or (a <= hi and prev[a] < weight(a - 1)):
        return a
    # before the crossing the cost is weight(i), non-increasing: the first i where it reaches weight(a - 1)
    target, a2, b2 = weight(a - 1), lo, a - 1
    while a2 < b2:
        m = (a2 + b2) // 2
        if weight(m) <= target:
            b2 = m
        else:
            a2 = m + 1
    return a2


def _minmax_split(weights: list[float], pp: int) -> list[int]:
    """Blocks cut into pp runs minimising the largest run's weight (first and last runs may be empty, they hold
    the embeddings / the head, whose weights are weights[0] / weights[-1]). Dynamic programming over (stage, blocks
    placed) with each best cut found by bisection: O(pp · n log n), where trying every cut was O(pp · n²) (3 s for
    2,000 blocks on 2 stages; 0.01 s now)."""
    blocks = weights[1:-1]
    n = len(blocks)
    pre = list(itertools.accumulate([0.0] + blocks))
    inf = math.inf
    # best[k][j]: the lightest heaviest-stage of blocks[:j] on stages 0..k, with cut[k][j] where stage k starts
    best = [[inf] * (n + 1) for _ in range(pp)]
    cut = [[0] * (n + 1) for _ in range(pp)]
    for j in range(n + 1):
        best[0][j] = weights[0] + pre[j]
    for k in range(1, pp):
        last = k == pp - 1
        tail = weights[-1] if last else 0.0
        lo = k - 1  # stages 1..k-1 hold a block each: best[k-1][i] is finite from here
        for j in range(n + 1):
            hi = j if last else j - 1  # middle stages hold a block
            if hi < lo:
                continue
            i = _first_best_cut(best[k - 1], pre, j, lo, hi, tail)
            best[k][j], cut[k][j] = max(best[k - 1][i], pre[j] - pre[i] + tail), i
    stage_of, j = [0] * n, n
    for k in range(pp - 1, 0, -1):
        i = cut[k][j]
        for b in range(i, j):
            stage_of[b] = k
        j = i
    return stage_of


def best_split(measures: dict, pp: int) -> list[int]:
    """The block → stage split that balances parameters and compute best, from the per-layer figures."""
    names = [n for layers in measures["layers"] for n in layers]
    params = [measures["layer_params"][n] for n in names]
    flops = [measures["layer_flops"][n] for n in names]
    n = len(names) - 2
    if math.comb(n + pp - 1, pp - 1) <= SEARCH_LIMIT:
        # every split as its cuts, scored from prefix sums in O(pp): one stage list per split, summed over every
        # layer, was O(n²) on 2 stages (9 s for 2,000 blocks)
        pre_p, pre_f = list(itertools.accumulate([0, *params])), list(itertools.accumulate([0, *flops]))
        cuts = min(itertools.combinations(range(n + 1), pp - 1), key=lambda c: _cut_score(c, pre_p, pre_f))
        return [bisect.bisect_right(cuts, i) for i in range(n)]
    total_p, total_f = sum(params) or 1, sum(flops) or 1
    return _minmax_split([p / total_p + f / total_f for p, f in zip(params, flops, strict=True)], pp)


def split_func(base: Callable, block_stages: list[int]) -> Callable:
    """The recipe's pipeline_func with its stages replaced by `block_stages` (recompute and fusion ids kept)."""

    def placed(network, layer_id, offset, parallel_config, layers):
        base(network, layer_id, offset, parallel_config, layers)
        network.pipeline_stage = block_stages[layer_id + offset]

    return placed


def _describe_moves(model: ModelConfig, now: list[int], best: list[int]) -> str:
    names = [f"encoder.{i}" for i in range(model.encoder_layers)] + [
        f"decoder.{i}" for i in range(model.decoder_layers)
    ]
    return ", ".join(f"{names[i]} to stage {b}" for i, (a, b) in enumerate(zip(now, best, strict=True)) if a != b)


def _remedy(change: str, flags: str | None, world: int, measures: dict, why: str) -> dict:
    """`change`: what to do, as a person reads it; `flags`: the train.py flags that do it (None: no flag does)."""
    r = ratios(measures)
    return {
        "change": change,
        "flags": flags,
        "world_size": world,
        "changes_gpu_count": False,
        "why": why,
        "ratios": {k: v["ratio"] for k, v in r.items()},
    }


def balance(
    cfg: TrainConfig,
    world: int,
    model: ModelConfig,
    parallel: ParallelConfig,
    func: Callable,
    measures: dict,
    remeasure: Callable[[TrainConfig, Callable | None], dict],
) -> dict | None:
    """Stage imbalance of a pipeline and the remedies that keep the GPU count: the embeddings split over the TP ranks
    (when replicated ones weigh on stage 0) and the split of blocks over stages that balances best, each re-planned
    with `remeasure(config, pipeline_func)`. None without a pipeline."""
    pp = parallel.pipeline_stage
    if pp == 1:
        return None
    r = ratios(measures)
    out = {"threshold": IMBALANCE, "ratios": r, "flagged": _worst(r) > IMBALANCE, "cause": None, "remedies": []}
    if not out["flagged"]:
        return out
    emb = measures["layer_params"].get("embeddings", 0)
    if parallel.vocab_emb_dp and parallel.model_parallel > 1 and r["params"]["high_stage"] == 0:
        out["cause"] = {"embeddings_params": emb, "stage_params": measures["params"][0]}
    tries = [(cfg, "", "", measures)]
    if parallel.vocab_emb_dp and parallel.model_parallel > 1:
        changed = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, vocab_emb_dp=False))
        try:
            split_emb = remeasure(changed, func)
        except UserError:
            split_emb = None
        better = split_emb is not None and ratios(split_emb)["params"]["ratio"] < r["params"]["ratio"]
        if better:
            out["remedies"].append(
                _remedy(
                    "--vocab_emb_dp 0",
                    "--vocab_emb_dp 0",
                    world,
                    split_emb,
                    f"the word tables split over the {parallel.model_parallel} TP ranks instead of replicated on each",
                )
            )
            tries.append((changed, "--vocab_emb_dp 0", "with the tables split, ", split_emb))
    now = assign_stages(model, parallel, func)
    for changed, prefix, context, base in tries:
        best = best_split(base, pp)
        if best == now:
            continue
        named = [
            name for name in BUILTIN_PIPELINE_FUNCS if assign_stages(model, parallel, load_pipeline_func(name)) == best
        ]
        try:
            replanned = remeasure(changed, split_func(func, best))
        except UserError:
            continue
        if _worst(ratios(replanned)) >= _worst(ratios(base)):
            continue  # no split does better than the one it has
        both = f"{prefix} + " if prefix else ""
        if named:
            flags = f"{prefix} --pipeline_func {named[0]}".strip()
            change, why = flags, f"{context}the split that balances best ({_describe_moves(model, now, best)})"
        else:
            flags = None
            change = f"{both}move {_describe_moves(model, now, best)}"
            why = (
                f"{context}the split that balances best; no built-in pipeline_func gives it: write one "
                f"(--pipeline_func package.module:function, model/placement.py)"
            )
        rem = _remedy(change, flags, world, replanned, why)
        rem["block_stages"] = best
        out["remedies"].append(rem)
    return out


def small_batch(cfg: TrainConfig, model: ModelConfig, parallel: ParallelConfig, device: str | None) -> dict | None:
    """A note when a GPU's micro-batch has too few tokens to keep it busy: a d_model-wide matrix product of M rows
    has ⌈M/128⌉·⌈d_model/128⌉ output tiles of 128×128, and with fewer tiles than SMs some SMs have nothing to do —
    so below SMs·128·128/d_model source tokens per micro-batch the step is bound by kernel launches and latency."""
    name = (device or "h100").lower()
    sms = SMS.get(name, SMS["h100"])
    dp, mb = parallel.data_parallel, parallel.micro_batch_num
    micro = cfg.data.batch_size // (dp * mb)
    tokens = micro * model.src_len
    threshold = math.ceil(sms * TILE * TILE / model.d_model)
    if tokens >= threshold:
        return None
    pairs = math.ceil(threshold / model.src_len)
    return {
        "pairs_per_micro_batch": micro,
        "tokens_per_micro_batch": tokens,
        "threshold_tokens": threshold,
        "sms": sms,
        "device": name if name in SMS else f"{name} (counted as an h100)",
        "pairs_per_dp_rank": cfg.data.batch_size // dp,
        "batch_size_at_threshold": pairs * mb * dp,
    }


def plan_advice(
    cfg: TrainConfig,
    world: int,
    model: ModelConfig,
    parallel: ParallelConfig,
    func: Callable,
    measures: dict,
    device: str | None,
    remeasure,
) -> dict:
    return {
        "balance": balance(cfg, world, model, parallel, func, measures, remeasure),
        "small_batch": small_batch(cfg, model, parallel, device),
    }
