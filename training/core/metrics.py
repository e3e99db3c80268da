"""What one rank (global rank 0) reports per optimizer step: the seed's loss line (with the time left: ETA), a
progress bar, TensorBoard, and OUTPUT_DIR/metrics.jsonl (one JSON object per step: step, epoch (counted from 1, as
in the loss line), loss, lr, grad_norm (global, before clipping;
training only), loss_scale and skipped_steps (fp16), pairs (the global batch's sentence pairs: with token batches
they vary), tokens (the global batch's target tokens), tokens_per_sec,
step_time, padding (PAD share of the batch's positions), tflops (the model's FLOPs per second, all ranks), mfu
(where the device's peak is known), peak_mem_mib; see training/core/speed.py), and the experiment trackers chosen
(training/core/trackers.py: the same numbers, and run.json as their configuration)."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time

from common.errors import UserError, no_room_error
from common.progress_bar import ProgressBar
from common.staging import atomic_write
from training.core.trackers import Trackers, forget_earlier_runs


def _fmt(value) -> str:
    return "nan" if value is None else f"{value:.4f}"


def format_duration(seconds: float) -> str:
    """3725 → '1h02m', 192 → '3m12s', 7.4 → '7s'."""
    seconds = max(0, int(round(seconds)))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class MetricsWriter:
    def __init__(
        self,
        output_dir: str,
        enabled: bool,
        total_steps: int,
        start_step: int = 0,
        resumed: bool = False,
        log_interval: int = 1,
        tensorboard: bool = True,
        checkpoint_steps: int = 0,
        trackers: Trackers | None = None,
    ):
        self.enabled, self.log_interval, self.output_dir = enabled, max(1, log_interval), output_dir
        self.total_steps = total_steps
        self._jsonl = self._tb = self._bar = None
        self._trackers = trackers if enabled and trackers else None  # rank 0's alone: one tracker run per job
        self._clock: tuple[float, int] | None = None  # (when this run's first step began, the step before it)
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        # append: a resumed run continues the same file (its steps carry on from the checkpoint's), after dropping
        # the records of the steps it replays; TensorBoard hides those events itself (purge_step)
        path = os.path.join(output_dir, "metrics.jsonl")
        if not resumed:  # a fresh start (training.run.start_point decided it)
            forget_earlier_runs(output_dir)
            kept = keep_earlier_records(path)
            if kept:
                print(
                    f"{path} held the records of an earlier run with no checkpoint to continue; kept as {kept}",
                    flush=True,
                )
        else:
            if self._trackers is not None:
                self._trackers.resuming()
            dropped = drop_records_after(path, start_step)
            if dropped:
                print(
                    f"{path}: removed {dropped} records after step {start_step} (this run writes those steps again)",
                    flush=True,
                )
        self._path = path
        # unbuffered: one whole line per write call (see _append)
        self._jsonl = open(path, "ab", buffering=0)  # noqa: SIM115 - the run's log, open until close()
        if tensorboard:
            self._tb = TensorBoard(
                os.path.join(output_dir, "tensorboard"), purge_step=start_step + 1, flush_steps=checkpoint_steps
            )
        self._bar = ProgressBar(
            total=total_steps,
            initial=start_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=None if sys.stderr.isatty() else True,
        )

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        # strict JSON: a non-finite value (an fp16 overflow's grad norm) is written as null
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        step = record["step"]
        if self._clock is None:  # the first step of this run (a resume starts later)
            self._clock = (time.monotonic() - record.get("step_time", 0.0), step - 1)
        self._append(json.dumps(record, allow_nan=False) + "\n", step)
        if self._tb is not None:
            scalars = {f"train/{key}": record[key] for key in TRAIN_SCALARS if record.get(key) is not None}
            scalars.update(
                {
                    f"valid/{key[len('valid_') :]}": record[key]
                    for key in ("valid_loss", "valid_bleu")
                    if record.get(key) is not None
                }
            )
            self._tb.write(scalars, step)
        if self._trackers is not None:
            self._trackers.log(record)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=_fmt(record["loss"]), tok_s=f"{record['tokens_per_sec']:.0f}")
        if step % self.log_interval == 0 or "valid_loss" in record:
            # the seed's LossMonitor/TimeMonitor line, plus throughput (and every validation, whatever the interval)
            line = f"epoch: {record['epoch']} step: {step}, loss is {_fmt(record['loss'])}"
            if "grad_norm" in record:
                line += f", grad norm: {_fmt(record['grad_norm'])}"
            if "valid_loss" in record:
                line += (
                    f", valid loss: {_fmt(record['valid_loss'])} (best {_fmt(record['best_valid_loss'])} "
                    f"at step {record['best_step']})"
                )
            if "valid_bleu" in record:
                line += f", valid BLEU: {record['valid_bleu']:.2f}"
            if record.get("loss_scale") is not None:
                line += f", loss scale: {record['loss_scale']:g} (skipped steps: {record['skipped_steps']})"
            line += f", step time: {record['step_time'] * 1000:.1f} ms, tokens/s: {record['tokens_per_sec']:.0f}"
            if record.get("mfu") is not None:
                line += f", MFU: {100 * record['mfu']:.1f}%"
            line += f", ETA: {format_duration(self.eta_seconds(step))}"
            (self._bar.write if self._bar is not None and not self._bar.disable else print)(line)
            sys.stdout.flush()

    def eta_seconds(self, step: int) -> float:
        """Time left until the last step, at this run's mean wall-clock per step so far (validations and saves
        included, as they will recur)."""
        started, before = self._clock
        per_step = (time.monotonic() - started) / max(step - before, 1)
        return per_step * max(self.total_steps - step, 0)

    def _append(self, line: str, step: int) -> None:
        """Append one record whole or not at all: a write that runs out of room (a full disk, a quota, a file-size
        limit) is cut back to the end of the previous record, so the file never ends in half a line."""
        data = memoryview(line.encode())
        start = self._jsonl.seek(0, os.SEEK_END)
        try:
            while data:
                data = data[self._jsonl.write(data) :]
        except OSError as exc:
            self._jsonl.truncate(start)
            if no_room_error(exc) is None:
                raise
            raise UserError(
                f"writing {self._path} failed at step {step} ({exc.strerror}): the file ends with "
                f"step {step - 1}'s record, whole. Free space (or raise the file-size limit) and "
                f"continue with --resume from the last checkpoint"
            ) from None

    def run_info(self, info: dict) -> None:
        """OUTPUT_DIR/run.json: what this run is (layout, precision, optimizer DeepSpeed built, steps)."""
        if self.enabled:
            with atomic_write(os.path.join(self.output_dir, "run.json")) as f:
                json.dump(info, f, indent=1)
            if self._trackers is not None:
                self._trackers.run_record(info)

    def message(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def close(self, summary: dict | None = None, status: str = "finished") -> None:
        """status (the trackers' end of the run): finished, stopped (a stop request) or failed. A second call does
        nothing: the trainer closes on its error path too, whatever was closed before."""
        if not self.enabled or self._jsonl is None or self._jsonl.closed:
            return
        if self._bar is not None:
            self._bar.close()
        if summary:
            summary = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}
            print("summary: " + json.dumps(summary), flush=True)
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._trackers is not None:
            self._trackers.close(status)


TRAIN_SCALARS = (
    "loss",
    "lr",
    "grad_norm",
    "loss_scale",
    "tokens_per_sec",
    "step_time",
    "padding",
    "tflops",
    "mfu",
    "peak_mem_mib",
)


class TensorBoard:
    """TensorBoard's writer, which writes from a thread of its own: when that write runs out of room (a full disk,
    a quota, `ulimit -f`) the thread printed a traceback and the next call raised it again. Here such a failure
    ends the events with one line naming the folder, and training goes on (metrics.jsonl keeps every step, and its
    own write stops the run with a line if the disk stays full).

    Events are flushed to disk every `flush_secs` (FLUSH_SECS), at every multiple of `flush_steps` (the checkpoint
    interval: a resume starts there, and its events must be on disk) and at close, not at every step: a flush is a
    file write on rank 0 that the other ranks would wait for at the next collective. A crash therefore loses at most
    the last `flush_secs` of TensorBoard events; metrics.jsonl, written at every step, keeps every step."""

    FLUSH_SECS = 30.0

    def __init__(self, folder: str, purge_step: int, flush_secs: float = FLUSH_SECS, flush_steps: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        _quiet_tensorboard_threads()
        self.folder, self.flush_secs, self.flush_steps = folder, flush_secs, flush_steps
        self._writer = SummaryWriter(folder, purge_step=purge_step)
        self._flushed = time.monotonic()

    def write(self, scalars: dict, step: int) -> None:
        def add():
            for key, value in scalars.items():
                self._writer.add_scalar(key, value, step)
            now = time.monotonic()
            if now - self._flushed >= self.flush_secs or (self.flush_steps and step % self.flush_steps == 0):
                self._writer.flush()
                self._flushed = now

        self._guarded(step, add)

    def close(self) -> None:
        self._guarded(None, lambda: self._writer.close())

    def _guarded(self, step: int | None, call) -> None:
        if self._writer is None:
            return
        try:
            call()
        except Exception as exc:  # only a write that ran out of room is turned into a line
            full = no_room_error(exc)
            if full is None:
                raise
            self._writer = None
            at = f" at step {step}" if step is not None else ""
            print(
                f"warning: TensorBoard events into {self.folder} stopped{at} ({full.strerror}); training goes "
                f"on and metrics.jsonl keeps every step. Free space there (or use --tensorboard 0)",
                file=sys.stderr,
                flush=True,
            )


def _quiet_tensorboard_threads() -> None:
    """The event writer's thread re-raises what its write raised (threading's hook prints it), and the main thread
    is told again at its next call: that is where it is said (TensorBoard._guarded)."""
    if getattr(threading.excepthook, "tensorboard_quiet", False):
        return
    before = threading.excepthook

    def hook(args):
        if not (type(args.thread).__module__.startswith("tensorboard.") and no_room_error(args.exc_value)):
            before(args)

    hook.tensorboard_quiet = True
    threading.excepthook = hook


# ------------------------------------------------------------------------------------------------ metrics log
def keep_earlier_records(path: str) -> str | None:
    """A fresh start (step 0) into a folder whose metrics.jsonl holds records (a run that saved no checkpoint):
    move them beside as metrics.<n>.jsonl instead of deleting them; returns the new name, or None."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return None
    root, n = path[: -len(".jsonl")], 1
    while os.path.exists(f"{root}.{n}.jsonl"):
        n += 1
    os.replace(path, f"{root}.{n}.jsonl")
    return f"{root}.{n}.jsonl"


def drop_records_after(path: str, step: int) -> int:
    """Remove the records of steps after `step` (and any torn last line) from a metrics.jsonl; returns how many
    lines went. The file is rewritten atomically, so a crash now leaves the old or the new file."""
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    keep = []
    for line in lines:
        try:
            record = json.loads(line)
            if isinstance(record, dict) and int(record.get("step", 0)) <= step:
                keep.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, TypeError):
            pass  # a line a crash cut short
    dropped = len(lines) - len(keep)
    if dropped:
        with atomic_write(path) as f:
            f.writelines(keep)
    return dropped
