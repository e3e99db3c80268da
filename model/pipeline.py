"""Blocks → pipeline stages with the seed's `pipeline_func`, and the model as a DeepSpeed PipelineModule.

The seed places each Transformer block with a lambda

    pipeline_func(network, layer_id, offset, parallel_config, layers)

that sets `network.pipeline_stage` (encoder blocks: offset 0; decoder blocks: offset = encoder layers; `layers` is
the number of blocks). We call it the same way on a placeholder per block *before* building anything, so only the
blocks of this rank's stage are ever constructed (DeepSpeed LayerSpecs). Embeddings always sit on stage 0, the head
and the loss on the last stage. A recipe may name its own function (`module:function`); the seed's own lambda,
including its `set_comm_fusion` call, runs unchanged.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Optional

from model.config import ConfigError, ModelConfig, ParallelConfig


@dataclass
class BlockPlacement:
    """What `pipeline_func` receives as `network`: it sets `pipeline_stage` (and may call set_comm_fusion)."""
    kind: str
    layer_id: int
    pipeline_stage: int = 0
    comm_fusion: Optional[int] = None

    def set_comm_fusion(self, group: int) -> None:
        self.comm_fusion = group


def default_pipeline_func(network, layer_id, offset, parallel_config, layers):
    """Even split by block index, as the seed's default: block k of n goes to stage ⌊k·pp/n⌋."""
    network.pipeline_stage = (layer_id + offset) * parallel_config.pipeline_stage // layers


def load_pipeline_func(spec: Optional[str]) -> Callable:
    """'module.path:function' → the function; None → the default even split."""
    if not spec:
        return default_pipeline_func
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"pipeline_func={spec!r} cannot be loaded ({exc}); give it as 'package.module:function'")


def assign_stages(model: ModelConfig, parallel: ParallelConfig, pipeline_func: Optional[Callable] = None) -> list[int]:
    """Stage of each block (encoder blocks then decoder blocks), checked to be a valid pipeline."""
    func = pipeline_func or default_pipeline_func
    n, pp = model.num_blocks, parallel.pipeline_stage
    stages = []
    for kind, count, offset in (("encoder", model.encoder_layers, 0), ("decoder", model.decoder_layers,
                                                                        model.encoder_layers)):
        for layer_id in range(count):
            placement = BlockPlacement(kind, layer_id)
            func(placement, layer_id, offset, parallel, n)
            stages.append(int(placement.pipeline_stage))
    desc = f"pipeline_func placed blocks (encoder…decoder) on stages {stages} with pipeline_stage={pp}"
    if any(s < 0 or s >= pp for s in stages):
        raise ConfigError(f"{desc}: every stage must be in 0..{pp - 1}")
    if any(b < a for a, b in zip(stages, stages[1:])):
        raise ConfigError(f"{desc}: stages must not decrease from one block to the next")
    # Embeddings are on stage 0 and the head on the last: those stages are never empty.
    empty = [s for s in range(1, pp - 1) if s not in stages]
    if empty:
        raise ConfigError(f"{desc}: stage(s) {empty} hold no block")
    return stages


def layer_stages(model: ModelConfig, parallel: ParallelConfig, block_stages: list[int]) -> list[int]:
    """Stage of every pipeline layer: [Embeddings] + blocks + [Head]."""
    return [0] + list(block_stages) + [parallel.pipeline_stage - 1]


def build_pipeline_module(model: ModelConfig, parallel: ParallelConfig, grid, seed: int,
                          pipeline_func: Optional[Callable] = None):
    """The model as a DeepSpeed PipelineModule whose stage split follows `pipeline_func`, on `grid`."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    from model.topology import ParallelContext, first_last_stage_group
    from model.transformer import Head, TokenLoss, block_specs

    ctx = ParallelContext.from_grid(grid)
    block_st = assign_stages(model, parallel, pipeline_func)
    stages = layer_stages(model, parallel, block_st)
    specs = block_specs(model, parallel, ctx, seed, block_st[model.encoder_layers:])
    bounds = [stages.index(s) for s in range(parallel.pipeline_stage)] + [len(stages)]   # every stage non-empty

    tie_group = first_last_stage_group(parallel, grid) if model.share_embeddings else None

    class StagedPipelineModule(PipelineModule):
        def _partition_layers(self, method="uniform"):
            self.parts = bounds
            stage_id = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

        def get_tied_weights_and_groups(self):
            """DeepSpeed sums these weights' gradients over their group before the optimizer step (for every
            optimizer it builds). Ours: the shared word table on stage 0 and its replica in the last stage's Head
            — identical from the start, so they stay identical."""
            tied = super().get_tied_weights_and_groups()
            if tie_group is not None:
                tied += [(p, tie_group) for name, p in self.named_parameters()
                         if getattr(p, "tied_to", None) or "blocks." + name == Head.TIED_TO]
            return tied

    module = StagedPipelineModule(layers=[LayerSpec(cls, **kw) for cls, kw in specs], topology=grid.topology(),
                                  loss_fn=TokenLoss(model, ctx), partition_method="uniform")
    module._grid = grid          # one grid for layers and engine (PipelineModule built its own copy of it)
    for p in module.parameters():   # PipelineModule resets ds_pipe_replicated on every parameter; the replica of a
        if getattr(p, "tied_to", None):   # tied weight is counted once (on its owner) in the gradient norm
            p.ds_pipe_replicated = True
    module.block_stages = block_st
    return module, ctx
