"""Cost layer: hardware figures, roofline, memory per device, HLO collectives and FLOPs.

These are models of what a step costs, apart from the process runtime: datasheet
figures (:mod:`~shardax.cost.hardware`), the roofline (:mod:`~shardax.cost.roofline`),
model-state memory per plan (:mod:`~shardax.cost.memory`), the collectives of a compiled
program (:mod:`~shardax.cost.hlo`), its FLOPs (:mod:`~shardax.cost.flops`), targets:
compile-only devices of a GPU cluster or TPU slice (:mod:`~shardax.cost.compile_target`), and a
compiled step's cost per device with a predicted step time (:func:`~shardax.cost.estimate`,
:mod:`~shardax.cost.predict`).
"""

from shardax.cost.compile_target import (
    GPU_KINDS,
    GPUS_PER_HOST,
    TPU_FAMILIES,
    Target,
    gpu_target_config,
    gpu_target_configs,
    known_targets,
    parse_target,
    target,
)
from shardax.cost.estimation import Estimate, estimate
from shardax.cost.hardware import (
    BATCH_SIZE_TABLE,
    DEVICE_KIND_SPECS,
    HARDWARE_SPECS,
    BatchSizeRecommendation,
    GpuArch,
    HardwareSpec,
    HardwareType,
    detect_hardware_type,
    device_info,
    device_spec,
    get_batch_size_recommendation,
    hardware_type_of,
    validate_batch_size,
)

__all__ = [
    "BATCH_SIZE_TABLE",
    "DEVICE_KIND_SPECS",
    "GPUS_PER_HOST",
    "GPU_KINDS",
    "HARDWARE_SPECS",
    "TPU_FAMILIES",
    "BatchSizeRecommendation",
    "Estimate",
    "GpuArch",
    "HardwareSpec",
    "HardwareType",
    "Target",
    "detect_hardware_type",
    "device_info",
    "device_spec",
    "estimate",
    "get_batch_size_recommendation",
    "gpu_target_config",
    "gpu_target_configs",
    "hardware_type_of",
    "known_targets",
    "parse_target",
    "target",
    "validate_batch_size",
]
