"""Does a layout fit the device, and what to change when it does not: plan.py's memory verdict.

A rank's peak is counted by the cost model (`model.costs`: parameters, gradients and optimizer state, the
activations in flight, DeepSpeed's buffers — `rank_peak`); a stage fits when its largest rank's peak is at most
USABLE = 80% of the device's memory. The rest is for what the count leaves out: measured on a CPU the peak was 1.03 to
1.22 times the count (docs/memory.md: the backward pass's own temporaries, the allocator keeping freed memory), and a
GPU adds the CUDA context, cuBLAS and NCCL workspaces. For a stage that does not fit, `remedies` tries the changes a
user would make — recompute, a higher ZeRO stage, smaller micro-batches, more pipeline stages, more tensor
parallelism, alone and with recompute — re-plans each (the layout rules must still hold) and names those under which
every stage fits. How close the count comes to a measured run: docs/memory.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from common.errors import UserError
from model.config import ParallelConfig
from training.config.sections import TrainConfig

GIB = 2**30
# data-sheet memory of one GPU, GiB, by the name --device takes
DEVICE_MEMORY_GIB = {"h100": 80, "h200": 141, "a100": 80, "a100-40gb": 40, "v100": 32, "l40s": 48, "a10": 24, "l4": 24}
USABLE = 0.8  # 1 / 1.22, the largest measured / counted peak (docs/memory.md)


def device_bytes(device: str | None, device_memory: float | None) -> tuple[str, float]:
    """(a name for the report, the device's memory in bytes) from --device / --device_memory (GiB)."""
    if device_memory is not None:
        return (f"{device} " if device else "") + f"{device_memory:g} GiB (--device_memory)", device_memory * GIB
    name = (device or "h100").lower()
    if name not in DEVICE_MEMORY_GIB:
        raise UserError(
            f"--device {device}: unknown; known: {', '.join(DEVICE_MEMORY_GIB)} — or give its memory with "
            f"--device_memory GiB"
        )
    how = "--device" if device else "the default --device h100"
    return f"{name} {DEVICE_MEMORY_GIB[name]} GiB ({how})", DEVICE_MEMORY_GIB[name] * GIB


def verdict(stage_peaks: list[int], memory: float) -> list[dict]:
    usable = USABLE * memory
    return [
        {"stage": k, "peak_bytes": peak, "usable_bytes": int(usable), "fits": peak <= usable}
        for k, peak in enumerate(stage_peaks)
    ]


def _with(cfg: TrainConfig, **parallel) -> TrainConfig:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel))


def candidates(
    cfg: TrainConfig, world: int, parallel: ParallelConfig, blocks: int
) -> list[tuple[str, str, TrainConfig, int]]:
    """(kind of change, the flags to change, the changed config, the world it runs on), the least disruptive first;
    within a kind, the smallest change first. A ZeRO stage is offered only above the one DeepSpeed already runs
    (bf16 and fp16 run at least stage 1)."""
    from training.core.engine import optimizer_zero_stage  # (imports DeepSpeed: only when a stage does not fit)

    p, dp = cfg.parallel, parallel.data_parallel
    zero = optimizer_zero_stage(parallel, p.precision)
    out: list[tuple[str, str, TrainConfig, int]] = []
    if not p.recompute:
        out.append(("recompute", "--recompute 1", _with(cfg, recompute=True), world))
    for stage in (1, 2, 3):
        if stage > zero and dp > 1 and (stage == 1 or p.pipeline_stage == 1):
            out.append(("zero", f"--zero_stage {stage}", _with(cfg, zero_stage=stage), world))
    k = 2
    while p.micro_batch_num * k <= cfg.data.batch_size // dp:
        out.append(
            (
                "micro",
                f"--micro_batch_num {p.micro_batch_num * k}",
                _with(cfg, micro_batch_num=p.micro_batch_num * k),
                world,
            )
        )
        k *= 2
    if p.pipeline_stage * 2 <= blocks:
        if dp % 2 == 0:
            out.append(
                (
                    "pp",
                    f"--pipeline_stage {p.pipeline_stage * 2}",
                    _with(cfg, pipeline_stage=p.pipeline_stage * 2),
                    world,
                )
            )
        out.append(
            (
                "pp",
                f"--pipeline_stage {p.pipeline_stage * 2}",
                _with(cfg, pipeline_stage=p.pipeline_stage * 2),
                world * 2,
            )
        )
    if dp % 2 == 0:
        out.append(("mp", f"--mp {p.model_parallel * 2}", _with(cfg, model_parallel=p.model_parallel * 2), world))
    out.append(("mp", f"--mp {p.model_parallel * 2}", _with(cfg, model_parallel=p.model_parallel * 2), world * 2))
    if not p.recompute:  # recompute together with each of the others
        out += [
            (f"recompute+{kind}", f"--recompute 1 {flags}", _with(changed, recompute=True), w)
            for kind, flags, changed, w in out[1:]
        ]
    return out


def remedies(
    cfg: TrainConfig,
    world: int,
    parallel: ParallelConfig,
    blocks: int,
    memory: float,
    stage_peaks: Callable[[TrainConfig, int], list[int]],
    limit: int = 4,
) -> list[dict]:
    """The changes under which every stage fits (each re-planned with `stage_peaks(config, world)`), with the largest
    stage's peak: the smallest change of each kind, the least disruptive kinds first; empty when none is enough.
    Each: {"text", "flags", "world_size", "changes_gpu_count", "largest_stage_bytes"}; a change that needs more GPUs
    says so in its text ("needs 32 GPUs, not 16"), as a flag alone would not."""
    found, kinds, fitting = [], set(), set()
    for kind, flags, changed, w in candidates(cfg, world, parallel, blocks):
        if kind in kinds or (
            kind.startswith("recompute+") and ("recompute" in kinds or (flags[len("--recompute 1 ") :], w) in fitting)
        ):
            continue  # a smaller change of this kind already fits
        try:
            peaks = stage_peaks(changed, w)
        except UserError:  # the layout rules do not allow it (heads, batch, blocks)
            continue
        if max(peaks) <= USABLE * memory:
            kinds.add(kind)
            fitting.add((flags, w))
            gpus = f"needs {w} GPUs, not {world}: --world_size {w}; " if w != world else ""
            found.append(
                {
                    "text": f"{flags} ({gpus}largest stage {max(peaks) / GIB:.1f} GiB)",
                    "flags": flags,
                    "world_size": w,
                    "changes_gpu_count": w != world,
                    "largest_stage_bytes": max(peaks),
                }
            )
            if len(found) == limit:
                break
    return found
