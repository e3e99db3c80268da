"""Token batches (--max_tokens): pure functions over the real Multi30k lengths, then train.py's checks.
Parity of token batches under dp, tp and pp (dynamic shapes) against one process: tests/test_parity.py."""

import json

import numpy as np
import pytest

from common.errors import UserError
from preprocess.token_batches import TokenBatchSchedule, length_buckets, padded_length, snap
from tests.launch import TINY, losses, run_train

SRC_LEN = TGT_LEN = 32


@pytest.fixture(scope="module")
def lengths(multi30k_dataset_factory):
    data = multi30k_dataset_factory(SRC_LEN, TGT_LEN)
    return data, *data.real_lengths()


def test_padded_length_rounds_up_and_caps():
    assert padded_length(np.array([1, 8, 9, 31, 32]), 8, 30).tolist() == [8, 8, 16, 30, 30]


@pytest.mark.parametrize("max_tokens,multiple", [(2048, 16), (1000, 8), (4096, 48)])
def test_batches_fit_the_budget_cover_each_pair_once_and_pad_little(lengths, max_tokens, multiple):
    data, src, tgt = lengths
    sched = TokenBatchSchedule(src, tgt, max_tokens, multiple, seed=3, src_len=SRC_LEN, tgt_len=TGT_LEN)
    seen, real, positions = [], 0, 0
    for step in range(sched.batches_per_epoch):
        idx = sched.global_batch(step)
        s, t = sched.shape(step)
        assert len(idx) % multiple == 0 and len(idx) * max(s, t) <= max_tokens
        assert s % 8 == 0 or s == SRC_LEN
        assert src[idx].max() <= s and tgt[idx].max() <= t  # nothing real is cut off
        full = data.batch(idx)  # padded to the dataset's lengths
        assert (full["src_ids"][:, s:] == data.pad_id).all() and (full["labels"][:, t:] == data.pad_id).all()
        seen.append(idx)
        real += int(src[idx].sum() + tgt[idx].sum())
        positions += len(idx) * (s + t)
    seen = np.concatenate(seen)
    assert len(np.unique(seen)) == len(seen)  # each pair at most once an epoch
    assert len(seen) > len(src) - sched.batches_per_epoch * multiple  # only a remainder is left out
    fixed = 1 - (src.sum() + tgt.sum()) / (len(src) * (SRC_LEN + TGT_LEN))
    padding = 1 - real / positions
    print(
        f"max_tokens {max_tokens} ×{multiple}: {sched.batches_per_epoch} batches, padding {padding:.1%} "
        f"(fixed length {SRC_LEN}: {fixed:.1%})"
    )
    assert padding < fixed / 2


def reference_batches(src, tgt, max_tokens, multiple, seed, src_len, tgt_len, pad_multiple):
    """The packing rule written plainly (a pair at a time, as the schedule was first written): sort by (padded
    target, padded source, a seeded tie), then let a batch take groups of `multiple` pairs while pairs × longest
    padded side stays within max_tokens."""
    s_pad, t_pad = padded_length(src, pad_multiple, src_len), padded_length(tgt, pad_multiple, tgt_len)
    tie = np.random.default_rng([seed, 2**31]).permutation(len(src))
    order = np.lexsort((tie, s_pad, t_pad))
    end_all = len(order) // multiple * multiple
    batches, start = [], 0
    while start < end_all:
        end, s_max, t_max = start, 0, 0
        while end < end_all:
            group = order[end : end + multiple]
            s_new, t_new = max(s_max, int(s_pad[group].max())), max(t_max, int(t_pad[group].max()))
            if end > start and (end + multiple - start) * max(s_new, t_new) > max_tokens:
                break
            end, s_max, t_max = end + multiple, s_new, t_new
        batches.append((order[start:end], (s_max, t_max)))
        start = end
    return batches


@pytest.mark.parametrize("max_tokens,multiple,pad", [(2048, 16, 8), (1000, 8, 8), (300, 1, 3), (4096, 48, 1)])
def test_vectorised_schedule_equals_the_plain_packing_rule(lengths, max_tokens, multiple, pad):
    """The schedule is built with a radix sort and a loop over groups (10 M pairs in seconds); its batches, their
    order and their shapes are exactly the plain rule's (which checkpoints' data order was made with)."""
    _, src, tgt = lengths
    sched = TokenBatchSchedule(src, tgt, max_tokens, multiple, 9, SRC_LEN, TGT_LEN, pad)
    want = reference_batches(src, tgt, max_tokens, multiple, 9, SRC_LEN, TGT_LEN, pad)
    assert sched.batches_per_epoch == len(want)
    epoch = np.random.default_rng([9, 0]).permutation(len(want))
    for step in range(len(want)):
        idx, shape = want[epoch[step]]
        assert np.array_equal(sched.global_batch(step), idx) and sched.shape(step) == shape, step


def test_same_batches_every_epoch_in_a_new_order_and_a_pure_function_of_the_step(lengths):
    _, src, tgt = lengths

    def make(seed):
        return TokenBatchSchedule(src, tgt, 2048, 16, seed, SRC_LEN, TGT_LEN)

    a, b = make(5), make(5)
    n = a.batches_per_epoch
    epoch0 = {tuple(a.global_batch(k)) for k in range(n)}
    epoch1 = {tuple(a.global_batch(n + k)) for k in range(n)}
    assert epoch0 == epoch1  # fixed batches...
    assert [tuple(a.global_batch(k)) for k in range(5)] != [tuple(a.global_batch(n + k)) for k in range(5)]
    for step in (7, 3, 2 * n + 1, 0):  # ...and any step, in any order, alike
        assert np.array_equal(a.global_batch(step), b.global_batch(step)) and a.shape(step) == b.shape(step)
    assert [tuple(make(6).global_batch(k)) for k in range(3)] != [tuple(a.global_batch(k)) for k in range(3)]


def test_budget_too_small_for_one_group_is_a_user_error(lengths):
    _, src, tgt = lengths
    with pytest.raises(UserError, match=r"--max_tokens 100 cannot hold batch_multiple 16 pairs .* at least 512"):
        TokenBatchSchedule(src, tgt, 100, 16, 1, SRC_LEN, TGT_LEN)


@pytest.mark.parametrize(
    "flags,nproc,needle",
    [
        (
            ["--max_tokens", "512", "--batch_multiple", "6"],
            2,
            "batch_multiple=6 is not divisible by data_parallel×micro_batch_num = 2×2 = 4",
        ),
        (["--max_tokens", "64"], 1, "--max_tokens 64 cannot hold batch_multiple 16 pairs"),
    ],
)
def test_bad_token_batch_flags_fail_fast(flags, nproc, needle, multi30k_tsv, bpe_tokenizer, tmp_path):
    extra = ["--micro_batch_num", "2"] if nproc == 2 else []
    proc = run_train(
        nproc,
        [
            "--file_path",
            multi30k_tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--output_dir",
            tmp_path,
            *TINY,
            *flags,
            *extra,
            "--steps",
            1,
        ],
        check=False,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert needle in proc.stderr, proc.stderr[-2000:]


def test_a_resume_with_other_batching_flags_is_refused_naming_the_saved_ones():
    """The checkpoint's data_order against the resuming run's (training.core.data): any batching flag or the seed
    differing is refused with the flags to pass; the end-to-end refusal: tests/test_checkpoint.py."""
    from argparse import Namespace

    from training.core.data import check_data_order, data_order, legacy_data_order

    def order(**kw):
        flags = dict(max_tokens=2048, batch_multiple=16, pad_multiple=8, seed=1, batch_size=128, num_batch_buckets=0)
        return data_order(Namespace(**{**flags, **kw}))

    saved = order()
    check_data_order(saved, order(batch_size=64), "ckpt")  # batch_size is not part of a token-batch order
    for kw in (
        {"max_tokens": 4096},
        {"batch_multiple": 8},
        {"pad_multiple": 1},
        {"seed": 2},
        {"max_tokens": 0},
        {"num_batch_buckets": 4},
    ):
        with pytest.raises(
            UserError,
            match=r"checkpoint ckpt was trained with token batches max_tokens=2048 "
            r"batch_multiple=16 pad_multiple=8 seed=1; resuming with .* would change "
            r"the data order. Pass --max_tokens 2048 --batch_multiple 16 "
            r"--pad_multiple 8 --seed 1 --num_batch_buckets 0$",
        ):
            check_data_order(saved, order(**kw), "ckpt")
    # buckets are recorded only when on, so checkpoints saved before the flag existed match a run without it
    assert "num_batch_buckets" not in saved and order(num_batch_buckets=4)["num_batch_buckets"] == 4
    with pytest.raises(UserError, match=r"--seed 1 --num_batch_buckets 4$"):
        check_data_order(order(num_batch_buckets=4), saved, "ckpt")
    fixed = order(max_tokens=0)
    assert fixed == {"batching": "fixed", "batch_size": 128, "seed": 1}
    with pytest.raises(UserError, match=r"Pass --batch_size 128 --seed 1 \(and no --max_tokens\)$"):
        check_data_order(fixed, order(max_tokens=0, batch_size=64), "ckpt")
    # checkpoints from before data_order was stored: batch_size and seed, as they were checked then
    legacy = {"batch_size": 128, "seed": 1}
    check_data_order(legacy_data_order(legacy, fixed), fixed, "ckpt")
    check_data_order(legacy_data_order(legacy, saved), saved, "ckpt")
    with pytest.raises(UserError, match="seed=1"):
        check_data_order(legacy_data_order(legacy, order(seed=3)), order(seed=3), "ckpt")


def test_length_buckets_add_the_fewest_pad_positions_of_any_choice():
    """The dynamic program against every choice of at most N lengths (the longest always among them)."""
    import itertools

    rng = np.random.default_rng(1)
    for _ in range(150):
        lengths = rng.integers(1, 12, int(rng.integers(1, 30))) * 8
        n = int(rng.integers(1, 5))
        buckets = length_buckets(lengths, n)
        values = np.unique(lengths)
        assert len(buckets) <= n and buckets[-1] == values[-1] and set(buckets) <= set(values)
        added = (snap(lengths, buckets) - lengths).sum()
        best = min(
            (snap(lengths, np.array(sorted({*others, values[-1]}))) - lengths).sum()
            for r in range(min(n, len(values)))
            for others in itertools.combinations(values[:-1], r)
        )
        assert added == best, (lengths, n, buckets)


def test_bucketed_batches_come_in_few_shapes_and_still_cover_each_pair_once(lengths):
    """--num_batch_buckets N on the real Multi30k lengths: each side's padded lengths are among N values, so the
    batches have fewer distinct shapes; still nothing real is cut and no pair comes twice in an epoch."""
    data, src, tgt = lengths
    plain = TokenBatchSchedule(src, tgt, 1024, 16, 3, SRC_LEN, TGT_LEN, pad_multiple=1)
    shapes = {0: len(plain.stats()["shapes"])}
    for n in (2, 4):
        sched = TokenBatchSchedule(src, tgt, 1024, 16, 3, SRC_LEN, TGT_LEN, pad_multiple=1, num_buckets=n)
        src_b, tgt_b = sched.buckets
        assert len(src_b) <= n and len(tgt_b) <= n
        seen = []
        for step in range(sched.batches_per_epoch):
            idx = sched.global_batch(step)
            s, t = sched.shape(step)
            assert s in src_b and t in tgt_b and len(idx) * max(s, t) <= 1024
            assert src[idx].max() <= s and tgt[idx].max() <= t
            seen.append(idx)
        seen = np.concatenate(seen)
        assert len(np.unique(seen)) == len(seen) and len(seen) > len(src) - sched.batches_per_epoch * 16
        shapes[n] = len(sched.stats()["shapes"])
    print(f"distinct batch shapes, Multi30k, --max_tokens 1024 --pad_multiple 1: {shapes}")
    assert shapes[2] <= 4 < shapes[0] and shapes[4] <= 16 and shapes[4] < shapes[0]
    with pytest.raises(UserError, match="--num_batch_buckets -1 must be >= 0"):
        TokenBatchSchedule(src, tgt, 1024, 16, 3, SRC_LEN, TGT_LEN, num_buckets=-1)


def test_bucketed_token_batches_train_and_a_resume_takes_the_buckets_from_the_checkpoint(
    multi30k_tsv, bpe_tokenizer, tmp_path
):
    """train.py with --num_batch_buckets: the checkpoint records it with the other batching flags, a bare
    --resume takes it (the same losses as the uninterrupted run), and resuming without buckets is refused."""
    base = [
        "--file_path",
        multi30k_tsv,
        "--tokenizer",
        bpe_tokenizer,
        *TINY,
        "--log_interval",
        1,
        "--max_tokens",
        256,
        "--num_batch_buckets",
        2,
    ]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run_train(1, [*base, "--output_dir", full, "--steps", 3])
    run_train(1, [*base, "--output_dir", cut, "--steps", 2, "--save_checkpoint_steps", 2])
    meta = json.loads((cut / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["data_order"]["num_batch_buckets"] == 2
    bare = ["--file_path", multi30k_tsv, "--output_dir", cut, "--resume", "--tensorboard", 0, "--log_interval", 1]
    refused = run_train(1, [*bare, "--steps", 3, "--num_batch_buckets", 0], check=False)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert (
        "Pass --max_tokens 256 --batch_multiple 16 --pad_multiple 8 --seed 7 --num_batch_buckets 2" in refused.stderr
    ), refused.stderr[-2000:]
    resumed = run_train(1, [*bare, "--steps", 3])
    assert "num_batch_buckets=2" in resumed.stdout
    assert losses(cut) == losses(full)
