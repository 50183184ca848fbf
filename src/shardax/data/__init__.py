"""Data layer: global batches, process-sharded loading, uneven batches, async prefetch."""

from shardax._names import exports as _exports
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

__all__ = _exports(__name__)

# Names that left this namespace keep working for a minor version (shardax/_names.py MOVED).
__getattr__ = _moved(__name__)
