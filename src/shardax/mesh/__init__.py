"""Mesh layer: topology-aware meshes, the default axis names, and mesh descriptions."""

from shardax._names import exports as _exports
from shardax.checks import moved as _moved
from shardax.mesh.axes import (
    CONTEXT_AXIS,
    DATA_AXIS,
    EXPERT_AXIS,
    FSDP_AXIS,
    MODEL_AXIS,
    REPLICA_AXIS,
    STAGE_AXIS,
)
from shardax.mesh.make import make_mesh, mesh_info

__all__ = _exports(__name__)

# Names that left this namespace keep working for a minor version (shardax/_names.py MOVED).
__getattr__ = _moved(__name__)
