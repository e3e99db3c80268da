"""Tune the Multi30k recipe on val: train several variants of a recipe side by side, average each one's last
checkpoints, beam-decode val, and print one table (val BLEU/chrF, steps, training wall-clock).

Only val is decoded: the test sets are scored once, by the recipe's own run (run_scripts/translation_recipe.sh).
Meant for a GPU machine, where the small recipe model leaves the GPU mostly idle and several runs fit at once; on
CPU, run one at a time (--parallel 1).

    python benchmarks/sweep_translation.py --recipe recipes/multi30k-en-fr/multi30k-en-fr.json \
        --data out/multi30k-en-fr/data --out out/sweep --parallel 4 \
        --variant 'base:' --variant 'lr2e-3:--lr 2e-3' --variant 'long:--epochs 40'

--data is a recipe's data folder (train.tsv, val.tsv, bpe/tokenizer.json: what translation_recipe.sh makes);
--variant NAME:FLAGS adds train.py flags over the recipe. Results: OUT/NAME/val.json and OUT/summary.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_variant(name, flags, args):
    out = os.path.join(args.out, name)
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, "log.txt"), "a")
    py = sys.executable
    data = args.data
    start = time.time()
    train = [py, "run_scripts/train.py", "--recipe", args.recipe, "--file_path", f"{data}/train.tsv",
             "--tokenizer", f"{data}/bpe/tokenizer.json", "--valid_file", f"{data}/val.tsv",
             "--output_dir", f"{out}/train", "--resume", "auto", *shlex.split(flags)]
    steps = [train,
             [py, "run_scripts/average_checkpoints.py", f"{out}/train", "--last", str(args.average),
              "--output", f"{out}/avg.pt"],
             [py, "run_scripts/evaluate.py", "--ckpt_file", f"{out}/avg.pt", "--tokenizer",
              f"{data}/bpe/tokenizer.json", "--src", f"data/multi30k/val.{args.src}.gz",
              "--ref", f"data/multi30k/val.{args.tgt}.gz", "--beam", str(args.beam), "--lenpen", str(args.lenpen),
              "--output", f"{out}/val.hyp", "--no_progress"]]
    train_seconds = None
    for i, cmd in enumerate(steps):
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
        log.write(proc.stdout)
        log.flush()
        if proc.returncode:
            return name, flags, {"error": f"{os.path.basename(cmd[1])} exited {proc.returncode} (see {out}/log.txt)"}
        if i == 0:
            train_seconds = time.time() - start
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    metrics = [json.loads(line) for line in open(f"{out}/train/metrics.jsonl")]
    valid = [m["valid_loss"] for m in metrics if "valid_loss" in m]
    result.update(train_seconds=round(train_seconds, 1), steps=metrics[-1]["step"],
                  best_valid_loss=min(valid) if valid else None)
    json.dump(result, open(f"{out}/val.json", "w"))
    print(f"{name}: val BLEU {result['bleu']:.2f} chrF {result['chrf']:.2f}, {result['steps']} steps, "
          f"trained in {train_seconds:.0f} s", flush=True)  # partial results survive a run cut short
    return name, flags, result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
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
    os.makedirs(args.out, exist_ok=True)
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda nv: run_variant(*nv, args), variants))
    rows = ["| variant | flags | val BLEU | val chrF | best valid_loss | steps | train s |", "|---|---|---|---|---|---|---|"]
    for name, flags, r in results:
        if "error" in r:
            rows.append(f"| {name} | `{flags}` | {r['error']} | | | | |")
        else:
            rows.append(f"| {name} | `{flags}` | {r['bleu']:.2f} | {r['chrf']:.2f} | {r['best_valid_loss']:.4f} | "
                        f"{r['steps']} | {r['train_seconds']:.0f} |")
    table = "\n".join(rows)
    open(os.path.join(args.out, "summary.md"), "a").write(table + "\n\n")
    print(table)


if __name__ == "__main__":
    main()
