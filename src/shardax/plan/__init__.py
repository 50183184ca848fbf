"""Plan layer: pytrees to pytrees of ``NamedSharding``."""

from shardax.checks import moved as _moved
from shardax.plan.activation import constrain
from shardax.plan.annotations import axis_rules, from_linen, from_nnx
from shardax.plan.core import Plan, fsdp, fsdp_over, replicate, shard
from shardax.plan.follow import follow_params
from shardax.plan.init import init_sharded
from shardax.plan.regex import rules
from shardax.plan.report import ShardingReport, describe, validate
from shardax.plan.tree import dtype_name, is_key, itemsize
from shardax.plan.zero import zero1, zero2

__all__ = [
    "Plan",
    "ShardingReport",
    "axis_rules",
    "constrain",
    "describe",
    "dtype_name",
    "follow_params",
    "from_linen",
    "from_nnx",
    "fsdp",
    "fsdp_over",
    "init_sharded",
    "is_key",
    "itemsize",
    "replicate",
    "rules",
    "shard",
    "validate",
    "zero1",
    "zero2",
]

# Names that left this namespace (internal now, or moved), by their home; they keep
# working for a release, with a DeprecationWarning.
__getattr__ = _moved(
    __name__,
    {
        "DEFAULT_FSDP_MIN_SIZE": "shardax.plan.core.DEFAULT_FSDP_MIN_SIZE",
        "FollowParams": "shardax.plan.follow.FollowParams",
        "Row": "shardax.plan.report.Row",
        "annotated_specs": "shardax.plan.annotations.annotated_specs",
        "axis_size": "shardax.plan.core.axis_size",
        "check_spec": "shardax.plan.specs.check_spec",
        "current_axis_rules": "shardax.plan.annotations.current_axis_rules",
        "format_bytes": "shardax.plan.report.format_bytes",
        "fsdp_spec": "shardax.plan.core.fsdp_spec",
        "is_array": "shardax.plan.tree.is_array",
        "logical_to_mesh": "shardax.plan.annotations.logical_to_mesh",
        "map_arrays": "shardax.plan.tree.map_arrays",
        "path_str": "shardax.plan.tree.path_str",
        "planned": "shardax.plan.placed.planned",
        "record": "shardax.plan.placed.record",
        "spec_errors": "shardax.plan.specs.spec_errors",
    },
)
