"""In-model tools, called inside a model while it is traced: collectives, remat, pipeline,
attention (context parallelism), moe (expert parallelism), fp8 matmuls.

One concept per module; each module's public names are re-exported here (the most used
also from ``shardax``).
"""

from shardax._names import exports as _exports
from shardax.checks import moved as _moved
from shardax.parallel.collectives import all_gather, all_reduce, reduce, weighted_mean
from shardax.parallel.context import attention, choose_impl, unzigzag, zigzag, zigzag_layout
from shardax.parallel.experts import MoEAux, capacity, choose_dispatch, moe
from shardax.parallel.fp8 import fp8_dot_general
from shardax.parallel.fused import choose_kernel
from shardax.parallel.gpipe import bubble, pipeline
from shardax.parallel.one_f_one_b import pipeline_1f1b
from shardax.parallel.remat_policy import POLICIES as REMAT_POLICIES
from shardax.parallel.remat_policy import remat

__all__ = _exports(__name__)

# Names that left this namespace keep working for a minor version (shardax/_names.py MOVED).
__getattr__ = _moved(__name__)
