"""The model as a DeepSpeed PipelineModule whose stage split follows the blocks' placement (model.placement).

What crosses a stage boundary is one floating-point tensor and the token ids behind it: the two hidden tensors a
stage hands on — (src_h, tgt_h) inside the encoder, (tgt_h, memory) after it, each [B, L, d] — concatenated along
the sequence into one [B, S+T, d] (`join_boundary`), which the next stage splits again (`split_boundary`). DeepSpeed's
pipeline engine splits only the first tensor of a stage's output over the tensor-parallel ranks on the wire
(`pipe_partitioned`, `grad_partitioned`: each TP rank sends 1/tp of it, and the receiving stage all-gathers it) and
requires every other tensor to carry no gradient, so with two hidden tensors each TP rank had to send its full
replicated copy of both (training.core.engine)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from deepspeed.pipe import LayerSpec, PipelineModule

from model.config import ModelConfig, ParallelConfig
from model.parallel.topology import ParallelContext, first_last_stage_group
from model.placement import layer_stages, place_blocks
from model.transformer import DecoderLayer, EncoderLayer, Head, TokenLoss, block_specs


def join_boundary(outputs: tuple) -> tuple:
    """A stage's output as it crosses to the next stage: its two hidden tensors [B, L1, d], [B, L2, d] as one
    [B, L1+L2, d], the ids behind it. An output with one floating-point tensor ((x, tgt_ids) before the Head) is
    unchanged."""
    if not isinstance(outputs, tuple) or sum(t.is_floating_point() for t in outputs) < 2:
        return outputs
    first, second, *ids = outputs
    return (torch.cat([first, second], dim=1), *ids)


def split_boundary(inputs: tuple, first_layer: type) -> tuple:
    """`join_boundary`'s inverse on the receiving stage, whose first layer says what the joined tensor holds: an
    encoder layer takes (src_h, tgt_h, src_ids, tgt_ids), a decoder layer (tgt_h, memory, src_ids, tgt_ids); the
    Head takes (x, tgt_ids) as it came. The halves are views of the received tensor, so its gradient is the two
    halves' gradients side by side."""
    if first_layer not in (EncoderLayer, DecoderLayer):
        return inputs
    joined, src_ids, tgt_ids = inputs
    length = (src_ids if first_layer is EncoderLayer else tgt_ids).shape[1]
    first, second = joined.split([length, joined.shape[1] - length], dim=1)
    return first, second, src_ids, tgt_ids


def build_pipeline_module(
    model: ModelConfig, parallel: ParallelConfig, grid, seed: int, pipeline_func: Callable | None = None
):
    """The model as a DeepSpeed PipelineModule whose stage split follows `pipeline_func`, on `grid`. Batches whose
    shape changes between steps (token batches) are announced by training.core.engine.Engine.expect_shape."""
    ctx = ParallelContext.from_grid(grid)
    placements = place_blocks(model, parallel, pipeline_func)
    block_st = [p.pipeline_stage for p in placements]
    stages = layer_stages(model, parallel, block_st)
    specs = block_specs(model, parallel, ctx, seed, placements)
    bounds = [stages.index(s) for s in range(parallel.pipeline_stage)] + [len(stages)]  # every stage non-empty

    tie_group = first_last_stage_group(parallel, grid) if model.share_embeddings else None

    class StagedPipelineModule(PipelineModule):
        def _partition_layers(self, method="uniform"):
            self.parts = bounds
            stage_id = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

        pending: deque = deque()

        def expect_packings(self, packings: list) -> None:
            """The coming micro-batches' (source, target) packings, in order, built on the host
            (training.core.data.StepBatches.packings). DeepSpeed hands this stage copies of the ids (the first
            stage's inputs cloned, the others' received), so each forward puts its micro-batch's packings on the
            ids it gets; every stage runs its forwards in micro-batch order (1F1B and inference schedules)."""
            self.pending = deque(packings)

        def forward(self, inputs):
            """This stage's layers, between the boundary format of the stages before and after it."""
            if self.stage_id > 0:
                inputs = split_boundary(inputs, specs[bounds[self.stage_id]][0])
            if self.pending:
                ids = [t for t in inputs if not t.is_floating_point()]  # (src_ids, tgt_ids), or (tgt_ids,)
                for t, pack in zip(ids, self.pending.popleft()[-len(ids) :]):
                    if (pack.batch, pack.length) != tuple(t.shape):  # never another micro-batch's packing
                        raise RuntimeError(f"packing of a {pack.batch}×{pack.length} batch for ids {tuple(t.shape)}")
                    pack.keep_on(t, model.pad_id)
            outputs = super().forward(inputs)
            return join_boundary(outputs) if self.stage_id < parallel.pipeline_stage - 1 else outputs

        def get_tied_weights_and_groups(self):
            """DeepSpeed sums these weights' gradients over their group before the optimizer step (for every
            optimizer it builds). Ours: the shared word table on stage 0 and its replica in the last stage's Head
            — identical from the start, so they stay identical."""
            tied = super().get_tied_weights_and_groups()
            if tie_group is not None:
                tied += [
                    (p, tie_group)
                    for name, p in self.named_parameters()
                    if getattr(p, "tied_to", None) or "blocks." + name == Head.TIED_TO
                ]
            return tied

    module = StagedPipelineModule(
        layers=[LayerSpec(cls, **kw) for cls, kw in specs],
        topology=grid.topology(),
        loss_fn=TokenLoss(model, parallel.dp_mp_config, ctx),
        partition_method="uniform",
    )
    module._grid = grid  # one grid for layers and engine (PipelineModule built its own copy of it)
    for p in module.parameters():  # PipelineModule resets ds_pipe_replicated on every parameter; the replica of a
        if getattr(p, "tied_to", None):  # tied weight is counted once (on its owner) in the gradient norm
            p.ds_pipe_replicated = True
    module.block_stages = block_st
    return module, ctx
