"""Where a training step's time goes, read from a torch.profiler trace: device kernels by kind, the device's idle
share, kernel launches and host synchronizations per step — and on a machine without a GPU, the host's operators by
kind. `profile_steps` records a few steps and writes the Chrome trace (open it in https://ui.perfetto.dev);
`summarize_trace` reads any Kineto Chrome trace, so a test can feed it a GPU-shaped one."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter, defaultdict

STEP_MARK = "gpu_step.step"  # the record_function around each profiled step

# Kernel and operator names by kind, first match wins. cuBLAS names its GEMMs sm90_xmma_*, nvjet_*, cutlass_*;
# flash / memory-efficient attention kernels say flash or fmha; torch's fused AdamW runs in multi_tensor_apply.
KINDS = [
    ("communication", re.compile(r"nccl|gloo|c10d::|record_param_comms", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|optimizer", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|aten::(addmm|mm|bmm|baddbmm)$|triton_tem", re.I)),
]
LAUNCH = re.compile(
    r"^(cuda|cu)(LaunchKernel|LaunchKernelEx|LaunchKernelExC|LaunchCooperativeKernel|GraphLaunch)"
    r"(_v\d+)?$"
)
SYNC = re.compile(
    r"^(cuda|cu)(DeviceSynchronize|StreamSynchronize|EventSynchronize|Memcpy|MemcpyDtoH|Ctx"
    r"Synchronize)(_v\d+)?$"
)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)["traceEvents"]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def _self_times(ops: list[dict]) -> dict[str, float]:
    """Each host operator's own time (its duration less its children's), per thread by nesting."""
    own: dict[str, float] = defaultdict(float)
    by_thread = defaultdict(list)
    for e in ops:
        by_thread[(e["pid"], e["tid"])].append(e)
    for events in by_thread.values():
        stack: list[tuple[float, str]] = []  # (end, name) of the enclosing operators
        for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1][0] <= e["ts"]:
                stack.pop()
            if stack:  # a child's time is not its parent's own
                own[stack[-1][1]] -= e["dur"]
            own[e["name"]] += e["dur"]
            stack.append((e["ts"] + e["dur"], e["name"]))
    return own


def summarize_trace(events: list[dict], top: int = 8) -> dict:
    """Per-step figures of the steps marked STEP_MARK in a Kineto trace's events (times in ms)."""
    steps = [
        e for e in events if e.get("ph") == "X" and e.get("name") == STEP_MARK and e.get("cat") == "user_annotation"
    ]
    if not steps:
        raise ValueError(f"no {STEP_MARK!r} annotations in the trace")
    n = len(steps)
    first, last = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    inside = [e for e in events if e.get("ph") == "X" and first <= e["ts"] <= last]
    kernels = [e for e in inside if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    runtime = [e for e in inside if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    wall_us = sum(e["dur"] for e in steps)
    out = {"steps": n, "step_ms": wall_us / n / 1e3}
    if kernels:
        by_kind: dict[str, float] = defaultdict(float)
        by_name: Counter = Counter()
        for e in kernels:
            kind = "memory copy/set" if e["cat"] != "kernel" else kind_of(e["name"])
            by_kind[kind] += e["dur"]
            by_name[e["name"][:120]] += e["dur"]
        busy = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
        out["device"] = {
            "busy_ms": busy / n / 1e3,
            "idle_share": max(0.0, 1 - busy / (last - first)),
            "kernels": sum(e["cat"] == "kernel" for e in kernels) / n,
            "ms_by_kind": {k: v / n / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [(name, us / n / 1e3) for name, us in by_name.most_common(top)],
            "device_to_host_copies": sum("DtoH" in e["name"] for e in kernels) / n,
        }
    out["launches"] = sum(bool(LAUNCH.match(e["name"])) for e in runtime) / n
    # the same count without names: host calls whose correlation id a kernel carries (a runtime call that a CUPTI
    # older than the CUDA release names "INVALID" still counts here)
    launched = {e.get("args", {}).get("correlation") for e in kernels if e["cat"] == "kernel"} - {None}
    if launched:
        out["launches_by_correlation"] = sum(e.get("args", {}).get("correlation") in launched for e in runtime) / n
    syncs = Counter(e["name"] for e in runtime if SYNC.match(e["name"]))
    out["host_syncs"] = {name: count / n for name, count in sorted(syncs.items())}
    ops = [e for e in inside if e.get("cat") == "cpu_op"]
    own = _self_times(ops)
    # the thread that ran the steps, and the others: on CUDA, autograd runs backward on a device thread of its own
    main = {(e["pid"], e["tid"]) for e in steps}
    in_main = sum(_self_times([e for e in ops if (e["pid"], e["tid"]) in main]).values())
    out["host_outside_ops_ms"] = max(0.0, wall_us - in_main) / n / 1e3
    out["host_other_threads_ops_ms"] = (sum(own.values()) - in_main) / n / 1e3
    host_kind: dict[str, float] = defaultdict(float)
    for name, us in own.items():
        host_kind[kind_of(name)] += us
    out["host_ops_ms_by_kind"] = {k: v / n / 1e3 for k, v in sorted(host_kind.items(), key=lambda kv: -kv[1])}
    out["top_host_ops_ms"] = [(name, us / n / 1e3) for name, us in sorted(own.items(), key=lambda kv: -kv[1])[:top]]
    return out


def profile_steps(step_fn, steps: int, trace_path: str, cuda: bool) -> dict:
    """Run `step_fn(i)` for i in range(steps) under torch.profiler; write the Chrome trace; its summary. On CUDA
    each step ends in a torch.cuda.synchronize() of this function's (so the step's kernels fall inside its mark):
    that one cudaDeviceSynchronize a step is taken out of the host syncs counted."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for i in range(steps):
            with record_function(STEP_MARK):
                step_fn(i)
                if cuda:
                    torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    summary = summarize_trace(_load(trace_path))
    summary["cuda"] = cuda
    if cuda:
        syncs = summary["host_syncs"]
        syncs["cudaDeviceSynchronize"] = syncs.get("cudaDeviceSynchronize", 1) - 1
        if syncs["cudaDeviceSynchronize"] <= 0:
            del syncs["cudaDeviceSynchronize"]
    return summary


def describe(summary: dict) -> list[str]:
    """The summary as lines a person reads."""

    def kinds(d):
        return ", ".join(f"{k} {v:.1f}" for k, v in d.items() if v >= 0.05) or "-"

    lines = [f"profiled {summary['steps']} steps: {summary['step_ms']:.1f} ms a step"]
    dev = summary.get("device")
    if dev:
        lines.append(
            f"  device busy {dev['busy_ms']:.1f} ms a step (idle {100 * dev['idle_share']:.0f} %): "
            f"{kinds(dev['ms_by_kind'])} ms; {dev['kernels']:.0f} kernels"
        )
        lines += [f"    {ms:8.2f} ms  {name}" for name, ms in dev["top_kernels_ms"]]
    syncs = ", ".join(f"{name} {count:g}" for name, count in summary["host_syncs"].items()) or "none"
    if dev:
        by_id = summary.get("launches_by_correlation")
        other = f" ({by_id:.0f} by correlation id)" if by_id is not None and by_id != summary["launches"] else ""
        lines.append(
            f"  host: {summary['launches']:.0f} kernel launches a step{other}; synchronizing calls a step: "
            f"{syncs}; device→host copies {dev['device_to_host_copies']:g}"
        )
    elif summary.get("cuda"):
        lines.append(
            "  a CUDA run with no kernel events recorded: the trace is incomplete (CUPTI lost them; CUDA "
            "graphs captured before profiling do this) — do not read it as an idle device"
        )
    else:
        lines.append("  no device activity in this profile (a CPU run): the host's operators are the step")
    lines.append(
        f"  host operators' own time: {kinds(summary['host_ops_ms_by_kind'])} ms; the stepping thread "
        f"outside operators {summary['host_outside_ops_ms']:.1f} ms a step (Python, DeepSpeed, data"
        + (", waiting for backward" if summary["host_other_threads_ops_ms"] > 0 else "")
        + "); "
        f"other threads' operators {summary['host_other_threads_ops_ms']:.1f} ms (autograd's device thread "
        "runs backward on CUDA)"
    )
    lines += [f"    {ms:8.2f} ms  {name}" for name, ms in summary["top_host_ops_ms"]]
    return lines
