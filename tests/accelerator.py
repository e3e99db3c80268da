"""Which precisions this machine's DeepSpeed accelerator computes in — the same answer train.py acts on.

CPUs differ: DeepSpeed's CPU accelerator offers bf16 where the CPU has it (avx512_bf16 / AMX, or emulated), fp16
only with avx512_fp16. A test of a precision the accelerator lacks is skipped with the reason (train.py refuses
that precision there with one `error:` line, which tests/test_train_errors.py checks); everything else runs.
"""

from __future__ import annotations

import pytest

NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def supported(precision: str) -> bool:
    import torch
    from deepspeed.accelerator import get_accelerator

    return getattr(torch, NAMES[precision]) in get_accelerator().supported_dtypes()


def reason(precision: str) -> str:
    from deepspeed.accelerator import get_accelerator

    return (
        f"DeepSpeed's {get_accelerator().device_name()} accelerator does not compute in {precision} on this "
        f"machine (train.py refuses --precision {precision} here)"
    )


def skip_unless(precision: str):
    """A pytest mark: skip unless the accelerator supports `precision`."""
    return pytest.mark.skipif(not supported(precision), reason=reason(precision))


def param(value, precision: str):
    """A parametrize value that is skipped where `precision` is not supported."""
    return pytest.param(value, marks=skip_unless(precision))
