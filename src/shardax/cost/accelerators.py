"""The table of accelerators: one row per kind, everything shardax knows of it.

A row (``Accelerator``) holds a kind's one spelling (``"H100"``: in target names,
calibrations, reports), the words of the device kinds JAX reports for it, its datasheet
figures, the host a target of it comes in (devices per host, the network between hosts), the
rule of its memory budget, its TPU slices, and its measured tables (a file of
``shardax/cost/tables/``). Every look-up of a kind in ``shardax.cost`` reads ``ACCELERATORS``,
so a new kind is one row here plus its table file (CONTRIBUTING: "Adding an accelerator").

>>> from types import SimpleNamespace
>>> accelerator_of(SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")).kind
'H100'
>>> kind_of("NVIDIA H100 PCIe"), kind_of("TPU v5 lite"), kind_of("NVIDIA L4")
('H100-PCIe', 'v5e', 'NVIDIA L4')
>>> named("a100-80gb").device_kind, named("v5litepod").kind
('NVIDIA A100-SXM4-80GB', 'v5e')
"""

from __future__ import annotations

import dataclasses
import re
from enum import Enum
from typing import Any

from shardax.cost.datasheet import GiB, GpuArch, HardwareSpec, KiB, MiB, TpuSlices


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


BUDGETS = ("allocator", "datasheet")
"""The rules of a kind's memory budget: ``"allocator"``, JAX's allocator takes a share of
the memory (``XLA_CLIENT_MEM_FRACTION``, ``shardax.cost.budget``) and programs are planned
in it; ``"datasheet"``, programs are planned in all of it (a TPU)."""


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One kind of accelerator: a row of ``ACCELERATORS``.

    Attributes:
        kind: its one spelling (``"H100"``, ``"A100-80GB"``, ``"v5p"``): a target's name
            (``"8xH100"``), a calibration's kind, the reports' word.
        platform: ``"gpu"`` or ``"tpu"``.
        matches: how JAX's device kinds name it: each entry a few words that must all be
            words of the device kind (case-insensitive); the entry of the most words wins
            across rows (``"h100 pcie"`` over ``"h100"``), then the first row.
        device_kind: the device kind its target's devices report.
        spec: its datasheet figures; None for a kind known by name only (priced from its
            calibration, ``shardax.cost.figures``).
        hardware_type: the seed's [`HardwareType`][shardax.HardwareType] its devices are
            detected as (None: ``UNKNOWN``); the first row of a type gives its figures.
        host_devices: the devices of one host of a GPU target (an HGX/DGX server: one
            NVLink domain, the server its datasheet's link figures describe); None: no GPU
            target of this kind.
        network: the named network between its hosts when a target names none
            (``shardax.cost.network.NETWORKS``: the reference server's), else None.
        memory_budget: the rule of the memory programs are planned in (``BUDGETS``).
        tpu: its slices (``TpuSlices``) for TPU targets, else None.
        calibration: its measured tables: a file of ``shardax/cost/tables/`` (or a path),
            ``shardax calibrate --out``'s; None where not measured.
        aliases: other spellings of ``kind`` in target names (``"v5litepod"``).
    """

    kind: str
    platform: str
    matches: tuple[str, ...]
    device_kind: str = ""
    spec: HardwareSpec | None = None
    hardware_type: HardwareType | None = None
    host_devices: int | None = None
    network: str | None = None
    memory_budget: str = "datasheet"
    tpu: TpuSlices | None = None
    calibration: str | None = None
    aliases: tuple[str, ...] = ()


# Link figures are per device and one way: NVLink 4 (H100, H200) 900 GB/s bidirectional ->
# 450e9; NVLink 5 (B200) 1.8 TB/s -> 900e9; NVLink 3 (A100) 600 GB/s -> 300e9. Between hosts
# the reference servers (DGX H100/H200/B200: eight 400 Gb/s ConnectX-7; DGX A100: eight
# 200 Gb/s HDR) give each GPU one NIC: 50e9 and 25e9 bytes/s. TPU ICI: the Cloud TPU pages'
# bidirectional per-chip figure halved; DCN: the per-host NICs over the host's chips.
# Dense bf16 FLOP/s without sparsity, HBM bytes/s, HBM bytes, from the vendors' datasheets.
_HOPPER = GpuArch((9, 0), 132, 1.98, 50 * MiB, 228 * KiB, 227 * KiB)
_TORUS_2D = {
    **{1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4"},
    **{32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
}
_GPU_HOST = {"host_devices": 8, "memory_budget": "allocator"}
_ROWS = (
    Accelerator(
        "H100", "gpu", ("h100",), "NVIDIA H100 80GB HBM3",
        HardwareSpec(
            989e12, 3350e9, 81559 * MiB, 450e9, 50e9,
            "NVIDIA H100 SXM datasheet; DGX H100 user guide (8x ConnectX-7 400 Gb/s); memory: "
            "81,559 MiB, as nvidia-smi reports the H100 lent to this project (the datasheet's "
            "'80GB')",
            _HOPPER,
        ),
        HardwareType.H100, network="ib-ndr", calibration="h100-2026-11-27.json", **_GPU_HOST,
    ),
    Accelerator(
        "H100-PCIe", "gpu", ("h100 pcie",),
        spec=HardwareSpec(756e12, 2000e9, 80 * GiB, source="H100 PCIe datasheet"),
        hardware_type=HardwareType.H100,
    ),
    Accelerator(
        "H100-NVL", "gpu", ("h100 nvl",),
        spec=HardwareSpec(835e12, 3900e9, 94e9, source="NVIDIA H100 NVL datasheet"),
        hardware_type=HardwareType.H100,
    ),
    Accelerator(
        "H800-PCIe", "gpu", ("h800 pcie",),
        spec=HardwareSpec(756e12, 2000e9, 80 * GiB, source="H800 PCIe datasheet"),
    ),
    Accelerator(
        "H800", "gpu", ("h800",),
        spec=HardwareSpec(989e12, 3350e9, 80 * GiB, source="NVIDIA H800 SXM datasheet"),
    ),
    Accelerator("H20", "gpu", ("h20",)),
    Accelerator(
        "GH200-144G", "gpu", ("gh200 144g",),
        spec=HardwareSpec(989e12, 4900e9, 144e9, source="NVIDIA GH200 datasheet"),
    ),
    Accelerator(
        "GH200", "gpu", ("gh200",),
        spec=HardwareSpec(989e12, 4000e9, 96e9, source="NVIDIA GH200 datasheet"),
    ),
    Accelerator(
        "H200-NVL", "gpu", ("h200 nvl",),
        spec=HardwareSpec(835e12, 4800e9, 141e9, source="NVIDIA H200 NVL datasheet"),
    ),
    Accelerator(
        "H200", "gpu", ("h200",), "NVIDIA H200",
        HardwareSpec(
            989e12, 4800e9, 143771 * MiB, 450e9, 50e9,
            "NVIDIA H200 SXM datasheet; DGX H200 user guide (8x ConnectX-7 400 Gb/s); memory: "
            "143,771 MiB, as nvidia-smi reports the H200 lent to this project (the datasheet's "
            "'141 GB')",
            _HOPPER,
        ),
        network="ib-ndr", calibration="h200-2026-11-27.json", **_GPU_HOST,
    ),
    Accelerator(
        "GB200", "gpu", ("gb200",),
        spec=HardwareSpec(2500e12, 8000e9, 186e9, source="NVIDIA GB200 NVL72 datasheet"),
    ),
    Accelerator(
        "B200", "gpu", ("b200",), "NVIDIA B200",
        HardwareSpec(
            2250e12, 8000e9, 180e9, 900e9, 50e9,
            "NVIDIA DGX/HGX B200 datasheet (per GPU: 1/8 of the 8-GPU figures; 8x ConnectX-7 "
            "400 Gb/s)",
            GpuArch((10, 0), 148, 1.965, 126 * MiB, 228 * KiB, 227 * KiB),
        ),
        network="ib-ndr", **_GPU_HOST,
    ),
    Accelerator(
        "A100-80GB", "gpu", ("a100",), "NVIDIA A100-SXM4-80GB",
        HardwareSpec(
            312e12, 2039e9, 80 * GiB, 300e9, 25e9,
            "NVIDIA A100 80GB SXM datasheet; DGX A100 user guide (8x HDR 200 Gb/s)",
            GpuArch((8, 0), 108, 1.41, 40 * MiB, 164 * KiB, 163 * KiB, fpus_per_sm=64),
        ),
        HardwareType.A100, network="ib-hdr", **_GPU_HOST,
    ),
    Accelerator(
        "A100-40GB", "gpu", ("a100 40gb",),
        spec=HardwareSpec(
            312e12, 1555e9, 40 * GiB, 300e9, 25e9,
            "NVIDIA A100 datasheet (40GB SXM); DGX A100 user guide (8x HDR 200 Gb/s)",
        ),
        hardware_type=HardwareType.A100, network="ib-hdr",
    ),
    Accelerator(
        "V100", "gpu", ("v100",),
        spec=HardwareSpec(125e12, 900e9, 16 * GiB, source="NVIDIA V100 SXM2 datasheet"),
        hardware_type=HardwareType.V100,
    ),
    Accelerator(
        "v5p", "tpu", ("v5p", "v5"), "TPU v5",
        HardwareSpec(
            459e12, 2765e9, 95 * GiB, 600e9, 6.25e9,
            "cloud.google.com/tpu/docs/v5p (ICI 1200 GB/s bidirectional; DCN 50 Gb/s per chip)",
        ),
        HardwareType.TPU_V5P,
        # cloud.google.com/tpu/docs/v5p: slice shapes 2x2x1 (4 chips) to 16x16x24 (6144 chips).
        tpu=TpuSlices("v5p", 2, {
            4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
            256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16",
            6144: "16x16x24"}),
    ),
    Accelerator(
        "v5e", "tpu", ("v5 lite", "v5e", "v5litepod"), "TPU v5 lite",
        HardwareSpec(
            197e12, 819e9, 16 * GiB, 200e9, 3.125e9,
            "cloud.google.com/tpu/docs/v5e (ICI 400 GB/s bidirectional; 2x100 Gb/s NICs per 8 "
            "chips)",
        ),
        HardwareType.TPU_V5E, tpu=TpuSlices("v5e", 1, _TORUS_2D, one_host=8),
        aliases=("v5litepod",),
    ),
    Accelerator(
        "v6e", "tpu", ("v6 lite", "v6e"), "TPU v6 lite",
        HardwareSpec(
            918e12, 1640e9, 32 * GiB, 400e9, 12.5e9,
            "cloud.google.com/tpu/docs/v6e (ICI 800 GB/s bidirectional; 4x200 Gb/s NICs per 8 "
            "chips)",
        ),
        tpu=TpuSlices("v6e", 1, _TORUS_2D, one_host=8),
    ),
    Accelerator(
        "v4", "tpu", ("v4",), "TPU v4",
        HardwareSpec(275e12, 1228e9, 32 * GiB, source="cloud.google.com/tpu/docs/v4"),
        HardwareType.TPU_V4,
    ),
)  # fmt: skip
ACCELERATORS: dict[str, Accelerator] = {row.kind: row for row in _ROWS}
"""The table: every accelerator kind shardax knows, by its one spelling (``kind``)."""


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", str(text).lower()))


def platform_of(device: Any) -> str:
    """``device``'s platform as the table spells it: ``"gpu"`` for JAX's ``gpu``, ``cuda``
    and ``rocm``, else JAX's own (``"tpu"``, ``"cpu"``)."""
    platform = str(getattr(device, "platform", "")).lower()
    return "gpu" if platform in ("cuda", "rocm") else platform


def matching(device_kind: str, platform: str | None = None) -> Accelerator | None:
    """The row of a device kind as JAX reports it (``"NVIDIA H100 80GB HBM3"``), on
    ``platform`` if given: the row with the most specific entry of ``matches`` whose words
    are all the kind's; None where no row names it.

    >>> matching("NVIDIA A100-SXM4-40GB").kind, matching("NVIDIA GH200 480GB").kind
    ('A100-40GB', 'GH200')
    """
    words = _words(device_kind)
    best, most = None, 0
    for row in ACCELERATORS.values():
        if platform is not None and row.platform != platform:
            continue
        for entry in row.matches:
            wanted = entry.split()
            if len(wanted) > most and all(w in words for w in wanted):
                best, most = row, len(wanted)
    return best


def accelerator_of(device: Any) -> Accelerator | None:
    """The row of ``device`` (a JAX device, or anything with ``platform`` and
    ``device_kind``), else None (a CPU, a kind in no row)."""
    return matching(str(getattr(device, "device_kind", "") or ""), platform_of(device))


def named(kind: str) -> Accelerator | None:
    """The row whose ``kind`` (or alias) is ``kind``, case-insensitive; else None."""
    text = str(kind).strip().lower()
    for row in ACCELERATORS.values():
        if text == row.kind.lower() or text in row.aliases:
            return row
    return None


def kind_of(device_kind: str) -> str:
    """The kind a device kind is filed under (calibrations, reports): its row's ``kind``
    (``"NVIDIA H100 80GB HBM3"`` is ``"H100"``), else the device kind as JAX names it."""
    row = matching(device_kind)
    return row.kind if row is not None else str(device_kind)


def gpu_targets() -> list[Accelerator]:
    """The rows a GPU target's name may give (a host size and a compiler description)."""
    return [r for r in ACCELERATORS.values() if r.host_devices and r.spec and r.spec.gpu]


def tpu_targets() -> list[Accelerator]:
    """The rows a TPU target's name may give (their slices)."""
    return [r for r in ACCELERATORS.values() if r.tpu is not None]
