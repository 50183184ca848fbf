"""The digits data set that ``shardax train --model mlp`` fits (scikit-learn's 8×8 digits)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from shardax.cli.common import require


def digits_file() -> Path | None:
    """The CSV that ``sklearn.datasets.load_digits`` reads, found without importing
    scikit-learn (whose import, SciPy with it, costs over a second of every job's
    start); None where scikit-learn is not installed or no longer ships it there."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets/data/digits.csv.gz"
    return path if path.is_file() else None


def load_digits(seed: int, command: str = "train") -> tuple[np.ndarray, ...]:
    """The 1797 digits shipped inside scikit-learn, shuffled, split 80/20, scaled to [0, 1]."""
    path = digits_file()
    if path is not None:  # as load_digits reads it: 64 pixels, then the label
        data = np.loadtxt(path, delimiter=",")
        x, y = data[:, :-1], data[:, -1]
    else:
        x, y = require("sklearn.datasets", "demo", command).load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]
