"""Data layer: global batches, process-sharded loading, uneven batches, async prefetch."""

from shardax.checks import moved as _moved
from shardax.data.assembly import global_batch
from shardax.data.loader import Batches, batches
from shardax.data.placement import (
    batch_sharding,
    distribute_batch,
    place_on_device,
    replicate_across_devices,
    shard_batch_dim,
)
from shardax.data.prefetch import Prefetcher, prefetch_to_device
from shardax.data.wait import Timed, timed

__all__ = [
    "Batches",
    "Prefetcher",
    "Timed",
    "batch_sharding",
    "batches",
    "distribute_batch",
    "global_batch",
    "place_on_device",
    "prefetch_to_device",
    "replicate_across_devices",
    "shard_batch_dim",
    "timed",
]

# Names that left this namespace (internal now, or moved), by their home; they keep
# working for a release, with a DeprecationWarning.
__getattr__ = _moved(
    __name__,
    {
        "POLICIES": "shardax.data.policy.POLICIES",
        "as_sharding": "shardax.data.assembly.as_sharding",
        "batch_shardings": "shardax.data.spec.batch_shardings",
        "fit_batch": "shardax.data.policy.fit_batch",
        "leaf_sharding": "shardax.data.placement.leaf_sharding",
        "pad_batch": "shardax.data.policy.pad_batch",
        "process_grid": "shardax.data.assembly.process_grid",
    },
)
