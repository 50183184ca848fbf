"""``DevicePlacement``: the seed's facade over the placement and runtime functions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import Mesh, Sharding

from shardax.data import placement
from shardax.data.prefetch import prefetch_to_device
from shardax.runtime.devices import device_info
from shardax.runtime.hardware import (
    BatchSizeRecommendation,
    HardwareType,
    detect_hardware_type,
    get_batch_size_recommendation,
    validate_batch_size,
)


class DevicePlacement:
    """Places pytrees on devices and gives hardware-aware batch-size advice.

    >>> placement = DevicePlacement()
    >>> placement.hardware_type  # on a CPU-only machine
    <HardwareType.CPU: 'cpu'>
    """

    def __init__(self, default_device: Any | None = None) -> None:
        self.default_device = jax.local_devices()[0] if default_device is None else default_device
        self._hardware_type = detect_hardware_type()

    def place_on_device(self, data: Any, device: Any | None = None) -> Any:
        """Commits ``data`` to ``device`` (default: this object's default device)."""
        return placement.place_on_device(data, self.default_device if device is None else device)

    def distribute_batch(self, data: Any, sharding: Sharding) -> Any:
        """Places ``data`` with ``sharding``; see :func:`shardax.distribute_batch`."""
        return placement.distribute_batch(data, sharding)

    def replicate_across_devices(self, data: Any, devices: list[Any] | None = None) -> Any:
        """Copies ``data`` whole onto every device of ``devices`` (default: all)."""
        return placement.replicate_across_devices(data, devices)

    def shard_batch_dim(
        self, data: Any, mesh: Mesh, batch_axis: int = 0, mesh_axis: str = "data"
    ) -> Any:
        """Splits dimension ``batch_axis`` of every leaf over ``mesh_axis``."""
        return placement.shard_batch_dim(data, mesh, batch_axis, mesh_axis)

    def prefetch_to_device(
        self, data_iterator: Iterator[Any], device: Any | None = None, buffer_size: int = 2
    ) -> Iterator[Any]:
        """Prefetches onto ``device`` (a Device, Sharding or Mesh; default: the default
        device); see :func:`shardax.prefetch_to_device`."""
        target = self.default_device if device is None else device
        return prefetch_to_device(data_iterator, target, buffer_size)

    def get_batch_size_recommendation(
        self, hardware_type: HardwareType | None = None
    ) -> BatchSizeRecommendation:
        """The table's recommendation for ``hardware_type`` (default: the detected one)."""
        return get_batch_size_recommendation(
            self._hardware_type if hardware_type is None else hardware_type
        )

    def validate_batch_size(
        self, batch_size: int, warn_suboptimal: bool = True
    ) -> tuple[bool, str]:
        """``(is_valid, message)`` for ``batch_size`` on the detected hardware."""
        return validate_batch_size(batch_size, self._hardware_type, warn_suboptimal)

    def get_device_info(self) -> dict[str, Any]:
        """``num_devices``, ``hardware_type`` (this object's), ``platforms``, ``device_kinds``
        and ``devices``; see :func:`shardax.device_info`."""
        return {**device_info(), "hardware_type": self._hardware_type.value}

    @property
    def hardware_type(self) -> HardwareType:
        """The detected hardware type."""
        return self._hardware_type

    @property
    def num_devices(self) -> int:
        """The number of devices of all processes."""
        return jax.device_count()
