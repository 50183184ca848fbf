"""Train layer: collectives, metrics and the data-parallel facade."""

from shardax.train.collectives import all_gather, all_reduce, bound_axes, reduce, require_bound
from shardax.train.data_parallel import DataParallel
from shardax.train.metrics import DistributedMetrics

__all__ = [
    "DataParallel",
    "DistributedMetrics",
    "all_gather",
    "all_reduce",
    "bound_axes",
    "reduce",
    "require_bound",
]
