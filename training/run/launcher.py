"""DeepSpeed's runner (`deepspeed`, `python -m deepspeed.launcher.runner`) as run_scripts/run_cluster.sh starts it:

    python -m training.run.launcher --hostfile H --master_addr A --master_port P train.py ...

the same in everything but what it ends when it is stopped. Stopped (SIGTERM, Ctrl-C) while it runs a job over pdsh,
DeepSpeed's runner ends the job's node launchers with `pkill -f "<python> -u -m deepspeed.launcher.launch"` on every
node, which also ends every other DeepSpeed job started there with the same interpreter — another user's job sharing
the nodes, or (in tests/cluster, whose virtual nodes share one process table) every launch on the machine. Here the
pattern also holds this job's --world_info, --master_addr and --master_port, which no other running job has."""

from __future__ import annotations

import re
import shlex

LAUNCH_MODULE = "deepspeed.launcher.launch"
OWN = ("--world_info=", "--master_addr=", "--master_port=")


def _ere(text: str) -> str:
    """`text` as a POSIX extended regular expression matching exactly it (pkill's patterns)."""
    return re.sub(r"([.\[\]()*+?{}|^$\\])", r"\\\1", text)


def job_kill_command(kill_cmd: list, launch_cmd: list) -> list:
    """DeepSpeed's kill command (pdsh's arguments, then `pkill -f` and its pattern) with a pattern that matches only
    the node launchers of `launch_cmd` (the pdsh command the runner started). Unchanged when the launch command
    does not have the expected shape (a DeepSpeed whose launch line differs: its own pattern, as before)."""
    try:
        start = kill_cmd.index("pkill -f ")
        module = launch_cmd.index(LAUNCH_MODULE)
    except ValueError:
        return kill_cmd
    args = launch_cmd[module + 1 :]
    own = {prefix: next((a for a in args if a.startswith(prefix)), None) for prefix in OWN}
    if None in own.values():
        return kill_cmd
    # --node_rank (pdsh's %n, a different number on each node) sits between --world_info and --master_addr
    pattern = (
        f"{_ere(LAUNCH_MODULE)} {_ere(own['--world_info='])} --node_rank=[0-9]+ "
        f"{_ere(own['--master_addr='])} {_ere(own['--master_port='])}( |$)"
    )
    return kill_cmd[:start] + ["pkill -f", shlex.quote(pattern)]


def main(argv: list | None = None) -> None:
    from deepspeed.launcher import multinode_runner, runner

    pdsh_command = multinode_runner.PDSHRunner.get_cmd

    def get_cmd(self, environment, active_resources):
        # (cmd, kill_cmd, env) in DeepSpeed 0.19; only the kill command is replaced, whatever else comes with it
        cmd, kill_cmd, *rest = pdsh_command(self, environment, active_resources)
        return (cmd, job_kill_command(kill_cmd, cmd), *rest)

    multinode_runner.PDSHRunner.get_cmd = get_cmd
    runner.main(argv)


if __name__ == "__main__":
    main()
