"""Checkpoints: exact same-layout resume (dropout on), online resharding between layouts, kill -9 during training
and during a save, the merge tool, and every bad-checkpoint message.

Save→resume is just runs in a row (torchtitan style): an uninterrupted run that saves every step is the reference;
a second run resumes from one of its checkpoints, under the same or another layout.
"""
import shutil
import subprocess
import sys

import pytest
import torch

from tests.launch import REPO_ROOT, TINY, env, losses, run_train

STEPS, CUT = 4, 2
DROPOUT = ["--dropout", "0.1"]                    # TINY sets 0; later flags win


def flags(tsv, tok, out, *extra):
    return ["--file_path", tsv, "--tokenizer", tok, "--output_dir", out, *TINY, *extra]


def merged(path):
    sys.path.insert(0, str(REPO_ROOT / "run_scripts"))
    from merge_checkpoint import merge
    return merge(str(path), with_optimizer=True)


LAYOUTS = {"dp2-zero1": (2, ["--enable_parallel_optimizer", "1"]),
           "tp2": (2, ["--mp", "2"]),
           "pp2": (2, ["--pipeline_stage", "2", "--micro_batch_num", "2"]),
           "tp4": (4, ["--mp", "4"])}


@pytest.fixture(scope="module")
def references(multi30k_tsv, bpe_tokenizer, tmp_path_factory):
    """Uninterrupted runs, saving every step, with dropout on (same-layout) and off (for resharding)."""
    cache = {}

    def get(layout, dropout):
        key = (layout, dropout)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ref-{layout}-{'drop' if dropout else 'nodrop'}")
            nproc, extra = LAYOUTS[layout]
            run_train(nproc, flags(multi30k_tsv, bpe_tokenizer, out, "--steps", STEPS, "--save_checkpoint_steps",
                                   1, "--keep_checkpoint_max", 10, *extra, *(DROPOUT if dropout else [])))
            cache[key] = out
        return cache[key]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2-zero1", "tp2", "pp2"])
def test_same_layout_resume_is_exact_with_dropout(layout, references, multi30k_tsv, bpe_tokenizer, tmp_path):
    ref = references(layout, True)
    nproc, extra = LAYOUTS[layout]
    ckpt = ref / "checkpoints" / f"step_{CUT:08d}"
    run_train(nproc, flags(multi30k_tsv, bpe_tokenizer, tmp_path, "--steps", STEPS, "--ckpt_file", ckpt,
                           "--save_checkpoint_steps", 1, *extra, *DROPOUT))
    assert losses(tmp_path) == losses(ref)[CUT:]                     # bit-identical continuation
    a, b = merged(ref), merged(tmp_path)
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
        assert torch.equal(a["optimizer"][name]["exp_avg_sq"], b["optimizer"][name]["exp_avg_sq"]), name


RESHARD = [  # (saved under, loaded under)
    ("tp2", "pp2"),
    ("pp2", "serial"),
    ("dp2-zero1", "tp2"),
    ("tp4", "tp2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("src,dst", RESHARD, ids=[f"{s}->{d}" for s, d in RESHARD])
def test_reshard_onto_another_layout(src, dst, references, multi30k_tsv, bpe_tokenizer, tmp_path):
    ref = references(src, False)
    ckpt = ref / "checkpoints" / f"step_{CUT:08d}"
    nproc, extra = LAYOUTS.get(dst, (1, []))
    run_train(nproc, flags(multi30k_tsv, bpe_tokenizer, tmp_path, "--steps", STEPS, "--ckpt_file", ckpt,
                           "--save_checkpoint_steps", 1, *extra))
    # Loaded parameters and AdamW moments are the originals, so the next step's loss is the uninterrupted run's,
    # and every later step agrees up to fp32 summation order (a wrong moment would move weights by ~lr at once).
    lr = float(TINY[TINY.index("--lr") + 1])
    got, ref_losses = losses(tmp_path), losses(ref)[CUT:]
    first = abs(got[0] - ref_losses[0]) / ref_losses[0]
    worst_loss = max(abs(a - b) / b for a, b in zip(got, ref_losses))
    a, b = merged(ref), merged(tmp_path)
    worst_step = max(float((a["model"][n] - b["model"][n]).abs().max()) for n in a["model"]) / lr
    print(f"RESHARD {src}->{dst}: next-step loss rel {first:.2e}, worst loss rel {worst_loss:.2e}, "
          f"largest weight difference after {STEPS - CUT} steps = {worst_step:.2e} × lr")
    assert first <= 1e-6
    assert worst_loss <= 1e-5
    assert worst_step <= 0.05


@pytest.mark.slow
@pytest.mark.parametrize("crash", ["train:3", "save:3"])
def test_kill_9_then_resume_matches_uninterrupted(crash, references, multi30k_tsv, bpe_tokenizer, tmp_path):
    ref = references("tp2", True)
    nproc, extra = LAYOUTS["tp2"]
    args = flags(multi30k_tsv, bpe_tokenizer, tmp_path, "--steps", STEPS, "--save_checkpoint_steps", 1,
                 *extra, *DROPOUT)
    e = dict(env(), DSR_CRASH_AT=crash)
    from tests.launch import launch_cmd
    killed = subprocess.run(launch_cmd(nproc) + [str(a) for a in args], cwd=REPO_ROOT, env=e, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode != 0
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == f"step_{2:08d}"          # the crashed step never became 'latest'
    if crash.startswith("save"):
        assert (root / f"step_{3:08d}.tmp").is_dir() and not (root / f"step_{3:08d}").exists()
    run_train(nproc, args + ["--resume"])
    a, b = merged(ref), merged(tmp_path)
    assert a["step"] == b["step"] == STEPS
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert not list(root.glob("*.tmp"))                                # the partial save was cleaned up


def test_merged_checkpoint_loads_into_serial_model(references, multi30k_tsv, bpe_tokenizer, tmp_path):
    ref = references("tp2", True)
    out = tmp_path / "model.pt"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "run_scripts" / "merge_checkpoint.py"), str(ref),
                           "--output", str(out)], capture_output=True, text=True, env=env())
    assert proc.returncode == 0, proc.stderr
    obj = torch.load(out, weights_only=False)
    from model.config import ModelConfig
    from model.transformer import Seq2SeqTransformer
    model = Seq2SeqTransformer(ModelConfig(**obj["model_config"]))
    model.load_state_dict(obj["model"], strict=True)
    assert obj["step"] == STEPS


# --------------------------------------------------------------------------------------------- bad checkpoints
def _bad(tmp_path, references, multi30k_tsv, bpe_tokenizer, ckpt, *extra):
    from tests.launch import launch_cmd
    args = flags(multi30k_tsv, bpe_tokenizer, tmp_path / "run", "--steps", STEPS, "--mp", "2", *extra)
    if ckpt is not None:
        args += ["--ckpt_file", ckpt]
    return subprocess.run(launch_cmd(1) + [str(a) for a in args], cwd=REPO_ROOT, env=env(), capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def ckpt_copy(references, tmp_path):
    src = references("tp2", True) / "checkpoints" / f"step_{CUT:08d}"
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _expect_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    err = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
    assert err, proc.stderr[-3000:]
    for n in needles:
        assert n in err[-1], err[-1]
    return err[-1]


def test_bad_checkpoints_are_refused_with_the_reason(ckpt_copy, tmp_path, multi30k_tsv, bpe_tokenizer):
    """Missing, partial, corrupt, other model size, other vocabulary; one process (mp 2 → world mismatch
    would come first, so these run as a single process with --mp 1 overriding)."""
    from training.checkpoint import check_compatible, read_meta, resolve, load_full_state
    from preprocess.errors import UserError
    from model.config import ModelConfig

    with pytest.raises(UserError, match="not found"):
        resolve(str(tmp_path / "nope"))
    partial = tmp_path / "partial"
    (partial / f"step_{5:08d}.tmp").mkdir(parents=True)
    with pytest.raises(UserError, match="partial checkpoint"):
        resolve(str(partial))
    meta = read_meta(str(ckpt_copy))
    (ckpt_copy / "shard_pp0_tp1.pt").unlink()
    with pytest.raises(UserError, match="incomplete: missing shard_pp0_tp1.pt"):
        read_meta(str(ckpt_copy))
    (ckpt_copy / "shard_pp0_tp1.pt").write_bytes((ckpt_copy / "shard_pp0_tp0.pt").read_bytes()[:100])
    with pytest.raises(UserError, match="shard_pp0_tp1.pt is corrupt or truncated"):
        load_full_state(str(ckpt_copy), meta)
    other = ModelConfig(**meta["model"]).replace(d_model=64, vocab_size=9000)
    with pytest.raises(UserError, match=r"different model — vocab_size: checkpoint 8000 vs now 9000; d_model: "
                                        r"checkpoint 32 vs now 64"):
        check_compatible(meta, other, "ckpt")
    (ckpt_copy / "meta.json").write_text("{not json")
    with pytest.raises(UserError, match="meta.json is corrupt"):
        read_meta(str(ckpt_copy))


def test_resume_from_cli_errors_and_auto(references, multi30k_tsv, bpe_tokenizer, tmp_path):
    from tests.launch import launch_cmd

    def run(*extra, out=tmp_path / "fresh"):
        args = flags(multi30k_tsv, bpe_tokenizer, out, "--steps", 1, *extra)
        return subprocess.run(launch_cmd(1) + [str(a) for a in args], cwd=REPO_ROOT, env=env(),
                              capture_output=True, text=True, timeout=300)

    _expect_error(run("--resume"), "--resume: no checkpoint in", "--resume auto")
    ok = run("--resume", "auto")
    assert ok.returncode == 0, ok.stderr[-2000:]
    src = references("tp2", True)
    _expect_error(run("--ckpt_file", src, "--d_model", "64"), "different model", "d_model: checkpoint 32 vs now 64")
    _expect_error(run("--ckpt_file", src, "--batch_size", "8"), "batch_size=16", "--batch_size 16")
    # a different vocabulary: a word-level tokenizer of the same data
    from preprocess.tokenizer import train_tokenizer
    word = train_tokenizer([multi30k_tsv], tmp_path / "word", type="word", vocab_size=8000)
    args = ["--file_path", multi30k_tsv, "--tokenizer", word, "--output_dir", tmp_path / "w", *TINY,
            "--steps", 1, "--ckpt_file", src, "--vocab_size", "8000"]
    proc = subprocess.run(launch_cmd(1) + [str(a) for a in args], cwd=REPO_ROOT, env=env(), capture_output=True,
                          text=True, timeout=300)
    _expect_error(proc, "different tokenizer")


def test_merge_drops_vocab_padding_of_any_tp_size(tmp_path):
    """Shards of a tp-4 model with vocab 51 (padded to 52) merge back to exactly the serial model's weights:
    each rank's shards are built directly (no process group) and written in the checkpoint's shard format."""
    from model.config import ModelConfig, ParallelConfig
    from model.sharding import partition_dim
    from model.topology import ParallelContext
    from model.transformer import Seq2SeqTransformer
    from training.checkpoint import canonical_name, load_full_state

    cfg = ModelConfig(vocab_size=51, d_model=16, num_heads=4, ffn_size=24, encoder_layers=1, decoder_layers=1,
                      src_len=6, tgt_len=6)
    serial = dict(Seq2SeqTransformer(cfg, ParallelConfig(vocab_emb_dp=False), seed=5).named_parameters())
    for t in range(4):
        shard = Seq2SeqTransformer(cfg, ParallelConfig(model_parallel=4, vocab_emb_dp=False),
                                   ParallelContext(tp_size=4, tp_rank=t), seed=5)
        entries = {canonical_name(n): {"param": p.data, "exp_avg": p.data * 2, "exp_avg_sq": p.data ** 2,
                                       "partition_dim": partition_dim(p), "full_size": getattr(p, "full_size", None)}
                   for n, p in shard.named_parameters()}
        torch.save(entries, tmp_path / f"shard_pp0_tp{t}.pt")
    full = load_full_state(str(tmp_path), {"parallel": {"model_parallel": 4, "pipeline_stage": 1}})
    assert full["blocks.3.proj.weight"]["param"].shape == (51, 16)       # padded row 52 dropped
    for name, p in serial.items():
        assert torch.equal(full[name]["param"], p.data), name
        assert torch.equal(full[name]["exp_avg"], p.data * 2), name
