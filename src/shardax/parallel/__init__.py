"""In-model tools, called inside a model while it is traced: remat, pipeline, moe.

One concept per module; each module's public names are re-exported here and from
``shardax``.
"""

from shardax.parallel.moe import EXPERT_AXIS, MoEAux, capacity, choose_dispatch, moe
from shardax.parallel.one_f_one_b import pipeline_1f1b
from shardax.parallel.pipeline import STAGE_AXIS, bubble, pipeline, scan_layers
from shardax.parallel.remat import POLICIES as REMAT_POLICIES
from shardax.parallel.remat import checkpoint_policy, remat

__all__ = [
    "EXPERT_AXIS",
    "REMAT_POLICIES",
    "STAGE_AXIS",
    "MoEAux",
    "bubble",
    "capacity",
    "checkpoint_policy",
    "choose_dispatch",
    "moe",
    "pipeline",
    "pipeline_1f1b",
    "remat",
    "scan_layers",
]
