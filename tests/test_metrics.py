"""What train.py reports per step beyond the loss: padding, achieved FLOP/s, MFU (only where the peak is known) and
peak memory — checked against the data and the cost model independently of how train.py computed them; one epoch
numbering in the loss line and metrics.jsonl, the time left in the loss line, and run.json saying how to run it
again."""

import json
import re
import shlex
import subprocess

import numpy as np

from model.config import ModelConfig
from model.costs import model_flops
from preprocess.textio import read_tsv_pairs
from preprocess.token_batches import TokenBatchSchedule
from preprocess.tokenizer import load_tokenizer
from tests.launch import REPO_ROOT, TINY, read_metrics, run_train
from tests.progress import scaled


def test_step_metrics_padding_flops_memory(multi30k_tsv, bpe_tokenizer, tmp_path):
    flags = [
        "--file_path",
        multi30k_tsv,
        "--tokenizer",
        bpe_tokenizer,
        "--output_dir",
        tmp_path,
        *TINY,
        "--max_tokens",
        "256",
        "--batch_multiple",
        "8",
        "--steps",
        4,
        "--log_interval",
        2,
    ]
    proc = run_train(1, flags)
    records = read_metrics(tmp_path)
    src_len = tgt_len = int(TINY[TINY.index("--src_len") + 1])
    # the real lengths from the tokenizer's untruncated counts (not from the token store train.py reads)
    tok = load_tokenizer(bpe_tokenizer)
    counts = [
        np.array([len(e.ids) for e in tok.encode_batch(side, add_special_tokens=False)])
        for side in read_tsv_pairs(multi30k_tsv)
    ]
    src_real = np.minimum(counts[0] + 1, src_len)
    tgt_real = np.minimum(counts[1] + 1, tgt_len)
    sched = TokenBatchSchedule(src_real, tgt_real, 256, 8, int(TINY[TINY.index("--seed") + 1]), src_len, tgt_len)
    cfg = ModelConfig(
        vocab_size=8000,
        d_model=32,
        num_heads=4,
        ffn_size=64,
        encoder_layers=2,
        decoder_layers=2,
        src_len=src_len,
        tgt_len=tgt_len,
    )
    for step, r in enumerate(records):
        idx = sched.global_batch(step)
        s, t = sched.shape(step)
        n_src, n_tgt = int(src_real[idx].sum()), int(tgt_real[idx].sum())
        assert r["tokens"] == n_tgt
        assert abs(r["padding"] - (1 - (n_src + n_tgt) / (len(idx) * (s + t)))) < 1e-4
        flops = model_flops(cfg, n_src, n_tgt, len(idx), s, t)
        assert abs(r["tflops"] * 1e12 * r["step_time"] / flops - 1) < 1e-6
        assert "mfu" not in r  # a CPU: no peak to divide by, none guessed
        assert 100 < r["peak_mem_mib"] < 8000
    assert len({r["padding"] for r in records}) > 1  # token batches: each its own padding

    # one epoch numbering: the loss line's epoch is the record's, counted from 1
    lines = re.findall(r"^epoch: (\d+) step: (\d+), loss is .*, ETA: (\d+(?:h\d\dm|m\d\ds|s))$", proc.stdout, re.M)
    assert [int(s) for _, s, _ in lines] == [2, 4], proc.stdout
    by_step = {r["step"]: r for r in records}
    assert all(by_step[int(s)]["epoch"] == int(e) for e, s, _ in lines) and records[0]["epoch"] == 1
    assert lines[-1][2] == "0s"  # the last step: nothing left

    # run.json: the resolved configuration, how it was started, and the code's version
    info = json.loads((tmp_path / "run.json").read_text())
    config = info["config"]
    assert config["optimization"]["lr"] == 1e-3 and config["optimization"]["lr_schedule"] == "constant"
    assert config["data"]["max_tokens"] == 256 and config["model"]["d_model"] == 32
    assert info["files"]["file_path"] == str(multi30k_tsv) and info["files"]["tokenizer"] == str(bpe_tokenizer)
    argv = shlex.split(info["command"])
    assert argv[1].endswith("run_scripts/train.py") and argv[argv.index("--max_tokens") + 1] == "256"
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    want = head.stdout.strip() if head.returncode == 0 else "unknown"
    assert info["git_commit"].split("+")[0] == want


def test_code_version_outside_git_is_unknown(tmp_path):
    from common.repository import git_commit

    assert git_commit(tmp_path) == "unknown"


def test_eta_formatting():
    from training.core.metrics import format_duration

    assert [format_duration(s) for s in (0, 7.4, 59.6, 192, 3725, 90061)] == [
        "0s",
        "7s",
        "1m00s",
        "3m12s",
        "1h02m",
        "25h01m",
    ]


def test_plot_metrics_draws_every_curve_of_real_runs(multi30k_tsv, bpe_tokenizer, tmp_path, assert_user_error):
    """run_scripts/plot_metrics.py on two real runs (12 steps, validation with BLEU every 4): every panel has one
    curve per run holding exactly the run's metrics.jsonl values, validation loss and BLEU at the validated steps;
    the PNG is written; a folder without metrics is one error line."""
    import sys

    from tests.launch import concurrently, env, run_python

    valid = tmp_path / "valid.tsv"
    valid.write_text("".join(multi30k_tsv.read_text(encoding="utf-8").splitlines(keepends=True)[:32]), encoding="utf-8")
    common = [
        "--file_path",
        multi30k_tsv,
        "--tokenizer",
        bpe_tokenizer,
        *TINY,
        "--steps",
        12,
        "--valid_file",
        valid,
        "--valid_interval",
        4,
        "--valid_bleu",
        1,
    ]
    concurrently(
        *[
            lambda name=name, lr=lr: run_train(1, [*common, "--lr", lr, "--output_dir", tmp_path / name])
            for name, lr in (("lr1e-3", "1e-3"), ("lr3e-3", "3e-3"))
        ]
    )
    plot = str(REPO_ROOT / "run_scripts" / "plot_metrics.py")
    proc = run_python(
        [
            sys.executable,
            plot,
            tmp_path / "lr1e-3",
            tmp_path / "lr3e-3" / "metrics.jsonl",
            "--output",
            tmp_path / "curves.png",
        ],
        env=env(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"wrote {tmp_path / 'curves.png'} (lr1e-3: steps 1-12, lr3e-3: steps 1-12)")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    sys.path.insert(0, str(REPO_ROOT / "run_scripts"))
    from plot_metrics import plot_runs, read_run

    runs = [read_run(str(tmp_path / name)) for name in ("lr1e-3", "lr3e-3")]
    drawn = plot_runs(runs, str(tmp_path / "again.png"))
    for (name, _), records in zip(runs, (read_metrics(tmp_path / n) for n in ("lr1e-3", "lr3e-3"))):
        got = {title: {label: (steps, values) for label, steps, values in lines} for title, lines in drawn.items()}
        steps = list(range(1, 13))
        assert got["loss"][name] == (steps, [r["loss"] for r in records])
        assert got["loss"][f"{name} (valid)"] == ([4, 8, 12], [r["valid_loss"] for r in records if "valid_loss" in r])
        assert got["valid BLEU"][name] == ([4, 8, 12], [r["valid_bleu"] for r in records if "valid_bleu" in r])
        assert got["learning rate"][name] == (steps, [r["lr"] for r in records])
        assert got["gradient norm"][name] == (steps, [r["grad_norm"] for r in records])
        assert got["throughput"][name] == (steps, [r["tokens_per_sec"] for r in records])
    assert_user_error(run_python([sys.executable, plot, tmp_path / "nothing"], env=env()), "no metrics.jsonl")


def test_eta_is_the_runs_mean_step_time_times_the_steps_left(tmp_path, monkeypatch):
    """The ETA the step line shows: this run's wall-clock since its first step began, per step, times the steps
    left — a resumed run counts from its own first step. The clock is set by hand (seconds)."""
    from training.core import metrics

    now = [0.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    writer = metrics.MetricsWriter(
        str(tmp_path), enabled=True, total_steps=20, start_step=4, resumed=True, log_interval=100, tensorboard=False
    )
    record = {"epoch": 1, "loss": 1.0, "tokens_per_sec": 1.0}
    now[0] = 100.0
    writer.log({**record, "step": 5, "step_time": 2.0})  # step 5 began at 98 s
    now[0] = 110.0
    writer.log({**record, "step": 8, "step_time": 3.0})
    assert writer.eta_seconds(8) == (110.0 - 98.0) / (8 - 4) * (20 - 8)  # 3 s a step, 12 steps left: 36 s
    assert writer.eta_seconds(20) == 0.0
    writer.close()


def test_tensorboard_out_of_room_is_one_line_naming_the_folder(tmp_path):
    """TensorBoard writes from its own thread: a write past the room (here `ulimit -f`, EFBIG; a full disk is the
    same error path) printed that thread's traceback and raised again at the next call. Now one warning naming the
    folder, and the run goes on."""
    import resource
    import sys

    folder = tmp_path / "tensorboard"
    code = (
        f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r})\n"
        "from training.core.metrics import TensorBoard\n"
        f"tb = TensorBoard({str(folder)!r}, purge_step=1)\n"
        "for step in range(1, 3001):\n"
        "    tb.write({'train/loss': 1.0, 'train/lr': 0.5}, step)\n"
        "tb.close()\n"
        "print('went on', flush=True)\n"
    )
    limit = 16 << 10
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "went on", proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert re.fullmatch(
        rf"warning: TensorBoard events into {re.escape(str(folder))} stopped at step \d+ \(File too "
        r"large\); training goes on and metrics.jsonl keeps every step\. Free space there \(or use "
        r"--tensorboard 0\)",
        lines[0],
    ), lines[0]


def test_tensorboard_flushes_on_an_interval_at_checkpoint_steps_and_at_close(tmp_path):
    """A flush per step is a file write on rank 0 that the other ranks wait for at the next collective: events are
    flushed every flush_secs, at every multiple of the checkpoint interval (a resume starts there) and at close."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from training.core.metrics import TensorBoard

    tb = TensorBoard(str(tmp_path / "tb"), purge_step=1, flush_steps=4)
    flushes = []
    writer_flush = tb._writer.flush
    tb._writer.flush = lambda: (flushes.append(step), writer_flush())
    for step in range(1, 11):
        tb.write({"train/loss": float(step)}, step)
    assert flushes == [4, 8]  # not every step: the interval (30 s) has not passed
    tb.flush_secs = 0.0
    step = 11
    tb.write({"train/loss": 11.0}, step)
    assert flushes == [4, 8, 11]
    tb.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 12))
