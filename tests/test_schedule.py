"""Learning-rate schedules against independent references, and their exact continuation after a resume."""
import math

import pytest
import torch

from common.errors import UserError
from tests.launch import TINY, read_metrics, run_many
from training.core.schedule import lr_factor


def torch_factors(scheduler_cls, steps, **kw):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = scheduler_cls(opt, **kw)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_then_constant():
    f = lr_factor("constant", 4, 100)
    assert [f(k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor("constant", 0, 100)(0) == 1.0


def test_inverse_sqrt_is_fairseqs():
    # fairseq: lr = peak · sqrt(warmup) / sqrt(num_updates) after warmup, num_updates counted from 1
    f = lr_factor("inverse_sqrt", 4000, 10 ** 6)
    for k in (3999, 4000, 10_000, 99_999):
        assert math.isclose(f(k), math.sqrt(4000) / math.sqrt(k + 1), rel_tol=1e-12)
    assert f(3999) == 1.0                                 # continuous at the end of warmup


def test_cosine_matches_torch_after_warmup():
    warmup, total = 5, 45
    f = lr_factor("cosine", warmup, total, min_ratio=0.1)
    ref = torch_factors(torch.optim.lr_scheduler.CosineAnnealingLR, total - warmup, T_max=total - warmup, eta_min=0.1)
    assert all(math.isclose(f(warmup + i), r, rel_tol=1e-9, abs_tol=1e-12) for i, r in enumerate(ref))
    assert math.isclose(f(total), 0.1) and math.isclose(f(total + 10), 0.1)


def test_polynomial_matches_torch_after_warmup():
    warmup, total = 3, 23
    f = lr_factor("polynomial", warmup, total, power=2.0)
    ref = torch_factors(torch.optim.lr_scheduler.PolynomialLR, total - warmup, total_iters=total - warmup, power=2.0)
    assert all(math.isclose(f(warmup + i), r, rel_tol=1e-9, abs_tol=1e-12) for i, r in enumerate(ref))


@pytest.mark.parametrize("kw,needle", [
    (dict(kind="linear"), "--lr_schedule 'linear' is not one of"),
    (dict(kind="cosine", warmup_steps=10, total_steps=10), "decays from --warmup_steps 10 to the last step"),
    (dict(min_ratio=1.5), "--min_lr_ratio 1.5 must be in [0, 1]"),
    (dict(power=0.0), "--lr_power 0.0 must be > 0"),
])
def test_bad_schedules(kw, needle):
    args = dict(kind="cosine", warmup_steps=2, total_steps=10, min_ratio=0.0, power=1.0) | kw
    with pytest.raises(UserError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        lr_factor(args["kind"], args["warmup_steps"], args["total_steps"], args["min_ratio"], args["power"])


SCHEDULES = ("inverse_sqrt", "cosine")


@pytest.fixture(scope="module")
def schedule_runs(multi30k_tsv, bpe_tokenizer, tmp_path_factory):
    """Per schedule: 8 steps in one process saving at step 4, and the same run resumed from step 4 under dp2 —
    the full runs in one launch, the resumed ones in another (tests/drivers/train_many.py)."""
    root = tmp_path_factory.mktemp("schedules")

    def common(schedule):
        return ["--file_path", multi30k_tsv, "--tokenizer", bpe_tokenizer, *TINY, "--steps", 8,
                "--lr_schedule", schedule, "--warmup_steps", 3, "--min_lr_ratio", 0.1]
    run_many(1, [common(s) + ["--output_dir", root / s / "full", "--save_checkpoint_steps", 4] for s in SCHEDULES],
             root)
    run_many(2, [common(s) + ["--output_dir", root / s / "resumed",
                              "--ckpt_file", root / s / "full" / "checkpoints" / "step_00000004"] for s in SCHEDULES],
             root)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_resumes_exactly_on_another_layout(schedule, schedule_runs):
    """Saved at step 4 of 8 in one process, resumed under dp2: every later step's lr is the uninterrupted run's."""
    full, resumed = read_metrics(schedule_runs / schedule / "full"), read_metrics(schedule_runs / schedule / "resumed")
    peak = float(TINY[TINY.index("--lr") + 1])
    f = lr_factor(schedule, 3, 8, 0.1)
    assert [r["lr"] for r in full] == pytest.approx([peak * f(k) for k in range(8)], rel=1e-12)
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in full[4:]]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in full[4:]], rel=1e-5)
