"""In-model tools, called inside a model while it is traced: remat, pipeline.

One concept per module; each module's public names are re-exported here and from
``shardax``.
"""

from shardax.parallel.pipeline import STAGE_AXIS, bubble, pipeline, scan_layers

__all__ = ["STAGE_AXIS", "bubble", "pipeline", "scan_layers"]
