"""Calibration factors fitted to measured step times by least squares, their leave-one-out check, and the file
that keeps them per cluster (`plan.py --search --calibration FILE`).

A layout's predicted step is Σ_f factor_f · x_f, x_f its seconds per factor at factor 1 (training.plan.step_model:
compute efficiency, link bandwidth, latency, per-pass overhead, optimizer, fixed, overlap). The fit minimises the
squared relative errors of the trials plus a pull of each log-factor towards the prior,

    Σ_i ((Σ_f k_f x_if − y_i) / y_i)²  +  λ Σ_f (ln k_f − ln k⁰_f)²

— least squares in ln k (Gauss-Newton), so every factor stays positive, a factor no trial informs keeps its prior,
and three trials can move seven factors without the fit running off. Which stage is slowest depends on the factors,
so the rows are recomputed at each new fit (three rounds). Why these choices, and how well it predicts:
docs/layout-search.md.
"""

from __future__ import annotations

import json
import math

import numpy as np

from common.errors import UserError
from training.plan.step_model import FACTORS

REGULARISATION = 0.01  # λ: a factor e× off its prior costs as much as a 10 % misfit of one trial
FILE_KIND = "dstr-plan layout calibration"


def fit(rows: list[tuple[dict, float]], prior: dict, strength: float = REGULARISATION) -> dict:
    """Factors for rows of (features, measured seconds), pulled towards `prior`."""
    if not rows:
        return dict(prior)
    X = np.array([[feat[f] for f in FACTORS] for feat, _ in rows], dtype=float)
    y = np.array([m for _, m in rows], dtype=float)
    theta0 = np.log([prior[f] for f in FACTORS])
    theta, root = theta0.copy(), math.sqrt(strength)

    def residual(t):
        return np.concatenate([(X @ np.exp(t) - y) / y, root * (t - theta0)])

    cost = float(residual(theta) @ residual(theta))
    for _ in range(60):
        k = np.exp(theta)
        J = np.vstack([X * k / y[:, None], root * np.eye(len(FACTORS))])
        step = np.linalg.lstsq(J, -residual(theta), rcond=None)[0]
        step = np.clip(step, -2.0, 2.0)  # at most e² per round: the model is linear in k, not ln k
        for _ in range(20):  # halve until the cost falls
            trial = theta + step
            new = float(residual(trial) @ residual(trial))
            if new <= cost:
                break
            step = step / 2
        else:
            break
        done = cost - new < 1e-12 * max(cost, 1e-30)
        theta, cost = trial, new
        if done:
            break
    return dict(zip(FACTORS, (float(v) for v in np.exp(theta)), strict=True))


def calibrate(rows_of, prior: dict, rounds: int = 3) -> dict:
    """Factors from `rows_of(factors)` → [(features, measured)], refitted as the slowest stages move."""
    factors = dict(prior)
    for _ in range(rounds):
        factors = fit(rows_of(factors), prior)
    return factors


def leave_one_out(rows_of_subset, predict_one, count: int, prior: dict) -> list[float]:
    """Each trial's prediction from factors fitted on the others. `rows_of_subset(skip, factors)`: the rows without
    trial `skip`; `predict_one(i, factors)`: trial i's predicted seconds."""
    out = []
    for i in range(count):
        factors = calibrate(lambda f, i=i: rows_of_subset(i, f), prior)
        out.append(predict_one(i, factors))
    return out


def load(path: str, device: str) -> dict:
    """The saved calibration: {"factors", "rows", ...}; UserError for a file that is not one, or another device's."""
    from common.user_files import read_json

    data = read_json(path, "--calibration")
    if not isinstance(data, dict) or data.get("kind") != FILE_KIND:
        raise UserError(
            f'--calibration {path} is not a layout calibration (no "kind": "{FILE_KIND}"): give a file '
            f"that plan.py --search --trials wrote, or a new path for it to write"
        )
    factors = data.get("factors")
    if not isinstance(factors, dict) or any(
        not isinstance(factors.get(f), (int, float)) or not factors[f] > 0 for f in FACTORS
    ):
        raise UserError(
            f'--calibration {path}: "factors" must give a positive number for each of '
            f"{', '.join(FACTORS)}; write it again with --trials"
        )
    if data.get("device") != device:
        raise UserError(
            f"--calibration {path} was fitted on device {data.get('device')!r}, this search is for "
            f"{device!r}: pass --device {data.get('device')}, or another file for this cluster"
        )
    rows = [
        (r["features"], float(r["measured_step_s"]))
        for r in data.get("rows", [])
        if isinstance(r, dict)
        and isinstance(r.get("features"), dict)
        and all(isinstance(r["features"].get(f), (int, float)) for f in FACTORS)
    ]
    return {"factors": {f: float(factors[f]) for f in FACTORS}, "rows": rows, "raw": data}


def save(path: str, device: str, device_type: str, factors: dict, rows: list[dict], prior: dict) -> None:
    """Write the factors and every row they were fitted on (the next search with --trials adds to them)."""
    body = {
        "kind": FILE_KIND,
        "version": 1,
        "device": device,
        "device_type": device_type,
        "factors": factors,
        "prior_factors": prior,
        "rows": rows,
        "_comment": "Written by plan.py --search --trials; read by plan.py --search --calibration (this file). "
        "factors multiply the prior seconds of each term of the step model: docs/layout-search.md.",
    }
    from common.staging import atomic_write

    with atomic_write(path) as f:
        json.dump(body, f, indent=1)
        f.write("\n")
