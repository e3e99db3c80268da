"""The blocks one rank of a layout builds, counted on torch's `meta` device, and the bytes a rank holds.

Shared by the one-layout plan (`training.plan.planner`) and the layout search (`training.plan.layer_figures`,
`training.plan.layout_memory`), which sit below the planner.
"""

from __future__ import annotations

from collections.abc import Sequence

from model.config import ModelConfig, ParallelConfig
from model.costs import deepspeed_buffer_bytes, rank_peak, state_bytes
from model.placement import assign_stages, layer_stages, place_blocks


def layer_names(model: ModelConfig) -> list[str]:
    """Names of the pipeline layers in order: embeddings, encoder.i, decoder.i, head."""
    return (
        ["embeddings"]
        + [f"encoder.{i}" for i in range(model.encoder_layers)]
        + [f"decoder.{i}" for i in range(model.decoder_layers)]
        + ["head"]
    )


def stage_layers(model: ModelConfig, parallel: ParallelConfig, pipeline_func=None) -> list[list[int]]:
    """Indices (into layer_names) of the layers each stage holds, from the recipe's pipeline_func."""
    per_stage: list[list[int]] = [[] for _ in range(parallel.pipeline_stage)]
    for i, k in enumerate(layer_stages(model, parallel, assign_stages(model, parallel, pipeline_func))):
        per_stage[k].append(i)  # one pass: a scan per stage was stages × layers
    return per_stage


def stage_specs(
    model: ModelConfig, parallel: ParallelConfig, stage: int, tp_rank: int, pipeline_func=None, seed: int = 0
) -> list[tuple[str, type, dict]]:
    """(layer name, class, arguments) of every layer one rank of (stage, tp_rank) builds, with a ParallelContext
    and no process group."""
    from model.parallel.topology import ParallelContext
    from model.transformer import block_specs

    placements = place_blocks(model, parallel, pipeline_func)
    stages = layer_stages(model, parallel, [p.pipeline_stage for p in placements])
    ctx = ParallelContext(
        tp_size=parallel.model_parallel, tp_rank=tp_rank, tp_group=None, pp_size=parallel.pipeline_stage, pp_rank=stage
    )
    specs = block_specs(model, parallel, ctx, seed, placements)
    return [(name, cls, kw) for name, (cls, kw), s in zip(layer_names(model), specs, stages, strict=True) if s == stage]


def build_stage_modules(
    model: ModelConfig,
    parallel: ParallelConfig,
    stage: int,
    tp_rank: int,
    pipeline_func=None,
    seed: int = 0,
    device: str = "meta",
) -> list[tuple[str, object]]:
    """The modules one rank of (stage, tp_rank) builds, with a ParallelContext and no process group.

    `device="meta"` gives real shapes without allocating or initialising weights."""
    import torch

    with torch.device(device):
        return [
            (name, cls(**kw)) for name, cls, kw in stage_specs(model, parallel, stage, tp_rank, pipeline_func, seed)
        ]


def count_params(modules: Sequence[tuple[str, object]]) -> dict[str, int]:
    return {name: sum(p.numel() for p in m.parameters()) for name, m in modules}


def _shape_key(name: str, model: ModelConfig, kw: dict) -> tuple:
    """What a block's parameter shapes can depend on: its kind and arguments, its index only as first, last or in
    between (the index seeds the block's generator, and the last block of a stack carries its final LayerNorm)."""
    kind = name.partition(".")[0]
    index = kw.get("index")
    count = model.encoder_layers if kind == "encoder" else model.decoder_layers
    where = None if index is None else (index == 0, index == count - 1)
    return kind, where, tuple(sorted((key, repr(value)) for key, value in kw.items() if key != "index"))


def stage_param_counts(
    model: ModelConfig, parallel: ParallelConfig, stage: int, tp_rank: int, pipeline_func=None, seed: int = 0
) -> dict[str, int]:
    """count_params(build_stage_modules(...)), building one block of each shape: a deep stack's blocks share a
    handful of shapes, and building every one on the meta device (its weights' initialisation traced) was most of
    the 37 s of CPU a 1,000 + 1,000-layer plan took (6 s now, imports included)."""
    import torch

    counts, by_shape = {}, {}
    with torch.device("meta"):
        for name, cls, kw in stage_specs(model, parallel, stage, tp_rank, pipeline_func, seed):
            key = _shape_key(name, model, kw)
            if key not in by_shape:
                by_shape[key] = sum(p.numel() for p in cls(**kw).parameters())
            counts[name] = by_shape[key]
    return counts


def rank_memory(
    n_params: int, by_layer: dict, activations: int, parallel: ParallelConfig, ds_cfg: dict, precision: str
) -> dict:
    """One rank's bytes: params / grads / optimizer state (ZeRO as DeepSpeed runs it), activations, DeepSpeed's
    buffers, and its peak (model.costs.rank_peak)."""
    zero_cfg = ds_cfg["zero_optimization"]
    zero = zero_cfg["stage"]  # what DeepSpeed runs (half precision: at least 1)
    state = state_bytes(n_params, parallel.data_parallel, zero, precision)
    blocks = [n for name, n in by_layer.items() if name.startswith(("encoder.", "decoder."))]
    buffers = deepspeed_buffer_bytes(
        n_params,
        parallel.data_parallel,
        zero,
        precision,
        int(zero_cfg.get("reduce_bucket_size", 5e8)),
        bool(zero_cfg.get("overlap_comm", False)),
        max(blocks, default=0),
        contiguous_gradients=bool(zero_cfg.get("contiguous_gradients", False)),
    )
    return {
        **state,
        "state_bytes": state["total_bytes"],
        "activation_bytes": activations,
        "buffer_bytes": buffers["during_backward"] + buffers["after_backward"],
        "buffers": buffers,
        "total_bytes": rank_peak(state["total_bytes"], activations, buffers),
    }
