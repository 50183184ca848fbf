"""Plan layer: pytrees to pytrees of ``NamedSharding``."""

from shardax.plan.activation import constrain
from shardax.plan.annotations import (
    annotated_specs,
    axis_rules,
    current_axis_rules,
    from_linen,
    from_nnx,
    logical_to_mesh,
)
from shardax.plan.core import (
    DEFAULT_FSDP_MIN_SIZE,
    Plan,
    axis_size,
    fsdp,
    fsdp_over,
    fsdp_spec,
    replicate,
    shard,
)
from shardax.plan.follow import FollowParams, follow_params
from shardax.plan.init import init_sharded
from shardax.plan.placed import planned, record
from shardax.plan.regex import rules
from shardax.plan.report import Row, ShardingReport, describe, format_bytes, validate
from shardax.plan.specs import check_spec, spec_errors
from shardax.plan.tree import dtype_name, is_array, is_key, itemsize, map_arrays, path_str
from shardax.plan.zero import zero1, zero2

__all__ = [
    "DEFAULT_FSDP_MIN_SIZE",
    "FollowParams",
    "Plan",
    "Row",
    "ShardingReport",
    "annotated_specs",
    "axis_rules",
    "axis_size",
    "check_spec",
    "constrain",
    "current_axis_rules",
    "describe",
    "dtype_name",
    "follow_params",
    "format_bytes",
    "from_linen",
    "from_nnx",
    "fsdp",
    "fsdp_over",
    "fsdp_spec",
    "init_sharded",
    "is_array",
    "is_key",
    "itemsize",
    "logical_to_mesh",
    "map_arrays",
    "path_str",
    "planned",
    "record",
    "replicate",
    "rules",
    "shard",
    "spec_errors",
    "validate",
    "zero1",
    "zero2",
]
