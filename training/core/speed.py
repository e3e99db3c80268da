"""A step's speed figures for metrics.jsonl: achieved model FLOP/s, MFU where the device's peak is known, and
peak memory — all from the one cost model (`model.costs`)."""

from __future__ import annotations

import resource
import sys

import torch

from model.config import ModelConfig
from model.costs import model_flops, peak_flops


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


class SpeedMeter:
    """Per step: `tflops` (the model's FLOPs of the global batch / step time, all ranks together), `mfu` (that over
    world × the device's dense peak in this precision; only for devices in model.costs.PEAK_FLOPS — never
    guessed) and `peak_mem_mib` (this rank's peak: the accelerator's allocated memory, or on a CPU the process's
    resident set)."""

    def __init__(self, model_cfg: ModelConfig, world: int, precision: str, device: torch.device):
        self.model_cfg, self.world, self.device = model_cfg, world, device
        self.peak = peak_flops(device_name(device), precision)

    def peak_memory_mib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return kib / 1024 if sys.platform != "darwin" else kib / 2**20

    def figures(self, src_tokens: int, tgt_tokens: int, pairs: int, lengths: tuple[int, int], seconds: float) -> dict:
        flops = model_flops(self.model_cfg, src_tokens, tgt_tokens, pairs, *lengths)
        rate = flops / max(seconds, 1e-9)
        out: dict[str, float | None] = {"tflops": rate / 1e12}
        if self.peak is not None:
            out["mfu"] = rate / (self.world * self.peak)
        out["peak_mem_mib"] = round(self.peak_memory_mib(), 1)
        return out
