"""In-model tools, called inside a model while it is traced: collectives, remat, pipeline,
attention (context parallelism), moe (expert parallelism).

One concept per module; each module's public names are re-exported here (the most used
also from ``shardax``).
"""

from shardax.checks import moved as _moved
from shardax.parallel.collectives import all_gather, all_reduce, reduce, weighted_mean
from shardax.parallel.context import attention, choose_impl, unzigzag, zigzag, zigzag_layout
from shardax.parallel.experts import MoEAux, capacity, choose_dispatch, moe
from shardax.parallel.fused import choose_kernel
from shardax.parallel.gpipe import bubble, pipeline
from shardax.parallel.one_f_one_b import pipeline_1f1b
from shardax.parallel.remat_policy import POLICIES as REMAT_POLICIES
from shardax.parallel.remat_policy import remat

__all__ = [
    "REMAT_POLICIES",
    "MoEAux",
    "all_gather",
    "all_reduce",
    "attention",
    "bubble",
    "capacity",
    "choose_dispatch",
    "choose_impl",
    "choose_kernel",
    "moe",
    "pipeline",
    "pipeline_1f1b",
    "reduce",
    "remat",
    "unzigzag",
    "weighted_mean",
    "zigzag",
    "zigzag_layout",
]

# Names that left this namespace (internal now, or moved), by their home; they keep
# working for a release, with a DeprecationWarning.
__getattr__ = _moved(
    __name__,
    {
        "ATTENTION_KERNELS": "shardax.parallel.fused.KERNELS",
        "bound_axes": "shardax.parallel.collectives.bound_axes",
        "checkpoint_policy": "shardax.parallel.remat_policy.checkpoint_policy",
        "require_bound": "shardax.parallel.collectives.require_bound",
        "scan_layers": "shardax.parallel.gpipe.scan_layers",
        "sequence_sharding": "shardax.parallel.context.sequence_sharding",
    },
)
