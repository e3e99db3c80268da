"""The batch plan.py sizes a token-batch run at (`--max_tokens`): the largest batch a step can hold, not --batch_size.

With token batches train.py ignores --batch_size for training (it only sizes validation batches), so planning at it
(the default 32 pairs) predicted 2.9 GiB for transformer-big where its own batches need about 20 GiB — and advised
raising --batch_size, which changes nothing. A token batch holds pairs × padded length <= max_tokens on each side,
in groups of batch_multiple pairs (preprocess/token_batches.py); at full length (src_len / tgt_len, the fixed width
padding never exceeds) that is the fewest pairs but the most memory and time a step can need — attention grows with
the length, everything else with the tokens — so that is the batch planned. A --batch_size given on the command line
is planned as given (a user asking "what if"), and the plan says which one it used.
"""

from __future__ import annotations

from training.config.sections import TrainConfig


def budget_pairs(cfg: TrainConfig) -> int:
    """Pairs of the largest token batch: max_tokens over the longer side's full length, in whole batch_multiple
    groups (at least one: a batch always holds one group)."""
    d = cfg.data
    longest = max(cfg.model.src_len, cfg.model.tgt_len)
    return max(d.batch_multiple, d.max_tokens // longest // d.batch_multiple * d.batch_multiple)


def planning_batch(cfg: TrainConfig, batch_size_given: bool) -> tuple[TrainConfig, dict | None]:
    """(the configuration to plan with, what the plan says about its batch: None without token batches)."""
    d = cfg.data
    if not d.max_tokens:
        return cfg, None
    pairs = budget_pairs(cfg)
    longest = max(cfg.model.src_len, cfg.model.tgt_len)
    note = {
        "max_tokens": d.max_tokens,
        "longest": longest,
        "batch_multiple": d.batch_multiple,
        "budget_pairs": pairs,
        "planned_pairs": d.batch_size if batch_size_given else pairs,
        "source": "--batch_size" if batch_size_given else "max_tokens",
    }
    return (cfg if batch_size_given else cfg.with_flags(batch_size=pairs)), note


def describe(note: dict) -> str:
    """The report's line under the batch arithmetic."""
    budget = (
        f"--max_tokens {note['max_tokens']:,} / {note['longest']} tokens (the longer side at full length), in "
        f"groups of --batch_multiple {note['batch_multiple']} = {note['budget_pairs']:,} pairs"
    )
    if note["source"] == "--batch_size":
        return (
            f"token batches: planned at --batch_size {note['planned_pairs']:,} as given; the budget holds at most "
            f"{budget}"
        )
    return f"token batches: planned at the largest batch a step can hold, {budget} (not --batch_size)"


def tokens_for(pairs: int, note: dict) -> int:
    """The --max_tokens that holds `pairs` pairs at full length (what the report names instead of --batch_size)."""
    return pairs * note["longest"]
