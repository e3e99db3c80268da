"""Experiment trackers beside metrics.jsonl: Weights & Biases (--wandb PROJECT) and MLflow (--mlflow EXPERIMENT).

The metrics writer (training.core.metrics) feeds them on global rank 0 only: the run record (run.json) as the run's
configuration, and every step record's numbers under metrics.jsonl's keys at its step. A resumed run continues the
tracker runs OUTPUT_DIR/trackers.json names. A tracker is a side channel: one that fails (its service gone, its disk
full, its server unreachable) is turned off with one warning, and training goes on.
docs/metrics-and-validation.md#experiment-trackers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

from common.errors import UserError
from common.staging import atomic_write

DISTRIBUTION = "ds-transformer-recipes"  # setup.cfg's name: its extras [wandb] and [mlflow] install these
RECORD = "trackers.json"  # in OUTPUT_DIR: the tracker runs this folder's run logs to, continued by its resumes


def install_hint(extra: str) -> str:
    """How to install an extra without losing the checkout: `pip install -e '<checkout>[extra]'` (pip install
    '.[extra]', without -e, replaces the editable install with a copy, and copied recipes no longer find the
    checkout's launch scripts); outside a checkout, the package's own distribution."""
    root = Path(__file__).resolve().parents[2]
    if (root / "run_scripts" / "run.sh").is_file():
        return f"pip install -e '{root}[{extra}]'"
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def require(flag: str) -> None:
    """Argument-check time (before any process group): --wandb needs wandb, --mlflow mlflow (and, for the default
    store in OUTPUT_DIR, SQLAlchemy). The specs are looked up, not imported: importing them costs seconds on every
    rank."""
    packages = [flag] + (["sqlalchemy"] if flag == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI") else [])
    for package in packages:
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):  # a finder that refuses it; a broken half-imported module
            found = False
        if not found:
            raise UserError(f"--{flag} needs the {package} package: {install_hint(flag)}, or leave --{flag} out")


def scalars(record: dict) -> dict:
    """The numbers of one metrics.jsonl record, under its keys, `step` left out (it is the tracker's step)."""
    return {
        key: value
        for key, value in record.items()
        if key != "step" and not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    }


class WandbRun:
    flag = "--wandb"

    key = "wandb"

    def __init__(self, project: str, entity: str | None, name: str | None, output_dir: str):
        self.project, self.entity, self.name, self.output_dir = project, entity, name, output_dir
        self._wandb = self._run = None
        self.continued, self.have_through = False, 0

    def start(self, record: dict, earlier: dict | None = None) -> None:
        """earlier: trackers.json's entry of the run this one resumes, continued when it names the same project
        (and entity). An offline run continued writes a second offline-run-* folder with the same id: `wandb sync`
        uploads them, in order, as one run."""
        import wandb

        self._wandb = wandb
        # WANDB_MODE (offline, disabled), WANDB_DIR and the rest of wandb's environment are read by wandb itself;
        # the run folder goes under OUTPUT_DIR unless WANDB_DIR says otherwise. console="off": wandb leaves
        # stdout/stderr alone (the step lines and the one-line errors stay as they are)
        where = None if os.environ.get("WANDB_DIR") else self.output_dir
        mode = None if self.has_credentials(wandb) else "offline"
        if mode:
            folder = os.path.join(os.environ.get("WANDB_DIR") or self.output_dir, "wandb")
            print(
                f"note: --wandb: no W&B credentials here (`wandb login` or WANDB_API_KEY), so the run is logged "
                f"offline in {folder}; upload it later with `wandb sync {folder}/offline-run-*`",
                flush=True,
            )
        self.continued = (
            bool(earlier)
            and (earlier.get("project"), earlier.get("entity")) == (self.project, self.entity)
            and isinstance(earlier.get("id"), str)
        )

        def init(**resume):
            return wandb.init(
                project=self.project,
                entity=self.entity,
                name=self.name,
                dir=where,
                config=record,
                mode=mode,
                settings=wandb.Settings(console="off"),
                **resume,
            )

        if self.continued:
            try:
                self._run = init(id=earlier["id"], resume="allow")
            except Exception as exc:  # noqa: BLE001 - e.g. a run deleted on the server: W&B refuses its id (409)
                self.continued = False
                print(
                    f"note: --wandb: the run this one resumes ({earlier['id']}) cannot be continued "
                    f"({str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}); a new run starts",
                    flush=True,
                )
        if not self.continued:
            self._run = init()
        # online, a resumed run's starting_step is the step after the server's last one (wandb drops, with a
        # warning each time, a step that goes back); offline nothing is known (resumed False): everything is sent
        self.have_through = max(0, self._run.starting_step - 1) if self.continued and self._run.resumed else 0

    def identity(self) -> dict:
        return {"id": self._run.id, "project": self.project, "entity": self.entity}

    @staticmethod
    def has_credentials(wandb) -> bool:
        """Whether wandb may go online: credentials found (WANDB_API_KEY, a settings file, .netrc) or a mode that
        needs none. Without any, wandb.init asks for a key at a terminal — rank 0 blocked while the other ranks
        wait at their next collective — or, without one, raises."""
        if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled") or os.environ.get(
            "WANDB_DISABLED", ""
        ).lower() in ("true", "1"):
            return True
        return bool(wandb.login(prompt=False, verify=False))

    def update(self, record: dict) -> None:
        self._run.config.update(record, allow_val_change=True)

    def log(self, numbers: dict, step: int) -> None:
        self._run.log(numbers, step=step)

    def finish(self, status: str) -> None:
        self._run.finish(exit_code=0 if status == "finished" else 1)
        # the service process ends now, not at interpreter exit: a launched rank leaves by os._exit (no atexit)
        self._wandb.teardown()

    def abandon(self) -> None:
        """After a failure: drop the connection and wandb's exit hook, which would otherwise fail again at exit."""
        if self._wandb is not None:
            with contextlib.suppress(Exception, SystemExit):  # the tracker is already broken; nothing more to say
                self._wandb.teardown()


class MlflowRun:
    flag = "--mlflow"

    key = "mlflow"

    def __init__(self, experiment: str, name: str | None, output_dir: str):
        self.experiment, self.name, self.output_dir = experiment, name, output_dir
        self._mlflow = self._logged = None
        self.continued, self.have_through = False, 0

    def start(self, record: dict, earlier: dict | None = None) -> None:
        """earlier: trackers.json's entry of the run this one resumes, continued when it names the same experiment
        in the same tracking store and the store still has it."""
        import mlflow

        self._mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # mlflow's default, a store in the working folder (and its file store refused since 3.x): the run's own
            # folder instead, a SQLite database with the artifacts beside it
            mlflow.set_tracking_uri(f"sqlite:///{Path(self.output_dir, 'mlflow.db').resolve()}")
            if mlflow.get_experiment_by_name(self.experiment) is None:
                mlflow.create_experiment(
                    self.experiment, artifact_location=Path(self.output_dir, "mlruns").resolve().as_uri()
                )
        mlflow.set_experiment(self.experiment)
        self._logged = set()
        if (
            earlier
            and (earlier.get("experiment"), earlier.get("tracking_uri")) == (self.experiment, mlflow.get_tracking_uri())
            and isinstance(earlier.get("run_id"), str)
        ):
            try:
                # what the store has (the steps a killed run logged but still had queued, log_metrics being
                # asynchronous, are not there); every training record has an lr
                have = max(
                    (m.step for m in mlflow.tracking.MlflowClient().get_metric_history(earlier["run_id"], "lr")),
                    default=0,
                )
                run = mlflow.start_run(run_id=earlier["run_id"])  # refuses a deleted run, changing nothing
                self.continued, self.have_through = True, have
                # a parameter keeps its first value (MLflow refuses a change); run.json, the artifact, is the latest
                self._logged = set(run.data.params)
            except mlflow.exceptions.MlflowException as exc:
                print(
                    f"note: --mlflow: the run this one resumes ({earlier['run_id']}) cannot be continued "
                    f"({str(exc).splitlines()[0][:200]}); a new run starts",
                    flush=True,
                )
        if not self.continued:
            mlflow.start_run(run_name=self.name)
        self.update(record)

    def identity(self) -> dict:
        return {
            "run_id": self._mlflow.active_run().info.run_id,
            "experiment": self.experiment,
            "tracking_uri": self._mlflow.get_tracking_uri(),
        }

    def update(self, record: dict) -> None:
        # parameters cannot change once logged: the new ones go in (the run record grows at the end), and the
        # whole record each time as the run's run.json artifact
        params = {k: v for k, v in flatten(record).items() if k not in self._logged}
        self._mlflow.log_params(params)
        self._logged |= set(params)
        self._mlflow.log_dict(record, "run.json")

    def log(self, numbers: dict, step: int) -> None:
        # queued, not waited for: rank 0 must not wait for a tracking server at every step (the other ranks would
        # wait for rank 0 at the next collective); end_run sends what is queued
        self._mlflow.log_metrics(numbers, step=step, synchronous=False)

    def finish(self, status: str) -> None:
        self._mlflow.end_run({"finished": "FINISHED", "stopped": "KILLED"}.get(status, "FAILED"))

    def abandon(self) -> None:
        if self._mlflow is not None:
            with contextlib.suppress(Exception):  # the tracker is already broken; nothing more to say
                self._mlflow.end_run("FAILED")


def forget_earlier_runs(output_dir: str) -> None:
    """A fresh start (no checkpoint) in a folder an earlier run used: its tracker runs are not this run's to go on."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(output_dir, RECORD))


def flatten(record: dict, prefix: str = "") -> dict:
    """{"config": {"model": {"d_model": 32}}} → {"config.model.d_model": "32"}: MLflow's parameters are flat
    strings (at most 6000 characters)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:6000]
    return out


class Trackers:
    """The trackers a run chose; each call goes to every one still on."""

    def __init__(self, runs: list, output_dir: str | None = None):
        self._runs, self._started, self._output_dir = list(runs), False, output_dir
        self._chosen = tuple(runs)
        self._step: int | None = None
        self._resuming = False  # from a checkpoint: continue the runs trackers.json names

    @classmethod
    def chosen(
        cls,
        output_dir: str,
        wandb: str | None = None,
        wandb_entity: str | None = None,
        wandb_run_name: str | None = None,
        mlflow: str | None = None,
    ) -> Trackers:
        runs = []
        if wandb:
            runs.append(WandbRun(wandb, wandb_entity, wandb_run_name, output_dir))
        if mlflow:
            runs.append(MlflowRun(mlflow, wandb_run_name, output_dir))
        return cls(runs, output_dir)

    def __bool__(self) -> bool:
        return bool(self._runs)

    def resuming(self) -> None:
        """This run resumes from a checkpoint: its tracker runs continue those trackers.json names, and each is sent
        the steps it does not have yet. The steps it has from before the resume's checkpoint step keep their first
        values: replayed from the checkpoint they are the same numbers (metrics.jsonl holds the new records)."""
        self._resuming = True

    def run_record(self, record: dict) -> None:
        """The first record starts the runs (their configuration); later ones update it."""
        if self._started:
            for run in list(self._runs):
                self._guarded(run, "update", record)
            return
        self._started = True
        earlier = self._read_record() if self._resuming else {}
        for run in list(self._runs):
            self._guarded(run, "start", record, earlier.get(run.key))
        for run in self._runs:
            if run.continued:
                print(
                    f"note: {run.flag} continues the run named in {os.path.join(self._output_dir, RECORD)}"
                    + (
                        f" (it has steps through {run.have_through}: those are not sent again)"
                        if run.have_through
                        else ""
                    ),
                    flush=True,
                )
        ids = {}
        for run in self._runs:
            with contextlib.suppress(Exception):  # without its identity a resume starts a new tracker run, no more
                ids[run.key] = run.identity()
        # a tracker chosen but off (it failed to start) loses its entry: the next resume starts a new run rather
        # than meet the same failure; the entries of trackers not chosen this time stay
        chosen = {run.key for run in self._chosen}
        self._write_record({**{k: v for k, v in earlier.items() if k not in chosen}, **ids})

    def log(self, record: dict) -> None:
        self._step = record["step"]
        numbers = scalars(record)
        for run in list(self._runs):
            if self._step > run.have_through:
                self._guarded(run, "log", numbers, self._step)

    def _read_record(self) -> dict:
        try:
            with open(os.path.join(self._output_dir, RECORD), encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):  # none yet (a run before trackers.json existed), or damaged
            return {}
        return {k: v for k, v in record.items() if isinstance(v, dict)} if isinstance(record, dict) else {}

    def _write_record(self, record: dict) -> None:
        path = os.path.join(self._output_dir, RECORD)
        try:
            with atomic_write(path) as f:
                json.dump(record, f, indent=1)
        except OSError as exc:
            print(
                f"warning: could not write {path} ({exc.strerror}): a resume of this run will start new tracker runs",
                file=sys.stderr,
                flush=True,
            )

    def close(self, status: str) -> None:
        """status: finished, stopped (a stop request) or failed."""
        for run in list(self._runs):
            self._guarded(run, "finish", status)
        self._runs = []

    def _guarded(self, run, method: str, *args) -> None:
        try:
            getattr(run, method)(*args)
        except Exception as exc:  # noqa: BLE001 - any failure of a side channel must leave training running
            self._runs.remove(run)
            run.abandon()
            at = f" at step {self._step}" if self._step is not None else ""
            why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            print(
                f"warning: {run.flag} tracking stopped{at} ({why}); training goes on, metrics.jsonl keeps every step",
                file=sys.stderr,
                flush=True,
            )
