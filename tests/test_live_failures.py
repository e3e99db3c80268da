"""The suite names a failing test the moment it fails (tests/live_failures.py), in a plain run and in the README's
two-worker run, through a pipe: a second test waits until the first one's failure has been read from pytest's
output, so the line cannot have come from the summary at the end."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import pytest

from tests.launch import env
from tests.progress import scaled

TESTS = """
import os, pathlib, time


def test_a_fails():
    assert False, "on purpose"


def test_b_waits_until_the_failure_was_read():
    seen = pathlib.Path(os.environ["SEEN"])
    deadline = time.monotonic() + float(os.environ["LIMIT"])
    while not seen.exists():
        assert time.monotonic() < deadline, "the failure was not named while the run went on"
        time.sleep(0.1)
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "two workers"])
def test_a_failure_is_named_while_the_run_goes_on(tmp_path, workers):
    (tmp_path / "test_inner.py").write_text(TESTS)
    seen = tmp_path / "seen"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.live_failures", "-p", "no:cacheprovider", *workers]
    proc = subprocess.Popen(
        [*cmd, "test_inner.py"],
        cwd=tmp_path,
        env=dict(env(), SEEN=str(seen), LIMIT=str(scaled(60))),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watchdog = threading.Timer(scaled(300), proc.kill)  # a pytest that hangs (an xdist worker that never starts)
    watchdog.start()  # ends the pipe, and the test fails below instead of waiting forever
    lines = []
    for line in proc.stdout:  # ends when pytest does: test_b gives up after LIMIT if the line never comes
        lines.append(line)
        if re.fullmatch(r"FAILED test_inner\.py::test_a_fails \(call, \d+ s\) - AssertionError: on purpose\n", line):
            seen.touch()
    output = "".join(lines)
    watchdog.cancel()
    assert proc.wait(timeout=scaled(60)) == 1, output
    assert seen.exists(), output
    assert re.search(r"1 failed, 1 passed", output), output  # the summary is pytest's own, unchanged
