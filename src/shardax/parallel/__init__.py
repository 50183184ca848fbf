"""In-model tools, called inside a model while it is traced: collectives, remat, pipeline,
attention (context parallelism), moe (expert parallelism).

One concept per module; each module's public names are re-exported here (the most used
also from ``shardax``).
"""

from shardax.parallel.collectives import (
    all_gather,
    all_reduce,
    bound_axes,
    reduce,
    require_bound,
    weighted_mean,
)
from shardax.parallel.context import (
    attention,
    choose_impl,
    sequence_sharding,
    unzigzag,
    zigzag,
)
from shardax.parallel.experts import MoEAux, capacity, choose_dispatch, moe
from shardax.parallel.fused import KERNELS as ATTENTION_KERNELS
from shardax.parallel.fused import choose_kernel
from shardax.parallel.gpipe import bubble, pipeline, scan_layers
from shardax.parallel.one_f_one_b import pipeline_1f1b
from shardax.parallel.remat_policy import POLICIES as REMAT_POLICIES
from shardax.parallel.remat_policy import checkpoint_policy, remat

__all__ = [
    "ATTENTION_KERNELS",
    "REMAT_POLICIES",
    "MoEAux",
    "all_gather",
    "all_reduce",
    "attention",
    "bound_axes",
    "bubble",
    "capacity",
    "checkpoint_policy",
    "choose_dispatch",
    "choose_impl",
    "choose_kernel",
    "moe",
    "pipeline",
    "pipeline_1f1b",
    "reduce",
    "remat",
    "require_bound",
    "scan_layers",
    "sequence_sharding",
    "unzigzag",
    "weighted_mean",
    "zigzag",
]
