"""Prefetching: keeps ``buffer_size`` batches placed on devices ahead of the consumer."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from typing import Any

import jax
from jax.sharding import Mesh, Sharding, SingleDeviceSharding

from shardax.data.placement import batch_sharding, distribute_batch


def as_sharding(target: Any) -> Sharding:
    """A ``Sharding`` from a device, a sharding, a mesh (its batch sharding) or None."""
    if target is None:
        return SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(target, Sharding):
        return target
    if isinstance(target, Mesh):
        return batch_sharding(target)
    if isinstance(target, jax.Device):
        return SingleDeviceSharding(target)
    raise TypeError(
        f"prefetch target must be a Device, a Sharding, a Mesh or None, got {type(target)}"
    )


def prefetch_to_device(
    iterable: Iterable[Any], target: Any = None, buffer_size: int = 2
) -> Iterator[Any]:
    """Yields the batches of ``iterable`` in order, placed ``buffer_size`` ahead.

    Placement is asynchronous in JAX, so transfers overlap with the consumer's work.

    >>> batches = prefetch_to_device(({"x": np.ones(8) * i} for i in range(3)))
    >>> [int(b["x"][0]) for b in batches]
    [0, 1, 2]
    """
    if buffer_size < 1:
        raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
    sharding = as_sharding(target)
    queue: collections.deque[Any] = collections.deque()
    source = iter(iterable)
    for item in source:
        queue.append(distribute_batch(item, sharding))
        if len(queue) > buffer_size:
            yield queue.popleft()
    while queue:
        yield queue.popleft()
