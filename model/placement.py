"""Blocks → pipeline stages: the seed's `pipeline_func` called on one `BlockPlacement` per block.

The rules only: this module imports nothing of model/ but its config, so the Transformer (which asks which blocks
to recompute) and the pipeline builder (which asks which stage holds each block) both import it.

The seed places each Transformer block with a function

    pipeline_func(network, layer_id, offset, parallel_config, layers)

(encoder blocks: offset 0; decoder blocks: offset = encoder layers; `layers` = encoder + decoder layers). We call it
the same way, *before* building anything, on a `BlockPlacement` per block, so only the blocks of this rank's stage
are ever constructed (DeepSpeed LayerSpecs). Embeddings always sit on stage 0, the head and the loss on the last
stage. What the function may do with `network`, as the seed's lambdas do:

    network.pipeline_stage = k      the block's stage, an int in 0..pipeline_stage-1, not decreasing block to block
    network.recompute()             activation checkpointing of this block only (exact:
    model.parallel.random.checkpoint)
    network.set_comm_fusion(k)      the seed's gradient fusion id: recorded and printed per block by plan.py

Fusion ids are reported, not used to group gradient reductions: they only decide how many all-reduce calls
MindSpore makes (the sum is the same), and DeepSpeed already fuses gradients into buckets — ZeRO 0's buffered
all-reduce, ZeRO 1/2's reduce buckets — which training.core.engine sizes from the same `gradient_aggregation_group`
the seed's default lambda derives its ids from (≈ that many equal groups). Grouping by id would replace
DeepSpeed's reduction code for a performance hint; the plan shows the ids so a recipe can be compared with the seed.

Built-in functions, by name (`--pipeline_func seed|even`, or "package.module:function"):
    seed (default)  MindSpore's default layer lambda: block i (with offset) on stage
                    min((i + offset) // max(layers // pipeline_stage, 1), pipeline_stage - 1); fusion id
                    (i + offset) // max(layers // gradient_aggregation_group, 1) + 1; recompute() when
                    parallel_config.recompute. Uneven splits put the remainder on the last stage.
    even            the same, with stage ⌊(i + offset) · pipeline_stage / layers⌋ (remainder spread out).
    blocks:N0,N1,…  N0 blocks (encoder then decoder order) on stage 0, N1 on stage 1, …: any split as a recipe
                    value, no code of one's own (what `plan.py --search` writes for the splits it finds); fusion
                    ids and recompute as the seed's.
With pipeline_stage 1 there is no pipeline and the stage a function sets is not used (the tutorial's own lambda
puts every block on stage ≥ 1); recompute and fusion ids still apply.
"""

from __future__ import annotations

import bisect
import dataclasses
import importlib
import itertools
import numbers
from collections.abc import Callable
from dataclasses import dataclass

from model.config import ConfigError, ModelConfig, ParallelConfig


@dataclass
class BlockPlacement:
    """What `pipeline_func` receives as `network` for one block, and what it decided."""

    kind: str  # "encoder" | "decoder"
    layer_id: int
    pipeline_stage: int = 0
    comm_fusion: int | None = None
    recomputed: bool = False

    @property
    def name(self) -> str:
        return f"{self.kind}.{self.layer_id}"

    def recompute(self) -> None:
        """The seed's `Cell.recompute()`: rebuild this block's activations in backward instead of keeping them."""
        self.recomputed = True

    def set_comm_fusion(self, fusion_id: int) -> None:
        self.comm_fusion = fusion_id


def _seed_fusion_and_recompute(network, layer_id, offset, parallel_config, layers) -> None:
    """The part of MindSpore's default lambda after the stage: gradient fusion id and recompute."""
    dis = max(layers // parallel_config.gradient_aggregation_group, 1)
    network.set_comm_fusion((layer_id + offset) // dis + 1)
    if parallel_config.recompute:
        network.recompute()


def seed_pipeline_func(network, layer_id, offset, parallel_config, layers):
    """MindSpore's default layer lambda: equal runs of max(layers // pp, 1) blocks, the remainder on the last stage."""
    pp = parallel_config.pipeline_stage
    network.pipeline_stage = min((layer_id + offset) // max(layers // pp, 1), pp - 1)
    _seed_fusion_and_recompute(network, layer_id, offset, parallel_config, layers)


def even_pipeline_func(network, layer_id, offset, parallel_config, layers):
    """Block k of n on stage ⌊k·pp/n⌋: stage sizes differ by at most one block."""
    network.pipeline_stage = (layer_id + offset) * parallel_config.pipeline_stage // layers
    _seed_fusion_and_recompute(network, layer_id, offset, parallel_config, layers)


BUILTIN_PIPELINE_FUNCS = {"seed": seed_pipeline_func, "even": even_pipeline_func}
DEFAULT_PIPELINE_FUNC = "seed"
BLOCKS_PREFIX = "blocks:"  # blocks:N0,N1,...: N_k blocks on stage k


def blocks_pipeline_func(counts: list[int]) -> Callable:
    """The split `blocks:N0,N1,...` names: the first N0 blocks on stage 0, the next N1 on stage 1, and so on. The
    function carries its spec (`pipeline_func_name`), so a plan or a written recipe names it the same way."""
    spec = BLOCKS_PREFIX + ",".join(str(c) for c in counts)
    bounds = list(itertools.accumulate(counts))

    def blocks_per_stage(network, layer_id, offset, parallel_config, layers):
        pp = parallel_config.pipeline_stage
        if pp > 1 and (len(counts) != pp or bounds[-1] != layers):
            raise ValueError(
                f"{spec} places {bounds[-1]} blocks on {len(counts)} stages, but the model has {layers} "
                f"blocks on pipeline_stage={pp}: give {pp} counts that add up to {layers}"
            )
        network.pipeline_stage = bisect.bisect_right(bounds, layer_id + offset) if pp > 1 else 0
        _seed_fusion_and_recompute(network, layer_id, offset, parallel_config, layers)

    blocks_per_stage.spec = spec
    return blocks_per_stage


def _parse_blocks(spec: str) -> Callable:
    counts = spec[len(BLOCKS_PREFIX) :].split(",")
    if not all(c.strip().isdigit() for c in counts) or any(int(c) < 0 for c in counts):
        raise ConfigError(
            f"pipeline_func={spec!r}: give the blocks on each stage as non-negative integers, e.g. "
            f"{BLOCKS_PREFIX}3,5,4 for 12 blocks on 3 stages"
        )
    return blocks_pipeline_func([int(c) for c in counts])


def load_pipeline_func(spec: str | None) -> Callable:
    """'seed' | 'even' | 'blocks:N0,N1,...' | 'module.path:function' → the function; None → the seed's default
    split."""
    spec = spec or DEFAULT_PIPELINE_FUNC
    if spec in BUILTIN_PIPELINE_FUNCS:
        return BUILTIN_PIPELINE_FUNCS[spec]
    if spec.startswith(BLOCKS_PREFIX):
        return _parse_blocks(spec)
    module, colon, name = spec.partition(":")
    if not colon:
        raise ConfigError(
            f"pipeline_func={spec!r} is neither a built-in ({', '.join(BUILTIN_PIPELINE_FUNCS)}), "
            f"nor {BLOCKS_PREFIX}N0,N1,... nor 'package.module:function'"
        )
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(
            f"pipeline_func={spec!r} cannot be loaded ({exc}); give it as 'package.module:function' "
            f"importable by every rank (its folder on PYTHONPATH: run.sh and run_cluster.sh put the "
            f"checkout there)"
        ) from exc


def pipeline_func_name(func: Callable | None) -> str:
    """'seed' / 'even' for the built-ins, 'blocks:N0,...' for a split, else 'module:function' (how a recipe names
    it)."""
    func = func or BUILTIN_PIPELINE_FUNCS[DEFAULT_PIPELINE_FUNC]
    if isinstance(getattr(func, "spec", None), str):
        return func.spec
    for name, builtin in BUILTIN_PIPELINE_FUNCS.items():
        if func is builtin:
            return name
    return f"{getattr(func, '__module__', '?')}:{getattr(func, '__qualname__', repr(func))}"


def place_blocks(
    model: ModelConfig, parallel: ParallelConfig, pipeline_func: Callable | None = None
) -> list[BlockPlacement]:
    """Call `pipeline_func` on every block (encoder blocks, then decoder blocks) and check the pipeline it gives."""
    func = pipeline_func or BUILTIN_PIPELINE_FUNCS[DEFAULT_PIPELINE_FUNC]
    fname = pipeline_func_name(func)
    n, pp = model.num_blocks, parallel.pipeline_stage
    placements = []
    for kind, count, offset in (
        ("encoder", model.encoder_layers, 0),
        ("decoder", model.decoder_layers, model.encoder_layers),
    ):
        for layer_id in range(count):
            placement = BlockPlacement(kind, layer_id)
            where = f"block {placement.name} (layer_id={layer_id}, offset={offset}, layers={n})"
            try:
                func(placement, layer_id, offset, parallel, n)
            except Exception as exc:  # the user's code: one line naming it and the block, no traceback
                detail = " ".join(str(exc).split())
                raise ConfigError(f"pipeline_func {fname} raised {type(exc).__name__}: {detail} — at {where}") from exc
            stage = placement.pipeline_stage
            if not isinstance(stage, numbers.Integral) or isinstance(stage, bool):
                raise ConfigError(
                    f"pipeline_func {fname} set pipeline_stage={stage!r} ({type(stage).__name__}) "
                    f"at {where}: it must be an int"
                )
            placement.pipeline_stage = int(stage) if pp > 1 else 0  # one stage: nothing to place
            placements.append(placement)
    stages = [p.pipeline_stage for p in placements]
    desc = f"pipeline_func {fname} placed blocks (encoder…decoder) on stages {stages} with pipeline_stage={pp}"
    bad = [p for p in placements if not 0 <= p.pipeline_stage < pp]
    if bad:
        raise ConfigError(f"{desc}: every stage must be in 0..{pp - 1} ({bad[0].name} is on {bad[0].pipeline_stage})")
    down = [(a, b) for a, b in zip(placements, placements[1:]) if b.pipeline_stage < a.pipeline_stage]
    if down:
        a, b = down[0]
        raise ConfigError(
            f"{desc}: stages must not decrease from one block to the next ({b.name} on "
            f"{b.pipeline_stage} after {a.name} on {a.pipeline_stage})"
        )
    # Embeddings are on stage 0 and the head on the last: those stages are never empty.
    used = set(stages)  # a set: `in` on the list was a scan of every block per stage
    empty = [s for s in range(1, pp - 1) if s not in used]
    if empty:
        raise ConfigError(f"{desc}: stage(s) {empty} hold no block")
    return placements


def assign_stages(model: ModelConfig, parallel: ParallelConfig, pipeline_func: Callable | None = None) -> list[int]:
    """Stage of each block (encoder blocks then decoder blocks), checked to be a valid pipeline."""
    return [p.pipeline_stage for p in place_blocks(model, parallel, pipeline_func)]


def in_one_process(placements: list[BlockPlacement]) -> list[BlockPlacement]:
    """The same decisions with every block on stage 0 (the whole model in one process)."""
    return [dataclasses.replace(p, pipeline_stage=0) for p in placements]


def layer_stages(model: ModelConfig, parallel: ParallelConfig, block_stages: list[int]) -> list[int]:
    """Stage of every pipeline layer: [Embeddings] + blocks + [Head]."""
    return [0] + list(block_stages) + [parallel.pipeline_stage - 1]
