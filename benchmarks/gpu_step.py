#!/usr/bin/env python3
"""One device's training step, as train.py runs it (DeepSpeed engine, token batches of real data): tokens/s,
model TFLOP/s, MFU against a named device's dense peak, peak memory — per precision, recompute and token-batch size.

    python -m benchmarks.gpu_step                                    # CUDA: transformer-big; CPU: a tiny model
    python -m benchmarks.gpu_step --precision bf16 fp32 --recompute 0 1 --max_tokens 8192 16384 25000
    python -m benchmarks.gpu_step --size tiny --steps 3 --warmup 1 --device_peak H100 --json out/step.json
    python -m benchmarks.gpu_step --precision bf16 --compile none default reduce-overhead --profile out/profile

The data is the bundled Multi30k (French → English; a TSV and a BPE tokenizer are made in --workdir unless
--file_path/--tokenizer are given). The model is the transformer-big recipe's (recipes/transformer-big-wmt14-en-fr:
d_model 1024, 16 heads, FFN 4096, 6+6 layers, the recipe's 32k vocabulary (its softmax and embedding table; the ids
come from the smaller Multi30k tokenizer), shared embeddings, dropout 0.3, label smoothing 0.1) or, with --size
tiny (the default without CUDA), d_model 32, 4 heads, FFN 64, 2+2 layers, so CI keeps the script working. FLOPs are
model.costs's count (the one plan.py and metrics.jsonl use); MFU only against a device in model.costs.PEAK_FLOPS (the
CUDA device's own name by default, or --device_peak NAME), never a guessed peak. Figures: medians over the steps after
--warmup (of step time, and of each step's tokens / time and FLOPs / time), so one slow step — a recompile — does not
move them; slowest_step_s shows it. --hf also trains `transformers`' Blenderbot of the same dimensions (the
architecture run_scripts/export_hf.py exports to) on the very same batches — a plain torch loop: fused AdamW, autocast
for bf16, gradient checkpointing for recompute, the same label-smoothed cross-entropy over the non-PAD targets — as
the reference. --compile MODE compiles every block of our model with torch.compile (dynamic shapes: token batches
change shape) and with inductor's random numbers drawn as eager's are (`fallback_random`: recompute's replay and the
comparison with eager need the same dropout masks), so a compiled row's loss equals the eager row's to rounding.
`reduce-overhead` is the CUDA-graph variant, but inductor records a graph per input shape and replays it only when
the shape comes again — packed token batches almost never repeat one; --repeat_batches K cycles K batches, so its
rows show what replayed graphs would give (an upper bound). A variant that fails (out of memory, a compiler error) is
reported in its row and the others go on; a CUDA error that leaves the device unusable ends the run with what it
has. Each row is printed and --json rewritten as soon as our figures are in, before the profile and before
`transformers` runs (whose failure is the row's `hf_error`, ours kept). --profile DIR profiles the first
configuration that ran, on its warm engine right after its measured steps (benchmarks/step_profile.py: device kernels
by kind, idle share, launches, host syncs; the Chrome trace is DIR/trace.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

from common.errors import UserError, run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SIZES = {
    "big": [
        "--vocab_size",
        32000,
        "--d_model",
        1024,
        "--num_heads",
        16,
        "--ffn_size",
        4096,
        "--encoder_layer",
        6,
        "--decoder_layer",
        6,
        "--src_len",
        256,
        "--tgt_len",
        256,
        "--dropout",
        0.3,
        "--attention_dropout",
        0.0,
    ],
    "tiny": [
        "--d_model",
        32,
        "--num_heads",
        4,
        "--ffn_size",
        64,
        "--encoder_layer",
        2,
        "--decoder_layer",
        2,
        "--src_len",
        32,
        "--tgt_len",
        32,
        "--dropout",
        0.1,
    ],
}
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")  # none: eager; the others torch.compile's
COMMON = [
    "--share_embeddings",
    "true",
    "--label_smoothing",
    0.1,
    "--lr",
    5e-4,
    "--tensorboard",
    0,
    "--log_interval",
    10**6,
]


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SIZES), default=None, help="big (default on CUDA) or tiny (default on CPU)")
    p.add_argument(
        "--precision", nargs="+", default=None, choices=["fp32", "bf16"], help="default: bf16 fp32 on CUDA, fp32 on CPU"
    )
    p.add_argument(
        "--recompute", nargs="+", type=int, default=None, choices=[0, 1], help="default: 0 1 on CUDA, 0 on CPU"
    )
    p.add_argument(
        "--max_tokens",
        nargs="+",
        type=int,
        default=None,
        help="token batch sizes (tokens per side): default 8192 16384 25000 (big), 512 1024 (tiny)",
    )
    p.add_argument(
        "--compile",
        nargs="+",
        default=["none"],
        choices=list(COMPILE_MODES),
        help="torch.compile every block: none (eager), default, reduce-overhead (CUDA graphs), "
        "max-autotune (default: none)",
    )
    p.add_argument(
        "--repeat_batches",
        type=int,
        default=0,
        metavar="K",
        help="cycle the first K batches (0: every step a new batch): repeated shapes let CUDA graphs "
        "replay; use a --warmup of at least 2K",
    )
    p.add_argument("--steps", type=int, default=10, help="measured steps per configuration (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="steps before measuring (default 3)")
    p.add_argument(
        "--device_peak",
        default=None,
        metavar="NAME",
        help="MFU against this device's dense peak (a name in model.costs.PEAK_FLOPS, e.g. H100); "
        "default: the CUDA device's own name; none on CPU",
    )
    p.add_argument("--file_path", default=None, help="training TSV (default: the bundled Multi30k, made in --workdir)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: an 8k BPE made in --workdir)")
    p.add_argument("--workdir", default="out/gpu_step", help="where the default data and tokenizer go")
    p.add_argument("--hf", action="store_true", help="also train transformers' equivalent model on the same batches")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures here as JSON")
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="profile the first configuration that ran (its warm engine, after its measured steps): "
        "DIR/trace.json (Chrome trace) and DIR/profile.json",
    )
    p.add_argument("--profile_steps", type=int, default=3, help="steps the profile records (default 3)")
    return p.parse_args(argv)


def default_data(args) -> tuple[str, str]:
    from preprocess.parallel import make_tsv
    from preprocess.tokenizer import train_tokenizer

    os.makedirs(args.workdir, exist_ok=True)
    tsv = args.file_path or os.path.join(args.workdir, "train.fr_en.tsv")
    if not os.path.isfile(tsv):
        data = os.path.join(ROOT, "data", "multi30k")
        make_tsv(os.path.join(data, "train.fr.gz"), os.path.join(data, "train.en.gz"), tsv)
    tok = args.tokenizer
    if tok is None:
        tok = os.path.join(args.workdir, "bpe8k", "tokenizer.json")
        if not os.path.isfile(tok):
            tok = str(train_tokenizer([tsv], os.path.dirname(tok), type="bpe", vocab_size=8000, progress=False))
    return tsv, tok


def _timed(step_fn, cuda: bool):
    """(what step_fn returned, its seconds), the device's queue empty before and after."""
    import torch

    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = step_fn()
    if cuda:
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def measure_hf(
    feeder, data, model_cfg, device, precision: str, recompute: bool, steps: int, warmup: int, repeat: int = 0
) -> dict:
    """`transformers`' Blenderbot with our dimensions, trained on the batches `feeder` gave ours."""
    import torch
    import torch.nn.functional as F
    from transformers import BlenderbotForConditionalGeneration

    from model.hf_export import blenderbot_config

    cuda = device.type == "cuda"
    hf_cfg = blenderbot_config(model_cfg, data.bos_id, data.eos_id, data.pad_id)
    hf_cfg.use_cache = False
    torch.manual_seed(0)
    model = BlenderbotForConditionalGeneration(hf_cfg).to(device)
    model.train()
    if recompute:
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, betas=(0.9, 0.98), fused=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    pad = data.pad_id
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times, tokens = [], []

    def train(batches):
        for (src, tgt), labels in batches:
            with autocast:
                logits = model(
                    input_ids=src, attention_mask=src != pad, decoder_input_ids=tgt, decoder_attention_mask=tgt != pad
                ).logits
            loss = F.cross_entropy(
                logits.float().flatten(0, 1),
                labels.flatten(),
                ignore_index=pad,
                label_smoothing=model_cfg.label_smoothing,
                reduction="sum",
            )
            (loss / batches.global_tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for step in range(warmup + steps):
        batches = _batch(feeder, step, repeat)
        _, seconds = _timed(lambda batches=batches: train(batches), cuda)
        if step >= warmup:
            times.append(seconds)
            tokens.append(batches.src_tokens + batches.global_tokens)
    mem = (torch.cuda.max_memory_allocated(device) / 2**20) if cuda else None
    return {
        "hf_median_step_s": statistics.median(times),
        "hf_tokens_per_s": _median_rate(tokens, times),
        "hf_peak_mem_mib": round(mem, 1) if mem is not None else None,
    }


def _median_rate(amounts: list, seconds: list) -> float:
    """The median over steps of amount / time: a step that recompiled (or waited on anything else once) does not
    move it, as it would move total amount / total time."""
    return statistics.median(a / t for a, t in zip(amounts, seconds))


def build(flags: list, compile_mode: str):
    """train.py's engine for these flags, every block compiled with torch.compile unless `compile_mode` is none."""
    import torch

    from benchmarks.harness import build_ours

    if compile_mode != "none":
        torch._dynamo.reset()  # a fresh cache per variant: no recompile limit carried over, graph pools freed
        torch._inductor.config.fallback_random = True  # eager's dropout masks: recompute replays them exactly
    runner = build_ours([str(f) for f in flags])
    if compile_mode != "none":
        for block in runner.engine.module.blocks:
            block.compile(dynamic=True, mode=compile_mode)
    return runner


def _batch(feeder, step: int, repeat: int):
    return feeder.step(step % repeat if repeat else step)


def measure(runner, steps: int, warmup: int, peak_name, repeat: int = 0) -> dict:
    """Our step's figures: `warmup` steps, then `steps` timed ones on the runner's engine."""
    import torch

    from model.costs import model_flops, peak_flops
    from training.core.speed import SpeedMeter, device_name
    from training.core.step import train_step

    engine, cuda = runner.engine, runner.engine.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(engine.device)
    times, work, loss = [], [], None
    for step in range(warmup + steps):
        batches = _batch(runner.feeder, step, repeat)
        loss, seconds = _timed(lambda b=batches, e=engine: train_step(e, b), cuda)  # ends reading the loss
        if step >= warmup:
            times.append(seconds)
            work.append(
                (
                    batches.src_tokens,
                    batches.global_tokens,
                    model_flops(
                        engine.model_cfg, batches.src_tokens, batches.global_tokens, batches.pairs, *batches.lengths
                    ),
                )
            )
    per_step = statistics.median(times)
    rate = _median_rate([f for _, _, f in work], times)
    name = peak_name or (device_name(engine.device) if cuda else None)
    peak = peak_flops(name, engine.precision) if name else None
    mem = SpeedMeter(engine.model_cfg, 1, engine.precision, engine.device).peak_memory_mib()
    return {
        "median_step_s": per_step,
        "slowest_step_s": max(times),
        "tokens_per_s": _median_rate([s + t for s, t, _ in work], times),
        "target_tokens_per_s": _median_rate([t for _, t, _ in work], times),
        "tflops": rate / 1e12,
        "mfu": rate / peak if peak else None,
        "peak_device": name if peak else None,
        "peak_mem_mib": round(mem, 1),
        "device": device_name(engine.device),
        "loss": loss,
    }


def hf_inputs(runner) -> tuple:
    """What measure_hf needs of our runner (so the runner, and its device memory, can go first)."""
    engine = runner.engine
    return (runner.feeder, runner.data, engine.model_cfg, engine.device, engine.precision, engine.parallel.recompute)


def _free(cuda: bool) -> None:
    import gc

    import torch

    gc.collect()
    if cuda:
        with contextlib.suppress(Exception):  # a CUDA context already lost: main() stops at the error
            torch.cuda.empty_cache()


def profile_runner(runner, first_step: int, steps: int, out_dir: str, configuration: dict, repeat: int = 0) -> dict:
    """Profile `steps` more steps of an engine already warm (benchmarks/step_profile.py); write DIR/trace.json and
    DIR/profile.json, print where the step's time goes."""
    from benchmarks.step_profile import describe, profile_steps
    from training.core.step import train_step

    os.makedirs(out_dir, exist_ok=True)
    engine = runner.engine
    summary = profile_steps(
        lambda i: train_step(engine, _batch(runner.feeder, first_step + i, repeat)),
        steps,
        os.path.join(out_dir, "trace.json"),
        engine.device.type == "cuda",
    )
    summary["configuration"] = configuration
    _write_json(os.path.join(out_dir, "profile.json"), summary)
    print(f"profile of {configuration} → {out_dir}/trace.json", flush=True)
    for line in describe(summary):
        print(line, flush=True)
    return summary


def _print_row(row: dict) -> None:
    head = (
        f"{row['size']} {row['precision']} recompute={int(row['recompute'])} max_tokens={row['max_tokens']} "
        f"compile={row['compile']}"
    )
    if "error" in row:
        print(f"{head}: failed — {row['error']}", flush=True)
        return
    mfu = f"{100 * row['mfu']:.1f}% of {row['peak_device']}" if row["mfu"] is not None else "-"
    print(
        f"{head}: {row['median_step_s'] * 1000:.1f} ms/step, {row['tokens_per_s']:,.0f} tokens/s, "
        f"{row['tflops']:.3f} TFLOP/s, MFU {mfu}, peak {row['peak_mem_mib']:,.0f} MiB, loss {row['loss']:.4f} "
        f"({row['device']})",
        flush=True,
    )


def _print_hf(row: dict) -> None:
    if "hf_error" in row:
        print(f"  transformers on the same batches: failed — {row['hf_error']}", flush=True)
    else:
        print(
            f"  transformers on the same batches: {row['hf_median_step_s'] * 1000:.1f} ms/step, "
            f"{row['hf_tokens_per_s']:,.0f} tokens/s; ours {row['speedup_vs_hf']:.2f}×",
            flush=True,
        )


# CUDA errors that are a shortage of memory, not a broken device: the next variant may still fit
_OUT_OF_MEMORY = (
    "out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUBLAS_STATUS_NOT_INITIALIZED",
)


def _device_lost(error: Exception) -> bool:
    """A CUDA error after which the process cannot use the device again (an illegal memory access, say)."""
    import torch

    message = str(error)
    if isinstance(error, torch.cuda.OutOfMemoryError) or any(m in message for m in _OUT_OF_MEMORY):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return isinstance(error, accelerator_error) or "CUDA error" in message


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip() or '-').splitlines()[0][:300]}"


def _write_json(path: str | None, value) -> None:
    if path:
        from common.staging import atomic_write

        with atomic_write(path) as f:
            json.dump(value, f, indent=1)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    import torch

    from model.costs import peak_flops

    cuda = torch.cuda.is_available()
    size = args.size or ("big" if cuda else "tiny")
    precisions = args.precision or (["bf16", "fp32"] if cuda else ["fp32"])
    recomputes = args.recompute if args.recompute is not None else ([0, 1] if cuda else [0])
    max_tokens = args.max_tokens or ([8192, 16384, 25000] if size == "big" else [512, 1024])
    for precision in precisions if args.device_peak else []:
        if peak_flops(args.device_peak, precision) is None:
            raise UserError(
                f"--device_peak {args.device_peak}: no {precision} peak known for it (model/costs.py "
                f"PEAK_FLOPS lists H100, H100 PCIe, H200, A100)"
            )
    if args.repeat_batches and args.warmup < 2 * args.repeat_batches:
        print(
            f"note: --warmup {args.warmup} < 2 × --repeat_batches {args.repeat_batches}: a CUDA graph is "
            f"recorded at a shape's second call, so some measured steps record instead of replaying",
            flush=True,
        )
    graphs = any(m in ("reduce-overhead", "max-autotune") for m in args.compile)
    if args.profile and cuda and graphs:
        # CUPTI must be set up before the first graph is captured, or a later profile misses the graphs' kernels
        from torch.profiler._utils import _init_for_cuda_graphs

        _init_for_cuda_graphs()
    tsv, tok = default_data(args)
    rows, lost, profiled = [], None, False
    for precision in precisions:
        for recompute in recomputes:
            for tokens in max_tokens:
                for mode in args.compile:
                    flags = [
                        "--file_path",
                        tsv,
                        "--tokenizer",
                        tok,
                        "--cache_dir",
                        os.path.join(args.workdir, "cache"),
                        *SIZES[size],
                        *COMMON,
                        "--precision",
                        precision,
                        "--recompute",
                        bool(recompute),
                        "--max_tokens",
                        tokens,
                        "--output_dir",
                        os.path.join(args.workdir, "run"),
                    ]
                    row = {
                        "size": size,
                        "precision": precision,
                        "recompute": bool(recompute),
                        "max_tokens": tokens,
                        "compile": mode,
                        "repeat_batches": args.repeat_batches,
                        "flags": [str(f) for f in flags],
                    }
                    rows.append(row)
                    if lost:
                        row["error"] = f"not run: the device was lost earlier ({lost})"
                        _print_row(row)
                        _write_json(args.json, rows)
                        continue
                    wants_profile = bool(args.profile) and not profiled
                    lost = one_configuration(args, row, rows, cuda, wants_profile)
                    profiled = profiled or (wants_profile and "error" not in row)
    done = [r for r in rows if "error" not in r]
    return 0 if done and not lost else 1


def one_configuration(args, row: dict, rows: list, cuda: bool, profile: bool) -> str | None:
    """Measure one row: ours first (printed and written at once, so a cut or a failing reference keeps it), then
    the profile of the same warm engine, then `transformers` on the same batches (its failure is `hf_error`).
    Returns the error that lost the device, if one did."""
    runner, lost = None, None
    try:
        runner = build(row["flags"], row["compile"])
        row.update(measure(runner, args.steps, args.warmup, args.device_peak, args.repeat_batches))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - out of memory, a compiler failure: this variant's answer
        row["error"] = _error(e)
        lost = row["error"] if _device_lost(e) else None
    _print_row(row)
    _write_json(args.json, rows)
    if "error" in row:
        del runner
        _free(cuda)  # after the except block: its traceback held the failed engine
        return lost
    if profile:
        configuration = {k: row[k] for k in ("size", "precision", "recompute", "max_tokens", "compile")}
        try:
            profile_runner(
                runner, args.warmup + args.steps, args.profile_steps, args.profile, configuration, args.repeat_batches
            )
        except Exception as e:  # noqa: BLE001 - a failed profile is reported; the measured row stays
            row["profile_error"] = _error(e)
            print(f"profile failed — {row['profile_error']}", flush=True)
            _write_json(args.json, rows)
            if _device_lost(e):
                return row["profile_error"]
    inputs = hf_inputs(runner) if args.hf else None
    del runner
    _free(cuda)
    if not args.hf:
        return None
    try:
        row.update(measure_hf(*inputs, args.steps, args.warmup, args.repeat_batches))
        row["speedup_vs_hf"] = row["tokens_per_s"] / row["hf_tokens_per_s"]
    except Exception as e:  # noqa: BLE001 - the reference failed (not installed, out of memory): ours stays
        row["hf_error"] = _error(e)
        lost = row["hf_error"] if _device_lost(e) else None
    else:
        lost = None
    del inputs
    _free(cuda)
    _print_hf(row)
    _write_json(args.json, rows)
    return lost


if __name__ == "__main__":
    run_cli(main)
