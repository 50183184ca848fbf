"""The probe batch's rows: their count, reordered or sliced as the devices hold them.

The causes and the noise floor run the reference on reordered rows (the same examples,
another order of the sums) or on each device's slice of them.

>>> batch = {"x": np.arange(8).reshape(4, 2), "scale": 2.0}
>>> batch_size(batch), rows_are_examples(batch)
(4, True)
>>> [part["x"][:, 0].tolist() for part in slices(batch, 2)]
[[0, 2], [4, 6]]
>>> rows(batch, lambda x: x[::-1])["x"][:, 0].tolist()
[6, 4, 2, 0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from shardax.plan.tree import is_array


def batch_size(batch: Any) -> int:
    """The leading size of the batch's first array (0 for a scalar or no array)."""
    leaves = [x for x in jax.tree.leaves(batch) if is_array(x)]
    return int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else 0


def rows(batch: Any, fn: Callable[[np.ndarray], np.ndarray]) -> Any:
    """``fn`` of each array of the batch (as NumPy); scalars are left alone."""
    return jax.tree.map(lambda x: fn(np.asarray(x)) if is_array(x) and np.ndim(x) else x, batch)


def slices(batch: Any, n: int) -> list[Any]:
    """The batch's rows in ``n`` equal consecutive slices: what each device holds."""
    size = batch_size(batch) // n
    return [rows(batch, lambda x, i=i: x[i * size : (i + 1) * size]) for i in range(n)]


def rows_are_examples(batch: Any) -> bool:
    """Whether every array of the batch has the same leading dimension (>= 2): its rows
    can be reordered as examples (a batch of mixed leading sizes is left alone)."""
    sizes = {np.shape(x)[0] for x in jax.tree.leaves(batch) if is_array(x) and np.ndim(x)}
    return len(sizes) == 1 and next(iter(sizes)) >= 2


def devices_over_rows(batch: Any, mesh: Mesh | None) -> int:
    """The number of slices the batch's rows are split in: by the placement of a placed
    batch, else over the whole mesh."""
    for x in jax.tree.leaves(batch):
        if isinstance(x, jax.Array) and x.ndim:
            return x.shape[0] // max(x.sharding.shard_shape(x.shape)[0], 1)
    return mesh.size if mesh is not None else 1
