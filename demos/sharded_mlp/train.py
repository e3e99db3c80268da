"""The seed's quickstart (003) end to end: its data, its Net with one strategy and the rest propagated, MSELoss and
Momentum(lr 0.2, momentum 0.1), 4 steps per epoch for 5 epochs, the loss line of every step on every rank, and
the strategy dumps — in real processes (one per rank: DeepSpeed's launcher or mpirun) or simulated in one process.

Data, as the seed's `get_dataset`: every rank draws `np.random.seed(1)`, `rand(batch, in_dim)` inputs and
`rand(batch, out_dim)` labels, and yields that same batch every step; with dataset_strategy "data_parallel" the
ranks' batches together are the global batch (8 × 2 = 16 rows, the (16, 32) of the seed's IR). (The tutorial's
call passes the arguments out of order; its IR and log show this reading.) Weights: N(0, 0.01) like MindSpore's
"normal" initializer, from a torch generator — the seed's own draw cannot be reproduced, so the loss values are not
the seed's, only its form and trend; the serial run below is the reference they must equal.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from common.errors import UserError
from demos.sharded_mlp.network import SEED_STRATEGY, network_with_loss
from demos.strategy.dump import execute_dump, strategy_dump
from demos.strategy.graph import trace
from demos.strategy.layout import format_strategy
from demos.strategy.propagate import Plan, propagate


@dataclass(frozen=True)
class MLPConfig:
    mesh: tuple[int, ...] = (2, 4)
    strategy: tuple = SEED_STRATEGY
    in_dim: int = 32
    hidden_dim: int = 16
    out_dim: int = 16
    batch_size: int = 2  # per rank (the seed's var_single_batch_size)
    steps_per_epoch: int = 4
    epochs: int = 5
    lr: float = 0.2
    momentum: float = 0.1
    seed: int = 0  # weights

    @property
    def world(self) -> int:
        return math.prod(self.mesh)


def seed_batch(cfg: MLPConfig) -> tuple[np.ndarray, np.ndarray]:
    """One rank's batch, as the seed's get_dataset draws it."""
    np.random.seed(1)
    inputs = np.random.rand(cfg.batch_size, cfg.in_dim).astype(np.float32)
    labels = np.random.rand(cfg.batch_size, cfg.out_dim).astype(np.float32)
    return inputs, labels


def global_batch(cfg: MLPConfig) -> dict[str, torch.Tensor]:
    """The ranks' batches stacked in rank order: what the network sees as one (world × batch) batch."""
    x, y = seed_batch(cfg)
    return {"data": torch.from_numpy(np.tile(x, (cfg.world, 1))), "label": torch.from_numpy(np.tile(y, (cfg.world, 1)))}


def build(cfg: MLPConfig):
    """(network with loss, its plan on cfg.mesh)."""
    module = network_with_loss(
        in_dim=cfg.in_dim, hidden_dim=cfg.hidden_dim, out_dim=cfg.out_dim, strategy=cfg.strategy, seed=cfg.seed
    )
    graph = trace(module, global_batch(cfg))
    return module, propagate(graph, cfg.mesh)


def loss_line(epoch: int, step: int, loss: float) -> str:
    return f"epoch: {epoch} step: {step}, loss is {loss}"


def train_serial(cfg: MLPConfig) -> list[float]:
    """The same network, data and optimizer in one process on whole tensors: the reference."""
    module, _ = build(cfg)
    opt = torch.optim.SGD(module.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    batch = global_batch(cfg)
    losses = []
    for _ in range(cfg.epochs * cfg.steps_per_epoch):
        loss = module(batch["data"], batch["label"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@dataclass
class ShardedResult:
    plan: Plan
    losses: list[float]
    runner: object
    backward: dict


def train_sharded(cfg: MLPConfig, mesh, module, plan: Plan, log: Callable[[str], None] = print) -> ShardedResult:
    """Train `build(cfg)`'s module and plan on `mesh` (a DeviceMesh of cfg.mesh; real ranks or simulated);
    records the first step. Build them outside a simulation: LocalTensorMode draws random numbers per rank."""
    from torch.distributed.tensor.debug import CommDebugMode

    from demos.strategy.execute import ShardedRunner, counted, loss_value

    runner = ShardedRunner(plan, mesh, module)
    opt = torch.optim.SGD(runner.parameters(), lr=cfg.lr, momentum=cfg.momentum, foreach=False)
    batch = {k: runner.distribute_input(k, v) for k, v in global_batch(cfg).items()}
    losses, backward = [], {}
    for epoch in range(1, cfg.epochs + 1):
        for step in range(1, cfg.steps_per_epoch + 1):
            first = not losses
            loss = runner.forward(batch, record=first)
            opt.zero_grad()
            with CommDebugMode() as comm:
                loss.backward()
            if first:
                backward = counted(comm)
            opt.step()
            losses.append(loss_value(loss))
            log(loss_line(epoch, step, losses[-1]))
    return ShardedResult(plan, losses, runner, backward)


def write_dumps(result: ShardedResult, out_dir: str, rank: int) -> str:
    """OUT/rank_R/{step_parallel_begin,execute}.txt; returns the rank's folder."""
    folder = os.path.join(out_dir, f"rank_{rank}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "step_parallel_begin.txt"), "w", encoding="utf-8") as f:
        f.write(strategy_dump(result.plan) + "\n")
    with open(os.path.join(folder, "execute.txt"), "w", encoding="utf-8") as f:
        f.write(execute_dump(result.plan, result.runner.records, rank, result.backward) + "\n")
    return folder


def check_line(plan: Plan) -> str:
    ops = "; ".join(
        f"{p.op.instance} {format_strategy(p.strategy)}{'' if p.source == 'shard()' else ' (propagated)'}"
        for p in plan.ops.values()
    )
    return f"strategies ok on mesh {plan.mesh}: {ops}"


# ------------------------------------------------------------------------------------------------------------ CLI


def parse_mesh(text: str) -> tuple[int, ...]:
    try:
        mesh = tuple(int(s) for s in text.replace("x", ",").split(",") if s.strip())
    except ValueError:
        mesh = ()
    if not mesh or any(n < 1 for n in mesh):
        raise UserError(f"--mesh {text!r}: give the mesh dimensions as positive integers, e.g. 2,4")
    return mesh


def parse_strategy(text: str) -> tuple:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise UserError(f'--strategy {text!r} is not a tuple of tuples, e.g. "((2, 4), (4, 1))"') from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sharded_mlp.py",
        description="The seed's quickstart (003): Net(32, 16, 16) with a strategy on the "
        "first MatMul, the others propagated, trained on DTensor over a device mesh. Launch one process per rank "
        "(deepspeed --num_gpus 8, or mpirun -n 8), or --simulate in one process.",
    )
    p.add_argument("--mesh", default="2,4", help="device mesh, e.g. 2,4 (default; 8 ranks) or 8,8 (64)")
    p.add_argument(
        "--strategy",
        default=str(SEED_STRATEGY),
        help="the first MatMul's strategy, MindSpore's tuple form (default \"((2, 4), (4, 1))\")",
    )
    p.add_argument("--epochs", type=int, default=5, help="epochs (default 5, the seed's)")
    p.add_argument("--steps_per_epoch", type=int, default=4, help="steps per epoch, each on the same batch (4)")
    p.add_argument("--batch_size", type=int, default=2, help="rows per rank (default 2; global = ranks × this)")
    p.add_argument("--lr", type=float, default=0.2, help="Momentum learning rate (0.2)")
    p.add_argument("--momentum", type=float, default=0.1, help="momentum (0.1)")
    p.add_argument("--output_dir", default=None, help="rank_R/ strategy dumps and metrics.jsonl go here")
    p.add_argument("--check", action="store_true", help="plan only (one process): print the strategies and exit")
    p.add_argument(
        "--simulate",
        action="store_true",
        help="all ranks in this one process (LocalTensorMode over a fake process group), compared with the serial run",
    )
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # DeepSpeed's launcher
    return p


def config_from(args) -> MLPConfig:
    cfg = MLPConfig(
        mesh=parse_mesh(args.mesh),
        strategy=parse_strategy(args.strategy),
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
    )
    for name in ("epochs", "steps_per_epoch", "batch_size"):
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name} {getattr(cfg, name)} must be >= 1")
    return cfg


def main(argv: list | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from(args)
    if args.check:
        print(check_line(build(cfg)[1]))
        return 0
    if args.simulate:
        run_simulated(cfg, args.output_dir)
        return 0
    return run_distributed(cfg, args.output_dir)


def run_simulated(cfg: MLPConfig, out_dir: str | None, log: Callable[[str], None] = print) -> ShardedResult:
    """Every rank in this process (demos.strategy.simulation); prints the dumps and the gap to the serial run."""
    from demos.strategy.execute import make_mesh
    from demos.strategy.simulation import simulated_world

    module, plan = build(cfg)
    log(strategy_dump(plan))
    with simulated_world(cfg.world):
        result = train_sharded(cfg, make_mesh(cfg.mesh), module, plan, log=log)
        if out_dir:
            for rank in range(cfg.world):
                write_dumps(result, out_dir, rank)
    log(execute_dump(result.plan, result.runner.records, 0, result.backward))
    serial = train_serial(cfg)
    worst = max(abs(a - b) / abs(b) for a, b in zip(result.losses, serial))
    log(
        f"simulated {cfg.world} ranks on mesh {cfg.mesh}: max relative loss difference to the serial run over "
        f"{len(serial)} steps: {worst:.2e}"
    )
    return result


def run_distributed(cfg: MLPConfig, out_dir: str | None) -> int:
    import torch.distributed as dist

    from demos.strategy.execute import make_mesh
    from training.run.job import join_job, leave_job

    world = join_job("auto")
    rank = dist.get_rank()
    try:
        if world != cfg.world:
            raise UserError(
                f"the mesh {cfg.mesh} needs {cfg.world} processes but {world} were started; launch "
                f"{cfg.world} (deepspeed --num_gpus {cfg.world} / mpirun -n {cfg.world}) or change --mesh"
            )
        module, plan = build(cfg)  # checked on every rank before any collective
        if rank == 0:
            print(strategy_dump(plan), flush=True)
        result = train_sharded(cfg, make_mesh(cfg.mesh), module, plan, log=lambda line: print(line, flush=True))
        if out_dir:
            write_dumps(result, out_dir, rank)
            if rank == 0:
                with open(os.path.join(out_dir, "metrics.jsonl"), "w", encoding="utf-8") as f:
                    for k, loss in enumerate(result.losses):
                        f.write(
                            json.dumps(
                                {
                                    "epoch": k // cfg.steps_per_epoch + 1,
                                    "step": k % cfg.steps_per_epoch + 1,
                                    "loss": loss,
                                }
                            )
                            + "\n"
                        )
        if rank == 0:
            print(execute_dump(result.plan, result.runner.records, rank, result.backward), flush=True)
        leave_job()  # watches stopped, barrier, group torn down
    finally:
        if dist.is_initialized():  # an error: no barrier (the launcher stops the others)
            dist.destroy_process_group()
    return 0
