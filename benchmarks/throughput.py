#!/usr/bin/env python3
"""Training throughput, measured: ours (run_scripts/train.py, as users run it) against `transformers` at identical
dimensions, batches, padding and thread count; token batches against fixed padding; 1 against 2 processes; bf16;
DeepSpeed's communication options. Writes BENCHMARKS.md (and benchmarks/results.json, the raw figures).

    python -m benchmarks.throughput --file_path out/data/train.fr_en.tsv --tokenizer out/data/bpe8k/tokenizer.json
    python -m benchmarks.throughput ... --only hf procs --steps 12 --repeats 2

Groups (--only): hf (ours vs transformers, fp32), bf16 (the same in bf16), max_tokens (token batches vs fixed
padding), procs (1 vs 2 processes: tp2, dp2), deepspeed (dp2 ZeRO-1/2 with overlap_comm / contiguous_gradients).
The model is benchmarks/harness.py's BENCH_MODEL (d_model 256, 3+3 layers, FFN 1024, 4 heads, global batch 64 × 32
tokens, dropout 0.1). Every configuration runs `--repeats` times, the configurations of a group alternating so that
a change in machine load hits them alike; the figure is the median step time after `--warmup` steps, over all
repeats, and target tokens per second at that median. One process uses every core (OMP_NUM_THREADS = cores), two
processes one core less each. A measurement, not a test: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import BENCH_MODEL, cpu_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RESULTS = os.path.join(ROOT, "benchmarks", "results.json")
REPORT = os.path.join(ROOT, "BENCHMARKS.md")
KEEP = "<!-- other commands' measurements below: throughput.py keeps them -->"

OVERLAP = {"zero_optimization": {"overlap_comm": True, "contiguous_gradients": True}}
# name: (runner, processes, extra flags, what it is)
CONFIGS = {
    "hf": ("hf", 1, [], "transformers Blenderbot, torch AdamW (default: a loop over tensors)"),
    "hf-fused": ("hf", 1, ["--fused_adamw"], "transformers Blenderbot, torch AdamW fused=True"),
    "ours": ("ours", 1, [], "ours, train.py --distribute false"),
    "hf-bf16": ("hf", 1, ["--precision", "bf16"], "transformers Blenderbot, autocast bf16, torch AdamW"),
    "ours-bf16": ("ours", 1, ["--precision", "bf16"], "ours, train.py --precision bf16 (BF16_Optimizer)"),
    "ours-maxtok": ("ours", 1, ["--max_tokens", "2048"], "ours, --max_tokens 2048 (token batches)"),
    "ours-tp2": ("ours", 2, ["--mp", "2"], "ours, tp2 on 2 processes"),
    "ours-dp2": ("ours", 2, [], "ours, dp2 on 2 processes (ZeRO 0)"),
    "ours-dp2-zero1": ("ours", 2, ["--zero_stage", "1"], "ours, dp2 ZeRO-1"),
    "ours-dp2-zero1-overlap": (
        "ours",
        2,
        ["--zero_stage", "1", "--deepspeed_config", "OVERLAP"],
        "ours, dp2 ZeRO-1, overlap_comm + contiguous_gradients",
    ),
    "ours-dp2-zero2": ("ours", 2, ["--zero_stage", "2"], "ours, dp2 ZeRO-2"),
    "ours-dp2-zero2-overlap": (
        "ours",
        2,
        ["--zero_stage", "2", "--deepspeed_config", "OVERLAP"],
        "ours, dp2 ZeRO-2, overlap_comm + contiguous_gradients",
    ),
}
GROUPS = {
    "hf": ["hf", "hf-fused", "ours"],
    "bf16": ["hf-bf16", "ours-bf16"],
    "max_tokens": ["ours", "ours-maxtok"],
    "procs": ["ours", "ours-tp2", "ours-dp2"],
    "deepspeed": ["ours-dp2-zero1", "ours-dp2-zero1-overlap", "ours-dp2-zero2", "ours-dp2-zero2-overlap"],
}


def _run(name: str, data: list[str], steps: int, tmp: str, port: int) -> list[dict]:
    runner, nproc, extra, _ = CONFIGS[name]
    extra = [os.path.join(tmp, "overlap.json") if e == "OVERLAP" else e for e in extra]
    cores = os.cpu_count() or 1
    env = dict(
        os.environ,
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS=str(max(1, cores // nproc)),
    )
    out = os.path.join(tmp, f"{name}-{port}")
    if runner == "hf":
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "hf_train.py"), *data, "--steps", str(steps), *extra]
    else:
        script = [os.path.join(ROOT, "run_scripts", "train.py")]
        launch = (
            [sys.executable]
            if nproc == 1
            else [
                sys.executable,
                "-m",
                "deepspeed.launcher.runner",
                "--num_gpus",
                str(nproc),
                "--master_port",
                str(port),
            ]
        )
        cmd = [*launch, *script, *data, *BENCH_MODEL, "--steps", str(steps), "--output_dir", out, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    if runner == "hf":
        return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def measure(group: str, data: list[str], steps: int, warmup: int, repeats: int) -> dict:
    names = GROUPS[group]
    records: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "overlap.json"), "w") as f:
            json.dump(OVERLAP, f)
        for r in range(repeats):
            for i, name in enumerate(names):
                got = _run(name, data, steps, tmp, 29700 + 10 * r + i)[warmup:]
                records[name] += got
                print(
                    f"  {group} repeat {r + 1}/{repeats} {name}: median "
                    f"{1000 * statistics.median(x['step_time'] for x in got):.0f} ms",
                    flush=True,
                )
    out = {}
    for name, recs in records.items():
        med = statistics.median(x["step_time"] for x in recs)
        out[name] = {
            "what": CONFIGS[name][3],
            "processes": CONFIGS[name][1],
            "median_step_ms": round(1000 * med, 1),
            "tokens_per_sec": round(statistics.median(x["tokens"] for x in recs) / med, 1),
            "steps_measured": len(recs),
        }
        for key in ("padding", "tflops", "peak_mem_mib"):
            if key in recs[0]:
                out[name][key] = round(statistics.median(x[key] for x in recs), 4)
    return out


def machine() -> dict:
    import deepspeed
    import torch
    import transformers

    model = cpu_model()
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            words = next(line for line in f if line.startswith("flags")).split()
        flags = " ".join(w for w in words if w.startswith(("avx", "amx")))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "simd": flags,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
    }


def table(results: dict, names: list[str], base: str) -> list[str]:
    rows = [
        "| configuration | processes | median step | target tokens/s | vs " + base + " | padding | TFLOP/s |",
        "|---|---|---|---|---|---|---|",
    ]
    ref = results[base]["tokens_per_sec"]
    for n in names:
        r = results[n]
        pad = f"{100 * r['padding']:.0f} %" if "padding" in r else ""
        tfl = f"{r['tflops']:.3f}" if "tflops" in r else ""
        rows.append(
            f"| {r['what']} | {r['processes']} | {r['median_step_ms']:.0f} ms | {r['tokens_per_sec']:,.0f} | "
            f"{r['tokens_per_sec'] / ref:.2f}× | {pad} | {tfl} |"
        )
    return rows


def write_report(saved: dict) -> None:
    titles = {
        "hf": ("Ours vs transformers, fp32, one process", "hf"),
        "bf16": ("bf16, one process", "hf-bf16"),
        "max_tokens": ("Token batches vs fixed padding, one process", "ours"),
        "procs": ("One process vs two", "ours"),
        "deepspeed": ("DeepSpeed communication options, dp2", "ours-dp2-zero1"),
    }
    out = [
        "# Benchmarks",
        "",
        "Measured by `benchmarks/throughput.py` (the command under each table; it rewrites this file). Model: "
        "d_model 256, 3 + 3 layers, FFN 1024, 4 heads, joint BPE 8k, global batch 64 × 32 tokens (padded), "
        "dropout 0.1, Multi30k fr→en. Target tokens/s counts the real (non-PAD) target tokens of each batch. The "
        "`transformers` model is Blenderbot — the architecture `run_scripts/export_hf.py` exports ours to — with "
        "our dimensions, trained with a plain torch AdamW loop on the very same batches. MFU needs the device's "
        "peak FLOP/s and is not given for CPUs (model/costs.py); TFLOP/s is the model's FLOPs per second.",
        "",
    ]
    for group, (title, base) in titles.items():
        if group not in saved:
            continue
        entry = saved[group]
        m = entry["machine"]
        out += [
            f"## {title}",
            "",
            f"{entry['date']}, {m['cpu']} ({m['cores']} cores, {m['simd'] or 'no AVX'}), Python {m['python']}, "
            f"torch {m['torch']}, DeepSpeed {m['deepspeed']}, transformers {m['transformers']}; "
            f"{entry['steps']} steps per run, the first {entry['warmup']} left out, "
            f"{entry['repeats']} repeats.",
            "",
        ]
        out += table(entry["results"], list(entry["results"]), base)
        out += ["", f"`{entry['command']}`", ""]
        if entry.get("note"):
            out += [entry["note"], ""]
    kept = ""  # the other benchmarks' sections (below KEEP) are not this command's to rewrite
    if os.path.exists(REPORT):
        with open(REPORT, encoding="utf-8") as f:
            old = f.read()
        if KEEP in old:
            kept = "\n" + old[old.index(KEEP) :]
    with open(REPORT, "w", encoding="utf-8") as f:
        f.write("\n".join(out).rstrip() + "\n" + kept)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file_path", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--only", nargs="+", choices=list(GROUPS), default=list(GROUPS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--note", default="", help="a sentence for the report under these groups' tables")
    args = p.parse_args()
    data = ["--file_path", args.file_path, "--tokenizer", args.tokenizer]
    saved = json.loads(Path(RESULTS).read_text(encoding="utf-8")) if os.path.isfile(RESULTS) else {}
    info = machine()
    for group in args.only:
        print(f"{group}:", flush=True)
        results = measure(group, data, args.steps, args.warmup, args.repeats)
        saved[group] = {
            "results": results,
            "machine": info,
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "date": datetime.date.today().isoformat(),
            "note": args.note,
            "command": " ".join(
                [
                    "python -m benchmarks.throughput",
                    *data,
                    "--only",
                    group,
                    "--steps",
                    str(args.steps),
                    "--warmup",
                    str(args.warmup),
                    "--repeats",
                    str(args.repeats),
                ]
            ),
        }
        with open(RESULTS, "w", encoding="utf-8") as f:
            json.dump(saved, f, indent=1)
        write_report(saved)
        for name, r in results.items():
            print(f"  {name:<24} {r['median_step_ms']:>9.1f} ms  {r['tokens_per_sec']:>9,.0f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
