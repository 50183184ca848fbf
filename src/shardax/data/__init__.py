"""Data layer: global batches, process-sharded loading, uneven batches, async prefetch."""

from shardax.data.assembly import as_sharding, global_batch, process_grid
from shardax.data.loader import Batches, batches
from shardax.data.placement import (
    batch_sharding,
    distribute_batch,
    leaf_sharding,
    place_on_device,
    replicate_across_devices,
    shard_batch_dim,
)
from shardax.data.policy import POLICIES, fit_batch, pad_batch
from shardax.data.prefetch import Prefetcher, prefetch_to_device
from shardax.data.spec import batch_shardings
from shardax.data.wait import Timed, timed

__all__ = [
    "POLICIES",
    "Batches",
    "Prefetcher",
    "Timed",
    "as_sharding",
    "batch_sharding",
    "batch_shardings",
    "batches",
    "distribute_batch",
    "fit_batch",
    "global_batch",
    "leaf_sharding",
    "pad_batch",
    "place_on_device",
    "prefetch_to_device",
    "process_grid",
    "replicate_across_devices",
    "shard_batch_dim",
    "timed",
]
