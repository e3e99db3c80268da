"""Bad configurations fail before training, in seconds, with one `error:` line — no hang, no traceback.

Most run as one process (the layout check reports every rule a layout breaks in one line, the world size among
them), two at a time; the ZeRO-2 + pipeline case runs under DeepSpeed's launcher on 2 processes, to prove no rank
hangs waiting for another.
"""
import time

import pytest

from tests import accelerator
from tests.launch import TINY, concurrently, run_train

CASES = [
    # (flags, processes, words the message must contain)
    (["--mp", "2"], 1, ["= 2 but the world has 1 processes", "Layouts that fit 1 processes: dp=1 mp=1 pp=1"]),
    (["--mp", "2", "--num_heads", "3", "--d_model", "33"], 1, ["num_heads=3 is not divisible by model_parallel=2"]),
    (["--mp", "2", "--ffn_size", "63"], 1, ["FFN size=63 is not divisible by model_parallel=2"]),
    (["--pipeline_stage", "2", "--encoder_layer", "1", "--decoder_layer", "0"], 1,
     ["encoder_layers=1 decoder_layers=0"]),
    (["--batch_size", "15", "--micro_batch_num", "2"], 1,
     ["global batch_size=15 is not divisible by data_parallel×micro_batch_num = 1×2", "try batch_size 14 or 16"]),
    (["--pipeline_stage", "2", "--zero_stage", "2"], 2, ["ZeRO stage 2 cannot be combined with pipeline_stage=2"]),
    (["--vocab_size", "100"], 1, ["--vocab_size 100 is smaller than the tokenizer's vocabulary (8000)"]),
    (["--clip_grad", "-1"], 1, ["--clip_grad -1.0 must be >= 0"]),
    (["--lr", "-1"], 1, ["--lr -1 must be >= 0"]),
    # refused on every machine, before the precision check (DeepSpeed would not sum the tied gradients: issue 23)
    (["--precision", "fp16", "--pipeline_stage", "2", "--share_embeddings", "1"], 1,
     ["--precision fp16 with --pipeline_stage 2 and --share_embeddings 1", "use --precision bf16 or fp32"]),
    (["--interleave_num", "3"], 1, ["interleave_num=3 does not divide the micro-batch of 16 samples per rank",
                                    "use interleave_num 1, 2, 4 or 8"]),
]


MISSING = [
    ("data", ["--file_path", "/nonexistent/train.tsv"], "--file_path /nonexistent/train.tsv not found"),
    ("tokenizer", ["--tokenizer", "/nonexistent/tokenizer.json"], "--tokenizer /nonexistent/tokenizer.json not found"),
    ("no data", ["--file_path", ""], "--file_path is required"),
    ("recipe", ["--recipe", "/nonexistent.json"], "recipe /nonexistent.json not found"),
]


@pytest.fixture(scope="module")
def outcomes(multi30k_tsv, bpe_tokenizer, tmp_path_factory):
    """Every train.py run of this file, started two at a time (each spends most of its seconds importing torch on
    one core): {key: (completed process, seconds, its output folder)}."""
    jobs = {}
    for extra, nproc, _ in CASES:
        jobs[("config", " ".join(extra))] = (nproc, ["--steps", 2, *extra])
    jobs[("stages",)] = (1, ["--pipeline_stage", "5"])
    for what, extra, _ in MISSING:
        jobs[("missing", what)] = (1, extra)
    if not accelerator.supported("fp16"):
        jobs[("fp16",)] = (1, ["--steps", 1, "--precision", "fp16"])

    def one(key, nproc, extra):
        out = tmp_path_factory.mktemp("bad")
        start = time.time()
        # the 2-process case goes through DeepSpeed's own launcher: no rank may hang waiting for another
        proc = run_train(nproc, ["--file_path", multi30k_tsv, "--tokenizer", bpe_tokenizer, "--output_dir", out,
                                 *TINY, *extra], check=False, timeout=120, launcher="deepspeed")
        return proc, time.time() - start, out
    results = concurrently(*[lambda k=k, n=n, e=e: one(k, n, e) for k, (n, e) in jobs.items()])
    return dict(zip(jobs, results))


@pytest.mark.parametrize("extra,nproc,needles", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_config_fails_fast_with_message(extra, nproc, needles, outcomes):
    proc, seconds, out = outcomes[("config", " ".join(extra))]
    assert proc.returncode != 0
    errors = [line for line in (proc.stderr + proc.stdout).splitlines() if "error: " in line]
    assert errors, proc.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    if nproc == 1:
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (out / "metrics.jsonl").exists()          # failed before the first step
    assert seconds < 90


def test_more_stages_than_blocks(outcomes):
    proc, _, _ = outcomes[("stages",)]
    assert "pipeline_stage=5 > 4 blocks" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("what,extra,needle", MISSING)
def test_missing_files(what, extra, needle, outcomes):
    proc, _, _ = outcomes[("missing", what)]
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and needle in lines[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_half_precision_the_accelerator_lacks_is_refused(monkeypatch):
    """An accelerator that cannot compute in a half precision is refused by name with what it supports (on a CPU
    without avx512_fp16 that is fp16 for real: see test_precision_this_machine_lacks_is_refused_by_train_py).
    DeepSpeed's accelerator is real; only its answer is narrowed here."""
    import torch
    from deepspeed.accelerator import get_accelerator

    from common.errors import UserError
    from training.core.engine import check_precision
    acc = get_accelerator()
    monkeypatch.setattr(acc, "supported_dtypes", lambda: [torch.float32, torch.bfloat16])
    check_precision("bf16")
    with pytest.raises(UserError) as err:
        check_precision("fp16")
    assert str(err.value) == (f"--precision fp16: DeepSpeed's {acc.device_name()} accelerator supports fp32, bf16 on "
                              f"this machine; use --precision bf16")


@pytest.mark.skipif(accelerator.supported("fp16"), reason="this machine computes in fp16 (nothing to refuse)")
def test_precision_this_machine_lacks_is_refused_by_train_py(outcomes, assert_user_error):
    """The real refusal, end to end: train.py --precision fp16 on an accelerator without fp16 (this CPU)."""
    proc, _, out = outcomes[("fp16",)]
    line = assert_user_error(proc, "--precision fp16", "accelerator supports fp32")
    assert not (out / "metrics.jsonl").exists(), line
