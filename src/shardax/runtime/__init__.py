"""Runtime layer: devices, hardware detection and the roofline table."""

from shardax.runtime.devices import device_info
from shardax.runtime.hardware import (
    BATCH_SIZE_TABLE,
    HARDWARE_SPECS,
    BatchSizeRecommendation,
    HardwareSpec,
    HardwareType,
    detect_hardware_type,
    get_batch_size_recommendation,
    hardware_type_of,
    validate_batch_size,
)

__all__ = [
    "BATCH_SIZE_TABLE",
    "HARDWARE_SPECS",
    "BatchSizeRecommendation",
    "HardwareSpec",
    "HardwareType",
    "detect_hardware_type",
    "device_info",
    "get_batch_size_recommendation",
    "hardware_type_of",
    "validate_batch_size",
]
