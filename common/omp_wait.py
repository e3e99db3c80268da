"""OpenMP's wait policy for the project's processes, chosen before torch loads its OpenMP runtime.

torch's OpenMP threads spin between parallel regions by default. On a node whose cores other jobs also use, the
spinning takes the time those jobs (and this process's own other threads) need: a tiny train.py step took 10× longer
at load 5 on 2 cores (numbers and the command in docs/speed.md, "Threads on a shared machine"). Sleeping at once
(PASSIVE) costs little when the cores are idle, so it is the default; the user's own OMP_WAIT_POLICY wins, and
`OMP_WAIT_POLICY=default` keeps the runtime's own behaviour.
"""

from __future__ import annotations

import os

DEFAULT = "PASSIVE"


def choose_omp_wait_policy(environ=os.environ) -> str | None:
    """Set OMP_WAIT_POLICY for this process and the processes it starts; returns the policy they get (None: the
    OpenMP runtime's own). Takes effect in this process only when torch is not imported yet: the runtime reads the
    variable once, when it is loaded."""
    value = environ.get("OMP_WAIT_POLICY")
    if value is not None and value.strip().lower() == "default":
        del environ["OMP_WAIT_POLICY"]  # the runtime would call "default" invalid; unset is its default
        return None
    if value is None:
        environ["OMP_WAIT_POLICY"] = DEFAULT
    return environ["OMP_WAIT_POLICY"]
