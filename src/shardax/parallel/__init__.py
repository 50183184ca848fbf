"""In-model tools, called inside a model while it is traced: remat, pipeline.

One concept per module; each module's public names are re-exported here and from
``shardax``.
"""

from shardax.parallel.remat import POLICIES as REMAT_POLICIES
from shardax.parallel.remat import checkpoint_policy, remat

__all__ = ["REMAT_POLICIES", "checkpoint_policy", "remat"]
