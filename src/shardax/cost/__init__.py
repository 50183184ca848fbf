"""Cost layer: hardware figures, roofline, memory per device, HLO collectives and FLOPs.

These are models of what a step costs, apart from the process runtime: datasheet
figures (:mod:`~shardax.cost.hardware`), the roofline (:mod:`~shardax.cost.roofline`),
model-state memory per plan (:mod:`~shardax.cost.memory`), the collectives of a compiled
program (:mod:`~shardax.cost.hlo`), its FLOPs (:mod:`~shardax.cost.flops`) beside model
FLOPs by the common convention (:mod:`~shardax.cost.model_flops`), targets:
compile-only devices of a GPU cluster or TPU slice (:mod:`~shardax.cost.compile_target`), and a
compiled step's cost per device with a predicted step time (:func:`~shardax.cost.estimate`,
:mod:`~shardax.cost.predict`), and the per-op model of a compiled program
(:mod:`~shardax.cost.ops`: its instructions by class; :mod:`~shardax.cost.opcost`: each
priced by a device kind's measured tables, :mod:`~shardax.cost.calibration`).
"""

from shardax.checks import moved as _moved
from shardax.cost.compile_target import Target, target
from shardax.cost.estimation import Estimate, estimate
from shardax.cost.hardware import (
    BatchSizeRecommendation,
    HardwareSpec,
    HardwareType,
    detect_hardware_type,
    device_info,
    device_spec,
    get_batch_size_recommendation,
    validate_batch_size,
)

__all__ = [
    "BatchSizeRecommendation",
    "Estimate",
    "HardwareSpec",
    "HardwareType",
    "Target",
    "detect_hardware_type",
    "device_info",
    "device_spec",
    "estimate",
    "get_batch_size_recommendation",
    "target",
    "validate_batch_size",
]

# Names that left this namespace (internal now, or moved), by their home; they keep
# working for a release, with a DeprecationWarning.
__getattr__ = _moved(
    __name__,
    {
        "BATCH_SIZE_TABLE": "shardax.cost.hardware.BATCH_SIZE_TABLE",
        "DEVICE_KIND_SPECS": "shardax.cost.hardware.DEVICE_KIND_SPECS",
        "GPUS_PER_HOST": "shardax.cost.compile_target.GPUS_PER_HOST",
        "GPU_KINDS": "shardax.cost.compile_target.GPU_KINDS",
        "GpuArch": "shardax.cost.hardware.GpuArch",
        "HARDWARE_SPECS": "shardax.cost.hardware.HARDWARE_SPECS",
        "TPU_FAMILIES": "shardax.cost.compile_target.TPU_FAMILIES",
        "gpu_target_config": "shardax.cost.compile_target.gpu_target_config",
        "gpu_target_configs": "shardax.cost.compile_target.gpu_target_configs",
        "hardware_type_of": "shardax.cost.hardware.hardware_type_of",
        "known_targets": "shardax.cost.compile_target.known_targets",
        "parse_target": "shardax.cost.compile_target.parse_target",
    },
)
