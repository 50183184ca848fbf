"""Runtime layer: devices, hardware detection and the roofline table."""

from shardax.runtime.agreement import AgreementError, check_agreement, fingerprint
from shardax.runtime.devices import device_info
from shardax.runtime.distributed import backend_started, initialize, resolve_coordinates
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
from shardax.runtime.processes import (
    device_put_global,
    host_reduce,
    host_value,
    is_main_process,
    print0,
)
from shardax.runtime.watchdog import WATCHDOG_EXIT_CODE, StepWatchdog

__all__ = [
    "BATCH_SIZE_TABLE",
    "HARDWARE_SPECS",
    "WATCHDOG_EXIT_CODE",
    "AgreementError",
    "BatchSizeRecommendation",
    "HardwareSpec",
    "HardwareType",
    "StepWatchdog",
    "backend_started",
    "check_agreement",
    "detect_hardware_type",
    "device_info",
    "device_put_global",
    "fingerprint",
    "get_batch_size_recommendation",
    "hardware_type_of",
    "host_reduce",
    "host_value",
    "initialize",
    "is_main_process",
    "print0",
    "resolve_coordinates",
    "validate_batch_size",
]
