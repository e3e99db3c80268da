"""train.py's body: set up, then step → validate → log → save until the last step.

    Trainer(config).train()        config: training.config.sections.TrainConfig (flags.parse_config(argv))

`setup()` does everything that can fail on a user's mistake before any step, cheapest first: the output folder and
its lock (rank 0, before the process group), the process group, where the run starts and the settings it takes from
that checkpoint (decided once, on rank 0), the layout against the world size, the accelerator's precision, the data,
the engine. `train()` then runs the loop; checkpoints,
validation, non-finite steps and metrics each live in their own module and are driven from here.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from common.errors import Stopped, UserError
from training import faults_for_tests
from training.checkpoint.carried_settings import take_settings, trajectory
from training.checkpoint.folder import step_dirname
from training.checkpoint.manager import CheckpointManager
from training.checkpoint.shared_folder import check_output_folder
from training.config.preflight import check_run
from training.config.sections import TrainConfig
from training.core.data import BatchFeeder, batch_schedule, prepare_data
from training.core.data_recheck import DataRecheck
from training.core.distributed import device
from training.core.engine import build_engine, check_precision
from training.core.metrics import MetricsWriter
from training.core.schedule import lr_factor
from training.core.speed import SpeedMeter
from training.core.step import StepTimer, current_lr, eval_step, train_step
from training.core.trackers import Trackers
from training.evaluation.validation import BEST, BestTracker, Validator
from training.run import launch_record
from training.run.job import join_job
from training.run.job_watch import publish_stopping
from training.run.nonfinite_steps import NonFiniteSteps
from training.run.output_lock import claim_output_dir
from training.run.start_point import agree
from training.run.stop_request import StopRequest

LAYOUT_KEYS = ("world", "dp", "mp", "pp", "micro_batch_num", "interleave_num")


class Trainer:
    def __init__(self, config: TrainConfig):
        self.cfg = config
        self._provenance: dict = {}
        self.launches: list[dict] = []  # run.json's "launches" (rank 0): this run's launches, this one last
        self.lock = None
        self.validator: Validator | None = None
        self.tracker: BestTracker | None = None
        self.request = StopRequest()  # installed by train(): a bare setup() (tests' drivers) is not stopped

    # ------------------------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        self.lock = claim_output_dir(self.cfg.checkpoint)  # rank 0: the folder and its lock, first
        self.world = join_job(self.cfg.parallel.distribute, self.cfg.faults.comm_timeout)
        self.rank = dist.get_rank()
        check_output_folder(self.cfg.checkpoint.output_dir)  # every node sees the folder rank 0 claimed
        # where the run starts, decided once on rank 0, and the settings the checkpoint carries
        self.start = agree(self.cfg.checkpoint, report=self._say)
        self.cfg, lines = take_settings(self.cfg, self.start)
        for line in lines:
            self._say(line)
        cfg = self.cfg
        note = cfg.parallel.world_size_note(self.world)
        if note:
            self._say(note)
        # the layout and the DeepSpeed settings before touching data (cheap, and the error users need first); the
        # same checks as plan.py --check, which the launch scripts run before any rank starts
        _, self.parallel = check_run(cfg, self.world)
        check_precision(cfg.parallel.precision)
        self._prepare_data()
        self._build(cfg.data.batch_unit[0])

    def _prepare_data(self) -> None:
        """The token store (built on local rank 0 if needed) and the vocabulary and batch size checked against it."""
        cfg = self.cfg
        with self.request.preparing():  # a stop request ends a long first build at once, leaving nothing of it
            self.data = prepare_data(
                cfg.data.file_path,
                cfg.model.tokenizer,
                cfg.model.src_len,
                cfg.model.tgt_len,
                cfg.model.tokenizer_vocab_size,
                progress=self.rank == 0,
                cache_dir=cfg.data.cache_dir,
                corpus=cfg.data.corpus(),
            )
        self.vocab = cfg.model.vocab_size or self.data.vocab_size
        if self.vocab < self.data.vocab_size:
            raise UserError(
                f"--vocab_size {self.vocab} is smaller than the tokenizer's vocabulary "
                f"({self.data.vocab_size}); use --vocab_size {self.data.vocab_size} or more, or leave it "
                f"out"
            )
        if not cfg.data.max_tokens and cfg.data.batch_size > self.data.num_samples:
            raise UserError(
                f"--batch_size {cfg.data.batch_size} is larger than the dataset ({self.data.num_samples} pairs)"
            )

    def _build(self, batch_unit: int) -> None:
        """The model's config, the batch schedule, the DeepSpeed engine, the feeder and the checkpoint manager."""
        cfg = self.cfg
        self.model_cfg = cfg.model.model_config(vocab_size=self.vocab, pad_id=self.data.pad_id)
        schedule = batch_schedule(
            self.data,
            cfg.data.batch_size,
            cfg.data.seed,
            cfg.data.max_tokens,
            cfg.data.batch_multiple,
            cfg.data.pad_multiple,
            cfg.data.num_batch_buckets,
        )
        opt = cfg.optimization
        self.total_steps = opt.steps if opt.steps is not None else opt.epochs * schedule.batches_per_epoch
        lr_schedule = lr_factor(
            opt.lr_schedule, opt.warmup_steps, opt.horizon(self.total_steps), opt.min_lr_ratio, opt.lr_power
        )

        self.engine = build_engine(
            self.model_cfg,
            self.parallel,
            world_size=self.world,
            global_batch=batch_unit,
            seed=opt.seed,
            lr=opt.lr,
            weight_decay=opt.weight_decay,
            lr_schedule=lr_schedule,
            clip_grad=opt.clip_grad,
            betas=opt.betas,
            eps=opt.adam_eps,
            precision=cfg.parallel.precision,
            pipeline_func=cfg.parallel.pipeline_func,
            ds_overrides=cfg.parallel.deepspeed_overrides,
            ds_config_file=cfg.parallel.deepspeed_config,
        )
        self.feeder = BatchFeeder(
            self.data,
            schedule,
            self.engine.ctx.dp_rank,
            self.engine.ctx.dp_size,
            self.parallel.micro_batch_num,
            device(),
        )
        self.checkpoints = CheckpointManager(
            self.engine,
            cfg.checkpoint,
            cfg.data,
            opt.seed,
            self.model_cfg,
            self.parallel,
            self.data.tokenizer_path,
            validating=bool(cfg.validation.valid_file),
            trajectory=trajectory(cfg, self.total_steps),
        )

    def _say(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

    def load(self) -> int:
        """The checkpoint to start from (if any), then validation's state, which depends on the start step."""
        self.start_step = self.checkpoints.resume(self.start)
        val = self.cfg.validation
        if val.valid_file and self.cfg.optimization.train:
            # the weights alone (no moments, no RNG): what decoding needs, a third of a checkpoint's bytes
            bleu_model = (
                (lambda step: self.checkpoints.save(step, name=".valid_bleu", weights_only=True))
                if val.valid_bleu
                else None
            )
            with self.request.preparing():  # the validation set's store: as the training set's
                self.validator = Validator(
                    val.valid_file,
                    str(self.data.tokenizer_path),
                    self.cfg.model.src_len,
                    self.cfg.model.tgt_len,
                    self.cfg.data.valid_batch_size,
                    self.engine.ctx,
                    self.parallel.micro_batch_num,
                    device(),
                    progress=self.rank == 0,
                    bleu=bleu_model,
                    cache_dir=self.cfg.data.cache_dir,
                    corpus=self.cfg.data.corpus(valid=True),
                )
            self.valid_every = val.valid_interval or self.feeder.schedule.batches_per_epoch
            self.tracker = BestTracker(
                self.checkpoints.root,
                val.early_stop_patience,
                None if self.start.fresh else self.start_step,
                self.valid_every,
            )
        return self.start_step

    def _describe(self) -> dict:
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in self.engine.module.parameters())  # ZeRO-3: full
        return {
            **self.engine.describe(),
            "vocab": self.vocab,
            "params_rank0": n_params,
            "start_step": self.start_step,
            "total_steps": self.total_steps,
            "started_from": {"how": self.start.how, "checkpoint": self.start.path},
            **self._provenance,
            "launches": self.launches,
            "config": self.cfg.to_dict(),
        }

    def _where_from(self) -> dict:
        """How to run this again (run.json): the command line, the code's commit, and the files as resolved — the
        tokenizer train.py built or was given, absolute paths."""
        import shlex

        from common.repository import git_commit

        cfg = self.cfg

        def absolute(path):
            return os.path.abspath(path) if path else None

        return {
            "command": shlex.join([sys.executable, *sys.argv]),
            "git_commit": git_commit(),
            "files": {
                "file_path": absolute(cfg.data.file_path),
                "tokenizer": absolute(self.data.tokenizer_path),
                "valid_file": absolute(cfg.validation.valid_file),
                "output_dir": absolute(cfg.checkpoint.output_dir),
                "recipe": absolute(cfg.recipe),
            },
        }

    def start_logging(self) -> None:
        log = self.cfg.logging
        self.writer = MetricsWriter(
            self.cfg.checkpoint.output_dir,
            enabled=self.rank == 0,
            total_steps=self.total_steps,
            start_step=self.start_step,
            resumed=not self.start.fresh,
            log_interval=log.log_interval,
            tensorboard=log.tensorboard,
            checkpoint_steps=self.cfg.checkpoint.save_checkpoint_steps,
            trackers=Trackers.chosen(
                self.cfg.checkpoint.output_dir, log.wandb, log.wandb_entity, log.wandb_run_name, log.mlflow
            ),
        )
        self._provenance = self._where_from() if self.rank == 0 else {}  # one git call, on the writing rank
        if self.rank == 0:  # each launch's SLURM job and restart, and how it ended (requeue reads it)
            self.launches = launch_record.launches(
                self.cfg.checkpoint.output_dir, self.start_step, resumed=not self.start.fresh
            )
        info = self.info = self._describe()
        self.writer.run_info(info)
        self.writer.message(
            " ".join(
                ["layout:"]
                + [f"{k}={info[k]}" for k in LAYOUT_KEYS]
                + [
                    f"zero={info['zero_stage']}",
                    f"recompute={info['recompute']}",
                    f"precision={info['precision']}",
                    f"optimizer={info['optimizer']}",
                    f"grad_accum={info['grad_accum_dtype']}",
                    f"backend={info['backend']}",
                    f"device={info['device']}",
                ]
            )
            + f" | vocab={self.vocab} params on rank 0={info['params_rank0']:,} | steps "
            f"{self.start_step}→{self.total_steps}"
        )
        if self.start_step >= self.total_steps:
            self.writer.message(
                f"nothing to train: the checkpoint is at step {self.start_step} and --steps is "
                f"{self.total_steps}; raise --steps to continue"
            )

    # ------------------------------------------------------------------------------------------------ the loop
    def train(self) -> int:
        request = self.request.install()  # SIGTERM / SIGUSR1 / SIGHUP / the launcher's end: save the step, stop
        try:
            self.setup()
            self.load()
        except BaseException as exc:
            if isinstance(exc, Stopped):  # a stop request while the data was prepared: every rank stops so
                publish_stopping(exc.exit_status - 128)
            if self.lock is not None:  # nothing written yet: the lock file and folders this run made go
                self.lock.undo()
            raise
        self.recheck = DataRecheck.start()  # the data files taken on trust (their record, a sample), hashed in full
        self.start_logging()
        try:
            return self.loop(request)
        except BaseException:
            # the trackers' runs end marked failed now: a launched rank leaves by os._exit, past any exit hook
            self.writer.close(status="failed")
            raise

    def loop(self, request: StopRequest) -> int:
        opt, faults = self.cfg.optimization, self.cfg.faults
        speed = SpeedMeter(self.model_cfg, self.world, self.cfg.parallel.precision, device())
        nonfinite = NonFiniteSteps(
            self.engine, faults.nan_policy, faults.nan_skip_limit, opt.lr, self.checkpoints.latest
        )
        faults_for_tests.arm(self.engine)
        losses = []
        for step in range(self.start_step, self.total_steps):
            record = self.step(step, speed)
            losses.append(record["loss"])
            done = step + 1
            if opt.train:
                faults_for_tests.after_step(self.engine, done)
                stop = nonfinite.after_step(done, record["loss"], record)
                if stop:  # logged (loss null), then ended before validating or saving
                    self.writer.log(record)
                    self.writer.close(status="failed")
                    raise UserError(stop)
            improved = self.validate(done, record)
            self.writer.log(record)
            early_stop = self.tracker is not None and self.tracker.should_stop
            # the data files the start trusted, hashed in full beside these steps: a changed one stops the run here
            self.recheck.after_step(done, last=done == self.total_steps or early_stop)
            self.save(done, improved, last=done == self.total_steps or early_stop)
            # every rank, every step: the same answer (the vote of the step before; the last step's at once)
            code = request.agreed(device(), self.world, final=done == self.total_steps or early_stop)
            if code:
                return self.stop_on_request(done, code, request, losses)
            if early_stop:
                best = self.tracker.best
                self.writer.message(
                    f"early stop after step {done}: valid_loss has not improved for "
                    f"{self.tracker.since_best} validations (best {best['valid_loss']:.4f} at step "
                    f"{best['step']}, kept in {self.checkpoints.root}/{BEST})"
                )
                break
        return self.finish(losses)

    def step(self, step: int, speed: SpeedMeter) -> dict:
        """One optimizer step (or, with --train 0, one loss evaluation) and its metrics record."""
        batches = self.feeder.step(step)
        lr = current_lr(self.engine)  # the rate this step uses (the scheduler moves after it)
        with StepTimer() as t:
            loss = (train_step if self.cfg.optimization.train else eval_step)(self.engine, batches)
        # epochs counted from 1 everywhere (the seed's loss line did; metrics.jsonl said 0 for the same step)
        record = {"step": step + 1, "epoch": self.feeder.epoch_of(step) + 1, "loss": loss, "lr": lr}
        if self.cfg.optimization.train:
            record["grad_norm"] = self.engine.grad_norm()
            if self.engine.precision == "fp16":
                record.update(loss_scale=self.engine.loss_scale(), skipped_steps=self.engine.ds.skipped_steps)
        record.update(
            pairs=batches.pairs,
            tokens=batches.global_tokens,
            tokens_per_sec=batches.global_tokens / max(t.seconds, 1e-9),
            step_time=t.seconds,
            padding=round(batches.padding, 4),
            **speed.figures(batches.src_tokens, batches.global_tokens, batches.pairs, batches.lengths, t.seconds),
        )
        return record

    def validate(self, step: int, record: dict) -> bool:
        """Every --valid_interval steps and after the last: the figures go into the step's record; True when this
        validation is the best so far."""
        if self.validator is None or (step % self.valid_every and step != self.total_steps):
            return False
        figures = self.validator.evaluate(self.engine, step)
        improved = self.tracker.update(step, figures)
        record.update(figures, best_valid_loss=self.tracker.best["valid_loss"], best_step=self.tracker.best["step"])
        return improved

    def save(self, step: int, improved: bool, last: bool) -> None:
        if self.cfg.optimization.train:
            faults_for_tests.before_save(step)
            self.checkpoints.after_step(step, last=last)
        if improved:
            self.checkpoints.save(step, name=BEST, validation=self.tracker.best)

    def stop_on_request(self, step: int, code: int, stop: StopRequest, losses: list) -> int:
        """A stop request agreed after `step`: save that step (--save_on_signal), say so, exit non-zero."""
        stop.close()
        why = stop.describe_agreed(code)
        saved = None
        if not self.cfg.optimization.train:
            outcome = "an evaluation run: nothing to save"
        elif self.cfg.faults.save_on_signal:
            latest = self.checkpoints.latest()
            if latest is None or os.path.basename(latest) != step_dirname(step):
                self.checkpoints.save(step)
            outcome = f"checkpoint {step_dirname(step)} saved; resume with --resume"
            saved = step_dirname(step)
        else:
            latest = self.checkpoints.latest()
            outcome = "no checkpoint saved (--save_on_signal 0); " + (
                f"resume with --resume from {os.path.basename(latest)}" if latest else "nothing to resume"
            )
        if self.launches:  # (run.json is written by finish, once the checkpoint is committed)
            launch_record.ended(self.launches[-1], "stopped", step, by=why, checkpoint=saved)
        self.finish(losses, stopped=f"stopped by {why} at step {step}")
        if self.rank == 0:
            print(f"stopped by {why} at step {step}; {outcome}", file=sys.stderr, flush=True)
        return StopRequest.exit_status(code)

    def finish(self, losses: list, stopped: str | None = None) -> int:
        self.checkpoints.drain()  # a background save in flight is committed before the run ends
        summary = {
            "steps": self.start_step + len(losses),
            "final_loss": losses[-1] if losses else None,
            "output_dir": os.path.abspath(self.cfg.checkpoint.output_dir),
        }
        if stopped:
            summary["stopped"] = stopped
        if self.tracker is not None:
            summary["best_validation"] = self.tracker.best
        if self.launches and "end" not in self.launches[-1]:
            launch_record.ended(self.launches[-1], "finished", summary["steps"])
        # what this rank's optimizer holds now, next to the run's description (plan.py predicts it:
        # tests/test_parity.py)
        self.writer.run_info({**self._describe(), "optimizer_state_bytes_rank0": self.engine.optimizer_state_bytes()})
        self.writer.close(summary, status="stopped" if stopped else "finished")
        if self.lock is not None:
            self.lock.release()
        return 0


def run_training(config: TrainConfig) -> int:
    return Trainer(config).train()
