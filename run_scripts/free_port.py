#!/usr/bin/env python3
"""Print a TCP port that nobody on this machine listens on now, for DeepSpeed's launcher:

    deepspeed --master_port $(python run_scripts/free_port.py) --num_gpus 2 run_scripts/train.py ...

Without --master_port the launcher takes 29500, which another job on the node may hold (train.py then stops in one
line naming the port). run.sh and run_cluster.sh choose their port the same way (launch_common.sh's free_port).
"""

import socket
import sys


def free_port() -> int:
    """A port the kernel hands out as free now (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> int:
    if argv in (["-h"], ["--help"]):
        print(f"usage: python run_scripts/free_port.py\n\n{__doc__}", end="")
        return 0
    if argv:
        print(f"error: free_port.py takes no arguments (got {argv[0]!r}); it prints a free port", file=sys.stderr)
        return 2
    print(free_port())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
