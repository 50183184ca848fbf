"""Pytree helpers shared by every layer: which leaves are arrays, and their paths."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from shardax.checks import public


@public("sx.plan.is_array")
def is_array(x: Any) -> bool:
    """True for ``jax.Array``, NumPy arrays and scalars, and ``jax.ShapeDtypeStruct``."""
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


@public("sx.plan.path_str")
def path_str(path: tuple[Any, ...]) -> str:
    """A key path joined by "/", for example ``layers/0/kernel``."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


@public("sx.plan.map_arrays")
def map_arrays(fn: Callable[[str, Any], Any], tree: Any, *rest: Any) -> Any:
    """Maps ``fn(path, leaf, *rest_leaves)`` over array leaves; other leaves pass through.

    >>> map_arrays(lambda p, x: p, {"a": np.ones(2), "b": "text"})
    {'a': 'a', 'b': 'text'}
    """

    def go(path: tuple[Any, ...], leaf: Any, *others: Any) -> Any:
        return fn(path_str(path), leaf, *others) if is_array(leaf) else leaf

    return jax.tree_util.tree_map_with_path(go, tree, *rest)
