"""Peak memory per rank of a searched layout's stage, counted exactly as plan.py counts it (training.plan.planner:
rank_memory on the DeepSpeed config train.py would generate, activations of model.costs times the micro-batches in
flight), from the per-layer parameters of training.plan.layer_figures instead of a model built per stage.
tests/test_layout_search.py compares the two on several layouts.
"""

from __future__ import annotations

from model.config import ParallelConfig
from model.costs import activation_bytes, in_flight
from training.plan.layer_figures import LayerFigures
from training.plan.search_setting import Setting


def ds_config(setting: Setting, parallel: ParallelConfig, n_params: int) -> dict:
    """The DeepSpeed config train.py would generate for a rank of `n_params` parameters."""
    from training.core.engine import deepspeed_config

    p = setting.cfg.parallel
    return deepspeed_config(
        parallel,
        setting.batch,
        p.precision,
        setting.cfg.optimization.clip_grad,
        n_params,
        p.deepspeed_overrides,
        p.deepspeed_config,
        device_type=setting.device_type,
    )


def _rank_bytes(
    setting: Setting, parallel: ParallelConfig, n_params: int, largest_block: int, activations: int, cache: dict
) -> tuple[int, dict]:
    # a rank's state and DeepSpeed buffers depend on dp, the ZeRO stage and whether it is pipelined (the
    # zero_optimization section), never on the micro-batches or tp: one count serves every layout that shares them
    canonical = ParallelConfig(
        data_parallel=parallel.data_parallel,
        pipeline_stage=min(parallel.pipeline_stage, 2),
        zero_stage=parallel.zero_stage,
        optimizer_shard=parallel.optimizer_shard,
        gradient_aggregation_group=parallel.gradient_aggregation_group,
    )
    key = ("rank", canonical, n_params, largest_block, activations)
    if key not in cache:
        from training.plan.stage_build import rank_memory

        ds_cfg = ds_config(setting, canonical, n_params)
        by_layer = {"encoder.0": largest_block} if largest_block else {}
        cache[key] = (
            rank_memory(n_params, by_layer, activations, canonical, ds_cfg, setting.precision)["total_bytes"],
            ds_cfg,
        )
    return cache[key]


def stage_memory(
    setting: Setting, parallel: ParallelConfig, figs: LayerFigures, lo: int, hi: int, stage: int, cache: dict
) -> tuple[int, dict, int]:
    """(the largest TP rank's peak bytes, rank 0's DeepSpeed config, the largest rank's parameters) of a stage
    holding layers lo..hi-1. `cache`: the search's, keyed by what each figure depends on."""
    micro = setting.batch // (parallel.data_parallel * parallel.micro_batch_num)
    flight = in_flight(parallel, stage)
    whole = (
        "peak",
        id(figs),
        lo,
        hi,
        flight,
        micro,
        parallel.recompute,
        parallel.data_parallel,
        parallel.zero_stage,
        parallel.pipeline_stage > 1,
    )
    if whole in cache:
        return cache[whole]
    shape = figs.composition(lo, hi)
    key = ("acts", parallel.model_parallel, parallel.recompute, shape, micro)
    if key not in cache:
        names = figs.names[lo:hi]
        recomputed = [n for n in names if n.startswith(("encoder.", "decoder."))] if parallel.recompute else []
        cache[key] = activation_bytes(setting.model, parallel, names, micro, setting.precision, recomputed)
    acts = cache[key]
    live = acts["per_micro_batch"] * flight + acts["recompute_transient"]
    peak, first_cfg, most = 0, None, 0
    for n, largest in figs.rank_params(lo, hi):
        total, ds_cfg = _rank_bytes(setting, parallel, n, largest, live, cache)
        peak, first_cfg, most = max(peak, total), first_cfg or ds_cfg, max(most, n)
    cache[whole] = (peak, first_cfg, most)
    return cache[whole]
