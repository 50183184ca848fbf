"""Plan layer: pytrees to pytrees of ``NamedSharding``."""

from shardax.plan.core import (
    DEFAULT_FSDP_MIN_SIZE,
    Plan,
    axis_size,
    fsdp,
    fsdp_spec,
    replicate,
    shard,
)
from shardax.plan.tree import is_array, map_arrays, path_str
from shardax.plan.validate import check_spec

__all__ = [
    "DEFAULT_FSDP_MIN_SIZE",
    "Plan",
    "axis_size",
    "check_spec",
    "fsdp",
    "fsdp_spec",
    "is_array",
    "map_arrays",
    "path_str",
    "replicate",
    "shard",
]
