"""Hardware: detection, device inventory, the seed's batch-size table, a device's datasheet figures.

>>> import shardax as sx
>>> sx.get_batch_size_recommendation(sx.HardwareType.H100).critical_batch_size
298
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import jax

from shardax.checks import as_bool, as_count, public, received
from shardax.cost.accelerators import ACCELERATORS, HardwareType, accelerator_of, platform_of
from shardax.cost.datasheet import GiB, HardwareSpec


def as_hardware_type(name: str, value: Any) -> HardwareType:
    """``value`` as a [`HardwareType`][shardax.HardwareType] (a member or its value,
    ``"h100"``), else ``ValueError`` naming ``name``, the value received and the known
    values.

    >>> as_hardware_type("hardware_type", "h100")
    <HardwareType.H100: 'h100'>
    """
    try:
        return HardwareType(value)
    except ValueError:
        known = ", ".join(repr(h.value) for h in HardwareType)
        raise ValueError(
            f"{name} must be a HardwareType or one of its values ({known}), got {received(value)}"
        ) from None


@public("sx.BatchSizeRecommendation")
@dataclasses.dataclass(frozen=True)
class BatchSizeRecommendation:
    """Hardware-specific batch size recommendations.

    Attributes:
        min_batch_size: Minimum batch size for reasonable efficiency.
        optimal_batch_size: Optimal batch size for peak throughput.
        critical_batch_size: Critical batch size for reaching roofline (per JAX guide).
        max_memory_batch_size: Maximum batch size before OOM (estimate).
        notes: Additional notes about the recommendation.
    """

    min_batch_size: int
    optimal_batch_size: int
    critical_batch_size: int
    max_memory_batch_size: int | None = None
    notes: str = ""

    def __post_init__(self) -> None:  # sizes of at least one example, in order
        for name in ("min_batch_size", "optimal_batch_size", "critical_batch_size"):
            object.__setattr__(self, name, as_count(name, getattr(self, name)))
        if self.max_memory_batch_size is not None:
            size = as_count("max_memory_batch_size (or None)", self.max_memory_batch_size)
            object.__setattr__(self, "max_memory_batch_size", size)
        if self.min_batch_size > self.optimal_batch_size:
            raise ValueError(
                f"min_batch_size must be <= optimal_batch_size, got {self.min_batch_size} > "
                f"{self.optimal_batch_size}"
            )


_R = BatchSizeRecommendation
# The table of seed 000, verbatim.
BATCH_SIZE_TABLE: dict[HardwareType, BatchSizeRecommendation] = {
    HardwareType.TPU_V5E: _R(64, 256, 240, notes="Critical batch size for reaching roofline"),
    HardwareType.TPU_V5P: _R(128, 512, 480, notes="Higher throughput, needs larger batches"),
    HardwareType.TPU_V4: _R(64, 256, 192, notes="Similar to v5e, slightly lower critical"),
    HardwareType.H100: _R(64, 320, 298, notes="Critical batch size for roofline"),
    HardwareType.A100: _R(32, 256, 240, notes="For 80GB variant"),
    HardwareType.V100: _R(16, 128, 96, notes="Memory-limited on 16GB variant"),
    HardwareType.CPU: _R(1, 32, 16, notes="Memory-bandwidth bound"),
}
# Not in the seed's table: conservative values, and a note that says so.
_UNKNOWN = _R(
    32,
    128,
    64,
    notes="Unknown hardware: not in the recommendation table; these are conservative guesses, "
    "measure with `shardax tune-batch`.",
)


HARDWARE_SPECS: dict[HardwareType, HardwareSpec] = {}
"""The datasheet figures of each [`HardwareType`][shardax.HardwareType]: those of the first
row of ``shardax.cost.accelerators.ACCELERATORS`` detected as it (a view of the table)."""
for _row in ACCELERATORS.values():
    if _row.hardware_type is not None and _row.spec is not None:
        HARDWARE_SPECS.setdefault(_row.hardware_type, _row.spec)
DEVICE_KIND_SPECS: tuple[tuple[str, str, HardwareSpec], ...] = tuple(
    (r.platform, r.kind.lower(), r.spec)
    for r in ACCELERATORS.values()
    if r.spec is not None and r.hardware_type is None
)
"""``(platform, kind, figures)`` of the rows the seed's ``HardwareType`` does not name (a
view of the table, for the name it replaced; ``shardax.cost.accelerators`` is the table)."""


def is_gpu(device: Any) -> bool:
    """Whether ``device`` (a JAX device, or anything with a ``platform``) is a GPU: JAX
    names the platform ``gpu``, ``cuda`` or ``rocm``.

    >>> is_gpu(jax.devices("cpu")[0])
    False
    """
    return str(getattr(device, "platform", "")).lower() in ("gpu", "cuda", "rocm")


@public("sx.cost.device_spec")
def device_spec(device: Any = None) -> HardwareSpec | None:
    """Datasheet figures of ``device`` (default: the first of ``jax.devices()``), or None
    where they are not known (a CPU, an accelerator in no table).

    The device is matched to its row of the table of accelerators
    (``shardax.cost.accelerators.accelerator_of``), whose figures these are.

    >>> from types import SimpleNamespace
    >>> device_spec(SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")).peak_flops
    989000000000000.0
    >>> device_spec(jax.devices("cpu")[0]) is None
    True
    """
    device = jax.devices()[0] if device is None else device
    row = accelerator_of(device)
    return row.spec if row is not None else None


@public("sx.cost.detect_hardware_type")
def detect_hardware_type(devices: Sequence[Any] | None = None) -> HardwareType:
    """Detects the hardware type of the first device (default: ``jax.devices()``).

    A GPU or TPU whose kind is not in the table is ``HardwareType.UNKNOWN``; it is
    never presented as a neighbouring model.

    >>> detect_hardware_type()  # on a CPU-only machine
    <HardwareType.CPU: 'cpu'>
    """
    devices = jax.devices() if devices is None else devices
    if not devices:
        return HardwareType.UNKNOWN
    return hardware_type_of(devices[0].platform, devices[0].device_kind)


def hardware_type_of(platform: str, device_kind: str) -> HardwareType:
    """Maps a device's ``platform`` and ``device_kind`` to a
    [`HardwareType`][shardax.HardwareType]: its row's (``shardax.cost.accelerators``)."""
    device = SimpleNamespace(platform=platform, device_kind=device_kind)
    if platform_of(device) == "cpu":
        return HardwareType.CPU
    row = accelerator_of(device)
    return row.hardware_type if row is not None and row.hardware_type else HardwareType.UNKNOWN


@public("sx.get_batch_size_recommendation")
def get_batch_size_recommendation(
    hardware_type: HardwareType | None = None,
) -> BatchSizeRecommendation:
    """Get batch size recommendation for current or specified hardware.

    Args:
        hardware_type: Hardware type to get recommendation for; None detects it.

    Returns:
        BatchSizeRecommendation with hardware-specific values. For
        ``HardwareType.UNKNOWN`` its ``notes`` say the values are guesses.
    """
    hw = (
        detect_hardware_type()
        if hardware_type is None
        else as_hardware_type("hardware_type", hardware_type)
    )
    return BATCH_SIZE_TABLE.get(hw, _UNKNOWN)


def memory_bytes(hardware_type: HardwareType) -> float | None:
    """The memory of one device of ``hardware_type``: its datasheet's (``HARDWARE_SPECS``),
    this host's for a CPU, else None (``UNKNOWN``)."""
    spec = HARDWARE_SPECS.get(hardware_type)
    if spec is not None:
        return spec.memory_bytes
    if hardware_type is HardwareType.CPU:
        with contextlib.suppress(ValueError, OSError, AttributeError):  # no sysconf here
            return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return None


@public("sx.cost.validate_batch_size")
def validate_batch_size(
    batch_size: int,
    hardware_type: HardwareType | None = None,
    warn_suboptimal: bool = True,
) -> tuple[bool, str]:
    """Checks ``batch_size`` against the table; returns ``(is_valid, message)``.

    The message is the seed's: it says "below minimum recommended", "below critical
    size", "optimal" or "acceptable", naming the size, the threshold and the hardware.
    Any integer is judged, as the seed judges it: 0 or a negative size is
    ``(False, "... below minimum recommended ...")``. A value that is not an integer (a
    string, a float, a bool) raises ``ValueError`` naming ``batch_size``, and so does a
    size one device could not hold at one byte per example (more examples than the bytes
    of its memory: the datasheet's, or this host's for a CPU), such as ``10**12``.

    >>> validate_batch_size(64, HardwareType.H100)[0]
    True
    >>> validate_batch_size(0, HardwareType.CPU)[0]
    False
    """
    batch_size = as_count("batch_size", batch_size, minimum=None)
    warn_suboptimal = as_bool("warn_suboptimal", warn_suboptimal)
    hw = (
        detect_hardware_type()
        if hardware_type is None
        else as_hardware_type("hardware_type", hardware_type)
    )
    memory = memory_bytes(hw)
    if memory is not None and batch_size > memory:
        raise ValueError(
            f"batch_size must be a number of examples one {hw.value} device can hold, at "
            f"least one byte each: at most its {memory / GiB:.4g} GiB of memory, "
            f"{int(memory):,} examples; got {batch_size:,}"
        )
    rec = get_batch_size_recommendation(hw)
    where = f"for {hw.value}"
    if batch_size < rec.min_batch_size:
        return False, (
            f"Batch size {batch_size} is below minimum recommended {rec.min_batch_size} {where}. "
            "Performance will be significantly degraded."
            + (" A batch holds at least 1 example." if batch_size < 1 else "")
        )
    if batch_size < rec.critical_batch_size and warn_suboptimal:
        return True, (
            f"Batch size {batch_size} is below critical size {rec.critical_batch_size} {where}. "
            "Consider increasing for optimal throughput."
        )
    if batch_size >= rec.optimal_batch_size:
        return True, f"Batch size {batch_size} is optimal {where}."
    return True, f"Batch size {batch_size} is acceptable {where}."


@public("sx.cost.device_info")
def device_info(devices: Sequence[Any] | None = None) -> dict[str, Any]:
    """Describes ``devices`` (default: all devices of all processes).

    Returns a dict with ``num_devices``, ``hardware_type``, ``platforms``,
    ``device_kinds``, ``process_count`` and ``devices`` (one dict per device with
    ``id``, ``platform``, ``device_kind`` and ``process_index``).

    >>> device_info()["num_devices"] >= 1
    True
    """
    devices = list(jax.devices() if devices is None else devices)
    return {
        "num_devices": len(devices),
        "hardware_type": detect_hardware_type(devices).value,
        "platforms": sorted({d.platform for d in devices}),
        "device_kinds": sorted({str(d.device_kind) for d in devices}),
        "process_count": len({d.process_index for d in devices}),
        "devices": [
            {
                "id": d.id,
                "platform": d.platform,
                "device_kind": str(d.device_kind),
                "process_index": d.process_index,
            }
            for d in devices
        ],
    }
