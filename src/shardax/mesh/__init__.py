"""Mesh layer: topology-aware meshes and their description."""

from shardax.mesh.make import DATA_AXIS, MeshSpec, make_mesh, mesh_info, resolve_mesh_shape
from shardax.mesh.manager import DeviceMeshManager

__all__ = [
    "DATA_AXIS",
    "DeviceMeshManager",
    "MeshSpec",
    "make_mesh",
    "mesh_info",
    "resolve_mesh_shape",
]
