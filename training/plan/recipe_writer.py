"""`plan.py --search --write_recipe DIR`: a searched layout as a recipe folder of the shape of recipes/*/ — NAME.json
and run.sh — that run_scripts/run.sh, run_cluster.sh and the SLURM script launch unmodified.

The JSON is the recipe searched from (its comments, model, training and deepspeed sections kept), with every train.py
flag given on plan.py's command line written into it (the search planned with them: model flags into "model", the
rest into "training"; paths made absolute, so the folder runs from anywhere), and its "parallel" section replaced by
the layout: the old section's comments described the old layout. The trials (training.plan.trials) launch recipes
written here too, so every trial also checks the writer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat

from common.errors import UserError
from training.config.sections import ModelSection
from training.plan.layout_space import Layout
from training.plan.search_setting import Setting

# plan.py's own flags and what a launch supplies itself: never written into a recipe
NOT_IN_RECIPE = {
    "recipe",
    "local_rank",
    "hostfile",
    "gpus_per_node",
    "json",
    "check",
    "device",
    "device_memory",
    "write_hostfile",
    "predict_speed",
    "step_time_1gpu",
    "assumed_mfu",
    "intra_node_GB_s",
    "inter_node_Gb_s",
    "file_path",
    "output_dir",
    "world_size",
    "distribute",
    "resume",
    "ckpt_file",
    "deepspeed_overrides",
    "explicit",
}
LAYOUT_FLAGS = {
    "model_parallel",
    "pipeline_stage",
    "micro_batch_num",
    "optimizer_shard",
    "zero_stage",
    "recompute",
    "vocab_emb_dp",
    "interleave_num",
    "pipeline_func",
    "data_parallel",
    "precision",
    "gradient_aggregation_group",
    "deepspeed_config",
}
PATH_FLAGS = {"tokenizer", "valid_file", "cache_dir", "deepspeed_config"}
MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelSection)}


def recipe_name(folder: str) -> str:
    """The recipe's file name (and run folder name, runs/NAME): the folder's name in letters, digits, . _ -."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", os.path.basename(os.path.normpath(folder))).strip("-.")
    return name or "searched"


def parallel_section(setting: Setting, layout: Layout, why: str) -> dict:
    p = setting.cfg.parallel
    out = {
        "_search": why,
        "world_size": setting.world,
        "model_parallel": layout.model_parallel,
        "pipeline_stage": layout.pipeline_stage,
        "micro_batch_num": layout.micro_batch_num,
        "optimizer_shard": layout.zero_stage > 0,
        "zero_stage": layout.zero_stage,
        "recompute": layout.recompute,
        "vocab_emb_dp": layout.vocab_emb_dp,
        "interleave_num": layout.interleave_num,
        "precision": p.precision,
        "gradient_aggregation_group": p.gradient_aggregation_group,
    }
    if layout.pipeline_stage > 1:
        out["pipeline_func"] = layout.pipeline_func
    if p.deepspeed_config:
        out["deepspeed_config"] = os.path.abspath(p.deepspeed_config)
    return out


def _flag_value(dest: str, value):
    if dest in PATH_FLAGS and isinstance(value, str) and value:
        return os.path.abspath(value)
    return value


def recipe_body(setting: Setting, layout: Layout, given: dict, why: str, launch: str) -> dict:
    """The recipe as a dict. `given`: {flag dest: value} of the train.py flags on plan.py's command line."""
    source = {}
    if setting.cfg.recipe:
        from common.user_files import read_json

        source = read_json(setting.cfg.recipe, "recipe")
    body = {}  # the source's own "_launch" / "_plan" name its folder and layout, not these
    body["_comment"] = (
        f"Written by plan.py --search from {setting.cfg.recipe or 'flags only'}: {why} "
        f"(docs/layout-search.md)."
        + (f" The recipe's own note: {source['_comment']}" if source.get("_comment") else "")
    )
    body["_launch"] = launch
    for section in ("model", "training"):
        body[section] = dict(source.get(section, {}))
    taken: dict[str, list[str]] = {"model": [], "training": []}
    for dest, value in given.items():
        if dest in NOT_IN_RECIPE or dest in LAYOUT_FLAGS or value is None or dest.startswith("_"):
            continue
        section = "model" if dest in MODEL_FIELDS else "training"
        other = "training" if section == "model" else "model"
        body[other].pop(dest, None)
        body[section][dest] = _flag_value(dest, value)
        taken[section].append(f"--{dest}")
    for section, flags in taken.items():
        if flags:  # the source's comments may describe the values these replaced
            body[section]["_plan_flags"] = f"from plan.py's command line, over the recipe's: {' '.join(flags)}"
    micro = setting.batch // (layout.data_parallel * layout.micro_batch_num)
    unit = (
        f"token batches of up to {setting.cfg.data.max_tokens} tokens a side; at full length "
        if setting.cfg.data.max_tokens
        else ""
    )
    body["training"]["_batch"] = (
        f"{unit}micro {micro} × accum {layout.micro_batch_num} × dp {layout.data_parallel} = global {setting.batch}"
    )
    body["parallel"] = parallel_section(setting, layout, why)
    body["deepspeed"] = dict(source.get("deepspeed", {}))
    return body


RUN_SH = """#!/usr/bin/env bash
# Written by plan.py --search: the @NAME@ recipe (@WORLD@ ranks) launched through @TARGET@.
#   bash run.sh @ARGS@ [extra train.py flags...]
# = bash @TARGET@ @ARGS@ @NAME@.json [extra...]
USAGE="usage: bash run.sh @ARGS@ [extra train.py flags...]
  DATA_PATH   the training TSV (on several nodes: at the same path on every node)
@HOSTFILE_USAGE@  extra flags go to train.py and override @NAME@.json; environment as @TARGET@ (MASTER_PORT,
  RUNS_DIR, RUN_NAME, DRY_RUN=1, ...), DSR_ROOT (the repository, for a copy of this folder elsewhere)"
case "${1:-}" in -h|--help) echo "$USAGE"; exit 0 ;; esac
# The repository (so a copy of this folder runs from anywhere): $DSR_ROOT, else the checkout this folder sits in,
# else the one the installed package comes from — common/repository.py says which, or why none
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT=$(PYTHONPATH="${DSR_ROOT:-$HERE/../..}${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -m common.repository) || {
    [ $? -eq 2 ] || echo "error: no repository found for $HERE: set DSR_ROOT=/path/to/the/checkout" >&2
    exit 2
}
if [ $# -lt @COUNT@ ] || [[ "$1" == -* ]]@CHECK2@; then
    echo "$USAGE" >&2
    exit 2
fi
@THREADS@DATA_PATH="$1"
@SHIFT@
exec bash "$ROOT/@TARGET@" @QUOTED@ "$HERE/@NAME@.json" "$@"
"""
# CPU ranks: the machine's cores shared out (one rank per core on 2 cores), not every rank using all of them
THREADS = 'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / @WORLD@ > 0 ? $(nproc) / @WORLD@ : 1 ))}"\n'


def run_sh(name: str, setting: Setting, one_node: bool) -> str:
    """The launcher, as recipes/*/run.sh: run.sh on one node, run_cluster.sh with a hostfile on several."""
    fill = {
        "NAME": name,
        "WORLD": str(setting.world),
        "TARGET": "run_scripts/run.sh" if one_node else "run_scripts/run_cluster.sh",
        "ARGS": "DATA_PATH" if one_node else "DATA_PATH HOSTFILE",
        "HOSTFILE_USAGE": ("" if one_node else "  HOSTFILE    DeepSpeed hostfile, one 'HOST slots=N' line per node\n"),
        "COUNT": "1" if one_node else "2",
        "CHECK2": "" if one_node else ' || [[ "$2" == -* ]]',
        "THREADS": THREADS if setting.device_type == "cpu" else "",
        "SHIFT": "shift" if one_node else 'HOSTFILE="$2"\nshift 2',
        "QUOTED": '"$DATA_PATH"' if one_node else '"$DATA_PATH" "$HOSTFILE"',
    }
    text = RUN_SH.replace("@THREADS@", fill.pop("THREADS"))
    for key, value in fill.items():
        text = text.replace(f"@{key}@", value)
    return text


def check_folder(folder: str) -> None:
    """Before any work: a folder that holds files is not overwritten."""
    if os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
        raise UserError(
            f"--write_recipe {folder} already exists and is not an empty folder: give a new folder for the recipe"
        )


def write_recipe(folder: str, setting: Setting, layout: Layout, given: dict, why: str, one_node: bool) -> str:
    """Write NAME.json and run.sh into `folder` (made if needed); returns the JSON's path."""
    os.makedirs(folder, exist_ok=True)
    name = recipe_name(folder)
    launch = f"bash {os.path.join(folder, 'run.sh')} DATA_PATH{'' if one_node else ' HOSTFILE'} [extra train.py flags]"
    path = os.path.join(folder, f"{name}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(recipe_body(setting, layout, given, why, launch), f, indent=2, ensure_ascii=False)
        f.write("\n")
    script = os.path.join(folder, "run.sh")
    with open(script, "w", encoding="utf-8") as f:
        f.write(run_sh(name, setting, one_node))
    os.chmod(script, os.stat(script).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path
