"""All ranks of a mesh in this one process: a fake process group (no transport) under
`torch.distributed._local_tensor.LocalTensorMode`, which keeps one tensor per rank and carries out each collective
on them. A plan then runs with real values for every rank — the losses, local shapes and counted collectives of an
8- or 64-rank run in seconds, for tests and for planning bigger meshes before launching them.
"""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def simulated_world(world: int):
    """A fake process group of `world` ranks (this process is all of them) with LocalTensorMode on."""
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("simulated_world needs a process without a process group")
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        with LocalTensorMode(world):
            yield
    finally:
        dist.destroy_process_group()
