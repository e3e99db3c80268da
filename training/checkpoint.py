"""Checkpoints that any parallel layout can load: save, resume, and reshard at load time (no conversion step).

Layout on disk (OUTPUT_DIR/checkpoints/), format 2:

    step_00000020/
        meta.json                 step, configs (model, the saving layout), the batching flags and seed
                                  (`data_order`: a resume with others is refused), the pairs trained on
                                  (`samples_seen`), the optimizer step and which optimizer saved it, LR schedule,
                                  tokenizer hash, the checkpoint's and run's identities, and the list of files below
        shard_pp{P}_tp{T}.safetensors
                                  for every parameter of pipeline stage P, TP rank T: its fp32 master weight
                                  `param/<name>` and AdamW moments `exp_avg/<name>`, `exp_avg_sq/<name>`, gathered
                                  over the DP (ZeRO) ranks; the header's metadata holds each parameter's TP partition
                                  dim and full size, the format version and the checkpoint identity
        rng_rank{R}.safetensors   every RNG stream of global rank R (exact dropout on a same-layout resume)
    latest                        the name of the newest complete checkpoint

Parameters are keyed by layout-free names (`blocks.<layer>.<...>`: the same in the serial model and the pipeline).
Loading reads, for each of this rank's parameters, only the rows of the saved TP shards that overlap its own slice
(`model.sharding.shard_rows` / `saved_pieces`: safetensors slices of a mapped file), nothing of other stages, and
writes them through training.optimizer_state, which knows each optimizer DeepSpeed builds (AdamW, BF16_Optimizer,
ZeRO 1/2/3). So tp2 → pp2, tp4 → tp2, dp2 ZeRO-3 → tp2, bf16 → fp32... all load online. Saving gathers one tensor
at a time and only the DP rank 0 of each (stage, TP rank) writes it (training.shard_io streams it into the file).

Atomicity: files go into `step_N.tmp/`; after every rank has written, rank 0 writes meta.json, renames the folder to
`step_N`, then moves `latest` (write + rename), and only then prunes old checkpoints. A crash at any moment leaves
either the previous complete checkpoint or an ignored `.tmp` folder. Multi-node runs need OUTPUT_DIR on a shared
filesystem. Every file carries the checkpoint's identity, so a file copied in from another checkpoint is refused.
Format 1 (torch .pt shards) is converted by run_scripts/convert_checkpoint.py.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import signal
from typing import Optional

import torch
import torch.distributed as dist

from model.config import ModelConfig, ParallelConfig
from model.random import RNG
from model.sharding import partition_dim, saved_pieces, shard_rows
from preprocess.errors import UserError
from training import optimizer_state
from training.data import check_data_order, data_order, legacy_data_order
from training.disk_full import checkpoint_file_guard
from training.nonfinite import refuse_non_finite_weights
from training.optimizer_state import KEYS, STATE_KEYS, local_shape  # noqa: F401  (STATE_KEYS: importable here)
from training.shard_io import ShardWriter, read_all, read_header, read_slice, write_tensors

FORMAT_VERSION = 2
SHARD_FORMAT = "ds-transformer-recipes checkpoint shard"
# model sizes that must match for a checkpoint to load (dropout, smoothing etc. may change on resume)
SHAPE_FIELDS = ("vocab_size", "d_model", "num_heads", "ffn", "encoder_layers", "decoder_layers", "src_len",
                "tgt_len", "pad_id", "share_embeddings")


# ----------------------------------------------------------------------------------------------- names & files
def canonical_name(name: str) -> str:
    """'blocks.3.attn.qkv.weight' (serial) and '3.attn.qkv.weight' (PipelineModule) → 'blocks.3.attn.qkv.weight'."""
    return name if name.startswith("blocks.") else "blocks." + name


def shard_file(pp_rank: int, tp_rank: int) -> str:
    return f"shard_pp{pp_rank}_tp{tp_rank}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.safetensors"


def tensor_name(key: str, name: str) -> str:
    """The safetensors name of a parameter's "param" / "exp_avg" / "exp_avg_sq"."""
    return f"{key}/{name}"


def write_shard_file(path: str, entries: dict, metadata: dict) -> None:
    """A whole shard at once from {name: {"param", "exp_avg", "exp_avg_sq", "partition_dim", "full_size"}}
    (the converter and tests; save() streams instead)."""
    params = {n: {"partition_dim": e["partition_dim"], "full_size": e["full_size"]} for n, e in entries.items()}
    write_tensors(path, {tensor_name(k, n): e[k].float().contiguous() for n, e in entries.items() for k in KEYS},
                  {**metadata, "format": SHARD_FORMAT, "format_version": FORMAT_VERSION,
                   "params": json.dumps(params)})


def rng_tensors(state: dict, prefix: str = "") -> dict:
    """RNG.get_state() as flat {"default/cpu": tensor, "tp/cpu": ..., ...} for a safetensors file."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(rng_tensors(value, f"{prefix}{key}/"))
        elif value is not None:
            out[f"{prefix}{key}"] = value
    return out


def rng_state(flat: dict) -> dict:
    state: dict = {"default": {}, "tp": None}          # RNG.get_state(): {"default": {device: state}, "tp": ...}
    for key, value in flat.items():
        group, device = key.split("/", 1)
        if state.get(group) is None:
            state[group] = {}
        state[group][device] = value
    return state


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
    state = optimizer_state.for_engine(engine)        # an optimizer it does not know: refused before any file
    run_id, checkpoint_id = _ids(engine)
    root = checkpoints_dir(output_dir)
    refuse_non_finite_weights(engine, step, latest_checkpoint(root) if os.path.isdir(root) else None)  # collective
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
    if writes or state.partitioned:                 # under ZeRO the gathers are collectives over DP
        _save_shard(os.path.join(tmp, shard_file(ctx.pp_rank, ctx.tp_rank)) if writes else None, state, params,
                    {**ids, "pp_rank": ctx.pp_rank, "tp_rank": ctx.tp_rank})
    rng_path = os.path.join(tmp, rng_file(rank))
    with checkpoint_file_guard(rng_path + ".part"):
        write_tensors(rng_path, rng_tensors(RNG.get_state()), {**ids, "rank": rank})
    _crash_point("save", step)
    dist.barrier()
    if rank == 0:
        sched = engine.ds.lr_scheduler
        meta = {
            "format_version": FORMAT_VERSION, **ids, "optimizer_step": state.step(),
            "optimizer": state.describe(), "skipped_steps": int(getattr(engine.ds, "skipped_steps", 0)),
            "model": dataclasses.asdict(model_cfg), "parallel": dataclasses.asdict(parallel),
            "world_size": dist.get_world_size(), "batch_size": args.batch_size, "seed": args.seed,
            "data_order": data_order(args), "samples_seen": int(engine.ds.global_samples),
            "lr_scheduler": {"last_epoch": sched.last_epoch, "last_lr": sched.get_last_lr()},
            "tokenizer_sha256": _sha256(tokenizer_path),
            "shards": [shard_file(p, t) for p in range(parallel.pipeline_stage)
                       for t in range(parallel.model_parallel)],
            "rng": [rng_file(r) for r in range(dist.get_world_size())],
        }
        scaler = state.scaler_state()
        if scaler is not None:
            meta["loss_scaler"] = scaler
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


def _save_shard(path: Optional[str], state, params: list, metadata: dict) -> None:
    """Gather every parameter's master weight and moments one tensor at a time; the writer (path not None) streams
    each into the shard and drops it, the other DP ranks only take part in the gathers."""
    if path is None:
        _gather_shard(None, state, params, metadata)
        return
    with checkpoint_file_guard(path + ".part"):     # out of room: one line, the partial save removed
        _gather_shard(path, state, params, metadata)


def _gather_shard(path: Optional[str], state, params: list, metadata: dict) -> None:
    writer = None
    if path is not None:
        info = {n: {"partition_dim": partition_dim(p), "full_size": getattr(p, "full_size", None)}
                for n, p in params}                     # full_size: serial length along dim (drops vocab padding)
        specs = [(tensor_name(k, n), local_shape(p), torch.float32) for n, p in params for k in KEYS]
        writer = ShardWriter(path, specs, {**metadata, "format": SHARD_FORMAT, "format_version": FORMAT_VERSION,
                                           "params": json.dumps(info)})
    try:
        for n, p in params:                             # the same order on every DP rank
            for k in KEYS:
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
def convert_command(path: str) -> str:
    new = os.path.join(os.path.dirname(os.path.abspath(path)), "v2-" + os.path.basename(os.path.abspath(path)))
    return f"python run_scripts/convert_checkpoint.py {path} {new}"


def read_meta(path: str) -> dict:
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        raise UserError(f"{path} is not a complete checkpoint: meta.json is missing")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{meta_path} is corrupt ({exc})")
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version == 1:
        raise UserError(f"{path} is a format-1 checkpoint (torch .pt shards) and this version reads format "
                        f"{FORMAT_VERSION} (safetensors); convert it once with `{convert_command(path)}` and load "
                        f"the converted folder")
    if version != FORMAT_VERSION:
        raise UserError(f"{path}: checkpoint format {version} is not {FORMAT_VERSION}: it was written by another "
                        f"version of this code; load it with that version")
    missing = [n for n in meta["shards"] + meta["rng"] if not os.path.isfile(os.path.join(path, n))]
    if missing:
        raise UserError(f"{path} is incomplete: missing {', '.join(missing[:4])}"
                        + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    return meta


def check_compatible(meta: dict, model_cfg: ModelConfig, path: str) -> None:
    saved = ModelConfig(**meta["model"])
    diffs = [f"{f}: checkpoint {getattr(saved, f)} vs now {getattr(model_cfg, f)}" for f in SHAPE_FIELDS
             if getattr(saved, f) != getattr(model_cfg, f)]
    if diffs:
        raise UserError(f"checkpoint {path} was trained with a different model — " + "; ".join(diffs)
                        + ". Use the same model flags/recipe (layouts may differ)")


def _check_identity(path: str, fname: str, got: dict, meta: dict) -> None:
    """A file of this checkpoint carries meta.json's checkpoint id; anything else was copied in."""
    if got.get("checkpoint_id") == meta.get("checkpoint_id"):
        return
    if got.get("run_id") == meta.get("run_id"):
        origin = f"step {got.get('step')} of the same run"
    else:
        origin = f"another run (run {got.get('run_id')}, step {got.get('step')})"
    raise UserError(f"checkpoint {path}: {fname} belongs to {origin}, not to this checkpoint (run "
                    f"{meta.get('run_id')}, step {meta.get('step')}): a file was copied in from another checkpoint; "
                    f"use the checkpoint's own files or an earlier complete checkpoint")


class ShardIndex:
    """The saved shards of a checkpoint, by parameter: which stage saved it, its TP partition and shapes, from the
    files' headers only (every file's identity checked). Values are read on demand, slice by slice."""

    def __init__(self, path: str, meta: dict):
        self.path, self.meta = path, meta
        self.saved_tp = meta["parallel"]["model_parallel"]
        self.entries: dict = {}
        for pp in range(meta["parallel"]["pipeline_stage"]):
            for tp in range(self.saved_tp):
                header, info = read_header(self.file(pp, tp))
                if info.get("format") != SHARD_FORMAT or info.get("format_version") != str(FORMAT_VERSION):
                    raise UserError(f"checkpoint {path}: {shard_file(pp, tp)} is not a format-{FORMAT_VERSION} "
                                    f"checkpoint shard")
                _check_identity(path, shard_file(pp, tp), info, meta)
                if tp:
                    continue
                for name, e in json.loads(info["params"]).items():
                    self.entries[name] = {**e, "stage": pp, "shape": header[tensor_name("param", name)]["shape"]}

    def file(self, pp: int, tp: int) -> str:
        return os.path.join(self.path, shard_file(pp, tp))

    def names(self) -> list:
        return list(self.entries)

    def _entry(self, name: str) -> dict:
        if name not in self.entries:
            raise UserError(f"checkpoint {self.path} has no parameter {name}")
        return self.entries[name]

    def full_len(self, name: str, dim: int) -> int:
        e = self._entry(name)
        if e["partition_dim"] == dim:
            return e["full_size"] or e["shape"][dim] * self.saved_tp
        return e["shape"][dim]

    def read_rows(self, name: str, key: str, dim: Optional[int], lo: int = 0, hi: Optional[int] = None):
        """Rows [lo, hi) along `dim` of the full (serial, unpadded) tensor — dim None: all of it — reading only the
        saved shards that hold them."""
        e, tname = self._entry(name), tensor_name(key, name)
        saved_dim = e["partition_dim"]
        if dim is None and saved_dim is not None:
            dim, lo, hi = saved_dim, 0, None
        if dim is None or saved_dim is None:          # replicated when saved: TP rank 0's copy has it all
            return read_slice(self.file(e["stage"], 0), tname, dim, lo, hi)
        hi = self.full_len(name, dim) if hi is None else hi
        if saved_dim != dim:                          # split along another dim when saved: whole, then narrow
            return self.read_rows(name, key, saved_dim).narrow(dim, lo, hi - lo)
        parts = [read_slice(self.file(e["stage"], t), tname, dim, a, b)
                 for t, a, b in saved_pieces(lo, hi, e["shape"][dim], self.saved_tp)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def read_local(self, name: str, key: str, dim: Optional[int], tp_rank: int, shape: tuple) -> torch.Tensor:
        """TP rank `tp_rank`'s slice, of `shape`, by take_shard's rule (zero rows past the end: TP padding)."""
        if dim is None:
            value = self.read_rows(name, key, None)
        else:
            lo, hi, pad = shard_rows(self.full_len(name, dim), tp_rank, shape[dim])
            parts = [self.read_rows(name, key, dim, lo, hi)] if hi > lo else []
            if pad:
                pad_shape = list(shape)
                pad_shape[dim] = pad
                parts.append(torch.zeros(pad_shape, dtype=torch.float32))
            value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
        if tuple(value.shape) != tuple(shape):
            raise UserError(f"checkpoint {self.path}: {name} has shape {tuple(value.shape)} here, the model needs "
                            f"{tuple(shape)}")
        return value


def read_shard(path: str, pp_rank: int, tp_rank: int) -> dict:
    """What (stage pp_rank, TP rank tp_rank) saved: {canonical name: {"param", "exp_avg", "exp_avg_sq",
    "partition_dim", "full_size"}} (the local shard, gathered over ZeRO partitions)."""
    file = os.path.join(path, shard_file(pp_rank, tp_rank))
    _, info = read_header(file)
    tensors = read_all(file)
    return {name: {**{k: tensors[tensor_name(k, name)] for k in KEYS}, **e}
            for name, e in json.loads(info["params"]).items()}


def load_full_state(path: str, meta: dict, names: Optional[set] = None) -> dict:
    """{canonical name: {"param"/"exp_avg"/"exp_avg_sq": full tensor}} merged over the saved TP shards."""
    index = ShardIndex(path, meta)
    return {name: {k: index.read_rows(name, k, None) for k in KEYS}
            for name in index.names() if names is None or name in names}


def load(engine, path: str, model_cfg: ModelConfig, parallel: ParallelConfig, args,
         tokenizer_path: Optional[str] = None) -> int:
    meta = read_meta(path)
    now = _sha256(tokenizer_path)
    if meta.get("tokenizer_sha256") and now and meta["tokenizer_sha256"] != now:
        raise UserError(f"checkpoint {path} was trained with a different tokenizer (vocabulary) than {tokenizer_path}"
                        f"; token ids would not match. Use the tokenizer it was trained with (--tokenizer)")
    check_compatible(meta, model_cfg, path)
    now_order = data_order(args)
    check_data_order(meta.get("data_order") or legacy_data_order(meta, now_order), now_order, path)
    state = optimizer_state.for_engine(engine)
    index = ShardIndex(path, meta)
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
        _, info = read_header(os.path.join(path, fname))
        _check_identity(path, fname, info, meta)
        RNG.set_state(rng_state(read_all(os.path.join(path, fname))))
    else:   # dropout streams cannot be carried across layouts; restart them deterministically from (seed, step)
        RNG.seed(args.seed + 7919 * meta["step"], tp_rank=ctx.tp_rank, pp_rank=ctx.pp_rank)
    return meta["step"]


# ----------------------------------------------------------------------------------------------- train.py hooks
def check_optimizer(engine, args) -> None:
    """At start, before any step: a run that will save or load a checkpoint needs an optimizer whose state the
    checkpoint code knows (training.optimizer_state); otherwise the first save would fail hours later."""
    if args.save_checkpoint_steps or args.valid_file or args.resume or args.ckpt_file:
        optimizer_state.for_engine(engine)


def maybe_resume(engine, args, model_cfg, parallel, data) -> int:
    from training.output_dir import resume_source          # --resume [PATH|auto] / --ckpt_file → a folder or None
    path = resume_source(args)
    if path is None:
        return 0
    step = load(engine, path, model_cfg, parallel, args, getattr(data, "tokenizer_path", None))
    if dist.get_rank() == 0:
        saved = read_meta(path)["optimizer"]
        print(f"resumed from {path} at step {step} (saved by {saved['class']}, {saved['precision']}, ZeRO "
              f"{saved['zero_stage']})", flush=True)
    return step


def maybe_save(engine, args, step, model_cfg, parallel, data, last: bool = False) -> None:
    """Every --save_checkpoint_steps steps, and at the run's last step (its end or an early stop), so the final
    weights are always in the rotation (checkpoint averaging takes the last K)."""
    _crash_point("train", step)
    if args.save_checkpoint_steps and (step % args.save_checkpoint_steps == 0 or last):
        save(engine, args.output_dir, step, model_cfg, parallel, args, getattr(data, "tokenizer_path", None),
             args.keep_checkpoint_max)
