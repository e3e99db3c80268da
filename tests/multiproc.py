"""Run a function on N real processes joined by a gloo process group, and collect what each returns.

Forked (not spawned) so the children reuse the parent's imports: a 4-rank run costs well under a second of
start-up. A rank that raises sends its traceback to the parent, which fails the test with it; a rank that hangs
is killed after `timeout` seconds, so a broken collective fails the test instead of stalling the suite.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world, port, fn, args, queue):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
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
    """fn(rank, world, *args) on `world` processes; returns [result of rank 0, ..., rank world-1]."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                import torch
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    except Exception as exc:  # queue.Empty on a hang
        errors.append(f"timed out after {timeout}s waiting for ranks ({exc!r})")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
