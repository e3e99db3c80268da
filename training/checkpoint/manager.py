"""Checkpoints that any parallel layout can load: save, load (resharding at load time, no conversion step), and
the trainer's checkpoint manager.

What a checkpoint holds and how it is read: training.checkpoint.format. The folder's rules (names, `latest`,
pruning, partial saves): training.checkpoint.folder. Which checkpoint a run starts from: training.run.start_point.

Loading reads, for each of this rank's parameters, only the rows of the saved TP shards that overlap its own slice,
nothing of other stages, and writes them through training.checkpoint.optimizer_state, which knows each optimizer
DeepSpeed builds (AdamW, BF16_Optimizer, ZeRO 1/2/3). So tp2 → pp2, tp4 → tp2, dp2 ZeRO-3 → tp2, bf16 → fp32... all
load online. Saving gathers one tensor at a time and only the DP rank 0 of each (stage, TP rank) writes it
(training.checkpoint.shard_io streams it into the file).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import shutil

import torch
import torch.distributed as dist

from common.errors import UserError
from common.hashing import file_sha256
from model.config import ModelConfig, ParallelConfig
from model.parallel.random import RNG
from model.parallel.sharding import partition_dim
from training.checkpoint import optimizer_state
from training.checkpoint.background import BackgroundSaves
from training.checkpoint.disk_full import checkpoint_file_guard
from training.checkpoint.folder import (
    checkpoints_dir,
    latest_checkpoint,
    point_latest_at,
    prune,
    step_dirname,
    write_atomic,
)
from training.checkpoint.format import (
    FORMAT_VERSION,
    SHARD_FORMAT,
    TOKENIZER,
    ShardIndex,
    canonical_name,
    check_compatible,
    check_identity,
    collect_digests,
    read_meta,
    rng_file,
    rng_state,
    rng_tensors,
    shard_file,
    tensor_name,
    verify_file,
    write_digest,
)
from training.checkpoint.nonfinite import refuse_non_finite_weights
from training.checkpoint.optimizer_state import KEYS, local_shape
from training.checkpoint.recovery_script import ship_folder_hint, ship_recovery_files
from training.checkpoint.shard_io import ShardWriter, read_all, read_header, write_tensors
from training.checkpoint.shared_folder import check_checkpoint
from training.checkpoint.spread_verify import verify_spread
from training.checkpoint.tied_copies import refuse_drifted_tied_copies
from training.config.sections import CheckpointSection, DataSection
from training.core.data import check_data_order, data_order, legacy_data_order

# called with the step once a save's files are written, before they are committed (moved into place, `latest`):
# where the failure tests' crash injection hooks in (training.faults_for_tests), from above this package
BEFORE_COMMIT: list = []


def _tokenizer_sha256(path: str | None) -> str | None:
    return file_sha256(path) if path and os.path.isfile(path) else None


def _new_id() -> int:
    """A random 62-bit id from the OS, not from torch's generators (they drive dropout: saving must not move them)."""
    return secrets.randbits(62)


def _ids(engine) -> tuple[str, str]:
    """(run id, checkpoint id), the same on every rank: rank 0 draws them, one broadcast on the engine's device.
    The run id is drawn at a run's first save, or inherited from the checkpoint it loaded."""
    t = torch.tensor(
        [_new_id(), _new_id()] if dist.get_rank() == 0 else [0, 0], dtype=torch.int64, device=engine.device
    )
    dist.broadcast(t, src=0)
    run_rand, ckpt_rand = (int(v) for v in t.tolist())
    if getattr(engine, "run_id", None) is None:
        engine.run_id = f"{run_rand:016x}"
    return engine.run_id, f"{ckpt_rand:016x}"


# ----------------------------------------------------------------------------------------------- save
def save(
    engine,
    output_dir: str,
    step: int,
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    data: DataSection,
    tokenizer_path: str | None,
    keep: int,
    name: str | None = None,
    validation: dict | None = None,
    weights_only: bool = False,
    trajectory: dict | None = None,
    background: BackgroundSaves | None = None,
) -> str:
    """Save step `step` as checkpoints/step_N (moving `latest`, pruning to `keep`), or as checkpoints/<name>
    (e.g. "best": replaced in place, outside the rotation). `validation` goes into meta.json. `weights_only`: the
    fp32 weights alone — no AdamW moments, no RNG states — for decoding (the validation BLEU model), a third of the
    bytes; such a checkpoint is not resumable. `trajectory`: the optimisation settings a resumed run takes
    (training.checkpoint.carried_settings.trajectory), meta.json's "optimization". `background`
    (training.checkpoint.background, with no save in flight): gather into a host snapshot here, write, hash and
    commit on its thread — the files are the same bytes as a synchronous save's.

    Every rank: refuse weights that must not be saved → a fresh .tmp folder → what this rank writes → write it now
    (or snapshot it and write on the background thread) → rank 0 commits (meta.json, move into place, `latest`)."""
    state = optimizer_state.for_engine(engine)  # an optimizer it does not know: refused before any file
    run_id, checkpoint_id = _ids(engine)
    root = checkpoints_dir(output_dir)
    latest = latest_checkpoint(root, strict=False) if os.path.isdir(root) else None
    refuse_non_finite_weights(engine, step, latest)  # collectives: every rank, same point
    refuse_drifted_tied_copies(engine, step, latest)
    final = os.path.join(root, name or step_dirname(step))
    tmp = _fresh_tmp(root, final)
    state.prepare()
    ids = {"checkpoint_id": checkpoint_id, "run_id": run_id, "step": step}
    files = _RankFiles.of(engine, state, tmp, ids, weights_only)
    commit = None
    if dist.get_rank() == 0:  # meta.json: what the engine holds now, read before the next step moves it
        meta = _meta(
            engine, state, ids, model_cfg, parallel, data, tokenizer_path, validation, weights_only, trajectory
        )
        commit = functools.partial(_commit, meta, tmp, final, root, name, step, keep, tokenizer_path)
    if background is None:
        files.write_now(state, step)
        dist.barrier()
        if commit is not None:
            commit()
        dist.barrier()
    else:
        background.start(files.snapshot_writer(state, step, background.staging), commit)
    return final


def _fresh_tmp(root: str, final: str) -> str:
    """`final`.tmp, emptied by rank 0, seen by every rank once this returns (a barrier)."""
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    return tmp


@dataclasses.dataclass
class _RankFiles:
    """What this rank writes into a save's .tmp folder: its (stage, TP rank)'s shard if it is that pair's DP rank 0,
    and its RNG states unless the save is weights-only. Under ZeRO every DP rank takes part in the shard's gathers
    (collectives over DP) though only one writes."""

    params: list  # (canonical name, parameter); a pipeline's tied replica is saved by its owner
    keys: tuple
    gathers: bool
    shard_path: str | None  # None: not this rank's shard to write
    shard_ids: dict
    rng_path: str | None
    rng_ids: dict

    @classmethod
    def of(cls, engine, state, tmp: str, ids: dict, weights_only: bool) -> _RankFiles:
        ctx, rank = engine.ctx, dist.get_rank()
        writes = ctx.dp_rank == 0  # one writer per (stage, TP rank)
        return cls(
            params=[
                (canonical_name(n), p)
                for n, p in engine.module.named_parameters()
                if not getattr(p, "ds_pipe_replicated", False)
            ],
            keys=("param",) if weights_only else KEYS,
            gathers=writes or state.partitioned,
            shard_path=os.path.join(tmp, shard_file(ctx.pp_rank, ctx.tp_rank)) if writes else None,
            shard_ids={**ids, "pp_rank": ctx.pp_rank, "tp_rank": ctx.tp_rank},
            rng_path=None if weights_only else os.path.join(tmp, rng_file(rank)),
            rng_ids={**ids, "rank": rank},
        )

    def write_now(self, state, step: int) -> None:
        """Gather and write the shard tensor by tensor, then the RNG states (a synchronous save)."""
        if self.gathers:
            digest = _save_shard(self.shard_path, state, self.params, self.shard_ids, self.keys)
            if self.shard_path is not None:
                write_digest(self.shard_path, digest)
        if self.rng_path is not None:
            _write_rng(self.rng_path, rng_tensors(RNG.get_state()), self.rng_ids)
        for hook in BEFORE_COMMIT:
            hook(step)

    def snapshot_writer(self, state, step: int, staging):
        """Gather into a host snapshot now (the collectives stay on the training thread); the returned function
        writes the same bytes as `write_now` from the snapshot, on the background thread."""
        writes = self.shard_path is not None
        values = _snapshot_shard(state, self.params, self.keys, staging, keep=writes) if self.gathers else None
        rng = {n: t.clone() for n, t in rng_tensors(RNG.get_state()).items()} if self.rng_path is not None else None

        def write():
            if self.shard_path is not None:
                with checkpoint_file_guard(self.shard_path + ".part"):
                    writer = _shard_writer(self.shard_path, self.params, self.shard_ids, self.keys)
                    values.reverse()  # each buffer dropped once written
                    _write_all(writer, ((tensor_name(k, n), values.pop()) for n, _ in self.params for k in self.keys))
                write_digest(self.shard_path, writer.sha256)
            if self.rng_path is not None:
                _write_rng(self.rng_path, rng, self.rng_ids)
            for hook in BEFORE_COMMIT:
                hook(step)

        return write


def _meta(
    engine,
    state,
    ids: dict,
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    data: DataSection,
    tokenizer_path: str | None,
    validation: dict | None,
    weights_only: bool,
    trajectory: dict | None,
) -> dict:
    """meta.json as the save's step left it; "sha256" is filled in at the commit (its place in the file kept)."""
    sched = engine.ds.lr_scheduler
    meta = {
        "format_version": FORMAT_VERSION,
        **ids,
        "optimizer_step": state.step(),
        "optimizer": state.describe(),
        "skipped_steps": int(getattr(engine.ds, "skipped_steps", 0)),
        "model": dataclasses.asdict(model_cfg),
        "parallel": dataclasses.asdict(parallel),
        "world_size": dist.get_world_size(),
        "batch_size": data.batch_size,
        "seed": data.seed,
        "data_order": data_order(data),
        "samples_seen": int(engine.ds.global_samples),
        "lr_scheduler": {"last_epoch": sched.last_epoch, "last_lr": list(sched.get_last_lr())},
        "tokenizer_sha256": _tokenizer_sha256(tokenizer_path),
        "shards": [shard_file(p, t) for p in range(parallel.pipeline_stage) for t in range(parallel.model_parallel)],
        "rng": [] if weights_only else [rng_file(r) for r in range(dist.get_world_size())],
    }
    if trajectory is not None:
        meta["optimization"] = trajectory
    if weights_only:
        meta["weights_only"] = True
    if meta["tokenizer_sha256"]:  # the checkpoint carries its tokenizer: decoding needs no flag
        meta["tokenizer"] = TOKENIZER
    meta["sha256"] = {}
    scaler = state.scaler_state()
    if scaler is not None:
        meta["loss_scaler"] = scaler
    if validation is not None:
        meta["validation"] = validation
    return meta


def _commit(
    meta: dict, tmp: str, final: str, root: str, name: str | None, step: int, keep: int, tokenizer_path: str | None
) -> None:
    """Rank 0, once every rank's files are in `tmp`: meta.json, the rename, `latest`, pruning."""
    if meta.get("tokenizer"):
        shutil.copyfile(tokenizer_path, os.path.join(tmp, TOKENIZER))
    ship_recovery_files(tmp)
    meta["sha256"] = collect_digests(tmp, meta["shards"] + meta["rng"])  # each writer's, as it wrote
    write_atomic(os.path.join(tmp, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
    if os.path.exists(final):  # re-saving a step (a resumed run) replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    ship_folder_hint(root)  # DeepSpeed's users look in checkpoints/ itself for zero_to_fp32.py
    if name is None:
        point_latest_at(root, step)
        prune(root, keep)


def _write_rng(path: str, tensors: dict, metadata: dict) -> None:
    with checkpoint_file_guard(path + ".part"):
        write_digest(path, write_tensors(path, tensors, metadata))


def _save_shard(path: str | None, state, params: list, metadata: dict, keys=KEYS) -> str | None:
    """Gather every parameter's master weight and moments one tensor at a time; the writer (path not None) streams
    each into the shard and drops it, the other DP ranks only take part in the gathers. Returns the file's sha256
    (the writer's), else None."""
    if path is None:
        _gather_shard(None, state, params, keys)
        return None
    with checkpoint_file_guard(path + ".part"):  # out of room: one line, the partial save removed
        writer = _shard_writer(path, params, metadata, keys)
        _gather_shard(writer, state, params, keys)
        return writer.sha256


def _shard_writer(path: str, params: list, metadata: dict, keys=KEYS) -> ShardWriter:
    info = {
        n: {"partition_dim": partition_dim(p), "full_size": getattr(p, "full_size", None)} for n, p in params
    }  # full_size: serial length along dim (drops vocab padding)
    specs = [(tensor_name(k, n), local_shape(p), torch.float32) for n, p in params for k in keys]
    return ShardWriter(
        path, specs, {**metadata, "format": SHARD_FORMAT, "format_version": FORMAT_VERSION, "params": json.dumps(info)}
    )


def _gather_shard(writer: ShardWriter | None, state, params: list, keys=KEYS) -> None:
    def gathered():
        for n, p in params:  # the same order on every DP rank
            for k in keys:
                yield tensor_name(k, n), state.get(p, k)

    if writer is None:
        for _ in gathered():
            pass
        return
    _write_all(writer, gathered())


def _write_all(writer: ShardWriter, values) -> None:
    """Every (name, tensor) into `writer`, then close it (abort on any failure)."""
    try:
        for tname, value in values:
            writer.write(tname, value)
            del value
        writer.close()
    except BaseException:
        writer.abort()
        raise


def _snapshot_shard(state, params: list, keys, staging, keep: bool) -> list | None:
    """The gathers of `_gather_shard`, on the main thread in the same order; the writer (`keep`) copies each value
    into a host buffer (training.checkpoint.snapshot), the others only take part."""
    values = [] if keep else None
    for _name, p in params:
        for k in keys:
            value = state.get(p, k)
            if keep:
                values.append(staging.copy(value))
            del value
    staging.finish()
    return values


def load(
    engine,
    path: str,
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    data: DataSection,
    seed: int,
    tokenizer_path: str | None = None,
    verify: bool = True,
    spread: bool = False,
) -> int:
    """Load checkpoint `path` into the engine, whatever layout saved it; returns its step. `seed`: the run's seed
    (dropout streams restart from it when the layout differs from the saving one). `verify` with `spread` (every
    rank loads: train.py): each file is hashed once by one rank (training.checkpoint.spread_verify, a collective)
    once the cheap checks passed, not by every rank that reads it."""
    meta = read_meta(path)
    if meta.get("weights_only"):
        raise UserError(
            f"{path} holds weights only (no optimizer state: a decoding copy), so training cannot "
            f"continue from it; resume from a step_* checkpoint"
        )
    now = _tokenizer_sha256(tokenizer_path)
    if meta.get("tokenizer_sha256") and now and meta["tokenizer_sha256"] != now:
        raise UserError(
            f"checkpoint {path} was trained with a different tokenizer (vocabulary) than {tokenizer_path}"
            f"; token ids would not match. Use the tokenizer it was trained with (--tokenizer)"
        )
    check_compatible(meta, model_cfg, path)
    now_order = data_order(data)
    check_data_order(meta.get("data_order") or legacy_data_order(meta, now_order), now_order, path)
    state = optimizer_state.for_engine(engine)
    index = ShardIndex(path, meta, verify=verify and not spread)  # the headers: every file's identity
    if verify and spread:
        verify_spread(path)
        verify = False
    ctx = engine.ctx
    state.prepare()
    state.begin_load()
    for name, p in engine.module.named_parameters():  # the same order on every DP rank (ZeRO scatters)
        key = getattr(p, "tied_to", None) or canonical_name(name)  # a tied replica loads its owner's value
        for k in KEYS:
            value = index.read_local(key, k, partition_dim(p), ctx.tp_rank, local_shape(p))
            state.set(p, k, value)
            del value
    state.end_load()
    state.set_step(meta["optimizer_step"])
    state.load_scaler_state(meta.get("loss_scaler"))
    sched = engine.ds.lr_scheduler
    sched.last_epoch = meta["lr_scheduler"]["last_epoch"]
    sched._last_lr = list(meta["lr_scheduler"]["last_lr"])
    for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr(), strict=True):
        group["lr"] = lr
    engine.ds.global_steps = meta["step"]
    engine.ds.global_samples = meta["samples_seen"]
    engine.ds.skipped_steps = meta["skipped_steps"]
    engine.run_id = meta["run_id"]  # this run continues the checkpoint's lineage

    same_layout = meta["parallel"] == dataclasses.asdict(parallel) and meta["world_size"] == dist.get_world_size()
    if same_layout:
        fname = rng_file(dist.get_rank())
        if verify:
            verify_file(path, fname, meta)
        _, info = read_header(os.path.join(path, fname))
        check_identity(path, fname, info, meta, {"rank": dist.get_rank()})
        RNG.set_state(rng_state(read_all(os.path.join(path, fname))))
    else:  # dropout streams cannot be carried across layouts; restart them deterministically from (seed, step)
        RNG.seed(seed + 7919 * meta["step"], tp_rank=ctx.tp_rank, pp_rank=ctx.pp_rank)
    return meta["step"]


class CheckpointManager:
    """The trainer's one handle on checkpoints: it knows the run's folder, model, layout, data order and tokenizer,
    and owns when to save (every --save_checkpoint_steps and at the last step), the named saves outside the
    rotation (`best`, the validation BLEU model), and the load at start."""

    def __init__(
        self,
        engine,
        section: CheckpointSection,
        data: DataSection,
        seed: int,
        model_cfg: ModelConfig,
        parallel: ParallelConfig,
        tokenizer_path: str | None,
        validating: bool = False,
        trajectory: dict | None = None,
    ):
        self.engine, self.section, self.data, self.seed = engine, section, data, seed
        self.trajectory = trajectory
        self.model_cfg, self.parallel, self.tokenizer_path = model_cfg, parallel, tokenizer_path
        self.root = checkpoints_dir(section.output_dir)
        # --save_mode background: the rotation's saves are written on a thread (training.checkpoint.background)
        self.background = BackgroundSaves(engine.device) if section.save_mode == "background" else None
        # a run that will save or load needs an optimizer whose state the checkpoint code knows; refused now, not
        # at the first save hours later
        if section.will_touch_checkpoints or validating:
            optimizer_state.for_engine(engine)

    def resume(self, start) -> int:
        """Load the checkpoint of the run's start point (training.run.start_point.StartPoint, the same on every
        rank); the step to start at (0 for a fresh start)."""
        if start.path is None:
            return 0
        rank = dist.get_rank()
        check_checkpoint(start.path)  # every node sees the folder rank 0 chose, with the same meta.json
        step = load(
            self.engine,
            start.path,
            self.model_cfg,
            self.parallel,
            self.data,
            self.seed,
            self.tokenizer_path,
            verify=self.section.verify and not start.verified,
            spread=True,
        )
        if rank == 0:
            saved = start.meta["optimizer"]
            print(
                f"resumed from {start.path} at step {step} (saved by {saved['class']}, {saved['precision']}, ZeRO "
                f"{saved['zero_stage']})",
                flush=True,
            )
        return step

    def after_step(self, step: int, last: bool = False) -> None:
        """Every --save_checkpoint_steps steps, and at the run's last step (its end or an early stop), so the final
        weights are always in the rotation (checkpoint averaging takes the last K). Every rank, every step: a
        background save in flight is committed here once every rank's files are written."""
        if self.background is not None:
            self.background.poll()
        every = self.section.save_checkpoint_steps
        if every and (step % every == 0 or last):
            self.save(step, in_background=not last)

    def save(
        self,
        step: int,
        name: str | None = None,
        validation: dict | None = None,
        keep: int | None = None,
        weights_only: bool = False,
        in_background: bool = False,
    ) -> str:
        """step_N in the rotation (name None), or a named checkpoint outside it (e.g. "best"). `in_background`
        (with --save_mode background, a step_N save): return once the snapshot is taken; otherwise return once the
        checkpoint is committed. Either waits for a save in flight first."""
        if keep is None:
            keep = self.section.keep_checkpoint_max if name is None else 0
        self.drain()
        background = self.background if in_background and name is None else None
        return save(
            self.engine,
            self.section.output_dir,
            step,
            self.model_cfg,
            self.parallel,
            self.data,
            self.tokenizer_path,
            keep,
            name=name,
            validation=validation,
            weights_only=weights_only,
            trajectory=self.trajectory,
            background=background,
        )

    def drain(self) -> None:
        """Every rank, the same point: wait until a background save in flight is committed."""
        if self.background is not None:
            self.background.drain()

    def latest(self) -> str | None:
        """The newest committed checkpoint (after a save in flight is committed: every rank, the same point)."""
        self.drain()
        return latest_checkpoint(self.root, strict=False) if os.path.isdir(self.root) else None
