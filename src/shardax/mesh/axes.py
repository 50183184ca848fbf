"""The mesh axis names shardax uses by default: one source of truth.

Every layer takes an ``axis=`` argument, so any name works; these are the defaults,
and ``shardax train --mesh`` uses them. ``sx.make_mesh({DATA_AXIS: 4, MODEL_AXIS: 2})`` builds a
mesh with the two.

>>> from shardax.mesh import axes
>>> axes.DATA_AXIS, axes.MODEL_AXIS, axes.STAGE_AXIS
('data', 'model', 'stage')
"""

DATA_AXIS = "data"
"""The batch axis: meshes, batch shardings, FSDP and the gradient all-reduce."""

MODEL_AXIS = "model"
"""The tensor-parallel axis: weights split by rules (Megatron-style TP)."""

STAGE_AXIS = "stage"
"""The pipeline axis [`shardax.pipeline`][shardax.pipeline] splits the layers over."""

REPLICA_AXIS = "replica"
"""The replica axis of HSDP meshes (``{"replica": R, "fsdp": F}``): across processes."""

FSDP_AXIS = "fsdp"
"""The sharded axis of HSDP meshes, within a replica."""

CONTEXT_AXIS = "context"
"""The sequence axis of context parallelism ([`shardax.attention`][shardax.attention])."""

EXPERT_AXIS = "expert"
"""The expert axis of expert parallelism ([`shardax.moe`][shardax.moe])."""

ISLAND_AXIS = "island"
"""The axis between DiLoCo's islands (``sx.DiLoCo``): only the outer step crosses it, so
``sx.make_mesh`` puts it across processes (hosts, slices) before any other."""
