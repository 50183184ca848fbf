"""Cost layer: the table of accelerators, roofline, memory per device, HLO collectives and FLOPs.

These are models of what a step costs, apart from the process runtime: one row per
accelerator kind (``accelerators``: datasheet figures, host, memory budget, calibration), the
seed's hardware API (``hardware``), the roofline (``roofline``), model-state memory per plan
(``memory``), the HLO reader (``hlo``), FLOPs (``flops``) beside model FLOPs by the common
convention (``model_flops``), targets: compile-only devices of a GPU cluster or TPU slice
(``compile_target``), and a compiled step's cost per device with a predicted step time
([`estimate`][shardax.estimate], ``predict``), and the per-op model of a compiled program
(``ops``: its instructions by class; ``opcost``: each priced by a device kind's measured
tables, ``calibration``), and the network between GPU hosts (``network``) with collectives
priced level by level (``nccl``).
"""

from shardax._names import exports as _exports
from shardax.checks import moved as _moved
from shardax.cost.compile_target import Target, target
from shardax.cost.estimation import estimate
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
from shardax.cost.network import Network, named_network
from shardax.cost.report import Estimate

__all__ = _exports(__name__)

# Names that left this namespace keep working for a minor version (shardax/_names.py MOVED).
__getattr__ = _moved(__name__)
