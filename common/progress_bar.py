"""The project's progress bar: tqdm, with a cleanup that survives a construction cut short.

A stop request while the data is prepared raises where the main thread is (training/run/stop_request.py), and
Ctrl-C raises KeyboardInterrupt anywhere: when that lands inside tqdm's constructor, between its `disable = False`
and its `pos`, the half-built bar is collected later and tqdm's `__del__` prints "Exception ignored ...
AttributeError: 'tqdm' object has no attribute 'pos'" with a traceback, beside the run's correct one-line stop
message. Every bar of the project is this class (tests/test_progress_bar.py checks both)."""

from __future__ import annotations

from tqdm import tqdm


class ProgressBar(tqdm):
    def close(self) -> None:
        if not hasattr(self, "pos"):  # construction cut short: nothing drawn (tqdm's set of bars holds it weakly)
            self.disable = True
            return
        super().close()
