"""The suite's own scheduling: with `-n 2 --dist loadfile` the files that take longest start first."""

from __future__ import annotations

import types

from tests import conftest
from tests.launch import REPO_ROOT


class _Worker:
    """What xdist's scheduler asks of a worker: the tests it is sent, in order."""

    def __init__(self, name: str):
        self.sent: list[int] = []
        self.gateway = types.SimpleNamespace(id=name)
        self.shutting_down = False

    def send_runtest_some(self, indexes):
        self.sent += indexes

    def shutdown(self):
        self.shutting_down = True


def test_the_slowest_files_start_first_on_two_workers(pytestconfig):
    """xdist orders a loadfile run's files by their number of tests, most first, so the slow files (a few long
    tests each: SLURM, multi-node, faults) started last and one worker ran them alone at the end. The suite's
    configuration keeps tests/conftest.py's order: each worker's first file is one of the two slowest."""
    from xdist.scheduler import LoadFileScheduling

    assert [n for n in conftest.SLOW_FILES_FIRST if not (REPO_ROOT / "tests" / n).is_file()] == []
    # a collection as the suite's: the slow files hold a few tests each, the quick ones many
    others = ["test_train_errors.py", "test_plan.py", "test_tp_layers.py"]
    files = others + list(conftest.SLOW_FILES_FIRST)
    items = [
        types.SimpleNamespace(path=REPO_ROOT / "tests" / f, nodeid=f"tests/{f}::t{i}")
        for f in files
        for i in range(100 if f in others else 3)
    ]
    conftest.pytest_collection_modifyitems(items)
    ids = [item.nodeid for item in items]
    option = types.SimpleNamespace(
        tx=["2*popen"], numprocesses=2, dist="loadfile", maxprocesses=None,
        loadscopereorder=pytestconfig.option.loadscopereorder,
    )  # fmt: skip
    config = types.SimpleNamespace(option=option, getvalue=lambda name: getattr(option, name))
    scheduler = LoadFileScheduling(config)
    workers = [_Worker("gw0"), _Worker("gw1")]
    for w in workers:
        scheduler.add_node(w)
    for w in workers:
        scheduler.add_node_collection(w, ids)
    scheduler.schedule()
    first = [ids[w.sent[0]].split("::")[0] for w in workers]
    assert first == [f"tests/{conftest.SLOW_FILES_FIRST[0]}", f"tests/{conftest.SLOW_FILES_FIRST[1]}"]
