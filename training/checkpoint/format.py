"""A checkpoint on disk (format 2): the names of its files, meta.json, and reading its shards slice by slice.

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
        tokenizer.json            a copy of the tokenizer the run trained with (meta.json's "tokenizer";
                                  its sha256 is "tokenizer_sha256"), so that decoding, export and --resume find it
                                  without being told (`recorded_tokenizer`)

Parameters are keyed by layout-free names (`blocks.<layer>.<...>`: the same in the serial model and the pipeline).
`ShardIndex` reads, for any TP slice a loading rank needs, only the rows of the saved TP shards that overlap it
(`model.parallel.sharding.shard_rows` / `saved_pieces`: safetensors slices of a mapped file). Every file carries the
checkpoint's identity, so a file copied in from another checkpoint is refused.

Integrity: meta.json's "sha256" holds every file's digest, computed by its writer as it wrote it. A load verifies
each file it reads data from against it (`verify=False` skips that: `--verify 0`; train.py's ranks share the work
instead, each file hashed once per job: training.checkpoint.spread_verify), so bytes changed on disk after
the save — a flipped bit in a shard — are refused with the file's name instead of trained on. Weights that are not
finite are refused at every load (resume, evaluate, export, averaging) naming the tensor; saves already refuse to
write them (training.checkpoint.nonfinite). Checkpoints from before checksums were stored load unverified. Format 1
(torch .pt shards) is
converted by run_scripts/convert_checkpoint.py (training.checkpoint.convert).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import torch

from common.errors import UserError
from common.hashing import file_sha256
from model.config import ModelConfig, ParallelConfig
from model.parallel.sharding import saved_pieces, shard_rows
from training.checkpoint.optimizer_state import KEYS
from training.checkpoint.shard_io import read_all, read_header, read_slice, write_tensors

FORMAT_VERSION = 2


SHARD_FORMAT = "ds-transformer-recipes checkpoint shard"


# model sizes that must match for a checkpoint to load (dropout, smoothing etc. may change on resume)
SHAPE_FIELDS = (
    "vocab_size",
    "d_model",
    "num_heads",
    "ffn",
    "encoder_layers",
    "decoder_layers",
    "src_len",
    "tgt_len",
    "pad_id",
    "share_embeddings",
)


# ----------------------------------------------------------------------------------------------- names & files
def canonical_name(name: str) -> str:
    """'blocks.3.attn.qkv.weight' (serial) and '3.attn.qkv.weight' (PipelineModule) → 'blocks.3.attn.qkv.weight'."""
    return name if name.startswith("blocks.") else "blocks." + name


def shard_file(pp_rank: int, tp_rank: int) -> str:
    return f"shard_pp{pp_rank}_tp{tp_rank}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.safetensors"


TOKENIZER = "tokenizer.json"  # the run's tokenizer, copied into every checkpoint


def recorded_tokenizer(path: str, meta: dict) -> str | None:
    """The tokenizer checkpoint `path` recorded (its own copy), or None for a checkpoint saved before checkpoints
    held one. UserError when the copy is not the file the run trained with (its sha256 differs)."""
    name = meta.get("tokenizer")
    if not isinstance(name, str) or os.path.basename(name) != name:
        return None
    copy = os.path.join(path, name)
    if not os.path.isfile(copy):
        raise UserError(
            f"checkpoint {path} is incomplete: its tokenizer copy {name} is missing; pass the tokenizer "
            f"it was trained with (--tokenizer)"
        )
    want = meta.get("tokenizer_sha256")
    if want and file_sha256(copy) != want:
        raise UserError(
            f"checkpoint {path}: {name} does not match the tokenizer's sha256 saved with it (the file "
            f"changed after the save); pass the tokenizer it was trained with (--tokenizer)"
        )
    return copy


def tensor_name(key: str, name: str) -> str:
    """The safetensors name of a parameter's "param" / "exp_avg" / "exp_avg_sq"."""
    return f"{key}/{name}"


def write_shard_file(path: str, entries: dict, metadata: dict) -> str:
    """A whole shard at once from {name: {"param", "exp_avg", "exp_avg_sq", "partition_dim", "full_size"}}
    (the converter and tests; save() streams instead)."""
    params = {n: {"partition_dim": e["partition_dim"], "full_size": e["full_size"]} for n, e in entries.items()}
    return write_tensors(
        path,
        {tensor_name(k, n): e[k].float().contiguous() for n, e in entries.items() for k in KEYS},
        {**metadata, "format": SHARD_FORMAT, "format_version": FORMAT_VERSION, "params": json.dumps(params)},
    )


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
    state: dict = {"default": {}, "tp": None}  # RNG.get_state(): {"default": {device: state}, "tp": ...}
    for key, value in flat.items():
        group, device = key.split("/", 1)
        if state.get(group) is None:
            state[group] = {}
        state[group][device] = value
    return state


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
        raise UserError(f"{meta_path} is corrupt ({exc})") from exc
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version == 1:
        raise UserError(
            f"{path} is a format-1 checkpoint (torch .pt shards) and this version reads format "
            f"{FORMAT_VERSION} (safetensors); convert it once with `{convert_command(path)}` and load "
            f"the converted folder"
        )
    if version != FORMAT_VERSION:
        raise UserError(
            f"{path}: checkpoint format {version} is not {FORMAT_VERSION}: it was written by another "
            f"version of this code; load it with that version"
        )
    check_meta(meta, path, meta_path)
    missing = [n for n in meta["shards"] + meta["rng"] if not os.path.isfile(os.path.join(path, n))]
    if missing:
        raise UserError(
            f"{path} is incomplete: missing {', '.join(missing[:4])}"
            + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        )
    return meta


# meta.json's fields that loading reads, with the JSON types they must have: a hand-edited or damaged meta.json is
# one line naming the field, not a traceback
META_FIELDS = {
    "format_version": int,
    "step": int,
    "shards": list,
    "rng": list,
    "model": dict,
    "parallel": dict,
    "world_size": int,
    "optimizer_step": int,
    "samples_seen": int,
    "skipped_steps": int,
    "lr_scheduler": dict,
    "run_id": str,
    "checkpoint_id": str,
}
TYPE_NAMES = {int: "an integer", list: "a list", dict: "an object", str: "a string"}


def check_meta(meta: dict, path: str, meta_path: str) -> None:
    """meta.json of checkpoint `path` as the code reads it: every field of its type, and what it states twice in
    agreement (UserError naming the first problem)."""
    _check_meta_fields(meta, meta_path)
    _check_stated_twice(meta, path, meta_path)


def _check_meta_fields(meta: dict, meta_path: str) -> None:
    for key, kind in META_FIELDS.items():
        value = meta.get(key)
        if value is None or not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            what = "missing" if key not in meta else f"{json.dumps(value)[:40]}, not {TYPE_NAMES[kind]}"
            raise UserError(
                f"{meta_path}: field {key!r} is {what}; the file was edited or damaged — use another checkpoint"
            )
    files = meta["shards"] + meta["rng"]
    if not all(isinstance(n, str) and n and os.path.basename(n) == n for n in files):
        raise UserError(f"{meta_path}: 'shards' and 'rng' must list file names inside the checkpoint folder")
    sums = meta.get("sha256", {})
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise UserError(f"{meta_path}: field 'sha256' must map file names to hex digests")
    model_kinds = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    for key, value in meta["model"].items():
        _check_kind(f"model.{key}", value, model_kinds.get(key), meta_path)
    check_layout(meta["parallel"], meta_path)
    schedule = meta["lr_scheduler"]
    if (
        not _kind_matches(schedule.get("last_epoch"), "int")
        or not isinstance(schedule.get("last_lr"), list)
        or not all(_kind_matches(lr, "float") for lr in schedule["last_lr"])
    ):
        raise UserError(
            f"{meta_path}: field 'lr_scheduler' is {json.dumps(schedule)[:60]}, not "
            f'{{"last_epoch": an integer, "last_lr": a list of numbers}}; the file was edited or '
            f"damaged — use another checkpoint"
        )
    if isinstance(meta.get("optimization"), dict):
        for key, value in meta["optimization"].items():
            _check_kind(f"optimization.{key}", value, TRAJECTORY_KINDS.get(key, "float"), meta_path)


TRAJECTORY_KINDS = {"lr_schedule": "str", "warmup_steps": "int", "decay_steps": "int", "steps": "int"}  # else float
LAYOUT_SIZES = ("data_parallel", "model_parallel", "pipeline_stage")  # what the files of a checkpoint follow


def check_layout(parallel: dict, meta_path: str) -> None:
    """The saving layout as the code reads it: its three sizes present and >= 1, every field it knows of its type
    ("pipeline_stage": "2" traced back in range()). Fields it does not know are a newer or older layout's, unread."""
    kinds = {f.name: f.type for f in dataclasses.fields(ParallelConfig)}
    for key in LAYOUT_SIZES:
        value = parallel.get(key)
        if not _kind_matches(value, "int") or value < 1:
            raise UserError(
                f"{meta_path}: field 'parallel.{key}' is {json.dumps(value)[:40]}, not an integer >= 1; "
                f"the file was edited or damaged — use another checkpoint"
            )
    for key, value in parallel.items():
        if key in kinds:
            _check_kind(f"parallel.{key}", value, kinds[key], meta_path)


def _stated_twice(meta: dict, path: str) -> list[tuple[str, object, str, object]]:
    """(a meta.json field, its value, what else states it, that value) for each value a checkpoint states twice; a
    save writes both alike, so a difference is an edit or a copy."""
    parallel, world = meta["parallel"], meta["world_size"]
    sizes = [parallel[k] for k in LAYOUT_SIZES]
    pairs = [
        (
            "world_size",
            world,
            "parallel's data_parallel × model_parallel × pipeline_stage say",
            sizes[0] * sizes[1] * sizes[2],
        ),
        (
            "shards",
            meta["shards"],
            "the layout (parallel) says",
            [shard_file(p, t) for p in range(sizes[2]) for t in range(sizes[1])],
        ),
        (
            "rng",
            meta["rng"],
            "world_size says",
            [] if meta.get("weights_only") else [rng_file(r) for r in range(world)],
        ),
    ]
    name = re.fullmatch(r"step_(\d+)", os.path.basename(os.path.normpath(path)))
    if name:
        pairs.append(("step", meta["step"], f"the folder's name {name.group(0)} says", int(name.group(1))))
    if meta.get("sha256"):
        pairs.append(("sha256", sorted(meta["sha256"]), "shards and rng list", sorted(meta["shards"] + meta["rng"])))
    order = meta.get("data_order")
    if isinstance(order, dict):
        if "seed" in meta and "seed" in order:
            pairs.append(("seed", meta["seed"], "data_order says", order["seed"]))
        if order.get("batching") == "fixed" and "batch_size" in meta and "batch_size" in order:
            pairs.append(("batch_size", meta["batch_size"], "data_order says", order["batch_size"]))
    validation = meta.get("validation")
    if isinstance(validation, dict) and "step" in validation:
        pairs.append(("step", meta["step"], "its validation says", validation["step"]))
    return pairs


def _check_stated_twice(meta: dict, path: str, meta_path: str) -> None:
    for field, value, other, other_value in _stated_twice(meta, path):
        if value != other_value:
            raise UserError(
                f"{meta_path}: {field} is {json.dumps(value)[:80]} but {other} "
                f"{json.dumps(other_value)[:80]}: meta.json was edited (or the folder renamed), and "
                f"loading it would go on from the wrong place — put the value back, or use another "
                f"checkpoint"
            )


def _kind_matches(value, kind: str) -> bool:
    if kind.endswith(" | None"):  # e.g. parallel.zero_stage: null = DeepSpeed's default
        return value is None or _kind_matches(value, kind[: -len(" | None")])
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) if kind == "int" else math.isfinite(value)


def _check_kind(name: str, value, kind: str | None, meta_path: str) -> None:
    """One recorded setting as the code reads it (`vocab_size: 500.0` or `dropout: "0.1"` traced back when the
    model was built)."""
    if kind is None:
        raise UserError(
            f"{meta_path}: unknown field {name!r}; the file was edited, or written by another version — "
            f"use another checkpoint"
        )
    if not _kind_matches(value, kind):
        what = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string"}[kind]
        raise UserError(
            f"{meta_path}: field {name!r} is {json.dumps(value)[:40]}, not {what}; the file was edited "
            f"or damaged — use another checkpoint"
        )


def write_digest(path: str, digest: str) -> None:
    """The writer's sha256 of `path`, beside it until rank 0 puts every file's into meta.json."""
    with open(path + ".sha256", "w", encoding="utf-8") as f:
        f.write(digest)


def collect_digests(folder: str, names: list) -> dict:
    """{file name: sha256} from the digests the writers left in `folder` (removed once read)."""
    sums = {}
    for name in names:
        side = os.path.join(folder, name + ".sha256")
        with open(side, encoding="utf-8") as f:
            sums[name] = f.read().strip()
        os.remove(side)
    return sums


def verify_file(path: str, name: str, meta: dict) -> None:
    """UserError when file `name` of checkpoint `path` is not what its writer wrote (sha256 in meta.json)."""
    want = meta.get("sha256", {}).get(name)
    if want is None:
        return  # written before checksums were stored
    got = file_sha256(os.path.join(path, name))
    if got != want:
        raise UserError(
            f"checkpoint {path}: {name} does not match the checksum saved with it (sha256 {got[:12]}… "
            f"instead of {want[:12]}…): the file changed after it was written (a damaged disk or copy); "
            f"use an earlier checkpoint (train.py --resume auto picks the newest intact one), or load it "
            f"unchecked (train.py --verify 0; the other scripts --no_verify)"
        )


def verify_checkpoint(path: str, with_tokenizer: bool = False) -> dict:
    """meta.json complete and every file as written (`with_tokenizer`: its tokenizer copy too — what --resume auto's
    choice asks; a load given --tokenizer needs no copy); returns the meta (UserError naming the first problem)."""
    meta = read_meta(path)
    for name in meta["shards"] + meta["rng"]:
        verify_file(path, name, meta)
    if with_tokenizer:
        recorded_tokenizer(path, meta)
    return meta


def refuse_non_finite(name: str, tensor: torch.Tensor, where: str) -> None:
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise UserError(
            f"{where}: {name} holds {bad} non-finite value(s) (nan or inf); such weights cannot be "
            f"trained on, evaluated, exported or averaged — use an earlier checkpoint"
        )


def check_compatible(meta: dict, model_cfg: ModelConfig, path: str) -> None:
    saved = ModelConfig(**meta["model"])
    diffs = [
        f"{f}: checkpoint {getattr(saved, f)} vs now {getattr(model_cfg, f)}"
        for f in SHAPE_FIELDS
        if getattr(saved, f) != getattr(model_cfg, f)
    ]
    if diffs:
        raise UserError(
            f"checkpoint {path} was trained with a different model — "
            + "; ".join(diffs)
            + ". Use the same model flags/recipe (layouts may differ)"
        )


def check_identity(path: str, fname: str, got: dict, meta: dict, place: dict | None = None) -> None:
    """A file of this checkpoint carries meta.json's checkpoint id; anything else was copied in. Its header also
    states the step and the file's place (`place`: {"pp_rank", "tp_rank"} of a shard, {"rank"} of RNG states),
    which must be meta.json's step and the file's name."""
    if got.get("checkpoint_id") == meta.get("checkpoint_id"):
        _check_header_states(path, fname, got, meta, place or {})
        return
    if got.get("run_id") == meta.get("run_id"):
        origin = f"step {got.get('step')} of the same run"
    else:
        origin = f"another run (run {got.get('run_id')}, step {got.get('step')})"
    raise UserError(
        f"checkpoint {path}: {fname} belongs to {origin}, not to this checkpoint (run "
        f"{meta.get('run_id')}, step {meta.get('step')}): a file was copied in from another checkpoint; "
        f"use the checkpoint's own files or an earlier complete checkpoint"
    )


def _check_header_states(path: str, fname: str, got: dict, meta: dict, place: dict) -> None:
    """What a file's header states that meta.json (or the file's name) states too. Headers written before they held
    a value lack it: nothing to compare."""
    if "step" in got and got["step"] != str(meta["step"]):
        raise UserError(
            f"checkpoint {path}: meta.json says step {meta['step']}, but {fname} was saved at step "
            f"{got['step']} (its header): meta.json was edited, and a resume would count steps, the "
            f"learning rate and the data position from the wrong step on these weights. Put back "
            f'"step": {got["step"]}, or use another checkpoint'
        )
    for key, want in place.items():
        if key in got and got[key] != str(want):
            raise UserError(
                f"checkpoint {path}: {fname} holds {key} {got[key]} (its header), not {want} as its name "
                f"says: the checkpoint's files were renamed; use the checkpoint as it was saved, or "
                f"another one"
            )


def check_headers(path: str, meta: dict) -> None:
    """Every file meta.json lists, by its header alone (no tensor read): this checkpoint's, saved at its step, in
    the place its name says — before a run is set up on a checkpoint that will not load."""
    parallel = meta["parallel"]
    for pp in range(parallel["pipeline_stage"]):
        for tp in range(parallel["model_parallel"]):
            _, info = read_header(os.path.join(path, shard_file(pp, tp)))
            check_identity(path, shard_file(pp, tp), info, meta, {"pp_rank": pp, "tp_rank": tp})
    for rank, name in enumerate(meta["rng"]):
        _, info = read_header(os.path.join(path, name))
        check_identity(path, name, info, meta, {"rank": rank})


class ShardIndex:
    """The saved shards of a checkpoint, by parameter: which stage saved it, its TP partition and shapes, from the
    files' headers only (every file's identity checked). Values are read on demand, slice by slice; with `verify`,
    each file is checked against its saved sha256 before its first value is read. Weights ("param") that are not
    finite are refused."""

    def __init__(self, path: str, meta: dict, verify: bool = True):
        self.path, self.meta, self.verify = path, meta, verify
        self._verified: set = set()
        self.saved_tp = meta["parallel"]["model_parallel"]
        self.entries: dict = {}
        for pp in range(meta["parallel"]["pipeline_stage"]):
            for tp in range(self.saved_tp):
                header, info = read_header(self.file(pp, tp))
                if info.get("format") != SHARD_FORMAT or info.get("format_version") != str(FORMAT_VERSION):
                    raise UserError(
                        f"checkpoint {path}: {shard_file(pp, tp)} is not a format-{FORMAT_VERSION} checkpoint shard"
                    )
                check_identity(path, shard_file(pp, tp), info, meta, {"pp_rank": pp, "tp_rank": tp})
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

    def _read(self, pp: int, tp: int, tname: str, dim: int | None, lo: int, hi: int | None) -> torch.Tensor:
        fname = shard_file(pp, tp)
        empty = dim is not None and hi is not None and hi <= lo  # no bytes of this file are read
        if self.verify and not empty and fname not in self._verified:
            verify_file(self.path, fname, self.meta)
            self._verified.add(fname)
        return read_slice(self.file(pp, tp), tname, dim, lo, hi)

    def read_rows(self, name: str, key: str, dim: int | None, lo: int = 0, hi: int | None = None):
        """Rows [lo, hi) along `dim` of the full (serial, unpadded) tensor — dim None: all of it — reading only the
        saved shards that hold them."""
        value = self._rows(name, key, dim, lo, hi)
        if key == "param":
            refuse_non_finite(name, value, f"checkpoint {self.path}")
        return value

    def _rows(self, name: str, key: str, dim: int | None, lo: int = 0, hi: int | None = None):
        e, tname = self._entry(name), tensor_name(key, name)
        saved_dim = e["partition_dim"]
        if dim is None and saved_dim is not None:
            dim, lo, hi = saved_dim, 0, None
        if dim is None or saved_dim is None:  # replicated when saved: TP rank 0's copy has it all
            return self._read(e["stage"], 0, tname, dim, lo, hi)
        hi = self.full_len(name, dim) if hi is None else hi
        if saved_dim != dim:  # split along another dim when saved: whole, then narrow
            return self._rows(name, key, saved_dim).narrow(dim, lo, hi - lo)
        parts = [
            self._read(e["stage"], t, tname, dim, a, b)
            for t, a, b in saved_pieces(lo, hi, e["shape"][dim], self.saved_tp)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def read_local(self, name: str, key: str, dim: int | None, tp_rank: int, shape: tuple) -> torch.Tensor:
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
            raise UserError(
                f"checkpoint {self.path}: {name} has shape {tuple(value.shape)} here, the model needs {tuple(shape)}"
            )
        return value


def read_shard(path: str, pp_rank: int, tp_rank: int) -> dict:
    """What (stage pp_rank, TP rank tp_rank) saved: {canonical name: {"param", "exp_avg", "exp_avg_sq",
    "partition_dim", "full_size"}} (the local shard, gathered over ZeRO partitions)."""
    file = os.path.join(path, shard_file(pp_rank, tp_rank))
    _, info = read_header(file)
    tensors = read_all(file)
    return {
        name: {**{k: tensors[tensor_name(k, name)] for k in KEYS}, **e}
        for name, e in json.loads(info["params"]).items()
    }


def load_full_state(path: str, meta: dict, names: set | None = None, verify: bool = True) -> dict:
    """{canonical name: {"param"/"exp_avg"/"exp_avg_sq": full tensor}} merged over the saved TP shards."""
    index = ShardIndex(path, meta, verify=verify)
    keys = ("param",) if meta.get("weights_only") else KEYS
    return {
        name: {k: index.read_rows(name, k, None) for k in keys}
        for name in index.names()
        if names is None or name in names
    }
