"""Plan layer: pytrees to pytrees of ``NamedSharding``."""

from shardax._names import exports as _exports
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

__all__ = _exports(__name__)

# Names that left this namespace keep working for a minor version (shardax/_names.py MOVED).
__getattr__ = _moved(__name__)
