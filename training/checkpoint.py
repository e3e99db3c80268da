"""Checkpoints that any parallel layout can load: save, resume, and reshard at load time (no conversion step).

Layout on disk (OUTPUT_DIR/checkpoints/):

    step_00000020/
        meta.json                 step, configs (model, the saving layout), batch/seed (the data position), the
                                  optimizer step, LR schedule, tokenizer hash, and the list of files below
        shard_pp{P}_tp{T}.pt      for every parameter of pipeline stage P, TP rank T: its fp32 value and AdamW
                                  exp_avg / exp_avg_sq, gathered over the DP (ZeRO) ranks, with its TP partition dim
        rng_rank{R}.pt            every RNG stream of global rank R (exact dropout on a same-layout resume)
    latest                        the name of the newest complete checkpoint

Parameters are keyed by layout-free names (`blocks.<layer>.<...>`: the same in the serial model and the pipeline).
Loading rebuilds each parameter's full tensor from the saved TP shards (`model.sharding.merge_shards`) and takes the
slice this rank needs (`take_shard`); ZeRO partitions are written back through DeepSpeed's fragment API. So tp2 →
pp2, tp4 → tp2, dp4+ZeRO-1 → 1 process... all load online.

Atomicity: files go into `step_N.tmp/`; after every rank has written, rank 0 writes meta.json, renames the folder to
`step_N`, then moves `latest` (write + rename), and only then prunes old checkpoints. A crash at any moment leaves
either the previous complete checkpoint or an ignored `.tmp` folder. Multi-node runs need OUTPUT_DIR on a shared
filesystem.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
from typing import Optional

import torch
import torch.distributed as dist

from model.config import ModelConfig, ParallelConfig
from model.random import RNG
from model.sharding import merge_shards, partition_dim, take_shard
from preprocess.errors import UserError
from training.disk_full import checkpoint_file_guard
from training.nonfinite import refuse_non_finite_weights

FORMAT_VERSION = 1
STATE_KEYS = ("exp_avg", "exp_avg_sq")
# model sizes that must match for a checkpoint to load (dropout, smoothing etc. may change on resume)
SHAPE_FIELDS = ("vocab_size", "d_model", "num_heads", "ffn", "encoder_layers", "decoder_layers", "src_len",
                "tgt_len", "pad_id", "share_embeddings")


# ----------------------------------------------------------------------------------------------- names & state
def canonical_name(name: str) -> str:
    """'blocks.3.attn.qkv.weight' (serial) and '3.attn.qkv.weight' (PipelineModule) → 'blocks.3.attn.qkv.weight'."""
    return name if name.startswith("blocks.") else "blocks." + name


def _zero(p) -> bool:
    return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")


def _base_optimizer(engine):
    opt = engine.ds.optimizer
    return getattr(opt, "optimizer", opt)


def get_full(engine, p, key: str) -> torch.Tensor:
    """The fp32 value or AdamW state of this rank's (TP/PP-local) parameter, gathered over ZeRO partitions.
    Collective under ZeRO: every DP rank calls it for the same parameters in the same order."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    if _zero(p):
        t = safe_get_full_fp32_param(p) if key == "param" else safe_get_full_optimizer_state(p, key)
        return t.detach().float().cpu().reshape(p.ds_shape if hasattr(p, "ds_shape") else p.shape).clone()
    if key == "param":
        return p.detach().float().cpu().clone()
    state = _base_optimizer(engine).state.get(p, {})
    return state[key].detach().float().cpu().clone() if key in state else torch.zeros(p.shape)


def set_full(engine, p, key: str, value: torch.Tensor) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    if _zero(p):
        dev_value = value.to(device=p.device if p.numel() else "cpu", dtype=torch.float32)
        if key == "param":
            safe_set_full_fp32_param(p, dev_value)
            if hasattr(p, "ds_tensor"):                       # ZeRO-3: this rank's slice of the flat parameter
                part = p.ds_tensor
                start = engine.ctx.dp_rank * part.ds_numel
                seg = value.flatten()[start:start + part.ds_numel]
                part.data[:seg.numel()].copy_(seg.to(part.dtype))
            else:
                p.data.copy_(value.to(p.dtype))
        else:
            safe_set_full_optimizer_state(p, dev_value, key)
        return
    if key == "param":
        p.data.copy_(value.to(p.dtype))
    else:
        state = _base_optimizer(engine).state.setdefault(p, {})
        state[key] = value.to(device=p.device, dtype=torch.float32).clone()


def ensure_zero_state(engine) -> None:
    """Make ZeRO's per-parameter views of the AdamW state exist and be current.

    DeepSpeed links each parameter to its fragment of the flat optimizer state when the optimizer is built, before
    AdamW has created any state, so the fragment API finds no exp_avg. We create the (zero) state a fresh AdamW
    would create on its first step, then re-link; both are no-ops for the values training sees."""
    opt = engine.ds.optimizer
    base = getattr(opt, "optimizer", None)
    flats = getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_partitioned_groups_flat",
                                                                             None)
    if base is None or not flats:
        return
    for flat in flats:
        state = base.state[flat]
        if "exp_avg" not in state:
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(flat), exp_avg_sq=torch.zeros_like(flat))
    if hasattr(opt, "_link_all_hp_params"):
        opt._link_all_hp_params()
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def _optimizer_step(engine) -> int:
    for state in _base_optimizer(engine).state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def _set_optimizer_step(engine, step: int, params) -> None:
    base = _base_optimizer(engine)
    if not any(_zero(p) for p in params):
        for p in params:
            base.state.setdefault(p, {})
    for state in base.state.values():
        if isinstance(state, dict) and ("exp_avg" in state or not state):
            state["step"] = torch.tensor(float(step))


# ----------------------------------------------------------------------------------------------- paths
def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(ckpt_root: str) -> Optional[str]:
    pointer = os.path.join(ckpt_root, "latest")
    if not os.path.isfile(pointer):
        return None
    with open(pointer, encoding="utf-8") as f:
        name = f.read().strip()
    path = os.path.join(ckpt_root, name)
    if not os.path.isdir(path):
        raise UserError(f"{pointer} names {name}, which does not exist: the checkpoint folder was damaged; point "
                        f"--ckpt_file at one of the step_* folders in {ckpt_root}")
    return path


def resolve(path: str) -> str:
    """--ckpt_file: a step folder, or a checkpoints/ or output folder (→ its latest)."""
    if not os.path.exists(path):
        raise UserError(f"checkpoint {path} not found")
    if not os.path.isdir(path):
        raise UserError(f"checkpoint {path} is a file: give a step_* folder, a checkpoints/ folder or a run's "
                        f"output_dir (a .pt from merge_checkpoint.py is already merged, for evaluate.py/export_hf.py)")
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    for root in (path, checkpoints_dir(path)):
        found = latest_checkpoint(root) if os.path.isdir(root) else None
        if found:
            return found
    if path.endswith(".tmp") or any(n.endswith(".tmp") for n in os.listdir(path)):
        raise UserError(f"{path} holds only a partial checkpoint (a save was interrupted); use an earlier one")
    raise UserError(f"{path} is not a checkpoint: no meta.json and no 'latest' pointer in it")


def _write_atomic(path: str, write) -> None:
    tmp = path + ".part"
    with checkpoint_file_guard(tmp):        # out of room: one line, the partial save removed (training.disk_full)
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def _crash_point(where: str, step: int) -> None:
    """Fault injection for the kill -9 tests: DSR_CRASH_AT=save:7 or train:7 SIGKILLs global rank 0 there."""
    spec = os.environ.get("DSR_CRASH_AT")
    if spec and spec == f"{where}:{step}" and dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def _sha256(path: Optional[str]) -> Optional[str]:
    if not path or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# ----------------------------------------------------------------------------------------------- save
def save(engine, output_dir: str, step: int, model_cfg: ModelConfig, parallel: ParallelConfig, args,
         tokenizer_path: Optional[str], keep: int, name: Optional[str] = None,
         validation: Optional[dict] = None) -> str:
    """Save step `step` as checkpoints/step_N (moving `latest`, pruning to `keep`), or as checkpoints/<name>
    (e.g. "best": replaced in place, outside the rotation). `validation` goes into meta.json."""
    ctx, rank = engine.ctx, dist.get_rank()
    root = checkpoints_dir(output_dir)
    refuse_non_finite_weights(engine, step, latest_checkpoint(root) if os.path.isdir(root) else None)  # collective
    final = os.path.join(root, name or step_dirname(step))
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()

    ensure_zero_state(engine)
    # a pipeline's replica of a tied weight (shared embeddings) is saved once, by the stage that owns it
    params = [(n, p) for n, p in engine.module.named_parameters() if not getattr(p, "ds_pipe_replicated", False)]
    shard = {}
    for pname, p in params:                                   # collective over DP under ZeRO: same order everywhere
        entry = {key: get_full(engine, p, key) for key in ("param",) + STATE_KEYS}
        dim = partition_dim(p)
        entry["partition_dim"] = dim
        entry["full_size"] = getattr(p, "full_size", None)   # serial length along dim: drops vocab padding
        shard[canonical_name(pname)] = entry       # (not `name`: that is the checkpoint's name, None = step_N)
    if ctx.dp_rank == 0:
        fname = f"shard_pp{ctx.pp_rank}_tp{ctx.tp_rank}.pt"
        _write_atomic(os.path.join(tmp, fname), lambda f: torch.save(shard, f))
    _write_atomic(os.path.join(tmp, f"rng_rank{rank}.pt"), lambda f: torch.save(RNG.get_state(), f))
    _crash_point("save", step)
    dist.barrier()
    if rank == 0:
        sched = engine.ds.lr_scheduler
        meta = {
            "format_version": FORMAT_VERSION, "step": step, "optimizer_step": _optimizer_step(engine),
            "model": dataclasses.asdict(model_cfg), "parallel": dataclasses.asdict(parallel),
            "world_size": dist.get_world_size(), "batch_size": args.batch_size, "seed": args.seed,
            "samples_seen": step * args.batch_size, "lr_scheduler": {"last_epoch": sched.last_epoch,
                                                                      "last_lr": sched.get_last_lr()},
            "tokenizer_sha256": _sha256(tokenizer_path),
            "shards": [f"shard_pp{p}_tp{t}.pt" for p in range(parallel.pipeline_stage)
                       for t in range(parallel.model_parallel)],
            "rng": [f"rng_rank{r}.pt" for r in range(dist.get_world_size())],
        }
        if validation is not None:
            meta["validation"] = validation
        _write_atomic(os.path.join(tmp, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
        if os.path.exists(final):                             # re-saving a step (a resumed run) replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        if name is None:
            _write_atomic(os.path.join(root, "latest"), lambda f: f.write(step_dirname(step).encode()))
            _prune(root, keep)
    dist.barrier()
    return final


def _prune(root: str, keep: int) -> None:
    if keep <= 0:
        return
    done = sorted(n for n in os.listdir(root) if n.startswith("step_") and not n.endswith(".tmp"))
    for name in done[:-keep]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    for name in os.listdir(root):                              # partial saves left by a crash
        if name.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# ----------------------------------------------------------------------------------------------- load
def read_meta(path: str) -> dict:
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        raise UserError(f"{path} is not a complete checkpoint: meta.json is missing")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{meta_path} is corrupt ({exc})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: checkpoint format {meta.get('format_version')} is not {FORMAT_VERSION}")
    missing = [n for n in meta["shards"] + meta["rng"] if not os.path.isfile(os.path.join(path, n))]
    if missing:
        raise UserError(f"{path} is incomplete: missing {', '.join(missing[:4])}"
                        + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    return meta


def _load_file(path: str):
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise UserError(f"checkpoint file {path} is corrupt or truncated ({type(exc).__name__}: {exc})")


def check_compatible(meta: dict, model_cfg: ModelConfig, path: str) -> None:
    saved = ModelConfig(**meta["model"])
    diffs = [f"{f}: checkpoint {getattr(saved, f)} vs now {getattr(model_cfg, f)}" for f in SHAPE_FIELDS
             if getattr(saved, f) != getattr(model_cfg, f)]
    if diffs:
        raise UserError(f"checkpoint {path} was trained with a different model — " + "; ".join(diffs)
                        + ". Use the same model flags/recipe (layouts may differ)")


def read_shard(path: str, pp_rank: int, tp_rank: int) -> dict:
    """What (stage pp_rank, TP rank tp_rank) saved: {canonical name: {"param", "exp_avg", "exp_avg_sq",
    "partition_dim", "full_size"}} (the local shard, gathered over ZeRO partitions)."""
    return _load_file(os.path.join(path, f"shard_pp{pp_rank}_tp{tp_rank}.pt"))


def load_full_state(path: str, meta: dict, names: Optional[set] = None) -> dict:
    """{canonical name: {"param"/"exp_avg"/"exp_avg_sq": full tensor}} merged over the saved TP shards."""
    saved_tp, saved_pp = meta["parallel"]["model_parallel"], meta["parallel"]["pipeline_stage"]
    full: dict = {}
    for pp in range(saved_pp):
        pieces = [read_shard(path, pp, t) for t in range(saved_tp)]
        for name, entry in pieces[0].items():
            if names is not None and name not in names:
                continue
            dim = entry["partition_dim"]
            full[name] = {k: merge_shards([p[name][k] for p in pieces], dim, entry["full_size"])
                          for k in ("param",) + STATE_KEYS}
    return full


def load(engine, path: str, model_cfg: ModelConfig, parallel: ParallelConfig, args,
         tokenizer_path: Optional[str] = None) -> int:
    meta = read_meta(path)
    now = _sha256(tokenizer_path)
    if meta.get("tokenizer_sha256") and now and meta["tokenizer_sha256"] != now:
        raise UserError(f"checkpoint {path} was trained with a different tokenizer (vocabulary) than {tokenizer_path}"
                        f"; token ids would not match. Use the tokenizer it was trained with (--tokenizer)")
    check_compatible(meta, model_cfg, path)
    if meta["batch_size"] != args.batch_size or meta["seed"] != args.seed:
        raise UserError(f"checkpoint {path} was trained with batch_size={meta['batch_size']} seed={meta['seed']}; "
                        f"resuming with batch_size={args.batch_size} seed={args.seed} would change the data order. "
                        f"Pass --batch_size {meta['batch_size']} --seed {meta['seed']}")
    ensure_zero_state(engine)
    params = list(engine.module.named_parameters())
    full = load_full_state(path, meta, {getattr(p, "tied_to", None) or canonical_name(n) for n, p in params})
    ctx = engine.ctx
    for name, p in params:
        key = getattr(p, "tied_to", None) or canonical_name(name)      # a tied replica loads its owner's value
        if key not in full:
            raise UserError(f"checkpoint {path} has no parameter {key}")
        dim = partition_dim(p)
        local_shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape
        for k in ("param",) + STATE_KEYS:
            value = full[key][k]
            if dim is not None:
                value = take_shard(value, dim, ctx.tp_rank, ctx.tp_size, local_shape[dim])
            if tuple(value.shape) != tuple(local_shape):
                raise UserError(f"checkpoint {path}: {key} has shape {tuple(value.shape)}, the model needs "
                                f"{tuple(local_shape)}")
            set_full(engine, p, k, value)
    _set_optimizer_step(engine, meta["optimizer_step"], [p for _, p in params])
    sched = engine.ds.lr_scheduler
    sched.last_epoch = meta["lr_scheduler"]["last_epoch"]
    sched._last_lr = list(meta["lr_scheduler"]["last_lr"])
    for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr()):
        group["lr"] = lr
    engine.ds.global_steps = meta["step"]
    engine.ds.global_samples = meta["samples_seen"]

    same_layout = meta["parallel"] == dataclasses.asdict(parallel) and meta["world_size"] == dist.get_world_size()
    if same_layout:
        RNG.set_state(_load_file(os.path.join(path, f"rng_rank{dist.get_rank()}.pt")))
    else:   # dropout streams cannot be carried across layouts; restart them deterministically from (seed, step)
        RNG.seed(args.seed + 7919 * meta["step"], tp_rank=ctx.tp_rank, pp_rank=ctx.pp_rank)
    return meta["step"]


# ----------------------------------------------------------------------------------------------- train.py hooks
def maybe_resume(engine, args, model_cfg, parallel, data) -> int:
    from training.output_dir import resume_source          # --resume [PATH|auto] / --ckpt_file → a folder or None
    path = resume_source(args)
    if path is None:
        return 0
    step = load(engine, path, model_cfg, parallel, args, getattr(data, "tokenizer_path", None))
    if dist.get_rank() == 0:
        print(f"resumed from {path} at step {step}", flush=True)
    return step


def maybe_save(engine, args, step, model_cfg, parallel, data) -> None:
    _crash_point("train", step)
    if args.save_checkpoint_steps and step % args.save_checkpoint_steps == 0:
        save(engine, args.output_dir, step, model_cfg, parallel, args, getattr(data, "tokenizer_path", None),
             args.keep_checkpoint_max)
