"""The HLO reader: compiled program text as the cost models read it.

``program``: computations, how often each runs, an instruction's parts; ``collectives``:
the collectives and the bytes each device sends; ``kernels``: the fused attention calls.
"""

from shardax.cost.hlo.collectives import (
    OPS,
    Collective,
    collective_bytes,
    collective_of,
    collectives,
    replica_groups,
)
from shardax.cost.hlo.kernels import attention_kernel, attention_kernels, fused_attention
from shardax.cost.hlo.program import DTYPE_BYTES, arrays, computations, line_calls, runs

__all__ = [
    "DTYPE_BYTES",
    "OPS",
    "Collective",
    "arrays",
    "attention_kernel",
    "attention_kernels",
    "collective_bytes",
    "collective_of",
    "collectives",
    "computations",
    "fused_attention",
    "line_calls",
    "replica_groups",
    "runs",
]
