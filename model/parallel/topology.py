"""Process groups for tensor (TP), data (DP) and pipeline (PP) parallelism, from DeepSpeed's grid.

One source of truth: the same `PipeModelDataParallelTopology` / `PipelineParallelGrid` that DeepSpeed's pipeline
engine uses. Ranks are laid out with TP fastest, then DP, then PP (rank = pp·dp·mp + dp_rank·mp + tp_rank), so a
TP group sits on consecutive ranks — inside one node on a real cluster. Layers never create groups; they read them
from the `ParallelContext` built here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from model.config import ParallelConfig


def make_topology(parallel: ParallelConfig) -> PipeModelDataParallelTopology:
    return PipeModelDataParallelTopology(
        num_pp=parallel.pipeline_stage, num_mp=parallel.model_parallel, num_dp=parallel.data_parallel
    )


@dataclass(frozen=True)
class RankCoord:
    rank: int
    pp: int
    dp: int
    tp: int


def rank_map(parallel: ParallelConfig) -> list[RankCoord]:
    """rank → (pp, dp, tp) for every rank; a pure function (no process group), used by plan and tests.
    The order of DeepSpeed's PipeModelDataParallelTopology (axes pipe, data, model: TP fastest), computed rather than
    looked up: its get_coord searches every rank, quadratic in the world (65,536 ranks took 41 s in plan.py).
    tests/test_plan.py checks the two agree."""
    tp, dp, pp = parallel.model_parallel, parallel.data_parallel, parallel.pipeline_stage
    return [
        RankCoord(rank=rank, pp=rank // (dp * tp), dp=rank // tp % dp, tp=rank % tp) for rank in range(pp * dp * tp)
    ]


@dataclass
class ParallelContext:
    """What a layer needs to know about its place in the grid. `tp_group` None means no communication."""

    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    dp_size: int = 1
    dp_rank: int = 0
    dp_group: Any = None
    pp_size: int = 1
    pp_rank: int = 0
    grid: Any | None = None

    @classmethod
    def serial(cls) -> ParallelContext:
        return cls()

    @classmethod
    def from_grid(cls, grid) -> ParallelContext:
        tp = grid.get_slice_parallel_world_size()
        return cls(
            tp_size=tp,
            tp_rank=grid.get_slice_parallel_rank(),
            tp_group=grid.get_slice_parallel_group() if tp > 1 else None,
            dp_size=grid.get_data_parallel_world_size(),
            dp_rank=grid.get_data_parallel_rank(),
            dp_group=grid.get_data_parallel_group(),
            pp_size=grid.get_pipe_parallel_world_size(),
            pp_rank=grid.get_stage_id(),
            grid=grid,
        )


def skip_shm_all_reduce() -> None:
    """DeepSpeed's comm backend, whenever it is created (init_distributed, or deepspeed.initialize on a process group
    made by torch), JIT-builds its CPU shared-memory all-reduce with a C++ compiler (minutes, once per machine, and a
    lock file that a killed build leaves makes the next one wait forever) — for a buffer training never uses."""
    import importlib

    # by module path: the package attribute `deepspeed.comm.torch` is the torch library itself
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def init_deepspeed_comm(backend: str = "gloo", timeout_s: float | None = None) -> None:
    """deepspeed.init_distributed without DeepSpeed's CPU shared-memory all-reduce.

    On CPU, DeepSpeed's comm backend maps a 66 MB /dev/shm buffer per rank, named after the master port, and never
    unlinks it: every run with a new port leaks world_size × 66 MB of RAM until the machine fills up and ranks hang.
    That buffer serves only `inference_all_reduce`, which training never calls, so we do not build it.

    `timeout_s`: how long any collective waits for its peers. The default group gets it from init_process_group;
    the groups DeepSpeed's grid creates later call `new_group` without a timeout, which takes torch's module
    defaults — `default_pg_timeout` for gloo and the others, `default_pg_nccl_timeout` for NCCL (10 minutes in
    torch 2.13; `distributed_c10d._get_default_timeout` picks one by backend) — so both are set.
    """
    import importlib
    from datetime import timedelta

    import deepspeed
    import deepspeed.comm as ds_dist

    if ds_dist.is_initialized():
        return
    skip_shm_all_reduce()
    kwargs = {}
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
        c10d = importlib.import_module("torch.distributed.distributed_c10d")
        c10d.default_pg_timeout = kwargs["timeout"]
        if getattr(c10d, "default_pg_nccl_timeout", None) is not None:  # None: a torch built without NCCL
            c10d.default_pg_nccl_timeout = kwargs["timeout"]
    deepspeed.init_distributed(dist_backend=backend, verbose=False, **kwargs)


def build_grid(parallel: ParallelConfig):
    """Create DeepSpeed's PipelineParallelGrid (collective: every rank must call it, in the same order)."""
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    return PipelineParallelGrid(topology=make_topology(parallel))


def build_context(parallel: ParallelConfig) -> ParallelContext:
    """The context for this process: serial when the layout is a single process, else from a fresh grid."""
    if parallel.world_size == 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            return ParallelContext.serial()
    return ParallelContext.from_grid(build_grid(parallel))


def first_last_stage_group(parallel: ParallelConfig, grid):
    """The group joining this rank with its counterpart on the other end of the pipeline (stage 0 ↔ the last
    stage, same data- and tensor-parallel coordinate), for a weight tied across them (shared embeddings); None on
    middle stages. Collective: every rank creates every pair's group, in the same order."""
    import torch.distributed as dist

    topo, last, mine = grid.topology(), parallel.pipeline_stage - 1, None
    for dp in range(parallel.data_parallel):
        for tp in range(parallel.model_parallel):
            ranks = [topo.get_rank(pipe=0, data=dp, model=tp), topo.get_rank(pipe=last, data=dp, model=tp)]
            group = dist.new_group(ranks=ranks)
            if dist.get_rank() in ranks:
                mine = group
    return mine
