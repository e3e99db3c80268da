"""What one rank (global rank 0) reports per optimizer step: the seed's loss line, a progress bar, TensorBoard,
and OUTPUT_DIR/metrics.jsonl (one JSON object per step: step, epoch, loss, lr, tokens, tokens_per_sec, step_time)."""
from __future__ import annotations

import json
import os
import sys
from typing import Optional

from tqdm import tqdm


class MetricsWriter:
    def __init__(self, output_dir: str, enabled: bool, total_steps: int, start_step: int = 0,
                 log_interval: int = 1, tensorboard: bool = True):
        self.enabled, self.log_interval = enabled, max(1, log_interval)
        self._jsonl = self._tb = self._bar = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        # append: a resumed run continues the same file (its steps carry on from the checkpoint's)
        self._jsonl = open(os.path.join(output_dir, "metrics.jsonl"), "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                         disable=None if sys.stderr.isatty() else True)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        step = record["step"]
        if self._tb is not None:
            for key in ("loss", "lr", "tokens_per_sec", "step_time"):
                self._tb.add_scalar(f"train/{key}", record[key], step)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_sec']:.0f}")
        if step % self.log_interval == 0:
            # the seed's LossMonitor/TimeMonitor line, plus throughput
            line = (f"epoch: {record['epoch'] + 1} step: {step}, loss is {record['loss']:.4f}, "
                    f"step time: {record['step_time'] * 1000:.1f} ms, tokens/s: {record['tokens_per_sec']:.0f}")
            (self._bar.write if self._bar is not None and not self._bar.disable else print)(line)
            sys.stdout.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def close(self, summary: Optional[dict] = None) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if summary:
            print("summary: " + json.dumps(summary), flush=True)
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
