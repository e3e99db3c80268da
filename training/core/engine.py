"""DeepSpeed engine setup (on the process group of training.core.distributed): grid, model (pipelined or not),
optimizer, LR schedule, ZeRO config.

pipeline_stage > 1 → the model is a `PipelineModule` driven by DeepSpeed's pipeline engine (ZeRO 0/1).
pipeline_stage = 1 → the same blocks in one `nn.Module` on DeepSpeed's regular engine (ZeRO 0–3); micro-batches are
gradient-accumulation steps. In both cases DeepSpeed gets our grid as `mpu`, so its data-parallel reductions use the
DP group and its gradient-norm treats TP-sharded parameters correctly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from common.errors import UserError
from model.config import ModelConfig, ParallelConfig
from model.costs import GRAD_BYTES, deepspeed_zero_stage
from model.parallel.random import RNG
from model.parallel.topology import ParallelContext, build_grid
from model.pipeline import build_pipeline_module
from model.placement import load_pipeline_func
from model.transformer import Seq2SeqTransformer
from training.core.boundary_meta import BoundaryMeta
from training.core.distributed import device
from training.core.grad_norm import ClippingAdamW
from training.core.objective import GlobalTokenMean


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The seed's `set_weight_decay`: decay everything but LayerNorm parameters and biases."""
    decay, no_decay = [], []
    norm_params = {id(p) for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if id(p) in norm_params or name.endswith("bias") else decay).append(p)
    # DeepSpeed drops empty groups from the optimizer after the LR scheduler counted them (a pipeline stage of
    # embeddings only has no LayerNorm or bias): leave them out here
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def check_precision(precision: str) -> None:
    """Refuse a half precision the accelerator cannot compute in, naming the accelerator and what it supports."""
    if precision == "fp32":
        return
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    supported = acc.supported_dtypes()
    if HALF_DTYPES[precision] not in supported:
        names = [
            n for n, d in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)) if d in supported
        ]
        fallback = names[-1] if len(names) > 1 else "fp32"
        raise UserError(
            f"--precision {precision}: DeepSpeed's {acc.device_name()} accelerator supports "
            f"{', '.join(names)} on this machine; use --precision {fallback}"
        )


def optimizer_zero_stage(parallel: ParallelConfig, precision: str) -> int:
    """The ZeRO stage DeepSpeed runs for a layout and precision.

    Mixed precision here means fp32 master weights, fp32 moments and fp32 gradient accumulation. DeepSpeed builds
    that only with ZeRO >= 1 (its ZeRO-0 wrappers, FP16_UnfusedOptimizer and the pipeline's BF16_Optimizer
    without fp32 accumulation, sum micro-batch gradients in half precision, and ZeRO 0 with fp32 accumulation is
    refused), so a ZeRO-0 layout in fp16/bf16 runs stage 1: bf16 → BF16_Optimizer, fp16 → the ZeRO-1 optimizer
    with dynamic loss scaling. Stage 1 only partitions the optimizer state over dp (nothing changes at dp 1)."""
    return deepspeed_zero_stage(parallel.effective_zero_stage, precision)  # one rule, plan.py's too


def clips_in_client_optimizer(parallel: ParallelConfig, precision: str) -> bool:
    """fp32 at ZeRO 0: DeepSpeed steps our optimizer unwrapped, and ClippingAdamW measures and clips the norm."""
    return optimizer_zero_stage(parallel, precision) == 0 and precision == "fp32"


# A ZeRO reduce / all-gather bucket is a buffer of this size: large enough that each collective moves megabytes
# (latency is amortised), small enough not to cost a noticeable share of memory on a large model (DeepSpeed's
# default, 5e8 elements, is 2 GB in fp32). PyTorch DDP's default bucket is 25 MB; Megatron-DeepSpeed's recipes use
# 50-500 MB.
BUCKET_CAP_BYTES = 100 * 2**20

# Gradients are averaged over the data-parallel ranks in fp32 under every precision (DeepSpeed's
# `communication_data_type`; without it DeepSpeed reduces in the training precision: a bf16 average over 8 to 64
# ranks is off by 4e-3 to 8e-3 relative, an fp32 one by 6e-8). Weights and activations stay in half precision; the
# reduction buckets and model.costs count GRAD_BYTES = 4 bytes an element. Each optimizer's reduction and where it
# casts: docs/parallelism.md#mixed-precision-and-clipping.
GRAD_REDUCE_DTYPE = "fp32"


# DeepSpeed's ZeRO 1/2 optimizer asserts that the all-gather bucket is a multiple of 2 elements (4-byte alignment
# of fp16 data: `nccl_start_alignment_factor` in stage_1_and_2.py); an odd bucket failed every such run at start
BUCKET_ALIGNMENT = 2


def bucket_elements(num_grad_elements: int, groups: int) -> int:
    """DeepSpeed's reduce/allgather bucket size in elements: the seed's `gradient_aggregation_group` fusion groups
    (gradient bytes / groups), capped at BUCKET_CAP_BYTES, rounded up to BUCKET_ALIGNMENT. A recipe's "deepspeed"
    section may set other sizes."""
    per_group = -(-num_grad_elements // max(groups, 1))
    size = max(1, min(per_group, BUCKET_CAP_BYTES // GRAD_BYTES))
    return -(-size // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT


# ZeRO's communication overlap, by device: on GPUs what DeepSpeed recommends (its ZeRO-3 default, and the ZeRO-1/2
# settings of its tutorials: gradient reduction overlapped with the backward pass, gradients copied into one
# contiguous buffer); on CPUs/gloo off, as measured (no faster, slightly slower: BENCHMARKS.md). A recipe's
# "deepspeed" section overrides either. Which optimizers overlap at all: docs/speed.md.
ZERO_OVERLAP = {
    "cuda": {"overlap_comm": True, "contiguous_gradients": True},
    "cpu": {"overlap_comm": False, "contiguous_gradients": False},
}


def zero_overlap(parallel: ParallelConfig, device_type: str) -> dict:
    """The overlap settings for a layout on a device. A pipeline reduces its gradients once, after the last
    micro-batch's backward (PipelineEngine._exec_reduce_grads), and DeepSpeed turns overlap_comm off for a
    PipelineModule anyway (engine._configure_zero_optimizer, with a warning on every rank): off here, so the config
    says what runs."""
    settings = dict(ZERO_OVERLAP.get(device_type, ZERO_OVERLAP["cuda"]))
    if parallel.pipeline_stage > 1:
        settings["overlap_comm"] = False
    return settings


def deepspeed_config(
    parallel: ParallelConfig,
    global_batch: int,
    precision: str,
    clip_grad: float,
    num_grad_elements: int,
    overrides: dict | None = None,
    user_file: str | None = None,
    device_type: str = "cpu",
) -> dict:
    """The DeepSpeed config for a layout; `device_type`: the accelerator's ("cuda", "cpu"), which picks the ZeRO
    overlap defaults (ZERO_OVERLAP)."""
    micro = global_batch // (parallel.data_parallel * parallel.micro_batch_num)
    bucket = bucket_elements(num_grad_elements, parallel.gradient_aggregation_group)
    zero_stage = optimizer_zero_stage(parallel, precision)
    cfg = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": parallel.micro_batch_num,
        # fp32 ZeRO 0 clips in training.core.grad_norm.ClippingAdamW (exact under pipelining); the rest in DeepSpeed
        "gradient_clipping": 0.0 if clips_in_client_optimizer(parallel, precision) else clip_grad,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": zero_stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            **zero_overlap(parallel, device_type),
        },
        "fp16": {"enabled": precision == "fp16"},
        "bf16": {"enabled": precision == "bf16"},
        # every optimizer DeepSpeed builds here casts to this before its gradient all-reduce / reduce-scatter
        # (GRAD_REDUCE_DTYPE); a user's DeepSpeed config may not change it (training.core.deepspeed_check)
        "communication_data_type": GRAD_REDUCE_DTYPE,
        # Between pipeline stages each TP rank sends 1/mp of the activation and of its gradient, and the receiving
        # stage all-gathers them over its TP ranks (the tensors are replicated over them), instead of every TP rank
        # sending its full copy. DeepSpeed splits one grad-carrying tensor per boundary: model.pipeline joins
        # ours into one. With batch shapes that change (token batches) the engine's split records are kept per
        # shape (training.core.boundary_meta). DeepSpeed turns both off at mp 1. Its receiving side
        # (PartitionedTensor.from_meta) always assumes equal pieces; ours are, since d_model is a multiple of
        # num_heads and num_heads of mp (validate_layout).
        "pipeline": {"pipe_partitioned": True, "grad_partitioned": True},
    }
    if precision in HALF_DTYPES:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    extra = dict(overrides or {})
    if user_file:
        from common.user_files import read_json

        extra.update(read_json(user_file, "--deepspeed_config"))
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if key in extra and extra[key] != cfg[key]:
            raise UserError(
                f"DeepSpeed config sets {key}={extra[key]} but the flags give {cfg[key]} "
                f"(batch_size={global_batch}, dp={parallel.data_parallel}, micro_batch_num="
                f"{parallel.micro_batch_num}); remove it from the DeepSpeed config or change the flags"
            )
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    if cfg["zero_optimization"]["stage"] != zero_stage:
        raise UserError(
            "set the ZeRO stage with --zero_stage / --enable_parallel_optimizer, not in the DeepSpeed "
            "config, so the layout check sees it"
        )
    for key in ("fp16", "bf16"):  # (DeepSpeed ignores the old "bfloat16" key when "bf16" is there)
        # another precision here would make DeepSpeed build an optimizer the run does not describe (fp16/bf16
        # at ZeRO 0 → FP16_UnfusedOptimizer, whose state checkpoints cannot find)
        if isinstance(cfg.get(key), dict) and bool(cfg[key].get("enabled")) != (precision == key):
            raise UserError(
                f"the DeepSpeed config sets {key}.enabled={cfg[key].get('enabled')} but --precision is "
                f"{precision}; choose the precision with --precision (fp32, bf16, fp16), not in the "
                f"DeepSpeed config"
            )
    return cfg


class Engine:
    """The DeepSpeed engine plus what the loop needs to know about this rank's place and the objective."""

    def __init__(
        self,
        ds_engine,
        ctx: ParallelContext,
        parallel: ParallelConfig,
        model_cfg: ModelConfig,
        pipelined: bool,
        ds_config: dict,
        objective: GlobalTokenMean,
        precision: str,
    ):
        self.ds, self.ctx, self.parallel, self.model_cfg = ds_engine, ctx, parallel, model_cfg
        self.pipelined, self.ds_config, self.objective, self.precision = pipelined, ds_config, objective, precision
        # checkpoint lineage (training.checkpoint.manager): first save, or the loaded one
        self.run_id: str | None = None
        # what the stages exchanged about their boundary tensors, per micro-batch shape (token batches change it)
        self.boundary = BoundaryMeta(ds_engine) if pipelined else None

    def expect_shape(self, shape: tuple) -> None:
        """Tell the pipeline engine the shape (rows, source length, target length) of the micro-batches that come
        next (every micro-batch of a step has one; every rank sees the same shapes): the stages exchange a shape's
        tensor sizes the first time it comes and reuse them afterwards (training.core.boundary_meta)."""
        if self.pipelined:
            self.boundary.expect(shape)

    @property
    def module(self):
        return self.ds.module

    @property
    def device(self) -> torch.device:
        return self.ds.device

    @property
    def zero_stage(self) -> int:
        return self.ds_config["zero_optimization"]["stage"]

    def describe(self) -> dict:
        """What runs: the layout, and the precision and optimizer DeepSpeed actually built (OUTPUT_DIR/run.json)."""
        import torch.distributed as dist

        _, accum_dtype = self.ds.get_data_types()
        p = self.parallel
        return {
            "world": dist.get_world_size(),
            "dp": p.data_parallel,
            "mp": p.model_parallel,
            "pp": p.pipeline_stage,
            "micro_batch_num": p.micro_batch_num,
            "interleave_num": p.interleave_num,
            "zero_stage": self.zero_stage,
            "recompute": p.recompute,
            "precision": self.precision,
            "optimizer": type(self.ds.optimizer).__name__,
            "grad_accum_dtype": str(accum_dtype).replace("torch.", ""),
            # the dtype DeepSpeed casts gradients to for the data-parallel reduction, and whether the optimizer
            # it built overlaps that reduction with the backward pass (ZeRO 1-3 with overlap_comm; docs/speed.md)
            "grad_reduce_dtype": str(self.ds.communication_data_type).replace("torch.", ""),
            "grad_reduce_overlap": self.reduction_overlaps_backward(),
            "backend": dist.get_backend(),
            "device": self.device.type,
            # stage boundaries split over the TP ranks on the wire (the pipeline engine's own flags)
            "pipe_partitioned": bool(getattr(self.ds, "is_pipe_partitioned", False)),
            "grad_partitioned": bool(getattr(self.ds, "is_grad_partitioned", False)),
        }

    def reduction_overlaps_backward(self) -> bool:
        """Whether the optimizer DeepSpeed built reduces gradients on a stream of its own while backward runs: ZeRO 1/2
        with overlap_comm (DeepSpeedZeroOptimizer.overlap_comm, which DeepSpeed clears for a PipelineModule) and ZeRO 3
        with overlap_comm (its reduce_and_partition_stream). BF16_Optimizer and fp32 ZeRO 0 reduce after backward."""
        if self.zero_stage == 3:
            return bool(self.ds.zero_overlap_comm())
        return bool(getattr(self.ds.optimizer, "overlap_comm", False))

    def grad_norm(self) -> float:
        """The last step's global gradient norm before clipping (the serial model's norm under any layout)."""
        opt = self.ds.optimizer
        if isinstance(opt, ClippingAdamW):
            return opt.last_grad_norm
        norm = self.ds.get_global_grad_norm()
        return float(norm) if norm is not None else math.nan

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: AdamW's moments and, where DeepSpeed wraps the optimizer, its
        fp32 master copy of the parameters (what plan.py's optimizer_bytes predicts; zero before the first step,
        when AdamW has no state yet). Reads DeepSpeed 0.19.8's attributes for its master partitions:
        single_partition_of_fp32_groups (ZeRO 1/2), fp32_partitioned_groups_flat (ZeRO 3),
        fp32_groups_flat_partition (BF16_Optimizer)."""
        opt = self.ds.optimizer
        base = getattr(opt, "optimizer", opt)
        total = sum(
            v.nbytes for state in base.state.values() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")
        )
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
            total += sum(t.nbytes for t in getattr(opt, attr, None) or [] if torch.is_tensor(t))
        return int(total)

    def loss_scale(self) -> float | None:
        """fp16's current dynamic loss scale (the ZeRO optimizers DeepSpeed builds for fp16 keep it); else None."""
        return float(self.ds.optimizer.loss_scale) if self.precision == "fp16" else None


def build_engine(
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    *,
    world_size: int,
    global_batch: int,
    seed: int,
    lr: float,
    weight_decay: float,
    lr_schedule: Callable[[int], float],
    clip_grad: float,
    betas: tuple[float, float] = (0.9, 0.98),
    eps: float = 1e-8,
    precision: str = "fp32",
    pipeline_func: str | None = None,
    ds_overrides: dict | None = None,
    ds_config_file: str | None = None,
) -> Engine:
    """The DeepSpeed engine for a layout the caller has validated (model.config.validate_layout, once, in
    training.trainer.Trainer.setup). With token batches (shapes that change between steps, `Engine.expect_shape`)
    `global_batch` is the number the batch sizes are a multiple of, which DeepSpeed's config counts as its batch."""
    import deepspeed

    func = load_pipeline_func(pipeline_func)
    grid = build_grid(parallel)
    pipelined = parallel.pipeline_stage > 1
    if pipelined:
        model, ctx = build_pipeline_module(model_cfg, parallel, grid, seed, func)
    else:
        ctx = ParallelContext.from_grid(grid)
        model = Seq2SeqTransformer(model_cfg, parallel, ctx, seed=seed, pipeline_func=func)
    objective = GlobalTokenMean(ctx.dp_size, parallel.micro_batch_num)
    model.loss_fn.normalize = objective.micro_loss
    # dropout streams: same default stream on the TP ranks of a stage, one extra stream per TP rank
    RNG.seed(seed, tp_rank=ctx.tp_rank, pp_rank=ctx.pp_rank)
    n_grad = sum(p.numel() for p in model.parameters())
    ds_cfg = deepspeed_config(
        parallel, global_batch, precision, clip_grad, n_grad, ds_overrides, ds_config_file, device_type=device().type
    )
    groups = weight_decay_groups(model, weight_decay)
    # fused: one kernel over all parameters instead of ~10 elementwise passes per tensor (on this repository's
    # CPU benchmark 2.5 s → 0.14 s per step for 13 M parameters; CUDA has a fused AdamW too). Elementwise, so every
    # layout and ZeRO partitioning computes each element alike.
    adamw = dict(lr=lr, betas=tuple(betas), eps=eps, fused=True)
    if clips_in_client_optimizer(parallel, precision):
        optimizer = ClippingAdamW(
            groups, max_norm=clip_grad, tp_rank=ctx.tp_rank, norm_group=grid.get_model_parallel_group(), **adamw
        )
    else:
        optimizer = torch.optim.AdamW(groups, **adamw)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule)  # training.core.schedule.lr_factor
    kwargs = dict(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_cfg)
    if not pipelined:
        kwargs["mpu"] = grid
    ds_engine, _, _, _ = deepspeed.initialize(**kwargs)
    return Engine(ds_engine, ctx, parallel, model_cfg, pipelined, ds_cfg, objective, precision)
