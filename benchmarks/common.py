"""What the benchmarks share: the benchmark model, and one training step of ours or of `transformers`' equivalent
model on the same global batches.

`build_ours(train.py flags)` is train.py's own path (parse_args → data → build_engine → training.loop.train_step) in
this process; `build_hf(train.py flags)` builds `transformers`' Blenderbot with the same dimensions — the architecture
run_scripts/export_hf.py exports ours to (pre-LN, learned positions, GELU; see model/hf_export.py) — trained with a
plain torch AdamW loop (same betas, eps, weight decay groups) on the very same padded batches, with the mean
cross-entropy over the non-PAD target tokens, as ours.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The configuration of issue 11: d_model 256, 3+3 layers, FFN 1024, 4 heads, batch 64 × 32 tokens, dropout 0.1, fp32
BENCH_MODEL = ["--d_model", "256", "--encoder_layer", "3", "--decoder_layer", "3", "--ffn_size", "1024",
               "--num_heads", "4", "--batch_size", "64", "--src_len", "32", "--tgt_len", "32", "--dropout", "0.1",
               "--lr", "1e-4", "--tensorboard", "0", "--log_interval", "1000000"]


class OursRunner:
    def __init__(self, args):
        from training.args import model_config, parallel_config
        from training.data import BatchFeeder, batch_schedule, prepare_data
        from training.engine import build_engine, device, init_distributed
        from training.run import batch_unit_of
        from training.schedule import lr_factor
        world = init_distributed(args.distribute)
        self.data = prepare_data(args.file_path, args.tokenizer, args.src_len, args.tgt_len, progress=False)
        cfg = model_config(args, vocab_size=args.vocab_size or self.data.vocab_size, pad_id=self.data.pad_id)
        parallel = parallel_config(args, world)
        unit, name = batch_unit_of(args)
        self.engine = build_engine(cfg, parallel, world_size=world, global_batch=unit, seed=args.seed,
                                   lr=args.lr, weight_decay=args.weight_decay,
                                   lr_schedule=lr_factor("constant", 0, 1, 0.0, 1.0), clip_grad=args.clip_grad,
                                   precision=args.precision, ds_overrides=args.deepspeed_overrides,
                                   dynamic_shapes=bool(args.max_tokens), batch_name=name)
        schedule = batch_schedule(self.data, args.batch_size, args.seed, args.max_tokens, args.batch_multiple,
                                  args.pad_multiple)
        self.feeder = BatchFeeder(self.data, schedule, self.engine.ctx.dp_rank, self.engine.ctx.dp_size,
                                  parallel.micro_batch_num, device())

    def step(self, step: int) -> tuple[float, int]:
        from training.loop import train_step
        batches = self.feeder.step(step)
        return train_step(self.engine, batches), batches.global_tokens


class HFRunner:
    """`fused_adamw`: torch's fused AdamW kernel (what train.py uses) instead of torch's default per-tensor loop —
    to show how much of the difference is the optimizer."""

    def __init__(self, args, fused_adamw: bool = False):
        import torch
        from model.hf_export import blenderbot_config
        from training.args import model_config
        from training.data import BatchFeeder, batch_schedule, prepare_data
        from training.engine import weight_decay_groups
        self.data = prepare_data(args.file_path, args.tokenizer, args.src_len, args.tgt_len, progress=False)
        cfg = model_config(args, vocab_size=args.vocab_size or self.data.vocab_size, pad_id=self.data.pad_id)
        torch.manual_seed(args.seed)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision]
        from transformers import BlenderbotForConditionalGeneration
        hf_cfg = blenderbot_config(cfg, self.data.bos_id, self.data.eos_id, self.data.pad_id)
        hf_cfg.use_cache = False
        self.model = BlenderbotForConditionalGeneration(hf_cfg)
        self.model.train()
        # bf16: the weights stay fp32 and autocast runs the matrix products in bf16 (what a plain torch user does)
        self.autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
        self.optimizer = torch.optim.AdamW(weight_decay_groups(self.model, args.weight_decay), lr=args.lr,
                                           betas=(0.9, 0.98), eps=1e-8, **({"fused": True} if fused_adamw else {}))
        self.feeder = BatchFeeder(self.data, batch_schedule(self.data, args.batch_size, args.seed), 0, 1, 1,
                                  torch.device("cpu"))
        self.pad = self.data.pad_id

    def step(self, step: int) -> tuple[float, int]:
        batches = self.feeder.step(step)
        (inputs, labels), = list(batches)
        src, tgt = inputs
        labels = labels.masked_fill(labels == self.pad, -100)          # transformers' ignore index
        with self.autocast:
            out = self.model(input_ids=src, attention_mask=src != self.pad, decoder_input_ids=tgt,
                             decoder_attention_mask=tgt != self.pad, labels=labels)
        out.loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.last_padding = batches.padding
        return float(out.loss), batches.global_tokens


def _parse(flags: list[str]):
    from training.args import parse_args
    return parse_args([str(f) for f in flags])


def build_ours(flags: list[str]) -> OursRunner:
    return OursRunner(_parse(flags))


def build_hf(flags: list[str], fused_adamw: bool = False) -> HFRunner:
    return HFRunner(_parse(flags), fused_adamw)
