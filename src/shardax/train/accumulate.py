"""Gradient accumulation as a wrapper: ``k`` microbatches in a ``lax.scan``.

``microbatched`` turns a function of one batch into the same function of ``k``
microbatches of it, summing the results weighted by each microbatch's count of real
examples (or tokens) when the batch has a ``"mask"`` leaf, so the result is the mean over
the whole batch either way. The model state (batch norm statistics, say) takes one step
per optimizer step, as on one device: every microbatch starts from the step's model
state, and the new one is the same weighted mean of theirs (floating leaves; other leaves
are the last microbatch's). A BatchNorm's running mean with momentum 0.9 then moves by
0.9 once, not 0.9**k (threading it through k microbatches took k momentum steps), and
equals one device's; its running variance is the mean of the microbatches' variances,
which leaves out the spread of the microbatch means. This is levanter's
``microbatched``, for the train step's per-shard function.

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


def _floating(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def microbatched(fn: ShardFn, k: int, constrain: Callable[[Any], Any] | None = None) -> ShardFn:
    """``fn`` over ``k`` microbatches: microbatch ``j`` holds the examples ``i`` with
    ``i % k == j`` (``shardax.train.batch.split_microbatches``), and gets
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
            sums, total, states = carry
            mb, mkeys, j = xs
            grads, loss, aux, new = fn(model_state, mb, mkeys, jax.random.fold_in(rng, j))
            count = valid_count(mb) if masked else jnp.float32(1)
            sums = jax.tree.map(
                lambda s, v: s + count.astype(v.dtype) * v, sums, (grads, loss, aux)
            )
            states = jax.tree.map(
                lambda s, v: s + count.astype(v.dtype) * v if _floating(v) else v, states, new
            )
            return (sums, total + count, states), None

        first = jax.tree.map(lambda x: x[0], (micro, micro_keys))
        shapes = jax.eval_shape(lambda mb, mk: fn(model_state, mb, mk, rng), *first)
        zeros = jax.tree.map(jnp.zeros_like, shapes[:3])  # with the shardings in their types
        states = jax.tree.map(lambda x: jnp.zeros_like(x) if _floating(x) else x, model_state)
        (sums, total, states), _ = lax.scan(
            body, (zeros, jnp.float32(0), states), (micro, micro_keys, jnp.arange(k))
        )
        scale = 1 / jnp.maximum(total, 1)
        grads, loss, aux = jax.tree.map(lambda s: _mean(s, scale), sums)
        # No real example in the batch: the model state stays as it was.
        new_state = jax.tree.map(
            lambda s, old: (
                jnp.where(total > 0, _mean(s, scale).astype(old.dtype), old)
                if _floating(old)
                else s
            ),
            states,
            model_state,
        )
        return grads, loss, aux, new_state

    return accumulated
