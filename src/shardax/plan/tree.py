"""Pytree helpers shared by every layer: which leaves are arrays, and their paths.

A typed PRNG key array (``jax.random.key``, the state of every ``nnx.Rngs``) is an array
leaf like any other: [`is_key`][shardax.plan.is_key] tells it apart,
[`dtype_name`][shardax.plan.dtype_name] and [`itemsize`][shardax.plan.itemsize] describe
it (``key<fry>``, 8 bytes of key data per key), and every plan places it replicated (a key
is a generator's state, never a weight to split).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from shardax.checks import public


def is_array(x: Any) -> bool:
    """True for ``jax.Array``, NumPy arrays and scalars, and ``jax.ShapeDtypeStruct``."""
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


@public("sx.plan.is_key")
def is_key(x: Any) -> bool:
    """True for a typed PRNG key array (``jax.random.key``) or a ``ShapeDtypeStruct`` of one.

    >>> is_key(jax.random.key(0)), is_key(jax.random.PRNGKey(0)), is_key(np.ones(2))
    (True, False, False)
    """
    dtype = getattr(x, "dtype", None)
    return is_array(x) and dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@public("sx.plan.dtype_name")
def dtype_name(x: Any) -> str:
    """The dtype of an array leaf as a name: ``float32``, ``bfloat16``, ``key<fry>``.

    >>> dtype_name(np.ones(2, np.float32)), dtype_name(jax.random.key(0))
    ('float32', 'key<fry>')
    """
    return str(x.dtype) if is_key(x) else np.dtype(x.dtype).name


@public("sx.plan.itemsize")
def itemsize(x: Any) -> int:
    """Bytes per element of an array leaf; for a key, the bytes of its key data.

    >>> itemsize(np.ones(2, np.float32)), itemsize(jax.random.key(0))
    (4, 8)
    """
    return _key_itemsize(x.dtype) if is_key(x) else np.dtype(x.dtype).itemsize


@functools.cache
def _key_itemsize(dtype: Any) -> int:
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
    return math.prod(data.shape) * np.dtype(data.dtype).itemsize


def path_str(path: tuple[Any, ...]) -> str:
    """A key path joined by "/", for example ``layers/0/kernel``."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def map_arrays(fn: Callable[[str, Any], Any], tree: Any, *rest: Any) -> Any:
    """Maps ``fn(path, leaf, *rest_leaves)`` over array leaves; other leaves pass through.

    >>> map_arrays(lambda p, x: p, {"a": np.ones(2), "b": "text"})
    {'a': 'a', 'b': 'text'}
    """

    def go(path: tuple[Any, ...], leaf: Any, *others: Any) -> Any:
        return fn(path_str(path), leaf, *others) if is_array(leaf) else leaf

    return jax.tree_util.tree_map_with_path(go, tree, *rest)
