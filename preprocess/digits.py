"""Handwritten digits for the seed's MLP example, offline: scikit-learn's bundled `load_digits` (1,797 scans of
8×8 pixels, 16 grey levels, from the UCI optdigits set) made to look like the seed's MNIST input.

The seed feeds 28×28 MNIST images through Rescale(1/255) and Normalize(0.1307, 0.3081) into Dense(784, 512). We keep
that network unchanged: each 8×8 image is scaled to [0, 1] (÷16), resized to 28×28 (bilinear), normalised with
the seed's MNIST mean and std and flattened to 784 values. The first `train_size` samples train, the rest are held
out for the accuracy figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.errors import UserError

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
SIDE = 28


@dataclass
class Digits:
    images: torch.Tensor  # [N, 784] float32
    labels: torch.Tensor  # [N] int64

    def __len__(self) -> int:
        return len(self.labels)


def load_digits_28x28(train_size: int = 1500) -> tuple[Digits, Digits]:
    """(train, held-out) splits of scikit-learn's digits, as the seed's 784-value MNIST vectors."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UserError("the digits example needs scikit-learn: pip install scikit-learn") from None
    raw = load_digits()
    if not 0 < train_size < len(raw.target):
        raise UserError(f"train_size {train_size} must be between 1 and {len(raw.target) - 1}")
    x = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [N, 1, 8, 8] in [0, 1]
    x = F.interpolate(x, size=(SIDE, SIDE), mode="bilinear", align_corners=False)
    x = ((x - MNIST_MEAN) / MNIST_STD).flatten(1)
    y = torch.tensor(raw.target, dtype=torch.int64)
    return Digits(x[:train_size], y[:train_size]), Digits(x[train_size:], y[train_size:])
