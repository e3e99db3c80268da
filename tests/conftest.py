"""Shared pytest fixtures: the real Multi30k data turned into a TSV, a BPE tokenizer and datasets, built once.

- `multi30k_dir`: data/multi30k (the bundled .gz files).
- `multi30k_tsv`: Multi30k train as French<TAB>English TSV (29,000 pairs), built once per session.
- `val_tsv`: Multi30k validation (1,014 pairs) as the same TSV.
- `bpe_tokenizer`: path to a joint BPE tokenizer.json (vocab 8000) trained on `multi30k_tsv`.
- `multi30k_dataset_factory(src_len=32, tgt_len=32)`: a TranslationDataset of `multi30k_tsv`, tokenized once
  per length pair into a session cache and loaded from it afterwards.
- `corpus`: 80,000 synthetic pairs of Multi30k sentences (a token store that takes seconds to build).
- `real_interpreters`: the commands a test starts run as interpreters of their own, not forks.
- `run_module(module, *args)`: `python -m module args...` from the repository root, captured.
- `assert_user_error(result, *needles)`: the one-line `error: ...` contract of every CLI (tests/launch.py's
  one_error, its stderr that line alone).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.omp_wait import choose_omp_wait_policy
from tests.live_failures import pytest_configure as _live_failures_configure
from tests.live_failures import pytest_runtest_logreport  # noqa: F401 - a hook: a failure named as it happens
from tests.progress import scaled

REPO_ROOT = Path(__file__).resolve().parent.parent
# The suite's own processes (xdist workers, the fork server, every command a test starts) wait as train.py's do:
# OpenMP threads that spin would take the cores the suite's other processes — and a shared machine's jobs — need.
choose_omp_wait_policy()

# A suite started under nohup (SIGHUP ignored) or as a background job of a script (SIGINT ignored) would pass the
# ignore on to every run it starts (an ignored signal stays ignored across exec), and the stop-signal tests would
# see runs that, rightly, never stop. A handler is not inherited: pytest still outlives its terminal, its runs don't.
if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
    signal.signal(signal.SIGHUP, lambda *_: None)
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def installed_checkout() -> str | None:
    """Where Python, started outside the checkout, imports this repository's packages from (None: nowhere)."""
    probe = "import common.script_entry as s; print(s.package_root())"
    found = subprocess.run([sys.executable, "-c", probe], cwd="/", capture_output=True, text=True, timeout=scaled(120))
    return found.stdout.strip() if found.returncode == 0 else None


def pytest_configure(config):
    _live_failures_configure(config)
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist 3.8+: files in SLOW_FILES_FIRST's order
        config.option.loadscopereorder = False
    _require_this_checkout(config)


def _require_this_checkout(config):
    """The launch scripts, SLURM jobs and console scripts the tests start import the installed packages: installed
    from another folder (or not at all), dozens of tests would fail far from the cause, after most of an hour."""
    if hasattr(config, "workerinput"):
        return  # an xdist worker: the controller has checked
    found = installed_checkout()
    if found != str(REPO_ROOT):
        where = f"from {found}" if found else "nowhere (not installed)"
        raise pytest.UsageError(
            f"the tests need this checkout's packages installed, and Python imports them {where}: run "
            f"`pip install -e '.[test]'` in {REPO_ROOT} (the README's test command does), then the tests again"
        )


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    return REPO_ROOT / "data" / "multi30k"


@pytest.fixture(scope="session")
def multi30k_tsv(multi30k_dir, tmp_path_factory) -> Path:
    from preprocess.parallel import make_tsv

    out = tmp_path_factory.mktemp("multi30k") / "train.fr_en.tsv"
    make_tsv(multi30k_dir / "train.fr.gz", multi30k_dir / "train.en.gz", out)
    return out


@pytest.fixture(scope="session")
def bpe_tokenizer(multi30k_tsv, tmp_path_factory) -> Path:
    from preprocess.tokenizer import train_tokenizer

    return train_tokenizer([multi30k_tsv], tmp_path_factory.mktemp("bpe8k"), type="bpe", vocab_size=8000)


@pytest.fixture(scope="session")
def val_tsv(multi30k_dir, tmp_path_factory) -> Path:
    from preprocess.parallel import make_tsv

    out = tmp_path_factory.mktemp("val") / "val.fr_en.tsv"
    make_tsv(multi30k_dir / "val.fr.gz", multi30k_dir / "val.en.gz", out)
    return out


@pytest.fixture(scope="session")
def multi30k_dataset_factory(multi30k_tsv, bpe_tokenizer, tmp_path_factory):
    from preprocess.dataset import TranslationDataset

    cache_dir = tmp_path_factory.mktemp("tokcache")

    def make(src_len: int = 32, tgt_len: int = 32):
        return TranslationDataset(multi30k_tsv, bpe_tokenizer, src_len, tgt_len, cache_dir=cache_dir, progress=False)

    return make


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """80,000 synthetic pairs, 22 MB: 6 blocks; its token store takes several seconds to build on 2 cores (13-30 s
    measured here). Each line joins 1-3 Multi30k train pairs drawn with a fixed seed: WMT-like lengths, real text."""
    import numpy as np

    from common.text_lines import read_lines

    fr = [line.strip() for line in read_lines(REPO_ROOT / "data" / "multi30k" / "train.fr.gz")]
    en = [line.strip() for line in read_lines(REPO_ROOT / "data" / "multi30k" / "train.en.gz")]
    rng = np.random.default_rng(0)
    joins = rng.integers(1, 4, size=80_000).tolist()
    picks = rng.integers(0, len(fr), size=sum(joins)).tolist()
    lines, k = [], 0
    for j in joins:
        chosen = picks[k : k + j]
        k += j
        lines.append(" ".join(fr[i] for i in chosen) + "\t" + " ".join(en[i] for i in chosen) + "\n")
    path = tmp_path_factory.mktemp("corpus") / "big.fr_en.tsv"
    path.write_text("".join(lines), encoding="utf-8")
    return path


@pytest.fixture
def real_interpreters(monkeypatch):
    """Every command the test starts is its own interpreter, not a fork of tests/drivers/fork_server.py: for the
    tests whose subject is how a process ends, hangs or what it leaves (`pytest.mark.usefixtures`)."""
    monkeypatch.setenv("DSR_TEST_FORK", "0")


@pytest.fixture(scope="session")
def run_module():
    def run(module: str, *args) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        from tests.launch import run_python

        return run_python([sys.executable, "-m", module, *map(str, args)], env=env)

    return run


@pytest.fixture(scope="session")
def assert_user_error():
    from tests.launch import one_error

    def check(result: subprocess.CompletedProcess, *needles: str) -> str:
        return one_error(result, *needles, alone=True)

    return check


# The files that take longest, longest first (seconds of one worker, measured with --durations on 2 cores, unloaded):
# with two workers a file runs whole on one worker (--dist loadfile), and a long file drawn last leaves the other
# worker idle at the end. pytest_configure below keeps this order: xdist would put the files with most tests first.
SLOW_FILES_FIRST = (
    "test_faults.py",  # 472
    "test_slurm.py",  # ~400
    "test_parity.py",  # 320
    "test_multinode.py",  # 316
    "test_front_door.py",  # 251
    "test_layout_search.py",
    "test_checkpoint.py",  # 215
    "test_recipes.py",  # 201
    "test_readme_chain.py",  # 189
    "test_gpu_session.py",  # 182
    "test_launch_scripts.py",  # 110
    "test_start_leaves_nothing.py",  # 101
    "test_gpu_step.py",  # 99
    "test_checkpoint_integrity.py",  # 94
    "test_shared_machine.py",  # 90
    "test_trackers.py",  # 87
    "test_background_save.py",  # 87
    "test_data_store.py",  # 83
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
