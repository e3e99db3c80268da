"""`plan.py --search`: every layout of the world (training.plan.layout_space), each pipeline's blocks split as the
recipe splits them and as the min-max split (training.plan.stage_split), ZeRO stages, a prediction for each
(training.plan.layout_prediction), rejections with reasons, and the ranking. The design: docs/layout-search.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.errors import UserError
from model.placement import assign_stages, blocks_pipeline_func, load_pipeline_func, pipeline_func_name
from training.plan import memory as mem
from training.plan import step_model as sm
from training.plan.layer_figures import layer_figures
from training.plan.layout_prediction import Context, Prediction, predict, split_costs
from training.plan.layout_space import Group, Layout, enumerate_space, errors
from training.plan.search_setting import GIB, Setting
from training.plan.stage_split import best_split

SPLIT_SEARCH_LIMIT = 4096  # (i, j) pairs × stages up to which a memory-bound split is searched stage by stage


@dataclass
class SearchResult:
    candidates: list[Prediction]  # ranked, fastest first
    rejected: list[dict]  # {"layout": Layout, "reason": str, "kind": str}
    factors: dict
    seconds: float = 0.0  # wall clock
    cpu_seconds: float = 0.0  # this process's CPU: what one core spent (a busy machine's wall is longer)
    recipe_own: dict = field(default_factory=dict)

    @property
    def considered(self) -> int:
        return len(self.candidates) + len(self.rejected)


def usable_bytes(setting: Setting) -> float:
    return mem.USABLE * setting.memory_bytes


def memory_reason(setting: Setting, pred: Prediction) -> str:
    k = max(range(len(pred.stage_peaks)), key=pred.stage_peaks.__getitem__)
    usable = usable_bytes(setting)
    return (
        f"memory: stage {k} needs {pred.stage_peaks[k] / GIB:.2f} GiB per rank, "
        f"{(pred.stage_peaks[k] - usable) / GIB:.2f} GiB over the {usable / GIB:.2f} GiB usable "
        f"({mem.USABLE:.0%} of {setting.memory_name})"
    )


def zero_stages(setting: Setting, group: Group) -> tuple[list[int], list[int]]:
    """(stages to predict, stages DeepSpeed refuses with a pipeline). fp16/bf16 run ZeRO 0 as 1 (their fp32 master
    weights: model.costs.deepspeed_zero_stage), so 0 is not tried beside 1 there."""
    allowed, refused = group.zero_stages()
    if setting.precision in ("fp16", "bf16") and group.base.data_parallel > 1:
        allowed = [z for z in allowed if z > 0]
    return allowed, refused


def own_counts(setting: Setting, layout: Layout, cache: dict | None = None) -> list[int] | None:
    """Blocks per stage under the layout's pipeline_func (None when that function refuses this layout); a
    pipeline_func places blocks by the stage count (the seed's does), so that is the cache key."""
    key = ("own", layout.pipeline_stage, layout.pipeline_func)
    if cache is not None and key in cache:
        return cache[key]
    try:
        stages = assign_stages(setting.model, layout.parallel(), load_pipeline_func(layout.pipeline_func))
        counts = [stages.count(k) for k in range(layout.pipeline_stage)]
    except UserError:
        counts = None
    if cache is not None:
        cache[key] = counts
    return counts


def splits(ctx: Context, base: Layout) -> list[tuple[str, list[int]]]:
    """(pipeline_func, blocks per stage) to predict: the layout's own split and the min-max one when it differs."""
    n, pp = ctx.setting.model.num_blocks, base.pipeline_stage
    if pp == 1:
        return [("seed", [n])]
    out = []
    own = own_counts(ctx.setting, base, ctx.cache)
    if own is not None:
        out.append((base.pipeline_func, own))
    figs = layer_figures(ctx.setting.model, base.model_parallel, base.vocab_emb_dp, True)
    best = best_split(split_costs(ctx, base, figs), pp)
    if best is not None and best != own:
        out.append((pipeline_func_name(blocks_pipeline_func(best)), best))
    return out


def memory_bound_split(ctx: Context, layout: Layout) -> list[int] | None:
    """The min-max split among those whose every stage fits, or None (searched only for modest block counts: each
    (stage, blocks i..j-1) is a memory count of its own)."""
    from training.plan.layout_memory import stage_memory
    from training.plan.layout_prediction import parallel_of

    s, pp, n = ctx.setting, layout.pipeline_stage, ctx.setting.model.num_blocks
    if pp * (n + 1) ** 2 > SPLIT_SEARCH_LIMIT:
        return None
    figs = layer_figures(s.model, layout.model_parallel, layout.vocab_emb_dp, True)
    usable, parallel = usable_bytes(s), parallel_of(ctx, layout)

    def feasible(k, i, j):
        import numpy as np

        out = np.zeros(np.broadcast(i, j).shape, dtype=bool)
        for idx in np.ndindex(out.shape):
            a, b = int(np.broadcast_to(i, out.shape)[idx]), int(np.broadcast_to(j, out.shape)[idx])
            if a <= b:
                lo, hi = (0 if k == 0 else a + 1), (n + 2 if k == pp - 1 else b + 1)
                out[idx] = stage_memory(s, parallel, figs, lo, hi, k, ctx.cache)[0] <= usable
        return out

    return best_split(split_costs(ctx, layout, figs), pp, feasible)


def evaluate(ctx: Context, group: Group) -> tuple[list[Prediction], list[dict]]:
    """Every ZeRO stage × split of a group: the predictions that fit, and the rejections."""
    found, rejected = [], []
    allowed, refused = zero_stages(ctx.setting, group)
    for zero in refused:
        layout = group.base.with_(zero_stage=zero)
        rejected.append({"layout": layout, "reason": "; ".join(errors(layout, ctx.setting)), "kind": "deepspeed"})
    options = splits(ctx, group.base)
    for zero in allowed:
        fits = False
        for func, counts in options:
            pred = predict(
                ctx, group.base.with_(zero_stage=zero, pipeline_func=func), counts, usable_bytes(ctx.setting)
            )
            if pred.terms is not None:
                found.append(pred)
                fits = True
            else:
                rejected.append(
                    {
                        "layout": pred.layout,
                        "reason": memory_reason(ctx.setting, pred),
                        "kind": "memory",
                        "blocks_per_stage": counts,
                    }
                )
        if not fits and group.base.pipeline_stage > 1:
            counts = memory_bound_split(ctx, group.base.with_(zero_stage=zero))
            if counts is not None:
                func = pipeline_func_name(blocks_pipeline_func(counts))
                found.append(predict(ctx, group.base.with_(zero_stage=zero, pipeline_func=func), counts))
    return found, rejected


def rank_key(factors: dict):
    def key(p: Prediction):
        L = p.layout
        return (
            round(p.seconds(factors), 12),
            p.peak_bytes,
            L.pipeline_stage,
            L.model_parallel,
            L.micro_batch_num,
            L.zero_stage,
            L.recompute,
            L.interleave_num,
            not L.vocab_emb_dp,
            L.pipeline_func,
        )

    return key


def search(setting: Setting, factors: dict | None = None) -> SearchResult:
    """Every layout, predicted at `factors` (default: the priors), ranked."""
    started, cpu = time.perf_counter(), time.process_time()
    prior = sm.prior_for(setting)
    factors = dict(factors or default_factors(prior))
    ctx = Context(setting, prior, factors)
    groups, refused = enumerate_space(setting)
    rejected = [
        {"layout": lay, "reason": why, "kind": "nodes" if "spans nodes" in why else "rules"} for lay, why in refused
    ]
    candidates = []
    for group in groups:
        found, more = evaluate(ctx, group)
        candidates += found
        rejected += more
    candidates.sort(key=rank_key(factors))
    result = SearchResult(candidates, rejected, factors)
    result.recipe_own = recipe_layout(ctx)
    result.seconds, result.cpu_seconds = time.perf_counter() - started, time.process_time() - cpu
    return result


def default_factors(prior: sm.Prior) -> dict:
    return {f: (prior.overlap if f == "overlap" else 1.0) for f in sm.FACTORS}


def recipe_layout(ctx: Context) -> dict:
    """The recipe's own layout at this world: its prediction, or why it cannot run here."""
    s = ctx.setting
    p = s.cfg.parallel
    tp, pp = p.model_parallel, p.pipeline_stage
    dp = max(s.world // max(tp * pp, 1), 1)
    zero = p.zero_stage if p.zero_stage is not None else (1 if p.optimizer_shard else 0)
    layout = Layout(
        tp,
        pp,
        dp,
        zero,
        p.micro_batch_num,
        p.recompute,
        p.vocab_emb_dp,
        p.interleave_num,
        (p.pipeline_func or "seed") if pp > 1 else "seed",
    )
    problems = (
        errors(layout, s)
        if tp * pp * dp == s.world
        else [f"mp {tp} × pipeline_stage {pp} does not divide the world of {s.world} ranks"]
    )
    counts = own_counts(s, layout) if not problems else None
    if problems or counts is None:
        return {"layout": layout, "runs": False, "reason": "; ".join(problems) or "its pipeline_func refuses it"}
    pred = predict(ctx, layout, counts)
    fits = pred.peak_bytes <= usable_bytes(s)
    return {"layout": layout, "runs": fits, "prediction": pred, "reason": None if fits else memory_reason(s, pred)}
