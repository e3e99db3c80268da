"""Tune a Multi30k recipe on val: run it several times side by side with other train.py flags, each run decoding val
only, and print one table (val BLEU/chrF, best valid_loss, steps, training wall-clock).

Each variant is run_scripts/translation_recipe.sh itself (training, averaging the last checkpoints, beam search) with
SETS=val: the test sets are scored once, by the recipe's own run. Every variant starts from the same data folder
(copied into its own), so they share the tokenizer. Meant for a GPU machine, where the small recipe model leaves the
GPU mostly idle and several runs fit at once; on CPU, run one at a time (--parallel 1).

    python -m benchmarks.sweep_translation --recipe recipes/multi30k-en-fr/multi30k-en-fr.json \
        --data out/multi30k-en-fr/data --out out/sweep --parallel 4 \
        --variant 'base:' --variant 'lr2e-3:--lr 2e-3' --variant 'long:--epochs 40'

--data is a recipe run's data folder (train.tsv, val.tsv, bpe/tokenizer.json); --variant NAME:FLAGS adds train.py
flags over the recipe. Results: OUT/NAME/ (the recipe's own output folder, val.json in it) and OUT/summary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_variant(name, flags, args):
    out = os.path.join(args.out, name)
    if not os.path.isdir(os.path.join(out, "data")):
        shutil.copytree(args.data, os.path.join(out, "data"), ignore=shutil.ignore_patterns(".tokcache"))
    env = dict(
        os.environ,
        SETS="val",
        PYTHON=os.environ.get("PYTHON", sys.executable),
        AVERAGE=str(args.average),
        BEAM=str(args.beam),
        LENPEN=str(args.lenpen),
    )
    start = time.time()
    with open(os.path.join(out, "log.txt"), "a") as log:
        proc = subprocess.run(
            ["bash", "run_scripts/translation_recipe.sh", args.src, args.tgt, args.recipe, out, *shlex.split(flags)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if proc.returncode:
        return name, flags, {"error": f"the recipe exited {proc.returncode} (see {out}/log.txt)"}
    with open(os.path.join(out, "val.json")) as f:
        result = json.load(f)
    with open(os.path.join(out, "train", "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    valid = [m["valid_loss"] for m in metrics if "valid_loss" in m]
    result.update(
        seconds=round(time.time() - start, 1),
        steps=metrics[-1]["step"],
        best_valid_loss=min(valid) if valid else float("nan"),
    )
    print(
        f"{name}: val BLEU {result['bleu']:.2f} chrF {result['chrf']:.2f}, {result['steps']} steps, "
        f"{result['seconds']:.0f} s",
        flush=True,
    )  # partial results survive a sweep cut short
    return name, flags, result


def main():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    p.add_argument("--recipe", required=True)
    p.add_argument("--data", required=True, help="train.tsv, val.tsv and bpe/tokenizer.json")
    p.add_argument("--out", required=True)
    p.add_argument("--variant", action="append", required=True, help="NAME:train.py flags over the recipe")
    p.add_argument("--parallel", type=int, default=1, help="variants trained at once (default 1)")
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="fr")
    p.add_argument("--average", type=int, default=5)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--lenpen", type=float, default=1.0)
    args = p.parse_args()
    variants = []
    for v in args.variant:
        name, sep, flags = v.partition(":")
        if not sep or not name or "/" in name:
            p.error(f"--variant {v!r}: expected NAME:FLAGS, e.g. 'lr2e-3:--lr 2e-3'")
        variants.append((name, flags))
    missing = [
        f for f in ("train.tsv", "val.tsv", "bpe/tokenizer.json") if not os.path.isfile(os.path.join(args.data, f))
    ]
    if missing:
        p.error(
            f"--data {args.data} lacks {', '.join(missing)}: pass the data folder of a recipe run "
            f"(bash recipes/multi30k-en-fr/run.sh OUT makes OUT/data)"
        )
    os.makedirs(args.out, exist_ok=True)
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda nv: run_variant(*nv, args), variants))
    rows = [
        "| variant | flags | val BLEU | val chrF | best valid_loss | steps | recipe s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, flags, r in results:
        if "error" in r:
            rows.append(f"| {name} | `{flags}` | {r['error']} | | | | |")
        else:
            rows.append(
                f"| {name} | `{flags}` | {r['bleu']:.2f} | {r['chrf']:.2f} | {r['best_valid_loss']:.4f} | "
                f"{r['steps']} | {r['seconds']:.0f} |"
            )
    table = "\n".join(rows)
    with open(os.path.join(args.out, "summary.md"), "a") as f:
        f.write(table + "\n\n")
    print(table)


if __name__ == "__main__":
    main()
