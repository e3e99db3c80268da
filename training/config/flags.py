"""train.py's command line and recipe files (defaults < recipe JSON < flags), read from the settings' declarations
(training.config.sections) into a Namespace and then a TrainConfig. A recipe holds sections {"model", "parallel",
"training", "deepspeed"}; any key in the first three is a setting's flag name or the seed's alias, "_" keys are
comments (docs/settings.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from common.cli_args import Number, OutOfRange, Parser
from common.errors import UserError
from common.user_files import read_json
from training.config.schema import as_bool
from training.config.sections import SECTIONS, TrainConfig
from training.core.deepspeed_check import check_deepspeed_config, strip_comments

EXAMPLES = """\
examples (CPU, bundled Multi30k; see README):
  dstr-train --file_path out/data/train.fr_en.tsv --steps 20 --output_dir out/serial
  # several processes: DeepSpeed's launcher takes a script's path, run_scripts/train.py or $(which dstr-train)
  deepspeed --num_gpus 2 run_scripts/train.py --distribute true --file_path out/data/train.fr_en.tsv \\
      --mp 2 --steps 20 --output_dir out/tp2
  deepspeed --num_gpus 8 run_scripts/train.py --recipe recipes/8pcs/8pcs.json --file_path DATA.tsv
  deepspeed --hostfile hostfile run_scripts/train.py --recipe recipes/16pcs/16pcs.json --file_path DATA.tsv

The data-parallel size is derived as world_size // mp // pipeline_stage, as in the seed.
"""
NOT_SETTINGS = ("recipe", "local_rank", "help")  # flags, but not recipe keys


def build_parser() -> argparse.ArgumentParser:
    """train.py's flags: one group per section, each setting under its name and the seed's alias."""
    p = Parser(
        prog="dstr-train",
        description="Train the encoder-decoder Transformer with tensor (mp), pipeline and data "
        "parallelism on DeepSpeed. Launch with `deepspeed --num_gpus N`, `deepspeed --hostfile H`, torchrun, or "
        "plain python for one process.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for kind in SECTIONS.values():
        group, added = p.add_argument_group(kind.__doc__), set()
        for f in dataclasses.fields(kind):
            if "setting" in f.metadata:
                f.metadata["setting"].add_to(group, f.name, f.default)
            elif "flag_from" in f.metadata and f.metadata["flag_from"] not in added:
                added.add(f.metadata["flag_from"])
                f.metadata["flag_from"](group)
    p.add_argument("--recipe", default=None, help="JSON recipe (recipes/*/*.json); flags given here override it")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _recipe_value(action: argparse.Action, value, where: str):
    """A recipe value checked like the flag it stands for: its numeric type's range, or the type JSON gives."""
    if value is None:
        return None
    kind = action.type
    if isinstance(kind, Number):
        try:
            return kind(value)
        except OutOfRange as exc:
            raise UserError(f"{where} is {json.dumps(value)}; it {exc.problem}") from None
    try:
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ValueError
            value = int(value)
        elif kind is as_bool:
            value = as_bool(value)
        elif not isinstance(value, str):  # paths, names, choices: strings
            raise ValueError
    except (ValueError, argparse.ArgumentTypeError):
        want = {int: "an integer", as_bool: "true or false"}.get(kind, "a string")
        raise UserError(f"{where} is {json.dumps(value)}; it must be {want}") from None
    if action.choices is not None and value not in action.choices:
        raise UserError(f"{where} is {json.dumps(value)}; it must be one of {list(action.choices)}")
    return value


def load_recipe(path: str) -> dict:
    """Flatten a recipe's sections into flag defaults; the 'deepspeed' section is kept as a dict."""
    data = read_json(path, "recipe")
    if not isinstance(data, dict):
        raise UserError(f"recipe {path}: expected a JSON object with sections model, parallel, training, deepspeed")
    flat: dict = {}
    actions = {o[2:]: a for a in build_parser()._actions for o in a.option_strings if a.dest not in NOT_SETTINGS}
    for section, values in data.items():
        if section.startswith("_"):
            continue
        if section not in ("model", "parallel", "training", "deepspeed"):
            raise UserError(f"recipe {path}: unknown section {section!r} (model, parallel, training, deepspeed)")
        if not isinstance(values, dict):
            raise UserError(f"recipe {path}: section {section!r} must be a JSON object of settings")
        if section == "deepspeed":
            flat["deepspeed_overrides"] = strip_comments(values)  # "_" keys are comments at any depth
            continue
        for key, value in values.items():
            if key.startswith("_"):
                continue
            if key not in actions:
                raise UserError(f"recipe {path}: unknown key {section}.{key}")
            flat[actions[key].dest] = _recipe_value(actions[key], value, f"recipe {path}: {section}.{key}")
    return flat


def parse_args(argv: list | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Flags over recipe over defaults. `parser`: build_parser() with extra arguments (plan.py adds its own)."""
    parser = parser or build_parser()
    first, _ = parser.parse_known_args(argv)
    recipe = load_recipe(first.recipe) if first.recipe else {}
    overrides = recipe.pop("deepspeed_overrides", {})
    parser.set_defaults(**recipe)
    args = parser.parse_args(argv)
    args.deepspeed_overrides = overrides
    # DeepSpeed settings of the wrong type fail here, in seconds, not after the model is built
    if overrides:
        check_deepspeed_config(overrides, f"recipe {first.recipe}: deepspeed", args.precision)
    if args.deepspeed_config:
        check_deepspeed_config(
            read_json(args.deepspeed_config, "--deepspeed_config"),
            f"--deepspeed_config {args.deepspeed_config}",
            args.precision,
        )
    return args


def given_flags(parser: argparse.ArgumentParser, argv: list | None) -> set[str]:
    """The dests of the flags on the command line itself, not their defaults (`parser`: a fresh build_parser())."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    found, _ = parser.parse_known_args(argv)
    return set(vars(found))


def parse_config(argv: list | None = None) -> TrainConfig:
    """train.py's command line → the typed, checked configuration the trainer runs. It remembers which flags the
    user set (command line, then recipe): a run that starts from a checkpoint takes the checkpoint's value for every
    other setting it carries (training.checkpoint.carried_settings, once training.run.start_point has decided)."""
    args = parse_args(argv)
    explicit = {dest: f"--{dest}" for dest in given_flags(build_parser(), argv)}
    if args.recipe:
        for dest in load_recipe(args.recipe):
            explicit.setdefault(dest, f"recipe {args.recipe}'s {dest}")
    args.explicit = explicit
    return TrainConfig.from_flags(args)
