"""A rank's command line carried through a remote shell untouched: train.py's arguments, a few environment
variables and where its log goes, as one token of letters, digits, '-' and '_'.

Why: DeepSpeed's pdsh runner joins the command for every node into one string that each node's login shell parses
again; it wraps an argument that holds a space in double quotes and leaves `$(...)`, backticks and `$VAR` alone, so
a data path or run folder such as `/data/a $(rm -rf ~)` would be *run* on every node. No quoting survives that
reliably (the remote shell, pdsh and DeepSpeed each take a turn), so run_cluster.sh sends no path on that line:

    train.py --launch_payload <urlsafe base64 of {"argv": [...], "env": {...}, "log_dir": "...", "cwd": "..."}>

and train.py, first thing, swaps its argv for the payload's (`apply`). Under mpirun the same token is used, so both
launchers start ranks the same way. `log_dir`: the rank writes its stdout and stderr to `LOG_DIR/HOST_rankR.log`
itself (instead of the launcher's --enable_each_rank_log / --output-filename, whose paths would cross the remote
shell too).

run_cluster.sh encodes with `python -m common.launch_payload encode ...` (the repository on PYTHONPATH; nothing here
imports torch).
"""

from __future__ import annotations

import base64
import json
import os
import socket
import sys
from collections.abc import Sequence

from common.ranks import global_rank_from_env

FLAG = "--launch_payload"


def encode(argv: Sequence[str], env: dict | None = None, log_dir: str | None = None, cwd: str | None = None) -> str:
    payload = {"argv": list(argv), "env": dict(env or {}), "log_dir": log_dir, "cwd": cwd}
    return base64.urlsafe_b64encode(json.dumps(payload).encode("utf-8")).decode("ascii").rstrip("=")


def decode(token: str) -> dict:
    raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    payload = json.loads(raw.decode("utf-8"))
    if not isinstance(payload, dict):
        raise ValueError("not a launch payload")
    _check_fields(payload)
    return payload


def _check_fields(payload: dict) -> None:
    """Every field as `apply` uses it (a number for "cwd" or a list for "env" traced back there)."""
    argv, env = payload.get("argv"), payload.get("env", {})
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ValueError('"argv" must be a list of strings')
    if not isinstance(env, dict) or not all(
        isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in env.values()
    ):
        raise ValueError('"env" must map names to strings')
    for key in ("log_dir", "cwd"):
        if payload.get(key) is not None and not isinstance(payload[key], str):
            raise ValueError(f'"{key}" must be a folder path (a string) or null')


def log_path(log_dir: str) -> str:
    """This rank's log file: LOG_DIR/HOST_rankR.log (what run_cluster.sh follows and searches for errors)."""
    return os.path.join(log_dir, f"{socket.gethostname()}_rank{global_rank_from_env()}.log")


def apply(argv: Sequence[str]) -> list[str]:
    """`argv` (without the program name) with a launch payload unpacked: the payload's arguments in its place,
    (the launcher's own, such as DeepSpeed's --local_rank=N, kept in front), its environment set, and stdout /
    stderr sent to the rank's log file. Any other argv comes back as it is."""
    argv = list(argv)
    if FLAG not in argv:
        return argv
    at = argv.index(FLAG)
    if at + 1 >= len(argv):
        sys.exit(f"error: {FLAG} needs its token (run_cluster.sh writes it)")
    try:
        payload = decode(argv[at + 1])
    except (ValueError, UnicodeDecodeError) as exc:
        sys.exit(f"error: {FLAG}: the token does not decode ({exc}); it is written by run_cluster.sh, not by hand")
    os.environ.update({str(k): str(v) for k, v in payload.get("env", {}).items()})
    if payload.get("cwd"):  # relative paths in the arguments mean what they meant to the user
        try:
            os.chdir(payload["cwd"])
        except OSError as exc:
            sys.exit(
                f"error: on {socket.gethostname()}, the folder the job was launched from ({payload['cwd']}) "
                f"cannot be entered ({exc.strerror}): launch from a folder every node sees at the same path"
            )
    if payload.get("log_dir"):
        os.makedirs(payload["log_dir"], exist_ok=True)
        fd = os.open(log_path(payload["log_dir"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    return argv[:at] + [str(a) for a in payload["argv"]] + argv[at + 2 :]


def _main(args: list[str]) -> int:
    usage = (
        "usage: python -m common.launch_payload encode [--cwd DIR] [--log_dir DIR] [--env NAME=VALUE]... -- ARG..."
        "\n       python -m common.launch_payload decode TOKEN\n"
        "Prints the token run_cluster.sh passes as `train.py --launch_payload TOKEN` (or the decoded JSON)."
    )
    if not args or args[0] in ("-h", "--help"):
        print(usage)
        return 0 if args else 2
    if args[0] == "decode" and len(args) == 2:
        print(json.dumps(decode(args[1]), indent=1))
        return 0
    if args[0] != "encode" or "--" not in args:
        print(usage, file=sys.stderr)
        return 2
    opts, argv = args[1 : args.index("--")], args[args.index("--") + 1 :]
    env, log_dir, cwd = {}, None, None
    while opts:
        key = opts.pop(0)
        if key == "--log_dir" and opts:
            log_dir = opts.pop(0)
        elif key == "--cwd" and opts:
            cwd = opts.pop(0)
        elif key == "--env" and opts and "=" in opts[0]:
            name, value = opts.pop(0).split("=", 1)
            env[name] = value
        else:
            print(f"error: unexpected {key!r}\n{usage}", file=sys.stderr)
            return 2
    print(encode(argv, env, log_dir, cwd))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
