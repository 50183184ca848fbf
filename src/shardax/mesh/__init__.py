"""Mesh layer: topology-aware meshes, the default axis names, and mesh descriptions."""

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

__all__ = [
    "CONTEXT_AXIS",
    "DATA_AXIS",
    "EXPERT_AXIS",
    "FSDP_AXIS",
    "MODEL_AXIS",
    "REPLICA_AXIS",
    "STAGE_AXIS",
    "make_mesh",
    "mesh_info",
]

# Names that left this namespace (internal now, or moved), by their home; they keep
# working for a release, with a DeprecationWarning.
__getattr__ = _moved(
    __name__,
    {
        "MeshSpec": "shardax.mesh.make.MeshSpec",
        "resolve_mesh_shape": "shardax.mesh.make.resolve_mesh_shape",
    },
)
