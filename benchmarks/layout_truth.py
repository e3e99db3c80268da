#!/usr/bin/env python3
"""The search's pick against the truth on this machine: run the layouts of a small model on 2 and 4 CPU ranks,
then calibrate as `plan.py --search --trials 3` does and see where its pick lands (issue 42's goals).

    python -m benchmarks.layout_truth --file_path out/data/train.fr_en.tsv --output truth.json


For each world it runs — through the recipe writer and run.sh, as a trial does — every ranked layout with at most
`--max_micro` micro-batches, no recompute and no interleave (what a CPU rank's step is made of: more micro-batches,
recompute and interleave only add passes; a few of those are run too, `--extras` per world, to check it), for
`--steps` steps each, and takes each one's 20th-percentile step after the warm-up (steadier than the median
on a shared machine: other processes only add time). Then the calibration: the three layouts `--trials 3` would
choose, their measured steps (as above), the least-squares fit and the re-ranking, as plan.py does them; the
pick's measured step is compared with the fastest measured. Each trial's leave-one-out prediction is reported beside its
measurement. Prints a line per layout and a summary; `--output` keeps every figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

# the model of issue 42's check: d_model 64, 4 heads, FFN 256, 2 + 2 layers, 32 pairs a step, a 2,000-token BPE
FLAGS = [
    "--recipe",
    "recipes/cpu-tiny/cpu-tiny.json",
    "--d_model",
    "64",
    "--num_heads",
    "4",
    "--ffn_size",
    "256",
    "--encoder_layer",
    "2",
    "--decoder_layer",
    "2",
    "--batch_size",
    "32",
    "--tokenizer_vocab_size",
    "2000",
]


def setting_for(world: int):
    from training.config.flags import parse_args
    from training.config.sections import TrainConfig
    from training.plan.planner import build_plan_parser
    from training.plan.search_setting import make_setting
    from training.plan.speed_prediction import Links

    args = parse_args(FLAGS + ["--device", "cpu"], parser=build_plan_parser())
    links = Links(args.intra_node_GB_s, args.inter_node_Gb_s, world)
    given = {
        "d_model": 64,
        "num_heads": 4,
        "ffn_size": 256,
        "encoder_layer": 2,
        "decoder_layer": 2,
        "batch_size": 32,
        "tokenizer_vocab_size": 2000,
    }
    return make_setting(TrainConfig.from_flags(args), world, None, world, "cpu", None, links, 0.35), given


def plain(p, max_micro: int) -> bool:
    lay = p.layout
    return lay.micro_batch_num <= max_micro and not lay.recompute and lay.interleave_num == 1


def key(p) -> str:
    return p.layout.short() + " " + ",".join(map(str, p.blocks_per_stage))


def low_step(work: str, index: int, steps: int) -> float:
    """The 20th percentile of a run's step times after the warm-up: other processes on the machine (this one is
    shared) only ever add time, so a low percentile of many steps is steadier than the median."""
    from training.plan import trials as tr
    from training.plan.recipe_writer import recipe_name

    path = os.path.join(work, "runs", recipe_name(os.path.join(work, f"trial-{index}")), "output", "metrics.jsonl")
    with open(path, encoding="utf-8") as f:
        times = [json.loads(line)["step_time"] for line in f if '"step_time"' in line][tr.warmup_steps(steps) :]
    return sorted(times)[len(times) // 5]


class Timer:
    """Runs layouts of one world as trials do, once each: {layout: median step seconds}."""

    def __init__(self, world, setting, given, data, steps, factors):
        self.world, self.setting, self.given, self.data, self.steps, self.factors = (
            world,
            setting,
            given,
            data,
            steps,
            factors,
        )
        self.work = tempfile.mkdtemp(prefix=f"layout-truth-{world}-")
        self.measured: dict[str, float] = {}

    def run(self, p, label: str = "") -> float:
        from training.plan import trials as tr

        if key(p) not in self.measured:
            t = tr.run_trial(
                tr.Trial(p),
                len(self.measured) + 1,
                self.setting,
                self.data,
                self.steps,
                self.work,
                None,
                self.given,
                900,
            )
            self.measured[key(p)] = (
                low_step(self.work, len(self.measured) + 1, self.steps) if t.measured_step_s else float("inf")
            )
            print(
                f"{self.world} ranks {label:>6} {key(p):<48} predicted {p.seconds(self.factors) * 1e3:7.1f} ms  "
                f"measured {self.measured[key(p)] * 1e3:7.1f} ms" + (f"  ({t.error})" if t.error else ""),
                flush=True,
            )
        return self.measured[key(p)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file_path", required=True, help="the training data (a TSV)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--max_micro", type=int, default=2)
    ap.add_argument("--extras", type=int, default=4, help="layouts outside the plain set run per world, as a check")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from training.plan import trials as tr
    from training.plan.layout_search import search
    from training.plan.search_cli import fit_trials

    report = {}
    for world in args.worlds:
        setting, given = setting_for(world)
        first = search(setting)
        plain_set = [p for p in first.candidates if plain(p, args.max_micro)]
        others = [p for p in first.candidates if not plain(p, args.max_micro)]
        extras = [others[i * len(others) // args.extras] for i in range(args.extras)] if others else []
        timer = Timer(world, setting, given, os.path.abspath(args.file_path), args.steps, first.factors)
        measured, run = timer.measured, timer.run
        for p in plain_set:
            run(p, "plain")
        for p in extras:
            run(p, "extra")
        picks = tr.choose(first.candidates, 3, first.factors)
        done = []
        for p in picks:
            t = tr.Trial(p)
            t.measured_step_s = run(p, "trial")
            done.append(t)
        factors, loo = fit_trials(setting, done, [], dict(first.factors))
        calibrated = search(setting, factors)
        pick = calibrated.candidates[0]
        pick_s = run(pick, "pick")
        fastest = min(measured, key=measured.get)
        errors = [abs(loo[id(t)] / t.measured_step_s - 1) for t in done if id(t) in loo]
        report[world] = {
            "layouts_ranked": len(first.candidates),
            "layouts_run": len(measured),
            "measured_ms": {k: v * 1e3 for k, v in sorted(measured.items(), key=lambda kv: kv[1])},
            "uncalibrated_pick": key(first.candidates[0]),
            "trials": [key(t.prediction) for t in done],
            "trial_measured_ms": [t.measured_step_s * 1e3 for t in done],
            "trial_loo_ms": [loo.get(id(t), float("nan")) * 1e3 for t in done],
            "median_loo_error": statistics.median(errors) if errors else None,
            "factors": factors,
            "calibrated_pick": key(pick),
            "calibrated_pick_ms": pick_s * 1e3,
            "fastest": fastest,
            "fastest_ms": measured[fastest] * 1e3,
            "pick_over_fastest": pick_s / measured[fastest],
        }
        r = report[world]
        print(
            f"{world} ranks: {r['layouts_run']} of {r['layouts_ranked']} layouts run; fastest {fastest} "
            f"{r['fastest_ms']:.1f} ms; calibrated pick {r['calibrated_pick']} {r['calibrated_pick_ms']:.1f} ms "
            f"({r['pick_over_fastest']:.3f}× the fastest); median leave-one-out error "
            f"{r['median_loo_error']:.1%} over trials {r['trials']}",
            flush=True,
        )
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
