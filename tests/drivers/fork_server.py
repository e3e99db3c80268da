#!/usr/bin/env python3
"""Start the tests' single-process Python commands as forks of one process that has imported torch and DeepSpeed.

    python tests/drivers/fork_server.py SOCKET        (started by tests/launch.py, once per test session)

A test command such as `python run_scripts/train.py ARGS` or `python -m preprocess.dataset ARGS` spends ~3.5 s of
a 2-core CPU importing torch and DeepSpeed before its first line runs, and the suite runs dozens of them. This
server imports those third-party packages once (none of this repository's code), then for each request forks a
child that becomes the command: its own process (pid, exit code, signals), stdout/stderr on the files the client
sent, the request's cwd, environment and argv, the script run as `__main__` as the interpreter would, uncaught
exceptions printed as the interpreter prints them, exit code 1. A fork copies only the forking thread, so the
server forks only while it has no other (it refuses to start otherwise, and every command starts its own
interpreter). Python's multiprocessing "forkserver" start
method works the same way. Multi-rank runs (tests/drivers/spawn_ranks.py) and the failure tests start real
interpreters.

Protocol (one Unix-socket connection per command): the client sends an 8-byte length with two file descriptors
(stdout, stderr), then the JSON request {argv, cwd, env}; the server answers the child's pid, and its exit code
(negative: the signal) when it ends, one line each.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import struct
import sys

HEADER = struct.Struct("!Q")


def request_fork(path: str, argv: list, cwd: str, env: dict, out_fd: int, err_fd: int, pgid: int = 0):
    """Client side: ask the server at `path` to start `argv` (`python [-u] SCRIPT ...` or `python -m MODULE ...`)
    with stdout/stderr on out_fd/err_fd, in process group `pgid` (0: a new group led by the child). Returns
    (connection, its reader, pid); the reader's next line is the exit code."""
    body = json.dumps({"argv": [str(a) for a in argv], "cwd": str(cwd), "env": dict(env), "pgid": pgid}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(conn, [HEADER.pack(len(body))], [out_fd, err_fd])
    conn.sendall(body)
    answers = conn.makefile("r")
    return conn, answers, int(answers.readline())


def _pythonpath(env) -> list:
    """$PYTHONPATH's entries as the interpreter puts them on sys.path (an empty entry: the working directory)."""
    value = env.get("PYTHONPATH", "")
    return [os.path.abspath(p) for p in value.split(os.pathsep)] if value else []


def _thread_names() -> list:
    """The names of this process's threads (Linux: /proc/self/task; elsewhere only Python's own are seen)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        import threading

        return [t.name for t in threading.enumerate()]
    names = []
    for task in tasks:
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return names


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("client went away")
        data += chunk
    return data


def _become(request: dict, out_fd: int, err_fd: int, base_path: list) -> None:
    """In the child: turn into `request["argv"]` and exit as the interpreter would. Never returns."""
    import atexit
    import runpy
    import signal
    import traceback

    code = 0
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setpgid(0, request.get("pgid", 0))  # the client can end it and anything it starts
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        for fd in (devnull, out_fd, err_fd):
            os.close(fd)
        sys.stdout.reconfigure(write_through=True)  # as `python -u`
        sys.stderr.reconfigure(write_through=True)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = [a for i, a in enumerate(request["argv"][1:]) if not (a == "-u" and i == 0)]  # -u: see above
        pythonpath = _pythonpath(request["env"])
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[:] = [os.getcwd(), *pythonpath, *base_path]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *pythonpath, *base_path]
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException as exc:  # noqa: BLE001 - reported as the interpreter reports an uncaught exception:
        tb = exc.__traceback__  # from the script's own frames on (not runpy's or this file's)
        while tb is not None and tb.tb_frame.f_code.co_filename in (runpy.__file__, "<frozen runpy>", __file__):
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def main() -> int:
    path = sys.argv[1]
    # the interpreter's own path (stdlib, site-packages) without this script's folder and $PYTHONPATH: each child
    # puts its request's $PYTHONPATH in front, as its interpreter would
    ours = set(_pythonpath(os.environ))
    base_path = [p for p in sys.path[1:] if p not in ours]
    import importlib

    # pyarrow's bundled jemalloc starts a background thread when it loads: a fork copies only the forking thread,
    # and a lock another thread held stays locked in the child (CPython 3.12 warns of it). Turned off for this
    # process alone; each child's own environment is its request's.
    os.environ["JE_ARROW_MALLOC_CONF"] = "background_thread:false"
    # third-party code every child shares (deepspeed: and torch). torch._dynamo: torch imports it on the first
    # optimizer's construction (Optimizer.add_param_group is wrapped by torch._compile._disable_dynamo), 1.2 s of
    # CPU in every training command otherwise
    for name in ("deepspeed", "datasets", "numpy", "safetensors.torch", "transformers", "torch._dynamo"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)  # a missing one: imported by the child that needs it
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
    mine = sorted(
        m
        for m, mod in list(sys.modules.items())
        if m not in ("__main__", "__mp_main__")
        and isinstance(getattr(mod, "__file__", None), str)
        and os.path.isabs(mod.__file__)
        and mod.__file__.startswith(repo)
    )
    if mine:  # each child must import this repository's code afresh
        print(f"fork server: imported this repository's {mine}", file=sys.stderr, flush=True)
        return 1
    threads = _thread_names()
    if len(threads) > 1:  # e.g. OMP_NUM_THREADS > 1: OpenBLAS's thread server; a new interpreter is safe
        print(f"fork server: {len(threads)} threads after the imports ({', '.join(threads)})", file=sys.stderr)
        return 1
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)  # the client reads up to this line (imports may print before it)
    quiet = os.open(os.devnull, os.O_WRONLY)  # nothing more on the client's pipe: it is no longer read
    os.dup2(quiet, 1)
    os.close(quiet)
    waiting: dict[int, socket.socket] = {}
    while os.getppid() == parent:  # the test session is gone: so is this server
        ready, _, _ = select.select([server], [], [], 0.02)
        if ready:
            conn, _ = server.accept()
            try:
                head, fds, _, _ = socket.recv_fds(conn, HEADER.size, 2)
                head += _recv_exactly(conn, HEADER.size - len(head))
                request = json.loads(_recv_exactly(conn, HEADER.unpack(head)[0]))
                if len(fds) != 2:
                    raise ValueError("expected stdout and stderr descriptors")
            except (ConnectionError, ValueError) as exc:
                print(f"fork server: bad request ({exc})", file=sys.stderr, flush=True)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                for sock in waiting.values():
                    sock.close()
                _become(request, fds[0], fds[1], base_path)
            with contextlib.suppress(OSError):  # also here, so the group exists before the client can signal it
                os.setpgid(pid, request.get("pgid") or pid)
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()
    _session_gone(path, waiting)
    return 0


def _session_gone(path: str, running: dict) -> None:
    """The test session ended without stopping this server (SIGTERM or SIGKILL to the suite: no atexit ran): end
    the commands still running, each its own process group, which no signal to the suite's group reaches, and remove
    the socket and its folder (tests/launch.py made it for this server alone)."""
    import signal

    for pid in running:
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:  # it joined the client's group (request_fork's pgid)
                os.kill(pid, signal.SIGKILL)
    for pid in running:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    with contextlib.suppress(OSError):
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


if __name__ == "__main__":
    sys.exit(main())
