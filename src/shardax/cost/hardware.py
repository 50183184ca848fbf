"""Hardware: detection, device inventory, the seed's batch-size table and datasheet figures.

>>> import shardax as sx
>>> sx.get_batch_size_recommendation(sx.HardwareType.H100).critical_batch_size
298
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
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
    """``value`` as a [`HardwareType`][shardax.HardwareType] (a member or its value, ``"h100"``),
    else
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


@dataclasses.dataclass(frozen=True)
class GpuArch:
    """What XLA's GPU compiler needs to know of a GPU beyond its datasheet row: the
    fields of the target configs that [`shardax.cost.target`][shardax.target] compiles for
    (``shardax.cost.compile_target.gpu_target_config``).

    Attributes:
        compute_capability: CUDA compute capability, ``(major, minor)``.
        sm_count: streaming multiprocessors.
        clock_ghz: boost clock in GHz.
        l2_cache_bytes: L2 cache bytes.
        shared_memory_per_sm: shared memory bytes per multiprocessor.
        shared_memory_per_block_optin: shared memory bytes a block may opt in to.
        fpus_per_sm: FP32 units per multiprocessor.
    """

    compute_capability: tuple[int, int]
    sm_count: int
    clock_ghz: float
    l2_cache_bytes: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    fpus_per_sm: int = 128


@public("sx.cost.HardwareSpec")
@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    """Public datasheet figures of one accelerator, for roofline estimates and targets.

    Attributes:
        peak_flops: dense bf16 FLOP/s of one device (no sparsity).
        hbm_bandwidth: bytes/s of one device's high-bandwidth memory.
        memory_bytes: bytes of memory on one device.
        ici_bandwidth: bytes/s one way per device over the fast links: NVLink within a
            GPU host, ICI within a TPU slice (the datasheets' bidirectional figure halved).
            None where not known.
        dcn_bandwidth: bytes/s one way per device over the slower network: InfiniBand
            between GPU hosts (the NIC bandwidth of a reference 8-GPU server, per GPU),
            DCN between TPU slices. None where not known.
        source: where the figures come from.
        gpu: the GPU's compiler description (``GpuArch``) for GPU targets, else None.
    """

    peak_flops: float
    hbm_bandwidth: float
    memory_bytes: float
    ici_bandwidth: float | None = None
    dcn_bandwidth: float | None = None
    source: str = ""
    gpu: GpuArch | None = None

    @property
    def critical_intensity(self) -> float:
        """FLOPs per byte at which compute and memory time are equal (peak ÷ bandwidth)."""
        return self.peak_flops / self.hbm_bandwidth


GiB = 1024**3
KiB = 1024
MiB = 1024**2
# Link figures are per device and one way: NVLink 4 (H100, H200) 900 GB/s bidirectional ->
# 450e9; NVLink 5 (B200) 1.8 TB/s -> 900e9; NVLink 3 (A100) 600 GB/s -> 300e9. Between hosts
# the reference servers (DGX H100/H200/B200: eight 400 Gb/s ConnectX-7; DGX A100: eight
# 200 Gb/s HDR) give each GPU one NIC: 50e9 and 25e9 bytes/s. TPU ICI: the Cloud TPU pages'
# bidirectional per-chip figure halved; DCN: the per-host NICs over the host's chips.
_H100 = (
    "NVIDIA H100 SXM datasheet; DGX H100 user guide (8x ConnectX-7 400 Gb/s); memory: "
    "81,559 MiB, as nvidia-smi reports the H100 lent to this project (the datasheet's '80GB')"
)
_A100 = "NVIDIA A100 80GB SXM datasheet; DGX A100 user guide (8x HDR 200 Gb/s)"
_V4 = "cloud.google.com/tpu/docs/v4"
_V5E = "cloud.google.com/tpu/docs/v5e (ICI 400 GB/s bidirectional; 2x100 Gb/s NICs per 8 chips)"
_V5P = "cloud.google.com/tpu/docs/v5p (ICI 1200 GB/s bidirectional; DCN 50 Gb/s per chip)"
_V6E = "cloud.google.com/tpu/docs/v6e (ICI 800 GB/s bidirectional; 4x200 Gb/s NICs per 8 chips)"
HARDWARE_SPECS: dict[HardwareType, HardwareSpec] = {
    HardwareType.TPU_V5E: HardwareSpec(197e12, 819e9, 16 * GiB, 200e9, 3.125e9, _V5E),
    HardwareType.TPU_V5P: HardwareSpec(459e12, 2765e9, 95 * GiB, 600e9, 6.25e9, _V5P),
    HardwareType.TPU_V4: HardwareSpec(275e12, 1228e9, 32 * GiB, _V4),
    HardwareType.H100: HardwareSpec(
        989e12, 3350e9, 81559 * MiB, 450e9, 50e9, _H100,
        GpuArch((9, 0), 132, 1.98, 50 * MiB, 228 * KiB, 227 * KiB),
    ),
    HardwareType.A100: HardwareSpec(
        312e12, 2039e9, 80 * GiB, 300e9, 25e9, _A100,
        GpuArch((8, 0), 108, 1.41, 40 * MiB, 164 * KiB, 163 * KiB, fpus_per_sm=64),
    ),
    HardwareType.V100: HardwareSpec(125e12, 900e9, 16 * GiB, source="NVIDIA V100 SXM2 datasheet"),
}  # fmt: skip


# Device kinds the seed's HardwareType enum does not tell apart or does not name, by the
# kind JAX reports (lower case, matched as a substring; first match wins, so the more
# specific kinds come first). Dense bf16 FLOP/s without sparsity, HBM bytes/s, HBM bytes,
# from the vendors' datasheets (each row names its source).
_H200 = (
    "NVIDIA H200 SXM datasheet; DGX H200 user guide (8x ConnectX-7 400 Gb/s); memory: "
    "143,771 MiB, as nvidia-smi reports the H200 lent to this project (the datasheet's "
    "'141 GB')"
)
_B200 = "NVIDIA DGX/HGX B200 datasheet (per GPU: 1/8 of the 8-GPU figures; 8x ConnectX-7 400 Gb/s)"
DEVICE_KIND_SPECS: tuple[tuple[str, str, HardwareSpec], ...] = (
    ("gpu", "h100 pcie", HardwareSpec(756e12, 2000e9, 80 * GiB, source="H100 PCIe datasheet")),
    ("gpu", "h100 nvl", HardwareSpec(835e12, 3900e9, 94e9, source="NVIDIA H100 NVL datasheet")),
    ("gpu", "h800 pcie", HardwareSpec(756e12, 2000e9, 80 * GiB, source="H800 PCIe datasheet")),
    ("gpu", "h800", HardwareSpec(989e12, 3350e9, 80 * GiB, source="NVIDIA H800 SXM datasheet")),
    ("gpu", "gh200 144g", HardwareSpec(989e12, 4900e9, 144e9, source="NVIDIA GH200 datasheet")),
    ("gpu", "gh200", HardwareSpec(989e12, 4000e9, 96e9, source="NVIDIA GH200 datasheet")),
    ("gpu", "h200 nvl", HardwareSpec(835e12, 4800e9, 141e9, source="NVIDIA H200 NVL datasheet")),
    ("gpu", "h200", HardwareSpec(
        989e12, 4800e9, 143771 * MiB, 450e9, 50e9, _H200,
        GpuArch((9, 0), 132, 1.98, 50 * MiB, 228 * KiB, 227 * KiB),
    )),
    ("gpu", "gb200", HardwareSpec(2500e12, 8000e9, 186e9, source="NVIDIA GB200 NVL72 datasheet")),
    ("gpu", "b200", HardwareSpec(
        2250e12, 8000e9, 180e9, 900e9, 50e9, _B200,
        GpuArch((10, 0), 148, 1.965, 126 * MiB, 228 * KiB, 227 * KiB),
    )),
    ("tpu", "v6 lite", HardwareSpec(918e12, 1640e9, 32 * GiB, 400e9, 12.5e9, _V6E)),
    ("tpu", "v6e", HardwareSpec(918e12, 1640e9, 32 * GiB, 400e9, 12.5e9, _V6E)),
)  # fmt: skip


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

    The device kind is looked up first in ``DEVICE_KIND_SPECS`` (accelerators the
    seed's [`HardwareType`][shardax.HardwareType] does not name, such as the H200), then through
    [`detect_hardware_type`][shardax.cost.detect_hardware_type] in ``HARDWARE_SPECS``.

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


def hardware_type_of(platform: str, device_kind: str) -> HardwareType:
    """Maps a device's ``platform`` and ``device_kind`` to a
    [`HardwareType`][shardax.HardwareType]."""
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
