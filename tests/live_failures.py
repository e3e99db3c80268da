"""A failing test named the moment it fails, not only in the summary at the end.

`pytest -q` (the README's test command) marks a failure with an `F` among the dots and names it only when the run
ends. A run beside other jobs takes hours and may be stopped by hand before its end; three times the failed test
had to be found from the temporary folders (docs/testing.md, "With other jobs on the machine"). tests/conftest.py
imports this hook, so every run of the suite prints one line per failure as it happens:

    FAILED tests/test_faults.py::test_x (call, 66 s) - AssertionError: the job did not end within 60 s

In an xdist run the controller prints it (the workers' terminals are not shown).
"""

from __future__ import annotations

_config: list = []  # the run's config (none in an xdist worker)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):
        _config[:] = [config]


def pytest_runtest_logreport(report):
    reporter = _config[0].pluginmanager.get_plugin("terminalreporter") if _config else None
    if not report.failed or reporter is None:
        return
    kind = "FAILED" if report.when == "call" else "ERROR"
    if _config[0].get_terminal_writer().width_of_current_line:
        reporter.write("\n")  # after -q's dots (ensure_newline knows only the lines that start with a file's path)
    crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "")  # e.g. "AssertionError: ..."
    why = f" - {crash.splitlines()[0][:200]}" if crash else ""
    reporter.write_line(f"{kind} {report.nodeid} ({report.when}, {report.duration:.0f} s){why}", red=True)
    reporter.flush()  # a pipe (CI's log, nohup) would hold the line in its buffer until the run ends
