"""Masks and means: the mean over the real examples or tokens of a padded batch.

A batch may carry a top-level boolean ``"mask"`` leaf whose shape leads the batch's
shape: ``(batch,)``, True for real examples, or ``(batch, seq)``, True for real tokens. A
loss function returns the mean over the real examples (tokens) it was given;
[`masked_mean`][shardax.masked_mean] computes it, and the train step weights each shard
and microbatch by its count of real examples (tokens), so the result is the mean over the
whole global batch.

>>> masked_mean(jnp.array([1.0, 2.0, 9.0]), jnp.array([True, True, False]))
Array(1.5, dtype=float32)
>>> masked_mean(jnp.array([[1.0, 5.0], [3.0, 9.0]]), jnp.array([[True, True], [True, False]]))
Array(3., dtype=float32)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from shardax.checks import public

MASK_KEY = "mask"


def batch_mask(batch: Any) -> jax.Array | None:
    """The batch's ``"mask"`` leaf, or None when it has none."""
    return batch.get(MASK_KEY) if isinstance(batch, dict) else None


@public("sx.masked_mean")
def masked_mean(values: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Mean of ``values`` over the entries where ``mask`` is True.

    ``mask`` is boolean (as the batch's ``"mask"`` leaf the train step weights shards
    by) and covers the leading axes of ``values``: ``(batch,)`` for examples,
    ``(batch, seq)`` for tokens. Trailing axes are averaged too. With no real entry (an
    all-False mask) the result is 0, not NaN. ``mask=None`` is the plain mean. A float
    or integer mask is refused rather than read as weights or as truth values: for a
    weighted mean use ``jnp.sum(values * w) / jnp.sum(w)``, or ``mask=w > 0`` for a mask.
    Lists and NumPy arrays are taken as arrays.
    """
    values = jnp.asarray(values)
    if mask is None:
        return jnp.mean(values)
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(
            f"mask must be boolean (True for the real entries), got dtype "
            f"{mask.dtype}; for weights use jnp.sum(values * w) / jnp.sum(w), or pass "
            "mask=w > 0"
        )
    if mask.ndim < 1 or mask.shape != values.shape[: mask.ndim]:
        raise ValueError(
            "mask must cover the leading axes of values, (batch,) or "
            f"(batch, seq); values have shape {values.shape}, mask has shape {mask.shape}"
        )
    weights = jnp.broadcast_to(
        mask.reshape(mask.shape + (1,) * (values.ndim - mask.ndim)), values.shape
    )
    total = jnp.sum(jnp.where(weights, values, 0))
    return total / jnp.maximum(jnp.sum(weights), 1).astype(total.dtype)


def valid_count(batch: Any) -> jax.Array | None:
    """The number of real examples or tokens (float32) of ``batch``; None without a mask."""
    mask = batch_mask(batch)
    return None if mask is None else jnp.sum(mask, dtype=jnp.float32)
