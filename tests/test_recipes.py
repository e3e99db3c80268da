"""The recipes: complete folders, the seed's settings, batch arithmetic in their comments that matches the layout,
and real runs through the launch scripts (2pcs on 2 processes, 8pcs on 8, cpu-tiny as a user would run it)."""

import json
import os
import re
import shutil
import subprocess
import time

import pytest

from tests.launch import REPO_ROOT, launches, losses, only_launch, only_run_dir, read_metrics, run_script, script_env
from tests.progress import load_factor, scaled
from training.config.flags import load_recipe, parse_args
from training.config.sections import TrainConfig
from training.plan.planner import build_plan_parser, configs

RECIPES = {"2pcs": 2, "8pcs": 8, "8pcs-dp2-mp4": 8, "16pcs": 16, "cpu-tiny": 2}
SEED_MODEL = {
    "vocab_size": 20000,
    "d_model": 128,
    "num_heads": 8,
    "encoder_layer": 1,
    "decoder_layer": 1,
    "src_len": 10,
    "tgt_len": 10,
    "batch_size": 32,
    "lr": 1e-4,
}


def recipe_path(name):
    return REPO_ROOT / "recipes" / name / f"{name}.json"


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_folder_is_complete(name):
    folder = REPO_ROOT / "recipes" / name
    launcher = folder / "run.sh"
    assert launcher.is_file() and os.access(launcher, os.X_OK)
    assert f"{name}.json" in launcher.read_text()
    # no count of its own: run.sh reads the JSON's world_size (run_cluster.sh: the hostfile's slots)
    assert not re.search(r'run(_cluster)?\.sh" "\$DATA_PATH" ("\$HOSTFILE" )?\d', launcher.read_text())
    raw = json.loads(recipe_path(name).read_text())
    assert raw["_comment"] and raw["training"]["_batch"]
    load_recipe(str(recipe_path(name)))  # no unknown key, every value of the flag's type
    readme = (REPO_ROOT / "recipes" / "README.md").read_text()
    assert f"[`{name}`]({name}/{name}.json)" in readme


@pytest.mark.parametrize("name", list(RECIPES))
def test_batch_comment_matches_the_layout(name):
    """Each recipe's "_batch" comment (micro M × accum A × dp D = global G) is the arithmetic it really gets, on the
    world size its JSON says it is written for."""
    world = RECIPES[name]
    raw = json.loads(recipe_path(name).read_text())
    assert raw["parallel"]["world_size"] == world
    m = re.match(r"micro (\d+) × accum (\d+) × dp (\d+) = global (\d+)", raw["training"]["_batch"])
    assert m, raw["training"]["_batch"]
    micro, accum, dp, total = map(int, m.groups())
    args = parse_args(["--recipe", str(recipe_path(name)), "--vocab_size", "20000"], parser=build_plan_parser())
    _, parallel = configs(TrainConfig.from_flags(args), world)
    assert (parallel.data_parallel, parallel.micro_batch_num, args.batch_size) == (dp, accum, total)
    assert micro * accum * dp == total == args.batch_size


def test_seed_settings():
    for name, mp in (("2pcs", 2), ("8pcs", 8), ("16pcs", 8)):
        args = parse_args(["--recipe", str(recipe_path(name))])
        assert {k: getattr(args, k) for k in SEED_MODEL} == SEED_MODEL, name
        assert args.model_parallel == mp and args.ffn_size == 0 and args.epochs == 1
    args = parse_args(["--recipe", str(recipe_path("16pcs"))])
    assert (args.pipeline_stage, args.micro_batch_num, args.optimizer_shard) == (2, 2, True)
    _, parallel = configs(TrainConfig.from_flags(args), 16)
    assert parallel.data_parallel == 1 and parallel.effective_zero_stage == 1
    for name in ("2pcs", "8pcs"):
        args = parse_args(["--recipe", str(recipe_path(name))])
        assert (args.pipeline_stage, args.micro_batch_num, args.optimizer_shard) == (1, 1, False)
    tiny = parse_args(["--recipe", str(recipe_path("cpu-tiny"))])
    assert tiny.vocab_size is None and tiny.tokenizer_vocab_size == 2000  # sized to its own BPE tokenizer


def test_a_job_of_another_size_than_the_recipes_world_size_runs_and_says_so(multi30k_tsv, bpe_tokenizer, tmp_path):
    """world_size is a recipe key like any other (a flag overrides it; 0 is one line). train.py runs on the world its
    launcher gives it: cpu-tiny (world_size 2) on one process, with a note naming both."""
    from common.errors import UserError
    from training.config.flags import parse_config

    tiny = str(recipe_path("cpu-tiny"))
    assert parse_config(["--recipe", tiny]).parallel.world_size == 2
    assert parse_config(["--recipe", tiny, "--world_size", "4"]).parallel.world_size == 4
    with pytest.raises(UserError, match=r"^--world_size 0 must be >= 1 \(the processes the layout is written for\)$"):
        parse_config(["--recipe", tiny, "--world_size", "0"])
    from tests.launch import run_train

    proc = run_train(
        1,
        [
            "--recipe",
            tiny,
            "--mp",
            1,
            "--steps",
            1,
            "--file_path",
            multi30k_tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--output_dir",
            tmp_path / "out",
            "--save_checkpoint_steps",
            0,
        ],
    )
    assert (
        "note: the layout is written for 2 processes (world_size) but this job has 1; dp follows the job: "
        "world // mp // pipeline_stage"
    ) in proc.stdout.splitlines()
    assert "layout: world=1 dp=1 mp=1 pp=1" in proc.stdout


# ---------------------------------------------------------------------------------------------------- real runs


def check_run(run_dir, nproc, steps, launch=None):
    """The run folder after a launch: metrics of steps 1..steps, and in the launch's log folder one log per rank
    and what the launch recorded."""
    assert [r["step"] for r in read_metrics(run_dir / "output")] == list(range(1, steps + 1))
    launch = launch or only_launch(run_dir)
    logs = sorted(launch.glob("*_rank*.log"))
    assert sorted(int(re.search(r"_rank(\d+)\.log$", p.name).group(1)) for p in logs) == list(range(nproc))
    for name in ("command.sh", "env.log", "layout.txt", "launcher.log"):
        assert (launch / name).is_file(), name
    return logs


@pytest.mark.slow
def test_2pcs_recipe_through_run_sh(multi30k_tsv, bpe_tokenizer, tmp_path):
    runs = tmp_path / "runs"
    proc = run_script(
        "run_scripts/run.sh",
        [
            multi30k_tsv,
            2,
            "recipes/2pcs/2pcs.json",
            "--steps",
            2,
            "--d_model",
            32,
            "--tokenizer",
            bpe_tokenizer,
            "--tensorboard",
            0,
        ],
        script_env(runs),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = only_run_dir(runs)
    assert run_dir.name == "2pcs"  # runs/<recipe>: the same for every launch
    check_run(run_dir, 2, 2)
    launch = only_launch(run_dir)
    rank0 = next(launch.glob("*_rank0.log")).read_text()
    assert "layout: world=2 dp=1 mp=2 pp=1" in rank0 and "vocab=20000" in rank0  # recipe + flag overrides
    assert f"per-rank logs: {launch}" in proc.stdout
    assert "recipes/2pcs/2pcs.json" in (launch / "command.sh").read_text()


@pytest.mark.slow
def test_8pcs_recipe_on_8_processes(multi30k_tsv, bpe_tokenizer, tmp_path):
    """bash run_scripts/run.sh DATA 8 picks recipes/8pcs (mp 8) by itself; tiny dims, 2 steps."""
    runs = tmp_path / "runs"
    proc = run_script(
        "run_scripts/run.sh",
        [multi30k_tsv, 8, "--steps", 2, "--d_model", 32, "--tokenizer", bpe_tokenizer, "--tensorboard", 0],
        script_env(runs),
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = only_run_dir(runs)
    assert run_dir.name == "8pcs"
    logs = check_run(run_dir, 8, 2)
    rank0 = next(p for p in logs if p.name.endswith("_rank0.log")).read_text()
    assert "layout: world=8 dp=1 mp=8 pp=1" in rank0


@pytest.mark.slow
def test_cpu_tiny_recipe_as_a_user_runs_it(multi30k_tsv, tmp_path):
    """recipes/cpu-tiny/run.sh DATA: builds its 2000-token BPE tokenizer, trains 60 steps on 2 processes in under
    a minute, and shows rank 0's loss lines on the console while it runs."""
    runs = tmp_path / "runs"
    env = script_env(runs, QUIET="")
    env.pop("OMP_NUM_THREADS", None)  # the recipe's launcher sets it
    t = time.perf_counter()
    proc = run_script("recipes/cpu-tiny/run.sh", [multi30k_tsv], env, timeout=300)
    seconds = time.perf_counter() - t
    print(f"cpu-tiny: {seconds:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = only_run_dir(runs)
    check_run(run_dir, 2, 60)
    got = losses(run_dir / "output")
    assert got[-1] < got[0] - 1.0, got
    assert "epoch: 1 step: 60, loss is" in proc.stdout  # rank 0 followed on the console
    assert "OMP_NUM_THREADS=1" in (only_launch(run_dir) / "env.log").read_text()
    assert seconds < scaled(90), f"{seconds:.0f} s at load factor {load_factor():.1f}"


@pytest.mark.slow
def test_a_copied_recipe_runs_from_anywhere(multi30k_tsv, tmp_path):
    """The recipes README says: copy a recipe folder and edit it. A copy outside the repository finds the repository
    through the installed package (here the checkout on PYTHONPATH, as `pip install -e .` gives) or DSR_ROOT, and
    launches from any directory: cpu-tiny for 3 steps, from a folder that has nothing to do with the repository."""
    copy = tmp_path / "elsewhere" / "my-tiny"
    shutil.copytree(REPO_ROOT / "recipes" / "cpu-tiny", copy)
    runs = tmp_path / "runs"
    env = script_env(runs)
    env.pop("DSR_ROOT", None)
    proc = subprocess.run(
        ["bash", str(copy / "run.sh"), str(multi30k_tsv), "--steps", "3", "--log_interval", "1"],
        cwd=tmp_path / "elsewhere",
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = only_run_dir(runs)
    check_run(run_dir, 2, 3)
    assert str(copy / "cpu-tiny.json") in (only_launch(run_dir) / "command.sh").read_text()  # the copy's own recipe

    # DSR_ROOT names the repository without any installed package (a dry run: the command only; another RUNS_DIR,
    # since runs/cpu-tiny now holds the 3-step run's checkpoint and a fresh launch there is refused)
    bare = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    bare["RUNS_DIR"] = str(tmp_path / "dry-runs")
    proc = subprocess.run(
        ["bash", str(copy / "run.sh"), str(multi30k_tsv)],
        cwd=tmp_path,
        env=dict(bare, DSR_ROOT=str(REPO_ROOT), DRY_RUN="1"),
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert proc.returncode == 0, proc.stderr
    assert f"{REPO_ROOT}/run_scripts/train.py" in proc.stdout.splitlines()[-1]
    proc = subprocess.run(
        ["bash", str(copy / "run.sh"), str(multi30k_tsv)],
        cwd=tmp_path,
        env=dict(bare, DSR_ROOT=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"error: DSR_ROOT={tmp_path} is not the repository's folder (it has no run_scripts/run.sh); set DSR_ROOT to "
        f"the folder you cloned, or unset it"
    ]


@pytest.mark.slow
def test_cpu_tiny_resumes_through_its_own_run_sh(multi30k_tsv, tmp_path):
    """What a stopped or finished recipe run says — resume with --resume — works through the recipe's run.sh as
    printed: the run folder runs/cpu-tiny is the same for every launch, so `run.sh DATA --steps 30 --resume` after a
    20-step run continues at step 21 in it (each launch's logs kept in logs/<time>/). The same command without
    --resume is refused in one line naming --resume, before anything starts; and a run left in a folder of the old
    scheme (runs/cpu-tiny-<time>) is named when --resume or --resume auto would otherwise miss it and start over."""
    runs = tmp_path / "runs"
    env = script_env(runs)
    env.pop("OMP_NUM_THREADS", None)  # the recipe's launcher sets it
    first = run_script("recipes/cpu-tiny/run.sh", [multi30k_tsv, "--steps", 20], env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run_dir = only_run_dir(runs)
    assert run_dir.name == "cpu-tiny"
    check_run(run_dir, 2, 20)
    assert sorted(p.name for p in (run_dir / "output" / "checkpoints").glob("step_*")) == ["step_00000020"]

    # a given --output_dir replaces output/: train.py's own rules for it apply, the launcher does not refuse
    dry = run_script(
        "recipes/cpu-tiny/run.sh",
        [multi30k_tsv, "--output_dir", run_dir / "output"],
        dict(env, DRY_RUN="1"),
        timeout=120,
    )
    assert dry.returncode == 0 and dry.stdout.splitlines()[-1].rstrip().endswith(f"--output_dir {run_dir}/output")
    again = run_script("recipes/cpu-tiny/run.sh", [multi30k_tsv, "--steps", 30], env, timeout=120)
    assert again.returncode == 2 and again.stderr.splitlines() == [
        f"error: run folder {run_dir} already holds checkpoints up to step_00000020: add --resume to this command to "
        f"continue that run, or set RUN_NAME=NAME to start a new run beside it"
    ], again.stderr
    assert len(launches(run_dir)) == 1  # nothing started, nothing written

    resumed = run_script("recipes/cpu-tiny/run.sh", [multi30k_tsv, "--steps", 30, "--resume"], env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert only_run_dir(runs) == run_dir
    first_launch, second_launch = launches(run_dir)
    check_run(run_dir, 2, 30, launch=second_launch)  # steps 1..30, each once
    rank0 = next(second_launch.glob("*_rank0.log")).read_text()
    assert f"resumed from {run_dir}/output/checkpoints/step_00000020 at step 20" in rank0 and "steps 20→30" in rank0
    assert "steps 0→20" in next(first_launch.glob("*_rank0.log")).read_text()  # the first launch's log kept

    old = runs / "cpu-tiny-20250101-120000"  # as a launch before stable run folders named it
    run_dir.rename(old)
    for resume in (["--resume"], ["--resume", "auto"]):
        proc = run_script("recipes/cpu-tiny/run.sh", [multi30k_tsv, "--steps", 40, *resume], env, timeout=120)
        assert proc.returncode == 2 and proc.stderr.splitlines() == [
            f"error: {' '.join(resume)}: run folder {run_dir} holds no checkpoint, but {old} (the folder of an earlier "
            f"launch, from before run folders kept their name) holds checkpoints up to step_00000030: continue that "
            f"run here with --resume {old}/output, or move {old} away to start afresh"
        ], proc.stderr
    assert not run_dir.exists()
