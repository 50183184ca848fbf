"""Hardware: detection, device inventory, the seed's batch-size table and datasheet figures.

>>> import shardax as sx
>>> sx.get_batch_size_recommendation(sx.HardwareType.H100).critical_batch_size
298
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from enum import Enum
from typing import Any

import jax

from shardax.checks import as_bool, as_count, public, received


class HardwareType(Enum):
    """Enumeration of supported hardware types."""

    TPU_V5E = "tpu_v5e"
    TPU_V5P = "tpu_v5p"
    TPU_V4 = "tpu_v4"
    H100 = "h100"
    A100 = "a100"
    V100 = "v100"
    CPU = "cpu"
    UNKNOWN = "unknown"


def as_hardware_type(name: str, value: Any) -> HardwareType:
    """``value`` as a :class:`HardwareType` (a member or its value, ``"h100"``), else
    ``ValueError`` naming ``name``, the value received and the known values.

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


@public("sx.cost.HardwareSpec")
@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    """Public datasheet figures of one accelerator, for roofline estimates.

    Attributes:
        peak_flops: dense bf16 FLOP/s of one device.
        hbm_bandwidth: bytes/s of one device's high-bandwidth memory.
        memory_bytes: bytes of memory on one device.
    """

    peak_flops: float
    hbm_bandwidth: float
    memory_bytes: float

    @property
    def critical_intensity(self) -> float:
        """FLOPs per byte at which compute and memory time are equal (peak ÷ bandwidth)."""
        return self.peak_flops / self.hbm_bandwidth


GiB = 1024**3
HARDWARE_SPECS: dict[HardwareType, HardwareSpec] = {
    HardwareType.TPU_V5E: HardwareSpec(197e12, 819e9, 16 * GiB),
    HardwareType.TPU_V5P: HardwareSpec(459e12, 2765e9, 95 * GiB),
    HardwareType.TPU_V4: HardwareSpec(275e12, 1228e9, 32 * GiB),
    HardwareType.H100: HardwareSpec(989e12, 3350e9, 80 * GiB),
    HardwareType.A100: HardwareSpec(312e12, 2039e9, 80 * GiB),
    HardwareType.V100: HardwareSpec(125e12, 900e9, 16 * GiB),
}


# Device kinds the seed's HardwareType enum does not tell apart or does not name, by the
# kind JAX reports (lower case, matched as a substring; first match wins, so the more
# specific kinds come first). Dense bf16 FLOP/s without sparsity, HBM bytes/s, HBM bytes,
# from the vendors' datasheets.
DEVICE_KIND_SPECS: tuple[tuple[str, str, HardwareSpec], ...] = (
    ("gpu", "h100 pcie", HardwareSpec(756e12, 2000e9, 80 * GiB)),
    ("gpu", "h100 nvl", HardwareSpec(835e12, 3900e9, 94e9)),
    ("gpu", "h800 pcie", HardwareSpec(756e12, 2000e9, 80 * GiB)),
    ("gpu", "h800", HardwareSpec(989e12, 3350e9, 80 * GiB)),
    ("gpu", "gh200 144g", HardwareSpec(989e12, 4900e9, 144e9)),
    ("gpu", "gh200", HardwareSpec(989e12, 4000e9, 96e9)),
    ("gpu", "h200 nvl", HardwareSpec(835e12, 4800e9, 141e9)),
    ("gpu", "h200", HardwareSpec(989e12, 4800e9, 141e9)),
    ("gpu", "gb200", HardwareSpec(2500e12, 8000e9, 186e9)),
    ("gpu", "b200", HardwareSpec(2250e12, 8000e9, 180e9)),
    ("tpu", "v6 lite", HardwareSpec(918e12, 1640e9, 32 * GiB)),
    ("tpu", "v6e", HardwareSpec(918e12, 1640e9, 32 * GiB)),
)


@public("sx.cost.device_spec")
def device_spec(device: Any = None) -> HardwareSpec | None:
    """Datasheet figures of ``device`` (default: the first of ``jax.devices()``), or None
    where they are not known (a CPU, an accelerator in no table).

    The device kind is looked up first in :data:`DEVICE_KIND_SPECS` (accelerators the
    seed's :class:`HardwareType` does not name, such as the H200), then through
    :func:`detect_hardware_type` in :data:`HARDWARE_SPECS`.

    >>> from types import SimpleNamespace
    >>> device_spec(SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")).peak_flops
    989000000000000.0
    >>> device_spec(jax.devices("cpu")[0]) is None
    True
    """
    device = jax.devices()[0] if device is None else device
    platform = str(device.platform).lower()
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    kind = str(device.device_kind or "").lower()
    for on, name, spec in DEVICE_KIND_SPECS:
        if on == platform and name in kind:
            return spec
    return HARDWARE_SPECS.get(hardware_type_of(device.platform, device.device_kind))


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


@public("sx.cost.hardware_type_of")
def hardware_type_of(platform: str, device_kind: str) -> HardwareType:
    """Maps a device's ``platform`` and ``device_kind`` to a :class:`HardwareType`."""
    platform, kind = platform.lower(), str(device_kind or "").lower()
    if platform == "cpu":
        return HardwareType.CPU
    if platform == "tpu":
        if "v5 lite" in kind or "v5e" in kind or "v5litepod" in kind:
            return HardwareType.TPU_V5E
        if "v5p" in kind or kind.strip() == "tpu v5":
            return HardwareType.TPU_V5P
        if "v4" in kind:
            return HardwareType.TPU_V4
        return HardwareType.UNKNOWN
    if platform in ("gpu", "cuda", "rocm"):
        for name, hw in (
            ("h100", HardwareType.H100),
            ("a100", HardwareType.A100),
            ("v100", HardwareType.V100),
        ):
            if name in kind:
                return hw
    return HardwareType.UNKNOWN


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
    ``(False, "... below minimum recommended ...")``. Only a value that is not an
    integer (a string, a float, a bool) raises ``ValueError`` naming ``batch_size``.

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
