"""The per-device evidence: is the distributed result each device's slice run alone?

Each device's slice of the batch runs on one device, and the results are averaged as the
step averages devices (by their mask counts, or equally). When that gives the distributed
result, a weighting of the slices that gives one device's names per-device means weighted
equally; otherwise the rows are coupled, through statistics over the batch (BatchNorm) or,
when reordering the rows changes one device's loss, as rows that refer to each other.

>>> parts = [{"loss": np.array(1.0)}, {"loss": np.array(3.0)}]
>>> float(weighted(parts, [1.0, 3.0])["loss"])
2.5
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardax.train.masks import valid_count
from shardax.train.verification.comparison import close, numeric, values
from shardax.train.verification.rows import batch_size, slices


@dataclasses.dataclass(frozen=True)
class Slices:
    """What the per-device evidence needs from a path: ``run`` (one device's result on a
    slice of the batch), ``reordered`` (one device's loss on the rows reversed; None: not
    asked), ``n`` (the devices the rows are split over), ``got`` and ``want`` (the
    distributed and one device's results, as ``run`` gives them) and ``batchnorm`` (the
    model has a BatchNorm: coupled rows are its statistics)."""

    run: Callable[[Any], Any]
    reordered: Callable[[], Any] | None
    n: int
    got: Any
    want: Any
    batchnorm: bool = False


def floats(tree: Any) -> Any:
    """``tree`` with None in place of every leaf that is not a floating array."""
    return jax.tree.map(
        lambda x: x if numeric(x) and jnp.issubdtype(x.dtype, jnp.inexact) else None, tree
    )


def _vector(tree: Any) -> np.ndarray:
    parts = [values(x).ravel() for x in jax.tree.leaves(floats(tree))]
    return np.concatenate(parts) if parts else np.zeros(0)


def weighted(trees: list[Any], weights: list[float]) -> Any:
    """The weighted mean of the floating leaves of ``trees`` (of one structure)."""
    w = np.asarray(weights, np.float64) / max(float(np.sum(weights)), 1e-30)
    return jax.tree.map(
        lambda *xs: sum(wi * values(x) for wi, x in zip(w, xs, strict=True)),
        *[floats(t) for t in trees],
    )


def _weights_explain(parts: list[Any], whole: Any, rtol: float) -> bool | None:
    """Whether some weighting of the slices' results gives the whole batch's (least
    squares over the loss and every gradient element); None when too few numbers."""
    a = np.stack([_vector(p) for p in parts], axis=1)
    b = _vector(whole)
    if b.size <= 2 * a.shape[1]:
        return None
    w, *_ = np.linalg.lstsq(a, b, rcond=None)
    return bool(np.linalg.norm(a @ w - b) <= min(10 * rtol, 1e-2) * np.linalg.norm(b))


def per_device(evidence: Slices, batch: Any, rtol: float, atol: float) -> str | None:
    """The cause's name (one of ``"per-device means weighted equally"``, ``"rows are not
    independent examples"``, ``"per-device BatchNorm statistics"``) when the distributed
    result is each device's slice run alone; None when it is not, or cannot be told."""
    n = evidence.n
    if n < 2 or batch_size(batch) % n:
        return None
    parts_of = slices(batch, n)
    parts = [evidence.run(b) for b in parts_of]
    counts = [1.0 if valid_count(b) is None else float(valid_count(b)) for b in parts_of]
    if not close(weighted(parts, counts), floats(evidence.got), rtol, atol):
        return None
    if _weights_explain(parts, evidence.want, rtol):
        return "per-device means weighted equally"
    if not evidence.batchnorm and evidence.reordered is not None:
        loss = {k: v for k, v in evidence.want.items() if k in ("metrics", "returned")}
        if not close(evidence.reordered(), loss, rtol, atol):
            return "rows are not independent examples"
    return "per-device BatchNorm statistics"
