"""Experiment trackers (training/core/trackers.py): real train.py runs with --wandb in W&B's offline mode (no
network), read back from the run file wandb wrote — the same numbers at the same steps as metrics.jsonl, run.json as
the config, one run per job whatever the world size —, a tracker whose service dies mid-run turning into one warning
while training goes on, and a missing package as one error line before anything starts."""

import json
import struct
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from tests.launch import REPO_ROOT, TINY, env, read_metrics, run_train
from tests.progress import scaled

# pip install -e '.[test]' installs both (setup.cfg); the missing-package case needs neither
needs_wandb = pytest.mark.skipif(find_spec("wandb") is None, reason="wandb is not installed: pip install -e '.[wandb]'")
needs_mlflow = pytest.mark.skipif(
    find_spec("mlflow") is None or find_spec("sqlalchemy") is None,
    reason="mlflow is not installed: pip install -e '.[mlflow]'",
)


def read_wandb_run(run_dir: Path) -> dict:
    """An offline run's name, config, history ({step: numbers}) and exit code (None: never finished), from its
    run-*.wandb file: wandb's record log (LevelDB's log format: 32 KiB blocks of chunks, each a 7-byte header —
    crc32c, length, kind — then the bytes; kinds 1 whole, 2 first, 3 middle, 4 last) after a 7-byte file header,
    each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    pos, pending, run = 7, b"", {"name": None, "config": {}, "history": {}, "exit_code": None}
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header: padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zeros: the rest of the block is padding
            pos += room
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind not in (1, 4):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        pending = b""
        which = record.WhichOneof("record_type")
        if which == "run":
            run["name"] = record.run.display_name
        if which == "exit":
            run["exit_code"] = record.exit.exit_code
        updates = record.run.config.update if which == "run" else record.config.update if which == "config" else []
        run["config"].update({u.key: json.loads(u.value_json) for u in updates if u.key != "_wandb"})
        if which == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            run["history"][record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return run


def offline_runs(output_dir: Path) -> list[Path]:
    return sorted((output_dir / "wandb").glob("offline-run-*"))


def numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@needs_wandb
def test_wandb_offline_run_has_metrics_and_run_record(multi30k_tsv, bpe_tokenizer, tmp_path, offline):
    """One process, 6 steps with validation every 3: every step's numbers (validation's included) at its step,
    exactly metrics.jsonl's; the config is run.json (the final one, with the optimizer state it adds at the end)."""
    valid = tmp_path / "valid.tsv"
    valid.write_text("".join(multi30k_tsv.read_text(encoding="utf-8").splitlines(keepends=True)[:32]), encoding="utf-8")
    out = tmp_path / "run"
    run_train(
        1,
        [
            "--file_path",
            multi30k_tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--output_dir",
            out,
            *TINY,
            "--steps",
            6,
            "--valid_file",
            valid,
            "--valid_interval",
            3,
            "--wandb",
            "proj",
            "--wandb_run_name",
            "tiny",
        ],
    )
    (run_dir,) = offline_runs(out)
    run = read_wandb_run(run_dir)
    config, history = run["config"], run["history"]
    assert run["name"] == "tiny" and run["exit_code"] == 0
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, 7)) == sorted(history)
    assert {r["step"]: numbers(r) for r in records} == history
    assert "valid_loss" in history[3] and "valid_loss" in history[6] and "grad_norm" in history[1]
    assert config == json.loads((out / "run.json").read_text())
    assert config["config"]["logging"]["wandb"] == "proj" and "optimizer_state_bytes_rank0" in config


@needs_wandb
@pytest.mark.slow
def test_wandb_two_ranks_one_run(multi30k_tsv, bpe_tokenizer, tmp_path, offline):
    """Tensor-parallel on 2 ranks: one run (rank 0's) in the shared output folder, and it has every step."""
    out = tmp_path / "tp2"
    run_train(
        2,
        [
            "--file_path",
            multi30k_tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--output_dir",
            out,
            *TINY,
            "--mp",
            2,
            "--steps",
            4,
            "--wandb",
            "proj",
        ],
    )
    (run_dir,) = offline_runs(out)
    run = read_wandb_run(run_dir)
    assert {r["step"]: numbers(r) for r in read_metrics(out)} == run["history"]
    assert sorted(run["history"]) == [1, 2, 3, 4]
    assert run["config"]["world"] == 2 and run["config"]["mp"] == 2 and run["exit_code"] == 0


@needs_wandb
@pytest.mark.slow
def test_wandb_run_ends_failed_when_training_stops_on_an_error(
    multi30k_tsv, bpe_tokenizer, tmp_path, offline, monkeypatch
):
    """Step 3's loss is nan (--nan_policy stop) on 2 ranks, whose processes leave by os._exit (no exit hooks): the
    run is finished before, marked failed (exit code 1) with steps 1-3, and the job ends with its error line."""
    monkeypatch.setenv("DSR_NAN_AT", "3")
    out = tmp_path / "tp2"
    proc = run_train(
        2,
        [
            "--file_path",
            multi30k_tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--output_dir",
            out,
            *TINY,
            "--mp",
            2,
            "--steps",
            6,
            "--wandb",
            "proj",
        ],
        check=False,
    )
    assert proc.returncode != 0 and "\nerror: step 3: the loss is nan" in proc.stderr, proc.stderr[-3000:]
    (run_dir,) = offline_runs(out)
    run = read_wandb_run(run_dir)
    assert run["exit_code"] == 1 and sorted(run["history"]) == [1, 2, 3] and "loss" not in run["history"][3]


@needs_wandb
def test_wandb_service_killed_mid_run_is_one_warning(multi30k_tsv, bpe_tokenizer, tmp_path, offline, monkeypatch):
    """W&B's service process (wandb-core) SIGKILLed after step 3 (training/faults_for_tests.py): the log of step 3
    fails for real (the connection is gone); one warning, the run finishes every step with exit status 0, and the
    offline run keeps the steps logged before."""
    monkeypatch.setenv("DSR_TRACKER_DOWN_AT", "3")
    out = tmp_path / "run"
    proc = run_train(
        1,
        [
            "--file_path",
            multi30k_tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--output_dir",
            out,
            *TINY,
            "--steps",
            6,
            "--wandb",
            "proj",
        ],
    )
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: --wandb")]
    assert len(warnings) == 1, proc.stderr
    assert warnings[0].startswith("warning: --wandb tracking stopped at step 3 ("), warnings[0]
    assert "training goes on" in warnings[0]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))
    assert json.loads(proc.stdout.rpartition("summary: ")[2].splitlines()[0])["steps"] == 6


@needs_mlflow
def test_mlflow_run_in_output_dir_has_metrics_and_run_record(multi30k_tsv, bpe_tokenizer, tmp_path, offline):
    """No MLFLOW_TRACKING_URI: the store is OUTPUT_DIR/mlflow.db, read back with MLflow's client: one finished run
    named as asked, every number's history exactly metrics.jsonl's, run.json as the run's artifact and parameters."""
    out = tmp_path / "run"
    run_train(
        1,
        [
            "--file_path",
            multi30k_tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--output_dir",
            out,
            *TINY,
            "--steps",
            4,
            "--mlflow",
            "exp",
            "--wandb_run_name",
            "tiny",
        ],
    )
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny"
    records = read_metrics(out)
    for key in numbers(records[0]):
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert got == [(r["step"], r[key]) for r in records], key
    assert set(run.data.metrics) == set(numbers(records[-1]))
    info = json.loads((out / "run.json").read_text())
    assert run.data.params["config.logging.mlflow"] == "exp" and run.data.params["world"] == "1"
    assert run.data.params["optimizer_state_bytes_rank0"] == str(info["optimizer_state_bytes_rank0"])
    artifact = Path(run.info.artifact_uri.removeprefix("file://"), "run.json")
    assert str(artifact).startswith(str(out / "mlruns")) and json.loads(artifact.read_text()) == info


@needs_mlflow
def test_mlflow_server_unreachable_is_one_warning(multi30k_tsv, bpe_tokenizer, tmp_path, monkeypatch):
    """MLFLOW_TRACKING_URI names a server nobody listens on: one warning, and the run trains every step."""
    from tests.multiproc import free_port

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    out = tmp_path / "run"
    proc = run_train(
        1,
        [
            "--file_path",
            multi30k_tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--output_dir",
            out,
            *TINY,
            "--steps",
            3,
            "--mlflow",
            "exp",
        ],
    )
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: --mlflow")]
    assert len(warnings) == 1 and "tracking stopped (" in warnings[0], proc.stderr
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


@needs_wandb
@needs_mlflow
def test_resumed_run_continues_its_tracker_runs(multi30k_tsv, bpe_tokenizer, tmp_path, offline, monkeypatch):
    """A run killed (SIGKILL) right after step 5, its last checkpoint at step 3, resumed to step 6: the resume
    continues the W&B run (a second offline folder with the same id, which `wandb sync` joins) and the MLflow run
    (the same run id, FINISHED again) that OUTPUT_DIR/trackers.json names, and sends each the steps it does not have:
    offline, W&B cannot know, so the new folder has steps 4-6 (wandb-core, its parent killed, ends without writing
    the steps still in its queue: the killed run's folder has some of steps 1-5, the same numbers);
    MLflow's store has no step twice, and every value it has is metrics.jsonl's (the replayed steps are the same
    numbers). A third run, after the MLflow run was deleted from its store, says so and starts a new one."""
    out = tmp_path / "run"
    args = [
        "--file_path",
        multi30k_tsv,
        "--tokenizer",
        bpe_tokenizer,
        "--output_dir",
        out,
        *TINY,
        "--save_checkpoint_steps",
        3,
        "--save_mode",
        "sync",
        "--wandb",
        "proj",
        "--mlflow",
        "exp",
    ]
    monkeypatch.setenv("DSR_CRASH_AT", "train:5")
    killed = run_train(1, [*args, "--steps", 6], check=False)
    assert killed.returncode != 0 and [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5], killed.stderr[-2000:]
    monkeypatch.delenv("DSR_CRASH_AT")
    resumed = run_train(1, [*args, "--steps", 6, "--resume", "auto"])
    for flag in ("--wandb", "--mlflow"):
        assert f"note: {flag} continues the run named in {out / 'trackers.json'}" in resumed.stdout, resumed.stdout[
            -3000:
        ]
    record = json.loads((out / "trackers.json").read_text())
    records = {r["step"]: r for r in read_metrics(out)}
    assert sorted(records) == [1, 2, 3, 4, 5, 6]

    first, second = offline_runs(out)
    assert first.name.endswith(record["wandb"]["id"]) and second.name.endswith(record["wandb"]["id"])
    before, after = read_wandb_run(first)["history"], read_wandb_run(second)
    same = ("loss", "lr", "grad_norm", "tokens", "pairs")  # the numbers a replay repeats (timings differ)
    assert set(before) <= {1, 2, 3, 4, 5}
    assert all({k: before[step][k] for k in same} == {k: records[step][k] for k in same} for step in before), before
    assert after["history"] == {step: numbers(records[step]) for step in (4, 5, 6)} and after["exit_code"] == 0

    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("exp").experiment_id
    (run,) = client.search_runs([experiment])
    assert run.info.run_id == record["mlflow"]["run_id"] and run.info.status == "FINISHED"
    for key in ("loss", "lr", "grad_norm"):
        got = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        steps = [step for step, _ in got]
        assert len(steps) == len(set(steps)) and {4, 5, 6} <= set(steps), (key, got)
        assert all(value == records[step][key] for step, value in got), (key, got)

    client.delete_run(run.info.run_id)
    third = run_train(1, [*args, "--steps", 7, "--resume", "auto"])
    assert f"note: --mlflow: the run this one resumes ({run.info.run_id}) cannot be continued (" in third.stdout
    (new,) = client.search_runs([experiment])
    assert new.info.run_id != run.info.run_id and new.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(new.info.run_id, "loss")] == [7]
    assert json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"] == new.info.run_id


@needs_mlflow
def test_tracker_that_fails_to_start_loses_its_trackers_json_entry(tmp_path, monkeypatch, capsys):
    """A resume whose MLflow server is unreachable: MLflow is turned off with one warning, and trackers.json forgets
    its run (the next resume starts a new one instead of meeting the same failure) but keeps W&B's entry, a tracker
    not chosen this time. A fresh start (step 0) in the folder forgets every earlier run."""
    from tests.multiproc import free_port
    from training.core.metrics import MetricsWriter
    from training.core.trackers import MlflowRun, Trackers

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    record = tmp_path / "trackers.json"
    earlier = {
        "wandb": {"id": "abc", "project": "p", "entity": None},
        "mlflow": {"run_id": "r1", "experiment": "exp", "tracking_uri": "sqlite:///x.db"},
    }
    record.write_text(json.dumps(earlier))
    trackers = Trackers([MlflowRun("exp", None, str(tmp_path))], str(tmp_path))
    writer = MetricsWriter(
        str(tmp_path), enabled=True, total_steps=4, start_step=2, resumed=True, tensorboard=False, trackers=trackers
    )
    writer.run_info({"world": 1})
    writer.close()
    assert "warning: --mlflow tracking stopped (" in capsys.readouterr().err
    assert json.loads(record.read_text()) == {"wandb": earlier["wandb"]}
    MetricsWriter(str(tmp_path), enabled=True, total_steps=4, start_step=0, tensorboard=False).close()
    assert not record.exists()


BLOCK_WANDB = """import sys


class Missing:  # as if wandb were not installed: its import fails as a missing package's does
    def find_spec(self, name, path=None, target=None):
        if name == "wandb" or name.startswith("wandb."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, Missing())
"""


def test_missing_wandb_is_one_line_naming_the_extra(multi30k_tsv, tmp_path, assert_user_error):
    """A fresh interpreter in which `import wandb` fails (a sitecustomize hides it): train.py --wandb stops with one
    line naming the extra, before the output folder or a process group exists."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(BLOCK_WANDB)
    e = env()
    e["PYTHONPATH"] = f"{hide}:{e['PYTHONPATH']}"
    check = subprocess.run([sys.executable, "-c", "import wandb"], env=e, capture_output=True, text=True)
    assert check.returncode != 0 and "No module named 'wandb'" in check.stderr
    out = tmp_path / "never"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "run_scripts" / "train.py"),
            "--file_path",
            str(multi30k_tsv),
            "--output_dir",
            str(out),
            "--wandb",
            "proj",
        ],
        env=e,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    # -e and the checkout: `pip install '.[wandb]'` would replace the editable install (copied recipes need it)
    assert_user_error(proc, f"--wandb needs the wandb package: pip install -e '{REPO_ROOT}[wandb]'")
    assert not out.exists()


@needs_mlflow
def test_deepspeed_import_leaves_mlflow_out_until_asked():
    """DeepSpeed's autotuner imports mlflow when it is installed (1.4 s per rank start, measured);
    common/deepspeed_import.py refuses it that one import: a rank imports training and deepspeed without mlflow, and
    `import mlflow` (train.py --mlflow) still works after."""
    code = (
        "import sys, training, deepspeed; from deepspeed.autotuning import autotuner\n"
        "assert 'mlflow' not in sys.modules and not autotuner.has_mlflow, 'mlflow imported'\n"
        "import mlflow; print('ok', mlflow.__name__)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env(), capture_output=True, text=True, timeout=scaled(120)
    )
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1:] == ["ok mlflow"], proc.stderr[-2000:]
    # without the refusal the same import does bring mlflow in: the check above can fail
    bare = subprocess.run(
        [sys.executable, "-c", "import sys, deepspeed; print('mlflow' in sys.modules)"],
        cwd="/",
        env=env(),
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert bare.stdout.splitlines()[-1:] == ["True"], bare.stderr[-2000:]


@needs_wandb
def test_wandb_without_credentials_logs_offline_and_says_how_to_upload(
    multi30k_tsv, bpe_tokenizer, tmp_path, monkeypatch
):
    """Online mode (no WANDB_MODE) on a machine with no W&B key: wandb.init would ask for one at a terminal (rank 0
    blocked, the other ranks waiting at their next collective) or, with no terminal, fail. The run is logged
    offline instead, with one note naming `wandb login` and the `wandb sync` command."""
    home = tmp_path / "home"
    home.mkdir()
    for name in ("WANDB_MODE", "WANDB_DIR", "WANDB_API_KEY", "WANDB_DISABLED", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb-config"))
    out = tmp_path / "run"
    proc = run_train(
        1,
        [
            "--file_path",
            multi30k_tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--output_dir",
            out,
            *TINY,
            "--steps",
            2,
            "--wandb",
            "proj",
        ],
        timeout=240,
    )
    assert "no W&B credentials here (`wandb login` or WANDB_API_KEY)" in proc.stdout, proc.stdout[-2000:]
    assert f"wandb sync {out / 'wandb'}/offline-run-*" in proc.stdout
    assert "tracking stopped" not in proc.stderr, proc.stderr[-2000:]
    (run_dir,) = offline_runs(out)
    run = read_wandb_run(run_dir)
    assert sorted(run["history"]) == [1, 2] and run["exit_code"] == 0
