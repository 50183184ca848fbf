"""Global batches: each process passes its own slice, and gets one global ``jax.Array``.

With one process this is a ``device_put``. With many, every process passes the rows its
devices hold, and ``jax.make_array_from_process_local_data`` assembles the global array
without moving data between hosts. Shapes are checked first, so a process that passes the
wrong number of rows gets an error naming the expected and received shapes, not a hang.

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": -1})
>>> batch = sx.global_batch({"x": np.ones((16, 3)), "y": np.arange(16)}, mesh)
>>> batch["x"].shape, batch["x"].sharding.spec
((16, 3), P('data',))
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding, SingleDeviceSharding

from shardax.checks import as_count, public
from shardax.data.leaves import check_batch_leaves, sharded_dims
from shardax.data.placement import batch_sharding, leaf_sharding
from shardax.plan.specs import spec_axes
from shardax.plan.tree import map_arrays
from shardax.runtime.processes import device_put_global


def as_sharding(target: Any) -> Sharding:
    """A ``Sharding`` from a device, a sharding, a mesh (its batch sharding) or None.

    >>> as_sharding(jax.devices()[1])
    SingleDeviceSharding(device=CpuDevice(id=1), memory_kind=device)
    """
    if target is None:
        return SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(target, Sharding):
        return target
    if isinstance(target, Mesh):
        return batch_sharding(target)
    if isinstance(target, jax.Device):
        return SingleDeviceSharding(target)
    raise TypeError(
        "target must be a jax.Device, a jax.sharding.Sharding, a Mesh or None, "
        f"got {type(target).__name__}: {target!r}"
    )


def process_grid(sharding: NamedSharding, ndim: int) -> tuple[int, ...]:
    """How many processes split each of ``ndim`` dimensions under ``sharding``.

    ``(2, 1)`` means the rows are split between two groups of processes and every process
    holds all columns. One process always gives all ones.

    >>> process_grid(sx.batch_sharding(sx.make_mesh()), 2)
    (1, 1)
    """
    spec = (tuple(sharding.spec) + (None,) * ndim)[:ndim]
    shards = tuple(math.prod(sharding.mesh.shape[a] for a in spec_axes(e)) for e in spec)
    # Probe with one index per shard: the distinct starts this process sees per dimension.
    probe = NamedSharding(sharding.mesh, jax.P(*spec))
    index_map = probe.addressable_devices_indices_map(shards)
    local = [len({(idx[d].start or 0) for idx in index_map.values()}) for d in range(ndim)]
    return tuple(n // k for n, k in zip(shards, local, strict=True))


def _check_share(
    path: str, shape: tuple[int, ...], spec: Any, grid: tuple[int, ...], global_size: int
) -> None:
    """The first sharded dimension of ``shape`` is this process's share of ``global_size``."""
    sharded = [d for d, e in enumerate(tuple(spec)[: len(shape)]) if e is not None]
    if not sharded:
        return
    d = sharded[0]
    if global_size % grid[d]:
        raise ValueError(
            f"global_size {global_size} is not divisible by the {grid[d]} "
            f"processes that split dimension {d} of leaf {path!r}"
        )
    share = global_size // grid[d]
    if shape[d] != share:
        expected = (*shape[:d], share, *shape[d + 1 :])
        raise ValueError(
            f"leaf {path!r} has local shape {shape}, expected {expected} "
            f"(global batch {global_size} split over {grid[d]} process(es))"
        )


@public("sx.global_batch")
def global_batch(local_batch: Any, sharding: Any, global_size: int | None = None) -> Any:
    """Places this process's ``local_batch`` as one global array per leaf with ``sharding``.

    Args:
      local_batch: a pytree of NumPy or JAX arrays; leaves that are not arrays pass
        through. With ``P`` processes splitting the batch dimension, each passes its
        ``1/P`` of the rows, in process order.
      sharding: a ``Sharding``, a ``Mesh`` (its batch sharding over ``"data"``) or a device.
        Scalars are replicated.
      global_size: the expected global batch size; when given, each leaf's batch dimension
        is checked against this process's share of it.

    Raises ``ValueError`` naming the leaf, the expected and the received shape when leaves
    disagree on the batch size, when it differs from ``global_size``'s share, or when a
    dimension is not divisible by its mesh axes.
    """
    sharding = as_sharding(sharding)
    if global_size is not None:
        global_size = as_count("global_size", global_size)
    check_batch_leaves(local_batch, dims=sharded_dims(sharding))
    multi = jax.process_count() > 1

    def one(path: str, x: Any) -> Any:
        local_shape = np.shape(x)
        named = isinstance(sharding, NamedSharding)
        grid = process_grid(sharding, len(local_shape)) if named else (1,) * len(local_shape)
        if global_size is not None and named:
            _check_share(path, local_shape, sharding.spec, grid, global_size)
        global_shape = tuple(n * k for n, k in zip(local_shape, grid, strict=True))
        s = leaf_sharding(path, global_shape, sharding)  # fits the spec, checks divisibility
        if not multi:
            return device_put_global(x, s)
        return jax.make_array_from_process_local_data(s, np.asarray(x), global_shape)

    return map_arrays(one, local_batch)
