"""Checkpoints that any parallel layout can load: save, load (resharding at load time, no conversion step), and
the trainer's checkpoint manager.

What a checkpoint holds and how it is read: training.checkpoint.format. The folder's rules (names, `latest`,
pruning, partial saves): training.checkpoint.folder. Which checkpoint a run starts from: training.checkpoint.resume.

Loading reads, for each of this rank's parameters, only the rows of the saved TP shards that overlap its own slice,
nothing of other stages, and writes them through training.checkpoint.optimizer_state, which knows each optimizer
DeepSpeed builds (AdamW, BF16_Optimizer, ZeRO 1/2/3). So tp2 → pp2, tp4 → tp2, dp2 ZeRO-3 → tp2, bf16 → fp32... all
load online. Saving gathers one tensor at a time and only the DP rank 0 of each (stage, TP rank) writes it
(training.checkpoint.shard_io streams it into the file).
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from common.errors import UserError
from common.hashing import file_sha256
from model.config import ModelConfig, ParallelConfig
from model.parallel.random import RNG
from model.parallel.sharding import partition_dim
from training.checkpoint import optimizer_state
from training.checkpoint.folder import (checkpoints_dir, latest_checkpoint, prune, step_dirname,
                                        write_atomic)
from training.checkpoint.format import (FORMAT_VERSION, SHARD_FORMAT, TOKENIZER, ShardIndex, canonical_name,
                                        check_compatible, check_identity, collect_digests, read_meta, rng_file,
                                        rng_state, rng_tensors, shard_file, tensor_name, verify_file, write_digest)
from training.checkpoint.optimizer_state import KEYS, local_shape
from training.checkpoint.shard_io import ShardWriter, read_all, read_header, write_tensors
from training.config.sections import CheckpointSection, DataSection
from training.core.data import check_data_order, data_order, legacy_data_order
from training.checkpoint.disk_full import checkpoint_file_guard
from training.checkpoint.nonfinite import refuse_non_finite_weights
from training.checkpoint.shared_folder import check_checkpoint
from training.checkpoint.spread_verify import verify_spread
from training.checkpoint.tied_copies import refuse_drifted_tied_copies


# called with the step once a save's files are written, before they are committed (moved into place, `latest`):
# where the failure tests' crash injection hooks in (training.run.injection), from above this package
BEFORE_COMMIT: list = []


def _tokenizer_sha256(path: Optional[str]) -> Optional[str]:
    return file_sha256(path) if path and os.path.isfile(path) else None


def _new_id() -> int:
    """A random 62-bit id from the OS, not from torch's generators (they drive dropout: saving must not move them)."""
    return secrets.randbits(62)


def _ids(engine) -> tuple[str, str]:
    """(run id, checkpoint id), the same on every rank: rank 0 draws them, one broadcast on the engine's device.
    The run id is drawn at a run's first save, or inherited from the checkpoint it loaded."""
    t = torch.tensor([_new_id(), _new_id()] if dist.get_rank() == 0 else [0, 0], dtype=torch.int64,
                     device=engine.device)
    dist.broadcast(t, src=0)
    run_rand, ckpt_rand = (int(v) for v in t.tolist())
    if getattr(engine, "run_id", None) is None:
        engine.run_id = f"{run_rand:016x}"
    return engine.run_id, f"{ckpt_rand:016x}"


# ----------------------------------------------------------------------------------------------- save
def save(engine, output_dir: str, step: int, model_cfg: ModelConfig, parallel: ParallelConfig, data: DataSection,
         tokenizer_path: Optional[str], keep: int, name: Optional[str] = None,
         validation: Optional[dict] = None, weights_only: bool = False, trajectory: Optional[dict] = None) -> str:
    """Save step `step` as checkpoints/step_N (moving `latest`, pruning to `keep`), or as checkpoints/<name>
    (e.g. "best": replaced in place, outside the rotation). `validation` goes into meta.json. `weights_only`: the
    fp32 weights alone — no AdamW moments, no RNG states — for decoding (the validation BLEU model), a third of the
    bytes; such a checkpoint is not resumable. `trajectory`: the optimisation settings a resumed run takes
    (training.run.start_point.trajectory), meta.json's "optimization"."""
    ctx, rank = engine.ctx, dist.get_rank()
    state = optimizer_state.for_engine(engine)        # an optimizer it does not know: refused before any file
    run_id, checkpoint_id = _ids(engine)
    root = checkpoints_dir(output_dir)
    latest = latest_checkpoint(root, strict=False) if os.path.isdir(root) else None
    refuse_non_finite_weights(engine, step, latest)                  # collectives: every rank, same point
    refuse_drifted_tied_copies(engine, step, latest)
    final = os.path.join(root, name or step_dirname(step))
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()

    state.prepare()
    ids = {"checkpoint_id": checkpoint_id, "run_id": run_id, "step": step}
    # a pipeline's replica of a tied weight (shared embeddings) is saved once, by the stage that owns it
    params = [(canonical_name(n), p) for n, p in engine.module.named_parameters()
              if not getattr(p, "ds_pipe_replicated", False)]
    writes = ctx.dp_rank == 0                       # one writer per (stage, TP rank)
    keys = ("param",) if weights_only else KEYS
    if writes or state.partitioned:                 # under ZeRO the gathers are collectives over DP
        shard_path = os.path.join(tmp, shard_file(ctx.pp_rank, ctx.tp_rank)) if writes else None
        digest = _save_shard(shard_path, state, params, {**ids, "pp_rank": ctx.pp_rank, "tp_rank": ctx.tp_rank},
                             keys)
        if shard_path is not None:
            write_digest(shard_path, digest)
    if not weights_only:
        rng_path = os.path.join(tmp, rng_file(rank))
        with checkpoint_file_guard(rng_path + ".part"):
            write_digest(rng_path, write_tensors(rng_path, rng_tensors(RNG.get_state()), {**ids, "rank": rank}))
    for hook in BEFORE_COMMIT:
        hook(step)
    dist.barrier()
    if rank == 0:
        sched = engine.ds.lr_scheduler
        meta = {
            "format_version": FORMAT_VERSION, **ids, "optimizer_step": state.step(),
            "optimizer": state.describe(), "skipped_steps": int(getattr(engine.ds, "skipped_steps", 0)),
            "model": dataclasses.asdict(model_cfg), "parallel": dataclasses.asdict(parallel),
            "world_size": dist.get_world_size(), "batch_size": data.batch_size, "seed": data.seed,
            "data_order": data_order(data), "samples_seen": int(engine.ds.global_samples),
            "lr_scheduler": {"last_epoch": sched.last_epoch, "last_lr": sched.get_last_lr()},
            "tokenizer_sha256": _tokenizer_sha256(tokenizer_path),
            "shards": [shard_file(p, t) for p in range(parallel.pipeline_stage)
                       for t in range(parallel.model_parallel)],
            "rng": [] if weights_only else [rng_file(r) for r in range(dist.get_world_size())],
        }
        if trajectory is not None:
            meta["optimization"] = trajectory
        if weights_only:
            meta["weights_only"] = True
        if meta["tokenizer_sha256"]:                 # the checkpoint carries its tokenizer: decoding needs no flag
            shutil.copyfile(tokenizer_path, os.path.join(tmp, TOKENIZER))
            meta["tokenizer"] = TOKENIZER
        meta["sha256"] = collect_digests(tmp, meta["shards"] + meta["rng"])     # each writer's, as it wrote
        scaler = state.scaler_state()
        if scaler is not None:
            meta["loss_scaler"] = scaler
        if validation is not None:
            meta["validation"] = validation
        write_atomic(os.path.join(tmp, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
        if os.path.exists(final):                             # re-saving a step (a resumed run) replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        if name is None:
            write_atomic(os.path.join(root, "latest"), lambda f: f.write(step_dirname(step).encode()))
            prune(root, keep)
    dist.barrier()
    return final


def _save_shard(path: Optional[str], state, params: list, metadata: dict, keys=KEYS) -> Optional[str]:
    """Gather every parameter's master weight and moments one tensor at a time; the writer (path not None) streams
    each into the shard and drops it, the other DP ranks only take part in the gathers. Returns the file's sha256
    (the writer's), else None."""
    if path is None:
        return _gather_shard(None, state, params, metadata, keys)
    with checkpoint_file_guard(path + ".part"):     # out of room: one line, the partial save removed
        return _gather_shard(path, state, params, metadata, keys)


def _gather_shard(path: Optional[str], state, params: list, metadata: dict, keys=KEYS) -> Optional[str]:
    writer = None
    if path is not None:
        info = {n: {"partition_dim": partition_dim(p), "full_size": getattr(p, "full_size", None)}
                for n, p in params}                     # full_size: serial length along dim (drops vocab padding)
        specs = [(tensor_name(k, n), local_shape(p), torch.float32) for n, p in params for k in keys]
        writer = ShardWriter(path, specs, {**metadata, "format": SHARD_FORMAT, "format_version": FORMAT_VERSION,
                                           "params": json.dumps(info)})
    try:
        for n, p in params:                             # the same order on every DP rank
            for k in keys:
                value = state.get(p, k)
                if writer is not None:
                    writer.write(tensor_name(k, n), value)
                del value
        if writer is not None:
            writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return writer.sha256 if writer is not None else None


def load(engine, path: str, model_cfg: ModelConfig, parallel: ParallelConfig, data: DataSection, seed: int,
         tokenizer_path: Optional[str] = None, verify: bool = True, spread: bool = False) -> int:
    """Load checkpoint `path` into the engine, whatever layout saved it; returns its step. `seed`: the run's seed
    (dropout streams restart from it when the layout differs from the saving one). `verify` with `spread` (every
    rank loads: train.py): each file is hashed once by one rank (training.checkpoint.spread_verify, a collective)
    once the cheap checks passed, not by every rank that reads it."""
    meta = read_meta(path)
    if meta.get("weights_only"):
        raise UserError(f"{path} holds weights only (no optimizer state: a decoding copy), so training cannot "
                        f"continue from it; resume from a step_* checkpoint")
    now = _tokenizer_sha256(tokenizer_path)
    if meta.get("tokenizer_sha256") and now and meta["tokenizer_sha256"] != now:
        raise UserError(f"checkpoint {path} was trained with a different tokenizer (vocabulary) than {tokenizer_path}"
                        f"; token ids would not match. Use the tokenizer it was trained with (--tokenizer)")
    check_compatible(meta, model_cfg, path)
    now_order = data_order(data)
    check_data_order(meta.get("data_order") or legacy_data_order(meta, now_order), now_order, path)
    state = optimizer_state.for_engine(engine)
    index = ShardIndex(path, meta, verify=verify and not spread)      # the headers: every file's identity
    if verify and spread:
        verify_spread(path)
        verify = False
    ctx = engine.ctx
    state.prepare()
    state.begin_load()
    for name, p in engine.module.named_parameters():   # the same order on every DP rank (ZeRO scatters)
        key = getattr(p, "tied_to", None) or canonical_name(name)      # a tied replica loads its owner's value
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
    for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr()):
        group["lr"] = lr
    engine.ds.global_steps = meta["step"]
    engine.ds.global_samples = meta["samples_seen"]
    engine.ds.skipped_steps = meta["skipped_steps"]
    engine.run_id = meta["run_id"]                     # this run continues the checkpoint's lineage

    same_layout = meta["parallel"] == dataclasses.asdict(parallel) and meta["world_size"] == dist.get_world_size()
    if same_layout:
        fname = rng_file(dist.get_rank())
        if verify:
            verify_file(path, fname, meta)
        _, info = read_header(os.path.join(path, fname))
        check_identity(path, fname, info, meta)
        RNG.set_state(rng_state(read_all(os.path.join(path, fname))))
    else:   # dropout streams cannot be carried across layouts; restart them deterministically from (seed, step)
        RNG.seed(seed + 7919 * meta["step"], tp_rank=ctx.tp_rank, pp_rank=ctx.pp_rank)
    return meta["step"]



class CheckpointManager:
    """The trainer's one handle on checkpoints: it knows the run's folder, model, layout, data order and tokenizer,
    and owns when to save (every --save_checkpoint_steps and at the last step), the named saves outside the
    rotation (`best`, the validation BLEU model), and the load at start."""

    def __init__(self, engine, section: CheckpointSection, data: DataSection, seed: int, model_cfg: ModelConfig,
                 parallel: ParallelConfig, tokenizer_path: Optional[str], validating: bool = False,
                 trajectory: Optional[dict] = None):
        self.engine, self.section, self.data, self.seed = engine, section, data, seed
        self.trajectory = trajectory
        self.model_cfg, self.parallel, self.tokenizer_path = model_cfg, parallel, tokenizer_path
        self.root = checkpoints_dir(section.output_dir)
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
        step = load(self.engine, start.path, self.model_cfg, self.parallel, self.data, self.seed, self.tokenizer_path,
                    verify=self.section.verify and not start.verified, spread=True)
        if rank == 0:
            saved = start.meta["optimizer"]
            print(f"resumed from {start.path} at step {step} (saved by {saved['class']}, {saved['precision']}, ZeRO "
                  f"{saved['zero_stage']})", flush=True)
        return step

    def after_step(self, step: int, last: bool = False) -> None:
        """Every --save_checkpoint_steps steps, and at the run's last step (its end or an early stop), so the final
        weights are always in the rotation (checkpoint averaging takes the last K)."""
        every = self.section.save_checkpoint_steps
        if every and (step % every == 0 or last):
            self.save(step)

    def save(self, step: int, name: Optional[str] = None, validation: Optional[dict] = None,
             keep: Optional[int] = None, weights_only: bool = False) -> str:
        """step_N in the rotation (name None), or a named checkpoint outside it (e.g. "best")."""
        if keep is None:
            keep = self.section.keep_checkpoint_max if name is None else 0
        return save(self.engine, self.section.output_dir, step, self.model_cfg, self.parallel, self.data,
                    self.tokenizer_path, keep, name=name, validation=validation, weights_only=weights_only,
                    trajectory=self.trajectory)

    def latest(self) -> Optional[str]:
        return latest_checkpoint(self.root, strict=False) if os.path.isdir(self.root) else None
