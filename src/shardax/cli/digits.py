"""The digits data set that ``shardax train --model mlp`` fits (scikit-learn's 8×8 digits)."""

from __future__ import annotations

import numpy as np

from shardax.cli.common import require


def load_digits(seed: int, command: str = "train") -> tuple[np.ndarray, ...]:
    """The 1797 digits shipped inside scikit-learn, shuffled, split 80/20, scaled to [0, 1]."""
    datasets = require("sklearn.datasets", "demo", command)
    x, y = datasets.load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]
