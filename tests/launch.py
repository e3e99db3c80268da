"""Run run_scripts/train.py on N processes as a DeepSpeed launch would (see launch_cmd) and read back what it
wrote; the helpers the test files share (defined here once: tests/test_repository_layout.py refuses a copy):

- train_flags: a tiny run's train.py flags; run_tool: a run_scripts/ command;
- step_dir, merged, read_metrics, losses: a run's checkpoint folder, a checkpoint merged, its metrics;
- one_error, usage_error: the one `error: ` line of a refused command (conftest's assert_user_error: the
  strict form).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.multiproc import free_port
from tests.progress import scaled

REPO_ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(REPO_ROOT / "run_scripts" / "train.py")
TRAIN_MANY = str(REPO_ROOT / "tests" / "drivers" / "train_many.py")
SPAWN = str(REPO_ROOT / "tests" / "drivers" / "spawn_ranks.py")
FORK_SERVER = str(REPO_ROOT / "tests" / "drivers" / "fork_server.py")

# Tiny but complete: 2 encoder + 2 decoder blocks, 4 heads, padded sentences, real Multi30k batches.
# fmt: off
TINY_MODEL = [
    "--d_model", "32", "--num_heads", "4", "--ffn_size", "64", "--encoder_layer", "2", "--decoder_layer", "2",
    "--src_len", "12", "--tgt_len", "12",
]
TINY = [
    *TINY_MODEL,
    "--batch_size", "16", "--lr", "1e-3", "--seed", "7", "--dropout", "0", "--tensorboard", "0", "--log_interval", "5",
]
# fmt: on

_fork_server: dict = {}  # the session's server: its process, socket path, a start lock


def _fork_server_socket():
    """The session's fork server (tests/drivers/fork_server.py), started on first use; None where it cannot run
    (DSR_TEST_FORK=0, no AF_UNIX): commands then start their own interpreter."""
    import socket
    import tempfile
    import threading

    if os.environ.get("DSR_TEST_FORK", "1") == "0" or not hasattr(socket, "send_fds"):
        return None
    lock = _fork_server.setdefault("lock", threading.Lock())
    with lock:
        if _fork_server.get("failed"):
            return None
        proc = _fork_server.get("proc")
        if proc is None or proc.poll() is not None:
            folder = tempfile.mkdtemp(prefix="dsr-fork-", dir="/tmp" if os.path.isdir("/tmp") else None)
            path = os.path.join(folder, "socket")
            proc = subprocess.Popen(
                [sys.executable, FORK_SERVER, path],
                cwd=REPO_ROOT,
                env=env(),
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,  # a signal to the suite's group (CI's cancel, `timeout`, Ctrl-C) leaves it to
                # end the commands it forked, which that signal does not reach, once this process is gone
            )
            for line in proc.stdout:  # DeepSpeed's import logs to stdout first
                if line.strip() == "ready":
                    break
            else:  # e.g. a socket path too long: every command starts its own
                print(
                    f"tests: the fork server did not start (rc={proc.wait()}); starting a new interpreter for "
                    f"every command",
                    file=sys.stderr,
                    flush=True,
                )
                _fork_server["failed"] = True
                _stop_fork_server(proc, folder)
                return None
            proc.stdout.close()
            import atexit

            atexit.register(_stop_fork_server, proc, folder)
            _fork_server.update(proc=proc, path=path)
        return _fork_server["path"]


def _stop_fork_server(proc: subprocess.Popen, folder: str) -> None:
    """End the session's fork server and remove its socket's folder (a suite leaves nothing in /tmp)."""
    import shutil

    proc.kill()
    proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


def run_python(cmd: list, cwd=REPO_ROOT, env: dict = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)` for a command
    `python SCRIPT ...` or `python -m MODULE ...`, started as a fork of the session's fork server (its own process,
    exit code and output, without importing torch and DeepSpeed again: tests/drivers/fork_server.py). `timeout` is
    the limit on an idle machine, scaled by the load seen (tests/progress.py): beside other jobs all is slower."""
    import signal
    import tempfile

    timeout = scaled(timeout)
    cmd = [str(c) for c in cmd]
    rest = cmd[2:] if cmd[1:2] == ["-u"] else cmd[1:]  # `python [-u] SCRIPT|-m MODULE ...`
    forkable = cmd[0] == sys.executable and bool(rest) and (rest[0] == "-m" or not rest[0].startswith("-"))
    path = _fork_server_socket() if forkable else None
    if path is None:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    from tests.drivers.fork_server import request_fork

    # the ranks a spawner starts are forks too (tests/drivers/spawn_ranks.py reads DSR_FORK_SERVER)
    child_env = dict(os.environ if env is None else env, DSR_FORK_SERVER=path)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        conn, answers, pid = request_fork(path, cmd, cwd, child_env, out.fileno(), err.fileno())
        conn.settimeout(timeout)
        try:
            line = answers.readline()
        except TimeoutError:
            os.killpg(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(cmd, timeout) from None
        finally:
            conn.close()
        if not line:
            raise RuntimeError(f"the fork server went away while {cmd} ran")
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(
            cmd, int(line), out.read().decode(errors="replace"), err.read().decode(errors="replace")
        )


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")  # 8 ranks on 2 cores: no thread oversubscription
    e.pop("WORLD_SIZE", None)
    e.pop("RANK", None)
    e.pop("LOCAL_RANK", None)
    return e


def launch_cmd(nproc: int, script: str = TRAIN, launcher: str = "spawn", port: int = None) -> list[str]:
    """The command that starts `script` on `nproc` ranks of this machine.

    launcher "spawn" (the tests' numeric runs): tests/drivers/spawn_ranks.py, which starts each rank with the
    environment and `--local_rank` DeepSpeed's per-node launcher gives it, without importing DeepSpeed first (about
    3.5 s saved per launch on a 2-core CPU; tests/test_launch_scripts.py checks the ranks see the same).
    launcher "deepspeed": DeepSpeed's own per-node launcher, exactly what `deepspeed --num_gpus N` execs on one node
    (the world encoded by the runner's encode_world_info) — for tests whose subject is what the launcher does when a
    rank fails. run.sh and the recipes' tests go through the `deepspeed` runner itself, as users do.
    `port`: the master port (default: one of tests.multiproc.free_port, which no other test process can get)."""
    if nproc == 1:
        return [sys.executable, script]
    port = port or free_port()
    if launcher == "spawn":
        return [sys.executable, SPAWN, f"--nproc={nproc}", f"--master_port={port}", script]
    from deepspeed.launcher.runner import encode_world_info

    world = encode_world_info({"localhost": list(range(nproc))})
    return [
        sys.executable,
        "-u",
        "-m",
        "deepspeed.launcher.launch",
        f"--world_info={world}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        script,
    ]


def train_flags(tsv, tok, out, *extra, cache=None) -> list:
    """train.py's flags for a TINY run on `tsv` with tokenizer `tok` into `out` (then `extra`); `cache`: its
    --cache_dir."""
    return [
        "--file_path",
        tsv,
        "--tokenizer",
        tok,
        *(["--cache_dir", cache] if cache is not None else []),
        "--output_dir",
        out,
        *TINY,
        *extra,
    ]


def run_train(
    nproc: int, args: list, timeout: float = 300, check: bool = True, launcher: str = "spawn"
) -> subprocess.CompletedProcess:
    proc = run_python(launch_cmd(nproc, launcher=launcher) + [str(a) for a in args], env=env(), timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"train.py on {nproc} process(es) failed (rc={proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def run_many(nproc: int, runs: list, workdir, *driver_flags, timeout: float = 900) -> subprocess.CompletedProcess:
    """Several train.py runs of the same world size in one launch (tests/drivers/train_many.py); `runs` is a list
    of train.py argument lists (or {"load_and_save": argv}: see the driver). Raises with the launch's output if any
    run fails."""
    runs_file = Path(workdir) / f"runs-{nproc}-{os.getpid()}-{len(runs)}.json"
    runs_file.write_text(
        json.dumps(
            [
                {k: [str(a) for a in v] for k, v in entry.items()}
                if isinstance(entry, dict)
                else [str(a) for a in entry]
                for entry in runs
            ]
        )
    )
    proc = run_python(launch_cmd(nproc, TRAIN_MANY) + [str(runs_file), *driver_flags], env=env(), timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"train_many on {nproc} process(es) failed (rc={proc.returncode}):\n"
            f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def attempt_dir(root, what: str) -> Path:
    """A new folder under `root` for one launch: a fixture that launches again after a failed launch (its tests ask
    for a run the failure left undone) never writes into the failed attempt's output folders, which train.py would
    refuse ("already holds checkpoints") — one failure must not fail every later case."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"{what}-", dir=root))


def concurrently(*calls, workers: int = 2) -> list:
    """Call each zero-argument function (each starts a process and waits for it) two at a time; their results in
    order. A single-process CLI run spends most of its time importing torch on one core: two at once keep both of
    a 2-core machine busy. Only for runs that touch disjoint files."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def step_dir(out, step: int) -> Path:
    """The folder of a run's checkpoint of step `step` (`out`: the run's --output_dir)."""
    return Path(out) / "checkpoints" / f"step_{step:08d}"


def merged(ckpt) -> dict:
    """A checkpoint folder's full state with the optimizer's (dstr-merge-checkpoint's merge)."""
    from training.cli.merge_checkpoint import merge

    return merge(str(ckpt), with_optimizer=True)


def run_tool(script, *args, cwd=REPO_ROOT, stdin=None) -> subprocess.CompletedProcess:
    """run_scripts/SCRIPT (or a path) with ARGS, captured; `stdin`: a file to redirect it from (a shell's `< FILE`)."""
    cmd = [
        sys.executable,
        str(script if os.path.isabs(str(script)) else REPO_ROOT / "run_scripts" / script),
        *map(str, args),
    ]
    if stdin is None:
        return run_python(cmd, cwd=cwd, env=env())
    with open(stdin, "rb") as f:
        return subprocess.run(cmd, cwd=cwd, env=env(), stdin=f, capture_output=True, text=True, timeout=scaled(300))


def one_error(proc: subprocess.CompletedProcess, *needles: str, returncode: int = None, alone: bool = False) -> str:
    """The one `error: ` line of a command that failed as a user error should: no traceback, exactly one such line
    (in stdout and stderr together; `alone`: stderr holds that line and nothing else), holding each of `needles`.
    `returncode`: the exit status it must have (None: any but 0)."""
    text = (proc.stdout or "") + (proc.stderr or "")
    if returncode is None:
        assert proc.returncode != 0, f"expected failure, got rc=0\n{text[-3000:]}"
    else:
        assert proc.returncode == returncode, (proc.returncode, text[-3000:])
    assert "Traceback" not in text, text[-4000:]
    if alone:
        lines = (proc.stderr or "").strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), f"expected one error line, got:\n{proc.stderr}"
    else:
        lines = [line for line in text.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1, text[-4000:]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def usage_error(proc: subprocess.CompletedProcess, *needles: str, alone: bool = False) -> str:
    """one_error for a command refused as a usage error: exit status 2 (common.errors.run_cli)."""
    return one_error(proc, *needles, returncode=2, alone=alone)


def read_metrics(output_dir) -> list[dict]:
    """metrics.jsonl's whole records (a run still writing may have half a line at the end: left out)."""
    path = Path(output_dir) / "metrics.jsonl"
    whole = path.read_text().rpartition("\n")[0]
    return [json.loads(line) for line in whole.splitlines() if line.strip()]


def losses(output_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(output_dir)]


def script_env(runs_dir, **extra) -> dict:
    """Environment for run_scripts/run.sh / run_cluster.sh in tests: this interpreter, DeepSpeed's runner as a
    module, a free master port, runs under `runs_dir`, rank 0's log not echoed."""
    e = env()
    for key in ("LAUNCHER", "LAUNCHER_ARGS", "DRY_RUN", "RUN_NAME", "MASTER_ADDR"):
        e.pop(key, None)
    e.update(
        PYTHON=sys.executable,
        DEEPSPEED=f"{sys.executable} -m deepspeed.launcher.runner",
        MASTER_PORT=str(free_port()),
        RUNS_DIR=str(runs_dir),
        QUIET="1",
    )
    e.update({k: str(v) for k, v in extra.items()})
    return {k: v for k, v in e.items() if v != ""}


def run_script(script: str, args: list, env_: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """`bash SCRIPT ARGS...` from the repository root (script relative to it); `timeout` scaled as run_python's."""
    return subprocess.run(
        ["bash", str(REPO_ROOT / script), *map(str, args)],
        cwd=REPO_ROOT,
        env=env_,
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
    )


def only_run_dir(runs_dir) -> Path:
    dirs = [p for p in Path(runs_dir).iterdir() if p.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def launches(run_dir) -> list[Path]:
    """A run folder's launches, oldest first: RUN/logs/<time>/ (command.sh, env.log, launcher.log, rank logs)."""
    return sorted(p for p in (Path(run_dir) / "logs").iterdir() if p.is_dir())


def only_launch(run_dir) -> Path:
    found = launches(run_dir)
    assert len(found) == 1, found
    return found[0]
