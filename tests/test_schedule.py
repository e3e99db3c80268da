"""Learning-rate schedules against independent references, and their exact continuation after a resume."""

import math
import shutil
from pathlib import Path

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
    f = lr_factor("inverse_sqrt", 4000, 10**6)
    for k in (3999, 4000, 10_000, 99_999):
        assert math.isclose(f(k), math.sqrt(4000) / math.sqrt(k + 1), rel_tol=1e-12)
    assert f(3999) == 1.0  # continuous at the end of warmup


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


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(kind="linear"), "--lr_schedule 'linear' is not one of"),
        (dict(kind="cosine", warmup_steps=10, total_steps=10), "decays from --warmup_steps 10 to the last step"),
        (dict(min_ratio=1.5), "--min_lr_ratio 1.5 must be in [0, 1]"),
        (dict(power=0.0), "--lr_power 0.0 must be > 0"),
    ],
)
def test_bad_schedules(kw, needle):
    args = dict(kind="cosine", warmup_steps=2, total_steps=10, min_ratio=0.0, power=1.0) | kw
    with pytest.raises(UserError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        lr_factor(args["kind"], args["warmup_steps"], args["total_steps"], args["min_ratio"], args["power"])


SCHEDULES = ("inverse_sqrt", "cosine")
# the trajectory the runs are started with; the resumed and continued runs are given none of it
TRAJECTORY = [
    "--lr",
    "2e-3",
    "--warmup_steps",
    3,
    "--min_lr_ratio",
    0.1,
    "--clip_grad",
    0.7,
    "--weight_decay",
    0.05,
    "--adam_beta1",
    0.85,
    "--adam_beta2",
    0.97,
    "--adam_eps",
    1e-7,
]
TP2XPP2 = ["--mp", 2, "--pipeline_stage", 2, "--micro_batch_num", 2]


def _without_trajectory(flags: list) -> list:
    """TINY without its --lr: the resumed runs name no optimisation setting at all."""
    i = flags.index("--lr")
    return flags[:i] + flags[i + 2 :]


def _stopped_at_4(full: Path, into: Path) -> None:
    """What a run stopped after step 4 of 8 leaves: its folder with checkpoints up to step 4."""
    shutil.copytree(full / "checkpoints", into / "checkpoints", ignore=shutil.ignore_patterns("step_00000008"))
    (into / "checkpoints" / "latest").write_text("step_00000004")


@pytest.fixture(scope="module")
def schedule_runs(multi30k_tsv, bpe_tokenizer, tmp_path_factory):
    """Per schedule, in one process and on tp2×pp2: 8 steps saving at step 4; the same folder stopped at step 4 and
    resumed with `--resume` and no schedule flag; and (one process → dp2) continued from step 4 with --ckpt_file and
    no schedule flag. Launches: one per world size and phase (tests/drivers/train_many.py)."""
    root = tmp_path_factory.mktemp("schedules")
    data = ["--file_path", multi30k_tsv, "--tokenizer", bpe_tokenizer, "--tensorboard", 0]

    def full(schedule, layout):
        return [
            *data,
            *TINY,
            *TRAJECTORY,
            "--steps",
            8,
            "--lr_schedule",
            schedule,
            *layout,
            "--output_dir",
            root / schedule / f"full{'-tp2xpp2' if layout else ''}",
            "--save_checkpoint_steps",
            4,
        ]

    def resumed(schedule, layout):
        name = f"resumed{'-tp2xpp2' if layout else ''}"
        _stopped_at_4(root / schedule / f"full{'-tp2xpp2' if layout else ''}", root / schedule / name)
        return [*data, "--output_dir", root / schedule / name, "--resume", *layout]

    run_many(1, [full(s, []) for s in SCHEDULES], root)
    run_many(4, [full(s, TP2XPP2) for s in SCHEDULES], root)
    run_many(1, [resumed(s, []) for s in SCHEDULES], root)
    run_many(4, [resumed(s, TP2XPP2) for s in SCHEDULES], root)
    run_many(
        2,
        [
            [
                *data,
                *_without_trajectory(TINY),
                "--output_dir",
                root / s / "continued",
                "--ckpt_file",
                root / s / "full" / "checkpoints" / "step_00000004",
            ]
            for s in SCHEDULES
        ],
        root,
    )
    return root


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("layout", ["", "-tp2xpp2"])
def test_resume_without_schedule_flags_is_the_uninterrupted_run(schedule, layout, schedule_runs):
    """Stopped after step 4 of 8 and resumed with --resume alone: the checkpoint gives back the whole trajectory
    (lr, schedule, warmup, horizon, floor, clipping, weight decay, AdamW's betas and eps, the planned 8 steps), so
    steps 5-8 equal the uninterrupted run's bit for bit — loss, lr and grad_norm."""
    full = read_metrics(schedule_runs / schedule / f"full{layout}")
    resumed = read_metrics(schedule_runs / schedule / f"resumed{layout}")
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    for key in ("lr", "loss", "grad_norm"):
        assert [r[key] for r in resumed] == [r[key] for r in full[4:]], key
    clipped = [r["grad_norm"] > 0.7 for r in full]
    assert any(clipped), "clipping never acted: the test would not see a lost --clip_grad"


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_continues_exactly_on_another_layout(schedule, schedule_runs):
    """Saved at step 4 of 8 in one process, continued under dp2 with --ckpt_file and no optimisation flag: every
    later step's lr is the uninterrupted run's, and the loss follows it."""
    full, continued = (
        read_metrics(schedule_runs / schedule / "full"),
        read_metrics(schedule_runs / schedule / "continued"),
    )
    peak = float(TRAJECTORY[TRAJECTORY.index("--lr") + 1])
    f = lr_factor(schedule, 3, 8, 0.1)
    assert [r["lr"] for r in full] == pytest.approx([peak * f(k) for k in range(8)], rel=1e-12)
    assert [r["step"] for r in continued] == [5, 6, 7, 8]
    assert [r["lr"] for r in continued] == [r["lr"] for r in full[4:]]
    assert [r["loss"] for r in continued] == pytest.approx([r["loss"] for r in full[4:]], rel=1e-5)
    assert [r["grad_norm"] for r in continued] == pytest.approx([r["grad_norm"] for r in full[4:]], rel=1e-5)
