"""The installed commands (setup.cfg's console_scripts, dstr-*):

- every entry point resolves to a function of the installed packages that leaves through common.errors.run_cli;
- no name is one that an installed distribution (DeepSpeed's ds*, deepspeed, dsr...) already installs;
- the scripts pip would write for them (its own script maker, into a temporary folder: the shared environment's
  installation is left alone) answer --help with exit 0, and say the same as run_scripts/X.py --help; the usage
  line and the examples name the dstr-* command (not `python run_scripts/X.py`, `python -m preprocess.X`);
- DeepSpeed's launcher runs the installed train command on two ranks (`deepspeed --num_gpus 2 $(which dstr-train)`).
"""

import ast
import configparser
import importlib
import inspect
import os
import re
import subprocess
import sys
import textwrap
from importlib.metadata import distributions

import pytest

from tests.launch import REPO_ROOT, TINY, concurrently, env, read_metrics
from tests.multiproc import free_port
from tests.progress import scaled

OURS = "ds-transformer-recipes"


def entry_points() -> dict[str, str]:
    """{command: "module:function"} from setup.cfg."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO_ROOT / "setup.cfg")
    lines = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict(tuple(part.strip() for part in line.split("=", 1)) for line in lines if line.strip())


def resolve(target: str):
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def test_every_tool_has_a_command_with_the_prefix():
    names = entry_points()
    assert all(name.startswith("dstr-") for name in names), names
    wanted = {
        "train",
        "translate",
        "evaluate",
        "plan",
        "export-hf",
        "average-checkpoints",
        "merge-checkpoint",
        "convert-checkpoint",
        "plot-metrics",
        "prepare-tsv",
        "prepare-tokenizer",
        "prepare-dataset",
        "prepare-wmt14",
    }
    assert {f"dstr-{w}" for w in wanted} <= set(names), sorted(names)


def test_entry_points_resolve_inside_the_installed_packages_and_leave_through_run_cli():
    cfg = configparser.ConfigParser()
    cfg.read(REPO_ROOT / "setup.cfg")
    packages = cfg["options.packages.find"]["include"].split()
    for name, target in entry_points().items():
        function = resolve(target)
        assert callable(function), (name, target)
        module = target.split(":")[0]
        assert module.split(".")[0] in packages, (name, target)
        # the function's own body calls run_cli: one exit path, user mistakes in one line
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        calls = {
            getattr(n.func, "id", getattr(n.func, "attr", None)) for n in ast.walk(tree) if isinstance(n, ast.Call)
        }
        assert "run_cli" in calls, (name, target)
        wrapped = getattr(function, "main", None)  # common.errors.console_script(main)
        assert wrapped is None or wrapped is importlib.import_module(module).main, (name, target)


def test_no_installed_distribution_uses_our_names():
    ours = set(entry_points())
    taken = {}
    for dist in distributions():
        if (dist.metadata["Name"] or "").lower() == OURS:
            continue  # this repository, installed editable: its own commands
        for ep in dist.entry_points:
            if ep.group == "console_scripts":
                taken[ep.name] = dist.metadata["Name"]
        for file in dist.files or ():  # plain scripts (setup.py's scripts=: DeepSpeed's ds, dsr, ...)
            if file.parent.name == "bin":
                taken[file.name] = dist.metadata["Name"]
    assert {"deepspeed", "ds", "dsr"} <= set(taken), "DeepSpeed's commands are not seen: the check would be empty"
    clash = {name: taken[name] for name in ours & set(taken)}
    assert not clash, f"commands that another distribution installs too: {clash}"


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """The console scripts pip writes at install time (its own script maker, the same template), in a temporary
    folder; they import the packages from PYTHONPATH (this checkout, tests.launch.env). The maker runs in its own
    interpreter: pip's vendored distlib imports the standard library's distutils, after which setuptools (which
    test_repository_layout imports) refuses to load in this process."""
    folder = tmp_path_factory.mktemp("bin")
    code = (
        "import sys\n"
        "from pip._vendor.distlib.scripts import ScriptMaker\n"
        "maker = ScriptMaker(None, sys.argv[1])\n"
        "maker.executable = sys.executable\n"
        "maker.variants = {''}\n"
        "for spec in sys.argv[2:]:\n"
        "    maker.make(spec)\n"
    )
    specs = [f"{name} = {target}" for name, target in entry_points().items()]
    subprocess.run([sys.executable, "-c", code, str(folder), *specs], check=True, timeout=scaled(120))
    return folder


def run_script(path, *args, cwd=None, timeout=300):
    # a fresh interpreter, through the script's #! line, as a user's shell runs it
    return subprocess.run(
        [str(path), *map(str, args)], cwd=cwd, env=env(), capture_output=True, text=True, timeout=scaled(timeout)
    )


def test_the_installed_commands_answer_help(scripts, tmp_path):
    names = sorted(entry_points())
    results = concurrently(*[lambda n=n: run_script(scripts / n, "--help", cwd=tmp_path) for n in names])
    for name, proc in zip(names, results, strict=True):
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        assert proc.stdout.startswith(f"usage: {name} "), (name, proc.stdout[:500])
        assert not older_names(proc.stdout), (name, older_names(proc.stdout))
    # the command and the repository's script are one tool: the same flags, the same name
    shim = subprocess.run(
        [sys.executable, str(REPO_ROOT / "run_scripts" / "translate.py"), "--help"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    command = results[names.index("dstr-translate")]
    assert flag_names(shim.stdout) == flag_names(command.stdout) and "--ckpt_file" in flag_names(command.stdout)
    assert shim.stdout.startswith("usage: dstr-translate ")


def older_names(help_text: str) -> list[str]:
    """Commands a --help names by what they were before the dstr-* commands: `python run_scripts/X.py`,
    `python -m preprocess.X`, or a usage or indented example line that runs `X.py`. DeepSpeed's launcher takes a
    script's path, so `deepspeed ... run_scripts/train.py` stays (README's form)."""
    found = re.findall(r"python (?:run_scripts/\w+\.py|-m preprocess\.\w+)", help_text)
    return found + [line for line in help_text.splitlines() if re.match(r"(?:usage: |  +(?:\S.* \| )?)\w+\.py ", line)]


def flag_names(help_text: str) -> list[str]:
    return sorted({w.strip(",[]") for w in help_text.split() if w.startswith("--")})


def test_a_user_mistake_is_one_line(scripts, tmp_path):
    proc = run_script(scripts / "dstr-plot-metrics", tmp_path / "nothing-here", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nothing-here'}: no metrics.jsonl (give a run's --output_dir or its metrics.jsonl)"
    ]


@pytest.mark.slow
def test_deepspeed_launches_the_installed_train_command(scripts, multi30k_tsv, bpe_tokenizer, tmp_path):
    """`deepspeed --num_gpus 2 $(which dstr-train) ...`: the launcher runs `python -u SCRIPT`, and the console
    script is a Python file — two tensor-parallel ranks train and save."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        str(scripts / "dstr-train"),
        "--file_path",
        multi30k_tsv,
        "--tokenizer",
        bpe_tokenizer,
        "--mp",
        "2",
        "--output_dir",
        out,
        *TINY,
        "--steps",
        "2",
        "--save_checkpoint_steps",
        "2",
    ]
    proc = subprocess.run(
        list(map(str, cmd)), cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=scaled(600)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2]
    assert (out / "checkpoints" / "step_00000002" / "meta.json").is_file()
    assert os.path.basename(str(scripts / "dstr-train")) in proc.stdout + proc.stderr  # the launcher ran it
