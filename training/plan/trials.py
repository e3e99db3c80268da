"""`plan.py --search --trials K`: which K layouts to run, running them, and what they measured.

The trials are the best-ranked layouts, but chosen so that the calibration can be fitted: the first is the top
layout, each next one the layout among the top few that adds the most information about the factors — the largest
zᵀA⁻¹z, z its seconds per factor over its predicted step (relative, as the fit weighs errors), A the information of
those chosen so far plus the fit's pull to the prior (a greedy D-optimal design). Three trials of near-identical
layouts would leave every factor but one at its prior.

Each trial is a recipe written by training.plan.recipe_writer and launched through its run.sh — run_scripts/run.sh,
or run_cluster.sh with the hostfile — for S steps on the ranks at hand, the way a user launches it; its step time
is the median of metrics.jsonl's step_time after the first steps (start-up, the first batches' shapes), its memory
the largest peak_mem_mib rank 0 logged.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass

import numpy as np

from training.plan.calibration import REGULARISATION
from training.plan.layout_prediction import Prediction
from training.plan.recipe_writer import recipe_name, write_recipe
from training.plan.search_setting import Setting
from training.plan.step_model import FACTORS

POOL = 4  # trials are chosen among the top POOL × K layouts (at least MIN_POOL)
MIN_POOL = 12
MIN_TIMED_STEPS = 3  # steps left to time once the warm-up is left out


def warmup_steps(steps: int) -> int:
    """Steps left out of a trial's median: start-up and the first shapes cost more than a step."""
    return max(2, steps // 5)


@dataclass
class Trial:
    prediction: Prediction  # at the factors the trial was chosen with
    recipe: str = ""
    measured_step_s: float | None = None
    measured_peak_mib: float | None = None
    timed_steps: int = 0
    wall_s: float = 0.0
    error: str | None = None


def choose(candidates: list[Prediction], k: int, factors: dict) -> list[Prediction]:
    """K of the top layouts: the best, then each adding the most information (module docstring)."""
    pool = candidates[: max(POOL * k, MIN_POOL)]
    if not pool:
        return []
    z = np.array([[p.features()[f] / max(p.seconds(factors), 1e-30) for f in FACTORS] for p in pool])
    info = REGULARISATION * np.eye(len(FACTORS)) + np.outer(z[0], z[0])
    chosen = [0]
    while len(chosen) < min(k, len(pool)):
        inv = np.linalg.inv(info)
        gains = [(float(z[i] @ inv @ z[i]) if i not in chosen else -1.0, -i) for i in range(len(pool))]
        best = -max(gains)[1]
        chosen.append(best)
        info += np.outer(z[best], z[best])
    return [pool[i] for i in chosen]


def _measure(metrics: str, steps: int) -> tuple[float, float, int]:
    """(median step seconds after the warm-up, largest peak MiB, steps timed) from a run's metrics.jsonl."""
    with open(metrics, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    times = [r["step_time"] for r in rows if "step_time" in r][warmup_steps(steps) :]
    if len(times) < MIN_TIMED_STEPS:
        raise ValueError(f"only {len(times)} steps timed after the warm-up (metrics.jsonl has {len(rows)} rows)")
    peaks = [r["peak_mem_mib"] for r in rows if r.get("peak_mem_mib") is not None]
    return statistics.median(times), max(peaks, default=float("nan")), len(times)


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    marked = [ln for ln in lines if ln.startswith("error:") or "Error" in ln]
    return (marked or lines or ["no output"])[-1][:400]


def run_trial(
    trial: Trial,
    index: int,
    setting: Setting,
    data: str,
    steps: int,
    workdir: str,
    hostfile: str | None,
    given: dict,
    timeout: float,
) -> Trial:
    """Write the trial's recipe, launch it for `steps` steps, and read what it measured (or why it failed)."""
    folder = os.path.join(workdir, f"trial-{index}")
    one_node = hostfile is None
    trial.recipe = write_recipe(
        folder, setting, trial.prediction.layout, given, f"trial {index} of plan.py --search", one_node
    )
    env = dict(os.environ, RUNS_DIR=os.path.join(workdir, "runs"), QUIET="1")
    env.pop("MASTER_PORT", None)  # run.sh takes a free port (never a fixed 29500)
    cmd = ["bash", os.path.join(folder, "run.sh"), data] + ([hostfile] if hostfile else [])
    cmd += ["--steps", str(steps), "--save_checkpoint_steps", "0", "--tensorboard", "0", "--log_interval", str(steps)]
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
        proc.communicate()
        trial.error = f"timed out after {timeout:g} s (--trial_timeout); its logs: {folder}"
        return trial
    finally:
        trial.wall_s = time.perf_counter() - started
    metrics = os.path.join(workdir, "runs", recipe_name(folder), "output", "metrics.jsonl")
    if proc.returncode != 0 or not os.path.isfile(metrics):
        trial.error = f"exit status {proc.returncode}: {_last_error(out)}"
        return trial
    try:
        trial.measured_step_s, trial.measured_peak_mib, trial.timed_steps = _measure(metrics, steps)
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        trial.error = f"no step time in {metrics}: {exc}"
    return trial
