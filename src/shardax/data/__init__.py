"""Data layer: placing batches on devices, and prefetching them."""

from shardax.data.device_placement import DevicePlacement
from shardax.data.placement import (
    batch_sharding,
    distribute_batch,
    leaf_sharding,
    place_on_device,
    replicate_across_devices,
    shard_batch_dim,
)
from shardax.data.prefetch import as_sharding, prefetch_to_device

__all__ = [
    "DevicePlacement",
    "as_sharding",
    "batch_sharding",
    "distribute_batch",
    "leaf_sharding",
    "place_on_device",
    "prefetch_to_device",
    "replicate_across_devices",
    "shard_batch_dim",
]
