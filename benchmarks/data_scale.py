#!/usr/bin/env python3
"""Corpus-scale data: preprocessing time and memory, store size, train.py's start and memory per rank, schedule
build time — on synthetic corpora of 0.1 M to 4.5 M pairs made from the bundled Multi30k sentences.

    python -m benchmarks.data_scale --work out/data_scale --sizes 0.1M 1M 4.5M --report

For each size: a TSV of `pairs` lines, each the concatenation of 1-3 randomly drawn Multi30k train pairs (French
sources, English targets; ~25 source words a pair, ~270 bytes a line, as the issue's corpus), then

- `python -m preprocess.dataset` (src_len = tgt_len = 128, a BPE-8k tokenizer trained on Multi30k train): wall time,
  the peak resident memory of its largest process (getrusage) and of all its processes together (sampled);
- the store's size on disk against its real tokens (non-PAD positions of src and labels) × 2 bytes;
- `run_scripts/train.py` with 1 and 2 ranks (DeepSpeed's launcher, the store already built): seconds from the launch
  to the first step's metrics record, and each rank's peak RSS and PSS (shared pages split between the processes
  that map them) up to its end after that step; the node's total is the sum of the ranks' PSS;
- the fixed and token-batch schedules built over the corpus's real lengths, and over 10 M synthetic lengths.

`--formats` compares the store's numpy memmap with the same ids in an Arrow file (LargeList<uint16> columns):
file size, open time, resident memory after opening, time to build padded batches. `--report` writes the tables into
BENCHMARKS.md between this script's markers. The corpora and stores stay under --work (delete it afterwards).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

REPORT = ROOT / "BENCHMARKS.md"
BEGIN, END = "<!-- data_scale.py: begin -->", "<!-- data_scale.py: end -->"
LENGTH = 128
TRAIN_FLAGS = [
    "--src_len",
    str(LENGTH),
    "--tgt_len",
    str(LENGTH),
    "--batch_size",
    "32",
    "--d_model",
    "128",
    "--steps",
    "1",
    "--dropout",
    "0",
    "--tensorboard",
    "0",
    "--log_interval",
    "1",
]


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1_000, "M": 1_000_000}.get(text[-1], 1)
    return int(round(float(text[:-1] if scale > 1 else text) * scale))


def size_name(pairs: int) -> str:
    return f"{pairs / 1e6:g} M" if pairs >= 100_000 else f"{pairs:,}"


def make_corpus(pairs: int, path: Path, seed: int = 0) -> Path:
    """`pairs` lines of 1-3 Multi30k train pairs joined by spaces (drawn with replacement, fixed seed)."""
    from common.staging import atomic_write
    from common.text_lines import read_lines

    if path.is_file():
        return path
    data = ROOT / "data" / "multi30k"
    fr = [line.strip() for line in read_lines(data / "train.fr.gz")]
    en = [line.strip() for line in read_lines(data / "train.en.gz")]
    rng = np.random.default_rng(seed)
    with atomic_write(path) as f:
        for start in range(0, pairs, 100_000):
            n = min(100_000, pairs - start)
            joins = rng.integers(1, 4, size=n)
            picks = rng.integers(0, len(fr), size=int(joins.sum())).tolist()
            lines, k = [], 0
            for j in joins.tolist():
                chosen = picks[k : k + j]
                k += j
                lines.append(" ".join(fr[i] for i in chosen) + "\t" + " ".join(en[i] for i in chosen) + "\n")
            f.write("".join(lines))
    return path


def run_measured(cmd: list, env: dict | None = None, poll: float = 0.5) -> dict:
    """Run `cmd`: its wall time, CPU time (user + system, all its processes), return code, output, and memory:
    `peak_max_mib` the largest single process's peak RSS (GNU time's %M: getrusage over the waited-for process tree,
    exact), `peak_tree_mib` the largest sum of PSS
    over the process and its descendants (sampled every `poll` s; PSS, because forked workers share most of their
    pages with the parent and a sum of RSS would count those once per process)."""
    import tempfile

    import psutil

    with tempfile.NamedTemporaryFile("r", suffix=".time") as timing:
        start = time.perf_counter()
        proc = subprocess.Popen(
            ["/usr/bin/time", "-f", "%M %U %S", "-o", timing.name, *cmd],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        peak_tree, watcher = 0, psutil.Process(proc.pid)
        while proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                peak_tree = max(peak_tree, sum(p.memory_full_info().pss for p in watcher.children(recursive=True)))
            time.sleep(poll)
        out, err = proc.communicate()
        seconds = time.perf_counter() - start
        max_kib, user, system = timing.read().strip().splitlines()[-1].split()
    return {
        "seconds": seconds,
        "rc": proc.returncode,
        "stdout": out,
        "stderr": err,
        "peak_tree_mib": peak_tree / 2**20,
        "peak_max_mib": int(max_kib) / 1024,
        "cpu_s": float(user) + float(system),
    }


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def tokenizer(work: Path) -> Path:
    from preprocess.parallel import make_tsv
    from preprocess.tokenizer import train_tokenizer

    tok = work / "bpe8k" / "tokenizer.json"
    if not tok.is_file():
        tsv = work / "multi30k.train.tsv"
        make_tsv(ROOT / "data/multi30k/train.fr.gz", ROOT / "data/multi30k/train.en.gz", tsv)
        train_tokenizer([tsv], tok.parent, vocab_size=8000)
    return tok


def preprocess(tsv: Path, tok: Path, cache: Path, num_proc: int | None) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "preprocess.dataset",
        "--file_path",
        str(tsv),
        "--tokenizer",
        str(tok),
        "--src_len",
        str(LENGTH),
        "--tgt_len",
        str(LENGTH),
        "--cache_dir",
        str(cache),
        "--no_progress",
    ]
    if num_proc is not None:
        cmd += ["--num_proc", str(num_proc)]
    result = run_measured(cmd, env())
    if result["rc"] != 0:
        raise SystemExit(f"preprocessing failed:\n{result['stderr'][-3000:]}")
    return result


def store_figures(tsv: Path, tok: Path, cache: Path) -> dict:
    from preprocess.dataset import TranslationDataset

    data = TranslationDataset(tsv, tok, LENGTH, LENGTH, cache_dir=cache, progress=False)
    stats = data.stats()
    return {
        "pairs": stats["samples"],
        "store_bytes": stats["store_bytes"],
        "real_tokens": stats["real_tokens"],
        "ratio": stats["store_bytes"] / (2 * stats["real_tokens"]),
        "tsv_bytes": tsv.stat().st_size,
        "store": str(data.cache_path),
    }


def _rank_memory(pids: list) -> dict:
    import psutil

    out = {}
    for pid in pids:
        try:
            full = psutil.Process(pid).memory_full_info()
            out[pid] = (full.rss, full.pss)
        except psutil.Error:
            pass
    return out


TOKEN_BATCHES = ["--max_tokens", "4096", "--batch_multiple", "16"]


def _watch_ranks(proc: subprocess.Popen, metrics: Path, start: float) -> tuple[float | None, dict]:
    """Until `proc` ends: when its first step's record appeared (seconds after `start`), and each train.py
    process's peak (RSS, PSS), sampled every 0.25 s."""
    import psutil

    first_step, peaks, main = None, {}, psutil.Process(proc.pid)
    while proc.poll() is None:
        if first_step is None and metrics.is_file() and metrics.stat().st_size > 0:
            first_step = time.perf_counter() - start
        try:
            procs = [
                p
                for p in main.children(recursive=True)
                if "train.py" in " ".join(p.cmdline()) and "deepspeed.launcher" not in " ".join(p.cmdline())
            ]
        except psutil.Error:
            procs = []
        for pid, (rss, pss) in _rank_memory([p.pid for p in procs]).items():
            old = peaks.get(pid, (0, 0))
            peaks[pid] = (max(old[0], rss), max(old[1], pss))
        time.sleep(0.25)
    return first_step, peaks


def train_first_step(tsv: Path, tok: Path, cache: Path, ranks: int, work: Path, extra: tuple = ()) -> dict:
    """Launch train.py on `ranks` ranks (one step) and measure: seconds from the launch to the first step's record
    in metrics.jsonl; `peak_mib` the exact peak RSS of the largest rank (GNU time's %M over the process tree);
    each rank's RSS and PSS, sampled every 0.25 s."""
    import tempfile

    from training.core.distributed import free_port  # not a port near 29500 that another job may hold

    out_dir = work / f"train-{tsv.stem}-{ranks}{'-tokens' if extra else ''}"
    if out_dir.exists():
        shutil.rmtree(out_dir)
    script = str(ROOT / "run_scripts" / "train.py")
    args = [
        "--file_path",
        str(tsv),
        "--tokenizer",
        str(tok),
        "--cache_dir",
        str(cache),
        "--output_dir",
        str(out_dir),
        *TRAIN_FLAGS,
        *extra,
    ]
    cmd = (
        [sys.executable, script]
        if ranks == 1
        else [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            str(ranks),
            "--master_port",
            str(free_port()),
            script,
        ]
    )
    with tempfile.NamedTemporaryFile("r", suffix=".time") as timing:
        start = time.perf_counter()
        proc = subprocess.Popen(
            ["/usr/bin/time", "-f", "%M", "-o", timing.name, *cmd, *args],
            cwd=ROOT,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        first_step, peaks = _watch_ranks(proc, out_dir / "metrics.jsonl", start)
        log = proc.communicate()[0]
        peak_kib = int(timing.read().strip().splitlines()[-1])
    if proc.returncode != 0:
        raise SystemExit(f"train.py on {ranks} rank(s) failed:\n{log[-3000:]}")
    # the ranks: the `ranks` processes with the largest peaks (each rank's supervisor, a fork made before torch is
    # imported, is small)
    top = sorted(peaks.values(), key=lambda v: -v[0])[:ranks]
    return {
        "ranks": ranks,
        "first_step_s": first_step,
        "seconds": time.perf_counter() - start,
        "peak_mib": peak_kib / 1024,
        "rss_mib": [r / 2**20 for r, _ in top],
        "pss_mib": [p / 2**20 for _, p in top],
    }


SCHEDULE_CODE = """
import json, resource, sys, time
import numpy as np
from preprocess.dataset import GlobalBatchSchedule
from preprocess.token_batches import TokenBatchSchedule
if {tsv!r}:
    from preprocess.dataset import TranslationDataset
    data = TranslationDataset({tsv!r}, {tok!r}, {length}, {length}, cache_dir={cache!r}, progress=False)
    n = data.num_samples
    start = time.perf_counter()
    src, tgt = data.real_lengths()
else:
    n = {pairs}
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    src, tgt = rng.integers(2, {length} + 1, n), rng.integers(2, {length} + 1, n)
lengths_s = time.perf_counter() - start
start = time.perf_counter()
fixed = GlobalBatchSchedule(n, 32, 1)
fixed.global_batch(0)
fixed_s = time.perf_counter() - start
start = time.perf_counter()
tokens = TokenBatchSchedule(src, tgt, 4096, 16, 1, {length}, {length})
tokens.global_batch(0)
tokens_s = time.perf_counter() - start
print(json.dumps({{"pairs": n, "lengths_s": lengths_s, "fixed_s": fixed_s, "tokens_s": tokens_s,
                  "token_batches": tokens.batches_per_epoch,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def schedules(tsv: Path | None, tok: Path | None, cache: Path | None, pairs: int = 0) -> dict:
    code = SCHEDULE_CODE.format(
        tsv=str(tsv) if tsv else "",
        tok=str(tok) if tok else "",
        cache=str(cache) if cache else "",
        length=LENGTH,
        pairs=pairs,
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


FORMATS_CODE = """
import json, sys, time, os
import numpy as np
import psutil
def anon():
    full = psutil.Process().memory_full_info()
    return full.uss / 2 ** 20, full.rss / 2 ** 20
kind, folder, arrow_path = sys.argv[1], {store!r}, {arrow!r}
rng = np.random.default_rng(0)
base_uss, base_rss = anon()
start = time.perf_counter()
if kind == "memmap":
    from preprocess.token_store import TokenStore
    store = TokenStore(folder)
    n = store.pairs
    def batch(idx):
        return [store.padded_rows(s, idx, {length}, 0, end=3) for s in ("src", "tgt")]
else:
    import pyarrow as pa
    source = pa.memory_map(arrow_path)
    table = pa.ipc.open_file(source).read_all()
    n = table.num_rows
    def pad(column, idx):
        taken = column.take(pa.array(idx)).combine_chunks()
        offsets = taken.offsets.to_numpy()
        values = taken.values.to_numpy()
        lengths = np.diff(offsets)
        out = np.zeros((len(idx), {length}), dtype=np.int64)
        cols = np.arange({length} - 1)
        rows, where = np.nonzero(cols[None, :] < lengths[:, None])
        out[rows, where] = values[offsets[:-1][rows] + where]
        out[np.arange(len(idx)), lengths] = 3
        return out
    def batch(idx):
        return [pad(table.column(s), idx) for s in ("src", "tgt")]
open_s = time.perf_counter() - start
uss, rss = anon()
batches = [rng.integers(0, n, 64) for _ in range(2000)]
start = time.perf_counter()
for idx in batches:
    batch(idx)
batch_ms = (time.perf_counter() - start) / len(batches) * 1e3
print(json.dumps({{"open_s": open_s, "uss_growth_mib": uss - base_uss, "rss_growth_mib": rss - base_rss,
                  "batch_ms": batch_ms}}))
"""


def formats(store_folder: str, work: Path) -> dict:
    """The store's ids as an Arrow file (written once), then each format opened and batched in a fresh process."""
    import pyarrow as pa

    from preprocess.token_store import TokenStore

    arrow = work / "formats.arrow"
    store = TokenStore(Path(store_folder))
    if not arrow.is_file():
        arrays = [
            pa.LargeListArray.from_arrays(pa.array(np.asarray(store.offsets[s])), pa.array(np.asarray(store.tokens[s])))
            for s in ("src", "tgt")
        ]
        table = pa.table({"src": arrays[0], "tgt": arrays[1]})
        with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=1 << 20)
    out = {
        "memmap_bytes": sum(store.offsets[s].nbytes + store.tokens[s].nbytes for s in ("src", "tgt")),
        "arrow_bytes": arrow.stat().st_size,
    }
    for kind in ("memmap", "arrow"):
        code = FORMATS_CODE.format(store=store_folder, arrow=str(arrow), length=LENGTH)
        proc = subprocess.run([sys.executable, "-c", code, kind], cwd=ROOT, env=env(), capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        out[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def machine() -> str:
    from benchmarks.harness import cpu_model

    cpu = cpu_model(platform.processor() or platform.machine())
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def report(results: dict) -> str:
    rows = results["sizes"]
    lines = [
        BEGIN,
        "## Corpus-scale data: preprocessing, store, start-up and memory per rank",
        "",
        f"{results['date']}, {results['machine']}; synthetic corpora of Multi30k train pairs joined 1-3 at a "
        f"time (fixed seed), src_len = tgt_len = {LENGTH}, joint BPE 8k; `python -m preprocess.dataset` with "
        f"its default --num_proc ({results['num_proc']}); train.py: d_model 128, batch 32, one step, the store "
        f"already built; RSS counts the store's mapped pages a rank touched, PSS splits shared pages between the "
        f"processes that map them (node total = the sum of the ranks' PSS).",
        "",
        "| pairs | TSV | preprocess: wall (CPU) | pairs/s | peak RSS: largest process / PSS of all | store | "
        "store ÷ (real tokens × 2 B) |",
        "|---|---|---|---|---|---|---|",
    ]
    return lines + _preprocess_rows(rows) + _train_table(rows) + _schedule_table(results, rows) + _rest(results, rows)


def _preprocess_rows(rows: list) -> list[str]:
    lines = []
    for r in rows:
        p, s = r["preprocess"], r["store"]
        lines.append(
            f"| {size_name(s['pairs'])} | {s['tsv_bytes'] / 1e6:,.0f} MB | {p['seconds']:.0f} s ({p['cpu_s']:.0f} s) | "
            f"{s['pairs'] / p['seconds']:,.0f} | {p['peak_max_mib']:,.0f} / {p['peak_tree_mib']:,.0f} MiB | "
            f"{s['store_bytes'] / 1e6:,.0f} MB | {s['ratio']:.2f} |"
        )
    return lines


def _train_table(rows: list) -> list[str]:
    lines = [
        "",
        "train.py, the store already built, one step: time from the launch to the first step's record; peak "
        "RSS exact (getrusage: the largest rank); RSS and PSS per rank sampled every 0.25 s.",
        "",
        "| pairs | 1 rank: first step | peak RSS | 1 rank, --max_tokens 4096: peak RSS | 2 ranks: first step | "
        "peak RSS (larger rank) | RSS / PSS per rank | node total PSS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r.get("train")
        if not t:
            continue
        one, two, tokens = t["1"], t["2"], t["1-tokens"]
        lines.append(
            f"| {size_name(r['pairs'])} | {one['first_step_s']:.1f} s | {one['peak_mib']:,.0f} MiB | "
            f"{tokens['peak_mib']:,.0f} MiB | {two['first_step_s']:.1f} s | {two['peak_mib']:,.0f} MiB | "
            f"{' + '.join(f'{a:,.0f} / {b:,.0f}' for a, b in zip(two['rss_mib'], two['pss_mib']))} MiB | "
            f"{sum(two['pss_mib']):,.0f} MiB |"
        )
    return lines


def _schedule_table(results: dict, rows: list) -> list[str]:
    lines = [
        "",
        "Schedules (a fresh process each; fixed: the epoch's permutation and batch 0; token batches: "
        "--max_tokens 4096, batch_multiple 16, over the store's real lengths; peak RSS of the process):",
        "",
        "| pairs | real lengths (from the store's offsets; synthetic: drawn) | fixed schedule | token-batch "
        "schedule | token batches | peak RSS |",
        "|---|---|---|---|---|---|",
    ]
    for r in [*rows, {"schedule": results.get("schedule_10m")}]:
        sc = r.get("schedule")
        if not sc:
            continue
        lines.append(
            f"| {size_name(sc['pairs'])}{'' if 'store' in r else ' (synthetic lengths)'} | "
            f"{sc['lengths_s']:.2f} s | {sc['fixed_s']:.2f} s | {sc['tokens_s']:.2f} s | "
            f"{sc['token_batches']:,} | {sc['peak_mib']:,.0f} MiB |"
        )
    return lines


def _rest(results: dict, rows: list) -> list[str]:
    """The store formats compared, the machine's load, the commands and notes, the end marker."""
    lines = []
    f = results.get("formats")
    if f:
        lines += [
            "",
            f"### Token store format: numpy memmap vs Arrow ({size_name(f['pairs'])} pairs)",
            "",
            "The same ids and offsets, opened in a fresh process; 2,000 padded batches of 64 random pairs "
            f"({LENGTH} positions, both sides).",
            "",
            "| format | bytes on disk (ids + offsets) | open | private memory after open | per batch |",
            "|---|---|---|---|---|",
        ]
        for kind, size in (("memmap", f["memmap_bytes"]), ("arrow", f["arrow_bytes"])):
            m = f[kind]
            lines.append(
                f"| {'numpy memmap' if kind == 'memmap' else 'Arrow IPC file, memory-mapped'} | "
                f"{size / 1e6:,.1f} MB | {m['open_s'] * 1e3:.1f} ms | {m['uss_growth_mib']:+.1f} MiB | "
                f"{m['batch_ms']:.3f} ms |"
            )
    loads = ", ".join(
        f"{size_name(r['pairs'])}: {r['load_before']:.1f} → {r['load_after']:.1f} (then "
        f"{r['load_rest'][0]:.1f} → {r['load_rest'][1]:.1f})"
        for r in rows
    )
    lines += [
        "",
        f"The machine was shared with other work: 1-minute load average before → after each size's "
        f"preprocessing (then its train.py runs and schedules): {loads} (2 cores; above 2, wall times include "
        f"waiting for a core — CPU time does not).",
        "",
    ]
    lines += ["```", *results["commands"], "```", ""]
    lines += results.get("notes", [])
    lines.append(END)
    return "\n".join(lines)


def write_report(text: str) -> None:
    old = REPORT.read_text(encoding="utf-8")
    if BEGIN in old and END in old:
        new = old[: old.index(BEGIN)] + text + old[old.index(END) + len(END) :]
    else:
        new = old.rstrip() + "\n\n" + text + "\n"
    REPORT.write_text(new, encoding="utf-8")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=str(ROOT / "out" / "data_scale"), help="corpora, stores, runs (delete after)")
    p.add_argument("--sizes", nargs="+", default=["0.1M", "1M", "4.5M"], help="corpus sizes in pairs (0.1M, 1M, ...)")
    p.add_argument("--num_proc", type=int, default=None, help="preprocess.dataset --num_proc (default: its own)")
    p.add_argument("--formats", default="1M", help="compare memmap and Arrow on this size's store ('' : skip)")
    p.add_argument("--schedule_pairs", default="10M", help="also build schedules over this many synthetic lengths")
    p.add_argument("--skip_train", action="store_true", help="leave out the train.py runs")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="keep the preprocessing figures of --work's results.json where its store still exists "
        "(re-measure the rest without another cold build)",
    )
    p.add_argument("--report", action="store_true", help="write the tables into BENCHMARKS.md")
    p.add_argument("--report_only", action="store_true", help="only write --work's results.json into BENCHMARKS.md")
    args = p.parse_args()
    if args.report_only:
        write_report(report(json.loads((Path(args.work) / "results.json").read_text())))
        return 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    from preprocess.store_builder import default_num_proc

    results = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "sizes": [],
        "num_proc": args.num_proc or default_num_proc(),
        "commands": ["python -m benchmarks.data_scale " + " ".join(sys.argv[1:])],
    }
    tok = tokenizer(work)
    saved = work / "results.json"
    earlier = json.loads(saved.read_text()) if args.reuse and saved.is_file() else {"sizes": []}
    previous = {r["pairs"]: r for r in earlier["sizes"]}
    if previous:  # the preprocessing figures come from the earlier run's command
        results["commands"] = [*earlier.get("commands", [earlier.get("command")])[:1], *results["commands"]]
    for size in args.sizes:
        pairs = parse_size(size)
        print(f"== {size_name(pairs)} pairs", flush=True)
        tsv = make_corpus(pairs, work / f"corpus-{size}.tsv")
        before = previous.get(pairs)
        if args.reuse and before and Path(before["store"]["store"]).is_dir():
            row = {key: before[key] for key in ("pairs", "load_before", "load_after", "preprocess", "store")}
        else:
            shutil.rmtree(cache / size, ignore_errors=True)  # a cold build, every time
            row = {
                "pairs": pairs,
                "load_before": os.getloadavg()[0],
                "preprocess": preprocess(tsv, tok, cache / size, args.num_proc),
            }
            row["preprocess"].pop("stdout"), row["preprocess"].pop("stderr")
            row["store"] = store_figures(tsv, tok, cache / size)
            row["load_after"] = os.getloadavg()[0]
        row["load_rest"] = [os.getloadavg()[0]]
        print(json.dumps(row), flush=True)
        if not args.skip_train:
            row["train"] = {str(n): train_first_step(tsv, tok, cache / size, n, work) for n in (1, 2)}
            row["train"]["1-tokens"] = train_first_step(tsv, tok, cache / size, 1, work, tuple(TOKEN_BATCHES))
            print(json.dumps(row["train"]), flush=True)
        row["schedule"] = schedules(tsv, tok, cache / size)
        print(json.dumps(row["schedule"]), flush=True)
        if args.formats and parse_size(args.formats) == pairs:
            results["formats"] = {"pairs": pairs, **formats(row["store"]["store"], work)}
            print(json.dumps(results["formats"]), flush=True)
        row["load_rest"].append(os.getloadavg()[0])
        results["sizes"].append(row)
    if args.schedule_pairs:
        results["schedule_10m"] = schedules(None, None, None, parse_size(args.schedule_pairs))
        print(json.dumps(results["schedule_10m"]), flush=True)
    (work / "results.json").write_text(json.dumps(results, indent=1))
    if args.report:
        write_report(report(results))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
