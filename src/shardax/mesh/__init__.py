"""Mesh layer: topology-aware meshes, the default axis names, and mesh descriptions."""

from shardax.mesh.axes import (
    CONTEXT_AXIS,
    DATA_AXIS,
    EXPERT_AXIS,
    FSDP_AXIS,
    MODEL_AXIS,
    REPLICA_AXIS,
    STAGE_AXIS,
)
from shardax.mesh.make import MeshSpec, make_mesh, mesh_info, resolve_mesh_shape

__all__ = [
    "CONTEXT_AXIS",
    "DATA_AXIS",
    "EXPERT_AXIS",
    "FSDP_AXIS",
    "MODEL_AXIS",
    "REPLICA_AXIS",
    "STAGE_AXIS",
    "MeshSpec",
    "make_mesh",
    "mesh_info",
    "resolve_mesh_shape",
]
