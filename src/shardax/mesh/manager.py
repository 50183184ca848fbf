"""``DeviceMeshManager``: the seed's facade over :mod:`shardax.mesh.make`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from shardax.mesh.make import MeshSpec, make_mesh, mesh_info


class DeviceMeshManager:
    """Creates device meshes for data, model and hybrid parallelism.

    >>> manager = DeviceMeshManager()
    >>> mesh = manager.create_device_mesh({"data": -1})
    >>> manager.get_mesh_info(mesh)["total_devices"] == manager.num_devices
    True
    """

    def __init__(self, devices: Sequence[Any] | None = None) -> None:
        self._devices = list(jax.devices() if devices is None else devices)

    def create_device_mesh(
        self,
        mesh_shape: MeshSpec,
        devices: Sequence[Any] | None = None,
    ) -> Mesh:
        """A mesh from ``{"data": 2, "model": 1}`` or ``[("data", 2), ("model", 1)]``."""
        return make_mesh(mesh_shape, devices=self._devices if devices is None else devices)

    def create_data_parallel_mesh(
        self, num_devices: int | None = None, axis_name: str = "data"
    ) -> Mesh:
        """A 1-D mesh over ``num_devices`` devices (default: all)."""
        return self.create_device_mesh({axis_name: -1 if num_devices is None else num_devices})

    def create_model_parallel_mesh(
        self, num_devices: int | None = None, axis_name: str = "model"
    ) -> Mesh:
        """A 1-D mesh named ``axis_name`` over ``num_devices`` devices (default: all)."""
        return self.create_device_mesh({axis_name: -1 if num_devices is None else num_devices})

    def create_hybrid_mesh(
        self,
        data_parallel_size: int = 1,
        model_parallel_size: int = 1,
        data_axis: str = "data",
        model_axis: str = "model",
    ) -> Mesh:
        """A 2-D ``(data, model)`` mesh; either size may be -1."""
        return self.create_device_mesh(
            [(data_axis, data_parallel_size), (model_axis, model_parallel_size)]
        )

    def get_mesh_info(self, mesh: Mesh) -> dict[str, Any]:
        """``total_devices`` and ``axes`` of ``mesh`` (see :func:`shardax.mesh.mesh_info`)."""
        return mesh_info(mesh)

    @property
    def num_devices(self) -> int:
        """The number of devices this manager builds meshes from."""
        return len(self._devices)

    @property
    def devices(self) -> list[Any]:
        """The devices this manager builds meshes from."""
        return list(self._devices)
