"""In-model tools, called inside a model while it is traced: remat, pipeline, attention.

One concept per module; each module's public names are re-exported here and from
``shardax``.
"""

from shardax.parallel.context import (
    CONTEXT_AXIS,
    attention,
    choose_impl,
    sequence_sharding,
    unzigzag,
    zigzag,
)
from shardax.parallel.one_f_one_b import pipeline_1f1b
from shardax.parallel.pipeline import STAGE_AXIS, bubble, pipeline, scan_layers
from shardax.parallel.remat import POLICIES as REMAT_POLICIES
from shardax.parallel.remat import checkpoint_policy, remat

__all__ = [
    "CONTEXT_AXIS",
    "REMAT_POLICIES",
    "STAGE_AXIS",
    "attention",
    "bubble",
    "checkpoint_policy",
    "choose_impl",
    "pipeline",
    "pipeline_1f1b",
    "remat",
    "scan_layers",
    "sequence_sharding",
    "unzigzag",
    "zigzag",
]
