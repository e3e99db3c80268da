"""Before the first step: does every rank see the output folder — and the checkpoint it resumes from — as rank 0
does? A job of several nodes needs them on a file system every node mounts at the same path (NFS, Lustre, ...).

Without this check a node that sees another folder under the same path trains until the first save, where its
ranks fail on a `step_N.tmp` folder that does not exist for them while rank 0 waits in a barrier — hours in. So
rank 0 writes a file with a fresh random token into OUTPUT_DIR; every rank reads it back (and the sha256 of the
resumed checkpoint's meta.json); the answers are gathered; if a rank saw something else, every rank stops with one
line naming the hosts (and ranks) that do not share the folder. A few milliseconds, once per run.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import uuid

from common.errors import UserError
from common.ranks import note_rank_hosts
from common.staging import atomic_write

PROBE = ".shared-folder-check"


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _digest(path: str) -> str | None:
    data = _read(path)
    return hashlib.sha256(data).hexdigest() if data is not None else None


def _gather(value) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _who(answers: list, bad: list) -> str:
    """'vnode1 (ranks 2, 3), vnode2 (rank 4)' for the ranks in `bad`."""
    by_host: dict[str, list[int]] = {}
    for rank in bad:
        by_host.setdefault(answers[rank][0], []).append(rank)
    return ", ".join(
        f"{host} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})" for host, r in by_host.items()
    )


def check_output_folder(output_dir: str) -> None:
    """Collective: every rank sees the file rank 0 writes into `output_dir`, else UserError on every rank."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank = dist.get_rank()
    probe = os.path.join(os.path.abspath(output_dir), PROBE)
    token = [uuid.uuid4().hex if rank == 0 else None]
    if rank == 0:
        with atomic_write(probe) as f:  # whole or absent: a rank reading half a token would be wrong
            f.write(token[0])
    dist.broadcast_object_list(token, src=0)
    seen = _read(probe)
    answers = _gather((socket.gethostname(), seen is not None and seen.decode("ascii", "replace") == token[0]))
    note_rank_hosts([host for host, _ in answers])  # a survivor of a lost node names it (rank_supervisor)
    if rank == 0:
        with contextlib.suppress(OSError):
            os.remove(probe)
    bad = [r for r, (_, ok) in enumerate(answers) if not ok]
    if bad:
        raise UserError(
            f"--output_dir {output_dir} is not the same folder on every node: {_who(answers, bad)} "
            f"do not see the file rank 0 ({answers[0][0]}) wrote there. Every node must see the output "
            f"folder (and the data) at the same path: put it on a file system all nodes mount (NFS, "
            f"Lustre, ...), or run on one node"
        )


def check_checkpoint(path: str) -> None:
    """Collective: every rank sees the checkpoint `path` rank 0 resumes from, with the same meta.json."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    answers = _gather((socket.gethostname(), _digest(os.path.join(path, "meta.json"))))
    reference = answers[0][1]
    bad = [r for r, (_, digest) in enumerate(answers) if digest != reference]
    if bad:
        raise UserError(
            f"the checkpoint {path} is not the same on every node: {_who(answers, bad)} "
            f"{'do not see it' if reference else 'see one where rank 0 sees none'} (its meta.json "
            f"differs from what rank 0 ({answers[0][0]}) reads). Resume from a folder every node mounts "
            f"at the same path"
        )
