"""run_scripts/run.sh and run_cluster.sh (usage, layout pre-check, the commands they build, the OpenMPI path),
the rank-table → hostfile converter, hostfile parsing, and train.py's adoption of mpirun's environment."""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common import launch_payload
from common.errors import UserError
from tests.launch import REPO_ROOT, only_launch, only_run_dir, read_metrics, run_script, script_env
from tests.progress import scaled
from training.plan.cluster import (
    Host,
    format_hostfile,
    hosts_to_rank_table,
    parse_hostfile_text,
    rank_nodes,
    rank_table_to_hosts,
    read_hostfile,
)

RUN = "run_scripts/run.sh"
CLUSTER = "run_scripts/run_cluster.sh"
HOSTFILES = REPO_ROOT / "run_scripts" / "hostfiles"
TABLES = REPO_ROOT / "run_scripts" / "rank_tables"
FAKE_MPI = REPO_ROOT / "tests" / "fake_openmpi"


@pytest.fixture
def tsv(tmp_path):
    path = tmp_path / "data.tsv"
    path.write_text("bonjour\thello\n")
    return path


def assert_usage_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in first, first
    assert "usage: bash run_scripts/" in proc.stderr


# ----------------------------------------------------------------------------------------------------- usage


@pytest.mark.parametrize(
    "args,needle",
    [
        ([], "missing arguments"),
        (["{tsv}"], "missing arguments"),
        (["{tmp}/nope.tsv", "2"], "is not a file"),
        (["{tmp}", "2"], "is a folder but not one written by datasets' save_to_disk"),
        (["{tsv}", "0"], "RANK_SIZE '0' is not a positive integer"),
        (["{tsv}", "two"], "RANK_SIZE 'two' is not a positive integer"),
        (["{tsv}", "-2"], "is not a positive integer"),
        (["{tsv}", "2.5"], "is not a positive integer"),
        (["{tsv}", "2", "{tmp}/nope.json"], "recipe '{tmp}/nope.json' is not a file"),
        (["{tsv}", "{tmp}/nope.json"], "recipe '{tmp}/nope.json' is not a file"),
        (["{tsv}", "2", "--launcher", "slurm"], "unknown launcher 'slurm'"),
        (["{tsv}", "2", "--launcher"], "--launcher needs a value"),
    ],
    ids=[
        "none",
        "one",
        "data-missing",
        "data-folder",
        "zero",
        "word",
        "negative",
        "fraction",
        "recipe-missing",
        "recipe-only-missing",
        "launcher",
        "launcher-empty",
    ],
)
def test_run_sh_usage(args, needle, tsv, tmp_path):
    fill = {"tsv": tsv, "tmp": tmp_path}
    proc = run_script(RUN, [a.format(**fill) for a in args], script_env(tmp_path / "runs"))
    assert_usage_error(proc, needle.format(**fill))
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "args,needle",
    [
        ([], "missing arguments"),
        (["{tsv}"], "missing arguments"),
        (["{tsv}", "{tmp}/nohosts"], "HOSTFILE '{tmp}/nohosts' not found"),
        (["{tmp}/nope.tsv", "{hf}"], "DATA_PATH '{tmp}/nope.tsv' is not a file"),
        (["{tmp}", "{hf}"], "DATA_PATH {tmp} is a folder but not one written by datasets' save_to_disk"),
        (["{tsv}", "{hf}", "{tmp}/nope.json"], "is not a file"),
        (["{tsv}", "{hf}", "--launcher=mvapich"], "unknown launcher 'mvapich'"),
    ],
    ids=["none", "one", "hostfile-missing", "data-missing", "data-folder", "recipe-missing", "launcher"],
)
def test_run_cluster_usage(args, needle, tsv, tmp_path):
    fill = {"tsv": tsv, "tmp": tmp_path, "hf": HOSTFILES / "hostfile_2nodes"}
    proc = run_script(CLUSTER, [a.format(**fill) for a in args], script_env(tmp_path / "runs"))
    assert_usage_error(proc, needle.format(**fill))


@pytest.fixture(scope="module")
def saved_to_disk(multi30k_dir, tmp_path_factory) -> Path:
    """Multi30k val (1,014 pairs) as a `datasets` save_to_disk folder with the columns fr and en."""
    import datasets

    from common.text_lines import read_lines

    sides = {lang: [line.strip() for line in read_lines(multi30k_dir / f"val.{lang}.gz")] for lang in ("fr", "en")}
    folder = tmp_path_factory.mktemp("saved") / "val"
    datasets.Dataset.from_dict(sides).save_to_disk(str(folder))
    return folder


def test_a_recipe_launches_on_a_datasets_save_to_disk_folder(saved_to_disk, tmp_path):
    """train.py reads a save_to_disk folder (preprocess.corpus_source), but the launch scripts refused one ("is not
    a file"): recipes/cpu-tiny/run.sh on such a folder trains 2 steps on 2 processes, given it as an absolute path;
    run_cluster.sh takes it too (its launcher stood in for)."""
    runs = tmp_path / "runs"
    env = script_env(runs)
    env.pop("OMP_NUM_THREADS", None)  # the recipe's launcher sets it
    proc = run_script(
        "recipes/cpu-tiny/run.sh",
        [saved_to_disk, "--src_field", "fr", "--tgt_field", "en", "--steps", 2],
        env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = only_run_dir(runs)
    assert [r["step"] for r in read_metrics(run_dir / "output")] == [1, 2]
    assert f"--file_path {saved_to_disk} " in (only_launch(run_dir) / "command.sh").read_text()
    echo = tmp_path / "ds.py"  # stands in for the deepspeed command
    echo.write_text("import sys\nprint(sys.argv[1:])\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=2\n")
    proc = run_script(
        CLUSTER,
        [saved_to_disk, hostfile, REPO_ROOT / "recipes/cpu-tiny/cpu-tiny.json"],
        script_env(tmp_path / "cluster", DEEPSPEED=f"{sys.executable} {echo}"),
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "script", [RUN, CLUSTER, "recipes/2pcs/run.sh", "recipes/16pcs/run.sh", "recipes/cpu-tiny/run.sh"]
)
def test_help_and_recipe_launcher_usage(script, tmp_path):
    proc = run_script(script, [], script_env(tmp_path))
    assert proc.returncode == 2 and "usage: bash " in proc.stderr
    if script.startswith("run_scripts"):
        proc = run_script(script, ["--help"], script_env(tmp_path))
        assert proc.returncode == 0 and proc.stdout.startswith("usage: bash " + script)


SHELL_SCRIPTS = sorted(
    p.relative_to(REPO_ROOT).as_posix()
    for p in [*(REPO_ROOT / "run_scripts").glob("*.sh"), *(REPO_ROOT / "recipes").glob("*/run.sh")]
)
PY_SCRIPTS = sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "run_scripts").glob("*.py"))


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_every_launcher_answers_help_and_starts_nothing(script, tmp_path):
    """`bash X --help` prints its usage and exits 0 — the quickstart used to start a run into `--output_dir --help`.
    Recipes answer from a copy of their folder (they need no repository for it). Nothing is written anywhere."""
    path = REPO_ROOT / script
    if script.startswith("recipes/"):
        copy = tmp_path / "copy" / path.parent.name
        copy.mkdir(parents=True)
        for f in path.parent.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        path = copy / "run.sh"
    work = tmp_path / "cwd"
    work.mkdir()
    env = script_env(tmp_path / "runs")
    env.pop("MASTER_PORT")
    before = sorted(REPO_ROOT.joinpath("out").rglob("*")) if (REPO_ROOT / "out").exists() else []
    proc = subprocess.run(
        ["bash", str(path), "--help"], cwd=work, env=env, capture_output=True, text=True, timeout=scaled(60)
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert proc.stdout.startswith("usage: ") and proc.stderr == "", (proc.stdout, proc.stderr)
    if script.startswith("recipes/"):  # a copy's usage names the copy, not the folder it was copied from
        assert f"bash {path} " in proc.stdout.splitlines()[0] and "recipes/" not in proc.stdout.splitlines()[0]
    assert not any(work.iterdir()) and not (tmp_path / "runs").exists()
    assert (sorted(REPO_ROOT.joinpath("out").rglob("*")) if (REPO_ROOT / "out").exists() else []) == before


@pytest.mark.parametrize("script", PY_SCRIPTS)
def test_every_python_script_answers_help(script, tmp_path):
    from tests.launch import env, run_python

    proc = run_python([sys.executable, REPO_ROOT / script, "--help"], cwd=tmp_path, env=env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: ") and "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------------------- the master port


def test_a_free_master_port_unless_one_is_given_and_a_busy_one_is_one_line(tsv, tmp_path):
    """Without MASTER_PORT the launchers pick a port nobody listens on (29500 was fixed: a second job on the
    machine failed at the rendezvous); a given port that is busy stops the launch with one line, nothing created."""
    import socket

    busy = socket.socket()
    busy.bind(("", 0))
    busy.listen()
    try:
        env = script_env(tmp_path / "runs", DRY_RUN=1)
        env.pop("MASTER_PORT")
        proc = run_script(RUN, [tsv, 2, "recipes/2pcs/2pcs.json"], env)
        assert proc.returncode == 0, proc.stderr
        port = int(flag(shlex.split(proc.stdout.strip().splitlines()[-1]), "--master_port"))
        assert port != 29500
        with socket.socket() as probe:
            probe.bind(("", port))  # free
        for script, args in (
            (RUN, [tsv, 2, "recipes/2pcs/2pcs.json"]),
            ("run_scripts/quickstart.sh", [tmp_path / "q"]),
            ("recipes/interleaved-mlp/run.sh", []),
        ):
            proc = run_script(
                script, args, script_env(tmp_path / "runs", MASTER_PORT=busy.getsockname()[1]), timeout=60
            )
            assert proc.returncode == 2, (script, proc.stdout[-2000:], proc.stderr[-2000:])
            assert proc.stderr.splitlines() == [
                f"error: MASTER_PORT {busy.getsockname()[1]} is in use on this "
                f"machine (another job's rendezvous?); leave MASTER_PORT unset to get "
                f"a free port, or choose another"
            ], script
            assert not (tmp_path / "runs").exists() and not (tmp_path / "q").exists()
        proc = run_script(RUN, [tsv, 2], script_env(tmp_path / "runs", MASTER_PORT="29x"))
        assert proc.returncode == 2 and proc.stderr.startswith("error: MASTER_PORT '29x' is not a port number")
        # no free port to be had (a Python that cannot bind): one line, not DeepSpeed's 29500 as before
        python = tmp_path / "python"
        python.write_text(
            f'#!/bin/bash\ncase "$*" in *\'bind(("", 0))\'*) exit 1 ;; esac\nexec {sys.executable} "$@"\n'
        )
        python.chmod(0o755)
        env = script_env(tmp_path / "runs", DRY_RUN=1, PYTHON=str(python))
        env.pop("MASTER_PORT")
        proc = run_script(RUN, [tsv, 2, "recipes/2pcs/2pcs.json"], env)
        assert proc.returncode == 2 and proc.stderr.splitlines() == [
            f"error: could not pick a free master port ({python} could not bind a TCP socket); set MASTER_PORT to a "
            f"port free on this machine"
        ]
    finally:
        busy.close()


# --------------------------------------------------------------------------- pre-check and the built commands


def test_layout_precheck_stops_before_launch(tsv, tmp_path):
    proc = run_script(RUN, [tsv, 8, REPO_ROOT / "recipes/16pcs/16pcs.json"], script_env(tmp_path / "runs"))
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "1×8×2 = 16 but the world has 8 processes" in errors[0], proc.stderr
    assert "Layouts that fit 8 processes" in errors[0]
    assert not (tmp_path / "runs").exists()
    # a hostfile DeepSpeed would reject is rejected before launching as well
    bad = tmp_path / "hostfile"
    bad.write_text("node-a slots=8\nnode-a slots=8\n")
    proc = run_script(CLUSTER, [tsv, bad], script_env(tmp_path / "runs"))
    assert proc.returncode == 2 and "host node-a is listed twice" in proc.stderr, proc.stderr


def dry_run(script, args, tmp_path, **env):
    proc = run_script(script, args, script_env(tmp_path / "runs", DRY_RUN=1, **env))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[1].startswith("layout ok: ")
    assert not (tmp_path / "runs").exists()  # a dry run creates nothing
    return shlex.split(lines[-1]), lines[1]


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_run_sh_commands(tsv, tmp_path):
    cmd, layout = dry_run(RUN, [tsv, 8, "--steps", 3], tmp_path)  # the default recipe for 8
    assert flag(cmd, "--num_gpus") == "8" and "--enable_each_rank_log" in cmd
    assert flag(cmd, "--recipe") == str(REPO_ROOT / "recipes/8pcs/8pcs.json")
    assert flag(cmd, "--distribute") == "true" and flag(cmd, "--file_path") == str(tsv)
    assert cmd[-2:] == ["--steps", "3"] and "dp 1 × mp 8 × pp 1" in layout
    assert flag(cmd, "--world_size") == "8"  # train.py hears the count the launcher starts
    run_dir = Path(flag(cmd, "--output_dir")).parent
    assert run_dir == tmp_path / "runs" / "8pcs"  # runs/<recipe>: the same for every launch
    assert re.fullmatch(r"\d{8}-\d{6}", Path(flag(cmd, "--enable_each_rank_log")).name)  # logs/<time>: this launch
    assert Path(flag(cmd, "--enable_each_rank_log")).parent == run_dir / "logs"

    cmd, layout = dry_run(RUN, [tsv, 4, "--launcher", "openmpi"], tmp_path)  # no 4pcs recipe: the seed's --mp 4
    assert flag(cmd, "--mp") == "4" and "--recipe" not in cmd and "--num_gpus" not in cmd
    assert flag(cmd, "--launcher") == "openmpi" and "--force_multi" in cmd
    mpi = flag(cmd, "--launcher_args").split()
    assert flag(mpi, "-x") == "MASTER_ADDR=127.0.0.1" and "--output-filename" in mpi
    assert "--launcher" not in cmd[cmd.index(str(REPO_ROOT / "run_scripts/train.py")) :]  # not passed to train.py


def test_a_copied_recipe_edited_to_2_ranks_launches_2(tsv, tmp_path):
    """A recipe's run.sh writes no count: a copy of recipes/8pcs whose JSON is edited to pp 2 on 2 ranks (mp 1,
    pipeline_stage 2, world_size 2) launches 2 processes — the count comes from the JSON's world_size."""
    copy = tmp_path / "elsewhere" / "my-pp2"
    shutil.copytree(REPO_ROOT / "recipes" / "8pcs", copy)
    raw = json.loads((copy / "8pcs.json").read_text())
    raw["parallel"].update(model_parallel=1, pipeline_stage=2, micro_batch_num=2, world_size=2)
    (copy / "8pcs.json").write_text(json.dumps(raw, indent=2))
    proc = subprocess.run(
        ["bash", str(copy / "run.sh"), str(tsv)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=script_env(tmp_path / "runs", DRY_RUN=1),
        timeout=scaled(120),
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    cmd = shlex.split(lines[-1])
    assert flag(cmd, "--num_gpus") == "2" and flag(cmd, "--world_size") == "2", lines[-1]
    assert lines[1].startswith("layout ok: 2 ranks = dp 1 × mp 1 × pp 2"), lines[1]
    assert flag(cmd, "--recipe") == str(copy / "8pcs.json")


def test_rank_size_given_wins_over_the_recipes_world_size_and_run_name_names_a_second_run(tsv, tmp_path):
    """run.sh DATA RECIPE.json starts the recipe's world_size (or --world_size among the flags); an explicit
    RANK_SIZE wins, as a flag wins over a recipe key, with a note; the two given apart and different, or a recipe
    that says nothing, is one line. RUN_NAME puts a second run of a recipe beside the first."""

    def dry(*args, **env):
        proc = run_script(RUN, list(args), script_env(tmp_path / "runs", DRY_RUN=1, **env))
        lines = proc.stdout.strip().splitlines()
        return proc, (shlex.split(lines[-1]) if proc.returncode == 0 else [])

    tiny = str(REPO_ROOT / "recipes/cpu-tiny/cpu-tiny.json")
    proc, cmd = dry(tsv, tiny)
    assert flag(cmd, "--num_gpus") == "2" and flag(cmd, "--world_size") == "2" and proc.stderr == ""
    proc, cmd = dry(tsv, tiny, "--world_size", 1, "--mp", 1)
    assert flag(cmd, "--num_gpus") == "1"
    dp2mp4 = str(REPO_ROOT / "recipes/8pcs-dp2-mp4/8pcs-dp2-mp4.json")
    proc, cmd = dry(tsv, 4, dp2mp4)
    assert flag(cmd, "--num_gpus") == "4" and flag(cmd, "--world_size") == "4"
    assert "layout ok: 4 ranks = dp 1 × mp 4 × pp 1" in proc.stdout
    assert proc.stderr.splitlines() == [f"note: RANK_SIZE 4 overrides the world_size 8 of {dp2mp4}: 4 processes"]
    proc, _ = dry(tsv, 2, tiny, "--world_size", 4)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "error: RANK_SIZE 2 and --world_size 4 disagree: give the number of processes once"
    ]
    en_fr = str(REPO_ROOT / "recipes/multi30k-en-fr/multi30k-en-fr.json")
    proc, _ = dry(tsv, en_fr)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f'error: recipe {en_fr} does not say how many processes it is written for: add "world_size": N to its '
        f'"parallel" section, or give the count: bash run_scripts/run.sh DATA N {en_fr}'
    ]
    proc, cmd = dry(tsv, tiny, RUN_NAME="lr3e-3")
    assert Path(flag(cmd, "--output_dir")) == tmp_path / "runs" / "cpu-tiny-lr3e-3" / "output"
    proc, _ = dry(tsv, tiny, RUN_NAME="a/b")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "error: RUN_NAME 'a/b' must be a plain name (letters, digits, . _ -): it becomes part of the run folder's "
        "name, cpu-tiny-RUN_NAME"
    ]
    assert not (tmp_path / "runs").exists()
    # run_cluster.sh: the hostfile's slots are the count, over the recipe's world_size (said in a note)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=2\n")
    proc = run_script(CLUSTER, [tsv, hostfile, dp2mp4, "--mp", 2], script_env(tmp_path / "runs", DRY_RUN=1))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"note: the hostfile's 2 slots override the world_size 8 of {dp2mp4}: 2 processes"
    ]
    assert flag(launch_payload.decode(shlex.split(proc.stdout.splitlines()[-2])[-1])["argv"], "--world_size") == "2"
    # plan.py plans for the recipe's world size when none is given
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "run_scripts/plan.py"),
            "--check",
            "--recipe",
            str(REPO_ROOT / "recipes/16pcs/16pcs.json"),
        ],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert proc.returncode == 0 and proc.stdout.startswith("layout ok: 16 ranks = dp 1 × mp 8 × pp 2"), proc.stderr


def cluster_dry_run(args, tmp_path, **env):
    """run_cluster.sh's dry run: (launcher command, the payload every rank gets, the layout line)."""
    proc = run_script(CLUSTER, args, script_env(tmp_path / "runs", DRY_RUN=1, **env))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[1].startswith("layout ok: ") and lines[-1].startswith("train.py ")
    cmd = shlex.split(lines[-2])
    assert cmd[-2] == "--launch_payload" and cmd[-3] == str(REPO_ROOT / "run_scripts/train.py")
    return cmd, launch_payload.decode(cmd[-1]), lines[1]


def test_run_cluster_commands(tsv, tmp_path):
    cmd, payload, layout = cluster_dry_run([tsv, HOSTFILES / "hostfile_2nodes"], tmp_path, MASTER_PORT=29777)
    assert flag(cmd, "--hostfile") == str(HOSTFILES / "hostfile_2nodes")
    assert flag(cmd, "--master_addr") == "192.0.2.10" and flag(cmd, "--master_port") == "29777"
    argv = payload["argv"]
    assert flag(argv, "--recipe") == str(REPO_ROOT / "recipes/16pcs/16pcs.json")  # the default recipe
    assert flag(argv, "--file_path") == str(tsv) and flag(argv, "--distribute") == "true"
    run_dir = Path(flag(argv, "--output_dir")).parent
    assert run_dir == tmp_path / "runs" / "16pcs" and flag(argv, "--world_size") == "16"  # the hostfile's slots
    assert Path(payload["log_dir"]).parent == run_dir / "logs"  # logs/<time>
    assert payload["cwd"] == str(REPO_ROOT)  # run_script runs there
    # the ranks write their own logs (the payload says where): no log path crosses the remote shell
    assert "--enable_each_rank_log" not in cmd and "--no_ssh_check" not in cmd and "--launcher" not in cmd
    assert "16 ranks = dp 1 × mp 8 × pp 2" in layout
    cmd, payload, _ = cluster_dry_run(
        [tsv, HOSTFILES / "hostfile_2nodes"],
        tmp_path,
        LAUNCHER="openmpi",
        LAUNCHER_ARGS="--allow-run-as-root",
        MASTER_ADDR="10.0.0.1",
        OMP_NUM_THREADS="1",
        EXPORT_VARS="NCCL_IB_HCA DSR_UNSET",
        NCCL_IB_HCA="mlx5",
    )
    assert flag(cmd, "--launcher") == "openmpi" and flag(cmd, "--master_addr") == "10.0.0.1"
    mpi = flag(cmd, "--launcher_args").split()
    assert "-x" in mpi and "MASTER_ADDR=10.0.0.1" in mpi and mpi[-1] == "--allow-run-as-root"
    # OMP_NUM_THREADS, the launch's id and the variables EXPORT_VARS names reach every rank (an unset one is left out)
    launch_id = payload["env"].pop("DSR_LAUNCH_ID")
    assert "--output-filename" not in mpi and payload["env"] == {"OMP_NUM_THREADS": "1", "NCCL_IB_HCA": "mlx5"}
    assert launch_id and " " not in launch_id
    # without DEEPSPEED: DeepSpeed's runner that stops only this job's launchers (tests/test_shared_machine.py)
    cmd, _, _ = cluster_dry_run([tsv, HOSTFILES / "hostfile_2nodes"], tmp_path, DEEPSPEED="")
    assert cmd[:3] == [sys.executable, "-m", "training.run.launcher"], cmd[:4]


def test_a_launch_payload_carries_any_argument_through_a_shell(tmp_path):
    """What DeepSpeed's pdsh runner does to a command (joins it into one string that the remote shell parses)
    cannot touch the token: the shell hands train.py back exactly the arguments it was given, and runs nothing."""
    marker = tmp_path / "ran"
    nasty = [
        f"a $(touch {marker}) b",
        f"`touch {marker}`",
        "it's",
        'say "hi"',
        "$HOME",
        "tab\there",
        "ünï",
        "--flag=x y",
    ]
    token = launch_payload.encode(
        nasty, env={"OMP_NUM_THREADS": "1"}, log_dir=str(tmp_path / "log s"), cwd=str(tmp_path)
    )
    assert re.fullmatch(r"[A-Za-z0-9_-]+", token)
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from common import launch_payload; "
        "print(repr(launch_payload.apply(sys.argv[2:])), flush=True)"
    )
    line = f"{sys.executable} -c {shlex.quote(script)} {REPO_ROOT} --local_rank=0 --launch_payload {token}"
    proc = subprocess.run(
        ["bash", "-c", line], capture_output=True, text=True, timeout=scaled(60), env=dict(os.environ, RANK="3")
    )
    assert proc.returncode == 0 and not marker.exists(), proc.stderr
    logs = list((tmp_path / "log s").glob("*_rank3.log"))  # stdout went to the rank's log
    assert len(logs) == 1 and logs[0].read_text().strip() == repr(["--local_rank=0"] + nasty)


@pytest.mark.parametrize(
    "payload,why",
    [
        ({"argv": ["--steps", 3]}, '"argv" must be a list of strings'),
        ({"argv": [], "cwd": 7}, '"cwd" must be a folder path'),
        ({"argv": [], "env": ["A=1"]}, '"env" must map names to strings'),
        ({"argv": [], "log_dir": ["x"]}, '"log_dir" must be a folder path'),
    ],
)
def test_a_launch_payload_with_a_wrong_typed_field_is_one_line(payload, why):
    """A token with a field of the wrong type traced back in `apply` (os.chdir(7), env.items() of a list)."""
    import base64

    token = base64.urlsafe_b64encode(json.dumps(payload).encode()).decode().rstrip("=")
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "run_scripts/train.py"), "--launch_payload", token],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        cwd=REPO_ROOT,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --launch_payload: the token does not decode ({why}"), (
        proc.stderr
    )


def test_failed_run_reports_rank_errors(tsv, tmp_path):
    """When the launcher fails, the script exits with its status and shows the ranks' `error:` lines."""
    fake = tmp_path / "fake_deepspeed"
    fake.write_text(
        'while [ $# -gt 0 ]; do [ "$1" = --enable_each_rank_log ] && d=$2; shift; done\n'
        'mkdir -p "$d"; echo started > "$d/t_rank0.log"\n'
        'echo "error: --vocab_size 100 is too small" > "$d/t_rank1.log"; exit 3\n'
    )
    proc = run_script(RUN, [tsv, 2, "recipes/2pcs/2pcs.json"], script_env(tmp_path / "runs", DEEPSPEED=f"bash {fake}"))
    assert proc.returncode == 3, proc.stderr
    assert "training failed (launcher exit status 3)" in proc.stderr
    assert "error: --vocab_size 100 is too small" in proc.stderr
    launch = only_launch(only_run_dir(tmp_path / "runs"))
    assert f"per-rank logs: {launch}" in proc.stderr
    assert (launch / "command.sh").read_text().splitlines()[-1].startswith(f"bash {fake}")


@pytest.mark.slow
def test_openmpi_launch_runs_with_mpirun_environment(multi30k_tsv, bpe_tokenizer, tmp_path):
    """run_cluster.sh --launcher openmpi on a one-host hostfile, through DeepSpeed's real OpenMPI runner; mpirun is
    a stand-in (tests/fake_openmpi) that starts the ranks with only OMPI_COMM_WORLD_* and the -x exports, as
    OpenMPI does, so train.py must map them itself."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    log = tmp_path / "mpirun.log"
    env = script_env(tmp_path / "runs", PATH=f"{FAKE_MPI}{os.pathsep}{os.environ['PATH']}", FAKE_MPIRUN_LOG=log)
    proc = run_script(
        CLUSTER,
        [
            multi30k_tsv,
            hostfile,
            REPO_ROOT / "recipes/2pcs/2pcs.json",
            "--launcher",
            "openmpi",
            "--steps",
            2,
            "--d_model",
            32,
            "--tokenizer",
            bpe_tokenizer,
            "--tensorboard",
            0,
        ],
        env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    mpirun = log.read_text().split()
    assert mpirun[:2] == ["-n", "2"] and "MASTER_ADDR=localhost" in mpirun
    run_dir = only_run_dir(tmp_path / "runs")
    assert [r["step"] for r in read_metrics(run_dir / "output")] == [1, 2]
    host = socket.gethostname()  # each rank writes its own log (the launch payload says where)
    launch = only_launch(run_dir)
    rank0 = (launch / f"{host}_rank0.log").read_text()
    assert "layout: world=2 dp=1 mp=2 pp=1" in rank0
    assert (launch / f"{host}_rank1.log").exists() and (launch / "hostfile").exists()
    assert f"per-rank logs: {launch}" in proc.stdout


def test_adopt_mpi_env():
    from training.core.distributed import adopt_mpi_env

    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    assert adopt_mpi_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_SIZE"]) == ("3", "8", "1", "4")
    assert not adopt_mpi_env({"WORLD_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "2"})  # a torch launcher came first
    assert not adopt_mpi_env({})
    with pytest.raises(UserError, match="without MASTER_ADDR and MASTER_PORT"):
        adopt_mpi_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})


# ------------------------------------------------------------------------------------- rank tables, hostfiles


def convert(*args):
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "run_scripts/rank_table_to_hostfile.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )


@pytest.mark.parametrize(
    "n,hosts", [(2, [("192.0.2.10", 2)]), (8, [("192.0.2.10", 8)]), (16, [("192.0.2.10", 8), ("192.0.2.11", 8)])]
)
def test_shipped_rank_tables_round_trip(n, hosts, tmp_path):
    table = TABLES / f"rank_table_{n}pcs.json"
    out = tmp_path / "hostfile"
    proc = convert(table, "-o", out)
    assert proc.returncode == 0, proc.stderr
    got = read_hostfile(str(out))
    assert [(h.name, h.slots) for h in got] == hosts
    # hostfile → rank table → hostfile gives the same file; the seed's table format is what we ship
    assert rank_table_to_hosts(hosts_to_rank_table(got)) == got
    data = json.loads(table.read_text())
    assert data["server_count"] == str(len(hosts)) and data["status"] == "completed"
    assert [d["rank_id"] for s in data["server_list"] for d in s["device"]] == [str(r) for r in range(n)]
    assert convert(table).stdout.splitlines()[1:] == [f"{h} slots={s}" for h, s in hosts]
    if n == 16:  # the shipped 2-node hostfile is the 16pcs table
        assert read_hostfile(str(HOSTFILES / "hostfile_2nodes")) == got


def _table(**change):
    t = hosts_to_rank_table([Host("192.0.2.10", 2), Host("192.0.2.11", 2)])
    for key, value in change.items():
        if key == "mutate":
            value(t)
        else:
            t[key] = value
    return t


MALFORMED = [
    ("not-an-object", [1, 2], "expected a JSON object"),
    ("no-server-list", {"version": "1.0"}, 'missing "server_list"'),
    ("empty-server-list", _table(server_list=[], server_count="0"), '"server_list" is empty'),
    ("count-mismatch", _table(server_count="3"), "server_count is 3 but server_list has 2 servers"),
    (
        "no-server-id",
        _table(mutate=lambda t: t["server_list"][1].pop("server_id")),
        'server_list[1]: missing "server_id"',
    ),
    ("no-devices", _table(mutate=lambda t: t["server_list"][0].update(device=[])), '"device" is empty'),
    ("rank-order", _table(mutate=lambda t: t["server_list"][1]["device"].reverse()), "rank_id 3, expected 2"),
    (
        "rank-not-int",
        _table(mutate=lambda t: t["server_list"][0]["device"][0].update(rank_id="zero")),
        "\"rank_id\" is 'zero', not an integer",
    ),
    (
        "duplicate-server",
        _table(mutate=lambda t: t["server_list"][1].update(server_id="192.0.2.10")),
        "server_id 192.0.2.10 appears twice",
    ),
    (
        "duplicate-device",
        _table(mutate=lambda t: t["server_list"][0]["device"][1].update(device_id="0")),
        "device_id repeated",
    ),
]


@pytest.mark.parametrize("name,table,needle", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_rank_tables(name, table, needle):
    with pytest.raises(UserError) as e:
        rank_table_to_hosts(table)
    assert needle in str(e.value)


def test_converter_cli_errors(tmp_path, assert_user_error):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps(_table(server_count="3")))
    assert_user_error(convert(bad), "server_count is 3 but server_list has 2 servers")
    bad.write_text('{"server_list": [}')
    assert_user_error(convert(bad), "is not valid JSON")
    assert_user_error(convert(tmp_path / "missing.json"), "not found")
    assert_user_error(convert(TABLES / "rank_table_2pcs.json", "-o", tmp_path / "no" / "dir" / "h"), "does not exist")


def test_hostfile_parsing():
    text = "# comment\n\nworker-0 slots=8\nworker-1   slots=4 max_slots=4\n"
    assert parse_hostfile_text(text) == [Host("worker-0", 8), Host("worker-1", 4)]
    assert parse_hostfile_text(format_hostfile([Host("a", 2)], header="x\ny")) == [Host("a", 2)]
    for text, needle in [
        ("worker-0\n", "line 1: 'worker-0' is not 'HOST slots=N'"),
        ("a slots=2\na slots=2\n", "line 2: host a is listed twice"),
        ("a slots=0\n", "has slots=0"),
        ("# nothing\n", "lists no hosts"),
    ]:
        with pytest.raises(UserError, match=needle):
            parse_hostfile_text(text)
    # what editors and people write: a byte-order mark, CRLF, tabs, comments after an entry — read as meant
    messy = "\ufeff# nodes\r\nworker-0\tslots=8  # the first\r\n\t\r\nworker-1 slots=4\r\n"
    assert parse_hostfile_text(messy) == [Host("worker-0", 8), Host("worker-1", 4)]
    for text, needle in [
        (
            "a\u200b slots=2\n",
            r"line 1: host 'a\\u200b' holds characters a terminal does not "
            r"show \(U\+200B\)",
        ),
        ("a;touch${IFS}x slots=2\n", "holds characters other than letters"),
        ("x slots=1\na slots=2\n\na slots=2\n", "line 4: host a is listed twice \\(first on line 2\\)"),
    ]:
        with pytest.raises(UserError, match=needle):
            parse_hostfile_text(text)
    nodes = rank_nodes(12, [Host("a", 8), Host("b", 4)])
    assert nodes[7] == (0, "a", 7) and nodes[8] == (1, "b", 0)
    assert rank_nodes(10, ranks_per_node=4)[9] == (2, "node2", 1)
    with pytest.raises(UserError, match="has 12 slots"):
        rank_nodes(16, [Host("a", 8), Host("b", 4)])


def test_run_cluster_hands_the_launcher_a_clean_hostfile(tsv, tmp_path):
    """A hostfile with a byte-order mark and CRLF (written on Windows) launches with a clean copy in the run folder
    (DeepSpeed would otherwise take the BOM into the first host's name and retry that address until a timeout); a
    duplicate host is one line, nothing started."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_bytes("\ufeff127.0.0.1 slots=2\r\n# end\r\n".encode("utf-8"))
    runs = tmp_path / "runs"
    echo = tmp_path / "ds.py"  # stands in for the deepspeed command: shows what it was given
    echo.write_text("import sys\nprint(sys.argv[1:])\n")
    env = script_env(runs, DEEPSPEED=f"{sys.executable} {echo}")
    proc = run_script(CLUSTER, [tsv, hostfile, REPO_ROOT / "recipes/cpu-tiny/cpu-tiny.json"], env)
    assert proc.returncode == 0, proc.stderr
    launch = only_launch(only_run_dir(runs))
    assert (launch / "hostfile").read_text() == "127.0.0.1 slots=2\n"
    assert f"'--hostfile', '{launch / 'hostfile'}'" in proc.stdout and "'--master_addr', '127.0.0.1'" in proc.stdout
    hostfile.write_text("127.0.0.1 slots=1\n127.0.0.1 slots=1\n")
    proc = run_script(CLUSTER, [tsv, hostfile, REPO_ROOT / "recipes/cpu-tiny/cpu-tiny.json"], env)
    assert proc.returncode == 2 and proc.stderr.startswith("error: hostfile") and "listed twice" in proc.stderr


def test_the_tests_rank_spawner_gives_what_deepspeeds_launcher_gives(tmp_path):
    """tests/drivers/spawn_ranks.py (the numeric tests' multi-rank launches) starts each rank with the command-line
    flag and distributed environment DeepSpeed's per-node launcher gives it, and like it ends the job with a failing
    rank's exit code."""
    from tests.launch import _fork_server, env, launch_cmd, run_python

    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, os, sys\n"  # the whole environment but the (free) port
        "env = {k: v for k, v in os.environ.items() if k != 'MASTER_PORT'}\n"
        "with open(sys.argv[-1] + os.environ['RANK'], 'w') as f:\n"
        "    json.dump({'argv': sys.argv[1:-1], 'parent': os.getppid(), **env}, f)\n"
        "if 'fail' in sys.argv:\n"  # rank 1 fails while the others wait for it
        "    sys.exit(3) if os.environ['RANK'] == '1' else __import__('time').sleep(600)\n"
    )
    parents = {}

    def ranks(out):
        seen = [json.loads(Path(f"{out}{r}").read_text()) for r in range(3)]
        parents[out.name] = {r.pop("parent") for r in seen}
        return [{k: v for k, v in r.items() if k != "DSR_FORK_SERVER"} for r in seen]

    seen = {}
    for launcher in ("spawn", "deepspeed"):
        out = tmp_path / launcher
        # as the tests start them: through the fork server, whose ranks are its forks too
        proc = run_python(launch_cmd(3, str(probe), launcher=launcher) + ["x", out], env=env(), timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen[launcher] = ranks(out)
    # and the spawner started on its own (no fork server): its ranks are new interpreters
    own = subprocess.run(
        launch_cmd(3, str(probe)) + ["x", tmp_path / "own"],
        cwd=REPO_ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert own.returncode == 0, own.stderr[-2000:]
    assert seen["spawn"] == seen["deepspeed"] == ranks(tmp_path / "own")
    server = _fork_server["proc"].pid  # the spawner's ranks are forks of the server, or new processes
    assert parents["spawn"] == {server} and server not in parents["own"] | parents["deepspeed"]
    assert [(r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"], r["LOCAL_SIZE"]) for r in seen["spawn"]] == [
        (str(r), str(r), "3", "3") for r in range(3)
    ]
    assert [r["argv"] for r in seen["spawn"]] == [[f"--local_rank={r}", "x"] for r in range(3)]
    for start_it in (
        lambda cmd: run_python(cmd, env=env(), timeout=120),
        lambda cmd: subprocess.run(cmd, cwd=REPO_ROOT, env=env(), capture_output=True, text=True, timeout=scaled(120)),
    ):
        start = time.time()
        failed = start_it(launch_cmd(3, str(probe)) + ["fail", tmp_path / "f"])
        # the waiting ranks were ended, not waited for
        assert failed.returncode == 3 and time.time() - start < scaled(30)


@pytest.mark.parametrize("mode", ["ok", "exit", "raise"])
def test_a_fork_of_the_fork_server_runs_a_script_as_its_own_interpreter_would(mode, tmp_path, monkeypatch):
    """tests/drivers/fork_server.py (how the tests start single-process Python commands): argv, cwd, environment,
    sys.path, __name__, stdout/stderr, exit codes and an uncaught exception's report are the interpreter's."""
    from tests.launch import env, run_python

    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, os, sys\n"
        "print(json.dumps({'argv': sys.argv, 'cwd': os.getcwd(), 'path': sys.path, 'name': __name__, "
        "'x': os.environ.get('X')}))\n"
        "print('to stderr', file=sys.stderr)\n"
        "if sys.argv[1] == 'exit':\n"
        "    sys.exit(3)\n"
        "if sys.argv[1] == 'raise':\n"
        "    raise ValueError('boom')\n"
    )
    cmd = [sys.executable, str(probe), mode, "two words"]
    e = dict(env(), X="42")
    forked = run_python(cmd, cwd=tmp_path, env=e)
    real = subprocess.run(cmd, cwd=tmp_path, env=e, capture_output=True, text=True, timeout=scaled(60))
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)
    assert forked.returncode == {"ok": 0, "exit": 3, "raise": 1}[mode]
    assert json.loads(forked.stdout)["x"] == "42" and forked.stderr.startswith("to stderr")
    if mode == "ok":  # a fork of the server; with DSR_TEST_FORK=0 (the failure tests) a new interpreter
        from tests.launch import _fork_server

        parent = "import os; print(os.getppid())"
        (tmp_path / "parent.py").write_text(parent)
        assert int(run_python([sys.executable, tmp_path / "parent.py"], env=e).stdout) == _fork_server["proc"].pid
        monkeypatch.setenv("DSR_TEST_FORK", "0")
        assert int(run_python([sys.executable, tmp_path / "parent.py"], env=e).stdout) == os.getpid()


def test_the_fork_server_forks_with_one_thread_or_does_not_start(tmp_path):
    """A fork copies only the forking thread; a lock another thread held stays locked in the child. The session's
    server has one thread (pyarrow's jemalloc starts a background thread on import unless told not to); with
    OpenBLAS's threads (OMP_NUM_THREADS=2) it refuses to start, naming them."""
    from tests.launch import FORK_SERVER, _fork_server, env, run_python

    assert run_python([sys.executable, "-m", "json.tool", "--help"], env=env()).returncode == 0
    if os.environ.get("DSR_TEST_FORK") != "0":
        assert len(os.listdir(f"/proc/{_fork_server['proc'].pid}/task")) == 1
    threaded = subprocess.run(
        [sys.executable, FORK_SERVER, tmp_path / "socket"],
        env=dict(env(), OMP_NUM_THREADS="2"),
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert threaded.returncode == 1 and "fork server: 2 threads after the imports (" in threaded.stderr
    assert not (tmp_path / "socket").exists()


@pytest.mark.skipif(os.environ.get("DSR_TEST_FORK") == "0", reason="DSR_TEST_FORK=0: no fork server")
def test_a_forked_command_builds_an_optimizer_without_importing_torch_dynamo(tmp_path):
    """torch imports torch._dynamo when the first optimizer is built (1.2 s of CPU, a training command's largest
    start cost after the server's imports): the server has imported it, so a fork builds one importing nothing."""
    from tests.launch import env, run_python

    probe = tmp_path / "optimizer.py"
    probe.write_text(
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    proc = run_python([sys.executable, probe], env=env())
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout[-2000:] + proc.stderr[-2000:]


def test_a_session_s_fork_server_leaves_nothing_in_tmp(tmp_path):
    """A test session that started the fork server removes the server and its socket's folder when it ends
    (before, every suite run left two dsr-fork-* folders in /tmp)."""
    from tests.launch import env

    session = (
        "import sys\n"
        "from tests.launch import _fork_server, run_python\n"
        "proc = run_python([sys.executable, '-m', 'json.tool', '--help'])\n"
        "assert proc.returncode == 0, proc.stderr\n"
        "print(_fork_server['path'], _fork_server['proc'].pid)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", session], cwd=REPO_ROOT, env=env(), capture_output=True, text=True, timeout=scaled(120)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    path, pid = done.stdout.split()
    assert path.startswith("/tmp/dsr-fork-") and not Path(path).parent.exists()
    assert not Path(f"/proc/{pid}").exists()


@pytest.mark.skipif(os.environ.get("DSR_TEST_FORK") == "0", reason="DSR_TEST_FORK=0: no fork server")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_killed_session_s_fork_server_ends_its_commands_and_leaves_nothing_in_tmp(sig, tmp_path):
    """A test session's process group killed (SIGTERM from CI's cancel or `timeout`, which pytest does not handle,
    or SIGKILL: no atexit runs) while a command it started runs: its fork server, which no signal to the group
    reaches, ends that command — in a process group of its own, which the signal did not reach either — and removes
    its socket's folder. Before: the server died with the group, its folder stayed and the command ran on."""
    from tests.launch import env
    from tests.progress import running, wait_until

    pid_file = tmp_path / "command.pid"
    (tmp_path / "long.py").write_text(
        "import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    )
    session = (
        "import sys, threading, time\n"
        "from tests.launch import _fork_server, run_python\n"
        f"cmd = [sys.executable, {str(tmp_path / 'long.py')!r}, {str(pid_file)!r}]\n"
        "threading.Thread(target=run_python, args=(cmd,), daemon=True).start()\n"
        "for _ in range(1200):\n"
        "    if _fork_server.get('path') or _fork_server.get('failed'):\n"
        "        break\n"
        "    time.sleep(0.1)\n"
        "print(_fork_server.get('path'), getattr(_fork_server.get('proc'), 'pid', None), flush=True)\n"
        "time.sleep(600)\n"
    )
    popen = subprocess.Popen(
        [sys.executable, "-c", session],
        cwd=REPO_ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a group of its own, as a suite's: the signal goes to the whole group
    )
    try:
        path, server = popen.stdout.readline().split()
        assert path != "None", "the fork server did not start"
        wait_until(lambda: pid_file.exists() and pid_file.read_text(), popen, 60, "the command's start")
        command = int(pid_file.read_text())
    finally:
        os.killpg(popen.pid, sig)
        popen.wait()

    def left() -> list[str]:
        folder = [path] if Path(path).parent.exists() else []
        return folder + [f"pid {pid}" for pid in (int(server), command) if running(pid)]

    deadline = time.monotonic() + scaled(30)
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == []


@pytest.mark.parametrize("forked", [True, False])
def test_a_commands_time_limit_grows_with_the_load(forked, tmp_path, monkeypatch):
    """A test's limit on a command is the idle machine's, times the load seen (tests/progress.py): beside four
    training jobs (load 30 on 2 cores) a 2-rank start took past its fixed 240 s and the test failed, not the code."""
    from tests import progress
    from tests.launch import env, run_python

    if not forked:
        monkeypatch.setenv("DSR_TEST_FORK", "0")
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(3)\nprint('done')\n")
    monkeypatch.setattr(progress, "_worst", [4.0])  # as if the load had been 4× the cores
    proc = run_python([sys.executable, tmp_path / "slow.py"], env=env(), timeout=1.5)
    assert proc.returncode == 0 and proc.stdout == "done\n"
