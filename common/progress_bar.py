"""The project's progress bar: tqdm, with a cleanup that survives a construction cut short.

A stop request while the data is prepared raises where the main thread is (training/run/stop_request.py), and
Ctrl-C raises KeyboardInterrupt anywhere: when that lands inside tqdm's constructor, between its `disable = False`
and its `pos`, the half-built bar is collected later and tqdm's `__del__` prints "Exception ignored ...
AttributeError: 'tqdm' object has no attribute 'pos'" with a traceback, beside the run's correct one-line stop
message. Landing after the constructor first drew the bar, it left that line open, and the stop message was glued
to it ("tokenizing big.tsv:   0%|  | 0.00/80.1k [00:00<?, ? pairs/s]stopped by SIGTERM ..."): the line is ended.
Every bar of the project is this class (tests/test_progress_bar.py checks both)."""

from __future__ import annotations

import contextlib

from tqdm import tqdm


class ProgressBar(tqdm):
    def __init__(self, *args, **kwargs):
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            drawn = hasattr(self, "sp") and not getattr(self, "disable", True)  # the first draw comes right after sp
            self.disable = True  # nothing more of this bar, from close() or __del__
            if drawn:
                with contextlib.suppress(Exception):
                    self.fp.write("\n")
                    self.fp.flush()
            raise

    def close(self) -> None:
        if not hasattr(self, "pos"):  # construction cut short: nothing drawn (tqdm's set of bars holds it weakly)
            self.disable = True
            return
        super().close()
