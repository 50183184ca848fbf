"""Uneven batches: what to do with a last batch smaller than the others.

Three policies, named where batching happens (``sx.batches``, ``sx.prefetch_to_device``):

- ``"error"`` (the default): raise, naming the sizes;
- ``"drop"``: leave the short batch out;
- ``"pad"``: pad it with zeros to the fixed batch size and add a boolean top-level ``"mask"``
  leaf (True = real example) to every batch, so shapes never change and the step never
  recompiles. The train step ignores masked examples in its loss and metrics.

>>> batch = pad_batch({"x": np.ones((3, 2))}, 4)
>>> batch["x"].shape, batch["mask"].tolist()
((4, 2), [True, True, True, False])
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from shardax.plan.tree import path_str

POLICIES = ("error", "drop", "pad")
MASK = "mask"


def check_policy(policy: str) -> str:
    """Returns ``policy`` if it is one of ``POLICIES``, else raises ``ValueError``."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return policy


def num_batches(num_examples: int, batch_size: int, policy: str) -> int:
    """Batches per epoch of ``num_examples`` under ``policy``; "error" raises on a remainder.

    >>> num_batches(10, 4, "drop"), num_batches(10, 4, "pad")
    (2, 3)
    """
    check_policy(policy)
    full, rest = divmod(num_examples, batch_size)
    if rest and policy == "error":
        raise ValueError(
            f"{num_examples} examples do not split into batches of {batch_size}: the last "
            f"batch would have {rest}; pass policy='drop' to leave it out or policy='pad' "
            "to pad it and add a 'mask' leaf"
        )
    return full + (1 if rest and policy == "pad" else 0)


def batch_size_of(batch: Any) -> int:
    """The leading dimension shared by every array leaf of ``batch``; raises if they differ."""
    sizes = {
        path_str(p): np.shape(x)[0]
        for p, x in jax.tree_util.tree_leaves_with_path(batch)
        if np.ndim(x) > 0
    }
    if not sizes:
        raise ValueError("batch has no array leaf with a batch dimension")
    if len(set(sizes.values())) > 1:
        raise ValueError(f"the leaves of a batch differ in their leading dimension: {sizes}")
    return next(iter(sizes.values()))


def pad_batch(batch: dict[str, Any], batch_size: int, real: int | None = None) -> dict[str, Any]:
    """Pads every array leaf of the dict ``batch`` with zeros to ``batch_size`` rows and adds
    ``batch["mask"]``, True for the first ``real`` rows (default: the rows it had)."""
    if not isinstance(batch, dict):
        raise TypeError(
            f"policy='pad' adds a top-level 'mask' leaf, so batches must be dicts, got "
            f"{type(batch).__name__}"
        )
    if MASK in batch:
        raise ValueError("policy='pad' adds a 'mask' leaf, but the batch already has one")
    n = batch_size_of(batch)
    if n > batch_size:
        raise ValueError(f"batch has {n} examples, more than the batch size {batch_size}")

    def pad(x: Any) -> Any:
        if np.ndim(x) == 0 or n == batch_size:
            return x
        x = np.asarray(x)
        return np.concatenate([x, np.zeros((batch_size - n, *x.shape[1:]), x.dtype)])

    out = jax.tree.map(pad, batch)
    out[MASK] = np.arange(batch_size) < (n if real is None else real)
    return out


def fit_batch(batch: Any, batch_size: int, policy: str) -> Any | None:
    """``batch`` made to have ``batch_size`` examples under ``policy``; None means drop it.

    Under "pad" every batch gets the ``"mask"`` leaf, full ones included, so the structure
    is the same for all batches.
    """
    check_policy(policy)
    n = batch_size_of(batch)
    if n > batch_size:
        raise ValueError(f"batch has {n} examples, more than the batch size {batch_size}")
    if policy == "pad":
        return pad_batch(batch, batch_size)
    if n == batch_size:
        return batch
    if policy == "drop":
        return None
    raise ValueError(
        f"batch has {n} examples but the batch size is {batch_size}; pass policy='drop' to "
        "leave short batches out or policy='pad' to pad them and add a 'mask' leaf"
    )
