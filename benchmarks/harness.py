"""What the benchmarks share: the benchmark model, and one training step of ours or of `transformers`' equivalent
model on the same global batches.

`build_ours(train.py flags)` is train.py's own path (parse_config → data → build_engine → training.core.step.train_step)
in
this process; `build_hf(train.py flags)` builds `transformers`' Blenderbot with the same dimensions — the architecture
run_scripts/export_hf.py exports ours to (pre-LN, learned positions, GELU; see model/hf_export.py) — trained with a
plain torch AdamW loop (same betas, eps, weight decay groups) on the very same padded batches, with the mean
cross-entropy over the non-PAD target tokens, as ours.

(Named harness, not common: a module common.py here would hide the repository's common/ package from a benchmark run
by its path, whose folder comes first on sys.path.)
"""

from __future__ import annotations


def cpu_model(default: str = "unknown") -> str:
    """The processor's name from /proc/cpuinfo (`default` where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return default


# The configuration of issue 11: d_model 256, 3+3 layers, FFN 1024, 4 heads, batch 64 × 32 tokens, dropout 0.1, fp32
BENCH_MODEL = [
    "--d_model",
    "256",
    "--encoder_layer",
    "3",
    "--decoder_layer",
    "3",
    "--ffn_size",
    "1024",
    "--num_heads",
    "4",
    "--batch_size",
    "64",
    "--src_len",
    "32",
    "--tgt_len",
    "32",
    "--dropout",
    "0.1",
    "--lr",
    "1e-4",
    "--tensorboard",
    "0",
    "--log_interval",
    "1000000",
]


class OursRunner:
    def __init__(self, cfg):
        from model.config import validate_layout
        from training.core.data import BatchFeeder, batch_schedule, prepare_data
        from training.core.distributed import device
        from training.core.engine import build_engine
        from training.core.schedule import lr_factor
        from training.run.job import join_job

        m, d, o = cfg.model, cfg.data, cfg.optimization
        world = join_job(cfg.parallel.distribute)
        self.data = prepare_data(d.file_path, m.tokenizer, m.src_len, m.tgt_len, progress=False, cache_dir=d.cache_dir)
        model_cfg = m.model_config(vocab_size=m.vocab_size or self.data.vocab_size, pad_id=self.data.pad_id)
        parallel = cfg.parallel.parallel_config(world)
        unit, name = d.batch_unit
        validate_layout(parallel, model_cfg, world_size=world, global_batch=unit, batch_name=name)
        self.engine = build_engine(
            model_cfg,
            parallel,
            world_size=world,
            global_batch=unit,
            seed=o.seed,
            lr=o.lr,
            weight_decay=o.weight_decay,
            lr_schedule=lr_factor("constant", 0, 1, 0.0, 1.0),
            clip_grad=o.clip_grad,
            precision=cfg.parallel.precision,
            ds_overrides=cfg.parallel.deepspeed_overrides,
        )
        schedule = batch_schedule(
            self.data, d.batch_size, d.seed, d.max_tokens, d.batch_multiple, d.pad_multiple, d.num_batch_buckets
        )
        self.feeder = BatchFeeder(
            self.data, schedule, self.engine.ctx.dp_rank, self.engine.ctx.dp_size, parallel.micro_batch_num, device()
        )

    def step(self, step: int) -> tuple[float, int]:
        from training.core.step import train_step

        batches = self.feeder.step(step)
        return train_step(self.engine, batches), batches.global_tokens


class HFRunner:
    """`fused_adamw`: torch's fused AdamW kernel (what train.py uses) instead of torch's default per-tensor loop —
    to show how much of the difference is the optimizer."""

    def __init__(self, config, fused_adamw: bool = False):
        import torch

        from model.hf_export import blenderbot_config
        from training.core.data import BatchFeeder, batch_schedule, prepare_data
        from training.core.engine import weight_decay_groups

        m, d, o = config.model, config.data, config.optimization
        self.data = prepare_data(d.file_path, m.tokenizer, m.src_len, m.tgt_len, progress=False, cache_dir=d.cache_dir)
        cfg = m.model_config(vocab_size=m.vocab_size or self.data.vocab_size, pad_id=self.data.pad_id)
        torch.manual_seed(o.seed)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[config.parallel.precision]
        from transformers import BlenderbotForConditionalGeneration

        hf_cfg = blenderbot_config(cfg, self.data.bos_id, self.data.eos_id, self.data.pad_id)
        hf_cfg.use_cache = False
        self.model = BlenderbotForConditionalGeneration(hf_cfg)
        self.model.train()
        # bf16: the weights stay fp32 and autocast runs the matrix products in bf16 (what a plain torch user does)
        self.autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
        self.optimizer = torch.optim.AdamW(
            weight_decay_groups(self.model, o.weight_decay),
            lr=o.lr,
            betas=(0.9, 0.98),
            eps=1e-8,
            **({"fused": True} if fused_adamw else {}),
        )
        self.feeder = BatchFeeder(
            self.data, batch_schedule(self.data, d.batch_size, d.seed), 0, 1, 1, torch.device("cpu")
        )
        self.pad = self.data.pad_id

    def step(self, step: int) -> tuple[float, int]:
        batches = self.feeder.step(step)
        ((inputs, labels),) = list(batches)
        src, tgt = inputs
        labels = labels.masked_fill(labels == self.pad, -100)  # transformers' ignore index
        with self.autocast:
            out = self.model(
                input_ids=src,
                attention_mask=src != self.pad,
                decoder_input_ids=tgt,
                decoder_attention_mask=tgt != self.pad,
                labels=labels,
            )
        out.loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.last_padding = batches.padding
        return float(out.loss), batches.global_tokens


def _parse(flags: list[str]):
    from training.config.flags import parse_config

    return parse_config([str(f) for f in flags])


def build_ours(flags: list[str]) -> OursRunner:
    return OursRunner(_parse(flags))


def build_hf(flags: list[str], fused_adamw: bool = False) -> HFRunner:
    return HFRunner(_parse(flags), fused_adamw)
