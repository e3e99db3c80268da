"""The model as a DeepSpeed PipelineModule whose stage split follows the blocks' placement (model.placement)."""
from __future__ import annotations

from typing import Callable, Optional

from deepspeed.pipe import LayerSpec, PipelineModule

from model.config import ModelConfig, ParallelConfig
from model.parallel.topology import ParallelContext, first_last_stage_group
from model.placement import layer_stages, place_blocks
from model.transformer import Head, TokenLoss, block_specs


def build_pipeline_module(model: ModelConfig, parallel: ParallelConfig, grid, seed: int,
                          pipeline_func: Optional[Callable] = None, dynamic_shape: bool = False):
    """The model as a DeepSpeed PipelineModule whose stage split follows `pipeline_func`, on `grid`.
    `dynamic_shape`: batches change shape from step to step (token batches, `--max_tokens`): DeepSpeed then sends
    the shapes with every activation instead of once."""
    ctx = ParallelContext.from_grid(grid)
    placements = place_blocks(model, parallel, pipeline_func)
    block_st = [p.pipeline_stage for p in placements]
    stages = layer_stages(model, parallel, block_st)
    specs = block_specs(model, parallel, ctx, seed, placements)
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
                                  loss_fn=TokenLoss(model, parallel.dp_mp_config, ctx), partition_method="uniform",
                                  dynamic_shape=dynamic_shape)
    module._grid = grid          # one grid for layers and engine (PipelineModule built its own copy of it)
    for p in module.parameters():   # PipelineModule resets ds_pipe_replicated on every parameter; the replica of a
        if getattr(p, "tied_to", None):   # tied weight is counted once (on its owner) in the gradient norm
            p.ds_pipe_replicated = True
    module.block_stages = block_st
    return module, ctx
