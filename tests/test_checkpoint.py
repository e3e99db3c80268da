"""Checkpoints under every optimizer DeepSpeed builds here: exact same-layout resume, online resharding (into ZeRO
layouts too), loading across precisions, kill -9 during training and during a save, the merge tool, the format-1
converter, and every bad-checkpoint message.

Save→resume is runs in a row (torchtitan style): an uninterrupted run that saves every step is the reference; a
second run resumes from one of its checkpoints, under the same or another layout. A third kind of run loads a
checkpoint and saves it again at once (tests/drivers/load_and_save.py): what a layout and optimizer loaded, written
back out, must equal what was saved, tensor for tensor. Runs of one world size share one launch
(tests/drivers/train_many.py), in phases:

    references      2 processes: every case of REFERENCES (STEPS steps, saving every step); 4 processes: tp4
    kill -9         2 processes, one launch per crash point (the launch dies)
    continuations   2 processes: same-layout resumes, reshards, load-and-save round trips, resumes after kill -9;
                    1 process: the reshards and round trips into the serial layout
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from common.file_modes import umask as current_umask
from tests import accelerator
from tests.launch import (
    REPO_ROOT,
    TINY,
    TINY_MODEL,
    attempt_dir,
    concurrently,
    env,
    launch_cmd,
    losses,
    merged,
    run_many,
    run_python,
    run_train,
    step_dir,
    train_flags,
)
from tests.progress import scaled

STEPS, CUT = 4, 2
LR = float(TINY[TINY.index("--lr") + 1])
DROPOUT = ["--dropout", "0.1"]  # TINY sets 0; later flags win
PP2 = ["--pipeline_stage", "2", "--micro_batch_num", "2"]

# name: (processes, precision, flags, the optimizer DeepSpeed builds for it — read back from run.json)
LAYOUTS = {
    "serial": (1, "fp32", [], "ClippingAdamW"),
    "tp2": (2, "fp32", ["--mp", "2"], "ClippingAdamW"),
    "pp2": (2, "fp32", PP2, "ClippingAdamW"),
    "dp2": (2, "fp32", [], "ClippingAdamW"),
    "dp2-zero1": (2, "fp32", ["--zero_stage", "1"], "DeepSpeedZeroOptimizer"),
    "dp2-zero2": (2, "fp32", ["--zero_stage", "2"], "DeepSpeedZeroOptimizer"),
    "dp2-zero3": (2, "fp32", ["--zero_stage", "3"], "DeepSpeedZeroOptimizer_Stage3"),
    "tp4": (4, "fp32", ["--mp", "4"], "ClippingAdamW"),
    "bf16-tp2": (2, "bf16", ["--mp", "2"], "BF16_Optimizer"),
    "bf16-pp2": (2, "bf16", PP2, "BF16_Optimizer"),
    "bf16-dp2-zero1": (2, "bf16", ["--zero_stage", "1"], "BF16_Optimizer"),
    "bf16-dp2-zero2": (2, "bf16", ["--zero_stage", "2"], "DeepSpeedZeroOptimizer"),
    "bf16-dp2-zero3": (2, "bf16", ["--zero_stage", "3"], "DeepSpeedZeroOptimizer_Stage3"),
    "fp16-dp2-zero1": (2, "fp16", ["--zero_stage", "1"], "DeepSpeedZeroOptimizer"),
}
# uninterrupted references: (layout, dropout). Same-layout resumes of the dropout ones also prove the RNG streams
# are restored; the dropout-free ones double as reshard sources (another layout draws other dropout masks).
REFERENCES = {
    "tp2-drop": ("tp2", True),
    "pp2-drop": ("pp2", True),
    "dp2-zero1-drop": ("dp2-zero1", True),
    "dp2": ("dp2", False),
    "dp2-zero2": ("dp2-zero2", False),
    "dp2-zero3": ("dp2-zero3", False),
    "tp2": ("tp2", False),
    "pp2": ("pp2", False),
    "tp4": ("tp4", False),
    "bf16-pp2": ("bf16-pp2", False),
    "bf16-dp2-zero1": ("bf16-dp2-zero1", False),
    "bf16-dp2-zero2": ("bf16-dp2-zero2", False),
    "bf16-dp2-zero3": ("bf16-dp2-zero3", False),
    "fp16-dp2-zero1": ("fp16-dp2-zero1", False),
}
# every optimizer DeepSpeed builds here, each resumed on its own layout
SAME_LAYOUT = [
    "tp2-drop",
    "pp2-drop",
    "dp2",
    "dp2-zero1-drop",
    "dp2-zero2",
    "dp2-zero3",
    "bf16-pp2",
    "bf16-dp2-zero1",
    "bf16-dp2-zero2",
    "bf16-dp2-zero3",
    "fp16-dp2-zero1",
]
RESHARD = [  # (reference saved under, layout loaded under)
    ("tp2", "pp2"),
    ("pp2", "serial"),
    ("tp4", "tp2"),
    ("tp2", "dp2-zero1"),
    ("pp2", "dp2-zero2"),
    ("tp2", "dp2-zero3"),
    ("dp2-zero3", "tp2"),
    ("bf16-pp2", "bf16-dp2-zero2"),
]
ACROSS_PRECISION = [("bf16-pp2", "pp2"), ("tp2", "bf16-tp2")]  # (reference, layout of the other precision)
CRASHES = ["train:3", "save:3"]


def precision_of(name: str) -> str:
    return LAYOUTS[REFERENCES[name][0] if name in REFERENCES else name][1]


def runnable(name: str) -> bool:
    return accelerator.supported(precision_of(name))


def case(name: str):
    """A parametrize value, skipped with the reason where this machine lacks the precision it needs."""
    return name if runnable(name) else accelerator.param(name, precision_of(name))


def pair(src: str, dst: str):
    missing = [precision_of(n) for n in (src, dst) if not runnable(n)]
    return pytest.param(src, dst, id=f"{src}->{dst}", marks=[accelerator.skip_unless(missing[0])] if missing else [])


def layout_flags(layout: str, dropout: bool = False) -> list:
    _, precision, extra, _ = LAYOUTS[layout]
    return ["--precision", precision, *extra, *(DROPOUT if dropout else [])]


def assert_same_state(a: dict, b: dict, what: str) -> None:
    """Two merged checkpoints hold bit-identical fp32 master weights and AdamW moments."""
    assert a["model"].keys() == b["model"].keys(), what
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"{what}: {name}"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a["optimizer"][name][key], b["optimizer"][name][key]), f"{what}: {name} {key}"
    assert a["optimizer_step"] == b["optimizer_step"], what


@pytest.fixture(scope="module")
def runs(multi30k_tsv, bpe_tokenizer, tmp_path_factory):
    """Output folder of every run by name, made on demand, one launch per phase and world size."""
    root = tmp_path_factory.mktemp("ckpt")
    data = (multi30k_tsv, bpe_tokenizer)
    done: dict = {}

    def ref_args(name, out):
        layout, dropout = REFERENCES[name]
        return train_flags(
            *data,
            out / name,
            "--steps",
            STEPS,
            "--save_checkpoint_steps",
            1,
            "--keep_checkpoint_max",
            10,
            *layout_flags(layout, dropout),
        )

    def launch(what, nproc, batch, out):
        start = time.time()
        run_many(nproc, batch, out)
        print(f"[{what}: {len(batch)} runs on {nproc} process(es) in one launch, {time.time() - start:.0f} s]")

    def references(nproc):
        names = [n for n in REFERENCES if LAYOUTS[REFERENCES[n][0]][0] == nproc and runnable(n)]
        out = attempt_dir(root, f"references{nproc}")  # a retry after a failed launch starts in new folders
        launch("references", nproc, [ref_args(n, out) for n in names], out)
        for n in names:
            done[n] = out / n
            info = json.loads((out / n / "run.json").read_text())
            assert info["optimizer"] == LAYOUTS[REFERENCES[n][0]][3], (n, info)

    def kill(crash, attempt):
        out = attempt / f"kill-{crash.replace(':', '-')}"
        argv = train_flags(*data, out, "--steps", STEPS, "--save_checkpoint_steps", 1, *layout_flags("tp2", True))
        start = time.time()
        proc = subprocess.run(
            launch_cmd(2) + [str(a) for a in argv],
            cwd=REPO_ROOT,
            env=dict(env(), DSR_CRASH_AT=crash),
            capture_output=True,
            text=True,
            timeout=scaled(300),
        )
        print(f"[kill -9 at {crash}: {time.time() - start:.0f} s]")
        ckpts = out / "checkpoints"
        done[f"kill {crash}"] = {
            "returncode": proc.returncode,
            "latest": (ckpts / "latest").read_text(),
            "tmp": (ckpts / f"step_{3:08d}.tmp").is_dir(),
            "final": (ckpts / f"step_{3:08d}").exists(),
        }
        return out

    def continuations():
        for nproc in (2, 4):
            if not any(n in done for n in REFERENCES if LAYOUTS[REFERENCES[n][0]][0] == nproc):
                references(nproc)
        attempt = attempt_dir(root, "continuations")
        killed = {crash: kill(crash, attempt) for crash in CRASHES}
        batches: dict = {1: [], 2: []}

        def add(name, layout, argv, resave=False):
            batches[LAYOUTS[layout][0]].append({"load_and_save": argv} if resave else argv)
            done[name] = argv[argv.index("--output_dir") + 1]

        for name in SAME_LAYOUT:
            if runnable(name):
                layout, dropout = REFERENCES[name]
                add(
                    f"resume {name}",
                    layout,
                    train_flags(
                        *data,
                        attempt / f"resume-{name}",
                        "--steps",
                        STEPS,
                        "--ckpt_file",
                        step_dir(done[name], CUT),
                        "--save_checkpoint_steps",
                        1,
                        *layout_flags(layout, dropout),
                    ),
                )
        for src, dst in RESHARD + ACROSS_PRECISION:
            if runnable(src) and runnable(dst):
                tag = f"{src}-to-{dst}"
                if (src, dst) in RESHARD:
                    add(
                        f"reshard {src}->{dst}",
                        dst,
                        train_flags(
                            *data,
                            attempt / f"reshard-{tag}",
                            "--steps",
                            STEPS,
                            "--ckpt_file",
                            step_dir(done[src], CUT),
                            "--save_checkpoint_steps",
                            1,
                            *layout_flags(dst),
                        ),
                    )
                add(
                    f"load+save {src}->{dst}",
                    dst,
                    train_flags(
                        *data,
                        attempt / f"resave-{tag}",
                        "--steps",
                        STEPS,
                        "--ckpt_file",
                        step_dir(done[src], CUT),
                        *layout_flags(dst),
                    ),
                    resave=True,
                )
        for crash, out in killed.items():
            add(
                f"resume {crash}",
                "tp2",
                train_flags(
                    *data, out, "--steps", STEPS, "--save_checkpoint_steps", 1, *layout_flags("tp2", True), "--resume"
                ),
            )
        for nproc, batch in batches.items():
            if batch:
                launch("continuations", nproc, batch, attempt)

    def get(name):
        if name not in done:
            if name in REFERENCES:
                references(LAYOUTS[REFERENCES[name][0]][0])
            else:
                continuations()
        return done[name]

    return get


# --------------------------------------------------------------------------------------------- resume and reshard
@pytest.mark.slow
@pytest.mark.parametrize("name", [case(n) for n in SAME_LAYOUT])
def test_same_layout_resume_is_bit_identical(name, runs):
    """Every optimizer DeepSpeed builds here: losses, fp32 master weights and both AdamW moments after the resumed
    steps equal the uninterrupted run's bit for bit (dropout on where the name says so: the RNG streams too)."""
    ref, got = runs(name), runs(f"resume {name}")
    assert losses(got) == losses(ref)[CUT:]
    a, b = merged(ref), merged(got)
    assert a["step"] == b["step"] == STEPS
    assert_same_state(a, b, name)
    # the moments are real: every tensor's are non-zero (a checkpoint that lost them would save zeros)
    for n, state in a["optimizer"].items():
        assert state["exp_avg"].any() and state["exp_avg_sq"].any(), n


@pytest.mark.slow
@pytest.mark.parametrize("src,dst", [pair(s, d) for s, d in RESHARD])
def test_reshard_onto_another_layout(src, dst, runs):
    ref, got = runs(src), runs(f"reshard {src}->{dst}")
    # 1. Loading is lossless: the destination layout's optimizer, saved again at once, holds exactly the source's
    #    master weights and moments (here into ZeRO partitions, out of them, across TP sizes and stages).
    assert_same_state(merged(step_dir(ref, CUT)), merged(runs(f"load+save {src}->{dst}")), f"{src}->{dst}")
    # 2. Training continues as the uninterrupted run. fp32: the next step's loss is the reference's up to fp32
    #    summation order (another layout sums in another order: measured ≤ 1.1e-7), later steps too, and after
    #    STEPS - CUT more steps every weight is within 0.05·lr of the reference's (measured ≤ 1.3e-3·lr; Adam moves
    #    an element by ~lr per step, so a wrong or zeroed moment is off by ~lr at once). bf16: layouts may round
    #    differently, so the parity suite's bf16 bound applies (5e-4 relative loss, tests/test_parity.py) and
    #    weights within 0.5·lr (measured: 0 for this pair); restarting from the initial weights is off by 1.3e-2.
    half = precision_of(src) != "fp32"
    got_losses, ref_losses = losses(got), losses(ref)[CUT:]
    first = abs(got_losses[0] - ref_losses[0]) / ref_losses[0]
    worst_loss = max(abs(a - b) / b for a, b in zip(got_losses, ref_losses, strict=False))
    a, b = merged(ref), merged(got)
    worst_step = max(float((a["model"][n] - b["model"][n]).abs().max()) for n in a["model"]) / LR
    print(
        f"RESHARD {src}->{dst}: next-step loss rel {first:.2e}, worst loss rel {worst_loss:.2e}, "
        f"largest weight difference after {STEPS - CUT} steps = {worst_step:.2e} × lr"
    )
    if half:
        assert worst_loss <= 5e-4
        assert worst_step <= 0.5
    else:
        assert first <= 1e-6
        assert worst_loss <= 1e-5
        assert worst_step <= 0.05


@pytest.mark.slow
@pytest.mark.parametrize("src,dst", [pair(s, d) for s, d in ACROSS_PRECISION])
def test_checkpoint_of_another_precision_loads_exactly(src, dst, runs):
    """bf16 (BF16_Optimizer) → fp32 (AdamW) and fp32 → bf16: master weights and moments are fp32 under both, so the
    other precision's optimizer holds exactly what was saved (its step count too)."""
    saved, loaded = merged(step_dir(runs(src), CUT)), merged(runs(f"load+save {src}->{dst}"))
    assert_same_state(saved, loaded, f"{src}->{dst}")
    meta = json.loads((step_dir(runs(src), CUT) / "meta.json").read_text())
    assert meta["optimizer"]["precision"] == precision_of(src) != precision_of(dst)


@pytest.mark.slow
@pytest.mark.parametrize("crash", CRASHES)
def test_kill_9_then_resume_matches_uninterrupted(crash, runs):
    resumed = runs(f"resume {crash}")
    killed = runs(f"kill {crash}")
    assert killed["returncode"] != 0
    if crash.startswith("train"):
        # --save_mode background (the default): step 2's save may still be in flight when rank 0 dies after step 3,
        # and then step 1 stays the latest (tests/test_background_save.py: such a kill resumes exactly)
        assert killed["latest"] in (f"step_{1:08d}", f"step_{2:08d}")
    else:
        assert killed["latest"] == f"step_{2:08d}"  # the crashed step never became 'latest'
    if crash.startswith("save"):
        assert killed["tmp"] and not killed["final"]
    a, b = merged(runs("tp2-drop")), merged(resumed)
    assert a["step"] == b["step"] == STEPS
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert not list((resumed / "checkpoints").glob("*.tmp"))  # the partial save was cleaned up


def test_merged_checkpoint_loads_into_serial_model(runs, tmp_path):
    ref = runs("tp2-drop")
    out = tmp_path / "model.pt"
    proc = run_python(
        [sys.executable, str(REPO_ROOT / "run_scripts" / "merge_checkpoint.py"), str(ref), "--output", str(out)],
        env=env(),
    )
    assert proc.returncode == 0, proc.stderr
    obj = torch.load(out, weights_only=True)
    from model.config import ModelConfig
    from model.transformer import Seq2SeqTransformer

    model = Seq2SeqTransformer(ModelConfig(**obj["model_config"]))
    model.load_state_dict(obj["model"], strict=True)
    assert obj["step"] == STEPS


CONSOLIDATED = ["tp2", "pp2", "dp2-zero2", "dp2-zero3"]  # saved by real 2-rank runs (the references)


def merge_cli(*args, cwd=REPO_ROOT) -> subprocess.CompletedProcess:
    return run_python(
        [sys.executable, str(REPO_ROOT / "run_scripts" / "merge_checkpoint.py"), *map(str, args)], cwd=cwd, env=env()
    )


def test_consolidated_safetensors_is_the_serial_state_dict_of_every_layout(runs, tmp_path):
    """merge_checkpoint.py --output X.safetensors: the tensors a plain safetensors reader sees are the single-device
    model's state dict as the .pt of the same checkpoint loads into it; the header holds step, model config, source
    and digests; evaluate/translate/export load it as they load the .pt."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from model.config import ModelConfig
    from model.transformer import Seq2SeqTransformer
    from training.checkpoint import consolidated

    for name in CONSOLIDATED:
        ckpt = step_dir(runs(name), STEPS)
        pt, st = tmp_path / f"{name}.pt", tmp_path / f"{name}.safetensors"
        if name == CONSOLIDATED[0]:  # the command itself once, the function after
            for out in (pt, st):
                proc = merge_cli(runs(name), "--output", out)  # a run's folder → its latest
                assert proc.returncode == 0, proc.stderr[-3000:]
        else:
            merged = consolidated.merge(str(ckpt))
            consolidated.save(merged, str(pt))
            consolidated.save(merged, str(st))
        obj = torch.load(pt, weights_only=True)
        model = Seq2SeqTransformer(ModelConfig(**obj["model_config"]))
        model.load_state_dict(obj["model"], strict=True)
        serial = model.state_dict()
        tensors = load_file(str(st))
        assert tensors.keys() == serial.keys(), name
        for key, value in serial.items():
            assert tensors[key].dtype == torch.float32 and torch.equal(tensors[key], value), (name, key)
        with safe_open(str(st), framework="pt") as f:
            info = f.metadata()
        meta = json.loads((ckpt / "meta.json").read_text())
        assert json.loads(info["step"]) == STEPS and json.loads(info["model_config"]) == meta["model"], name
        assert json.loads(info["source_sha256"]) == meta["sha256"] and json.loads(info["checkpoint"]) == str(ckpt)
        assert json.loads(info["saved_layout"]) == meta["parallel"] and len(info["tensors_sha256"]) == 64
        loaded = consolidated.load(str(st))  # what evaluate.py / translate.py / export_hf.py do
        assert loaded["tokenizer_json"] == obj["tokenizer_json"] and loaded["step"] == STEPS
        assert all(torch.equal(loaded["model"][k], v) for k, v in obj["model"].items())
    assert oct(os.stat(st).st_mode & 0o777) == oct(0o666 & ~current_umask())  # not safetensors' own 0600


def test_consolidation_refuses_damage_in_one_line(runs, tmp_path, assert_user_error):
    """A flipped byte in a ZeRO-3 run's shard: merge_checkpoint.py and the folder's zero_to_fp32.py refuse it naming
    the file, and write nothing; so is a consolidated .safetensors changed after it was written."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(step_dir(runs("dp2-zero3"), STEPS), ckpt)
    shard = ckpt / "shard_pp0_tp0.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    shard.write_bytes(bytes(data))
    for proc in (
        merge_cli(ckpt, "--output", tmp_path / "out.safetensors"),
        run_python([sys.executable, ckpt / "zero_to_fp32.py", ".", tmp_path / "out.safetensors"], cwd=ckpt, env=env()),
    ):
        assert_user_error(proc, "shard_pp0_tp0.safetensors", "sha256")
        assert not list(tmp_path.glob("out.safetensors*"))
    good = tmp_path / "good.safetensors"
    assert merge_cli(step_dir(runs("dp2-zero3"), STEPS), "--output", good).returncode == 0
    data = bytearray(good.read_bytes())
    data[-5] ^= 0x01
    good.write_bytes(bytes(data))
    (tmp_path / "in.fr").write_text("Un homme en vélo.\n", encoding="utf-8")
    proc = run_python(
        [
            sys.executable,
            str(REPO_ROOT / "run_scripts" / "translate.py"),
            "--ckpt_file",
            good,
            "--input",
            tmp_path / "in.fr",
        ],
        env=env(),
    )
    assert_user_error(proc, "good.safetensors does not match the tensors_sha256 in its header")


def test_zero_to_fp32_in_the_checkpoint_folder_consolidates_it(runs, tmp_path, assert_user_error):
    """Every checkpoint folder holds a zero_to_fp32.py (as DeepSpeed's do) that reads this format: run from the folder
    as DeepSpeed's is, it writes what merge_checkpoint.py writes. Without the package importable: one line saying
    what to install. DeepSpeed's own zero_to_fp32 fails naming the note that says which script to run."""
    from safetensors.torch import load_file

    from training.checkpoint import consolidated

    ckpt = step_dir(runs("pp2"), STEPS)
    script = ckpt / "zero_to_fp32.py"
    assert os.stat(script).st_mode & 0o100  # executable, as DeepSpeed makes its copy
    want = consolidated.merge(str(ckpt))["model"]
    for out in ("model.safetensors", "model.bin", "folder"):
        proc = run_python([sys.executable, script, ".", tmp_path / out], cwd=ckpt, env=env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        path = tmp_path / "folder" / "pytorch_model.bin" if out == "folder" else tmp_path / out
        got = load_file(str(path)) if out.endswith(".safetensors") else torch.load(path, weights_only=True)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), out
    # -S -E: no site-packages (no editable install) and no PYTHONPATH, run from the folder: not importable
    proc = subprocess.run(
        [sys.executable, "-S", "-E", "zero_to_fp32.py", ".", str(tmp_path / "x.pt")],
        cwd=ckpt,
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert_user_error(proc, "needs the ds-transformer-recipes package", "pip install", "merge_checkpoint.py")
    proc = subprocess.run(
        [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(ckpt.parent), str(tmp_path / "ds.bin")],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode != 0
    assert "NOT-A-DEEPSPEED-CHECKPOINT_run-zero_to_fp32.py-in-this-folder" in proc.stderr.strip().splitlines()[-1]


def test_shards_are_safetensors_with_format_and_identity(runs):
    """Other tools read the shards: plain safetensors, weights and moments by name, metadata in the header."""
    from safetensors import safe_open

    ckpt = step_dir(runs("tp2-drop"), CUT)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["format_version"] == 2 and meta["shards"] == ["shard_pp0_tp0.safetensors", "shard_pp0_tp1.safetensors"]
    with safe_open(str(ckpt / meta["shards"][1]), framework="pt") as f:
        info = f.metadata()
        assert info["format_version"] == "2" and info["checkpoint_id"] == meta["checkpoint_id"]
        assert info["tp_rank"] == "1" and info["step"] == str(CUT)
        name = "blocks.3.self_attn.qkv.weight"  # column-parallel: split along dim 0
        assert {f"param/{name}", f"exp_avg/{name}", f"exp_avg_sq/{name}"} <= set(f.keys())
        assert json.loads(info["params"])[name]["partition_dim"] == 0
        assert f.get_slice(f"param/{name}").get_shape() == [48, 32]  # 3 × 32 rows / tp2


def test_a_rank_reads_only_the_saved_slices_that_overlap_its_own(runs, tmp_path):
    """tp4 → tp2: TP rank 0 of the new layout needs saved ranks 0 and 1 only. With the other two shards' tensors
    overwritten by NaN (headers intact), rank 0 still gets exactly take_shard of the merged tensors."""
    from model.parallel.sharding import take_shard
    from training.checkpoint.format import ShardIndex, load_full_state, read_meta
    from training.checkpoint.shard_io import read_header

    ckpt = tmp_path / "ckpt"
    shutil.copytree(step_dir(runs("tp4"), CUT), ckpt)
    meta = read_meta(str(ckpt))
    full = load_full_state(str(ckpt), meta)
    for t in (2, 3):
        path = ckpt / f"shard_pp0_tp{t}.safetensors"
        header, _ = read_header(str(path))
        raw = bytearray(path.read_bytes())
        start = len(raw) - max(v["data_offsets"][1] for v in header.values())
        raw[start:] = torch.full(((len(raw) - start) // 4,), float("nan")).numpy().tobytes()
        path.write_bytes(bytes(raw))
    index = ShardIndex(str(ckpt), meta)

    def rank_shape(name, rank):
        entry = index.entries[name]
        dim = entry["partition_dim"]
        if dim is None:
            return dim, full[name]["param"]
        shard_len = -(-(entry["full_size"] or entry["shape"][dim] * 4) // 2)
        return dim, take_shard(full[name]["param"], dim, rank, 2, shard_len)

    checked = 0
    for name in index.entries:
        for key in ("param", "exp_avg", "exp_avg_sq"):
            dim, want = rank_shape(name, 0)
            want = full[name][key] if dim is None else take_shard(full[name][key], dim, 0, 2, want.shape[dim])
            assert torch.equal(index.read_local(name, key, dim, 0, tuple(want.shape)), want), (name, key)
            checked += dim is not None
    assert checked >= 10
    name = next(n for n, e in index.entries.items() if e["partition_dim"] is not None)
    dim, want = rank_shape(name, 1)  # rank 1's rows are in the overwritten shards: read them,
    from common.errors import UserError  # and the damage is found (their checksums, then the NaNs)

    with pytest.raises(UserError, match=r"shard_pp0_tp2.safetensors does not match the checksum saved with it"):
        index.read_local(name, "param", dim, 1, tuple(want.shape))
    with pytest.raises(UserError, match=rf"{name} holds \d+ non-finite value"):
        ShardIndex(str(ckpt), meta, verify=False).read_local(name, "param", dim, 1, tuple(want.shape))


# --------------------------------------------------------------------------------------------- bad checkpoints
@pytest.fixture
def ckpt_copy(runs, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(step_dir(runs("tp2-drop"), CUT), dst)
    return dst


def _expect_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    err = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert err, proc.stderr[-3000:]
    for n in needles:
        assert n in err[-1], err[-1]
    return err[-1]


def test_bad_checkpoints_are_refused_with_the_reason(ckpt_copy, tmp_path):
    """Missing, partial, truncated, corrupt, other model size, other vocabulary."""
    from common.errors import UserError
    from model.config import ModelConfig
    from training.checkpoint.folder import resolve
    from training.checkpoint.format import check_compatible, load_full_state, read_meta

    with pytest.raises(UserError, match="not found"):
        resolve(str(tmp_path / "nope"))
    partial = tmp_path / "partial"
    (partial / f"step_{5:08d}.tmp").mkdir(parents=True)
    with pytest.raises(UserError, match="partial checkpoint"):
        resolve(str(partial))
    meta = read_meta(str(ckpt_copy))
    shard = ckpt_copy / "shard_pp0_tp1.safetensors"
    saved = shard.read_bytes()
    shard.unlink()
    with pytest.raises(UserError, match="incomplete: missing shard_pp0_tp1.safetensors"):
        read_meta(str(ckpt_copy))
    for cut in (100, len(saved) - 4):  # inside the header; inside the tensors
        shard.write_bytes(saved[:cut])
        with pytest.raises(UserError, match="shard_pp0_tp1.safetensors is corrupt or truncated"):
            load_full_state(str(ckpt_copy), meta)
    other = ModelConfig(**meta["model"]).replace(d_model=64, vocab_size=9000)
    with pytest.raises(
        UserError,
        match=r"different model — vocab_size: checkpoint 8000 vs now 9000; d_model: "
        r"checkpoint 32 vs now 64",
    ):
        check_compatible(meta, other, "ckpt")
    (ckpt_copy / "meta.json").write_text("{not json")
    with pytest.raises(UserError, match="meta.json is corrupt"):
        read_meta(str(ckpt_copy))


def test_a_shard_from_another_checkpoint_is_refused(runs, ckpt_copy, tmp_path, multi30k_tsv, bpe_tokenizer):
    """A shard copied in from another step of the same run, or from another run of the same layout: refused by its
    identity (the shapes alone would load it silently)."""
    from common.errors import UserError
    from training.checkpoint.format import load_full_state, read_meta

    meta = read_meta(str(ckpt_copy))
    own = (ckpt_copy / "shard_pp0_tp1.safetensors").read_bytes()
    shutil.copy(step_dir(runs("tp2-drop"), 3) / "shard_pp0_tp1.safetensors", ckpt_copy)
    with pytest.raises(
        UserError,
        match=r"shard_pp0_tp1.safetensors belongs to step 3 of the same run, not to this "
        r"checkpoint \(run [0-9a-f]+, step 2\)",
    ):
        load_full_state(str(ckpt_copy), meta)
    (ckpt_copy / "shard_pp0_tp1.safetensors").write_bytes(own)
    load_full_state(str(ckpt_copy), meta)  # its own file again: fine
    shutil.copy(step_dir(runs("tp2"), CUT) / "shard_pp0_tp1.safetensors", ckpt_copy)
    proc = run_python(
        launch_cmd(1)
        + [
            str(a)
            for a in train_flags(
                multi30k_tsv, bpe_tokenizer, tmp_path / "run", "--steps", STEPS, "--ckpt_file", ckpt_copy
            )
        ],
        env=env(),
    )
    _expect_error(
        proc,
        "shard_pp0_tp1.safetensors belongs to another run (run ",
        "step 2)",
        "a file was copied in from another checkpoint",
    )


def test_resume_from_cli_errors_and_auto(runs, multi30k_tsv, bpe_tokenizer, tmp_path):
    from preprocess.tokenizer import train_tokenizer

    word = train_tokenizer([multi30k_tsv], tmp_path / "word", type="word", vocab_size=8000)
    src = runs("tp2-drop")

    def run(name, *extra, tokenizer=bpe_tokenizer):
        args = train_flags(multi30k_tsv, tokenizer, tmp_path / name, "--steps", 1, *extra)
        return lambda: run_python(launch_cmd(1) + [str(a) for a in args], env=env())

    no_ckpt, auto, model, batch, tokens, vocab = concurrently(  # each into its own folder, two at a time
        run("a", "--resume"),
        run("b", "--resume", "auto"),
        run("c", "--ckpt_file", src, "--d_model", "64"),
        run("d", "--ckpt_file", src, "--batch_size", "8"),
        run("e", "--ckpt_file", src, "--max_tokens", "512"),
        # a different vocabulary: a word-level tokenizer of the same data
        run("f", "--ckpt_file", src, "--vocab_size", "8000", tokenizer=word),
    )
    _expect_error(no_ckpt, "--resume: no checkpoint in", "--resume auto")
    assert auto.returncode == 0, auto.stderr[-2000:]
    _expect_error(
        model, "--d_model 64 conflicts with checkpoint", "whose weights have d_model=32", "Leave --d_model out"
    )
    _expect_error(batch, "batch_size=16", "--batch_size 16")
    _expect_error(
        tokens,
        "trained with fixed batches batch_size=16 seed=7; resuming with token batches max_tokens=512",
        "would change the data order. Pass --batch_size 16 --seed 7 (and no --max_tokens)",
    )
    _expect_error(vocab, f"--tokenizer {word} is not the tokenizer checkpoint", "sha256 differs")


def test_resume_takes_the_checkpoints_settings_unless_a_flag_overrides_them(multi30k_tsv, bpe_tokenizer, tmp_path):
    """`--resume` with no model, tokenizer or batching flag continues with the checkpoint's (its meta.json holds
    them, and its tokenizer copy) — the same losses as the uninterrupted run — and says which settings it took; a
    flag that may change (dropout) overrides it and is named; one whose weights could not load (heads; a recipe's
    d_model) is refused in one line naming it, before anything is built."""
    model = [*TINY_MODEL, "--batch_size", "16", "--seed", "7", "--dropout", "0.1"]
    rest = ["--lr", "1e-3", "--tensorboard", "0", "--log_interval", "1"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    whole, first = concurrently(
        lambda: run_train(
            1,
            [
                "--file_path",
                multi30k_tsv,
                "--tokenizer",
                bpe_tokenizer,
                "--output_dir",
                full,
                *model,
                *rest,
                "--steps",
                3,
            ],
        ),
        lambda: run_train(
            1,
            [
                "--file_path",
                multi30k_tsv,
                "--tokenizer",
                bpe_tokenizer,
                "--output_dir",
                cut,
                *model,
                *rest,
                "--steps",
                2,
                "--save_checkpoint_steps",
                2,
            ],
        ),
    )
    bare = ["--file_path", multi30k_tsv, "--output_dir", cut, "--resume", *rest]
    resumed = run_train(1, [*bare, "--steps", 3, "--save_checkpoint_steps", 3])
    assert losses(cut) == losses(full)  # bit for bit: the same model, data order and dropout
    line = next(row for row in resumed.stdout.splitlines() if row.startswith("starting from checkpoint "))
    for setting in (
        "vocab_size=8000 d_model=32 num_heads=4 ffn_size=64 encoder_layer=2 decoder_layer=2 src_len=12 "
        "tgt_len=12 share_embeddings=false dropout=0.1 attention_dropout=0.1 label_smoothing=0.0",
        "/checkpoints/step_00000002/tokenizer.json",
        "batch_size=16 seed=7",
    ):
        assert setting in line, line
    assert "overridden" not in resumed.stdout

    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"model": {"d_model": 64}}))
    # refused by rank 0's start-point decision, under the folder's lock (so one after the other), before the data
    # and the model are built
    heads = run_train(1, [*bare, "--steps", 4, "--num_heads", "2"], check=False)
    from_recipe = run_train(1, [*bare, "--steps", 4, "--recipe", recipe], check=False)
    override = run_train(1, [*bare, "--steps", 4, "--dropout", "0"], check=False)
    assert override.returncode == 0, override.stderr[-2000:]
    assert "overridden by flags: dropout=0.0 (checkpoint 0.1)" in override.stdout
    info = json.loads((cut / "run.json").read_text())
    assert info["config"]["model"]["attention_dropout"] == 0.0
    assert info["started_from"]["how"] == "--resume"  # rank 0's start point, recorded
    assert info["started_from"]["checkpoint"].endswith("checkpoints/step_00000003"), info["started_from"]
    _expect_error(heads, "--num_heads 2 conflicts with checkpoint", "num_heads=4", "Leave --num_heads out")
    _expect_error(from_recipe, f"recipe {recipe}'s d_model 64 conflicts with checkpoint")
    assert len([row for row in heads.stderr.splitlines() if row.strip()]) == 1


def _write_format_1(src, dst):
    """The checkpoint at `src` in format 1, as the code before safetensors wrote it: torch.save'd dicts per shard
    {name: {"param", "exp_avg", "exp_avg_sq", "partition_dim", "full_size"}}, rng_rank{R}.pt, meta.json v1."""
    from training.checkpoint.format import read_shard
    from training.checkpoint.shard_io import read_all

    meta = json.loads((src / "meta.json").read_text())
    dst.mkdir()
    for p in range(meta["parallel"]["pipeline_stage"]):
        for t in range(meta["parallel"]["model_parallel"]):
            torch.save(read_shard(str(src), p, t), dst / f"shard_pp{p}_tp{t}.pt")
    for r in range(meta["world_size"]):
        flat = read_all(str(src / f"rng_rank{r}.safetensors"))
        torch.save({"default": {"cpu": flat["default/cpu"]}, "tp": {"cpu": flat["tp/cpu"]}}, dst / f"rng_rank{r}.pt")
    old = {
        k: v
        for k, v in meta.items()  # format 1 recorded no tokenizer copy either
        if k not in ("checkpoint_id", "run_id", "optimizer", "skipped_steps", "tokenizer")
    }
    old.update(
        format_version=1,
        shards=[s.replace(".safetensors", ".pt") for s in meta["shards"]],
        rng=[s.replace(".safetensors", ".pt") for s in meta["rng"]],
    )
    (dst / "meta.json").write_text(json.dumps(old))


def test_format_1_checkpoint_gets_the_convert_command_and_converts_exactly(runs, tmp_path):
    from common.errors import UserError
    from training.checkpoint.format import read_meta
    from training.checkpoint.shard_io import read_all

    src = step_dir(runs("tp2-drop"), CUT)
    old, new = tmp_path / "old" / "step_00000002", tmp_path / "old" / "v2-step_00000002"
    old.parent.mkdir()
    _write_format_1(src, old)
    with pytest.raises(
        UserError,
        match=r"format-1 checkpoint \(torch .pt shards\).*convert it once with "
        r"`python run_scripts/convert_checkpoint.py \S+step_00000002 \S+v2-step_",
    ):
        read_meta(str(old))

    def convert(*args):
        return run_python(
            [sys.executable, str(REPO_ROOT / "run_scripts" / "convert_checkpoint.py"), *map(str, args)], env=env()
        )

    proc = convert(old, new)
    assert proc.returncode == 0, proc.stderr
    assert_same_state(merged(src), merged(new), "converted")
    for r in (0, 1):
        a, b = read_all(str(src / f"rng_rank{r}.safetensors")), read_all(str(new / f"rng_rank{r}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a, b = read_meta(str(src)), read_meta(str(new))
    for key in (
        "step",
        "optimizer_step",
        "model",
        "parallel",
        "lr_scheduler",
        "batch_size",
        "seed",
        "samples_seen",
        "tokenizer_sha256",
        "world_size",
    ):
        assert a[key] == b[key], key
    _expect_error(convert(old, new), "already exists")
    _expect_error(convert(src, tmp_path / "x"), "is not a format-1 checkpoint")


def test_an_optimizer_the_checkpoint_code_does_not_know_is_refused():
    """At save (and at the start of a run that checkpoints): never a silent skip. A torch optimizer that is not
    AdamW, and DeepSpeed's ZeRO-0 half-precision wrapper, which a --deepspeed_config contradicting --precision
    would make DeepSpeed build — that config is refused before DeepSpeed sees it."""
    from types import SimpleNamespace

    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from common.errors import UserError
    from model.config import ParallelConfig
    from training.checkpoint.optimizer_state import UnsupportedOptimizer, for_engine
    from training.core.engine import deepspeed_config

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(
        UnsupportedOptimizer,
        match=r"cannot checkpoint DeepSpeed's torch.optim.sgd.SGD: the "
        r"checkpoint code knows .* only for torch AdamW at ZeRO 0",
    ):
        for_engine(SimpleNamespace(ds=SimpleNamespace(optimizer=sgd)))
    unfused = FP16_UnfusedOptimizer.__new__(FP16_UnfusedOptimizer)
    with pytest.raises(UnsupportedOptimizer, match="FP16_UnfusedOptimizer.*choose the precision with --precision"):
        for_engine(SimpleNamespace(ds=SimpleNamespace(optimizer=unfused)))
    with pytest.raises(UserError, match=r"DeepSpeed config sets bf16.enabled=True but --precision is fp32"):
        deepspeed_config(ParallelConfig(), 16, "fp32", 0.0, 100, {"bf16": {"enabled": True}})
    with pytest.raises(UserError, match=r"fp16.enabled=False but --precision is fp16"):
        deepspeed_config(ParallelConfig(), 16, "fp16", 0.0, 100, {"fp16": {"enabled": False}})
    assert deepspeed_config(ParallelConfig(), 16, "bf16", 0.0, 100, {"bf16": {"enabled": True}})["bf16"]


def test_merge_drops_vocab_padding_of_any_tp_size(tmp_path):
    """Shards of a tp-4 model with vocab 51 (padded to 52) merge back to exactly the serial model's weights:
    each rank's shards are built directly (no process group) and written in the checkpoint's shard format."""
    from model.config import ModelConfig, ParallelConfig
    from model.parallel.sharding import partition_dim
    from model.parallel.topology import ParallelContext
    from model.transformer import Seq2SeqTransformer
    from training.checkpoint.format import canonical_name, load_full_state, write_shard_file

    cfg = ModelConfig(
        vocab_size=51, d_model=16, num_heads=4, ffn_size=24, encoder_layers=1, decoder_layers=1, src_len=6, tgt_len=6
    )
    serial = dict(Seq2SeqTransformer(cfg, ParallelConfig(vocab_emb_dp=False), seed=5).named_parameters())
    for t in range(4):
        shard = Seq2SeqTransformer(
            cfg, ParallelConfig(model_parallel=4, vocab_emb_dp=False), ParallelContext(tp_size=4, tp_rank=t), seed=5
        )
        entries = {
            canonical_name(n): {
                "param": p.data,
                "exp_avg": p.data * 2,
                "exp_avg_sq": p.data**2,
                "partition_dim": partition_dim(p),
                "full_size": getattr(p, "full_size", None),
            }
            for n, p in shard.named_parameters()
        }
        write_shard_file(str(tmp_path / f"shard_pp0_tp{t}.safetensors"), entries, {"checkpoint_id": "c"})
    meta = {"parallel": {"model_parallel": 4, "pipeline_stage": 1}, "checkpoint_id": "c"}
    full = load_full_state(str(tmp_path), meta)
    assert full["blocks.3.proj.weight"]["param"].shape == (51, 16)  # padded row 52 dropped
    for name, p in serial.items():
        assert torch.equal(full[name]["param"], p.data), name
        assert torch.equal(full[name]["exp_avg"], p.data * 2), name
    # and read lazily onto the last rank of tp 2 (rows 26-50 + one zero row) and of tp 8 (rows 49-50 + 5 zero rows)
    from model.parallel.sharding import take_shard
    from training.checkpoint.format import ShardIndex

    index = ShardIndex(str(tmp_path), meta)
    for tp in (2, 8):
        shard = dict(
            Seq2SeqTransformer(
                cfg,
                ParallelConfig(model_parallel=tp, vocab_emb_dp=False),
                ParallelContext(tp_size=tp, tp_rank=tp - 1),
                seed=5,
            ).named_parameters()
        )
        for name, p in shard.items():
            dim, key = partition_dim(p), canonical_name(name)
            want = take_shard(serial[key].data, dim, tp - 1, tp, p.shape[dim]) if dim is not None else p.data
            assert torch.equal(index.read_local(key, "param", dim, tp - 1, tuple(p.shape)), want), (tp, name)
            assert torch.equal(want, p.data), (tp, name)  # what that layout itself builds


def test_saved_pieces_follow_take_shard():
    """The rows a rank reads (model.parallel.sharding.shard_rows + saved_pieces) are take_shard(merge_shards(...)), for
    every saved/new TP size pair up to 4 and a length that needs padding."""
    from model.parallel.sharding import merge_shards, saved_pieces, shard_rows, take_shard

    full = torch.arange(51.0).reshape(51, 1)
    for saved_tp in (1, 2, 3, 4):
        saved_len = -(-51 // saved_tp)
        shards = [take_shard(full, 0, t, saved_tp, saved_len) for t in range(saved_tp)]
        assert torch.equal(merge_shards(shards, 0, 51), full)
        for tp in (1, 2, 3, 4):
            n = -(-51 // tp)
            for r in range(tp):
                lo, hi, pad = shard_rows(51, r, n)
                rows = [shards[t][a:b] for t, a, b in saved_pieces(lo, hi, saved_len, saved_tp)]
                got = torch.cat(rows + [torch.zeros(pad, 1)])
                assert torch.equal(got, take_shard(full, 0, r, tp, n)), (saved_tp, tp, r)


@pytest.mark.parametrize("fused", [True, False])
def test_a_restored_adamw_step_counter_is_where_torchs_own_step_puts_it(fused):
    """The fused (and capturable) AdamW kernels want the step counter on the parameter's device; the others keep
    it on the CPU. A resume that put it on the CPU for a fused CUDA AdamW failed at its first step (seen on an
    H100: 'state_steps is on cpu'). Here the parameter lives on the meta device, which stands in for the GPU: any
    device other than the CPU tells the two rules apart without one."""
    from types import SimpleNamespace

    from training.checkpoint.optimizer_state import for_engine
    from training.core.grad_norm import ClippingAdamW

    p = torch.nn.Parameter(torch.empty(3, device="meta"))
    opt = ClippingAdamW([p], max_norm=0.0, tp_rank=0, norm_group=None, lr=0.1)
    opt.param_groups[0]["fused"] = fused  # torch refuses fused=True for meta tensors at construction
    opt.state[p].update(exp_avg=torch.empty(3, device="meta"), exp_avg_sq=torch.empty(3, device="meta"))
    view = for_engine(SimpleNamespace(ds=SimpleNamespace(optimizer=opt)))
    view.set_step(7)
    step = opt.state[p]["step"]
    assert step.dtype == torch.float32 and step.shape == ()
    assert step.device == (p.device if fused else torch.device("cpu"))
