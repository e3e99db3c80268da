"""The project's progress bar: tqdm, with a constructor that cleans up after itself when it is cut short.

A stop request while the data is prepared raises where the main thread is (training/run/stop_request.py), and
Ctrl-C raises KeyboardInterrupt anywhere. Landing inside tqdm's constructor it left a half-built bar behind:
- between its `disable = False` and its `pos`, tqdm's `__del__` later printed "Exception ignored ...
  AttributeError: 'tqdm' object has no attribute 'pos'" with a traceback, beside the run's one-line stop message;
- after the first draw, the bar's line stayed open and the stop message was glued to it ("tokenizing big.tsv:
  0%|  | 0.00/80.1k [00:00<?, ? pairs/s]stopped by SIGTERM ...").
Here a cut construction disables the bar (tqdm's close() and `__del__` then do nothing) and ends a line already drawn.
Every bar of the project is this class (tests/test_progress_bar.py checks all three)."""

from __future__ import annotations

import contextlib

from tqdm import tqdm


class ProgressBar(tqdm):
    def __init__(self, *args, **kwargs):
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            drawn = hasattr(self, "sp") and not getattr(self, "disable", True)  # the first draw comes right after sp
            self.disable = True  # close() and __del__ then leave it alone (tqdm's set of bars holds it weakly)
            if drawn:
                with contextlib.suppress(Exception):
                    self.fp.write("\n")
                    self.fp.flush()
            raise
