"""A checkpoint's files checked against their sha256 once per job, the hashing spread over the ranks.

Rank 0 reads meta.json (completeness) and deals the files out, largest first, each to the rank with the fewest
bytes so far; one broadcast carries the deal, each rank hashes its share, one all-gather brings the verdicts back, and
every rank raises the same one line naming the first damaged file (in meta.json's order). So a job hashes every byte
once — not every rank the files it reads, plus rank 0 the whole checkpoint under --resume auto. Without a process
group of several ranks it is format.verify_checkpoint. docs/checkpoints.md, "Integrity".
"""

from __future__ import annotations

import os

from common.errors import UserError
from training.checkpoint.folder import step_checkpoints
from training.checkpoint.format import read_meta, recorded_tokenizer, verify_checkpoint, verify_file


def _group():
    """(rank, world) of the process group, or None without one of several ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.get_rank(), dist.get_world_size()


def deal(path: str, names: list, world: int) -> list:
    """The files each rank hashes: largest first, to the rank with the fewest bytes so far (the lowest on a tie)."""
    sizes = {name: os.path.getsize(os.path.join(path, name)) for name in names}
    shares, loads = [[] for _ in range(world)], [0] * world
    for name in sorted(names, key=lambda n: (-sizes[n], names.index(n))):
        rank = loads.index(min(loads))
        shares[rank].append(name)
        loads[rank] += sizes[name]
    return shares


def _first_problem(path: str, names: list, meta: dict, order: dict):
    """(position in meta.json, the line) of the first of `names` that does not verify, or None."""
    for name in names:
        try:
            verify_file(path, name, meta)
        except UserError as exc:
            return order[name], str(exc)
        except OSError as exc:
            return order[name], f"checkpoint {path}: {name} cannot be read ({exc.strerror or exc})"
    return None


def verify_spread(path: str, with_tokenizer: bool = False) -> dict:
    """Collective (every rank, same point): meta.json complete and every file as its writer wrote it (and its
    tokenizer copy: `with_tokenizer`); returns the meta. UserError on every rank with the same line otherwise."""
    group = _group()
    if group is None:
        return verify_checkpoint(path, with_tokenizer)
    import torch.distributed as dist

    rank, world = group
    box: list = [None]
    if rank == 0:
        try:
            meta = read_meta(path)
            if with_tokenizer:
                recorded_tokenizer(path, meta)  # small: rank 0 alone (format.verify_checkpoint)
            names = meta["shards"] + meta["rng"]
            box[0] = (names, deal(path, names, world), meta)
        except (UserError, OSError) as exc:
            box[0] = str(exc)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise UserError(box[0])
    names, shares, meta = box[0]
    mine = _first_problem(path, shares[rank], meta, {n: i for i, n in enumerate(names)})
    verdicts: list = [None] * world
    dist.all_gather_object(verdicts, mine)
    problems = sorted(v for v in verdicts if v is not None)
    if problems:
        raise UserError(problems[0][1])
    return meta


def newest_intact_spread(root: str) -> tuple:
    """Collective: training.run.start_point.newest_intact's answer — the newest step_* checkpoint of `root` that
    verifies, and "step_N: why" for each newer one skipped — each candidate checked by verify_spread."""
    group = _group()
    candidates: list = [step_checkpoints(root) if group is None or group[0] == 0 else None]
    if group is not None:
        import torch.distributed as dist

        dist.broadcast_object_list(candidates, src=0)
    skipped = []
    for path in candidates[0]:
        try:
            verify_spread(path, with_tokenizer=True)  # a damaged checkpoint of any kind is passed
            return path, skipped
        except UserError as exc:
            skipped.append(f"{os.path.basename(path)}: {exc}")
    return None, skipped
