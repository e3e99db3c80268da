"""What the user fixes for `plan.py --search`: the model, precision, global batch, world size, nodes, device and
links — everything the search does not choose (docs/layout-search.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from common.errors import UserError
from model.config import ModelConfig
from training.config.sections import TrainConfig
from training.plan import memory as mem
from training.plan.cluster import Host, rank_nodes
from training.plan.speed_prediction import Links

GIB = 2**30


@dataclass(frozen=True, eq=False)
class Setting:
    cfg: TrainConfig  # the recipe and flags (the planning batch already applied: token_budget)
    model: ModelConfig  # with the vocabulary train.py would size it to
    vocab_source: str  # where that vocabulary comes from, for the report
    world: int
    nodes: tuple  # (node index, host, local rank) of every rank: cluster.rank_nodes
    per_node: int  # ranks of the largest node
    device: str  # h100, h200, a100, ... or cpu
    device_type: str  # "cuda" or "cpu": the DeepSpeed settings train.py picks there
    memory_bytes: float
    memory_name: str
    links: Links
    assumed_mfu: float
    cores: int = 0  # CPU ranks: the cores they share (this machine's: the trials run here)

    @property
    def precision(self) -> str:
        return self.cfg.parallel.precision

    @property
    def batch(self) -> int:
        """The global batch every layout is planned at (pairs)."""
        return self.cfg.data.batch_size

    @property
    def batch_unit(self) -> tuple[int, str]:
        """What data_parallel × micro_batch_num must divide, and its flag (token batches: batch_multiple)."""
        return self.cfg.data.batch_unit

    def node_of(self, rank: int) -> int:
        return self.nodes[rank][0]


def vocabulary(cfg: TrainConfig) -> tuple[int, str]:
    """(vocabulary, where it comes from): --vocab_size, else the --tokenizer's size, else --tokenizer_vocab_size (the
    BPE tokenizer train.py builds has that many tokens)."""
    m = cfg.model
    if m.vocab_size:
        return m.vocab_size, "--vocab_size"
    if m.tokenizer:
        from preprocess.tokenizer import load_tokenizer

        return load_tokenizer(m.tokenizer).get_vocab_size(), f"--tokenizer {m.tokenizer}"
    return m.tokenizer_vocab_size, "--tokenizer_vocab_size (the BPE tokenizer train.py builds)"


def host_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_memory(device: str, device_memory_gib: float | None, per_node: int) -> tuple[float, str]:
    """(bytes one rank may use, a name for the report). On a CPU the ranks of a node share its memory."""
    if device == "cpu" and device_memory_gib is None:
        total = host_memory_bytes()
        return total / per_node, f"cpu: {total / GIB:.0f} GiB of host memory shared by {per_node} rank(s)"
    name, memory = mem.device_bytes(device, device_memory_gib)
    return memory, name


def make_setting(
    cfg: TrainConfig,
    world: int,
    hosts: list[Host] | None,
    gpus_per_node: int,
    device: str,
    device_memory_gib: float | None,
    links: Links,
    assumed_mfu: float,
) -> Setting:
    vocab, source = vocabulary(cfg)
    model = cfg.model.model_config(vocab_size=vocab, pad_id=0)
    nodes = tuple(rank_nodes(world, hosts, gpus_per_node))
    per_node = max(h.slots for h in hosts) if hosts else min(gpus_per_node, world)
    if device != "cpu" and device not in mem.DEVICE_MEMORY_GIB and device_memory_gib is None:
        raise UserError(
            f"--device {device}: unknown; known: cpu, {', '.join(mem.DEVICE_MEMORY_GIB)} — or give its "
            f"memory with --device_memory GiB"
        )
    memory, name = device_memory(device, device_memory_gib, per_node)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return Setting(
        cfg=cfg,
        model=model,
        vocab_source=source,
        world=world,
        nodes=nodes,
        per_node=per_node,
        device=device,
        device_type="cpu" if device == "cpu" else "cuda",
        memory_bytes=memory,
        memory_name=name,
        links=links,
        assumed_mfu=assumed_mfu,
        cores=cores if device == "cpu" else 0,
    )
