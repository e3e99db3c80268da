"""Draw the curves of one or several training runs into a PNG: loss (with the validation loss), validation BLEU,
learning rate, gradient norm and tokens/s against the step.

    dstr-plot-metrics out/quickstart                       # → out/quickstart/curves.png
    dstr-plot-metrics out/run-a out/run-b --output ab.png --smooth 20

Each argument is a run's output_dir (its metrics.jsonl) or a metrics.jsonl file; every run gets one colour in every
panel, labelled with its folder's name (a launcher's run folder for runs/NAME-TIME/output). --smooth N draws the
training loss, gradient norm and tokens/s as running means over N steps (the raw values faint behind them);
validation points are drawn as they are. A panel no run has data for (BLEU without --valid_bleu) says so. A line a
crash cut short is skipped, and said.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from common.errors import UserError, console_script
from common.staging import staged_file

# panel title → (metrics.jsonl key, y label, smoothed?)
PANELS = [
    ("loss", "loss", "loss (train; valid: markers)", True),
    ("valid BLEU", "valid_bleu", "BLEU", False),
    ("learning rate", "lr", "lr", False),
    ("gradient norm", "grad_norm", "global norm, before clipping", True),
    ("throughput", "tokens_per_sec", "target tokens/s", True),
]


def read_run(path: str) -> tuple[str, list[dict]]:
    """(label, records) of a run folder or a metrics.jsonl file."""
    file = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise UserError(f"{path}: no metrics.jsonl (give a run's --output_dir or its metrics.jsonl)")
    records, torn = [], 0
    with open(file, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                torn += 1
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    if torn:
        print(f"{file}: skipped {torn} line(s) that are not JSON (a run that stopped mid-write)", file=sys.stderr)
    if not records:
        raise UserError(f"{file} holds no step records")
    folder = os.path.dirname(os.path.abspath(file))
    label = os.path.basename(folder) or folder
    if label == "output":  # run.sh's run folders: runs/<recipe>/output/metrics.jsonl
        label = os.path.basename(os.path.dirname(folder))
    return label, sorted(records, key=lambda r: r["step"])


def running_mean(values: list[float], n: int) -> list[float]:
    out, total, window = [], 0.0, []
    for v in values:
        window.append(v)
        total += v
        if len(window) > n:
            total -= window.pop(0)
        out.append(total / len(window))
    return out


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def plot_runs(runs: list[tuple[str, list[dict]]], output: str, smooth: int = 1) -> dict:
    """Write the PNG; returns what each panel drew: {panel: [(label, steps, values), ...]} (the tests read it)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANELS), 1, figsize=(9, 2.6 * len(PANELS)), sharex=True)
    drawn: dict = {title: [] for title, *_ in PANELS}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, key, ylabel, smoothed) in zip(axes, PANELS, strict=True):
        for i, (label, records) in enumerate(runs):
            colour = colours[i % len(colours)]
            steps, values = series(records, key)
            if steps:
                if smoothed and smooth > 1:
                    ax.plot(steps, values, color=colour, alpha=0.25, linewidth=0.8)
                    values = running_mean(values, smooth)
                style = {"marker": "o", "markersize": 3} if key == "valid_bleu" else {}
                ax.plot(steps, values, color=colour, label=label, linewidth=1.2, **style)
                drawn[title].append((label, steps, values))
            if key == "loss":
                v_steps, v_values = series(records, "valid_loss")
                if v_steps:
                    ax.plot(
                        v_steps,
                        v_values,
                        color=colour,
                        linestyle="--",
                        marker="o",
                        markersize=4,
                        label=f"{label} (valid)",
                    )
                    drawn[title].append((f"{label} (valid)", v_steps, v_values))
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        if drawn[title]:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, f"no {key} in these runs", transform=ax.transAxes, ha="center", va="center", color="gray")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with staged_file(output, suffix=".png") as tmp:  # a name of its own, gone if the drawing fails
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return drawn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="dstr-plot-metrics",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", nargs="+", help="run folders (--output_dir of train.py) or metrics.jsonl files")
    p.add_argument("--output", "-o", default=None, help="the PNG to write (default: FIRST_RUN/curves.png)")
    p.add_argument("--smooth", type=int, default=1, help="running mean over N steps for noisy curves (default 1)")
    args = p.parse_args(argv)
    if args.smooth < 1:
        raise UserError(f"--smooth {args.smooth} must be >= 1 (1: the raw values)")
    runs = [read_run(path) for path in args.runs]
    first = args.runs[0] if os.path.isdir(args.runs[0]) else os.path.dirname(os.path.abspath(args.runs[0]))
    output = args.output or os.path.join(first, "curves.png")
    if not output.lower().endswith(".png"):
        raise UserError(f"--output {output}: give a .png file")
    drawn = plot_runs(runs, output, args.smooth)
    steps = ", ".join(f"{label}: steps {records[0]['step']}-{records[-1]['step']}" for label, records in runs)
    empty = [title for title, lines in drawn.items() if not lines]
    print(f"wrote {output} ({steps})" + (f"; no data for: {', '.join(empty)}" if empty else ""))
    return 0


cli = console_script(main)  # the console script (setup.cfg): user mistakes in one line


if __name__ == "__main__":
    cli()
