"""What `plan.py --search` prints: the result as the `--json` dict, and as text (the ranked table with each layout's
time by term and its memory headroom, the chosen layout beside the recipe's own, rejections by reason, trials)."""

from __future__ import annotations

import statistics
from collections import Counter

from training.plan import memory as mem
from training.plan.layout_prediction import Prediction
from training.plan.layout_search import SearchResult, usable_bytes
from training.plan.search_setting import GIB, Setting

SHOWN = ("compute", "tp", "bubble", "dp", "recompute")  # the table's columns; "other" is the rest


def layout_dict(layout, counts=None) -> dict:
    out = layout.as_dict()
    if counts is not None:
        out["blocks_per_stage"] = list(counts)
    return out


def candidate_dict(setting: Setting, pred: Prediction, factors: dict, rank: int | None = None) -> dict:
    usable = usable_bytes(setting)
    out = {
        "layout": layout_dict(pred.layout, pred.blocks_per_stage),
        "predicted_step_s": pred.seconds(factors),
        "breakdown_s": pred.breakdown(factors),
        "peak_memory_gib": pred.peak_bytes / GIB,
        "memory_headroom_gib": (usable - pred.peak_bytes) / GIB,
        "stage_peak_memory_gib": [p / GIB for p in pred.stage_peaks],
        "slowest_stage": pred.slowest_stage,
    }
    return {"rank": rank, **out} if rank is not None else out


def own_dict(setting: Setting, result: SearchResult) -> dict:
    own = result.recipe_own
    out = {"layout": layout_dict(own["layout"]), "runs": own["runs"], "reason": own.get("reason")}
    if own.get("prediction") is not None:
        out.update(
            {k: v for k, v in candidate_dict(setting, own["prediction"], result.factors).items() if k != "layout"}
        )
    return out


def result_dict(setting: Setting, result: SearchResult, info: dict) -> dict:
    """The --json object: search (what was searched and how), candidates, rejected, chosen (with the recipe's own
    layout and the predicted gain over it); the caller adds trials and calibration."""
    f = result.factors
    cands = [candidate_dict(setting, p, f, i + 1) for i, p in enumerate(result.candidates)]
    own = own_dict(setting, result)
    chosen = dict(cands[0]) if cands else None
    if chosen is not None:
        chosen["recipe_layout"] = own
        chosen["predicted_gain"] = (
            own["predicted_step_s"] / chosen["predicted_step_s"] if own.get("predicted_step_s") else None
        )
    search = {
        **info,
        "world_size": setting.world,
        "device": setting.device,
        "memory": setting.memory_name,
        "usable_memory_gib": usable_bytes(setting) / GIB,
        "precision": setting.precision,
        "global_batch": setting.batch,
        "vocab_size": setting.model.vocab_size,
        "vocab_source": setting.vocab_source,
        "considered": result.considered,
        "candidates": len(cands),
        "rejected": len(result.rejected),
        "rejected_by_kind": dict(Counter(r["kind"] for r in result.rejected)),
        "seconds": result.seconds,
        "cpu_seconds": result.cpu_seconds,
        "factors": f,
    }
    rejected = [
        {"layout": layout_dict(r["layout"], r.get("blocks_per_stage")), "reason": r["reason"], "kind": r["kind"]}
        for r in result.rejected
    ]
    return {"search": search, "candidates": cands, "rejected": rejected, "chosen": chosen}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def _table(out: dict, top: int) -> list[str]:
    head = (
        f"  {'rank':>4} {'step ms':>9} " + " ".join(f"{c:>9}" for c in SHOWN) + f" {'other':>8}"
        f" {'peak GiB':>9} {'headroom':>9}  layout"
    )
    lines = [head]
    for c in out["candidates"][:top]:
        b = c["breakdown_s"]
        other = sum(v for k, v in b.items() if k not in SHOWN)
        lines.append(
            f"  {c['rank']:>4} {_ms(c['predicted_step_s']):>9} "
            + " ".join(f"{_ms(b[k]):>9}" for k in SHOWN)
            + f" {_ms(other):>8} {c['peak_memory_gib']:>9.2f} {c['memory_headroom_gib']:>9.2f}  "
            + short(c["layout"])
        )
    return lines


def short(layout: dict) -> str:
    from training.plan.layout_space import Layout

    fields = {k: v for k, v in layout.items() if k != "blocks_per_stage"}
    text = Layout(**fields).short()
    if layout.get("pipeline_stage", 1) > 1 and "blocks:" not in text and layout.get("blocks_per_stage"):
        text += f" (blocks {'/'.join(str(n) for n in layout['blocks_per_stage'])})"
    return text


def _rejections(out: dict, examples: int = 2) -> list[str]:
    rej = out["rejected"]
    if not rej:
        return ["rejected: none"]
    lines = [f"rejected: {len(rej)} layouts (every one with its reason in --json)"]
    by_kind: dict[str, list] = {}
    for r in rej:
        by_kind.setdefault(r["kind"], []).append(r)
    names = {
        "memory": "need more memory than the device has",
        "rules": "break the layout rules (train.py would refuse them)",
        "deepspeed": "are refused by DeepSpeed",
        "nodes": "put a tensor-parallel group across nodes",
    }
    for kind, items in sorted(by_kind.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"  {len(items):>6} {names.get(kind, kind)}, e.g.")
        lines += [f"           {short(r['layout'])}: {r['reason']}" for r in items[:examples]]
    return lines


def format_search(out: dict, top: int) -> str:
    s = out["search"]
    lines = [
        f"search: {s['world_size']} ranks, {s['memory']} ({s['usable_memory_gib']:.3g} GiB usable a rank: "
        f"{mem.USABLE:.0%}), {s['precision']}, global batch {s['global_batch']}, vocabulary "
        f"{s['vocab_size']} ({s['vocab_source']})"
    ]
    if s.get("token_budget"):
        from training.plan.token_budget import describe

        lines.append(f"  {describe(s['token_budget'])}")
    lines.append(
        f"  considered {s['considered']:,} layouts in {s['seconds']:.2f} s ({s['cpu_seconds']:.2f} s of CPU): "
        f"{s['candidates']:,} ranked, "
        f"{s['rejected']:,} rejected; step model factors {s['factors_source']} (docs/layout-search.md)"
    )
    if s.get("device_choice", "--device") != "--device":
        lines.append(f"  device {s['device']}: {s['device_choice']}")
    if not out["candidates"]:
        return "\n".join(lines + ["no layout fits: every one is rejected below", ""] + _rejections(out))
    lines += [
        "",
        f"ranked by predicted step time (ms; top {min(top, len(out['candidates']))} of "
        f"{len(out['candidates'])}; prediction, not measurement):",
    ] + _table(out, top)
    lines += ["", *_chosen_lines(out), ""] + _rejections(out)
    if out.get("trials"):
        lines += ["", *trial_lines(out)]
    if out.get("recipe_written"):
        w = out["recipe_written"]
        lines += ["", f"recipe written: {w['json']} and {w['run_sh']}  (launch: {w['launch']})"]
    return "\n".join(lines)


def _chosen_lines(out: dict) -> list[str]:
    c, own = out["chosen"], out["chosen"]["recipe_layout"]
    lines = [
        f"chosen: {short(c['layout'])} — {_ms(c['predicted_step_s'])} ms a step predicted, peak "
        f"{c['peak_memory_gib']:.2f} GiB ({c['memory_headroom_gib']:.2f} GiB headroom)"
    ]
    if own.get("predicted_step_s") and own["runs"]:
        lines.append(
            f"  the recipe's own layout {short(own['layout'])}: {_ms(own['predicted_step_s'])} ms → the "
            f"chosen one is {c['predicted_gain']:.2f}× as fast (predicted)"
        )
    else:
        lines.append(f"  the recipe's own layout {short(own['layout'])} cannot run here: {own['reason']}")
    return lines


def trial_lines(out: dict) -> list[str]:
    cal = out.get("calibration", {})
    lines = [
        f"trials: {len(out['trials'])} run for {cal.get('trial_steps')} steps each on {cal.get('where')} "
        f"({cal.get('trial_wall_s', 0):.0f} s in all); step times in ms, the first "
        f"{cal.get('warmup_steps')} steps of each left out",
        f"  {'predicted':>9} {'measured':>9} {'calibrated':>10} {'leave-one-out':>13} {'error':>7}  layout",
    ]
    for t in out["trials"]:
        if t.get("error"):
            lines.append(f"  {_ms(t['predicted_step_s']):>9} {'failed':>9}  {short(t['layout'])}: {t['error']}")
            continue
        loo = t.get("loo_predicted_step_s")
        err = f"{t['loo_error']:+.0%}" if t.get("loo_error") is not None else "—"
        lines.append(
            f"  {_ms(t['predicted_step_s']):>9} {_ms(t['measured_step_s']):>9} "
            f"{_ms(t['calibrated_step_s']):>10} {(_ms(loo) if loo else '—'):>13} {err:>7}  "
            f"{short(t['layout'])}"
        )
    if any(t.get("error") for t in out["trials"]):
        lines.append(f"  the trials' recipes, runs and logs are kept in {cal.get('trial_dir')}")
    errors = [abs(t["loo_error"]) for t in out["trials"] if t.get("loo_error") is not None]
    if errors:
        lines.append(
            f"  median leave-one-out error {statistics.median(errors):.1%} (each trial predicted from "
            f"factors fitted on the others)"
        )
    factors = ", ".join(f"{k} {v:.3g}" for k, v in cal.get("factors", {}).items())
    lines.append(f"  calibrated factors: {factors}" + (f"; saved to {cal['file']}" if cal.get("file") else ""))
    return lines
