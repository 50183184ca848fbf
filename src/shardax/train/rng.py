"""Per-example random keys that do not depend on the device count or the microbatching.

Example ``i`` of the global batch at step ``s`` gets ``fold_in(fold_in(key, s), i)``;
every mode computes the same keys for the same examples, whichever device holds them.

>>> keys = example_keys(jax.random.key(0), jnp.int32(3), jnp.arange(4))
>>> keys.shape
(4,)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from shardax.checks import public


def step_key(key: jax.Array, step: jax.Array) -> jax.Array:
    """The key of one step: ``fold_in(key, step)``."""
    return jax.random.fold_in(key, step)


def fold_in_each(keys: jax.Array, data: jax.Array | int) -> jax.Array:
    """``fold_in(key, data)`` of every key of a typed key array of any shape: a model's
    own layer-stacked streams (``nnx.split_rngs(splits=L)`` + ``nnx.vmap``) keep a key
    array of shape ``(L,)`` per stream.

    >>> fold_in_each(jax.random.split(jax.random.key(0), 4), 7).shape
    (4,)
    """
    fold = lambda key: jax.random.fold_in(key, data)  # noqa: E731
    for _ in range(keys.ndim):
        fold = jax.vmap(fold)
    return fold(keys)


@public("sx.train.example_keys")
def example_keys(key: jax.Array, step: jax.Array, index: jax.Array) -> jax.Array:
    """A typed key per example: ``fold_in(step_key(key, step), index[i])``.

    ``index`` holds the examples' positions in the global batch, shape ``(batch,)``.
    """
    base = step_key(key, step)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(index)


@public("sx.train.dropout")
def dropout(keys: jax.Array, x: jax.Array, rate: float) -> jax.Array:
    """Inverted dropout with one key per example (leading axis of ``x``).

    >>> y = dropout(example_keys(jax.random.key(0), 0, jnp.arange(8)), jnp.ones((8, 3)), 0.5)
    """
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    if rate == 0.0:
        return x
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, x.shape[1:]))(keys)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)
