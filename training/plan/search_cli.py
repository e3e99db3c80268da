"""`plan.py --search` on the command line: its flags (one argparse group of their own), their checks, and the run —
search, trials and calibration, output, the recipe. The search itself: training.plan.layout_search.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

from common.cli_args import integer, number
from common.errors import UserError
from training.plan import calibration as cal
from training.plan import trials as tr
from training.plan.layout_prediction import Context, predict
from training.plan.layout_search import default_factors, search
from training.plan.recipe_writer import check_folder, write_recipe
from training.plan.search_report import format_search, layout_dict, result_dict
from training.plan.search_setting import Setting, make_setting
from training.plan.speed_prediction import Links
from training.plan.step_model import prior_for

SEARCH_ONLY = ("top", "write_recipe", "trials", "trial_dir", "calibration")


def add_search_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("dstr-plan --search: choose the layout (docs/layout-search.md)")
    g.add_argument(
        "--search",
        action="store_true",
        help="rank every layout of the world (tp × pp × dp, ZeRO, micro-batches, recompute, split "
        "embeddings, interleave, stage splits) by predicted step time; every rejected one with its "
        "reason; the chosen one beside the recipe's own. With --json: candidates, rejected, chosen. "
        "--device cpu plans CPU processes (the default with --trials on a machine without a GPU)",
    )
    g.add_argument("--top", type=integer(1), default=10, metavar="K", help="layouts the text table shows (default 10)")
    g.add_argument(
        "--write_recipe",
        default=None,
        metavar="DIR",
        help="write the chosen layout as a recipe folder (DIR/DIR.json and run.sh) that run.sh, "
        "run_cluster.sh and the SLURM script launch as it is; DIR must be new or empty",
    )
    g.add_argument(
        "--trials",
        type=integer(0),
        default=0,
        metavar="K",
        help="run K of the top layouts for --trial_steps steps on the ranks at hand (needs "
        "--file_path; GPUs with --hostfile on a cluster, CPU processes without a GPU), fit the step "
        "model's factors to their step times, re-rank, and show each trial's leave-one-out "
        "prediction beside its measurement",
    )
    g.add_argument(
        "--trial_steps",
        type=integer(tr.MIN_TIMED_STEPS + 2, why="a few steps are left out as warm-up"),
        default=30,
        metavar="S",
        help="steps per trial (default 30; the first fifth is left out)",
    )
    g.add_argument(
        "--trial_dir",
        default=None,
        metavar="DIR",
        help="keep the trials' recipes, runs and logs in a new folder under DIR (default: a temporary "
        "folder, removed when every trial ran, kept and named when one failed)",
    )
    g.add_argument(
        "--trial_timeout",
        type=number(0, low_open=True, why="seconds"),
        default=1800.0,
        metavar="SECONDS",
        help="end a trial that runs longer (default 1800)",
    )
    g.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="this cluster's calibration: read when it exists (its factors and device are used), "
        "written after --trials (their rows added to its own)",
    )


def check_flags(args: argparse.Namespace) -> None:
    """The search flags' mistakes, before any work."""
    if not args.search:
        given = [f"--{name} {getattr(args, name)}" for name in SEARCH_ONLY if getattr(args, name) not in (None, 0, 10)]
        if given:
            raise UserError(f"{' '.join(given)} needs --search (choose the layout, then write it, try it, calibrate)")
        return
    if args.trials and not args.file_path:
        raise UserError(f"--trials {args.trials} needs --file_path DATA: the training data the trials train on")
    if args.trials and args.file_path and not os.path.exists(args.file_path):
        raise UserError(f"--file_path {args.file_path} not found (the data --trials {args.trials} train on)")
    if args.calibration and not args.trials and not os.path.isfile(args.calibration):
        raise UserError(f"--calibration {args.calibration} not found: run --trials K once to write it")
    if args.write_recipe:
        check_folder(args.write_recipe)
    from model.placement import load_pipeline_func

    load_pipeline_func(args.pipeline_func)  # the recipe's split must load (its layouts are searched too)


def choose_device(args: argparse.Namespace) -> tuple[str, str]:
    """(device, why): --device; else a calibration file's; else cpu when trials run here without a GPU; else h100."""
    if args.device:
        return args.device.lower(), "--device"
    if args.calibration and os.path.isfile(args.calibration):
        from common.user_files import read_json

        data = read_json(args.calibration, "--calibration")
        if isinstance(data, dict) and isinstance(data.get("device"), str):
            return data["device"], f"--calibration {args.calibration}"
    import torch

    if args.trials and not torch.cuda.is_available():
        return "cpu", "no GPU here: the trials run on CPU processes"
    return "h100", "the default --device"


def check_trial_ranks(setting: Setting, args: argparse.Namespace) -> None:
    """Trials run on the ranks at hand: without a hostfile, one node of GPUs (or CPU processes)."""
    if args.hostfile or setting.device_type == "cpu":
        return
    import torch

    found = torch.cuda.device_count()
    if found < setting.world:
        raise UserError(
            f"--trials on {setting.world} ranks needs {setting.world} GPUs here (found {found}): give the "
            f"nodes with --hostfile, or --device cpu to try the layouts on CPU processes"
        )


def given_train_flags(args: argparse.Namespace, argv: list | None) -> dict:
    """{dest: value} of the train.py flags on the command line (what a written recipe must keep)."""
    from training.config.flags import build_parser, given_flags

    return {d: getattr(args, d) for d in given_flags(build_parser(), argv) if hasattr(args, d)}


def run_search(args: argparse.Namespace, argv: list | None, cfg, world: int, hosts, budget: dict | None) -> int:
    """plan.py --search (its flags already checked: check_flags)."""
    device, why = choose_device(args)
    per_node = max(h.slots for h in hosts) if hosts else args.gpus_per_node
    setting = make_setting(
        cfg,
        world,
        hosts,
        args.gpus_per_node,
        device,
        args.device_memory,
        Links(args.intra_node_GB_s, args.inter_node_Gb_s, per_node),
        args.assumed_mfu,
    )
    defaults = default_factors(prior_for(setting))
    saved = cal.load(args.calibration, device) if args.calibration and os.path.isfile(args.calibration) else None
    result = search(setting, saved["factors"] if saved else defaults)
    source = f"from {args.calibration}" if saved else "at their priors (uncalibrated)"
    trials = None
    if args.trials:
        check_trial_ranks(setting, args)
        trials = run_trials(args, setting, result, saved, defaults, given_train_flags(args, argv))
        first = result
        result = search(setting, trials["calibration"]["factors"])
        result.seconds, result.cpu_seconds = first.seconds + result.seconds, first.cpu_seconds + result.cpu_seconds
        source = f"calibrated on {len(trials['trials'])} trials"
    out = result_dict(setting, result, {"token_budget": budget, "device_choice": why, "factors_source": source})
    if trials:
        out.update(trials)
        for t in out["trials"]:
            t["calibrated_step_s"] = _calibrated(setting, result.factors, t)
    if args.write_recipe and out["chosen"]:
        out["recipe_written"] = _write_chosen(args, setting, result, argv)
    print(as_json(out) if args.json else format_search(out, args.top))
    sys.stdout.flush()
    if not out["chosen"]:
        raise UserError(
            f"none of the {result.considered} layouts of {world} ranks can run (reasons above): "
            f"more ranks, a device with more memory, or a smaller batch or model"
        )
    return 0


def as_json(out: dict) -> str:
    import json

    return json.dumps(out, indent=1, default=str)


def _calibrated(setting: Setting, factors: dict, t: dict) -> float | None:
    if t.get("measured_step_s") is None:
        return None
    from training.plan.layout_space import Layout

    layout = Layout(**{k: v for k, v in t["layout"].items() if k != "blocks_per_stage"})
    return predict(Context(setting, prior_for(setting), factors), layout, t["layout"]["blocks_per_stage"]).seconds(
        factors
    )


def _write_chosen(args: argparse.Namespace, setting: Setting, result, argv: list | None) -> dict:
    best = result.candidates[0]
    why = (
        f"layout {best.layout.short()} chosen among {result.considered} by plan.py --search, "
        f"{best.seconds(result.factors) * 1e3:.1f} ms a step predicted on {setting.device}"
    )
    one_node = args.hostfile is None and setting.world <= setting.per_node
    path = write_recipe(args.write_recipe, setting, best.layout, given_train_flags(args, argv), why, one_node)
    run_sh = os.path.join(args.write_recipe, "run.sh")
    return {
        "json": path,
        "run_sh": run_sh,
        "layout": layout_dict(best.layout, best.blocks_per_stage),
        "launch": f"bash {run_sh} DATA_PATH" + ("" if one_node else " HOSTFILE"),
    }


def run_trials(
    args: argparse.Namespace, setting: Setting, result, saved: dict | None, defaults: dict, given: dict
) -> dict:
    """Run the trials, fit the factors (with the saved rows), leave-one-out, save: {"trials", "calibration"}."""
    picks = tr.choose(result.candidates, args.trials, result.factors)
    if args.trial_dir:  # a folder of its own each time: a run folder holding metrics is appended to
        os.makedirs(args.trial_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="dstr-trials-", dir=args.trial_dir)
    done = []
    for i, pick in enumerate(picks, 1):
        print(
            f"trial {i}/{len(picks)}: {pick.layout.short()} for {args.trial_steps} steps ...",
            file=sys.stderr,
            flush=True,
        )
        t = tr.run_trial(
            tr.Trial(pick),
            i,
            setting,
            os.path.abspath(args.file_path),
            args.trial_steps,
            workdir,
            args.hostfile,
            given,
            args.trial_timeout,
        )
        print(
            f"  {t.error or f'{t.measured_step_s * 1e3:.1f} ms a step'} ({t.wall_s:.0f} s)", file=sys.stderr, flush=True
        )
        done.append(t)
    ok = [t for t in done if t.measured_step_s is not None]
    if not ok:
        raise UserError(
            f"every trial failed (first: {done[0].error if done else 'none chosen'}); the trials' "
            f"recipes and logs are in {workdir}"
        )
    factors, loo = fit_trials(setting, ok, saved["rows"] if saved else [], defaults)
    rows = [_row(setting, t, factors) for t in ok]
    if args.calibration:
        old = saved["raw"].get("rows", []) if saved else []
        cal.save(args.calibration, setting.device, setting.device_type, factors, old + rows, defaults)
    if not args.trial_dir and len(ok) == len(done):
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "trials": [_trial_dict(setting, t, loo.get(id(t)), result.factors) for t in done],
        "calibration": {
            "factors": factors,
            "file": args.calibration,
            "trial_steps": args.trial_steps,
            "warmup_steps": tr.warmup_steps(args.trial_steps),
            "where": _where(setting, args),
            "trial_wall_s": sum(t.wall_s for t in done),
            "trial_dir": workdir,
            "median_loo_error": _median_error(setting, done, loo),
        },
    }


def fit_trials(setting: Setting, ok: list, saved_rows: list, defaults: dict) -> tuple[dict, dict]:
    """(factors fitted on every trial and the saved rows, {id(trial): its leave-one-out prediction})."""
    prior = prior_for(setting)

    def rows(factors, skip=None):
        ctx = Context(setting, prior, factors)
        return list(saved_rows) + [
            (predict(ctx, t.prediction.layout, t.prediction.blocks_per_stage).features(), t.measured_step_s)
            for i, t in enumerate(ok)
            if i != skip
        ]

    factors = cal.calibrate(rows, defaults)
    loo = {}
    if len(ok) + len(saved_rows) >= 2:
        values = cal.leave_one_out(
            lambda skip, f: rows(f, skip),
            lambda i, f: predict(
                Context(setting, prior, f), ok[i].prediction.layout, ok[i].prediction.blocks_per_stage
            ).seconds(f),
            len(ok),
            defaults,
        )
        loo = {id(t): v for t, v in zip(ok, values, strict=True)}
    return factors, loo


def _row(setting: Setting, t, factors: dict) -> dict:
    pred = predict(Context(setting, prior_for(setting), factors), t.prediction.layout, t.prediction.blocks_per_stage)
    m = setting.model
    return {
        "features": pred.features(),
        "measured_step_s": t.measured_step_s,
        "layout": layout_dict(t.prediction.layout, t.prediction.blocks_per_stage),
        "world_size": setting.world,
        "model": {
            "d_model": m.d_model,
            "encoder_layers": m.encoder_layers,
            "decoder_layers": m.decoder_layers,
            "vocab_size": m.vocab_size,
            "global_batch": setting.batch,
            "precision": setting.precision,
        },
    }


def _trial_dict(setting: Setting, t, loo: float | None, factors: dict) -> dict:
    out = {
        "layout": layout_dict(t.prediction.layout, t.prediction.blocks_per_stage),
        "predicted_step_s": t.prediction.seconds(factors),
        "measured_step_s": t.measured_step_s,
        "loo_predicted_step_s": loo,
        "loo_error": (loo / t.measured_step_s - 1) if loo is not None and t.measured_step_s else None,
        "measured_peak_mib": t.measured_peak_mib,
        "predicted_peak_gib": t.prediction.peak_bytes / 2**30,
        "timed_steps": t.timed_steps,
        "wall_s": t.wall_s,
        "recipe": t.recipe,
        "error": t.error,
    }
    return out


def _median_error(setting: Setting, done: list, loo: dict) -> float | None:
    errors = [abs(loo[id(t)] / t.measured_step_s - 1) for t in done if id(t) in loo]
    return statistics.median(errors) if errors else None


def _where(setting: Setting, args: argparse.Namespace) -> str:
    if args.hostfile:
        return f"the hostfile's {setting.world} ranks"
    return f"{setting.world} {'CPU processes' if setting.device_type == 'cpu' else 'GPUs'} of this machine"
