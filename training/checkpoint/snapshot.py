"""A background save's snapshot: the values it will write, copied into host buffers on the main thread before the
next optimizer step changes them (training.checkpoint.background writes them afterwards).

On a GPU the buffers are pinned, so each device→host copy runs asynchronously at full bus speed (from pageable memory
it is synchronous and slower) and one synchronisation at the end covers them all; pinning is costly, so pinned
buffers are kept for the next save. On a CPU there is no device copy: the snapshot is a plain copy, and its buffers
are freed with the snapshot (keeping them would hold a second copy of the state all the time, not only while a save
is written).
"""

from __future__ import annotations

import torch


class Staging:
    """Host buffers for one rank's snapshots, handed out in order: `copy(value)` for each value of a save,
    `finish()` once they are all queued."""

    def __init__(self):
        self.pinned = torch.cuda.is_available()
        self._kept: list[torch.Tensor] = []  # pinned buffers of the last save, reused in the same order
        self._next = 0
        self._queued = False

    def copy(self, value: torch.Tensor) -> torch.Tensor:
        """A host copy of `value` (any device), valid once `finish()` returned."""
        value = value.detach()
        buf = None
        if self.pinned and self._next < len(self._kept):
            kept = self._kept[self._next]
            if kept.shape == value.shape and kept.dtype == value.dtype:
                buf = kept
        if buf is None:
            buf = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=self.pinned)
            if self.pinned:
                self._kept[self._next : self._next + 1] = [buf]
        self._next += 1
        async_copy = self.pinned and value.device.type == "cuda"
        buf.copy_(value, non_blocking=async_copy)
        self._queued = self._queued or async_copy
        return buf

    def finish(self) -> None:
        """Wait for the queued device→host copies; the next save starts handing out buffers from the first again."""
        if self._queued:
            torch.cuda.current_stream().synchronize()
        del self._kept[self._next :]
        self._next, self._queued = 0, False
