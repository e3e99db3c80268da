"""translate.py as a streaming translator, and --ckpt_file RUN/best:

- a line written to translate.py's stdin (a pipe kept open) is answered on stdout before stdin is closed, then the
  next one; each answer is that line's translation (the Translator's, alone in its batch); an empty line is answered
  with an empty line at once, a too long one with the truncation warning naming its line;
- a whole file, given as --input or poured into a pipe, gives the Translator's whole-batch translations;
- RUN/best loads the checkpoint of the run's lowest valid_loss (checkpoints/best, the step metrics.jsonl's
  validations say), RUN/latest and RUN the newest step, and the stderr line names the step and why; a run without
  validation has no best: one `error:` line.
"""

import os
import select
import subprocess
import sys
import time
from itertools import islice

import pytest

from tests.launch import REPO_ROOT, TINY, env, read_metrics, run_python, run_train
from tests.progress import scaled

TRANSLATE = str(REPO_ROOT / "run_scripts" / "translate.py")
EVALUATE = str(REPO_ROOT / "run_scripts" / "evaluate.py")


@pytest.fixture(scope="module")
def validated_run(multi30k_tsv, multi30k_dir, bpe_tokenizer, tmp_path_factory):
    """6 steps, validated every 2 (checkpoints/best), a checkpoint every 2 steps, all kept."""
    folder = tmp_path_factory.mktemp("stream-run")
    valid = folder / "val.tsv"
    import gzip

    with (
        gzip.open(multi30k_dir / "val.fr.gz", "rt", encoding="utf-8") as fr,
        gzip.open(multi30k_dir / "val.en.gz", "rt", encoding="utf-8") as en,
    ):
        valid.write_text(
            "".join(f"{a.strip()}\t{b.strip()}\n" for a, b in islice(zip(fr, en, strict=True), 64)), encoding="utf-8"
        )
    out = folder / "run"
    run_train(
        1,
        [
            "--file_path",
            multi30k_tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--output_dir",
            out,
            *TINY,
            "--steps",
            6,
            "--save_checkpoint_steps",
            2,
            "--keep_checkpoint_max",
            5,
            "--valid_file",
            valid,
            "--valid_interval",
            2,
        ],
    )
    return out


@pytest.fixture(scope="module")
def sources(multi30k_dir):
    import gzip

    with gzip.open(multi30k_dir / "val.fr.gz", "rt", encoding="utf-8") as f:
        return [next(f).rstrip("\n") for _ in range(40)]


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """One line of the process's stdout within `timeout` seconds (stdin still open), else fail."""
    deadline = time.monotonic() + scaled(timeout)
    buf = b""
    fd = proc.stdout.fileno()
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        ready = select.select([fd], [], [], max(left, 0))[0]
        if not ready:
            proc.kill()
            raise AssertionError(
                f"no answer within {timeout} s (stdin still open); got {buf!r}; stderr: "
                f"{proc.stderr.read().decode()[-2000:]}"
            )
        chunk = os.read(fd, 1)
        if not chunk:
            raise AssertionError(f"stdout ended; stderr: {proc.stderr.read().decode()[-2000:]}")
        buf += chunk
    return buf.decode("utf-8").rstrip("\n")


def test_each_line_is_answered_before_the_next_is_written(validated_run, sources):
    from training.evaluation.translator import Translator

    translator = Translator.load(str(validated_run), device="cpu")
    long = " ".join(sources[:6])  # past TINY's src_len 12: cut, with a warning
    want = [translator.translate([s]).hypotheses[0] for s in (sources[0], sources[1], long)]
    proc = subprocess.Popen(
        [sys.executable, TRANSLATE, "--ckpt_file", str(validated_run)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env(),
        cwd=REPO_ROOT,
    )
    try:
        answers = []
        for line in (sources[0], "", sources[1], long):
            proc.stdin.write((line + "\n").encode("utf-8"))
            proc.stdin.flush()
            answers.append(read_line(proc, timeout=120))  # the first one includes loading the checkpoint
        rest, err = proc.communicate(timeout=scaled(120))  # closes stdin: the end of the input
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()[-3000:]
    assert answers == [want[0], "", want[1], want[2]] and rest == b""
    err = err.decode()
    assert "warning: 1 of 1 sources have more than src_len-1 = 11 tokens" in err and "(lines 4)" in err, err
    assert "3 sentences in" in err


def test_a_whole_file_is_translated_as_before(validated_run, sources, tmp_path):
    """--input FILE and the same lines poured into a pipe closed at once: the Translator's whole-batch output."""
    from training.evaluation.translator import Translator

    lines = sources[:20] + [""] + sources[20:]
    want = Translator.load(str(validated_run), device="cpu").translate(sources).hypotheses
    want = want[:20] + [""] + want[20:]
    (tmp_path / "in.fr").write_text("\n".join(lines) + "\n", encoding="utf-8")
    by_file = subprocess.run(
        [sys.executable, TRANSLATE, "--ckpt_file", str(validated_run), "--input", str(tmp_path / "in.fr")],
        env=env(),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert by_file.returncode == 0, by_file.stderr[-3000:]
    assert by_file.stdout.splitlines() == want
    piped = subprocess.run(
        [sys.executable, TRANSLATE, "--ckpt_file", str(validated_run)],
        input="\n".join(lines) + "\n",
        env=env(),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert piped.stdout.splitlines() == want


def test_best_and_latest_name_the_checkpoint_and_why(validated_run, sources, tmp_path, assert_user_error):
    records = [r for r in read_metrics(validated_run) if "valid_loss" in r]
    assert [r["step"] for r in records] == [2, 4, 6]
    best = min(records, key=lambda r: r["valid_loss"])
    (tmp_path / "in.fr").write_text("\n".join(sources[:3]) + "\n", encoding="utf-8")

    def run(script, ckpt, *extra):
        args = ["--input", tmp_path / "in.fr"] if script == TRANSLATE else ["--src", tmp_path / "in.fr"]
        return run_python([sys.executable, script, "--ckpt_file", ckpt, *args, *extra], env=env())

    proc = run(TRANSLATE, validated_run / "best")
    assert proc.returncode == 0, proc.stderr[-3000:]
    head = (
        f"checkpoint {validated_run / 'checkpoints' / 'best'} (step {best['step']}; best: the lowest valid_loss "
        f"of the run's validations, {best['valid_loss']:.4f})"
    )
    assert head in proc.stderr, proc.stderr
    for ckpt in (validated_run / "latest", validated_run):
        proc = run(TRANSLATE, ckpt)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (
            f"checkpoint {validated_run / 'checkpoints' / 'step_00000006'} (step 6; latest: the newest "
            f"complete checkpoint of {validated_run})" in proc.stderr
        ), proc.stderr
    proc = run(EVALUATE, validated_run / "best", "--no_progress")  # evaluate.py takes it too
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"(step {best['step']}; best: the lowest valid_loss" in proc.stdout, proc.stdout

    no_validation = tmp_path / "plain"  # a run that never validated
    (no_validation / "checkpoints").mkdir(parents=True)
    os.symlink(validated_run / "checkpoints" / "step_00000002", no_validation / "checkpoints" / "step_00000002")
    (no_validation / "checkpoints" / "latest").write_text("step_00000002")
    assert_user_error(
        run(TRANSLATE, no_validation / "best"),
        f"{no_validation} holds no best checkpoint",
        "--valid_file",
        f"{no_validation / 'latest'}",
    )
