"""``DistributedMetrics``: the seed's facade over :mod:`shardax.train.collectives`.

The reductions work in every mode: inside shard_map or pmap they reduce over the
named axis; under plain jit, where values are already global, they return them.

>>> dm = DistributedMetrics()
>>> dm.reduce_mean({"loss": jnp.float32(1.0)})  # under jit or eagerly: unchanged
{'loss': Array(1., dtype=float32)}
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from shardax.facade import facade
from shardax.train.collectives import all_gather as _all_gather
from shardax.train.collectives import reduce


def all_gather(metrics: Any, axis_name: str | None = "batch") -> Any:
    """Stacks ``metrics`` from every device along ``axis_name`` on a leading axis."""
    return _all_gather(metrics, axis_name)


def reduce_mean(metrics: Any, axis_name: str | None = "batch") -> Any:
    """Means ``metrics`` across ``axis_name`` (None: every bound axis)."""
    return reduce(metrics, "mean", axis_name)


def reduce_sum(metrics: Any, axis_name: str | None = "batch") -> Any:
    """Sums ``metrics`` across ``axis_name`` (None: every bound axis)."""
    return reduce(metrics, "sum", axis_name)


def reduce_max(metrics: Any, axis_name: str | None = "batch") -> Any:
    """Maximum of ``metrics`` across ``axis_name`` (None: every bound axis)."""
    return reduce(metrics, "max", axis_name)


def reduce_min(metrics: Any, axis_name: str | None = "batch") -> Any:
    """Minimum of ``metrics`` across ``axis_name`` (None: every bound axis)."""
    return reduce(metrics, "min", axis_name)


def reduce_custom(
    metrics: dict[str, Any],
    reduce_fn: dict[str, str | None] | None = None,
    axis_name: str | None = "batch",
) -> dict[str, Any]:
    """Reduces each metric by its own op from ``reduce_fn`` (default "mean").

    An op of None leaves that metric as it is; an unknown op is a ``ValueError``.
    """
    ops = reduce_fn or {}
    return {
        k: v if ops.get(k, "mean") is None else reduce(v, ops.get(k, "mean"), axis_name)
        for k, v in metrics.items()
    }


def collect_from_devices(metrics: dict[str, Any]) -> dict[str, Any]:
    """Splits pmap outputs (leading device axis) into per-device lists, outside pmap."""
    return {
        k: list(v) if isinstance(v, jax.Array) and v.ndim > 0 else v for k, v in metrics.items()
    }


@facade(
    all_gather,
    reduce_mean,
    reduce_sum,
    reduce_max,
    reduce_min,
    reduce_custom,
    collect_from_devices,
)
class DistributedMetrics(nnx.Module):
    """Metric reductions across devices; every method also exists as ``*_static``."""

    def __init__(self) -> None:
        pass
