"""Run a function on N real processes joined by a gloo process group, and collect what each returns.

Forked (not spawned) so the children reuse the parent's imports: a 4-rank run costs well under a second of
start-up. A rank that raises sends its traceback to the parent, which fails the test with it; a rank that hangs
is killed after `timeout` seconds, so a broken collective fails the test instead of stalling the suite.
"""

from __future__ import annotations

import collections
import fcntl
import io
import multiprocessing as mp
import os
import socket
import tempfile
import traceback

from tests.progress import scaled

# Master ports for the tests' jobs, without races: binding port 0 and releasing it let two pytest processes (or
# another job, or an outgoing connection: port 0 draws from the kernel's ephemeral range) get the same port. A port
# is ours only while we hold an exclusive lock on PORT_LOCKS/<port>.lock — shared by every test process on this
# machine, released by the kernel when the holder exits — and it must be bindable when we take it. Ports come from
# PORT_RANGE, below Linux's ephemeral range (32768-60999) and above DeepSpeed's default 29500's neighbourhood, from
# an offset derived from the pid, so concurrent processes rarely even try the same one. A process keeps its last
# KEPT ports locked (a test's job is long over when 64 later ones have been handed out), not every one it took.
PORT_RANGE = (30000, 32700)
PORT_LOCKS = os.path.join("/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir(), "dsr-test-ports")
KEPT = 64
_held: collections.deque = collections.deque()  # (port, open lock file) of this process, oldest first


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store binds
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def free_port() -> int:
    """A port no other test process holds and nothing listens on; this process keeps it locked (see above)."""
    os.makedirs(PORT_LOCKS, mode=0o1777, exist_ok=True)
    low, high = PORT_RANGE
    start = low + (os.getpid() * 97 + len(_held) * 7) % (high - low)
    for i in range(high - low):
        port = low + (start - low + i) % (high - low)
        if any(p == port for p, _ in _held):
            continue
        f = open(os.path.join(PORT_LOCKS, f"{port}.lock"), "a")  # noqa: SIM115 - held open: the lock lasts with it
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        if not _bindable(port):
            f.close()
            continue
        _held.append((port, f))
        while len(_held) > KEPT:
            _held.popleft()[1].close()
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE} (locks under {PORT_LOCKS})")


def _child(rank, world, port, fn, args, queue):
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_SIZE=str(world),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        # no rank leaves while another may still be connecting a group it made but never used: seen twice in full
        # runs, a 4-rank case whose last group (DeepSpeed's grid builds several) a slow rank was still connecting
        # failed there with gloo's "connectFullMesh ... Connection closed by peer" after the other ranks had
        # finished their work and exited (every process exit 0)
        dist.barrier()
        # Tensors go back as bytes: torch's fd-sharing pickler would break once this process exits.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout: float = 180.0) -> list:
    """fn(rank, world, *args) on `world` processes; returns [result of rank 0, ..., rank world-1]. `timeout`: the
    idle machine's limit, grown with the load (tests/progress.py)."""
    limit = scaled(timeout)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            # after a failure the others get a few seconds to report too: the first to fail is often not the cause
            # (a peer's error closes its connections, and the ranks that were waiting on it fail next)
            rank, status, payload = queue.get(timeout=limit if not errors else 5.0)
            if status == "ok":
                import torch

                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{payload}")
    except Exception as exc:  # noqa: BLE001 - queue.Empty on a hang, or a rank's result that does not load
        if not errors:
            errors.append(f"timed out after {limit:.0f} s waiting for ranks ({exc!r})")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
