"""Gradient accumulation as a wrapper: ``k`` microbatches in a ``lax.scan``.

:func:`microbatched` turns a function of one batch into the same function of ``k``
microbatches of it, summing the results weighted by each microbatch's count of real
examples (or tokens) when the batch has a ``"mask"`` leaf, so the result is the mean over
the whole batch either way. The model state (batch norm statistics, say) is threaded
through the microbatches in order. This is levanter's ``microbatched``, for the
train step's per-shard function.

>>> def fn(model_state, batch, keys, rng):
...     return None, jnp.mean(batch["x"]), {}, model_state
>>> whole = microbatched(fn, 2)(None, {"x": jnp.arange(4.0)}, None, jax.random.key(0))
>>> float(whole[1])
1.5
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from shardax.train.batch import split_microbatches
from shardax.train.masks import batch_mask, valid_count

ShardFn = Callable[[Any, Any, Any, jax.Array], tuple[Any, jax.Array, Any, Any]]
"""``fn(model_state, batch, keys, rng) -> (grads, loss, aux, model_state)``: the means
over one (micro)batch; ``grads`` may be None (an evaluation)."""


def _mean(total: jax.Array, scale: jax.Array) -> jax.Array:
    """``total * scale`` in the total's floating dtype; an integer or boolean sum (a count
    in the aux metrics) becomes a float32 mean rather than rounding to 0."""
    if jnp.issubdtype(total.dtype, jnp.inexact):
        return (total * scale.astype(total.dtype)).astype(total.dtype)
    return total.astype(jnp.float32) * scale


def microbatched(fn: ShardFn, k: int, constrain: Callable[[Any], Any] | None = None) -> ShardFn:
    """``fn`` over ``k`` microbatches: microbatch ``j`` holds the examples ``i`` with
    ``i % k == j`` (:func:`shardax.train.batch.split_microbatches`), and gets
    ``fold_in(rng, j)`` and its slice of ``keys``. ``constrain`` (optional) is applied
    to the stacked microbatches, e.g. to keep each split over the data axis."""
    if k == 1:
        return fn

    def accumulated(model_state: Any, batch: Any, keys: Any, rng: jax.Array):
        micro = split_microbatches(batch, k)
        micro_keys = None if keys is None else split_microbatches(keys, k)
        if constrain is not None:
            micro = constrain(micro)
        masked = batch_mask(batch) is not None

        def body(carry: Any, xs: Any) -> tuple[Any, None]:
            sums, total, model_state = carry
            mb, mkeys, j = xs
            grads, loss, aux, model_state = fn(model_state, mb, mkeys, jax.random.fold_in(rng, j))
            count = valid_count(mb) if masked else jnp.float32(1)
            sums = jax.tree.map(
                lambda s, v: s + count.astype(v.dtype) * v, sums, (grads, loss, aux)
            )
            return (sums, total + count, model_state), None

        first = jax.tree.map(lambda x: x[0], (micro, micro_keys))
        shapes = jax.eval_shape(lambda mb, mk: fn(model_state, mb, mk, rng), *first)
        zeros = jax.tree.map(jnp.zeros_like, shapes[:3])  # with the shardings in their types
        (sums, total, model_state), _ = lax.scan(
            body, (zeros, jnp.float32(0), model_state), (micro, micro_keys, jnp.arange(k))
        )
        scale = 1 / jnp.maximum(total, 1)
        grads, loss, aux = jax.tree.map(lambda s: _mean(s, scale), sums)
        return grads, loss, aux, model_state

    return accumulated
